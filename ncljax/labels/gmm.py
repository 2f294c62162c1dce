"""Two-component 1-D Gaussian mixture fitted by EM, for per-epoch clean/noisy division.

Noisy-correspondence methods split the training set once per epoch by fitting a
two-component Gaussian mixture to one scalar per sample:

* NCR / PC2 co-dividing (and DivideMix before them): per-sample losses, min-max
  normalised; the *low-mean* component is clean, ``w = low_mean_posterior(...)``.
* GSC: intra-modal structure-consistency scores, min-max normalised; the
  *high-mean* component is clean, ``r = high_mean_posterior(...)``.

The reference implementations call ``sklearn.mixture.GaussianMixture(n_components=2,
max_iter=10, tol=1e-2, reg_covar=5e-4)`` on the host. This module is the same
estimator as a pure, jittable JAX function over ``[N]`` with an optional validity
mask, so padded, sharded or vmapped (two networks) buffers can be fitted in place.

Initialisation and stopping:

* The responsibilities start as the hard assignment of the *optimal* 2-means partition,
  then one M-step (sklearn's ``init_params='kmeans'`` does the same with its k-means
  result). In 1-D the optimal partition is a threshold of the sorted values, so it is
  found exactly: the between-cluster sum of squares of every split is read off prefix
  sums (``O(N log N)``, one sort), and the best split wins. This is deterministic (no
  seed) and cannot stop in a poor local optimum. A 2-means started from the minimum
  and maximum and stopped after a few Lloyd iterations can: one isolated low value
  becomes a one-point component and the GMM then calls every other value clean; and
  sklearn's k-means++ start is random (``random_state=None`` in the official code).
  Ties are never split: equal values share a cluster.
* The stopping rule is sklearn's: iteration ``n`` compares the mean log-likelihood at
  the parameters of iterations ``n - 1`` and ``n - 2`` (the first iteration never
  stops) and then runs its M-step, so the returned parameters, ``n_iter`` and
  ``converged`` are those of ``GaussianMixture(n_components=2, max_iter, tol,
  reg_covar)`` from the same start.
* Components are returned sorted by ascending mean, so index 0 is always the
  low-mean component.
* A *degenerate* buffer (fewer than two distinct valid values) has no two clusters;
  the fit is flagged (``degenerate``) and the callers keep their previous estimate.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

_LOG_2PI = math.log(2.0 * math.pi)


class GaussianMixture1D(NamedTuple):
    r"""A fitted two-component 1-D Gaussian mixture, components sorted by mean.

    Attributes:
      weights: ``[2]`` mixing proportions :math:`\pi_k`, summing to 1.
      means: ``[2]`` component means :math:`\mu_k`, ascending (index 0 = low mean).
      variances: ``[2]`` component variances :math:`\sigma_k^2`, ``reg_covar``
        included.
      log_likelihood: scalar, mean per-sample log-likelihood of the valid data at
        the returned parameters.
      n_iter: int32 scalar, number of EM iterations (M-steps after the
        initialisation) that were run.
      converged: bool scalar, whether the log-likelihood change fell below ``tol``
        before ``max_iter`` iterations ran out.
      degenerate: bool scalar, True when the valid values hold fewer than two distinct
        values (all equal, or fewer than two valid entries): the mixture is then not an
        estimate of anything, and a caller should keep its previous labels.
    """

    weights: jax.Array
    means: jax.Array
    variances: jax.Array
    log_likelihood: jax.Array
    n_iter: jax.Array
    converged: jax.Array
    degenerate: jax.Array


def _as_float(x: ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _valid_mask(x: jax.Array, where: ArrayLike | None) -> jax.Array:
    if where is None:
        return jnp.ones(x.shape, dtype=bool)
    return jnp.broadcast_to(jnp.asarray(where, dtype=bool), x.shape)


def minmax_normalize(
    x: ArrayLike, *, where: ArrayLike | None = None, eps: float = 1e-12
) -> jax.Array:
    r"""Min-max normalises ``x`` to ``[0, 1]`` over its valid entries.

    .. math::
      \bar x_n = \frac{x_n - \min_m x_m}{\max_m x_m - \min_m x_m}

    with min and max taken over the entries where ``where`` is True. If the range
    is not above ``eps`` (all valid values equal, or no valid value) the result is
    all zeros instead of NaN. Entries outside ``where`` are transformed with the
    same affine map, so they may fall outside ``[0, 1]``.

    Args:
      x: ``[N]`` values (per-sample losses or scores).
      where: optional bool ``[N]``; False entries are ignored by min and max.
      eps: smallest range treated as non-degenerate.

    Returns:
      ``[N]`` normalised values, dtype of ``x`` promoted to at least float32.

    References:
      GSC (Zhao et al., CVPR 2024), Sec. 3.3 before Eq. 4; PC2 (Duan et al., ACM MM
      2024), Appendix B (co-dividing) and the NCR code it inherits.
    """
    x = _as_float(x)
    mask = _valid_mask(x, where)
    lo = jnp.min(x, where=mask, initial=jnp.inf)
    hi = jnp.max(x, where=mask, initial=-jnp.inf)
    span = hi - lo
    ok = span > eps
    return jnp.where(ok, (x - lo) / jnp.where(ok, span, 1.0), jnp.zeros_like(x))


def _log_joint(x: jax.Array, weights, means, variances) -> jax.Array:
    """``[..., 2]`` log pi_k + log N(x | mu_k, sigma_k^2)."""
    x = x[..., None]
    return jnp.log(weights) - 0.5 * (_LOG_2PI + jnp.log(variances) + (x - means) ** 2 / variances)


def _e_step(x: jax.Array, mask: jax.Array, params, n_valid: jax.Array):
    """Masked responsibilities ``[N, 2]`` and mean log-likelihood at ``params``."""
    log_joint = _log_joint(x, *params)
    log_norm = jax.nn.logsumexp(log_joint, axis=-1)
    resp = jnp.exp(log_joint - log_norm[:, None]) * mask[:, None]
    mean_ll = jnp.sum(jnp.where(mask, log_norm, 0.0)) / n_valid
    return resp, mean_ll


def _m_step(x: jax.Array, resp: jax.Array, reg_covar: float):
    """Weights, means and variances from responsibilities (zero rows = excluded)."""
    # Same floor as sklearn: an empty component gets mean 0 and variance reg_covar
    # instead of 0/0.
    nk = jnp.sum(resp, axis=0) + 10.0 * jnp.finfo(x.dtype).eps
    means = jnp.sum(resp * x[:, None], axis=0) / nk
    variances = jnp.sum(resp * (x[:, None] - means) ** 2, axis=0) / nk + reg_covar
    weights = nk / jnp.sum(nk)
    return weights, means, variances


def _two_means_high(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The optimal 1-D 2-means partition of the valid entries.

    Sorted valid values ``v_1 <= ... <= v_n``; splitting after ``t`` of them leaves a
    within-cluster sum of squares ``sum (v - m)^2 - B(t)`` with the between-cluster term
    ``B(t) = S_t^2 n / (t (n - t))``, ``S_t`` the prefix sum of the centred values. The
    best split maximises ``B`` over the ``t`` where ``v_t < v_{t+1}`` (ties stay
    together). Returns ``(high [N] bool, degenerate bool)``; a degenerate buffer (no
    such split) puts everything in the low cluster.
    """
    n = jnp.sum(mask)
    big = jnp.finfo(x.dtype).max
    values = jnp.where(mask, x, big)
    sharding = jax.typeof(values).sharding
    if any(axis is not None for axis in sharding.spec):
        # An explicitly sharded buffer is sorted whole (N scalars, gathered once).
        values = jax.sharding.reshard(values, sharding.update(spec=P()))
    values = jnp.sort(values)  # valid values first, ascending
    valid = jnp.arange(x.shape[0]) < n
    nf = jnp.maximum(n, 1).astype(x.dtype)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / nf
    prefix = jnp.cumsum(jnp.where(valid, values - mean, 0.0))  # S_t at index t - 1
    t = jnp.arange(1, x.shape[0] + 1, dtype=x.dtype)
    nxt = jnp.concatenate([values[1:], values[-1:]])
    splittable = (t < nf) & valid & (values < nxt)
    between = jnp.where(splittable, prefix**2 * nf / (t * jnp.maximum(nf - t, 1.0)), -1.0)
    best = jnp.argmax(between)
    degenerate = ~jnp.any(splittable)
    threshold = jnp.where(degenerate, big, values[best])
    return mask & (x > threshold), degenerate


