"""The PC2 notebook runs top to bottom on (shrunk) :quick runs of configs/pc2.py:synthetic
and configs/ncr.py:synthetic, and its summary holds the numbers of the runs' logs."""

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
NOTEBOOK = os.path.join(ROOT, "notebooks", "pc2_pseudo_captions.py")
FIGURES = (
    "pc2_codivide_loss.png",
    "pc2_codivide_loss_histograms.png",
    "pc2_pseudo_captions.png",
    "pc2_division_quality.png",
)
COLUMNS = {
    "loss": ["clean", "noisy", "d_clean", "d_noisy", "rsum"],
    "pseudo": ["acc", "cosine", "margin", "windows"],
    "division": ["AUC_w", "P_w", "R_w", "AUC_wo", "P_wo", "R_wo", "o_clean", "o_noisy"],
    "refresh": ["clean0", "clean1", "osc0", "osc1", "cls0", "cls1"],
}
PSEUDO_KEYS = {
    "acc": "pseudo_caption_accuracy",
    "cosine": "pseudo_cosine",
    "margin": "pseudo_margin",
}
TITLE = re.compile(r"^\[(\w+)\] (\S+)$")
ROW = re.compile(r"^\s*(\d+) (warm-up|clean|pseudo|noisy)\s+(.*)$")
OSCILLATION = re.compile(
    r"^(\S+): oscillation of the (clean|noisy) pairs' co-divide loss "
    r"\(mean \|change\| over (\d+) epoch-to-epoch steps\): (\S+)$"
)


def _config(method: str):
    config = config_lib.load_file(os.path.join(ROOT, "configs", f"{method}.py"), "synthetic,quick")
    # 320 pairs (5 captions an image) in batches of 32; log windows of 3 steps.
    config.data.num_train, config.data.num_val, config.data.num_test = 64, 16, 16
    config.train.batch_size, config.eval.batch_size = 32, 32
    config.train.progress_bar = False
    config.train.num_devices = 1
    config.train.log_every_steps = 3
    # Global feature vectors instead of regions and tokens: the same cosine head and the
    # same PC2 pseudo-classifier path (it reads the embeddings either way), compiled in
    # half the time on 2 cores.
    config.model.image_input = config.model.text_input = "global"
    config.model.tokens.word_dim = (
        config_lib.base_config().model.tokens.word_dim
    )  # read with tokens only
    # A warm-up epoch, then two co-training epochs (two co-divides, one change between
    # them), both with the second update: PC2's pseudo-captions, NCR's noisy set.
    config.train.epochs = 3
    config.method_kwargs.warmup_epochs = 1
    if method == "pc2":
        config.method_kwargs.pseudo_start_epoch = 0
    else:
        config.method_kwargs.noisy_start_epoch = 0
    return config


def _number(text: str) -> float:
    return float("nan") if text == "n/a" else float(text)


def _tables(printed: str) -> dict[tuple[str, str], dict[int, dict]]:
    """The summary tables: (table, run name) -> epoch -> {"phase": ..., column: float}."""
    tables, key = {}, None
    for line in printed.splitlines():
        title, row = TITLE.match(line), ROW.match(line)
        if title:
            key = (title[1], title[2])
            tables[key] = {}
        elif row and key is not None:
            cells = [_number(x) for x in row[3].split()]
            tables[key][int(row[1])] = {
                "phase": row[2],
                **dict(zip(COLUMNS[key[0]], cells, strict=True)),
            }
        elif not line.strip():
            key = None
    return tables


