r"""Evidence, Dirichlet opinions and Dempster-Shafer fusion, in log space (UGNCL, DECL, TMC).

A batch of ``K`` image-caption pairs is read as a ``K``-way classification: each image
query "classifies" the captions and each caption query the images. A raw similarity ``R``
becomes non-negative *evidence* ``e = exp(l)`` with log-evidence ``l = softplus(R) / tau``
(UGNCL, ``'exp_softplus'``) or ``l = tanh(R) / tau`` (DECL, ``'exp_tanh'``). A query's
evidence vector parameterises a Dirichlet ``alpha = e + 1`` with strength
``Lambda = sum_k alpha_k``, and subjective logic reads it as belief masses
``b_k = e_k / Lambda`` and an uncertainty mass ``u = K / Lambda`` (``u + sum_k b_k = 1``).

With ``tau = 0.1`` the evidence overflows float32 from ``R ~ 8.9``, so every function here
takes the log-evidence ``l`` and never forms ``exp(l)`` where it could overflow:
``log alpha = softplus(l)``, ``log Lambda = logsumexp_k log alpha_k``, beliefs and
uncertainty are ``exp`` of differences. The Dirichlet KL term is evaluated from
``log alpha`` with the gamma-function terms regrouped so the parts that grow like
``alpha`` cancel analytically (and an asymptotic series for large arguments), so it is
exact in float32 for any evidence: raw similarities of any magnitude give finite values
and finite, bounded gradients without clipping (``max_log_evidence`` remains available).

Rows are queries and the last axis the ``K`` classes (candidates). ``where`` (bool
``[K]``) marks the real classes of a padded batch: padding classes carry no evidence and
do not count in ``K``.

Equations: UGNCL (Zha et al., SIGIR 2024), Secs. 3.2.1-3.2.3 (Eqs. 3-15), in log space
because the evidence of Eq. 3 overflows float32 once ``softplus(R) / tau > 88.7``; Sensoy et
al., "Evidential Deep Learning to Quantify Classification Uncertainty", NeurIPS 2018;
Han et al., "Trusted Multi-View Classification", ICLR 2021 (the combination rule).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy import special
from jax.typing import ArrayLike

from ncljax import masking

EVIDENCE_FNS = ("exp_softplus", "exp_tanh")
# Above this Dirichlet parameter the gamma-function terms of the KL use their asymptotic
# series (error below 1e-9 there); below it the exact functions, whose float32 rounding
# (relative 1e-7 of terms of size ~a log a) is then at most ~3e-5 absolute.
_ASYMPTOTIC_FROM = 100.0
_HALF_LOG_2PI_E = 0.5 * (1.0 + math.log(2.0 * math.pi))


class Opinion(NamedTuple):
    """A subjective-logic opinion per query.

    Attributes:
      belief: ``[..., K]`` belief masses ``b_k = e_k / Lambda`` (0 on padding classes).
      uncertainty: ``[...]`` uncertainty mass ``u = K / Lambda``; ``u + sum_k b_k = 1``.
      log_strength: ``[...]`` ``log Lambda``, the log Dirichlet strength.
    """

    belief: jax.Array
    uncertainty: jax.Array
    log_strength: jax.Array


def _float(x: ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    return x.astype(jnp.result_type(x, jnp.float32))


def _classes(num: int, where: ArrayLike | None) -> jax.Array:
    return masking.valid_rows(num, where, name="where (one flag per class)")


def _normaliser(log_a: jax.Array, valid: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """``(m, S)`` with ``Lambda = e^m S``: ``m`` the query's largest ``log alpha``, ``S`` the
    sum of ``alpha / e^m`` over the real classes (along ``axis``, kept as size 1). Ratios
    ``x / Lambda`` are then ``(x / e^m) / S``, exact for any ``Lambda`` (``exp(l - log
    Lambda)`` would inherit the rounding of a large ``log Lambda``)."""
    masked = jnp.where(valid, log_a, -jnp.inf)
    shift = jax.lax.stop_gradient(jnp.max(masked, axis=axis, keepdims=True))
    total = jnp.exp(masked - shift).sum(axis, keepdims=True)
    return shift, total


def _class_mask(num_dims: int, valid: jax.Array, axis: int) -> jax.Array:
    """The classes' mask ``[K]`` shaped to broadcast along ``axis`` of a ``num_dims`` array."""
    axis = axis % num_dims
    return valid.reshape((-1,) + (1,) * (num_dims - 1 - axis))