def fit_gmm_1d(
    x: ArrayLike,
    *,
    where: ArrayLike | None = None,
    max_iter: int = 10,
    tol: float = 1e-2,
    reg_covar: float = 5e-4,
) -> GaussianMixture1D:
    r"""Fits a two-component 1-D Gaussian mixture by EM.

    .. math::
      p(x) = \sum_{k=1}^{2} \pi_k\,\mathcal N(x \mid \mu_k, \sigma_k^2)

    Initialisation: the hard assignment of the optimal (exact) 1-D 2-means partition as
    responsibilities, then one M-step. Each EM iteration is

    .. math::
      \gamma_{nk} = \frac{\pi_k\mathcal N(x_n\mid\mu_k,\sigma_k^2)}
                         {\sum_{k'}\pi_{k'}\mathcal N(x_n\mid\mu_{k'},\sigma_{k'}^2)},
      \quad N_k = \sum_n \gamma_{nk},\quad \pi_k = \frac{N_k}{N},\quad
      \mu_k = \frac{\sum_n \gamma_{nk} x_n}{N_k},\quad
      \sigma_k^2 = \frac{\sum_n \gamma_{nk}(x_n-\mu_k)^2}{N_k} + \epsilon_{reg},

    with the E-step in log space (``logsumexp``) and :math:`N_k` floored at
    ``10 * finfo.eps`` (as sklearn) so an empty component stays finite (it gets mean
    0 and variance ``reg_covar``); :math:`\pi_k` is computed as
    :math:`N_k / \sum_{k'} N_{k'}`, equal to :math:`N_k/N` up to that floor. After each
    E-step the mean log-likelihood
    :math:`\mathcal L = \frac1N\sum_n \log\sum_k \pi_k\mathcal N(x_n\mid\mu_k,\sigma_k^2)`
    at the current parameters is compared with its value one iteration earlier; EM runs
    that iteration's M-step and stops when :math:`|\Delta\mathcal L| <` ``tol``, or after
    ``max_iter`` iterations (sklearn's ``GaussianMixture`` rule; see the module
    docstring).

    Entries where ``where`` is False are excluded from every statistic (2-means
    partition, :math:`N_k`, :math:`N`, :math:`\mathcal L`); their values may be
    anything, NaN included.

    Args:
      x: ``[N]`` values, usually min-max normalised losses or scores.
      where: optional bool ``[N]``; False marks padding to ignore.
      max_iter: static, maximum number of EM iterations (>= 0).
      tol: static, convergence threshold on the change of the mean log-likelihood.
      reg_covar: static, positive value added to every variance.

    Returns:
      A :class:`GaussianMixture1D` whose components are sorted by ascending mean.

    References:
      Arazo et al., "Unsupervised Label Noise Modeling and Loss Correction", ICML
      2019 (mixture on per-sample losses); Li et al., "DivideMix", ICLR 2020, and
      Huang et al., "NCR", NeurIPS 2021 (two-component loss GMM, low mean = clean);
      Zhao et al., "GSC", CVPR 2024, Eq. 4 (high mean = clean); Duan et al., "PC2",
      ACM MM 2024, Appendix B (co-dividing).
    """
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0, got {max_iter}")
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if not reg_covar > 0:
        raise ValueError(f"reg_covar must be > 0 (it keeps variances positive), got {reg_covar}")

    x = _as_float(x)
    if x.ndim != 1:
        raise ValueError(f"x must have shape [N], got {x.shape}")
    mask = _valid_mask(x, where)
    x = jnp.where(mask, x, jnp.zeros_like(x))  # padding may hold NaN or inf
    n_valid = jnp.maximum(jnp.sum(mask), 1).astype(x.dtype)

    high, degenerate = _two_means_high(x, mask)
    hard = jnp.stack([~high, high], axis=-1).astype(x.dtype) * mask[:, None]
    params = _m_step(x, hard, reg_covar)
    resp, mean_ll = _e_step(x, mask, params, n_valid)

    def cond(state):
        *_, n, converged = state
        return (n < max_iter) & ~converged

    def body(state):
        # Iteration n + 1 as sklearn: test the change between the log-likelihoods of the
        # last two parameter sets, then take the M-step either way.
        _, resp, mean_ll, previous_ll, n, _ = state
        converged = jnp.abs(mean_ll - previous_ll) < tol
        new_params = _m_step(x, resp, reg_covar)
        new_resp, new_ll = _e_step(x, mask, new_params, n_valid)
        return new_params, new_resp, new_ll, mean_ll, n + 1, converged

    init = (params, resp, mean_ll, jnp.asarray(-jnp.inf, x.dtype), jnp.int32(0), jnp.bool_(False))
    params, _, mean_ll, _, n_iter, converged = lax.while_loop(cond, body, init)

    weights, means, variances = params
    order = jnp.argsort(means, stable=True)
    return GaussianMixture1D(
        weights=weights[order],
        means=means[order],
        variances=variances[order],
        log_likelihood=mean_ll,
        n_iter=n_iter,
        converged=converged,
        degenerate=degenerate,
    )


