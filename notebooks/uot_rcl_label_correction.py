# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # UOT-RCL: progressive label correction, and robustness to the noise rate
#
# From a UOT-RCL run (``python train.py --config=configs/uot_rcl.py:synthetic
# --workdir=runs/uot_synthetic``), this notebook shows
#
# 1. the per-epoch label correction: the accuracy of the corrected labels (``argmax Q``
#    on the pairs the partial OT transported, ``rho_i > 0.5``) against the true labels,
#    next to the accuracy of the observed noisy labels, and the selected fraction
#    following the transported mass ``s`` (0.2 -> 0.8);
# 2. the paper's robustness analysis (its Tables I-II read along the noise rate): test
#    mAP of UOT-RCL and the CE baseline at symmetric noise 0.2 / 0.4 / 0.6 / 0.8, trained
#    the same way. The sweep's runs are trained here when their workdirs hold no
#    ``results.json`` yet (20 runs' worth of minutes at full size; ``:quick`` in CI).
#
# Settings come from the environment so the same file runs in CI:
#
# * ``NCLJAX_WORKDIR``: the UOT-RCL run (default ``runs/uot_synthetic``);
# * ``NCLJAX_SWEEP_DIR``: where the sweep's runs live (default ``runs/uot_sweep``);
# * ``NCLJAX_SWEEP_ARG``: the config argument of the sweep runs (``""`` or ``"quick"``);
# * ``NCLJAX_NOISE_RATES``: comma-separated rates (default ``0.2,0.4,0.6,0.8``).
#
# Figures are written to ``<workdir>/figures``.

# %%

import json
import os
import pathlib
import sys

import matplotlib

if "ipykernel" not in sys.modules:  # run as a script (CI): draw to files only
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

WORKDIR = pathlib.Path(os.environ.get("NCLJAX_WORKDIR", "runs/uot_synthetic"))
SWEEP_DIR = pathlib.Path(os.environ.get("NCLJAX_SWEEP_DIR", "runs/uot_sweep"))
SWEEP_ARG = os.environ.get("NCLJAX_SWEEP_ARG", "")
RATES = [float(r) for r in os.environ.get("NCLJAX_NOISE_RATES", "0.2,0.4,0.6,0.8").split(",")]
FIGURES = WORKDIR / "figures"
FIGURES.mkdir(parents=True, exist_ok=True)


def find_root() -> pathlib.Path:
    """The repository root (holding ``configs/``), from here or the notebook's folder."""
    for start in (pathlib.Path.cwd(), pathlib.Path(globals().get("__file__", ".")).resolve()):
        for folder in (start, *start.parents):
            if (folder / "configs" / "uot_rcl.py").exists():
                return folder
    raise FileNotFoundError("Run this notebook from inside the ncljax repository.")


def read_rows(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: train first, e.g. python train.py "
            f"--config=configs/uot_rcl.py:synthetic --workdir={workdir}"
        )
    with open(path) as f:
        return [json.loads(line) for line in f]


rows = read_rows(WORKDIR)
with open(WORKDIR / "config.json") as f:
    run_config = json.load(f)
print(
    "method:",
    run_config["method"],
    "| noise:",
    run_config["noise"]["kind"],
    run_config["noise"]["rate"],
)

# %% [markdown]
# ## 1. Label correction per epoch
#
# The validation rows carry the label diagnostics of the epoch's memory (the trainer
# scores ``label_estimate_fn`` against the true labels; they never reach the method).
# The refresh rows carry the partial OT's own numbers.

