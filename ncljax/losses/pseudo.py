r"""PC2's pseudo-classification objective: pseudo-label cross-entropy and an entropy term.

A pseudo-classifier maps each image (and caption) to ``K`` logits. The argmax of the caption's
prediction is the hard pseudo-label of the image's prediction (paper Eq. 2), and an entropy
term (Eq. 3, in one of three forms, see :func:`prediction_entropy_loss`) keeps the
predictions from collapsing or over-sharpening.

Every function returns ``[B]`` per-example *shares*: their mean over the real pairs (``where``)
is the objective. A padding pair gets 0 and no gradient; its logits are never read.

Equations: PC2 (Duan et al., ACM MM 2024), Sec. 4.2, Eqs. 2-3, and the official code
(``alipay/PC2-NoiseofWeb``, ``pc2/model.py``: ``NonContrastiveLoss`` and ``entropy``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import masking

_SG = jax.lax.stop_gradient
ENTROPY_MODES = ("code_sample", "marginal", "printed")
_LOG_CLAMP = 1e-8


def _logits(logits: ArrayLike, name: str) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"{name} must be [B, K], got shape {logits.shape}")
    return logits.astype(jnp.result_type(logits, jnp.float32))


_valid = masking.valid_rows


def _real_rows(logits: jax.Array, valid: jax.Array) -> jax.Array:
    """The logits with padding rows replaced by zeros (no NaN or gradient from padding)."""
    return jnp.where(valid[:, None], logits, 0.0)


def pseudo_label_cross_entropy(
    image_logits: ArrayLike,
    text_logits: ArrayLike,
    *,
    where: ArrayLike | None = None,
    center_targets: bool = False,
) -> jax.Array:
    r"""Cross-entropy of the image prediction against the caption's hard pseudo-label (Eq. 2).

    .. math::
      \hat q_i = \arg\max_k q_{ik}, \qquad
      \ell_i = H(\hat q_i, p_i) = -\log p_{i\hat q_i}, \qquad
      \mathcal L^{pse} = \frac1B \sum_i \ell_i

    with :math:`p_i = \mathrm{softmax}(\text{image logits}_i)` and
    :math:`q_i = \mathrm{softmax}(\text{text logits}_i)`. The argmax is taken on the text
    logits (the same class as on :math:`q`; ties go to the lowest class). The text path only
    supplies the target: no gradient reaches ``text_logits``. The code's text-side
    cross-entropy (image argmax as the caption's label) is computed there but never added to
    the loss, so it is absent here.

    ``center_targets=True`` (not in the paper or the code) takes the argmax of the caption
    logits minus their mean over the batch's real captions, :math:`\hat q_i = \arg\max_k
    (t_{ik} - \frac1n \sum_j t_{jk})`: a class that every caption favours (e.g. through the
    output bias) does not become every pair's label, so the labels stay sample-dependent (the
    centering of DINO's teacher, applied to the hard label).

    Args:
      image_logits: ``[B, K]`` pseudo-classifier logits of the images (gradient flows).
      text_logits: ``[B, K]`` logits of the captions (no gradient).
      where: optional bool ``[B]``, the real pairs.
      center_targets: centre the caption logits on the batch before the argmax.

    Returns:
      ``[B]`` per-example cross-entropy (>= 0), 0 at padding.

    References:
      Duan et al., "PC2: Pseudo-Classification Based Pseudo-Captioning for Noisy Correspondence
      Learning in Cross-Modal Retrieval", ACM MM 2024, Eq. 2.
    """
    image_logits = _logits(image_logits, "image_logits")
    text_logits = _logits(text_logits, "text_logits")
    if text_logits.shape != image_logits.shape:
        raise ValueError(
            f"text_logits must have the shape of image_logits {image_logits.shape}, "
            f"got {text_logits.shape}"
        )
    valid = _valid(image_logits.shape[0], where)
    text_logits = _SG(_real_rows(text_logits, valid))
    if center_targets:
        count = jnp.maximum(valid.sum(), 1).astype(text_logits.dtype)
        text_logits = text_logits - text_logits.sum(0) / count  # padding rows are zero
    target = jnp.argmax(text_logits, axis=1)
    log_p = jax.nn.log_softmax(_real_rows(image_logits, valid), axis=1)
    ce = -jnp.take_along_axis(log_p, target[:, None], axis=1)[:, 0]
    return jnp.where(valid, ce, 0.0)


def prediction_entropy_loss(
    image_logits: ArrayLike, *, mode: str = "code_sample", where: ArrayLike | None = None
) -> jax.Array:
    r"""The entropy term of the pseudo-classification objective, as per-example shares.

    Three forms, since the paper's Eq. 3 (Sec. 4.2) and the official code
    (``pc2/model.py``, ``entropy``) disagree, with
    :math:`p_i = \mathrm{softmax}(\text{image logits}_i)` and
    :math:`\bar p = \frac1n\sum_{i\ \mathrm{real}} p_i` the mean over the ``n`` real pairs:

    * ``'code_sample'`` (default, the official code): minus the mean per-example entropy,
      :math:`p` clamped at :math:`10^{-8}` inside the log,

      .. math:: \mathcal L^{ent} = \frac1n \sum_i \sum_k p_{ik}\log\max(p_{ik}, 10^{-8})
         = -\frac1n\sum_i H(p_i), \qquad s_i = \sum_k p_{ik}\log\max(p_{ik}, 10^{-8});

    * ``'marginal'`` (the intended SCAN form): minus the entropy of the batch-mean prediction,

      .. math:: \mathcal L^{ent} = -H(\bar p) = \sum_k \bar p_k \log \bar p_k, \qquad
         s_i = \sum_k p_{ik}\log\max(\bar p_k, 10^{-8});

    * ``'printed'`` (Eq. 3 as printed, added with :math:`+\lambda^{ent}`): :math:`+H(\bar p)`,

      .. math:: \mathcal L^{ent} = -\frac1n\sum_i p_i^\top \log \bar p = H(\bar p), \qquad
         s_i = -\sum_k p_{ik}\log\max(\bar p_k, 10^{-8}).

    The marginal shares are the summands of Eq. 3: since :math:`\frac1n\sum_i p_i = \bar p`,
    their mean over the real pairs is exactly :math:`\mp H(\bar p)`, value and gradient
    (:math:`\bar p` depends on every real row, so the gradient of one share reaches every real
    row). A share alone is not a per-example entropy. :math:`\bar p` is the mean over the real
    pairs of the batch passed in: the trainer's loss sees the global batch (on any number
    of devices), so it is the global batch's mean.

    Args:
      image_logits: ``[B, K]`` pseudo-classifier logits of the images (gradient flows).
      mode: ``'code_sample'``, ``'marginal'`` or ``'printed'``.
      where: optional bool ``[B]``, the real pairs.

    Returns:
      ``[B]`` shares whose mean over the real pairs is :math:`\mathcal L^{ent}`; 0 at padding.

    References:
      Duan et al., ACM MM 2024, Eq. 3; Van Gansbeke et al., "SCAN: Learning to Classify Images
      without Labels", ECCV 2020, Eq. 2 (the entropy of the mean prediction).
    """
    if mode not in ENTROPY_MODES:
        raise ValueError(f"entropy_mode must be one of {ENTROPY_MODES}, got {mode!r}")
    logits = _logits(image_logits, "image_logits")
    valid = _valid(logits.shape[0], where)
    p = jax.nn.softmax(_real_rows(logits, valid), axis=1)
    if mode == "code_sample":
        share = jnp.sum(p * jnp.log(jnp.maximum(p, _LOG_CLAMP)), axis=1)
    else:
        count = jnp.maximum(valid.sum(), 1).astype(p.dtype)
        p_bar = jnp.where(valid[:, None], p, 0.0).sum(0) / count
        share = p @ jnp.log(jnp.maximum(p_bar, _LOG_CLAMP))
        if mode == "printed":
            share = -share
    return jnp.where(valid, share, 0.0)


def pseudo_classification_loss(
    image_logits: ArrayLike,
    text_logits: ArrayLike,
    *,
    entropy_weight: float = 10.0,
    entropy_mode: str = "code_sample",
    where: ArrayLike | None = None,
    center_targets: bool = False,
) -> jax.Array:
    r"""The pseudo-classification objective of a clean (or warm-up) batch, per example.

    .. math:: \mathcal L = \mathcal L^{pse} + \lambda^{ent}\,\mathcal L^{ent}

    (:func:`pseudo_label_cross_entropy` plus the shares of :func:`prediction_entropy_loss`),
    with :math:`\lambda^{pse} = 1` and :math:`\lambda^{ent} = 10` (the run commands; the
    argparse default is 1).

    Args:
      image_logits: ``[B, K]`` pseudo-classifier logits of the images (gradient flows).
      text_logits: ``[B, K]`` logits of the captions (targets only, no gradient).
      entropy_weight: :math:`\lambda^{ent}` (10).
      entropy_mode: ``'code_sample'`` (default), ``'marginal'`` or ``'printed'``.
      where: optional bool ``[B]``, the real pairs.
      center_targets: see :func:`pseudo_label_cross_entropy` (off: the paper and the code).

    Returns:
      ``[B]`` shares whose mean over the real pairs is :math:`\mathcal L`; 0 at padding.

    References:
      Duan et al., ACM MM 2024, Eqs. 2, 3 and 10.
    """
    ce = pseudo_label_cross_entropy(
        image_logits, text_logits, where=where, center_targets=center_targets
    )
    ent = prediction_entropy_loss(image_logits, mode=entropy_mode, where=where)
    return ce + entropy_weight * ent
