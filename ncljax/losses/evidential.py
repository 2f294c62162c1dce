r"""Evidential and trusted-robust objectives (UGNCL; the EDL loss of DECL and TMC).

* :func:`edl_loss`: the evidential loss of each query, the Dirichlet's expected squared
  error plus the weighted KL to the uniform Dirichlet of its non-target evidence (Eqs.
  12-14), from log-evidence (``ncljax.evidence``);
* :func:`top_k_mean`: the mean of each row's ``k`` largest entries, ``k`` traced (no
  recompilation as the count anneals);
* :func:`trusted_robust_loss` (Eq. 16, per pair, the intended orientation) and
  :func:`trl_warmup_loss`;
* :func:`ugncl_loss`: the overall objective of a batch over ``W`` views (Eq. 18), training
  and warm-up.

Per-pair values ``[K]``; padding pairs get 0.

Equations: UGNCL (Zha et al., SIGIR 2024), Sec. 3.2.3 (Eqs. 12-15) and Sec. 3.3
(Eqs. 16-18), and the official code (``qxzha/UGNCL``, ``model/UGNCL.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import evidence
from ncljax.losses.contrastive import symmetric_info_nce
from ncljax.losses.ranking import hinge_costs

_SG = jax.lax.stop_gradient
# The codes of UGNCL's four sets (Eqs. 8-11), which ``ncljax.labels.ugncl`` divides the
# pairs into and :func:`trusted_robust_loss` reads.
CLEAN, NOISY, HARD_CLEAN, HARD_NOISY = 0, 1, 2, 3
EDL_VIEW_AGGREGATIONS = ("per_view_mean", "dst")
RANKINGS = ("trusted", "contrastive")


def edl_loss(
    log_e: ArrayLike,
    target: ArrayLike,
    *,
    kl_weight: float = 0.1,
    where: ArrayLike | None = None,
    axis: int = -1,
) -> jax.Array:
    r"""Evidential loss of each query (UGNCL Eq. 14; Sensoy et al. 2018).

    .. math::

        \mathcal L_{edl} = \mathcal L_{ls}(\alpha, y)
            + \xi_1 \mathrm{KL}[\mathrm{Dir}(\tilde\alpha) \| \mathrm{Dir}(1)], \qquad
        \tilde\alpha = y + (1 - y) \odot \alpha

    Args:
      log_e: ``[Q, K]`` log-evidence of each query over the ``K`` classes.
      target: ``[Q, K]`` targets ``y`` in ``[0, 1]`` (a constant).
      kl_weight: :math:`\xi_1` (0.1, constant); a Python 0 skips the KL term.
      where: optional bool ``[K]``, the real classes.
      axis: the classes' axis (-1); 0 reads the columns of ``[K, Q]`` inputs as the
        queries, as their transposes would without the copy.

    Returns:
      ``[Q]``.
    """
    log_e = jnp.asarray(log_e)
    target = _SG(jnp.asarray(target, log_e.dtype))
    squared = evidence.edl_squared_error(log_e, target, where=where, axis=axis)
    if isinstance(kl_weight, int | float) and kl_weight == 0:
        # No KL term: its log-gamma and digamma over every [Q, K] entry (and their
        # gradients) are the step's dearest work, and 0 times it is 0 where it is finite.
        return squared
    log_a = evidence.log_alpha(log_e)
    # log(y + (1 - y) alpha), exact at y = 0 and y = 1.
    log_a_tilde = jnp.logaddexp(jnp.log(target), jnp.log1p(-target) + log_a)
    kl = evidence.dirichlet_kl_uniform(log_a_tilde, where=where, axis=axis)
    return squared + kl_weight * kl


def top_k_mean(
    costs: ArrayLike, k: ArrayLike, *, max_k: int | None = None, min_k: int | None = None
) -> jax.Array:
    r"""Mean of the ``k`` largest entries of each row: :math:`\frac1k \mathrm{Top}_k(c_{i,:})`.

    ``k`` may be traced (a mask over the sorted row): changing it does not recompile.
    With ``max_k`` (static; ``k <= max_k``) only the ``max_k`` largest entries are
    selected (``lax.top_k``) instead of sorting whole rows: the same value, and at a
    ``4096 x 4096`` cost matrix with its gradient 0.15 s instead of 2.6 s on 2 CPU cores.
    With ``min_k`` too (static, below ``max_k``), a ``k`` at or below it selects only
    ``min_k`` entries (``lax.cond``: one branch runs): UGNCL's count anneals to its floor
    within the first epochs and stays there.
    """
    costs = jnp.asarray(costs)
    k = jnp.asarray(k, jnp.int32)

    def mean_of_top(bound):
        if bound is None:
            ordered = -jnp.sort(-costs, axis=-1)
        else:
            ordered, _ = jax.lax.top_k(costs, min(bound, costs.shape[-1]))
        keep = jnp.arange(ordered.shape[-1]) < k
        return jnp.where(keep, ordered, 0.0).sum(-1) / jnp.maximum(k, 1).astype(costs.dtype)

    if max_k is None or min_k is None or min_k >= min(max_k, costs.shape[-1]):
        return mean_of_top(max_k)
    return jax.lax.cond(k <= min_k, lambda: mean_of_top(min_k), lambda: mean_of_top(max_k))


def trusted_robust_loss(
    sim: ArrayLike,
    codes: ArrayLike,
    margins: ArrayLike,
    num_negatives: ArrayLike,
    *,
    where: ArrayLike | None = None,
    max_negatives: int | None = None,
    min_negatives: int | None = None,
) -> jax.Array:
    r"""Trusted robust loss of each pair (UGNCL Eq. 16 with the determined sets; Sec. 3.3).

    .. math::

        \ell_i = \begin{cases}
            \max_j a_{ij} + \max_j c_{ij} & i \in S_C \;(g_i = \gamma) \\
            \frac1\lambda \big(\mathrm{Top}_\lambda(a_{i,:}) + \mathrm{Top}_\lambda(c_{i,:})\big)
                & i \in S_H \;(g_i = \tilde\gamma_i) \\
            0 & i \in S_N
        \end{cases}

    with :math:`a_{ij} = [g_i - S_{ii} + S_{ij}]_+` (image ``i`` against caption ``j``) and
    :math:`c_{ij} = [g_i - S_{ii} + S_{ji}]_+` (caption ``i`` against image ``j``), both using
    the pair's own margin and ``a_ii = c_ii = 0``. This is the intended orientation; the
    released code takes the caption queries' maxima over the clean images' rows and the
    hard captions' top-``lambda`` along image rows (``model/UGNCL.py``, ``train_batch``).

    Args:
      sim: ``[K, K]`` similarities (``tanh`` of the raw scores), rows images.
      codes: ``[K]`` partition codes (``ncljax.labels.ugd_partition``).
      margins: ``[K]`` per-pair margins (``trusted_margins``: ``gamma`` on ``S_C``).
      num_negatives: :math:`\lambda` (traced int).
      where: optional bool ``[K]``, the real pairs.
      max_negatives: a static bound on ``num_negatives`` (:func:`top_k_mean`'s ``max_k``).
      min_negatives: the schedule's static floor (:func:`top_k_mean`'s ``min_k``).

    Returns:
      ``[K]`` per-pair loss (summed over the batch in Eq. 18).
    """
    codes = jnp.asarray(codes)
    cost_i2t, cost_t2i = hinge_costs(sim, _SG(jnp.asarray(margins)), where=where)
    hardest = cost_i2t.max(-1) + cost_t2i.max(-1)
    bounds = dict(max_k=max_negatives, min_k=min_negatives)
    top = top_k_mean(cost_i2t, num_negatives, **bounds) + top_k_mean(
        cost_t2i, num_negatives, **bounds
    )
    hard = (codes == HARD_CLEAN) | (codes == HARD_NOISY)
    return jnp.where(codes == CLEAN, hardest, jnp.where(hard, top, 0.0))


def trl_warmup_loss(
    sim: ArrayLike,
    num_negatives: ArrayLike,
    *,
    margin: float = 0.2,
    where: ArrayLike | None = None,
    max_negatives: int | None = None,
    min_negatives: int | None = None,
) -> jax.Array:
    r"""Warm-up trusted robust loss: every pair's top-``lambda`` mean with the constant margin.

    .. math::

        \ell_i = \frac1\lambda \big(\mathrm{Top}_\lambda(a_{i,:})
                 + \mathrm{Top}_\lambda(c_{i,:})\big)
    """
    cost_i2t, cost_t2i = hinge_costs(sim, margin, where=where)
    bounds = dict(max_k=max_negatives, min_k=min_negatives)
    return top_k_mean(cost_i2t, num_negatives, **bounds) + top_k_mean(
        cost_t2i, num_negatives, **bounds
    )


def trusted_contrastive_loss(
    sim: ArrayLike,
    codes: ArrayLike | None,
    margins: ArrayLike | None,
    *,
    margin: float = 0.2,
    temperature: float = 0.07,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""The trusted robust loss in contrastive form: each pair's symmetric InfoNCE weighted
    by how far the division trusts it (ncljax's; not in the paper).

    .. math::

        \ell_i = t_i \, \tfrac12\big[-\log \operatorname{softmax}_j(S_{ij}/\tau)_i
            - \log \operatorname{softmax}_j(S_{ji}/\tau)_i\big], \qquad
        t_i = \begin{cases} 1 & i \in S_C \\ \min(\tilde\gamma_i / \gamma, 1)
            & i \in S_H \\ 0 & i \in S_N \end{cases}

    The trusted margin :math:`\tilde\gamma_i \in [0, \gamma]` of Eq. 17 becomes a weight,
    as NCR's contrastive ranking weights its rectified labels (``ncljax.methods.ncr``): a
    pair is pulled to its partner against every in-batch negative in proportion to the
    trust the division gives it, instead of against its hardest negative (``S_C``) or its
    top-``lambda`` (``S_H``). ``codes=None``: the warm-up, every weight 1.

    Args:
      sim: ``[K, K]`` similarities (rows images).
      codes: ``[K]`` partition codes, or ``None`` (every pair weight 1).
      margins: ``[K]`` trusted margins (``trusted_margins``; read on ``S_H``).
      margin: :math:`\gamma`, the margins' scale.
      temperature: :math:`\tau`.
      where: optional bool ``[K]``, the real pairs.

    Returns:
      ``[K]``; 0 on padding.
    """
    sim = jnp.asarray(sim)
    valid = jnp.ones(sim.shape[-1], bool) if where is None else jnp.asarray(where, bool)
    per_pair = symmetric_info_nce(sim, temperature=temperature, where=valid)
    if codes is None:
        weight = jnp.ones_like(per_pair)
    else:
        codes = jnp.asarray(codes)
        trusted = jnp.clip(_SG(jnp.asarray(margins, sim.dtype)) / margin, 0.0, 1.0)
        hard = (codes == HARD_CLEAN) | (codes == HARD_NOISY)
        weight = jnp.where(codes == CLEAN, 1.0, jnp.where(hard, trusted, 0.0))
    return jnp.where(valid, weight * per_pair, 0.0)


