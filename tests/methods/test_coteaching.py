"""The co-teaching skeleton (``ncljax.methods.coteaching``) and NCR's top-level functions,
each called alone against a hand-written table or a numpy evaluation."""

import dataclasses
import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.methods import base, coteaching, ncr, pc2


def test_settings_are_the_factory_signature():
    params = inspect.signature(ncr.ncr).parameters
    fields = {f.name: f.default for f in dataclasses.fields(ncr.Settings)}
    assert {k: p.default for k, p in params.items()} == fields
    assert set(ncr.CHECKS) == set(fields)
    s = ncr.ncr(noisy_start_epoch=7).settings
    assert isinstance(s, ncr.Settings) and s.noisy_start_epoch == 7 and s.margin == 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.margin = 0.3


def test_plan_is_the_table_and_the_phase_says_the_updates():
    s = ncr.Settings(warmup_epochs=2, noisy_start_epoch=2)
    # epoch: (phase, updates, lr_epoch, selectable, refresh)
    table = {
        0: (0, (0,), 0, False, False),
        1: (0, (0,), 0, False, False),
        2: (1, (0,), 0, True, True),
        3: (1, (0,), 1, True, True),
        4: (2, (0, 1), 2, True, True),
        9: (2, (0, 1), 7, True, True),
    }
    for epoch, want in table.items():
        p = ncr.plan(s, epoch)
        assert (p.phase, p.updates, p.lr_epoch, p.selectable, p.refresh) == want, epoch
        assert p.in_turn and p.min_batch == 2 and not p.reset_optimizer
        assert p.updates == coteaching.updates_of(p.phase)
    never = ncr.Settings(warmup_epochs=2, noisy_start_epoch=None)  # configs/ncr.py:vectors
    assert [ncr.plan(never, e).updates for e in range(2, 40)] == [(0,)] * 38
    pc2_like = coteaching.plan(s, 2, second=False, reset_at_start=True, restart_best=True)
    assert pc2_like.reset_optimizer and pc2_like.restart_best
    assert not coteaching.plan(s, 3, second=False, reset_at_start=True).reset_optimizer


def test_streams_walk_the_peers_division():
    clean = jnp.array([[1, 0, 1, 1], [0, 0, 1, 0]], jnp.float32)
    memory = base.Memory({"clean": clean}, {})
    main_plan = coteaching.plan(ncr.Settings(warmup_epochs=0), 0, second=False)
    got = coteaching.streams(memory, main_plan, 0)  # network 0 walks network 1's sets
    np.testing.assert_array_equal(got.main, [2])
    np.testing.assert_array_equal(got.aux, [0, 1, 3])
    got = coteaching.streams(memory, main_plan, 1)
    np.testing.assert_array_equal(got.main, [0, 2, 3])
    warmup = coteaching.plan(ncr.Settings(), 0, second=False)
    assert coteaching.streams(memory, warmup, 0) == base.Streams()


def _mean_negative_hinge(sim, margin):
    """Numpy loop: per pair, both hinge directions summed over the negatives and divided by
    the batch size (the official ``cost.mean(1)`` over a row whose diagonal is zeroed)."""
    n = sim.shape[0]
    out = np.zeros(n)
    for i in range(n):
        i2t = [max(0.0, margin - sim[i, i] + sim[i, j]) for j in range(n) if j != i]
        t2i = [max(0.0, margin - sim[i, i] + sim[j, i]) for j in range(n) if j != i]
        out[i] = np.sum(i2t) / n + np.sum(t2i) / n
    return out


def test_warmup_loss_and_the_undivided_fallback():
    rng = np.random.default_rng(0)
    sim = rng.uniform(-1, 1, (5, 5)).astype(np.float32)
    s = ncr.Settings(margin=0.3)
    mask = jnp.ones(5, bool)
    want = _mean_negative_hinge(sim.astype(np.float64), 0.3)
    np.testing.assert_allclose(coteaching.warmup_loss(s, jnp.asarray(sim), mask), want, rtol=1e-5)
    own = jnp.full(5, 7.0)
    rows = {"divided": jnp.array([1.0, 0.0, 1.0, 0.0, 1.0])}
    got = coteaching.unless_undivided(s, own, jnp.asarray(sim), rows, mask)
    np.testing.assert_allclose(got, np.where([1, 0, 1, 0, 1], 7.0, want), rtol=1e-5)


