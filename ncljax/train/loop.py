"""``train_and_evaluate``: train one method on one dataset, resumably, and test the best model.

Reads top to bottom: data and noise, model and method, state, resume, then per epoch as
the method's ``EpochPlan`` says: refresh (the method's estimation step), optimiser reset,
the epoch's passes (one together pass, or one pass per network in turn), validation,
selection, checkpoint; finally the best-on-validation model is evaluated on the test
split and ``results.json`` written.

A checkpoint records the epoch, the pass, the position in it and the index sets of the
epoch's passes, so a run killed anywhere resumes to the same result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from ncljax import backend, cluster, methods, models, optim
from ncljax.config import validation
from ncljax.data import fingerprint, pipeline, sources
from ncljax.methods.base import WARMUP, InitContext
from ncljax.train import arms, checkpoint, passes, rundir, trajectory, writers
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib
from ncljax.train.diagnostics import (
    fallback_share,
    label_diagnostics,
    mean_of_sums,
    noise_diagnostics,
    score_diagnostics,
)
from ncljax.train.refresh import Refresher

Callback = Callable[[int, dict], None]


def _absolute_folder(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` with a vectors folder's ``data.folder`` expanded (``~``: the shell leaves
    it in ``--config.data.folder=~/...``) and made absolute, so that ``config.json`` names
    the folder from any directory (the audit and retrieval read it); a copy."""
    folder = config.data.get("folder")
    if not folder:
        return config
    config = config.copy_and_resolve_references()
    config.data.folder = os.path.abspath(os.path.expanduser(folder))
    return config


def _fingerprint(data_config) -> dict:
    """The ``config.json`` entry of the data's fingerprint (none for a prepared dataset)."""
    digests = fingerprint.data_fingerprint(data_config)
    return {} if digests is None else {fingerprint.KEY: digests}


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    callbacks: Sequence[Callback] = (),
    overridden: Collection[str] | None = None,
) -> dict[str, float]:
    """Trains ``config.method`` on ``config.data`` in ``workdir``; returns test metrics.

    Resumes from ``workdir/checkpoints`` when a checkpoint exists. Writes
    ``config.json``, ``metrics.jsonl``, ``results.json`` and ``checkpoints/``.

    Args:
      config: a config built on ``ncljax.config.base_config()``.
      workdir: the run directory.
      callbacks: ``fn(epoch, val_metrics)`` called after each epoch's checkpoint.
      overridden: the config fields given on the command line (``train.py``), so a field
        that a command-line choice leaves unread is warned about rather than refused
        (``fields.ignored_fields``).

    Every field is checked, the data read and the model built before anything is written.
    The run then holds ``workdir/lock`` until it returns or fails.

    Under ``train.division='race'`` the method trains twice, divided in ``workdir`` and
    undivided in ``workdir/undivided``, and ``results.json`` is the figures of the run
    whose best model validates higher (``ncljax.train.arms``; a divided run that switched
    its division off at every refresh is its own undivided run, not trained again);
    callbacks see both runs' epochs, the divided run's first.

    Returns:
      Test metrics of the best-on-validation model.

    Raises:
      ValueError: a bad config field or dataset file (one message naming it).
      rundir.WorkdirLocked: another live run holds ``workdir``.
      checkpoint.CheckpointError: no checkpoint can be restored, or one cannot be written.
      OSError: ``workdir`` cannot be written (permissions, a full disk).
      FloatingPointError: a non-finite loss; the last good checkpoint is kept.
    """
    if config.distributed:
        cluster.initialize(config.cluster)
    if arms.racing(config):  # the divided run here, the undivided one in workdir/undivided
        validation.check(config, overridden)
        return arms.race(
            config,
            workdir,
            lambda c, w: _train_and_evaluate(c, w, callbacks, overridden),
            evaluator_lib.eval_kind(config).selection,
        )
    return _train_and_evaluate(config, workdir, callbacks, overridden)


