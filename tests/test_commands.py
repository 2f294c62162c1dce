"""The installed commands: ``ncljax COMMAND`` and the shipped config files by name, from
any directory (``ncljax/__main__.py``, ``ncljax.config.files``)."""

import json
import os
import subprocess
import sys

import pytest

from ncljax.config import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ncljax(*args, cwd):
    out = subprocess.run(
        [sys.executable, "-m", "ncljax", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )
    return out.returncode, out.stdout, out.stderr


def test_the_shipped_config_files_are_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a checkout: no configs/ here
    assert {"gsc", "ncr", "pc2", "quickstart", "srem", "ugncl", "uot_rcl", "vse"} <= set(
        files.names()
    )
    gsc = os.path.join(files.CONFIG_DIR, "gsc.py")
    assert files.resolve("gsc:vectors") == f"{gsc}:vectors"
    assert files.resolve("gsc.py") == gsc
    assert files.resolve("configs/gsc.py:f30k,quick") == f"{gsc}:f30k,quick"
    assert files.resolve("quickstart") == os.path.join(files.CONFIG_DIR, "quickstart.py")
    # A file that exists is taken as it is; another name or folder is left to be refused.
    (tmp_path / "gsc.py").write_text("def get_config(arg):\n    return None\n")
    assert files.resolve("gsc.py:vectors") == "gsc.py:vectors"
    assert files.resolve("nosuch:vectors") == "nosuch:vectors"
    assert files.resolve("mine/gsc.py") == "mine/gsc.py"


def test_a_checkouts_configs_folder_is_the_shipped_one():
    assert os.path.samefile(os.path.join(ROOT, "configs"), files.CONFIG_DIR)


def test_the_command_lists_its_subcommands_and_refuses_an_unknown_one(tmp_path):
    code, stdout, _ = _ncljax("--help", cwd=tmp_path)
    assert code == 0
    for command in ("train", "audit", "retrieve", "report", "ensemble"):
        assert f"  {command}" in stdout
    code, _, stderr = _ncljax("trian", cwd=tmp_path)
    assert code != 0
    assert stderr.strip() == (
        "Unknown command 'trian': use one of train, audit, retrieve, report, ensemble, embed "
        "(ncljax --help)."
    )


@pytest.mark.slow  # 12 s; CI trains and audits by name from the installed wheel (.ci/run)
def test_train_and_audit_by_name_from_another_directory(tmp_path):
    """``ncljax train --config=vse:synthetic,quick`` where there is no checkout, then
    ``ncljax audit`` of the run (a baseline: nothing to audit, said in one line)."""
    workdir = tmp_path / "run"
    code, stdout, stderr = _ncljax(
        "train",
        "--config=vse:synthetic,quick",
        "--config.train.epochs=1",
        "--config.train.progress_bar=False",
        f"--workdir={workdir}",
        cwd=tmp_path,
    )
    assert code == 0, stderr[-2000:]
    with open(workdir / "results.json") as f:
        assert "rsum" in json.load(f)
    lines = stdout.strip().splitlines()
    assert lines[0].startswith(
        "Training vse (cosine head) on synthetic: 1280 training pairs, per_caption noise at "
        "0.4 (seed 0); 1 epoch of batch 64 on "
    )
    assert lines[0].endswith(f" cpu devices; workdir {workdir}.")  # the tests' 8 CPU devices
    assert lines[-1] == (
        f"Done: {workdir / 'results.json'} (per-epoch metrics in metrics.jsonl). Next: ncljax "
        f"retrieve --workdir={workdir} --query=image:0 retrieves with it."
    )
    code, _, stderr = _ncljax("audit", f"--workdir={workdir}", cwd=tmp_path)
    assert code == 3, stderr[-2000:]
    assert stderr.strip().startswith("vse is a baseline: it estimates nothing")


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("nosuch:vectors", "Config file nosuch not found; pass an existing file or a shipped"),
        ("gsc:vectros", "ValueError: Unknown config argument 'vectros'"),
    ],
)
def test_a_config_name_that_is_not_shipped_is_one_line(tmp_path, config, says):
    code, _, stderr = _ncljax("train", f"--config={config}", cwd=tmp_path)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith(says), stderr[-2000:]


def test_train_help_lists_the_methods_the_configs_and_the_fields(tmp_path):
    _, stdout, _ = _ncljax("train", "--help", cwd=tmp_path)  # absl exits 1 after its help
    assert "Methods: vse, infonce, ncr, gsc, srem, ugncl, pc2, ce, uot_rcl." in stdout
    assert "  gsc: synthetic, f30k, coco, cc152k, vectors" in stdout
    assert "  model.sgraf.sim_dim=256  [read with model.head='sgr' or model.head='saf']" in stdout
    assert "  --config: A shipped config by name" in stdout