def log_evidence(
    raw: ArrayLike,
    *,
    temperature: float = 0.1,
    evidence_fn: str = "exp_softplus",
    max_log_evidence: float | None = None,
) -> jax.Array:
    r"""Log-evidence ``l = log e`` of raw similarity scores (UGNCL Eq. 3, DECL).

    .. math::

        l = \mathrm{softplus}(R) / \tau \;(\text{exp\_softplus}), \qquad
        l = \tanh(R) / \tau \;(\text{exp\_tanh})

    ``exp_softplus`` gives ``e >= 1`` (``softplus >= 0``: no pair can carry "no
    evidence"); ``exp_tanh`` is bounded in ``[e^{-1/tau}, e^{1/tau}]``.

    Args:
      raw: raw (unsquashed) similarities of any shape, e.g. ``[K, K]`` (rows images).
      temperature: :math:`\tau` (0.1 in UGNCL and DECL).
      evidence_fn: ``'exp_softplus'`` (UGNCL) or ``'exp_tanh'`` (DECL).
      max_log_evidence: clip ``l`` at this value (``None``: no clip). Every function of this
        module is finite without it; it bounds the evidence for reproducing a clipped
        implementation.

    Returns:
      ``l``, the shape of ``raw``.
    """
    raw = _float(raw)
    if evidence_fn == "exp_softplus":
        out = jax.nn.softplus(raw) / temperature
    elif evidence_fn == "exp_tanh":
        out = jnp.tanh(raw) / temperature
    else:
        raise ValueError(f"evidence_fn must be one of {EVIDENCE_FNS}, got {evidence_fn!r}")
    if max_log_evidence is not None:
        out = jnp.minimum(out, max_log_evidence)
    return out


def log_alpha(log_e: ArrayLike) -> jax.Array:
    """``log(alpha) = log(e + 1) = softplus(l)``: Dirichlet parameters from log-evidence."""
    return jax.nn.softplus(_float(log_e))


