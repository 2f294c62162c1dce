"""Runs a notebook of ``notebooks/`` top to bottom for the notebook tests."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def execute(notebook_path: str, env: dict) -> str:
    """Runs the notebook top to bottom; returns what it printed.

    Through a Jupyter kernel when the ``[notebooks]`` extras are installed, else as the
    plain script a jupytext percent file also is (CI installs ``[test]`` only).
    """
    try:
        import jupytext
        import nbclient
    except ImportError:
        out = subprocess.run(
            [sys.executable, notebook_path], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout
    notebook = jupytext.read(notebook_path)
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
