r"""Where the time of the SGRAF steps goes: FLOPs, the machine's peak, memory, a profile.

  python benchmarks/step_profile.py                     # every case, one process each: the table
  python benchmarks/step_profile.py --case=sgr          # one case, printed as one JSON line
  python benchmarks/step_profile.py --groups=1          # the padded head (no length grouping)
  python benchmarks/step_profile.py --dtype=bfloat16    # the head's bfloat16 matrix products

Cases (real Flickr30K shapes, random inputs: 36 x 2048 regions, 300-d words, Bi-GRU 1024,
similarity vectors 256, 3 SGR steps; captions padded to ``--length`` (16) with valid
lengths drawn uniformly between half of it and all of it, i.e. 8-16 tokens):

* ``sgr`` / ``saf``: the library's jitted train step of the ``vse`` baseline (hardest-
  negative triplet on sigmoid similarities, Adam 2e-4, clipping 2.0) at batch 128;
* ``gsc``: the GSC step (one network; cross-modal, image-image and text-text SGR passes,
  purified losses, buffer writes) at batch 96;
* ``eval``: the SGR similarity of one evaluation block of ``--eval-images`` (100) images
  x ``--eval-captions`` (500) captions, and the implied time of the Flickr30K test
  (1,000 x 5,000 pairs);
* ``peak``: the machine's measured peak, a 4096^3 float32 matrix product (and bfloat16
  with float32 accumulation on a GPU).

Per case: the median time over ``--repeats`` calls after a compiling call; FLOPs per call
from the compiled program (``_hlo.program_flops``: XLA's own ``cost_analysis`` counts a
loop body once, so it is printed beside it for reference), both as executed (each chunk
of captions at the length its group runs) and as the padded head would do them; the
achieved fraction of the float32 peak; XLA's ``memory_analysis`` (arguments + temporaries)
and the process's peak RSS; and a profile of one call by kind of operation (matmul,
softmax and norms, the GRU's scan, elementwise), in percent of the profiled time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys

from _common import VOCAB, machine, random_batch, set_cpu_devices, timed

set_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _hlo import KINDS, Program, profile_by_kind  # noqa: E402
from flax import nnx  # noqa: E402

from ncljax import backend, methods  # noqa: E402
from ncljax.methods import InitContext, Memory  # noqa: E402
from ncljax.models import retrieval, sgraf  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import state as state_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402

CASES = ("sgr", "saf", "gsc", "eval")
BATCH = {"sgr": 128, "saf": 128, "gsc": 96}


def options(args):
    """The library's per-backend compiler options (``ncljax.backend``), or XLA's own."""
    return {} if args.xla_defaults else backend.compiler_options()


def parse_remat(text: str):
    """``--remat``: a ``model.sgraf.remat`` choice (auto, full, projections, none)."""
    return retrieval.resolve_remat(text)


def model_fn(args, head):
    return lambda rngs: sgraf.SGRAFModel(
        2048,
        VOCAB,
        kind=head,
        chunk=args.chunk,
        remat=parse_remat(args.remat),
        length_groups=args.groups,
        compute_dtype=args.dtype,
        rngs=rngs,
    )


def branch_weights(lengths, chunk, length, groups):
    """Fraction of caption chunks that run each static length (for the FLOP count)."""
    limits = sgraf.group_lengths(length, groups)
    if len(limits) == 1:
        return None, limits
    ordered = np.sort(np.asarray(lengths))
    n = len(ordered)
    chunk = n if chunk <= 0 else min(chunk, n)
    last = np.minimum(np.arange(chunk, n + (-n % chunk) + 1, chunk), n) - 1
    picks = np.minimum(np.searchsorted(limits, ordered[last]), len(limits) - 1)
    weights = np.bincount(picks, minlength=len(limits)) / len(picks)
    return {len(limits): list(weights)}, limits


def build_train(args, case):
    rng = np.random.default_rng(0)
    head = "saf" if case == "saf" else "sgr"
    name = "gsc" if case == "gsc" else "vse"
    batch_size = args.batch or BATCH[case]
    method = methods.build_method(name, {"num_networks": 1})
    tx = optax.chain(optax.clip_by_global_norm(2.0), optax.adam(2e-4))
    graphdef, state = state_lib.create(
        model_fn=model_fn(args, head),
        tx=tx,
        memory=method.init_memory(InitContext(batch_size, None, None, None)),
        num_networks=1,
        seed=0,
    )
    if name == "gsc":  # soft labels drawn uniformly, so the purified masks are not trivial
        labels = jnp.asarray(rng.uniform(size=(1, batch_size)))
        samples = dict(state.memory.samples, labels=labels)
        state = state._replace(memory=Memory(samples, state.memory.state))
    mesh = mesh_lib.make_mesh(0)
    state = mesh_lib.replicate(state, mesh)
    batch = random_batch(rng, batch_size, args.length)
    lengths = batch["length"]
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=batch_size),
        static_argnums=2,
        donate_argnums=0,
        compiler_options=options(args),
    )
    phase = 1 if name == "gsc" else 0
    with jax.set_mesh(mesh):
        compiled = step.lower(state, batch, phase).compile()
    holder = [state]

    def run():
        with jax.set_mesh(mesh):
            holder[0], metrics = step(holder[0], batch, phase)
            jax.block_until_ready(metrics)

    return compiled, run, batch_size, lengths


def build_eval(args):
    rng = np.random.default_rng(0)
    model = model_fn(args, "sgr")(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = (nnx.to_pure_dict(params), nnx.to_pure_dict(rest))
    images = random_batch(rng, args.eval_images, args.length)
    texts = random_batch(rng, args.eval_captions, args.length)

    @jax.jit
    def encode(state, images, texts):
        m = nnx.merge(graphdef, *state)
        return m.encode_image({"regions": images["regions"]}), m.encode_text(texts)

    image, text = encode(state, images, texts)

    @functools.partial(jax.jit, compiler_options=options(args))
    def block(state, image, text):
        return nnx.merge(graphdef, *state).similarity(image, text)

    compiled = block.lower(state, image, text).compile()

    def run():
        jax.block_until_ready(block(state, image, text))

    return compiled, run, args.eval_images * args.eval_captions, texts["length"]


def peak(args):
    out = {"case": "peak", "machine": machine()}
    n = 4096
    dtypes = ["float32"] + (["bfloat16"] if jax.devices()[0].platform == "gpu" else [])
    for name in dtypes:
        a = jnp.ones((n, n), name)
        f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        times = timed(
            lambda f=f, a=a: jax.block_until_ready(f(a, a)), warmup=2, repeats=args.repeats + 2
        )
        out[f"peak_{name}_gflops"] = 2 * n**3 / statistics.median(times) / 1e9
    return out


def profile_case(args, case):
    if case == "eval":
        compiled, run, pairs, lengths = build_eval(args)
    else:
        compiled, run, pairs, lengths = build_train(args, case)
    program = Program(compiled.as_text())
    weights, limits = branch_weights(lengths, args.chunk, args.length, args.groups)
    executed = program.flops(weights)
    padded_weights = None if weights is None else {len(limits): [0.0] * (len(limits) - 1) + [1.0]}
    padded = program.flops(padded_weights)
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    memory = compiled.memory_analysis()
    times = timed(run, warmup=1, repeats=args.repeats)
    t = statistics.median(times)
    top = []
    kinds = profile_by_kind(program, run, top)
    profiled = sum(kinds.values()) or 1.0
    flops = sum(executed.values())
    return {
        "case": case,
        "pairs": pairs,
        "seconds": t,
        "seconds_range": [min(times), max(times)],
        "pairs_per_s": pairs / t,
        "gflop_executed": flops / 1e9,
        "gflop_matmul": executed.get("matmul", 0.0) / 1e9,
        "gflop_padded": sum(padded.values()) / 1e9,
        "gflop_xla_cost_analysis": float(xla.get("flops", 0.0)) / 1e9,
        "gflops_achieved": flops / t / 1e9,
        "memory_args_gib": memory.argument_size_in_bytes / 2**30,
        "memory_temp_gib": memory.temp_size_in_bytes / 2**30,
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "profile_percent": {k: 100 * v / profiled for k, v in kinds.items()},
        "profiled_seconds": profiled,
        "top_instructions": top,
        "settings": {
            "length": args.length,
            "groups": args.groups,
            "chunk": args.chunk,
            "remat": args.remat,
            "dtype": args.dtype,
            "limits": list(limits),
            "compiler_options": options(args),
        },
    }


def table(rows, peak_row):
    f32 = peak_row["peak_float32_gflops"]
    print(f"# {peak_row['machine']}")
    line = f"# measured peak: float32 {f32:.0f} GFLOP/s"
    if "peak_bfloat16_gflops" in peak_row:
        line += f", bfloat16 {peak_row['peak_bfloat16_gflops']:.0f} GFLOP/s"
    print(line)
    print(
        "| case | s/call | pairs/s | GFLOP (executed / padded / XLA cost) | GFLOP/s | "
        "of peak | XLA args + temp | peak RSS | " + " | ".join(KINDS) + " |"
    )
    print("|---" * (9 + len(KINDS)) + "|")
    for r in rows:
        profile = " | ".join(f"{r['profile_percent'][k]:.0f}%" for k in KINDS)
        print(
            f"| {r['case']} | {r['seconds']:.2f} | {r['pairs_per_s']:,.0f} | "
            f"{r['gflop_executed']:,.0f} / {r['gflop_padded']:,.0f} / "
            f"{r['gflop_xla_cost_analysis']:,.0f} | {r['gflops_achieved']:.0f} | "
            f"{100 * r['gflops_achieved'] / f32:.0f}% | "
            f"{r['memory_args_gib']:.2f} + {r['memory_temp_gib']:.2f} GiB | "
            f"{r['rss_gib']:.1f} GiB | {profile} |"
        )
        if r["case"] == "eval":
            print(f"#   eval: the Flickr30K test (5,000,000 pairs) {5e6 / r['pairs_per_s']:.0f} s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("all", "peak", *CASES), default="all")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch", type=int, default=0, help="0: 128 (sgr, saf), 96 (gsc)")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--remat", default="auto", choices=("auto", "full", "projections", "none"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--eval-images", type=int, default=100)
    parser.add_argument("--eval-captions", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--xla-defaults", action="store_true", help="XLA's own options, not ncljax.backend's"
    )
    args = parser.parse_args()
    if args.case == "peak":
        print(json.dumps(peak(args)))
        return
    if args.case != "all":
        print(json.dumps(profile_case(args, args.case)))
        return
    forwarded = [a for a in sys.argv[1:] if not a.startswith("--cases")]

    def child(case):
        cmd = [sys.executable, os.path.abspath(__file__), *forwarded, f"--case={case}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    peak_row = child("peak")
    rows = [child(case) for case in args.cases.split(",")]
    table(rows, peak_row)
    print("# JSON " + json.dumps({"peak": peak_row, "rows": rows}))


if __name__ == "__main__":
    main()
