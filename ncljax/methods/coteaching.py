"""The co-teaching skeleton of NCR and PC2: co-divide, then co-rectify in turn.

Two networks A and B. After a warm-up (each network in turn over all pairs), every
co-training epoch starts with a *co-divide*: an eval-mode pass gives each pair's loss,
and per network a two-component GMM over the min-max normalised losses gives the clean
probability ``prob`` (posterior of the low-mean component) and the split ``clean``
(``ncljax.labels.loss_division``). Then each network in turn walks its *peer's* clean set
(the main stream) with its peer's noisy set cycled alongside (the auxiliary stream): the
first update of a step trains on the clean batch, the optional second on the noisy batch
(NCR's co-rectified noisy pairs, PC2's pseudo-captions), from the parameters the first
produced.

A co-teaching method's settings extend :class:`Settings` (the warm-up, the hinge margin,
the GMM and its degeneracy checks); its module supplies only what is its own (targets,
losses, extra memory) and builds its plan, streams and co-divide from the functions here:

* :func:`plan`: the epoch plan; the phase alone says which updates a step makes
  (:func:`updates_of`): ``WARMUP`` and ``MAIN`` make one, ``SECOND`` two;
* :func:`streams`: the peer's clean and noisy sets;
* :func:`init_samples`, :func:`co_divide`, :func:`division_diagnostics`: the per-sample
  division memory, the refresh that fits it (with the fallback of a degenerate division)
  and its logged diagnostics;
* :func:`unless_undivided`: the clean update's loss, or the warm-up objective while the
  peer has no division yet.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import labels as labels_lib
from ncljax import losses
from ncljax.labels import gmm as gmm_lib
from ncljax.labels import ncr as ncr_labels
from ncljax.labels import share as share_lib
from ncljax.methods import base, settings

WARMUP, MAIN = base.WARMUP, base.MAIN  # warm-up; co-training with the clean update only
SECOND = base.MAIN + 1  # co-training with the clean and the second (noisy-batch) update


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings every co-teaching method has (its ``Settings`` extend these).

    Attributes:
      margin: ``alpha`` of every hinge loss (0.2).
      warmup_epochs: warm-up epochs before co-training (5; the official scripts: 5 on
        F30K, 10 on COCO and CC152K).
      threshold: clean split of the GMM posterior (0.5).
      gmm_max_iter: EM iterations of the per-epoch GMM (10).
      gmm_tol: EM tolerance (1e-2).
      gmm_reg_covar: GMM variance floor (5e-4).
      loss_reduction: ``'sum'`` over the batch (the official codes; with clipping at 2.0
        this is not the same as a mean) or ``'mean'``.
      division_min_weight: a GMM component lighter than this makes the division
        degenerate (``ncljax.labels.gmm.check_division``; 0.01).
      division_min_separation: component means closer than this many standard
        deviations of the normalised losses make the division degenerate (0.1).
      ranking: the loss every update trains, ``'hinge'`` (the papers: the mean-negative
        hinge in the warm-up and as the co-divide's per-pair loss, the hardest-negative
        hinge with the soft margins ``alpha * f(y)`` of the co-rectified targets ``y``
        after it) or ``'contrastive'`` (a switch for data the hinge does not hold on: the
        symmetric InfoNCE at ``temperature`` in the warm-up and as the co-divide's loss,
        weighted by ``y`` after it, the weight taking the soft margin's place; see
        :func:`rectified_loss`).
      temperature: the InfoNCE temperature of ``ranking='contrastive'`` (0.07, CLIP's).
      noise_share: ``'none'`` (the papers) or ``'partner'`` (ncljax's; the ``:vectors``
        configs): the co-divide's eval pass also gives each pair's in-batch partner
        p-value (``ncljax.labels.srem.partner_p_value``, image to caption), and a
        network whose p-values bound the mismatched share below ``noise_floor``, where the
        validation split's estimate agrees (``ncljax.labels.share.switch_off``), divides
        nothing that epoch: every pair is clean with probability 1. A GMM always finds
        two groups; on a folder with next to no mismatched pair the clean pairs it sets
        aside cost more than it removes.
      noise_floor: that floor (0.05).
    """

    margin: float = 0.2
    warmup_epochs: int = 5
    threshold: float = 0.5
    gmm_max_iter: int = 10
    gmm_tol: float = 1e-2
    gmm_reg_covar: float = 5e-4
    loss_reduction: str = "sum"
    division_min_weight: float = 0.01
    division_min_separation: float = 0.1
    ranking: str = "hinge"
    temperature: float = 0.07
    noise_share: str = "none"
    noise_floor: float = 0.05


