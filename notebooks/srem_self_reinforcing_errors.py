# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # SREM: self-reinforcing errors over the epochs (Fig. 1a / Fig. 3 of the paper, from runs)
#
# Dang et al., "Noisy Correspondence Learning with Self-Reinforcing Errors Mitigation",
# AAAI 2024. This notebook reads one or more finished SREM runs and draws:
#
# 1. the precision and recall of each direction's clean split (energy below `tau` and the
#    partner the row's argmax, Eq. 2) over the epochs, with the fraction selected;
# 2. the share of the hinge's positive pull that reaches truly noisy pairs (the paper's
#    noisy gradient ratio, under 7% on F30K at 60% noise);
# 3. the energy histograms of clean and noisy pairs at several epochs, with the threshold
#    `tau` and the margins `m_clean`, `m_noisy` of the energy-bounded loss;
# 4. the noise-detection AUC of the energy over the epochs;
#
# and prints a per-epoch summary and the test metrics.
#
# The runs come from, e.g.,
# `python train.py --config=configs/srem.py:synthetic --workdir=runs/srem_synthetic`
# (or `:synthetic,quick`: one warm-up and one main epoch). Set `NCLJAX_WORKDIRS` to the
# run directories, comma-separated (default `runs/srem_synthetic`; `NCLJAX_WORKDIR` is
# read when it is unset); figures are saved to `NCLJAX_FIGURES` (default: the first
# run's `figures/`). The true noise mask was read by the trainer's diagnostics only
# (`metrics.jsonl`, `workdir/diagnostics/epoch_XXXX.npz`), never by the method.

# %%
import glob
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

WORKDIRS = [
    w.strip()
    for w in os.environ.get(
        "NCLJAX_WORKDIRS", os.environ.get("NCLJAX_WORKDIR", "runs/srem_synthetic")
    ).split(",")
    if w.strip()
]
FIGURES = os.environ.get("NCLJAX_FIGURES", os.path.join(WORKDIRS[0], "figures"))
os.makedirs(FIGURES, exist_ok=True)
DIRECTIONS = ("i2t", "t2i")


