r"""UOT-RCL's relation plan (Eqs. 16-18) on the costs of a training run: plain Sinkhorn
against ott's Anderson acceleration.

  # 1. train with every 49th batch's relation cost saved (any train flags after --)
  python benchmarks/relation_plan.py --capture=/tmp/costs --every=49 -- \
      --config=uot_rcl:vectors --config.data.folder=DIR --workdir=/tmp/run \
      --config.train.batch_size=1024 --config.method_kwargs.warmup_epochs=1
  # 2. solve the saved costs with each setting
  python benchmarks/relation_plan.py --costs=/tmp/costs --anderson=0,3,5 --epsilon=0.1,0.05

Capture: the training program runs in this process with ``ncljax.labels.relation_plan``
wrapped so that, on every ``--every``-th call, the JSD cost it receives (``[B, B]``) and
its real rows are written to ``--capture`` (``cost_NNNNN.npz``, with the iterations the
run's own solver took); the run is otherwise the user's.

Solve: for each saved cost (``--files`` of them, evenly spaced over the run) and each
``--epsilon``, ``relation_plan`` is compiled for each ``--anderson`` memory (0: plain
Sinkhorn) and timed (the mean of three calls after the compiling one). One JSON line per
cost, epsilon and memory: the iterations, whether it converged, milliseconds, and the L1
distance of its plan to the first ``--anderson`` setting's (``l1_to_first``; plain Sinkhorn
when 0 is listed first, as by default) and to a float64 plain solve at threshold 1e-9
(``l1_to_reference``). Then one summary line per epsilon and memory.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import runpy
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ncljax.labels import ot


def capture(out: str, every: int, train_args: list[str]) -> None:
    os.makedirs(out, exist_ok=True)
    calls = [0]

    def save(cost, where, n_iters):
        call = calls[0]
        calls[0] += 1
        if call % every == 0:
            np.savez(
                os.path.join(out, f"cost_{call:05d}.npz"),
                cost=np.asarray(cost),
                where=np.asarray(where),
                n_iters=np.asarray(n_iters),
            )

    original = ot.relation_plan

    def recorded(cost, *, where=None, **kwargs):
        plan = original(cost, where=where, **kwargs)
        real = jnp.ones(jnp.shape(cost)[:1], bool) if where is None else where
        jax.debug.callback(save, cost, real, plan.n_iters)
        return plan

    ot.relation_plan = recorded  # the method calls it through the module
    sys.argv = ["ncljax.train", *train_args]
    runpy.run_module("ncljax.train", run_name="__main__")


def solve(costs: str, files: int, epsilons: list[float], memories: list[int]) -> None:
    paths = sorted(glob.glob(os.path.join(costs, "cost_*.npz")))
    if not paths:
        raise SystemExit(f"no cost_*.npz in {costs}: run --capture first")
    paths = [paths[i] for i in np.unique(np.linspace(0, len(paths) - 1, files).astype(int))]
    plan = jax.jit(ot.relation_plan, static_argnames=("threshold", "max_iterations", "anderson"))
    summary = {}
    for path in paths:
        saved = np.load(path)
        cost, where = jnp.asarray(saved["cost"]), jnp.asarray(saved["where"])
        for epsilon in epsilons:
            with jax.enable_x64(True):
                reference = plan(
                    jnp.asarray(saved["cost"], jnp.float64),
                    where=where,
                    epsilon=epsilon,
                    threshold=1e-9,
                    max_iterations=20_000,
                    anderson=0,
                ).plan
                reference = np.asarray(reference)
            plain = None
            for memory in memories:
                out = plan(cost, where=where, epsilon=epsilon, anderson=memory)
                jax.block_until_ready(out)
                start = time.perf_counter()
                for _ in range(3):
                    out = plan(cost, where=where, epsilon=epsilon, anderson=memory)
                    jax.block_until_ready(out)
                ms = (time.perf_counter() - start) / 3 * 1e3
                got = np.asarray(out.plan, np.float64)
                plain = got if plain is None else plain
                row = {
                    "cost": os.path.basename(path),
                    "run_iterations": int(saved["n_iters"]),
                    "epsilon": epsilon,
                    "anderson": memory,
                    "iterations": int(out.n_iters),
                    "converged": bool(out.converged),
                    "ms": round(ms, 1),
                    "l1_to_first": float(np.abs(got - plain).sum()),
                    "l1_to_reference": float(np.abs(got - reference).sum()),
                }
                print(json.dumps(row), flush=True)
                summary.setdefault((epsilon, memory), []).append(row)
    for (epsilon, memory), rows in summary.items():
        iterations = [r["iterations"] for r in rows]
        print(
            json.dumps(
                {
                    "summary": True,
                    "epsilon": epsilon,
                    "anderson": memory,
                    "costs": len(rows),
                    "iterations_mean": round(float(np.mean(iterations)), 1),
                    "iterations_max": max(iterations),
                    "unconverged": sum(not r["converged"] for r in rows),
                    "ms_mean": round(float(np.mean([r["ms"] for r in rows])), 1),
                    "l1_to_reference_max": max(r["l1_to_reference"] for r in rows),
                }
            ),
            flush=True,
        )


def main() -> None:
    argv = sys.argv[1:]
    train_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, train_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capture", help="train, saving relation costs into this folder")
    parser.add_argument("--every", type=int, default=49)
    parser.add_argument("--costs", help="solve the costs saved in this folder")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--epsilon", default="0.1")
    parser.add_argument("--anderson", default="0,5")
    args = parser.parse_args(argv)
    if args.capture:
        capture(args.capture, args.every, train_args)
    elif args.costs:
        solve(
            args.costs,
            args.files,
            [float(e) for e in args.epsilon.split(",")],
            [int(m) for m in args.anderson.split(",")],
        )
    else:
        parser.error("give --capture=DIR (with train flags after --) or --costs=DIR")


if __name__ == "__main__":
    main()
