"""SREM's calibrated division and fallback in the method: the refresh calibrating on the
last epoch's energies, the steps reading it, the fallback warnings, the ``'paper'``
switch, the uniform warm-up and the configs."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import methods
from ncljax.labels import srem as selection
from ncljax.methods import base
from ncljax.methods import srem as srem_method
from tests.labels.test_srem_calibration import _energies, _otsu_oracle


def _logits(seed, b=8, boost=4.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, b)) * 2
    logits[np.arange(b), np.arange(b)] += boost
    return jnp.asarray(logits, jnp.float32)


def _ctx(phase, epoch=3):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, jnp.asarray(epoch, jnp.int32), phase, 40, zero, jax.random.key(0))


def _refresh_ctx(epoch):
    return base.RefreshContext(epoch, 10, 0, jax.random.key(0), None)


def _trained_memory(method, n=200, epoch=4, seed=0):
    memory = method.init_memory(base.InitContext(n, None, None, None))
    rng = np.random.default_rng(seed)
    samples = dict(memory.samples)
    samples["energy_i2t"] = jnp.asarray(_energies(seed, n))
    samples["energy_t2i"] = jnp.asarray(_energies(seed + 1, n))
    written = rng.random(n) < 0.9  # the rest: the epoch's skipped partial batch
    samples["energy_epoch"] = jnp.where(written, epoch - 1.0, epoch - 2.0)
    samples["clean_i2t"] = jnp.asarray(rng.random(n) < 0.3, jnp.float32)
    return base.Memory(samples, memory.state), written


@pytest.mark.parametrize("calibration", ["data", "warmup"])
def test_refresh_calibrates_each_direction_on_the_last_epochs_energies(calibration):
    method = methods.build_method("srem", {"warmup_epochs": 2, "calibration": calibration})
    # Up to the first main epoch: the Otsu split of the last epoch's energies.
    for epoch in (1, 2):
        memory, written = _trained_memory(method, epoch=epoch, seed=epoch)
        with np.testing.assert_no_warnings():
            new, diag = method.refresh_fn(memory, None, _refresh_ctx(epoch))
        division = np.asarray(new.state["calibration"])
        for i, d in enumerate(("i2t", "t2i")):
            want = _otsu_oracle(np.asarray(memory.samples[f"energy_{d}"])[written])
            np.testing.assert_allclose(division[i], want[:3], rtol=1e-4, atol=1e-5)
            assert diag[f"calibrated_tau_{d}"] == pytest.approx(want[0], rel=1e-4, abs=1e-5)
        assert diag["division_fallback"] == 0.0
    # In the main phase: 'data' re-measures it on every epoch's energies, 'warmup' keeps
    # the last warm-up epoch's, whatever the energies do.
    later, written = _trained_memory(method, epoch=4, seed=9)
    later = base.Memory(dict(later.samples), new.state)
    again, diag = method.refresh_fn(later, None, _refresh_ctx(4))
    if calibration == "warmup":
        np.testing.assert_array_equal(again.state["calibration"], division)
        assert diag["calibrated_tau_i2t"] == pytest.approx(float(division[0, 0]))
    else:
        for i, d in enumerate(("i2t", "t2i")):
            want = _otsu_oracle(np.asarray(later.samples[f"energy_{d}"])[written])
            np.testing.assert_allclose(again.state["calibration"][i], want[:3], rtol=1e-4)
    # The next epoch's steps read it from the memory state in their loss context.
    logits = _logits(2)
    outputs = {"logit": logits}
    mask = jnp.ones(8, bool)
    ctx = _ctx(base.MAIN)._replace(memory_state=new.state)
    loss, _ = method.loss_fn(outputs, {"mask": mask}, {}, {}, ctx)
    want, _ = srem_method.srem_loss(
        logits,
        threshold=division[:, 0],
        m_clean=division[:, 1],
        m_noisy=division[:, 2],
        fallback=True,
        where=mask,
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_a_drift_of_the_energies_is_re_measured_not_fallen_back():
    """A forced drift: every logit of a main epoch falls by 20, so every energy rises by
    20 (the level the shift-free losses leave free). The division re-measured on the
    drifted energies ('data') moves with them: the next step selects exactly the pairs the
    undrifted step selected and trains no fallback. The frozen one ('warmup') selects
    nothing and the batch falls back."""
    shift, b = 20.0, 32
    logits = _logits(3, b=b, boost=3.0)
    mask = jnp.ones(b, bool)

    def memory_of(method, f, epoch):
        memory = method.init_memory(base.InitContext(b, None, None, None))
        samples = dict(memory.samples)
        samples["energy_i2t"] = selection.energy(f)
        samples["energy_t2i"] = selection.energy(f.T)
        samples["energy_epoch"] = jnp.full(b, epoch - 1.0)
        return base.Memory(samples, memory.state)

    def step(method, state, f):
        ctx = _ctx(base.MAIN)._replace(memory_state=state)
        _, aux = method.loss_fn({"logit": f}, {"mask": mask}, {}, {}, ctx)
        fell_back = float(np.asarray(aux.metrics["division_fallback"]).max())
        return np.asarray(aux.metrics["selected_i2t"]) > 0, fell_back

    for calibration in ("data", "warmup"):
        method = methods.build_method("srem", {"warmup_epochs": 1, "calibration": calibration})
        warm, _ = method.refresh_fn(memory_of(method, logits, 1), None, _refresh_ctx(1))
        before, fell_back = step(method, warm.state, logits)
        assert before.any() and not before.all() and fell_back == 0.0
        drifted = base.Memory(memory_of(method, logits - shift, 3).samples, warm.state)
        new, _ = method.refresh_fn(drifted, None, _refresh_ctx(3))
        after, fell_back = step(method, new.state, logits - shift)
        if calibration == "data":
            moved = np.asarray(new.state["calibration"]) - np.asarray(warm.state["calibration"])
            np.testing.assert_allclose(moved, shift, rtol=1e-4)  # threshold and margins
            np.testing.assert_array_equal(after, before)
            assert fell_back == 0.0
        else:
            np.testing.assert_array_equal(new.state["calibration"], warm.state["calibration"])
            assert not after.any() and fell_back == 1.0


def test_refresh_keeps_the_previous_calibration_when_the_energies_divide_nothing(caplog):
    method = methods.build_method("srem", {"warmup_epochs": 4})
    memory, _ = _trained_memory(method)
    previous = jnp.array([[-1.0, -2.0, 0.0], [-1.5, -2.5, 0.5]])
    samples = dict(memory.samples) | {"energy_t2i": jnp.full(200, -0.7)}
    memory = base.Memory(samples, {"calibration": previous})
    with caplog.at_level(logging.WARNING):
        new, diag = method.refresh_fn(memory, None, _refresh_ctx(4))
    np.testing.assert_array_equal(new.state["calibration"][1], previous[1])
    assert not np.allclose(new.state["calibration"][0], previous[0])  # i2t still divides
    assert diag["division_fallback"] == 1.0
    assert len(caplog.records) == 1 and "fallback" in caplog.text


def test_refresh_warns_once_when_batches_fell_back(caplog):
    method = methods.build_method("srem", {"warmup_epochs": 4})
    memory, written = _trained_memory(method)
    samples = dict(memory.samples) | {"division_fallback": jnp.asarray(written, jnp.float32)}
    with caplog.at_level(logging.WARNING):
        _, diag = method.refresh_fn(base.Memory(samples, memory.state), None, _refresh_ctx(4))
    assert diag["division_fallback"] == 1.0
    assert len(caplog.records) == 1
    assert "100.0% of the pairs of epoch 3" in caplog.text and "fallback" in caplog.text


def test_a_step_that_selects_nothing_trains_the_warmup_objective_and_says_so():
    method = methods.build_method("srem", {"calibration": "paper", "tau": -50.0})
    logits = _logits(3)
    mask = jnp.ones(8, bool)
    loss, aux = method.loss_fn({"logit": logits}, {"mask": mask}, {}, {}, _ctx(base.MAIN))
    warm, _ = srem_method.srem_loss(logits, warmup=True, where=mask)
    np.testing.assert_allclose(loss, warm, rtol=1e-6)
    np.testing.assert_array_equal(aux.memory["division_fallback"], np.ones(8))
    np.testing.assert_array_equal(aux.metrics["division_fallback"], np.ones(8))


def test_paper_calibration_keeps_the_constants_exactly():
    method = methods.build_method("srem", {"calibration": "paper", "tau": -3.0})
    memory, _ = _trained_memory(method)
    new, diag = method.refresh_fn(memory, None, _refresh_ctx(4))
    np.testing.assert_array_equal(new.state["calibration"], [[-3.0, -4.0, 0.0]] * 2)
    assert not any(k.startswith("calibrated_") for k in diag)
    logits = _logits(0)
    mask = jnp.array([True] * 6 + [False] * 2)
    ignored = _ctx(base.MAIN)._replace(memory_state={"calibration": jnp.zeros((2, 3))})
    loss, _ = method.loss_fn({"logit": logits}, {"mask": mask}, {}, {}, ignored)
    old, views = srem_method.srem_loss(logits, threshold=-3.0, where=mask)  # the old objective
    assert all(0 < int(v.clean.sum()) < 6 for v in views.values())
    np.testing.assert_array_equal(loss, old)


def test_unknown_calibration_says_what_to_set():
    with pytest.raises(ValueError, match="method_kwargs") as error:
        methods.build_method("srem", {"calibration": "gmm"})
    assert "srem calibration must be one of ('data', 'warmup', 'paper')" in str(error.value)
    with pytest.raises(ValueError, match="srem warmup_rectify must be one of"):
        methods.build_method("srem", {"warmup_rectify": "hard"})


def test_configs_keep_the_paper_constants_on_the_papers_benchmarks():
    from tests.train.test_loop import load_config

    kwargs = load_config("srem", "synthetic").method_kwargs
    assert (kwargs.calibration, kwargs.warmup_rectify) == ("warmup", "uniform")
    kwargs = load_config("srem", "vectors").method_kwargs
    assert (kwargs.calibration, kwargs.warmup_rectify) == ("data", "uniform")
    assert (kwargs.lambda1, kwargs.cosine_temperature) == (0.0, 0.07)
    assert (kwargs.division, kwargs.ranking) == ("partner", "contrastive")
    assert (kwargs.noise_share, kwargs.partner_rule) == ("partner", "share")
    for dataset in ("f30k", "coco", "cc152k"):
        kwargs = load_config("srem", dataset).method_kwargs
        assert (kwargs.calibration, kwargs.warmup_rectify) == ("paper", "biased")
        assert (kwargs.division, kwargs.ranking) == ("energy", "hinge")
        assert kwargs.partner_rule == "level"


def test_the_warmup_step_uses_uniform_complementary_labels_by_default():
    method = methods.build_method("srem", {})
    logits = _logits(7)
    mask = jnp.ones(8, bool)
    loss, _ = method.loss_fn({"logit": logits}, {"mask": mask}, {}, {}, _ctx(base.WARMUP))
    want, _ = srem_method.srem_loss(logits, warmup=True, rectify="uniform", where=mask)
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_an_epoch_whose_p_values_bound_the_noise_near_0_keeps_every_pair():
    """``noise_share='partner'``: the steps write each pair's partner p-value; the refresh
    bounds the mismatched share on the last epoch's p-values (the pairs it wrote), and
    where the bound is below ``noise_floor`` the next epoch's partner test runs at level 1
    (every pair clean). Uniform p-values keep the test at its level."""
    kwargs = {"division": "partner", "ranking": "contrastive", "noise_share": "partner"}
    method = methods.build_method("srem", kwargs)
    memory, written = _trained_memory(method, n=400, epoch=4)
    assert float(memory.state["division_off"]) == 0.0
    rng = np.random.default_rng(5)
    # Unwritten pairs (the skipped partial batch) look like noise and must not count.
    small = np.where(written, rng.uniform(0.005, 0.4, 400), 0.9).astype(np.float32)
    memory = base.Memory(dict(memory.samples, partner_p=jnp.asarray(small)), memory.state)
    off, diag = method.refresh_fn(memory, None, _refresh_ctx(4))
    assert float(off.state["division_off"]) == 1.0 and diag["division_off"] == 1.0
    assert diag["noise_share_estimate"] == 0.0
    uniform = np.linspace(0.0025, 1.0, 400, dtype=np.float32)
    memory = base.Memory(dict(memory.samples, partner_p=jnp.asarray(uniform)), memory.state)
    on, diag = method.refresh_fn(memory, None, _refresh_ctx(4))
    assert float(on.state["division_off"]) == 0.0
    assert diag["noise_share_estimate"] == pytest.approx(1.0, abs=0.02)
    # The steps: a batch with mismatched pairs; at level 1 every pair is clean.
    b = 32
    logits = _logits(4, b=b, boost=3.0)
    logits = logits.at[:8, :8].set(logits[:8, :8] - 3.0 * jnp.eye(8))  # 8 partners like negatives
    mask = jnp.ones(b, bool)
    ctx = _ctx(base.MAIN)
    _, aux_on = method.loss_fn(
        {"logit": logits}, {"mask": mask}, {}, {}, ctx._replace(memory_state=on.state)
    )
    _, aux_off = method.loss_fn(
        {"logit": logits}, {"mask": mask}, {}, {}, ctx._replace(memory_state=off.state)
    )
    want = selection.partner_test_mask(logits, 0.05, where=mask)
    np.testing.assert_array_equal(aux_on.memory["clean_i2t"], np.asarray(want, np.float32))
    assert float(aux_on.memory["clean_i2t"].mean()) < 1.0
    np.testing.assert_array_equal(aux_off.memory["clean_i2t"], 1.0)
    np.testing.assert_allclose(
        aux_off.memory["partner_p"], selection.partner_p_value(logits, where=mask), rtol=1e-6
    )


def _wilson_bound(p, lam=0.5, z=1.6448536269514722):
    """Storey's share with a one-sided 95% Wilson bound, written out (the oracle)."""
    n = p.size
    q = np.sum(p > lam) / n
    upper = (q + z * z / (2 * n) + z * np.sqrt(q * (1 - q) / n + z * z / (4 * n * n))) / (
        1 + z * z / n
    )
    return min(upper / (1 - lam), 1.0)


