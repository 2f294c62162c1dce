r"""UOT-RCL: partial-OT label correction and OT relation alignment (Han et al., 2024).

Cross-modal retrieval with noisy *category* labels. After a cross-entropy warm-up on the
observed labels (Eq. 2), every epoch starts with an estimation step over the whole
training set (``refresh_fn``):

1. a class-balanced confident set: per predicted class, the pairs whose image and text
   posteriors agree best (smallest JSD; Eqs. 4-5);
2. momentum-smoothed soft targets (Eq. 9) and a cross-modal consistent cost from each
   pair's nearest neighbours in both modalities, weighted by modal consistency ratios
   (Eqs. 6-8, with ncljax's floor and shift safeguards, which the paper lacks);
3. partial optimal transport of a growing mass ``s`` (0.2 -> 0.8) of the samples to the
   classes (Eqs. 10-14, dummy-point construction, Sinkhorn in ott-jax): the plan, times
   ``N``, is each pair's corrected soft label; untransported pairs are left out.

Each step then minimises ``L_PLC + lambda L_BHG`` (Eq. 19): cross-entropy on the
corrected labels (Eq. 15) plus a soft-target InfoNCE whose targets are an OT plan between
the batch's images and texts, with the JSD of their relation distributions to the
confident set as cost (Eqs. 16-18). No gradient flows through targets or plans.

No official code was released: every choice the paper (Secs. IV-V) leaves open or
states ambiguously is a field of :class:`Settings`, with ncljax's default. The model needs
``model.classifier=True`` (unit prototypes, temperature ``tau_1`` =
``model.prototypes.temperature``). The module is UOT-RCL's settings and pure
functions (:func:`plan`, :func:`forward`, :func:`loss`, :func:`refresh`, ...);
:func:`bind` makes the bundle and :func:`uot_rcl` is the registry's factory.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import losses, models
from ncljax.labels import correction, disk, ot
from ncljax.labels import uot_rcl as uot_rcl_labels
from ncljax.methods import base, baselines, settings

_WARMUP, _MAIN = base.WARMUP, base.MAIN
_MASS = settings.interval(0, 1, low_open=True)  # a transported fraction; 1: balanced OT


class Settings(NamedTuple):
    """UOT-RCL's hyperparameters (``config.method_kwargs``): the factory's arguments.

    Attributes:
      warmup_epochs: epochs of cross-entropy on the observed labels (``E_w`` = 2).
      momentum: ``gamma`` of the soft-target update (Eq. 9; 0.99).
      relation_weight: ``lambda`` of ``L_BHG`` (Eq. 19; 0.4).
      neighbours: ``kappa`` nearest neighbours per modality (Wiki 10, NUS 200, XMediaNet 150).
      per_class: confident pairs per predicted class ``n_G`` (5).
      mass_start: transported mass at the first post-warm-up epoch (0.2).
      mass_end: transported mass at the last epoch (0.8).
      label_epsilon: entropic regularisation of the partial OT on the shifted cost (0.05;
        not in the paper).
      label_corner: cost of the dummy-dummy corner in units of ``label_epsilon`` (30: the
        transported mass is exactly ``s``; 0 is the paper's matrix, which transports more
        when costs tie at the minimum; see ``ncljax.labels.partial_ot_labels``).
      label_threshold: Sinkhorn threshold of the partial OT (1e-6).
      label_max_iterations: Sinkhorn iterations cap of the partial OT.
      class_marginal: ``'uniform'`` (the paper's example, ``1/K``) or ``'empirical'``
        (observed label frequencies; for class-imbalanced sets).
      relation_epsilon: entropic regularisation of the relation OT on the max-scaled
        JSD cost (0.1; not in the paper).
      relation_threshold: Sinkhorn threshold of the relation OT.
      relation_max_iterations: Sinkhorn iterations cap of the relation OT.
      relation_anderson: Anderson acceleration of the relation OT's Sinkhorn over this
        many past potentials, 0 for plain Sinkhorn (5; ``ncljax.labels.relation_plan``:
        the same plan within ``relation_threshold`` in 2-3x fewer iterations, more the
        longer the model trains) [ncljax].
      relation_temperature: ``tau_2`` of the relation scores (1).
      relation_sign: +1 (softmax of similarity, as Eqs. 6-8 use ``d``) or -1 (the paper's
        literal ``exp(-d / tau_2)``).
      match_temperature: ``tau_3`` of the matching probabilities (1).
      confident: ``'jsd'`` (Eqs. 4-5) or ``'random'`` (the "w/o confident set" ablation).
      anchors: confident-set embeddings recomputed with the ``'current'`` parameters at
        every step (stop-gradient; the default, the paper does not say) or the per-epoch
        ``'snapshot'``.
      exclude_self: exclude each sample from its own neighbours (ncljax's choice; Eq. 8
        does not say).
      vote_normalise: normalise each sample's blended vote ``b_i`` (Eq. 8) over the
        classes before ``-log`` (default True; ``False`` is the paper's literal cost).
        The literal cost lowers a whole row by ``log`` of the vote's magnitude, so the
        partial OT transports the samples with the largest consistency ratios and the
        densest neighbourhoods, not the ones whose label is clearest: on the embedded
        data at 40% noise it selected labels 50% correct at ``s = 0.2`` (normalised:
        98%).
      knn_chunk: query rows per chunk of the neighbour search (memory ``chunk x N``) and
        of the nearest confident pair's (memory ``chunk x G``, the confident set).
      knn_key_chunk: candidate rows per chunk of it, or ``None`` (all ``N`` at once): the
        search's block is then ``knn_chunk x knn_key_chunk`` whatever ``N``, the same
        neighbours (``ncljax.labels.knn_cosine``).
      knn: the neighbour search, ``'exact'`` (every pair against every other, ``N^2 D``
        work: about a minute at 10^5 pairs on 2 CPU cores, hours at 10^6) or
        ``'blocks'``, an approximate search among nearby pairs
        (``ncljax.labels.knn_cosine_blocks``: ``N * knn_probes * knn_block * D`` work; 6.5 s
        at 10^5 pairs with recall 0.99, 71 s at 10^6 with recall 0.97 on clustered
        embeddings, ``benchmarks/RESULTS.md``) [ncljax; the paper searches exactly].
      knn_block: rows per block of the approximate search (1024).
      knn_probes: blocks each block searches (16).
      embeddings: where the refresh keeps every pair's embeddings: ``'device'`` (in
        memory, ``2 N D`` floats and their copies: 60 GB at ``10^7`` pairs of 256
        dimensions) or ``'disk'`` (files in the run's workdir, read ``knn_chunk`` rows at
        a time: the refresh's memory grows with ``N K``, not ``N D``;
        ``ncljax.labels.disk``, the same labels to round-off) [ncljax].
      num_networks: 1 (UOT-RCL trains one network).
    """

    warmup_epochs: int = 2
    momentum: float = 0.99
    relation_weight: float = 0.4
    neighbours: int = 10
    per_class: int = 5
    mass_start: float = 0.2
    mass_end: float = 0.8
    label_epsilon: float = 0.05
    label_corner: float = 30.0
    label_threshold: float = 1e-6
    label_max_iterations: int = 5000
    class_marginal: str = "uniform"
    relation_epsilon: float = 0.1
    relation_threshold: float = 1e-5
    relation_max_iterations: int = 1000
    relation_anderson: int = 5
    relation_temperature: float = 1.0
    relation_sign: float = 1.0
    match_temperature: float = 1.0
    confident: str = "jsd"
    anchors: str = "current"
    exclude_self: bool = True
    vote_normalise: bool = True
    knn_chunk: int = 2048
    knn_key_chunk: int | None = None
    knn: str = "exact"
    knn_block: int = 1024
    knn_probes: int = 16
    embeddings: str = "device"
    num_networks: int = 1


CHECKS = {
    "warmup_epochs": settings.NON_NEGATIVE_INT,
    "momentum": settings.UNIT_INTERVAL,  # Fig. 4 sweeps 0 to 1
    "relation_weight": settings.NON_NEGATIVE,
    "neighbours": settings.POSITIVE_INT,
    "per_class": settings.POSITIVE_INT,
    "mass_start": _MASS,
    "mass_end": _MASS,
    "label_epsilon": settings.POSITIVE,
    "label_corner": settings.NON_NEGATIVE,  # 0: the paper's matrix
    "label_threshold": settings.POSITIVE,
    "label_max_iterations": settings.POSITIVE_INT,
    "class_marginal": settings.one_of("uniform", "empirical"),
    "relation_epsilon": settings.POSITIVE,
    "relation_threshold": settings.POSITIVE,
    "relation_max_iterations": settings.POSITIVE_INT,
    "relation_anderson": settings.NON_NEGATIVE_INT,
    "relation_temperature": settings.POSITIVE,
    "relation_sign": settings.one_of(1.0, -1.0),
    "match_temperature": settings.POSITIVE,
    "confident": settings.one_of("jsd", "random"),
    "anchors": settings.one_of("current", "snapshot"),
    "exclude_self": settings.BOOLEAN,
    "vote_normalise": settings.BOOLEAN,
    "knn_chunk": settings.POSITIVE_INT,
    "knn_key_chunk": settings.optional(settings.POSITIVE_INT, "all candidates at once"),
    "knn": settings.one_of("exact", "blocks"),
    "knn_block": settings.POSITIVE_INT,
    "knn_probes": settings.POSITIVE_INT,
    "embeddings": settings.one_of("device", "disk"),
    "num_networks": settings.NUM_NETWORKS,
}


# The confident set keeps each anchor pair's raw model inputs (the fields the encoders read,
# ``models.input_fields``), in memory under these keys, each of ``g`` rows of this shape
# (``DatasetInfo`` attributes) and dtype.
ANCHOR_KEYS = {
    "global_image": "anchors_image",
    "global_text": "anchors_text",
    "regions": "anchors_regions",
    "tokens": "anchors_tokens",
    "length": "anchors_length",
}
_ANCHOR_ROWS = {
    "global_image": (("image_dim",), jnp.float32),
    "global_text": (("text_dim",), jnp.float32),
    "regions": (("num_regions", "region_dim"), jnp.float32),
    "tokens": (("max_length",), jnp.int32),
    "length": ((), jnp.int32),
}
_GLOBAL_INPUTS = (("global_image",), ("global_text",))
# Above this many training pairs the first refresh notes the exact search's cost.
EXACT_SEARCH_WARNING = 100_000
# Above this many bytes of embeddings (both modalities; the in-memory refresh holds about
# six times as much) the first refresh notes ``embeddings='disk'``.
EMBEDDINGS_WARNING = 1024**3


def _empty_anchors(info, g: int, fields) -> dict[str, jax.Array]:
    """Zeros for ``g`` anchors' raw inputs of the model's ``fields``."""
    empty = {}
    for field in fields:
        row, dtype = _ANCHOR_ROWS[field]
        empty[ANCHOR_KEYS[field]] = jnp.zeros((g, *(getattr(info, a) for a in row)), dtype)
    return empty


def _anchor_batches(memory_state) -> tuple[dict, dict]:
    """The confident set's stored inputs as an image batch and a caption batch."""
    stored = {f: memory_state[key] for f, key in ANCHOR_KEYS.items() if key in memory_state}
    image = {f: v for f, v in stored.items() if f in ("global_image", "regions")}
    return image, {f: v for f, v in stored.items() if f not in image}


def init_memory(
    s: Settings, ctx: base.InitContext, *, fields: tuple = _GLOBAL_INPUTS
) -> base.Memory:
    """Soft targets at the observed one-hot labels, no corrected labels yet (all zero),
    an empty confident set of ``num_classes * per_class`` anchors (their raw inputs: the
    model's image and caption ``fields``, ``models.input_fields``), and the class marginal
    of the partial OT.

    Raises:
      ValueError: where the dataset has no class labels.
    """
    info, n = ctx.info, ctx.num_samples
    k = info.num_classes
    if k < 2:
        raise ValueError("UOT-RCL needs class labels; the dataset has none.")
    g = k * s.per_class
    observed_image = np.asarray(ctx.labels_image, np.int64)
    observed_text = np.asarray(ctx.labels_text, np.int64)
    return base.Memory(
        samples={
            "targets_image": jax.nn.one_hot(observed_image, k, dtype=jnp.float32),
            "targets_text": jax.nn.one_hot(observed_text, k, dtype=jnp.float32),
            "labels": jnp.zeros((n, k), jnp.float32),
        },
        state={
            **_empty_anchors(info, g, fields[0] + fields[1]),
            "anchor_mask": jnp.zeros(g, bool),
            "anchor_z_image": jnp.zeros((g, ctx.embed_dim), jnp.float32),
            "anchor_z_text": jnp.zeros((g, ctx.embed_dim), jnp.float32),
            "class_marginal": _marginal(observed_image, observed_text, k, s.class_marginal),
        },
    )


def plan_problems(s: Settings, name: str, epochs: int) -> list[str]:
    """A run must outlast the warm-up (``base.warmup_problems``)."""
    return base.warmup_problems(name, s.warmup_epochs, epochs)


def plan(s: Settings, epoch: int) -> base.EpochPlan:
    """``warmup_epochs`` epochs of cross-entropy, then the corrected training, each of its
    epochs after a label correction."""
    main = epoch >= s.warmup_epochs
    return base.EpochPlan(phase=_MAIN if main else _WARMUP, refresh=main)


def forward(s: Settings, model, batch, memory_state, *, train, rngs, phase, ctx=None):
    """The model's outputs; in a main-phase training step also the confident set's
    embeddings ``anchor_z_image``/``anchor_z_text`` (encoded by the current parameters
    without gradient, or the epoch's snapshot) and its ``anchor_mask``."""
    del ctx
    outputs = model(batch, train=train, rngs=rngs)
    if not (train and phase == _MAIN):
        return outputs
    if s.anchors == "current":
        image_batch, text_batch = _anchor_batches(memory_state)
        anchor_image = model.encode_image(image_batch)
        anchor_text = model.encode_text(text_batch)
        outputs["anchor_z_image"] = jax.lax.stop_gradient(anchor_image["emb"])
        outputs["anchor_z_text"] = jax.lax.stop_gradient(anchor_text["emb"])
    else:
        outputs["anchor_z_image"] = memory_state["anchor_z_image"]
        outputs["anchor_z_text"] = memory_state["anchor_z_text"]
    outputs["anchor_mask"] = memory_state["anchor_mask"]
    return outputs


class UOTRCLTerms(NamedTuple):
    """The terms of :func:`uot_rcl_loss`, each ``[B]``: the cross-entropy on the corrected
    labels (``plc``), the relation-aligned InfoNCE (``bhg``), whether the batch's
    relation plan converged (``relation_converged``, 0/1 broadcast) and the Sinkhorn
    iterations it took (``relation_iterations``, broadcast)."""

    plc: jax.Array
    bhg: jax.Array
    relation_converged: jax.Array
    relation_iterations: jax.Array


def uot_rcl_loss(
    z_image: jax.Array,
    z_text: jax.Array,
    logits_image: jax.Array,
    logits_text: jax.Array,
    labels: jax.Array,
    anchor_z_image: jax.Array,
    anchor_z_text: jax.Array,
    anchor_mask: jax.Array,
    *,
    where: jax.Array | None = None,
    relation_weight: float = 0.4,
    match_temperature: float = 1.0,
    relation_temperature: float = 1.0,
    relation_sign: float = 1.0,
    relation_epsilon: float = 0.1,
    relation_threshold: float = 1e-5,
    relation_max_iterations: int = 1000,
    relation_anderson: int = 5,
) -> tuple[jax.Array, UOTRCLTerms]:
    """UOT-RCL's objective ``L_PLC + lambda L_BHG`` (Eq. 19), ``([B], terms)``.

    ``L_PLC``: the cross-entropy of both modalities' class logits on the corrected soft
    labels ``Q`` (Eq. 15; :func:`ncljax.labels.correct_labels`). ``L_BHG``: the two
    directions of InfoNCE between the batch's embeddings at ``match_temperature``, on the
    soft targets of the relation plan (Eqs. 16-18): the image-text OT plan whose cost is
    the Jensen-Shannon divergence of the pairs' relation distributions over the confident
    anchors (no gradient through the plan).

    Args:
      z_image, z_text: ``[B, D]`` unit embeddings.
      logits_image, logits_text: ``[B, K]`` class logits.
      labels: ``[B, K]`` the pairs' corrected soft labels.
      anchor_z_image, anchor_z_text: ``[G, D]`` the confident anchors' embeddings.
      anchor_mask: ``[G]`` the real anchors.
      where: ``[B]`` the real rows (padding excluded from the plan and the InfoNCE).
      relation_weight: ``lambda``.
      match_temperature: of the InfoNCE logits.
      relation_temperature, relation_sign: of the relation scores (Eq. 16).
      relation_epsilon, relation_threshold, relation_max_iterations, relation_anderson: the
        plan's Sinkhorn.

    Returns:
      ``(loss [B], UOTRCLTerms)``.
    """
    mask = jnp.ones(z_image.shape[0], bool) if where is None else where
    plc = losses.soft_cross_entropy(logits_image, labels) + losses.soft_cross_entropy(
        logits_text, labels
    )
    relation = functools.partial(
        correction.relation_scores,
        anchor_mask=anchor_mask,
        temperature=relation_temperature,
        sign=relation_sign,
    )
    r_image = relation(jax.lax.stop_gradient(z_image), anchor_z_image)
    r_text = relation(jax.lax.stop_gradient(z_text), anchor_z_text)
    targets = ot.relation_plan(
        correction.jensen_shannon_pairwise(r_image, r_text),  # Eq. 17
        where=mask,
        epsilon=relation_epsilon,
        threshold=relation_threshold,
        max_iterations=relation_max_iterations,
        anderson=relation_anderson,
    )
    logits = z_image @ z_text.T / match_temperature
    bhg = losses.info_nce(logits, targets.image_to_text, where=mask) + losses.info_nce(
        logits.T, targets.text_to_image, where=mask
    )  # Eq. 18: the two directions summed
    converged = jnp.broadcast_to(targets.converged, plc.shape).astype(jnp.float32)
    iterations = jnp.broadcast_to(targets.n_iters, plc.shape).astype(jnp.float32)
    return plc + relation_weight * bhg, UOTRCLTerms(plc, bhg, converged, iterations)


def loss(s: Settings, outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """:func:`uot_rcl_loss` with the settings ``s`` on the corrected labels
    ``rows['labels']``. Warm-up: cross-entropy on the observed labels
    (``baselines.ce_loss``, Eq. 2)."""
    if ctx.phase == _WARMUP:
        return baselines.ce_loss(outputs, batch, rows, peer_rows, ctx)
    total, terms = uot_rcl_loss(
        outputs["image"]["emb"],
        outputs["text"]["emb"],
        outputs["image_logits"],
        outputs["text_logits"],
        rows["labels"],
        outputs["anchor_z_image"],
        outputs["anchor_z_text"],
        outputs["anchor_mask"],
        where=batch["mask"],
        relation_weight=s.relation_weight,
        match_temperature=s.match_temperature,
        relation_temperature=s.relation_temperature,
        relation_sign=s.relation_sign,
        relation_epsilon=s.relation_epsilon,
        relation_threshold=s.relation_threshold,
        relation_max_iterations=s.relation_max_iterations,
        relation_anderson=s.relation_anderson,
    )
    metrics = {
        "loss_plc": terms.plc,
        "loss_bhg": terms.bhg,
        "relation_converged": terms.relation_converged,
        "relation_iterations": terms.relation_iterations,
    }
    return total, base.Aux(metrics=metrics)


def stats(s: Settings, outputs, batch) -> dict:
    """The estimation's per-pair inputs: embeddings and class logits of both modalities."""
    del s, batch
    return {
        "z_image": outputs["image"]["emb"],
        "z_text": outputs["text"]["emb"],
        "logits_image": outputs["image_logits"],
        "logits_text": outputs["text_logits"],
    }


def _correction_options(s: Settings) -> dict:
    """The settings as ``labels.correct_labels``' keyword arguments."""
    return dict(
        per_class=s.per_class,
        neighbours=s.neighbours,
        momentum=s.momentum,
        epsilon=s.label_epsilon,
        corner=s.label_corner * s.label_epsilon,
        threshold=s.label_threshold,
        max_iterations=s.label_max_iterations,
        confident=s.confident,
        exclude_self=s.exclude_self,
        vote_normalise=s.vote_normalise,
        knn_chunk=s.knn_chunk,
        knn_key_chunk=s.knn_key_chunk,
        knn=s.knn,
        knn_block=s.knn_block,
        knn_probes=s.knn_probes,
    )


def estimator(s: Settings) -> Callable:
    """:func:`_estimate` with the settings bound, jitted:
    ``(samples, class_marginal, stats, mass, key) -> (samples, confident set, OT result)``."""
    return jax.jit(functools.partial(_estimate, **_correction_options(s)))


def _estimate_on_disk(s: Settings, samples, class_marginal, stats, mass, key, scratch):
    """:func:`_estimate` with the embeddings in files (``embeddings='disk'``)."""
    correct = functools.partial(disk.correct_labels_on_disk, scratch=scratch)
    return _estimate(
        samples, class_marginal, stats, mass, key, correct=correct, **_correction_options(s)
    )


def refresh(s: Settings, memory, stats, ctx, *, estimate_fn: Callable | None = None):
    """The label correction before a main epoch (nothing during the warm-up).

    Args:
      s: the settings.
      memory: the network's memory.
      stats: :func:`stats` of every training pair.
      ctx: the ``RefreshContext`` (epoch, schedule, key, and ``fetch`` of the confident
        pairs' raw features).
      estimate_fn: :func:`estimator`'s result (a bundle compiles it once); ``None``
        builds it.

    Returns:
      ``(memory, diagnostics)``: new targets, labels and confident set (anchors); the
      scheduled and transported mass, the OT's convergence, the selected share.
    """
    if ctx.epoch < s.warmup_epochs:
        return memory, {}
    num_pairs = stats["z_image"].shape[0]
    if s.knn == "exact" and num_pairs > EXACT_SEARCH_WARNING and ctx.epoch == s.warmup_epochs:
        logging.warning(
            "uot_rcl: the exact neighbour search compares every one of the %d training pairs "
            "with every other before each epoch (about a minute at 10^5 pairs on 2 CPU "
            "cores, growing with the square of N). method_kwargs.knn='blocks' searches "
            "nearby pairs only (6 s at 10^5 pairs, recall 0.98).",
            num_pairs,
        )
    held = 4 * num_pairs * stats["z_image"].shape[1] * 2  # both modalities, float32
    if s.embeddings == "device" and held > EMBEDDINGS_WARNING and ctx.epoch == s.warmup_epochs:
        logging.warning(
            "uot_rcl: the refresh holds the embeddings of all %d training pairs in memory "
            "(%.1f GB for both modalities) about six times over while it searches (13 GB "
            "at 10^6 pairs of 256 dimensions). "
            "method_kwargs.embeddings='disk' keeps them in files in the workdir and reads "
            "them in chunks.",
            num_pairs,
            held / 1e9,
        )
    estimate_fn = estimator(s) if estimate_fn is None else estimate_fn
    mass = ot.mass_schedule(
        ctx.epoch,
        num_epochs=ctx.num_epochs,
        warmup_epochs=s.warmup_epochs,
        start=s.mass_start,
        end=s.mass_end,
    )
    if s.embeddings == "disk":
        samples, confident_set, result = _estimate_on_disk(
            s, memory.samples, memory.state["class_marginal"], stats, mass, ctx.rng, ctx.scratch
        )
    else:
        samples, confident_set, result = estimate_fn(
            memory.samples, memory.state["class_marginal"], stats, mass, ctx.rng
        )
    fetched = ctx.fetch(np.asarray(confident_set.index))
    state = dict(memory.state)
    for field, key in ANCHOR_KEYS.items():
        if key in state:  # the model's inputs (init_memory)
            state[key] = jnp.asarray(fetched[field], state[key].dtype)
    state["anchor_mask"] = confident_set.mask
    if s.anchors == "snapshot":
        index = np.asarray(confident_set.index)
        state.update(
            anchor_z_image=jnp.asarray(disk.read_rows(stats["z_image"], index)),
            anchor_z_text=jnp.asarray(disk.read_rows(stats["z_text"], index)),
        )
    if not bool(result.converged):
        logging.warning(
            "uot_rcl: the label partial OT of epoch %d did not converge in %d Sinkhorn "
            "iterations (threshold %g); its labels are approximate. Raise "
            "method_kwargs.label_max_iterations or label_epsilon.",
            ctx.epoch,
            int(result.n_iters),
            s.label_threshold,
        )
    diagnostics = {
        "mass": float(mass),
        "transported_mass": float(result.mass),
        "ot_converged": float(result.converged),
        "ot_iterations": float(result.n_iters),
        "selected_fraction": float(jnp.mean(result.selection > 0.5)),
        "confident_pairs": float(confident_set.mask.sum()),
    }
    return base.Memory(samples=samples, state=state), diagnostics


def label_estimate(memory: base.Memory) -> tuple[jax.Array, jax.Array]:
    """Each pair's corrected label (argmax of ``Q``) and whether it was transported
    (row mass above 1/2)."""
    labels = memory.samples["labels"]
    return jnp.argmax(labels, -1), labels.sum(-1) > 0.5


VERDICT = base.Verdict(
    "the corrected soft label's mass on the observed labels (mean of image and text)",
    0.5,
    "half the pair's mass on its observed label",
)


def bind(s: Settings, model_config=None) -> base.Method:
    """UOT-RCL's bundle with the settings ``s`` bound; ``model_config`` (the run's model
    section, where given) says which raw inputs the confident set keeps."""
    fields = _GLOBAL_INPUTS if model_config is None else models.input_fields(model_config)
    return base.bind_module(
        sys.modules[__name__],
        s,
        init_memory=functools.partial(init_memory, s, fields=fields),
        disk_stats=("z_image", "z_text") if s.embeddings == "disk" else (),
        refresh_fn=functools.partial(refresh, s, estimate_fn=estimator(s)),
        label_estimate_fn=label_estimate,
        verdict=VERDICT,
        num_networks=s.num_networks,
    )


def validate(values) -> None:
    """Refuses more ``neighbours`` than the block search is sure to search, whatever
    the number of pairs (after every setting passed its own rule)."""
    if values["knn"] != "blocks":
        return
    # knn_probes - 1 full blocks and the last block, which may hold one pair
    most = (values["knn_probes"] - 1) * values["knn_block"] + 1 - int(values["exclude_self"])
    settings.require(
        values["neighbours"] <= most,
        "uot_rcl",
        "neighbours",
        f"<= (knn_probes - 1) * knn_block{'' if values['exclude_self'] else ' + 1'} = {most} "
        "with knn='blocks' (the last block may hold a single pair; raise knn_probes or "
        "knn_block)",
        values["neighbours"],
    )


uot_rcl = settings.factory(
    "uot_rcl",
    Settings,
    CHECKS,
    bind,
    validate=validate,
    family="labels",
    plan_problems=plan_problems,
)


def _marginal(labels_image, labels_text, num_classes: int, kind: str) -> jax.Array:
    """The class marginal ``r`` of the partial OT: uniform, or observed label frequencies."""
    if kind == "uniform":
        return jnp.full(num_classes, 1.0 / num_classes, jnp.float32)
    counts = np.bincount(labels_image, minlength=num_classes) + np.bincount(
        labels_text, minlength=num_classes
    )
    return jnp.asarray(counts / counts.sum(), jnp.float32)


def _estimate(samples, class_marginal, stats, mass, key, *, correct=None, **options):
    """The per-epoch estimation (``correct``: ``ncljax.labels.uot_rcl.correct_labels``, on
    device, or ``ncljax.labels.disk.correct_labels_on_disk``; ``options``: its keyword
    arguments): ``(samples with the new targets and labels, confident set, partial-OT
    output)``."""
    correct = uot_rcl_labels.correct_labels if correct is None else correct
    fixed = correct(
        stats["z_image"],
        stats["z_text"],
        stats["logits_image"],
        stats["logits_text"],
        samples["targets_image"],
        samples["targets_text"],
        class_marginal,
        mass=mass,
        key=key,
        **options,
    )
    samples = dict(
        samples,
        targets_image=fixed.targets_image,
        targets_text=fixed.targets_text,
        labels=fixed.ot.labels,
    )
    return samples, fixed.confident_set, fixed.ot
