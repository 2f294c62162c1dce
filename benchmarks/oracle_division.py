r"""What a perfect division could reach on a world: InfoNCE trained on the matched pairs only.

  python benchmarks/oracle_division.py --out=/tmp/oracle \
      --worlds=vec_default,vec_weak_classes,vec_few_regions --rates=0.4 --seeds=0,1,2

For each world, noise rate and seed, the report's folder cell (``python -m ncljax.report``
writes the same one: ``ncljax.data.real_worlds.write_cell``) and two runs of the user's
path, ``configs/infonce.py:vectors`` at the run's seed:

* ``noisy``: on the cell's folder, every training pair (the report's InfoNCE row);
* ``oracle``: on a copy of the folder whose training split keeps only its matched pairs
  (the mismatched rows, image and caption, dropped; validation and test unchanged): what
  a method that divided the pairs perfectly, and then trained InfoNCE on the clean side,
  would reach;
* with ``--division_aucs=0.6,0.7,...``, ``auc<a>``: the same with an imperfect division
  of AUC ``a`` in place of the perfect one: each training pair scores ``d [matched] + e``
  with ``e ~ N(0, 1)`` and ``d = sqrt(2) Phi^-1(a)`` (two unit normals ``d`` apart are
  told apart at AUC ``a``), and the ``N - floor(rate N)`` best-scoring pairs are kept, as
  many as the perfect division keeps. What a division as good as a method's verdict buys
  (``division_auc_<a>`` is the realised AUC of the draw; no held-out AUCs for these).

Then both models score the test split with ``rate`` of its captions moved to another
image (``vectors.mismatch_texts`` at the run's seed): pairs neither model trained on, so
the AUCs say how well a model of this world tells a matched pair from a mismatched one,
without the memory of its training pairs (on its own training pairs the oracle reads
1.000: it fitted the matched ones and never saw the others). ``auc_cosine`` ranks by the
pair's cosine, ``auc_rank`` by the mean of the caption's percentile among the split's
images and the image's among the split's captions (as the audit's held-out ``pair_auc``
reads a pair). A verdict on training pairs read 0.00-0.13 below its run's held-out
figure on the synthetic worlds (README, the audit), so the oracle's is a ceiling on
what a verdict could read where the vectors are what limits it.

Prints one JSON line per cell and a table: the test rSum of both runs, the gap (the most
any method could gain over InfoNCE by dividing), and the oracle verdict's AUCs.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ncljax import report  # noqa: E402
from ncljax.data import real_worlds, vectors  # noqa: E402
from ncljax.evaluate import detection  # noqa: E402


def _train(args: list[str], workdir: str, log: str) -> None:
    if os.path.exists(os.path.join(workdir, "results.json")):
        return
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args, f"--workdir={workdir}"]
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}); see {log}.")


def _rsum(workdir: str) -> float:
    with open(os.path.join(workdir, "results.json")) as f:
        return float(json.load(f)["rsum"])


def _kept(matched: np.ndarray, auc: float | None, seed: int) -> tuple[np.ndarray, float]:
    """The pairs a division of AUC ``auc`` keeps (``None``: the perfect one), and the
    draw's realised AUC."""
    if auc is None:
        return matched, 1.0
    from scipy import stats

    rng = np.random.default_rng([seed, round(auc * 1000)])
    score = np.sqrt(2.0) * stats.norm.ppf(auc) * matched + rng.standard_normal(matched.size)
    keep = np.zeros(matched.size, bool)
    keep[np.argsort(-score, kind="stable")[: int(matched.sum())]] = True
    realised = detection.noise_detection_metrics(score, matched)["noise_auc"]
    return keep, float(realised)


def _oracle_folder(
    cell_dir: str, world: str, rate: float, seed: int, auc: float | None = None
) -> tuple[str, float]:
    folder = os.path.join(cell_dir, "oracle_folder" if auc is None else f"auc{auc:g}_folder")
    splits, mismatched = real_worlds.lying_splits(world, rate=rate, seed=seed)
    keep, realised = _kept(~mismatched["train"], auc, seed)
    if not os.path.exists(os.path.join(folder, "test_texts.npy")):
        train = dict(splits["train"])
        for key, value in train.items():
            if value is not None and len(value) == keep.size:
                train[key] = (
                    [v for v, k in zip(value, keep, strict=True) if k]
                    if isinstance(value, list)
                    else np.asarray(value)[keep]
                )
        vectors.write_folder(folder, {**splits, "train": train}, dtype=np.float32)
    return folder, realised


