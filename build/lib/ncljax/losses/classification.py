"""Prototype classification losses in the common embedding space (UOT-RCL, MRL practice).

Every loss is returned per example, shape ``[B]``, and is never reduced over the batch. These
losses have no in-batch interactions, so masking is a plain multiplication by the caller.
"""

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

# Lower bound on a prototype's norm, as in torch.nn.functional.normalize; it keeps the value and
# the gradient finite for an all-zero prototype.
_NORM_EPS = 1e-12


def prototype_logits(
    z: ArrayLike,
    prototypes: ArrayLike,
    *,
    temperature: float | ArrayLike = 1.0,
) -> jax.Array:
    r"""Class logits as scaled cosine scores against unit-normalised class prototypes.

    .. math::

        x_{bk} = \frac{\hat\mu_k^\top z_b}{\tau_1}, \qquad
        \hat\mu_k = \frac{\mu_k}{\max(\lVert\mu_k\rVert_2, \epsilon)}

    so that :math:`\operatorname{softmax}_k(x_{b\cdot}) = p(k \mid x_b)`.

    Args:
      z: ``[B, L]`` embeddings, assumed already L2-normalised (not normalised here).
      prototypes: ``[K, L]`` class prototypes :math:`\mu`; normalised row-wise here.
      temperature: :math:`\tau_1` (scalar). Default 1.0.

    Returns:
      ``[B, K]`` logits.

    References:
      Han et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval with Noisy
      Labels" (UOT-RCL), 2024, Eq. 1.
    """
    z = jnp.asarray(z)
    prototypes = jnp.asarray(prototypes)
    dtype = jnp.result_type(z, prototypes, float)
    z = z.astype(dtype)
    prototypes = prototypes.astype(dtype)
    # rsqrt(max(|mu|^2, eps^2)) instead of mu / |mu|: the gradient of the norm is 0/0 at zero.
    squared_norm = jnp.sum(jnp.square(prototypes), axis=-1, keepdims=True)
    unit_prototypes = prototypes * jax.lax.rsqrt(jnp.maximum(squared_norm, _NORM_EPS**2))
    return (z @ unit_prototypes.T) / temperature


def soft_cross_entropy(logits: ArrayLike, targets: ArrayLike) -> jax.Array:
    r"""Cross-entropy between (possibly unnormalised) target rows and softmax class posteriors.

    .. math::

        \ell_b = -\sum_{k=1}^{K} q_{bk} \log \operatorname{softmax}_k(x_{b\cdot})

    Targets are used as given, without renormalisation; UOT-RCL feeds it rows of the partial-OT
    plan, whose mass is below 1 for the samples it trusts less.

    Args:
      logits: ``[B, K]`` class logits.
      targets: ``[B, K]`` non-negative targets :math:`q`.

    Returns:
      ``[B]`` per-example loss.

    References:
      Han et al., UOT-RCL, 2024, Eq. 15 (with :math:`q = N\hat Y`).
    """
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, float))
    targets = jnp.asarray(targets, dtype=logits.dtype)
    if targets.shape != logits.shape:
        raise ValueError(f"targets must have shape {logits.shape}, got {targets.shape}")
    return optax.softmax_cross_entropy(logits, targets)


def _class_nll(logits: jax.Array, labels: ArrayLike) -> jax.Array:
    """Negative log-likelihood ``[B]`` of hard class ids ``[B]`` or soft targets ``[B, K]``."""
    labels = jnp.asarray(labels)
    if labels.ndim == 2:
        return soft_cross_entropy(logits, labels)
    if labels.ndim != 1 or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"labels must be int [B] class ids or float [B, K] targets, got {labels.dtype} "
            f"{labels.shape}"
        )
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def prototype_cross_entropy(
    z_image: ArrayLike,
    z_text: ArrayLike,
    prototypes: ArrayLike,
    labels_image: ArrayLike,
    labels_text: ArrayLike | None = None,
    *,
    temperature: float | ArrayLike = 1.0,
) -> jax.Array:
    r"""Per-example prototype cross-entropy, summed over the image and text modalities.

    .. math::

        \ell_b = -\big(\log p^v_{b,\tilde y^v_b} + \log p^t_{b,\tilde y^t_b}\big), \qquad
        p^m_{b\cdot} = \operatorname{softmax}\big(\hat\mu z^m_b / \tau_1\big)

    With soft labels each term becomes :math:`-\sum_k q^m_{bk} \log p^m_{bk}`. The two modality
    terms are summed, not averaged, as in the paper; averaging would change the meaning of the
    weights that combine this loss with others.

    Args:
      z_image: ``[B, L]`` L2-normalised image embeddings :math:`z^v`.
      z_text: ``[B, L]`` L2-normalised text embeddings :math:`z^t`.
      prototypes: ``[K, L]`` class prototypes, normalised row-wise inside.
      labels_image: int ``[B]`` class ids or float ``[B, K]`` soft targets for the images.
      labels_text: int ``[B]`` or float ``[B, K]`` labels for the texts. Default:
        ``labels_image``.
      temperature: :math:`\tau_1` (scalar). Default 1.0.

    Returns:
      ``[B]`` per-example loss.

    References:
      Han et al., "A Unified Optimal Transport Framework for Cross-Modal Retrieval with Noisy
      Labels" (UOT-RCL), 2024, Eqs. 1-2.
    """
    if labels_text is None:
        labels_text = labels_image
    logits_image = prototype_logits(z_image, prototypes, temperature=temperature)
    logits_text = prototype_logits(z_text, prototypes, temperature=temperature)
    return _class_nll(logits_image, labels_image) + _class_nll(logits_text, labels_text)