def load_run(workdir: str) -> dict:
    """A run's config, metrics rows, per-epoch diagnostics and test results."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise SystemExit(
            f"{workdir} holds no run: train first, e.g. python train.py "
            f"--config=configs/srem.py:synthetic --workdir={workdir}"
        )
    with open(path) as f:
        config = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    files = sorted(glob.glob(os.path.join(workdir, "diagnostics", "epoch_*.npz")))
    if config["method"] != "srem" or not files:
        raise SystemExit(f"{workdir} holds no SREM run with energy diagnostics.")
    results = None
    if os.path.exists(os.path.join(workdir, "results.json")):
        with open(os.path.join(workdir, "results.json")) as f:
            results = json.load(f)
    diagnostics = {int(os.path.basename(f)[6:10]): dict(np.load(f)) for f in files}
    first = next(iter(diagnostics.values()))
    clean = first["neg_energy_i2t_hist_clean"][0].sum()
    noisy = first["neg_energy_i2t_hist_noisy"][0].sum()
    return {
        "name": os.path.basename(os.path.normpath(workdir)),
        "config": config,
        "kwargs": config["method_kwargs"],
        "warmup": config["method_kwargs"]["warmup_epochs"],
        "train": [r for r in rows if r["split"] == "train"],
        "val": {r["epoch"]: r for r in rows if r["split"] == "val"},
        "diagnostics": diagnostics,
        "clean_rate": clean / (clean + noisy),  # of the training pairs, from the true mask
        "results": results,
    }


def value(row: dict, key: str) -> float:
    """A logged number; NaN where the row lacks it or logged NaN (``null``)."""
    v = row.get(key)
    return math.nan if v is None else float(v)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def epoch_metrics(run: dict) -> dict[int, dict]:
    """Per epoch, the train rows' ratios pooled over the epoch's pairs.

    Each train row holds ratios over the steps since the previous row (sums over the
    window's pairs divided by their counts). All batches are full, so a window holds
    ``n = steps x batch`` pairs; its selected fraction ``s`` and precision ``p`` give its
    selected pairs ``s n`` and correct selections ``p s n``, and a recall ``r > 0`` its
    clean pairs ``p s n / r``. The windows' clean counts are not logged otherwise: where
    a window has ``r = 0``, the epoch's clean pairs are its pairs times the training
    set's clean share (an epoch visits every pair but a last partial batch). Precision
    is NaN in an epoch that selected nothing. The noisy gradient share (main phase only)
    is weighted by the window's selected pairs of both directions, the pairs the pull
    falls on (its total is not logged); NaN in an epoch that selected nothing.
    """
    out, previous = {}, 0
    for row in run["train"]:
        n, previous = max(row["step"] - previous, 0), row["step"]  # pairs / batch size
        acc = out.setdefault(row["epoch"], {"pairs": 0.0, "share": 0.0, "pulled": 0.0})
        acc["pairs"] += n
        for d in DIRECTIONS:
            s = value(row, f"selected_{d}")
            p = value(row, f"step_clean_precision_{d}")
            r = value(row, f"step_clean_recall_{d}")
            hits = p * s * n if s > 0 else 0.0
            acc[f"selected_{d}"] = acc.get(f"selected_{d}", 0.0) + s * n
            acc[f"hits_{d}"] = acc.get(f"hits_{d}", 0.0) + hits
            clean = hits / r if r > 0 else math.nan  # NaN: unknown, the whole epoch's is used
            acc[f"clean_{d}"] = acc.get(f"clean_{d}", 0.0) + clean
        if row.get("noisy_weight_share") is not None:
            pulled = sum(value(row, f"selected_{d}") for d in DIRECTIONS) * n
            acc["share"] += row["noisy_weight_share"] * pulled
            acc["pulled"] += pulled
    summary = {}
    for epoch, acc in sorted(out.items()):
        e = {"phase": "warm-up" if epoch < run["warmup"] else "main"}
        for d in DIRECTIONS:
            clean = acc[f"clean_{d}"]
            if math.isnan(clean):
                clean = acc["pairs"] * run["clean_rate"]
            e[f"precision_{d}"] = ratio(acc[f"hits_{d}"], acc[f"selected_{d}"])
            e[f"recall_{d}"] = ratio(acc[f"hits_{d}"], clean)
            e[f"selected_{d}"] = ratio(acc[f"selected_{d}"], acc["pairs"])
        e["noisy_share"] = ratio(acc["share"], acc["pulled"])
        val = run["val"].get(epoch, {})
        e["noise_auc"] = value(val, "noise_auc")
        e["val_rsum"] = value(val, "rsum")
        summary[epoch] = e
    return summary


runs = [load_run(w) for w in WORKDIRS]
for run in runs:
    run["epochs"] = epoch_metrics(run)
    k, noise = run["kwargs"], run["config"]["noise"]
    print(
        f"{run['name']}: noise {noise['kind']} {noise['rate']} (clean share "
        f"{run['clean_rate']:.3f}), {len(run['epochs'])} epochs ({run['warmup']} warm-up), "
        f"batch {run['config']['train']['batch_size']}, tau={k['tau']} "
        f"m_clean={k['m_clean']} m_noisy={k['m_noisy']}"
    )
many = len(runs) > 1


def label(run: dict, text: str) -> str:
    return f"{run['name']}: {text}" if many else text


def shade_warmup(ax, run: dict) -> None:
    """Grey band over the warm-up epochs (the split is computed for the logs only)."""
    if run["warmup"] > 0 and run is runs[0]:
        ax.axvspan(-0.5, run["warmup"] - 0.5, color="0.85", zorder=0, label="warm-up")


# %% [markdown]
# ## 1. Precision and recall of the clean split (Fig. 1a)
#
# The clean split of each direction against the true mask, pooled over each epoch's
# training steps: precision (solid), recall (dashed) and the fraction of pairs selected
# (dotted). In the warm-up (grey) the model learns from complementary labels alone and
# the split only feeds the logs; from the first main epoch on, the hinge and the energy
# loss train on it, so errors in the split could reinforce themselves. The thin grey line
# is the clean share of the training pairs, the precision of a random selection.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
for ax, d in zip(axes, DIRECTIONS, strict=True):
    for i, run in enumerate(runs):
        epochs = list(run["epochs"])
        shade_warmup(ax, run)
        for j, (key, style) in enumerate((("precision", "-"), ("recall", "--"), ("selected", ":"))):
            values = [run["epochs"][e][f"{key}_{d}"] for e in epochs]
            color = f"C{i if many else j}"  # one color per run, or per curve for one run
            ax.plot(epochs, values, style, marker="o", ms=3, color=color, label=label(run, key))
    ax.axhline(runs[0]["clean_rate"], color="0.5", lw=0.8, label="clean share")
    ax.set_title(f"clean split, {d}")
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.02, 1.02)
axes[0].set_ylabel("precision / recall / fraction")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "srem_selection_precision_recall.png"), dpi=120)

# %% [markdown]
# ## 2. Noisy gradient ratio
#
# The share of the hinge's positive pull (the swapped weights of the selected pairs,
# summed over both directions) that falls on truly mismatched pairs, in the main phase
# (the warm-up trains no hinge), pooled over each epoch. Weighting every pair alike
# would put the noise rate there (given in the legend); the paper reports under 7% on
# F30K at 60% noise (dashed). An epoch that selected nothing has no pull (no point).

# %%
fig, ax = plt.subplots(figsize=(7, 4))
highest = 7.0
for i, run in enumerate(runs):
    main = [e for e, m in run["epochs"].items() if m["phase"] == "main"]
    if not main:
        print(f"{run['name']}: no main epoch yet, no hinge to weigh.")
        continue
    shares = [100 * run["epochs"][e]["noisy_share"] for e in main]
    rate = run["config"]["noise"]["rate"]
    text = f"noisy share of the pull (uniform weighting: {rate:.0%})"
    ax.plot(main, shares, marker="o", color=f"C{i}", label=label(run, text))
    highest = max([highest, *[x for x in shares if not math.isnan(x)]])
ax.axhline(7, color="black", ls="--", lw=1, label="paper: < 7% (F30K, 60% noise)")
ax.set_xlabel("epoch")
ax.set_ylabel("noisy gradient ratio (%)")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.set_ylim(0, 1.25 * highest)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "srem_noisy_gradient_ratio.png"), dpi=120)

# %% [markdown]
# ## 3. Energies of clean and noisy pairs (Fig. 3)
#
# The energy `E = -logsumexp(F)` of each pair's image query (i2t) and caption query (t2i),
# as the epoch's training steps last saw them (`diagnostics/epoch_XXXX.npz` stores the
# negative energy `-E`). The split keeps pairs left of `tau` (solid) whose partner wins
# the row; the energy-bounded loss pushes clean pairs below `m_clean` (blue, dashed) and
# the others above `m_noisy` (red, dashed). Drawn at the first epoch, the last warm-up
# epoch, the first main epoch, and the last epoch.


# %%
def chosen_epochs(run: dict) -> list[int]:
    available = sorted(run["diagnostics"])
    wanted = {available[0], run["warmup"] - 1, run["warmup"], available[-1]}
    return [e for e in available if e in wanted]


panels = [(run, d) for run in runs for d in DIRECTIONS]
columns = max(len(chosen_epochs(run)) for run in runs)
fig, axes = plt.subplots(
    len(panels), columns, figsize=(4 * columns, 3 * len(panels)), squeeze=False
)
for (run, d), row_axes in zip(panels, axes, strict=True):
    k = run["kwargs"]
    for ax in row_axes[len(chosen_epochs(run)) :]:
        ax.axis("off")
    for ax, epoch in zip(row_axes, chosen_epochs(run), strict=False):
        diag = run["diagnostics"][epoch]
        edges = -diag[f"neg_energy_{d}_edges"][::-1]  # E = -(-E), increasing
        for group, color in (("clean", "tab:blue"), ("noisy", "tab:red")):
            counts = diag[f"neg_energy_{d}_hist_{group}"][0][::-1]
            ax.stairs(counts, edges, fill=True, alpha=0.45, color=color, label=f"{group} pairs")
        ax.axvline(k["tau"], color="black", lw=1.5, label=f"tau = {k['tau']}")
        ax.axvline(k["m_clean"], color="tab:blue", ls="--", lw=1, label=f"m_clean = {k['m_clean']}")
        ax.axvline(k["m_noisy"], color="tab:red", ls="--", lw=1, label=f"m_noisy = {k['m_noisy']}")
        phase = run["epochs"].get(epoch, {}).get("phase", "")
        ax.set_title(label(run, f"{d}, epoch {epoch} ({phase})"), fontsize=9)
        ax.set_xlabel("energy E")
    row_axes[0].set_ylabel("pairs")
    if d == DIRECTIONS[0]:  # each run's thresholds
        row_axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "srem_energy_histograms.png"), dpi=120)

# %% [markdown]
# ## 4. Noise-detection AUC of the energy
#
# ROC AUC for the clean class on the training pairs after each epoch: of the score
# `sigmoid(tau - (E_i2t + E_t2i) / 2)` (solid, the run's `noise_auc`) and of each
# direction's energy alone (dashed i2t, dotted t2i).

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for i, run in enumerate(runs):
    epochs = sorted(run["val"])
    shade_warmup(ax, run)
    for key, style, name in (
        ("noise_auc", "-", "mean energy"),
        ("noise_auc_neg_energy_i2t", "--", "i2t energy"),
        ("noise_auc_neg_energy_t2i", ":", "t2i energy"),
    ):
        values = [value(run["val"][e], key) for e in epochs]
        ax.plot(epochs, values, style, marker="o", ms=3, color=f"C{i}", label=label(run, name))
ax.axhline(0.5, color="0.5", lw=0.8)
ax.set_xlabel("epoch")
ax.set_ylabel("noise-detection AUC")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
aucs = [y for line in ax.lines[:-1] for y in line.get_ydata() if not math.isnan(y)]
ax.set_ylim(min([0.3, *aucs]) - 0.02, 1.0)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "srem_energy_auc.png"), dpi=120)

# %% [markdown]
# ## 5. Summary
#
# Per epoch: precision (P), recall (R) and fraction selected (sel) of each direction's
# clean split, the noisy gradient ratio in % (main epochs), the energy AUC and the
# validation rsum; then the test metrics of the best validation epoch (`results.json`).


# %%
def cell(x: float, width: int = 7, digits: int = 4) -> str:
    return f"{'n/a':>{width}}" if math.isnan(x) else f"{x:>{width}.{digits}f}"


columns = ["P_i2t", "R_i2t", "sel_i2t", "P_t2i", "R_t2i", "sel_t2i", "noisy%", "AUC", "rsum"]
for run in runs:
    print(f"\n{run['name']}")
    print(f"{'epoch':>5} {'phase':<7}" + "".join(f"{c:>8}" for c in columns))
    for epoch, m in run["epochs"].items():
        numbers = [m[f"{k}_{d}"] for d in DIRECTIONS for k in ("precision", "recall", "selected")]
        text = "".join(" " + cell(x) for x in numbers)
        text += " " + cell(100 * m["noisy_share"], digits=2) + " " + cell(m["noise_auc"])
        text += " " + cell(m["val_rsum"], digits=1)
        print(f"{epoch:>5} {m['phase']:<7}{text}")
    results = run["results"]
    if results is None:
        print("no results.json: the run did not finish its test.")
        continue
    print(
        f"test (best val epoch {results.get('best_epoch')}): rsum {results['rsum']:.2f} | "
        + " ".join(f"{k} {results[k]:.2f}" for k in ("i2t_r1", "i2t_r5", "i2t_r10"))
        + " | "
        + " ".join(f"{k} {results[k]:.2f}" for k in ("t2i_r1", "t2i_r5", "t2i_r10"))
        + f" | noise AUC {value(results, 'noise_auc'):.4f}"
    )
