"""The GSC notebook runs top to bottom on a (shrunk) :quick run of configs/gsc.py:synthetic."""

import os

import pytest

from ncljax import config as config_lib
from ncljax.train import train_and_evaluate
from tests.notebooks import runner

pytestmark = pytest.mark.heavy  # out of the default run; CI runs it (see pyproject.toml)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "gsc_structure_consistency.py")
FIGURES = (
    "gsc_label_trajectories.png",
    "gsc_intra_scores_gmm.png",
    "gsc_label_distributions.png",
    "gsc_detection_auc.png",
)


def _config():
    config = config_lib.load_file(os.path.join(ROOT, "configs", "gsc.py"), "synthetic,quick")
    config.data.num_train, config.data.num_val, config.data.num_test = 64, 16, 16
    config.train.batch_size, config.eval.batch_size = 32, 32
    config.train.progress_bar = False
    config.train.num_devices = 1
    return config


def test_notebook_executes_on_a_quick_run(tmp_path):
    workdir, figures = tmp_path / "run", tmp_path / "figures"
    train_and_evaluate(_config(), str(workdir))
    env = dict(os.environ, NCLJAX_WORKDIR=str(workdir), NCLJAX_FIGURES=str(figures))
    printed = runner.execute(NOTEBOOK, env)
    for name in FIGURES:
        assert (figures / name).stat().st_size > 10_000, name
    assert "epoch 1: AUC cross" in printed