def _train_and_evaluate(config, workdir: str, callbacks, overridden) -> dict[str, float]:
    """One run of ``config`` in ``workdir`` (see ``train_and_evaluate``)."""
    # Every field is checked, and everything built, before anything is written.
    config, b = _build(config, overridden)
    method, pairs, mesh, tx, graphdef = b.method, b.pairs, b.mesh, b.tx, b.graphdef
    evaluator, train_split = b.evaluator, b.train_split
    # The initial state goes to _train in a list it empties: no frame keeps it (its
    # per-pair memory, a copy the size of the run's, stayed alive for the whole run).
    initial = [b.state]
    del b
    text_fields = models.input_fields(config.model)[1]
    schedule = optim.learning_rate_schedule(config.optim, num_epochs=config.train.epochs)

    rundir.make_workdir(workdir)
    with contextlib.ExitStack() as stack:
        stack.enter_context(rundir.WorkdirLock(workdir))
        rundir.write_config(
            workdir,
            config,
            {
                "noise_checksum": pairs.checksum,
                "noise_realised_rate": pairs.realised_rate,
                **_fingerprint(config.data),
            },
        )
        checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
        stack.callback(checkpointer.close)  # also when a run stops with an error
        writer = writers.MetricWriter(workdir)
        stack.callback(writer.close)
        buckets = tuple(config.data.length_buckets) if "tokens" in text_fields else ()
        replicated, data_sharding = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
        run = _Run(
            config=config,
            method=method,
            pairs=pairs,
            train_step=jax.jit(
                step_lib.make_train_step(graphdef, method, tx, num_samples=pairs.num_records),
                static_argnums=2,
                donate_argnums=0,
                compiler_options=backend.compiler_options(),
                in_shardings=(replicated, data_sharding, replicated, replicated),
                out_shardings=(replicated, replicated),
            ),
            sharding=data_sharding,
            writer=writer,
            checkpointer=checkpointer,
            clean=mesh_lib.replicate(pairs.clean, mesh),  # scores clean estimates; logs only
            lengths=train_split.caption_lengths() if buckets else None,
            buckets=buckets,
            tx=tx,
            schedule=schedule,
        )
        if jax.process_index() == 0:
            print(opening_line(config, method, pairs, mesh, workdir), flush=True)
        return _train(run, graphdef, initial, evaluator, mesh, workdir, callbacks)


def opening_line(config, method, pairs, mesh, workdir: str) -> str:
    """What the run trains, on what, where: its first line."""
    data = config.data
    where = f"the folder {data.folder}" if data.name == "vectors" else f"{data.name}"
    noise = config.noise
    if noise.kind == "none":
        lies = "its own pairs and labels"
    elif noise.kind == "file":
        lies = f"noise from {noise.file.path} ({pairs.realised_rate:.0%} of the pairs)"
    else:
        lies = f"{noise.kind} noise at {noise.rate:g} (seed {noise.seed})"
    networks = f", {method.num_networks} networks" if method.num_networks > 1 else ""
    devices = f"{mesh.size} {jax.default_backend()} device{'s' if mesh.size > 1 else ''}"
    return (
        f"Training {config.method}{networks} ({config.model.head} head) on {where}: "
        f"{pairs.num_records} training pairs, {lies}; {config.train.epochs} "
        f"epoch{'s' if config.train.epochs != 1 else ''} of batch "
        f"{config.train.batch_size} on {devices}; workdir {workdir}."
    )


class _Built(NamedTuple):
    """What a run builds before it writes anything (``_build``)."""

    method: Any
    pairs: pipeline.TrainingPairs
    mesh: jax.sharding.Mesh
    tx: Any
    graphdef: Any
    state: Any
    evaluator: Any
    train_split: Any


