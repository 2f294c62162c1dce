r"""NCR and PC2 throughput: co-training steps with the SGR head, whole epochs on synthetic
data, and PC2's per-epoch bank and oscillation GMM.

  python benchmarks/ncr_throughput.py step --phase=2 --batch=128      # clean + noisy updates
  python benchmarks/ncr_throughput.py step --phase=1 --batch=128      # clean update only
  python benchmarks/ncr_throughput.py step --phase=0 --batch=128      # warm-up step
  python benchmarks/ncr_throughput.py step --method=pc2 --phase=2     # clean + pseudo-caption
  python benchmarks/ncr_throughput.py epoch --config=ncr              # also: pc2, gsc, vse
  python benchmarks/ncr_throughput.py refresh --method=pc2 --pairs=145000   # also: ncr

``step``: real Flickr30K shapes with random inputs (36 x 2048 regions, 300-d words, Bi-GRU
1024, similarity vectors 256, 3 SGR steps, captions of ``--length`` tokens with valid
lengths between half of it and all of it), the library's jitted in-turn step of network 0
against its frozen peer (Adam 2e-4, clipping 2.0). Phase 2 is NCR's co-training step
after ``noisy_start_epoch``: a no-grad eval-mode pass (the network on the clean and the
noisy batch, the peer on the noisy batch) then two sequential updates (clean, then
noisy); phase 1 makes the clean update only (and skips the noisy predictions); phase 0 is
the warm-up step. ``--method=pc2``: the same with PC2's pseudo-classifier (``K = 128``,
hidden 256: 36 x 1024 inputs, 9.4M parameters per network); phase 2 is its clean update
then the pseudo-caption update (both batches forwarded again in train mode, each noisy
image against its borrowed clean caption), phase 1 the clean update, phase 0 the warm-up
(ranking plus pseudo-classification, bank writes). Median pairs/s (pairs of the clean
batch per step) over ``--repeats`` steps after a compiling warm-up, and the process's peak
RSS.

``epoch``: wall time of whole epochs of ``train_and_evaluate`` on the embedded synthetic
data (20,000 pairs, 40% per-caption noise, region encoder + Bi-GRU + cosine head, batch
128): ``ncr`` (no warm-up, the noisy update from the first epoch: co-divide pass of both
networks, then each network's pass over its peer's clean set), ``gsc`` (GSC+, both
networks together under vmap) and ``vse`` (one network). Time from the start of the run
to the end of each epoch's validation (``callbacks``); the first epoch includes
compilation, so the second is the figure. ``pc2``: no warm-up, pseudo-captions from the
first epoch (co-divide pass with the image predictions, both GMMs, each network's pass).

``refresh``: the per-epoch host step after the statistics pass, on ``--pairs`` pairs (145,000
is Flickr30K's training set) of random statistics: NCR's loss GMM, or PC2's loss GMM, the
oscillation GMM and the bank update (the oscillation against the ``[N, 128]`` bank is
measured in the statistics pass, by PC2's ``stats_fn``: computed here beforehand, in
chunks, and not timed). Median seconds over ``--repeats`` calls after a compiling one, and
the bank's size.
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

from _common import VOCAB, machine, random_batch, set_cpu_devices, timed

set_cpu_devices(sys.argv)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from ncljax import backend, methods  # noqa: E402
from ncljax import config as config_lib  # noqa: E402
from ncljax.config import presets  # noqa: E402
from ncljax.methods import InitContext, Memory, RefreshContext, ncr  # noqa: E402
from ncljax.models import sgraf  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Info:
    num_regions = 36  # what the pseudo-classifier's input size reads


def _method(name):
    model_config = presets.use_sgraf(config_lib.base_config()).model
    return methods.build_method(name, {}, model_config=model_config)


def _model(args, method, rngs):
    model = sgraf.SGRAFModel(2048, VOCAB, chunk=args.chunk, remat=args.remat, rngs=rngs)
    if method.heads_fn is not None:
        model.method_heads = nnx.Dict(method.heads_fn(_Info, rngs))
    return model


def step(args):
    rng = np.random.default_rng(0)
    method = _method(args.method)
    tx = optax.chain(optax.clip_by_global_norm(2.0), optax.adam(2e-4))
    n = 2 * args.batch
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: _model(args, method, rngs),
        tx=tx,
        memory=method.init_memory(InitContext(n, None, None, None)),
        num_networks=2,
        seed=0,
    )
    samples = dict(state.memory.samples, prob=rng.uniform(0.5, 1.0, (2, n)).astype(np.float32))
    state = state._replace(memory=Memory(samples, state.memory.state))
    mesh = mesh_lib.make_mesh(0)
    state = mesh_lib.replicate(state, mesh)
    sharding = mesh_lib.batch_sharding(mesh)
    clean = jax.device_put(random_batch(rng, args.batch, args.length), sharding)
    noisy = jax.device_put(random_batch(rng, args.batch, args.length, args.batch), sharding)
    train_step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=n),
        static_argnums=2,
        donate_argnums=0,
        compiler_options=backend.compiler_options(),
    )
    updates = (0, 1) if args.phase == ncr.CLEAN_NOISY else (0,)
    spec = step_lib.StepSpec(phase=args.phase, updates=updates, in_turn=True)
    holder = [state]

    def run():
        holder[0], metrics = train_step(holder[0], (clean, noisy), spec, None, np.int32(0))
        jax.block_until_ready(metrics)

    with jax.set_mesh(mesh):
        times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"step method={args.method} phase={args.phase} updates={len(updates)} batch={args.batch} "
        f"length={args.length}: {t:.2f} s/step median ({min(times):.2f}-{max(times):.2f}), "
        f"{args.batch / t:.1f} pairs/s, peak RSS {rss:.1f} GiB"
    )


def epoch(args):
    from ncljax.train import train_and_evaluate

    def load(name, arg):
        return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)

    if args.config == "ncr":
        config = load("ncr", "synthetic")
        config.method_kwargs.warmup_epochs = 0
        config.method_kwargs.noisy_start_epoch = 0
    elif args.config == "pc2":
        config = load("pc2", "synthetic")
        config.method_kwargs.warmup_epochs = 0
        config.method_kwargs.pseudo_start_epoch = 0
    else:
        config = load(args.config, "synthetic")
    config.train.epochs = args.epochs
    config.train.progress_bar = False
    config.train.num_devices = 1
    stamps = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        train_and_evaluate(
            config,
            workdir,
            callbacks=[lambda e, val: stamps.append(time.perf_counter() - start)],
        )
    per_epoch = np.diff([0.0, *stamps])
    print(
        f"epoch config={args.config} epochs={args.epochs}: "
        + ", ".join(f"epoch {e}: {t:.1f} s" for e, t in enumerate(per_epoch))
    )


def _pc2_pass(method, logits, samples, chunk=4096):
    """PC2's statistics-pass rows (oscillation, prediction class and probability, the new
    bank) of every pair, in chunks of ``chunk`` pairs; the co-divide loss is given apart."""
    jnp, n = jax.numpy, logits.shape[0]
    parts = []
    for start in range(0, n, chunk):
        index = np.arange(start, min(n, start + chunk))
        outputs = {"sim": jnp.zeros((index.size, index.size)), "image_logits": logits[index]}
        batch = {"mask": jnp.ones(index.size, bool), "index": jnp.asarray(index)}
        rows = {name: samples[name][index] for name in method.stats_rows}
        parts.append(method.stats_fn(outputs, batch, rows))
    return {k: jnp.concatenate([p[k] for p in parts]) for k in parts[0] if k != "loss"}


def refresh(args):
    rng = np.random.default_rng(0)
    method = _method(args.method)
    n = args.pairs
    memory = method.init_memory(InitContext(n, None, None, None))
    loss = np.concatenate([rng.normal(0.1, 0.03, n - n // 3), rng.normal(0.5, 0.1, n // 3)])
    stats = {"loss": jax.numpy.asarray(loss, np.float32)}
    if args.method == "pc2":
        logits = rng.normal(size=(n, 128)).astype(np.float32)
        stats["pred"] = jax.nn.softmax(jax.numpy.asarray(logits), axis=-1)
        bank = jax.nn.softmax(jax.numpy.asarray(logits + rng.normal(size=logits.shape)), -1)
        samples = dict(memory.samples, bank=bank, bank_valid=np.ones(n, np.float32))
        memory = Memory(samples, memory.state)
        stats |= _pc2_pass(method, logits, samples)
    jax.block_until_ready(stats)
    ctx = RefreshContext(1, 10, 0, jax.random.key(0), None)

    def run():
        new, diagnostics = method.refresh_fn(memory, stats, ctx)
        jax.block_until_ready((new, diagnostics))

    times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    bank = memory.samples.get("bank")
    size = 0 if bank is None else bank.size * bank.dtype.itemsize / 2**20
    print(
        f"refresh method={args.method} pairs={n}: {t:.3f} s median "
        f"({min(times):.3f}-{max(times):.3f}), bank {size:.1f} MiB per network"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["step", "epoch", "refresh"])
    parser.add_argument("--method", default="ncr", choices=["ncr", "pc2"])
    parser.add_argument("--pairs", type=int, default=145000)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--phase", type=int, default=ncr.CLEAN_NOISY)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--no-remat", dest="remat", action="store_false")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="ncr", choices=["ncr", "pc2", "gsc", "vse"])
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    print(f"# {machine()}")
    {"step": step, "epoch": epoch, "refresh": refresh}[args.mode](args)


if __name__ == "__main__":
    main()
