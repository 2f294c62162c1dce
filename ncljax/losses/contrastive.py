"""InfoNCE (softmax cross-entropy over in-batch candidates) with hard or soft targets.

Convention: ``sim[b, c]`` is the similarity of image ``b`` and caption ``c``; pair ``b`` sits on the
diagonal. Every loss is returned per query, shape ``[B]``, and is never reduced over the batch.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import masking


def info_nce(
    logits: ArrayLike,
    targets: ArrayLike | None = None,
    *,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""One-direction InfoNCE: cross-entropy of each query row against in-batch candidates.

    .. math::

        \ell_b = -\sum_{c \in \mathcal{V}} y_{bc}
            \log \frac{\exp(x_{bc})}{\sum_{c' \in \mathcal{V}} \exp(x_{bc'})},
        \qquad \mathcal{V} = \{c : \mathrm{where}_c\}

    Masked-out columns are excluded from the softmax and from the target sum. Soft targets are
    used as given: rows need not sum to 1 and are not renormalised.

    Args:
      logits: ``[B, B]`` scores; row ``b`` is query ``b``, column ``c`` is candidate ``c``.
      targets: optional ``[B, B]`` non-negative targets :math:`y`. Default: the identity (the
        positive of query ``b`` is candidate ``b``).
      where: optional bool ``[B]``, True for real examples. A masked example is never a candidate
        for the others and its own loss is 0. Default: all real.

    Returns:
      ``[B]`` per-query loss.

    References:
      van den Oord et al., "Representation Learning with Contrastive Predictive Coding", 2018,
      Eq. 4; Radford et al., "Learning Transferable Visual Models From Natural Language
      Supervision" (CLIP), 2021, Fig. 3.
    """
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, float))
    if logits.ndim != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"logits must be square [B, B], got {logits.shape}")
    num = logits.shape[0]
    if targets is not None:
        targets = jnp.asarray(targets, dtype=logits.dtype)
        if targets.shape != logits.shape:
            raise ValueError(f"targets must have shape {logits.shape}, got {targets.shape}")
    where = masking.valid_rows(num, where)

    column_ok = where[None, :]
    masked_logits = jnp.where(column_ok, logits, -jnp.inf)
    # A masked query row is replaced by zeros so its softmax stays finite (even when every
    # example is masked) and neither its values nor its gradient can leak NaN; its loss is
    # zeroed below anyway.
    masked_logits = jnp.where(where[:, None], masked_logits, 0.0)
    if targets is None:
        # The identity's cross-entropy is logsumexp(row) - x_bb: no [B, B] target product
        # (the step's largest B x B term after the logits at batch 4096).
        loss = jax.nn.logsumexp(masked_logits, axis=-1) - jnp.diagonal(masked_logits)
        return jnp.where(where, loss, 0.0)
    log_prob = jax.nn.log_softmax(masked_logits, axis=-1)
    # Excluded columns hold -inf; replace them before multiplying so 0 * -inf cannot give NaN,
    # in the value or in the gradient with respect to the targets.
    log_prob = jnp.where(column_ok, log_prob, 0.0)
    loss = -jnp.sum(targets * log_prob, axis=-1)
    return jnp.where(where, loss, 0.0)


def symmetric_info_nce(
    sim: ArrayLike,
    *,
    temperature: float | ArrayLike = 1.0,
    targets: ArrayLike | None = None,
    targets_t2i: ArrayLike | None = None,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""Image-to-text and text-to-image InfoNCE averaged per pair (CLIP loss, unreduced).

    .. math::

        \ell_b = \tfrac12\Big[-\sum_c y^{i2t}_{bc}\log\operatorname{softmax}_c(s_{b\cdot}/\tau)
                 -\sum_i y^{t2i}_{bi}\log\operatorname{softmax}_i(s_{\cdot b}/\tau)\Big]

    With hard targets this is GSC's :math:`\tfrac12[-\log p^{i2t}_b - \log p^{t2i}_b]` (GSC
    applies it to sigmoid similarities with :math:`\tau = 0.07` and weights it by the label
    :math:`y_b` outside). UOT-RCL's matching loss uses soft targets and *sums* the two
    directions, which is twice this value.

    Args:
      sim: ``[B, B]`` image-by-caption similarities; positives on the diagonal.
      temperature: softmax temperature :math:`\tau` (scalar). Default 1.0.
      targets: optional ``[B, B]`` image-to-text targets; row ``b`` is image ``b`` and column ``c``
        is caption ``c``. Default: the identity.
      targets_t2i: optional ``[B, B]`` text-to-image targets; row ``b`` is caption ``b`` and
        column ``i`` is image ``i``. Default: ``targets.T`` (the identity if ``targets`` is None).
      where: optional bool ``[B]``, True for real pairs. A masked pair is never a negative in
        either direction and its own loss is 0. Default: all real.

    Returns:
      ``[B]`` per-pair loss, indexed by pair ``b`` in both directions.

    References:
      van den Oord et al., "Representation Learning with Contrastive Predictive Coding", 2018,
      Eq. 4; Radford et al., CLIP, 2021, Fig. 3; Zhao et al., "Mitigating Noisy Correspondence
      by Geometrical Structure Consistency Learning" (GSC), CVPR 2024, Eq. 6 (hard targets); Han
      et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval with Noisy Labels"
      (UOT-RCL), 2024, Eq. 18 (soft matching targets).
    """
    sim = jnp.asarray(sim)
    sim = sim.astype(jnp.result_type(sim, float))
    logits = sim / temperature
    if targets is None and targets_t2i is None:
        loss_i2t, loss_t2i = info_nce_directions(logits, where=where)
        return 0.5 * (loss_i2t + loss_t2i)
    if targets_t2i is None and targets is not None:
        targets_t2i = jnp.asarray(targets).T
    loss_i2t = info_nce(logits, targets, where=where)
    loss_t2i = info_nce(logits.T, targets_t2i, where=where)
    return 0.5 * (loss_i2t + loss_t2i)


def info_nce_directions(logits: ArrayLike, *, where: ArrayLike | None = None):
    r"""Both directions' InfoNCE with the identity's targets, ``(i2t [B], t2i [B])``:
    :func:`info_nce` of ``logits`` and of ``logits.T``, the second reduced down the columns
    of ``logits`` instead of along the rows of a transposed copy (at ``B = 4096`` on a CPU
    the copy and its gradient's cost more than the loss: ``benchmarks/RESULTS.md``).

    .. math:: \ell^{i2t}_b = \operatorname{lse}_c x_{bc} - x_{bb}, \qquad
       \ell^{t2i}_b = \operatorname{lse}_i x_{ib} - x_{bb}

    over the real candidates (``where``); 0 at padding.

    Args:
      logits: ``[B, B]`` scores, rows images, columns captions, pairs on the diagonal.
      where: optional bool ``[B]``, the real pairs.

    Returns:
      ``(i2t, t2i)``, ``[B]`` each.
    """
    loss_i2t = info_nce(logits, where=where)  # checks the shape and casts
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, float))
    valid = masking.valid_rows(logits.shape[0], where)
    # As info_nce, down the columns: a masked pair is no candidate, and a masked query's
    # column is zeros, so its softmax stays finite; its loss is zeroed below.
    t2i = jnp.where(valid[None, :], jnp.where(valid[:, None], logits, -jnp.inf), 0.0)
    loss_t2i = jax.nn.logsumexp(t2i, axis=0) - jnp.diagonal(logits)
    return loss_i2t, jnp.where(valid, loss_t2i, 0.0)
