"""Test setup: eight fake CPU devices, so every test can compare 1 device with 8, and one
compilation cache per test session.

Many tests compile the same programs (the step of a tiny config, the evaluation encoders);
on 2 CPU cores compilation is most of their time. JAX's persistent compilation cache in a
directory of this session (shared by the xdist workers, removed at the end) compiles each
program once. A cached executable is the one a fresh compilation would produce, so no
result depends on the cache.
"""

import os
import shutil
import tempfile

# Must be set before jax is imported anywhere in the test session (the xdist workers
# inherit the controller's environment, hence its cache directory).
# The 8 fake devices' collectives run as 8 rendezvousing threads; with two xdist workers on
# 2 cores one participant can be descheduled long enough that XLA's default terminate
# timeout aborted a worker once ("may be stuck", then "Fatal Python error: Aborted").
# A longer timeout lets a starved participant arrive; a true deadlock still ends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=300"
    + " --xla_cpu_collective_timeout_seconds=300"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ncljax-tests-jit-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

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
