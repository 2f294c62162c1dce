r"""UOT-RCL's cost, literal (Eq. 8) against vote-normalised: transported-label accuracy.

  python benchmarks/uot_vote_normalise.py --rates=0.4 --workdir=runs/vote_normalise
  python benchmarks/uot_vote_normalise.py --rates=0.2,0.4,0.6 --epochs=20

Trains ``configs/uot_rcl.py:synthetic`` (symmetric label noise, 4 warm-up epochs, then the
partial OT transports ``s`` from 0.2 up to 0.8) twice per noise rate: with
``vote_normalise=True`` (the default: each sample's blended neighbour vote ``b_i`` is
divided by its sum before ``-log``) and ``False`` (the paper's literal cost
``-log b_ik``). Prints, per epoch after the warm-up, the mass ``s``, the share of pairs
the plan selects (row mass above 1/2) and the accuracy of the labels it transports to
them against the true labels (``corrected_accuracy``; the observed labels' accuracy is
``1 - rate``), then the test mAP of each run. This is the table the default of
``uot_rcl(vote_normalise=...)`` rests on: the literal cost lowers whole rows by ``log`` of
the vote's magnitude (consistency ratios times neighbour similarities), so at small ``s``
it selects the samples with the densest neighbourhoods rather than the clearest labels.

A run whose ``results.json`` exists in ``--workdir`` is read, not retrained.
"""

import argparse
import json
import os

from ncljax import config as config_lib
from ncljax.train import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config():
    return config_lib.load_file(os.path.join(ROOT, "configs", "uot_rcl.py"), "synthetic")


def run(workdir: str, rate: float, normalise: bool, epochs: int | None):
    if not os.path.exists(os.path.join(workdir, "results.json")):
        config = load_config()
        config.noise.rate = rate
        config.method_kwargs.vote_normalise = normalise
        config.train.progress_bar = False
        if epochs:
            config.train.epochs = epochs
        train_and_evaluate(config, workdir)
    with open(os.path.join(workdir, "results.json")) as f:
        results = json.load(f)
    per_epoch = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row["split"] == "refresh" and "mass" in row:
                per_epoch.setdefault(row["epoch"], {})["mass"] = row["mass"]
            if row["split"] == "val" and "corrected_accuracy" in row:
                per_epoch.setdefault(row["epoch"], {}).update(
                    accuracy=float("nan")
                    if row["corrected_accuracy"] is None
                    else row["corrected_accuracy"],
                    selected=row["selected_fraction"],
                )
    return results, per_epoch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="0.4")
    parser.add_argument("--epochs", type=int, default=0, help="0: the config's 20")
    parser.add_argument("--workdir", default="runs/vote_normalise")
    args = parser.parse_args()
    for rate in (float(r) for r in args.rates.split(",")):
        runs = {
            name: run(
                os.path.join(args.workdir, f"{name}_{rate}"),
                rate,
                name == "normalised",
                args.epochs,
            )
            for name in ("normalised", "literal")
        }
        print(f"\nnoise {rate} (observed labels {1 - rate:.0%} correct)\n")
        print("| epoch | s | selected (normalised / literal) | accuracy (normalised / literal) |")
        print("|---|---|---|---|")
        epochs = sorted(e for e, v in runs["normalised"][1].items() if "mass" in v)
        nan = {"selected": float("nan"), "accuracy": float("nan")}
        for e in epochs:
            n, lit = runs["normalised"][1][e], runs["literal"][1].get(e, nan)
            print(
                f"| {e} | {n['mass']:.2f} | {n['selected']:.3f} / {lit['selected']:.3f} | "
                f"{n['accuracy']:.3f} / {lit['accuracy']:.3f} |"
            )
        for name, (results, _) in runs.items():
            print(
                f"\n{name}: test mAP i2t {results['map_i2t']:.3f}, t2i {results['map_t2i']:.3f} "
                f"(best epoch {results['best_epoch']})"
            )


if __name__ == "__main__":
    main()
