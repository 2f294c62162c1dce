r"""NCR: noisy correspondence rectifier, the co-teaching baseline (NeurIPS 2021).

Huang et al., "Learning with Noisy Correspondence for Cross-modal Matching". Two networks
A and B, each trained with the other's division of the data (co-teaching):

* **Warm-up** (``warmup_epochs``): each network in turn makes one pass over all pairs,
  minimising the mean-negative hinge loss ``l_b`` (``ncljax.losses.triplet_mean``, margin
  ``alpha``) summed over the batch.
* **Co-divide** (every co-training epoch, before any update): an eval-mode pass of both
  networks over the training set gives each pair's ``l_b``; per network, min-max
  normalisation and a two-component GMM give the clean probability ``w`` (posterior of
  the low-mean component) and the split ``w > 0.5`` with the "keep 1% noisy" rule
  (``ncljax.labels.loss_division``).
* **Co-rectify** (one pass per network, in turn): network A walks B's clean set; each
  clean batch is paired with the next batch of B's noisy set (cycled, reshuffled when
  exhausted), so A's epoch is ``ceil(|clean_B| / batch)`` steps. Before the step's
  updates, a no-grad eval-mode pass gives A's correspondence prediction ``P`` on both
  batches and the frozen B's on the noisy one (``ncljax.labels.correspondence_prediction``).
  Targets: ``y_hat = w_B + (1 - w_B) P_A`` on the clean batch (Eq. 6), ``(P_A + P_B) / 2``
  on the noisy batch (Eq. 7). Update 1: the hardest-negative hinge loss with the soft
  margins ``alpha (10^y_hat - 1) / 9`` (exponential) or ``alpha y_hat`` (linear) on the
  clean batch; update 2 (from co-training epoch ``noisy_start_epoch``, the official
  ``num_epochs // 2``): the same on the noisy batch, from the parameters update 1 made. A
  batch of one pair (clean or noisy) ends the pass. Then B does the same against A's
  end-of-pass state.
* Evaluation averages the two networks' similarities. Warm-up epochs are never selected
  as best; the learning rate is ``lr * 0.1^floor(e / 30)`` in co-training epochs ``e``.

Backbones: the SGR head (the paper), and the cosine head over region/token inputs or
over global feature vectors: NCR reads only the ``[B, B]`` similarity of a batch.

Where the official code (``XLearning-SCU/2021-NeurIPS-NCR``) differs from the paper, the
paper is the default and the code a switch: ``margin_of='image'`` (the code's ``[B, 1]``
noisy-batch margins index the t2i term by the negative image) and
``target_prediction='broadcast'`` (the code's clean targets broadcast ``[B, 1]``
probabilities against the ``[B]`` predictions into a ``[B, B]`` matrix, ``w_i + (1 - w_i)
P_j``, whose entry ``(i, j)`` sets the margin of both hinge terms pairing image ``i`` with
caption ``j``; ``ncljax.labels.ncr.rectified_label_matrix``).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from ncljax import labels as labels_lib
from ncljax.labels import ncr as ncr_labels
from ncljax.methods import base, coteaching, settings

WARMUP, CLEAN = coteaching.WARMUP, coteaching.MAIN  # warm-up; co-training, clean update only
CLEAN_NOISY = coteaching.SECOND  # co-training with both updates
_MARGINS = ("exponential", "linear", "sin")
TARGET_PREDICTIONS = ("pair", "broadcast")  # the clean targets: Eq. 6, the code's B x B


@dataclasses.dataclass(frozen=True)
class Settings(coteaching.Settings):
    """NCR's hyperparameters (``config.method_kwargs``): the co-teaching settings
    (``ncljax.methods.coteaching.Settings``: ``margin``, ``warmup_epochs``, ``threshold``,
    the GMM's and its degeneracy checks', ``loss_reduction``) and:

    Attributes:
      soft_margin: ``'exponential'`` (``alpha (10^y - 1) / 9``, the official default),
        ``'linear'`` (``alpha y``) or ``'sin'`` (in the official code, not in the paper).
      noisy_start_epoch: first co-training epoch (counted from the end of the warm-up)
        with the second update on the noisy batch; the official ``num_epochs // 2``.
        ``None``: no noisy update at all, the network trains on its peer's clean set
        only (``configs/ncr.py:vectors``: on real folders the noisy batch's
        co-rectified targets follow the network's own predictions, which learn the
        mismatched pairs; see that file for the measurements).
      margin_of: whose soft margin a hinge term uses: ``'positive'`` (its own pair's, the
        paper's Eq. 5) or ``'image'`` (the official code: the t2i term of caption ``b``
        against image ``i`` uses image ``i``'s margin).
      target_prediction: ``'pair'`` (each clean pair's own prediction ``P_b``, Eq. 6) or
        ``'broadcast'`` (the official code: the ``[B, B]`` labels ``w_i + (1 - w_i) P_j``,
        image ``i``'s probability with caption ``j``'s prediction, one soft margin per
        image-caption pairing in both directions; ``margin_of`` then applies to the noisy
        batch only).
      num_networks: 2 (NCR), or 1: a single network trained on its own division.

    Degenerate divisions: a co-divide that puts every pair on one side of ``threshold``
    (every posterior above it, or none), or whose mixture separates nothing (fewer than
    two distinct losses, a component of weight below ``division_min_weight``, means
    closer than ``division_min_separation`` standard deviations;
    ``ncljax.labels.gmm.check_division``), is not used. The network keeps its previous
    non-degenerate division; before any, its peer trains with the warm-up objective
    (the mean-negative hinge on all pairs). The refresh logs a warning with "fallback"
    and reports ``division_fallback`` (1) in its diagnostics.

    NCR applies no threshold to a similarity-derived score as an absolute constant: the
    GMM split ``threshold`` is a posterior (calibrated by the mixture fitted on the
    epoch's min-max normalised losses), the predictions ``P`` are scaled by a batch's top
    tenth, and ``margin`` is the hinge loss's hyperparameter; it has no ``calibration``
    switch.
    """

    soft_margin: str = "exponential"
    noisy_start_epoch: int | None = 20
    margin_of: str = "positive"
    target_prediction: str = "pair"
    num_networks: int = 2


CHECKS = {
    **coteaching.CHECKS,
    "soft_margin": settings.one_of(*_MARGINS),
    "noisy_start_epoch": settings.optional(settings.NON_NEGATIVE_INT, "no noisy update"),
    "margin_of": settings.one_of("positive", "image"),
    "target_prediction": settings.noted(
        settings.one_of(*TARGET_PREDICTIONS),
        "'broadcast' is the official code's B x B labels and replaces 'first'",
    ),
    "num_networks": settings.NUM_NETWORKS,
}


def init_memory(s: Settings, ctx: base.InitContext) -> base.Memory:
    """The co-teaching division memory (``coteaching.init_samples``)."""
    del s
    return base.Memory(samples=coteaching.init_samples(ctx.num_samples), state={})


def plan_problems(s: Settings, name: str, epochs: int) -> list[str]:
    """A run must outlast the warm-up (``base.warmup_problems``)."""
    return base.warmup_problems(name, s.warmup_epochs, epochs)


def plan(s: Settings, epoch: int) -> base.EpochPlan:
    """Warm-up epochs, then co-training; the noisy update from co-training epoch
    ``noisy_start_epoch`` on (phase ``CLEAN_NOISY``; never where it is ``None``)."""
    start = s.noisy_start_epoch
    return coteaching.plan(s, epoch, second=start is not None and epoch - s.warmup_epochs >= start)


def streams(s: Settings, memory, plan: base.EpochPlan, network: int) -> base.Streams:
    """The peer's clean set, with its noisy set alongside (``coteaching.streams``)."""
    del s
    return coteaching.streams(memory, plan, network)


def predict(s: Settings, net, batch) -> jax.Array:
    """A network's correspondence prediction ``P`` of each pair of ``batch`` (eval mode)."""
    sim = net(batch, train=False)["sim"]
    return labels_lib.correspondence_prediction(sim, where=batch["mask"], margin=s.margin)


def prepare(s: Settings, model, peer, batches, ctx) -> dict:
    """The no-grad predictions shared by a step's updates: the training network's on the
    clean batch and, with the noisy update, both networks' mean on the noisy batch."""
    if ctx.phase == WARMUP:
        return {}
    out = {"clean": predict(s, model, batches[0])}
    if ctx.phase == CLEAN_NOISY:
        noisy = batches[1]
        out["noisy"] = (predict(s, model, noisy) + predict(s, peer, noisy)) / 2
    return out


def clean_targets(s: Settings, prob, prediction) -> jax.Array:
    """The co-rectified clean targets: Eq. 6 per pair, or the code's ``[B, B]`` matrix."""
    if s.target_prediction == "broadcast":
        return ncr_labels.rectified_label_matrix(prob, prediction)
    return labels_lib.rectified_labels(prob, prediction)


def loss(s: Settings, outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """Warm-up: the mean-negative hinge. Update 0: the hardest-negative hinge with the soft
    margins of the peer's clean set's co-rectified targets (the warm-up objective while
    the peer has no division). Update 1: the same on the noisy batch's targets."""
    del rows
    sim, mask = outputs["sim"], batch["mask"]
    if ctx.phase == WARMUP:
        return coteaching.warmup_loss(s, sim, mask), base.Aux()
    if ctx.update == 0:  # the peer's clean set, co-rectified
        targets = clean_targets(s, peer_rows["prob"], ctx.prepared["clean"])
        name = "clean"
    else:  # the peer's noisy set, co-rectified by both networks
        targets = ctx.prepared["noisy"]
        name = "noisy"
    matrix = targets.ndim == 2  # a margin per pairing: margin_of does not apply
    per_pair, margins = coteaching.rectified_loss(
        s, sim, targets, mask, kind=s.soft_margin, margin_of="positive" if matrix else s.margin_of
    )
    if ctx.update == 0:
        per_pair = coteaching.unless_undivided(s, per_pair, sim, peer_rows, mask)
    if matrix:  # the logs score each pair's own entry (Eq. 6's target and margin)
        targets = jnp.diagonal(targets)
        margins = jnp.diagonal(margins) if margins.ndim == 2 else margins
    aux = base.Aux(
        metrics={f"target_{name}": targets, f"loss_{name}": per_pair},
        clean_estimates={name: targets},
        applied_weight=margins,
    )
    return per_pair, aux


def stats(s: Settings, outputs, batch) -> dict:
    """The co-divide's per-pair statistics in eval mode (``coteaching.stats``): the
    warm-up objective's loss, and the partner p-value with ``noise_share='partner'``."""
    return coteaching.stats(s, outputs["sim"], batch["mask"])


def refresh(s: Settings, memory, stats, ctx):
    """The co-divide (``coteaching.co_divide``) and its diagnostics."""
    samples, division, checked, fallback, extra = coteaching.co_divide(
        s, "ncr", memory.samples, stats, ctx
    )
    diagnostics = coteaching.division_diagnostics(division, checked, fallback, samples)
    diagnostics.update(extra)
    return base.Memory(samples=samples, state=memory.state), diagnostics


def diagnostic_scores(memory: base.Memory) -> dict:
    """Per-pair scores for the logs: the GMM's clean probability ``prob`` (the division
    the peer trains on), ``1 - loss``, the min-max normalised co-divide loss, and
    ``neg_loss``, the raw co-divide loss negated (its per-epoch means over clean and noisy
    pairs are PC2's Fig. 2)."""
    s = memory.samples
    neg_loss = -s["loss_raw"] if "loss_raw" in s else -s["loss"]  # runs before loss_raw
    return {"prob": s["prob"], "low_loss": 1.0 - s["loss"], "neg_loss": neg_loss}


def bind(s: Settings) -> base.Method:
    """NCR's bundle with the settings ``s`` bound."""
    return base.bind_module(
        sys.modules[__name__],
        s,
        clean_score_fn=coteaching.clean_score,
        verdict=coteaching.verdict(s),
        diagnostic_scores_fn=diagnostic_scores,
        num_networks=s.num_networks,
        loss_reduction=s.loss_reduction,
    )


ncr = settings.factory("ncr", Settings, CHECKS, bind, plan_problems=plan_problems)
