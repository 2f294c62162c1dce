"""UGNCL's top-level functions one by one (``ncljax.methods.ugncl``), against hand-written
tables and a numpy evaluation of the warm-up objective (Eqs. 12 and 16 with every label 1),
without building the method through the registry."""

import inspect

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ncljax import losses
from ncljax.labels import ugncl as division
from ncljax.methods import base, ugncl

CLEAN, NOISY, HARD_CLEAN, HARD_NOISY = 0, 1, 2, 3


def _ctx(phase, step=0):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(jnp.asarray(step, jnp.int32), zero, phase, 10, zero, None)


def test_settings_are_the_factory_signature():
    params = inspect.signature(ugncl.ugncl).parameters
    defaults = {k: p.default for k, p in params.items() if k != "model_config"}
    assert defaults == ugncl.Settings()._asdict()
    assert params["model_config"].default is None
    assert set(ugncl.CHECKS) == set(ugncl.Settings._fields)
    assert ugncl.ugncl(theta=3).settings == ugncl.Settings(theta=3)


def test_plan_by_hand():
    s = ugncl.Settings(warmup_epochs=2)
    # epoch: (phase, refresh, lr_epoch, selectable)
    table = {
        0: (base.WARMUP, False, 0, False),
        1: (base.WARMUP, False, 0, False),
        2: (base.MAIN, True, 0, True),
        3: (base.MAIN, True, 1, True),
        9: (base.MAIN, True, 7, True),
    }
    for epoch, want in table.items():
        plan = ugncl.plan(s, epoch)
        assert (plan.phase, plan.refresh, plan.lr_epoch, plan.selectable) == want, epoch
        assert plan.drop_remainder and plan.min_batch == 2
        assert not ugncl.plan(s._replace(full_batches=False), epoch).drop_remainder


def test_scores_of_each_head():
    s = ugncl.Settings(cosine_shift=0.2, cosine_temperature=0.1)
    cos = np.array([[0.9, 0.1], [0.0, 0.6]], np.float32)
    raw, sim = ugncl.scores(s, {"sim": jnp.asarray(cos)})
    assert raw.shape == sim.shape == (1, 2, 2)
    np.testing.assert_allclose(raw[0], (cos - 0.2) / 0.1, rtol=1e-5)
    np.testing.assert_array_equal(sim[0], cos)  # the ranking loss reads the cosine
    logit = np.array([[[2.0, -1.0], [0.5, 3.0]]] * 2, np.float32)
    raw, sim = ugncl.scores(s, {"logit": jnp.asarray(logit)})
    np.testing.assert_array_equal(raw, logit)
    np.testing.assert_allclose(sim, np.tanh(logit), rtol=1e-6)


def test_eval_transform_is_the_log_evidence_of_the_head_score():
    s = ugncl.Settings(tau=0.5, cosine_shift=0.2, cosine_temperature=0.25)
    x = np.array([[-0.5, 0.0], [0.3, 0.9]])
    softplus = lambda v: np.log1p(np.exp(v))
    got = ugncl.eval_transform(s, jnp.asarray(x, jnp.float32), cosine=True)
    np.testing.assert_allclose(got, softplus((x - 0.2) / 0.25) / 0.5, rtol=1e-5)
    got = ugncl.eval_transform(s, jnp.asarray(x, jnp.float32), cosine=False)
    np.testing.assert_allclose(got, softplus(x) / 0.5, rtol=1e-5)


def test_divide_by_hand_and_its_degenerate_cases():
    s = ugncl.Settings(calibration="paper", threshold=0.5, epsilon=0.5)
    u = jnp.asarray([0.1, 0.2, 0.7, 0.8, 0.3, 0.9])
    prediction = jnp.asarray([True, False, True, False, True, False])
    q = jnp.asarray([0.9, 0.1, 0.7, 0.2, 0.6, 0.6])
    codes, u_used, q_used, bad = ugncl.divide(s, u, prediction, q)
    # u < p: clean if predicted, else noisy; u >= p: hard-clean if q > epsilon.
    want = [CLEAN, NOISY, HARD_CLEAN, HARD_NOISY, CLEAN, HARD_CLEAN]
    np.testing.assert_array_equal(codes, want)
    assert u_used is u and q_used is q and not bool(bad)
    # Every pair in one set, or none trusted (no clean and no hard-clean pair).
    assert bool(ugncl.divide(s, jnp.ones(6), prediction, jnp.zeros(6))[3])
    assert bool(ugncl.divide(s, jnp.full(6, 0.1), jnp.zeros(6, bool), q)[3])
    # Padding is no pair: the real ones alone decide.
    where = jnp.asarray([True, True, False, False, False, False])
    assert not bool(ugncl.divide(s, u, prediction, q, where=where)[3])
    where = jnp.asarray([True, False, False, False, True, False])
    assert bool(ugncl.divide(s, u, prediction, q, where=where)[3])  # all clean


