"""Padded rows: the validity mask every pure function takes (``where``) and the masked
sums the training step streams.

A batch may be padded to a fixed size (the last batch of a pass, a shard of a global
batch); its real rows are flagged by a bool ``where`` of shape ``[B]``. Every loss,
estimator and Dirichlet function of ``ncljax`` reads it through :func:`valid_rows`, so
a missing mask means "every row is real" and a mask of the wrong shape is one error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike


def valid_rows(num: int, where: ArrayLike | None, name: str = "where") -> jax.Array:
    """Bool ``[num]``: ``where`` as a mask, every row real when it is ``None``.

    Raises:
      ValueError: ``where`` is not of shape ``(num,)`` (the message names ``name``).
    """
    if where is None:
        return jnp.ones(num, bool)
    where = jnp.asarray(where, bool)
    if where.shape != (num,):
        raise ValueError(f"{name} must have shape ({num},), got {where.shape}")
    return where


def masked_metric(values: jax.Array, mask: jax.Array) -> jax.Array:
    """``[2]``: (sum over the entries ``mask`` keeps, their number) of ``values``
    ``[..., B]``; summed over steps and divided at the end, a mean over real rows."""
    mask = jnp.broadcast_to(mask, values.shape)
    return jnp.stack([jnp.where(mask, values, 0.0).sum(), mask.sum().astype(jnp.float32)])
