r"""SREM's objectives: energy-bounded loss, swapped-weight hinge, biased complementary learning.

Each loss reads a ``[B, B]`` matrix in direction view (rows queries, columns candidates, the
diagonal the observed pairs; ``F`` for image-to-text, ``F.T`` for text-to-image) and returns
``[B]`` per-pair *shares*: their mean over the real pairs is the paper's objective, whose
expectations are means over subsets (the clean pairs, the noisy pairs, the batch). Summing the
shares of a batch and dividing by its real pairs, as the trainer's ``'mean'`` reduction does,
gives that objective exactly, on any number of devices. Padding pairs get 0.

:func:`ncljax.methods.srem.srem_loss` composes them with the estimators of
``ncljax.labels.srem`` into the total objective of both directions (main training and
warm-up).

Equations: SREM (Dang et al., AAAI 2024), "Methodology" (its sections are unnumbered):
Eq. 3, Eq. 6, Eqs. 12-13 and the total objective of "Model Optimization".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import masking

_SG = jax.lax.stop_gradient
CL_REDUCTIONS = ("sum", "mean")
CL_PROBS = ("softmax", "sigmoid", "rcl")
RECTIFY = ("biased", "uniform", "matmul_PQ", "matmul_QtP")
_MATMUL_CLAMP = 1.0 - 1e-6


def _subset_share(values: jax.Array, subset: jax.Array, valid: jax.Array) -> jax.Array:
    """``values`` on ``subset`` scaled by ``n / max(1, |subset|)``: a mean over the subset
    once averaged over the ``n`` real pairs."""
    subset = subset & valid
    scale = valid.sum() / jnp.maximum(subset.sum(), 1)
    return jnp.where(subset, values * scale, 0.0)


def energy_bounded_loss(
    energies: ArrayLike,
    clean: ArrayLike,
    *,
    m_clean: float = -4.0,
    m_noisy: float = 0.0,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""Energy-bounded loss of one direction (Eq. 3), as per-pair shares.

    .. math::
      L_u = \frac{1}{|\mathcal C|}\sum_{i\in\mathcal C}[E_i - m_{clean}]_+^2
          + \frac{1}{|\mathcal N|}\sum_{i\in\mathcal N}[m_{noisy} - E_i]_+^2

    pushing clean energies below ``m_clean`` and noisy ones above ``m_noisy`` (an empty subset
    contributes 0).

    Args:
      energies: ``[B]`` energies ``E`` (``ncljax.labels.srem.energy``; gradient flows).
      clean: bool ``[B]``, the clean split :math:`\mathcal C` (the rest is :math:`\mathcal N`).
      m_clean: the clean margin (-4, the paper's Fig. 4).
      m_noisy: the noisy margin (0).
      where: optional bool ``[B]``, the real pairs.

    Returns:
      ``[B]`` shares whose mean over the real pairs is :math:`L_u`.

    References:
      Dang et al., AAAI 2024, Eq. 3; Liu et al., "Energy-based Out-of-distribution
      Detection", NeurIPS 2020, Eq. 9.
    """
    energies = jnp.asarray(energies)
    energies = energies.astype(jnp.result_type(energies, jnp.float32))
    valid = masking.valid_rows(energies.shape[0], where)
    clean = _SG(jnp.asarray(clean, bool))
    pull = jax.nn.relu(energies - m_clean) ** 2
    push = jax.nn.relu(m_noisy - energies) ** 2
    return _subset_share(pull, clean, valid) + _subset_share(push, ~clean, valid)