def test_clean_targets_per_pair_and_broadcast():
    w = jnp.array([0.9, 0.2, 0.6])
    p = jnp.array([0.5, 1.0, 0.0])
    pair = ncr.clean_targets(ncr.Settings(), w, p)
    np.testing.assert_allclose(pair, [0.95, 1.0, 0.6], rtol=1e-6)  # w + (1 - w) P, Eq. 6
    matrix = ncr.clean_targets(ncr.Settings(target_prediction="broadcast"), w, p)
    want = [[w[i] + (1 - w[i]) * p[j] for j in range(3)] for i in range(3)]
    np.testing.assert_allclose(matrix, np.asarray(want), rtol=1e-6)


def test_co_divide_splits_and_falls_back(caplog):
    s = ncr.Settings()
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.normal(0.1, 0.02, 300), rng.normal(0.6, 0.05, 100)])
    samples = coteaching.init_samples(400)
    ctx = base.RefreshContext(epoch=3, num_epochs=5, network=1, rng=None, fetch=None)
    new, division, checked, fallback, extra = coteaching.co_divide(
        s, "ncr", samples, {"loss": values}, ctx
    )
    assert extra == {}
    assert not fallback and float(new["divided"].min()) == 1.0
    np.testing.assert_array_equal(np.asarray(new["clean"]) > 0.5, np.arange(400) < 300)
    diagnostics = coteaching.division_diagnostics(division, checked, fallback, new)
    assert float(diagnostics["clean_fraction"]) == pytest.approx(0.75)
    assert float(diagnostics["division_fallback"]) == 0.0
    # All-equal losses: nothing to divide; the previous division is kept, with a warning.
    with caplog.at_level(logging.WARNING):
        kept, _, _, fallback, _ = coteaching.co_divide(
            s, "ncr", new, {"loss": np.full(400, 0.3)}, ctx
        )
    assert fallback and "network 1's per-pair losses of epoch 3 are all equal" in caplog.text
    assert "keeping its previous division" in caplog.text
    np.testing.assert_array_equal(kept["clean"], new["clean"])
    np.testing.assert_allclose(kept["loss_raw"], 0.3)


def _info_nce_oracle(sim, t):
    """Per pair: the mean of -log softmax over the row and over the column at the pair."""
    b = sim.shape[0]
    out = np.zeros(b)
    for i in range(b):
        row = np.exp(sim[i] / t)
        col = np.exp(sim[:, i] / t)
        out[i] = 0.5 * (-np.log(row[i] / row.sum()) - np.log(col[i] / col.sum()))
    return out


def test_contrastive_ranking_weighs_each_pairs_infonce_by_its_target():
    rng = np.random.default_rng(0)
    sim = rng.uniform(-1, 1, (6, 6)).astype(np.float32)
    y = rng.uniform(0, 1, 6).astype(np.float32)
    mask = jnp.ones(6, bool)
    s = ncr.Settings(ranking="contrastive", temperature=0.1)
    loss, weights = coteaching.rectified_loss(
        s, jnp.asarray(sim), jnp.asarray(y), mask, kind="exponential", margin_of="positive"
    )
    want = y * _info_nce_oracle(sim.astype(np.float64), 0.1)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(weights, y)
    # A B x B target (NCR's broadcast labels) weighs each pair by its own entry.
    matrix = np.tile(y[None, :], (6, 1)) * 0.5 + np.diag(y) * 0.5
    loss2, _ = coteaching.rectified_loss(
        s, jnp.asarray(sim), jnp.asarray(matrix), mask, kind="exponential", margin_of="positive"
    )
    np.testing.assert_allclose(loss2, want, rtol=1e-5)
    # The targets carry no gradient; the warm-up and the co-divide read the unweighted loss.
    grad = jax.grad(
        lambda t: coteaching.rectified_loss(
            s, jnp.asarray(sim), t, mask, kind="exponential", margin_of="positive"
        )[0].sum()
    )(jnp.asarray(y))
    np.testing.assert_array_equal(grad, 0.0)
    np.testing.assert_allclose(
        coteaching.warmup_loss(s, jnp.asarray(sim), mask),
        _info_nce_oracle(sim.astype(np.float64), 0.1),
        rtol=1e-5,
    )


