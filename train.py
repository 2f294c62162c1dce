r"""Trains a method on a benchmark, resumably, and evaluates the best model on the test split.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python train.py --config=configs/vse.py:synthetic,quick --config.train.epochs=3
  python train.py --config=configs/gsc.py:f30k --config.data.manual_dir=/path/to/files

The workdir (default ``runs/<config name>``) receives config.json, metrics.jsonl,
results.json and checkpoints/; rerunning the same command resumes from the latest
checkpoint.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from ncljax.train import config as config_lib
from ncljax.train import train_and_evaluate
from ncljax.train.checkpoint import CheckpointError
from ncljax.train.rundir import WorkdirLocked

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/quickstart.py[:quick].", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
flags.mark_flag_as_required("config")


def parse_flags(argv):
    """absl flag parsing, with one clear line for a config override naming no field."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:  # raised by ml_collections for unknown fields
        hint = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        overrides = [a for a in argv[1:] if a.startswith("--config.")]
        names = [a.split("=", 1)[-1] for a in overrides if a.startswith("--config.data.name=")]
        if names and any(a.startswith("--config.data.") for a in overrides if "name=" not in a):
            sys.exit(
                f"Unknown config field in {overrides}: {hint}. The data fields of the config "
                f"file's dataset apply before data.name={names[-1]} is switched; pass the "
                f"dataset as the config file's argument instead: "
                f"--config=configs/<method>.py:{names[-1]} (its fields are then known)."
            )
        sys.exit(
            f"Unknown config field in {overrides}: {hint}. All fields and their defaults "
            "are listed in ncljax/train/config.py."
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    path, arg = config_flags.get_config_filename(flags.FLAGS["config"]), ""
    if not os.path.isfile(path) and ":" in os.path.basename(path):  # 'file.py:arg'
        path, arg = path[: path.rindex(":")], path[path.rindex(":") + 1 :]
    if not os.path.isfile(path):
        sys.exit(
            f"Config file {path} not found; pass an existing file, e.g. configs/quickstart.py."
        )
    workdir = _WORKDIR.value
    if workdir is None:
        name = os.path.splitext(os.path.basename(path))[0]
        workdir = os.path.join("runs", "_".join(filter(None, [name, *arg.split(",")])))
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    config = _CONFIG.value
    try:
        if "data.name" in overrides:
            _switch_dataset(config, path, arg, overrides)
        train_and_evaluate(config, workdir, overridden=set(overrides))
    except (
        OSError,  # an unwritable or full workdir, a missing dataset file
        ValueError,  # a bad config field, malformed data
        FloatingPointError,  # a non-finite loss
        CheckpointError,  # no checkpoint can be restored or written
        WorkdirLocked,  # another run uses the workdir
    ) as e:
        if flags.FLAGS.verbosity > 0:  # -v 1: the whole traceback
            raise
        sys.exit(f"{type(e).__name__}: {e}")


def _switch_dataset(config, path: str, arg: str, overrides: dict) -> None:
    """``--config.data.name=X`` on a file built for another dataset: the data section is
    rebuilt from X's defaults (then the command line's other data fields); the rest stays
    the file's, which a warning says."""
    file_dataset = config_lib.load_file(path, arg).data.name
    if config.data.name == file_dataset:
        return
    keep = [k.split(".", 1)[1] for k in overrides if k.startswith("data.")]
    config_lib.switch_dataset(config, config.data.name, keep=keep)
    logging.warning(
        "data.name=%s replaces the config file's dataset %s: the data section now holds "
        "%s's defaults, every other setting (model, optimiser, noise, method) is the file's "
        "for %s. %s:%s applies the file's own settings for %s, if it lists that dataset.",
        config.data.name,
        file_dataset,
        config.data.name,
        file_dataset,
        path,
        config.data.name,
        config.data.name,
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
