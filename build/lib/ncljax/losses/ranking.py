"""Hinge triplet ranking losses over an in-batch image-by-caption similarity matrix.

Convention: ``sim[b, c]`` is the similarity of image ``b`` and caption ``c``; pair ``b`` (image
``b``, caption ``b``) is the positive and sits on the diagonal. Every loss is returned per pair,
shape ``[B]``, and is never reduced over the batch.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import masking


def _negative_mask(num: int, where: ArrayLike | None) -> jax.Array:
    """Bool ``[B, B]``: True where query ``b`` is real, candidate ``c`` is real and ``c != b``."""
    off_diagonal = ~jnp.eye(num, dtype=bool)
    if where is None:
        return off_diagonal
    where = masking.valid_rows(num, where)
    return off_diagonal & where[:, None] & where[None, :]


_MARGIN_OF = ("positive", "image", "caption")


def hinge_costs(
    sim: ArrayLike,
    margin: float | ArrayLike = 0.2,
    *,
    where: ArrayLike | None = None,
    margin_of: str = "positive",
) -> tuple[jax.Array, jax.Array]:
    r"""Hinge cost of every in-batch negative, in both retrieval directions.

    .. math::

        C^{i2t}_{bc} = [\alpha_b + s(i_b, t_c) - s(i_b, t_b)]_+, \qquad
        C^{t2i}_{bi} = [\alpha_b + s(i_i, t_b) - s(i_b, t_b)]_+, \qquad c, i \neq b.

    Row ``b`` of ``cost_i2t`` holds image ``b`` as the query against the negative captions ``c``;
    row ``b`` of ``cost_t2i`` holds caption ``b`` as the query against the negative images ``i``.
    Both are zero on the diagonal, in every column whose negative is masked out, and in every row
    whose own example is masked out.

    A ``[B, B]`` margin gives every image-caption pairing its own margin, used by the terms of
    both directions that pair them: :math:`\alpha_{bc}` for image ``b`` against caption ``c``,
    :math:`\alpha_{ib}` for caption ``b`` against image ``i`` (the official NCR code's clean
    margins, ``ncljax.labels.ncr.rectified_label_matrix``).

    Args:
      sim: ``[B, B]`` image-by-caption similarities; positives on the diagonal.
      margin: the margin :math:`\alpha`: a scalar, a per-pair ``[B]`` array of soft margins, or
        a ``[B, B]`` array ``margin[i, c]`` for the terms that pair image ``i`` with caption
        ``c``. Default 0.2.
      where: optional bool ``[B]``, True for real examples. Masked examples are never used as
        negatives and their own rows are zero. Default: all real.
      margin_of: whose margin a per-pair margin term uses. ``'positive'`` (default, the papers):
        the query's own pair, :math:`\alpha_b` in both directions. ``'image'``: the image's
        (the official NCR code's ``[B, 1]`` margins): :math:`\alpha_b` for image ``b``'s i2t
        terms, :math:`\alpha_i` for caption ``b``'s t2i term against image ``i``.
        ``'caption'``: the caption's (a ``[B]`` row, as PC2's noisy-pair loss): :math:`\alpha_c`
        for image ``b``'s i2t term against caption ``c``, :math:`\alpha_b` for caption ``b``.
        A ``[B, B]`` margin already names each term's margin and takes only ``'positive'``.

    Returns:
      ``(cost_i2t, cost_t2i)``, each ``[B, B]`` and non-negative.

    References:
      Faghri et al., "VSE++: Improving Visual-Semantic Embeddings with Hard Negatives", BMVC 2018,
      Sec. 3.1 (the hinge terms of the sum-of-hinges and max-of-hinges losses, Eq. 5).
    """
    sim = jnp.asarray(sim)
    sim = sim.astype(jnp.result_type(sim, float))
    if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"sim must be square [B, B], got {sim.shape}")
    if margin_of not in _MARGIN_OF:
        raise ValueError(f"margin_of must be one of {_MARGIN_OF}, got {margin_of!r}")
    num = sim.shape[0]
    positive = jnp.diagonal(sim)
    margin = jnp.asarray(margin, dtype=sim.dtype)
    valid = _negative_mask(num, where)
    if margin.ndim == 2:
        if margin.shape != (num, num):
            raise ValueError(f"a matrix margin must have shape ({num}, {num}), got {margin.shape}")
        if margin_of != "positive":
            raise ValueError(
                f"margin_of={margin_of!r} applies to a [B] margin; a [B, B] margin already "
                "names each term's margin (leave margin_of='positive')"
            )
        margin_i2t, margin_t2i = margin, margin.T  # [image, caption], [caption, image]
    else:
        margin = jnp.broadcast_to(margin, (num,))
        own, other = margin[:, None], margin[None, :]  # [b, c]: the query b's, the candidate's
        margin_i2t = other if margin_of == "caption" else own
        margin_t2i = other if margin_of == "image" else own
    cost_i2t = jnp.where(valid, jax.nn.relu(margin_i2t - positive[:, None] + sim), 0.0)
    cost_t2i = jnp.where(valid, jax.nn.relu(margin_t2i - positive[:, None] + sim.T), 0.0)
    return cost_i2t, cost_t2i


def triplet_hardest(
    sim: ArrayLike,
    margin: float | ArrayLike = 0.2,
    *,
    where: ArrayLike | None = None,
    margin_of: str = "positive",
) -> jax.Array:
    r"""Hinge triplet loss with the hardest in-batch negative (VSE++, max of hinges).

    .. math::

        \ell_b = \max_{c \neq b} [\alpha_b + s(i_b, t_c) - s(i_b, t_b)]_+
               + \max_{i \neq b} [\alpha_b + s(i_i, t_b) - s(i_b, t_b)]_+

    Args:
      sim: ``[B, B]`` image-by-caption similarities; positives on the diagonal.
      margin: scalar, per-pair ``[B]`` or per-pairing ``[B, B]`` margin :math:`\alpha` (see
        ``hinge_costs``). Default 0.2.
      where: optional bool ``[B]``, True for real examples; masked examples are never negatives
        and their own loss is 0. Default: all real.
      margin_of: whose per-pair margin each term uses (see ``hinge_costs``).

    Returns:
      ``[B]`` per-pair loss (0 when a pair has no real negative, e.g. ``B == 1``).

    References:
      Faghri et al., "VSE++: Improving Visual-Semantic Embeddings with Hard Negatives", BMVC 2018,
      Eq. 5.
    """
    cost_i2t, cost_t2i = hinge_costs(sim, margin, where=where, margin_of=margin_of)
    # Costs are >= 0 and excluded entries are exactly 0, so a plain max over the row is the max
    # over real negatives, and 0 when there are none.
    return jnp.max(cost_i2t, axis=1) + jnp.max(cost_t2i, axis=1)


def triplet_sum(
    sim: ArrayLike,
    margin: float | ArrayLike = 0.2,
    *,
    where: ArrayLike | None = None,
    margin_of: str = "positive",
) -> jax.Array:
    r"""Hinge triplet loss summed over all in-batch negatives (VSE0, sum of hinges).

    .. math::

        \ell_b = \sum_{c \neq b} [\alpha_b + s(i_b, t_c) - s(i_b, t_b)]_+
               + \sum_{i \neq b} [\alpha_b + s(i_i, t_b) - s(i_b, t_b)]_+

    Args:
      sim: ``[B, B]`` image-by-caption similarities; positives on the diagonal.
      margin: scalar, per-pair ``[B]`` or per-pairing ``[B, B]`` margin :math:`\alpha` (see
        ``hinge_costs``). Default 0.2.
      where: optional bool ``[B]``, True for real examples; masked examples are never negatives
        and their own loss is 0. Default: all real.
      margin_of: whose per-pair margin each term uses (see ``hinge_costs``).

    Returns:
      ``[B]`` per-pair loss.

    References:
      Kiros et al., "Unifying Visual-Semantic Embeddings with Multimodal Neural Language Models",
      2014 (pairwise ranking objective); Faghri et al., VSE++, BMVC 2018, Sec. 3.1 (the
      sum-of-hinges loss that Eq. 5 replaces).
    """
    cost_i2t, cost_t2i = hinge_costs(sim, margin, where=where, margin_of=margin_of)
    return jnp.sum(cost_i2t, axis=1) + jnp.sum(cost_t2i, axis=1)


def triplet_mean(
    sim: ArrayLike,
    margin: float | ArrayLike = 0.2,
    *,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""Hinge triplet loss averaged over the batch: NCR's per-pair warm-up and co-divide loss.

    .. math::

        \ell_b = \frac{1}{B} \sum_{c \neq b} [\alpha + s(i_b, t_c) - s(i_b, t_b)]_+
               + \frac{1}{B} \sum_{i \neq b} [\alpha + s(i_i, t_b) - s(i_b, t_b)]_+

    ``B`` is the number of real pairs: the official code averages over all ``B`` columns
    (rows) of its unpadded batch, the zeroed diagonal included.

    Args:
      sim: ``[B, B]`` image-by-caption similarities; positives on the diagonal.
      margin: scalar or per-pair ``[B]`` margin :math:`\alpha`. Default 0.2.
      where: optional bool ``[B]``, True for real examples. Default: all real.

    Returns:
      ``[B]`` per-pair loss (0 for padding).

    References:
      Huang et al., "Learning with Noisy Correspondence for Cross-modal Matching", NeurIPS
      2021, Eq. 3 (co-divide loss; the official code's ``eval_loss`` and ``warmup`` modes).
    """
    sim = jnp.asarray(sim)
    count = sim.shape[0] if where is None else jnp.asarray(where, bool).sum()
    return triplet_sum(sim, margin, where=where) / jnp.maximum(count, 1)