RANKINGS = ("hinge", "contrastive")
CHECKS = {
    "margin": settings.NON_NEGATIVE,
    "warmup_epochs": settings.NON_NEGATIVE_INT,
    "threshold": settings.UNIT_INTERVAL,  # a split of GMM posteriors
    "gmm_max_iter": settings.POSITIVE_INT,
    "gmm_tol": settings.NON_NEGATIVE,
    "gmm_reg_covar": settings.NON_NEGATIVE,
    "loss_reduction": settings.LOSS_REDUCTIONS,
    "division_min_weight": settings.DIVISION_MIN_WEIGHT,
    "division_min_separation": settings.NON_NEGATIVE,
    "ranking": settings.one_of(*RANKINGS),
    "temperature": settings.POSITIVE,
    "noise_share": settings.one_of(*share_lib.MODES),
    "noise_floor": settings.UNIT_INTERVAL,
}


def updates_of(phase: int) -> tuple[int, ...]:
    """The streams of a step's sequential updates in ``phase``: the clean batch, then in
    ``SECOND`` the noisy one."""
    return (0, 1) if phase == SECOND else (0,)


def plan(
    s: Settings,
    epoch: int,
    *,
    second: bool,
    reset_at_start: bool = False,
    restart_best: bool = False,
) -> base.EpochPlan:
    """The plan of ``epoch``: warm-up epochs in turn (never selected), then co-training.

    Args:
      s: the method's settings (``warmup_epochs``).
      epoch: the epoch.
      second: whether this co-training epoch makes the second update (phase ``SECOND``).
      reset_at_start: reset the optimisers at the first co-training epoch (PC2).
      restart_best: forget the best validation score before this epoch (PC2's start of
        the pseudo-caption update).

    Co-training epochs refresh the division first, read the learning rate at the epoch
    counted from the end of the warm-up, and end a pass at a batch of one pair.
    """
    if epoch < s.warmup_epochs:
        return base.EpochPlan(phase=WARMUP, in_turn=True, lr_epoch=0, selectable=False, min_batch=2)
    e = epoch - s.warmup_epochs
    phase = SECOND if second else MAIN
    return base.EpochPlan(
        phase=phase,
        refresh=True,
        in_turn=True,
        updates=updates_of(phase),
        reset_optimizer=reset_at_start and e == 0,
        lr_epoch=e,
        restart_best=restart_best,
        min_batch=2,
    )


def streams(memory: base.Memory, plan: base.EpochPlan, network: int) -> base.Streams:
    """Network ``network`` walks its peer's clean set with the peer's noisy set alongside;
    in the warm-up, every pair."""
    if plan.phase == WARMUP:
        return base.Streams()
    split = np.asarray(memory.samples["clean"])
    clean = split[(network + 1) % split.shape[0]] > 0.5
    return base.Streams(main=np.flatnonzero(clean), aux=np.flatnonzero(~clean))


def init_samples(num_samples: int) -> dict[str, jax.Array]:
    """The division memory: ``prob`` (the GMM's clean probability), ``clean`` (its split),
    ``loss`` (the min-max normalised co-divide loss), ``loss_raw`` and ``divided`` (1 once
    the network has a non-degenerate division)."""
    ones = jnp.ones(num_samples, jnp.float32)
    zeros = jnp.zeros(num_samples, jnp.float32)
    return {"prob": ones, "clean": ones, "loss": zeros, "loss_raw": zeros, "divided": zeros}


