"""The GSC notebook runs top to bottom on a (shrunk) :quick run of configs/gsc.py:synthetic."""

import os
import subprocess
import sys

from ncljax.train import config as config_lib
from ncljax.train import train_and_evaluate

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


def _execute(env: dict) -> str:
    """Runs the notebook top to bottom; returns what it printed.

    Through a Jupyter kernel when the ``[notebooks]`` extras are installed, else as the
    plain script a jupytext percent file also is (CI installs ``[test]`` only).
    """
    try:
        import jupytext
        import nbclient
    except ImportError:
        out = subprocess.run(
            [sys.executable, NOTEBOOK], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout
    notebook = jupytext.read(NOTEBOOK)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )


def test_notebook_executes_on_a_quick_run(tmp_path):
    workdir, figures = tmp_path / "run", tmp_path / "figures"
    train_and_evaluate(_config(), str(workdir))
    env = dict(os.environ, NCLJAX_WORKDIR=str(workdir), NCLJAX_FIGURES=str(figures))
    printed = _execute(env)
    for name in FIGURES:
        assert (figures / name).stat().st_size > 10_000, name
    assert "epoch 1: AUC cross" in printed
