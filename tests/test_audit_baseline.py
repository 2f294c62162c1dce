"""The audit beside the practitioners' ranking: the raw cosine of each pair's own vectors
(CLIP-score filtering) and the AUC of both rankings against a file of known mismatches."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ncljax import audit
from ncljax.data import vectors
from ncljax.train import train_and_evaluate
from tests.train.test_loop import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_space_folder(path, seed=0):
    """Images and captions of one space: caption = its image + noise; 30% of the training
    captions moved to another image (the truth returned)."""
    rng = np.random.default_rng(seed)

    def split(n):
        images = rng.normal(size=(n, 16)).astype(np.float32)
        texts = images + 0.7 * rng.normal(size=(n, 16)).astype(np.float32)
        return images, texts

    train_images, train_texts = split(400)
    moved = rng.permutation(400)[:120]
    train_texts[moved] = train_texts[np.roll(moved, 1)]  # each moved to another's image
    splits = {"train": dict(images=train_images, texts=train_texts)}
    for name in ("val", "test"):
        images, texts = split(100)
        splits[name] = dict(images=images, texts=texts)
    vectors.write_folder(str(path), splits)
    with open(path / audit.SPACE_FILE, "w") as f:
        json.dump({"shared_space": True, "encoder": "a test's"}, f)
    mismatched = np.zeros(400, bool)
    mismatched[moved] = True
    return mismatched


def _auc(score, mismatched):
    clean, noisy = score[~mismatched], score[mismatched]
    return (clean[:, None] > noisy[None, :]).mean() + 0.5 * (
        clean[:, None] == noisy[None, :]
    ).mean()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    here = tmp_path_factory.mktemp("raw")
    mismatched = _one_space_folder(here / "folder")
    config = load_config("gsc", "vectors")
    config.data.folder = str(here / "folder")
    config.train.division = "on"  # one run (the race: tests/train/test_arms.py)
    config.train.epochs, config.train.progress_bar, config.train.num_devices = 2, False, 1
    train_and_evaluate(config, str(here / "run"))
    np.save(here / "mismatched.npy", np.flatnonzero(mismatched))
    return here, mismatched


def test_the_raw_cosine_and_both_aucs_against_known_mismatches(run):
    here, mismatched = run
    result = audit.audit(str(here / "run"), mismatched=str(here / "mismatched.npy"))
    folder = here / "folder"
    images = np.load(folder / "train_images.npy").astype(np.float64)
    texts = np.load(folder / "train_texts.npy").astype(np.float64)
    expected = (
        (images * texts).sum(1) / np.linalg.norm(images, axis=1) / np.linalg.norm(texts, axis=1)
    )  # the folder's own pairs: caption k beside image k
    with open(here / "run" / "audit" / "pairs.jsonl") as f:
        rows = [json.loads(line) for line in f]
    by_index = {r["index"]: r for r in rows}
    got = np.asarray([by_index[k]["raw_cosine"] for k in range(400)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
    scores = np.asarray([by_index[k]["clean_score"] for k in range(400)])
    known = result["known_mismatches"]
    assert known["count"] == 120
    assert known["auc_raw_cosine"] == pytest.approx(_auc(expected, mismatched), abs=1e-9)
    assert known["auc_method"] == pytest.approx(_auc(scores, mismatched), abs=1e-9)
    assert known["auc_raw_cosine"] > 0.9  # one space: the raw cosine finds the lies
    with open(here / "run" / "audit" / "audit.json") as f:
        assert json.load(f)["known_mismatches"] == known


def test_no_raw_cosine_without_one_declared_space_and_bad_files_are_one_line(run, tmp_path):
    here, _ = run
    workdir = str(here / "run")
    assert audit.audit(workdir, raw="no")["raw_cosine"] is False
    np.save(tmp_path / "short.npy", np.zeros(3, bool))
    with pytest.raises(ValueError, match=r"holds \(3,\) bools; give a \.npy of 400 bools"):
        audit.audit(workdir, mismatched=str(tmp_path / "short.npy"))
    (tmp_path / "ids.txt").write_text("0\n400\n")
    with pytest.raises(ValueError, match=r"indices outside \[0, 400\)"):
        audit.audit(workdir, mismatched=str(tmp_path / "ids.txt"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ncljax.audit",
            f"--workdir={workdir}",
            f"--mismatched={here / 'mismatched.npy'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, XLA_FLAGS=""),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Against the 120 known mismatches: AUC " in out.stdout
    assert " by the raw cosine." in out.stdout
