r"""GSC: geometrical structure consistency learning for noisy correspondence (CVPR 2024).

Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure Consistency
Learning". Every training step runs three similarity computations of one network:
cross-modal ``S`` (image-caption), intra-image ``G_I`` and intra-text ``G_T``, and
minimises, per pair,

    y_b * InfoNCE(S / tau_1)_b + gamma * y_b * StructureAlignment(A C^T / tau_2)_b

with the label-masked structures ``A = G_I diag(y)``, ``C = G_T diag(y)`` (Eqs. 6-9;
``ncljax.losses.gsc_loss``). The same forward pass writes two per-sample buffers: the
cross-modal indicator (Eq. 3) and the intra-modal consistency score (Eq. 8). Before each
epoch ``t >= 1`` the per-epoch estimation (``refresh_fn``) fits a two-component GMM on the
min-max normalised intra-modal scores, ensembles both indicators over epochs (momentum
0.7) and takes their minimum as the next labels (Eqs. 4, 10, 5;
``ncljax.labels.gsc_update_labels``). Epoch 0 trains with all labels 1.

With ``num_networks=2`` (GSC+, the paper's dual-network method) network A trains with network
B's labels and vice versa, both in the loss weights and in the structure masks; each
network fills its own buffers and estimates its own labels; evaluation averages the two
networks' similarities. ``num_networks=1`` is the single-network ``GSC`` variant.

Backbones: the SGR head (``model.head='sgr'``, sigmoid output) gives ``G_I`` and ``G_T``
with the same head (``SGRAFModel.image_similarity``/``text_similarity``), as the paper.
With the cosine head the intra-modal similarities are the cosines of the image (caption)
embeddings: a deviation from the paper and the official code (``forward_topology`` in
``GSC+/model/SGRAF.py``, which applies the SGR head to image-image and text-text pairs), and
the natural port to plain embedding backbones; the similarities then lie in ``[-1, 1]``
rather than ``(0, 1)``.

Sources: the paper (Zhao et al., CVPR 2024, Sec. 3) and the official code
(``MediaBrain-SJTU/GSC``, directories ``GSC+`` and ``GSC``); where the two differ, the
choice is a field of :class:`Settings`. The module is GSC's settings and pure functions
(:func:`plan`, :func:`forward`, :func:`loss`, :func:`refresh`, ...); :func:`bind` makes
the bundle and :func:`gsc` is the registry's factory.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ncljax import labels as labels_lib
from ncljax import losses
from ncljax.labels import gmm as gmm_lib
from ncljax.labels import share as share_lib
from ncljax.methods import base, settings
from ncljax.models import heads

_WARMUP, _MAIN = base.WARMUP, base.MAIN
_BUFFERS = (
    "cross",  # pred_buf: this epoch's cross-modal indicators
    "intra",  # topo_buf: this epoch's intra-modal scores
    *labels_lib.GSCLabels._fields,  # ensembled indicators, labels, last GMM fit
)


class Settings(NamedTuple):
    """GSC's hyperparameters (``config.method_kwargs``): the factory's arguments.

    Attributes:
      cross_temperature: ``tau_1`` of the cross-modal InfoNCE and indicator (0.07).
      intra_temperature: ``tau_2`` of the structure-alignment loss (1.0).
      intra_weight: ``gamma`` (``lambda``) of the intra-modal loss (0.01; the official
        COCO GSC+ script uses 0.05, CC152K GSC+ 0.02).
      cross_momentum: ``beta_1`` of the cross-modal temporal ensembling (0.7).
      intra_momentum: ``beta_2`` of the intra-modal temporal ensembling (0.7; the paper
        describes two momenta, the code shares one ``beta``: same default).
      intra_row_weight: multiply each row of the intra-modal loss by its label ``y_j``
        (the official code, and the paper's words "sample-wise purification"); ``False``
        is Eq. 7 as printed (structure columns masked only).
      warmup_epochs: epochs before the purified training (0 as the official scripts; the
        paper's "w/o temporal ensembling" ablation is 5 with both momenta 1.0).
      warmup_loss: ``'unit_labels'`` (GSC+ code: the full objective with all labels 1,
        no buffer writes) or ``'infonce_i2t'`` (GSC code: plain image-to-text InfoNCE).
      exchange_labels: with two networks, train each with the other's labels (GSC+);
        ``False`` lets each use its own (an ablation of the exchange).
      recompute_global: recompute the self-attention global vectors for the intra-modal
        SGR passes (fresh dropout masks and one more BatchNorm update each, as the
        official code); ``False`` reuses the cross-modal pass's vectors. No effect with
        the cosine head.
      text_structure: the SGRAF intra-text similarity ``h_TT``. ``'attention'`` (the
        default and the ``paper``/``single`` presets): the single-network GSC code's form,
        each word of caption ``i`` attending over caption ``j``'s valid words (SCAN),
        padding masked. ``'aligned'`` (the ``code`` preset of the dual-network configs):
        the GSC+ code's form, word-position-aligned squared differences over the batch's
        padded length, no attention, no padding mask, symmetric; it depends on the
        batch's longest caption (``SimilarityHead.text_text_aligned``). The paper says
        neither. No effect with the cosine head.
      gmm_max_iter: EM iterations of the per-epoch GMM (10).
      gmm_tol: EM tolerance (1e-2).
      gmm_reg_covar: GMM variance floor (5e-4).
      num_networks: 2 (GSC+, the paper's method) or 1 (the single-network GSC).
      division_min_weight: an intra-modal GMM component lighter than this makes the
        epoch's estimate degenerate (``ncljax.labels.gmm.check_division``; 0.01).
      division_min_separation: component means closer than this many standard
        deviations of the normalised scores make it degenerate (0.1).
      noise_share: ``'none'`` (the paper) or ``'partner'`` (ncljax's;
        ``configs/gsc.py:vectors``): every training step writes each pair's in-batch
        partner p-value (``ncljax.labels.srem.partner_p_value``, image to caption), and
        a refresh whose p-values bound the mismatched share below ``noise_floor``, where
        the validation split's estimate agrees (``ncljax.labels.share.switch_off``), sets
        every label to 1 for the next epoch: the
        division is off while the data shows next to no mismatched pair.
      noise_floor: that floor (0.05). Measured on real folders at 0% mismatched (seed
        0, test rSum): every label at 1 for the whole run reaches InfoNCE's level
        (cancer halves 518 against 514, digits 397 against 393), where GSC's labels cost
        20 and 9; the bound is 0.002-0.06 on clean folders from the second epoch, and
        at least 0.11 at 20% mismatched, where memorised mismatched pairs pull it down
        (MNIST halves, 0.10-0.13; ``ncljax.labels.share``).

    Degenerate estimates: when the intra-modal GMM, GSC's one division, puts every pair
    on one side of 0.5 (every pair clean, or none) or separates nothing (fewer than two
    distinct scores, a component lighter than ``division_min_weight``, means closer than
    ``division_min_separation`` standard deviations; ``ncljax.labels.gmm.check_division``),
    the network keeps its previous ensembles and labels (before any estimate: the labels
    1 of the first epoch, i.e. the ``'unit_labels'`` warm-up objective); the refresh logs
    a warning with "fallback" and reports ``division_fallback`` (1). The labels
    themselves are weights, not a selection: their level follows the cross-modal
    indicator (a softmax probability among the batch's captions, small on hard batches),
    and only their relative sizes reach an Adam step, so labels all below 0.5 still
    train.

    GSC applies no threshold to a similarity-derived score as an absolute constant: the
    labels are ``min(Y_CM, Y_IM)`` (a softmax probability and a GMM posterior over
    min-max normalised scores, both in ``[0, 1]``), weights rather than a cut, and the
    temperatures are the losses' hyperparameters; it has no ``calibration`` switch.
    """

    cross_temperature: float = 0.07
    intra_temperature: float = 1.0
    intra_weight: float = 0.01
    cross_momentum: float = 0.7
    intra_momentum: float = 0.7
    intra_row_weight: bool = True
    warmup_epochs: int = 0
    warmup_loss: str = "unit_labels"
    exchange_labels: bool = True
    recompute_global: bool = True
    text_structure: str = "attention"
    gmm_max_iter: int = 10
    gmm_tol: float = 1e-2
    gmm_reg_covar: float = 5e-4
    num_networks: int = 2
    division_min_weight: float = 0.01
    division_min_separation: float = 0.1
    noise_share: str = "none"
    noise_floor: float = 0.05


CHECKS = {
    "cross_temperature": settings.POSITIVE,
    "intra_temperature": settings.POSITIVE,
    "intra_weight": settings.NON_NEGATIVE,
    # The weight of the new estimate: 1 is the "w/o temporal ensembling" ablation.
    "cross_momentum": settings.UNIT_INTERVAL,
    "intra_momentum": settings.UNIT_INTERVAL,
    "intra_row_weight": settings.BOOLEAN,
    "warmup_epochs": settings.NON_NEGATIVE_INT,
    "warmup_loss": settings.one_of("unit_labels", "infonce_i2t"),
    "exchange_labels": settings.BOOLEAN,
    "recompute_global": settings.BOOLEAN,
    "text_structure": settings.one_of("attention", "aligned"),
    "gmm_max_iter": settings.POSITIVE_INT,
    "gmm_tol": settings.NON_NEGATIVE,
    "gmm_reg_covar": settings.NON_NEGATIVE,
    "num_networks": settings.NUM_NETWORKS,
    "division_min_weight": settings.DIVISION_MIN_WEIGHT,
    "division_min_separation": settings.NON_NEGATIVE,
    "noise_share": settings.one_of(*share_lib.MODES),
    "noise_floor": settings.UNIT_INTERVAL,
}


def init_memory(s: Settings, ctx: base.InitContext) -> base.Memory:
    """Every per-sample buffer at 1 (epoch 0 trains with all labels 1); no state."""
    ones = jnp.ones(ctx.num_samples, jnp.float32)
    return base.Memory(samples={name: ones for name in buffers(s)}, state={})


def buffers(s: Settings) -> tuple[str, ...]:
    """The per-sample buffers: GSC's, and ``partner_p`` with ``noise_share='partner'``
    (1 before the first epoch: no share known, the division stays on)."""
    return _BUFFERS + (("partner_p",) if s.noise_share == "partner" else ())


def plan_problems(s: Settings, name: str, epochs: int) -> list[str]:
    """A run must outlast the warm-up (``base.warmup_problems``)."""
    return base.warmup_problems(name, s.warmup_epochs, epochs)


def plan(s: Settings, epoch: int) -> base.EpochPlan:
    """``warmup_epochs`` warm-up epochs, then the purified training; the labels are
    re-estimated before every main epoch but the first (its buffers are still empty)."""
    return base.EpochPlan(
        phase=_WARMUP if epoch < s.warmup_epochs else _MAIN, refresh=epoch > s.warmup_epochs
    )


def needs_intra(s: Settings, phase: int) -> bool:
    """Whether a training step of ``phase`` needs the intra-modal similarities."""
    return phase == _MAIN or s.warmup_loss == "unit_labels"


def forward(s: Settings, model, batch, memory_state, *, train, rngs, phase, ctx=None):
    """The model's outputs, with ``sim_image`` and ``sim_text`` (:func:`intra_similarities`)
    in the training steps that need them."""
    del memory_state, ctx
    outputs = model(batch, train=train, rngs=rngs)
    if train and needs_intra(s, phase):
        outputs["sim_image"], outputs["sim_text"] = intra_similarities(
            model, outputs, rngs=rngs, recompute=s.recompute_global, text_form=s.text_structure
        )
    return outputs


def warmup_loss(s: Settings, outputs, mask: jax.Array) -> jax.Array:
    """The warm-up objective ``[B]``: image-to-text InfoNCE at ``tau_1``
    (``'infonce_i2t'``), or the full objective with every label 1 (``'unit_labels'``)."""
    sim = outputs["sim"]
    if s.warmup_loss == "infonce_i2t":
        return losses.info_nce(sim / s.cross_temperature, where=mask)
    unit = jnp.ones_like(mask, dtype=sim.dtype)
    return losses.gsc_loss(
        sim,
        outputs["sim_image"],
        outputs["sim_text"],
        unit,
        where=mask,
        cross_temperature=s.cross_temperature,
        intra_temperature=s.intra_temperature,
        intra_weight=s.intra_weight,
        row_weight=s.intra_row_weight,
    )


def loss(s: Settings, outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """``L_CM + gamma L_IM`` ``[B]`` with the labels ``y`` of the peer (``exchange_labels``)
    or of this network (Eqs. 6-9); writes this step's cross-modal indicators (Eq. 3) and
    intra-modal scores (Eq. 8) into the buffers ``cross`` and ``intra``, and logs the
    network's own labels as its clean estimate. Warm-up: :func:`warmup_loss`, no writes.
    """
    mask = batch["mask"]
    if ctx.phase == _WARMUP:
        return warmup_loss(s, outputs, mask), base.Aux()
    sim = outputs["sim"]
    y = (peer_rows if s.exchange_labels else rows)["labels"]
    sim_image, sim_text = outputs["sim_image"], outputs["sim_text"]
    cross = losses.gsc_cross_modal_loss(sim, y, temperature=s.cross_temperature, where=mask)
    intra = losses.gsc_intra_modal_loss(
        sim_image,
        sim_text,
        y,
        temperature=s.intra_temperature,
        row_weight=s.intra_row_weight,
        where=mask,
    )
    indicator = labels_lib.gsc_cross_modal_indicator(
        sim, temperature=s.cross_temperature, where=mask
    )
    score = labels_lib.gsc_intra_modal_score(sim_image, sim_text, y, where=mask)
    metrics = {
        "loss_cross": cross,
        "loss_intra": intra,
        "train_label": y,
        "cross_indicator": indicator,
        "intra_score": score,
    }
    memory = {"cross": indicator, "intra": score}
    if s.noise_share == "partner":
        memory["partner_p"] = labels_lib.partner_p_value(sim, where=mask)
    aux = base.Aux(
        metrics=metrics,
        memory=memory,
        clean_estimate=rows["labels"],
    )
    return cross + s.intra_weight * intra, aux


def update_labels(s: Settings, ema_cross, ema_intra, cross, intra, partner_p=None):
    """The per-epoch estimate (Eqs. 4, 10, 5; ``ncljax.labels.gsc_update_labels``) with
    the settings' momenta and GMM options: ``(GSCLabels, GMM fit, share)``.

    ``share`` is the ``NoiseShare`` of ``partner_p`` (``noise_share='partner'``;
    ``ncljax.labels.share.noise_share``), else ``None``.
    """
    new, mixture = labels_lib.gsc_update_labels(
        ema_cross,
        ema_intra,
        cross,
        intra,
        cross_momentum=s.cross_momentum,
        intra_momentum=s.intra_momentum,
        max_iter=s.gmm_max_iter,
        tol=s.gmm_tol,
        reg_covar=s.gmm_reg_covar,
    )
    if partner_p is None:
        return new, mixture, None
    return new, mixture, share_lib.noise_share(partner_p)


def label_updater(s: Settings) -> Callable:
    """:func:`update_labels` with ``s`` bound, jitted (one compiled function per bundle)."""
    return jax.jit(functools.partial(update_labels, s))


def _degeneracy(mixture, check) -> tuple[str, str]:
    """What was degenerate in an epoch's intra-modal estimate, and how, for the warning."""
    if bool(mixture.degenerate):
        return "intra-modal scores", "are all equal (no two clusters for the GMM)"
    if bool(check.one_set):
        return "intra-modal GMM", "puts every pair on one side of 0.5"
    separation, weight = float(check.separation), float(check.lighter_weight)
    return (
        "intra-modal GMM",
        (
            f"separates nothing (components {separation:.3f} standard deviations "
            f"apart, the lighter one of weight {weight:.4f})"
        ),
    )


def _refresh_diagnostics(mixture, check, fallback: bool, labels: jax.Array) -> dict:
    """The refresh's logged values: the GMM fit, the fallback flag and the new labels."""
    return {
        "gmm_weight_low": mixture.weights[0],
        "gmm_weight_high": mixture.weights[1],
        "gmm_mean_low": mixture.means[0],
        "gmm_mean_high": mixture.means[1],
        "gmm_var_low": mixture.variances[0],
        "gmm_var_high": mixture.variances[1],
        **gmm_lib.fit_diagnostics(mixture, check, fallback),
        "label_mean": labels.mean(),
        "label_clean_fraction": (labels > 0.5).mean(),
    }


def refresh(s: Settings, memory, stats, ctx, *, update_fn: Callable | None = None):
    """The labels of the next epoch from this epoch's buffers (Eqs. 4, 10, 5).

    A degenerate intra-modal division (``ncljax.labels.gmm.check_division``) keeps the
    previous ensembles and labels, with a warning naming the network and the epoch. With
    ``noise_share='partner'``, an epoch whose partner p-values bound the mismatched share
    below ``noise_floor`` trains every label at 1 (the ensembles still follow the
    buffers; a degenerate GMM is then no fallback, the division being off).

    Args:
      s: the settings.
      memory: this network's memory (buffers ``cross``, ``intra`` and the ensembles).
      stats: unused (the buffers were written by the training steps).
      ctx: the ``RefreshContext`` (its ``network`` and ``epoch`` name a fallback).
      update_fn: :func:`label_updater`'s result (a bundle compiles it once); ``None``
        builds it.

    Returns:
      ``(memory, diagnostics)``.
    """
    del stats
    update_fn = label_updater(s) if update_fn is None else update_fn
    samples = memory.samples
    partner_p = samples["partner_p"] if s.noise_share == "partner" else None
    new, mixture, share = update_fn(
        samples["ema_cross"], samples["ema_intra"], samples["cross"], samples["intra"], partner_p
    )
    check = gmm_lib.check_division(
        new.intra_normalised,
        new.intra_posterior,
        mixture,
        min_weight=s.division_min_weight,
        min_separation=s.division_min_separation,
    )
    off, held = False, None
    if share is not None:
        held_out = None if ctx is None else ctx.held_out
        off, held = share_lib.switch_off(
            share, s.noise_floor, held_out, divide=share_lib.divides(ctx)
        )
    fallback = bool(check.degenerate) and not off
    if fallback:
        what, how = _degeneracy(mixture, check)
        logging.warning(
            "gsc: network %d's %s of epoch %d %s; fallback: keeping its previous labels.",
            ctx.network,
            what,
            ctx.epoch,
            how,
        )
        keep = ("ema_cross", "ema_intra", "labels")
        new = new._replace(**{name: samples[name] for name in keep})
    if off:  # next to no mismatched pair: the division is off, every label 1
        new = new._replace(labels=jnp.ones_like(new.labels))
    samples = dict(samples, **new._asdict())
    diagnostics = _refresh_diagnostics(mixture, check, fallback, new.labels)
    if share is not None:
        diagnostics.update(share_lib.diagnostics(share, off, held))
    return base.Memory(samples=samples, state=memory.state), diagnostics


def clean_score(memory: base.Memory) -> jax.Array:
    """Each pair's clean score for the noise-detection metrics: its consistency label
    ``min(Y_CM, Y_IM)`` (Eq. 5) as estimated, also in an epoch whose division
    ``noise_share`` switched off (its labels all 1)."""
    s = memory.samples
    return jnp.minimum(s["ema_cross"], s["ema_intra"])


VERDICT = base.Verdict(
    "the consistency label min(cross-modal, intra-modal)",
    None,
    "GSC's labels weight each pair's loss; they select no pair",
)


def bind(s: Settings) -> base.Method:
    """GSC's bundle with the settings ``s`` bound."""
    return base.bind_module(
        sys.modules[__name__],
        s,
        refresh_fn=functools.partial(refresh, s, update_fn=label_updater(s)),
        clean_score_fn=clean_score,
        verdict=VERDICT,
        diagnostic_scores_fn=diagnostic_scores,
        num_networks=s.num_networks,
    )


gsc = settings.factory("gsc", Settings, CHECKS, bind, plan_problems=plan_problems)


def intra_similarities(
    model, outputs: dict, *, rngs=None, recompute: bool = True, text_form: str = "attention"
):
    """GSC's intra-image and intra-text similarities ``[B, B]`` of a training forward pass.

    SGRAF models: the SGR head on image-image and caption-caption pairs (same parameters
    and output map as the cross-modal similarity), with freshly computed self-attention
    global vectors when ``recompute``; ``text_form`` picks the caption-caption form
    (``SGRAFModel.text_similarity``). Cosine models: cosines of the embeddings.
    """
    image, text = outputs["image"], outputs["text"]
    if not hasattr(model, "image_similarity"):
        return (
            heads.cosine_similarity(image["emb"], image["emb"]),
            heads.cosine_similarity(text["emb"], text["emb"]),
        )
    if recompute:
        glob = model.visual_sa(image["regions"], train=True, rngs=rngs, mask=image.get("valid"))
        image = dict(image, glob=glob)
        text = dict(text, glob=model.text_sa(text["words"], text["mask"], train=True, rngs=rngs))
    return (
        model.image_similarity(image, train=True),
        model.text_similarity(text, train=True, form=text_form),
    )


def diagnostic_scores(memory: base.Memory) -> dict[str, jax.Array]:
    """Per-pair scores scored against the true mask and histogrammed for the notebook.

    ``label``, ``cross_label``, ``intra_label``: the final and the two ensembled labels the
    epoch trained with (Eqs. 5, 10); ``cross_indicator``, ``intra_score``: the epoch's raw
    buffers (Eqs. 3, 8); ``intra_fitted``, ``intra_posterior``: the normalised scores the
    last GMM was fitted on and its clean posterior (Eq. 4).
    """
    s = memory.samples
    return {
        "label": s["labels"],
        "cross_label": s["ema_cross"],
        "intra_label": s["ema_intra"],
        "cross_indicator": s["cross"],
        "intra_score": s["intra"],
        "intra_fitted": s["intra_normalised"],
        "intra_posterior": s["intra_posterior"],
    }
