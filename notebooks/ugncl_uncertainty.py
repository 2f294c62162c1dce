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
# # UGNCL: the uncertainty of clean and noisy pairs (the paper's visualisation, from runs)
#
# Zha et al., "UGNCL: Uncertainty-Guided Noisy Correspondence Learning for Efficient
# Cross-Modal Matching", SIGIR 2024. This notebook reads one or more finished UGNCL runs
# and draws:
#
# 1. the histograms of the division's uncertainty `u` of clean and of noisy pairs at
#    several epochs, with the threshold `p` between determined and hard pairs;
# 2. the sizes of the four sets of the division (determined-clean, determined-noisy,
#    hard-clean, hard-noisy) per epoch;
# 3. the number of hard negatives `lambda` of the trusted robust loss against the step,
#    with its schedule `max(floor(lambda_start - delta t), theta)`;
# 4. the precision and recall of the determined-clean set (and of the hard-clean set where
#    it is non-empty) against the true mask, per training epoch;
#
# and prints a per-epoch summary and the test metrics.
#
# The runs come from, e.g.,
# `python train.py --config=configs/ugncl.py:synthetic --workdir=runs/ugncl_synthetic`
# (or `:synthetic,quick`: one warm-up and one training epoch). Set `NCLJAX_WORKDIRS` to
# the run directories, comma-separated (default `runs/ugncl_synthetic`; `NCLJAX_WORKDIR`
# is read when it is unset); figures are saved to `NCLJAX_FIGURES` (default: the first
# run's `figures/`). The true noise mask was read by the trainer's diagnostics only
# (`metrics.jsonl`, `workdir/diagnostics/epoch_XXXX.npz`), never by the method. Every
# hyperparameter shown is read from the run's `config.json`.

# %%
import fractions
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
        "NCLJAX_WORKDIRS", os.environ.get("NCLJAX_WORKDIR", "runs/ugncl_synthetic")
    ).split(",")
    if w.strip()
]
FIGURES = os.environ.get("NCLJAX_FIGURES", os.path.join(WORKDIRS[0], "figures"))
os.makedirs(FIGURES, exist_ok=True)
SETS = ("clean", "noisy", "hard_clean", "hard_noisy")  # codes 0..3 of ncljax.labels.ugncl
SET_COLORS = {
    "clean": "tab:blue",
    "noisy": "tab:red",
    "hard_clean": "tab:cyan",
    "hard_noisy": "tab:orange",
}


