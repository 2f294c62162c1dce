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
# # PC2: the co-divide loss, pseudo-captions and the oscillation division (Fig. 2, from runs)
#
# Duan et al., "PC2: Pseudo-Classification Based Pseudo-Captioning for Noisy Correspondence
# Learning in Cross-Modal Retrieval", ACM MM 2024. This notebook reads a finished PC2 run
# and, where there is one, a finished NCR run (PC2's baseline, the same co-training without
# the pseudo-classifier), and draws:
#
# 1. the paper's Fig. 2: per co-training epoch, the mean co-divide loss (the eval-mode
#    per-pair mean-negative hinge loss computed before the epoch, on which the GMM divides
#    the pairs) of truly clean and of truly noisy pairs, NCR (left) against PC2 (right),
#    with the oscillation of the clean pairs' loss (its mean absolute epoch-to-epoch change);
# 2. the per-pair histograms of that loss at the first and last co-training epochs;
# 3. the accuracy of PC2's pseudo-captions (the share of pseudo-captioned noisy images whose
#    borrowed clean caption has the image's true latent class), with the borrowed caption's
#    prediction cosine and the margin it gets, over the epochs;
# 4. the division quality (AUC, precision, recall against the true mask) of PC2's loss GMM
#    and of its prediction-oscillation GMM, the mean oscillation of clean and noisy pairs,
#    and the clean fractions of the two splits per network;
#
# and prints per-epoch tables and the test metrics of each run.
#
# The runs come from
# `python train.py --config=configs/pc2.py:synthetic --workdir=runs/pc2_synthetic` and
# `python train.py --config=configs/ncr.py:synthetic --workdir=runs/ncr_synthetic` (or
# `:synthetic,quick`: one warm-up and two co-training epochs). Set `NCLJAX_PC2_WORKDIR`
# (default `runs/pc2_synthetic`) and `NCLJAX_NCR_WORKDIR` (default `runs/ncr_synthetic`;
# without it PC2 is drawn alone); figures are saved to `NCLJAX_FIGURES` (default: the PC2
# run's `figures/`). The true noise mask and the latent classes were read by the trainer's
# diagnostics only (`metrics.jsonl`, `workdir/diagnostics/epoch_XXXX.npz`), never by the
# methods. Every hyperparameter shown is read from the runs' `config.json`.

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

PC2_WORKDIR = os.environ.get("NCLJAX_PC2_WORKDIR", "runs/pc2_synthetic")
NCR_WORKDIR = os.environ.get("NCLJAX_NCR_WORKDIR", "runs/ncr_synthetic")
FIGURES = os.environ.get("NCLJAX_FIGURES", os.path.join(PC2_WORKDIR, "figures"))
os.makedirs(FIGURES, exist_ok=True)
PSEUDO_KEYS = ("pseudo_caption_accuracy", "pseudo_cosine", "pseudo_margin")
GROUP_COLORS = {"clean": "tab:blue", "noisy": "tab:red"}


