r"""A web-scale vectors folder trained, divided and audited on one machine.

  python benchmarks/ten_million.py --pairs=10000000 --dir=/data/bench      # 10^7 pairs
  python benchmarks/ten_million.py --pairs=100000 --dir=/tmp/bench        # a quick check
  python benchmarks/ten_million.py --pairs=1000000 --method=ncr \
      --override=method_kwargs.warmup_epochs=1                            # NCR: one co-divide
  python benchmarks/ten_million.py --pairs=1000000 --method=uot_rcl --classes=10 \
      --override=method_kwargs.warmup_epochs=1 --override=method_kwargs.knn=blocks \
      --override=method_kwargs.embeddings=disk                            # UOT-RCL

Writes ``--dir/pairs_<N>x<dim>/`` (``ncljax.data.vectors``'s layout, float16; ``_captions``
at the end of the name with ``--captions``): image vectors
``x ~ N(0, I)`` and caption vectors ``t = x W + 0.5 e`` (a fixed random ``W``, fresh noise
``e``), with ``--mismatched`` of the training captions moved to another image beforehand
(to another image of the same 65,536-row chunk; their indices saved beside the folder
as ``<folder>_mismatched.npy``), val and test of
``--eval_images`` clean pairs (each split with its image ids, and with ``--captions`` a
60-character caption per pair, which the audit exports). With ``--classes=C`` each image
also gets a class (the largest of its first ``C`` coordinates), ``--label_noise`` of the
training labels replaced by another class (their indices in ``<folder>_flipped.npy``),
for the label methods.
Writing streams in chunks: memory stays bounded.

Then runs, each in its own process under ``/usr/bin/time`` (wall time and peak resident
memory, the mapped folder's pages included; and the peak of the process's own anonymous
memory, sampled from ``/proc``), the user's path with a small model (``--hidden``,
``--embed_dim``) at ``--batch``:

* ``train``: ``python -m ncljax.train --config=<method>:vectors`` for ``--epochs`` epochs,
  one run (``train.division=on``: not the settings' race of a division against none)
  (2: GSC refreshes its labels from the epoch's buffers before every epoch but the first,
  so the second epoch trains on one division), with each refresh's own wall time (the
  trainer's ``refresh_seconds``: the statistics pass and the division, compilation
  included);
* ``audit``: ``python -m ncljax.audit`` over every training pair, and the AUC of its
  ``clean_score`` against ``mismatched.npy`` (and against ``flipped.npy``, where written).

Prints one JSON line per phase. The folder is reused by later runs of the same size;
``--cleanup`` deletes it (and the run) at the end.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

CHUNK = 1 << 16  # rows written at a time; a moved caption stays within its chunk


def _write_matrix(path: str, rows: int, dim: int, block_fn, chunk: int = CHUNK) -> None:
    """A float16 ``[rows, dim]`` .npy written chunk by chunk: ``block_fn(start, stop)``."""
    with open(path + ".tmp", "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f2", "fortran_order": False, "shape": (rows, dim)}
        )
        for start in range(0, rows, chunk):
            f.write(block_fn(start, min(start + chunk, rows)).astype(np.float16).tobytes())
    os.replace(path + ".tmp", path)


def _lines(path: str, lines) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def write(folder: str, args) -> float:
    """Writes the folder (unless a complete one is there); returns the seconds spent."""
    from ncljax.data import vectors

    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return 0.0
    tic = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    dim = args.dim
    w = np.random.default_rng(1).standard_normal((dim, dim), np.float32) / np.sqrt(dim)
    sizes = {"train": args.pairs, "val": args.eval_images, "test": args.eval_images}
    for s, (split, n) in enumerate(sizes.items()):
        seed = 10 * s

        def image_block(start, stop, seed=seed):
            rng = np.random.default_rng((seed, start))
            return rng.standard_normal((stop - start, dim), np.float32)

        chunk = CHUNK
        partner = np.arange(n)
        if split == "train":
            rng = np.random.default_rng(2)
            moved = np.flatnonzero(rng.random(n) < args.mismatched)
            # Each moved caption describes another image of its chunk of 65,536: the moved
            # captions of a chunk are rotated among themselves (no caption keeps its image).
            for first in range(0, n, chunk):
                here = moved[(moved >= first) & (moved < first + chunk)]
                if here.size > 1:
                    partner[here] = np.roll(here, 1 + int(rng.integers(here.size - 1)))
            moved = np.flatnonzero(partner != np.arange(n))
            np.save(folder + "_mismatched.npy", moved)

        def text_block(start, stop, seed=seed, partner=partner, n=n):
            # Chunks of texts and images coincide: the partners are in the image chunk.
            x = image_block(start, stop)[partner[start:stop] - start]
            noise = np.random.default_rng((seed + 1, start)).standard_normal(x.shape, np.float32)
            return x @ w + 0.5 * noise

        if args.classes:  # each image's class: the largest of its first C coordinates
            labels = np.concatenate(
                [
                    np.argmax(image_block(a, min(a + chunk, n))[:, : args.classes], axis=1)
                    for a in range(0, n, chunk)
                ]
            ).astype(np.int32)
            if split == "train":  # observed labels: a share replaced by a random class
                rng = np.random.default_rng(3)
                flip = np.flatnonzero(rng.random(n) < args.label_noise)
                labels[flip] = (labels[flip] + rng.integers(1, args.classes, flip.size)) % (
                    args.classes
                )
                np.save(folder + "_flipped.npy", flip)
            np.save(vectors.path_of(folder, split, "labels"), labels)
        _write_matrix(vectors.path_of(folder, split, "images"), n, dim, image_block)
        _write_matrix(vectors.path_of(folder, split, "texts"), n, dim, text_block)
        _lines(vectors.path_of(folder, split, "image_ids"), (f"{i}.jpg" for i in range(n)))
        if args.captions:  # a caption per pair of a crawl's alt-text length (60 characters)
            _lines(
                vectors.path_of(folder, split, "captions"),
                (f"{split} caption {k:09d}, about as long as a crawled alt text" for k in range(n)),
            )
    open(done, "w").close()
    return time.perf_counter() - tic


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _rss_anon_kib(pid: int) -> int:
    """The process's resident anonymous memory (its own, not the mapped folder's pages)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def timed(command: list[str], log: str) -> dict:
    """Runs ``command`` under ``/usr/bin/time -v``: wall seconds, peak resident MiB (with
    the mapped folder's pages) and peak anonymous MiB (the process's own memory, sampled
    every 0.2 s from ``/proc``)."""
    peak_anon = 0
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["/usr/bin/time", "-v", *command], stdout=f, stderr=subprocess.STDOUT
        )
        while proc.poll() is None:
            for child in _children(proc.pid):
                peak_anon = max(peak_anon, _rss_anon_kib(child))
            time.sleep(0.2)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, command)
    with open(log) as f:
        text = f.read()
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)
    seconds = sum(float(p) * 60**i for i, p in enumerate(reversed(wall.split(":"))))
    return {"seconds": seconds, "peak_mib": peak / 1024, "peak_anon_mib": peak_anon / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--pairs", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--mismatched", type=float, default=0.2)
    parser.add_argument("--eval_images", type=int, default=1000)
    parser.add_argument("--method", default="gsc")
    # GSC refreshes its labels before every epoch but the first: two epochs hold one division.
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--embed_dim", type=int, default=32)
    parser.add_argument(
        "--classes",
        type=int,
        default=0,
        help="write class labels (the largest of each image's first C coordinates) for the "
        "label methods (UOT-RCL), with --label_noise of the training labels wrong",
    )
    parser.add_argument("--label_noise", type=float, default=0.2)
    parser.add_argument(
        "--captions",
        action="store_true",
        help="write {split}_captions.txt too (60 characters a line), which the audit exports",
    )
    parser.add_argument("--cleanup", action="store_true")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="a config field for the training run, e.g. method_kwargs.warmup_epochs=1",
    )
    args = parser.parse_args()
    classes = f"_c{args.classes}" if args.classes else ""
    texts = "_captions" if args.captions else ""
    folder = os.path.join(args.dir, f"pairs_{args.pairs}x{args.dim}{classes}{texts}")
    seconds = write(folder, args)
    print(
        json.dumps(
            {
                "phase": "write",
                "folder": folder,
                "pairs": args.pairs,
                "dim": args.dim,
                "seconds": seconds,
                "reused": seconds == 0.0,
            }
        ),
        flush=True,
    )
    run = os.path.join(args.dir, f"run_{args.method}_{args.pairs}")
    shutil.rmtree(run, ignore_errors=True)
    train = [
        sys.executable,
        "-m",
        "ncljax.train",
        f"--config={args.method}:vectors",
        f"--config.data.folder={folder}",
        f"--workdir={run}",
        f"--config.train.epochs={args.epochs}",
        f"--config.train.batch_size={args.batch}",
        f"--config.model.cosine.image_hidden=({args.hidden},)",
        f"--config.model.text_mlp.hidden=({args.hidden},)",
        f"--config.model.embed_dim={args.embed_dim}",
        "--config.train.progress_bar=False",
        # one run: the :vectors settings race a division against none (two runs), and the
        # curve is of one (--override=train.division=race measures the race)
        "--config.train.division=on",
        *(f"--config.{field}" for field in args.override),
    ]
    try:
        out = timed(train, run + "_train.log")
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        rates = [r["pairs_per_s"] for r in rows if r.get("pairs_per_s")]
        # each refresh: its statistics pass and the networks' divisions, compilation included
        refreshes = [r["refresh_seconds"] for r in rows if "refresh_seconds" in r]
        print(
            json.dumps(
                {
                    "phase": "train",
                    **out,
                    "epochs": args.epochs,
                    "batch": args.batch,
                    "pairs_per_s_median": float(np.median(rates)) if rates else None,
                    "refresh_seconds": refreshes,
                }
            ),
            flush=True,
        )
        out = timed([sys.executable, "-m", "ncljax.audit", f"--workdir={run}"], run + "_audit.log")
        from ncljax.evaluate import detection

        score = np.zeros(args.pairs)
        with open(os.path.join(run, "audit", "pairs.jsonl")) as f:
            for line in f:
                row = json.loads(line)
                score[row["index"]] = row["clean_score"]
        # against the moved captions; with labels, also against the wrong labels
        aucs = {}
        for name, wrong in (("audit_auc", "_mismatched.npy"), ("audit_auc_labels", "_flipped.npy")):
            if os.path.exists(folder + wrong):
                clean = np.ones(args.pairs, bool)
                clean[np.load(folder + wrong)] = False
                aucs[name] = detection.noise_detection_metrics(score, clean)["noise_auc"]
        print(json.dumps({"phase": "audit", **out, **aucs}), flush=True)
    finally:
        if args.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