def load_run(workdir: str) -> dict:
    """A run's config, metrics rows, per-epoch diagnostics and test results."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise SystemExit(
            f"{workdir} holds no run: train first, e.g. python train.py "
            f"--config=configs/ugncl.py:synthetic --workdir={workdir}"
        )
    with open(path) as f:
        config = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    files = sorted(glob.glob(os.path.join(workdir, "diagnostics", "epoch_*.npz")))
    if config["method"] != "ugncl" or not files:
        raise SystemExit(f"{workdir} holds no UGNCL run with uncertainty diagnostics.")
    results = None
    if os.path.exists(os.path.join(workdir, "results.json")):
        with open(os.path.join(workdir, "results.json")) as f:
            results = json.load(f)
    diagnostics = {int(os.path.basename(f)[6:10]): dict(np.load(f)) for f in files}
    first = next(iter(diagnostics.values()))
    clean = first["certainty_hist_clean"][0].sum()
    noisy = first["certainty_hist_noisy"][0].sum()
    kwargs = config["method_kwargs"]
    return {
        "name": os.path.basename(os.path.normpath(workdir)),
        "config": config,
        "kwargs": kwargs,
        "warmup": kwargs["warmup_epochs"],
        "online": kwargs["division_cadence"] == "online",
        "batch": config["train"]["batch_size"],
        "train": [r for r in rows if r["split"] == "train"],
        "refresh": {r["epoch"]: r for r in rows if r["split"] == "refresh"},
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


def schedule(run: dict, steps: np.ndarray, capped: bool = True) -> np.ndarray:
    """``lambda_t = max(floor(lambda_start - delta t), theta)`` at the 1-based steps ``t``,
    in exact rational arithmetic (as ``ncljax.labels.ugncl.num_hard_negatives``); capped at
    the ``B - 1`` real negatives of a full batch of ``B`` pairs."""
    k = run["kwargs"]
    rate = fractions.Fraction(k["delta"]).limit_denominator(10**6)
    lam = np.array(
        [max(math.floor(k["lambda_start"] - rate * int(t)), k["theta"]) for t in steps], float
    )
    return np.maximum(np.minimum(lam, run["batch"] - 1), 1) if capped else lam


def step_windows(run: dict) -> list[tuple[int, int, dict]]:
    """``(first step, last step, row)`` of each train row: a row holds the means over the
    steps since the previous train row (a pass always ends with a row)."""
    out, previous = [], 0
    for row in run["train"]:
        out.append((previous + 1, row["step"], row))
        previous = row["step"]
    return out


def epoch_metrics(run: dict) -> dict[int, dict]:
    """Per epoch, the step logs pooled over the epoch's pairs, the division's set sizes,
    the mean ``u`` of clean and noisy pairs, and the validation numbers.

    A train row's ratios are pooled over its window: a set fraction is the set's pairs over
    the window's pairs, a precision the set's truly clean (or, for the noisy sets, truly
    noisy) pairs over the set's pairs, and an empty set logs precision 0. UGNCL trains on
    full batches only, so a window of ``s`` steps holds ``n = s B`` pairs; a set of
    fraction ``f`` and precision ``P`` holds ``f n`` pairs, ``P f n`` of them right. As the
    four sets partition the batch, the window's truly clean pairs are the right ones of
    the two clean sets plus the wrong ones of the two noisy sets, so the epoch's recall
    needs no logged count. Set sizes: the division pass before each training epoch
    (``refresh`` rows), or with ``division_cadence='online'`` the train rows' pooled set
    fractions. Mean ``u``: one minus the trainer's ``certainty_mean_clean``/``_noisy``
    after the epoch (the pairs' stored ``u``: the epoch's division, or online the value
    each pair last had), else from the histograms' bin centres. In warm-up epochs no
    division exists (the stored ``u`` is the initial 1): those columns are NaN.
    """
    batch, pooled = run["batch"], {}
    for first, last, row in step_windows(run):
        acc = pooled.setdefault(row["epoch"], {"pairs": 0.0, "divided": 0.0})
        n = (last - first + 1) * batch
        acc["pairs"] += n
        if row.get("set_clean") is None:  # a warm-up window: no division
            continue
        acc["divided"] += n
        size = {s: value(row, f"set_{s}") * n for s in SETS}
        right = {}
        for s in SETS:
            kind = "clean" if s in ("clean", "hard_clean") else "noisy"
            right[s] = value(row, f"step_{kind}_precision_{s}") * size[s] if size[s] > 0 else 0.0
            acc[f"size_{s}"] = acc.get(f"size_{s}", 0.0) + size[s]
            acc[f"right_{s}"] = acc.get(f"right_{s}", 0.0) + right[s]
        truly_clean = right["clean"] + right["hard_clean"]
        truly_clean += size["noisy"] - right["noisy"] + size["hard_noisy"] - right["hard_noisy"]
        acc["truly_clean"] = acc.get("truly_clean", 0.0) + truly_clean
    summary = {}
    for epoch, acc in sorted(pooled.items()):
        training = epoch >= run["warmup"]
        e = {"phase": "train" if training else "warm-up"}
        for s in ("clean", "hard_clean"):  # NaN both where the set was empty all epoch
            size, right = acc.get(f"size_{s}", 0.0), acc.get(f"right_{s}", 0.0)
            e[f"precision_{s}"] = ratio(right, size)
            e[f"recall_{s}"] = ratio(right, acc["truly_clean"]) if size > 0 else math.nan
        division = run["refresh"].get(epoch, {})
        for s in SETS:
            if run["online"]:
                e[f"set_{s}"] = ratio(acc.get(f"size_{s}", 0.0), acc["divided"])
            else:
                e[f"set_{s}"] = value(division, f"division_{s}") if training else math.nan
        val = run["val"].get(epoch, {})
        for group in ("clean", "noisy"):
            u = 1.0 - value(val, f"certainty_mean_{group}")
            if math.isnan(u) and epoch in run["diagnostics"]:
                u = histogram_mean(run["diagnostics"][epoch], group)
            e[f"u_{group}"] = u if training else math.nan
        e["noise_auc"] = value(val, "noise_auc")
        e["val_rsum"] = value(val, "rsum")
        summary[epoch] = e
    return summary


def uncertainty_histogram(diag: dict, group: str) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of ``u = 1 - certainty``, edges increasing."""
    return diag[f"certainty_hist_{group}"][0][::-1], 1.0 - diag["certainty_edges"][::-1]