def _build(config, overridden) -> tuple[ml_collections.ConfigDict, _Built]:
    """Checks every field and builds the run (data, method, noisy pairs, mesh, optimiser,
    model and state, evaluator) before anything is written: ``(config, built)`` with
    ``data.folder`` made absolute."""
    validation.check(config, overridden)
    config = _absolute_folder(config)
    dataset = sources.load_dataset(config.data)
    info = dataset.info
    validation.check(config, info=info)
    method = methods.build_method(config.method, config.method_kwargs, config.model)
    image_fields, text_fields = models.input_fields(config.model)
    train_split = dataset.split("train")
    pairs = pipeline.training_pairs(
        train_split,
        config.noise,
        num_classes=info.num_classes,
        image_fields=image_fields,
        text_fields=text_fields,
    )
    validation.check(config, realised_rate=pairs.realised_rate)
    mesh = mesh_lib.make_mesh(config.train.num_devices)
    validation.check(config, mesh_size=mesh.size)
    tx = optim.make_optimizer(config.optim)
    init = InitContext(
        pairs.num_records, info, pairs.labels_image, pairs.labels_text, config.model.embed_dim
    )
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(
            config.model, info, rngs, heads_fn=method.heads_fn
        ),
        tx=tx,
        memory=method.init_memory(init),
        num_networks=method.num_networks,
        seed=config.seed,
    )
    evaluator = evaluator_lib.Evaluator.of_method(graphdef, dataset, config, mesh, method)
    return config, _Built(method, pairs, mesh, tx, graphdef, state, evaluator, train_split)


def _train(run, graphdef, initial: list, evaluator, mesh, workdir, callbacks):
    """The run in its locked workdir: resume (from ``initial.pop()``, the built state), the
    epochs, then the test of the best model."""
    config, method = run.config, run.method
    num_epochs = config.train.epochs
    state, progress, saved_sets = _resume(run, mesh_lib.replicate(initial.pop(), mesh), workdir)
    kind = evaluator_lib.eval_kind(config)
    validated = {}  # the last validation's metrics, by the step of the model it scored
    refresh = Refresher(
        graphdef,
        method,
        run.pairs,
        mesh,
        config,
        num_epochs,
        held_out=lambda state: _held_out_share(evaluator, state, validated),
        scratch=os.path.join(workdir, "scratch"),
        divide=arms.divides(config),
    )
    with jax.set_mesh(mesh):
        for epoch in range(progress.epoch, num_epochs):
            plan = method.plan_fn(epoch)
            state, encoded, epoch_passes = _train_epoch(
                run, state, refresh, plan, progress, saved_sets
            )
            saved_sets = None
            _check_finite(state, run.checkpointer)
            val = _validate(run, state, evaluator, workdir, epoch, epoch_passes, kind)
            if config.train.pair_trajectory:  # before the checkpoint: see trajectory.py
                trajectory.record(workdir, epoch, evaluator.training_pair_similarity(state))
            validated.clear()
            validated[int(state.step)] = val
            progress = _select(run, state, progress, plan, val[kind.selection], kind.selection)
            progress = progress.next_epoch()
            run.checkpointer.save(state, progress.to_json(), encoded)
            for callback in callbacks:
                callback(epoch, val)
        test, best = _test_best(run, state, progress, evaluator, workdir, kind.selection)
    return _finish(run, state, test, best, workdir, kind)


def _held_out_share(evaluator, state, validated: dict) -> float | None:
    """The validation split's ``noise_share_estimate`` under ``state``'s model: the last
    validation's where it scored this model (``validated``, by step), else evaluated now
    (a resumed run); recall evaluation only, ``None`` otherwise or where undefined."""
    val = validated.get(int(state.step))
    value = (val if val is not None else evaluator(state, "val")).get("noise_share_estimate")
    return None if value is None or not np.isfinite(value) else float(value)


