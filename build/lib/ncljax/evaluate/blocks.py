"""Blocks of rows on device: the input checks, padding, placement and host transfer that the
Recall@K sweep, the mAP@all kernel and ``ncljax.retrieve`` share.

Placement. Every block is put on device with ``jax.device_put`` at the placements of
:func:`placements`: on ``jax.devices()[0]`` by default, so inputs that are already sharded are
gathered block by block and give the same result as host inputs; with a mesh, query (image)
rows are sharded over all the mesh's axes and database (caption) blocks are replicated.
"""

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def as_array(x: Any) -> Any:
    """A numpy array, or the jax Array itself (no host round trip)."""
    return x if isinstance(x, jax.Array) else np.asarray(x)


def as_arrays(tree: Any) -> Any:
    """:func:`as_array` of every leaf of ``tree``."""
    return jax.tree.map(as_array, tree)


def leading_size(tree: Any, name: str) -> int:
    """The leading (item) axis shared by every leaf of ``tree``.

    Raises:
      ValueError: ``tree`` (named ``name`` in the message) has no leaves, a scalar leaf, or
        leaves of different leading sizes.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"{name} is an empty pytree; pass arrays with a leading item axis")
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(x.shape) for x in leaves]
        raise ValueError(f"every leaf of {name} needs the same leading axis; got shapes {shapes}")
    return sizes.pop()


def take_rows(tree: Any, start: int, size: int) -> Any:
    """Rows ``[start, start + size)`` of every leaf; rows past the end repeat the last row.

    Repeating a real row (rather than zeros) keeps padded inputs finite for any ``sim_fn``
    (a zero row would give NaN under cosine normalisation); padded results are masked anyway.

    Args:
      tree: pytree of numpy or jax arrays with a common leading axis.
      start: the first row.
      size: rows per block; every block of a sweep has this many, so it compiles once.

    Returns:
      ``tree`` with every leaf ``[size, ...]``.
    """

    def take(x):
        stop = start + size
        if isinstance(x, np.ndarray) and stop <= x.shape[0]:
            return x[start:stop]
        return x[np.minimum(np.arange(start, stop), x.shape[0] - 1)]

    return jax.tree.map(take, tree)


def to_host(tree: Any) -> Any:
    """Numpy copies of (possibly sharded) results; gathered from every process if needed."""
    if jax.process_count() > 1:  # shards on other hosts are not addressable here
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return jax.device_get(tree)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``value`` (both positive)."""
    return -(-value // multiple) * multiple


def placements(mesh: Mesh | None) -> tuple[Any, Any, int]:
    """Where the blocks of a sweep go.

    Args:
      mesh: a mesh, or ``None`` for ``jax.devices()[0]``.

    Returns:
      ``(rows, replicated, multiple)``: the placement of query (image) rows, sharded over all
      the mesh's axes; that of database (caption) blocks, replicated; and the multiple that
      a block's row count must be (``mesh.size``, 1 without a mesh).
    """
    if mesh is None:
        device = jax.devices()[0]
        return device, device, 1
    return NamedSharding(mesh, P(tuple(mesh.axis_names))), NamedSharding(mesh, P()), mesh.size
