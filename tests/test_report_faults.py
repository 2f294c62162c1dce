"""The robustness report under faults: a killed or interrupted report takes its training
processes with it, a run another process trains is refused (and its wall time not
recorded), damaged or copied run folders and a bad ``--out`` or ``--set`` are named in one
line. ``train.py`` is replaced by a fake that writes ``results.json`` (or sleeps), so each
test takes seconds."""

import contextlib
import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import termios
import time

import pytest

from ncljax import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = report.Run("pairs", "vse", "small_global", 0.4, 0)

# train.py's stand-in: writes its pid, sleeps FAKE_SLEEP seconds, writes results.json
# unless FAKE_RESULTS=0 and exits with FAKE_EXIT; Ctrl-C: a second to close its
# checkpoints (the file "closed"), exit 130.
FAKE_TRAIN = """\
import json, os, sys, time
workdir = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir=")][0]
with open(os.path.join(workdir, "pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(workdir, "pid.tmp"), os.path.join(workdir, "child.pid"))
try:
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
except KeyboardInterrupt:
    time.sleep(1)
    open(os.path.join(workdir, "closed"), "w").close()
    sys.exit(130)
if os.environ.get("FAKE_RESULTS", "1") == "1":
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"rsum": 100.0, "best_epoch": 0}, f)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""
# The report's command line with the fake as its training command.
CLI = (
    "import sys; from ncljax import report; "
    "report.TRAIN_COMMAND = (sys.executable, sys.argv.pop(1)); report.cli()"
)


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    monkeypatch.setattr(report, "TRAIN_COMMAND", (sys.executable, str(path)))
    return str(path)


def _cli(fake, *args, env=None, **kwargs):
    """The report's command line, a Popen (``kwargs``: more of Popen's arguments)."""
    cmd = [sys.executable, "-c", CLI, fake, *args]
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def _run_cli(fake, *args, env=None):
    process = _cli(fake, *args, env=env)
    stdout, stderr = process.communicate(timeout=120)
    return process.returncode, stdout, stderr


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _child_pid(workdir: str, timeout: float = 60.0) -> int:
    path = os.path.join(workdir, "child.pid")
    assert _wait_for(lambda: os.path.exists(path), timeout), "the fake train.py never started"
    with open(path) as f:
        return int(f.read())


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    return lines[0]


# --- the report's children ---------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_killed_report_takes_its_training_process_with_it(fake_train, tmp_path):
    out = str(tmp_path / "k")
    args = [f"--out={out}", "--methods=vse", "--worlds=small_global", "--rates=0.4"]
    parent = _cli(fake_train, *args, env={"FAKE_SLEEP": "60"})
    child = None
    try:
        child = _child_pid(RUN.workdir(out))
        parent.kill()  # SIGKILL: no handler runs in the report
        parent.communicate()
        assert _wait_for(lambda: not _alive(child), 10), "train.py outlived the report"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        (signal.SIGINT, 130, "Interrupted; run the same command to resume."),
        (signal.SIGTERM, 143, "Terminated (SIGTERM); run the same command to resume."),
    ],
)
def test_ctrl_c_or_sigterm_ends_the_runs_and_says_how_to_resume(
    fake_train, tmp_path, sig, code, line
):
    out = str(tmp_path / "i")
    args = [f"--out={out}", "--methods=vse", "--worlds=small_global", "--rates=0.4"]
    parent = _cli(fake_train, *args, env={"FAKE_SLEEP": "60"})
    child = None
    try:
        child = _child_pid(RUN.workdir(out))
        parent.send_signal(sig)  # the report alone: its child is not told
        _, stderr = parent.communicate(timeout=30)
        assert parent.returncode == code
        assert _one_line(stderr) == line
        assert not _alive(child)
        assert not os.path.exists(os.path.join(RUN.workdir(out), report.RECORD))  # not failed
    finally:
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _controlling_terminal():
    """Makes the child's stdin, a pseudo-terminal, its controlling terminal (its session's
    foreground: Ctrl-C there reaches the report and its children)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux pseudo-terminal")
