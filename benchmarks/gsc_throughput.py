r"""GSC throughput: the train step with the SGR head, and the per-epoch label estimation.

  python benchmarks/gsc_throughput.py step --method=gsc --networks=1 --batch=128
  python benchmarks/gsc_throughput.py step --method=gsc --networks=2 --batch=128
  python benchmarks/gsc_throughput.py step --method=vse --networks=1 --batch=128
  python benchmarks/gsc_throughput.py step --method=srem --batch=128
  python benchmarks/gsc_throughput.py step --method=ugncl --batch=128
  python benchmarks/gsc_throughput.py division --batch=128
  python benchmarks/gsc_throughput.py estimate --samples=145000

``step``: real Flickr30K shapes with random inputs (36 x 2048 regions, 300-d words, Bi-GRU
1024, similarity vectors 256, 3 SGR steps, captions of ``--length`` tokens with valid
lengths between half of it and all of it), the library's jitted train step (Adam 2e-4,
clipping 2.0) of ``gsc`` (cross-modal, image-image and text-text SGR passes, purified
losses, buffer writes; labels drawn uniformly so the masks are not trivial), of the
``vse`` baseline (hardest-negative triplet on the cross-modal pass) or of ``srem``'s main
phase (one network; energies, clean splits, swapped weights, complementary
distributions and the three losses on the cross-modal pass's logits, with its memory
writes and logged metrics; no true mask is given, so the precision/recall diagnostics
are not computed) or of ``ugncl``'s training phase (two image views, so two SGR passes
sharing one caption encoding and head, raw logits; the division read from memory rows
drawn at random so every set is populated; evidential loss of both directions and
views, trusted robust loss); median pairs/s over ``--repeats`` steps after a compiling warm-up,
and the process's peak RSS (run one configuration per process: the peak includes
compilation).

``division``: UGNCL's per-epoch division pass, per batch: the eval-mode forward of both
views (no gradient) and the division signals (``ncljax.labels.division_signals``), as the
trainer's statistics pass runs it; pairs/s and the implied time of a Flickr30K pass
(145,000 pairs).

``estimate``: GSC's per-epoch estimation over ``--samples`` pairs (min-max, two-component
GMM by EM, temporal ensembling, minimum; ``ncljax.labels.gsc_update_labels``, jitted), on
bimodal scores; median seconds after a compiling call.
"""

import argparse
import functools
import resource
import statistics
import sys

from _common import VOCAB, machine, random_batch, set_cpu_devices, timed

set_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from ncljax import backend, labels, methods  # noqa: E402
from ncljax.methods import InitContext, Memory  # noqa: E402
from ncljax.models import sgraf  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402

MAIN_PHASE = 1  # GSC's purified phase (no warm-up), SREM's main phase


def step(args):
    rng = np.random.default_rng(0)
    kwargs = {} if args.method in ("srem", "ugncl") else {"num_networks": args.networks}
    method = methods.build_method(args.method, kwargs)
    tx = optax.chain(optax.clip_by_global_norm(2.0), optax.adam(2e-4))
    graphdef, state = state_lib.create(
        model_fn=functools.partial(_model, args),
        tx=tx,
        memory=method.init_memory(InitContext(args.batch, None, None, None)),
        num_networks=args.networks,
        seed=0,
    )
    if args.method == "gsc":
        shape = (args.networks, args.batch)
        samples = dict(state.memory.samples, labels=jnp.asarray(rng.uniform(size=shape)))
        state = state._replace(memory=Memory(samples, state.memory.state))
    if args.method == "ugncl":
        n = args.batch
        rows = {
            "uncertainty": rng.uniform(0.2, 0.8, n),
            "prediction": (rng.random(n) < 0.7).astype(np.float32),
            "soft_label": rng.uniform(0.0, 1.0, n),
        }
        samples = dict(state.memory.samples)
        samples.update({k: jnp.asarray(v, jnp.float32)[None] for k, v in rows.items()})
        state = state._replace(memory=Memory(samples, state.memory.state))
    mesh = mesh_lib.make_mesh(0)
    state = mesh_lib.replicate(state, mesh)
    batch = jax.device_put(
        random_batch(rng, args.batch, args.length), mesh_lib.batch_sharding(mesh)
    )
    train_step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=args.batch),
        static_argnums=2,
        donate_argnums=0,
        compiler_options=backend.compiler_options(),
    )
    phase = 0 if args.method == "vse" else MAIN_PHASE
    holder = [state]

    def run():
        holder[0], metrics = train_step(holder[0], batch, phase)
        jax.block_until_ready(metrics)

    with jax.set_mesh(mesh):
        times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"step method={args.method} networks={args.networks} batch={args.batch} "
        f"length={args.length} chunk={args.chunk} remat={args.remat}: {t:.2f} s/step median "
        f"({min(times):.2f}-{max(times):.2f}), {args.batch / t:.1f} pairs/s, "
        f"peak RSS {rss:.1f} GiB"
    )