SOFT_MARGINS = ("linear", "exponential", "sin")


def soft_margin(labels: ArrayLike, margin: float = 0.2, *, kind: str = "exponential") -> jax.Array:
    r"""NCR's soft margin of each pair from its correspondence label :math:`\hat y \in [0, 1]`.

    .. math::

        \hat\alpha = \alpha \hat y \;(\text{linear}), \qquad
        \hat\alpha = \alpha \frac{10^{\hat y} - 1}{9} \;(\text{exponential}), \qquad
        \hat\alpha = \alpha \frac{\sin(\pi \hat y - \pi / 2) + 1}{2} \;(\text{sin})

    Args:
      labels: ``[B]`` (soft) correspondence labels, or any shape (elementwise; ``[B, B]`` for
        the official NCR code's clean labels).
      margin: the full margin :math:`\alpha` of a clean pair. Default 0.2.
      kind: ``'exponential'`` (NCR's default, the paper's ``m = 10``), ``'linear'`` or
        ``'sin'`` (the official code's third curve).

    Returns:
      margins of the shape of ``labels``, 0 at :math:`\hat y = 0` and :math:`\alpha` at
      :math:`\hat y = 1`.

    References:
      Huang et al., NeurIPS 2021, Eq. 5 and Sec. 3.3 (adaptive margin); PC2 (Duan et al.,
      ACM MM 2024), Eqs. 5 and 8 with ``m = 10``.
    """
    y = jnp.asarray(labels)
    y = y.astype(jnp.result_type(y, float))
    if kind == "linear":
        return margin * y
    if kind == "exponential":
        return margin * (10.0**y - 1.0) / 9.0
    if kind == "sin":
        return margin * (jnp.sin(jnp.pi * y - jnp.pi / 2) + 1.0) / 2.0
    raise ValueError(f"soft margin kind must be one of {SOFT_MARGINS}, got {kind!r}")
