"""User errors on the command line (``train.py``, ``python -m ncljax.train.ensemble``):
one line on stderr, no traceback, no orbax log lines, a non-zero exit."""

import json
import os
import shutil
import subprocess
import sys

import optax
import pytest
from flax import nnx

from ncljax.methods import base
from ncljax.train import state as state_lib
from ncljax.train import train_and_evaluate
from tests.train.test_faults import _truncate_array_files
from tests.train.test_loop import ROOT, load_config, tiny


def _run(*args):
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    return out.returncode, out.stderr


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def _train_py(*args):
    return _run(os.path.join(ROOT, "train.py"), *args)


@pytest.mark.parametrize(
    ("argument", "word"),
    [("configs/vse.py:synthetci", "synthetci"), ("configs/ncr.py:wiki", "wiki")],
)
def test_a_misspelt_config_argument_is_one_line(tmp_path, argument, word):
    code, stderr = _train_py(f"--config={argument}", f"--workdir={tmp_path / 'run'}")
    assert code != 0
    assert _one_line(stderr).startswith(f"ValueError: Unknown config argument {word!r}: use one")
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(("method", "count"), [("vse", 0), ("ce", -1)])
def test_num_networks_below_one_is_one_line(tmp_path, method, count):
    code, stderr = _train_py(
        f"--config=configs/{method}.py:synthetic,quick",
        f"--config.method_kwargs.num_networks={count}",
        "--config.train.num_devices=1",  # ce's batch of 100 on the tests' 8 CPU devices
        "--config.train.progress_bar=False",
        f"--workdir={tmp_path / 'run'}",
    )
    assert code != 0
    line = _one_line(stderr)  # the method's factory or the state refuses it
    assert line.startswith("ValueError: ") and "num_networks" in line and f"{count}" in line
    assert not os.path.exists(tmp_path / "run")  # refused before anything is written


