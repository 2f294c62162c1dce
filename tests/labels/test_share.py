"""The mismatched share from partner p-values (``ncljax.labels.share``) against Storey's
estimator written out in numpy, scipy's Wilson interval, and simulated nulls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ncljax import labels
from ncljax.labels import share


def _storey(p, lam):
    """Storey (2002), Eq. 3, as printed: #{p > lambda} / (N (1 - lambda))."""
    p = np.asarray(p, np.float64)
    return sum(1 for v in p if v > lam) / (len(p) * (1 - lam))


@pytest.mark.parametrize("lam", [0.25, 0.5, 0.8])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_estimate_and_bound_against_storey_and_scipys_wilson_interval(lam, confidence):
    rng = np.random.default_rng(int(lam * 100 + confidence * 1000))
    n = 300
    p = np.where(rng.random(n) < 0.3, rng.random(n), rng.beta(0.3, 8.0, n)).astype(np.float32)
    got = labels.noise_share(p, lam=lam, confidence=confidence)
    k = int((p > lam).sum())
    # A one-sided bound at `confidence` is the upper end of the two-sided interval at
    # 2 * confidence - 1.
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=2 * confidence - 1, method="wilson")
    assert float(got.estimate) == pytest.approx(_storey(p, lam), rel=1e-5)
    assert float(got.bound) == pytest.approx(min(1.0, ci.high / (1 - lam)), rel=1e-5)
    assert float(got.count) == n
    assert float(got.bound) >= float(got.estimate)


def test_where_counts_only_the_given_pairs_and_no_pair_means_unknown():
    p = jnp.asarray([0.9, 0.9, 0.01, 0.02, 0.03, 0.04])
    where = jnp.asarray([False, False, True, True, True, True])
    got = labels.noise_share(p, where=where)
    assert float(got.estimate) == 0.0 and float(got.count) == 4
    ci = stats.binomtest(0, 4).proportion_ci(confidence_level=0.9, method="wilson")
    assert float(got.bound) == pytest.approx(min(1.0, ci.high / 0.5), rel=1e-5)
    none = labels.noise_share(p, where=jnp.zeros(6, bool))
    assert (float(none.estimate), float(none.bound), float(none.count)) == (1.0, 1.0, 0.0)


def test_the_in_batch_partner_p_values_of_mismatched_pairs_estimate_their_share():
    """Batches whose pairs are mismatched at rate ``pi`` (their partner logit drawn like a
    negative) and matched otherwise (partner well above): the estimate is ``pi`` within
    sampling error and the bound covers it; a batch of clean pairs is bounded near 0."""
    rng = np.random.default_rng(0)
    b, batches = 128, 40

    def p_values(pi):
        out = []
        for _ in range(batches):
            logits = rng.normal(size=(b, b))
            matched = rng.random(b) >= pi
            logits[np.arange(b), np.arange(b)] += np.where(matched, 6.0, 0.0)
            out.append(np.asarray(labels.partner_p_value(jnp.asarray(logits, jnp.float32))))
        return np.concatenate(out)

    for pi in (0.0, 0.2, 0.4, 0.6):
        got = labels.noise_share(p_values(pi))
        assert float(got.estimate) == pytest.approx(pi, abs=0.03)
        assert float(got.bound) >= pi
    assert float(labels.noise_share(p_values(0.0)).bound) < 0.01


def test_no_noise_compares_the_bound_with_the_floor():
    low = share.NoiseShare(jnp.float32(0.0), jnp.float32(0.04), jnp.float32(500))
    high = low._replace(bound=jnp.float32(0.06))
    assert bool(labels.no_noise(low, 0.05)) and not bool(labels.no_noise(high, 0.05))
    got = labels.share_diagnostics(low, labels.no_noise(low, 0.05))
    assert {k: float(v) for k, v in got.items()} == pytest.approx(
        {"noise_share_estimate": 0.0, "noise_share_bound": 0.04, "division_off": 1.0}
    )


def test_jits_and_has_no_gradient():
    p = jnp.linspace(0.01, 1.0, 50)
    eager = labels.noise_share(p)
    jitted = jax.jit(labels.noise_share)(p)
    np.testing.assert_allclose(jitted.bound, eager.bound, rtol=1e-6)
    grad = jax.grad(lambda x: labels.noise_share(x).bound)(p)
    np.testing.assert_array_equal(grad, 0.0)


def test_switch_off_needs_the_held_out_share_below_the_floor_too():
    low = labels.noise_share(np.full(400, 0.01, np.float32))  # bound 2.7 / 400 / 0.5 < 0.05
    high = labels.noise_share(np.linspace(0.0025, 1.0, 400, dtype=np.float32))
    asked = []

    def held(value):
        def fn():
            asked.append(value)
            return value

        return fn

    assert share.switch_off(low, 0.05) == (True, None)  # the training pairs alone
    assert share.switch_off(low, 0.05, held(0.01)) == (True, 0.01)
    assert share.switch_off(low, 0.05, held(0.2)) == (False, 0.2)  # memorised: kept on
    assert share.switch_off(low, 0.05, held(None)) == (True, None)  # no held-out estimate
    assert asked == [0.01, 0.2, None]
    assert share.switch_off(high, 0.05, held(0.0)) == (False, None)
    assert asked == [0.01, 0.2, None]  # not asked where the training pairs say no
    diag = share.diagnostics(low, True, 0.01)
    assert float(diag["held_out_share"]) == pytest.approx(0.01)
    assert "held_out_share" not in share.diagnostics(low, True)
