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
# # GSC: geometrical structure consistency (Fig. 5 of the paper, from a run)
#
# Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure Consistency
# Learning", CVPR 2024. This notebook reads a finished GSC run and draws:
#
# 1. the soft labels of clean and noisy pairs over the epochs (cross-modal, intra-modal
#    and final labels; individual tracked pairs and class means);
# 2. the distribution of the min-max normalised intra-modal consistency scores of clean
#    and noisy pairs with the two-component GMM fitted on them;
# 3. the cross-modal and intra-modal label distributions of clean and noisy pairs;
# 4. the noise-detection AUC of each label over the epochs.
#
# The run comes from, e.g.,
# `python train.py --config=configs/gsc.py:synthetic --workdir=runs/gsc_synthetic`
# (or `:quick`). Set `NCLJAX_WORKDIR` to the run directory; figures are saved to
# `NCLJAX_FIGURES` (default: `<workdir>/figures`). The true noise mask was read by the
# trainer's diagnostics only (`workdir/diagnostics/epoch_XXXX.npz`, `metrics.jsonl`).

# %%
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

WORKDIR = os.environ.get("NCLJAX_WORKDIR", "runs/gsc_synthetic")
FIGURES = os.environ.get("NCLJAX_FIGURES", os.path.join(WORKDIR, "figures"))
NETWORK = int(os.environ.get("NCLJAX_NETWORK", "0"))  # which network of GSC+ to draw
os.makedirs(FIGURES, exist_ok=True)

with open(os.path.join(WORKDIR, "config.json")) as f:
    config = json.load(f)
with open(os.path.join(WORKDIR, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
files = sorted(glob.glob(os.path.join(WORKDIR, "diagnostics", "epoch_*.npz")))
if config["method"] != "gsc" or not files:
    raise SystemExit(f"{WORKDIR} holds no GSC run with label diagnostics.")
epochs = [int(os.path.basename(f)[6:10]) for f in files]
diagnostics = [dict(np.load(f)) for f in files]
val = {r["epoch"]: r for r in rows if r["split"] == "val"}
refresh = {r["epoch"]: r for r in rows if r["split"] == "refresh"}
num_networks = diagnostics[0]["label_tracked"].shape[0]
suffix = f"_net{NETWORK}" if num_networks > 1 else ""
print(
    f"{config['method']} with {num_networks} network(s), noise {config['noise']['kind']} "
    f"{config['noise']['rate']}, {len(epochs)} epochs; drawing network {NETWORK}."
)
results_path = os.path.join(WORKDIR, "results.json")
if os.path.exists(results_path):
    with open(results_path) as f:
        print("test:", {k: v if v is None else round(v, 4) for k, v in json.load(f).items()})

# %% [markdown]
# ## 1. Label trajectories of clean and noisy pairs
#
# Thin lines: a fixed sample of tracked pairs; thick lines: the mean over all clean
# (blue) and all noisy (red) pairs. Epoch 0 trains with every label equal to 1; from
# epoch 1 on, the labels of noisy pairs decay towards 0 (at most by a factor 0.3 per
# epoch, the temporal ensembling with momentum 0.7).

# %%
clean_tracked = diagnostics[0]["clean_tracked"]
names = [("cross_label", "cross-modal $Y_{CM}$"), ("intra_label", "intra-modal $Y_{IM}$")]
names.append(("label", "final $y=\\min(Y_{CM},Y_{IM})$"))
fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
for ax, (name, title) in zip(axes, names, strict=True):
    tracks = np.stack([d[f"{name}_tracked"][NETWORK] for d in diagnostics], axis=1)
    for values, is_clean in zip(tracks[:40], clean_tracked[:40], strict=True):
        ax.plot(epochs, values, color="tab:blue" if is_clean else "tab:red", alpha=0.15, lw=0.8)
    for group, color in (("clean", "tab:blue"), ("noisy", "tab:red")):
        mean = [val[e][f"{name}_mean_{group}"] for e in epochs]
        ax.plot(epochs, mean, color=color, lw=2.5, label=f"{group} (mean over networks)")
    ax.set_title(title)
    ax.set_xlabel("epoch")
axes[0].set_ylabel("label")
axes[0].legend()
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "gsc_label_trajectories.png"), dpi=120)

