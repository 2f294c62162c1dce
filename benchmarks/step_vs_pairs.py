r"""Does a train step's time grow with the number of pairs ``N`` a run holds memory for?

  python benchmarks/step_vs_pairs.py --method=gsc --batch=1024 --pairs=10000,1000000,10000000
  python benchmarks/step_vs_pairs.py --method=infonce --batch=4096 --pairs=10000

A method's per-pair memory (``Method.init_memory`` at ``N`` pairs: GSC's labels and
buffers, SREM's energies, ...) is read and written by row at the batch's indices, so a
step should cost the same at 10^4 and 10^7 pairs. The model is a one-layer linear
embedding ``D = 256 -> 64`` of each side with the cosine head (the step's own work small,
so an O(N) cost shows), Adam; one random batch of ``--batch`` pairs at random indices;
the main phase (phase 1; 0 for the baselines). Median of 5 x 5 steps after a compiling
call, the state donated as the trainer does. Also prints XLA's temporary memory of the
compiled step, which must not grow with ``N`` either.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import machine, set_cpu_devices

set_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from ncljax import methods  # noqa: E402
from ncljax.methods import InitContext  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402

DIM = 256
SETTINGS = {  # the :vectors settings that shape the step
    "gsc": {"noise_share": "partner"},
    "srem": {"division": "partner", "ranking": "contrastive", "lambda1": 0.0},
    "infonce": {},
}


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.image = nnx.Linear(DIM, 64, rngs=rngs)
        self.text = nnx.Linear(DIM, 64, rngs=rngs)

    def __call__(self, batch, train=False, rngs=None):
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        image = unit(self.image(batch["global_image"]))
        text = unit(self.text(batch["global_text"]))
        return {"sim": image @ text.T, "image": {"emb": image}, "text": {"emb": text}}


def measure(name: str, batch_size: int, num_pairs: int) -> dict:
    method = methods.build_method(name, SETTINGS[name])
    tx = optax.adam(1e-3)
    graphdef, state = state_lib.create(
        model_fn=Linear,
        tx=tx,
        memory=method.init_memory(InitContext(num_pairs, None, None, None)),
        num_networks=method.num_networks,
        seed=0,
    )
    mesh = mesh_lib.make_mesh(0)
    state = mesh_lib.replicate(state, mesh)
    rng = np.random.default_rng(0)
    batch = {
        "global_image": rng.normal(size=(batch_size, DIM)).astype(np.float32),
        "global_text": rng.normal(size=(batch_size, DIM)).astype(np.float32),
        "index": rng.choice(num_pairs, batch_size, replace=False).astype(np.int32),
        "mask": np.ones(batch_size, bool),
    }
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=num_pairs),
        static_argnums=2,
        donate_argnums=0,
    )
    phase = 0 if name == "infonce" else 1
    with jax.set_mesh(mesh):
        temp = step.lower(state, batch, phase).compile().memory_analysis().temp_size_in_bytes
        state, metrics = step(state, batch, phase)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(5):
                state, metrics = step(state, batch, phase)
            jax.block_until_ready((state, metrics))
            times.append((time.perf_counter() - start) / 5)
    return {"ms": 1e3 * statistics.median(times), "temp_mib": temp / 2**20}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="gsc", choices=sorted(SETTINGS))
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--pairs", default="10000,1000000,10000000")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    print(f"# {machine()}")
    for num_pairs in (int(p) for p in args.pairs.split(",")):
        got = measure(args.method, args.batch, num_pairs)
        print(
            f"{args.method} batch={args.batch} pairs={num_pairs:>10,}: "
            f"step {got['ms']:8.2f} ms, XLA temp {got['temp_mib']:7.1f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
