"""``train_and_evaluate``: train one method on one dataset, resumably, and test the best model.

Reads top to bottom: data and noise, model and method, state, resume, then per epoch:
refresh (the method's estimation step), train steps, validation, checkpoints; finally
the best-on-validation model is evaluated on the test split and ``results.json`` written.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from ncljax import evaluate, methods, models
from ncljax.data import pipeline, sources
from ncljax.methods.base import InitContext, RefreshContext
from ncljax.train import checkpoint, evaluation, optim, writers
from ncljax.train import config as config_lib
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib
from ncljax.train.diagnostics import score_diagnostics

Callback = Callable[[int, dict], None]


# Fields a resumed run may change: they alter neither the shapes of the state nor the
# data order, e.g. to lower the learning rate after a NaN stop.
RESUMABLE = (
    "optim.learning_rate",
    "optim.schedule",
    "optim.decay_factor",
    "optim.decay_every",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "optim.weight_decay",
    "train.log_every_steps",
    "train.checkpoint_every_steps",
    "train.progress_bar",
    "data.num_threads",
    "data.prefetch",
    "data.length_buckets",
    "eval.batch_size",
    "eval.image_chunk",
    "eval.text_chunk",
    "distributed",
)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _write_config(workdir: str, config, extra: dict) -> None:
    """Writes ``config.json``; refuses a workdir that holds a run of another config.

    Only the ``RESUMABLE`` fields may differ from the run being resumed.
    """
    resolved = json.loads(config.to_json_best_effort())
    resolved.update(extra)
    path = os.path.join(workdir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            previous, current = _flatten(json.load(f)), _flatten(resolved)
        changed = sorted(
            k for k in previous.keys() | current.keys() if previous.get(k) != current.get(k)
        )
        fixed = [k for k in changed if k not in RESUMABLE]
        if fixed:
            raise ValueError(
                f"{workdir} holds a run with a different config ({fixed} differ). Use a new "
                "--workdir, or the same config to resume that run (only "
                f"{list(RESUMABLE)} may change)."
            )
        if changed:
            print(f"Resuming with changed {', '.join(f'{k}={current.get(k)}' for k in changed)}.")
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(resolved, f, indent=2, sort_keys=True)


def _mean(accumulated: dict) -> dict[str, float]:
    host = jax.device_get(accumulated)
    return {k: float(v[0] / max(v[1], 1.0)) for k, v in host.items()}


def _check_finite(state, steps_per_epoch: int, checkpointer) -> None:
    bad = int(state.nonfinite_step)
    if bad >= 0:
        last = checkpointer.latest_step()
        kept = (
            f"the last good checkpoint (step {last}) is kept"
            if last is not None
            else "no checkpoint was saved yet"
        )
        raise FloatingPointError(
            f"Non-finite (NaN/Inf) inputs, loss or gradients at step {bad} (epoch "
            f"{bad // steps_per_epoch}); its update was skipped and training stopped, "
            f"{kept}. Check the features for NaN/Inf, or rerun the same command with a lower "
            "--config.optim.learning_rate to resume from the checkpoint."
        )


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, callbacks: Sequence[Callback] = ()
) -> dict[str, float]:
    """Trains ``config.method`` on ``config.data`` in ``workdir``; returns test metrics.

    Resumes from ``workdir/checkpoints`` when a checkpoint exists. Writes
    ``config.json``, ``metrics.jsonl``, ``results.json`` and ``checkpoints/``.

    Args:
      config: a config built on ``ncljax.train.config.base_config()``.
      workdir: the run directory.
      callbacks: ``fn(epoch, val_metrics)`` called after each epoch's checkpoint.

    Returns:
      Test metrics of the best-on-validation model.
    """
    if config.distributed:
        jax.distributed.initialize()
    dataset = sources.load_dataset(config.data)
    info = dataset.info
    config_lib.validate(config, info)
    method = methods.build_method(config.method, config.method_kwargs)
    image_fields, text_fields = models.input_fields(config.model)
    train_split = dataset.split("train")
    pairs = pipeline.training_pairs(
        train_split,
        config.noise,
        num_classes=info.num_classes,
        image_fields=image_fields,
        text_fields=text_fields,
    )
    os.makedirs(workdir, exist_ok=True)
    _write_config(
        workdir,
        config,
        {"noise_checksum": pairs.checksum, "noise_realised_rate": pairs.realised_rate},
    )

    mesh = mesh_lib.make_mesh(config.train.num_devices)
    batch_size, num_epochs = config.train.batch_size, config.train.epochs
    if batch_size % mesh.size or config.eval.batch_size % mesh.size:
        raise ValueError(
            f"train.batch_size={batch_size} and eval.batch_size={config.eval.batch_size} "
            f"must be multiples of the {mesh.size} devices (or set train.num_devices)."
        )
    n = pairs.num_records
    steps_per_epoch = pipeline.num_batches(n, batch_size)
    tx = optim.make_optimizer(config.optim, steps_per_epoch=steps_per_epoch, num_epochs=num_epochs)
    init = InitContext(n, info, pairs.labels_image, pairs.labels_text, config.model.embed_dim)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(config.model, info, rngs),
        tx=tx,
        memory=method.init_memory(init),
        num_networks=method.num_networks,
        seed=config.seed,
    )
    state = mesh_lib.replicate(state, mesh)
    data_sharding = mesh_lib.batch_sharding(mesh)
    buckets = tuple(config.data.length_buckets) if "tokens" in text_fields else ()
    train_batches = pipeline.batches(
        pairs.record_fn,
        n,
        batch_size=batch_size,
        num_epochs=num_epochs,
        seed=config.seed,
        num_threads=config.data.num_threads,
        prefetch=config.data.prefetch,
        lengths=train_split.caption_lengths() if buckets else None,
        length_buckets=buckets,
    )
    iterator = iter(train_batches)
    checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    writer = writers.MetricWriter(workdir)
    meta = {"best_value": -math.inf, "best_epoch": -1}
    restored = checkpointer.restore(state, iterator)
    if restored is not None:
        state, meta = restored
        print(f"Resumed from step {int(state.step)} in {workdir}.")
    writer.truncate_after(int(state.step) if restored is not None else -1)

    evaluator = evaluation.Evaluator(
        graphdef,
        dataset,
        config,
        mesh,
        transform=method.eval_transform,
        fields=(image_fields, text_fields),
    )
    selection = "rsum" if config.eval.kind == "recall" else "map_avg"
    replicated = mesh_lib.replicated(mesh)
    train_step = jax.jit(
        step_lib.make_train_step(
            graphdef, method, tx, num_samples=n, steps_per_epoch=steps_per_epoch
        ),
        static_argnums=2,
        donate_argnums=0,
        in_shardings=(replicated, data_sharding, replicated),
        out_shardings=(replicated, replicated),
    )
    clean = mesh_lib.replicate(pairs.clean, mesh)  # scores clean_estimate; logs only
    refresh = _Refresher(graphdef, method, pairs, mesh, config, num_epochs)

    run = _Run(
        config, iterator, train_step, data_sharding, writer, checkpointer, steps_per_epoch, clean
    )

    with jax.set_mesh(mesh):
        for epoch in range(int(state.step) // steps_per_epoch, num_epochs):
            plan = method.plan_fn(epoch)
            if int(state.step) == epoch * steps_per_epoch and plan.refresh:
                state, diagnostics = refresh(state, epoch)
                if diagnostics:
                    writer.write(
                        step=int(state.step), epoch=epoch, split="refresh", metrics=diagnostics
                    )
            state = _train_epoch(run, state, epoch, plan.phase, meta)
            _check_finite(state, steps_per_epoch, checkpointer)
            val = evaluator(state, "val")
            val.update(_noise_diagnostics(method, state, pairs.clean))
            val.update(score_diagnostics(method, state, pairs.clean, workdir, epoch))
            val.update(_label_diagnostics(method, state, pairs))
            writer.write(step=int(state.step), epoch=epoch, split="val", metrics=val)
            tqdm.tqdm.write(f"epoch {epoch}: val " + _summary(val, config.eval.kind))
            if val[selection] > meta["best_value"]:
                meta = {"best_value": val[selection], "best_epoch": epoch}
                checkpointer.save_best(state, meta)
            checkpointer.save(state, iterator, meta)
            for callback in callbacks:
                callback(epoch, val)

        best = checkpointer.restore_best(state)
        if best is None:
            raise ValueError(
                f"No epoch reached a finite validation {selection}; nothing to test. "
                f"See {os.path.join(workdir, 'metrics.jsonl')}."
            )
        best_state, best_meta = best
        test = evaluator(best_state, "test")
        if config.eval.test_last_epoch:  # also the final parameters (MRL/UOT-RCL protocol)
            last = test if best_meta["best_epoch"] == num_epochs - 1 else evaluator(state, "test")
            test.update({f"last_{k}": v for k, v in last.items()})
    test["best_epoch"] = best_meta["best_epoch"]
    test[f"val_{selection}"] = best_meta["best_value"]
    test.update(_noise_diagnostics(method, state, pairs.clean))  # the final labels
    writer.write(step=int(state.step), epoch=num_epochs - 1, split="test", metrics=test)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(test, f, indent=2, sort_keys=True)
    print(f"test (best val epoch {best_meta['best_epoch']}): " + _summary(test, config.eval.kind))
    if config.eval.test_last_epoch:
        last = {k[len("last_") :]: v for k, v in test.items() if k.startswith("last_")}
        print(f"test (last epoch {num_epochs - 1}): " + _summary(last, config.eval.kind))
    writer.close()
    checkpointer.close()
    return test


def _summary(metrics: dict, kind: str) -> str:
    keys = (
        ("rsum", "i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
        if kind == "recall"
        else ("map_avg", "map_i2t", "map_t2i")
    )
    keys += tuple(k for k in ("noise_auc", "noise_precision", "noise_recall") if k in metrics)
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


class _Run(NamedTuple):
    """What every epoch of a run shares."""

    config: ml_collections.ConfigDict
    iterator: Any
    train_step: Callable
    sharding: jax.sharding.Sharding
    writer: writers.MetricWriter
    checkpointer: checkpoint.Checkpointer
    steps_per_epoch: int
    clean: jax.Array


def _train_epoch(run: _Run, state, epoch: int, phase: int, meta: dict):
    """Runs the rest of ``epoch`` (all of it, or from a mid-epoch checkpoint)."""
    cfg, steps_per_epoch = run.config, run.steps_per_epoch
    first = int(state.step) - epoch * steps_per_epoch
    accumulated, logged_at, tic = None, first, time.perf_counter()
    bar = tqdm.tqdm(
        total=steps_per_epoch,
        initial=first,
        desc=f"epoch {epoch}",
        unit="batch",
        disable=not cfg.train.progress_bar or jax.process_index() != 0,
        leave=False,
    )
    for done in range(first + 1, steps_per_epoch + 1):
        batch = pipeline.to_device(next(run.iterator), run.sharding)
        state, metrics = run.train_step(state, batch, phase, run.clean)
        accumulated = (
            metrics if accumulated is None else jax.tree.map(jnp.add, accumulated, metrics)
        )
        bar.update(1)
        if done % cfg.train.log_every_steps == 0 or done == steps_per_epoch:
            _check_finite(state, steps_per_epoch, run.checkpointer)  # the one host sync
            rate = (done - logged_at) * cfg.train.batch_size / (time.perf_counter() - tic)
            mean = _mean(accumulated) | {"pairs_per_s": rate}
            run.writer.write(step=int(state.step), epoch=epoch, split="train", metrics=mean)
            bar.set_postfix(loss=f"{mean['loss']:.4f}", pairs_per_s=f"{rate:.0f}")
            accumulated, logged_at, tic = None, done, time.perf_counter()
        every = cfg.train.checkpoint_every_steps  # host-side step count: no device sync
        if every and (epoch * steps_per_epoch + done) % every == 0 and done < steps_per_epoch:
            _check_finite(state, steps_per_epoch, run.checkpointer)
            run.checkpointer.save(state, run.iterator, meta)
    bar.close()
    return state


def _label_diagnostics(method, state, pairs) -> dict[str, float]:
    """Accuracy of the method's corrected labels on the pairs it trusts (true labels known)."""
    true = pairs.true_labels
    if method.label_estimate_fn is None or (true < 0).any():
        return {}
    labels, selected = method.label_estimate_fn(state_lib.network(state.memory, 0))
    labels, selected = np.asarray(labels), np.asarray(selected, bool)
    observed = np.concatenate([pairs.labels_image == true, pairs.labels_text == true])
    return {
        "corrected_accuracy": float((labels == true)[selected].mean()) if selected.any() else 0.0,
        "selected_fraction": float(selected.mean()),
        "observed_accuracy": float(observed.mean()),
    }


