"""Shared benchmark helpers: fake CPU devices, timing with medians, machine description,
random batches of Flickr30K shapes."""

import os
import platform
import sys

import numpy as np

VOCAB = 8481  # Flickr30K's NCR vocabulary


def set_cpu_devices(argv) -> int:
    """Reads ``--devices N`` and asks XLA for N CPU devices; call before importing jax."""
    n = 1
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            n = int(arg.split("=", 1)[1])
        elif arg == "--devices":
            n = int(argv[i + 1])
    if n > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        )
        # Two pool threads per device: with one, programs dispatched far ahead can take the
        # threads a running collective still needs, and XLA aborts (tests/conftest.py).
        try:
            threads = int(os.environ.get("PJRT_NPROC", ""))
        except ValueError:
            threads = 0
        if threads < 2 * n:
            os.environ["PJRT_NPROC"] = str(2 * n)
    return n


def timed(fn, *, warmup: int = 2, repeats: int = 5) -> list[float]:
    """Seconds of ``fn()`` (which must block until done) over ``repeats`` runs after warm-up."""
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times


def machine() -> str:
    import jax

    cpus = os.cpu_count()
    device = jax.devices()[0]
    huge = "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")
    pages = "huge pages on" if huge else "4 KiB pages"
    return (
        f"{platform.processor() or platform.machine()}, {cpus} cores, {device.platform} "
        f"x{jax.device_count()} ({device.device_kind}); python {sys.version.split()[0]}, "
        f"jax {jax.__version__}; {pages}"
    )


def random_batch(rng, n, length, offset=0):
    """``n`` pairs of Flickr30K shapes with random inputs: 36 x 2048 regions, captions of
    ``length`` token slots with valid lengths drawn between half of it and all of it."""
    lengths = rng.integers(max(length // 2, 1), length + 1, size=n)
    tokens = rng.integers(4, VOCAB, size=(n, length)) * (np.arange(length) < lengths[:, None])
    return {
        "regions": rng.normal(size=(n, 36, 2048)).astype(np.float32),
        "tokens": tokens.astype(np.int32),
        "length": lengths.astype(np.int32),
        "index": np.arange(offset, offset + n, dtype=np.int32),
        "mask": np.ones(n, bool),
    }
