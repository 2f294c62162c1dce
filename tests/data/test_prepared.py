"""Shared TFDS preparation helpers: ordered keys, the spill shim, and a tiny builder
prepared, damaged, killed and prepared concurrently (the oracle: record ``i`` of a split
holds ``[i] * 4`` and index ``i``)."""

import fcntl
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core import shuffle

from ncljax.data import prepared


def test_ordered_keys_keep_index_order_and_spread_over_the_shuffle_buckets():
    """TFDS sorts by key and, past its memory buffer, buckets keys by value (as a fraction
    of 2**128) and sorts each bucket in memory: keys must be increasing and spread."""
    for n in (1, 7, 42_941):
        keys = [prepared.ordered_key(i, n) for i in range(n)]
        assert keys == sorted(keys) and len(set(keys)) == n and keys[-1] < 2**128
    buckets = [
        shuffle.get_bucket_number(hkey=prepared.ordered_key(i, 42_941), num_buckets=1000)
        for i in range(42_941)
    ]
    assert np.bincount(buckets).max() <= 43 and len(set(buckets)) == 1000


def test_spill_shim_is_scoped():
    original = shuffle.tf
    with prepared.spill_without_tensorflow():
        inside = shuffle.tf
        assert inside.io.gfile.GFile is open or inside is original
    assert shuffle.tf is original


# ---------------------------------------------------------------- a tiny prepared dataset

SIZES = {"train": 40, "test": 7}
KILL_IN = "NCLJAX_TEST_KILL_IN"  # the generator kills its process in this split


class Tiny(prepared.Builder, skip_registration=True):
    """Records ``{'value': [i] * 4, 'index': i}`` in index order, per split of ``SIZES``."""

    name = "tiny_records"
    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        tfds.core.BuilderConfig(name="plain")
    ]

    def _info(self):
        value = tfds.features.Tensor(shape=(4,), dtype=np.float32, encoding="bytes")
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({"value": value, "index": np.int64}),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        self.info.metadata["sizes"] = SIZES
        return {split: self._generate_examples(split, n) for split, n in SIZES.items()}

    def _generate_examples(self, split, n):
        for i in range(n):
            if i == 3 and os.environ.get(KILL_IN) == split:
                os.kill(os.getpid(), signal.SIGKILL)
            yield prepared.ordered_key(i, n), {"value": np.full(4, i, np.float32), "index": i}


def tiny(data_dir):
    return Tiny(config="plain", data_dir=str(data_dir), file_format="array_record")


def assert_reads_back(splits):
    assert {split: len(records) for split, records in splits.items()} == SIZES
    for split, records in splits.items():
        for i in range(SIZES[split]):
            assert records[i]["index"] == i
            np.testing.assert_array_equal(records[i]["value"], np.full(4, i, np.float32))


def shard(data_dir, split):
    (path,) = glob.glob(os.path.join(tiny(data_dir).data_dir, f"*-{split}.array_record-*"))
    return path


def overwrite(path):
    with open(path, "r+b") as f:
        f.write(np.random.default_rng(0).bytes(os.path.getsize(path)))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", [overwrite, truncate, os.remove], ids=lambda f: f.__name__)
def test_a_damaged_prepared_file_names_the_directory_to_delete(tmp_path, damage):
    """ArrayRecord's own errors ('Corrupted Riegeli/records file', a decoding error on a
    truncated file, 'open() failed') name no dataset and come at the first read."""
    assert_reads_back(prepared.prepare(tiny(tmp_path), ""))
    damage(shard(tmp_path, "test"))
    builder = tiny(tmp_path)
    with pytest.raises(ValueError) as info:
        prepared.prepare(builder, "")
    message = str(info.value)
    assert f"split 'test' in {builder.data_dir}" in message
    assert f"Delete {builder.data_dir} and run again" in message
    assert "cannot be read" in message
    # Deleting it as told prepares it anew.
    shutil.rmtree(builder.data_dir)
    assert_reads_back(prepared.prepare(tiny(tmp_path), ""))


