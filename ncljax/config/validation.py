"""One validation of a run's config: ``check``, called at each stage of the run.

The trainer calls ``check`` as each fact the config is checked against becomes known, and
before anything is built from it or written::

    check(config, overridden)                    # before the dataset is read
    check(config, info=dataset.info)             # the dataset is open
    check(config, realised_rate=pairs.realised_rate)  # the noise is drawn
    check(config, mesh_size=mesh.size)           # the devices are known

The first call checks the config alone: the data section belongs to ``data.name``, every
field's type and range and the rules relating fields, and no non-default field goes
unread (the table ``fields.FIELDS``); all of its problems come in one message. The later
calls check what depends on the dataset (the training split holds a batch, the run's
steps fit its int32 step counter; label noise and ``eval.kind='map'`` need two classes),
on the noise (``noise.rate`` agrees with the rate a noise file realises) and on the
devices (the batches divide among them); each refuses the first problem it finds.
Whether a split is large enough for the evaluation's metrics is the evaluator's check
(``evaluator.check_splits``).

Every refusal is a ``ValueError`` whose one-line message names the field, its value and
the change to make.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from ncljax.config import base as config_lib
from ncljax.config import fields, presets
from ncljax.data import sources

# How far noise.rate may be from the rate a noise file realises (index files of the same
# nominal rate realise slightly less: a few pairs keep their own caption by chance).
NOISE_FILE_RATE_TOLERANCE = 0.05


def check(
    config,
    overridden: Collection[str] | None = None,
    *,
    info: sources.DatasetInfo | None = None,
    realised_rate: float | None = None,
    mesh_size: int | None = None,
) -> None:
    """Checks ``config`` at one stage of the run (see the module docstring).

    Without ``info``, ``realised_rate`` and ``mesh_size``, checks the config alone; with
    any of them, only what depends on the ones given.

    Args:
      config: the run's config.
      overridden: the fields given on the command line, when known (``train.py``): a
        field that a command-line choice leaves unread is then warned about rather than
        refused (``fields.ignored_fields``). Read by the first stage only.
      info: the dataset's ``DatasetInfo``.
      realised_rate: the fraction of training pairs the noise made noisy.
      mesh_size: the number of devices of the mesh.

    Raises:
      ValueError: one message naming the field, its value and what it must be.
    """
    if info is None and realised_rate is None and mesh_size is None:
        _check_fields(config, overridden)
    if info is not None:
        _check_against_data(config, info)
    if realised_rate is not None:
        _check_noise_file(config.noise, realised_rate)
    if mesh_size is not None:
        _check_devices(config, mesh_size)


def _check_fields(config, overridden: Collection[str] | None) -> None:
    """Every field's type and range, and no non-default field the run would not read,
    before a dataset is read or a file written."""
    _check_data_section(config)
    problems = fields.unknown_fields(config)
    if problems:  # the other checks read fields by their known names
        raise ValueError("Invalid config: " + "; ".join(problems) + ".")
    problems = fields.value_problems(config)
    refused, warned = fields.ignored_fields(config, overridden)
    problems += refused
    for message in warned:
        logging.warning("%s: the field is ignored.", message)
    if problems:
        raise ValueError("Invalid config: " + "; ".join(problems) + ".")


def _check_data_section(config) -> None:
    """Refuses a data section whose fields are not those of dataset ``data.name`` (a dataset
    registered with ``sources.register`` brings its own fields and is not checked)."""
    name = config.data.name
    if name not in sources.DATASETS:  # a researcher's dataset (sources.register): its fields
        return
    expected = set(sources.default_config(name).keys()) | set(config_lib.PIPELINE_FIELDS)
    found = set(config.data.keys())
    if found != expected:
        extra, missing = sorted(found - expected), sorted(expected - found)
        files = presets.config_files_taking(name)
        takers = (
            "the config files that take it: " + ", ".join(f"--config={f}" for f in files)
            if files
            else f"--config=<file>.py:{name}"
        )
        raise ValueError(
            f"Invalid config: the data section does not belong to data.name={name!r} (fields "
            f"{extra} are not {name}'s, {missing} are missing). Pass the dataset as the "
            f"config file's argument ({takers}), or rebuild the "
            "section with ncljax.config.switch_dataset(config, name)."
        )


# The state counts steps and epochs in int32 (``state.TrainState``): a run longer than this
# would wrap them around.
MAX_STEPS = 2**31 - 1


def _check_against_data(config, info) -> None:
    """The batch fits the training split, the run's steps fit the step counter; label
    noise and mAP have two classes to work on."""
    _, train_pairs = info.split_sizes["train"]
    if config.train.batch_size > train_pairs:
        raise ValueError(
            f"train.batch_size={config.train.batch_size} is larger than the training split "
            f"({train_pairs} pairs); lower it to at most {train_pairs}."
        )
    # At least one step per epoch and per batch of images (a run of pairs has more).
    per_epoch = max(1, info.split_sizes["train"][0] // config.train.batch_size)
    if config.train.epochs * per_epoch > MAX_STEPS:
        raise ValueError(
            f"train.epochs={config.train.epochs} makes at least "
            f"{config.train.epochs * per_epoch} training steps ({per_epoch} per epoch), more "
            f"than the run's int32 step counter holds ({MAX_STEPS}); lower "
            "--config.train.epochs."
        )
    if config.noise.kind in ("symmetric", "asymmetric") and info.num_classes < 2:
        raise ValueError(
            f"Label noise needs at least 2 classes; {info.name} has {info.num_classes}"
            f"{_classes_hint(info, 'noise.kind=none')}."
        )
    if config.eval.kind == "map" and info.num_classes < 2:
        raise ValueError(
            f"eval.kind='map' needs at least 2 classes; {info.name} has {info.num_classes}"
            f"{_classes_hint(info, 'eval.kind=recall')}."
        )


def _classes_hint(info, other: str) -> str:
    """What to do about a dataset with fewer than two classes."""
    if info.name == "vectors":
        where = (
            "its folder has no {split}_labels.npy: add them (int class ids per image)"
            if info.num_classes == 0
            else "its {split}_labels.npy hold one class: give the images their classes"
        )
        return f" ({where}, or set --config.{other})"
    return f" (set --config.{other})"


def _check_noise_file(noise, realised_rate: float) -> None:
    """Refuses ``noise.rate`` that contradicts the rate a noise file realises (``0`` is
    always accepted: the file decides)."""
    if (
        noise.kind == "file"
        and noise.rate
        and (abs(noise.rate - realised_rate) > NOISE_FILE_RATE_TOLERANCE)
    ):
        raise ValueError(
            f"noise.rate={noise.rate} but the noise file {noise.file.path} makes "
            f"{realised_rate:.3f} of the pairs noisy; with noise.kind='file' the file decides: "
            f"set noise.rate=0 (or {realised_rate:.2f}) to record what the run uses."
        )


def _check_devices(config, mesh_size: int) -> None:
    """The training and encoding batches are sharded evenly over the devices."""
    batch_size = config.train.batch_size
    if batch_size % mesh_size or config.eval.batch_size % mesh_size:
        raise ValueError(
            f"train.batch_size={batch_size} and eval.batch_size={config.eval.batch_size} "
            f"must be multiples of the {mesh_size} devices (or set train.num_devices)."
        )