def test_stored_division_reads_the_rows_the_refresh_wrote():
    rows = {
        "uncertainty": jnp.asarray([0.1, 0.9, 0.2]),
        "prediction": jnp.asarray([1.0, 0.0, 0.0]),
        "soft_label": jnp.asarray([0.2, 0.8, 0.3]),
        "division_uncertainty": jnp.asarray([0.9, 0.1, 0.8]),
        "division_soft_label": jnp.asarray([0.1, 0.2, 0.9]),
        "fallback_warmup": jnp.asarray([0.0, 1.0, 0.0]),
    }
    paper = ugncl.stored_division(ugncl.Settings(calibration="paper"), rows)
    np.testing.assert_array_equal(paper.codes, [CLEAN, HARD_CLEAN, NOISY])
    np.testing.assert_array_equal(paper.uncertainty, rows["uncertainty"])
    np.testing.assert_array_equal(paper.fallback, [False, True, False])
    data = ugncl.stored_division(ugncl.Settings(), rows)
    # v >= 0.5: hard (hard-clean if w > 0.5); v < 0.5: determined, noisy as neither the
    # prediction nor w > 0.5 says clean.
    np.testing.assert_array_equal(data.codes, [HARD_NOISY, NOISY, HARD_CLEAN])
    np.testing.assert_array_equal(data.soft_label, rows["division_soft_label"])
    del rows["fallback_warmup"]
    assert ugncl.stored_division(ugncl.Settings(), rows).fallback is None


def test_memory_rows_of_a_division():
    signals = division.DivisionSignals(
        jnp.asarray([0.3, 0.6]), jnp.asarray([True, False]), jnp.asarray([0.7, 0.2])
    )
    rows = ugncl.signal_rows(signals)
    assert list(rows) == ["uncertainty", "prediction", "soft_label"]
    np.testing.assert_array_equal(rows["prediction"], [1.0, 0.0])
    codes, fallback = jnp.asarray([2, 3], jnp.int8), jnp.asarray([True, False])
    rows = ugncl.division_rows(codes, rows["uncertainty"], rows["soft_label"], fallback)
    assert rows["codes"].dtype == jnp.int32 and rows["fallback_warmup"].dtype == jnp.float32
    np.testing.assert_array_equal(rows["fallback_warmup"], [1.0, 0.0])


def _warmup_oracle(raw, mask, s, lam):
    """Per pair: the evidential loss of both directions summed over the views (every
    label 1, ``xi1 = 0``) plus ``xi2 K`` times the views' summed top-``lambda`` hinges."""
    raw = raw.astype(np.float64)
    real = np.flatnonzero(mask)
    k = len(real)
    out = np.zeros(len(mask))
    for view in raw:
        alpha = np.exp(np.log1p(np.exp(view)) / s.tau) + 1.0  # e = exp(softplus(R) / tau)
        sim = np.tanh(view)
        for i in real:
            for a in (alpha[i, real], alpha[real, i]):  # caption query: column i
                mean = a / a.sum()
                y = (real == i).astype(float)
                out[i] += np.sum((y - mean) ** 2 + mean * (1 - mean) / (a.sum() + 1))
            for costs in (sim[i, real], sim[real, i]):
                hinge = np.maximum(0.0, s.gamma - sim[i, i] + costs)[real != i]
                out[i] += s.xi2 * k * np.sort(hinge)[::-1][:lam].mean()
    return out


