r"""The train step of each method on a folder of vectors, at web-scale batches, against
the machine's measured float32 peak (a roofline).

  python benchmarks/vectors_step.py                                  # every method and batch
  python benchmarks/vectors_step.py --methods=infonce,gsc --batches=1024,4096
  python benchmarks/vectors_step.py --folder=/tmp/vec512 --dim=512   # write once, then reuse
  python benchmarks/vectors_step.py --case=gsc:2048                  # one case, one JSON line
  python benchmarks/vectors_step.py --case=peak                      # the peak alone
  python benchmarks/vectors_step.py --methods=infonce --batches=32 --repeats=1 --peak-size=512
  python benchmarks/vectors_step.py --case=srem:4096 --profile       # where the step's time goes
  python benchmarks/vectors_step.py --case=srem:4096 --set=method_kwargs.block_rows=128

The folder (``ncljax.data.vectors``'s layout, written by ``vectors.write_folder``, float16
unit vectors): ``2 x`` the largest batch training pairs of ``--dim`` image vectors
``x ~ N(0, I)`` and captions ``t = x W + 0.5 e`` (a fixed random ``W``), ``--mismatched``
(0.2) of the captions moved to another image (``vectors.mismatch_texts``), and clean val
and test splits of ``--eval-images`` pairs; with ``--classes=C`` also class labels, which
UOT-RCL needs (``--methods=uot_rcl --classes=10``; the default methods are those
without). Without ``--folder`` it goes to a temporary directory, deleted at the end; with
``--folder`` it is written there unless a folder is already there, and kept.

Each case builds the method as ``ncljax train --config=<method>:vectors
--config.data.folder=DIR --config.train.batch_size=B`` does (``ncljax.config.get``, then
the trainer's own ``ncljax.train.loop._build``: data, method, pairs, mesh, optimiser,
model and state), and jits ``step.make_train_step`` with the trainer's arguments. It takes
the method's first main epoch (the first whose ``plan_fn(epoch).phase`` is not the
warm-up; epoch 0 for the baselines, which have none), starts it as the trainer does
(epoch counter, the refresh of an untrained model: the statistics pass and the division,
an optimiser reset where the plan asks for one), asks the library for the epoch's passes
(``passes.epoch_stream_sets`` / ``plan_passes``: the ``StepSpec``; network 0's pass of a
method that trains its networks in turn) and reads the pass's first step's batches with
``pipeline.stream_batches`` (a main batch, and an auxiliary one for the co-teaching
methods: a tuple, as the trainer passes them). It then calls the compiled step on them
(``(state, batches, clean, network)``, the spec being static), once to warm up, then
``--repeats`` times, blocking on the new state and the metrics each time.

Each case runs in its own process (``--case``), after a ``peak`` case: a 4096^3 float32
matrix product (``--peak-size``), as ``step_profile.py`` measures it; a case that fails
(e.g. out of memory) gets a ``failed`` row and the others go on. Prints one JSON line
per case as it finishes, then a markdown table and a ``# JSON`` line of everything.
Columns:

* ``nets``: networks in the state / networks the step trains (in turn: one);
* ``ms/step``: the median wall time of one step (the range is in the JSON);
* ``pairs/s``, ``us/pair``: ``B`` over that time, and its inverse (``B`` counts a
  batch's padding rows too: the step computes them; ``real_pairs`` in the JSON says how
  many of each batch are real, e.g. fewer in a co-teaching method's clean batch when the
  division of the untrained model sets many pairs aside);
* ``GFLOP/step``: FLOPs of the compiled program (``_hlo.Program``: every ``dot``
  ``2 x out x contracted``, other array instructions one per output element, loop
  bodies times their trip counts);
* ``per-pair / BxB / const``: that count split as ``c0 + c1 B + c2 B^2``, solved exactly
  from the programs compiled at ``B``, ``B/2`` and ``B/4`` (only compiled, not run): the
  encoders and per-pair losses grow with ``B``, the in-batch similarity matrices with
  ``B^2``, the optimiser update not at all;
* ``GFLOP/s``, ``of peak``: achieved FLOP rate, and its fraction of the measured peak;
* ``ms at peak``: the step's FLOPs at the peak rate, the roofline's compute bound;
* ``GB/step``, ``ms at bandwidth``: the bytes the compiled program moves through memory
  (``_hlo.Program.traffic``: each executed kernel reads its operands and writes its
  outputs once, loops times their trip counts, each conditional at its costliest branch
  or, ``--branches=cheapest``, its cheapest; a lower bound) and that traffic at the
  measured bandwidth (a STREAM triad ``x * s + y`` over ``--stream-size`` float32
  elements, in the ``peak`` case), the roofline's memory bound;
* ``of roofline``: the larger of the two bounds over the measured step;
* with ``--profile``, the JSON's ``profile``: one more call traced by ``jax.profiler``,
  its seconds by kind of kernel (``_hlo.profile_by_kind``), the 25 costliest kinds of
  kernel (instructions summed by name without their numeric suffix, with their calls:
  e.g. every ``wrapped_reduce-window``) and the 15 costliest instructions; ``--set``
  changes a config field of every case, as ``--config.<field>=<value>`` would;
* ``enc x``, ``BxB x``: the fitted matmul FLOPs of each part over an InfoNCE step's of
  the trained networks (analytic: per trained network, a forward and backward of the
  MLP towers, ``2 B sum(d_in d_out)`` forward and twice that backward but the first
  layer's input gradient, and of the ``B x B`` cosine matrix of each image view,
  ``2 B^2 E`` forward and twice that backward): ``infonce`` reads 1.00 and 1.00, a
  method's extra passes and matrices show as multiples.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import machine, set_cpu_devices, timed

import ncljax

if __name__ == "__main__":
    # as the commands do: the step's buffers on huge pages where the kernel gives them
    # (ncljax._huge_pages_environment; NCLJAX_HUGE_PAGES=0 measures without)
    ncljax._restart_with_huge_pages()
set_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _hlo import Program, profile_by_kind  # noqa: E402

from ncljax import backend, models  # noqa: E402
from ncljax import config as config_lib  # noqa: E402
from ncljax.data import pipeline, vectors  # noqa: E402
from ncljax.methods.base import WARMUP  # noqa: E402
from ncljax.train import loop, passes  # noqa: E402
from ncljax.train import mesh as mesh_lib  # noqa: E402
from ncljax.train import step as step_lib  # noqa: E402
from ncljax.train.refresh import Refresher  # noqa: E402

METHODS = ("infonce", "gsc", "ncr", "pc2", "srem", "ugncl")
BATCHES = (1024, 2048, 4096, 8192)


# ----------------------------------------------------------------------------- the folder


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def write_folder(
    folder: str,
    *,
    train_pairs: int,
    dim: int,
    eval_images: int,
    mismatched: float,
    classes: int = 0,
):
    """A vectors folder of ``train_pairs`` pairs (one caption per image), float16 unit
    vectors, ``mismatched`` of the training captions describing another image; with
    ``classes``, each image's class (the largest of its first ``classes`` coordinates),
    20% of the training labels replaced by another class."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((dim, dim), np.float32) / np.sqrt(dim)
    splits = {}
    for split, n in (("train", train_pairs), ("val", eval_images), ("test", eval_images)):
        x = rng.standard_normal((n, dim), np.float32)
        t = x @ w + 0.5 * rng.standard_normal((n, dim), np.float32)
        if split == "train" and mismatched > 0:
            source, _ = vectors.mismatch_texts(n, 1, rate=mismatched, seed=0)
            t = t[source]
        splits[split] = dict(images=_unit(x), texts=_unit(t))
        if classes:
            labels = np.argmax(x[:, :classes], axis=1)
            if split == "train":
                flip = rng.random(n) < 0.2
                labels[flip] = (labels[flip] + rng.integers(1, classes, flip.sum())) % classes
            splits[split]["labels"] = labels
    return vectors.write_folder(folder, splits, dtype=np.float16)


