"""The device mesh and the shardings of batches and state."""

from __future__ import annotations

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
    return jax.make_mesh(
        (len(devices),), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
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
