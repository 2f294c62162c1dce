"""Several processes (hosts) in one run: ``--config.distributed=True``.

Every process runs the same command; each sees its own devices, and the run's mesh spans
every device of every process (``jax.distributed``). ``distributed=True`` reads the
``cluster`` section:

- under Slurm, Open MPI or on Cloud TPU leave it empty: JAX detects the coordinator, the
  number of processes and each process's id;
- elsewhere give ``cluster.coordinator_address`` (``host:port`` of process 0),
  ``cluster.num_processes`` and, per process, ``cluster.process_id``.

The workdir must be one folder every process sees (a shared file system): process 0
writes the logs and results, every process writes its part of each checkpoint. On CPU
the processes exchange data through gloo (set here before JAX starts).
"""

from __future__ import annotations

import contextlib

import jax

from ncljax import rules
from ncljax.rules import Setting

CLUSTER = {
    "coordinator_address": Setting(
        "", None, "host:port of process 0 ('': detected under Slurm, Open MPI, Cloud TPU)"
    ),
    "num_processes": Setting(
        0, rules.int_at_least(0, "an integer >= 0 (0: detected)"), "how many processes"
    ),
    "process_id": Setting(
        -1, rules.int_at_least(-1, "an integer >= -1 (-1: detected)"), "this process's id"
    ),
}
DISTRIBUTED = rules.Choice(
    "distributed",
    False,
    (
        rules.Kind(False, doc="one process"),
        rules.Kind(True, {"cluster": CLUSTER}, doc="several processes, one run"),
    ),
)
CHOICES = (DISTRIBUTED,)


def initialize(cluster) -> None:
    """``jax.distributed.initialize`` with the ``cluster`` section's values (the empty
    ones detected by JAX); gloo collectives on CPU."""
    if jax.distributed.is_initialized():
        return
    with contextlib.suppress(AttributeError, ValueError):  # a JAX without it: its default
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address or None,
        num_processes=cluster.num_processes or None,
        process_id=None if cluster.process_id < 0 else cluster.process_id,
    )
