"""Tests for ncljax.labels.gmm against a float64 numpy EM loop, scipy densities and
scikit-learn's ``GaussianMixture`` (the estimator the official codes call)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import stats
from sklearn.mixture import GaussianMixture

from ncljax.labels import (
    GaussianMixture1D,
    fit_gmm_1d,
    gmm_posteriors,
    high_mean_posterior,
    low_mean_posterior,
    minmax_normalize,
)

F32_ATOL = 1e-5
F64_ATOL = 1e-10

# Eager calls retrace the EM loop on every call; jit once per setting instead.
# test_jit_equals_no_jit covers the eager path.
fit = jax.jit(fit_gmm_1d, static_argnames=("max_iter", "tol", "reg_covar"))


def _best_two_means(x):
    """Bool ``[N]`` high cluster of the 2-means partition of least within-cluster sum of
    squares, by trying every threshold between distinct values (float64, brute force)."""
    values = np.unique(x)
    best, best_sse = np.zeros(x.shape, bool), np.inf
    for threshold in values[:-1]:
        high = x > threshold
        sse = sum(((x[m] - x[m].mean()) ** 2).sum() for m in (high, ~high))
        if sse < best_sse:
            best, best_sse = high, sse
    return best


def _numpy_em(x, *, max_iter=10, tol=1e-2, reg_covar=5e-4):
    """Reference EM in float64 with plain loops and densities (no log space), started from
    the best 2-means partition and stopped by sklearn's rule."""
    x = np.asarray(x, dtype=np.float64)
    high = _best_two_means(x)
    resp = np.stack([~high, high], axis=1).astype(np.float64)

    def m_step(resp):
        weights, means, variances = np.zeros(2), np.zeros(2), np.zeros(2)
        for k in range(2):
            nk = resp[:, k].sum() + 10 * np.finfo(np.float64).eps
            means[k] = (resp[:, k] * x).sum() / nk
            variances[k] = (resp[:, k] * (x - means[k]) ** 2).sum() / nk + reg_covar
            weights[k] = nk
        return weights / weights.sum(), means, variances

    def e_step(params):
        weights, means, variances = params
        dens = np.stack(
            [
                weights[k]
                * np.exp(-((x - means[k]) ** 2) / (2 * variances[k]))
                / np.sqrt(2 * np.pi * variances[k])
                for k in range(2)
            ],
            axis=1,
        )
        total = dens.sum(axis=1)
        return dens / total[:, None], np.log(total).mean()

    params = m_step(resp)
    resp, mean_ll = e_step(params)
    previous_ll, n_iter, converged = -np.inf, 0, False
    lls = [mean_ll]
    for it in range(1, max_iter + 1):
        # sklearn: the change of the bound at the last two parameter sets, then the M-step.
        converged = abs(mean_ll - previous_ll) < tol
        params = m_step(resp)
        previous_ll = mean_ll
        resp, mean_ll = e_step(params)
        lls.append(mean_ll)
        n_iter = it
        if converged:
            break
    order = np.argsort(params[1], kind="stable")
    weights, means, variances = (p[order] for p in params)
    return dict(
        weights=weights,
        means=means,
        variances=variances,
        log_likelihood=mean_ll,
        n_iter=n_iter,
        converged=converged,
        posteriors=resp[:, order],
        lls=np.array(lls),
    )


def _bimodal(seed, n, frac_low, mu=(0.25, 0.75), sd=(0.08, 0.1)):
    rng = np.random.default_rng(seed)
    n_low = round(frac_low * n)
    x = np.concatenate([rng.normal(mu[0], sd[0], n_low), rng.normal(mu[1], sd[1], n - n_low)])
    return rng.permutation(x)


def _loss_like(seed, n):
    """Skewed, non-Gaussian modes, like min-max normalised per-sample losses."""
    rng = np.random.default_rng(seed)
    n_noisy = n // 5
    x = np.concatenate([rng.beta(2, 12, n - n_noisy), rng.beta(6, 3, n_noisy)])
    return (x - x.min()) / (x.max() - x.min())