def directional_log_evidence(log_e: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """``(i2t, t2i)`` query views of an image-by-caption ``[K, K]`` log-evidence matrix.

    Row ``i`` of ``i2t`` is image ``i``'s evidence over the captions; row ``j`` of ``t2i``
    (the transpose) is caption ``j``'s evidence over the images (UGNCL, Sec. 3.2.1).
    """
    log_e = _float(log_e)
    if log_e.ndim != 2 or log_e.shape[0] != log_e.shape[1]:
        raise ValueError(f"log_e must be square [K, K] (images x captions), got {log_e.shape}")
    return log_e, log_e.T


def dirichlet_opinion(log_e: ArrayLike, *, where: ArrayLike | None = None) -> Opinion:
    r"""Belief and uncertainty masses of each query's Dirichlet (UGNCL Eqs. 5-6).

    .. math::

        \alpha_k = e_k + 1, \quad \Lambda = \sum_k \alpha_k, \quad
        b_k = \frac{e_k}{\Lambda}, \quad u = \frac{K}{\Lambda}

    Args:
      log_e: ``[..., K]`` log-evidence, classes on the last axis.
      where: optional bool ``[K]``, the real classes; ``K`` counts only them.

    Returns:
      An :class:`Opinion`.
    """
    log_e = _float(log_e)
    valid = _classes(log_e.shape[-1], where)
    num = valid.sum().astype(log_e.dtype)
    shift, total = _normaliser(log_alpha(log_e), valid)
    belief = jnp.where(valid, jnp.exp(log_e - shift) / total, 0.0)
    uncertainty = num * jnp.exp(-shift[..., 0]) / total[..., 0]
    return Opinion(belief, uncertainty, (shift + jnp.log(total))[..., 0])


def ds_combine(
    belief1: ArrayLike, uncertainty1: ArrayLike, belief2: ArrayLike, uncertainty2: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    r"""Dempster-Shafer combination of two opinions over the same ``K`` classes (UGNCL Eq. 7).

    .. math::

        C = \sum_{k \ne l} b^1_k b^2_l, \qquad
        b_k = \frac{b^1_k b^2_k + b^1_k u^2 + b^2_k u^1}{1 - C}, \qquad
        u = \frac{u^1 u^2}{1 - C}

    with the closed form ``C = (sum b1)(sum b2) - sum_k b1_k b2_k`` (``O(K)`` per query, not
    the ``K x K`` outer product of the released code). Commutative and associative.

    Args:
      belief1, belief2: ``[..., K]`` belief masses.
      uncertainty1, uncertainty2: ``[...]`` uncertainty masses.

    Returns:
      ``(belief [..., K], uncertainty [...])``, again with ``u + sum_k b_k = 1``.
    """
    b1, b2 = _float(belief1), _float(belief2)
    u1, u2 = _float(uncertainty1)[..., None], _float(uncertainty2)[..., None]
    # 1 - C without cancellation: (sum b1 + u1)(sum b2 + u2) = 1, so
    # 1 - C = u1 u2 + u1 sum b2 + u2 sum b1 + sum_k b1_k b2_k.
    sum1, sum2 = b1.sum(-1, keepdims=True), b2.sum(-1, keepdims=True)
    scale = 1.0 / (u1 * u2 + u1 * sum2 + u2 * sum1 + (b1 * b2).sum(-1, keepdims=True))
    belief = (b1 * b2 + b1 * u2 + b2 * u1) * scale
    uncertainty = (u1 * u2 * scale)[..., 0]
    return belief, uncertainty


def opinion_to_alpha(
    belief: ArrayLike, uncertainty: ArrayLike, num_classes: ArrayLike | None = None
) -> jax.Array:
    r"""Dirichlet parameters of an opinion: ``alpha_k = b_k K / u + 1`` (UGNCL Eq. 7).

    ``num_classes``: ``K``, the real classes of a padded opinion (default: the last axis).
    """
    belief, uncertainty = _float(belief), _float(uncertainty)
    num = belief.shape[-1] if num_classes is None else num_classes
    return belief * num / uncertainty[..., None] + 1.0


def _log_expm1(x: jax.Array) -> jax.Array:
    """``log(exp(x) - 1)`` for ``x >= 0``, exact for small and large ``x``."""
    return x + jnp.log(-jnp.expm1(-x))


def fuse_log_evidence(
    log_e_views: ArrayLike, num_classes: ArrayLike | None = None, *, axis: int = 0
) -> jax.Array:
    r"""Log-evidence of the Dempster-Shafer combination of ``W`` opinions (folded pairwise).

    For opinions over ``K`` classes, :func:`ds_combine` of two Dirichlets with evidence
    ``e^1``, ``e^2`` has evidence ``e = e^1 + e^2 + e^1 e^2 / K`` per class (the conflict
    cancels), i.e. ``1 + e / K = (1 + e^1 / K)(1 + e^2 / K)``. Folding ``W`` opinions:

    .. math::

        \log e = \log K + \log\Big(\exp\Big(\sum_w \mathrm{softplus}(l^w - \log K)\Big)
                 - 1\Big)

    elementwise, so one call fuses whole ``[W, K, K]`` evidence matrices in both directions.

    Args:
      log_e_views: log-evidences with the ``W`` views on ``axis``.
      num_classes: ``K`` (the real classes of a padded batch); default the last axis' size.
      axis: the views' axis.

    Returns:
      The fused log-evidence, without the views' axis.
    """
    log_e_views = _float(log_e_views)
    num = log_e_views.shape[-1] if num_classes is None else num_classes
    log_k = jnp.log(jnp.asarray(num, log_e_views.dtype))
    total = jax.nn.softplus(log_e_views - log_k).sum(axis)
    return log_k + _log_expm1(total)


def edl_squared_error(
    log_e: ArrayLike, target: ArrayLike, *, where: ArrayLike | None = None, axis: int = -1
) -> jax.Array:
    r"""Expected squared error under each query's Dirichlet (EDL; UGNCL Eq. 12).

    .. math::

        \mathcal L_{ls} = \sum_k \Big(y_k - \frac{\alpha_k}{\Lambda}\Big)^2
                         + \frac{\alpha_k (\Lambda - \alpha_k)}{\Lambda^2 (\Lambda + 1)}

    Args:
      log_e: ``[Q, K]`` log-evidence of each query over the classes.
      target: ``[Q, K]`` targets ``y`` in ``[0, 1]``.
      where: optional bool ``[K]``, the real classes.
      axis: the classes' axis (-1); ``axis=0`` reads each column of a ``[K, Q]`` matrix
        as a query, as ``log_e.T`` would without the transposed copy.

    Returns:
      ``[Q]`` per-query loss.
    """
    log_a = log_alpha(log_e)
    target = _float(target)
    valid = _class_mask(log_a.ndim, _classes(log_a.shape[axis], where), axis)
    shift, total = _normaliser(log_a, valid, axis)
    mean = jnp.exp(jnp.where(valid, log_a, -jnp.inf) - shift) / total
    inverse_strength_plus_one = jnp.exp(-shift) / (total + jnp.exp(-shift))
    terms = jnp.square(target - mean) + mean * (1.0 - mean) * inverse_strength_plus_one
    return jnp.where(valid, terms, 0.0).sum(axis)


def diagonal_edl_squared_error(
    log_e: ArrayLike, target: ArrayLike, *, where: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    r""":func:`edl_squared_error` of both query directions of a ``[K, K]`` matrix whose
    queries each target their own class: ``(rows, columns)``, each ``[K]``.

    Row ``i`` (image ``i`` over the captions) and column ``j`` (caption ``j`` over the
    images) target :math:`y_i` on their own class and 0 elsewhere, as UGNCL's pairs do
    (Eq. 12 with :math:`\mathbf y_i = \tilde y_i \mathbf e_i`). Then a query's loss needs
    only three numbers of its Dirichlet, its own class's ``alpha`` and the sums of the
    others' ``alpha`` and ``alpha^2``:

    .. math::

        \mathcal L_{ls} = (y - p)^2 + q + \frac{1 - p^2 - q}{\Lambda + 1}, \qquad
        p = \frac{\alpha_i}{\Lambda}, \quad q = \sum_{k \ne i} \frac{\alpha_k^2}{\Lambda^2}

    and its gradient in the log-evidence is one elementwise expression of each entry and
    its row's and column's numbers (a custom VJP): the same values as
    ``edl_squared_error(log_e, eye * y[:, None])`` and ``edl_squared_error(log_e, eye *
    y[None, :], axis=0)`` to float32 rounding, in a few passes over the matrix instead of
    the dozens that differentiating them makes (``benchmarks/vectors_step.py``).

    Args:
      log_e: ``[K, K]`` log-evidence, rows images, columns captions.
      target: ``[K]`` targets :math:`y` in ``[0, 1]`` (a constant: no gradient).
      where: optional bool ``[K]``, the real pairs (classes in both directions).

    Returns:
      ``(rows [K], columns [K])``; a padding query's value is finite and its gradient 0
      where the caller zeroes it.
    """
    log_e = _float(log_e)
    if log_e.ndim != 2 or log_e.shape[0] != log_e.shape[1]:
        raise ValueError(f"log_e must be square [K, K], got {log_e.shape}")
    valid = _classes(log_e.shape[-1], where)
    target = jax.lax.stop_gradient(_float(target).astype(log_e.dtype))
    return _diagonal_edl(log_e, target, valid)


class _DiagonalStats(NamedTuple):
    """One direction's numbers per query (:func:`diagonal_edl_squared_error`), with
    ``Lambda = e^shift total``."""

    shift: jax.Array  # the largest log alpha of the query's real classes
    total: jax.Array  # sum of alpha / e^shift over the real classes
    own: jax.Array  # p, the query's own class's share
    own_complement: jax.Array  # 1 - p, from the other classes' sum (no cancellation)
    others_square: jax.Array  # q
    inverse: jax.Array  # 1 / (Lambda + 1)
    loss: jax.Array


# Along the rows of a [K, K] matrix, a reduction of several operands is one pass fused with
# the elementwise work that produces them, where XLA's CPU backend rewrites a single large
# reduction into reduce-windows that read a materialised input (one more write and read of
# the matrix). Down the columns the fused loop is the slower (strided): there, the plain
# reductions (measured at K = 4096 on 2 cores: sum and sum of squares of an exp, rows 40
# against 51 ms, columns 53 against 49 ms; a masked max with the diagonal, rows 16 against
# 24 ms, columns 45 against 24 ms).


def _sum_and_squares(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """``(sum x, sum x^2)`` along ``axis`` of a ``[K, K]`` matrix."""
    if axis % 2 == 0:
        return x.sum(axis), jnp.square(x).sum(axis)
    zero = jnp.zeros((), x.dtype)
    return jax.lax.reduce(
        (x, x * x), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), (axis,)
    )


def _max_and_own(masked: jax.Array, x: jax.Array, eye: jax.Array, axis: int):
    """``(max masked, x on the diagonal)`` along ``axis`` of a ``[K, K]`` matrix."""
    if axis % 2 == 0:
        return masked.max(axis), jnp.diagonal(x)
    zero = jnp.zeros((), x.dtype)
    return jax.lax.reduce(
        (masked, jnp.where(eye, x, zero)),
        (jnp.array(-jnp.inf, x.dtype), zero),
        lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]),
        (axis,),
    )


def _eye(num: int) -> jax.Array:
    return jnp.arange(num)[:, None] == jnp.arange(num)[None, :]


def _diagonal_stats(log_e, target, valid, axis: int) -> _DiagonalStats:
    """The queries along ``1 - axis`` over the classes along ``axis``.

    ``alpha / e^m = exp(l - m) + exp(-m)``: one exponential per entry, no softplus."""
    classes = _class_mask(2, valid, axis)
    eye = _eye(log_e.shape[0])
    # log alpha = softplus(l) increases with l: the largest log alpha is that of the
    # largest l, one reduction of l instead of one of its softplus; the query's own l in
    # the same pass
    largest, own_l = _max_and_own(jnp.where(classes, log_e, -jnp.inf), log_e, eye, axis)
    shift = log_alpha(largest)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)  # no real class: any finite shift
    floor = jnp.exp(-shift)  # 1 / e^m, the "+ 1" of alpha = e + 1
    scaled = jnp.exp(log_e - jnp.expand_dims(shift, axis)) + jnp.expand_dims(floor, axis)
    others = jnp.where(classes & ~eye, scaled, 0.0)
    others_sum, others_sq = _sum_and_squares(others, axis)
    own_scaled = jnp.where(valid, jnp.exp(own_l - shift) + floor, 0.0)
    total = others_sum + own_scaled
    safe = jnp.where(total > 0, total, 1.0)
    own, own_complement = own_scaled / safe, others_sum / safe
    others_square = others_sq / jnp.square(safe)
    inverse = floor / (total + floor)
    # 1 - p^2 - q: (1 - p)(1 + p) - q, exact where p is near 1
    spread = own_complement * (1.0 + own) - others_square
    # y - p: from 1 - p where the target is near 1
    miss = jnp.where(target >= 0.5, (target - 1.0) + own_complement, target - own)
    loss = jnp.square(miss) + others_square + inverse * spread
    return _DiagonalStats(shift, safe, own, own_complement, others_square, inverse, loss)