def _model(args, rngs):
    ugncl = args.method == "ugncl"
    return sgraf.SGRAFModel(
        2048,
        VOCAB,
        chunk=args.chunk,
        remat=args.remat,
        sigmoid=not ugncl,
        views=2 if ugncl else 1,
        rngs=rngs,
    )


def division(args):
    """UGNCL's statistics pass per batch: eval forward of both views + division signals."""
    rng = np.random.default_rng(0)
    args.method = "ugncl"
    method = methods.build_method("ugncl")
    graphdef, state = state_lib.create(
        model_fn=functools.partial(_model, args),
        tx=optax.identity(),
        memory=method.init_memory(InitContext(args.batch, None, None, None)),
        num_networks=1,
        seed=0,
    )
    mesh = mesh_lib.make_mesh(0)
    state = mesh_lib.replicate(state, mesh)
    batch = jax.device_put(
        random_batch(rng, args.batch, args.length), mesh_lib.batch_sharding(mesh)
    )

    def stats(model, batch):
        outputs = method.forward_fn(model, batch, None, train=False, rngs=None, phase=-1)
        return method.stats_fn(outputs, batch)

    forward = jax.jit(step_lib.make_forward(graphdef, stats))

    def run():
        jax.block_until_ready(forward(state.params, state.model_state, batch))

    with jax.set_mesh(mesh):
        times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"division batch={args.batch} length={args.length} views=2: {t:.2f} s/batch median "
        f"({min(times):.2f}-{max(times):.2f}), {args.batch / t:.1f} pairs/s, a Flickr30K "
        f"pass (145,000 pairs) {145_000 / args.batch * t / 3600:.2f} h, peak RSS {rss:.1f} GiB"
    )


def estimate(args):
    rng = np.random.default_rng(0)
    n = args.samples
    clean = rng.random(n) < 0.6
    intra = np.where(clean, rng.normal(0.8, 0.05, n), rng.normal(0.5, 0.1, n))
    cross = np.where(clean, rng.uniform(0.5, 1.0, n), rng.uniform(0.0, 0.3, n))
    ones = jnp.ones(n, jnp.float32)
    inputs = (ones, ones, jnp.asarray(cross, jnp.float32), jnp.asarray(intra, jnp.float32))
    update = jax.jit(functools.partial(labels.gsc_update_labels))

    def run():
        jax.block_until_ready(update(*inputs))

    times = timed(run, warmup=1, repeats=args.repeats)
    new, mixture = update(*inputs)
    agreement = float(np.mean((np.asarray(new.labels) > 0.5) == clean))
    print(
        f"estimate samples={n}: {statistics.median(times) * 1e3:.1f} ms median "
        f"({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), EM iterations "
        f"{int(mixture.n_iter)}, labels > 0.5 agree with the synthetic mask on {agreement:.3f}"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["step", "division", "estimate"])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--method", default="gsc", choices=["gsc", "vse", "srem", "ugncl"])
    parser.add_argument("--networks", type=int, default=1)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--no-remat", dest="remat", action="store_false")
    parser.add_argument("--samples", type=int, default=145_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# {machine()}")
    {"step": step, "division": division, "estimate": estimate}[args.mode](args)


if __name__ == "__main__":
    main()
