"""The SREM notebook runs top to bottom on a (shrunk) :quick run of configs/srem.py:synthetic,
and its summary holds the numbers of the run's logs."""

import json
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
NOTEBOOK = os.path.join(ROOT, "notebooks", "srem_self_reinforcing_errors.py")
FIGURES = (
    "srem_selection_precision_recall.png",
    "srem_noisy_gradient_ratio.png",
    "srem_energy_histograms.png",
    "srem_energy_auc.png",
)
DIRECTIONS = ("i2t", "t2i")
ROW = re.compile(r"^\s*(\d+) (warm-up|main)\s+(.*)$")


def _config():
    config = config_lib.load_file(os.path.join(ROOT, "configs", "srem.py"), "synthetic,quick")
    # 320 pairs in 10 full batches a epoch: every pair is visited, so the per-pair memory
    # the diagnostics histogram holds the very selections the steps logged.
    config.data.num_train, config.data.num_val, config.data.num_test = 64, 16, 16
    config.train.batch_size, config.eval.batch_size = 32, 32
    config.train.progress_bar = False
    config.train.num_devices = 1
    config.train.log_every_steps = 3  # windows of 3, 3, 3 and 1 steps a epoch
    assert config.train.epochs == 2 and config.method_kwargs.warmup_epochs == 1
    # The energy carries -log B: at batch 32 and this little training the energies sit
    # near 1.5, above the default tau = -2, and the split would be empty.
    config.method_kwargs.tau = 3.0
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


def _expected_from_logs(workdir) -> dict[int, dict]:
    """Per epoch, the step logs pooled over the epoch's pairs (each train row holds the
    ratios of the steps since the previous row, every batch full)."""
    with open(workdir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    sums, previous = {}, 0
    for row in (r for r in rows if r["split"] == "train"):
        steps, previous = row["step"] - previous, row["step"]
        acc = sums.setdefault(row["epoch"], {"steps": 0, "share": 0.0, "pulled": 0.0})
        acc["steps"] += steps
        pulled = 0.0
        for d in DIRECTIONS:
            selected = row[f"selected_{d}"] * steps
            acc[f"sel_{d}"] = acc.get(f"sel_{d}", 0.0) + selected
            precision = row[f"step_clean_precision_{d}"]  # null where nothing was selected
            acc[f"hit_{d}"] = acc.get(f"hit_{d}", 0.0) + (precision * selected if selected else 0.0)
            pulled += selected
        if row.get("noisy_weight_share") is not None:  # null: nothing pulled
            acc["share"] += row["noisy_weight_share"] * pulled
            acc["pulled"] += pulled
    return {
        epoch: {
            **{f"P_{d}": acc[f"hit_{d}"] / acc[f"sel_{d}"] for d in DIRECTIONS},
            **{f"sel_{d}": acc[f"sel_{d}"] / acc["steps"] for d in DIRECTIONS},
            "noisy%": 100 * acc["share"] / acc["pulled"] if acc["pulled"] else None,
        }
        for epoch, acc in sums.items()
    }


def _expected_from_memory(workdir, epoch: int) -> dict[str, float]:
    """The same split from the per-pair memory after the epoch (diagnostics, true mask)."""
    d = np.load(workdir / "diagnostics" / f"epoch_{epoch:04d}.npz")
    out = {}
    for direction in DIRECTIONS:
        clean = d[f"selected_{direction}_hist_clean"][0]
        noisy = d[f"selected_{direction}_hist_noisy"][0]
        out[f"P_{direction}"] = clean[-1] / (clean[-1] + noisy[-1])
        out[f"R_{direction}"] = clean[-1] / clean.sum()
        out[f"sel_{direction}"] = (clean[-1] + noisy[-1]) / (clean.sum() + noisy.sum())
    return out


def test_notebook_executes_on_a_quick_run(tmp_path):
    workdir, figures = tmp_path / "run", tmp_path / "figures"
    train_and_evaluate(_config(), str(workdir))
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
    assert sorted(table) == [0, 1] and table[0][0] == "warm-up" and table[1][0] == "main"
    columns = ["P_i2t", "R_i2t", "sel_i2t", "P_t2i", "R_t2i", "sel_t2i", "noisy%", "AUC", "rsum"]
    printed_rows = {e: dict(zip(columns, cells[1:], strict=True)) for e, cells in table.items()}
    logs = _expected_from_logs(workdir)
    for epoch, row in printed_rows.items():
        assert row["sel_i2t"] > 0 and row["sel_t2i"] > 0, (epoch, row)  # a real split
        for key in ("P_i2t", "P_t2i", "sel_i2t", "sel_t2i"):
            assert abs(row[key] - logs[epoch][key]) < 1e-4, (epoch, key, row, logs[epoch])
        memory = _expected_from_memory(workdir, epoch)
        for key, value in memory.items():
            assert abs(row[key] - value) < 1e-4, (epoch, key, row, memory)
    assert np.isnan(printed_rows[0]["noisy%"])  # the warm-up trains no hinge
    assert abs(printed_rows[1]["noisy%"] - logs[1]["noisy%"]) < 0.01

    with open(workdir / "metrics.jsonl") as f:
        val = {r["epoch"]: r for r in map(json.loads, f) if r["split"] == "val"}
    for epoch, row in printed_rows.items():
        assert abs(row["AUC"] - val[epoch]["noise_auc"]) < 1e-4
        assert abs(row["rsum"] - val[epoch]["rsum"]) < 0.06
    with open(workdir / "results.json") as f:
        results = json.load(f)
    assert f"test (best val epoch {results['best_epoch']}): rsum {results['rsum']:.2f}" in printed
