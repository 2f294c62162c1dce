r"""SREM's objectives: energy-bounded loss, swapped-weight hinge, biased complementary learning.

Each loss reads a ``[B, B]`` matrix in direction view (rows queries, columns candidates, the
diagonal the observed pairs; ``F`` for image-to-text, ``F.T`` for text-to-image) and returns
``[B]`` per-pair *shares*: their mean over the real pairs is the paper's objective, whose
expectations are means over subsets (the clean pairs, the noisy pairs, the batch). Summing the
shares of a batch and dividing by its real pairs, as the trainer's ``'mean'`` reduction does,
gives that objective exactly, on any number of devices. Padding pairs get 0.

:func:`srem_loss` composes them with the estimators of ``ncljax.labels.srem`` into the total
objective of both directions (main training and warm-up).

Equations: ``srem.md`` sections 3.3, 3.5-3.7 of the ncljax specs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax.labels import srem as selection

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
    valid = selection.valid_rows(energies.shape[0], where)
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
    valid = selection.valid_rows(num, where)
    hard_negative = jnp.asarray(hard_negative)
    weight = _SG(jnp.asarray(weight, scores.dtype))
    rows = jnp.arange(num)
    hinge = jax.nn.relu(margin - weight * jnp.diagonal(scores) + scores[rows, hard_negative])
    trained = _SG(jnp.asarray(clean, bool)) & (hard_negative != rows)
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
    top = jnp.arange(logits.shape[1])[None, :] == jnp.argmax(masked, axis=1)[:, None]
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
) -> jax.Array:
    r"""Cross-modal biased complementary learning of one direction (CMBCL, Eq. 13).

    Default (``form='expectation'``), the spec's reading of Eqs. 12-13: each complementary
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
    similarity, ``srem.md`` Sec. 8 item 10); ``'rcl'``
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

    Returns:
      ``[B]`` per query (>= 0), 0 at padding; the mean over the real pairs is :math:`L_c`.

    References:
      Dang et al., AAAI 2024, Eqs. 12-13; Hu et al., "Cross-Modal Retrieval with Partially
      Mismatched Pairs" (RCL), TPAMI 2023.
    """
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, jnp.float32))
    num = logits.shape[0]
    if reduction not in CL_REDUCTIONS:
        raise ValueError(f"cl_reduction must be one of {CL_REDUCTIONS}, got {reduction!r}")
    if prob not in CL_PROBS:
        raise ValueError(f"cl_prob must be one of {CL_PROBS}, got {prob!r}")
    if form not in ("expectation", "matmul_PQ", "matmul_QtP"):
        raise ValueError(f"form must be 'expectation', 'matmul_PQ' or 'matmul_QtP', got {form!r}")
    valid = selection.valid_rows(num, where)
    candidates = valid[:, None] & valid[None, :]
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


class SREMDirection(NamedTuple):
    """The per-batch quantities of one retrieval direction (all ``[B]`` unless noted).

    Attributes:
      energy: :math:`E` (Eq. 1).
      clean: bool, the clean split the losses use (Eq. 2 and ``clean_set``; in warm-up the
        selection Eq. 2 would make, for the logs only).
      hard_negative: int, :math:`\\phi`.
      entropy: normalised entropy :math:`e` (Eq. 4).
      argument: hinge argument :math:`a` (Eq. 5).
      weight: swapped weight :math:`\\omega` used by this direction's hinge (Eq. 6).
      mask: bool ``[B, B]``, complementary candidates :math:`\\mathcal A` (Eq. 11).
      q: ``[B, B]``, :math:`\\mathbf Q` (Eq. 12).
      hinge: shares of :math:`L_w` (0 in warm-up).
      energy_loss: shares of :math:`L_u` (0 in warm-up).
      complementary: per-query :math:`L_c` terms.
      pull: positive gradient of the hinge, :math:`-\\partial L_w/\\partial S_{ii}` of the
        summed hinge (0 in warm-up; the noisy gradient ratio's numerator on noisy pairs).
      fallback: bool scalar, this direction's division was degenerate and it trained the
        warm-up objective instead (``fallback=True`` of :func:`srem_loss` only).
    """

    energy: jax.Array
    clean: jax.Array
    hard_negative: jax.Array
    entropy: jax.Array
    argument: jax.Array
    weight: jax.Array
    mask: jax.Array
    q: jax.Array
    hinge: jax.Array
    energy_loss: jax.Array
    complementary: jax.Array
    pull: jax.Array
    fallback: jax.Array | bool = False


def srem_loss(
    logits: ArrayLike,
    *,
    warmup: bool = False,
    threshold: ArrayLike = -2.0,
    m_clean: ArrayLike = -4.0,
    m_noisy: ArrayLike = 0.0,
    margin: float = 0.2,
    beta: float = 50.0,
    offset: float = 0.5,
    lambda1: float = 0.05,
    lambda2: float = 1.0,
    cl_reduction: str = "sum",
    cl_prob: str = "softmax",
    rcl_temperature: float = 0.05,
    rectify: str = "biased",
    sgw_indicator: str = "literal",
    gradient_weighting: bool = True,
    clean_set: str = "per_direction",
    warmup_lambda2: bool = False,
    fallback: bool = False,
    warmup_rectify: str | None = None,
    where: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, SREMDirection]]:
    r"""SREM's total objective over both retrieval directions, per pair.

    Main training (``srem.md`` Sec. 3.7):

    .. math::
      L = \tfrac12(L_w^{i2t} + L_w^{t2i}) + \lambda_1(L_u^{i2t} + L_u^{t2i})
        + \lambda_2(L_c^{i2t} + L_c^{t2i})

    Warm-up: :math:`L_c^{i2t} + L_c^{t2i}` with no row clean (every negative is a complementary
    candidate), times :math:`\lambda_2` only with ``warmup_lambda2``. Pair ``i``'s share sums
    its image query's terms (row ``i`` of ``F``) and its caption query's (row ``i`` of
    ``F.T``).

    Fallback (``fallback=True``, main training only): a direction whose clean set (after
    ``clean_set``) holds no real pair of the batch, or every one, divides nothing; its hinge
    would train nothing (or every noisy pair) and its energy loss would push every energy
    one way. That direction trains its warm-up term instead (:math:`L_c` with no row
    clean, weighted as in warm-up) and flags ``fallback``.

    Args:
      logits: ``[B, B]`` logits ``F`` (rows images, columns captions, pairs on the diagonal).
      warmup: the warm-up objective (static).
      threshold: energy threshold :math:`\tau` of the clean split (-2): a scalar, or ``[2]``
        (image-to-text, text-to-image) for one per direction; may be traced.
      m_clean: clean energy margin (-4), scalar or ``[2]`` likewise.
      m_noisy: noisy energy margin (0), scalar or ``[2]`` likewise.
      margin: hinge margin :math:`\alpha` (0.2).
      beta: sharpness :math:`\beta` of the selection probabilities (50).
      offset: offset :math:`b` of the selection probabilities (0.5).
      lambda1: weight of :math:`L_u` (0.05).
      lambda2: weight of :math:`L_c` (1.0).
      cl_reduction: ``'sum'`` or ``'mean'`` (see :func:`complementary_loss`).
      cl_prob: ``'softmax'``, ``'sigmoid'`` or ``'rcl'`` (see :func:`complementary_loss`).
      rcl_temperature: temperature of ``cl_prob='rcl'`` (0.05).
      rectify: ``'biased'`` (Eqs. 10-12), ``'uniform'`` (no label rectification),
        ``'matmul_PQ'`` or ``'matmul_QtP'`` (literal Eq. 12 readings with the biased ``Q``).
      sgw_indicator: ``'literal'`` or ``'loss_direction'`` (see
        ``ncljax.labels.srem.swap_weights``).
      gradient_weighting: swapped gradient weighting; ``False``: :math:`\omega \equiv 1`.
      clean_set: ``'per_direction'``, ``'and'`` or ``'or'``.
      warmup_lambda2: multiply the warm-up loss by :math:`\lambda_2`.
      fallback: a degenerate division trains the warm-up objective (see above; static).
      warmup_rectify: ``rectify`` of the warm-up objective (``None``: ``rectify``).
      where: optional bool ``[B]``, the real pairs.

    Returns:
      ``(loss, directions)``: ``[B]`` shares whose mean over the real pairs is :math:`L`, and
      ``{'i2t': SREMDirection, 't2i': SREMDirection}``.

    References:
      Dang et al., "Noisy Correspondence Learning with Self-Reinforcing Errors Mitigation",
      AAAI 2024, Sec. "Model Optimization".
    """
    if warmup and warmup_rectify is not None:
        rectify = warmup_rectify
    if rectify not in RECTIFY:
        raise ValueError(f"rectify must be one of {RECTIFY}, got {rectify!r}")
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, jnp.float32))
    num = logits.shape[0]
    valid = selection.valid_rows(num, where)
    views = {"i2t": logits, "t2i": logits.T}
    per_direction = {
        name: dict(
            zip(views, jnp.broadcast_to(jnp.asarray(value, logits.dtype), (2,)), strict=True)
        )
        for name, value in (("threshold", threshold), ("m_clean", m_clean), ("m_noisy", m_noisy))
    }
    scores = {d: jax.nn.sigmoid(f) for d, f in views.items()}
    energies = {d: selection.energy(f, where=valid) for d, f in views.items()}
    selected = {
        d: selection.clean_mask(f, per_direction["threshold"][d], where=valid)
        for d, f in views.items()
    }
    clean = {}
    clean["i2t"], clean["t2i"] = selection.combine_clean_masks(
        selected["i2t"], selected["t2i"], clean_set
    )
    phi = {d: selection.hard_negative_index(f, where=valid) for d, f in views.items()}
    entropy = {d: selection.normalized_entropy(f, where=valid) for d, f in views.items()}
    argument = {d: _SG(selection.hinge_argument(scores[d], phi[d], margin)) for d in views}
    omega = {d: jnp.ones(num, logits.dtype) for d in views}
    if gradient_weighting:
        omega["i2t"], omega["t2i"] = selection.swap_weights(
            entropy["i2t"],
            entropy["t2i"],
            argument["i2t"],
            argument["t2i"],
            indicator=sgw_indicator,
        )
    form = rectify if rectify.startswith("matmul") else "expectation"
    zeros = jnp.zeros(num, logits.dtype)
    total = zeros
    directions = {}
    warmup_weight = lambda2 if warmup_lambda2 else 1.0
    for d, f in views.items():
        degenerate = jnp.asarray(False)
        if fallback and not warmup:
            degenerate = selection.degenerate_division(clean[d], where=valid)
        used = jnp.zeros(num, bool) if warmup else clean[d] & ~degenerate
        mask = selection.complementary_mask(used, phi[d], where=valid)
        selection_probs = selection.ms_selection_probs(scores[d], beta, offset, where=valid)
        q = selection.rectified_complementary_dist(
            selection_probs, mask, rectify=rectify != "uniform"
        )
        comp = complementary_loss(
            f,
            q,
            mask,
            reduction=cl_reduction,
            prob=cl_prob,
            rcl_temperature=rcl_temperature,
            form=form,
            where=valid,
        )
        if warmup:
            hinge = energy_loss = pull = zeros
            total = total + warmup_weight * comp
        else:
            hinge = weighted_hinge_loss(
                scores[d], phi[d], omega[d], used, margin=margin, where=valid
            )
            energy_loss = energy_bounded_loss(
                energies[d],
                used,
                m_clean=per_direction["m_clean"][d],
                m_noisy=per_direction["m_noisy"][d],
                where=valid,
            )
            pull = selection.positive_pull(scores[d], phi[d], omega[d], used, margin)
            main = 0.5 * hinge + lambda1 * energy_loss + lambda2 * comp
            if fallback:
                hinge, energy_loss, pull = (
                    jnp.where(degenerate, 0.0, v) for v in (hinge, energy_loss, pull)
                )
                main = jnp.where(degenerate, warmup_weight * comp, main)
            total = total + main
        directions[d] = SREMDirection(
            energy=energies[d],
            clean=clean[d],
            hard_negative=phi[d],
            entropy=entropy[d],
            argument=argument[d],
            weight=omega[d],
            mask=mask,
            q=q,
            hinge=hinge,
            energy_loss=energy_loss,
            complementary=comp,
            pull=pull,
            fallback=degenerate,
        )
    return jnp.where(valid, total, 0.0), directions
