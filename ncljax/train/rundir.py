"""The run directory: its ``config.json``, and which fields a resumed run may change."""

from __future__ import annotations

import json
import os

import jax
from flax import traverse_util

# Fields a resumed run may change: they alter neither the shapes of the state nor the
# data order, e.g. to lower the learning rate after a NaN stop.
RESUMABLE = (
    "optim.learning_rate",
    "optim.schedule",
    "optim.decay_factor",
    "optim.decay_every",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "optim.weight_decay",
    "train.log_every_steps",
    "train.checkpoint_every_steps",
    "train.progress_bar",
    "data.num_threads",
    "data.prefetch",
    "data.length_buckets",
    "eval.batch_size",
    "eval.image_chunk",
    "eval.text_chunk",
    "distributed",
)


def write_config(workdir: str, config, extra: dict) -> None:
    """Writes ``config.json``; refuses a workdir that holds a run of another config.

    Only the ``RESUMABLE`` fields may differ from the run being resumed.
    """
    resolved = json.loads(config.to_json_best_effort())
    resolved.update(extra)
    path = os.path.join(workdir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            previous = traverse_util.flatten_dict(json.load(f), sep=".")
            current = traverse_util.flatten_dict(resolved, sep=".")
        changed = sorted(
            k for k in previous.keys() | current.keys() if previous.get(k) != current.get(k)
        )
        fixed = [k for k in changed if k not in RESUMABLE]
        if fixed:
            raise ValueError(
                f"{workdir} holds a run with a different config ({fixed} differ). Use a new "
                "--workdir, or the same config to resume that run (only "
                f"{list(RESUMABLE)} may change)."
            )
        if changed:
            print(f"Resuming with changed {', '.join(f'{k}={current.get(k)}' for k in changed)}.")
    if jax.process_index() == 0:
        with open(path, "w") as f:
            json.dump(resolved, f, indent=2, sort_keys=True)
