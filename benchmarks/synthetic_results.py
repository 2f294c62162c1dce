r"""Test rSum of the noisy-correspondence methods and baselines on the embedded synthetic data.

  python benchmarks/synthetic_results.py --rates=0.4,0.6 --workdir=runs/synthetic_results
  python benchmarks/synthetic_results.py --runs=ncr,vse --rates=0.4

Trains each run at each per-caption noise rate with its shipped synthetic config (only
``noise.rate`` changed) and prints a markdown table of the test metrics of the
best-on-validation epoch, the noise-detection quality of the final clean estimates and
the wall time. The runs (all: region encoder + Bi-GRU + cosine head, Adam 1e-3, batch
128, 12 epochs, 20,000 training pairs):

* ``ncr``: ``configs/ncr.py:synthetic`` (2 warm-up + 10 co-training epochs);
* ``gsc``: ``configs/quickstart.py`` (single-network GSC);
* ``srem``: ``configs/srem.py:synthetic`` (2 warm-up + 10 main epochs);
* ``ugncl``: ``configs/ugncl.py:synthetic`` (two image views, 2 warm-up + 10 epochs);
* ``pc2``: ``configs/pc2.py:synthetic`` (2 warm-up + 10 co-training epochs, pseudo-captions
  from co-training epoch 5);
* ``vse``: ``configs/vse.py:synthetic`` (VSE++, hardest negatives);
* ``infonce``: the same config with the symmetric InfoNCE loss (temperature 0.07).

A run whose ``results.json`` exists in ``--workdir`` is read, not retrained.
"""

import argparse
import json
import os
import time

from ncljax import config as config_lib
from ncljax import methods
from ncljax.train import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = methods.of_family("pairs")  # every correspondence method of the registry


def load_config(name, arg=""):
    return config_lib.load_file(os.path.join(ROOT, "configs", name + ".py"), arg)


def make_config(run: str):
    if run == "ncr":
        return load_config("ncr", "synthetic")
    if run == "gsc":
        return load_config("quickstart")
    return load_config(run, "synthetic")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--rates", default="0.4,0.6")
    parser.add_argument("--workdir", default="runs/synthetic_results")
    args = parser.parse_args()
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for run in args.runs.split(","):
            workdir = os.path.join(args.workdir, f"{run}_{rate}")
            path = os.path.join(workdir, "results.json")
            wall = "read"
            if not os.path.exists(path):
                config = make_config(run)
                config.noise.rate = rate
                config.train.progress_bar = False
                tic = time.perf_counter()
                train_and_evaluate(config, workdir)
                wall = f"{time.perf_counter() - tic:.0f} s"
            with open(path) as f:
                results = json.load(f)
            rows.append((run, rate, results, wall))
    print("| run | noise | test rSum | i2t R@1 | t2i R@1 | best epoch | noise AUC | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for run, rate, r, wall in rows:
        auc = f"{r['noise_auc']:.3f}" if r.get("noise_auc") is not None else "-"
        print(
            f"| {run} | {rate} | {r['rsum']:.1f} | {r['i2t_r1']:.1f} | {r['t2i_r1']:.1f} | "
            f"{r['best_epoch']} | {auc} | {wall} |"
        )


if __name__ == "__main__":
    main()