# %% [markdown]
# ## 2. Intra-modal scores and the fitted two-component GMM
#
# The refresh before epoch `e` fits the GMM on the scores of epoch `e - 1`, min-max
# normalised; `diagnostics/epoch_e.npz` holds those same scores (`intra_fitted`) and
# `metrics.jsonl` the mixture (`split == "refresh"`). The component with the larger mean
# is the clean one; its posterior is the intra-modal indicator.

# %%
fitted_epochs = [e for e in epochs if e in refresh]
if fitted_epochs:
    chosen = fitted_epochs[-1]
    d = diagnostics[epochs.index(chosen)]
    edges = d["intra_fitted_edges"]
    width = np.diff(edges)
    hist_clean = d["intra_fitted_hist_clean"][NETWORK]
    hist_noisy = d["intra_fitted_hist_noisy"][NETWORK]
    total = (hist_clean.sum() + hist_noisy.sum()) * width
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(edges[:-1], hist_clean / total, width, align="edge", alpha=0.5, label="clean pairs")
    ax.bar(
        edges[:-1],
        hist_noisy / total,
        width,
        bottom=hist_clean / total,
        align="edge",
        alpha=0.5,
        color="tab:red",
        label="noisy pairs",
    )
    x = np.linspace(0, 1, 400)
    r = refresh[chosen]
    mixture = 0.0
    for part, color in (("low", "tab:red"), ("high", "tab:blue")):
        weight, mean = r[f"gmm_weight_{part}{suffix}"], r[f"gmm_mean_{part}{suffix}"]
        var = r[f"gmm_var_{part}{suffix}"]
        density = weight * np.exp(-((x - mean) ** 2) / (2 * var)) / np.sqrt(2 * np.pi * var)
        mixture = mixture + density
        ax.plot(x, density, color=color, ls="--", label=f"GMM {part}-mean component")
    ax.plot(x, mixture, color="black", lw=1.5, label="GMM")
    ax.set_xlabel("normalised intra-modal consistency score")
    ax.set_ylabel("density")
    ax.set_title(f"scores of epoch {chosen - 1}, GMM fitted before epoch {chosen}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES, "gsc_intra_scores_gmm.png"), dpi=120)
else:
    print("No label update yet (a one-epoch run): nothing to draw.")

# %% [markdown]
# ## 3. Cross-modal and intra-modal label distributions (last epoch)

# %%
last = diagnostics[-1]
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
for ax, (name, title) in zip(axes, names, strict=True):
    edges = last[f"{name}_edges"]
    for group, color in (("clean", "tab:blue"), ("noisy", "tab:red")):
        counts = last[f"{name}_hist_{group}"][NETWORK]
        ax.stairs(counts, edges, fill=True, alpha=0.5, color=color, label=f"{group} pairs")
    ax.set_yscale("log")
    ax.set_title(f"{title}, epoch {epochs[-1]}")
    ax.set_xlabel("label")
axes[0].set_ylabel("pairs")
axes[0].legend()
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "gsc_label_distributions.png"), dpi=120)

# %% [markdown]
# ## 4. Noise-detection quality of each label over the epochs
#
# ROC AUC of each label for the clean class (the paper's Fig. 5 reports accuracy of
# `label > 0.5`; AUC does not depend on that threshold).

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for name, title in names:
    ax.plot(epochs, [val[e][f"noise_auc_{name}"] for e in epochs], marker="o", label=title)
ax.set_xlabel("epoch")
ax.set_ylabel("noise-detection AUC")
ax.set_ylim(0.4, 1.0)
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(FIGURES, "gsc_detection_auc.png"), dpi=120)
for e in epochs:
    print(
        f"epoch {e}: AUC cross {val[e]['noise_auc_cross_label']:.3f} intra "
        f"{val[e]['noise_auc_intra_label']:.3f} final {val[e]['noise_auc_label']:.3f}"
    )
