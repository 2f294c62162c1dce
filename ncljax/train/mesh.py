"""The device mesh and the shardings of batches and state."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(num_devices: int = 0) -> jax.sharding.Mesh:
    """A 1-D ``data`` mesh over the first ``num_devices`` devices (0: all of them).

    The axis is ``Auto`` so the compiler propagates shardings through the global-batch
    loss (in-batch ``[B, B]`` similarity matrices need both operands on the ``data``
    axis, which explicit sharding rejects).
    """
    devices = jax.devices()
    if num_devices < 0 or num_devices > len(devices):
        raise ValueError(
            f"train.num_devices={num_devices} but {len(devices)} devices are visible; "
            "use 0 for all of them."
        )
    devices = devices[: num_devices or len(devices)]
    _warn_if_cpu_pool_too_small(devices)
    return jax.make_mesh(
        (len(devices),), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
    )


def cpu_pool_threads(num_devices: int) -> int:
    """Threads of XLA's CPU client pool for ``num_devices`` CPU devices, as XLA sizes it:
    the first of ``PJRT_NPROC`` and ``NPROC`` that reads as an integer (below 0 read as 0),
    else this process's cores; never fewer than the devices."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            threads = max(0, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
        return max(threads, num_devices)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(cores or 1, num_devices)


def _warn_if_cpu_pool_too_small(devices) -> None:
    """Warns when several CPU devices (``--xla_force_host_platform_device_count``) share a
    pool with fewer than two threads each.

    XLA's CPU client runs each device's part of a multi-device program on one pool. A part
    whose device already has 32 programs in flight waits for one of them to finish while
    it holds its pool thread, so with one thread per device the parts of programs
    dispatched ahead can hold every thread that the running program's collective still
    needs: the process deadlocks, and XLA aborts it after its terminate timeout. Two
    threads per device leave the running program a thread for each participant, where one
    Python thread dispatches.
    """
    n = len(devices)
    if n < 2 or devices[0].platform != "cpu":
        return
    threads = cpu_pool_threads(n)
    if threads < 2 * n:
        logging.warning(
            "%d CPU devices share XLA's pool of %d threads; programs dispatched ahead can "
            "deadlock their collectives (XLA then aborts the process). Set PJRT_NPROC=%d "
            "(two threads per device) before starting Python, or use one CPU device.",
            n,
            threads,
            2 * n,
        )


def evaluation_mesh(config) -> jax.sharding.Mesh:
    """The mesh on which a finished run is read again (retrieval, ensembles): its
    ``train.num_devices`` where this machine has them; where it has fewer (a run trained
    on 8 accelerators, retrieved on a laptop), the most of its devices that divide
    ``eval.batch_size``. An evaluation's results do not depend on the device count (to
    rounding), so a run is never refused for the devices it trained on."""
    visible = len(jax.devices())
    count = min(config.train.num_devices or visible, visible)
    while count > 1 and config.eval.batch_size % count:
        count -= 1
    return make_mesh(count)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data``."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def replicate(tree, mesh: jax.sharding.Mesh):
    """``tree`` replicated on every device of ``mesh``, from each process's host copy.

    Works with several processes (``device_put`` of arrays committed to one local device
    does not) and with typed PRNG keys.
    """

    def put(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            return jax.random.wrap_key_data(jax.device_put(data, replicated(mesh)))
        return jax.device_put(np.asarray(x), replicated(mesh))

    return jax.tree.map(put, tree)