def gmm_posteriors(x: ArrayLike, gmm: GaussianMixture1D) -> jax.Array:
    r"""Component responsibilities of ``x`` under a fitted mixture.

    .. math::
      \gamma_{nk} = \frac{\pi_k\mathcal N(x_n\mid\mu_k,\sigma_k^2)}
                         {\sum_{k'}\pi_{k'}\mathcal N(x_n\mid\mu_{k'},\sigma_{k'}^2)}

    computed as a softmax over log densities.

    Args:
      x: ``[N]`` values (same normalisation as the fit).
      gmm: a :class:`GaussianMixture1D` from :func:`fit_gmm_1d`.

    Returns:
      ``[N, 2]`` responsibilities; column 0 is the low-mean component, column 1 the
      high-mean one. Rows sum to 1.

    References:
      PC2 (Duan et al., ACM MM 2024), Appendix B (the posterior of each pair as its
      clean probability); GSC (Zhao et al., CVPR 2024), Eq. 4.
    """
    x = _as_float(x)
    return jax.nn.softmax(_log_joint(x, gmm.weights, gmm.means, gmm.variances), axis=-1)


def low_mean_posterior(x: ArrayLike, gmm: GaussianMixture1D) -> jax.Array:
    r"""``[N]`` posterior of the low-mean component: the clean probability over losses.

    Used by NCR-style co-dividing (PC2, Appendix B: :math:`w_i` from the lower-mean
    component) and by PC2's oscillation GMM (PC2, Sec. 4.4, after Eq. 7).
    """
    return gmm_posteriors(x, gmm)[..., 0]