# One odd N for all datasets, so each setting compiles once.
N_ODD = 1001
DATASETS = {
    "balanced": lambda: _bimodal(0, N_ODD, 0.5),
    "unequal_overlap": lambda: _bimodal(1, N_ODD, 0.15, mu=(0.35, 0.65), sd=(0.1, 0.06)),
    "skewed_mostly_low": lambda: _bimodal(2, N_ODD, 0.85, mu=(0.2, 0.6), sd=(0.1, 0.15)),
    "loss_like": lambda: _loss_like(3, N_ODD),
}
SETTINGS = [
    dict(),  # the official max_iter=10, tol=1e-2, reg_covar=5e-4
    dict(max_iter=25, tol=1e-3, reg_covar=1e-3),
    dict(max_iter=10, tol=0.0),  # always the full 10 iterations
]


def _assert_matches(gmm, posteriors, ref, atol):
    np.testing.assert_allclose(gmm.weights, ref["weights"], atol=atol, rtol=0)
    np.testing.assert_allclose(gmm.means, ref["means"], atol=atol, rtol=0)
    np.testing.assert_allclose(gmm.variances, ref["variances"], atol=atol, rtol=0)
    np.testing.assert_allclose(gmm.log_likelihood, ref["log_likelihood"], atol=10 * atol, rtol=0)
    np.testing.assert_allclose(posteriors, ref["posteriors"], atol=atol, rtol=0)
    assert int(gmm.n_iter) == ref["n_iter"]
    assert bool(gmm.converged) == ref["converged"]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_matches_numpy_em_float32(name, settings):
    x = DATASETS[name]()
    ref = _numpy_em(x, **settings)
    x32 = jnp.asarray(x, jnp.float32)
    gmm = fit(x32, **settings)
    assert gmm.means.dtype == jnp.float32
    _assert_matches(gmm, gmm_posteriors(x32, gmm), ref, F32_ATOL)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_matches_numpy_em_float64(name):
    x = DATASETS[name]()
    settings = dict(max_iter=40, tol=1e-7)
    ref = _numpy_em(x, **settings)
    with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.float64)
        gmm = fit(x64, **settings)
        assert gmm.means.dtype == jnp.float64
        _assert_matches(gmm, gmm_posteriors(x64, gmm), ref, F64_ATOL)


def test_where_mask_equals_fit_on_subset():
    x = _bimodal(4, 1537, 0.3)
    valid = np.random.default_rng(5).random(x.shape) < 0.7
    padded = np.where(valid, x, np.nan)  # padding content must not leak in
    settings = dict(max_iter=10, tol=0.0)
    ref = _numpy_em(x[valid], **settings)
    with jax.enable_x64(True):
        masked = fit(jnp.asarray(padded), where=jnp.asarray(valid), **settings)
        subset = fit(jnp.asarray(x[valid]), **settings)
        for field in GaussianMixture1D._fields:
            np.testing.assert_allclose(getattr(masked, field), getattr(subset, field), atol=1e-12)
        post = gmm_posteriors(jnp.asarray(x[valid]), masked)
        _assert_matches(masked, post, ref, F64_ATOL)
    masked32 = fit(jnp.asarray(padded, jnp.float32), where=valid, **settings)
    post32 = gmm_posteriors(jnp.asarray(x[valid], jnp.float32), masked32)
    _assert_matches(masked32, post32, ref, F32_ATOL)