def divide(s: Settings, values) -> ncr_labels.LossDivision:
    """The GMM division of per-pair ``values`` (``ncljax.labels.loss_division``)."""
    return labels_lib.loss_division(
        values,
        threshold=s.threshold,
        max_iter=s.gmm_max_iter,
        tol=s.gmm_tol,
        reg_covar=s.gmm_reg_covar,
    )


def check(s: Settings, division) -> gmm_lib.DivisionCheck:
    """Whether ``division`` is degenerate (``ncljax.labels.gmm.check_division``)."""
    return gmm_lib.check_division(
        division.normalised,
        division.prob,
        division.gmm,
        threshold=s.threshold,
        min_weight=s.division_min_weight,
        min_separation=s.division_min_separation,
    )


def stats(s: Settings, sim, mask) -> dict:
    """The co-divide's per-pair statistics of an eval-mode batch: the loss
    (:func:`warmup_loss`) and, with ``noise_share='partner'``, the partner p-value."""
    out = {"loss": warmup_loss(s, sim, mask)}
    if s.noise_share == "partner":
        out["partner_p"] = labels_lib.partner_p_value(sim, where=mask)
    return out


def co_divide(s: Settings, name: str, samples: dict, stats: dict, ctx: base.RefreshContext):
    """The co-divide of one network: its per-pair losses (``stats["loss"]``) divided by a
    GMM, or no division where ``stats["partner_p"]`` (``noise_share='partner'``) bounds
    the mismatched share below ``noise_floor``.

    Returns:
      ``(samples, division, check, fallback, extra)``: the updated memory rows (``loss``
      and ``loss_raw`` always; ``prob``, ``clean`` and ``divided`` unless the division is
      degenerate, when the previous division is kept and a warning with "fallback" is
      logged; all 1 where the division is off), the division, its check, whether it fell
      back, and the noise share's diagnostics (empty without ``partner_p``).
    """
    values = stats["loss"]
    division = divide(s, values)
    checked = check(s, division)
    samples = dict(
        samples,
        loss=division.normalised.astype(jnp.float32),
        loss_raw=jnp.asarray(values, jnp.float32),
    )
    off, extra = False, {}
    if s.noise_share == "partner":
        share = labels_lib.noise_share(stats["partner_p"])
        off, held = share_lib.switch_off(
            share, s.noise_floor, ctx.held_out, divide=share_lib.divides(ctx)
        )
        extra = labels_lib.share_diagnostics(share, off, held)
    fallback = bool(checked.degenerate) and not off
    if off:  # next to no mismatched pair: every pair clean
        ones = jnp.ones_like(samples["divided"])
        samples.update(prob=ones, clean=ones, divided=ones)
    elif fallback:
        warn_division_fallback(name, ctx, checked, samples["divided"])
    else:
        samples.update(
            prob=division.prob.astype(jnp.float32),
            clean=division.clean.astype(jnp.float32),
            divided=jnp.ones_like(samples["divided"]),
        )
    return samples, division, checked, fallback, extra


def division_diagnostics(division, checked, fallback: bool, samples: dict) -> dict:
    """The co-divide's refresh diagnostics (the GMM, its check, the fallback, the split)."""
    gmm = division.gmm
    return {
        "gmm_mean_clean": gmm.means[0],
        "gmm_mean_noisy": gmm.means[1],
        "gmm_weight_clean": gmm.weights[0],
        **gmm_lib.fit_diagnostics(gmm, checked, fallback),
        "clean_fraction": samples["clean"].mean(),
        "prob_mean": samples["prob"].mean(),
    }


def unless_undivided(s: Settings, loss, sim, peer_rows, mask):
    """``loss`` of the clean update, or the warm-up objective (the mean-negative hinge)
    for a network whose peer has no non-degenerate division yet."""
    undivided = peer_rows["divided"] < 0.5
    return jnp.where(undivided, warmup_loss(s, sim, mask), loss)


