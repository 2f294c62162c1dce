r"""Evaluate an ensemble of finished runs: their pooled similarities (SGRAF = SGR + SAF).

  python -m ncljax.train.ensemble --workdir=runs/sgr --workdir=runs/saf [--split=test]

Each run is rebuilt from its ``config.json``, its best-on-validation checkpoint is
restored, both splits' images and captions are encoded by every network of every run,
and Recall@K/rSum (or mAP) is computed on the runs' similarity matrices combined by their
methods' ``eval_pool`` (the mean for every method but UGNCL), in the same bounded-memory
blocks as a single run. The runs must share the dataset, its evaluation protocol and the
pool; they may differ in anything else (head, method, seed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import ml_collections
import optax

from ncljax import methods, models
from ncljax.data import sources
from ncljax.methods import InitContext
from ncljax.train import checkpoint
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib

_SHARED = ("data", "eval")  # sections every member of an ensemble must agree on


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a run saved in ``workdir/config.json``."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a finished ncljax run.")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def load_run(workdir: str, mesh) -> tuple[evaluator_lib.Evaluator, state_lib.TrainState]:
    """The evaluator of a finished run and its best-on-validation model."""
    config = load_config(workdir)
    dataset = sources.load_dataset(config.data)
    method = methods.build_method(config.method, config.method_kwargs, config.model)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(
            config.model, dataset.info, rngs, heads_fn=method.heads_fn
        ),
        tx=optax.identity(),  # only the model is restored
        memory=method.init_memory(InitContext(1, dataset.info, None, None)),
        num_networks=method.num_networks,
        seed=config.seed,
    )
    state = mesh_lib.replicate(state, mesh)
    checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    best = checkpointer.restore_best(state)
    checkpointer.close()
    if best is None:
        raise FileNotFoundError(f"{workdir} has no best checkpoint; train it first.")
    evaluator = evaluator_lib.Evaluator(
        graphdef,
        dataset,
        config,
        mesh,
        transform=method.eval_transform,
        fields=models.input_fields(config.model),
        pool=method.eval_pool,
    )
    return evaluator, best[0]


def evaluate_ensemble(workdirs: Sequence[str], split: str = "test") -> dict[str, float]:
    """Metrics of the pooled similarity of the runs in ``workdirs`` on ``split``.

    Raises:
      ValueError: when the runs do not share the dataset and evaluation settings, or
        their methods pool similarities differently.
    """
    configs = [load_config(w) for w in workdirs]
    for section in _SHARED:
        first = configs[0][section].to_dict()
        for workdir, config in zip(workdirs[1:], configs[1:], strict=True):
            if config[section].to_dict() != first:
                raise ValueError(
                    f"{workdir} and {workdirs[0]} differ in config section {section!r}; "
                    "an ensemble needs the same dataset and evaluation protocol."
                )
    mesh = mesh_lib.make_mesh(configs[0].train.num_devices)
    with jax.set_mesh(mesh):
        encoded = []
        for workdir in workdirs:
            evaluator, state = load_run(workdir, mesh)
            encoded.append(evaluator.encode(state, split))
        return evaluator_lib.score(encoded, configs[0], mesh, split)


def main(argv):
    del argv
    from absl import flags

    results = evaluate_ensemble(flags.FLAGS.workdir, flags.FLAGS.split)
    print(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_multi_string("workdir", None, "A finished run's directory (repeat).")
    flags.DEFINE_string("split", "test", "Split to evaluate.")
    flags.mark_flag_as_required("workdir")
    app.run(main)
