"""Feature encoders (Flax NNX): MLP over global features, region encoder, Bi-GRU text encoder."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ncljax.models import linear


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-8) -> jax.Array:
    """``x / max(||x||_2, eps)`` along ``axis``.

    Equal to SGRAF's ``x / (||x|| + eps)`` up to ``eps``; written with ``rsqrt`` of a
    floored squared norm so that the gradient at ``x = 0`` is finite (``d||x||`` is not).
    """
    squared = jnp.sum(x * x, axis=axis, keepdims=True)
    return x * jax.lax.rsqrt(jnp.maximum(squared, eps * eps))


def _linear_stack(dims: Sequence[int], rngs: nnx.Rngs) -> nnx.List:
    return nnx.List(
        [
            nnx.Linear(a, b, dot_general=linear.dot_general, rngs=rngs)
            for a, b in itertools.pairwise(dims)
        ]
    )


def _apply_stack(layers: nnx.List, x: jax.Array) -> jax.Array:
    """Linear layers with ReLU between them (none after the last)."""
    for layer in layers[:-1]:
        x = jax.nn.relu(layer(x))
    return layers[-1](x)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` ``[B, L, D]`` over positions where ``mask`` ``[B, L]`` is true."""
    weights = mask.astype(x.dtype)[..., None]
    return (x * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)