def histogram_mean(diag: dict, group: str) -> float:
    counts, edges = uncertainty_histogram(diag, group)
    return ratio(float((counts * (edges[1:] + edges[:-1]) / 2).sum()), float(counts.sum()))


runs = [load_run(w) for w in WORKDIRS]
for run in runs:
    run["epochs"] = epoch_metrics(run)
    k, noise, model = run["kwargs"], run["config"]["noise"], run["config"]["model"]
    head = f"head {model['head']}"
    if model["head"] == "cosine":
        head += f" (cosine_shift={k['cosine_shift']} cosine_temperature={k['cosine_temperature']})"
    print(
        f"{run['name']}: noise {noise['kind']} {noise['rate']} (clean share "
        f"{run['clean_rate']:.3f}), {len(run['epochs'])} epochs ({run['warmup']} warm-up), "
        f"batch {run['batch']}, {head}, division {k['division_mode']} "
        f"cadence={k['division_cadence']} p={k['threshold']} epsilon={k['epsilon']}, "
        f"lambda_start={k['lambda_start']} delta={k['delta']} theta={k['theta']}, "
        f"xi1={k['xi1']} xi2={k['xi2']}"
    )
many = len(runs) > 1


def label(run: dict, text: str) -> str:
    return f"{run['name']}: {text}" if many else text


def training_epochs(run: dict) -> list[int]:
    return [e for e, m in run["epochs"].items() if m["phase"] == "train"]


# %% [markdown]
# ## 1. Uncertainty of clean and noisy pairs (the paper's visualisation)
#
# The division's uncertainty `u` of every training pair (the views' mean of the two
# directions' `K / S`, `division_mode='decl_lineage'`; the trainer stores the certainty
# `1 - u`), split by the true mask: clean pairs blue, noisy pairs red. Pairs left of the
# threshold `p` are determined (clean if their counterpart is the most believed class,
# else noisy), the others hard (hard-clean if their soft label exceeds `epsilon`). Drawn
# for the first training epoch, a middle one and the last. With the per-epoch division
# (`division_cadence='epoch'`) an epoch's panel is the division the epoch trained on;
# online, the value each pair had when last seen in the epoch. (In warm-up epochs no
# division exists and every stored `u` is the initial 1.)


