"""Checkpoints: the latest ``TrainState`` with the run's progress, and the best-on-validation model.

Two orbax ``CheckpointManager`` directories under ``workdir/checkpoints``: ``latest``
(the whole ``TrainState``, the index sets of the epoch's passes and a JSON record of the
run's progress: epoch, pass, position in the pass, best validation so far and the step of
its checkpoint, the train metrics accumulated since the last log line; resumed
automatically) and ``best`` (parameters and model state of the best validation epoch,
for the final test evaluation). Batches are a pure function of the seed, the streams
and the position, so no data-iterator state is saved. Saves are synchronous and atomic
(orbax writes a temporary directory and renames it): a crash or a full disk mid-save
leaves the earlier checkpoints intact.

Damaged checkpoints. On resume the newest checkpoint is restored in full (every array,
the streams and the progress record); one that cannot be (a truncated array file, a
damaged JSON record, a missing item) is moved to ``checkpoints/damaged/`` (never
deleted), the reason is logged, and the next newest is tried. If none can be restored,
one error says so.

The best checkpoint belongs to the run's own history: the progress record names its
step, every save of ``latest`` removes the other ``best`` checkpoints, and a resume
removes those its progress record does not name (written by a run that was killed
before its ``latest`` save and is now resumed from an earlier step, possibly with
another learning rate).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import jax
import orbax.checkpoint as ocp

from ncljax.train.state import TrainState

DAMAGED = "damaged"
# The progress record's fields (checked on restore, so a damaged record is caught there).
META_KEYS = ("best_value", "best_epoch", "epoch", "pass", "position")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint of a run can be restored."""


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _to_saveable(state: TrainState) -> TrainState:
    return state._replace(rng=jax.random.key_data(state.rng))


def _from_saveable(state: TrainState) -> TrainState:
    return state._replace(rng=jax.random.wrap_key_data(state.rng))


def _reason(error: BaseException) -> str:
    """A one-line reason: the innermost cause's type and the first line of its message
    (orbax wraps TensorStore's error, which names the file and the problem, in one that
    prints a whole TensorStore spec)."""
    seen = {id(error)}
    while (error.__cause__ or error.__context__) is not None:
        inner = error.__cause__ or error.__context__
        if id(inner) in seen:
            break
        seen.add(id(inner))
        error = inner
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Mutes what orbax's failed reads and writes print on their own.

    A damaged array file fails many of orbax's concurrent reads at once, and a full disk
    many concurrent writes. Each failed task, coroutine, worker thread and TensorStore
    callback into a closed event loop prints a traceback (with a whole TensorStore spec)
    when it ends or is collected: hundreds of lines for one truncated file. Inside this
    block those reports are muted; the caller turns the failure into one message.
    """
    hooks = sys.excepthook, sys.unraisablehook, threading.excepthook
    loggers = [logging.getLogger(name) for name in ("asyncio", "absl")]
    levels = [logger.level for logger in loggers]
    sys.excepthook = lambda *args: None
    sys.unraisablehook = threading.excepthook = lambda *args: None
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sys.excepthook, sys.unraisablehook, threading.excepthook = hooks
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def mute_background_errors() -> None:
    """Mutes, for the rest of the process, what orbax's unfinished background work prints
    when it fails at exit. For a process about to end after an interrupt: a save it cut
    short left only a temporary directory, which the next run removes."""
    sys.unraisablehook = threading.excepthook = lambda *args: None
    for name in ("asyncio", "absl"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _settle(manager=None) -> None:
    """Lets the failed operation's stragglers end (inside ``muted``)."""
    if manager is not None:
        with contextlib.suppress(Exception):
            manager.wait_until_finished()
    gc.collect()
    time.sleep(0.1)  # reads and writes still in flight end into the closed loop
    gc.collect()


