"""Faults a run must survive: a locked workdir, damaged checkpoints and logs, a full disk,
an unwritable workdir, invalid settings, a collapsed model."""

import asyncio
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from ncljax.config import fields, files
from ncljax.train import checkpoint, loop, rundir, train_and_evaluate, trajectory
from tests.train.test_loop import ROOT, chance_rsum, load_config, read_metrics, tiny

pytestmark = pytest.mark.heavy  # out of the default run; CI runs it (see pyproject.toml)

# The tiny config: 64 images x 5 captions = 320 training pairs, 10 steps of 32 per epoch.


def _config(epochs=3):
    config = tiny(load_config("vse", "synthetic"), epochs=epochs)
    config.model.embed_dim, config.model.tokens.word_dim = 32, 16
    return config


class Crash(Exception):
    pass


def _crash_at(crash_epoch):
    def callback(epoch, metrics):
        if epoch == crash_epoch:
            raise Crash

    return callback


def _results(workdir):
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


def _same_rows(got, want):
    key = lambda r: (r["split"], r["step"])
    assert sorted(map(key, got)) == sorted(map(key, want))
    for a, b in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        for name, value in b.items():
            if name not in loop.WALL_CLOCK:
                assert a[name] == pytest.approx(value, abs=1e-9), (a["split"], a["step"], name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 3-epoch run, and one killed after epoch 1 (checkpoints 10 and 20).

    Text dropout, so its randomness must resume exactly too, and batches of two widths
    (one compilation each); the tests below resume the killed run and compare it with the
    uninterrupted one."""
    root = tmp_path_factory.mktemp("runs")
    config = _config()
    config.model.tokens.dropout = 0.2
    config.data.length_buckets = (10, 12)
    straight = train_and_evaluate(config, str(root / "straight"))
    with pytest.raises(Crash):
        train_and_evaluate(config, str(root / "crashed"), callbacks=[_crash_at(1)])
    assert sorted(os.listdir(root / "crashed" / "checkpoints" / "latest")) == ["10", "20"]
    return config, straight, root


def _largest_file(directory):
    files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _truncate_array_files(state):
    """Every array data file (orbax's OCDBT may leave unreferenced data in one of them)."""
    data = state / "ocdbt.process_0" / "d"
    for name in os.listdir(data):
        if os.path.getsize(data / name) > 4096:
            _truncate(data / name)


DAMAGE = {
    "truncated array files": lambda step: _truncate_array_files(step / "state"),
    "truncated progress JSON": lambda step: _truncate(step / "meta" / "metadata"),
    "truncated orbax metadata": lambda step: _truncate(step / "state" / "_METADATA"),
    "missing state item": lambda step: shutil.rmtree(step / "state"),
}


@pytest.mark.parametrize(
    "damage",
    list(DAMAGE),  # every kind in the default run: the resumes reuse the fixture's programs
)
def test_damaged_latest_checkpoint_resumes_from_the_previous_one(
    runs, tmp_path, damage, caplog, capsys
):
    config, straight, root = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "crashed", workdir)
    DAMAGE[damage](workdir / "checkpoints" / "latest" / "20")
    with caplog.at_level(logging.WARNING):
        resumed = train_and_evaluate(config, str(workdir))
    assert "Resumed from step 10" in capsys.readouterr().out
    assert os.path.isdir(workdir / "checkpoints" / "damaged" / "latest-20")  # never deleted
    assert resumed == pytest.approx(straight, abs=1e-9)
    _same_rows(read_metrics(workdir), read_metrics(root / "straight"))
    assert "latest/20 cannot be restored" in caplog.text, caplog.text
    assert "step 10 instead" in caplog.text


def test_no_restorable_checkpoint_is_one_clear_error(runs, tmp_path):
    config, _, root = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "crashed", workdir)
    for step in ("10", "20"):
        shutil.rmtree(workdir / "checkpoints" / "latest" / step / "state")
    with pytest.raises(checkpoint.CheckpointError, match=r"No checkpoint in .* can be restored"):
        train_and_evaluate(config, str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints" / "damaged")) == ["latest-10", "latest-20"]


def test_damaged_best_checkpoint_keeps_metrics_and_results(runs, tmp_path):
    config, _, root = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "straight", workdir)
    rows, results = read_metrics(workdir), _results(workdir)
    (best,) = os.listdir(workdir / "checkpoints" / "best")
    _truncate_array_files(workdir / "checkpoints" / "best" / best / "state")
    with pytest.raises(checkpoint.CheckpointError, match=f"best/{best} cannot be restored"):
        train_and_evaluate(config, str(workdir))
    assert read_metrics(workdir) == rows  # the test row is still there
    assert _results(workdir) == results