def _diagonal_grad(log_e, target, valid, s: _DiagonalStats, axis: int) -> jax.Array:
    r"""The gradient of each query's loss in each entry's log-evidence ``l_k`` (the queries
    along ``1 - axis``): with :math:`P = p^2 + q`,

    .. math::

        \frac{\partial \mathcal L}{\partial l_k} = \frac{e_k}{\Lambda} \Big[2 y (p -
            [k = i]) + (1 - \tfrac{1}{\Lambda + 1}) \big(2 (p_k - P) -
            \tfrac{1 - P}{\Lambda + 1}\big)\Big]

    (:math:`\partial \log \alpha_k / \partial l_k = e_k / \alpha_k`), one exponential per
    entry."""
    classes = _class_mask(2, valid, axis)

    def per_query(x):
        return jnp.expand_dims(x, axis)

    floor = jnp.exp(-s.shift)
    evidence_share = jnp.where(
        classes, jnp.exp(log_e - per_query(s.shift)) / per_query(s.total), 0.0
    )  # e_k / Lambda
    share = evidence_share + jnp.where(classes, per_query(floor / s.total), 0.0)  # p_k
    spread = s.own_complement * (1.0 + s.own) - s.others_square
    keep = 1.0 - s.inverse
    strength = spread * s.inverse
    # the own class: p - 1 = -(1 - p) and p - P = p (1 - p) - q, exact near p = 1
    own = -2.0 * target * s.own_complement + keep * (
        2.0 * (s.own * s.own_complement - s.others_square) - strength
    )
    other = per_query(2.0 * target * s.own) + per_query(keep) * (
        2.0 * (share - per_query(s.own * s.own + s.others_square)) - per_query(strength)
    )
    return evidence_share * jnp.where(_eye(log_e.shape[0]), per_query(own), other)


