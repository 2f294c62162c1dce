r"""UOT-RCL costs: the per-epoch estimation step and the train step.

  python benchmarks/uot_rcl.py --part=estimate     # XMediaNet and NUS-WIDE sizes
  python benchmarks/uot_rcl.py --part=step         # MRL backbone, batch 100 and 500
  python benchmarks/uot_rcl.py --part=estimate --n=32000 --k=200 --neighbours=150

Estimation: the jitted device half of ``refresh_fn`` (confident set, momentum targets,
modal consistency, chunked k-nearest neighbours in both modalities, consistent cost,
partial-OT label correction) on random statistics of the real sizes (``L = 512``
embeddings, ``n_G = 5``), timed end to end and per piece (kNN, partial OT). Statistics
are class-structured (each sample near its class centre) so Sinkhorn sees a realistic
cost, not pure noise.

Train step: the MRL backbone (``4096 -> 4096 -> 4096 -> 512`` per modality, 4096-d
image and 300-d text features, ``K = 200``, ``|G| = 1000`` anchors) in the main phase
(``L_PLC + 0.4 L_BHG`` with the relation OT), anchors re-encoded every step
(``current``, the method's default; the paper does not say) or read from the epoch
snapshot. Pairs/s exclude the input pipeline.
"""

import argparse
import functools
import statistics
import sys

from _common import machine, set_cpu_devices, timed

set_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ncljax import config as config_lib  # noqa: E402
from ncljax import (  # noqa: E402
    methods,
    models,
    optim,
)
from ncljax.config import presets  # noqa: E402
from ncljax.data import sources  # noqa: E402
from ncljax.labels import correction, ot  # noqa: E402
from ncljax.methods import base  # noqa: E402
from ncljax.methods import uot_rcl as uot_lib  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402

L = 512