def test_partial_last_metrics_line_is_dropped_with_a_warning(runs, tmp_path, caplog):
    config, straight, root = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "crashed", workdir)
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 24, "epoch": 2, "split": "tr')  # a power cut mid-write
    with caplog.at_level(logging.WARNING):
        resumed = train_and_evaluate(config, str(workdir))
    assert resumed == pytest.approx(straight, abs=1e-9)
    _same_rows(read_metrics(workdir), read_metrics(root / "straight"))
    assert "partly written" in caplog.text


def _train_py_args(config, workdir):
    """``train.py``'s command line for ``_config()`` as the ``runs`` fixture changes it."""
    return [
        os.path.join(ROOT, "train.py"),
        "--config=" + os.path.join(ROOT, "configs", "vse.py") + ":synthetic",
        *(
            f"--config.{field}={fields.get(config, field)}"
            for field in (
                "data.num_train",
                "data.num_val",
                "data.num_test",
                "train.epochs",
                "train.batch_size",
                "train.log_every_steps",
                "train.progress_bar",
                "eval.batch_size",
                "model.embed_dim",
                "model.tokens.word_dim",
                "model.tokens.dropout",
                "data.length_buckets",
            )
        ),
        f"--workdir={workdir}",
    ]


def test_ctrl_c_is_one_line_and_the_same_command_resumes(runs, tmp_path):
    """SIGINT after the first checkpoint: one line, exit code 130, the lock and the
    checkpoints closed; the same command then finishes with the uninterrupted run's results."""
    config, _, root = runs
    workdir = tmp_path / "run"
    cmd = [sys.executable, *_train_py_args(config, workdir)]
    # A child inherits an ignored SIGINT (tests started in the background) but not a
    # handled one: with a handler here it starts with the default, Python's KeyboardInterrupt.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        child = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        deadline = time.monotonic() + 300
        while not os.path.isdir(workdir / "checkpoints" / "latest" / "10"):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)  # in epoch 1, or in a save at its end
        _, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, stderr[-3000:]
    assert stderr.strip() == "Interrupted; run the same command to resume."
    assert not os.path.exists(workdir / "results.json")
    with open(workdir / "config.json") as f, open(root / "straight" / "config.json") as g:
        assert json.load(f) == json.load(g)  # the command line is the fixture's config
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resumed from step" in rerun.stdout
    assert _results(workdir) == pytest.approx(_results(root / "straight"), abs=1e-9)
    _same_rows(read_metrics(workdir), read_metrics(root / "straight"))


def test_opening_the_checkpoints_waits_for_orbax_to_remove_a_cut_short_save(tmp_path, monkeypatch):
    """orbax removes an interrupted save's temporary directories in a thread that its
    ``close`` does not wait for: a process that ends soon after opening its checkpoints
    (an error, ``ncljax.train.ensemble``, Ctrl-C) printed that thread's traceback at exit.
    A slow removal (0.5 s) is done when the ``Checkpointer`` is open."""
    from orbax.checkpoint._src.path import temporary_paths

    remove = temporary_paths.cleanup_temporary_paths

    async def slow_remove(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await remove(*args, **kwargs)

    monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow_remove)
    for manager in ("latest", "best"):
        os.makedirs(tmp_path / manager / "20.orbax-checkpoint-tmp")
    checkpointer = checkpoint.Checkpointer(str(tmp_path))
    try:
        assert os.listdir(tmp_path / "latest") == os.listdir(tmp_path / "best") == []
    finally:
        checkpointer.close()


