"""The jitted train step and the evaluation-mode forward functions.

``make_train_step`` composes a method's pure functions into ``train_step(state, batches,
spec, clean, network)``. ``spec`` (static) says how the step runs:

* together (``spec.in_turn=False``): every network steps on the same batches under
  ``jax.vmap`` over the leading network axis, its peer being the next network;
* in turn (``spec.in_turn=True``): only network ``network`` (traced, so one compilation
  serves every network) is sliced out and steps; its peer is frozen and every other
  network's parameters, statistics, optimiser state and memory are left bit-identical.

Per network: the method's optional no-grad ``prepare_fn`` (eval mode, shared by the
updates), then ``spec.updates`` sequential optimiser updates, update ``u`` on batch
``batches[spec.updates[u]]`` from the parameters the previous update produced: gather
memory rows, forward (the method's ``forward_fn`` gets the update's ``LossContext``, which
holds every batch of the step, so an update can read the others), per-example losses
masked and reduced over the *global* batch, one optimiser update, scatter memory rows (at
the batch's indices, then any ``memory_at`` rows at theirs). An update whose batch holds
no real pair moves nothing. A step whose inputs, losses or gradients are not finite leaves the
parameters, model and optimiser states unchanged, advances its step counter and records
its step in ``state.nonfinite_step``; the host checks it on log steps and stops the run
(the last good checkpoint is kept). Its memory keeps only the rows of its finite updates
(per-pair values of the parameters the step started from): the memory is written in
place by row, never copied or selected whole, so a step costs O(batch), not O(N).
Metrics are ``(sum, count)`` pairs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ncljax import masking
from ncljax.methods.base import NETWORK_AXIS, Aux, LossContext, Memory, Method
from ncljax.train import state as state_lib
from ncljax.train.state import TrainState

Metrics = dict[str, jax.Array]  # name -> [2] (sum, count)
TRAIN_STREAM, REFRESH_STREAM = 0, 1  # fold_in(state.rng, stream): disjoint key streams


class StepSpec(NamedTuple):
    """The static shape of a step (from the epoch's ``EpochPlan``).

    Attributes:
      phase: the method's phase.
      updates: the batch (index into the step's batches) of each sequential update.
      in_turn: one network steps (``network``) while the others stay frozen.
    """

    phase: int = 0
    updates: tuple[int, ...] = (0,)
    in_turn: bool = False


def _finite(tree) -> jax.Array:
    leaves = [
        jnp.isfinite(x).all()
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def gather_rows(samples: dict, index: jax.Array, network=None) -> dict:
    """Rows ``[B, ...]`` at ``index`` of ``[N, ...]`` memory, or of network ``network`` of
    stacked ``[K, N, ...]`` memory; padding indices (``N``) are clipped."""
    at = index if network is None else (network, index)
    return jax.tree.map(lambda m: m.at[at].get(mode="clip"), samples)


def _scatter_rows(samples: dict, index: jax.Array, rows: dict, network=None) -> dict:
    """Writes ``rows`` ``[B, ...]`` at ``index`` (of network ``network`` of stacked
    memory); out-of-range (padding) indices are dropped."""
    at = index if network is None else (network, index)
    out = dict(samples)
    for name, value in rows.items():
        if name not in out:
            raise KeyError(f"loss_fn wrote memory row {name!r}, absent from init_memory.")
        out[name] = out[name].at[at].set(value.astype(out[name].dtype), mode="drop")
    return out


def _valid_rows(tree, mask: jax.Array):
    """Rows ``[B, ...]`` with the padding entries zeroed (their writes are dropped)."""

    def zero(x):
        return jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))

    return jax.tree.map(zero, tree)


def streamed_noise_metrics(
    estimate: jax.Array, clean: jax.Array, mask: jax.Array, suffix: str = ""
) -> Metrics:
    """Per-step sums of the precision and recall of ``estimate > 0.5`` against the true
    mask (logs only; ``ncljax.evaluate.noise_detection_metrics`` scores a whole epoch)."""
    selected = estimate > 0.5
    hits = (selected & clean).astype(jnp.float32)
    return {
        f"step_clean_precision{suffix}": masking.masked_metric(hits, mask & selected),
        f"step_clean_recall{suffix}": masking.masked_metric(hits, mask & clean),
    }


def _diagnostic_metrics(aux: Aux, batch: dict, clean: jax.Array) -> Metrics:
    """The method's per-pair clean estimates and loss weights scored against the truth."""
    index, mask = batch["index"], batch["mask"]
    truth = jnp.take(clean, index, mode="clip")
    metrics = {}
    if aux.clean_estimate is not None:
        metrics |= streamed_noise_metrics(aux.clean_estimate, truth, mask)
    for name, estimate in aux.clean_estimates.items():
        metrics |= streamed_noise_metrics(estimate, truth, mask, f"_{name}")
    for name, estimate in aux.noisy_estimates.items():
        found = streamed_noise_metrics(estimate, ~truth, mask, f"_{name}")
        metrics |= {key.replace("_clean_", "_noisy_", 1): v for key, v in found.items()}
    logged = aux.applied_weight if aux.applied_weight is not None else aux.weight
    if logged is not None:
        weight = jnp.where(mask, logged, 0.0)
        noisy = jnp.where(truth, 0.0, weight).sum()
        metrics["noisy_weight_share"] = jnp.stack([noisy, weight.sum()])
    return metrics


def _reduce(per_example: jax.Array, mask: jax.Array, reduction: str) -> jax.Array:
    total = jnp.where(mask, per_example, 0.0).sum()
    if reduction == "sum":
        return total
    return total / jnp.maximum(mask.sum(), 1)


def make_train_step(
    graphdef: nnx.GraphDef,
    method: Method,
    tx: optax.GradientTransformation,
    *,
    num_samples: int,
) -> Callable[..., tuple[TrainState, Metrics]]:
    """Returns ``train_step(state, batches, spec, clean=None, network=0)`` (not jitted).

    ``batches`` is a batch dict or a tuple of them (main, auxiliary); ``spec`` a static
    ``StepSpec`` (or a phase ``int``); jit with ``static_argnums=2``. ``clean`` is the true
    clean mask ``[N]`` (or ``None``): it only scores the method's clean estimates for
    the logs and never reaches the method. ``network`` (traced int32) is the training
    network of an in-turn step.
    """
    if method.loss_reduction not in ("mean", "sum"):
        raise ValueError(
            f"Method {method.name!r} has loss_reduction={method.loss_reduction!r}; "
            "use 'mean' or 'sum'."
        )
    return _Step(graphdef, method, tx, num_samples).train_step


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """The pieces of a train step, top to bottom: :meth:`train_step` (every network, in
    turn or under ``vmap``, and the commit of a finite step), :meth:`network_step` (one
    network's updates), :meth:`update` (one optimiser update), :meth:`loss` (the
    forward and the method's loss)."""

    graphdef: nnx.GraphDef
    method: Method
    tx: optax.GradientTransformation
    num_samples: int

    def train_step(
        self,
        state: TrainState,
        batches,
        spec: StepSpec | int,
        clean: jax.Array | None = None,
        network: jax.Array | int = 0,
    ) -> tuple[TrainState, Metrics]:
        spec = spec if isinstance(spec, StepSpec) else StepSpec(phase=int(spec))
        batches = (batches,) if isinstance(batches, dict) else tuple(batches)
        num_networks = jax.tree.leaves(state.params)[0].shape[0]
        key = jax.random.fold_in(jax.random.fold_in(state.rng, TRAIN_STREAM), state.step)
        keys = jax.random.split(key, num_networks)
        ctx = LossContext(
            step=state.step,
            epoch=state.epoch,
            phase=spec.phase,
            num_samples=self.num_samples,
            network=jnp.zeros((), jnp.int32),
            rng=key,
        )
        samples = state.memory.samples
        step_fn = functools.partial(
            self.network_step, batches=batches, spec=spec, ctx=ctx, clean=clean
        )
        # The memory is read and written in place by row (the stacked [K, N] arrays and a
        # network index): no [N] slice, roll or copy per step.
        if spec.in_turn:
            k = jnp.asarray(network, jnp.int32)
            peer_k = (k + 1) % num_networks
            models = state_lib.network((state.params, state.model_state), peer_k)
            net = state_lib.network(
                (state.params, state.model_state, state.opt_state, state.memory.state), k
            )
            new_k, ok, metrics = step_fn(
                net, (*models, samples, peer_k), keys[k], k, own=(samples, k)
            )
            params, model_state, opt_state = state_lib.set_network(
                (state.params, state.model_state, state.opt_state), k, new_k[:3]
            )
            samples = new_k[3]
        else:
            roll = lambda tree: jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), tree)
            models = roll((state.params, state.model_state))
            net = (state.params, state.model_state, state.opt_state, state.memory.state)
            peer_ks = (jnp.arange(num_networks) + 1) % num_networks
            vmapped = jax.vmap(
                lambda net, models, peer_k, key, k, own: step_fn(
                    net,
                    (*models, samples, peer_k),
                    key,
                    k,
                    own=(own, None),
                    network_axis=NETWORK_AXIS,
                ),
                axis_name=NETWORK_AXIS,
            )
            (params, model_state, opt_state, samples), ok, metrics = vmapped(
                net, models, peer_ks, keys, jnp.arange(num_networks), samples
            )
            ok = ok.all()
            metrics = jax.tree.map(lambda m: m.sum(0), metrics)

        def keep(updated, old):
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), updated, old)

        new = state._replace(
            step=state.step + 1,
            params=keep(params, state.params),
            model_state=keep(model_state, state.model_state),
            opt_state=keep(opt_state, state.opt_state),
            memory=Memory(samples=samples, state=state.memory.state),
            nonfinite_step=jnp.where(
                ok | (state.nonfinite_step >= 0), state.nonfinite_step, state.step
            ),
        )
        return new, metrics

    def network_step(
        self, net, peer, key, network, batches, spec, ctx, clean, own, network_axis=None
    ):
        """One network's updates. ``net``: (params, model_state, opt_state, memory_state);
        ``peer``: (params, model_state, stacked samples, index) of its peer; ``own``: this
        network's samples, ``(samples [N, ...], None)`` or ``(stacked [K, N, ...], k)``.
        Returns ``((params, model_state, opt_state, samples), ok, metrics)``."""
        params, model_state, opt_state, memory_state = net
        peer_params, peer_model_state, stacked, peer_k = peer
        samples, own_k = own
        peer_rows = tuple(gather_rows(stacked, b["index"], peer_k) for b in batches)
        ctx = ctx._replace(
            network=network,
            batches=batches,
            peer_rows=peer_rows,
            memory_state=memory_state,
            network_axis=network_axis,
        )
        ctx = ctx._replace(
            prepared=self.prepare(params, model_state, peer_params, peer_model_state, batches, ctx)
        )
        ok, metrics = jnp.array(True), {}
        trained = (params, model_state, opt_state, samples)
        for u, stream in enumerate(spec.updates):
            key_u = key if u == 0 else jax.random.fold_in(key, u)
            trained, finite, step_metrics = self.update(
                trained,
                own_k,
                peer_rows[stream],
                memory_state,
                key_u,
                batches,
                stream,
                ctx._replace(update=u),
                clean,
            )
            ok &= finite
            for name, value in step_metrics.items():
                metrics[f"{name}_update{u}" if name in metrics else name] = value
        return trained, ok, metrics

    def update(self, trained, own_k, peer_rows, memory_state, key, batches, stream, ctx, clean):
        """One optimiser update on ``batches[stream]``: ``(params, model_state, opt_state,
        samples)`` after it (``samples`` of network ``own_k`` of the stacked memory, or the
        network's own ``[N, ...]`` memory when ``None``), whether everything it computed is
        finite, its metrics. Its memory rows are written only when it is finite: the
        index of a row not to write is ``N``, dropped by the scatter, so the memory is
        updated in place, never copied or selected whole."""
        params, model_state, opt_state, samples = trained
        batch = batches[stream]
        index, mask = batch["index"], batch["mask"]
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        (loss, (per_example, aux, new_model_state)), grads = grad_fn(
            params,
            model_state,
            gather_rows(samples, index, own_k),
            peer_rows,
            memory_state,
            key,
            batch,
            ctx,
        )
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        written = _valid_rows(aux.memory, mask)
        at_index, at_rows = aux.memory_at or (None, {})
        ok = _finite(batch) & jnp.isfinite(loss) & _finite(grads) & _finite(written)
        ok &= _finite(at_rows)
        # A zero-gradient Adam step still moves the parameters: no real pair, no step.
        real = mask.any()
        moved = lambda new, old: jax.tree.map(lambda a, b: jnp.where(real, a, b), new, old)
        params = moved(new_params, params)
        model_state = moved(new_model_state, model_state)
        opt_state = moved(new_opt_state, opt_state)
        if written:
            index = jnp.where(mask & ok, index, self.num_samples)
            samples = _scatter_rows(samples, index, written, own_k)
        if at_rows:  # no real pair, or not finite: no write
            at_index = jnp.where(real & ok, at_index, self.num_samples)
            samples = _scatter_rows(samples, at_index, at_rows, own_k)
        step_metrics = {"loss": masking.masked_metric(per_example, mask)}
        for name, values in aux.metrics.items():
            step_metrics[name] = masking.masked_metric(values, mask)
        if clean is not None:
            step_metrics |= _diagnostic_metrics(aux, batch, clean)
            if self.method.step_metrics_fn is not None and aux.extra is not None:
                step_metrics |= self.method.step_metrics_fn(aux.extra, batch, batches)
        return (params, model_state, opt_state, samples), ok, step_metrics

    def loss(self, params, model_state, rows, peer_rows, memory_state, key, batch, ctx):
        """The reduced loss of ``batch`` and ``(per_example, aux, new model state)``, the
        per-example losses weighted by ``aux.weight`` where the method gives one."""
        method = self.method
        model = nnx.merge(self.graphdef, params, model_state)
        dropout_key, loss_key = jax.random.split(key)
        outputs = method.forward_fn(
            model,
            batch,
            memory_state,
            train=True,
            rngs=nnx.Rngs(dropout=dropout_key),
            phase=ctx.phase,
            ctx=ctx,
        )
        per_example, aux = method.loss_fn(
            outputs, batch, rows, peer_rows, ctx._replace(rng=loss_key)
        )
        if not isinstance(aux, Aux):
            raise TypeError(
                f"Method {method.name!r}'s loss_fn returned {type(aux).__name__} as its "
                "auxiliaries; return an ncljax.methods.Aux."
            )
        weighted = per_example if aux.weight is None else aux.weight * per_example
        loss = _reduce(weighted, batch["mask"], method.loss_reduction)
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return loss, (weighted, aux, nnx.to_pure_dict(new_model_state))

    def prepare(self, params, model_state, peer_params, peer_model_state, batches, ctx):
        """The method's no-grad pass shared by a step's updates (``Method.prepare_fn``)."""
        if self.method.prepare_fn is None:
            return None
        model = nnx.merge(self.graphdef, params, model_state)
        peer = nnx.merge(self.graphdef, peer_params, peer_model_state)
        return jax.lax.stop_gradient(self.method.prepare_fn(model, peer, batches, ctx))


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