def _stats(n, k, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(k, size=n)
    centres = rng.normal(size=(k, L)).astype(np.float32)

    def view():
        z = centres[labels] + 3.0 * rng.normal(size=(n, L)).astype(np.float32)
        return z / np.linalg.norm(z, axis=1, keepdims=True)

    z_image, z_text = view(), view()
    prototypes = centres / np.linalg.norm(centres, axis=1, keepdims=True)
    noisy = np.where(rng.random(n) < 0.4, rng.integers(k, size=n), labels)
    stats = {
        "z_image": jnp.asarray(z_image),
        "z_text": jnp.asarray(z_text),
        "logits_image": jnp.asarray(z_image @ prototypes.T),
        "logits_text": jnp.asarray(z_text @ prototypes.T),
    }
    targets = jax.nn.one_hot(noisy, k, dtype=jnp.float32)
    return stats, {"targets_image": targets, "targets_text": targets, "labels": targets}


def _median(fn, repeats):
    return statistics.median(timed(fn, warmup=1, repeats=repeats))


def estimate(n, k, neighbours, repeats, chunk):
    stats, samples = _stats(n, k)
    marginal = jnp.full(k, 1.0 / k)
    run = jax.jit(
        functools.partial(
            uot_lib._estimate,
            per_class=5,
            neighbours=neighbours,
            momentum=0.99,
            epsilon=0.05,
            corner=0.0,
            threshold=1e-6,
            max_iterations=5000,
            confident="jsd",
            exclude_self=True,
            vote_normalise=True,
            knn_chunk=chunk,
        )
    )
    key = jax.random.key(0)
    out = []

    def full():
        out[:] = [jax.block_until_ready(run(samples, marginal, stats, 0.5, key))]

    total = _median(full, repeats)
    result = out[0][2]
    knn = jax.jit(functools.partial(correction.knn_cosine, k=neighbours, chunk=chunk))
    t_knn = _median(lambda: jax.block_until_ready(knn(stats["z_image"])), repeats)
    cost = jax.random.uniform(jax.random.key(1), (n, k)) * 5.0
    solve = jax.jit(functools.partial(ot.partial_ot_labels, class_marginal=marginal))
    t_ot = _median(lambda: jax.block_until_ready(solve(cost, mass=0.5)), repeats)
    print(
        f"estimate N={n} K={k} kappa={neighbours} chunk={chunk}: total {total:.2f} s "
        f"(kNN per modality {t_knn:.2f} s, partial OT on a random cost {t_ot:.3f} s); "
        f"OT iterations {int(result.n_iters)}, converged {bool(result.converged)}, "
        f"transported {float(result.mass):.4f} of 0.5"
    )


def train_step(batch_size, anchors, steps, repeats):
    info = sources.DatasetInfo("xmedianet", 1, 200, 0, 0, 0, 0, 4096, 300, {})
    config = config_lib.base_config()
    presets.use_mrl(config)
    kwargs = config_lib.method_kwargs("uot_rcl", neighbours=150, anchors=anchors)
    method = methods.build_method("uot_rcl", kwargs)
    n = 32000
    rng = np.random.default_rng(0)
    labels = rng.integers(200, size=n)
    memory = method.init_memory(base.InitContext(n, info, labels, labels, 512))
    g = 200 * 5
    state_mem = dict(
        memory.state,
        anchors_image=jnp.asarray(rng.normal(size=(g, 4096)), jnp.float32),
        anchors_text=jnp.asarray(rng.normal(size=(g, 300)), jnp.float32),
        anchor_mask=jnp.ones(g, bool),
        anchor_z_image=jnp.asarray(rng.normal(size=(g, 512)), jnp.float32),
        anchor_z_text=jnp.asarray(rng.normal(size=(g, 512)), jnp.float32),
    )
    samples = dict(memory.samples, labels=jax.nn.one_hot(labels, 200) * 0.8)
    memory = base.Memory(samples, state_mem)
    mesh = mesh_lib.make_mesh(0)
    tx = optim.make_optimizer(config.optim)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(config.model, info, rngs),
        tx=tx,
        memory=memory,
        num_networks=1,
        seed=0,
    )
    state = jax.device_put(state, mesh_lib.replicated(mesh))
    step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=n),
        static_argnums=2,
        donate_argnums=0,
    )
    batch = {
        "global_image": rng.normal(size=(batch_size, 4096)).astype(np.float32),
        "global_text": rng.normal(size=(batch_size, 300)).astype(np.float32),
        "label_image": labels[:batch_size],
        "label_text": labels[:batch_size],
        "index": np.arange(batch_size, dtype=np.int32),
        "mask": np.ones(batch_size, bool),
    }
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    holder = [state]

    def run():
        s = holder[0]
        for _ in range(steps):
            s, _ = step(s, batch, 1)
        jax.block_until_ready(s)
        holder[0] = s

    with jax.set_mesh(mesh):
        times = timed(run, warmup=1, repeats=repeats)
    rates = [steps * batch_size / t for t in times]
    print(
        f"train step (MRL backbone, main phase, anchors={anchors}) devices={jax.device_count()} "
        f"batch={batch_size}: pairs/s median={statistics.median(rates):.0f} "
        f"(min {min(rates):.0f}, max {max(rates):.0f}); "
        f"step {1e3 * statistics.median(times) / steps:.0f} ms"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--part", choices=["estimate", "step", "all"], default="all")
    parser.add_argument("--n", type=int, default=0, help="one estimation size (else both)")
    parser.add_argument("--k", type=int, default=0)
    parser.add_argument("--neighbours", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=0, help="one batch size (else 100, 500)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# {machine()}")
    if args.part in ("estimate", "all"):
        sizes = [(32000, 200, 150), (42941, 10, 200)]  # XMediaNet, NUS-WIDE (kappa: paper Sec. V-B)
        if args.n:
            sizes = [(args.n, args.k or 10, args.neighbours or 10)]
        for n, k, kappa in sizes:
            estimate(n, k, kappa, args.repeats, args.chunk)
    if args.part in ("step", "all"):
        for batch_size in [args.batch] if args.batch else [100, 500]:
            for anchors in ("current", "snapshot"):
                train_step(batch_size, anchors, args.steps, args.repeats)


if __name__ == "__main__":
    main()
