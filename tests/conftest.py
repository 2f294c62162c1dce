"""Test setup: eight fake CPU devices, so every test can compare 1 device with 8, and one
compilation cache per test session.

Many tests compile the same programs (the step of a tiny config, the evaluation encoders);
on 2 CPU cores compilation is most of their time. JAX's persistent compilation cache in a
directory of this session (shared by the xdist workers, removed at the end) compiles each
program once. A cached executable is the one a fresh compilation would produce, so no
result depends on the cache.

The rest of the compile time is XLA's CPU backend: each test compiles programs that then
run a few steps on tiny shapes. ``FAST_COMPILE`` (LLVM at optimisation level 0, the loop
emitters instead of the fusion emitters) compiles them in about 60% of the time and runs
them about 30% slower (benchmarks/suite_compile_flags.py; the default suite takes about 7
minutes instead of 12 on the 2-core machine, benchmarks/RESULTS.md). Its code may round
differently in the last bits; every test's tolerance is one that a differently-compiled
program must meet anyway. It is left out where execution dominates: a run that selects
the slow tests (``-m slow``), the tests' own training subprocesses that reset XLA_FLAGS,
and every run outside the tests; NCLJAX_TEST_FAST_COMPILE=0 leaves it out everywhere. A
jaxlib that no longer knows one of these flags would abort at start-up, so they are tried
in a subprocess first and left out if it fails.
"""

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _known_to_xla(flags: str) -> bool:
    """Whether this jaxlib starts with ``flags`` (an unknown XLA flag aborts the process)."""
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


def _selects_slow(argv: list[str]) -> bool:
    """Whether the command line's last ``-m`` expression selects the slow tests."""
    exprs = [b for a, b in itertools.pairwise(argv) if a == "-m"]
    exprs += [a[2:] for a in argv if a.startswith("-m") and len(a) > 2]  # -mslow
    return bool(exprs) and "slow" in exprs[-1] and "not slow" not in exprs[-1]


def _fast_compile() -> str:
    """``FAST_COMPILE``, unless NCLJAX_TEST_FAST_COMPILE=0, the run selects the slow tests
    (long learning runs, where execution outweighs compilation) or this jaxlib refuses it."""
    if os.environ.get("NCLJAX_TEST_FAST_COMPILE", "1") == "0" or _selects_slow(sys.argv):
        return ""
    return FAST_COMPILE if _known_to_xla(FAST_COMPILE) else ""


# Must be set before jax is imported anywhere in the test session (this file is the first
# conftest pytest loads). The controller decides; the xdist workers inherit its environment,
# hence the same flags and compilation cache.
# XLA's CPU client runs each device's part of a multi-device program on one pool of
# max(cores, devices) threads, 8 here. A part whose device already has 32 programs in
# flight waits for one of them to finish while it holds its pool thread. So once Python has
# dispatched more than 32 programs ahead, the next program's parts can hold the threads
# that the running program's collective still needs for its last participants: a
# deadlock, ended by XLA's terminate timeout ("may be stuck", then "Fatal Python error:
# Aborted"; under pytest's capture the message is lost with the worker). Which test it
# hits depends on timing: CI lost a worker in tests/test_evaluate.py, and two-worker runs
# of the heavy tier one in an NCR run, both running 8-device programs (inferred: their
# messages were lost, and the pool fix has not lost a worker since). PJRT_NPROC sizes
# that pool: with two threads per device, the blocked parts of one program leave the
# running one a thread per participant, as long as one Python thread dispatches
# (tests/test_fake_devices.py: 400 steps dispatched ahead deadlocked with 8 threads, in
# 2 runs of 2, and finish with 16). The terminate timeout is kept above XLA's 40 s so
# that a participant merely starved on the 2 shared cores is waited for.
N_FAKE_DEVICES = 8
if "NCLJAX_TEST_XLA_FLAGS" not in os.environ:
    os.environ["NCLJAX_TEST_XLA_FLAGS"] = " ".join(
        [
            os.environ.get("XLA_FLAGS", ""),
            _fast_compile(),
            f"--xla_force_host_platform_device_count={N_FAKE_DEVICES}",
            "--xla_cpu_collective_call_terminate_timeout_seconds=120",
        ]
    ).strip()


def _pool_threads() -> int:
    """The PJRT_NPROC this session was started with, as XLA reads it (0: none)."""
    try:
        return max(0, int(os.environ.get("PJRT_NPROC", "")))
    except ValueError:
        return 0


if _pool_threads() < 2 * N_FAKE_DEVICES:
    os.environ["PJRT_NPROC"] = str(2 * N_FAKE_DEVICES)
os.environ["XLA_FLAGS"] = os.environ["NCLJAX_TEST_XLA_FLAGS"]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ncljax-tests-jit-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# A shell that starts pytest in the background without job control (`cmd &` in a script,
# nohup) starts it with ctrl-c ignored, and an ignored signal stays ignored in every
# child: the tests of what ctrl-c does to the commands would then test the shell. The
# session (controller and workers) puts Python's own handler back, so the tests' children
# start with ctrl-c at its default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controller, at the very end
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set in conftest.py)"
    return devs