def _resume(run, state, workdir: str):
    """``(state, progress, saved stream sets)``: the latest checkpoint's, or a fresh run's
    (the metrics log cut back to the checkpoint's step either way)."""
    method, n = run.method, run.pairs.num_records
    progress, saved_sets = Progress(), None
    restored = run.checkpointer.restore(state, passes.encode_streams([], method.num_networks, n))
    if restored is not None:
        state, meta, saved = restored
        progress, saved_sets = Progress.from_json(meta), passes.decode_streams(saved)
        print(
            f"Resumed from step {int(state.step)} in {workdir} (epoch {progress.epoch}, "
            f"pass {progress.pass_}, step {progress.position} of the pass)."
        )
    run.writer.truncate_after(int(state.step) if restored is not None else -1)
    return state, progress, saved_sets


def _train_epoch(run, state, refresh, plan, progress: Progress, saved_sets):
    """Epoch ``progress.epoch``'s passes (from the checkpoint's pass and step when it
    stopped mid-epoch): ``(state, encoded streams, passes)``."""
    config, method, n = run.config, run.method, run.pairs.num_records
    epoch = progress.epoch
    resuming = saved_sets is not None and progress.mid_epoch
    if resuming:  # mid-epoch: refresh, reset and streams are in the checkpoint
        stream_sets, first_pass, position = saved_sets, progress.pass_, progress.position
    else:
        state = _start_epoch(run, state, refresh, epoch, plan)
        stream_sets = passes.epoch_stream_sets(method, plan, state.memory, n, method.num_networks)
        first_pass, position = 0, 0
    state = state._replace(
        opt_state=optim.set_learning_rate(
            state.opt_state, float(run.schedule(_lr_epoch(plan, epoch)))
        )
    )
    epoch_passes = passes.plan_passes(
        method,
        plan,
        stream_sets,
        epoch=epoch,
        batch_size=config.train.batch_size,
        seed=config.seed,
    )
    encoded = passes.encode_streams(stream_sets, method.num_networks, n)
    for p in range(first_pass, len(epoch_passes)):
        last = p == len(epoch_passes) - 1
        at = progress.at(p, position if p == first_pass else 0)
        state = _run_pass(run, state, at, epoch_passes[p], encoded, last)
    return state, encoded, epoch_passes


def _validate(run, state, evaluator, workdir: str, epoch: int, epoch_passes, kind) -> dict:
    """The epoch's validation metrics and diagnostics, logged and printed."""
    method, pairs = run.method, run.pairs
    val = evaluator(state, "val")
    val.update(noise_diagnostics(method, state, pairs.clean))
    val.update(score_diagnostics(method, state, pairs.clean, workdir, epoch))
    val.update(label_diagnostics(method, state, pairs))
    val.update(_pass_lengths(epoch_passes))
    val["learning_rate"] = optim.learning_rate(state.opt_state)
    run.writer.write(step=int(state.step), epoch=epoch, split="val", metrics=val)
    tqdm.tqdm.write(f"epoch {epoch}: val " + kind.summary(val))
    return val


def _select(run, state, progress: Progress, plan, value: float, selection: str) -> Progress:
    """``progress`` after the epoch's model selection (the best checkpoint saved when this
    epoch is strictly better; a tie keeps the earlier epoch, see ``_warn_if_tied``)."""
    every_epoch = run.config.train.select_every_epoch
    progress = progress.finished_pass()
    if plan.restart_best and not every_epoch:
        progress = progress.no_best()
    selectable = plan.selectable or every_epoch
    if selectable:
        _warn_if_tied(value, progress, selection)
    if selectable and value > progress.best_value:
        progress = dataclasses.replace(
            progress, best_value=value, best_epoch=progress.epoch, best_step=int(state.step)
        )
        run.checkpointer.save_best(state, progress.to_json())
    return progress


def _test_best(run, state, progress: Progress, evaluator, workdir: str, selection: str):
    """``(test metrics, best checkpoint's progress)`` of the best model (and of the final
    parameters too under ``eval.test_last_epoch``)."""
    best = run.checkpointer.restore_best(state, progress.best_step)
    if best is None:
        raise ValueError(
            f"No selectable epoch reached a finite validation {selection}; nothing to "
            f"test. See {os.path.join(workdir, 'metrics.jsonl')}."
        )
    best_state, best_meta = best
    best = Progress.from_json(best_meta)
    if arms.compares(run.config):  # the race's paired test reads them
        _write_shares(evaluator, best_state, best, workdir, selection)
    test = evaluator(best_state, "test")
    if run.config.eval.test_last_epoch:  # also the final parameters (MRL/UOT-RCL protocol)
        final = best.best_epoch == run.config.train.epochs - 1
        last = test if final else evaluator(state, "test")
        test.update({f"last_{k}": v for k, v in last.items()})
    return test, best


