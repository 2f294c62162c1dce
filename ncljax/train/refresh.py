"""The per-epoch estimation step: a statistics pass over the training set, then each
network's ``refresh_fn``."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ncljax import backend
from ncljax.data import pipeline
from ncljax.methods import base
from ncljax.methods.base import RefreshContext
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib


def _write_network(memory, k, value):
    """``memory`` with network ``k``'s slice set to ``value`` (``memory`` donated: written
    in place)."""
    return state_lib.set_network(memory, k, value)


def _scatter_stats(buffers, index, values):
    """Writes per-network values ``[K, B, ...]`` at ``index`` (padding ``N`` is dropped)."""
    return jax.tree.map(lambda b, v: b.at[:, index].set(v, mode="drop"), buffers, values)


class Refresher:
    """Runs a method's per-epoch estimation: statistics pass, then ``refresh_fn`` per network.

    The statistics pass is an eval-mode forward over the training pairs in batches of the
    training size, in a fresh shuffle each epoch (in-batch quantities such as a loss
    against the other pairs, or a ``B``-class evidence, then mean what they mean in
    training); the results are scattered back to index order and replicated. The
    statistics the method names in ``disk_stats`` go to ``.npy`` files in ``scratch``
    instead (written a batch at a time, handed to ``refresh_fn`` memory-mapped, deleted
    after the refresh).
    """

    def __init__(
        self,
        graphdef,
        method,
        pairs,
        mesh,
        config,
        num_epochs,
        held_out=None,
        scratch=None,
        divide=True,
    ):
        if method.disk_stats and scratch is None:
            raise ValueError(f"{method.name} keeps statistics on disk: give a scratch directory.")
        self._scratch = scratch
        self._divide = divide  # False: every division of the run off (train.division)
        self._held_out = held_out  # (state) -> float or None: the validation split's share
        self._method = method
        self._pairs = pairs
        self._mesh = mesh
        self._config = config
        self._num_epochs = num_epochs
        if method.stats_fn is not None:

            def stats(model, batch, memory_state, samples):
                outputs = method.forward_fn(
                    model, batch, memory_state, train=False, rngs=None, phase=base.STATS
                )
                if not method.stats_rows:
                    return method.stats_fn(outputs, batch)
                rows = step_lib.gather_rows(samples, batch["index"])  # padding: clipped
                return method.stats_fn(outputs, batch, rows)

            self._stats = jax.jit(
                step_lib.make_forward(graphdef, stats),
                compiler_options=backend.compiler_options(),
            )
            self._scatter = jax.jit(
                _scatter_stats, donate_argnums=0, out_shardings=mesh_lib.replicated(mesh)
            )
        self._write = jax.jit(  # one program for every network (k is traced)
            _write_network, donate_argnums=0, out_shardings=mesh_lib.replicated(mesh)
        )

    def _collect_stats(self, state, epoch: int):
        cfg, n = self._config, self._pairs.num_records
        seed = int(np.random.SeedSequence([cfg.seed, 2, epoch]).generate_state(1)[0])
        buffers = None
        read = {name: state.memory.samples[name] for name in self._method.stats_rows}
        dataset = pipeline.batches(
            self._pairs.record_fn,
            n,
            batch_size=cfg.train.batch_size,
            seed=seed,
            num_threads=cfg.data.num_threads,
        )
        files = {}
        with pipeline.reading(dataset) as batches:
            for batch in batches:
                device_batch = pipeline.to_device(batch, mesh_lib.batch_sharding(self._mesh))
                values = self._stats(
                    state.params, state.model_state, device_batch, state.memory.state, read
                )
                values, on_disk = _split(values, self._method.disk_stats)
                if buffers is None:
                    buffers = jax.tree.map(
                        lambda v: jnp.zeros((v.shape[0], n, *v.shape[2:]), v.dtype), values
                    )
                    files = {name: self._open(name, v, n) for name, v in on_disk.items()}
                buffers = self._scatter(buffers, device_batch["index"], values)
                index = np.asarray(batch["index"])
                real = index < n  # padding rows carry index N
                for name, v in on_disk.items():
                    files[name][:, index[real]] = _host(v)[:, real]
        for f in files.values():
            f.flush()
        # the refresh reads them: read-only maps of the files just written
        files = {name: np.load(f.filename, mmap_mode="r") for name, f in files.items()}
        return buffers, files

    def _open(self, name, value, n):
        """A ``[K, N, ...]`` ``.npy`` file in the scratch directory for the statistic ``name``."""
        os.makedirs(self._scratch, exist_ok=True)
        return np.lib.format.open_memmap(
            os.path.join(self._scratch, f"stats_{name}.npy"),
            mode="w+",
            dtype=value.dtype,
            shape=(value.shape[0], n, *value.shape[2:]),
        )

    def _fetch(self, indices) -> dict[str, jax.Array]:
        records = [self._pairs.record_fn(int(i)) for i in np.asarray(indices)]
        stacked = {k: np.stack([r[k] for r in records]) for k in records[0]}
        return mesh_lib.replicate(stacked, self._mesh)

    def __call__(self, state, epoch: int):
        method = self._method
        if method.refresh_fn is None:
            return state, {}
        stats, files = None, {}
        if method.stats_fn is not None:
            stats, files = self._collect_stats(state, epoch)
        num_networks = jax.tree.leaves(state.params)[0].shape[0]
        key = jax.random.fold_in(jax.random.fold_in(state.rng, step_lib.REFRESH_STREAM), epoch)
        memory, diagnostics = state.memory, {}
        state = state._replace(memory=None)  # the old memory is written in place below
        held_out = None
        if self._held_out is not None:
            held_out = functools.cache(lambda: self._held_out(state))  # once per refresh
        for k in range(num_networks):
            ctx = RefreshContext(
                epoch=epoch,
                num_epochs=self._num_epochs,
                network=k,
                rng=jax.random.fold_in(key, k),
                fetch=self._fetch,
                held_out=held_out,
                scratch=self._scratch,
                divide=self._divide,
            )
            rows = None
            if stats is not None:  # the files' rows of network k: views, read when used
                rows = {**state_lib.network(stats, k), **{n: f[k] for n, f in files.items()}}
            new, diag = method.refresh_fn(state_lib.network(memory, k), rows, ctx)
            del rows
            _check_rows(memory, new, k)
            # one network's new rows at a time, into the old memory's buffers: the refresh
            # holds the memory once plus a network's rows, not old + new + their stack
            memory = self._write(memory, np.int32(k), mesh_lib.replicate(new, self._mesh))
            del new
            suffix = f"_net{k}" if num_networks > 1 else ""
            diagnostics.update({f"{name}{suffix}": float(v) for name, v in diag.items()})
        if files:
            del files
            shutil.rmtree(self._scratch, ignore_errors=True)
        return state._replace(memory=memory), diagnostics


def _split(values: dict, names) -> tuple[dict, dict]:
    """The statistics a batch computed: those kept on the device, those ``names`` for disk."""
    return (
        {n: v for n, v in values.items() if n not in names},
        {n: v for n, v in values.items() if n in names},
    )


def _host(value: jax.Array) -> np.ndarray:
    """A batch's statistic on this host, whole (gathered from every process where the
    batch is spread over several)."""
    if value.is_fully_addressable:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value))


def _check_rows(memory, new, k: int) -> None:
    """Refuses a ``refresh_fn`` result that is not network ``k``'s memory in the structure,
    shapes and dtypes it was given (``ncljax.methods.base.Method.refresh_fn``): the trainer
    writes it into the memory's own buffers."""
    want = jax.tree.map(lambda x: (x.shape[1:], x.dtype), memory)
    got = jax.tree.map(lambda x: (tuple(np.shape(x)), jnp.result_type(x)), new)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError(
            f"refresh_fn returned network {k}'s memory as {got}, not in the structure, "
            f"shapes and dtypes it was given ({want}); a method's refresh_fn must keep them."
        )