def test_kill_between_best_and_latest_save_keeps_the_runs_own_best(tmp_path, monkeypatch):
    """Killed after epoch 1's best save, before its latest save; resumed with another lr.

    The best model must come from the resumed run's own history, as in a run that was
    killed cleanly after epoch 0 and resumed with that lr; and so must each pair's
    similarity of epoch 1 (``train.pair_trajectory``), written before the kill with the
    old lr and again after it.
    """
    config = _config(epochs=2)
    config.train.pair_trajectory = True
    with pytest.raises(Crash):
        train_and_evaluate(config, str(tmp_path / "reference"), callbacks=[_crash_at(0)])

    save = checkpoint.Checkpointer.save

    def killed_at_step_20(self, state, meta, streams):
        if int(state.step) == 20:
            raise Crash
        save(self, state, meta, streams)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", killed_at_step_20)
    with pytest.raises(Crash):
        train_and_evaluate(config, str(tmp_path / "killed"))
    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    assert "20" in os.listdir(tmp_path / "killed" / "checkpoints" / "best")
    assert os.listdir(tmp_path / "killed" / "checkpoints" / "latest") == ["10"]

    config.optim.learning_rate *= 20  # a resumable field: the epoch-1 model differs
    killed_epoch_1 = np.load(trajectory.epoch_path(str(tmp_path / "killed"), 1))
    want = train_and_evaluate(config, str(tmp_path / "reference"))
    got = train_and_evaluate(config, str(tmp_path / "killed"))
    assert got == pytest.approx(want, abs=1e-9)
    for epoch in (0, 1):
        np.testing.assert_array_equal(
            np.load(trajectory.epoch_path(str(tmp_path / "killed"), epoch)),
            np.load(trajectory.epoch_path(str(tmp_path / "reference"), epoch)),
        )
    assert not np.array_equal(
        killed_epoch_1, np.load(trajectory.epoch_path(str(tmp_path / "killed"), 1))
    )


def test_mid_pass_resume_logs_the_rows_of_the_uninterrupted_run(tmp_path, monkeypatch):
    config = _config(epochs=2)
    config.train.checkpoint_every_steps = 3  # steps 3, 6, 9, 12, ...; a log line every 4
    straight = train_and_evaluate(config, str(tmp_path / "straight"))
    save = checkpoint.Checkpointer.save

    def crash_after_step_12(self, state, meta, streams):
        save(self, state, meta, streams)
        if int(state.step) == 12:  # mid-epoch 1, two steps after its first log line
            raise Crash

    monkeypatch.setattr(checkpoint.Checkpointer, "save", crash_after_step_12)
    with pytest.raises(Crash):
        train_and_evaluate(config, str(tmp_path / "resumed"))
    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    resumed = train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed == pytest.approx(straight, abs=1e-9)
    _same_rows(read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "straight"))


def test_full_disk_during_a_save_keeps_the_earlier_checkpoints(runs, tmp_path, monkeypatch):
    config, straight, root = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "crashed", workdir)
    write = ocp.JsonCheckpointHandler._save_fn

    async def disk_full(self, x, directory):
        if "/latest/" in str(directory):  # the progress record of the next save
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return await write(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", disk_full)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 30 .* \[10, 20\] are intact"):
        train_and_evaluate(config, str(workdir))
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", write)
    latest = workdir / "checkpoints" / "latest"
    assert sorted(os.listdir(latest)) == ["10", "20", "30.orbax-checkpoint-tmp"]
    resumed = train_and_evaluate(config, str(workdir))
    assert resumed == pytest.approx(straight, abs=1e-9)
    assert sorted(os.listdir(latest)) == ["20", "30"]  # the partial save was cleaned up


def test_unwritable_workdir_is_one_message(tmp_path, monkeypatch):
    """Root ignores file permissions, so the PermissionError is injected."""
    config = _config(epochs=1)
    workdir = tmp_path / "run"
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).startswith(str(workdir)) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(PermissionError, match=f"cannot write to the run directory {workdir}"):
        train_and_evaluate(config, str(workdir))