def folder_pairs(folder: str) -> int:
    """Training pairs of an existing folder (0: none there)."""
    path = vectors.path_of(folder, "train", "texts")
    if not os.path.exists(path):
        return 0
    return int(np.load(path, mmap_mode="r").shape[0])


# ----------------------------------------------------------------------------- the cases


def peak(args) -> dict:
    """The measured peak: a ``--peak-size`` (4096) cubed float32 matrix product, as
    ``step_profile.py`` measures it."""
    n = args.peak_size
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    times = timed(lambda: jax.block_until_ready(f(a, a)), warmup=2, repeats=args.repeats + 2)
    # memory bandwidth: a STREAM triad x * s + y over float32 arrays far larger than the cache
    m = args.stream_size
    x, y = jnp.ones((m,), jnp.float32), jnp.full((m,), 2.0, jnp.float32)
    triad = jax.jit(lambda x, y: x * 1.5 + y)
    stream = timed(lambda: jax.block_until_ready(triad(x, y)), warmup=2, repeats=args.repeats + 2)
    return {
        "case": "peak",
        "machine": machine(),
        "peak_float32_gflops": 2 * n**3 / statistics.median(times) / 1e9,
        "peak_size": n,
        "bandwidth_gbs": 3 * 4 * m / statistics.median(stream) / 1e9,
        "stream_size": m,
    }