def _rows(workdir, split: str) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _close(a: float, b: float, tol: float = 1e-4) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def _check_run(tables, printed: str, workdir, method: str) -> None:
    name = workdir.name
    val = {r["epoch"]: r for r in _rows(workdir, "val")}
    refresh = {r["epoch"]: r for r in _rows(workdir, "refresh")}
    train = _rows(workdir, "train")
    second = "pseudo" if method == "pc2" else "noisy"
    for title in ("loss", "division", "refresh"):
        table = tables[(title, name)]
        assert sorted(table) == [0, 1, 2], (title, name, printed)
        assert [table[e]["phase"] for e in (0, 1, 2)] == ["warm-up", second, second]
        warm = [v for k, v in table[0].items() if k not in ("phase", "rsum")]
        assert all(math.isnan(v) for v in warm), (title, name, table[0])  # no co-divide

    # Fig. 2: minus the logged neg_loss means; the change between the two co-divides.
    loss = tables[("loss", name)]
    for epoch in (1, 2):
        for group in ("clean", "noisy"):
            logged = -val[epoch][f"neg_loss_mean_{group}"]
            assert _close(loss[epoch][group], logged), (name, epoch, group, loss[epoch])
            # ... and the per-pair histograms' bin centres (both networks) agree with it.
            diag = np.load(workdir / "diagnostics" / f"epoch_{epoch:04d}.npz")
            counts, edges = diag[f"neg_loss_hist_{group}"], diag["neg_loss_edges"]
            centres = -(edges[1:] + edges[:-1]) / 2
            from_hist = ((counts * centres).sum(1) / counts.sum(1)).mean()
            assert abs(from_hist - logged) <= np.diff(edges).max() / 2 + 1e-4, (name, epoch)
        assert abs(loss[epoch]["rsum"] - val[epoch]["rsum"]) < 0.06, (name, epoch)
    assert abs(loss[0]["rsum"] - val[0]["rsum"]) < 0.06, name
    changes = {}
    for group in ("clean", "noisy"):
        assert math.isnan(loss[1][f"d_{group}"]), (name, loss[1])
        change = abs(val[2][f"neg_loss_mean_{group}"] - val[1][f"neg_loss_mean_{group}"])
        assert _close(loss[2][f"d_{group}"], change), (name, group, loss[2], change)
        changes[group] = change
    found = {
        m[2]: (int(m[3]), _number(m[4]))
        for m in map(OSCILLATION.match, printed.splitlines())
        if m and m[1] == name
    }
    assert found.keys() == {"clean", "noisy"}, printed
    for group, (count, oscillation) in found.items():
        assert count == 1 and _close(oscillation, changes[group]), (name, group, found)

    # The loss GMM's (and PC2's oscillation GMM's) division quality, the oscillations.
    division = tables[("division", name)]
    for epoch in (1, 2):
        row, logs = division[epoch], val[epoch]
        for gmm, suffix in (("w", "prob"), ("wo", "osc_prob")):
            for column, key in (("AUC", "auc"), ("P", "precision"), ("R", "recall")):
                expected = logs.get(f"noise_{key}_{suffix}", float("nan"))
                assert _close(row[f"{column}_{gmm}"], expected), (name, epoch, column, gmm)
        for group in ("clean", "noisy"):
            expected = -logs.get(f"neg_osc_mean_{group}", float("nan"))
            assert _close(row[f"o_{group}"], expected), (name, epoch, group)
        if method == "ncr":
            assert math.isnan(row["AUC_wo"]) and math.isnan(row["o_clean"]), (name, row)
        else:
            assert not math.isnan(row["AUC_wo"]) and row["o_clean"] >= 0, (name, row)

    # The refresh pass's per-network diagnostics.
    table = tables[("refresh", name)]
    for epoch in (1, 2):
        for column, key in (("clean", "clean_fraction"), ("osc", "osc_clean_fraction")):
            for k in (0, 1):
                expected = refresh[epoch].get(f"{key}_net{k}", float("nan"))
                assert _close(table[epoch][f"{column}{k}"], expected), (name, epoch, column, k)
        for k in (0, 1):
            expected = refresh[epoch].get(f"prediction_classes_used_net{k}", float("nan"))
            assert _close(table[epoch][f"cls{k}"], expected), (name, epoch, k)
            if method == "pc2":
                assert 1 <= expected <= 32, (name, epoch, expected)

    # PC2's pseudo-captions: the mean over the epoch's logging windows of both networks.
    if method == "pc2":
        pseudo = tables[("pseudo", name)]
        assert sorted(pseudo) == [0, 1, 2], printed
        assert pseudo[0]["windows"] == 0 and math.isnan(pseudo[0]["acc"]), pseudo[0]
        with open(workdir / "config.json") as f:
            alpha = json.load(f)["method_kwargs"]["margin"]
        for epoch in (1, 2):
            rows = [r for r in train if r["epoch"] == epoch]
            assert {r["network"] for r in rows} == {0, 1}, rows
            assert pseudo[epoch]["windows"] == len(rows), (epoch, pseudo[epoch])
            for column, key in PSEUDO_KEYS.items():
                expected = float(np.mean([r[key] for r in rows]))
                assert _close(pseudo[epoch][column], expected), (epoch, column, pseudo[epoch])
            assert 0 <= pseudo[epoch]["acc"] <= 1, pseudo[epoch]
            assert 0 <= pseudo[epoch]["margin"] <= alpha + 1e-6, pseudo[epoch]
    else:
        assert ("pseudo", name) not in tables

    with open(workdir / "results.json") as f:
        results = json.load(f)
    test_line = (
        f"{name}: test (best val epoch {results['best_epoch']}): rsum {results['rsum']:.2f} | "
    )
    test_line += " ".join(f"{k} {results[k]:.2f}" for k in ("i2t_r1", "i2t_r5", "i2t_r10"))
    test_line += " | " + " ".join(f"{k} {results[k]:.2f}" for k in ("t2i_r1", "t2i_r5", "t2i_r10"))
    assert test_line in printed, printed


