"""The UGNCL notebook runs top to bottom on a (shrunk) :quick run of configs/ugncl.py:synthetic,
and its summary holds the numbers of the run's logs."""

import json
import math
import os
import re
import shutil

import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax.train import train_and_evaluate
from tests.notebooks import runner

pytestmark = pytest.mark.heavy  # out of the default run; CI runs it (see pyproject.toml)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "ugncl_uncertainty.py")
FIGURES = (
    "ugncl_uncertainty_histograms.png",
    "ugncl_set_sizes.png",
    "ugncl_hard_negatives.png",
    "ugncl_precision_recall.png",
)
SETS = ("clean", "noisy", "hard_clean", "hard_noisy")
COLUMNS = ["C", "N", "HC", "HN", "u_clean", "u_noisy", "P_C", "R_C", "P_HC", "R_HC", "AUC", "rsum"]
ROW = re.compile(r"^\s*(\d+) (warm-up|train)\s+(.*)$")
LAMBDA = re.compile(r"^(\S+): lambda over \d+ logging windows: .* max \|logged - schedule\| (\S+)$")


def _config():
    config = config_lib.load_file(os.path.join(ROOT, "configs", "ugncl.py"), "synthetic,quick")
    # 320 pairs in 10 full batches an epoch: every pair is visited once, so the per-pair
    # memory the diagnostics histogram holds the very division the steps logged.
    config.data.num_train, config.data.num_val, config.data.num_test = 64, 16, 16
    config.train.batch_size, config.eval.batch_size = 32, 32
    config.train.progress_bar = False
    config.train.num_devices = 1
    config.train.log_every_steps = 3  # windows of 3, 3, 3 and 1 steps an epoch
    assert config.method_kwargs.warmup_epochs == 1
    config.train.epochs = 3  # a warm-up epoch, then two training epochs (two divisions)
    # After one warm-up epoch on 320 pairs the division's u sits far above the default
    # p = 0.5 (0.75 to 0.97 as measured, with the cosine head's settings of the time), so
    # every pair would be hard, and with soft labels near 1/32 < epsilon all hard-noisy.
    # Every evidence exp(softplus(R) / tau) exceeds 1, so each direction's K / S is below
    # 1/2 and u < 1: at p = 1 every pair is determined and the prediction (its own
    # counterpart the most believed) splits them into determined-clean and -noisy, two
    # non-empty sets whatever the cosine head's shift and temperature.
    config.method_kwargs.threshold = 1.0
    return config


def _tables(printed: str) -> dict[str, dict[int, list]]:
    """The summary tables: run name -> epoch -> [phase, the columns as floats]."""
    tables, name = {}, None
    for line in printed.splitlines():
        match = ROW.match(line)
        if match and name is not None:
            cells = [float(x) if x != "n/a" else float("nan") for x in match[3].split()]
            tables[name][int(match[1])] = [match[2], *cells]
        elif line.strip() and " " not in line.strip():
            name = line.strip()
            tables[name] = {}
    return tables


def _rows(workdir, split: str) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _expected_from_logs(workdir, batch_size: int, num_clean: int) -> dict[int, dict]:
    """Per training epoch, the determined-clean set's precision and recall from the train
    rows (each the ratios over the steps since the previous row, every batch full; an epoch
    visits each of the ``num_clean`` truly clean pairs once)."""
    sums, previous = {}, 0
    for row in _rows(workdir, "train"):
        pairs, previous = (row["step"] - previous) * batch_size, row["step"]
        if "set_clean" not in row:  # warm-up
            continue
        acc = sums.setdefault(row["epoch"], {"selected": 0.0, "hits": 0.0})
        selected = row["set_clean"] * pairs
        acc["selected"] += selected
        if selected:  # the precision is null over no selected pair
            acc["hits"] += row["step_clean_precision_clean"] * selected
    return {
        epoch: {"P_C": acc["hits"] / acc["selected"], "R_C": acc["hits"] / num_clean}
        for epoch, acc in sums.items()
    }


