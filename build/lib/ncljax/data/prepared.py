"""Shared plumbing of the TFDS builders: prepare once from the manual files, then read.

Every real benchmark is a ``tfds.core.GeneratorBasedBuilder`` (subclass ``Builder``)
whose examples are written to ArrayRecord **in generation order**
(``DatasetInfo(disable_shuffling=True)`` and keys from ``ordered_key``), so the position
of a record in a split is its dataset index and ``as_data_source`` gives random access by
index without loading anything whole into memory. TensorFlow is not needed.

``prepare`` is the one entry point: it prepares a builder once (under a lock, after
removing what a killed preparation left behind) and opens its splits as
``SplitRecords``, whose reads name the prepared directory when a file is damaged.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import inspect
import os
import re
import resource
import shutil
import types
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core import constants

# TFDS 4.x (``utils.incomplete_dir``) writes ``<folder>/<version>`` as
# ``<folder>/incomplete.<6 of A-Z0-9>_<version>`` and renames it when done; a killed
# preparation leaves it behind.
_LEFTOVER = re.compile(re.escape(constants.INCOMPLETE_PREFIX) + r"[A-Z0-9]{6}_\d+\.\d+\.\d+")
LOCK_FILE = ".prepare.lock"


def ordered_key(index: int, num_examples: int) -> int:
    """The TFDS key of example ``index`` of a split written in index order.

    With shuffling disabled TFDS sorts examples by key. Once a split outgrows its 1 GB
    memory buffer, it spreads them over 1000 temporary buckets by key value (as a
    fraction of 2**128) and sorts each bucket in memory: keys spread evenly over
    [0, 2**128) keep every bucket at 1/1000 of the split, where keys 0..n-1 would put the
    whole split into one bucket and into memory.
    """
    return index * (2**128 // num_examples)


class _NeverRaised(Exception):
    pass


@contextlib.contextmanager
def spill_without_tensorflow() -> Iterator[None]:
    """Lets TFDS prepare a split larger than its 1 GB sort buffer without TensorFlow.

    TFDS sorts a split's examples in memory up to 1 GB; beyond that it spills them to
    temporary bucket files through ``tf.io.gfile``, which fails when TensorFlow is not
    installed (ncljax does not need it, and every precomp train split is larger than
    1 GB). The bucket files are local temporary files written and read back by the same
    TFDS code, so while a dataset is prepared Python's own file functions stand in for
    ``tf.io.gfile`` in TFDS's shuffle module. With TensorFlow installed nothing changes.
    """
    if importlib.util.find_spec("tensorflow") is not None:
        yield
        return
    from tensorflow_datasets.core import shuffle

    gfile = types.SimpleNamespace(GFile=open, exists=os.path.exists, remove=os.remove)
    errors = types.SimpleNamespace(ResourceExhaustedError=_NeverRaised)
    # The 1000 bucket files are open at once.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = shuffle.BUCKETS_NUMBER + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    original = shuffle.tf
    shuffle.tf = types.SimpleNamespace(io=types.SimpleNamespace(gfile=gfile), errors=errors)
    try:
        yield
    finally:
        shuffle.tf = original


class Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of ncljax's builders (TFDS-internal details they all need)."""

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's own lookup imports the importlib_resources backport for builders defined
        # in a package, which Python 3.11 environments need not have; this is the answer.
        return epath.Path(inspect.getfile(cls))


def data_dir(cfg) -> str:
    """Where prepared data lives: ``data.data_dir``, else TFDS's default directory."""
    return os.path.expanduser(cfg.data_dir or os.path.join("~", "tensorflow_datasets"))


def manual_dir(cfg, name: str) -> str:
    """The released files: ``data.manual_dir``, else ``<data_dir>/downloads/manual/<name>``."""
    if cfg.manual_dir:
        return os.path.expanduser(cfg.manual_dir)
    return os.path.join(data_dir(cfg), "downloads", "manual", name)


@contextlib.contextmanager
def _preparation_lock(folder: str) -> Iterator[bool]:
    """Holds an exclusive ``flock`` on ``<folder>/.prepare.lock``; waits for another holder.

    Yields whether the lock is held: False on a file system without locks (some network
    mounts), where preparation goes on unguarded.
    """
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    with open(path, "a") as lock:  # closing it (or the process ending) releases the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"Waiting for another process preparing data in {folder} (it holds {path}) ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as err:
            print(f"Cannot lock {path} ({err}); preparing without a lock.")
            yield False
            return
        yield True