def attempt(restore: Callable[[], dict]) -> tuple[dict | None, str | None]:
    """Runs one restore, turning any failure into a one-line reason.

    Inside :func:`muted`; the restored ``meta`` must hold every key of ``META_KEYS``. After a
    failure the failed reads are let end first, so nothing prints once the caller moves on.

    Args:
      restore: restores one checkpoint; returns a dict with at least ``'meta'``.

    Returns:
      ``(restore(), None)``, or ``(None, reason)`` when the checkpoint cannot be restored
      (a damaged or missing file, whichever layer finds it, or an incomplete progress record).
    """
    with muted():
        try:
            out = restore()
            _check_meta(out["meta"])
            return out, None
        except Exception as e:  # a damaged file, whichever layer finds it
            reason = _reason(e)
        _settle()  # the exception, and the failed reads its traceback holds, are gone now
        return None, reason


def _await_cleanup(manager) -> None:
    """Waits for the removal of an interrupted save's temporary directories.

    orbax starts it in a thread when the manager is created and waits for it only in its
    first ``save``; ``close`` does not. A process that stops before saving (an error, a
    restore-only use such as ``ncljax.train.ensemble``, Ctrl-C) would end with that thread
    still listing the directory, and its failure at interpreter exit prints a traceback.
    """
    wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)  # private in orbax
    if wait is not None:
        wait()


def _check_meta(meta) -> None:
    if not isinstance(meta, dict) or any(k not in meta for k in META_KEYS):
        raise ValueError(f"the progress record lacks {[k for k in META_KEYS if k not in meta]}")