def _diagonal_edl_fwd(log_e, target, valid):
    rows = _diagonal_stats(log_e, target, valid, axis=1)
    columns = _diagonal_stats(log_e, target, valid, axis=0)
    return (rows.loss, columns.loss), (log_e, target, valid, rows, columns)


@jax.custom_vjp
def _diagonal_edl(log_e, target, valid):
    return _diagonal_edl_fwd(log_e, target, valid)[0]


def _diagonal_edl_bwd(residuals, cotangents):
    log_e, target, valid, rows, columns = residuals
    row_ct, column_ct = cotangents
    grad = _diagonal_grad(log_e, target, valid, rows, axis=1) * row_ct[:, None]
    grad = grad + _diagonal_grad(log_e, target, valid, columns, axis=0) * column_ct[None, :]
    return grad, jnp.zeros_like(target), None


_diagonal_edl.defvjp(_diagonal_edl_fwd, _diagonal_edl_bwd)


def _r_of_log(log_a: jax.Array) -> jax.Array:
    """``r(a) = lgamma(a) - (a - 1) digamma(a) + a`` from ``log a`` (``a >= 1``), exact in float32.

    Asymptotically ``r(a) = log(a) / 2 + (1 + log 2 pi) / 2 - 1/(3a) - 1/(12a^2) - 1/(90a^3)
    + O(a^-4)`` (from Stirling's series of ``log Gamma`` and ``psi``).
    """
    large = log_a > math.log(_ASYMPTOTIC_FROM)
    a_small = jnp.exp(jnp.where(large, 0.0, log_a))  # both branches stay finite (jnp.where grads)
    exact = special.gammaln(a_small) - (a_small - 1.0) * special.digamma(a_small) + a_small
    inv = jnp.exp(-jnp.where(large, log_a, math.log(_ASYMPTOTIC_FROM)))
    series = 0.5 * log_a + _HALF_LOG_2PI_E - inv * (1.0 / 3.0 + inv * (1.0 / 12.0 + inv / 90.0))
    return jnp.where(large, series, exact)


