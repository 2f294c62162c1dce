"""``TrainState``: everything a run needs to continue, as one pytree."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ncljax.methods.base import Memory

PyTree = Any


class TrainState(NamedTuple):
    """Parameters, optimiser state, per-sample memory, step and key of a run.

    Every network-dependent leaf has a leading axis of size ``num_networks`` (1 or 2):
    dual networks are one pytree run with ``jax.vmap``.

    Attributes:
      step: global step, int32 scalar (one step may make several optimiser updates).
      epoch: the epoch being trained, int32 scalar (``LossContext.epoch``).
      params: model parameters as a pure dict, leaves ``[K, ...]``.
      model_state: the model's other variables (BatchNorm statistics), leaves ``[K, ...]``.
      opt_state: optimiser state, leaves ``[K, ...]``.
      memory: the method's ``Memory``, leaves ``[K, N, ...]`` / ``[K, ...]``.
      rng: the run's key; step ``t`` uses ``fold_in(rng, t)``.
      nonfinite_step: first step whose inputs, loss or gradients were NaN/Inf (its update was
        skipped), or -1.
    """

    step: jax.Array
    epoch: jax.Array
    params: PyTree
    model_state: PyTree
    opt_state: PyTree
    memory: Memory
    rng: jax.Array
    nonfinite_step: jax.Array


def stack(trees: list[PyTree]) -> PyTree:
    """Stacks identically structured pytrees on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def check_num_networks(num_networks) -> None:
    """Refuses a network count that is not a positive integer (one clear line, before
    anything is built; ``range(0)`` would otherwise surface as a ``jax.tree.map`` error).

    Raises:
      ValueError: naming ``method_kwargs.num_networks``, its value and what it must be.
    """
    if isinstance(num_networks, bool) or not isinstance(num_networks, numbers.Integral):
        raise ValueError(
            f"method_kwargs.num_networks={num_networks!r} must be an integer: 1 (one network) "
            "or 2 (two networks trained side by side)."
        )
    if num_networks < 1:
        raise ValueError(
            f"method_kwargs.num_networks={num_networks} must be at least 1: 1 (one network) "
            "or 2 (two networks trained side by side)."
        )


def init_networks(
    model_fn: Callable[[nnx.Rngs], nnx.Module], num_networks: int, key: jax.Array
) -> tuple[nnx.GraphDef, PyTree, PyTree]:
    """Builds ``num_networks`` independently initialised models and stacks their states.

    Returns:
      ``(graphdef, params, model_state)`` with pure-dict states whose leaves are
      ``[num_networks, ...]``.
    """
    check_num_networks(num_networks)
    graphdef, params, rest = None, [], []
    for k in range(num_networks):
        seed = jax.random.randint(jax.random.fold_in(key, k), (), 0, 2**31 - 1)
        model = model_fn(nnx.Rngs(params=int(seed)))
        graphdef, p, r = nnx.split(model, nnx.Param, ...)
        params.append(nnx.to_pure_dict(p))
        rest.append(nnx.to_pure_dict(r))
    return graphdef, stack(params), stack(rest)


def create(
    *,
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    tx: optax.GradientTransformation,
    memory: Memory,
    num_networks: int,
    seed: int,
) -> tuple[nnx.GraphDef, TrainState]:
    """A fresh ``TrainState`` and the model's graph definition.

    Args:
      model_fn: builds one model from ``nnx.Rngs``.
      tx: the optimiser (one state per network).
      memory: the method's memory for one network (copied for each network).
      num_networks: 1 or 2.
      seed: the run's seed.
    """
    key = jax.random.key(seed)
    init_key, rng = jax.random.split(key)
    graphdef, params, model_state = init_networks(model_fn, num_networks, init_key)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        epoch=jnp.zeros((), jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=jax.vmap(tx.init)(params),
        memory=stack([memory] * num_networks),
        rng=rng,
        nonfinite_step=jnp.full((), -1, jnp.int32),
    )
    return graphdef, state


def network(tree: PyTree, k: int | jax.Array) -> PyTree:
    """Network ``k``'s slice of a stacked pytree (``k`` may be traced)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, k, keepdims=False), tree)


def set_network(tree: PyTree, k: int | jax.Array, value: PyTree) -> PyTree:
    """``tree`` with network ``k``'s slice replaced by ``value``; the others untouched."""
    return jax.tree.map(lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v, k, 0), tree, value)