class Checkpointer:
    """Saves and restores a run's checkpoints in ``directory``."""

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        directory = os.path.abspath(directory)
        self._directory = directory
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "streams": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        try:
            self._latest = ocp.CheckpointManager(
                os.path.join(directory, "latest"),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep,
                    enable_async_checkpointing=False,
                    cleanup_tmp_directories=True,
                ),
                item_handlers=handlers,
            )
            # Every best checkpoint is kept until a save of ``latest`` makes it history.
            self._best = ocp.CheckpointManager(
                os.path.join(directory, "best"),
                options=ocp.CheckpointManagerOptions(
                    enable_async_checkpointing=False, cleanup_tmp_directories=True
                ),
                item_handlers={"state": handlers["state"], "meta": handlers["meta"]},
            )
            for manager in (self._latest, self._best):
                _await_cleanup(manager)
        except OSError as e:
            raise CheckpointError(
                f"Cannot open the checkpoint directory {directory} ({_reason(e)}); make it "
                "writable or use another --workdir."
            ) from None

    def latest_step(self) -> int | None:
        return self._latest.latest_step()

    def save(self, state: TrainState, meta: dict, streams: dict) -> None:
        """Saves the state, ``meta`` (progress, best so far) and the epoch's ``streams``
        (``passes.encode_streams``) at ``state.step``; then keeps only the ``best``
        checkpoint ``meta['best_step']`` names."""
        step = int(state.step)
        if step not in self._latest.all_steps():
            self._save(
                self._latest,
                step,
                ocp.args.Composite(
                    state=ocp.args.StandardSave(_to_saveable(state)),
                    streams=ocp.args.StandardSave(streams),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        self.keep_best(meta.get("best_step", -1))

    def _save(self, manager, step: int, args) -> None:
        with muted():
            try:
                manager.save(step, args=args)
                return
            except Exception as e:  # a full disk, a lost mount, permissions: orbax's own
                reason = _reason(e)
            _settle(manager)
        kept = [s for s in manager.all_steps() if s != step]
        raise CheckpointError(
            f"Saving the checkpoint of step {step} in {manager.directory} failed ({reason}). "
            f"The earlier checkpoints {kept} are intact. Free space on the disk (or fix the "
            "cause) and run the same command again to resume from them."
        )

    def restore(self, like: TrainState, like_streams: dict) -> tuple[TrainState, dict, dict] | None:
        """Restores the newest checkpoint that can be restored: a state shaped like ``like``,
        ``meta`` and the streams (shaped like ``like_streams``). Damaged ones are moved to
        ``checkpoints/damaged/`` and the next newest is tried. ``None`` when there is no
        checkpoint; the best checkpoints not named by the restored ``meta`` are removed.

        Raises:
          CheckpointError: when checkpoints exist but none can be restored.
        """
        abstract_state = _abstract(_to_saveable(like))
        abstract_streams = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like_streams
        )
        set_aside = []
        for step in sorted(self._latest.all_steps(), reverse=True):
            out, reason = attempt(
                lambda step=step: self._latest.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        streams=ocp.args.StandardRestore(abstract_streams),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
            )
            if out is None:
                set_aside.append(self._set_aside(self._latest, step, reason))
                continue
            meta = out["meta"]
            if set_aside:
                logging.warning("Resuming from the checkpoint of step %d instead.", step)
            # A best checkpoint written after this one belongs to a discarded history.
            self.keep_best(meta.get("best_step", -1), after=None if "best_step" in meta else step)
            state = _from_saveable(out["state"])
            return state, meta, jax.device_get(out["streams"])
        if set_aside:
            raise CheckpointError(
                f"No checkpoint in {self._latest.directory} can be restored; the damaged ones "
                f"were moved to {set_aside} (see the warnings above). Run the same command again "
                "to start this run from the beginning, or use a new --workdir."
            )
        self.keep_best(-1)  # no history: a best checkpoint here was never followed by a save
        return None

    def _set_aside(self, manager, step: int, reason: str) -> str:
        """Moves checkpoint ``step`` of ``manager`` to ``checkpoints/damaged/``."""
        source = os.path.join(str(manager.directory), str(step))
        name = f"{os.path.basename(str(manager.directory))}-{step}"
        target = os.path.join(self._directory, DAMAGED, name)
        suffix = 1
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(self._directory, DAMAGED, f"{name}.{suffix}")
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
        manager.reload()
        logging.warning(
            "The checkpoint %s cannot be restored (%s); it was moved to %s.",
            source,
            reason,
            target,
        )
        return target

    def keep_best(self, step: int, *, after: int | None = None) -> None:
        """Removes the best checkpoints other than ``step`` (``after``: only those past it).

        Every process calls it: orbax's ``delete`` removes the files on the primary process
        and then waits for every process (a delete called on process 0 alone waited there
        forever while the others went on into the next epoch's collectives)."""
        for s in self._best.all_steps():
            if s != step and (after is None or s > after):
                self._best.delete(s)

    def save_best(self, state: TrainState, meta: dict) -> None:
        """Keeps the model of ``state`` as the best one so far (``meta['best_step']``)."""
        step = int(state.step)
        if step in self._best.all_steps():  # never the run's own: written before a resume
            self._best.delete(step)
        model = {"params": state.params, "model_state": state.model_state}
        self._save(
            self._best,
            step,
            ocp.args.Composite(state=ocp.args.StandardSave(model), meta=ocp.args.JsonSave(meta)),
        )

    def restore_best(
        self, like: TrainState, step: int | None = None
    ) -> tuple[TrainState, dict] | None:
        """``like`` with the best model's parameters and model state, and its ``meta``.

        ``step``: the best checkpoint's step (from the progress record); default the newest.
        ``None`` when there is no best checkpoint.

        Raises:
          CheckpointError: the best checkpoint is missing or cannot be restored (it is left
            where it is).
        """
        steps = self._best.all_steps()
        if step is None or step < 0:
            step = self._best.latest_step()
            if step is None:
                return None
        path = os.path.join(str(self._best.directory), str(step))
        if step not in steps:
            raise CheckpointError(
                f"The best checkpoint {path} is missing (found {sorted(steps)}); the run cannot "
                "be tested. Restore it from a copy, or train again in a new --workdir."
            )
        model = {"params": like.params, "model_state": like.model_state}
        out, reason = attempt(
            lambda: self._best.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(model)),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        )
        if out is None:
            raise CheckpointError(
                f"The best checkpoint {path} cannot be restored ({reason}); the run cannot "
                "be tested. metrics.jsonl and results.json were left as they were. Restore the "
                "checkpoint from a copy, or train again in a new --workdir."
            )
        meta = out["meta"]
        best = out["state"]
        return like._replace(params=best["params"], model_state=best["model_state"]), meta

    def close(self) -> None:
        self._latest.close()
        self._best.close()
