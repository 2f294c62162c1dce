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

import functools
import logging

import jax.numpy as jnp
import numpy as np

from ncljax import labels as labels_lib
from ncljax import losses
from ncljax.labels import gmm as gmm_lib
from ncljax.labels import ncr as ncr_labels
from ncljax.methods import base, settings

WARMUP, CLEAN = base.WARMUP, base.MAIN  # warm-up; co-training with the clean update only
CLEAN_NOISY = base.MAIN + 1  # co-training with both updates
_MARGINS = ("exponential", "linear", "sin")
TARGET_PREDICTIONS = ("pair", "broadcast")  # the clean targets: Eq. 6, the code's B x B


def ncr(
    *,
    margin: float = 0.2,
    soft_margin: str = "exponential",
    warmup_epochs: int = 5,
    noisy_start_epoch: int = 20,
    threshold: float = 0.5,
    gmm_max_iter: int = 10,
    gmm_tol: float = 1e-2,
    gmm_reg_covar: float = 5e-4,
    margin_of: str = "positive",
    target_prediction: str = "pair",
    loss_reduction: str = "sum",
    num_networks: int = 2,
    division_min_weight: float = 0.01,
    division_min_separation: float = 0.1,
) -> base.Method:
    """NCR as a method bundle.

    Args:
      margin: ``alpha`` of every hinge loss (0.2).
      soft_margin: ``'exponential'`` (``alpha (10^y - 1) / 9``, the official default),
        ``'linear'`` (``alpha y``) or ``'sin'`` (in the official code, not in the paper).
      warmup_epochs: warm-up epochs before co-training (official scripts: 5 on F30K, 10 on
        COCO and CC152K).
      noisy_start_epoch: first co-training epoch (counted from the end of the warm-up)
        with the second update on the noisy batch; the official ``num_epochs // 2``.
      threshold: clean split of the GMM posterior (0.5).
      gmm_max_iter: EM iterations of the per-epoch GMM (10).
      gmm_tol: EM tolerance (1e-2).
      gmm_reg_covar: GMM variance floor (5e-4).
      margin_of: whose soft margin a hinge term uses: ``'positive'`` (its own pair's, the
        paper's Eq. 5) or ``'image'`` (the official code: the t2i term of caption ``b``
        against image ``i`` uses image ``i``'s margin).
      target_prediction: ``'pair'`` (each clean pair's own prediction ``P_b``, Eq. 6) or
        ``'broadcast'`` (the official code: the ``[B, B]`` labels ``w_i + (1 - w_i) P_j``,
        image ``i``'s probability with caption ``j``'s prediction, one soft margin per
        image-caption pairing in both directions; ``margin_of`` then applies to the noisy
        batch only).
      loss_reduction: ``'sum'`` over the batch (the official code; with clipping at 2.0
        this is not the same as a mean) or ``'mean'``.
      num_networks: 2 (NCR), or 1: a single network trained on its own division.
      division_min_weight: a GMM component lighter than this makes the division
        degenerate (``ncljax.labels.gmm.check_division``; 0.01).
      division_min_separation: component means closer than this many standard
        deviations of the normalised losses make the division degenerate (0.1).

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
    settings.check(
        "ncr",
        locals(),
        {
            "margin": settings.NON_NEGATIVE,
            "soft_margin": settings.one_of(*_MARGINS),
            "warmup_epochs": settings.NON_NEGATIVE_INT,
            "noisy_start_epoch": settings.NON_NEGATIVE_INT,
            "threshold": settings.UNIT_INTERVAL,  # a split of GMM posteriors
            "gmm_max_iter": settings.POSITIVE_INT,
            "gmm_tol": settings.NON_NEGATIVE,
            "gmm_reg_covar": settings.NON_NEGATIVE,
            "margin_of": settings.one_of("positive", "image"),
            "target_prediction": settings.noted(
                settings.one_of(*TARGET_PREDICTIONS),
                "'broadcast' is the official code's B x B labels and replaces 'first'",
            ),
            "loss_reduction": settings.LOSS_REDUCTIONS,
            "num_networks": settings.NUM_NETWORKS,
            "division_min_weight": settings.DIVISION_MIN_WEIGHT,
            "division_min_separation": settings.NON_NEGATIVE,
        },
    )
    predict = functools.partial(labels_lib.correspondence_prediction, margin=margin)
    divide = functools.partial(
        labels_lib.loss_division,
        threshold=threshold,
        max_iter=gmm_max_iter,
        tol=gmm_tol,
        reg_covar=gmm_reg_covar,
    )

    def init_memory(ctx: base.InitContext) -> base.Memory:
        ones = jnp.ones(ctx.num_samples, jnp.float32)
        zeros = jnp.zeros(ctx.num_samples, jnp.float32)
        samples = {"prob": ones, "clean": ones, "loss": zeros, "loss_raw": zeros}
        samples["divided"] = zeros  # 1 once the network has a non-degenerate division
        return base.Memory(samples=samples, state={})

    def plan_fn(epoch: int) -> base.EpochPlan:
        if epoch < warmup_epochs:
            return base.EpochPlan(
                phase=WARMUP, in_turn=True, lr_epoch=0, selectable=False, min_batch=2
            )
        e = epoch - warmup_epochs
        noisy = e >= noisy_start_epoch
        return base.EpochPlan(
            phase=CLEAN_NOISY if noisy else CLEAN,
            refresh=True,
            in_turn=True,
            updates=(0, 1) if noisy else (0,),
            lr_epoch=e,
            min_batch=2,
        )

    def streams_fn(memory, epoch, network):
        if epoch < warmup_epochs:
            return base.Streams()
        peer = (network + 1) % num_networks
        clean = np.asarray(memory.samples["clean"][peer]) > 0.5
        return base.Streams(main=np.flatnonzero(clean), aux=np.flatnonzero(~clean))

    def prepare_fn(model, peer, batches, ctx):
        if ctx.phase == WARMUP:
            return {}

        def prediction(net, batch):
            sim = net(batch, train=False)["sim"]
            return predict(sim, where=batch["mask"])

        out = {"clean": prediction(model, batches[0])}
        if ctx.phase == CLEAN_NOISY:
            noisy = batches[1]
            out["noisy"] = (prediction(model, noisy) + prediction(peer, noisy)) / 2
        return out

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        sim, mask = outputs["sim"], batch["mask"]
        if ctx.phase == WARMUP:
            return losses.triplet_mean(sim, margin, where=mask), {}
        if ctx.update == 0:  # the peer's clean set, co-rectified
            undivided = peer_rows["divided"] < 0.5  # the peer has no division yet: fallback
            own, prob = ctx.prepared["clean"], peer_rows["prob"]
            if target_prediction == "broadcast":
                targets = ncr_labels.rectified_label_matrix(prob, own)  # [B, B]
            else:
                targets = labels_lib.rectified_labels(prob, own)
            name = "clean"
        else:  # the peer's noisy set, co-rectified by both networks
            targets = ctx.prepared["noisy"]
            name = "noisy"
        margins = losses.soft_margin(targets, margin, kind=soft_margin)
        matrix = margins.ndim == 2  # a margin per pairing: margin_of does not apply
        loss = losses.triplet_hardest(
            sim, margins, where=mask, margin_of="positive" if matrix else margin_of
        )
        if ctx.update == 0:
            loss = jnp.where(undivided, losses.triplet_mean(sim, margin, where=mask), loss)
        if matrix:  # the logs score each pair's own entry (Eq. 6's target and margin)
            targets, margins = jnp.diagonal(targets), jnp.diagonal(margins)
        aux = {
            "metrics": {f"target_{name}": targets, f"loss_{name}": loss},
            "clean_estimates": {name: targets},
            "loss_weight": margins,
        }
        return loss, aux

    def stats_fn(outputs, batch):
        return {"loss": losses.triplet_mean(outputs["sim"], margin, where=batch["mask"])}

    def refresh_fn(memory, stats, ctx):
        division = divide(stats["loss"])
        gmm = division.gmm
        check = gmm_lib.check_division(
            division.normalised,
            division.prob,
            gmm,
            threshold=threshold,
            min_weight=division_min_weight,
            min_separation=division_min_separation,
        )
        samples = dict(
            memory.samples,
            loss=division.normalised.astype(jnp.float32),
            loss_raw=jnp.asarray(stats["loss"], jnp.float32),
        )
        fallback = bool(check.degenerate)
        if fallback:
            warn_division_fallback("ncr", ctx, check, samples["divided"])
        else:
            samples.update(
                prob=division.prob.astype(jnp.float32),
                clean=division.clean.astype(jnp.float32),
                divided=jnp.ones_like(samples["divided"]),
            )
        diagnostics = {
            "gmm_mean_clean": gmm.means[0],
            "gmm_mean_noisy": gmm.means[1],
            "gmm_weight_clean": gmm.weights[0],
            "gmm_iterations": gmm.n_iter,
            "gmm_converged": gmm.converged,
            "gmm_degenerate": gmm.degenerate,
            "gmm_separation": check.separation,
            "division_fallback": jnp.float32(fallback),
            "clean_fraction": samples["clean"].mean(),
            "prob_mean": samples["prob"].mean(),
        }
        return base.Memory(samples=samples, state=memory.state), diagnostics

    return base.Method(
        name="ncr",
        init_memory=init_memory,
        loss_fn=loss_fn,
        refresh_fn=refresh_fn,
        stats_fn=stats_fn,
        plan_fn=plan_fn,
        clean_score_fn=lambda memory: memory.samples["prob"],
        diagnostic_scores_fn=diagnostic_scores,
        num_networks=num_networks,
        streams_fn=streams_fn,
        prepare_fn=prepare_fn,
        loss_reduction=loss_reduction,
    )


def warn_division_fallback(name: str, ctx, check, divided) -> None:
    """Logs a degenerate co-divide and the fallback taken (NCR and PC2), once per refresh.

    Args:
      name: the method's name.
      ctx: the ``RefreshContext``.
      check: the co-divide's ``ncljax.labels.gmm.DivisionCheck``.
      divided: ``[N]`` the network's ``divided`` memory (any 1: a previous division).
    """
    if bool(check.inseparable) and float(check.separation) == 0.0:
        what = "per-pair losses of epoch %d are all equal (no two clusters for the GMM)"
    elif bool(check.one_set):
        what = "co-divide of epoch %d puts every pair on one side of the threshold"
    else:
        what = (
            "co-divide of epoch %d separates nothing (GMM components "
            f"{float(check.separation):.3f} standard deviations apart, the lighter one "
            f"of weight {float(check.lighter_weight):.4f})"
        )
    rule = (
        "keeping its previous division"
        if bool(jnp.any(divided > 0.5))
        else "no previous division, its peer trains with the warm-up objective"
    )
    logging.warning(f"%s: network %d's {what}; fallback: %s.", name, ctx.network, ctx.epoch, rule)


def diagnostic_scores(memory: base.Memory) -> dict:
    """Per-pair scores for the logs: the GMM's clean probability ``prob`` (the division
    the peer trains on), ``1 - loss``, the min-max normalised co-divide loss, and
    ``neg_loss``, the raw co-divide loss negated (its per-epoch means over clean and noisy
    pairs are PC2's Fig. 2)."""
    s = memory.samples
    neg_loss = -s["loss_raw"] if "loss_raw" in s else -s["loss"]  # runs before loss_raw
    return {"prob": s["prob"], "low_loss": 1.0 - s["loss"], "neg_loss": neg_loss}