@pytest.mark.parametrize("count", [0, -1, 1.0, True, "2"])
def test_the_state_refuses_a_network_count_that_is_not_a_positive_integer(count):
    """Whatever method passes it (a factory that does not check, a researcher's method)."""
    with pytest.raises(ValueError, match=rf"^method_kwargs.num_networks={count!r} must be "):
        state_lib.create(
            model_fn=lambda rngs: nnx.Linear(2, 2, rngs=rngs),
            tx=optax.sgd(0.1),
            memory=base.empty_memory(None),
            num_networks=count,
            seed=0,
        )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-epoch run."""
    workdir = tmp_path_factory.mktemp("ensemble") / "finished"
    config = tiny(load_config("vse", "synthetic"), epochs=1)
    config.model.embed_dim, config.model.tokens.word_dim = 32, 16  # array files test_faults damages
    config.train.num_devices = 1
    train_and_evaluate(config, str(workdir))
    return workdir


def _edit_config(workdir, edit):
    with open(workdir / "config.json") as f:
        config = json.load(f)
    edit(config)
    with open(workdir / "config.json", "w") as f:
        json.dump(config, f)


def _other_data(config):
    config["data"]["seed"] += 1


def _other_pool(config):  # UGNCL combines similarities by their log-mean-exp
    config["method"], config["method_kwargs"] = "ugncl", {"xi1": 0.0}  # no cosine-head warning


def _no_results(workdir):
    os.remove(workdir / "results.json")


def _no_best(workdir):
    shutil.rmtree(workdir / "checkpoints" / "best")


def _damaged_best(workdir):
    (best,) = os.listdir(workdir / "checkpoints" / "best")
    _truncate_array_files(workdir / "checkpoints" / "best" / best / "state")


# case: (what is done to a copy of the finished run, extra arguments, the message's start)
CASES = {
    "missing run": (lambda w: shutil.rmtree(w), (), "FileNotFoundError: {copy}/config.json not"),
    "unfinished run": (_no_results, (), "FileNotFoundError: {copy} has not finished training"),
    "different data": (
        lambda w: _edit_config(w, _other_data),
        (),
        "ValueError: {run} and {copy} differ in config section 'data'",
    ),
    "different pooling": (
        lambda w: _edit_config(w, _other_pool),
        (),
        "ValueError: The runs combine similarities differently ('logmeanexp', 'mean'",
    ),
    "bad split": (lambda w: None, ("--split=tset",), "ValueError: Unknown split 'tset'"),
    "section not an object": (  # was a traceback: 'int' object has no attribute ...
        lambda w: _edit_config(w, lambda c: c.__setitem__("model", 5)),
        (),
        "ValueError: {copy}/config.json is damaged: its 'model' is not what a run writes",
    ),
    "no best checkpoint": (_no_best, (), "FileNotFoundError: {copy} finished but has no best"),
    "damaged best checkpoint": (
        _damaged_best,
        (),
        "CheckpointError: The best checkpoint {copy}/checkpoints/best/10 cannot be restored",
    ),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_ensemble_errors_are_one_line(finished, tmp_path, case):
    damage, extra, message = CASES[case]
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    damage(copy)
    code, stderr = _run(  # the damaged copy first: it fails before the other is encoded
        "-m", "ncljax.train.ensemble", f"--workdir={copy}", f"--workdir={finished}", *extra
    )
    assert code != 0
    assert _one_line(stderr).startswith(message.format(copy=copy, run=finished))


def test_ensemble_prints_only_its_results(finished):
    """No orbax log lines; a run pooled with itself scores what it scored alone."""
    args = ["-m", "ncljax.train.ensemble", f"--workdir={finished}", f"--workdir={finished}"]
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    with open(finished / "results.json") as f:
        alone = json.load(f)
    pooled = json.loads(out.stdout)
    assert pooled == pytest.approx({k: alone[k] for k in pooled}, abs=1e-9)


def test_a_setting_whose_default_is_none_takes_a_command_line_value(tmp_path):
    # configs/ncr.py:vectors sets noisy_start_epoch=None; ml_collections takes no value for
    # a plain None field, so the config keeps it as a placeholder of the setting's type.
    code, stderr = _train_py(
        "--config=configs/ncr.py:vectors",
        f"--config.data.folder={tmp_path / 'absent'}",
        "--config.method_kwargs.noisy_start_epoch=3",
        f"--workdir={tmp_path / 'run'}",
    )
    assert code != 0
    line = _one_line(stderr)  # parsed; the missing folder is what stops it
    assert "not supported for overriding" not in line and "absent" in line, line


# config files that cannot be loaded: (file text, what the one line says after the error)
BROKEN_CONFIGS = {
    "not python": ("This is not a config.\n", "SyntaxError: invalid syntax (line 1)"),
    "nul bytes": ("\x00", "SyntaxError: source code string cannot contain null bytes"),
    "no get_config": ("x = 1\n", "AttributeError: it defines no get_config()"),
    "get_config raises": (
        "def get_config(arg=None):\n    raise RuntimeError('boom')\n",
        "RuntimeError: boom (line 2)",
    ),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(BROKEN_CONFIGS))
def test_a_config_file_that_cannot_be_loaded_is_one_line(tmp_path, case):
    # A traceback of 35-52 lines ending in the error, or "Unknown config field in []".
    text, says = BROKEN_CONFIGS[case]
    path = tmp_path / "mine.py"
    path.write_text(text)
    code, stderr = _train_py(f"--config={path}", f"--workdir={tmp_path / 'run'}")
    line = _one_line(stderr)
    assert code != 0 and line.startswith(f"Config file {path} cannot be loaded: {says}"), line
    assert "-v 1 shows the traceback" in line and not os.path.exists(tmp_path / "run")


def test_a_config_file_returning_no_config_is_one_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def get_config(arg=None):\n    return 3\n")  # AttributeError, traceback
    code, stderr = _train_py(f"--config={path}", f"--workdir={tmp_path / 'run'}")
    assert code != 0 and _one_line(stderr).startswith(
        f"Config file {path}: get_config('') returned int, not an ml_collections.ConfigDict"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [  # absl's two lines ("FATAL Flags parsing error" and "Pass --helpshort ..."), a
        # traceback (--flagfile), the whole help (a stray argument), or an errno message
        ((), "--config is required: pass a config file and its argument"),
        (
            ("--config=configs/vse.py:synthetic,quick", "--config.train.epochs=2.5"),
            "flag --config.train.epochs=2.5: invalid literal for int() with base 10: '2.5': "
            "--config.train.epochs takes an int",
        ),
        (
            ("--config=configs/vse.py:synthetic,quick", "--epochs=3"),
            "Unknown command line flag 'epochs': check its spelling",
        ),
        (
            ("--config=configs/vse.py:synthetic,quick", "stray"),
            "Unexpected arguments ['stray']: python train.py takes only flags",
        ),
        (
            ("--config=configs/vse.py:synthetic,quick", "--flagfile=/nonexistent/run.flags"),
            "Unable to open flagfile: [Errno 2] No such file or directory: "
            "'/nonexistent/run.flags': pass an existing --flagfile",
        ),
        (("--config=configs/vse.py:synthetic,quick", "--workdir="), "--workdir is empty: pass"),
        (
            ("--config=configs/gsc.py:f30k,quick", "--config.model.sim_dim=512"),
            "--config.model.sim_dim is now --config.model.sgraf.sim_dim: config fields moved",
        ),
        (
            ("--config=configs/vse.py:synthetic,quick", "--config.noise.file=index.npy"),
            "--config.noise.file is now --config.noise.file.path: config fields moved",
        ),
    ],
)
def test_flag_errors_are_one_line(args, says):
    code, stderr = _train_py(*args)
    line = _one_line(stderr)
    assert code != 0 and line.startswith(says), line


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("module", "args", "says"),
    [  # absl's two lines, or its usage error: the whole help (46-103 lines)
        ("ncljax.audit", ("--workdir=x", "stray"), "Unexpected arguments ['stray']"),
        ("ncljax.audit", (), "--workdir is required: pass --workdir=..."),
        ("ncljax.retrieve", ("--workdir=x", "--k=abc"), "flag --k=abc: invalid literal for int()"),
        ("ncljax.retrieve", ("--workdir=x", "--topk=3"), "Unknown command line flag 'topk'"),
        ("ncljax.train.ensemble", ("--workdir=x", "stray"), "Unexpected arguments ['stray']"),
    ],
)
def test_the_commands_flag_errors_are_one_line(module, args, says):
    code, stderr = _run("-m", module, *args)
    line = _one_line(stderr)
    assert code != 0 and line.startswith(says), line
    assert f"python -m {module} --helpshort lists" in line