def high_mean_posterior(x: ArrayLike, gmm: GaussianMixture1D) -> jax.Array:
    """``[N]`` posterior of the high-mean component: the clean probability over scores.

    Used by GSC (Eq. 4) on min-max normalised intra-modal consistency scores.
    """
    return gmm_posteriors(x, gmm)[..., 1]


class DivisionCheck(NamedTuple):
    r"""Whether a GMM division of the training pairs is usable, and why not.

    Attributes:
      degenerate: bool scalar, True when any of the flags below is: the caller falls back
        (keeps its previous division) instead of training on this one.
      one_set: bool scalar, every valid posterior lies on one side of the threshold (all
        clean, or no clean pair at all).
      inseparable: bool scalar, the mixture separates nothing: fewer than two distinct
        values (``GaussianMixture1D.degenerate``), a component of weight below
        ``min_weight``, or component means closer than ``min_separation`` standard
        deviations of the data.
      separation: float scalar, :math:`|\mu_1 - \mu_0| / \mathrm{sd}(x)` (0 when the data
        has no spread).
      lighter_weight: float scalar, :math:`\min_k \pi_k`.
    """

    degenerate: jax.Array
    one_set: jax.Array
    inseparable: jax.Array
    separation: jax.Array
    lighter_weight: jax.Array


