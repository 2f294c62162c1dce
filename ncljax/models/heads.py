"""Similarity and classification heads (Flax NNX)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ncljax.losses import classification
from ncljax.models import linear


def cosine_similarity(image_emb: jax.Array, text_emb: jax.Array) -> jax.Array:
    """Image-by-caption cosine similarity of unit vectors.

    Args:
      image_emb: ``[n_img, D]`` L2-normalised image embeddings.
      text_emb: ``[n_txt, D]`` L2-normalised caption embeddings.

    Returns:
      ``sim`` ``[n_img, n_txt]`` with ``sim[i, c] = <image_i, caption_c>``.
    """
    return image_emb @ text_emb.T


def _orthonormal_rows(key: jax.Array, num_rows: int, dim: int) -> jax.Array:
    """``num_rows`` orthonormal vectors in ``R^dim`` (random unit vectors if ``num_rows > dim``)."""
    if num_rows > dim:
        x = jax.random.normal(key, (num_rows, dim))
        return x / jnp.linalg.norm(x, axis=1, keepdims=True)
    q, _ = jnp.linalg.qr(jax.random.normal(key, (dim, dim)))
    return q[:, :num_rows].T


class Prototypes(nnx.Module):
    """``K`` learnable class prototypes on the unit sphere (UOT-RCL/MRL classifier).

    Initialised as orthonormal rows (MRL practice, needs ``K <= dim``); renormalised on
    every use, so they act as unit vectors whatever the optimiser does to their length.
    Logits are ``mu_k^T z / temperature`` (UOT-RCL Eq. 1).
    """

    def __init__(self, num_classes: int, dim: int, *, temperature: float = 1.0, rngs: nnx.Rngs):
        self.prototypes = nnx.Param(_orthonormal_rows(rngs.params(), num_classes, dim))
        self.temperature = temperature

    def __call__(self, z: jax.Array) -> jax.Array:
        """Class logits ``[B, K]`` of unit embeddings ``z`` ``[B, dim]``."""
        return classification.prototype_logits(
            z, self.prototypes[...], temperature=self.temperature
        )


def _torch_linear(in_dim: int, out_dim: int, rngs: nnx.Rngs) -> nnx.Linear:
    """A linear layer with PyTorch's default initialisation: weights and biases
    ``U(-1/sqrt(in_dim), 1/sqrt(in_dim))``."""
    bound = 1.0 / np.sqrt(in_dim)

    def bias_init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return nnx.Linear(
        in_dim,
        out_dim,
        kernel_init=nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
        bias_init=bias_init,
        dot_general=linear.dot_general,
        rngs=rngs,
    )


class PseudoClassifier(nnx.Module):
    """PC2's pseudo-classifier ``C``: a two-layer MLP ``W2 relu(W1 x + b1) + b2`` to ``K`` logits.

    No normalisation; PyTorch's default initialisation (``U(+-1/sqrt(fan_in))`` for weights
    and biases), as the official code. One head serves both modalities of a network: its
    image input gives the predictions that are trained, its caption input only the hard
    pseudo-labels (``ncljax.losses.pseudo_classification_loss``).

    What it reads depends on the backbone (``ncljax.methods.pc2`` builds it):

    * SGR/SAF heads: the ``R`` region embeddings of an image flattened region-major
      (``R * D`` inputs: ``36 * 1024 = 36864`` in the paper's setting, about 9.4M
      parameters), and a caption's word embeddings resampled to ``R`` positions
      (``ncljax.labels.resample_to_fixed``) and flattened the same way;
    * the cosine head, over region/token inputs or over global feature vectors: the
      image and caption embeddings (``D`` inputs).
    """

    def __init__(self, in_dim: int, num_classes: int = 128, *, hidden: int = 256, rngs: nnx.Rngs):
        if min(in_dim, num_classes, hidden) < 1:
            raise ValueError(
                f"PseudoClassifier sizes must be positive, got in_dim={in_dim}, "
                f"num_classes={num_classes}, hidden={hidden}."
            )
        self.hidden = _torch_linear(in_dim, hidden, rngs)
        self.out = _torch_linear(hidden, num_classes, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits ``[B, K]`` of inputs ``x`` ``[B, in_dim]``."""
        return self.out(jax.nn.relu(self.hidden(x)))


def num_params(state) -> int:
    """Number of scalars in a state pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))
