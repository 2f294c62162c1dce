r"""SREM's per-batch estimators: energy, clean selection, swapped weights, complementary labels.

Every function reads a ``[B, B]`` matrix in *direction view*: rows are the queries, columns the
candidates, the diagonal the observed pairs. Call it with the logits ``F`` (rows images) for
image-to-text and with ``F.T`` for text-to-image. ``where`` (bool ``[B]``) marks the real pairs
of a padded batch: a padding pair is neither a query nor a candidate, and its own outputs are 0
(``False`` for masks).

*Row blocks.* Every quantity of a query is a function of its own row. The functions that read
the matrix also take ``rows``: the matrix is then a block of ``b`` rows of the ``[B, B]``
matrix, ``rows`` their indices (a row's own pair is the column of its index; ``where`` still
``[B]``), and they return those ``b`` rows of what the whole matrix gives.
``ncljax.methods.srem.srem_loss`` (``block_rows``) runs its passes so, a few hundred rows at
a time, so that they stay in cache at large batches.

* :func:`energy` (Eq. 1), :func:`clean_mask` (Eq. 2, the energy threshold and the maximum
  similarity constraint), :func:`partner_p_value` and :func:`partner_test_mask` (a division
  by an in-batch permutation test instead, ncljax's), :func:`combine_clean_masks` (one clean
  set per direction, or their intersection or union);
* :func:`normalized_entropy` (Eq. 4), :func:`hard_negative_index`, :func:`hinge_argument`,
  :func:`sgw_weight` and :func:`swap_weights` (Eqs. 5-6, swapped gradient weighting);
* :func:`complementary_mask` (Eq. 11), :func:`ms_selection_probs` (Eq. 10) and
  :func:`rectified_complementary_dist` (Eqs. 11-12);
* :func:`positive_pull` (the per-pair positive gradient of Eq. 7, the diagnostic behind the
  paper's noisy gradient ratio);
* :func:`calibrate_energy` (the threshold and margins of Eqs. 2-3 from the energies' own
  two-class split) and :func:`degenerate_division` (a split that divides nothing).

Everything but :func:`energy` is a constant of the loss (``stop_gradient``: masks, indices,
entropies, weights, ``Q``).

Equations: SREM (Dang et al., AAAI 2024), "Methodology" (its sections are unnumbered):
Eqs. 1-2 ("Energy-Guided Sample Filtration"), Eqs. 4-7 ("Swapped Gradient Weighting") and
Eqs. 10-12 ("Cross-Modal Biased Complementary Learning"); the noisy gradient ratio of Fig. 5.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import masking

_SG = jax.lax.stop_gradient


def _square(matrix: ArrayLike, name: str = "logits", block: bool = False) -> jax.Array:
    """The matrix as floats: square ``[B, B]``, or with ``block`` a block of ``b <= B`` rows
    of one (the module's "row blocks")."""
    matrix = jnp.asarray(matrix)
    if not block and (matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]):
        raise ValueError(f"{name} must be square [B, B] (queries x candidates), got {matrix.shape}")
    if block and (matrix.ndim != 2 or matrix.shape[0] > matrix.shape[1]):
        raise ValueError(f"a block of {name} must be [b, B] with b <= B, got {matrix.shape}")
    return matrix.astype(jnp.result_type(matrix, jnp.float32))


valid_rows = masking.valid_rows  # bool [B]: the real pairs (all when where is None)


def _partners(matrix: jax.Array, rows: ArrayLike | None) -> jax.Array:
    """int ``[b]``: the column of each row's own pair (its row index in the whole matrix)."""
    return jnp.arange(matrix.shape[0]) if rows is None else jnp.asarray(rows)