def test_second_process_on_a_workdir_is_refused(tmp_path):
    workdir = tmp_path / "run"
    os.makedirs(workdir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys, time
                from ncljax.train import rundir
                with rundir.WorkdirLock({str(workdir)!r}):
                    print("locked", flush=True)
                    sys.stdin.readline()
            """),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        pattern = f"in use by another run \\(host {socket.gethostname()} pid {holder.pid}\\)"
        with pytest.raises(rundir.WorkdirLocked, match=pattern):
            train_and_evaluate(_config(epochs=1), str(workdir))
        assert not os.path.exists(workdir / "config.json")  # refused before writing
    finally:
        holder.communicate("\n", timeout=60)
    # Killed holders leave their record in the file; the next run takes over.
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import os; from ncljax.train import rundir; "
            f"rundir.WorkdirLock({str(workdir)!r}).acquire(); os._exit(9)",
        ],
        cwd=ROOT,
    )
    assert killed.returncode == 9
    with open(workdir / "lock") as f:
        assert f.read().startswith(f"host {socket.gethostname()} pid ")
    lock = rundir.WorkdirLock(str(workdir))
    lock.acquire()  # the stale lock of a dead process
    lock.release()


def test_a_run_inside_a_run_is_refused(tmp_path, caplog):
    config = _config(epochs=1)

    def second_run(epoch, metrics):
        with pytest.raises(rundir.WorkdirLocked, match=f"pid {os.getpid()}"):
            train_and_evaluate(config, str(tmp_path))

    train_and_evaluate(config, str(tmp_path), callbacks=[second_run])
    with open(tmp_path / "lock") as f:
        assert f.read() == ""  # released
    with open(tmp_path / "lock", "w") as f:
        f.write("host elsewhere pid 4242\n")  # a killed run's record, its flock gone
    lock = rundir.WorkdirLock(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    lock.release()
    assert "Took over the lock" in caplog.text and "pid 4242" in caplog.text


BAD_FIELDS = {
    "train.log_every_steps": 0,
    "eval.batch_size": 0,
    "optim.learning_rate": -2e-4,
    "data.length_buckets": ("abc",),  # what --config.data.length_buckets=abc gives
    "model.head": "sgrr",
    "optim.name": "sgd",
    "train.checkpoint_every_steps": -1,
}


@pytest.mark.parametrize("field", list(BAD_FIELDS))
def test_bad_fields_are_refused_before_anything_is_written(tmp_path, field):
    config = _config(epochs=1)
    section, name = field.split(".")
    with config.unlocked():
        config[section][name] = BAD_FIELDS[field]
    with pytest.raises(ValueError, match=f"{field}="):
        train_and_evaluate(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_contradictory_noise_fields_are_refused(tmp_path, caplog):
    config = _config(epochs=1)
    config.noise.kind, config.noise.rate = "per_caption", 0.4
    config.noise.file.path = str(tmp_path / "noise.npy")
    with pytest.raises(ValueError, match=r"only read with noise.kind=.file."):
        train_and_evaluate(config, str(tmp_path / "a"))
    config.noise.kind, config.noise.file.path = "none", ""
    config.train.epochs = 0  # stops at the next check: the warning comes first
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match=r"train\.epochs=0"):
        train_and_evaluate(config, str(tmp_path / "b"))
    assert "noise.rate=0.4 has no effect with noise.kind='none'" in caplog.text
    config.train.epochs = 1
    # A file whose realised rate contradicts noise.rate.
    config.noise.kind, config.noise.rate = "file", 0.2
    config.noise.file.path = str(tmp_path / "noise.npy")
    index = np.repeat(np.arange(64), 5)  # the image of each caption
    index[:160] = np.roll(index[:160], 5)  # half the captions moved to another image
    np.save(config.noise.file.path, index)
    with pytest.raises(ValueError, match=r"noise.rate=0.2 but the noise file"):
        train_and_evaluate(config, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c")


def test_a_collapsed_model_is_never_the_best(tmp_path):
    """A learning rate of 1e6 collapses the embeddings (every rate from 1e3 to 1e15 gives the
    same tied validation score); ties must not score it 600. (At 1e20 the weights overflow
    float32 on some CPUs and the run stops on its non-finite guard instead.)"""
    config = _config(epochs=2)
    with pytest.raises(Crash):
        train_and_evaluate(config, str(tmp_path), callbacks=[_crash_at(0)])
    config.optim.learning_rate = 1e6  # a resumable field
    results = train_and_evaluate(config, str(tmp_path))
    val = [r for r in read_metrics(tmp_path) if r["split"] == "val"]
    assert results["best_epoch"] == 0, val
    assert val[1]["rsum"] < 1.5 * chance_rsum(config.data.num_val, 5), val[1]


def test_missing_config_file_is_one_line(tmp_path):
    missing = str(tmp_path / "nope.py")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={missing}:quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip() == (
        f"Config file {missing} not found; pass an existing file or a shipped config by name "
        f"({', '.join(files.names())}), e.g. --config=quickstart."
    )