# %%
def chosen_epochs(run: dict) -> list[int]:
    available = [e for e in training_epochs(run) if e in run["diagnostics"]]
    if not available:
        return []
    wanted = {available[0], available[len(available) // 2], available[-1]}
    return [e for e in available if e in wanted]


columns = max([len(chosen_epochs(run)) for run in runs] + [1])
fig, axes = plt.subplots(
    len(runs), columns, figsize=(4.5 * columns, 3.2 * len(runs)), squeeze=False
)
for run, row_axes in zip(runs, axes, strict=True):
    k, epochs = run["kwargs"], chosen_epochs(run)
    for ax in row_axes[len(epochs) :]:
        ax.axis("off")
    if not epochs:
        row_axes[0].text(0.5, 0.5, label(run, "no training epoch yet"), ha="center", va="center")
        print(f"{run['name']}: no training epoch yet, no division to draw.")
        continue
    for ax, epoch in zip(row_axes, epochs, strict=False):
        diag, lo, hi = run["diagnostics"][epoch], math.inf, -math.inf
        for group, color in (("clean", "tab:blue"), ("noisy", "tab:red")):
            counts, edges = uncertainty_histogram(diag, group)
            ax.stairs(counts, edges, fill=True, alpha=0.45, color=color, label=f"{group} pairs")
            mean = run["epochs"][epoch][f"u_{group}"]
            ax.axvline(mean, color=color, ls=":", lw=1)
            occupied = np.flatnonzero(counts)
            if occupied.size:
                lo, hi = min(lo, edges[occupied[0]]), max(hi, edges[occupied[-1] + 1])
        if not math.isfinite(lo):  # no pair (cannot happen on a real run)
            lo, hi = edges[0], edges[-1]
        p = k["threshold"]
        ax.axvline(p, color="black", lw=1.5, label=f"threshold p = {p}")
        pad = 0.05 * (max(hi, p) - min(lo, p))
        ax.set_xlim(min(lo, p) - pad, max(hi, p) + pad)
        when = "last seen in" if run["online"] else "division before"
        ax.set_title(label(run, f"{when} epoch {epoch}"), fontsize=9)
        ax.set_xlabel("uncertainty u (dotted: means)")
    row_axes[0].set_ylabel("pairs")
    row_axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "ugncl_uncertainty_histograms.png"), dpi=120)

# %% [markdown]
# ## 2. Sizes of the four sets
#
# The fraction of the training pairs in each set per epoch: from the division pass before
# each training epoch, or, online, pooled over the epoch's batches. Warm-up epochs (grey)
# have no division: every pair gets label 1 and the top-`lambda` loss. The thin line is
# the clean share of the training pairs (what the two clean sets would hold together
# under a perfect division).

# %%
fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4), squeeze=False)
for run, ax in zip(runs, axes[0], strict=True):
    epochs = list(run["epochs"])
    if run["warmup"] > 0:
        ax.axvspan(-0.5, run["warmup"] - 0.5, color="0.85", zorder=0, label="warm-up")
    bottom = np.zeros(len(epochs))
    for s in SETS:
        sizes = np.nan_to_num([run["epochs"][e][f"set_{s}"] for e in epochs])
        ax.bar(epochs, sizes, bottom=bottom, color=SET_COLORS[s], label=s.replace("_", "-"))
        bottom += sizes
    ax.axhline(run["clean_rate"], color="0.3", lw=0.8, label="clean share")
    source = "online, per batch" if run["online"] else "division pass before the epoch"
    ax.set_title(label(run, f"the four sets ({source})"), fontsize=10)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1.02)
axes[0][0].set_ylabel("fraction of training pairs")
axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "ugncl_set_sizes.png"), dpi=120)

# %% [markdown]
# ## 3. Number of hard negatives `lambda`
#
# The logged `num_negatives` (solid: the mean over each logging window's steps) against
# the global step, with the schedule `max(floor(lambda_start - delta t), theta)` (dashed,
# `t` the 1-based step from the first warm-up step) and the same capped at the `B - 1`
# real negatives of a batch of `B` pairs (dotted; the loss never takes more). The grey
# band is the warm-up. The printed difference is between each window's logged mean and
# the capped schedule's mean over the window's steps.