def load_run(workdir: str, method: str) -> dict:
    """A run's config, metrics rows, per-epoch diagnostics and test results."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise SystemExit(
            f"{workdir} holds no run: train first, e.g. python train.py "
            f"--config=configs/{method}.py:synthetic --workdir={workdir}"
        )
    with open(path) as f:
        config = json.load(f)
    if config["method"] != method:
        raise SystemExit(f"{workdir} holds a {config['method']} run, not a {method} one.")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    files = sorted(glob.glob(os.path.join(workdir, "diagnostics", "epoch_*.npz")))
    diagnostics = {int(os.path.basename(f)[6:10]): dict(np.load(f)) for f in files}
    diagnostics = {e: d for e, d in diagnostics.items() if "neg_loss_edges" in d}
    clean_rate = math.nan
    if diagnostics:
        first = next(iter(diagnostics.values()))
        clean = first["neg_loss_hist_clean"][0].sum()
        clean_rate = clean / (clean + first["neg_loss_hist_noisy"][0].sum())
    results = None
    if os.path.exists(os.path.join(workdir, "results.json")):
        with open(os.path.join(workdir, "results.json")) as f:
            results = json.load(f)
    kwargs = config["method_kwargs"]
    train = [r for r in rows if r["split"] == "train"]
    val = {r["epoch"]: r for r in rows if r["split"] == "val"}
    return {
        "name": os.path.basename(os.path.normpath(workdir)),
        "method": method,
        "config": config,
        "kwargs": kwargs,
        "warmup": kwargs["warmup_epochs"],
        "train": train,
        "val": val,
        "refresh": {r["epoch"]: r for r in rows if r["split"] == "refresh"},
        "all_epochs": sorted({r["epoch"] for r in train} | set(val)),
        "diagnostics": diagnostics,
        "clean_rate": clean_rate,  # of the training pairs, from the true mask
        "results": results,
    }


def value(row: dict, key: str) -> float:
    """A logged number; NaN where the row lacks it or logged NaN (``null``)."""
    v = row.get(key)
    return math.nan if v is None else float(v)


def second_update_start(run: dict) -> int | None:
    """The first epoch (counted from 0, warm-up included) with the second update: PC2's
    pseudo-caption update (``pseudo_start_epoch``, off with ``noisy_weight=0``), NCR's
    noisy-set update (``noisy_start_epoch``); both counted in co-training epochs."""
    k = run["kwargs"]
    if run["method"] == "pc2":
        start = k.get("pseudo_start_epoch")
        if k.get("noisy_weight", 1.0) <= 0:
            return None
    else:
        start = k.get("noisy_start_epoch")
    return None if start is None else run["warmup"] + start


def phase(run: dict, epoch: int) -> str:
    """``warm-up`` (no co-divide), ``clean`` (the clean update only), ``pseudo`` (PC2 with
    the pseudo-caption update) or ``noisy`` (NCR with the noisy-set update)."""
    if epoch < run["warmup"]:
        return "warm-up"
    start = second_update_start(run)
    if start is not None and epoch >= start:
        return "pseudo" if run["method"] == "pc2" else "noisy"
    return "clean"


def cotraining_epochs(run: dict) -> list[int]:
    return [e for e in run["all_epochs"] if e >= run["warmup"]]


def epoch_metrics(run: dict) -> dict[int, dict]:
    """Per epoch: the co-divide loss of clean and noisy pairs (minus the logged means of
    ``neg_loss``, the raw loss negated and averaged over the two networks), its change
    from the previous epoch, the two GMMs' division quality, the mean prediction
    oscillation of clean and noisy pairs (PC2: minus ``neg_osc``), the refresh pass's
    per-network diagnostics, the pseudo-caption logs (PC2) and the validation rsum.

    The val row of epoch ``e`` scores the per-pair memory after the epoch, which holds the
    co-divide made before it (the training steps do not write these rows). Warm-up epochs
    have no co-divide (the memory holds its initial values): their columns are NaN.
    """
    summary, previous = {}, {}
    for epoch in run["all_epochs"]:
        e = {"phase": phase(run, epoch)}
        divided = epoch >= run["warmup"]
        val = run["val"].get(epoch, {}) if divided else {}
        refresh = run["refresh"].get(epoch, {}) if divided else {}
        for group in ("clean", "noisy"):
            loss = -value(val, f"neg_loss_mean_{group}")
            e[f"loss_{group}"] = loss
            e[f"change_{group}"] = abs(loss - previous.get(group, math.nan))
            previous[group] = loss
            e[f"osc_{group}"] = -value(val, f"neg_osc_mean_{group}")
        for gmm, suffix in (("w", "prob"), ("wo", "osc_prob")):
            for key in ("auc", "precision", "recall"):
                e[f"{key}_{gmm}"] = value(val, f"noise_{key}_{suffix}")
        for k in (0, 1):
            for key in ("clean_fraction", "osc_clean_fraction", "prediction_classes_used"):
                e[f"{key}_net{k}"] = value(refresh, f"{key}_net{k}")
        rows = [r for r in run["train"] if r["epoch"] == epoch]
        for key in PSEUDO_KEYS:  # the mean over the epoch's logging windows, both networks
            logged = [value(r, key) for r in rows]
            logged = [x for x in logged if not math.isnan(x)]
            e[key] = float(np.mean(logged)) if logged else math.nan
            for k in (0, 1):
                mine = [value(r, key) for r in rows if r.get("network") == k]
                mine = [x for x in mine if not math.isnan(x)]
                e[f"{key}_net{k}"] = float(np.mean(mine)) if mine else math.nan
        e["pseudo_windows"] = sum(r.get("pseudo_caption_accuracy") is not None for r in rows)
        e["val_rsum"] = value(run["val"].get(epoch, {}), "rsum")
        summary[epoch] = e
    return summary


def oscillation(run: dict, group: str) -> tuple[float, int]:
    """The mean absolute change of the group's mean co-divide loss between consecutive
    co-training epochs (both logged), and the number of such changes."""
    changes = [run["epochs"][e][f"change_{group}"] for e in cotraining_epochs(run)]
    changes = [x for x in changes if not math.isnan(x)]
    return (float(np.mean(changes)) if changes else math.nan), len(changes)


def describe(run: dict) -> str:
    k, config = run["kwargs"], run["config"]
    noise, model = config["noise"], config["model"]
    start = second_update_start(run)
    text = (
        f"{run['name']} ({run['method']}): noise {noise['kind']} {noise['rate']} (clean share "
        f"{run['clean_rate']:.3f}), {len(run['all_epochs'])} epochs ({run['warmup']} warm-up), "
        f"batch {config['train']['batch_size']}, head {model['head']} on "
        f"{model['image_input']}/{model['text_input']} inputs, margin={k.get('margin')} "
        f"threshold={k.get('threshold')}"
    )
    if run["method"] == "pc2":
        return text + (
            f", K={k.get('num_classes')} pseudo-classes (data: {config['data'].get('num_classes')}"
            f" latent classes), entropy {k.get('entropy_mode')} x {k.get('entropy_weight')}, "
            f"bank_mode={k.get('bank_mode')}, noisy_weight={k.get('noisy_weight')}, "
            f"noisy_margin_cutoff={k.get('noisy_margin_cutoff')}, pseudo_start_epoch="
            f"{k.get('pseudo_start_epoch')} (epoch {start})"
        )
    return text + (
        f", soft_margin={k.get('soft_margin')}, noisy_start_epoch={k.get('noisy_start_epoch')}"
        f" (epoch {start})"
    )


pc2 = load_run(PC2_WORKDIR, "pc2")
if os.path.exists(NCR_WORKDIR):
    ncr = load_run(NCR_WORKDIR, "ncr")
else:
    ncr = None
    print(f"No NCR run at {NCR_WORKDIR} (NCLJAX_NCR_WORKDIR): drawing PC2 only.")
runs = [run for run in (ncr, pc2) if run is not None]
for run in runs:
    run["epochs"] = epoch_metrics(run)
    print(describe(run))


def mark_start(ax, run: dict) -> None:
    """A dashed line at the first epoch of the run's second update."""
    start = second_update_start(run)
    if start is not None and start in run["epochs"]:
        what = "pseudo-caption update" if run["method"] == "pc2" else "noisy-set update"
        ax.axvline(start - 0.5, color="0.4", ls="--", lw=1, label=f"{what} from here")