def test_ctrl_c_in_a_terminal_lets_train_py_close_its_checkpoints(fake_train, tmp_path):
    out = str(tmp_path / "t")
    args = [f"--out={out}", "--methods=vse", "--worlds=small_global", "--rates=0.4"]
    master, slave = os.openpty()
    parent = _cli(
        fake_train,
        *args,
        env={"FAKE_SLEEP": "60"},
        stdin=slave,
        start_new_session=True,
        preexec_fn=_controlling_terminal,
    )
    os.close(slave)
    child = None
    try:
        child = _child_pid(RUN.workdir(out))
        os.write(master, b"\x03")  # Ctrl-C: SIGINT to the report and train.py
        _, stderr = parent.communicate(timeout=30)
        assert parent.returncode == 130
        assert _one_line(stderr) == "Interrupted; run the same command to resume."
        assert os.path.exists(os.path.join(RUN.workdir(out), "closed"))  # not cut short
    finally:
        os.close(master)
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_run_another_process_trains_is_refused_and_not_timed(fake_train, tmp_path, capsys):
    out = str(tmp_path)
    workdir = RUN.workdir(out)
    os.makedirs(workdir)
    with open(os.path.join(workdir, "lock"), "w") as lock:  # as train.py holds it
        lock.write("host elsewhere pid 4321\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (outcome,) = report.sweep([RUN], out)
    assert outcome.returncode is None and "pid 4321" in outcome.refused
    assert "NOT STARTED" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(workdir, "child.pid"))  # train.py never started
    assert not os.path.exists(os.path.join(workdir, report.RECORD))
    assert not report._failed(outcome)


def test_a_failed_attempt_records_no_wall_time_and_leaves_a_finished_run_alone(
    fake_train, tmp_path, monkeypatch
):
    out = str(tmp_path)
    # train.py refused (exit 1) while the run's earlier process finished it (results.json).
    monkeypatch.setenv("FAKE_SLEEP", "0.3")
    monkeypatch.setenv("FAKE_EXIT", "1")
    (outcome,) = report.sweep([RUN], out)
    assert outcome.returncode == 1 and outcome.wall_s >= 0.3
    assert not os.path.exists(os.path.join(RUN.workdir(out), report.RECORD))
    finished, failed = report.collect(out, "pairs")
    assert [r["wall_s"] for r in finished] == [None] and failed == []
    # A record of a failed attempt, as the report wrote it before, gives no wall time.
    with open(os.path.join(RUN.workdir(out), report.RECORD), "w") as f:
        json.dump({"returncode": 1, "wall_s": 4.3, "settings": {"quick": False, "set": []}}, f)
    finished, _ = report.collect(out, "pairs")
    assert finished[0]["wall_s"] is None
    # A failed attempt on an unfinished run is recorded, without a wall time.
    os.remove(os.path.join(RUN.workdir(out), "results.json"))
    monkeypatch.setenv("FAKE_RESULTS", "0")
    report.sweep([RUN], out)
    with open(os.path.join(RUN.workdir(out), report.RECORD)) as f:
        record = json.load(f)
    assert record["returncode"] == 1 and record["wall_s"] is None
    _, failed = report.collect(out, "pairs")
    assert [r["seed"] for r in failed] == [0]
    # A finished attempt records its wall time.
    monkeypatch.setenv("FAKE_RESULTS", "1")
    monkeypatch.setenv("FAKE_EXIT", "0")
    (outcome,) = report.sweep([RUN], out)
    with open(os.path.join(RUN.workdir(out), report.RECORD)) as f:
        assert json.load(f)["wall_s"] == pytest.approx(outcome.wall_s)


# --- damaged and copied run folders ----------------------------------------------------


def _finished_run(out, run=RUN, results=None, wall_s=10.0):
    workdir = run.workdir(str(out))
    os.makedirs(workdir)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results or {"rsum": 100.0, "best_epoch": 0}, f)
    record = {**run._asdict(), "returncode": 0, "wall_s": wall_s}
    record["settings"] = {"quick": False, "set": [], "noisy_val": False}
    with open(os.path.join(workdir, report.RECORD), "w") as f:
        json.dump(record, f)
    return workdir


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