def remove_leftovers(folder: str) -> list[str]:
    """Removes the ``incomplete.XXXXXX_<version>`` folders TFDS left in ``folder``.

    Only call it while holding the preparation lock of ``folder``: the folder of a live
    preparation has the same name.

    Returns:
      The removed paths (each also printed).
    """
    removed = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and _LEFTOVER.fullmatch(entry.name):
            shutil.rmtree(entry.path)
            print(f"Removed {entry.path}, left behind by an interrupted preparation.")
            removed.append(entry.path)
    return removed


def prepare(builder, manual: str) -> dict[str, SplitRecords]:
    """Prepares ``builder`` from ``manual`` if needed; opens and checks its splits.

    Preparation holds an exclusive lock on ``<data_dir>/<name>/<config>/.prepare.lock``
    (``fcntl.flock``, released when the process ends, however it ends): a second process
    asking for the same dataset waits, then reads what the first one prepared. Under the
    lock no other preparation of this dataset config is alive, so the
    ``incomplete.XXXXXX_<version>`` folders of killed ones (a half-written split can take
    tens of GB) are removed first. Where locks are unsupported, they are kept, and two
    processes must not prepare the same dataset at once.

    The builder's ``_split_generators`` must check the manual files and raise one clear
    error (naming the file and the expected layout) when they are missing or malformed.

    Returns:
      ``{split: SplitRecords}``; the first, middle and last record of each were read
      and are in index order (``check_order``).

    Raises:
      ValueError: naming the prepared directory, when a record cannot be read or the
        records are out of order.
    """
    if not builder.is_prepared():
        folder = os.fspath(builder.data_path.parent)
        with _preparation_lock(folder) as locked:
            if builder.is_prepared():  # by the process this one waited for
                builder.info.read_from_directory(builder.data_dir)
            else:
                if locked:
                    remove_leftovers(folder)
                print(
                    f"Preparing {builder.info.full_name} from {manual} into {builder.data_dir} ..."
                )
                with spill_without_tensorflow():
                    builder.download_and_prepare(
                        download_config=tfds.download.DownloadConfig(manual_dir=manual)
                    )
    directory = os.fspath(builder.data_dir)
    splits = {}
    for split, source in builder.as_data_source().items():
        splits[split] = SplitRecords(source, split, directory)
        check_order(splits[split])
    return splits


class SplitRecords:
    """The records of one prepared split by position (``len``, ``[position]``).

    A damaged ArrayRecord file (truncated or overwritten after preparation) fails only
    when a read reaches the damage, deep inside array_record, with ``Corrupted
    Riegeli``, a decoding error or a missing-file error that names no dataset; here any
    failed read of an existing position becomes one ``ValueError`` naming the prepared
    directory and what to do. A read that succeeds costs nothing more.

    Attributes:
      split: the split name.
      directory: the prepared directory ``<data_dir>/<name>/<config>/<version>``.
    """

    def __init__(self, source, split: str, directory: str):
        self._source = source
        self.split = split
        self.directory = directory

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, position: int):
        try:
            return self._source[position]
        except Exception as err:
            n = len(self._source)
            if isinstance(err, IndexError) and not -n <= position < n:
                raise
            raise self.damaged(
                f"record {position} cannot be read ({type(err).__name__}: {err})"
            ) from err

    def damaged(
        self,
        problem: str,
        cause: str = "its files were changed after preparation (truncated, overwritten or removed)",
    ) -> ValueError:
        """The error for a prepared split that must be prepared again."""
        return ValueError(
            f"The prepared split '{self.split}' in {self.directory} cannot be used: "
            f"{problem}; {cause}. Delete {self.directory} and run again to prepare it anew."
        )


def check_order(records: SplitRecords) -> None:
    """Reads the first, middle and last record of a split; refuses records out of index
    order. A damaged file fails here, when the data is opened, rather than hours into
    training."""
    n = len(records)
    for position in sorted({0, n // 2, n - 1}) if n else ():
        found = int(np.asarray(records[position]["index"]))
        if found != position:
            raise records.damaged(
                f"it holds record {found} at position {position}", "it was written shuffled"
            )
