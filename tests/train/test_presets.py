"""``ncljax.config.presets.dataset_hint``: the config arguments it suggests for a dataset are
ones the config files accept (once ``--config=configs/<method>.py:wiki`` for a file that
refuses wiki)."""

import os

import pytest

from ncljax import config as config_lib
from ncljax.config import presets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def _suggested(hint):
    return [
        word.removeprefix("--config=").rstrip(",;") for word in hint.split() if "--config=" in word
    ]


@pytest.mark.parametrize(("method", "dataset"), [("gsc", "wiki"), ("vse", "inria"), ("ncr", "now")])
def test_a_dataset_the_file_does_not_take_suggests_only_files_that_take_it(method, dataset):
    path = os.path.join(CONFIGS, f"{method}.py")
    with pytest.raises(ValueError, match="Unknown config argument"):
        config_lib.load_file(path, dataset)
    hint = presets.dataset_hint(path, dataset)
    assert hint.startswith(f"{path} takes only ") and f"not {dataset};" in hint
    suggested = _suggested(hint)
    assert suggested and all(s.endswith(f".py:{dataset}") for s in suggested)
    for argument in suggested:  # each suggestion loads, with the dataset asked for
        file, arg = argument.rsplit(":", 1)
        assert config_lib.load_file(file, arg).data.name == dataset
    # Every config file that takes the dataset is suggested (oracle: loading each).
    takes = []
    for name in sorted(f for f in os.listdir(CONFIGS) if f.endswith(".py") and f[0] != "_"):
        try:
            config_lib.load_file(os.path.join(CONFIGS, name), dataset)
        except ValueError:
            continue
        takes.append(f"{os.path.join(CONFIGS, name)}:{dataset}")
    assert suggested == takes
    shipped = [t.replace(CONFIGS, presets.CONFIG_DIR, 1) for t in takes]
    assert presets.config_files_taking(dataset) == shipped  # the shipped files by default


def test_a_dataset_the_file_takes_is_its_argument():
    path = os.path.join(CONFIGS, "gsc.py")
    assert presets.dataset_hint(path, "f30k") == (
        f"pass the dataset as the config file's argument: --config={path}:f30k"
    )
    assert presets.datasets_of(path) == ("synthetic", "f30k", "coco", "cc152k", "vectors")