DAMAGES = {
    "truncated results": ("results.json", '{"rsum": 1', "is not JSON"),
    "results not an object": ("results.json", "[1, 2]", "holds a JSON list, not an object"),
    "results of another family": ("results.json", '{"map_avg": 0.5}', "has no 'rsum'"),
    "damaged record": (report.RECORD, "", "is not JSON"),
    "damaged audit record": (report.AUDIT_RECORD, "{", "is not JSON"),
    "record of another seed": (
        report.RECORD,
        json.dumps({**RUN._asdict(), "seed": 3, "returncode": 0, "wall_s": 1.0}),
        "a copied or renamed run folder",
    ),
    "config of another method": (
        "config.json",
        json.dumps({"method": "ncr", "seed": 0, "noise": {"rate": 0.4}}),
        "a copied or renamed run folder",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_or_copied_run_is_named_and_the_table_still_written(tmp_path, capsys, damage):
    name, text, problem = DAMAGES[damage]
    _finished_run(tmp_path, report.Run("pairs", "vse", "small_global", 0.4, 1))
    workdir = _finished_run(tmp_path)
    _write(os.path.join(workdir, name), text)
    paths = report.report(str(tmp_path), "pairs")
    line = _one_line(capsys.readouterr().err)
    assert os.path.join(workdir, name) in line and problem in line
    rows = report.summarise(report.collect(str(tmp_path), "pairs")[0], "pairs")
    assert [(r["n"], r["seeds"]) for r in rows] == [(1, [1])]  # the damaged run is left out
    with open(paths["md"]) as f:
        text = f.read()
    assert "## Damaged runs" in text and os.path.join(workdir, name) in text


def test_a_renamed_run_folder_is_named_not_a_traceback(tmp_path, capsys):
    workdir = _finished_run(tmp_path)
    os.rename(workdir, workdir + " copy")
    report.report(str(tmp_path), "pairs")
    line = _one_line(capsys.readouterr().err)
    assert workdir + " copy" in line and "not a run folder of the report" in line


def test_aggregate_only_names_a_damaged_results_json_and_writes_the_table(fake_train, tmp_path):
    out = str(tmp_path / "a")
    _finished_run(out, report.Run("pairs", "vse", "small_global", 0.4, 1))
    workdir = _finished_run(out)
    _write(os.path.join(workdir, "results.json"), '{"rsum": 1')
    code, stdout, stderr = _run_cli(fake_train, f"--out={out}", "--aggregate_only")
    assert code == 0, stderr
    assert os.path.join(workdir, "results.json") in _one_line(stderr)
    assert "Report: " in stdout and os.path.exists(os.path.join(out, "report_pairs.csv"))


def test_a_sweep_tests_a_damaged_run_again_and_reads_past_a_damaged_record(
    fake_train, tmp_path, capsys
):
    out = str(tmp_path)
    damaged = _finished_run(out)
    _write(os.path.join(damaged, "results.json"), "[")
    other = report.Run("pairs", "vse", "small_global", 0.4, 1)
    _write(os.path.join(_finished_run(out, other), report.RECORD), "{")
    outcomes = report.sweep([RUN, other], out)
    assert {o.run.seed: o.returncode for o in outcomes} == {0: 0, 1: None}  # 0 trained again
    with open(os.path.join(damaged, "results.json")) as f:
        assert json.load(f)["rsum"] == 100.0
    assert "is not JSON" in capsys.readouterr().out


def test_a_sweep_refuses_a_copied_run_folder(fake_train, tmp_path):
    out = str(tmp_path)
    workdir = _finished_run(out, RUN)  # copied to seed 1
    copy = report.Run("pairs", "vse", "small_global", 0.4, 1).workdir(out)
    os.rename(workdir, copy)
    (outcome,) = report.sweep([report.Run("pairs", "vse", "small_global", 0.4, 1)], out)
    assert outcome.returncode is None and "seed 0" in outcome.refused
    assert "copied or renamed" in outcome.refused and workdir in outcome.refused


def test_a_real_world_run_copied_from_another_out_is_refused(fake_train, tmp_path):
    run = report.Run("pairs", "gsc", "cancer", 0.4, 0)
    workdir = run.workdir(str(tmp_path / "new"))
    os.makedirs(workdir)  # an interrupted run copied from tmp_path/old
    old = os.path.join(os.path.abspath(run.cell(str(tmp_path / "old"))), "folder")
    config = {"method": "gsc", "seed": 0, "noise": {"rate": 0.0}, "data": {"folder": old}}
    _write(os.path.join(workdir, "config.json"), json.dumps(config))
    (outcome,) = report.sweep([run], str(tmp_path / "new"))
    assert outcome.returncode is None and old in outcome.refused
    assert "copied from another --out" in outcome.refused
    assert not os.path.exists(os.path.join(workdir, "child.pid"))


# --- the command line -------------------------------------------------------------------


def test_an_out_that_is_a_file_is_one_line(fake_train, tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    code, _, stderr = _run_cli(fake_train, f"--out={path}", "--aggregate_only")
    assert code != 0 and f"--out={path} is a file" in _one_line(stderr)


def test_an_out_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(report.tempfile, "TemporaryFile", read_only)
    with pytest.raises(ValueError, match=r"--out=\S+ cannot be written \(Permission denied\)"):
        report.check_out(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only folder")
def test_a_read_only_out_is_one_line(fake_train, tmp_path):
    out = tmp_path / "ro"
    out.mkdir(mode=0o500)
    with contextlib.ExitStack() as stack:
        stack.callback(out.chmod, 0o700)
        code, _, stderr = _run_cli(fake_train, f"--out={out}", "--aggregate_only")
    assert code != 0 and "cannot be written" in _one_line(stderr)


def test_a_set_without_a_value_is_one_line(fake_train, tmp_path):
    code, _, stderr = _run_cli(fake_train, f"--out={tmp_path}", "--set")
    line = _one_line(stderr)
    assert code != 0 and "--set" in line and "--set=<field>=<value>" in line
    assert "helpshort" not in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # An empty list (an empty shell variable) started every method / world of the family.
        (["--methods=", "--worlds=small_global"], "--methods is empty: name at least one"),
        (["--methods=vse", "--worlds="], "--worlds is empty: name at least one"),
        # Each run then failed in train.py ("expected non-negative integer").
        (["--methods=vse", "--worlds=small_global", "--seeds=-1"], "--seeds must be integers in"),
        # absl's usage error printed the whole help.
        (["--methods=vse", "stray"], "Unexpected arguments ['stray']"),
    ],
)
def test_sweep_flags_that_name_nothing_are_one_line(fake_train, tmp_path, args, says):
    out = tmp_path / "out"
    code, _, stderr = _run_cli(fake_train, f"--out={out}", "--rates=0.4", *args)
    assert code != 0 and says in _one_line(stderr)
    assert not os.path.exists(out / "runs")  # nothing was started


def test_aggregate_only_refuses_an_out_without_runs_of_the_family(fake_train, tmp_path):
    # A mistyped --out was created and given an empty table, exit status 0.
    typo = tmp_path / "typo"
    code, _, stderr = _run_cli(fake_train, f"--out={typo}", "--aggregate_only")
    assert code != 0 and f"--out={typo} does not exist" in _one_line(stderr)
    assert not os.path.exists(typo)
    out = tmp_path / "out"
    os.makedirs(out / "runs" / "labels" / "ce" / "labels_default" / "rate0.4" / "seed0")
    code, _, stderr = _run_cli(fake_train, f"--out={out}", "--aggregate_only")
    line = _one_line(stderr)
    assert code != 0 and "holds no runs of family 'pairs'" in line and "--family=labels" in line
    assert os.listdir(out) == ["runs"]  # no report written
