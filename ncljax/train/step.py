"""The jitted train step and the evaluation-mode forward functions.

``make_train_step`` composes a method's pure functions into ``train_step(state, batch)``:
gather per-sample memory rows, forward every network (``jax.vmap`` over the leading
network axis), per-example losses masked and averaged over the *global* batch, one
optimiser update per network, scatter memory rows, and ``(sum, count)`` metrics. A step
whose inputs, loss or gradients are not finite leaves the state unchanged and records its step in
``state.nonfinite_step``; the host checks it on log steps and stops the run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ncljax.methods.base import LossContext, Memory, Method
from ncljax.train.state import TrainState

Metrics = dict[str, jax.Array]  # name -> [2] (sum, count)
TRAIN_STREAM, REFRESH_STREAM = 0, 1  # fold_in(state.rng, stream): disjoint key streams


def _finite(tree) -> jax.Array:
    leaves = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _gather_rows(samples: dict, index: jax.Array) -> dict:
    """Rows ``[K, B, ...]`` of ``[K, N, ...]`` memory; padding indices (``N``) are clipped."""
    return jax.tree.map(lambda m: jnp.take(m, index, axis=1, mode="clip"), samples)


def _scatter_rows(samples: dict, index: jax.Array, rows: dict) -> dict:
    """Writes ``rows`` ``[K, B, ...]`` at ``index``; out-of-range (padding) indices are dropped."""
    out = dict(samples)
    for name, value in rows.items():
        if name not in out:
            raise KeyError(f"loss_fn wrote memory row {name!r}, absent from init_memory.")
        out[name] = out[name].at[:, index].set(value.astype(out[name].dtype), mode="drop")
    return out


def masked_metric(values: jax.Array, mask: jax.Array) -> jax.Array:
    """``[2]`` (sum over valid entries, number of valid entries) of ``values`` ``[..., B]``."""
    mask = jnp.broadcast_to(mask, values.shape)
    return jnp.stack([jnp.where(mask, values, 0.0).sum(), mask.sum().astype(jnp.float32)])


def _valid_rows(tree, mask: jax.Array):
    """Rows ``[K, B, ...]`` with the padding entries zeroed (their writes are dropped)."""

    def zero(x):
        return jnp.where(mask.reshape((1, -1) + (1,) * (x.ndim - 2)), x, jnp.zeros_like(x))

    return jax.tree.map(zero, tree)


def noise_detection_metrics(estimate: jax.Array, clean: jax.Array, mask: jax.Array) -> Metrics:
    """Streaming precision/recall of ``estimate > 0.5`` against the true mask (logs only)."""
    selected = estimate > 0.5
    hits = (selected & clean).astype(jnp.float32)
    return {
        "step_noise_precision": masked_metric(hits, mask & selected),
        "step_noise_recall": masked_metric(hits, mask & clean),
    }


def make_train_step(
    graphdef: nnx.GraphDef,
    method: Method,
    tx: optax.GradientTransformation,
    *,
    num_samples: int,
    steps_per_epoch: int,
) -> Callable[[TrainState, dict, int], tuple[TrainState, Metrics]]:
    """Returns ``train_step(state, batch, phase, clean) -> (state, metrics)`` (not jitted).

    ``phase`` is static (``method.plan_fn``); jit with ``static_argnums=2``. ``clean`` is
    the true clean mask ``[N]`` (or ``None``): it only scores ``aux['clean_estimate']``
    for the logs and never reaches the method.
    """

    def net_loss(params, model_state, rows, peer_rows, memory_state, key, network, batch, ctx):
        model = nnx.merge(graphdef, params, model_state)
        dropout_key, loss_key = jax.random.split(key)
        outputs = method.forward_fn(
            model,
            batch,
            memory_state,
            train=True,
            rngs=nnx.Rngs(dropout=dropout_key),
            phase=ctx.phase,
        )
        ctx = ctx._replace(network=network, rng=loss_key)
        per_example, aux = method.loss_fn(outputs, batch, rows, peer_rows, ctx)
        mask = batch["mask"]
        loss = jnp.where(mask, per_example, 0.0).sum() / jnp.maximum(mask.sum(), 1)
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return loss, (per_example, aux, nnx.to_pure_dict(new_model_state))

    def train_step(
        state: TrainState, batch: dict, phase: int, clean: jax.Array | None = None
    ) -> tuple[TrainState, Metrics]:
        num_networks = jax.tree.leaves(state.params)[0].shape[0]
        key = jax.random.fold_in(jax.random.fold_in(state.rng, TRAIN_STREAM), state.step)
        index, mask = batch["index"], batch["mask"]
        rows = _gather_rows(state.memory.samples, index)
        peer_rows = jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), rows)
        ctx = LossContext(
            step=state.step,
            epoch=state.step // steps_per_epoch,
            phase=phase,
            num_samples=num_samples,
            network=jnp.zeros((), jnp.int32),
            rng=key,
        )
        grad_fn = jax.value_and_grad(
            functools.partial(net_loss, batch=batch, ctx=ctx), has_aux=True
        )
        (loss, (per_example, aux, model_state)), grads = jax.vmap(grad_fn)(
            state.params,
            state.model_state,
            rows,
            peer_rows,
            state.memory.state,
            jax.random.split(key, num_networks),
            jnp.arange(num_networks),
        )
        updates, opt_state = jax.vmap(tx.update)(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        samples = state.memory.samples
        written = _valid_rows(aux.get("memory", {}), mask)
        if written:
            samples = _scatter_rows(samples, jnp.where(mask, index, num_samples), written)
        # A non-finite step changes nothing but the step counter and the record of it.
        ok = _finite(batch) & jnp.isfinite(loss).all() & _finite(grads) & _finite(written)

        def keep(updated, old):
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), updated, old)

        new = state._replace(
            step=state.step + 1,
            params=keep(params, state.params),
            model_state=keep(model_state, state.model_state),
            opt_state=keep(opt_state, state.opt_state),
            memory=keep(Memory(samples=samples, state=state.memory.state), state.memory),
            nonfinite_step=jnp.where(
                ok | (state.nonfinite_step >= 0), state.nonfinite_step, state.step
            ),
        )
        metrics = {"loss": masked_metric(per_example, mask)}
        for name, values in aux.get("metrics", {}).items():
            metrics[name] = masked_metric(values, mask)
        if clean is not None and "clean_estimate" in aux:
            truth = jnp.broadcast_to(jnp.take(clean, index, mode="clip"), per_example.shape)
            metrics |= noise_detection_metrics(aux["clean_estimate"], truth, mask)
        return new, metrics

    return train_step


def make_forward(graphdef: nnx.GraphDef, fn: Callable) -> Callable:
    """``forward(params, model_state, batch, *per_network)``: ``fn(model, batch, ...)`` per network.

    ``params``, ``model_state`` and the ``per_network`` arguments have a leading network
    axis, ``batch`` is shared; the result has a leading network axis.
    """

    def one(params, model_state, batch, *per_network):
        return fn(nnx.merge(graphdef, params, model_state), batch, *per_network)

    def forward(params, model_state, batch, *per_network):
        in_axes = (0, 0, None) + (0,) * len(per_network)
        return jax.vmap(one, in_axes=in_axes)(params, model_state, batch, *per_network)

    return forward
