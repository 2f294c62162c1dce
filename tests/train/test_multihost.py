"""Several processes (hosts) give the same run as one process with as many devices."""

import json
import os
import socket
import subprocess
import sys

import ml_collections
import pytest

from ncljax import methods
from ncljax.data import vectors
from ncljax.train import train_and_evaluate
from tests.train import test_loop

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")


def run(workdir: str, cluster: dict) -> dict:
    """A tiny dual-network run with a refresh pass, on every device of every process
    (``distributed=True`` with the ``cluster`` section: the flag a user sets)."""
    methods.REGISTRY["refreshing"] = test_loop._refreshing_method
    config = test_loop.tiny(test_loop.load_config("vse", "synthetic"), epochs=2)
    config.method = "refreshing"
    config.method_kwargs = ml_collections.ConfigDict({"num_networks": 2})
    config.distributed = True
    config.cluster.update(cluster)
    return train_and_evaluate(config, workdir)


def race_config(folder: str) -> ml_collections.ConfigDict:
    """NCR's ``:vectors`` race on ``folder``, 3 short epochs, every division switched off
    (``noise_floor=1.0``): the divided run is its own undivided run."""
    config = test_loop.load_config("ncr", "vectors")
    config.data.folder = folder
    config.train.epochs, config.train.batch_size = 3, 32
    config.train.progress_bar = False
    config.method_kwargs.warmup_epochs = 1
    config.method_kwargs.noise_floor = 1.0
    return config


def run_race(workdir: str, cluster: dict, folder: str) -> dict:
    config = race_config(folder)
    config.distributed = True
    config.cluster.update(cluster)
    return train_and_evaluate(config, workdir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(tmp_path, *extra) -> list[dict]:
    """Both processes' returned results of one run in ``tmp_path / 'multi'``."""
    port = _free_port()
    outs = [tmp_path / f"out{p}.json" for p in range(2)]
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                str(p),
                "2",
                str(port),
                str(tmp_path / "multi"),
                str(outs[p]),
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    for w, log in zip(workers, logs, strict=True):
        assert w.returncode == 0, log[-3000:]
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.slow
def test_two_processes_equal_one_process_with_four_devices(tmp_path):
    multi = _two_processes(tmp_path)
    assert multi[0] == multi[1]
    single = train_and_evaluate(_single_config(), str(tmp_path / "single"))
    assert multi[0] == pytest.approx(single, abs=1e-6)


def _single_config():
    methods.REGISTRY["refreshing"] = test_loop._refreshing_method
    config = test_loop.tiny(test_loop.load_config("vse", "synthetic"), epochs=2)
    config.method = "refreshing"
    config.method_kwargs = ml_collections.ConfigDict({"num_networks": 2})
    config.train.num_devices = 4
    return config


@pytest.mark.slow
def test_two_processes_agree_that_a_race_which_never_divided_trains_once(tmp_path):
    """Only process 0 writes the metrics the shortcut reads; the other follows its
    decision (a process that trained the undivided run alone would wait forever in its
    collectives)."""
    folder = str(tmp_path / "pairs")
    vectors.from_synthetic(folder, num_train=160, num_val=40, num_test=40, noise_rate=0.0)
    multi = _two_processes(tmp_path, folder)
    assert multi[0] == multi[1]
    assert multi[0]["race_same_run"] == 1.0
    assert not os.path.exists(tmp_path / "multi" / "undivided")
    single = race_config(folder)
    single.train.num_devices = 4
    assert multi[0] == pytest.approx(train_and_evaluate(single, str(tmp_path / "single")), abs=1e-6)