def check_division(
    x: ArrayLike,
    prob: ArrayLike,
    gmm: GaussianMixture1D,
    *,
    threshold: float = 0.5,
    where: ArrayLike | None = None,
    min_weight: float = 0.01,
    min_separation: float = 0.1,
) -> DivisionCheck:
    r"""Flags a degenerate clean/noisy division by a fitted two-component mixture.

    A division is degenerate when it puts every valid pair in one set,

    .. math:: \min_n w_n > \tau \quad\text{or}\quad \max_n w_n \le \tau,

    or when the mixture it comes from separates nothing:

    .. math::
      \text{fewer than two distinct values},\quad \min_k \pi_k < \pi_{\min},\quad
      \text{or}\quad |\mu_1 - \mu_0| < \delta_{\min}\,\mathrm{sd}(x),

    with :math:`\mathrm{sd}(x)` the standard deviation of the valid values the mixture
    was fitted on. Both tests are scale-free: an increasing affine map of ``x`` and the
    same map of the mixture leave them unchanged (the callers fit min-max normalised
    values, so the fit is scale-free too), and one setting serves losses and scores of
    any backbone. :math:`\pi_{\min} = 0.01` is the share NCR's split already keeps noisy
    (``ncljax.labels.split_clean``); :math:`\delta_{\min} = 0.1`: two components whose
    means lie within a tenth of the data's spread describe one cluster.

    Args:
      x: ``[N]`` the values the mixture was fitted on (e.g. min-max normalised losses).
      prob: ``[N]`` the clean posterior of each value (the low- or high-mean component's).
      gmm: the fitted :class:`GaussianMixture1D`.
      threshold: :math:`\tau`, the clean split of ``prob`` (0.5).
      where: optional bool ``[N]``; False entries are ignored.
      min_weight: :math:`\pi_{\min}` in ``[0, 0.5)``.
      min_separation: :math:`\delta_{\min} \ge 0`.

    Returns:
      A :class:`DivisionCheck`.
    """
    if not 0.0 <= min_weight < 0.5:
        raise ValueError(f"min_weight must be in [0, 0.5), got {min_weight}")
    if min_separation < 0:
        raise ValueError(f"min_separation must be >= 0, got {min_separation}")
    x = _as_float(x)
    prob = jnp.asarray(prob)
    mask = _valid_mask(x, where)
    x = jnp.where(mask, x, 0.0)
    count = jnp.maximum(jnp.sum(mask), 1).astype(x.dtype)
    mean = jnp.sum(x) / count
    sd = jnp.sqrt(jnp.sum(jnp.where(mask, (x - mean) ** 2, 0.0)) / count)
    gap = jnp.abs(gmm.means[1] - gmm.means[0])
    spread = (sd > 0) & ~gmm.degenerate  # one distinct value: no spread, whatever fp says
    separation = jnp.where(spread, gap / jnp.where(spread, sd, 1.0), 0.0)
    inseparable = gmm.degenerate | (jnp.min(gmm.weights) < min_weight) | (gap < min_separation * sd)
    above = prob > threshold
    one_set = jnp.all(above | ~mask) | ~jnp.any(above & mask)
    return DivisionCheck(
        degenerate=one_set | inseparable,
        one_set=one_set,
        inseparable=inseparable,
        separation=separation,
        lighter_weight=jnp.min(gmm.weights),
    )


def fit_diagnostics(gmm: GaussianMixture1D, check: DivisionCheck, fallback: bool) -> dict:
    """The logged facts of a division's fit: EM iterations, convergence, degeneracy, the
    components' separation and whether the division fell back (``division_fallback``,
    0 or 1)."""
    return {
        "gmm_iterations": gmm.n_iter,
        "gmm_converged": gmm.converged,
        "gmm_degenerate": gmm.degenerate,
        "gmm_separation": check.separation,
        "division_fallback": jnp.float32(fallback),
    }
