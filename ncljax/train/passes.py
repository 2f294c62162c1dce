"""An epoch's plan made concrete: its passes, their streams and lengths.

``plan_passes`` turns a method's ``EpochPlan`` and ``streams_fn`` into the passes of one
epoch: one together pass, or one in-turn pass per network. Each pass has a main stream
(shuffled once) and optionally an auxiliary stream (cycled), with seeds derived from
``(seed, epoch, pass)``, so a pass is fully determined by its index sets. The index sets
are saved with every checkpoint (``encode_streams``), and a run resumed mid-pass replays
the very batches an uninterrupted run reads.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ncljax.data import pipeline
from ncljax.methods.base import EpochPlan, Method, Streams
from ncljax.train.step import StepSpec


class Pass(NamedTuple):
    """One pass of an epoch.

    Attributes:
      network: the training network of an in-turn pass, or ``None`` (together).
      streams: the main stream, then the auxiliary one if any.
      num_steps: steps of the pass.
      spec: the static step variant.
    """

    network: int | None
    streams: tuple[pipeline.StreamOrder, ...]
    num_steps: int
    spec: StepSpec

    @property
    def name(self) -> str:
        return "" if self.network is None else f"_net{self.network}"


def _indices(value, num_samples: int, what: str) -> np.ndarray:
    value = np.asarray(value).reshape(-1)
    if value.size and not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"streams_fn returned {what} of dtype {value.dtype}; use integers.")
    value = value.astype(pipeline.index_dtype(num_samples))
    if value.size > num_samples or (value.size and (value.min() < 0 or value.max() >= num_samples)):
        raise ValueError(
            f"streams_fn returned {what} with {value.size} entries in "
            f"[{value.min() if value.size else 0}, {value.max() if value.size else 0}]; a stream "
            f"holds at most N={num_samples} indices in [0, N)."
        )
    return value


def _every(n: int) -> np.ndarray:
    return np.arange(n, dtype=pipeline.index_dtype(n))


def method_streams(method: Method, memory, plan: EpochPlan, network: int | None, n: int) -> Streams:
    """``method.streams_fn`` checked, with ``None`` main meaning every pair."""
    if method.streams_fn is None:
        return Streams(_every(n), None)
    streams = method.streams_fn(memory, plan, network)
    main = _every(n) if streams.main is None else _indices(streams.main, n, "a main stream")
    aux = None if streams.aux is None else _indices(streams.aux, n, "an auxiliary stream")
    return Streams(main, aux)


def _num_steps(streams, plan: EpochPlan, batch_size: int, where: str) -> int:
    main = streams[0]
    steps = main.batches_per_cycle(batch_size)
    if plan.min_batch <= 1 or steps == 0:
        return steps
    short = pipeline.batch_sizes(main, steps, batch_size) < plan.min_batch
    if len(streams) > 1 and len(streams[1].indices):
        aux_short = pipeline.batch_sizes(streams[1], steps, batch_size) < plan.min_batch
        if aux_short.any() and (not short.any() or aux_short.argmax() < short.argmax()):
            logging.warning(
                "%s ends after %d of %d steps: an auxiliary batch has fewer than "
                "min_batch=%d pairs.",
                where,
                int(aux_short.argmax()),
                steps,
                plan.min_batch,
            )
        short |= aux_short
    return int(short.argmax()) if short.any() else steps


def plan_passes(
    method: Method,
    plan: EpochPlan,
    stream_sets: list[Streams],
    *,
    epoch: int,
    batch_size: int,
    seed: int,
) -> list[Pass]:
    """The passes of ``epoch`` from its plan and each pass's index sets (``stream_sets``:
    one per network in turn, or one for a together pass)."""
    passes = []
    for p, sets in enumerate(stream_sets):
        network = p if plan.in_turn else None
        key = (seed, epoch) if p == 0 else (seed, epoch, p)  # pass 0: the classic order
        streams = [pipeline.StreamOrder(sets.main, key, False, plan.drop_remainder)]
        if sets.aux is not None:
            streams.append(pipeline.StreamOrder(sets.aux, (*key, 1), True, plan.drop_remainder))
        if max(plan.updates) >= len(streams):
            raise ValueError(
                f"Method {method.name!r}: epoch {epoch} plans updates on streams "
                f"{plan.updates} but its streams_fn gave no auxiliary stream."
            )
        where = f"Epoch {epoch}, pass {p}"
        spec = StepSpec(phase=plan.phase, updates=tuple(plan.updates), in_turn=plan.in_turn)
        passes.append(
            Pass(network, tuple(streams), _num_steps(streams, plan, batch_size, where), spec)
        )
    return passes


def epoch_stream_sets(method: Method, plan: EpochPlan, memory, n: int, k: int):
    """The index sets of every pass of the epoch ``plan`` describes (asks ``streams_fn``
    after the refresh)."""
    if plan.in_turn:
        return [method_streams(method, memory, plan, net, n) for net in range(k)]
    return [method_streams(method, memory, plan, None, n)]


def encode_streams(stream_sets: list[Streams], num_passes: int, n: int) -> dict[str, np.ndarray]:
    """Fixed-shape arrays for a checkpoint: ``indices`` int32 ``[P, 2, N]`` (-1 padded) and
    ``lengths`` int32 ``[P, 2]`` (-1: no such stream)."""
    indices = np.full((num_passes, 2, n), -1, np.int32)
    lengths = np.full((num_passes, 2), -1, np.int32)
    for p, sets in enumerate(stream_sets):
        for s, value in enumerate(sets):
            if value is not None:
                indices[p, s, : len(value)] = value
                lengths[p, s] = len(value)
    return {"indices": indices, "lengths": lengths}


def decode_streams(saved: dict) -> list[Streams]:
    """The index sets ``encode_streams`` saved."""
    indices, lengths = np.asarray(saved["indices"]), np.asarray(saved["lengths"])
    out = []
    for p in range(lengths.shape[0]):
        if lengths[p, 0] < 0:
            break
        sets = [
            indices[p, s, : lengths[p, s]].copy() if lengths[p, s] >= 0 else None for s in range(2)
        ]
        out.append(Streams(*sets))
    return out
