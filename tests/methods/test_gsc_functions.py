"""GSC's settings and pure functions, called alone, against hand tables and numpy."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

from ncljax import methods
from ncljax.methods import base, gsc

WARMUP, MAIN = base.WARMUP, base.MAIN


def _ctx(phase):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, zero, phase, 8, zero, jax.random.key(0))


def test_settings_are_the_factory_signature():
    signature = {k: p.default for k, p in methods.hyperparameters("gsc").items()}
    assert gsc.Settings()._asdict() == signature
    assert list(gsc.CHECKS) == list(gsc.Settings._fields)
    method = gsc.gsc(intra_weight=0.3)
    assert method.settings == gsc.Settings(intra_weight=0.3)


@pytest.mark.parametrize(
    ("warmup_epochs", "phases", "refreshes"),
    [
        (0, "MMMM", "-RRR"),
        (2, "WWMMM", "---RR"),  # the first main epoch has no buffers to estimate from
    ],
)
def test_plan_against_a_table(warmup_epochs, phases, refreshes):
    s = gsc.Settings(warmup_epochs=warmup_epochs)
    plans = [gsc.plan(s, e) for e in range(len(phases))]
    assert "".join("W" if p.phase == WARMUP else "M" for p in plans) == phases
    assert "".join("R" if p.refresh else "-" for p in plans) == refreshes


def test_needs_intra_only_where_a_loss_reads_the_structures():
    unit, i2t = gsc.Settings(), gsc.Settings(warmup_loss="infonce_i2t")
    assert gsc.needs_intra(unit, WARMUP) and gsc.needs_intra(unit, MAIN)
    assert not gsc.needs_intra(i2t, WARMUP) and gsc.needs_intra(i2t, MAIN)


def _np_terms(sim, sim_image, sim_text, y, valid, tau1, tau2, row_weight):
    """Eqs. 3 and 6-8 per pair in float64, over the valid pairs only."""
    real = np.flatnonzero(valid)
    y = np.where(valid, y, 0.0)
    cross, intra, indicator, score = (np.zeros(len(y)) for _ in range(4))
    a, c = sim_image * y[None, :], sim_text * y[None, :]
    k = a @ c.T / tau2
    for b in real:
        i2t = sim[b, b] / tau1 - logsumexp(sim[b, real] / tau1)
        t2i = sim[b, b] / tau1 - logsumexp(sim[real, b] / tau1)
        cross[b] = -0.5 * y[b] * (i2t + t2i)
        indicator[b] = 0.5 * (np.exp(i2t) + np.exp(t2i))
        intra[b] = -(k[b, b] - logsumexp(k[b, real])) * (y[b] if row_weight else 1.0)
        norms = np.linalg.norm(a[b]) * np.linalg.norm(c[b])
        score[b] = a[b] @ c[b] / max(norms, 1e-8)
    return cross, intra, indicator, score


@pytest.mark.parametrize("exchange,row_weight", [(True, True), (False, False)])
def test_loss_against_numpy(exchange, row_weight):
    rng = np.random.default_rng(5)
    sim, sim_image, sim_text = (rng.uniform(0.05, 0.95, size=(5, 5)) for _ in range(3))
    valid = np.array([True, True, False, True, True])
    own, peer = rng.uniform(size=5), rng.uniform(size=5)
    s = gsc.Settings(
        cross_temperature=0.1,
        intra_temperature=0.5,
        intra_weight=0.3,
        exchange_labels=exchange,
        intra_row_weight=row_weight,
    )
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    outputs = {"sim": f32(sim), "sim_image": f32(sim_image), "sim_text": f32(sim_text)}
    rows, peer_rows = {"labels": f32(own)}, {"labels": f32(peer)}
    loss, aux = gsc.loss(s, outputs, {"mask": jnp.asarray(valid)}, rows, peer_rows, _ctx(MAIN))
    y = peer if exchange else own
    cross, intra, indicator, score = _np_terms(
        sim, sim_image, sim_text, y, valid, 0.1, 0.5, row_weight
    )
    np.testing.assert_allclose(loss, cross + 0.3 * intra, rtol=2e-5, atol=1e-6)
    assert list(aux.metrics) == [
        "loss_cross",
        "loss_intra",
        "train_label",
        "cross_indicator",
        "intra_score",
    ]
    np.testing.assert_allclose(aux.metrics["loss_intra"], intra, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(aux.memory["cross"], indicator, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(aux.memory["intra"], score, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(aux.clean_estimate, f32(own))  # its own belief
    assert aux.memory_at is None and aux.applied_weight is None


def test_warmup_loss_infonce_i2t_against_numpy():
    rng = np.random.default_rng(6)
    sim = rng.uniform(0, 1, size=(4, 4))
    s = gsc.Settings(warmup_loss="infonce_i2t", cross_temperature=0.2)
    got = gsc.warmup_loss(s, {"sim": jnp.asarray(sim, jnp.float32)}, jnp.ones(4, bool))
    want = -(np.diag(sim) / 0.2 - logsumexp(sim / 0.2, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    loss, aux = gsc.loss(s, {"sim": jnp.asarray(sim, jnp.float32)}, {"mask": jnp.ones(4, bool)},
                         {}, {}, _ctx(WARMUP))  # fmt: skip
    np.testing.assert_array_equal(loss, got)
    assert aux == base.Aux()  # no buffer writes, nothing logged


class _CosineModel:
    """A stand-in model: fixed unit embeddings, no SGR head (so cosine structures)."""

    def __init__(self, image, text):
        self.image, self.text = image, text

    def __call__(self, batch, *, train, rngs):
        del batch, train, rngs
        return {"sim": self.image @ self.text.T, "image": {"emb": self.image},
                "text": {"emb": self.text}}  # fmt: skip


def test_forward_adds_cosine_structures_in_training_steps_that_read_them():
    rng = np.random.default_rng(7)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    image, text = unit(rng.normal(size=(3, 4))), unit(rng.normal(size=(3, 4)))
    model = _CosineModel(jnp.asarray(image, jnp.float32), jnp.asarray(text, jnp.float32))
    call = lambda s, **kw: gsc.forward(s, model, {}, {}, rngs=None, **kw)
    out = call(gsc.Settings(), train=True, phase=WARMUP)
    np.testing.assert_allclose(out["sim_image"], image @ image.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["sim_text"], text @ text.T, rtol=1e-5, atol=1e-6)
    assert "sim_image" not in call(gsc.Settings(), train=False, phase=MAIN)
    i2t = gsc.Settings(warmup_loss="infonce_i2t")
    assert "sim_image" not in call(i2t, train=True, phase=WARMUP)


N = 200
ENSEMBLE = gsc.Settings(cross_momentum=0.5, intra_momentum=0.25)


@pytest.fixture(scope="module")
def update_fn():
    """ENSEMBLE's jitted label update, compiled once for both refresh tests."""
    return gsc.label_updater(ENSEMBLE)


