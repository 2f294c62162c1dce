r"""UOT-RCL's neighbour search at large N: the block search against the exact one.

  python benchmarks/knn_blocks.py --pairs=100000 --exact      # both, and the recall
  python benchmarks/knn_blocks.py --pairs=1000000 --probes=16,32
  python benchmarks/knn_blocks.py --pairs=1000000 --fanout=0,64   # one k-means, the tree

Embeddings: ``--pairs`` rows of ``--dim`` floats drawn around ``--classes`` random centres
(``centre + --spread * noise``), as a trained model's class-structured embeddings are.
For each ``--probes`` value, ``ncljax.labels.knn_cosine_blocks`` (``--block`` rows per
block, ``--neighbours`` neighbours, self excluded) is compiled and timed (the second of
two calls) with the process's peak resident memory after the searches (the data and the
search; the recall's own numpy pass comes after); its recall is the share of the exact
neighbours it finds, over ``--queries`` random rows whose exact neighbours numpy finds by
brute force (in chunks). ``--exact`` also times ``ncljax.labels.knn_cosine`` (query
chunks of 2,048 against key chunks of 8,192: bounded memory) on all rows. One JSON line
per search. For each ``--fanout`` value (0: one k-means of every block's centroid) the
block order alone is timed too (``order_seconds``) and the k-means tree's shape is
reported (``tree``: each level's centroids, or ``flat``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import numpy as np

from ncljax.labels import correction


def embeddings(pairs: int, dim: int, classes: int, spread: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim))
    out = np.empty((pairs, dim), np.float32)
    for start in range(0, pairs, 1 << 16):
        stop = min(start + (1 << 16), pairs)
        label = rng.integers(0, classes, stop - start)
        noise = rng.standard_normal((stop - start, dim))
        out[start:stop] = centres[label] + spread * noise
    return out


def exact_neighbours(z: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    unit = z / np.linalg.norm(z, axis=1, keepdims=True)
    found = []
    for start in range(0, rows.size, 100):
        some = rows[start : start + 100]
        sim = unit[some] @ unit.T
        sim[np.arange(some.size), some] = -np.inf
        found.append(np.argpartition(-sim, k, axis=1)[:, :k])
    return np.concatenate(found)


def timed(fn, z) -> tuple[float, np.ndarray]:
    jax.block_until_ready(fn(z))  # compiles
    start = time.perf_counter()
    index, _ = jax.block_until_ready(fn(z))
    return time.perf_counter() - start, np.asarray(index)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--spread", type=float, default=0.7)
    parser.add_argument("--neighbours", type=int, default=10)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--probes", default="16")
    parser.add_argument(
        "--fanout", default="64", help="comma-separated; 0: one k-means of every block"
    )
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    z = embeddings(args.pairs, args.dim, args.classes, args.spread, args.seed)
    rows = np.random.default_rng(args.seed + 1).choice(args.pairs, args.queries, replace=False)
    z_device = jax.numpy.asarray(z)
    common = {"pairs": args.pairs, "dim": args.dim, "neighbours": args.neighbours}
    results = []
    num_blocks = -(-args.pairs // args.block)
    for fanout in (int(f) or num_blocks + 1 for f in args.fanout.split(",")):
        fanout = max(fanout, 2)
        order = jax.jit(
            lambda x, fanout=fanout: correction._block_order(
                correction.embeddings(x), num_blocks, jax.random.key(args.seed), 32, 10, fanout
            )
        )
        order_seconds, _ = timed(lambda x, order=order: (order(x), None), z_device)
        shape = correction.tree_fans(num_blocks, fanout)
        for probes in (int(p) for p in args.probes.split(",")):
            search = jax.jit(
                lambda x, probes=probes, fanout=fanout: correction.knn_cosine_blocks(
                    x,
                    k=args.neighbours,
                    key=jax.random.key(args.seed),
                    block=args.block,
                    probes=probes,
                    fanout=fanout,
                )
            )
            seconds, index = timed(search, z_device)
            row = {"search": "blocks", **common, "block": args.block, "probes": probes}
            row |= {"tree": shape or "flat", "order_seconds": round(order_seconds, 2)}
            results.append((row | {"seconds": round(seconds, 2)}, index[rows]))
    if args.exact:
        search = jax.jit(
            lambda x: correction.knn_cosine(x, k=args.neighbours, chunk=2048, key_chunk=8192)
        )
        seconds, index = timed(search, z_device)
        results.append(({"search": "exact", **common, "seconds": round(seconds, 2)}, index[rows]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    truth = exact_neighbours(z, rows, args.neighbours)
    for row, found in results:
        hits = np.mean([len(set(a) & set(b)) for a, b in zip(truth, found, strict=True)])
        row |= {"recall": round(float(hits) / args.neighbours, 4), "peak_rss_gib": round(peak, 2)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