def first_main_epoch(method, epochs: int) -> int:
    """The first epoch whose plan is not the warm-up (0 for a method without one)."""
    main = [e for e in range(epochs) if method.plan_fn(e).phase != WARMUP]
    return main[0] if main else 0


def _mlp_flops(dims) -> int:
    """Matmul FLOPs per example of an MLP with layer widths ``dims``, forward and backward:
    ``2 sum(d_in d_out)`` forward, twice that backward (the weights' and the inputs'
    gradients) but for the first layer's input gradient (the data needs none)."""
    forward = 2 * sum(a * b for a, b in itertools.pairwise(dims))
    return 3 * forward - 2 * dims[0] * dims[1]


def reference_flops(config, batch: dict, batch_size: int, trained: int) -> dict:
    """An InfoNCE step's matmul FLOPs of ``trained`` networks: the towers' forward and
    backward (``encoder``) and the cosine matrix of each image view (``bxb``)."""
    m = config.model
    image_field, text_field = (f[0] for f in models.input_fields(m))
    d_img, d_txt = batch[image_field].shape[-1], batch[text_field].shape[-1]
    views = int(m.get("views", 1))
    image = _mlp_flops([d_img, *m.cosine.image_hidden, m.embed_dim])
    text = _mlp_flops([d_txt, *m.text_mlp.hidden, m.embed_dim])
    return {
        "encoder": trained * float(batch_size) * (views * image + text),
        "bxb": trained * 3.0 * 2 * batch_size**2 * m.embed_dim * views,
        "dims": [d_img, d_txt, list(m.cosine.image_hidden), m.embed_dim, views],
    }


def fit(points: dict[int, float]) -> tuple[float, float, float]:
    """``(c0, c1, c2)`` of ``c0 + c1 b + c2 b^2`` through three ``{b: flops}`` points."""
    b = np.array(sorted(points), np.float64)
    y = np.array([points[k] for k in sorted(points)], np.float64)
    return tuple(float(c) for c in np.linalg.solve(np.vander(b, 3, increasing=True), y))