class UGNCLTerms(NamedTuple):
    """The parts of :func:`ugncl_loss` per pair ``[K]``: ``evidential`` (both directions,
    aggregated over views) and ``robust`` (the trusted robust loss summed over views)."""

    evidential: jax.Array
    robust: jax.Array


def as_views(views, name: str = "views") -> tuple[jax.Array, ...]:
    """``W`` square ``[K, K]`` matrices from a ``[W, K, K]`` array or a sequence of them.

    A method that computes each view's matrix apart passes the sequence: stacking them
    would copy every ``[K, K]`` matrix, and its gradient again. A stacked array is split
    (the split's gradient is the concatenation, which XLA forwards)."""
    if isinstance(views, tuple | list):
        views = tuple(jnp.asarray(v) for v in views)
        if not views:
            raise ValueError(f"{name} must hold at least one [K, K] view")
    else:
        views = jnp.asarray(views)
        if views.ndim != 3:
            raise ValueError(f"{name} must be [W, K, K], got {views.shape}")
        views = tuple(v[0] for v in jnp.split(views, views.shape[0]))
    shape = views[0].shape
    if len(shape) != 2 or shape[0] != shape[1] or any(v.shape != shape for v in views):
        raise ValueError(
            f"{name} must be [W, K, K] (square, equal views), got {[v.shape for v in views]}"
        )
    return views