# %%
fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4), squeeze=False)
for i, (run, ax) in enumerate(zip(runs, axes[0], strict=True)):
    windows = step_windows(run)
    if not windows:
        ax.axis("off")
        continue
    k, last = run["kwargs"], windows[-1][1]
    edges = np.array([windows[0][0] - 1] + [w[1] for w in windows])
    logged = np.array([value(w[2], "num_negatives") for w in windows])
    expected = np.array([schedule(run, np.arange(a, b + 1)).mean() for a, b, _ in windows])
    t = np.arange(1, last + 1)
    warm = [w[1] for w in windows if w[2]["epoch"] < run["warmup"]]
    if warm:
        ax.axvspan(0, max(warm), color="0.85", zorder=0, label="warm-up")
    formula = f"max(floor({k['lambda_start']} - {k['delta']} t), {k['theta']})"
    ax.stairs(
        schedule(run, t, capped=False),
        np.arange(last + 1),
        color="0.3",
        ls="--",
        baseline=None,
        label=formula,
    )
    ax.stairs(
        schedule(run, t),
        np.arange(last + 1),
        color="0.3",
        ls=":",
        baseline=None,
        label=f"capped at B - 1 = {run['batch'] - 1}",
    )
    ax.stairs(logged, edges, color=f"C{i}", lw=2, baseline=None, label="logged num_negatives")
    ax.set_title(label(run, "hard negatives lambda"), fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.05 * max(k["lambda_start"], np.nanmax(logged)))
    ax.legend(fontsize=8)
    print(
        f"{run['name']}: lambda over {len(windows)} logging windows: logged num_negatives "
        f"{np.nanmin(logged):g} to {np.nanmax(logged):g}; max |logged - schedule| "
        f"{np.nanmax(np.abs(logged - expected)):.4g}"
    )
axes[0][0].set_ylabel("lambda")
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "ugncl_hard_negatives.png"), dpi=120)

# %% [markdown]
# ## 4. Precision and recall of the trusted sets
#
# Against the true mask, pooled over each training epoch's steps: of the determined-clean
# set (left; the pairs the hardest-negative triplet loss and label 1 trust) and of the
# hard-clean set (right; drawn in the epochs where it is non-empty), as predictors of
# clean pairs. Precision solid, recall dashed; the thin line is the clean share, the
# precision of a random selection.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharex=True, sharey=True)
for ax, s in zip(axes, ("clean", "hard_clean"), strict=True):
    drawn = False
    for i, run in enumerate(runs):
        epochs = training_epochs(run)
        for key, style in (("precision", "-"), ("recall", "--")):
            values = [run["epochs"][e][f"{key}_{s}"] for e in epochs]
            if not np.isnan(values).all():
                drawn = True
                ax.plot(
                    epochs, values, style, marker="o", ms=4, color=f"C{i}", label=label(run, key)
                )
    ax.axhline(runs[0]["clean_rate"], color="0.5", lw=0.8, label="clean share")
    name = "determined-clean" if s == "clean" else "hard-clean"
    if not drawn:
        ax.text(
            0.5,
            0.5,
            f"{name} set empty in every training epoch",
            transform=ax.transAxes,
            ha="center",
        )
    ax.set_title(f"{name} set as clean predictor")
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
axes[0].set_ylabel("precision / recall")
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "ugncl_precision_recall.png"), dpi=120)

# %% [markdown]
# ## 5. Summary
#
# Per epoch: the fractions of the training pairs in the four sets (C, N, HC, HN), the
# mean `u` of the truly clean and truly noisy pairs, the precision (P) and recall (R) of
# the determined-clean (C) and hard-clean (HC) sets, the noise-detection AUC of the
# certainty `1 - u` and the validation rsum (`n/a`: no division, or an empty set); then
# the test metrics of the best validation epoch (`results.json`).


# %%
def cell(x: float, width: int = 7, digits: int = 4) -> str:
    return f"{'n/a':>{width}}" if math.isnan(x) else f"{x:>{width}.{digits}f}"


KEYS = {
    "C": "set_clean",
    "N": "set_noisy",
    "HC": "set_hard_clean",
    "HN": "set_hard_noisy",
    "u_clean": "u_clean",
    "u_noisy": "u_noisy",
    "P_C": "precision_clean",
    "R_C": "recall_clean",
    "P_HC": "precision_hard_clean",
    "R_HC": "recall_hard_clean",
    "AUC": "noise_auc",
}
for run in runs:
    print(f"\n{run['name']}")
    print(f"{'epoch':>5} {'phase':<7}" + "".join(f"{c:>8}" for c in [*KEYS, "rsum"]))
    for epoch, m in run["epochs"].items():
        text = "".join(" " + cell(m[key]) for key in KEYS.values())
        print(f"{epoch:>5} {m['phase']:<7}{text} {cell(m['val_rsum'], digits=1)}")
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