@pytest.mark.parametrize("rule", ["level", "share"])
def test_the_share_rule_keeps_all_but_the_bounded_share_of_pairs(rule):
    """``partner_rule='share'``: the next epoch's partner test runs at the ``1 - bound``
    quantile of the last epoch's p-values (the pairs it wrote), never below
    ``partner_level``; ``'level'`` keeps ``partner_level``. A step then selects exactly the
    pairs whose partner p-value is at most that level."""
    kwargs = {"division": "partner", "ranking": "contrastive", "noise_share": "partner"}
    method = methods.build_method("srem", kwargs | {"partner_rule": rule})
    memory, written = _trained_memory(method, n=400, epoch=4)
    assert ("partner_level" in memory.state) == (rule == "share")
    rng = np.random.default_rng(7)
    # A weak model at 0%: every partner better than random, few by much; the unwritten
    # pairs (p 0.99) must not count.
    weak = np.where(written, rng.beta(1.0, 3.0, 400), 0.99).astype(np.float32)
    memory = base.Memory(dict(memory.samples, partner_p=jnp.asarray(weak)), memory.state)
    new, diag = method.refresh_fn(memory, None, _refresh_ctx(4))
    bound = _wilson_bound(weak[written].astype(np.float64))
    assert diag["noise_share_bound"] == pytest.approx(bound, abs=1e-5)
    assert 0.05 < bound < 1.0 and float(new.state["division_off"]) == 0.0
    want = max(0.05, float(np.quantile(weak[written], 1.0 - bound))) if rule == "share" else 0.05
    assert want > 0.05 or rule == "level"
    level = new.state.get("partner_level", 0.05)
    assert float(level) == pytest.approx(want, rel=1e-6)
    assert diag.get("partner_level", 0.05) == pytest.approx(want, rel=1e-6)
    # A strong model: the quantile falls below partner_level, which stays.
    strong = np.where(written, rng.uniform(0.0, 0.02, 400), 0.99).astype(np.float32)
    strong[:40] = np.linspace(0.5, 1.0, 40)  # a tenth of the pairs lie
    memory = base.Memory(dict(memory.samples, partner_p=jnp.asarray(strong)), memory.state)
    kept, _ = method.refresh_fn(memory, None, _refresh_ctx(4))
    assert float(kept.state.get("partner_level", 0.05)) == pytest.approx(0.05)
    # The step selects the pairs at or below the level.
    b = 32
    logits = _logits(4, b=b, boost=3.0)
    mask = jnp.ones(b, bool)
    ctx = _ctx(base.MAIN)._replace(memory_state=new.state)
    _, aux = method.loss_fn({"logit": logits}, {"mask": mask}, {}, {}, ctx)
    p = np.asarray(selection.partner_p_value(logits, where=mask))
    assert 0 < np.mean(p <= want) < 1  # the level divides this batch
    np.testing.assert_array_equal(aux.memory["clean_i2t"], (p <= want).astype(np.float32))


def test_noise_share_needs_the_partner_test():
    with pytest.raises(ValueError, match="noise_share must be 'none' unless division='partner'"):
        methods.build_method("srem", {"noise_share": "partner"})