def test_posteriors_match_scipy_densities():
    x = np.linspace(-0.2, 1.2, 57)
    gmm = GaussianMixture1D(
        weights=jnp.array([0.35, 0.65]),
        means=jnp.array([0.2, 0.7]),
        variances=jnp.array([0.01, 0.04]),
        log_likelihood=jnp.array(0.0),
        n_iter=jnp.int32(0),
        converged=jnp.bool_(False),
        degenerate=jnp.bool_(False),
    )
    joint = np.stack(
        [
            w * stats.norm.pdf(x, loc=m, scale=np.sqrt(v))
            for w, m, v in zip([0.35, 0.65], [0.2, 0.7], [0.01, 0.04], strict=True)
        ],
        axis=1,
    )
    expected = joint / joint.sum(axis=1, keepdims=True)
    post = gmm_posteriors(jnp.asarray(x, jnp.float32), gmm)
    np.testing.assert_allclose(post, expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(low_mean_posterior(x, gmm), expected[:, 0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(high_mean_posterior(x, gmm), expected[:, 1], atol=1e-6, rtol=0)


def test_log_likelihood_is_scipy_mixture_density_at_returned_parameters():
    x = _bimodal(6, 999, 0.4)
    gmm = fit(jnp.asarray(x, jnp.float32), max_iter=4, tol=0.0)
    w, m, v = (np.asarray(a, np.float64) for a in (gmm.weights, gmm.means, gmm.variances))
    mixture = w[0] * stats.norm.pdf(x, m[0], np.sqrt(v[0])) + w[1] * stats.norm.pdf(
        x, m[1], np.sqrt(v[1])
    )
    np.testing.assert_allclose(gmm.log_likelihood, np.log(mixture).mean(), atol=1e-5, rtol=0)


def test_recovers_true_parameters_and_sorts_components():
    rng = np.random.default_rng(7)
    n = 20_000
    is_low = rng.random(n) < 0.3
    x = np.where(is_low, rng.normal(0.2, 0.05, n), rng.normal(0.8, 0.1, n))
    # Reverse-sorted input so that nothing depends on the order of the data.
    x = np.sort(x)[::-1].copy()
    gmm = fit(jnp.asarray(x, jnp.float32), max_iter=100, tol=1e-8, reg_covar=1e-6)
    np.testing.assert_allclose(gmm.weights, [0.3, 0.7], atol=0.01)
    np.testing.assert_allclose(gmm.means, [0.2, 0.8], atol=0.005)
    np.testing.assert_allclose(np.sqrt(gmm.variances), [0.05, 0.1], rtol=0.05)
    assert gmm.means[0] < gmm.means[1]
    # Posterior columns follow the sorted components: the low mode is column 0.
    np.testing.assert_array_less(0.99, low_mean_posterior(jnp.array([0.15, 0.2, 0.25]), gmm))
    np.testing.assert_array_less(0.99, high_mean_posterior(jnp.array([0.7, 0.8, 0.95]), gmm))


def test_log_likelihood_non_decreasing_over_iterations():
    x = _bimodal(8, 1201, 0.35, mu=(0.4, 0.6), sd=(0.12, 0.12))  # heavy overlap: EM moves a lot
    fits = [fit(jnp.asarray(x, jnp.float32), max_iter=k, tol=0.0) for k in range(7)]
    lls = np.array([float(g.log_likelihood) for g in fits])
    assert [int(g.n_iter) for g in fits] == list(range(7))
    assert np.all(np.diff(lls) >= -1e-6), lls
    assert lls[-1] > lls[0] + 1e-3  # EM made progress, so the check is not vacuous
    np.testing.assert_allclose(lls, _numpy_em(x, max_iter=6, tol=0.0)["lls"], atol=1e-5)


def test_stopping_rule():
    x = jnp.asarray(_bimodal(9, 500, 0.5), jnp.float32)
    loose = fit(x, tol=1e9)  # the first iteration never stops (sklearn), the second does
    assert int(loose.n_iter) == 2 and bool(loose.converged)
    capped = fit(x, tol=0.0, max_iter=3)
    assert int(capped.n_iter) == 3 and not bool(capped.converged)
    none = fit(x, max_iter=0)
    assert int(none.n_iter) == 0 and not bool(none.converged)
    ref = _numpy_em(np.asarray(x), max_iter=0)
    np.testing.assert_allclose(none.means, ref["means"], atol=F32_ATOL)
    np.testing.assert_allclose(none.variances, ref["variances"], atol=F32_ATOL)


def test_all_equal_values_are_finite():
    x = jnp.full((9,), 0.37, jnp.float32)
    gmm = fit(x)
    assert bool(gmm.degenerate)
    post = gmm_posteriors(x, gmm)
    for leaf in (*gmm[:4], post):
        assert np.all(np.isfinite(leaf))
    # One component holds all the data; the other is empty (weight ~ 0, mean 0 from the
    # N_k floor), and sorting puts that empty one first.
    np.testing.assert_allclose(gmm.means, [0.0, 0.37], atol=1e-6)
    full = int(np.argmax(gmm.weights))
    np.testing.assert_allclose(gmm.weights[full], 1.0, atol=1e-5)
    np.testing.assert_allclose(gmm.means[full], 0.37, atol=1e-6)
    np.testing.assert_allclose(gmm.variances, 5e-4, rtol=1e-5)
    np.testing.assert_allclose(post.sum(axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(minmax_normalize(x), np.zeros(9))
    zero_fit = fit(minmax_normalize(x))
    assert all(np.all(np.isfinite(leaf)) for leaf in zero_fit[:4])


def test_two_points():
    x = jnp.array([0.9, 0.1])
    gmm = fit(x)
    assert not bool(gmm.degenerate)
    np.testing.assert_allclose(gmm.means, [0.1, 0.9], atol=1e-5)
    np.testing.assert_allclose(gmm.variances, [5e-4, 5e-4], rtol=1e-4)
    np.testing.assert_allclose(gmm.weights, [0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose(low_mean_posterior(x, gmm), [0.0, 1.0], atol=1e-6)


def test_huge_offset():
    rng = np.random.default_rng(10)
    noise = np.concatenate([rng.normal(0.0, 0.01, 300), rng.normal(0.05, 0.01, 200)])
    x = jnp.asarray(1e4 + noise, jnp.float32)
    x_norm = minmax_normalize(x)
    np.testing.assert_allclose([jnp.min(x_norm), jnp.max(x_norm)], [0.0, 1.0], atol=1e-6)
    for values in (x_norm, x):
        gmm = fit(values)
        post = gmm_posteriors(values, gmm)
        assert all(np.all(np.isfinite(leaf)) for leaf in (*gmm[:4], post))
        assert float(jnp.min(values)) <= gmm.means[0] < gmm.means[1] <= float(jnp.max(values))
        np.testing.assert_allclose(post.sum(axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("n_valid", [0, 1])
def test_almost_fully_masked_is_finite(n_valid):
    x = jnp.asarray(_bimodal(11, 16, 0.5), jnp.float32)
    where = jnp.arange(16) < n_valid
    gmm = fit(x, where=where)
    assert bool(gmm.degenerate)
    assert all(np.all(np.isfinite(leaf)) for leaf in gmm[:4])
    np.testing.assert_allclose(jnp.sum(gmm.weights), 1.0, atol=1e-6)


def test_minmax_normalize_matches_numpy_with_mask():
    rng = np.random.default_rng(12)
    x = rng.normal(3.0, 2.0, 101)
    valid = rng.random(101) < 0.6
    out = minmax_normalize(jnp.asarray(np.where(valid, x, np.inf), jnp.float32), where=valid)
    lo, hi = x[valid].min(), x[valid].max()
    np.testing.assert_allclose(np.asarray(out)[valid], (x[valid] - lo) / (hi - lo), atol=1e-6)


def test_jit_equals_no_jit():
    x = jnp.asarray(_loss_like(13, 777), jnp.float32)
    where = jnp.arange(777) % 7 != 0
    settings = dict(max_iter=20, tol=1e-4)
    eager = fit_gmm_1d(x, where=where, **settings)
    jitted = fit(x, where=where, **settings)
    for field in GaussianMixture1D._fields:
        np.testing.assert_allclose(getattr(jitted, field), getattr(eager, field), atol=1e-6)
    np.testing.assert_allclose(
        jax.jit(low_mean_posterior)(x, jitted), low_mean_posterior(x, eager), atol=1e-6
    )


def test_vmap_over_two_networks():
    # Two rows that need different numbers of iterations, with different masks.
    xs = jnp.asarray(
        np.stack([_bimodal(14, 600, 0.5), _bimodal(15, 600, 0.2, mu=(0.4, 0.6))]), jnp.float32
    )
    wheres = jnp.stack([jnp.ones(600, bool), jnp.arange(600) < 550])
    fit_30 = functools.partial(fit, max_iter=30, tol=1e-4)
    batched = jax.jit(jax.vmap(fit_30))(xs, where=wheres)
    post = jax.vmap(gmm_posteriors)(xs, batched)
    for i in range(2):
        single = fit_30(xs[i], where=wheres[i])
        for field in GaussianMixture1D._fields:
            np.testing.assert_allclose(
                getattr(batched, field)[i], getattr(single, field), atol=1e-6
            )
        np.testing.assert_allclose(post[i], gmm_posteriors(xs[i], single), atol=1e-6)
    assert int(batched.n_iter[0]) != int(batched.n_iter[1])


def test_sharded_over_8_devices_equals_single_device(devices):
    x = jnp.asarray(_bimodal(16, 4096, 0.4), jnp.float32)
    mesh = jax.make_mesh((8,), ("data",), devices=devices)
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    fit_20 = functools.partial(fit, max_iter=20, tol=1e-4)
    single, sharded = fit_20(x), fit_20(x_sharded)
    for field in GaussianMixture1D._fields:
        np.testing.assert_allclose(getattr(sharded, field), getattr(single, field), atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(reg_covar=0.0), dict(max_iter=-1), dict(tol=-1.0)])
def test_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        fit_gmm_1d(jnp.zeros(4), **kwargs)


def test_rejects_non_vector_input():
    with pytest.raises(ValueError):
        fit_gmm_1d(jnp.zeros((2, 3)))


def _normalised(x):
    return (x - x.min()) / (x.max() - x.min())


def _outlier(seed, n=2001):
    """Two close modes and one isolated low value (a pair the model finds absurd)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(0.6, 0.05, 1400), rng.normal(0.85, 0.05, n - 1401)])
    return _normalised(np.append(x, -1.0))


def _sparse_tail(seed, n=2001):
    """Overlapping modes above a sparse low tail."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(0.7, 0.08, 1100), rng.normal(0.55, 0.1, 800)])
    return _normalised(np.append(x, rng.uniform(-0.6, 0.3, n - x.size)))


BUFFERS = {
    "bimodal": lambda seed: _normalised(_bimodal(seed, 2001, 0.6, mu=(0.3, 0.7))),
    "skewed": lambda seed: _loss_like(seed, 2001),
    "outlier": _outlier,
    "sparse_tail": _sparse_tail,
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", sorted(BUFFERS))
def test_matches_sklearn_gaussian_mixture(kind, seed):
    """The official codes' call, ``GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4)``
    (float64), on four kinds of buffer.

    From the same start (sklearn given the parameters of the optimal 2-means partition):
    posteriors within 1e-4 (float32 round-off, 1e-6 typically), same parameters, iteration
    count and convergence flag. With sklearn's own start (best of four k-means++ runs,
    which may stop in a neighbouring partition): the same clusters, posteriors within
    1e-2. A min/max-started 2-means stopped after 10 Lloyd steps (the former start) makes
    the outlier a component of its own, every other value then "clean" (posteriors off by
    1.0), and differs by up to 0.1 on the others.
    """
    x = BUFFERS[kind](seed)
    gmm = fit(jnp.asarray(x, jnp.float32))
    got = np.asarray(gmm_posteriors(jnp.asarray(x, jnp.float32), gmm))
    assert not bool(gmm.degenerate)

    def sklearn_fit(**kwargs):
        sk = GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4, **kwargs).fit(x[:, None])
        order = np.argsort(sk.means_[:, 0])
        return sk, order, sk.predict_proba(x[:, None])[:, order]

    sk, order, expected = sklearn_fit(n_init=4, random_state=seed)
    np.testing.assert_array_equal(got[:, 1] > 0.5, expected[:, 1] > 0.5)
    np.testing.assert_allclose(got, expected, atol=1e-2, rtol=0)

    high = _best_two_means(x)
    parts = (~high, high)
    start = dict(
        weights_init=[np.mean(m) for m in parts],
        means_init=[[x[m].mean()] for m in parts],
        precisions_init=[[[1.0 / (x[m].var() + 5e-4)]] for m in parts],
    )
    sk, order, expected = sklearn_fit(**start)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(gmm.means, sk.means_[order, 0], atol=1e-5)
    np.testing.assert_allclose(gmm.weights, sk.weights_[order], atol=1e-5)
    np.testing.assert_allclose(gmm.variances, sk.covariances_[order, 0, 0], rtol=1e-4)
    assert int(gmm.n_iter) == sk.n_iter_ and bool(gmm.converged) == sk.converged_


def test_initial_partition_is_the_best_two_means():
    """Before any EM step (``max_iter=0``) the components are the optimal 2-means clusters,
    found by brute force over all thresholds; equal values are never split."""
    for kind in sorted(BUFFERS):
        x = BUFFERS[kind](3)[:400]
        x = np.round(x, 2)  # many ties
        high = _best_two_means(x)
        gmm = fit(jnp.asarray(x, jnp.float32), max_iter=0, reg_covar=1e-6)
        np.testing.assert_allclose(gmm.means, [x[~high].mean(), x[high].mean()], atol=1e-5)
        np.testing.assert_allclose(gmm.weights, [np.mean(~high), np.mean(high)], atol=1e-6)
