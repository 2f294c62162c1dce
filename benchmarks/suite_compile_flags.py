r"""What the test suite's XLA compile flags (``tests/conftest.py``: ``FAST_COMPILE``) buy and
cost, on the programs the tests compile: tiny training runs of the synthetic data.

  python benchmarks/suite_compile_flags.py
  python benchmarks/suite_compile_flags.py --methods=vse,ncr,ugncl --repeats=3

For each method and each setting (XLA's defaults; ``FAST_COMPILE``), a fresh process with
an empty persistent compilation cache of its own (as the suite's) trains the tests' ``tiny``
config (64 training images, batch 32, 2-3 epochs, one device) twice and prints one JSON
line:

* ``first_s``: the first run, compile-dominated (what a test pays once per program);
* ``again_s``: the same run again in the same process, every executable from the cache:
  tracing and execution, what a test pays when its programs are already compiled, and
  where the slower code of ``FAST_COMPILE`` shows;
* ``rsum``: the run's test rSum, which both settings must give to round-off.

The median of ``--repeats`` processes per cell. Nothing else should run on the machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

CHILD = r"""
import json, os, sys, tempfile, time
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
sys.path.insert(0, {root!r})
from ncljax.train import train_and_evaluate
from tests.train.test_loop import load_config, tiny
method = {method!r}
times = []
for _ in range(2):
    config = tiny(load_config(method, "synthetic"), epochs=3 if method != "vse" else 2)
    config.train.num_devices, config.train.progress_bar = 1, False
    start = time.perf_counter()
    results = train_and_evaluate(config, tempfile.mkdtemp())
    times.append(time.perf_counter() - start)
print(json.dumps({{"first_s": times[0], "again_s": times[1], "rsum": results["rsum"]}}))
"""


def measure(method: str, flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    code = CHILD.format(root=ROOT, method=method)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="vse,ncr,ugncl")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for method in args.methods.split(","):
        for name, flags in (("default", ""), ("fast_compile", FAST_COMPILE)):
            runs = [measure(method, flags) for _ in range(args.repeats)]
            row = {"method": method, "flags": name}
            for key in ("first_s", "again_s"):
                row[key] = round(statistics.median(r[key] for r in runs), 2)
            row["rsum"] = sorted({round(r["rsum"], 3) for r in runs})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