def _candidates(
    matrix: jax.Array, where: ArrayLike | None, rows: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(valid [b], candidates [b, B], own [b, B])``: a real query row against its real
    candidates, and each row's own pair."""
    partner = _partners(matrix, rows)
    columns = valid_rows(matrix.shape[1], where)
    valid = columns if rows is None else columns[partner]
    own = jnp.arange(matrix.shape[1])[None, :] == partner[:, None]
    return valid, valid[:, None] & columns[None, :], own


def _own_values(matrix: jax.Array, rows: ArrayLike | None) -> jax.Array:
    """``[b]``: each row's entry at its own pair (the diagonal of a square matrix)."""
    if rows is None:
        return jnp.diagonal(matrix)
    partner = _partners(matrix, rows)
    return jnp.take_along_axis(matrix, partner[:, None], axis=1)[:, 0]


def energy(
    logits: ArrayLike, *, where: ArrayLike | None = None, rows: ArrayLike | None = None
) -> jax.Array:
    r"""Energy of each query (Eq. 1): the negative log-sum-exp of its row of logits.

    .. math:: E_i = -\log \sum_j \exp(\mathbf F_{ij})

    Low energy means a confident query. Over ``B`` flat logits it is ``-log B`` (-4.85 for
    ``B = 128``): the energy depends on the batch size.

    Args:
      logits: ``[B, B]`` logits ``F`` in direction view.
      where: optional bool ``[B]``, the real pairs; padding is no candidate.
      rows: optional int ``[b]``; ``logits`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      ``[B]`` energies (gradient flows), 0 at padding rows.

    References:
      Dang et al., "Noisy Correspondence Learning with Self-Reinforcing Errors Mitigation",
      AAAI 2024, Eq. 1; Liu et al., "Energy-based Out-of-distribution Detection", NeurIPS 2020.
    """
    logits = _square(logits, block=rows is not None)
    valid, candidates, _ = _candidates(logits, where, rows)
    # A padding row reads its whole (finite) row, so no -inf reaches the gradient; it is
    # zeroed below.
    lse = jax.nn.logsumexp(jnp.where(candidates | ~valid[:, None], logits, -jnp.inf), axis=1)
    return jnp.where(valid, -lse, 0.0)


def _masked_argmax(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Row argmax over ``mask`` (ties to the lowest index, as ``jnp.argmax``)."""
    return masking.row_argmax(jnp.where(mask, values, -jnp.inf))


def clean_mask(
    logits: ArrayLike,
    threshold: float,
    *,
    where: ArrayLike | None = None,
    rows: ArrayLike | None = None,
) -> jax.Array:
    r"""The clean split of one direction (Eq. 2): low energy and the partner ranked first.

    .. math:: c_i = \mathbb 1[E_i < \tau]\;\mathbb 1[\arg\max_j \mathbf F_{ij} = i]

    The second factor is DECL's maximum-similarity constraint. A tie for the maximum is broken
    toward the lowest index, so a positive tied with an earlier candidate is not selected.

    Args:
      logits: ``[B, B]`` logits in direction view.
      threshold: the energy threshold :math:`\tau`.
      where: optional bool ``[B]``, the real pairs.
      rows: optional int ``[b]``; ``logits`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      bool ``[B]`` (no gradient), ``False`` at padding.

    References:
      Dang et al., AAAI 2024, Eq. 2; Qin et al., "Deep Evidential Learning with Noisy
      Correspondence for Cross-modal Retrieval" (DECL), ACM MM 2022.
    """
    logits = _SG(_square(logits, block=rows is not None))
    valid, candidates, _ = _candidates(logits, where, rows)
    first = _masked_argmax(logits, candidates) == _partners(logits, rows)
    low = energy(logits, where=where, rows=rows) < threshold
    return valid & first & low


def partner_p_value(
    logits: ArrayLike, *, where: ArrayLike | None = None, rows: ArrayLike | None = None
) -> jax.Array:
    r"""Each query's in-batch permutation p-value of its partner's logit (ncljax's).

    .. math:: p_i = \frac{1 + |\{j \ne i : \mathbf F_{ij} \ge \mathbf F_{ii}\}|}{n}

    over the ``n`` real candidates. If the pair is mismatched, its partner is one more
    caption the image has nothing to do with: its logit is exchangeable with the row's
    negatives, and :math:`p_i` is uniform on :math:`\{1/n, \ldots, 1\}`
    (:math:`P(p_i \le \alpha) \le \alpha`). A matched pair's partner ranks above
    most negatives, a small :math:`p_i`. Ties count against the partner. :math:`p_i = 1/n`
    is Eq. 2's maximum-similarity constraint (the partner ranked first), with the tie going
    to the negatives instead of the lowest index.

    Args:
      logits: ``[B, B]`` logits in direction view.
      where: optional bool ``[B]``, the real pairs.
      rows: optional int ``[b]``; ``logits`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      ``[B]`` p-values in ``(0, 1]`` (no gradient), 1 at padding.
    """
    logits = _SG(_square(logits, block=rows is not None))
    valid, candidates, own = _candidates(logits, where, rows)
    others = candidates & ~own
    beaten = jnp.sum(others & (logits >= _own_values(logits, rows)[:, None]), axis=1)
    real = valid_rows(logits.shape[1], where)
    n = jnp.maximum(jnp.sum(real), 1).astype(logits.dtype)
    return jnp.where(valid, (1.0 + beaten.astype(logits.dtype)) / n, 1.0)


def partner_test_mask(
    logits: ArrayLike,
    level: float,
    *,
    where: ArrayLike | None = None,
    rows: ArrayLike | None = None,
) -> jax.Array:
    """The clean split of one direction by the partner test (ncljax's): the pairs whose
    :func:`partner_p_value` is at most ``level``.

    It replaces Eq. 2's energy threshold, whose two-class split cuts a share of the pairs
    off whether or not any is mismatched, with a test against the batch's own mismatched
    pairs: at level 0.05 at most 5% of the mismatched pairs pass, in expectation, and a
    batch without mismatched pairs can be selected whole. Measured on real folders (see
    ``ncljax.methods.srem.Settings``, ``division``). A batch of fewer than ``1 / level``
    real pairs cannot reach the level (its smallest p-value is ``1 / n``): there the test
    keeps the pairs whose partner ranks first, Eq. 2's maximum-similarity constraint.

    Args:
      logits: ``[B, B]`` logits in direction view.
      level: the test's level in ``(0, 1]``.
      where: optional bool ``[B]``, the real pairs.
      rows: optional int ``[b]``; ``logits`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      bool ``[B]`` (no gradient), ``False`` at padding.
    """
    p = partner_p_value(logits, where=where, rows=rows)
    return partner_test(p, level, where=where, rows=rows)


def partner_test(
    p_values: ArrayLike,
    level: float,
    *,
    where: ArrayLike | None = None,
    rows: ArrayLike | None = None,
) -> jax.Array:
    """:func:`partner_test_mask` from the p-values :func:`partner_p_value` gave (``[b]``,
    with ``where`` and ``rows`` as given to it)."""
    p = jnp.asarray(p_values)
    real = valid_rows(p.shape[0] if where is None else jnp.shape(where)[0], where)
    valid = real if rows is None else real[jnp.asarray(rows)]
    smallest = 1.0 / jnp.maximum(jnp.sum(real), 1).astype(p.dtype)
    return valid & (p <= jnp.maximum(level, smallest))


CLEAN_SETS = ("per_direction", "and", "or")
DIVISIONS = ("energy", "partner")


def combine_clean_masks(
    clean_i2t: ArrayLike, clean_t2i: ArrayLike, mode: str = "per_direction"
) -> tuple[jax.Array, jax.Array]:
    """The clean sets the two directions train with.

    The paper writes one clean set and applies the filtration "symmetrically" to
    text-to-image (Dang et al., AAAI 2024, "Model Optimization"); how the two directions'
    sets combine is not stated.

    Args:
      clean_i2t: bool ``[B]`` of the image-to-text view.
      clean_t2i: bool ``[B]`` of the text-to-image view.
      mode: ``'per_direction'`` (default: each direction its own set), ``'and'`` (both use the
        intersection) or ``'or'`` (both use the union).

    Returns:
      ``(clean_i2t, clean_t2i)``, bool ``[B]`` each.
    """
    clean_i2t, clean_t2i = jnp.asarray(clean_i2t, bool), jnp.asarray(clean_t2i, bool)
    if mode == "per_direction":
        return clean_i2t, clean_t2i
    if mode == "and":
        both = clean_i2t & clean_t2i
        return both, both
    if mode == "or":
        either = clean_i2t | clean_t2i
        return either, either
    raise ValueError(f"clean_set must be one of {CLEAN_SETS}, got {mode!r}")


def normalized_entropy(
    logits: ArrayLike, *, where: ArrayLike | None = None, rows: ArrayLike | None = None
) -> jax.Array:
    r"""Entropy of each query's in-batch softmax, divided by its maximum (Eq. 4).

    .. math:: e_i = -\frac{1}{\log n} \sum_j \mathbf P_{ij} \log \mathbf P_{ij},
       \qquad \mathbf P_{i:} = \mathrm{softmax}(\mathbf F_{i:})

    with ``n`` the number of real candidates (the batch size ``B`` of a full batch).

    Args:
      logits: ``[B, B]`` logits in direction view.
      where: optional bool ``[B]``, the real pairs.
      rows: optional int ``[b]``; ``logits`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      ``[B]`` in ``[0, 1]`` (no gradient), 0 at padding and when there is one candidate.

    References:
      Dang et al., AAAI 2024, Eq. 4.
    """
    logits = _SG(_square(logits, block=rows is not None))
    valid, candidates, _ = _candidates(logits, where, rows)
    log_p = jax.nn.log_softmax(logits, axis=1, where=candidates)
    plogp = jnp.where(candidates, jnp.exp(log_p) * log_p, 0.0)
    count = candidates.sum(1)
    norm = jnp.log(jnp.maximum(count, 2).astype(logits.dtype))
    return jnp.where(valid & (count > 1), -plogp.sum(1) / norm, 0.0)


def hard_negative_index(
    logits: ArrayLike, *, where: ArrayLike | None = None, rows: ArrayLike | None = None
) -> jax.Array:
    r"""The hardest in-batch negative of each query: :math:`\phi(i) = \arg\max_{j \ne i} F_{ij}`.

    Args:
      logits: ``[B, B]`` logits (or sigmoid scores: the same order) in direction view.
      where: optional bool ``[B]``, the real pairs; padding is never a negative.
      rows: optional int ``[b]``; ``logits`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      int32 ``[B]`` (no gradient; ties to the lowest index). A query without a real negative
      (padding, or a batch of one) gets its own index.

    References:
      Dang et al., AAAI 2024, Eq. 6; Faghri et al., VSE++, BMVC 2018.
    """
    logits = _SG(_square(logits, block=rows is not None))
    _, candidates, own = _candidates(logits, where, rows)
    negatives = candidates & ~own
    found = _masked_argmax(logits, negatives)
    return jnp.where(negatives.any(1), found, _partners(logits, rows)).astype(jnp.int32)


def hinge_argument(scores: ArrayLike, hard_negative: ArrayLike, margin: float) -> jax.Array:
    r"""The hinge argument :math:`a_i = \alpha - \mathbf S_{ii} + \mathbf S_{i\phi(i)}`.

    Args:
      scores: ``[B, B]`` sigmoid scores ``S`` in direction view.
      hard_negative: int ``[B]``, :math:`\phi` (a query's own index: no negative, ``a = alpha``).
      margin: :math:`\alpha`.

    Returns:
      ``[B]`` (gradient flows through both scores).
    """
    scores = _square(scores, "scores")
    rows = jnp.arange(scores.shape[0])
    return margin - jnp.diagonal(scores) + scores[rows, jnp.asarray(hard_negative)]


def sgw_weight(entropy: ArrayLike, argument: ArrayLike) -> jax.Array:
    r"""Sensitivity weight (Eq. 5): :math:`w_i = 1 - e_i\,\mathbb 1[a_i > 0]`.

    A pair that already satisfies the margin (``a <= 0``) keeps the full weight 1.

    Args:
      entropy: ``[B]`` normalised entropies ``e``.
      argument: ``[B]`` hinge arguments ``a`` whose sign switches the down-weighting.

    Returns:
      ``[B]`` in ``[0, 1]`` (no gradient).
    """
    entropy, argument = _SG(jnp.asarray(entropy)), _SG(jnp.asarray(argument))
    return 1.0 - entropy * (argument > 0)


SGW_INDICATORS = ("literal", "loss_direction")


def swap_weights(
    entropy_i2t: ArrayLike,
    entropy_t2i: ArrayLike,
    argument_i2t: ArrayLike,
    argument_t2i: ArrayLike,
    *,
    indicator: str = "literal",
) -> tuple[jax.Array, jax.Array]:
    r"""Swapped gradient weights (Eqs. 5-6): each direction is weighted by the other's entropy.

    ``'literal'`` (default, Eqs. 5-6 as printed): :math:`\omega^{i2t} = w^{t2i}`,
    :math:`\omega^{t2i} = w^{i2t}`, the indicator included in the swap.
    ``'loss_direction'`` (the text's "the swap applies to :math:`e(P_i)`"): the entropy is
    swapped, the indicator is the loss's own,
    :math:`\omega^{i2t}_i = 1 - e^{t2i}_i\,\mathbb 1[a^{i2t}_i > 0]`; only then does a pair
    that satisfies its margin produce no gradient.

    Args:
      entropy_i2t: ``[B]`` normalised entropy of the image queries.
      entropy_t2i: ``[B]`` of the caption queries.
      argument_i2t: ``[B]`` hinge arguments of the image-to-text view.
      argument_t2i: ``[B]`` of the text-to-image view.
      indicator: ``'literal'`` (Eqs. 5-6 as printed) or ``'loss_direction'`` (the text's
        swap of :math:`e(P_i)` alone).

    Returns:
      ``(omega_i2t, omega_t2i)``, ``[B]`` each (no gradient).

    References:
      Dang et al., AAAI 2024, Eqs. 5-6.
    """
    if indicator == "literal":
        return sgw_weight(entropy_t2i, argument_t2i), sgw_weight(entropy_i2t, argument_i2t)
    if indicator == "loss_direction":
        return sgw_weight(entropy_t2i, argument_i2t), sgw_weight(entropy_i2t, argument_t2i)
    raise ValueError(f"sgw_indicator must be one of {SGW_INDICATORS}, got {indicator!r}")


def complementary_mask(
    clean: ArrayLike,
    hard_negative: ArrayLike,
    *,
    where: ArrayLike | None = None,
    rows: ArrayLike | None = None,
) -> jax.Array:
    r"""The complementary candidates of each query (Eq. 11).

    .. math:: \mathcal A_i = \{j \ne i\} \setminus \{\phi(i) \text{ if } c_i\}

    Every real row has candidates, clean or not; a clean row loses the hard negative its
    hinge already pushes away.

    Args:
      clean: bool ``[B]``, the clean split of this direction.
      hard_negative: int ``[B]``, :math:`\phi`.
      where: optional bool ``[B]``, the real pairs (required with ``rows``).
      rows: optional int ``[b]``; ``clean`` and ``hard_negative`` are then those of the
        block of these rows, and the mask is the block's ``[b, B]``.

    Returns:
      bool ``[B, B]`` (no gradient); all ``False`` on padding rows and columns.

    References:
      Dang et al., AAAI 2024, Eq. 11.
    """
    clean = jnp.asarray(clean, bool)
    if rows is not None and where is None:
        raise ValueError("complementary_mask of a block of rows needs where ([B])")
    num = clean.shape[0] if where is None else jnp.shape(where)[0]
    shape = jax.ShapeDtypeStruct((clean.shape[0], num), bool)
    _, candidates, own = _candidates(shape, where, rows)
    columns = jnp.arange(num)
    hinge_negative = clean[:, None] & (columns[None, :] == jnp.asarray(hard_negative)[:, None])
    return candidates & ~own & ~hinge_negative


def ms_selection_probs(
    scores: ArrayLike,
    beta: float,
    offset: float,
    *,
    where: ArrayLike | None = None,
    rows: ArrayLike | None = None,
) -> jax.Array:
    r"""Biased selection probability of each complementary label (Eq. 10).

    .. math:: \bar{\mathbf P}_{ij} = \frac{\exp(\beta(\mathbf S_{ij} - b))}
       {1 + \sum_{k \ne i} \exp(\beta(\mathbf S_{ik} - b))}, \qquad j \ne i

    (multi-similarity / binomial-deviance weighting: harder negatives weigh more). The sum runs
    over every real negative, before the hard negative is removed by Eq. 11. Computed in log
    space.

    Args:
      scores: ``[B, B]`` sigmoid scores ``S`` in direction view.
      beta: sharpness :math:`\beta`.
      offset: offset :math:`b`.
      where: optional bool ``[B]``, the real pairs.
      rows: optional int ``[b]``; ``scores`` is then the block of these rows of the
        ``[B, B]`` matrix (``[b, B]``; a row's own pair in the column of its index; may be
        traced), and every output is the block's ``[b]``.

    Returns:
      ``[B, B]`` in ``(0, 1)`` off the diagonal, 0 on it and at padding (no gradient).

    References:
      Dang et al., AAAI 2024, Eq. 10; Wang et al., "Multi-Similarity Loss with General Pair
      Weighting for Deep Metric Learning", CVPR 2019.
    """
    scores = _SG(_square(scores, "scores", rows is not None))
    _, candidates, own = _candidates(scores, where, rows)
    negatives = candidates & ~own
    z = jnp.where(negatives, beta * (scores - offset), -jnp.inf)
    log_norm = jnp.logaddexp(0.0, jax.nn.logsumexp(z, axis=1, keepdims=True))
    return jnp.where(negatives, jnp.exp(z - log_norm), 0.0)


def rectified_complementary_dist(
    selection: ArrayLike, mask: ArrayLike, *, rectify: bool = True
) -> jax.Array:
    r"""The distribution ``Q`` over each query's complementary candidates (Eqs. 11-12).

    .. math:: \mathbf Q_{ij} = \frac{\mathbb 1[j \in \mathcal A_i]\,\exp(\bar{\mathbf P}_{ij})}
       {\sum_{k \in \mathcal A_i} \exp(\bar{\mathbf P}_{ik})}

    A softmax of the selection probabilities themselves (values in ``(0, 1)``, so at most a
    factor ``e`` between candidates), as printed. ``rectify=False`` is the "without label
    rectification" ablation: uniform on :math:`\mathcal A_i`.

    Args:
      selection: ``[B, B]`` :math:`\bar{\mathbf P}` (:func:`ms_selection_probs`).
      mask: bool ``[B, B]`` :math:`\mathcal A` (:func:`complementary_mask`).
      rectify: biased (``True``, Eq. 12) or uniform ``Q``.

    Returns:
      ``[B, B]``: each row with a candidate sums to 1; exactly 0 off the mask (no gradient).

    References:
      Dang et al., AAAI 2024, Eqs. 11-12.
    """
    selection = _SG(_square(selection, "selection", block=True))  # any block of rows
    mask = jnp.asarray(mask, bool)
    logits = selection if rectify else jnp.zeros_like(selection)
    q = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=1, where=mask)
    return jnp.where(mask, q, 0.0)


def positive_pull(
    scores: ArrayLike,
    hard_negative: ArrayLike,
    weight: ArrayLike,
    clean: ArrayLike,
    margin: float,
) -> jax.Array:
    r"""The positive gradient each pair receives from the weighted hinge (Eq. 7).

    .. math:: g_i = c_i\,\omega_i\,\mathbb 1[\alpha - \omega_i \mathbf S_{ii}
       + \mathbf S_{i\phi(i)} > 0] = -\partial L_w / \partial \mathbf S_{ii}

    (of the summed hinge). Summed over the two directions and split by the true mask it gives
    the paper's noisy gradient ratio (Fig. 5): the share of the positive pull
    that reaches mismatched pairs.

    Args:
      scores: ``[B, B]`` sigmoid scores in direction view.
      hard_negative: int ``[B]``, :math:`\phi`.
      weight: ``[B]``, :math:`\omega`.
      clean: bool ``[B]``, the clean split the hinge trains on.
      margin: :math:`\alpha`.

    Returns:
      ``[B]`` >= 0 (no gradient).
    """
    scores = _SG(_square(scores, "scores"))
    negative = scores[jnp.arange(scores.shape[0]), jnp.asarray(hard_negative)]
    return positive_pull_of_scores(
        jnp.diagonal(scores), negative, hard_negative, weight, clean, margin
    )


def positive_pull_of_scores(
    positive: ArrayLike,
    negative: ArrayLike,
    hard_negative: ArrayLike,
    weight: ArrayLike,
    clean: ArrayLike,
    margin: float,
) -> jax.Array:
    r""":func:`positive_pull` from each query's two scores, :math:`\mathbf S_{ii}` and
    :math:`\mathbf S_{i\phi(i)}` (``[B]`` each), without the ``[B, B]`` matrix.

    Returns:
      ``[B]`` >= 0 (no gradient).
    """
    positive, negative = _SG(jnp.asarray(positive)), _SG(jnp.asarray(negative))
    weight = _SG(jnp.asarray(weight, positive.dtype))
    hard_negative = jnp.asarray(hard_negative)
    active = margin - weight * positive + negative > 0
    trained = jnp.asarray(clean, bool) & (hard_negative != jnp.arange(positive.shape[0]))
    return jnp.where(trained & active, weight, 0.0)


class EnergyCalibration(NamedTuple):
    """The energy division calibrated on one direction's energies (see
    :func:`calibrate_energy`; all scalars).

    Attributes:
      threshold: :math:`\\hat\\tau`, replaces the paper's ``tau`` in Eq. 2.
      m_clean: :math:`\\hat m_{clean}`, the low class's mean energy (Eq. 3).
      m_noisy: :math:`\\hat m_{noisy}`, the high class's mean energy (Eq. 3).
      clean_fraction: the share of the valid energies below ``threshold``.
      degenerate: bool, fewer than two distinct valid energies: nothing to divide, and
        the other fields are not estimates (a caller keeps its previous calibration).
      separation: the share of the energies' variance the split explains, the
        between-class over the total sum of squares (Otsu's effectiveness measure, in
        ``[0, 1]``, invariant to ``E -> aE + c``): about 0.64 for one Gaussian, 0.75 for a
        uniform, near 1 for two well-separated groups; 0 when degenerate.
    """

    threshold: jax.Array
    m_clean: jax.Array
    m_noisy: jax.Array
    clean_fraction: jax.Array
    degenerate: jax.Array
    separation: jax.Array = 0.0


def calibrate_energy(energies: ArrayLike, *, where: ArrayLike | None = None) -> EnergyCalibration:
    r"""Energy threshold and margins from the energies themselves: the optimal two-class split.

    The valid energies are sorted and cut where the between-class sum of squares is largest
    (Otsu's threshold; the exact optimum of 2-means in 1-D, the start of a two-component
    mixture fit):

    .. math::
      k^\star = \arg\max_k\; k\,(n-k)\,(\bar E_{\le k} - \bar E_{> k})^2,\qquad
      \hat\tau = \tfrac12(E_{(k^\star)} + E_{(k^\star+1)}),\qquad
      \hat m_{clean} = \bar E_{\le k^\star},\quad \hat m_{noisy} = \bar E_{> k^\star}

    over the sorted energies :math:`E_{(1)} \le \dots \le E_{(n)}`, cutting only between
    distinct values (ties share a class; the lowest such cut wins a tie of the criterion).
    It replaces the paper's constants ``tau = -2``, ``m_clean = -4``, ``m_noisy = 0``:
    ``E < \hat\tau`` is the low (confident) class, and the energy-bounded loss pushes each
    pair beyond its class's mean. Every output moves with the energies under
    :math:`E \to aE + c` (:math:`a > 0`): the division is invariant to a shift of the
    logits (which shifts every energy by the same amount) and to the ``-log B`` every
    energy of a batch size carries.

    Args:
      energies: ``[N]`` energies (e.g. of one direction over the previous epoch).
      where: optional bool ``[N]``, the energies to use.

    Returns:
      :class:`EnergyCalibration`; with fewer than two distinct valid values ``degenerate``
      is set, the threshold is below every value and both margins are their mean.
    """
    x = jnp.asarray(energies)
    x = x.astype(jnp.result_type(x, jnp.float32))
    if x.ndim != 1:
        raise ValueError(f"energies must be [N], got shape {x.shape}")
    valid = valid_rows(x.shape[0], where)
    n = valid.sum()
    count = jnp.maximum(n, 1).astype(x.dtype)
    centre = jnp.where(valid, x, 0.0).sum() / count  # prefix sums of centred values
    order = jnp.argsort(jnp.where(valid, x, jnp.inf))
    sorted_x = jnp.where(valid[order], x[order] - centre, 0.0)
    k = jnp.arange(1, x.shape[0] + 1, dtype=x.dtype)  # size of the low class
    low_sum = jnp.cumsum(sorted_x)
    high_count = count - k
    mean_low = low_sum / k
    mean_high = -low_sum / jnp.maximum(high_count, 1.0)  # the centred values sum to 0
    nxt = jnp.concatenate([sorted_x[1:], sorted_x[-1:]])
    cut = (k < n) & (nxt > sorted_x)
    between = jnp.where(cut, k * high_count * (mean_low - mean_high) ** 2, -1.0)
    best = jnp.argmax(between)
    degenerate = ~cut.any()
    threshold = 0.5 * (sorted_x[best] + nxt[best])
    threshold = jnp.where(degenerate, sorted_x[0] - 1.0, threshold) + centre
    m_clean = jnp.where(degenerate, 0.0, mean_low[best]) + centre
    m_noisy = jnp.where(degenerate, 0.0, mean_high[best]) + centre
    fraction = jnp.where(degenerate, 0.0, k[best] / count)
    total = jnp.where(valid[order], sorted_x**2, 0.0).sum()
    separation = jnp.where(degenerate | (total <= 0), 0.0, between[best] / count / total)
    return EnergyCalibration(threshold, m_clean, m_noisy, fraction, degenerate, separation)


def degenerate_division(
    clean: ArrayLike, *, where: ArrayLike | None = None, every: bool = True
) -> jax.Array:
    """Whether a batch's clean split divides nothing: no real pair clean, or every one.

    Args:
      clean: bool ``[B]``, one direction's clean split.
      where: optional bool ``[B]``, the real pairs.
      every: whether every pair clean is degenerate too (static; ``True``). An energy
        split that keeps every pair has cut nothing; the partner test
        (:func:`partner_test_mask`) may keep every pair of a batch without mismatched
        pairs, and only an empty split divides nothing.

    Returns:
      bool scalar (``False`` for a batch without a real pair).
    """
    clean = jnp.asarray(clean, bool)
    valid = valid_rows(clean.shape[0], where)
    selected = (clean & valid).sum()
    none = selected == 0
    return valid.any() & ((none | (selected == valid.sum())) if every else none)
