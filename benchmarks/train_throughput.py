r"""Train-step throughput (pairs/s) of the baselines, excluding the input pipeline.

  python benchmarks/train_throughput.py                 # 1 CPU device
  python benchmarks/train_throughput.py --devices=8     # 8 fake CPU devices
  python benchmarks/train_throughput.py --preset=quickstart --batch=128

Builds the model and state exactly as ``train.py`` does for each config, puts one
synthetic batch on the mesh, compiles the jitted step, then times ``--steps`` steps
(blocking on the result) ``--repeats`` times and reports the median pairs/s.
"""

import argparse
import statistics
import sys

from _common import machine, set_cpu_devices, timed

set_cpu_devices(sys.argv)

import jax  # noqa: E402

from ncljax import config as config_lib  # noqa: E402
from ncljax import (  # noqa: E402
    methods,
    models,
    optim,
)
from ncljax.data import pipeline, sources  # noqa: E402
from ncljax.methods import InitContext  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402


def preset(name: str):
    """The model/method settings of the shipped synthetic configs."""
    c = config_lib.base_config()
    c.data.num_train, c.data.num_val, c.data.num_test = 512, 8, 8
    if name in ("quickstart", "vse-dual", "infonce"):
        c.model.embed_dim, c.model.tokens.word_dim = 128, 64
        c.method = "infonce" if name == "infonce" else "vse"
        if name == "vse-dual":
            c.method_kwargs.num_networks = 2
    elif name == "ce":
        c.method = "ce"
        c.data.captions_per_image = 1
        c.model.image_input = c.model.text_input = "global"
        c.model.cosine.image_hidden = c.model.text_mlp.hidden = (512, 512)
        c.model.embed_dim, c.model.classifier = 128, True
    else:
        raise ValueError(f"unknown preset {name!r}")
    return c


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--preset", default="all")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    names = ["quickstart", "infonce", "vse-dual", "ce"] if args.preset == "all" else [args.preset]
    print(f"# {machine()}; batch {args.batch}")
    for name in names:
        config = preset(name)
        dataset = sources.load_dataset(config.data)
        method = methods.build_method(config.method, config.method_kwargs)
        image_fields, text_fields = models.input_fields(config.model)
        record = pipeline.pair_records(
            dataset.split("train"), image_fields=image_fields, text_fields=text_fields
        )
        batch = next(iter(pipeline.batches(record, 512, batch_size=args.batch, seed=0)))
        mesh = mesh_lib.make_mesh(0)
        tx = optim.make_optimizer(config.optim)
        graphdef, state = state_lib.create(
            model_fn=lambda rngs, c=config, d=dataset: models.build_model(c.model, d.info, rngs),
            tx=tx,
            memory=method.init_memory(InitContext(512, dataset.info, None, None)),
            num_networks=method.num_networks,
            seed=0,
        )
        state = jax.device_put(state, mesh_lib.replicated(mesh))
        step = jax.jit(
            step_lib.make_train_step(graphdef, method, tx, num_samples=512),
            static_argnums=2,
            donate_argnums=0,
        )
        device_batch = pipeline.to_device(batch, mesh_lib.batch_sharding(mesh))
        holder = [state]

        def run(step=step, holder=holder, device_batch=device_batch):
            s = holder[0]
            for _ in range(args.steps):
                s, _ = step(s, device_batch, 0)
            jax.block_until_ready(s)
            holder[0] = s

        with jax.set_mesh(mesh):
            times = timed(run, repeats=args.repeats)
        rates = [args.steps * args.batch / t for t in times]
        print(
            f"{name:11s} devices={jax.device_count()} batch={args.batch} "
            f"pairs/s median={statistics.median(rates):8.0f} "
            f"(min {min(rates):.0f}, max {max(rates):.0f}); "
            f"step {1e3 * statistics.median(times) / args.steps:.1f} ms"
        )


if __name__ == "__main__":
    main()