def test_hinge_ranking_is_the_hardest_negative_hinge_with_soft_margins():
    """The papers' default: margins alpha * (10^y - 1) / 9 (hand-worked on a 2 x 2 batch)."""
    sim = jnp.asarray([[0.5, 0.4], [0.1, 0.9]])
    y = jnp.asarray([1.0, 0.0])
    s = ncr.Settings()
    loss, margins = coteaching.rectified_loss(
        s, sim, y, jnp.ones(2, bool), kind="exponential", margin_of="positive"
    )
    np.testing.assert_allclose(margins, [0.2, 0.0], atol=1e-7)
    # pair 0: [0.2 - 0.5 + 0.4]_+ (i2t) + [0.2 - 0.5 + 0.1]_+ (t2i) = 0.1; pair 1: margin 0,
    # [0 - 0.9 + 0.1]_+ + [0 - 0.9 + 0.4]_+ = 0.
    np.testing.assert_allclose(loss, [0.1, 0.0], atol=1e-6)


@pytest.mark.parametrize("settings_type", [ncr.Settings, pc2.Settings], ids=["ncr", "pc2"])
def test_co_divide_divides_nothing_where_the_p_values_bound_the_noise_near_0(settings_type, caplog):
    """``noise_share='partner'``: every pair clean with probability 1 where no p-value is
    above 1/2 (k = 0 of 400: the bound 2.7 / 400 / 0.5 < 0.05), also when the GMM has
    nothing to divide (no fallback, no warning); uniform p-values keep the GMM's division."""
    s = settings_type(noise_share="partner")
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.normal(0.1, 0.02, 300), rng.normal(0.6, 0.05, 100)])
    ctx = base.RefreshContext(epoch=3, num_epochs=5, network=0, rng=None, fetch=None)
    samples = coteaching.init_samples(400)
    small = {"loss": values, "partner_p": np.full(400, 0.01, np.float32)}
    off, _, _, fallback, extra = coteaching.co_divide(s, "m", samples, small, ctx)
    assert not fallback and float(extra["division_off"]) == 1.0
    for name in ("prob", "clean", "divided"):
        np.testing.assert_array_equal(off[name], 1.0)
    np.testing.assert_allclose(off["loss_raw"], values, rtol=1e-6)
    # the audit's score still ranks the pairs: by the co-divide loss the mixture was fit to
    score = coteaching.clean_score(base.Memory(off, {}))
    lo, hi = values.min(), values.max()
    np.testing.assert_allclose(score, 1 - (values - lo) / (hi - lo), atol=1e-5)
    uniform = {"loss": values, "partner_p": np.linspace(0.0025, 1.0, 400, dtype=np.float32)}
    on, _, _, _, extra = coteaching.co_divide(s, "m", samples, uniform, ctx)
    paper, *_ = coteaching.co_divide(settings_type(), "m", samples, {"loss": values}, ctx)
    assert float(extra["division_off"]) == 0.0
    np.testing.assert_array_equal(on["clean"], paper["clean"])
    np.testing.assert_array_equal(on["prob"], paper["prob"])
    np.testing.assert_array_equal(coteaching.clean_score(base.Memory(on, {})), on["prob"])
    fresh = base.Memory(coteaching.init_samples(400), {})  # before any division: all 1
    np.testing.assert_array_equal(coteaching.clean_score(fresh), 1.0)
    with caplog.at_level(logging.WARNING):
        equal = dict(small, loss=np.full(400, 0.3))
        _, _, _, fallback, _ = coteaching.co_divide(s, "m", samples, equal, ctx)
    assert not fallback and not caplog.records


def test_stats_add_the_partner_p_value_only_with_the_switch():
    sim = jnp.asarray(np.random.default_rng(2).normal(size=(6, 6)), jnp.float32)
    mask = jnp.ones(6, bool)
    assert set(coteaching.stats(ncr.Settings(), sim, mask)) == {"loss"}
    got = coteaching.stats(ncr.Settings(noise_share="partner"), sim, mask)
    s = np.asarray(sim, np.float64)
    want = [(1 + sum(s[i, j] >= s[i, i] for j in range(6) if j != i)) / 6 for i in range(6)]
    np.testing.assert_allclose(got["partner_p"], want, rtol=1e-6)