def _write_shares(evaluator, best_state, best: Progress, workdir: str, selection: str):
    """Writes each validation image's share of the best model's rSum (``arms.SHARES``),
    warning where they do not sum to the rSum that selected it (a model that does not
    score the same twice)."""
    shares = evaluator.rsum_by_image(best_state, "val")
    total = float(np.sum(shares))
    if not math.isclose(total, best.best_value, rel_tol=1e-6, abs_tol=1e-6):
        logging.warning(
            "The best model (epoch %d) scores validation %s=%.6g now, %.6g when it was "
            "selected; the division race compares the shares of the score it has now.",
            best.best_epoch,
            selection,
            total,
            best.best_value,
        )
    arms.write_shares(workdir, shares)


def _finish(run, state, test: dict, best: Progress, workdir: str, kind) -> dict:
    """Completes, logs, writes and prints ``results.json``'s metrics."""
    config, method, pairs = run.config, run.method, run.pairs
    num_epochs, selection = config.train.epochs, kind.selection
    test["best_epoch"] = best.best_epoch
    test[f"val_{selection}"] = best.best_value
    test.update(noise_diagnostics(method, state, pairs.clean))  # the final labels
    main = [e for e in range(num_epochs) if method.plan_fn(e).phase != WARMUP]
    if main:  # a method without a main phase (the baselines) trains no fallback
        share = fallback_share(run.writer.rows(), main)  # process 0 holds the rows
        if jax.process_count() > 1:  # every process returns the same results
            share = float(multihost_utils.broadcast_one_to_all(np.float64(share)))
        test["fallback_share"] = share
    run.writer.write(step=int(state.step), epoch=num_epochs - 1, split="test", metrics=test)
    if jax.process_index() == 0:
        try:
            rundir.atomic_write_json(os.path.join(workdir, arms.results_file(config)), test)
        except OSError as e:
            raise rundir.unwritable(workdir, e) from None
    print(f"test (best val epoch {best.best_epoch}): " + kind.summary(test))
    if config.eval.test_last_epoch:
        last = {k[len("last_") :]: v for k, v in test.items() if k.startswith("last_")}
        print(f"test (last epoch {num_epochs - 1}): " + kind.summary(last))
    return test


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a run is, and its best model so far: saved with every checkpoint (as the JSON
    of :meth:`to_json`, whose keys ``checkpoint.META_KEYS`` checks and the audit reads).

    Attributes:
      epoch: the epoch in progress (the next one to run, at an epoch's end).
      pass_: the pass of the epoch in progress (JSON ``pass``).
      position: steps of that pass done.
      best_value: the best validation score so far (``-inf``: none yet).
      best_epoch: its epoch (-1: none).
      best_step: its step, which names the best checkpoint (-1: none).
      accumulated: the train metrics summed since the last log line, of a pass
        interrupted by a mid-epoch checkpoint, so the next line averages the same steps
        as an uninterrupted run.
    """

    epoch: int = 0
    pass_: int = 0
    position: int = 0
    best_value: float = -math.inf
    best_epoch: int = -1
    best_step: int = -1
    accumulated: dict | None = None

    @property
    def mid_epoch(self) -> bool:
        return bool(self.pass_ or self.position)

    def at(self, pass_: int, position: int) -> Progress:
        """At step ``position`` of pass ``pass_`` of this epoch."""
        return dataclasses.replace(self, pass_=pass_, position=position)

    def finished_pass(self) -> Progress:
        """After the epoch's passes: no partial sums left."""
        return dataclasses.replace(self, accumulated=None)

    def no_best(self) -> Progress:
        """Forgets the best model (``EpochPlan.restart_best``)."""
        return dataclasses.replace(self, best_value=-math.inf, best_epoch=-1, best_step=-1)

    def next_epoch(self) -> Progress:
        """At the start of the next epoch."""
        return dataclasses.replace(
            self, epoch=self.epoch + 1, pass_=0, position=0, accumulated=None
        )

    def to_json(self) -> dict:
        out = {
            "best_value": self.best_value,
            "best_epoch": self.best_epoch,
            "best_step": self.best_step,
            "epoch": self.epoch,
            "pass": self.pass_,
            "position": self.position,
        }
        if self.accumulated is not None:
            out["accumulated"] = self.accumulated
        return out

    @classmethod
    def from_json(cls, meta: dict) -> Progress:
        """From a checkpoint's record (one written before ``best_step`` existed too)."""
        return cls(
            epoch=int(meta["epoch"]),
            pass_=int(meta["pass"]),
            position=int(meta["position"]),
            best_value=float(meta["best_value"]),
            best_epoch=int(meta["best_epoch"]),
            best_step=int(meta.get("best_step", -1)),
            accumulated=meta.get("accumulated"),
        )


class _Run(NamedTuple):
    """What every epoch of a run shares."""

    config: ml_collections.ConfigDict
    method: Any
    pairs: pipeline.TrainingPairs
    train_step: Callable
    sharding: jax.sharding.Sharding
    writer: writers.MetricWriter
    checkpointer: checkpoint.Checkpointer
    clean: jax.Array
    lengths: np.ndarray | None
    buckets: tuple[int, ...]
    tx: Any
    schedule: Callable


# Metrics that measure the machine, not the run: a resumed or repeated run differs in them.
WALL_CLOCK = ("pairs_per_s", "refresh_seconds")


def _lr_epoch(plan, epoch: int) -> int:
    return epoch if plan.lr_epoch is None else plan.lr_epoch


def _start_epoch(run: _Run, state, refresh: Refresher, epoch: int, plan):
    """Before an epoch's first step: its counter, the refresh and an optimiser reset."""
    state = state._replace(epoch=jnp.full_like(state.epoch, epoch))
    if plan.refresh:
        tic = time.perf_counter()
        state, diagnostics = refresh(state, epoch)
        if diagnostics:
            # the statistics pass and every network's refresh, its memory written
            jax.block_until_ready(state.memory)
            diagnostics["refresh_seconds"] = time.perf_counter() - tic
            run.writer.write(
                step=int(state.step), epoch=epoch, split="refresh", metrics=diagnostics
            )
    if plan.reset_optimizer:
        shardings = jax.tree.map(lambda x: x.sharding, state.opt_state)
        fresh = jax.jit(jax.vmap(run.tx.init), out_shardings=shardings)(state.params)
        state = state._replace(opt_state=fresh)
    return state


def _run_pass(run: _Run, state, at: Progress, one_pass, encoded, last: bool):
    """Runs steps ``at.position ..`` of ``one_pass`` (pass ``at.pass_`` of epoch
    ``at.epoch``; ``last``: the epoch's last pass); logs and checkpoints along the way."""
    cfg, batch_size = run.config, run.config.train.batch_size
    epoch, start = at.epoch, at.position
    total = one_pass.num_steps
    batches = pipeline.stream_batches(
        run.pairs.record_fn,
        run.pairs.num_records,
        one_pass.streams,
        batch_size=batch_size,
        num_steps=total,
        start=start,
        num_threads=cfg.data.num_threads,
        prefetch=cfg.data.prefetch,
        lengths=run.lengths,
        length_buckets=run.buckets,
    )
    network = np.int32(one_pass.network or 0)
    host_step = int(state.step)  # counted on the host from here: no per-step device sync
    accumulated = None
    if start and at.accumulated is not None:  # resumed mid-pass: the partial sums
        accumulated = {k: jnp.asarray(v, jnp.float32) for k, v in at.accumulated.items()}
    tic = time.perf_counter()
    rate_from = start
    bar = tqdm.tqdm(
        total=total,
        initial=start,
        desc=f"epoch {epoch}{one_pass.name.replace('_', ' ')}",
        unit="batch",
        disable=not cfg.train.progress_bar or jax.process_index() != 0,
        leave=False,
    )
    with pipeline.reading(batches) as iterator, contextlib.closing(bar):
        put = lambda host: tuple(pipeline.to_device(b, run.sharding) for b in host)
        on_device = pipeline.prefetch_to_device(iterator, put, size=cfg.data.device_prefetch)
        for done, device_batches in enumerate(on_device, start=start + 1):
            state, metrics = run.train_step(
                state, device_batches, one_pass.spec, run.clean, network
            )
            accumulated = (
                metrics if accumulated is None else jax.tree.map(jnp.add, accumulated, metrics)
            )
            host_step += 1
            bar.update(1)
            if done % cfg.train.log_every_steps == 0 or done == total:
                _check_finite(state, run.checkpointer)  # the one host sync
                rate = (done - rate_from) * batch_size / (time.perf_counter() - tic)
                # NaN (logged null) over no item
                mean = mean_of_sums(accumulated) | {"pairs_per_s": rate}
                if one_pass.network is not None:
                    mean["network"] = one_pass.network
                run.writer.write(step=int(state.step), epoch=epoch, split="train", metrics=mean)
                bar.set_postfix(loss=f"{mean['loss']:.4f}", pairs_per_s=f"{rate:.0f}")
                accumulated, rate_from = None, done
                tic = time.perf_counter()
            every = cfg.train.checkpoint_every_steps
            # The epoch's last step is saved after validation, with the next epoch's progress.
            if every and host_step % every == 0 and not (last and done == total):
                _check_finite(state, run.checkpointer)
                sums = (
                    None
                    if accumulated is None
                    else {k: np.asarray(v).tolist() for k, v in jax.device_get(accumulated).items()}
                )
                progress = dataclasses.replace(at, position=done, accumulated=sums)
                run.checkpointer.save(state, progress.to_json(), encoded)
    return state


def _pass_lengths(epoch_passes) -> dict[str, float]:
    """Each pass's steps and stream sizes (the epoch length per network)."""
    out = {}
    for one_pass in epoch_passes:
        out[f"steps{one_pass.name}"] = one_pass.num_steps
        out[f"main_pairs{one_pass.name}"] = len(one_pass.streams[0].indices)
        if len(one_pass.streams) > 1:
            out[f"aux_pairs{one_pass.name}"] = len(one_pass.streams[1].indices)
    return out


def _warn_if_tied(value: float, progress: Progress, selection: str) -> None:
    """Logs a warning when epoch ``progress.epoch``'s validation score equals the best so far.

    Selection keeps the earliest of tied epochs, as the official NCR/SCAN code does
    (``is_best = rsum > best_rsum``) and as ``argmax`` over the logged scores reads: a later
    epoch replaces the best only by scoring strictly higher. A tie is exact equality, which
    for these expected values means the score did not tell the two models apart (a
    saturated metric, a degenerate validation split): the selection is then arbitrary, and
    the warning says so.
    """
    if progress.best_epoch >= 0 and value == progress.best_value:
        logging.warning(
            "epoch %d: validation %s=%.6g ties the best epoch %d, which stays selected (ties "
            "keep the earlier epoch); the score does not tell these models apart: check that "
            "the validation split is large enough and the metric not saturated.",
            progress.epoch,
            selection,
            value,
            progress.best_epoch,
        )


def _check_finite(state, checkpointer) -> None:
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
            f"{int(state.epoch)}); its update was skipped and training stopped, "
            f"{kept}. Check the features for NaN/Inf, or rerun the same command with a lower "
            "--config.optim.learning_rate to resume from the checkpoint."
        )