def test_notebook_executes_on_quick_runs(tmp_path):
    runs = {method: tmp_path / method for method in ("pc2", "ncr")}
    for method, workdir in runs.items():
        train_and_evaluate(_config(method), str(workdir))
    figures = tmp_path / "figures"
    env = dict(
        os.environ,
        NCLJAX_PC2_WORKDIR=str(runs["pc2"]),
        NCLJAX_NCR_WORKDIR=str(runs["ncr"]),
        NCLJAX_FIGURES=str(figures),
    )
    printed = runner.execute(NOTEBOOK, env)
    for name in FIGURES:
        assert (figures / name).stat().st_size > 10_000, name
    tables = _tables(printed)
    expected = {(t, m) for t in ("loss", "division", "refresh") for m in runs} | {("pseudo", "pc2")}
    assert set(tables) == expected, printed
    for method, workdir in runs.items():
        _check_run(tables, printed, workdir, method)
    # The side-by-side line: each run's clean-loss oscillation, NCR first.
    ncr, pc2 = (tables[("loss", m)][2]["d_clean"] for m in ("ncr", "pc2"))
    line = f"oscillation of the clean pairs' co-divide loss: NCR {ncr:.4f}, PC2 {pc2:.4f}"
    assert line in printed.splitlines(), printed

    # PC2 alone (no NCR workdir), on a copy of the run whose logs lack the pseudo-caption
    # metrics and the co-divide loss in epoch 1 (as before pseudo_start_epoch, or a run of
    # older code): those cells read n/a, the rest stays.
    partial = tmp_path / "pc2_partial"
    shutil.copytree(runs["pc2"], partial, ignore=shutil.ignore_patterns("checkpoints"))
    dropped = ("pseudo_caption_accuracy", "pseudo_cosine", "pseudo_margin", "neg_loss_mean_clean")
    with open(partial / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(partial / "metrics.jsonl", "w") as f:
        for row in rows:
            if row["epoch"] == 1:
                row = {k: v for k, v in row.items() if k not in dropped}
            f.write(json.dumps(row) + "\n")
    env |= dict(
        NCLJAX_PC2_WORKDIR=str(partial),
        NCLJAX_NCR_WORKDIR=str(tmp_path / "no_such_run"),
        NCLJAX_FIGURES=str(tmp_path / "figures_partial"),
    )
    printed = runner.execute(NOTEBOOK, env)
    assert f"No NCR run at {tmp_path / 'no_such_run'}" in printed, printed
    for name in FIGURES:
        assert (tmp_path / "figures_partial" / name).stat().st_size > 10_000, name
    tables = _tables(printed)
    assert {m for _, m in tables} == {"pc2_partial"}, printed
    pseudo, loss = tables[("pseudo", "pc2_partial")], tables[("loss", "pc2_partial")]
    assert math.isnan(pseudo[1]["acc"]) and pseudo[1]["windows"] == 0, pseudo
    assert not math.isnan(pseudo[2]["acc"]) and pseudo[2]["windows"] > 0, pseudo
    assert math.isnan(loss[1]["clean"]) and not math.isnan(loss[1]["noisy"]), loss
    assert math.isnan(loss[2]["d_clean"]) and not math.isnan(loss[2]["d_noisy"]), loss
    found = [m for m in map(OSCILLATION.match, printed.splitlines()) if m and m[2] == "clean"]
    assert len(found) == 1 and found[0][3] == "0" and found[0][4] == "n/a", printed
