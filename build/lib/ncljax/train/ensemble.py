r"""Evaluate an ensemble of finished runs: their pooled similarities (SGRAF = SGR + SAF).

  python -m ncljax.train.ensemble --workdir=runs/sgr --workdir=runs/saf [--split=test]

Each run is rebuilt from its ``config.json``, its best-on-validation checkpoint is
restored, both splits' images and captions are encoded by every network of every run,
and Recall@K/rSum (or mAP) is computed on the runs' similarity matrices combined by their
methods' ``eval_pool`` (the mean for every method but UGNCL), in the same bounded-memory
blocks as a single run. The runs must share the dataset, its evaluation protocol and the
pool; they may differ in anything else (head, method, seed). The command reports a run
that is missing, unfinished or damaged, or runs that cannot be pooled, in one line
(``-v 1``: the whole traceback).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
import optax

from ncljax import methods, models
from ncljax.config import renames
from ncljax.data import fingerprint, sources
from ncljax.methods import InitContext
from ncljax.train import checkpoint, rundir
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib

_SHARED = ("data", "eval")  # sections every member of an ensemble must agree on


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a run saved in ``workdir/config.json``.

    Raises:
      FileNotFoundError: ``workdir`` holds no run.
      ValueError: its ``config.json`` is damaged or not an ncljax run's.
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: {workdir} is not a finished ncljax run; give the --workdir "
            "of a train.py run."
        )
    with open(path) as f:
        try:
            resolved = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is damaged ({e}); restore it from a copy.") from None
    if isinstance(resolved, dict):
        resolved = renames.upgrade(resolved)  # a run saved before fields were renamed
    needed = ("method", "method_kwargs", "model", "seed", "train", *_SHARED)
    missing = [k for k in needed if k not in resolved] if isinstance(resolved, dict) else needed
    if missing:
        raise ValueError(f"{path} is not the config of an ncljax run (it lacks {list(missing)}).")
    sections = ("method_kwargs", "model", "train", *_SHARED)
    not_objects = [k for k in sections if not isinstance(resolved[k], dict)]
    if not_objects or not isinstance(resolved["method"], str):
        what = not_objects or ["method"]
        raise ValueError(
            f"{path} is damaged: its {', '.join(map(repr, what))} "
            f"{'is' if len(what) == 1 else 'are'} not what a run writes (sections are JSON "
            "objects, the method a name); restore it from a copy, or train again."
        )
    folder = resolved["data"].get("folder") if isinstance(resolved["data"], dict) else None
    if folder and not os.path.isabs(folder) and not os.path.isdir(folder):
        raise FileNotFoundError(
            f"{path} names data.folder {folder!r} relative to the directory its train.py ran "
            f"in, and {os.path.abspath(folder)} is not a folder: run this from that "
            "directory, or set data.folder in config.json to the folder's absolute path."
        )
    return ml_collections.ConfigDict(resolved)


def load_run(workdir: str, mesh) -> tuple[evaluator_lib.Evaluator, state_lib.TrainState]:
    """The evaluator of a finished run and its best-on-validation model.

    Raises:
      FileNotFoundError: ``workdir`` holds no run, or one that has not finished.
      checkpoint.CheckpointError: its best checkpoint cannot be restored.
    """
    config = load_config(workdir)
    if not os.path.exists(os.path.join(workdir, "results.json")):
        raise FileNotFoundError(
            f"{workdir} has not finished training (no results.json); run its train.py "
            "command again to finish it, then ensemble it."
        )
    fingerprint.check_unchanged(config, workdir, "retrieval or ensemble")
    dataset = sources.load_dataset(config.data)
    method = methods.build_method(config.method, config.method_kwargs, config.model)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(
            config.model, dataset.info, rngs, heads_fn=method.heads_fn
        ),
        tx=optax.identity(),  # only the model is restored
        memory=method.init_memory(InitContext(1, dataset.info, *[np.zeros(1, np.int64)] * 2)),
        num_networks=method.num_networks,
        seed=config.seed,
    )
    state = mesh_lib.replicate(state, mesh)
    checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        best = checkpointer.restore_best(state)
    finally:  # also when it cannot be restored: no orbax thread outlives the error
        checkpointer.close()
    if best is None:
        raise FileNotFoundError(
            f"{workdir} finished but has no best checkpoint in "
            f"{os.path.join(workdir, 'checkpoints', 'best')}; restore it from a copy, or train "
            "the run again in a new --workdir."
        )
    evaluator = evaluator_lib.Evaluator.of_method(graphdef, dataset, config, mesh, method)
    return evaluator, best[0]


def evaluate_ensemble(workdirs: Sequence[str], split: str = "test") -> dict[str, float]:
    """Metrics of the pooled similarity of the runs in ``workdirs`` on ``split``.

    Raises:
      ValueError: when the runs do not share the dataset and evaluation settings, or
        their methods pool similarities differently, or ``split`` is not a split.
      FileNotFoundError: a run is missing or has not finished.
      checkpoint.CheckpointError: a run's best checkpoint cannot be restored.
    """
    if split not in sources.SPLITS:
        raise ValueError(f"Unknown split {split!r}; use one of {sources.SPLITS}.")
    configs = [load_config(w) for w in workdirs]
    for section in _SHARED:
        first = configs[0][section].to_dict()
        for workdir, config in zip(workdirs[1:], configs[1:], strict=True):
            if config[section].to_dict() != first:
                raise ValueError(
                    f"{workdir} and {workdirs[0]} differ in config section {section!r}; "
                    "an ensemble needs the same dataset and evaluation protocol."
                )
    pools = [methods.build_method(c.method, c.method_kwargs, c.model).eval_pool for c in configs]
    if len(set(pools)) > 1:  # refused before anything is encoded
        raise ValueError(
            f"The runs combine similarities differently ({', '.join(map(repr, pools))} for "
            f"{list(workdirs)}); an ensemble needs one rule (Method.eval_pool)."
        )
    mesh = mesh_lib.evaluation_mesh(configs[0])
    with jax.set_mesh(mesh):
        encoded = []
        for workdir in workdirs:
            evaluator, state = load_run(workdir, mesh)
            encoded.append(evaluator.encode(state, split))
        return evaluator_lib.score(encoded, configs[0], mesh, split)


def main(argv):
    from ncljax import cli as _cli

    _cli.started()  # Ctrl-C from here on: KeyboardInterrupt, caught below
    from absl import app, flags
    from absl import logging as absl_logging

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every restore at INFO
    try:
        results = evaluate_ensemble(flags.FLAGS.workdir, flags.FLAGS.split)
    except (OSError, ValueError, checkpoint.CheckpointError) as e:
        if flags.FLAGS.verbosity > 0:  # -v 1: the whole traceback
            raise
        sys.exit(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:
        if flags.FLAGS.verbosity > 0:
            raise
        checkpoint.mute_background_errors()
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)
    print(json.dumps(rundir.finite_json(results), indent=2, sort_keys=True, allow_nan=False))


if __name__ == "__main__":
    from absl import app, flags

    from ncljax import cli

    flags.DEFINE_multi_string("workdir", None, "A finished run's directory (repeat).")
    flags.DEFINE_string("split", "test", "Split to evaluate.")
    flags.mark_flag_as_required("workdir")
    app.run(main, flags_parser=cli.flags_parser("python -m ncljax.train.ensemble"))
