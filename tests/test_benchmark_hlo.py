"""Tests for benchmarks/_hlo.py: FLOPs of a compiled program, by hand-worked counts."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _hlo import Program, profile_by_kind


def _program(fn, *args):
    return Program(jax.jit(fn).lower(*args).compile().as_text())


def test_loop_bodies_count_their_trip_count():
    w = jnp.ones((64, 32))
    x = jnp.ones((8, 16, 64))
    program = _program(lambda x: jax.lax.map(lambda xi: xi @ w, x), x)
    # 8 iterations of a [16, 64] x [64, 32] product: 2 * 16 * 32 * 64 FLOPs each.
    assert program.flops()["matmul"] == 8 * 2 * 16 * 32 * 64


def test_conditional_branches_count_with_their_weights():
    w = jnp.ones((64, 64))

    def body(x):
        index = (x.sum() > 0).astype(jnp.int32)
        short = lambda x: x[:, :16] @ w[:16]
        full = lambda x: x @ w
        return jax.lax.switch(index, [short, full], x)

    x = jnp.ones((4, 8, 64))
    program = _program(lambda x: jax.lax.map(body, x), x)
    short, full = 2 * 8 * 64 * 16, 2 * 8 * 64 * 64
    assert program.flops()["matmul"] == 4 * full  # default: the costliest branch
    assert program.flops({2: [0.75, 0.25]})["matmul"] == 4 * (0.75 * short + 0.25 * full)
    assert program.flops("cheapest")["matmul"] == 4 * short
    assert program.traffic("cheapest") < program.traffic()


def test_traffic_counts_each_kernels_operands_and_outputs_once():
    x = jnp.ones((256, 512), jnp.float32)
    y = jnp.ones((256, 512), jnp.bfloat16)
    # one fused elementwise kernel: reads x (4 B) and y (2 B), writes a float32 (4 B)
    program = _program(lambda x, y: jnp.tanh(x * 1.5 + y.astype(jnp.float32)), x, y)
    assert program.traffic() == 256 * 512 * (4 + 2 + 4)
    # a matrix product [256, 512] x [512, 128]: both operands in, the product out
    w = jnp.ones((512, 128), jnp.float32)
    program = _program(lambda x, w: x @ w, x, w)
    assert program.traffic() == 4 * (256 * 512 + 512 * 128 + 256 * 128)


def test_traffic_of_a_loop_counts_its_trip_count():
    x = jnp.ones((64, 64), jnp.float32)
    once = _program(lambda v: jnp.sin(v) * 2, x).traffic()
    looped = _program(lambda v: jax.lax.fori_loop(0, 10, lambda i, v: jnp.sin(v) * 2, v), x)
    # the body's kernel 10 times, a copy of the (not donated) input into the loop's buffer
    # and the loop counter's few bytes per trip; without trip counts it would read ~2x once
    assert 10 * once <= looped.traffic() <= 11 * once + 10 * 64


def test_traffic_of_a_loop_over_row_blocks_reads_each_block_once():
    x = jnp.ones((64, 256), jnp.float32)
    whole = _program(lambda v: jnp.sin(v).sum(1), x).traffic()

    def blocks(v):  # eight blocks of 8 rows, each sliced out of the matrix in the loop
        return jax.lax.map(jnp.sin, v.reshape(8, 8, 256)).sum(2).reshape(64)

    looped = _program(blocks, x).traffic()
    # each trip reads its block and writes its rows in place (8 KiB each), not the whole
    # matrix (64 KiB); around the loop: its output buffer set to 0, and the sum
    assert whole < looped < 5 * whole
    # what it would count if every trip read and wrote the whole matrix
    assert 3 * looped < 8 * 2 * 64 * 256 * 4


def test_profile_sums_each_kind_of_kernel_over_its_calls():
    x = jnp.ones((8, 64, 128), jnp.float32)
    fn = jax.jit(lambda v: jax.lax.map(lambda b: jnp.exp(b).sum(1), v))
    program = Program(fn.lower(x).compile().as_text())
    fn(x).block_until_ready()
    top, stems = [], {}
    kinds = profile_by_kind(program, lambda: fn(x).block_until_ready(), top, stems)
    # every traced instruction is counted once by kind and once under its name's stem
    assert abs(sum(kinds.values()) - sum(t for t, _ in stems.values())) < 1e-9
    assert all(not name[-1].isdigit() for name in stems)
    # the loop body's instructions run once per block of the map (8), under one stem each
    assert max(calls for _, calls in stems.values()) >= 8
    assert top and all(seconds >= 0 for seconds, *_ in top)
