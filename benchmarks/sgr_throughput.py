r"""SGR (SGRAF) throughput: train step at batch 128 and evaluation over 1K x 5K pairs.

  python benchmarks/sgr_throughput.py train --batch=128 --length=24 [--no-remat] [--chunk=16]
  python benchmarks/sgr_throughput.py eval --images=1000 [--image-chunk=100 --text-chunk=500]
  python benchmarks/sgr_throughput.py train --head=saf ...

Real Flickr30K shapes with random inputs: 36 x 2048 region features, 300-d words, Bi-GRU
1024, similarity vectors 256, 3 SGR steps; captions of ``--length`` tokens (valid lengths
drawn between half of it and all of it). ``train`` times the library's jitted train step
(VSE++ triplet on sigmoid similarities, Adam, clipping 2.0, as the NCR baselines) after a
compiling warm-up and reports the median pairs/s and the process's peak RSS (run one
configuration per process: the peak includes compilation). ``eval`` encodes the images and
captions once and times ``ncljax.evaluate.retrieval_metrics`` with the SGR head as
``sim_fn``.
"""

import argparse
import resource
import statistics
import sys

from _common import VOCAB, machine, random_batch, set_cpu_devices, timed

set_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from ncljax import backend, evaluate, methods  # noqa: E402
from ncljax.methods import InitContext  # noqa: E402
from ncljax.models import sgraf  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402


def model_fn(args):
    return lambda rngs: sgraf.SGRAFModel(
        2048, VOCAB, kind=args.head, chunk=args.chunk, remat=args.remat, rngs=rngs
    )


def train(args):
    rng = np.random.default_rng(0)
    method = methods.build_method("vse")
    tx = optax.chain(optax.clip_by_global_norm(2.0), optax.adam(2e-4))
    graphdef, state = state_lib.create(
        model_fn=model_fn(args),
        tx=tx,
        memory=method.init_memory(InitContext(args.batch, None, None, None)),
        num_networks=1,
        seed=0,
    )
    mesh = mesh_lib.make_mesh(0)
    state = mesh_lib.replicate(state, mesh)
    batch = jax.device_put(
        random_batch(rng, args.batch, args.length), mesh_lib.batch_sharding(mesh)
    )
    step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=args.batch),
        static_argnums=2,
        donate_argnums=0,
        compiler_options=backend.compiler_options(),
    )
    holder = [state]

    def run():
        holder[0], metrics = step(holder[0], batch, 0)
        jax.block_until_ready(metrics)

    with jax.set_mesh(mesh):
        times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"train head={args.head} batch={args.batch} length={args.length} chunk={args.chunk} "
        f"remat={args.remat}: {t:.2f} s/step median ({min(times):.2f}-{max(times):.2f}), "
        f"{args.batch / t:.1f} pairs/s, peak RSS {rss:.1f} GiB"
    )


def eval_(args):
    rng = np.random.default_rng(0)
    model = model_fn(args)(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = (nnx.to_pure_dict(params), nnx.to_pure_dict(rest))

    @jax.jit
    def encode_images(state, regions):
        return {
            k: v for k, v in nnx.merge(graphdef, *state).encode_image({"regions": regions}).items()
        }

    @jax.jit
    def encode_texts(state, tokens, lengths):
        return nnx.merge(graphdef, *state).encode_text({"tokens": tokens, "length": lengths})

    def sim_fn(state, image, text):
        return nnx.merge(graphdef, *state).similarity(image, text)

    data = random_batch(rng, args.images, args.length)
    texts = random_batch(rng, 5 * args.images, args.length)
    images = jax.tree.map(
        lambda *x: jnp.concatenate(x),
        *[encode_images(state, data["regions"][i : i + 100]) for i in range(0, args.images, 100)],
    )
    words = jax.tree.map(
        lambda *x: jnp.concatenate(x),
        *[
            encode_texts(state, texts["tokens"][i : i + 500], texts["length"][i : i + 500])
            for i in range(0, 5 * args.images, 500)
        ],
    )

    def run():
        evaluate.retrieval_metrics(
            sim_fn,
            images,
            words,
            captions_per_image=5,
            image_chunk=args.image_chunk,
            text_chunk=args.text_chunk,
            params=state,
        )

    times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    pairs = 5 * args.images**2
    print(
        f"eval head={args.head} {args.images} x {5 * args.images} length={args.length} "
        f"blocks {args.image_chunk}x{args.text_chunk} chunk={args.chunk}: {t:.1f} s median, "
        f"{pairs / t:,.0f} pairs/s"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "eval"])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--head", default="sgr", choices=["sgr", "saf"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--no-remat", dest="remat", action="store_false")
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--image-chunk", type=int, default=100)
    parser.add_argument("--text-chunk", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# {machine()}")
    {"train": train, "eval": eval_}[args.mode](args)


if __name__ == "__main__":
    main()
