"""UGNCL's calibrated mode and its fallback: the refresh divides by the mixtures of the
statistics (``calibration='data'``, the default), the loss reads that division, a
degenerate division (every pair in one set, no trusted pair, soft labels of one group)
falls back to the previous usable one or, before any, to the warm-up objective, with one
warning per refresh and ``division_fallback``; the configs choose the calibration."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import evidence, labels, losses, methods
from ncljax.labels import ugncl as division
from ncljax.methods import base
from tests.labels.test_ugncl_calibration import _oracle, _signals
from tests.methods.test_ugncl import MASK, _ctx, _ctx_refresh, _raw
from tests.train.test_loop import load_config

N = 200


def _stats(seed=0):
    u, q = _signals(seed, n=N)
    prediction = (np.random.default_rng(seed).random(N) < 0.3) & (q > np.exp(-3))
    return {
        "uncertainty": jnp.asarray(u, jnp.float32),
        "prediction": jnp.asarray(prediction, jnp.float32),
        "soft_label": jnp.asarray(q, jnp.float32),
    }


def _loss(method, raw, rows, step):
    """``method.loss_fn`` of a main step, jitted (the eager EM and sorts are slow)."""
    ctx = _ctx(base.MAIN, step)
    return jax.jit(lambda r, m: method.loss_fn({"logit": r}, {"mask": MASK}, m, m, ctx))(raw, rows)


def _memory(method, n=N):
    return method.init_memory(base.InitContext(n, None, None, None))


def test_refresh_divides_by_the_mixtures_of_the_statistics(caplog):
    method = methods.build_method("ugncl")
    stats = _stats()
    with caplog.at_level(logging.WARNING):
        new, diag = method.refresh_fn(_memory(method), stats, _ctx_refresh(2))
    assert not caplog.records
    v, w = _oracle(np.asarray(stats["uncertainty"]), np.asarray(stats["soft_label"]))
    predicted = (np.asarray(stats["prediction"]) > 0.5) | (w > 0.5)
    want = np.where(
        v < 0.5,
        np.where(predicted, division.CLEAN, division.NOISY),
        np.where(w > 0.5, division.HARD_CLEAN, division.HARD_NOISY),
    )
    np.testing.assert_array_equal(new.samples["codes"], want)
    np.testing.assert_allclose(new.samples["division_uncertainty"], v, atol=2e-4)
    np.testing.assert_allclose(new.samples["division_soft_label"], w, atol=2e-4)
    np.testing.assert_array_equal(new.samples["fallback_warmup"], 0.0)
    assert diag["division_fallback"] == 0.0
    assert diag["division_clean"] == pytest.approx((want == division.CLEAN).mean())

    # The loss reads the stored calibrated division: the margins and the hard sets'
    # targets take v and w where the paper takes u and q.
    rows = {k: v[:7] for k, v in new.samples.items()}
    raw, step = _raw(0), 40
    loss, aux = _loss(method, raw, rows, step)
    codes = jnp.asarray(want[:7])
    vr, wr = rows["division_uncertainty"], rows["division_soft_label"]
    y = labels.edl_targets(codes, wr, rows["prediction"] > 0.5)
    margins = labels.trusted_margins(codes, vr, wr)
    lam = labels.num_hard_negatives(step + 1, num_real=6)
    expected, _ = losses.ugncl_loss(
        evidence.log_evidence(raw),
        jnp.tanh(raw),
        labels=y,
        codes=codes,
        margins=margins,
        num_negatives=lam,
        robust_weight=0.8,
        where=MASK,
    )
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(aux.applied_weight, y)
    np.testing.assert_array_equal(aux.metrics["division_fallback"], 0.0)


def _warmup_loss(raw, step):
    lam = labels.num_hard_negatives(step + 1, num_real=6)
    want, _ = losses.ugncl_loss(
        evidence.log_evidence(raw), jnp.tanh(raw), num_negatives=lam, warmup=True, where=MASK
    )
    return want


@pytest.mark.parametrize(
    ("calibration", "case"),
    [
        ("paper", "one_set"),  # every pair hard-noisy (the real-data run)
        ("paper", "no_trusted"),  # noisy and hard-noisy only: no clean pair selected
        ("data", "equal_soft_labels"),
    ],
)
def test_a_degenerate_division_falls_back_and_says_so(caplog, calibration, case):
    method = methods.build_method("ugncl", {"calibration": calibration})
    stats = _stats(1)
    u = np.asarray(stats["uncertainty"])
    if case == "equal_soft_labels":  # a mixture that separates nothing
        bad = {**stats, "soft_label": jnp.full(N, 0.01)}
    elif case == "one_set":
        bad = {**stats, "uncertainty": jnp.ones(N), "soft_label": jnp.zeros(N)}
    else:
        bad = {
            "uncertainty": jnp.asarray(np.where(np.arange(N) % 2, 0.9, 0.1) + 0.01 * u),
            "prediction": jnp.zeros(N),
            "soft_label": jnp.asarray(np.full(N, 1e-3) * (1 + 0.1 * u)),
        }
    # Before any usable division: the warm-up objective, and the rows say so.
    memory = _memory(method)
    with caplog.at_level(logging.WARNING):
        first, diag = method.refresh_fn(memory, bad, _ctx_refresh(2))
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "fallback" in message and "warm-up objective" in message
    assert diag["division_fallback"] == 1.0 and diag["division_warmup"] == 1.0
    rows = {k: v[:7] for k, v in first.samples.items()}
    raw, step = _raw(2), 40
    loss, aux = _loss(method, raw, rows, step)
    np.testing.assert_allclose(loss, _warmup_loss(raw, step), rtol=1e-6)
    np.testing.assert_array_equal(aux.metrics["division_fallback"], 1.0)

    # A usable division, then a degenerate one: the usable one stays.
    caplog.clear()
    good, diag = method.refresh_fn(first, _stats(1), _ctx_refresh(3))
    assert diag["division_fallback"] == 0.0 and not caplog.records
    with caplog.at_level(logging.WARNING):
        kept, diag = method.refresh_fn(good, bad, _ctx_refresh(4))
    assert len(caplog.records) == 1
    assert "fallback: the previous usable division" in caplog.records[0].getMessage()
    assert diag["division_fallback"] == 1.0 and diag["division_warmup"] == 0.0
    for key, value in good.samples.items():
        np.testing.assert_array_equal(kept.samples[key], value, err_msg=key)
    # It never trains on no pair: the kept division trusts some pairs.
    codes = np.asarray(kept.samples["codes"])
    assert np.isin(codes, [division.CLEAN, division.HARD_CLEAN]).any()


def test_online_cadence_falls_back_to_the_warm_up_objective_on_a_degenerate_batch():
    method = methods.build_method("ugncl", {"division_cadence": "online"})
    # Equal scores everywhere: every uncertainty and soft label of the batch is equal.
    raw = jnp.zeros((2, 7, 7))
    step = 40
    loss, aux = _loss(method, raw, {}, step)
    np.testing.assert_allclose(loss, _warmup_loss(raw, step), rtol=1e-6)
    np.testing.assert_array_equal(aux.metrics["division_fallback"], 1.0)
    np.testing.assert_array_equal(aux.memory["fallback_warmup"], 1.0)
    # A batch that divides: no fallback, the calibrated rule of the batch's own signals.
    raw = _raw(3)
    _, aux = _loss(method, raw, {}, step)
    signals = labels.division_signals(evidence.log_evidence(raw), where=MASK)
    cal = jax.jit(division.calibrate_signals)(signals.uncertainty, signals.soft_label, where=MASK)
    np.testing.assert_array_equal(aux.metrics["division_fallback"], 0.0)
    np.testing.assert_allclose(aux.memory["division_uncertainty"], cal.hard_posterior)


def test_the_paper_calibration_ignores_the_mixtures():
    """``'paper'``: ``u < threshold`` and ``q > epsilon`` as printed, whatever the mixtures
    say (the margins and targets read ``u`` and ``q``)."""
    method = methods.build_method("ugncl", {"calibration": "paper", "threshold": 0.4})
    stats = _stats(2)
    new, diag = method.refresh_fn(_memory(method), stats, _ctx_refresh(2))
    want = labels.ugd_partition(
        stats["uncertainty"], stats["prediction"] > 0.5, stats["soft_label"], threshold=0.4
    )
    np.testing.assert_array_equal(new.samples["codes"], want)
    np.testing.assert_allclose(new.samples["division_uncertainty"], stats["uncertainty"])
    np.testing.assert_allclose(new.samples["division_soft_label"], stats["soft_label"])
    assert diag["division_fallback"] == 0.0


def test_bad_calibration_says_what_to_set():
    with pytest.raises(ValueError, match=r"ugncl calibration must be one of .*method_kwargs"):
        methods.build_method("ugncl", {"calibration": "auto"})


@pytest.mark.parametrize(
    ("arg", "want"),
    [
        ("synthetic", "data"),
        ("synthetic,world=small_global", "data"),
        ("f30k", "paper"),
        ("coco", "paper"),
        ("cc152k", "paper"),
    ],
)
def test_configs_keep_the_paper_constants_on_the_paper_backbone(arg, want):
    config = load_config("ugncl", arg)
    assert config.method_kwargs.calibration == want
    if want == "paper":
        assert config.method_kwargs.threshold == 0.5 and config.method_kwargs.epsilon == 0.5


def test_saturated_uncertainties_divide_by_the_soft_labels_alone():
    """Every ``u`` 0 (the default world once every row holds a pair of overwhelming
    evidence): no hard pair, no fallback, the soft labels' mixture and the prediction
    divide (the paper's division at ``u < p`` for every pair)."""
    method = methods.build_method("ugncl")
    stats = {**_stats(3), "uncertainty": jnp.zeros(N)}
    new, diag = method.refresh_fn(_memory(method), stats, _ctx_refresh(5))
    assert diag["division_fallback"] == 0.0
    _, w = _oracle(np.asarray(_stats(3)["uncertainty"]), np.asarray(stats["soft_label"]))
    predicted = (np.asarray(stats["prediction"]) > 0.5) | (w > 0.5)
    np.testing.assert_array_equal(
        new.samples["codes"], np.where(predicted, division.CLEAN, division.NOISY)
    )


def test_refresh_is_finite_on_a_large_training_set():
    """The refresh's mixtures over 20,000 pairs (the default world) give finite posteriors."""
    method = methods.build_method("ugncl")
    rng = np.random.default_rng(0)
    n = 20_000
    stats = {
        "uncertainty": jnp.asarray(rng.beta(2, 5, n), jnp.float32),
        "prediction": jnp.asarray(rng.random(n) < 0.5, jnp.float32),
        "soft_label": jnp.asarray(rng.beta(1, 3, n), jnp.float32),
    }
    new, diag = method.refresh_fn(_memory(method, n), stats, _ctx_refresh(2))
    for key in ("division_uncertainty", "division_soft_label"):
        assert np.isfinite(np.asarray(new.samples[key])).all()
    assert diag["division_fallback"] == 0.0
    assert jax.tree.leaves(new.samples)[0].shape == (n,)


def test_the_warm_up_objective_runs_only_where_a_pair_falls_back():
    """Two networks under the trainer's named vmap: one whose memory has no usable
    division (the warm-up objective), one divided (the main objective only). The
    fallback's test is one unbatched predicate, so the warm-up objective is a real
    branch (``cond``), not a select that computes it for every step."""
    method = methods.build_method("ugncl")
    memory = _memory(method)
    bad = {**_stats(1), "soft_label": jnp.full(N, 0.01)}
    first, _ = method.refresh_fn(memory, bad, _ctx_refresh(2))
    good, _ = method.refresh_fn(first, _stats(1), _ctx_refresh(3))
    rows = [{k: v[:7] for k, v in m.samples.items()} for m in (first, good)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *rows)
    raw, step = _raw(2), 40
    ctx = _ctx(base.MAIN, step)._replace(network_axis=base.NETWORK_AXIS)

    def one(r, m):
        loss, aux = method.loss_fn({"logit": r}, {"mask": MASK}, m, m, ctx)
        return loss, aux.metrics["division_fallback"]

    both = jax.vmap(one, axis_name=base.NETWORK_AXIS)
    raws = jnp.stack([raw, raw])
    loss, fallback = jax.jit(both)(raws, stacked)
    np.testing.assert_allclose(loss[0], _warmup_loss(raw, step), rtol=1e-6)
    np.testing.assert_allclose(loss[1], _loss(method, raw, rows[1], step)[0], rtol=1e-6)
    np.testing.assert_array_equal(fallback[:, 0], [1.0, 0.0])
    # Both divided: the same main objective for each, and the warm-up objective a branch.
    divided = jax.tree.map(lambda *a: jnp.stack(a), rows[1], rows[1])
    loss, _ = jax.jit(both)(raws, divided)
    np.testing.assert_allclose(loss, loss[1::-1], rtol=0)
    np.testing.assert_allclose(loss[0], _loss(method, raw, rows[1], step)[0], rtol=1e-6)
    assert " cond[" in str(jax.make_jaxpr(both)(raws, divided))