def _memory(cross, intra, previous):
    memory = gsc.init_memory(ENSEMBLE, base.InitContext(N, None, None, None))
    assert all(np.all(v == 1.0) for v in memory.samples.values())
    ones = dict.fromkeys(("ema_cross", "ema_intra", "labels"), jnp.asarray(previous))
    return base.Memory(dict(memory.samples, cross=cross, intra=intra, **ones), {})


def test_refresh_ensembles_and_takes_the_minimum(update_fn):
    rng = np.random.default_rng(8)
    clean = np.arange(N) < 120
    cross = np.where(clean, 0.8, 0.2).astype(np.float32)
    intra = np.where(clean, rng.normal(0.9, 0.02, N), rng.normal(0.2, 0.05, N)).astype(np.float32)
    memory = _memory(cross, intra, np.ones(N, np.float32))
    new, diagnostics = gsc.refresh(ENSEMBLE, memory, None, None, update_fn=update_fn)
    got = jax.device_get(new.samples)
    np.testing.assert_allclose(got["ema_cross"], 0.5 * cross + 0.5, rtol=1e-6)  # Eq. 10
    np.testing.assert_allclose(got["ema_intra"], 0.25 * got["intra_posterior"] + 0.75, rtol=1e-6)
    np.testing.assert_array_equal(got["labels"], np.minimum(got["ema_cross"], got["ema_intra"]))
    assert got["labels"][clean].min() > got["labels"][~clean].max()
    np.testing.assert_array_equal(gsc.clean_score(new), got["labels"])
    assert float(diagnostics["division_fallback"]) == 0.0
    assert list(diagnostics)[:2] == ["gmm_weight_low", "gmm_weight_high"]


