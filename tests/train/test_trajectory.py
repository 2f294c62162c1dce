"""Each training pair's similarity per epoch (``ncljax.train.trajectory``): the files and
their mean, against numpy."""

import os

import numpy as np
import pytest

from ncljax.train import trajectory


def _write(workdir, epochs, n=6, seed=0):
    values = np.random.default_rng(seed).normal(size=(epochs, n))
    for e in range(epochs):
        trajectory.record(str(workdir), e, values[e])
    return values.astype(np.float32)


def test_the_mean_up_to_an_epoch_is_numpys(tmp_path):
    values = _write(tmp_path, 4)
    for epoch in range(4):
        got, why = trajectory.mean_until(str(tmp_path), epoch, 6)
        assert why is None
        np.testing.assert_allclose(got, values[: epoch + 1].astype(np.float64).mean(0))
    assert sorted(os.listdir(tmp_path / trajectory.DIRECTORY)) == [
        f"epoch_{e:04d}.npy" for e in range(4)
    ]  # no partial file left behind


def test_a_rewritten_epoch_replaces_the_old_one(tmp_path):
    """A resumed run writes the epochs after its checkpoint again."""
    _write(tmp_path, 2)
    trajectory.record(str(tmp_path), 1, np.full(6, 3.0))
    got, _ = trajectory.mean_until(str(tmp_path), 1, 6)
    first = np.load(trajectory.epoch_path(str(tmp_path), 0)).astype(np.float64)
    np.testing.assert_allclose(got, (first + 3.0) / 2)


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("missing", "is missing"),
        ("short", "one finite value per training pair"),
        ("nan", "one finite value per training pair"),
        ("garbage", "cannot be read"),
    ],
)
def test_an_epoch_that_cannot_be_used_gives_no_mean_and_why(tmp_path, damage, reason):
    _write(tmp_path, 3)
    path = trajectory.epoch_path(str(tmp_path), 1)
    if damage == "missing":
        os.remove(path)
    elif damage == "short":
        np.save(path, np.zeros(5, np.float32))
    elif damage == "nan":
        np.save(path, np.full(6, np.nan, np.float32))
    else:
        with open(path, "wb") as f:
            f.write(b"not an array")
    got, why = trajectory.mean_until(str(tmp_path), 2, 6)
    assert got is None and reason in why and "epoch_0001" in why
    assert trajectory.mean_until(str(tmp_path), 0, 6)[0] is not None  # before it: fine
    assert trajectory.mean_until(str(tmp_path), -1, 6) == (None, "no epoch has finished")


def test_a_run_started_without_the_files_resumes_with_them(tmp_path, capsys):
    """``train.pair_trajectory`` changes no training: a run whose config.json predates it
    (or had it off) resumes with it on, and says so."""
    import ml_collections

    from ncljax.train import rundir

    config = ml_collections.ConfigDict({"train": {"epochs": 2}, "seed": 0})
    rundir.write_config(str(tmp_path), config, {})
    config.train.pair_trajectory = True
    rundir.write_config(str(tmp_path), config, {})
    assert "Resuming with changed train.pair_trajectory=True" in capsys.readouterr().out
