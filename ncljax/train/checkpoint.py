"""Checkpoints: the latest ``TrainState`` with the run's progress, and the best-on-validation model.

Two orbax ``CheckpointManager`` directories under ``workdir/checkpoints``: ``latest``
(the whole ``TrainState``, the index sets of the epoch's passes and a JSON record of the
run's progress: epoch, pass, position in the pass, best validation so far; resumed
automatically) and ``best`` (parameters and model state of the best validation epoch,
for the final test evaluation). Batches are a pure function of the seed, the streams
and the position, so no data-iterator state is saved. Saves are synchronous and atomic: a
crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from ncljax.train.state import TrainState


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _to_saveable(state: TrainState) -> TrainState:
    return state._replace(rng=jax.random.key_data(state.rng))


def _from_saveable(state: TrainState) -> TrainState:
    return state._replace(rng=jax.random.wrap_key_data(state.rng))


class Checkpointer:
    """Saves and restores a run's checkpoints in ``directory``."""

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        directory = os.path.abspath(directory)
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "streams": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._latest = ocp.CheckpointManager(
            os.path.join(directory, "latest"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=False
            ),
            item_handlers=handlers,
        )
        self._best = ocp.CheckpointManager(
            os.path.join(directory, "best"),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False),
            item_handlers={"state": handlers["state"], "meta": handlers["meta"]},
        )

    def latest_step(self) -> int | None:
        return self._latest.latest_step()

    def save(self, state: TrainState, meta: dict, streams: dict) -> None:
        """Saves the state, ``meta`` (progress, best so far) and the epoch's ``streams``
        (``passes.encode_streams``) at ``state.step``."""
        step = int(state.step)
        if step in self._latest.all_steps():
            return
        self._latest.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_saveable(state)),
                streams=ocp.args.StandardSave(streams),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def restore(self, like: TrainState, like_streams: dict) -> tuple[TrainState, dict, dict] | None:
        """Restores the latest checkpoint: a state shaped like ``like``, ``meta`` and the
        streams (shaped like ``like_streams``). ``None`` when there is no checkpoint."""
        step = self._latest.latest_step()
        if step is None:
            return None
        abstract_streams = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like_streams
        )
        out = self._latest.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(_to_saveable(like))),
                streams=ocp.args.StandardRestore(abstract_streams),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return _from_saveable(out["state"]), out["meta"], jax.device_get(out["streams"])

    def save_best(self, state: TrainState, meta: dict) -> None:
        """Keeps the model of ``state`` as the best one so far."""
        step = int(state.step)
        if step in self._best.all_steps():
            return
        model = {"params": state.params, "model_state": state.model_state}
        self._best.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(model), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore_best(self, like: TrainState) -> tuple[TrainState, dict] | None:
        """``like`` with the best model's parameters and model state, and its ``meta``."""
        step = self._best.latest_step()
        if step is None:
            return None
        model = {"params": like.params, "model_state": like.model_state}
        out = self._best.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(model)), meta=ocp.args.JsonRestore()
            ),
        )
        best = out["state"]
        return like._replace(params=best["params"], model_state=best["model_state"]), out["meta"]

    def close(self) -> None:
        self._latest.close()
        self._best.close()