def _noise_diagnostics(method, state, clean: np.ndarray) -> dict[str, float]:
    """Noise-detection quality of the method's clean estimate (mean over networks)."""
    if method.clean_score_fn is None or clean.all():
        return {}
    scores = [
        np.asarray(method.clean_score_fn(state_lib.network(state.memory, k)))
        for k in range(jax.tree.leaves(state.params)[0].shape[0])
    ]
    return evaluate.noise_detection_metrics(np.mean(scores, 0), clean)


def _scatter_stats(buffers, index, values):
    """Writes per-network values ``[K, B, ...]`` at ``index`` (padding ``N`` is dropped)."""
    return jax.tree.map(lambda b, v: b.at[:, index].set(v, mode="drop"), buffers, values)


class _Refresher:
    """Runs a method's per-epoch estimation: statistics pass, then ``refresh_fn`` per network.

    The statistics pass is an eval-mode forward over the training pairs in batches of the
    training size, in a fresh shuffle each epoch (in-batch quantities such as a loss
    against the other pairs, or a ``B``-class evidence, then mean what they mean in
    training); the results are scattered back to index order and replicated.
    """

    def __init__(self, graphdef, method, pairs, mesh, config, num_epochs):
        self._method = method
        self._pairs = pairs
        self._mesh = mesh
        self._config = config
        self._num_epochs = num_epochs
        if method.stats_fn is not None:

            def stats(model, batch, memory_state):
                outputs = method.forward_fn(
                    model, batch, memory_state, train=False, rngs=None, phase=-1
                )
                return method.stats_fn(outputs, batch)

            self._stats = jax.jit(step_lib.make_forward(graphdef, stats))
            self._scatter = jax.jit(
                _scatter_stats, donate_argnums=0, out_shardings=mesh_lib.replicated(mesh)
            )

    def _collect_stats(self, state, epoch: int):
        cfg, n = self._config, self._pairs.num_records
        seed = int(np.random.SeedSequence([cfg.seed, 2, epoch]).generate_state(1)[0])
        buffers = None
        for batch in pipeline.batches(
            self._pairs.record_fn,
            n,
            batch_size=cfg.train.batch_size,
            seed=seed,
            num_threads=cfg.data.num_threads,
        ):
            device_batch = pipeline.to_device(batch, mesh_lib.batch_sharding(self._mesh))
            values = self._stats(state.params, state.model_state, device_batch, state.memory.state)
            if buffers is None:
                buffers = jax.tree.map(
                    lambda v: jnp.zeros((v.shape[0], n, *v.shape[2:]), v.dtype), values
                )
            buffers = self._scatter(buffers, device_batch["index"], values)
        return buffers

    def _fetch(self, indices) -> dict[str, jax.Array]:
        records = [self._pairs.record_fn(int(i)) for i in np.asarray(indices)]
        stacked = {k: np.stack([r[k] for r in records]) for k in records[0]}
        return mesh_lib.replicate(stacked, self._mesh)

    def __call__(self, state, epoch: int):
        method = self._method
        if method.refresh_fn is None:
            return state, {}
        stats = self._collect_stats(state, epoch) if method.stats_fn is not None else None
        num_networks = jax.tree.leaves(state.params)[0].shape[0]
        key = jax.random.fold_in(jax.random.fold_in(state.rng, step_lib.REFRESH_STREAM), epoch)
        memories, diagnostics = [], {}
        for k in range(num_networks):
            ctx = RefreshContext(
                epoch=epoch,
                num_epochs=self._num_epochs,
                network=k,
                rng=jax.random.fold_in(key, k),
                fetch=self._fetch,
            )
            memory, diag = method.refresh_fn(
                state_lib.network(state.memory, k),
                None if stats is None else state_lib.network(stats, k),
                ctx,
            )
            memories.append(memory)
            suffix = f"_net{k}" if num_networks > 1 else ""
            diagnostics.update({f"{name}{suffix}": float(v) for name, v in diag.items()})
        memory = mesh_lib.replicate(state_lib.stack(memories), self._mesh)
        return state._replace(memory=memory), diagnostics
