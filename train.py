r"""Trains a method on a benchmark, resumably, and evaluates the best model on the test split.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python train.py --config=configs/vse_synthetic.py:quick --config.train.epochs=3

The workdir (default ``runs/<config name>``) receives config.json, metrics.jsonl,
results.json and checkpoints/; rerunning the same command resumes from the latest
checkpoint.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

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
        sys.exit(
            f"Unknown config field in {overrides}: {hint}. All fields and their defaults "
            "are listed in ncljax/train/config.py."
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    if not os.path.isfile(path):
        if ":" in os.path.basename(path):  # 'file.py:arg': the file part
            path = path[: path.rindex(":")]
        sys.exit(
            f"Config file {path} not found; pass an existing file, e.g. configs/quickstart.py."
        )
    workdir = _WORKDIR.value
    if workdir is None:
        workdir = os.path.join("runs", os.path.splitext(os.path.basename(path))[0])
    try:
        train_and_evaluate(_CONFIG.value, workdir)
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


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