# %%
val = [r for r in rows if r.get("split") == "val" and "corrected_accuracy" in r]
refresh = {r["epoch"]: r for r in rows if r.get("split") == "refresh"}
epochs = [r["epoch"] for r in val]
corrected = [r["corrected_accuracy"] if r["selected_fraction"] > 0 else float("nan") for r in val]
observed = [r["observed_accuracy"] for r in val]
selected = [r["selected_fraction"] for r in val]
mass = [refresh[e]["mass"] if e in refresh else float("nan") for e in epochs]

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
ax1.plot(epochs, corrected, "o-", label="corrected labels (selected pairs)")
ax1.plot(epochs, observed, "--", label="observed noisy labels")
ax1.set_xlabel("epoch")
ax1.set_ylabel("accuracy against true labels")
ax1.set_ylim(0, 1)
ax1.legend(loc="lower left")
ax2.plot(epochs, selected, "o-", label="selected fraction (rho > 0.5)")
ax2.plot(epochs, mass, "x--", label="transported mass s")
ax2.set_xlabel("epoch")
ax2.set_ylim(0, 1)
ax2.legend(loc="upper left")
fig.suptitle(f"UOT-RCL label correction ({WORKDIR.name})")
fig.tight_layout()
fig.savefig(FIGURES / "label_correction.png", dpi=120)

header = ("epoch", "s", "selected", "corrected acc", "observed acc", "OT conv.")
print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 6, 9, 14, 13, 9), strict=True)))
for e, s, sel, c, o in zip(epochs, mass, selected, corrected, observed, strict=True):
    conv = refresh[e]["ot_converged"] if e in refresh else float("nan")
    print(f"{e:5d} {s:6.3f} {sel:9.3f} {c:14.3f} {o:13.3f} {conv:9.0f}")

# %% [markdown]
# ## 2. mAP against the noise rate: UOT-RCL and CE
#
# Both methods use the same data, backbone, optimiser and schedule
# (``configs/uot_rcl.py:synthetic`` and ``configs/ce.py:synthetic``) and report the test mAP
# of their best-on-validation checkpoint and of their last epoch (the MRL protocol logs
# both; the figure draws the first).

# %%
from ncljax import config as config_lib
from ncljax.train import train_and_evaluate

# run name -> config file of its method (both with the argument "synthetic[,SWEEP_ARG]")
CONFIG_FILES = {"uot_synthetic": "uot_rcl.py", "ce_synthetic": "ce.py"}


def load_config(name: str):
    path = find_root() / "configs" / CONFIG_FILES[name]
    return config_lib.load_file(str(path), ",".join(filter(None, ["synthetic", SWEEP_ARG])))


def sweep_result(name: str, rate: float) -> dict:
    workdir = SWEEP_DIR / f"{name}_{rate:g}"
    results = workdir / "results.json"
    if not results.exists():
        config = load_config(name)
        config.noise.rate = rate
        config.train.progress_bar = False
        train_and_evaluate(config, str(workdir))
    with open(results) as f:
        return json.load(f)


table = {
    (name, rate): sweep_result(name, rate)
    for name in ("uot_synthetic", "ce_synthetic")
    for rate in RATES
}

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
for ax, key, title in zip(
    axes, ("map_i2t", "map_t2i"), ("image -> text", "text -> image"), strict=True
):
    for name, label in (("uot_synthetic", "UOT-RCL"), ("ce_synthetic", "CE")):
        ax.plot(RATES, [table[name, r][key] for r in RATES], "o-", label=label)
    ax.set_xlabel("symmetric label noise rate")
    ax.set_title(title)
    ax.legend()
axes[0].set_ylabel("test mAP@all")
fig.tight_layout()
fig.savefig(FIGURES / "map_vs_noise.png", dpi=120)

for prefix, title in (("", "best-validation epoch"), ("last_", "last epoch")):
    if f"{prefix}map_i2t" not in table["ce_synthetic", RATES[0]]:
        continue
    print(f"test mAP, {title}")
    print(f"{'noise':>5} | {'UOT I->T':>8} {'UOT T->I':>8} | {'CE I->T':>8} {'CE T->I':>8}")
    for r in RATES:
        u, c = table["uot_synthetic", r], table["ce_synthetic", r]
        uot = f"{u[prefix + 'map_i2t']:8.3f} {u[prefix + 'map_t2i']:8.3f}"
        print(f"{r:5.1f} | {uot} | {c[prefix + 'map_i2t']:8.3f} {c[prefix + 'map_t2i']:8.3f}")