def _digamma_of_log(log_a: jax.Array) -> jax.Array:
    """``digamma(a)`` from ``log a`` for any ``a >= 1`` (asymptotic series for large ``a``)."""
    large = log_a > math.log(_ASYMPTOTIC_FROM)
    exact = special.digamma(jnp.exp(jnp.where(large, 0.0, log_a)))
    inv = jnp.exp(-jnp.where(large, log_a, math.log(_ASYMPTOTIC_FROM)))
    series = log_a - inv * (0.5 + inv * (1.0 / 12.0 - inv * inv / 120.0))
    return jnp.where(large, series, exact)


def dirichlet_kl_uniform(
    log_alpha_: ArrayLike, *, where: ArrayLike | None = None, axis: int = -1
) -> jax.Array:
    r"""``KL[Dir(alpha) || Dir(1)]`` per query, from ``log alpha`` (UGNCL Eq. 13).

    .. math::

        \mathrm{KL} = \log\Gamma(\Lambda) - \log\Gamma(K) - \sum_k \log\Gamma(\alpha_k)
                      + \sum_k (\alpha_k - 1)\,[\psi(\alpha_k) - \psi(\Lambda)]

    evaluated as ``r(Lambda) + (K - 1) psi(Lambda) - sum_k r(alpha_k) - log Gamma(K)`` with
    ``r(a) = log Gamma(a) - (a - 1) psi(a) + a``: the terms that grow like ``a`` cancel
    analytically, so the value and its gradient are exact in float32 for any ``alpha``
    (an asymptotic series where ``a > 100``).

    Args:
      log_alpha_: ``[Q, K]`` log Dirichlet parameters (``alpha >= 1``, e.g. ``alpha-tilde``).
      where: optional bool ``[K]``, the real classes; ``K`` counts only them.
      axis: the classes' axis (-1; 0 for the columns of a ``[K, Q]`` matrix).

    Returns:
      ``[Q]`` per-query KL divergence (``>= 0``).
    """
    log_a = jnp.maximum(_float(log_alpha_), 0.0)
    classes = _classes(log_a.shape[axis], where)
    num = classes.sum().astype(log_a.dtype)
    valid = _class_mask(log_a.ndim, classes, axis)
    log_strength = jax.nn.logsumexp(jnp.where(valid, log_a, -jnp.inf), axis=axis)
    per_class = jnp.where(valid, _r_of_log(jnp.where(valid, log_a, 0.0)), 0.0).sum(axis)
    return (
        _r_of_log(log_strength)
        + (num - 1.0) * _digamma_of_log(log_strength)
        - per_class
        - special.gammaln(num)
    )


def log_mean_evidence(log_e_views: ArrayLike, *, axis: int = 0) -> jax.Array:
    r"""``log((1/W) sum_w e^w)``: UGNCL's retrieval score, the mean evidence of ``W`` views
    (the official code's ``evaluation.py``, ``validation``; the paper's Sec. 4.2 averages
    "the similarities calculated by diverse views"). Ranks like the mean evidence and never
    overflows."""
    log_e_views = _float(log_e_views)
    return jax.nn.logsumexp(log_e_views, axis=axis) - jnp.log(log_e_views.shape[axis])