def _uniform_init(scale: float):
    """``U(-scale, scale)`` initialiser (SGRAF word embeddings use 0.1)."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


class MLPEncoder(nnx.Module):
    """Linear-ReLU stack with an L2-normalised output (UOT-RCL/MRL modality encoder).

    ``z = l2(W_n relu(... relu(W_1 x)))``; the defaults are UOT-RCL's three layers
    ``d -> 4096 -> 4096 -> 512`` (UOT-RCL Sec. V-B, MRL's architecture). Flax's LeCun-normal
    init is used, not PyTorch's Kaiming-uniform of the MRL code (``penghu-cs/MRL``); the
    paper states no init.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 512,
        hidden: Sequence[int] = (4096, 4096),
        *,
        rngs: nnx.Rngs,
    ):
        self.layers = _linear_stack((in_dim, *hidden, out_dim), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Encodes ``x`` ``[B, in_dim]`` to unit vectors ``[B, out_dim]``."""
        return l2_normalize(_apply_stack(self.layers, x))


class RegionEncoder(nnx.Module):
    """Per-region projection, then mean pooling and L2 normalisation.

    ``v_r = l2(W x_r + c)`` are the region features used by attention heads (SCAN/SGRAF
    image encoder); the pooled embedding is ``l2(mean_r (W x_r + c))``. With ``hidden``
    non-empty, a ReLU MLP replaces the single linear map.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden: Sequence[int] = (), *, rngs: nnx.Rngs):
        self.layers = _linear_stack((in_dim, *hidden, out_dim), rngs)

    def __call__(self, regions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Encodes ``regions`` ``[B, R, in_dim]``.

        Returns:
          ``(region_features [B, R, out_dim], pooled [B, out_dim])``, both L2-normalised.
        """
        x = _apply_stack(self.layers, regions)
        return l2_normalize(x), l2_normalize(x.mean(1))


class GRU(nnx.Module):
    r"""One direction of a GRU with PyTorch's equations and initialisation.

    .. math::
      r = \sigma(W_{ir} x + b_{ir} + W_{hr} h + b_{hr}),\quad
      z = \sigma(W_{iz} x + b_{iz} + W_{hz} h + b_{hz}),

      n = \tanh(W_{in} x + b_{in} + r \odot (W_{hn} h + b_{hn})),\quad
      h' = (1 - z) \odot n + z \odot h.

    Unlike Flax's ``GRUCell``, the recurrent projection has a bias (``b_hn`` sits inside the
    reset gate), so PyTorch (SGRAF/NCR) weights map one to one. All weights and biases
    start as ``U(-1/sqrt(H), 1/sqrt(H))``. The input projection of every time step is one
    matrix product outside the scan; only the recurrent one runs step by step.
    """

    def __init__(self, in_dim: int, hidden: int, *, rngs: nnx.Rngs):
        init = _uniform_init(1.0 / float(hidden) ** 0.5)
        self.input_kernel = nnx.Param(init(rngs.params(), (in_dim, 3 * hidden)))
        self.input_bias = nnx.Param(init(rngs.params(), (3 * hidden,)))
        self.hidden_kernel = nnx.Param(init(rngs.params(), (hidden, 3 * hidden)))
        self.hidden_bias = nnx.Param(init(rngs.params(), (3 * hidden,)))
        self.hidden = hidden

    def __call__(self, x: jax.Array) -> jax.Array:
        """States ``[B, L, H]`` of the sequence ``x`` ``[B, L, in_dim]`` read left to right."""
        gates_x = x @ self.input_kernel[...] + self.input_bias[...]  # [B, L, 3H]
        w_h, b_h = self.hidden_kernel[...], self.hidden_bias[...]

        def step(h, gx):
            gx_r, gx_z, gx_n = jnp.split(gx, 3, axis=-1)
            gh_r, gh_z, gh_n = jnp.split(h @ w_h + b_h, 3, axis=-1)
            r = jax.nn.sigmoid(gx_r + gh_r)
            z = jax.nn.sigmoid(gx_z + gh_z)
            n = jnp.tanh(gx_n + r * gh_n)
            h = (1.0 - z) * n + z * h
            return h, h

        h0 = jnp.zeros((x.shape[0], self.hidden), gates_x.dtype)
        with jax.named_scope("gru"):  # profiles count the recurrent scan by this name
            _, states = jax.lax.scan(step, h0, jnp.swapaxes(gates_x, 0, 1))
        return jnp.swapaxes(states, 0, 1)


def _reverse_valid(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """Reverses the first ``lengths[b]`` positions of each row of ``x`` ``[B, L, ...]``.

    Applied twice it is the identity; padding positions stay where they are.
    """
    positions = jnp.arange(x.shape[1])[None, :]
    source = jnp.where(positions < lengths[:, None], lengths[:, None] - 1 - positions, positions)
    return jnp.take_along_axis(x, source.reshape(source.shape + (1,) * (x.ndim - 2)), axis=1)


class GRUTextEncoder(nnx.Module):
    """Word embedding, dropout and a one-layer bidirectional GRU over token ids.

    Word features are ``u_l = l2((h_fwd_l + h_bwd_l) / 2)`` (SGRAF's text encoder); the
    backward GRU starts at each caption's last valid token (PyTorch's packed sequences), so
    padding never leaks into valid positions. Padded positions of the word features are
    zero. The pooled embedding is ``l2(mean over valid words of (h_fwd_l + h_bwd_l) / 2)``.
    Embeddings start as ``U(-0.1, 0.1)`` (SGRAF), the GRUs as PyTorch's.
    """

    def __init__(
        self,
        vocab_size: int,
        word_dim: int,
        out_dim: int,
        *,
        dropout: float = 0.0,
        bidirectional: bool = True,
        rngs: nnx.Rngs,
    ):
        self.embed = nnx.Embed(vocab_size, word_dim, embedding_init=_uniform_init(0.1), rngs=rngs)
        self.dropout = nnx.Dropout(dropout)
        self.forward_gru = GRU(word_dim, out_dim, rngs=rngs)
        self.backward_gru = GRU(word_dim, out_dim, rngs=rngs) if bidirectional else None

    def __call__(
        self,
        tokens: jax.Array,
        lengths: jax.Array,
        *,
        train: bool = False,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Encodes ``tokens`` ``[B, L]`` (int) with valid ``lengths`` ``[B]``.

        Returns:
          ``(word_features [B, L, out_dim], mask [B, L], pooled [B, out_dim])``; word
          features and pooled vectors are L2-normalised, padded words are zero.
        """
        mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        x = self.dropout(self.embed(tokens), deterministic=not train, rngs=rngs)
        h = self.forward_gru(x)
        if self.backward_gru is not None:
            backward = _reverse_valid(self.backward_gru(_reverse_valid(x, lengths)), lengths)
            h = 0.5 * (h + backward)
        words = l2_normalize(h) * mask[..., None]
        return words, mask, l2_normalize(masked_mean(h, mask))