def test_warmup_loss_against_numpy():
    s = ugncl.Settings(xi1=0.0, tau=1.0, lambda_start=5, delta=1.0, theta=2)
    rng = np.random.default_rng(0)
    raw = (rng.normal(size=(2, 6, 6)) + 2 * np.eye(6)).astype(np.float32)
    mask = np.array([True, True, False, True, True, True])
    step = 1  # lambda = max(floor(5 - 1 * (step + 1)), 2) = 3 (of 4 real negatives)
    loss_fn = jax.jit(lambda o, b: ugncl.loss(s, o, b, {}, {}, _ctx(base.WARMUP, step)))
    loss, aux = loss_fn({"logit": jnp.asarray(raw)}, {"mask": jnp.asarray(mask)})
    assert isinstance(aux, base.Aux)
    np.testing.assert_allclose(aux.metrics["num_negatives"], 3.0)
    np.testing.assert_allclose(loss, _warmup_oracle(raw, mask, s, 3), rtol=1e-5, atol=1e-6)
    assert not aux.memory and not aux.clean_estimates and aux.applied_weight is None
    assert set(aux.metrics) == {"num_negatives", "loss_evidential", "loss_robust"}


def test_check_model_refuses_a_squashed_sgraf_score():
    ugncl.check_model(None)
    ugncl.check_model(ml_collections.ConfigDict({"head": "cosine", "sim_output": "sigmoid"}))
    ugncl.check_model(ml_collections.ConfigDict({"head": "sgr", "sgraf": {"sim_output": "raw"}}))
    with pytest.raises(ValueError, match="SAF head's raw score"):
        ugncl.check_model(
            ml_collections.ConfigDict({"head": "saf", "sgraf": {"sim_output": "sigmoid"}})
        )


def test_bind_binds_the_settings_and_the_head():
    s = ugncl.Settings(division_cadence="online", xi1=0.0)
    cosine = ml_collections.ConfigDict({"head": "cosine", "sim_output": "sigmoid"})
    method = ugncl.bind(s, model_config=cosine)
    assert method.settings is s and method.stats_fn is None  # online: no statistics pass
    x = jnp.asarray([[0.1, 0.7]])
    np.testing.assert_array_equal(method.eval_transform(x), ugncl.eval_transform(s, x, cosine=True))
    assert method.plan_fn(4) == ugncl.plan(s, 4)
    assert ugncl.bind(ugncl.Settings()).stats_fn is not None


@pytest.mark.parametrize("warmup", [True, False])
def test_objective_reads_the_ranking_setting(warmup):
    """``ranking='contrastive'`` trains ``losses.trusted_contrastive_loss`` at
    ``contrastive_temperature`` (weights from the division's codes and trusted margins over
    ``gamma``) in place of the trusted robust loss; the evidential part is the same."""
    rng = np.random.default_rng(3)
    sim = jnp.asarray(rng.uniform(-0.3, 0.9, (2, 6, 6)), jnp.float32)
    s = ugncl.Settings(ranking="contrastive", contrastive_temperature=0.1, gamma=0.25, xi2=0.5)
    log_e = ugncl.log_evidence(s, (sim - s.cosine_shift) / s.cosine_temperature)
    mask = jnp.ones(6)
    codes = jnp.array([0, 1, 2, 3, 0, 2])
    margins = jnp.array([0.25, 0.0, 0.1, 0.05, 0.25, 0.3], jnp.float32)
    phase = (
        dict(warmup=True)
        if warmup
        else dict(
            labels=jnp.ones(6), codes=codes, margins=margins, edl_view_aggregation="per_view_mean"
        )
    )
    shares, terms = ugncl.objective(s, log_e, sim, 5, mask, **phase)
    trusted, _ = ugncl.objective(s._replace(ranking="trusted"), log_e, sim, 5, mask, **phase)
    weights = np.ones(6) if warmup else np.array([1.0, 0.0, 0.4, 0.2, 1.0, 1.0])
    per_view = [losses.symmetric_info_nce(v, temperature=0.1) for v in sim]
    want_robust = weights * (np.asarray(per_view[0]) + np.asarray(per_view[1]))
    np.testing.assert_allclose(terms.robust, want_robust, rtol=1e-5)
    np.testing.assert_allclose(shares, terms.evidential + 0.5 * 6 * want_robust, rtol=1e-5)
    assert not np.allclose(shares, trusted)
