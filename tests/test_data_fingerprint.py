"""A run on a vectors folder records the folder's fingerprint; the audit, retrieval and a
resume refuse the run against files that changed (re-exported in another row order,
captions edited in place), and the folder is recorded as an absolute, expanded path.

The digest's oracle is hashlib's BLAKE2b over the size and the bytes, written here."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from ncljax import audit, retrieve
from ncljax.data import fingerprint, vectors
from ncljax.train import rundir, train_and_evaluate
from tests.train.test_loop import load_config


def test_a_small_file_is_hashed_whole(tmp_path):
    path = tmp_path / "a.bin"
    data = os.urandom(5000)
    path.write_bytes(data)
    want = hashlib.blake2b(b"5000" + data, digest_size=16).hexdigest()
    assert fingerprint.file_digest(str(path)) == want


def test_a_large_file_is_sampled_at_evenly_spaced_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "EXACT_BYTES", 1000)
    monkeypatch.setattr(fingerprint, "SAMPLES", 3)
    monkeypatch.setattr(fingerprint, "BLOCK", 100)
    data = bytearray(os.urandom(2100))
    path = tmp_path / "big.bin"
    path.write_bytes(bytes(data))
    # offsets (2100 - 100) * k // 2 for k = 0, 1, 2: 0, 1000, 2000
    blocks = data[0:100] + data[1000:1100] + data[2000:2100]
    want = hashlib.blake2b(b"2100" + bytes(blocks), digest_size=16).hexdigest()
    assert fingerprint.file_digest(str(path)) == want
    data[1050] ^= 1  # inside a sampled block: seen
    path.write_bytes(bytes(data))
    assert fingerprint.file_digest(str(path)) != want


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished GSC run (2 epochs, one divides) on a 64-pair vectors folder."""
    root = tmp_path_factory.mktemp("fingerprint")
    folder = str(root / "folder")
    vectors.from_synthetic(folder, num_train=64, num_val=16, num_test=16, noise_rate=0.4)
    config = load_config("gsc", "vectors,quick")
    config.data.folder = folder
    config.train.division = "on"  # one run (the race: tests/train/test_arms.py)
    config.train.epochs = 2
    config.train.batch_size = config.eval.batch_size = 32
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = str(root / "run")
    train_and_evaluate(config, workdir)
    return folder, workdir, config


def _copy(run, tmp_path):
    """A copy of the run whose config.json names a copy of its folder."""
    folder, workdir, _ = run
    folder2, workdir2 = str(tmp_path / "folder"), str(tmp_path / "run")
    shutil.copytree(folder, folder2)
    shutil.copytree(workdir, workdir2)
    path = os.path.join(workdir2, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["data"]["folder"] = folder2
    with open(path, "w") as f:
        json.dump(config, f)
    return folder2, workdir2


def test_the_run_records_every_file_of_its_folder(run):
    folder, workdir, _ = run
    with open(os.path.join(workdir, "config.json")) as f:
        recorded = json.load(f)[fingerprint.KEY]
    present = sorted(n for n in os.listdir(folder) if n.endswith((".npy", ".txt")))
    assert sorted(fingerprint.file_name(k) for k in recorded) == present
    for key, digest in recorded.items():
        assert digest == fingerprint.file_digest(os.path.join(folder, fingerprint.file_name(key)))
    audit.pair_scores(workdir)  # unchanged: read as before
    retrieve.load(workdir, "test")


def _reordered(folder):
    """Re-exports the training split in another row order (same shapes)."""
    order = np.random.default_rng(0).permutation(64)
    for kind in ("images", "texts"):
        path = vectors.path_of(folder, "train", kind)
        np.save(path, np.load(path)[order])


def _caption_edited(folder):
    path = vectors.path_of(folder, "train", "captions")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    lines[3] = "an edited caption"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


@pytest.mark.parametrize("change", [_reordered, _caption_edited])
def test_the_audit_and_retrieval_refuse_a_changed_folder(run, tmp_path, change):
    folder2, workdir2 = _copy(run, tmp_path)
    audit.pair_scores(workdir2)  # the copy itself is fine
    change(folder2)
    changed = "train_images.npy, train_texts.npy" if change is _reordered else "train_captions"
    with pytest.raises(ValueError, match=f"changed since .*{changed}"):
        audit.pair_scores(workdir2)
    with pytest.raises(ValueError, match=f"changed since .*{changed}"):
        retrieve.load(workdir2, "test")


def test_a_resume_on_a_changed_folder_is_refused_in_one_line(run, tmp_path):
    config = run[2]
    folder2, workdir2 = _copy(run, tmp_path)
    _reordered(folder2)
    config = config.copy_and_resolve_references()
    config.data.folder = folder2
    with pytest.raises(ValueError, match=r"files of data\.folder changed since the run in") as e:
        train_and_evaluate(config, workdir2)
    assert "train_images.npy, train_texts.npy" in str(e.value)


def test_a_run_recorded_before_fingerprints_resumes(run, tmp_path):
    _, workdir, config = run
    workdir2 = str(tmp_path / "run")
    shutil.copytree(workdir, workdir2)
    path = os.path.join(workdir2, "config.json")
    with open(path) as f:
        old = json.load(f)
    digests = old.pop(fingerprint.KEY)
    with open(path, "w") as f:
        json.dump(old, f)
    # The same config, now with a fingerprint: not a change of config.
    rundir.write_config(workdir2, config, {**_extra(old), fingerprint.KEY: digests})
    audit.pair_scores(workdir2)  # nothing recorded: nothing checked


def _extra(resolved):
    return {k: resolved[k] for k in ("noise_checksum", "noise_realised_rate")}


def test_the_folder_is_recorded_absolute_with_home_expanded(run, tmp_path, monkeypatch):
    folder, _, config = run
    home = tmp_path / "home"
    shutil.copytree(folder, home / "pairs")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    config = config.copy_and_resolve_references()
    config.data.folder = "~/pairs"  # as the shell leaves it in --config.data.folder=~/pairs
    config.train.epochs = 1
    train_and_evaluate(config, "relative_run")
    with open(tmp_path / "relative_run" / "config.json") as f:
        assert json.load(f)["data"]["folder"] == str(home / "pairs")


def test_a_relative_folder_of_an_older_run_says_where_it_is_read_from(run, tmp_path):
    workdir = run[1]
    workdir2 = str(tmp_path / "run")
    shutil.copytree(workdir, workdir2)
    path = os.path.join(workdir2, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["data"]["folder"] = "my_pairs"  # as typed, before runs recorded it absolute
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(FileNotFoundError, match=r"relative to the directory its train\.py ran in"):
        audit.pair_scores(workdir2)