def _per_view(fn, views: tuple[jax.Array, ...]) -> jax.Array:
    """``fn`` of each view, stacked ``[W, ...]`` (a loop over the few views)."""
    return jnp.stack([fn(view) for view in views])


def ugncl_loss(
    log_e_views: ArrayLike,
    sim_views: ArrayLike,
    *,
    labels: ArrayLike | None = None,
    codes: ArrayLike | None = None,
    margins: ArrayLike | None = None,
    num_negatives: ArrayLike,
    warmup: bool = False,
    margin: float = 0.2,
    kl_weight: float = 0.1,
    robust_weight: float = 0.8,
    edl_view_aggregation: str = "per_view_mean",
    ranking: str = "trusted",
    temperature: float = 0.07,
    where: ArrayLike | None = None,
    max_negatives: int | None = None,
    min_negatives: int | None = None,
) -> tuple[jax.Array, UGNCLTerms]:
    r"""UGNCL's overall objective of a batch (Eq. 18) as per-pair shares.

    Training: :math:`\mathcal L = \mathcal L_e + \xi_2 \sum_w \sum_i \ell^w_i` with the
    evidential part averaged over the batch and (``'per_view_mean'``, the code) over views,
    :math:`\mathcal L_e = \frac1W \sum_w \frac1K \sum_i [\mathcal L_{edl}(\alpha^{w,i2t}_i,
    \mathbf y_i) + \mathcal L_{edl}(\alpha^{w,t2i}_i, \mathbf y_i)]`, or (``'dst'``, the
    paper) on the Dempster-Shafer fusion of the views' opinions per direction. The target
    of query ``i`` is :math:`\tilde y_i` on class ``i`` and 0 elsewhere.
    Warm-up (the code): every label 1, the evidential part *summed* over views, and the
    top-``lambda`` loss on every pair with the constant margin.

    The returned shares are :math:`\mathcal L^{e}_i + \xi_2 K \sum_w \ell^w_i`: their mean
    over the ``K`` real pairs (the trainer's ``'mean'`` reduction) is :math:`\mathcal L`.

    Args:
      log_e_views: ``[W, K, K]`` log-evidence (rows images), or a sequence of ``W``
        ``[K, K]`` (:func:`as_views`).
      sim_views: the similarities of the ranking loss (``tanh`` of the raw scores), in
        the same form.
      labels: ``[K]`` :math:`\tilde y` (training; constants).
      codes: ``[K]`` partition codes (training).
      margins: ``[K]`` trusted margins (training).
      num_negatives: :math:`\lambda` (traced int).
      warmup: the warm-up objective.
      margin: :math:`\gamma` of the warm-up loss (and, contrastive, the trusted margins'
        scale).
      kl_weight: :math:`\xi_1`.
      robust_weight: :math:`\xi_2`.
      edl_view_aggregation: ``'per_view_mean'`` or ``'dst'``.
      ranking: ``'trusted'`` (Eq. 16; the warm-up's top-``lambda``) or ``'contrastive'``
        (:func:`trusted_contrastive_loss` at ``temperature`` in both phases; ``lambda``
        unread).
      temperature: the contrastive form's :math:`\tau`.
      where: optional bool ``[K]``, the real pairs.
      max_negatives: a static bound on ``num_negatives`` (the schedule's start): the
        top-``lambda`` means select that many entries per row instead of sorting rows.
      min_negatives: the schedule's static floor: a count at or below it selects only
        that many (:func:`top_k_mean`'s ``min_k``).

    Returns:
      ``(shares [K], UGNCLTerms)``.
    """
    log_e_views = as_views(log_e_views, "log_e_views")
    sim_views = as_views(sim_views, "sim_views")
    if len(sim_views) != len(log_e_views) or sim_views[0].shape != log_e_views[0].shape:
        raise ValueError(
            f"sim_views ({len(sim_views)} x {sim_views[0].shape}) and log_e_views "
            f"({len(log_e_views)} x {log_e_views[0].shape}) must match"
        )
    if edl_view_aggregation not in EDL_VIEW_AGGREGATIONS:
        raise ValueError(
            f"edl_view_aggregation must be one of {EDL_VIEW_AGGREGATIONS}, "
            f"got {edl_view_aggregation!r}"
        )
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}")
    num_views, num = len(log_e_views), log_e_views[0].shape[-1]
    dtype = log_e_views[0].dtype
    valid = jnp.ones(num, bool) if where is None else jnp.asarray(where, bool)
    real = valid.sum()
    y = jnp.ones(num, dtype) if warmup else _SG(jnp.asarray(labels, dtype))
    eye = jnp.eye(num, dtype=dtype)

    def both_directions(log_e):
        if isinstance(kl_weight, int | float) and kl_weight == 0:
            # each query targets its own class: three numbers per query and a gradient in
            # one elementwise pass (the dense form's passes were most of a :vectors step)
            rows, columns = evidence.diagonal_edl_squared_error(log_e, y, where=valid)
            return rows + columns
        # the caption queries are the columns (axis 0): no transposed copy of the [K, K]
        # matrix, or of its gradient, which at large K cost more than the loss itself
        i2t = edl_loss(log_e, eye * y[:, None], kl_weight=kl_weight, where=valid)
        t2i = edl_loss(log_e, eye * y[None, :], kl_weight=kl_weight, where=valid, axis=0)
        return i2t + t2i

    if edl_view_aggregation == "dst" and num_views > 1:
        evidential = both_directions(evidence.fuse_log_evidence(jnp.stack(log_e_views), real))
    else:
        per_view = _per_view(both_directions, log_e_views)
        evidential = per_view.sum(0) if warmup else per_view.mean(0)
    if ranking == "contrastive":
        robust = _per_view(
            lambda s: trusted_contrastive_loss(
                s,
                None if warmup else codes,
                None if warmup else margins,
                margin=margin,
                temperature=temperature,
                where=valid,
            ),
            sim_views,
        ).sum(0)
    elif warmup:
        robust = _per_view(
            lambda s: trl_warmup_loss(
                s,
                num_negatives,
                margin=margin,
                where=valid,
                max_negatives=max_negatives,
                min_negatives=min_negatives,
            ),
            sim_views,
        ).sum(0)
    else:
        robust = _per_view(
            lambda s: trusted_robust_loss(
                s,
                codes,
                margins,
                num_negatives,
                where=valid,
                max_negatives=max_negatives,
                min_negatives=min_negatives,
            ),
            sim_views,
        ).sum(0)
    evidential = jnp.where(valid, evidential, 0.0)
    robust = jnp.where(valid, robust, 0.0)
    shares = evidential + robust_weight * real.astype(robust.dtype) * robust
    return shares, UGNCLTerms(evidential, robust)