def no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9)


# %% [markdown]
# ## 1. The co-divide loss of clean and noisy pairs (Fig. 2)
#
# Before each co-training epoch, each network computes in eval mode every training pair's
# mean-negative hinge loss, and a two-component GMM on it divides the pairs into clean and
# noisy. Drawn per co-training epoch: the mean of that loss over the truly clean pairs
# (blue) and over the truly noisy pairs (red), averaged over the two networks, with the
# 25-75% range of the two networks' per-pair losses (bands, from the histograms of
# `diagnostics/epoch_XXXX.npz`). The paper's point: with NCR the clean pairs' loss
# oscillates from epoch to epoch, so the division flips pairs back and forth; PC2's
# pseudo-captions give the noisy images a clean caption to learn from, and its
# oscillation GMM rectifies the margins, which steadies the clean pairs' loss and widens
# the gap to the noisy pairs. The oscillation (in the titles) is the mean absolute change
# of the clean pairs' mean loss between consecutive co-training epochs.


# %%
def loss_histogram(diag: dict, group: str) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of the co-divide loss (``-neg_loss``) pooled over the networks,
    edges increasing."""
    return diag[f"neg_loss_hist_{group}"].sum(0)[::-1], -diag["neg_loss_edges"][::-1]


def histogram_quantile(counts: np.ndarray, edges: np.ndarray, q: float) -> float:
    """The ``q`` quantile of a histogram, linear within bins."""
    if counts.sum() == 0:
        return math.nan
    cumulative = np.concatenate([[0.0], np.cumsum(counts)]) / counts.sum()
    return float(np.interp(q, cumulative, edges))


fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True, squeeze=False)
for run, ax in zip(runs, axes[0], strict=True):
    epochs = cotraining_epochs(run)
    clean_osc, _ = oscillation(run, "clean")
    ax.set_title(
        f"{run['method'].upper()} ({run['name']}): clean-loss oscillation "
        f"{'n/a' if math.isnan(clean_osc) else f'{clean_osc:.4f}'}",
        fontsize=10,
    )
    if not epochs:
        no_data(ax, "no co-training epoch yet")
        continue
    for group, color in GROUP_COLORS.items():
        means = [run["epochs"][e][f"loss_{group}"] for e in epochs]
        ax.plot(epochs, means, marker="o", ms=4, color=color, label=f"{group} pairs (mean)")
        band = [e for e in epochs if e in run["diagnostics"]]
        if band:
            hists = [loss_histogram(run["diagnostics"][e], group) for e in band]
            low = [histogram_quantile(c, edges, 0.25) for c, edges in hists]
            high = [histogram_quantile(c, edges, 0.75) for c, edges in hists]
            ax.fill_between(band, low, high, color=color, alpha=0.15, lw=0)
    mark_start(ax, run)
    ax.set_xlabel("epoch (co-divide before it)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
axes[0][0].set_ylabel("co-divide loss (bands: 25-75% of pairs)")
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "pc2_codivide_loss.png"), dpi=120)

# %% [markdown]
# ## 2. Histograms of the co-divide loss
#
# The per-pair co-divide loss of the two networks pooled, truly clean pairs blue and truly
# noisy pairs red, at the first and the last co-training epoch of each run (dotted: the
# logged means). The GMM can only divide well where the two histograms separate.


# %%
def chosen_epochs(run: dict) -> list[int]:
    available = [e for e in cotraining_epochs(run) if e in run["diagnostics"]]
    return sorted({available[0], available[-1]}) if available else []


columns = max([len(chosen_epochs(run)) for run in runs] + [1])
fig, axes = plt.subplots(
    len(runs), columns, figsize=(4.5 * columns, 3.2 * len(runs)), squeeze=False
)
for run, row_axes in zip(runs, axes, strict=True):
    epochs = chosen_epochs(run)
    for ax in row_axes[len(epochs) :]:
        ax.axis("off")
    if not epochs:
        row_axes[0].axis("on")
        no_data(row_axes[0], f"{run['name']}: no co-divide yet")
        continue
    for ax, epoch in zip(row_axes, epochs, strict=False):
        lo, hi = math.inf, -math.inf
        for group, color in GROUP_COLORS.items():
            counts, edges = loss_histogram(run["diagnostics"][epoch], group)
            ax.stairs(counts, edges, fill=True, alpha=0.45, color=color, label=f"{group} pairs")
            ax.axvline(run["epochs"][epoch][f"loss_{group}"], color=color, ls=":", lw=1)
            occupied = np.flatnonzero(counts)
            if occupied.size:
                lo, hi = min(lo, edges[occupied[0]]), max(hi, edges[occupied[-1] + 1])
        if math.isfinite(lo):
            pad = 0.05 * max(hi - lo, 1e-6)
            ax.set_xlim(lo - pad, hi + pad)
        ax.set_title(f"{run['method'].upper()}: co-divide before epoch {epoch}", fontsize=9)
        ax.set_xlabel("co-divide loss")
    row_axes[0].set_ylabel("pairs (both networks)")
    row_axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "pc2_codivide_loss_histograms.png"), dpi=120)

# %% [markdown]
# ## 3. Pseudo-caption accuracy (PC2)
#
# In the pseudo-caption update (co-training epochs from `pseudo_start_epoch` on), every
# image of the peer's noisy set borrows the caption of the clean-set pair whose image
# prediction of the pseudo-classifier is most cosine-similar to its own. Left: the share
# of these borrowed captions whose true latent class is the image's (the synthetic data's
# classes; logged by the trainer only), per epoch the mean over the logging windows of
# both networks (solid; the networks' own means as markers), with `1 / data.num_classes`
# (a caption of a uniformly drawn class) for reference. Middle: the mean cosine between
# the noisy image's and the borrowed caption's image predictions. Right: the mean margin
# of the pseudo-pairs' hinge (Eq. 5, `alpha (10^s - 1) / 9` of the cosine `s`, 0 below
# `noisy_margin_cutoff`). Epochs without the update have no point.

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
epochs = pc2["all_epochs"]
logged = [e for e in epochs if not math.isnan(pc2["epochs"][e]["pseudo_caption_accuracy"])]
titles = {
    "pseudo_caption_accuracy": "pseudo-caption accuracy (true latent class)",
    "pseudo_cosine": "cosine of the borrowed caption's prediction",
    "pseudo_margin": "margin of the pseudo-pairs",
}
for ax, key in zip(axes, PSEUDO_KEYS, strict=True):
    ax.set_title(titles[key], fontsize=10)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not logged:
        start = pc2["kwargs"].get("pseudo_start_epoch")
        no_data(ax, f"no pseudo-caption update logged\n(pseudo_start_epoch={start})")
        continue
    ax.plot(epochs, [pc2["epochs"][e][key] for e in epochs], marker="o", color="C0", label="mean")
    for k, marker in ((0, "^"), (1, "v")):
        ax.plot(
            epochs,
            [pc2["epochs"][e][f"{key}_net{k}"] for e in epochs],
            marker,
            ms=5,
            color="0.4",
            label=f"network {k}",
        )
    mark_start(ax, pc2)
    ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
    ax.ticklabel_format(axis="y", useOffset=False)
num_classes = pc2["config"]["data"].get("num_classes")
if logged and num_classes:
    axes[0].axhline(1 / num_classes, color="0.5", lw=0.8, label=f"1 / {num_classes} classes")
    axes[0].set_ylim(0, 1.02)
if logged:
    axes[1].set_ylim(min(0.0, np.nanmin([pc2["epochs"][e]["pseudo_cosine"] for e in logged])), 1.02)
    axes[2].set_ylim(0, 1.1 * pc2["kwargs"]["margin"])
    axes[2].axhline(
        pc2["kwargs"]["margin"], color="0.5", lw=0.8, label=f"alpha = {pc2['kwargs']['margin']}"
    )
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "pc2_pseudo_captions.png"), dpi=120)

# %% [markdown]
# ## 4. The loss GMM against the oscillation GMM (PC2)
#
# Before each co-training epoch PC2 fits two GMMs per network: on the co-divide loss
# (clean probability `w`, the division the peer trains on) and on the prediction
# oscillation `o = KL(bank || p)` between the pseudo-classifier's predictions of two
# successive co-divides (`w_o`, which raises the margins of Eq. 8 where `w_o >= tau`).
# Left: each GMM's clean probability (averaged over the networks) as a detector of the
# truly clean pairs: AUC, and precision and recall of `> 0.5` (loss GMM solid, oscillation
# GMM dashed; NCR's loss GMM dotted grey where there is a run). Middle: the mean
# oscillation of truly clean and truly noisy pairs. Right: the fraction of the pairs each
# network's splits call clean (the refresh pass; loss split solid, oscillation split
# dashed), with the true clean share.

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4))
epochs = cotraining_epochs(pc2)
if epochs:
    for i, key in enumerate(("auc", "precision", "recall")):
        for gmm, style, name in (("w", "-", "loss GMM"), ("wo", "--", "oscillation GMM")):
            values = [pc2["epochs"][e][f"{key}_{gmm}"] for e in epochs]
            axes[0].plot(
                epochs, values, style, marker="o", ms=4, color=f"C{i}", label=f"{key}, {name}"
            )
    if ncr is not None:
        ncr_epochs = cotraining_epochs(ncr)
        values = [ncr["epochs"][e]["auc_w"] for e in ncr_epochs]
        axes[0].plot(ncr_epochs, values, ":", marker=".", color="0.5", label="auc, NCR loss GMM")
    for group, color in GROUP_COLORS.items():
        values = [pc2["epochs"][e][f"osc_{group}"] for e in epochs]
        axes[1].plot(epochs, values, marker="o", color=color, label=f"{group} pairs")
    for k in (0, 1):
        for key, style, name in (
            ("clean_fraction", "-", "loss"),
            ("osc_clean_fraction", "--", "osc"),
        ):
            values = [pc2["epochs"][e][f"{key}_net{k}"] for e in epochs]
            axes[2].plot(
                epochs,
                values,
                style,
                marker="o",
                ms=4,
                color=f"C{k}",
                label=f"net {k}, {name} split",
            )
    axes[2].axhline(pc2["clean_rate"], color="0.5", lw=0.8, label="true clean share")
else:
    for ax in axes:
        no_data(ax, "no co-training epoch yet")
for ax, title, ylabel in zip(
    axes,
    (
        "division quality (clean detection)",
        "prediction oscillation",
        "clean fraction of the splits",
    ),
    ("AUC / precision / recall", "mean KL oscillation", "fraction of training pairs"),
    strict=True,
):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("epoch (co-divide before it)")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if epochs:
        ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "pc2_division_quality.png"), dpi=120)

# %% [markdown]
# ## 5. Summary
#
# Per run and epoch (phases: `warm-up`, no co-divide; `clean`, the clean update only;
# `pseudo`, PC2 with the pseudo-caption update; `noisy`, NCR with the noisy-set update;
# `n/a`: not logged, e.g. no co-divide in the warm-up or no pseudo-caption before
# `pseudo_start_epoch`):
#
# * `[loss]`: the mean co-divide loss of clean and noisy pairs, their absolute change from
#   the previous epoch, and the validation rsum; then the oscillation (the mean of those
#   changes);
# * `[pseudo]` (PC2): the pseudo-caption accuracy, cosine and margin (means over the
#   epoch's logging windows of both networks) and the number of windows;
# * `[division]`: AUC, precision and recall of the loss GMM (`w`) and of the oscillation
#   GMM (`wo`, PC2), and the mean oscillation of clean and noisy pairs (PC2);
# * `[refresh]`: per network, the loss split's and the oscillation split's clean fractions
#   and the number of pseudo-classes the predictions use (PC2);
#
# then the test metrics of the best validation epoch (`results.json`).


# %%
def cell(x: float, width: int = 7, digits: int = 4) -> str:
    return f"{'n/a':>{width}}" if math.isnan(x) else f"{x:>{width}.{digits}f}"


def table(run: dict, title: str, columns: dict[str, str], digits: dict | None = None) -> None:
    print(f"\n[{title}] {run['name']}")
    print(f"{'epoch':>5} {'phase':<7}" + "".join(f"{c:>8}" for c in columns))
    for epoch, m in run["epochs"].items():
        text = "".join(
            " " + cell(m[key], digits=(digits or {}).get(name, 4)) for name, key in columns.items()
        )
        print(f"{epoch:>5} {m['phase']:<7}{text}")


LOSS = {
    "clean": "loss_clean",
    "noisy": "loss_noisy",
    "d_clean": "change_clean",
    "d_noisy": "change_noisy",
    "rsum": "val_rsum",
}
PSEUDO = {"acc": PSEUDO_KEYS[0], "cosine": PSEUDO_KEYS[1], "margin": PSEUDO_KEYS[2]}
PSEUDO["windows"] = "pseudo_windows"
DIVISION = {
    "AUC_w": "auc_w",
    "P_w": "precision_w",
    "R_w": "recall_w",
    "AUC_wo": "auc_wo",
    "P_wo": "precision_wo",
    "R_wo": "recall_wo",
    "o_clean": "osc_clean",
    "o_noisy": "osc_noisy",
}
REFRESH = {
    f"{short}{k}": f"{key}_net{k}"
    for short, key in (("clean", "clean_fraction"), ("osc", "osc_clean_fraction"))
    for k in (0, 1)
}
REFRESH |= {f"cls{k}": f"prediction_classes_used_net{k}" for k in (0, 1)}

for run in runs:
    table(run, "loss", LOSS, {"rsum": 1})
    for group in ("clean", "noisy"):
        osc, count = oscillation(run, group)
        print(
            f"{run['name']}: oscillation of the {group} pairs' co-divide loss (mean |change| "
            f"over {count} epoch-to-epoch steps): {cell(osc, width=0)}"
        )
    if run["method"] == "pc2":
        table(run, "pseudo", PSEUDO, {"windows": 0})
    table(run, "division", DIVISION)
    table(run, "refresh", REFRESH, {"cls0": 0, "cls1": 0})
print()
if ncr is not None:
    print(
        "oscillation of the clean pairs' co-divide loss: "
        + ", ".join(
            f"{run['method'].upper()} {cell(oscillation(run, 'clean')[0], 0)}" for run in runs
        )
    )
for run in runs:
    results = run["results"]
    if results is None:
        print(f"{run['name']}: no results.json: the run did not finish its test.")
        continue
    print(
        f"{run['name']}: test (best val epoch {results.get('best_epoch')}): rsum "
        f"{results['rsum']:.2f} | "
        + " ".join(f"{k} {results[k]:.2f}" for k in ("i2t_r1", "i2t_r5", "i2t_r10"))
        + " | "
        + " ".join(f"{k} {results[k]:.2f}" for k in ("t2i_r1", "t2i_r5", "t2i_r10"))
        + f" | noise AUC {value(results, 'noise_auc'):.4f}"
    )
