"""The method bundle: the small set of pure functions a training method is made of.

A factory (``ncljax.methods.REGISTRY``) builds a ``Method`` from its hyperparameters
(``config.method_kwargs``); a factory that declares a ``model_config`` parameter also
receives the run's ``model`` config section (what the head returns decides, e.g., how
UGNCL turns similarities into evidence), which is not a hyperparameter. A factory first
checks every hyperparameter it takes against its range (``ncljax.methods.settings.check``:
one line naming the argument, its value, its range and its ``--config.method_kwargs``
flag) and builds nothing from a value it refuses.

A method never touches parameters, optimisers, data loading or devices; the trainer
(``ncljax.train``) composes its functions into one jitted ``train_step`` and runs each
epoch as its ``EpochPlan`` says.

1. ``forward_fn(model, batch, memory_state, *, train, rngs, phase, ctx=None) -> outputs``
   runs the model (default: ``model(batch)``), so a method can ask for extra forward
   passes (e.g. the confident-set embeddings of UOT-RCL, the intra-modal similarities of
   GSC, PC2's pseudo-captions from the main batch). In a train step ``ctx`` is the
   update's ``LossContext`` (which holds the step's other batches); in the statistics
   pass it is ``None``.
2. ``loss_fn(outputs, batch, rows, peer_rows, ctx) -> (per_example_loss [B], aux)``:
   ``rows`` are this network's per-sample memory rows gathered at ``batch['index']``,
   ``peer_rows`` those of its peer (the other network of a pair; with one network
   ``peer_rows is rows``; ``ctx.peer_rows`` holds the peer's rows at each of the
   step's batches). ``aux`` is an :class:`Aux` (memory writes, logged metrics and the
   per-pair beliefs the trainer scores against the true mask, for the logs only); a
   field it does not have is an error, never a silently dropped key.

   The trainer averages the per-example loss over the real pairs of the global batch
   (``loss_reduction='mean'``) or sums it (``'sum'``: the reference code of VSE++/NCR,
   which matters with gradient clipping).
3. ``refresh_fn(memory, stats, ctx) -> (memory, diagnostics)`` is the per-epoch
   estimation step (GMM fit, OT solve, momentum update), run on the host between
   epochs with jitted pieces. It returns the network's memory in the structure, shapes
   and dtypes it was given: the trainer writes each network's result into the memory's
   own buffers, one network at a time. ``stats`` is ``None`` unless the method has a
   ``stats_fn(outputs, batch) -> dict of [B, ...]``; then the trainer first runs an
   eval-mode forward pass of every network over the training pairs (in shuffled
   batches of the training size) and hands the collected ``[N, ...]`` arrays (ordered
   by index) to ``refresh_fn``; those it names in ``disk_stats`` arrive as read-only
   memory-mapped numpy arrays of files the trainer writes and deletes, for statistics too
   large to hold for every pair. A method whose ``stats_rows`` names memory rows gets
   them too, as ``stats_fn(outputs, batch, rows)`` with the network's rows at the
   batch's pairs (before the refresh): a statistic that compares the pass with what
   the memory holds (PC2's oscillation against its prediction bank) is computed batch
   by batch, and only its result is collected over the pairs. A degenerate estimate
   (a GMM over equal values, an OT solve that did not converge) is logged there with
   ``logging.warning`` (the host reads the flag) and, where the method has one, the
   previous estimate is kept.
4. ``plan_fn(epoch) -> EpochPlan`` describes the epoch: its static phase, whether to
   refresh first, whether the networks train together or in turn, how many sequential
   optimiser updates a step makes and on which stream, optimiser resets, the epoch the
   learning-rate schedule reads, and whether the epoch may be selected as best.
5. ``streams_fn(memory, plan, network) -> Streams`` (optional) names the training pairs
   a pass walks: a main stream (each pair once per epoch, shuffled) and an auxiliary
   stream cycled alongside it (reshuffled whenever exhausted); the step receives one
   batch of each. Called after the refresh, with the stacked memory of all networks
   (leaves ``[K, N, ...]``), the epoch's ``EpochPlan`` (``plan_fn``'s decision: a
   method never re-derives its phase from the epoch number), and ``network`` the
   training network of an in-turn pass or ``None`` in a together pass. Default: every
   pair, no auxiliary stream.
6. ``prepare_fn(model, peer, batches, ctx) -> pytree`` (optional) is a no-grad,
   eval-mode pass shared by a step's updates, before the first of them: ``model`` is
   the training network, ``peer`` its peer (frozen in an in-turn pass; the network
   itself with one network), ``batches`` the step's batches (main first). Its result
   reaches ``loss_fn`` as ``ctx.prepared`` (e.g. NCR's co-rectified targets).
7. ``step_metrics_fn(extra, batch, batches) -> {name: [2]}`` (optional) scores the
   method's own ``Aux.extra`` for the logs, as ``(sum, count)`` pairs, in steps that
   score against the truth (``batches``: the step's batches, main first); e.g. PC2's
   share of pseudo-captions borrowed from the pair's own class.

Methods as settings and pure functions
--------------------------------------
Each method module defines a frozen ``Settings`` NamedTuple (the factory's arguments,
their defaults and their documentation), its range table ``CHECKS``
(``ncljax.methods.settings``), and top-level functions that take the settings first
(``plan(s, epoch)``, ``loss(s, outputs, batch, rows, peer_rows, ctx)``,
``refresh(s, memory, stats, ctx)``, ...), importable and testable one by one. Its
factory (``ncljax.methods.settings.factory``) checks the keyword arguments, builds the
``Settings`` and binds them into the ``Method`` (``Method.settings`` keeps them), so a
setting is followed from its config field to the code it changes by its name
(``s.noisy_start_epoch``). NCR and PC2 share the co-teaching skeleton of
``ncljax.methods.coteaching``.

Epochs as plans
---------------
An epoch is a sequence of passes. In a *together* pass (``in_turn=False``; GSC+ and the
baselines) every network steps on the same batch under ``jax.vmap`` (its axis named
:data:`NETWORK_AXIS`: a loss skips a term no pair of any network needs with
:func:`any_network` and :func:`compute_if`, a real branch rather than a select). In an *in-turn*
pass (``in_turn=True``; NCR, PC2: the official semantics) network 0 walks its streams
while every other network is frozen (parameters, statistics, optimiser state, memory),
then network 1 walks its own against network 0's end-of-pass state, and so on; the
training network is sliced out, so a turn costs one network. Within a step, the
``updates`` are applied in sequence, each from the parameters the previous one
produced; a network whose batch for an update holds no real pair does not move (a
zero-gradient Adam step would). Batches are padded to the global size with masked
copies; padding reaches no loss, no memory row and no BatchNorm statistic. A pass ends
early at the first step whose main or (non-empty) auxiliary batch has fewer than
``min_batch`` real pairs (NCR stops at a batch of one, which BatchNorm cannot take).

Method heads: a method may own modules trained with its network (PC2's
pseudo-classifier): ``heads_fn(info, rngs) -> {name: nnx.Module}`` builds them for the
dataset ``info``; the trainer attaches them to every network's model as
``model.method_heads[name]`` (after the backbone, so the backbone initialises as without
them), where the method's ``forward_fn`` calls them. They are parameters of the network
like any other: optimised, vmapped over the networks and checkpointed with it.

Per-sample memory lives in ``TrainState`` as ``Memory(samples, state)``: ``samples``
leaves have a leading ``[N]`` axis and are gathered/scattered by ``index``; ``state``
holds anything else (a confident set, EMA vectors of a fixed size). The trainer stacks
one memory per network on a leading axis. No method may read the true noise mask.

Evaluation: a network's similarities (one matrix per image view: UGNCL's models have
several, every other model one) pass through ``eval_transform``; those of all views and
networks of a run, and then of an ensemble's runs, are combined by ``eval_pool``.

Estimators on data nobody tuned them on: a threshold or margin that a method applies to
a similarity-derived score (an energy, an uncertainty, a loss) is scale-free or
calibrated from the data. Such a method takes ``calibration='data'`` (the default: the
value is derived from the scores' own distribution, documented in the factory with the
equation it replaces) or ``'paper'`` (the paper's constants, which the config files keep
on the paper's own backbone, SGR/SAF on the precomp benchmarks). A division that
degenerates (no pair selected, every pair in one set, components that separate nothing)
falls back by the rule its factory documents (the previous non-degenerate division, or
the warm-up objective), logs a warning with "fallback" once per epoch, and reports
``division_fallback`` (0 or 1) among its refresh diagnostics: a method never trains on
no pair for more than one epoch. ``configs/<method>.py:synthetic,world=<name>`` trains on
the other synthetic worlds (``ncljax.data.worlds``); ``python -m ncljax.report`` sweeps
methods x worlds x noise rates x seeds.

Phases: ``EpochPlan.phase`` is a small int; ``WARMUP`` and ``MAIN`` are shared by every
method with a warm-up, a method numbers further phases after ``MAIN``, and ``STATS`` is
the phase its ``forward_fn`` sees in the trainer's statistics pass (eval mode).

Adding a method
---------------
Three files and one line; nothing in the trainer, the config schema, the audit, the
report or the tests names a method (``tests/methods/test_recipe.py`` follows this recipe
with a toy method):

1. ``ncljax/methods/<name>.py``: a ``Settings`` NamedTuple (every field with a default
   and a docstring line), ``CHECKS`` (a ``settings.Rule`` per field), the module
   functions that take the settings first (at least ``loss``; ``init_memory``,
   ``stats``, ``refresh``, ``plan`` where the method has them; their names are those of
   ``MODULE_FUNCTIONS``), a ``bind(s)`` that returns ``bind_module(module, s, ...)``
   with the fields the module cannot name (``clean_score_fn`` and its :class:`Verdict`
   for the audit, ``num_networks``), and ``<name> = settings.factory('<name>',
   Settings, CHECKS, bind, family='pairs')`` (``'labels'`` for a noisy-label method;
   ``plan_problems=`` a check of the plan against the run's length, e.g. with a warm-up
   ``warmup_problems``): the name is written there only. Losses and estimators it
   needs that are pure go to ``ncljax/losses`` and ``ncljax/labels``, each with an
   oracle test.
2. One line in ``ncljax.methods.REGISTRY``'s list of factories: ``<module>.<name>``.
3. ``configs/<name>.py``: ``get_config(arg)`` from ``presets.start`` with
   ``config.method = '<name>'`` and ``config.method_kwargs =
   config_lib.method_kwargs('<name>', ...)`` (only what differs from the defaults),
   taking ``:synthetic`` and ``:vectors``.
4. Its tests: the registry-driven ones (backbones, vectors folders, worlds, settings,
   the report, the audit) include it; add its own oracle tests.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

WARMUP, MAIN = 0, 1  # the phases of a method with a warm-up (EpochPlan.phase)
STATS = -1  # the forward of the statistics pass before a refresh, never a train step

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
    """What ``loss_fn`` (and ``prepare_fn``) know besides their inputs.

    Attributes:
      step: global step (traced int32 scalar; one step may make several updates).
      epoch: current epoch (traced int32 scalar, ``TrainState.epoch``).
      phase: static phase of the epoch from ``plan_fn`` (a python int).
      num_samples: number of training pairs ``N`` (a python int).
      network: which network of a dual pair this is (traced int32; 0 with one network).
      rng: a key for this step, network and update.
      update: which of the step's sequential updates this is (a python int; 0 first).
      prepared: the result of the method's ``prepare_fn`` for this step (or ``None``).
      batches: all of the step's batches (main first), so that an update can read the
        others (PC2's pseudo-caption update reads the main batch's captions).
      peer_rows: the peer's memory rows gathered at each of ``batches`` (aligned).
      memory_state: this network's ``Memory.state`` (e.g. SREM's division in use), or
        ``None`` outside a train step.
      network_axis: the name of the ``vmap`` axis the networks train together under
        (:data:`NETWORK_AXIS`), or ``None`` (one network at a time: in turn, or outside
        the trainer). :func:`any_network` reads it.
    """

    step: Array
    epoch: Array
    phase: int
    num_samples: int
    network: Array
    rng: Array
    update: int = 0
    prepared: PyTree = None
    batches: tuple = ()
    peer_rows: tuple = ()
    memory_state: PyTree = None
    network_axis: str | None = None


# The axis name of the trainer's vmap over the networks that train together.
NETWORK_AXIS = "networks"


def any_network(flag: Array, ctx: LossContext) -> Array:
    """Whether ``flag`` holds anywhere: over all its elements and, under the trainer's vmap
    over networks, over every network. The result is one unbatched boolean, so a
    ``jax.lax.cond`` on it stays a branch under that vmap (a batched predicate would turn
    the cond into a select that computes both sides): a loss can skip a term that no pair
    of the step needs, e.g. a fallback objective once a division is usable."""
    flag = jnp.any(flag)
    if ctx.network_axis is not None:
        flag = jax.lax.psum(flag.astype(jnp.int32), ctx.network_axis) > 0
    return flag


def compute_if(pred: Array, fn: Callable, args: tuple, consts: tuple = ()) -> PyTree:
    """``fn(*args, *consts)`` where ``pred`` holds, zeros of its shapes where it does not,
    differentiable in ``args`` (not in ``consts``), computed in neither the forward nor the
    backward pass where ``pred`` is false.

    A plain ``jax.lax.cond`` inside the trainer's gradient still costs a skipped branch
    most of its price: reverse mode splits the cond, and the skipped side writes zeros for
    every intermediate the other side keeps for its gradient (``B x B`` matrices for a
    loss term). Here the branch keeps only its inputs, and the backward pass recomputes
    it under the same predicate (as ``jax.checkpoint`` would, once more of ``fn``'s forward
    where ``pred`` holds). ``pred`` must be one unbatched boolean (:func:`any_network`)."""

    def zeros(*a):
        return jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, *a))

    @jax.custom_vjp
    def run(pred, consts, *a):
        return jax.lax.cond(pred, fn, zeros, *a, *consts)

    def forward(pred, consts, *a):
        return run(pred, consts, *a), (pred, consts, a)

    def backward(residuals, cotangent):
        pred, consts, a = residuals

        def grads(a, cotangent):
            return jax.vjp(lambda *x: fn(*x, *consts), *a)[1](cotangent)

        def none(a, cotangent):
            del cotangent
            return jax.tree.map(jnp.zeros_like, a)

        return (None, None, *jax.lax.cond(pred, grads, none, a, cotangent))

    run.defvjp(forward, backward)
    return run(pred, tuple(consts), *args)


class RefreshContext(NamedTuple):
    """What ``refresh_fn`` knows besides memory and statistics.

    Attributes:
      epoch: the epoch about to start.
      num_epochs: total epochs of the run.
      network: which network's memory this is.
      rng: a key for this refresh.
      fetch: ``fetch(indices) -> batch`` returns training pairs by index as a device
        batch (e.g. to keep the raw features of a confident set in memory).
      scratch: a directory for the refresh's temporary files (the method's
        ``disk_stats`` are there; emptied after the refresh), or ``None``.
      held_out: ``held_out() -> float or None``, the validation split's estimated share
        of pairs whose image ranks no better than a random one's under the current model
        (``ncljax.train.evaluator.held_out_share``; computed when first called), or
        ``None`` where the trainer gives none.
      divide: ``False`` where the run switches every division off (``train.division=
        'off'``; ``ncljax.labels.share.divides``): a method whose division has a switch
        trains every pair as clean, whatever its statistics show.
    """

    epoch: int
    num_epochs: int
    network: int
    rng: Array
    fetch: Callable[[Any], dict[str, Array]]
    held_out: Callable[[], float | None] | None = None
    scratch: str | None = None
    divide: bool = True


class EpochPlan(NamedTuple):
    """How the trainer runs one epoch (see "Epochs as plans" in the module docstring).

    Attributes:
      phase: static step variant of the epoch (warm-up, main, ...): each phase compiles
        its own step.
      refresh: run the statistics pass and ``refresh_fn`` before the epoch.
      in_turn: the networks train one after another, each against its frozen peers
        (one pass per network); ``False``: together under ``vmap`` (one pass).
      updates: per step, the stream each sequential optimiser update reads (0: the main
        batch, 1: the auxiliary batch); ``(0, 1)`` makes two updates per step.
      reset_optimizer: re-initialise every network's optimiser state before the epoch.
      lr_epoch: the epoch the learning-rate schedule reads (``None``: this epoch), e.g.
        epochs counted from the end of a warm-up.
      selectable: the epoch may be selected as best on validation (warm-up: no); the
        config's ``train.select_every_epoch`` (the vectors presets) makes every epoch
        selectable.
      restart_best: forget the best validation score before this epoch is scored, so
        only this and later epochs can win (ignored under ``train.select_every_epoch``).
      min_batch: a pass ends at the first step whose main batch, or non-empty auxiliary
        stream's batch, has fewer real pairs than this (2 for BatchNorm).
      drop_remainder: every batch is full: the last partial batch of the main stream (and
        of each cycle of the auxiliary stream, when it holds a full batch) is skipped.
    """

    phase: int = 0
    refresh: bool = False
    in_turn: bool = False
    updates: tuple[int, ...] = (0,)
    reset_optimizer: bool = False
    lr_epoch: int | None = None
    selectable: bool = True
    restart_best: bool = False
    min_batch: int = 1
    drop_remainder: bool = False


class Streams(NamedTuple):
    """The training pairs a pass walks (indices into the ``N`` training pairs).

    Attributes:
      main: int ``[M]``: each visited once per epoch in a fresh shuffle (``None``: all
        ``N`` pairs).
      aux: int ``[A]`` cycled alongside the main stream, one batch per step, reshuffled
        whenever exhausted (``None``: no auxiliary batch).
    """

    main: Any = None
    aux: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Aux:
    """What ``loss_fn`` returns besides the per-example loss (a pytree; every field optional).

    Attributes:
      metrics: per-example values ``[B]`` to average and log, by name.
      memory: per-example rows to write back into ``memory.samples`` at
        ``batch['index']`` (padding rows are never written).
      memory_at: ``(index [M], rows)``: rows written into ``memory.samples`` at explicit
        indices after ``memory`` (an index outside ``[0, N)`` is dropped; the method keeps
        the indices of one write distinct), e.g. a method that reproduces a reference
        code's writes at other keys; ``None``: no such write.
      clean_estimate: ``[B]`` in ``[0, 1]``, the method's per-pair belief that a pair is
        clean, scored against the true mask (precision and recall of ``> 0.5``) in the
        logs only; ``None``: none.
      clean_estimates: several such beliefs by name (e.g. one per retrieval direction),
        logged as ``step_clean_precision_<name>`` and ``step_clean_recall_<name>``.
      noisy_estimates: per-pair beliefs that a pair is *noisy* by name (e.g. a method's
        noisy set), logged as ``step_noisy_precision_<name>`` (the share of truly noisy
        pairs among those ``> 0.5``) and ``step_noisy_recall_<name>``.
      weight: ``[B]`` (>= 0): per-pair weights the trainer's reduction applies, for a
        method that returns unweighted losses: the reduced loss is ``sum(w * loss) / n``
        over the ``n`` real rows (``'mean'``; ``'sum'``: ``sum(w * loss)``), so a weight
        of 0 drops a pair and the weights are not renormalised; ``None``: every pair 1.
        The logs report the share of it on truly noisy pairs.
      applied_weight: ``[B]`` (>= 0): how much each pair counted in the loss when the
        method applied the weight itself (a soft label, a margin, a mask); read by the
        logs only (the share of it on truly noisy pairs), never by the reduction.
      extra: anything else the method wants scored for the logs, by its own
        ``Method.step_metrics_fn`` (e.g. PC2's borrowed-caption rows).
    """

    metrics: dict[str, Array] = dataclasses.field(default_factory=dict)
    memory: dict[str, Array] = dataclasses.field(default_factory=dict)
    memory_at: tuple[Array, dict[str, Array]] | None = None
    clean_estimate: Array | None = None
    clean_estimates: dict[str, Array] = dataclasses.field(default_factory=dict)
    noisy_estimates: dict[str, Array] = dataclasses.field(default_factory=dict)
    weight: Array | None = None
    applied_weight: Array | None = None
    extra: PyTree = None


def default_forward(model, batch, memory_state, *, train, rngs, phase, ctx=None):
    del memory_state, phase, ctx
    return model(batch, train=train, rngs=rngs)


def _identity(x):
    return x


class Verdict(NamedTuple):
    """What ``python -m ncljax.audit`` tells a user about the method's per-pair score
    (``clean_score_fn``, or a labels method's clean estimate).

    Attributes:
      score: what the score is, in words (``audit.json``'s ``score``).
      threshold: the cut the method itself applies to it, or ``None`` where it applies
        none (the audit then ranks without a cut).
      rule: where the cut comes from, or why there is none.
      caveat: where the score was measured weak, and what to use instead ("" if nowhere).
    """

    score: str
    threshold: float | None
    rule: str
    caveat: str = ""


class Method(NamedTuple):
    """A training method as a bundle of pure functions (see the module docstring).

    Attributes:
      name: registry name.
      init_memory: ``(InitContext) -> Memory`` for one network.
      loss_fn: ``(outputs, batch, rows, peer_rows, ctx) -> (loss [B], Aux)``.
      forward_fn: ``(model, batch, memory_state, *, train, rngs, phase, ctx=None) ->
        outputs`` (``ctx``: the update's ``LossContext`` in a train step, ``None`` in the
        statistics pass).
      refresh_fn: per-epoch estimation, or ``None``.
      stats_fn: per-example statistics for ``refresh_fn``, or ``None``.
      stats_rows: the memory rows ``stats_fn`` reads (``stats_fn(outputs, batch,
        rows)``); empty: ``stats_fn(outputs, batch)``.
      disk_stats: the statistics the trainer writes to files instead of holding them in
        device memory (``refresh_fn`` gets them as read-only memory-mapped numpy arrays,
        to read in chunks): per-pair statistics too large to hold for every pair, such
        as UOT-RCL's embeddings at ``10^7`` pairs.
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
      eval_transform: applied to the similarities of each view of each network before
        they are pooled at evaluation (e.g. a sigmoid for logit heads).
      eval_pool: how the transformed similarities of a run's views and networks, and of
        an ensemble's runs, are combined at evaluation (``ncljax.train.evaluator.POOLS``):
        ``'mean'`` (arithmetic mean; every method but UGNCL) or ``'logmeanexp'``
        (``log(mean(exp(x)))``: UGNCL's mean of evidences from log-evidences).
      num_networks: 1, or 2 for dual-network methods.
      streams_fn: ``(memory, plan, network) -> Streams``, or ``None`` (all pairs).
      prepare_fn: ``(model, peer, batches, ctx) -> pytree``, or ``None``.
      loss_reduction: ``'mean'`` (over the real pairs of the global batch) or ``'sum'``.
      heads_fn: ``(info, rngs) -> {name: nnx.Module}``, the method's own heads (see
        "Method heads"), or ``None``.
      step_metrics_fn: ``(extra, batch, batches) -> {name: [2]}`` scores ``Aux.extra``
        for the logs (``(sum, count)`` pairs), or ``None``.
      settings: the method's frozen ``Settings`` (its checked hyperparameters), or
        ``None`` for a bundle built by hand.
      verdict: what the audit says about the method's score (:class:`Verdict`), or
        ``None`` (a baseline; or a bundle built by hand, whose score the audit describes
        as "the method's clean estimate" with the cut 0.5).
    """

    name: str
    init_memory: Callable[..., Memory]
    loss_fn: Callable[..., tuple[Array, Aux]]
    forward_fn: Callable[..., dict] = default_forward
    refresh_fn: Callable[..., tuple[Memory, dict]] | None = None
    stats_fn: Callable[..., dict] | None = None
    stats_rows: tuple[str, ...] = ()
    disk_stats: tuple[str, ...] = ()
    plan_fn: Callable[[int], EpochPlan] = lambda epoch: EpochPlan()
    clean_score_fn: Callable[[Memory], Array] | None = None
    label_estimate_fn: Callable[[Memory], tuple[Array, Array]] | None = None
    diagnostic_scores_fn: Callable[[Memory], dict[str, Array]] | None = None
    eval_transform: Callable[[Array], Array] = _identity
    eval_pool: str = "mean"
    num_networks: int = 1
    streams_fn: Callable[[Memory, EpochPlan, int | None], Streams] | None = None
    prepare_fn: Callable[..., PyTree] | None = None
    loss_reduction: str = "mean"
    heads_fn: Callable[..., dict] | None = None
    step_metrics_fn: Callable[..., dict[str, Array]] | None = None
    settings: Any = None
    verdict: Verdict | None = None


# A method module's functions that take its settings first, by the ``Method`` field each
# fills (``bind_module``).
MODULE_FUNCTIONS = {
    "init_memory": "init_memory",
    "loss_fn": "loss",
    "forward_fn": "forward",
    "refresh_fn": "refresh",
    "stats_fn": "stats",
    "plan_fn": "plan",
    "streams_fn": "streams",
    "prepare_fn": "prepare",
}


def bind_module(module, s, **fields) -> Method:
    """The ``Method`` of a method module with its settings ``s`` bound.

    Each of the module's top-level functions named in ``MODULE_FUNCTIONS`` (``loss``,
    ``plan``, ``refresh``, ...) fills its field with ``s`` bound as the first argument;
    ``fields`` give the rest (``num_networks``, ``clean_score_fn``, ...) and override a
    bound function where the module binds more than ``s`` (e.g. a compiled estimator).
    The name is the factory's (``settings.factory`` sets it; until then the module's).

    Raises:
      TypeError: the module has no ``loss`` (and ``fields`` no ``loss_fn``), or a
        top-level function whose name is a near miss of one of ``MODULE_FUNCTIONS``
        (``refrsh``), which would silently not be bound.
    """
    own = {
        n
        for n, f in vars(module).items()
        if callable(f)
        and not n.startswith("_")
        and getattr(f, "__module__", None) == module.__name__
    }
    unbound = [
        fn for field, fn in MODULE_FUNCTIONS.items() if fn not in own and field not in fields
    ]
    for n in sorted(own - set(MODULE_FUNCTIONS.values())):
        near = difflib.get_close_matches(n, unbound, n=1, cutoff=0.8)
        if near:
            raise TypeError(
                f"{module.__name__}.{n} looks like {near[0]!r}, a method function "
                f"(ncljax.methods.base.MODULE_FUNCTIONS), and would not be bound: rename it."
            )
    if "loss" not in own and "loss_fn" not in fields:
        raise TypeError(f"{module.__name__} has no loss function: define loss(s, outputs, ...).")
    bound = {
        field: functools.partial(getattr(module, fn), s)
        for field, fn in MODULE_FUNCTIONS.items()
        if field not in fields and fn in own
    }
    name = fields.pop("name", module.__name__.rsplit(".", 1)[-1])
    return Method(name=name, **bound, **fields, settings=s)


def warmup_problems(name: str, warmup_epochs: int, epochs: int) -> list[str]:
    """A warm-up of ``warmup_epochs`` as long as a run of ``epochs`` (the method would
    never train its own objective), in one line naming both flags."""
    if warmup_epochs >= epochs >= 1:
        return [
            f"method_kwargs.warmup_epochs={warmup_epochs} must be less than "
            f"train.epochs={epochs} ({name} would never leave its warm-up): lower "
            "--config.method_kwargs.warmup_epochs or raise --config.train.epochs"
        ]
    return []


def empty_memory(ctx: InitContext) -> Memory:
    """Memory of a method that keeps none."""
    del ctx
    return Memory(samples={}, state={})
