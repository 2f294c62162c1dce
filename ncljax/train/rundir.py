"""The run directory: its lock, its ``config.json``, and which fields a resumed run may change."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import socket

import jax
import numpy as np
from flax import traverse_util

from ncljax.config import renames
from ncljax.data import fingerprint

# Fields a resumed run may change: they alter neither the shapes of the state nor the
# data order, e.g. to lower the learning rate after a NaN stop.
# Records a run writes that runs before them did not: their absence from a resumed run's
# config.json is not a change of config.
NEW_RECORDS = (fingerprint.KEY,)
# Fields added since runs were first written, with the value a run that predates each ran
# with: a config.json without the field is read as that value (a run of before
# ``train.division`` divided as its method does, 'on', and resumes as such).
ABSENT_MEANS = {"train.division": "on"}
RESUMABLE = (
    "optim.learning_rate",
    "optim.schedule",
    "optim.step.factor",
    "optim.step.every",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "optim.adamw.weight_decay",
    "train.log_every_steps",
    "train.checkpoint_every_steps",
    "train.progress_bar",
    # the per-epoch similarity files only (a run that gains them mid-way is audited by its
    # best model, with a note: its first epochs have none)
    "train.pair_trajectory",
    # read when both runs of a race have finished, to decide between them
    "train.race_alpha",
    "data.num_threads",
    "data.prefetch",
    "data.length_buckets",
    "eval.batch_size",
    "eval.recall.image_chunk",
    "eval.recall.text_chunk",
    "distributed",
    "cluster.coordinator_address",  # another launch of the same run: the mesh's devices
    "cluster.num_processes",  # change, not its results (device-count invariant)
    "cluster.process_id",
)


def write_config(workdir: str, config, extra: dict) -> None:
    """Writes ``config.json``; refuses a workdir that holds a run of another config.

    Only the ``RESUMABLE`` fields may differ from the run being resumed.
    """
    resolved = finite_json({**json.loads(config.to_json_best_effort()), **extra})
    path = os.path.join(workdir, "config.json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                saved = renames.upgrade(finite_json(json.load(f)))  # runs of old names
                previous = traverse_util.flatten_dict(saved, sep=".")
        except (ValueError, AttributeError) as e:  # not JSON, or not an object
            raise ValueError(
                f"{path} is damaged ({type(e).__name__}: {e}); it records the config of the run "
                "in this workdir. Restore it from a copy, or use a new --workdir."
            ) from None
        current = traverse_util.flatten_dict(resolved, sep=".")
        absent = {k: v for k, v in ABSENT_MEANS.items() if k in current and k not in previous}
        previous = {**previous, **absent}
        unrecorded = tuple(r for r in NEW_RECORDS if not any(k.startswith(r) for k in previous))
        changed = sorted(
            k
            for k in previous.keys() | current.keys()
            if previous.get(k) != current.get(k) and not k.startswith(unrecorded)
        )
        fixed = [k for k in changed if k not in RESUMABLE]
        data_files = [
            fingerprint.file_name(k.split(".", 1)[1])
            for k in fixed
            if k.startswith(fingerprint.KEY + ".")
        ]
        if data_files and len(data_files) == len(fixed):
            raise ValueError(
                f"The files of data.folder changed since the run in {workdir} started "
                f"({', '.join(data_files)}): resume it on the folder it trained on, or use a "
                "new --workdir to train on this one."
            )
        if fixed:
            raise ValueError(
                f"{workdir} holds a run with a different config ({fixed} differ). Use a new "
                "--workdir, or the same config to resume that run (only "
                f"{list(RESUMABLE)} may change)."
            )
        if changed:
            print(f"Resuming with changed {', '.join(f'{k}={current.get(k)}' for k in changed)}.")
    if jax.process_index() == 0:
        try:
            atomic_write_json(path, resolved)
        except OSError as e:
            raise unwritable(workdir, e) from None


def finite_json(value):
    """``value`` with every NaN or infinite float (in nested dicts, lists and tuples)
    replaced by ``None``, so it is written as ``null``: ``NaN`` and ``Infinity`` are not
    JSON, and strict parsers refuse them. A metric that is undefined (a precision when
    nothing was flagged) reads as missing."""
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def atomic_write_json(path: str, value) -> None:
    """Writes ``value`` as strict JSON (non-finite floats as ``null``, ``finite_json``) to
    ``path`` through a temporary file and a rename, so a crash or a full disk never leaves
    a half-written file."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(finite_json(value), f, indent=2, sort_keys=True, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_save_npy(path: str, array) -> None:
    """Saves ``array`` to ``path`` (a ``.npy``) through a temporary file and a rename, so a
    crash leaves the previous file or none, never a partial one."""
    partial = f"{path}.partial.npy"
    np.save(partial, array)
    os.replace(partial, path)


LOCK_NAME = "lock"


class WorkdirLock:
    """An exclusive lock on a run directory, held while a run uses it.

    ``workdir/lock`` is locked with ``fcntl.flock`` and holds the holder's host and pid.
    The kernel releases a ``flock`` when its process ends, however it ends, so the lock of
    a dead process (a killed run, a power cut) is free: the next run takes it over and says
    so. A second process on a locked workdir is refused with the holder's host and pid.
    On a file system without ``flock`` the holder's pid is checked instead (same host only).
    Only process 0 of a multi-host run locks.
    """

    def __init__(self, workdir: str):
        self._path = os.path.join(workdir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        if jax.process_index() != 0:
            return
        fd = _open_for_writing(self._path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirLocked(
                f"{os.path.dirname(self._path)} is in use by another run ({holder}). Wait for "
                "it to finish or stop it, or use another --workdir."
            ) from None
        except OSError:  # no flock on this file system: fall back to the holder's pid
            holder = _parse_holder(_read_holder(fd))
            mine = holder is not None and holder[1] == os.getpid()
            if holder and holder[0] == socket.gethostname() and _alive(holder[1]) and not mine:
                os.close(fd)
                raise WorkdirLocked(
                    f"{os.path.dirname(self._path)} is in use by another run (host "
                    f"{holder[0]}, pid {holder[1]}). Wait for it to finish or stop it, or "
                    "use another --workdir."
                ) from None
        previous = _read_holder(fd)
        if previous:
            logging.warning(
                "Took over the lock of %s, left by a run that ended without releasing it (%s).",
                os.path.dirname(self._path),
                previous,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # an empty lock file: released cleanly
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class WorkdirLocked(RuntimeError):
    """Another live run holds the workdir."""


def _open_for_writing(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise unwritable(os.path.dirname(path), e) from None


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _parse_holder(text: str) -> tuple[str, int] | None:
    parts = text.split()
    if len(parts) == 4 and parts[0] == "host" and parts[2] == "pid" and parts[3].isdigit():
        return parts[1], int(parts[3])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        pass
    return True


def unwritable(path: str, error: OSError) -> OSError:
    """One clear error for a run directory that cannot be written (permissions, full disk)."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    hint = {
        errno.ENOSPC: "free space on its disk or use another --workdir",
        errno.EDQUOT: "free space in your quota or use another --workdir",
    }.get(error.errno, "make it writable or use another --workdir")
    return type(error)(error.errno, f"cannot write to the run directory {path} ({reason}); {hint}")


def make_workdir(workdir: str) -> None:
    """Creates ``workdir``; one clear error when it cannot be created or written."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise unwritable(workdir, e) from None