def weighted_hinge_loss(
    scores: ArrayLike,
    hard_negative: ArrayLike,
    weight: ArrayLike,
    clean: ArrayLike,
    *,
    margin: float = 0.2,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""Hinge with the hardest negative and a weighted positive, on the clean pairs (Eq. 6).

    .. math::
      L_w = \frac{1}{|\mathcal C|}\sum_{i\in\mathcal C}
            [\alpha - \mathrm{sg}(\omega_i)\,\mathbf S_{ii} + \mathbf S_{i\phi(i)}]_+

    An active hinge gives :math:`-\partial/\partial\mathbf S_{ii} = \omega_i` and
    :math:`-\partial/\partial\mathbf S_{i\phi(i)} = -1` per pair (Eq. 7); a query without a
    real negative contributes 0.

    Args:
      scores: ``[B, B]`` sigmoid scores ``S`` in direction view.
      hard_negative: int ``[B]``, :math:`\phi` (``ncljax.labels.srem.hard_negative_index``).
      weight: ``[B]``, :math:`\omega` (``ncljax.labels.srem.swap_weights``; 1 without
        gradient weighting). No gradient.
      clean: bool ``[B]``, the clean split.
      margin: :math:`\alpha` (0.2).
      where: optional bool ``[B]``, the real pairs.

    Returns:
      ``[B]`` shares whose mean over the real pairs is :math:`L_w`.

    References:
      Dang et al., AAAI 2024, Eqs. 6-7.
    """
    scores = jnp.asarray(scores)
    scores = scores.astype(jnp.result_type(scores, jnp.float32))
    num = scores.shape[0]
    hard_negative = jnp.asarray(hard_negative)
    negative = scores[jnp.arange(num), hard_negative]
    return weighted_hinge_shares(
        jnp.diagonal(scores), negative, hard_negative, weight, clean, margin=margin, where=where
    )


def weighted_hinge_shares(
    positive: ArrayLike,
    negative: ArrayLike,
    hard_negative: ArrayLike,
    weight: ArrayLike,
    clean: ArrayLike,
    *,
    margin: float = 0.2,
    where: ArrayLike | None = None,
) -> jax.Array:
    r""":func:`weighted_hinge_loss` from each query's two scores: its pair's
    :math:`\mathbf S_{ii}` and its hardest negative's :math:`\mathbf S_{i\phi(i)}` (``[B]``
    each, gradient flows), without the ``[B, B]`` matrix.

    Args:
      positive: ``[B]`` :math:`\mathbf S_{ii}`.
      negative: ``[B]`` :math:`\mathbf S_{i\phi(i)}`.
      hard_negative: int ``[B]``, :math:`\phi` (a query's own index: no negative, no share).
      weight, clean, margin, where: as :func:`weighted_hinge_loss`.

    Returns:
      ``[B]`` shares whose mean over the real pairs is :math:`L_w`.
    """
    positive = jnp.asarray(positive)
    positive = positive.astype(jnp.result_type(positive, jnp.float32))
    num = positive.shape[0]
    valid = masking.valid_rows(num, where)
    hard_negative = jnp.asarray(hard_negative)
    weight = _SG(jnp.asarray(weight, positive.dtype))
    hinge = jax.nn.relu(margin - weight * positive + negative)
    trained = _SG(jnp.asarray(clean, bool)) & (hard_negative != jnp.arange(num))
    return _subset_share(hinge, trained, valid)


def _log1m_softmax(logits: jax.Array, candidates: jax.Array) -> jax.Array:
    r""":math:`\log(1 - \mathrm{softmax}(x)_j)` over each row's candidates, exact and stable.

    Off a row's maximum ``p <= 1/2`` and ``log1p(-p)`` is accurate; at the maximum the value is
    :math:`\mathrm{lse}_{k \ne j} x_k - \mathrm{lse}_k x_k`, and ``-inf`` (a constant) for a
    row's lone candidate. No NaN reaches the gradient; 0 off the candidates.
    """
    rows_ok = candidates.any(1, keepdims=True)
    masked = jnp.where(candidates, logits, -jnp.inf)
    masked = jnp.where(rows_ok, masked, 0.0)
    lse = jax.nn.logsumexp(masked, axis=1, keepdims=True)
    top = jnp.arange(logits.shape[1])[None, :] == masking.row_argmax(masked)[:, None]
    rest = candidates & ~top
    has_rest = rest.any(1, keepdims=True)
    lse_rest = jax.nn.logsumexp(
        jnp.where(has_rest, jnp.where(rest, logits, -jnp.inf), 0.0), 1, keepdims=True
    )
    log_p = jnp.where(rest, masked - lse, -1.0)
    at_top = jnp.where(has_rest, lse_rest - lse, -jnp.inf)
    return jnp.where(candidates, jnp.where(top, at_top, jnp.log1p(-jnp.exp(log_p))), 0.0)


def _probabilities(logits, candidates, prob, rcl_temperature):
    """``(P [B, B], log(1 - P) [B, B])`` of the complementary loss (0 off the candidates)."""
    if prob == "sigmoid":
        return jax.nn.sigmoid(logits), -jax.nn.softplus(logits)
    scaled = jax.nn.sigmoid(logits) / rcl_temperature if prob == "rcl" else logits
    p = jax.nn.softmax(jnp.where(candidates, scaled, -jnp.inf), axis=1, where=candidates)
    return jnp.where(candidates, p, 0.0), _log1m_softmax(scaled, candidates)


def complementary_loss(
    logits: ArrayLike,
    q: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: str = "sum",
    prob: str = "softmax",
    rcl_temperature: float = 0.05,
    form: str = "expectation",
    where: ArrayLike | None = None,
    rows: ArrayLike | None = None,
) -> jax.Array:
    r"""Cross-modal biased complementary learning of one direction (CMBCL, Eq. 13).

    Default (``form='expectation'``), a reading of Eqs. 12-13 (no official code was
    released, and Eq. 12 taken literally is degenerate, see ``form``): each complementary
    label ``j`` of query ``i`` is drawn from :math:`\mathbf Q_{i:}` and its probability pushed
    down by negative learning,

    .. math::
      L_c = -\frac1B \sum_i \kappa_i \sum_{j\in\mathcal A_i}
            \mathbf Q_{ij}\log(1 - \mathbf P_{ij}),\qquad
      \kappa_i = |\mathcal A_i|\ (\texttt{'sum'})\ \text{or}\ 1\ (\texttt{'mean'}).

    With uniform ``Q`` on all negatives, ``'sum'`` and ``prob='rcl'`` this is RCL's
    complementary contrastive loss (``log`` form).

    ``prob``: ``'softmax'`` (default) :math:`\mathbf P = \mathrm{softmax}(\mathbf F_{i:})`
    over the real candidates; ``'sigmoid'`` :math:`\sigma(\mathbf F_{ij})`
    (:math:`-\log(1-\sigma) = \mathrm{softplus}`; with no positive term it collapses every
    similarity, so the paper's warm-up on :math:`L_c` alone would collapse); ``'rcl'``
    :math:`\mathrm{softmax}(\sigma(\mathbf F_{i:})/\tau_{rcl})` as RCL.

    ``form``: the literal matrix-product readings of Eq. 12 as ablations,
    ``'matmul_PQ'`` :math:`S' = \mathbf P\mathbf Q` and ``'matmul_QtP'``
    :math:`S' = \mathbf Q^\top\mathbf P`, with the loss
    :math:`-\kappa_i \frac{1}{|\mathcal A_i|}\sum_{j\in\mathcal A_i}\log(1 - \min(S'_{ij},
    1 - 10^{-6}))` (degenerate: the first pushes the positive down, the second can exceed 1).

    Args:
      logits: ``[B, B]`` logits ``F`` in direction view (gradient flows through ``P``).
      q: ``[B, B]`` :math:`\mathbf Q` (``ncljax.labels.srem.rectified_complementary_dist``),
        0 off the mask. No gradient.
      mask: bool ``[B, B]`` :math:`\mathcal A` (``ncljax.labels.srem.complementary_mask``).
      reduction: ``'sum'`` (default, RCL's scale) or ``'mean'`` (the literal expectation).
      prob: ``'softmax'``, ``'sigmoid'`` or ``'rcl'``.
      rcl_temperature: :math:`\tau_{rcl}` of ``prob='rcl'`` (0.05).
      form: ``'expectation'``, ``'matmul_PQ'`` or ``'matmul_QtP'``.
      where: optional bool ``[B]``, the real pairs.
      rows: optional int ``[b]``; ``logits``, ``q`` and ``mask`` are then the block of these
        rows of the ``[B, B]`` matrices (``[b, B]``; a row's own pair in the column of its
        index; may be traced), and the result is the block's ``[b]``
        (``form='expectation'`` only: the other forms mix rows).

    Returns:
      ``[B]`` per query (>= 0), 0 at padding; the mean over the real pairs is :math:`L_c`.

    References:
      Dang et al., AAAI 2024, Eqs. 12-13; Hu et al., "Cross-Modal Retrieval with Partially
      Mismatched Pairs" (RCL), TPAMI 2023.
    """
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, jnp.float32))
    if reduction not in CL_REDUCTIONS:
        raise ValueError(f"cl_reduction must be one of {CL_REDUCTIONS}, got {reduction!r}")
    if prob not in CL_PROBS:
        raise ValueError(f"cl_prob must be one of {CL_PROBS}, got {prob!r}")
    if form not in ("expectation", "matmul_PQ", "matmul_QtP"):
        raise ValueError(f"form must be 'expectation', 'matmul_PQ' or 'matmul_QtP', got {form!r}")
    if rows is not None and form != "expectation":
        raise ValueError(f"form={form!r} mixes rows: it cannot be computed on a block of rows")
    columns = masking.valid_rows(logits.shape[1], where)
    valid = columns if rows is None else columns[jnp.asarray(rows)]
    candidates = valid[:, None] & columns[None, :]
    mask = _SG(jnp.asarray(mask, bool)) & candidates
    q = jnp.where(mask, _SG(jnp.asarray(q, logits.dtype)), 0.0)
    size = mask.sum(1).astype(logits.dtype)
    kappa = size if reduction == "sum" else jnp.ones_like(size)
    p, log1m_p = _probabilities(logits, candidates, prob, rcl_temperature)
    if form == "expectation":
        # A lone candidate has P = 1 and log(1 - P) = -inf; it is never in the mask.
        per_query = -jnp.where(mask, q * log1m_p, 0.0).sum(1)
    else:
        mixed = p @ q if form == "matmul_PQ" else q.T @ p
        log1m = jnp.log1p(-jnp.minimum(mixed, _MATMUL_CLAMP))
        per_query = -jnp.where(mask, log1m, 0.0).sum(1) / jnp.maximum(size, 1.0)
    return jnp.where(valid, kappa * per_query, 0.0)
