"""Ctrl-C while a command is still importing (jax takes seconds) ends it in one line."""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMANDS = {
    "audit": [sys.executable, "-m", "ncljax.audit", "--workdir=nowhere"],
    "retrieve": [sys.executable, "-m", "ncljax.retrieve", "--workdir=nowhere"],
    "ensemble": [sys.executable, "-m", "ncljax.train.ensemble", "--workdirs=nowhere"],
    "report": [sys.executable, "-m", "ncljax.report", "--out=nowhere"],
    "train": [sys.executable, os.path.join(ROOT, "train.py"), "--config=nowhere.py"],
}


def _wait_for_numpy(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/maps") as f:
            if "numpy" in f.read():
                return
        time.sleep(0.005)
    raise AssertionError("the command never imported numpy")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/<pid>/maps")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_during_the_imports_is_one_line(command, tmp_path):
    proc = subprocess.Popen(
        COMMANDS[command],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
    )
    _wait_for_numpy(proc.pid)  # imported after the package: jax's seconds are still ahead
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["Interrupted while starting; nothing was done."]
    assert os.listdir(tmp_path) == []


def test_importing_the_package_leaves_ctrl_c_alone():
    code = (
        "import signal, ncljax, ncljax.losses; "
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": ROOT})
