"""The refresh writes each network's new memory into the old memory's buffers."""

import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.methods import base
from ncljax.train import mesh as mesh_lib
from ncljax.train.refresh import Refresher

N = 40


class _State(NamedTuple):
    params: dict
    rng: jax.Array
    memory: dict


def _refresh_fn(memory, stats, ctx):
    """Network k's rows become ``rows * (k + 2) + epoch``; a count goes up by one."""
    assert stats is None
    new = {
        "rows": memory["rows"] * (ctx.network + 2) + ctx.epoch,
        "labels": (memory["labels"] + 1) % 7,
        "count": memory["count"] + 1,
    }
    return new, {"mean": jnp.mean(new["rows"])}


def _refresher(num_devices, refresh_fn=_refresh_fn):
    mesh = mesh_lib.make_mesh(num_devices)
    method = types.SimpleNamespace(
        refresh_fn=refresh_fn, stats_fn=None, stats_rows=(), disk_stats=()
    )
    return Refresher(None, method, None, mesh, None, num_epochs=5), mesh


def _state(mesh, k=2):
    rng = np.random.default_rng(0)
    memory = {
        "rows": rng.normal(size=(k, N, 3)).astype(np.float32),
        "labels": rng.integers(0, 7, size=(k, N)).astype(np.int32),
        "count": np.zeros((k,), np.int32),
    }
    return _State(
        params={"w": jnp.zeros((k, 2))},
        rng=jax.random.key(0),
        memory=mesh_lib.replicate(memory, mesh),
    )


@pytest.mark.parametrize("num_devices", [1, 8])
def test_each_network_is_refreshed_into_the_old_buffers(num_devices):
    refresh, mesh = _refresher(num_devices)
    state = _state(mesh)
    before = jax.tree.map(lambda x: np.array(x, copy=True), state.memory)  # no view: donation
    old_leaves = jax.tree.leaves(state.memory)
    new_state, diagnostics = refresh(state, epoch=3)
    got = jax.tree.map(np.asarray, new_state.memory)
    for k in range(2):  # the oracle: each network's refresh_fn, by hand
        np.testing.assert_array_equal(got["rows"][k], before["rows"][k] * (k + 2) + 3)
        np.testing.assert_array_equal(got["labels"][k], (before["labels"][k] + 1) % 7)
        assert got["count"][k] == 1
        assert diagnostics[f"mean_net{k}"] == pytest.approx(got["rows"][k].mean(), rel=1e-6)
    # donated: the old memory is gone (not held beside the new one), the new one replicated
    assert all(leaf.is_deleted() for leaf in old_leaves)
    for leaf in jax.tree.leaves(new_state.memory):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == num_devices


def test_a_refresh_that_changes_its_memory_dtype_is_refused():
    def widened(memory, stats, ctx):
        new, diag = _refresh_fn(memory, stats, ctx)
        return {**new, "labels": new["labels"].astype(jnp.float32)}, diag

    refresh, mesh = _refresher(1, widened)
    with pytest.raises(ValueError, match="refresh_fn returned network 0's memory"):
        refresh(_state(mesh), epoch=1)


@pytest.mark.parametrize("num_devices", [1, 8])
def test_disk_statistics_reach_the_refresh_as_files_and_are_deleted(tmp_path, num_devices):
    """A method's ``disk_stats`` are written row by row, from batches spread over the
    devices, to ``.npy`` files in the scratch directory; ``refresh_fn`` reads each
    network's rows there (the rest stays on the device), and the files are gone after."""
    mesh = mesh_lib.make_mesh(num_devices)
    x = np.random.default_rng(1).normal(size=(N, 3)).astype(np.float32)
    seen = {}

    def record_fn(i):
        return {"x": x[i], "index": np.int32(i), "mask": np.bool_(True)}

    def refresh_fn(memory, stats, ctx):
        assert not stats["z"].flags.writeable
        seen[ctx.network] = (
            type(stats["z"]),
            np.array(stats["z"]),
            np.asarray(stats["s"]),
            sorted(p.name for p in tmp_path.joinpath("scratch").iterdir()),
        )
        return memory, {}

    method = types.SimpleNamespace(
        name="fake",
        refresh_fn=refresh_fn,
        stats_fn=lambda outputs, batch: {},
        stats_rows=(),
        disk_stats=("z",),
        forward_fn=None,
    )
    config = types.SimpleNamespace(
        seed=0,
        train=types.SimpleNamespace(batch_size=16),  # 40 pairs: the last batch padded
        data=types.SimpleNamespace(num_threads=1),
    )
    pairs = types.SimpleNamespace(record_fn=record_fn, num_records=N)
    refresh = Refresher(
        None, method, pairs, mesh, config, num_epochs=5, scratch=str(tmp_path / "scratch")
    )

    def stats(params, model_state, batch, memory_state, read):  # 2 networks' statistics
        k = jnp.arange(2.0)[:, None, None]
        return {"z": batch["x"][None] * (k + 2), "s": batch["x"][None, :, 0] + k[..., 0]}

    refresh._stats = jax.jit(stats)
    rows = np.zeros((2, N, 3), np.float32)
    memory = mesh_lib.replicate(base.Memory(samples={"rows": rows}, state={}), mesh)
    state = types.SimpleNamespace(
        params={"w": jnp.zeros((2, 1))}, model_state={}, rng=jax.random.key(0), memory=memory
    )
    state._replace = lambda **kw: state
    refresh(state, epoch=1)
    for k in range(2):
        kind, z, s, files = seen[k]
        assert issubclass(kind, np.memmap) and files == ["stats_z.npy"]
        np.testing.assert_allclose(z, x * (k + 2), rtol=1e-6)
        np.testing.assert_allclose(s, x[:, 0] + k, rtol=1e-6)
    assert not tmp_path.joinpath("scratch").exists()
    with pytest.raises(ValueError, match="keeps statistics on disk: give a scratch"):
        Refresher(None, method, pairs, mesh, config, num_epochs=5)