def warmup_loss(s: Settings, sim, mask):
    """The warm-up objective, also the co-divide's per-pair loss: the mean-negative hinge
    ``l_b`` of each pair (margin ``alpha``), or with ``ranking='contrastive'`` its
    symmetric InfoNCE at ``temperature``."""
    if s.ranking == "contrastive":
        return losses.symmetric_info_nce(sim, temperature=s.temperature, where=mask)
    return losses.triplet_mean(sim, s.margin, where=mask)


def rectified_loss(s: Settings, sim, targets, mask, *, kind: str, margin_of: str):
    """The loss of a batch with co-rectified targets ``y`` (``[B]``, or ``[B, B]`` for
    NCR's broadcast labels) and the per-pair weight the logs read (``Aux.applied_weight``).

    ``ranking='hinge'``: the hardest-negative hinge with the soft margins
    ``losses.soft_margin(y, alpha, kind)`` (NCR Eq. 5, PC2 Eq. 8), the margins as weights.
    ``'contrastive'``: ``y_b`` times the pair's symmetric InfoNCE; a ``[B, B]`` target
    reads its diagonal (each pair's own label). A pair the rectifier believes matched
    (``y`` near 1) is pulled to its partner against every in-batch negative, one it
    believes mismatched (``y`` near 0) is left alone: the weight plays the soft margin's
    part, without the hardest negative's dependence on one candidate.

    Returns:
      ``(per_pair [B], weights [B or B x B])``.
    """
    if s.ranking == "contrastive":
        y = jnp.diagonal(targets) if targets.ndim == 2 else targets
        y = jax.lax.stop_gradient(y)
        per_pair = losses.symmetric_info_nce(sim, temperature=s.temperature, where=mask)
        return y * per_pair, y
    margins = losses.soft_margin(targets, s.margin, kind=kind)
    return losses.triplet_hardest(sim, margins, where=mask, margin_of=margin_of), margins


def warn_division_fallback(name: str, ctx, checked, divided) -> None:
    """Logs a degenerate co-divide and the fallback taken, once per refresh.

    Args:
      name: the method's name.
      ctx: the ``RefreshContext``.
      checked: the co-divide's ``ncljax.labels.gmm.DivisionCheck``.
      divided: ``[N]`` the network's ``divided`` memory (any 1: a previous division).
    """
    if bool(checked.inseparable) and float(checked.separation) == 0.0:
        what = "per-pair losses of epoch %d are all equal (no two clusters for the GMM)"
    elif bool(checked.one_set):
        what = "co-divide of epoch %d puts every pair on one side of the threshold"
    else:
        what = (
            "co-divide of epoch %d separates nothing (GMM components "
            f"{float(checked.separation):.3f} standard deviations apart, the lighter one "
            f"of weight {float(checked.lighter_weight):.4f})"
        )
    rule = (
        "keeping its previous division"
        if bool(jnp.any(divided > 0.5))
        else "no previous division, its peer trains with the warm-up objective"
    )
    logging.warning(f"%s: network %d's {what}; fallback: %s.", name, ctx.network, ctx.epoch, rule)


def clean_score(memory: base.Memory) -> jax.Array:
    """The GMM's clean probability ``prob`` of each pair (the division the peer trains on);
    where every pair's is 1 after a division (``noise_share='partner'`` switched it off,
    or the mixture put every pair at 1) the co-divide loss ranks them instead, ``1 -
    loss`` (the min-max normalised loss the mixture was fitted to, measured at every
    co-divide whether or not the division is used): the method's own belief stays
    readable. Before any division every score is 1."""
    s = memory.samples
    prob = s["prob"]
    undivided = jnp.all(prob == prob.max()) & jnp.all(s["divided"] > 0.5)
    return jnp.where(undivided, 1.0 - s["loss"], prob)


def verdict(s: Settings) -> base.Verdict:
    """The audit's reading of a co-divide method's score: the GMM posterior, cut at the
    split the method selects its clean pairs with (``threshold``)."""
    return base.Verdict(
        "the GMM posterior that the pair is clean (co-divide)",
        float(s.threshold),
        "method_kwargs.threshold, the GMM split",
    )