def test_split_records_name_the_directory_on_any_failed_read():
    class Source:
        def __len__(self):
            return 3

        def __getitem__(self, position):
            if not -3 <= position < 3:
                raise IndexError(position)
            raise RuntimeError("Corrupted Riegeli/records file: block header hash mismatch")

    records = prepared.SplitRecords(Source(), "train", "/data/x/plain/1.0.0")
    with pytest.raises(ValueError, match="Corrupted Riegeli") as info:
        records[2]
    assert "split 'train' in /data/x/plain/1.0.0" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(IndexError):  # a wrong position is the caller's error, not damage
        records[3]


def test_records_out_of_order_are_refused(tmp_path):
    splits = prepared.prepare(tiny(tmp_path), "")
    shuffled = prepared.SplitRecords(
        [splits["train"][i] for i in reversed(range(40))], "train", "/d/1.0.0"
    )
    with pytest.raises(ValueError, match="holds record 39 at position 0; it was written shuffled"):
        prepared.check_order(shuffled)


# ---------------------------------------------------------------- interrupted preparations


def test_leftovers_of_a_killed_preparation_are_removed_before_preparing_again(tmp_path, capsys):
    """A preparation killed mid-split (SIGKILL: no cleanup runs) leaves TFDS's
    ``incomplete.XXXXXX_1.0.0`` folder; the next preparation removes it and says so."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_prepared as t; "
        "t.prepared.prepare(t.tiny(sys.argv[2]), '')"
    )
    env = {**os.environ, KILL_IN: "test"}  # after train is written
    here = os.path.dirname(__file__)
    command = [sys.executable, "-c", script, here, str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, check=False)
    assert done.returncode == -signal.SIGKILL
    folder = os.path.dirname(tiny(tmp_path).data_dir)
    (leftover,) = [name for name in os.listdir(folder) if name.startswith("incomplete.")]
    assert re.fullmatch(r"incomplete\.[A-Z0-9]{6}_1\.0\.0", leftover)
    assert os.listdir(os.path.join(folder, leftover))  # it holds the half-written files
    # Names outside TFDS's pattern, and other configs' folders, are left alone.
    keep = [
        os.path.join(folder, "incomplete.notes"),
        os.path.join(folder, os.pardir, "other", "incomplete.ABCDEF_1.0.0"),
    ]
    for path in keep:
        os.makedirs(path)
    capsys.readouterr()

    builder = tiny(tmp_path)
    assert not builder.is_prepared()
    assert_reads_back(prepared.prepare(builder, ""))
    assert f"Removed {os.path.join(folder, leftover)}, left behind" in capsys.readouterr().out
    assert sorted(os.listdir(folder)) == [prepared.LOCK_FILE, "1.0.0", "incomplete.notes"]
    assert all(os.path.isdir(path) for path in keep)


def test_a_second_preparer_waits_for_the_first_and_reads_its_result(tmp_path, capsys):
    first, second = tiny(tmp_path), tiny(tmp_path)
    folder = os.path.dirname(first.data_dir)
    os.makedirs(folder)
    result = {}
    with open(os.path.join(folder, prepared.LOCK_FILE), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a first preparer would hold it
        try:
            waiting = threading.Thread(
                target=lambda: result.update(prepared.prepare(second, "")), daemon=True
            )
            waiting.start()
            time.sleep(0.5)
            assert waiting.is_alive() and not result
            first.download_and_prepare()  # the first preparer's work, while it holds the lock
            # Leftovers are removed only before preparing, not by a preparer that waited.
            os.makedirs(os.path.join(folder, "incomplete.QWERTY_1.0.0"))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        waiting.join(timeout=30)
    assert not waiting.is_alive()
    out = capsys.readouterr().out
    assert f"Waiting for another process preparing data in {folder}" in out
    assert "Preparing" not in out and "Removed" not in out
    assert_reads_back(result)
    assert second.info.metadata["sizes"] == SIZES  # read from what the first one wrote
    assert os.path.isdir(os.path.join(folder, "incomplete.QWERTY_1.0.0"))
