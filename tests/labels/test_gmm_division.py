"""``check_division``: the degenerate-division flags against numpy (on sklearn's fit where
the mixture comes from data), their invariance to an affine map of the values, and the
errors of bad settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.mixture import GaussianMixture

from ncljax.labels import gmm as gmm_lib


def _numpy_flags(x, prob, weights, means, threshold=0.5, min_weight=0.01, min_separation=0.1):
    """The documented rule, in numpy: (one_set, inseparable, separation)."""
    x = np.asarray(x, np.float64)
    sd = x.std()
    gap = abs(means[1] - means[0])
    separation = gap / sd if sd > 0 else 0.0
    distinct = len(np.unique(x)) >= 2
    inseparable = (not distinct) or min(weights) < min_weight or gap < min_separation * sd
    above = np.asarray(prob) > threshold
    one_set = bool(above.all() or not above.any())
    return one_set, inseparable, separation


def _sklearn(x):
    """sklearn's fit from the same start as ``fit_gmm_1d`` (the best 2-means split)."""
    x64 = np.asarray(x, np.float64)
    order = np.sort(x64)
    n = len(order)
    best, split = -1.0, 1
    for t in range(1, n):  # the optimal 1-D 2-means split, by brute force
        if order[t - 1] == order[t]:
            continue
        a, b = order[:t], order[t:]
        between = t * (n - t) / n * (a.mean() - b.mean()) ** 2
        if between > best:
            best, split = between, t
    low = x64 <= order[split - 1]
    means = np.array([x64[low].mean(), x64[~low].mean()])
    var = np.array([x64[low].var(), x64[~low].var()]) + 5e-4
    sk = GaussianMixture(
        2,
        max_iter=10,
        tol=1e-2,
        reg_covar=5e-4,
        weights_init=np.array([low.mean(), 1 - low.mean()]),
        means_init=means[:, None],
        precisions_init=(1 / var)[:, None, None],
    ).fit(x64[:, None])
    order = np.argsort(sk.means_[:, 0])
    weights, means = sk.weights_[order], sk.means_[order, 0]
    prob = sk.predict_proba(x64[:, None])[:, order[0]]
    return weights, means, prob


def _data(kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "bimodal":
        return np.concatenate([rng.normal(0.1, 0.03, 300), rng.normal(0.6, 0.05, 200)])
    if kind == "outlier":  # one far value: a component of one pair (weight 1/400)
        return np.concatenate([rng.normal(0.3, 0.05, 399), [5.0]])
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["bimodal", "outlier"])
def test_flags_match_numpy_on_sklearns_fit(kind):
    x = _data(kind).astype(np.float32)
    fit = gmm_lib.fit_gmm_1d(x)
    prob = gmm_lib.low_mean_posterior(x, fit)
    check = gmm_lib.check_division(x, prob, fit)
    weights, means, sk_prob = _sklearn(x)
    np.testing.assert_allclose(fit.weights, weights, atol=1e-3)
    np.testing.assert_allclose(fit.means, means, atol=1e-3)
    one_set, inseparable, separation = _numpy_flags(x, sk_prob, weights, means)
    assert bool(check.one_set) == one_set
    assert bool(check.inseparable) == inseparable
    assert bool(check.degenerate) == (one_set or inseparable)
    assert float(check.separation) == pytest.approx(separation, rel=1e-3)
    assert bool(check.degenerate) == (kind == "outlier")


def test_all_equal_values_are_inseparable():
    x = jnp.full(50, 0.4)
    fit = gmm_lib.fit_gmm_1d(x)
    check = gmm_lib.check_division(x, gmm_lib.low_mean_posterior(x, fit), fit)
    assert bool(check.inseparable) and bool(check.degenerate)
    assert float(check.separation) == 0.0


@pytest.mark.parametrize("value", [0.9, 0.1, 0.5])
def test_every_posterior_on_one_side_is_one_set(value):
    x = _data("bimodal").astype(np.float32)
    fit = gmm_lib.fit_gmm_1d(x)
    prob = np.full(x.shape, value, np.float32)  # 0.5 is not above the threshold: no clean pair
    check = gmm_lib.check_division(x, prob, fit)
    assert bool(check.one_set) and bool(check.degenerate) and not bool(check.inseparable)
    prob[7] = 0.2 if value > 0.5 else 0.8  # one pair on the other side: two sets
    assert not bool(gmm_lib.check_division(x, prob, fit).degenerate)


def test_coinciding_means_and_an_empty_component_against_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 1.0, 200).astype(np.float32)
    prob = np.where(np.arange(200) < 100, 0.8, 0.2).astype(np.float32)
    for weights, means in [
        ([0.5, 0.5], [-0.04, 0.05]),  # 0.09 sd apart: one cluster
        ([0.5, 0.5], [-0.1, 0.1]),  # 0.2 sd apart: two
        ([0.005, 0.995], [-2.0, 0.0]),  # a component of half a percent
    ]:
        fit = gmm_lib.GaussianMixture1D(
            weights=jnp.asarray(weights),
            means=jnp.asarray(means),
            variances=jnp.ones(2),
            log_likelihood=jnp.zeros(()),
            n_iter=jnp.int32(1),
            converged=jnp.bool_(True),
            degenerate=jnp.bool_(False),
        )
        check = gmm_lib.check_division(x, prob, fit)
        _, inseparable, separation = _numpy_flags(x, prob, weights, means)
        assert bool(check.inseparable) == inseparable
        assert float(check.separation) == pytest.approx(separation, rel=1e-4)


@pytest.mark.parametrize("scale,shift", [(3.0, -1.0), (0.01, 5.0), (250.0, 7.0)])
def test_invariant_to_an_affine_map_of_values_and_mixture(scale, shift):
    for kind in ("bimodal", "outlier"):
        x = jnp.asarray(_data(kind, seed=1), jnp.float32)
        fit = gmm_lib.fit_gmm_1d(x)
        prob = gmm_lib.low_mean_posterior(x, fit)
        moved = fit._replace(means=scale * fit.means + shift, variances=scale**2 * fit.variances)
        want = gmm_lib.check_division(x, prob, fit)
        got = gmm_lib.check_division(scale * x + shift, prob, moved)
        assert bool(got.degenerate) == bool(want.degenerate)
        assert bool(got.inseparable) == bool(want.inseparable)
        assert float(got.separation) == pytest.approx(float(want.separation), rel=1e-3)


def test_where_mask_and_jit():
    x = _data("bimodal").astype(np.float32)
    padded = np.concatenate([x, [50.0, -50.0]]).astype(np.float32)
    where = np.arange(len(padded)) < len(x)
    fit = gmm_lib.fit_gmm_1d(padded, where=where)
    prob = gmm_lib.low_mean_posterior(padded, fit)
    check = jax.jit(gmm_lib.check_division)(padded, prob, fit, where=where)
    want = gmm_lib.check_division(x, prob[: len(x)], gmm_lib.fit_gmm_1d(x))
    assert not bool(check.degenerate) and not bool(want.degenerate)
    assert float(check.separation) == pytest.approx(float(want.separation), rel=1e-5)


@pytest.mark.parametrize(
    "kwargs", [{"min_weight": 0.5}, {"min_weight": -0.1}, {"min_separation": -1}]
)
def test_rejects_bad_settings(kwargs):
    x = jnp.arange(5.0)
    with pytest.raises(ValueError):
        gmm_lib.check_division(x, x, gmm_lib.fit_gmm_1d(x), **kwargs)