def parse_sets(sets) -> dict:
    """``--set`` fields as config overrides: ``field=value``, the value a Python literal
    where it reads as one (``method_kwargs.block_rows=128``), a string otherwise."""
    out = {}
    for item in sets:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise SystemExit(f"--set takes field=value, got {item!r}")
        try:
            out[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[field] = value
    return out


def build(args, method_name: str, batch_size: int):
    """The step of ``method_name``'s first main epoch at ``batch_size``, as the trainer
    builds and calls it."""
    overrides = {"data.folder": args.folder, "train.batch_size": batch_size}
    config = config_lib.get(f"{method_name}:vectors", overrides | parse_sets(args.set))
    config, b = loop._build(config, None)  # the trainer's own: checks, data, method, state
    method, pairs, mesh, tx, graphdef = b.method, b.pairs, b.mesh, b.tx, b.graphdef
    n = pairs.num_records
    epoch = first_main_epoch(method, config.train.epochs)
    plan = method.plan_fn(epoch)
    replicated, data_sharding = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
    step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=n),
        static_argnums=2,
        donate_argnums=0,
        compiler_options=backend.compiler_options(),
        in_shardings=(replicated, data_sharding, replicated, replicated),
        out_shardings=(replicated, replicated),
    )
    state = mesh_lib.replicate(b.state, mesh)
    with jax.set_mesh(mesh):
        # loop._start_epoch: the epoch counter, the refresh, an optimiser reset.
        state = state._replace(epoch=jnp.full_like(state.epoch, epoch))
        if args.at_step:  # a schedule that follows the step (UGNCL's count) reads it
            state = state._replace(step=jnp.full_like(state.step, args.at_step))
        if plan.refresh:
            refresh = Refresher(graphdef, method, pairs, mesh, config, config.train.epochs)
            state, _ = refresh(state, epoch)
        if plan.reset_optimizer:
            shardings = jax.tree.map(lambda x: x.sharding, state.opt_state)
            fresh = jax.jit(jax.vmap(tx.init), out_shardings=shardings)(state.params)
            state = state._replace(opt_state=fresh)
    stream_sets = passes.epoch_stream_sets(method, plan, state.memory, n, method.num_networks)
    one_pass = passes.plan_passes(
        method, plan, stream_sets, epoch=epoch, batch_size=batch_size, seed=config.seed
    )[0]
    reader = pipeline.stream_batches(
        pairs.record_fn,
        n,
        one_pass.streams,
        batch_size=batch_size,
        num_steps=1,
        num_threads=config.data.num_threads,
        prefetch=config.data.prefetch,
    )
    with pipeline.reading(reader) as iterator:
        host = next(iterator)
    batches = tuple(pipeline.to_device(x, data_sharding) for x in host)
    clean = mesh_lib.replicate(pairs.clean, mesh)
    network = np.int32(one_pass.network or 0)
    trained = 1 if plan.in_turn else method.num_networks
    info = {
        "config": config,
        "epoch": epoch,
        "spec": one_pass.spec,
        "networks": method.num_networks,
        "trained": trained,
        "streams": [len(s.indices) for s in one_pass.streams],
        "real_pairs": [int(np.asarray(x["mask"]).sum()) for x in host],
        "host_batch": host[0],
    }
    return step, state, batches, clean, network, mesh, info


