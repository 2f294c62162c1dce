"""The README's path for a user's own pairs, end to end: a folder of vectors whose training
pairs lie, then the three commands (train, audit, retrieve) as a user types them.

The folder is the synthetic world's global vectors with 40% of the training captions
swapped to another image (``vectors.from_synthetic``, which returns which): the ground
truth the audit's ranking is checked against. GSC and NCR train 8 epochs on its 1,500
pairs (about 12 and 17 s on 2 cores).
"""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ncljax import retrieve
from ncljax.data import vectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
    # One CPU device, as a user runs it: the suite's 8 fake devices (conftest.py) share 2
    # cores, and the XLA CPU all-gather of 8 devices can time out under that load.
    env = dict(os.environ, XLA_FLAGS="")
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=600, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    return out


def _auc(clean_score, mismatched):
    """P(a matched pair scores above a mismatched one), ties halved: a numpy pairwise
    comparison, independent of the library's AUC."""
    clean, noisy = clean_score[~mismatched], clean_score[mismatched]
    above = (clean[:, None] > noisy[None, :]).mean()
    return above + 0.5 * (clean[:, None] == noisy[None, :]).mean()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("own") / "pairs")
    mismatched = vectors.from_synthetic(path, world="small_global", noise_rate=0.4, seed=0)
    return path, mismatched


# Slow (GSC 27 s, NCR 30 s): the default run covers the same path with the README's Python
# block (tests/test_api.py), the commands by name (tests/test_commands.py), and CI runs
# embed, train, audit and retrieve from the installed wheel (.ci/run); the audits' AUC on
# known lies is checked in tests/test_audit_baseline.py.
@pytest.mark.slow
@pytest.mark.parametrize("method, least_auc", [("gsc", 0.85), ("ncr", 0.8)])
def test_train_audit_retrieve_on_a_folder_of_vectors(folder, tmp_path, method, least_auc):
    path, mismatched = folder
    run = str(tmp_path / "run")
    # 1. train (the README's command, shortened to 8 epochs)
    _cli(
        "train.py",
        f"--config=configs/{method}.py:vectors",
        f"--config.data.folder={path}",
        "--config.train.epochs=8",
        "--config.train.progress_bar=False",
        f"--workdir={run}",
    )
    with open(os.path.join(run, "results.json")) as f:
        results = json.load(f)

    # 2. audit: one row per training pair, most suspicious first, finding the lies
    out = _cli("-m", "ncljax.audit", f"--workdir={run}")
    assert "Wrote" in out.stdout
    with open(os.path.join(run, "audit", "pairs.csv"), newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["rank"]) for r in rows] == list(range(1, len(mismatched) + 1))
    assert sorted(int(r["index"]) for r in rows) == list(range(len(mismatched)))
    score = np.zeros(len(rows))
    for r in rows:
        score[int(r["index"])] = float(r["clean_score"])
    assert np.all(np.diff([float(r["clean_score"]) for r in rows]) >= 0)
    ids, captions = vectors.display_texts(path, "train")
    by_index = {int(r["index"]): r for r in rows}
    assert by_index[7]["caption"] == captions[7] and by_index[7]["image_id"] == ids[7]
    auc = _auc(score, mismatched)
    assert auc > least_auc, auc  # measured: GSC 0.93, NCR 0.85
    suspicious = np.array([int(r["index"]) for r in rows[: int(mismatched.sum())]])
    assert mismatched[suspicious].mean() > 0.7  # measured: GSC 0.82

    # 3. retrieve: the top K of an image given by its id, its own caption marked
    test_ids, test_captions = vectors.display_texts(path, "test")
    out = _cli("-m", "ncljax.retrieve", f"--workdir={run}", f"--query=id:{test_ids[3]}", "--k=5")
    lines = out.stdout.strip().splitlines()
    assert test_ids[3] in lines[0] and len(lines) == 6, out.stdout
    # the Python function ranks as the run's evaluator scored: its R@1 is the run's
    loaded = retrieve.load(run, "test")
    first = [retrieve.rank_captions(loaded, i).index[0] for i in range(len(test_ids))]
    r1 = 100.0 * np.mean(np.asarray(first) == np.arange(len(test_ids)))
    assert r1 == pytest.approx(results["i2t_r1"], abs=1e-6)
    top = retrieve.rank_captions(loaded, 3).index[:5]
    shown = [line for line in lines[1:] if test_captions[top[0]] in line]
    assert shown and shown[0] == lines[1]
