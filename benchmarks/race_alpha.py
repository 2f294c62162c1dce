r"""What the division race keeps at each level of its paired test, from a report's runs.

  python -m ncljax.report --out=/tmp/races --worlds=digits,mnist5k,cancer --rates=0 \
      --seeds=0,1,2 --methods=infonce,gsc,ncr,pc2,srem,ugncl --jobs=2
  python benchmarks/race_alpha.py --out=/tmp/races --alphas=0.5,0.2,0.1,0.05,0.01

Every race of the report's sweep (``train.division='race'``, the ``:vectors`` settings)
trained both runs, or one where the division never switched on, and each run wrote its
best model's validation rSum shares (``ncljax.train.arms.SHARES``). The race's decision at
another ``train.race_alpha`` needs no training, and neither does the decision by the test
the other way round. For each world, rate and method this prints, under each of two rules
and each level, the mean test rSum over seeds of the run the rule keeps, its difference to
InfoNCE's, and how many seeds the undivided run won:

* the shipped rule (``arms.decide``): the undivided run is kept unless the divided run
  validates higher, ``arms.paired_p_value`` of its shares against the undivided run's
  under the level;
* the other way round: the division is kept unless the undivided run validates higher at
  that level.

At 0.5 both are the higher validation rSum. One JSON line per race comes first (both
runs' validation and test rSum, and both p-values).
"""

import argparse
import glob
import json
import math
import os
from collections import defaultdict

import numpy as np

from ncljax.train import arms


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def races(out: str) -> tuple[list[dict], dict]:
    """``(one dict per race, InfoNCE's test rSum by (world, rate, seed))`` under ``out``."""
    found, base = [], {}
    root = os.path.join(out, "runs", "pairs")
    for workdir in sorted(glob.glob(os.path.join(root, "*", "*", "rate*", "seed*"))):
        method, world, rate, seed = os.path.relpath(workdir, root).split(os.sep)
        key = (world, float(rate[4:]), int(seed[4:]))
        if not os.path.exists(os.path.join(workdir, "results.json")):
            continue
        results = _read(os.path.join(workdir, "results.json"))
        if method == "infonce":
            base[key] = results["rsum"]
            continue
        if arms.WON not in results:
            continue  # not a race
        divided = _read(os.path.join(workdir, arms.DIVIDED_RESULTS))
        race = {"method": method, "world": world, "rate": key[1], "seed": key[2]}
        race |= {"val_divided": divided["val_rsum"], "test_divided": divided["rsum"]}
        race["same"] = results[arms.SAME] == 1.0
        if race["same"]:  # one run: no test
            race |= {"val_undivided": divided["val_rsum"], "test_undivided": divided["rsum"]}
            race["p"] = race["p_divided"] = 1.0
        else:
            undivided_dir = os.path.join(workdir, arms.UNDIVIDED)
            undivided = _read(os.path.join(undivided_dir, "results.json"))
            shares = arms.read_shares(workdir), arms.read_shares(undivided_dir)
            if shares[0] is None or shares[1] is None:
                raise SystemExit(f"{workdir}: a run without {arms.SHARES} (trained before it)")
            race |= {"val_undivided": undivided["val_rsum"], "test_undivided": undivided["rsum"]}
            race["p"] = arms.paired_p_value(shares[1], shares[0])
            race["p_divided"] = arms.paired_p_value(shares[0], shares[1])
        found.append(race)
    return found, base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="a report's --out")
    parser.add_argument("--alphas", default="0.5,0.2,0.1,0.05,0.01")
    args = parser.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    found, base = races(args.out)
    cells = defaultdict(list)
    for race in found:
        print(json.dumps(race))
        cells[(race["world"], race["rate"], race["method"])].append(race)
    rules = {
        "the undivided run kept unless the divided run validates higher at level alpha (shipped)": (
            lambda r, a: not r["p_divided"] < a
        ),
        "the division kept unless the undivided run validates higher at level alpha": (
            lambda r, a: r["p"] < a
        ),
    }
    for name, undivided_wins in rules.items():
        head = "| world | rate | method | InfoNCE | " + " | ".join(f"alpha {a:g}" for a in alphas)
        print(f"\n{name}:\n\n{head} |\n|" + "---|" * (4 + len(alphas)))
        for (world, rate, method), cell in sorted(cells.items()):
            keys = [(world, rate, r["seed"]) for r in cell]
            infonce = [base[k] for k in keys if k in base]
            ref = float(np.mean(infonce)) if len(infonce) == len(keys) else math.nan
            row = f"| {world} | {rate:g} | {method} | {ref:.1f} |"
            for a in alphas:
                won = [undivided_wins(r, a) and not r["same"] for r in cell]
                test = [
                    r["test_" + ("undivided" if w else "divided")]
                    for r, w in zip(cell, won, strict=True)
                ]
                mean = float(np.mean(test))
                row += f" {mean:.1f} ({mean - ref:+.1f}) [{sum(won)}/{len(cell)}] |"
            print(row)


if __name__ == "__main__":
    main()
