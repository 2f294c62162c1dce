"""The method bundle: the small set of pure functions a training method is made of.

A method never touches parameters, optimisers, data loading or devices; the trainer
(``ncljax.train``) composes its functions into one jitted ``train_step``:

1. ``forward_fn(model, batch, memory_state, *, train, rngs, phase) -> outputs`` runs the
   model (default: ``model(batch)``), so a method can ask for extra forward passes (e.g.
   the confident-set embeddings of UOT-RCL, the intra-modal similarities of GSC).
2. ``loss_fn(outputs, batch, rows, peer_rows, ctx) -> (per_example_loss [B], aux)``:
   ``rows`` are this network's per-sample memory rows gathered at ``batch['index']``,
   ``peer_rows`` those of the other network (dual networks exchange labels by reading
   them; with one network ``peer_rows is rows``). ``aux['metrics']`` holds per-example
   values ``[B]`` to average and log; ``aux['memory']`` holds per-example rows to write
   back into ``memory.samples`` at ``batch['index']``; ``aux['clean_estimate']``
   (optional, ``[B]`` in ``[0, 1]``) is the method's per-pair belief that the pair is
   clean, which the trainer scores against the true mask for the logs only.
3. ``refresh_fn(memory, stats, ctx) -> (memory, diagnostics)`` is the per-epoch
   estimation step (GMM fit, OT solve, momentum update), run on the host between
   epochs with jitted pieces. ``stats`` is ``None`` unless the method has a
   ``stats_fn(outputs, batch) -> dict of [B, ...]``; then the trainer first runs an
   eval-mode forward pass over the training pairs and hands the collected ``[N, ...]``
   arrays (ordered by index) to ``refresh_fn``.
4. ``plan_fn(epoch) -> EpochPlan`` tells the trainer the static phase of the epoch
   (warm-up or main; each phase compiles its own step) and whether to refresh first.

Per-sample memory lives in ``TrainState`` as ``Memory(samples, state)``: ``samples``
leaves have a leading ``[N]`` axis and are gathered/scattered by ``index``; ``state``
holds anything else (a confident set, EMA vectors of a fixed size). The trainer stacks
one memory per network on a leading axis. No method may read the true noise mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

Array = jax.Array
PyTree = Any


class Memory(NamedTuple):
    """Per-sample method state: ``samples`` leaves are ``[N, ...]``; ``state`` is the rest."""

    samples: dict[str, Array]
    state: dict[str, Array]


class InitContext(NamedTuple):
    """What ``init_memory`` knows: the training set's size and observed labels.

    Attributes:
      num_samples: number of training pairs ``N``.
      info: the dataset's ``DatasetInfo``.
      labels_image: observed (possibly noisy) image label of each pair, int64 ``[N]``.
      labels_text: observed caption label of each pair, int64 ``[N]``.
      embed_dim: the model's joint embedding size.
    """

    num_samples: int
    info: Any
    labels_image: Any
    labels_text: Any
    embed_dim: int = 0


class LossContext(NamedTuple):
    """What ``loss_fn`` knows besides its inputs.

    Attributes:
      step: global step (traced int32 scalar).
      epoch: current epoch (traced int32 scalar).
      phase: static phase of the epoch from ``plan_fn`` (a python int).
      num_samples: number of training pairs ``N`` (a python int).
      network: which network of a dual pair this is (traced int32; 0 with one network).
      rng: a key for this step and network.
    """

    step: Array
    epoch: Array
    phase: int
    num_samples: int
    network: Array
    rng: Array


class RefreshContext(NamedTuple):
    """What ``refresh_fn`` knows besides memory and statistics.

    Attributes:
      epoch: the epoch about to start.
      num_epochs: total epochs of the run.
      network: which network's memory this is.
      rng: a key for this refresh.
      fetch: ``fetch(indices) -> batch`` returns training pairs by index as a device
        batch (e.g. to keep the raw features of a confident set in memory).
    """

    epoch: int
    num_epochs: int
    network: int
    rng: Array
    fetch: Callable[[Any], dict[str, Array]]


class EpochPlan(NamedTuple):
    """``phase``: static step variant of the epoch; ``refresh``: run ``refresh_fn`` first."""

    phase: int = 0
    refresh: bool = False


def default_forward(model, batch, memory_state, *, train, rngs, phase):
    del memory_state, phase
    return model(batch, train=train, rngs=rngs)


def _identity(x):
    return x


class Method(NamedTuple):
    """A training method as a bundle of pure functions (see the module docstring).

    Attributes:
      name: registry name.
      init_memory: ``(InitContext) -> Memory`` for one network.
      loss_fn: ``(outputs, batch, rows, peer_rows, ctx) -> (loss [B], aux)``.
      forward_fn: ``(model, batch, memory_state, *, train, rngs, phase) -> outputs``.
      refresh_fn: per-epoch estimation, or ``None``.
      stats_fn: per-example statistics for ``refresh_fn``, or ``None``.
      plan_fn: ``epoch -> EpochPlan``.
      clean_score_fn: ``memory -> [N]`` the method's estimate that each pair is clean, for
        noise-detection diagnostics; ``None`` when the method has none.
      label_estimate_fn: ``memory -> (labels [N] int, selected [N] bool)``: the method's
        corrected class label of each pair and which pairs it currently trusts, scored
        against the true labels for the logs only; ``None`` when the method has none.
      diagnostic_scores_fn: ``memory -> {name: [N]}`` further per-pair scores (higher means
        cleaner, e.g. GSC's cross-modal, intra-modal and final labels), each scored against
        the true mask and histogrammed for clean and noisy pairs after every epoch (logs
        and ``workdir/diagnostics/`` only); ``None`` when the method has none.
      eval_transform: applied to each network's similarities before they are averaged at
        evaluation (e.g. a sigmoid for logit heads).
      num_networks: 1, or 2 for dual-network methods.
    """

    name: str
    init_memory: Callable[..., Memory]
    loss_fn: Callable[..., tuple[Array, dict]]
    forward_fn: Callable[..., dict] = default_forward
    refresh_fn: Callable[..., tuple[Memory, dict]] | None = None
    stats_fn: Callable[..., dict] | None = None
    plan_fn: Callable[[int], EpochPlan] = lambda epoch: EpochPlan()
    clean_score_fn: Callable[[Memory], Array] | None = None
    label_estimate_fn: Callable[[Memory], tuple[Array, Array]] | None = None
    diagnostic_scores_fn: Callable[[Memory], dict[str, Array]] | None = None
    eval_transform: Callable[[Array], Array] = _identity
    num_networks: int = 1


def empty_memory(ctx: InitContext) -> Memory:
    """Memory of a method that keeps none."""
    del ctx
    return Memory(samples={}, state={})