def test_notebook_executes_on_a_quick_run(tmp_path):
    workdir, figures = tmp_path / "run", tmp_path / "figures"
    config = _config()
    train_and_evaluate(config, str(workdir))
    # A second run to compare with (the notebook takes several): a copy of the first.
    shutil.copytree(workdir, tmp_path / "copy", ignore=shutil.ignore_patterns("checkpoints"))
    env = dict(
        os.environ,
        NCLJAX_WORKDIRS=f"{workdir},{tmp_path / 'copy'}",
        NCLJAX_FIGURES=str(figures),
    )
    printed = runner.execute(NOTEBOOK, env)
    for name in FIGURES:
        assert (figures / name).stat().st_size > 10_000, name

    tables = _tables(printed)
    assert set(tables) == {"run", "copy"}, printed
    assert repr(tables["run"]) == repr(tables["copy"])  # NaN != NaN
    table = tables["run"]
    assert sorted(table) == [0, 1, 2], printed
    assert [table[e][0] for e in (0, 1, 2)] == ["warm-up", "train", "train"]
    rows = {e: dict(zip(COLUMNS, cells[1:], strict=True)) for e, cells in table.items()}
    assert all(math.isnan(rows[0][c]) for c in COLUMNS[:10])  # no division in the warm-up

    # The schedule of lambda as the loss used it.
    lam = {m[1]: float(m[2]) for m in map(LAMBDA.match, printed.splitlines()) if m}
    assert lam.keys() == {"run", "copy"} and lam["run"] == 0.0, printed

    refresh = {r["epoch"]: r for r in _rows(workdir, "refresh")}
    val = {r["epoch"]: r for r in _rows(workdir, "val")}
    diag = {e: np.load(workdir / "diagnostics" / f"epoch_{e:04d}.npz") for e in (1, 2)}
    num_clean = int(diag[1]["certainty_hist_clean"].sum())
    clean_rate = num_clean / (num_clean + int(diag[1]["certainty_hist_noisy"].sum()))
    logs = _expected_from_logs(workdir, config.train.batch_size, num_clean)
    for epoch in (1, 2):
        row = rows[epoch]
        # The set sizes are the division pass's, and it made a real split.
        for key, s in zip(COLUMNS[:4], SETS, strict=True):
            assert abs(row[key] - refresh[epoch][f"division_{s}"]) < 1e-4, (epoch, key, row)
        assert sum(row[key] > 0 for key in COLUMNS[:4]) >= 2, (epoch, row)
        assert row["C"] > 0 and not math.isnan(row["P_C"]), (epoch, row)
        # Precision and recall of the determined-clean set: the pooled step logs ...
        for key in ("P_C", "R_C"):
            assert abs(row[key] - logs[epoch][key]) < 1e-4, (epoch, key, row, logs[epoch])
        # ... and the per-pair memory after the epoch (the division it trained on).
        clean = diag[epoch]["determined_clean_hist_clean"][0]
        noisy = diag[epoch]["determined_clean_hist_noisy"][0]
        assert abs(row["P_C"] - clean[-1] / (clean[-1] + noisy[-1])) < 1e-4, (epoch, row)
        assert abs(row["R_C"] - clean[-1] / clean.sum()) < 1e-4, (epoch, row)
        if row["HC"] == 0:
            assert math.isnan(row["P_HC"]) and math.isnan(row["R_HC"]), (epoch, row)
        # The mean u of clean and noisy pairs: exactly the trainer's means of 1 - u, close
        # to the histogram's bin centres, and together the division's mean.
        width = float(np.diff(diag[epoch]["certainty_edges"]).max())
        for group in ("clean", "noisy"):
            u = row[f"u_{group}"]
            assert abs(u - (1 - val[epoch][f"certainty_mean_{group}"])) < 1e-4, (epoch, group)
            counts = diag[epoch][f"certainty_hist_{group}"][0]
            edges = diag[epoch]["certainty_edges"]
            centres = 1 - (edges[1:] + edges[:-1]) / 2
            assert abs(u - (counts * centres).sum() / counts.sum()) <= width / 2 + 1e-4
        mean = clean_rate * row["u_clean"] + (1 - clean_rate) * row["u_noisy"]
        assert abs(mean - refresh[epoch]["division_uncertainty_mean"]) < 2e-4, (epoch, row)

    for epoch, row in rows.items():
        assert abs(row["AUC"] - val[epoch]["noise_auc"]) < 1e-4, (epoch, row)
        assert abs(row["rsum"] - val[epoch]["rsum"]) < 0.06, (epoch, row)
    with open(workdir / "results.json") as f:
        results = json.load(f)
    test_line = f"test (best val epoch {results['best_epoch']}): rsum {results['rsum']:.2f} | "
    test_line += " ".join(f"{k} {results[k]:.2f}" for k in ("i2t_r1", "i2t_r5", "i2t_r10"))
    assert test_line in printed, printed