def step_case(args, method_name: str, batch_size: int) -> dict:
    step, state, batches, clean, network, mesh, info = build(args, method_name, batch_size)
    spec, data_sharding = info["spec"], mesh_lib.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        tic = time.perf_counter()
        compiled = step.lower(state, batches, spec, clean, network).compile()
        compile_s = time.perf_counter() - tic
        program = Program(compiled.as_text())
        branches = None if args.branches == "costliest" else args.branches
        flops = program.flops(branches)
        points = {batch_size: flops}
        if args.split and batch_size % (4 * jax.device_count()) == 0:
            for b in (batch_size // 2, batch_size // 4):
                shapes = jax.tree.map(
                    lambda x, b=b: jax.ShapeDtypeStruct(
                        (b, *x.shape[1:]), x.dtype, sharding=data_sharding
                    ),
                    batches,
                )
                lowered = step.lower(state, shapes, spec, clean, network)
                points[b] = Program(lowered.compile().as_text()).flops(branches)
        memory = compiled.memory_analysis()
        holder = [state]

        def run():
            holder[0], metrics = compiled(holder[0], batches, clean, network)
            jax.block_until_ready((holder[0], metrics))

        times = timed(run, warmup=1, repeats=args.repeats)
        profile = None
        if args.profile:  # one more call, traced
            top, stems = [], {}
            kinds = profile_by_kind(program, run, top, stems)
            costliest = sorted(stems.items(), key=lambda kv: -kv[1][0])[:25]
            profile = {
                "seconds_by_kind": kinds,
                "kernels": [[name, round(t, 4), calls] for name, (t, calls) in costliest],
                "instructions": top,
            }
    t = statistics.median(times)
    total = sum(flops.values())
    out = {
        "case": f"{method_name}:{batch_size}",
        "method": method_name,
        "batch": batch_size,
        "networks": info["networks"],
        "trained_networks": info["trained"],
        "epoch": info["epoch"],
        "at_step": args.at_step,
        "branches": args.branches,
        "spec": info["spec"]._asdict(),
        "streams": info["streams"],
        "real_pairs": info["real_pairs"],
        "seconds": t,
        "seconds_range": [min(times), max(times)],
        "compile_seconds": compile_s,
        "pairs_per_s": batch_size / t,
        "us_per_pair": 1e6 * t / batch_size,
        "gflop": total / 1e9,
        "gflop_matmul": flops.get("matmul", 0.0) / 1e9,
        "gflops_achieved": total / t / 1e9,
        "gb_traffic": program.traffic(branch_weights=branches) / 1e9,
        "memory_args_gib": memory.argument_size_in_bytes / 2**30,
        "memory_temp_gib": memory.temp_size_in_bytes / 2**30,
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if profile is not None:
        out["profile"] = profile
    if len(points) == 3:
        c0, c1, c2 = fit({b: sum(f.values()) for b, f in points.items()})
        _, m1, m2 = fit({b: f.get("matmul", 0.0) for b, f in points.items()})
        ref = reference_flops(info["config"], info["host_batch"], batch_size, info["trained"])
        out |= {
            "fit_batches": sorted(points),
            "gflop_per_pair_part": c1 * batch_size / 1e9,
            "gflop_bxb_part": c2 * batch_size**2 / 1e9,
            "gflop_constant": c0 / 1e9,
            "gflop_matmul_per_pair_part": m1 * batch_size / 1e9,
            "gflop_matmul_bxb_part": m2 * batch_size**2 / 1e9,
            "reference_gflop_encoder": ref["encoder"] / 1e9,
            "reference_gflop_bxb": ref["bxb"] / 1e9,
            "reference_dims": ref["dims"],
            "encoder_x": m1 * batch_size / ref["encoder"],
            "bxb_x": m2 * batch_size**2 / ref["bxb"],
        }
    return out


# ----------------------------------------------------------------------------- the table


def table(rows, peak_row) -> None:
    f32 = peak_row.get("peak_float32_gflops")
    print(f"# {peak_row.get('machine', machine())}")
    bw = peak_row.get("bandwidth_gbs")
    if f32:
        n = peak_row["peak_size"]
        print(f"# measured peak: float32 {f32:.0f} GFLOP/s ({n}^3 matrix product)")
    if bw:
        m = peak_row["stream_size"]
        print(f"# measured bandwidth: {bw:.1f} GB/s (a float32 triad over {m:,} elements)")
    print(
        "| method | nets | B | ms/step | pairs/s | us/pair | GFLOP/step | per-pair / BxB / const"
        " | GFLOP/s | of peak | ms at peak | GB/step | ms at bandwidth | of roofline"
        " | enc x | BxB x |"
    )
    print("|---" * 16 + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | | {r['batch']} | failed: {r['error']} |" + " |" * 12)
            continue
        split, enc, bxb = "", "", ""
        if "gflop_bxb_part" in r:
            split = (
                f"{r['gflop_per_pair_part']:,.1f} / {r['gflop_bxb_part']:,.1f} / "
                f"{r['gflop_constant']:,.2f}"
            )
            enc, bxb = f"{r['encoder_x']:.2f}", f"{r['bxb_x']:.2f}"
        of_peak = f"{100 * r['gflops_achieved'] / f32:.0f}%" if f32 else ""
        at_peak = f"{1e3 * r['gflop'] / f32:.1f}" if f32 else ""
        at_bw, of_roof = "", ""
        if bw and f32 and "gb_traffic" in r:
            memory_s = r["gb_traffic"] / bw
            at_bw = f"{1e3 * memory_s:.1f}"
            roof = max(r["gflop"] / f32, memory_s)  # the slower of compute and memory
            of_roof = f"{100 * roof / r['seconds']:.0f}%"
        print(
            f"| {r['method']} | {r['networks']}/{r['trained_networks']} | {r['batch']} | "
            f"{1e3 * r['seconds']:.1f} | {r['pairs_per_s']:,.0f} | {r['us_per_pair']:.1f} | "
            f"{r['gflop']:,.1f} | {split} | {r['gflops_achieved']:.0f} | {of_peak} | "
            f"{at_peak} | {r.get('gb_traffic', 0.0):,.2f} | {at_bw} | {of_roof} | {enc} | {bxb} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--case", default="all", help="all, peak or METHOD:BATCH")
    parser.add_argument("--folder", default="", help="a vectors folder (written if absent)")
    parser.add_argument("--dim", type=int, default=512, help="vector dimension of a new folder")
    parser.add_argument("--mismatched", type=float, default=0.2)
    parser.add_argument(
        "--classes",
        type=int,
        default=0,
        help="class labels in a new folder (0: none), for the label methods (uot_rcl)",
    )
    parser.add_argument("--eval-images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--at-step",
        type=int,
        default=0,
        help="the optimisation step the state starts at (0: a fresh run's); UGNCL's "
        "hard-negative count anneals with it, to its floor after about 600 steps",
    )
    parser.add_argument(
        "--branches",
        choices=("costliest", "cheapest"),
        default="costliest",
        help="which branch of each conditional the FLOP and byte counts take (the step "
        "runs one; 'cheapest': e.g. UGNCL's warm-up objective skipped once a division is "
        "usable and its hard-negative count at its floor)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="a config field of every case, field=value (repeatable), e.g. "
        "method_kwargs.block_rows=128",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace one more call of each case (jax.profiler): seconds by kind of kernel, "
        "the costliest kinds (instructions summed by name) and instructions, in its JSON",
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--peak-size", type=int, default=4096, help="of the peak's matmul")
    parser.add_argument(
        "--stream-size", type=int, default=2**26, help="elements of the bandwidth's arrays"
    )
    parser.add_argument(
        "--no-split", dest="split", action="store_false", help="skip the B/2, B/4 compiles"
    )
    args = parser.parse_args()
    if args.case == "peak":
        print(json.dumps(peak(args)))
        return
    if args.case != "all":
        method_name, batch = args.case.split(":")
        print(json.dumps(step_case(args, method_name, int(batch))))
        return

    batches = [int(b) for b in args.batches.split(",")]
    methods_ = args.methods.split(",")
    temporary = not args.folder
    folder = tempfile.mkdtemp(prefix="ncljax_vectors_step_") if temporary else args.folder
    try:
        if folder_pairs(folder) == 0:
            tic = time.perf_counter()
            write_folder(
                folder,
                train_pairs=2 * max(batches),
                dim=args.dim,
                eval_images=args.eval_images,
                mismatched=args.mismatched,
                classes=args.classes,
            )
            print(f"# wrote {folder} in {time.perf_counter() - tic:.1f} s", flush=True)
        have = folder_pairs(folder)
        print(f"# folder {folder}: {have} training pairs", flush=True)
        if have < 2 * max(batches):
            print(f"# note: fewer than 2 x {max(batches)} training pairs", flush=True)
        forwarded = [
            f"--repeats={args.repeats}",
            f"--devices={args.devices}",
            f"--peak-size={args.peak_size}",
            f"--stream-size={args.stream_size}",
            f"--at-step={args.at_step}",
            f"--branches={args.branches}",
            *([] if args.split else ["--no-split"]),
            *(f"--set={item}" for item in args.set),
            *(["--profile"] if args.profile else []),
        ]

        def child(case):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *forwarded,
                f"--folder={folder}",
                f"--case={case}",
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
                sys.stderr.write(done.stderr[-4000:])
                return {"case": case, "error": f"exit {done.returncode}: {tail[0][:200]}"}
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            return row

        peak_row = child("peak")
        rows = []
        for m in methods_:
            for b in batches:
                row = child(f"{m}:{b}")
                row.setdefault("method", m)
                row.setdefault("batch", b)
                rows.append(row)
        table(rows, peak_row)
        print("# JSON " + json.dumps({"peak": peak_row, "rows": rows}))
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