def _percentile_scores(image_emb: np.ndarray, text_emb: np.ndarray) -> np.ndarray:
    """Pair k's mean percentile: its image among the images for caption k, and its caption
    among the captions for image k (1: above every other, ties count 1/2)."""
    sim = image_emb @ text_emb.T
    own = np.diag(sim)
    n = own.size
    below_t2i = ((sim < own[None, :]).sum(0) + 0.5 * ((sim == own[None, :]).sum(0) - 1)) / (n - 1)
    below_i2t = ((sim < own[:, None]).sum(1) + 0.5 * ((sim == own[:, None]).sum(1) - 1)) / (n - 1)
    return 0.5 * (below_t2i + below_i2t)


def _held_out_aucs(workdir: str, rate: float, seed: int) -> dict:
    from ncljax import retrieve

    image_emb, text_emb = retrieve.embeddings(retrieve.load(workdir, split="test"))
    source, mismatched = vectors.mismatch_texts(text_emb.shape[0], 1, rate=rate, seed=seed)
    text_emb, clean = text_emb[source], ~mismatched
    scores = {
        "cosine": (image_emb * text_emb).sum(1),
        "rank": _percentile_scores(image_emb, text_emb),
    }
    return {
        f"auc_{name}": float(detection.noise_detection_metrics(score, clean)["noise_auc"])
        for name, score in scores.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--worlds", default="vec_default,vec_weak_classes,vec_few_regions")
    p.add_argument("--rates", default="0.4")
    p.add_argument("--seeds", default="0")
    p.add_argument("--division_aucs", default="", help="imperfect divisions, e.g. 0.6,0.7")
    p.add_argument("--no_perfect", action="store_true", help="skip the perfect division")
    a = p.parse_args()
    aucs = [float(x) for x in a.division_aucs.split(",") if x]
    rows = []
    for world in a.worlds.split(","):
        for rate in map(float, a.rates.split(",")):
            for seed in map(int, a.seeds.split(",")):
                run = report.Run("pairs", "infonce", world, rate, seed)
                cell_dir = run.cell(a.out)
                info = real_worlds.write_cell(cell_dir, world, rate=rate, seed=seed)
                result = dict(world=world, rate=rate, seed=seed)
                folders = [("noisy", info["folder"])]
                if not a.no_perfect:
                    folders.append(("oracle", _oracle_folder(cell_dir, world, rate, seed)[0]))
                for auc in aucs:
                    folder, realised = _oracle_folder(cell_dir, world, rate, seed, auc)
                    folders.append((f"auc{auc:g}", folder))
                    result[f"division_auc_{auc:g}"] = realised
                for name, folder in folders:
                    workdir = os.path.join(cell_dir, f"run_{name}")
                    os.makedirs(workdir, exist_ok=True)
                    log = os.path.join(cell_dir, f"{name}.log")
                    _train(report.train_args(run, folder=os.path.abspath(folder)), workdir, log)
                    result[f"rsum_{name}"] = _rsum(workdir)
                    if name in ("noisy", "oracle"):
                        held = _held_out_aucs(workdir, max(rate, 0.2), seed)
                        result.update({f"{k}_{name}": v for k, v in held.items()})
                if "rsum_oracle" in result:
                    result["gap"] = result["rsum_oracle"] - result["rsum_noisy"]
                print(json.dumps(result), flush=True)
                rows.append(result)
    if aucs:
        heads = " | ".join(f"AUC {x:g}" for x in aucs)
        print(f"\n| world | rate | seed | InfoNCE | {heads} |")
        print("|---|---:|---:|---:|" + "---:|" * len(aucs))
        for r in rows:
            cells = " | ".join(
                f"{r[f'rsum_auc{x:g}']:.1f} ({r[f'rsum_auc{x:g}'] - r['rsum_noisy']:+.1f}; "
                f"{r[f'division_auc_{x:g}']:.3f})"
                for x in aucs
            )
            head = f"| `{r['world']}` | {r['rate']:.0%} | {r['seed']} | {r['rsum_noisy']:.1f}"
            print(f"{head} | {cells} |")
    if a.no_perfect:
        return
    print(
        "\n| world | rate | seed | InfoNCE | oracle | gap | held-out AUC, InfoNCE "
        "(cosine / rank) | held-out AUC, oracle (cosine / rank) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(
            f"| `{r['world']}` | {r['rate']:.0%} | {r['seed']} | {r['rsum_noisy']:.1f} | "
            f"{r['rsum_oracle']:.1f} | {r['gap']:+.1f} | {r['auc_cosine_noisy']:.3f} / "
            f"{r['auc_rank_noisy']:.3f} | {r['auc_cosine_oracle']:.3f} / "
            f"{r['auc_rank_oracle']:.3f} |"
        )


if __name__ == "__main__":
    main()