def test_refresh_falls_back_on_equal_scores(update_fn, caplog):
    previous = np.linspace(0.1, 0.9, N).astype(np.float32)
    memory = _memory(np.full(N, 0.5, np.float32), np.full(N, 0.3, np.float32), previous)
    ctx = base.RefreshContext(3, 10, 1, None, None)
    with caplog.at_level(logging.WARNING):
        new, diagnostics = gsc.refresh(ENSEMBLE, memory, None, ctx, update_fn=update_fn)
    assert "network 1's intra-modal scores of epoch 3 are all equal" in caplog.text
    np.testing.assert_array_equal(new.samples["labels"], previous)
    assert float(diagnostics["division_fallback"]) == 1.0


SHARED = ENSEMBLE._replace(noise_share="partner")


def _shared_memory(cross, intra, partner_p):
    memory = gsc.init_memory(SHARED, base.InitContext(N, None, None, None))
    assert set(memory.samples) == {*gsc._BUFFERS, "partner_p"}
    return base.Memory(dict(memory.samples, cross=cross, intra=intra, partner_p=partner_p), {})


def test_refresh_trains_every_label_at_1_where_the_p_values_bound_the_noise_near_0(caplog):
    """``noise_share='partner'``: p-values with none above 1/2 bound the mismatched share
    below the floor (k = 0 of N = 200: Wilson's bound 2.7 / 200 / 0.5 = 0.027), and every
    label is 1, while the ensembles and the audit's score follow the buffers as without
    the switch; uniform p-values (every pair could lie) leave the labels of the paper."""
    rng = np.random.default_rng(8)
    clean = np.arange(N) < 120
    cross = np.where(clean, 0.8, 0.2).astype(np.float32)
    intra = np.where(clean, rng.normal(0.9, 0.02, N), rng.normal(0.2, 0.05, N)).astype(np.float32)
    update = gsc.label_updater(SHARED)
    paper, _ = gsc.refresh(ENSEMBLE, _memory(cross, intra, np.ones(N, np.float32)), None, None)
    small = _shared_memory(cross, intra, np.full(N, 0.01, np.float32))
    off, diagnostics = gsc.refresh(SHARED, small, None, None, update_fn=update)
    np.testing.assert_array_equal(off.samples["labels"], 1.0)
    for name in ("ema_cross", "ema_intra", "intra_posterior"):
        np.testing.assert_allclose(off.samples[name], paper.samples[name], rtol=1e-6)
    np.testing.assert_allclose(gsc.clean_score(off), paper.samples["labels"], rtol=1e-6)
    assert float(diagnostics["division_off"]) == 1.0
    assert float(diagnostics["noise_share_bound"]) == pytest.approx(
        2.7055 / 200 / 1.0135 / 0.5, rel=1e-3
    )
    uniform = _shared_memory(cross, intra, np.linspace(0.005, 1.0, N, dtype=np.float32))
    on, diagnostics = gsc.refresh(SHARED, uniform, None, None, update_fn=update)
    np.testing.assert_allclose(on.samples["labels"], paper.samples["labels"], rtol=1e-6)
    assert float(diagnostics["division_off"]) == 0.0
    assert float(diagnostics["noise_share_estimate"]) == pytest.approx(1.0, abs=0.01)
    # A GMM with nothing to divide is no fallback while the division is off.
    equal = _shared_memory(cross, np.full(N, 0.3, np.float32), np.full(N, 0.01, np.float32))
    ctx = base.RefreshContext(3, 10, 0, None, None)
    with caplog.at_level(logging.WARNING):
        off, diagnostics = gsc.refresh(SHARED, equal, None, ctx, update_fn=update)
    assert not caplog.records and float(diagnostics["division_fallback"]) == 0.0
    np.testing.assert_array_equal(off.samples["labels"], 1.0)


def test_the_loss_writes_each_pairs_partner_p_value():
    rng = np.random.default_rng(3)
    b = 8
    sim = jnp.asarray(rng.normal(size=(b, b)), jnp.float32)
    outputs = {"sim": sim, "sim_image": sim, "sim_text": sim.T}
    mask = jnp.arange(b) < 6
    ones = dict.fromkeys(("labels",), jnp.ones(b))
    _, aux = gsc.loss(SHARED, outputs, {"mask": mask}, ones, ones, _ctx(MAIN))
    s = np.asarray(sim, np.float64)
    want = [(1 + sum(s[i, j] >= s[i, i] for j in range(6) if j != i)) / 6 for i in range(6)]
    np.testing.assert_allclose(np.asarray(aux.memory["partner_p"])[:6], want, rtol=1e-6)
    _, plain = gsc.loss(ENSEMBLE, outputs, {"mask": mask}, ones, ones, _ctx(MAIN))
    assert "partner_p" not in plain.memory
