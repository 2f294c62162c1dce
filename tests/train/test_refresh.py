"""The refresh writes each network's new memory into the old memory's buffers."""

import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    method = types.SimpleNamespace(refresh_fn=refresh_fn, stats_fn=None, stats_rows=())
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
