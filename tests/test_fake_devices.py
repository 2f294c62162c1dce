"""The test session's 8 fake CPU devices survive programs dispatched far ahead.

XLA's CPU client lets each device hold 32 programs in flight; a further program's parts
wait for a slot on the client's thread pool, holding their threads. With a pool of one
thread per device they can starve the running program's collective of a participant and
the process deadlocks until XLA aborts it (``tests/conftest.py`` says why PJRT_NPROC is set).
The check runs in a child process, so that a deadlock fails this test instead of killing
the worker that runs it.
"""

import logging
import math
import os
import subprocess
import sys

import jax

PROGRAM = """
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
assert len(jax.devices()) == 8


@jax.jit
def step(x):
    def block(a):
        return jax.lax.psum(jnp.sin(a) @ jnp.ones((a.shape[1], a.shape[1])), "data") / 8.0

    y = jax.shard_map(block, mesh=mesh, in_specs=P("data"), out_specs=P())(x)
    return x + 1e-3 * y.sum()


x = jax.device_put(jnp.ones((8 * 64, 256)), NamedSharding(mesh, P("data")))
for _ in range(400):  # never blocks: Python runs hundreds of programs ahead of the devices
    x = step(x)
    x = x * 1.0001  # an eager op on the sharded array: another 8-device program
print(float(x[0, 0]))
"""


def test_programs_dispatched_far_ahead_on_eight_devices_do_not_deadlock(devices):
    # The session's environment (8 devices, PJRT_NPROC), with a short terminate timeout so
    # that a deadlock aborts the child in about 30-50 s rather than minutes. On a machine
    # with 16 cores or more the pool is large enough without PJRT_NPROC.
    flags = os.environ["XLA_FLAGS"] + " --xla_cpu_collective_call_terminate_timeout_seconds=30"
    env = dict(os.environ, XLA_FLAGS=flags)
    child = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, (
        f"8-device programs dispatched ahead deadlocked (exit {child.returncode}, "
        f"PJRT_NPROC={env.get('PJRT_NPROC')}):\n{child.stderr[-2000:]}"
    )
    assert math.isfinite(float(child.stdout.split()[-1]))
    assert jax.device_count() == 8


def test_a_mesh_of_cpu_devices_with_one_pool_thread_each_is_warned_about(
    devices, monkeypatch, caplog
):
    from ncljax.train import mesh as mesh_lib

    with caplog.at_level(logging.WARNING):
        mesh_lib.make_mesh(0)  # this session: 8 devices, PJRT_NPROC=16
        mesh_lib.make_mesh(1)  # one device: no collectives
    assert "PJRT_NPROC" not in caplog.text
    monkeypatch.setenv("PJRT_NPROC", "8")
    with caplog.at_level(logging.WARNING):
        mesh_lib.make_mesh(0)
    assert "8 CPU devices share XLA's pool of 8 threads" in caplog.text
    assert "Set PJRT_NPROC=16" in caplog.text


def test_cpu_pool_threads(monkeypatch):
    from ncljax.train.mesh import cpu_pool_threads

    monkeypatch.setenv("PJRT_NPROC", "12")
    monkeypatch.setenv("NPROC", "3")
    assert cpu_pool_threads(8) == 12
    assert cpu_pool_threads(16) == 16  # never fewer threads than devices
    monkeypatch.setenv("PJRT_NPROC", " 20\n")  # read as XLA reads it
    assert cpu_pool_threads(8) == 20
    monkeypatch.setenv("PJRT_NPROC", "0")  # the first that reads as a number decides
    assert cpu_pool_threads(8) == 8
    monkeypatch.setenv("PJRT_NPROC", "many")  # not a number: NPROC next
    assert cpu_pool_threads(2) == 3
    monkeypatch.setenv("PJRT_NPROC", "\u00b2")  # a digit that is no integer
    assert cpu_pool_threads(2) == 3
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.delenv("NPROC")
    cores = len(os.sched_getaffinity(0))
    assert cpu_pool_threads(1) == cores
    assert cpu_pool_threads(cores + 5) == cores + 5
