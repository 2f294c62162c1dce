r"""PC2: pseudo-classification based pseudo-captioning (ACM MM 2024), on NCR's co-training.

Duan et al., "PC2: Pseudo-Classification Based Pseudo-Captioning for Noisy Correspondence
Learning in Cross-Modal Retrieval". Two networks A and B, each with its own
pseudo-classifier head ``C`` (``ncljax.models.PseudoClassifier``, a method head: trained,
vmapped and checkpointed with its network), trained as NCR's co-teaching pair:

* **Warm-up** (``warmup_epochs``): each network in turn walks all pairs, minimising the
  mean-negative hinge loss ``l_b`` (summed over the batch) plus the pseudo-classification
  objective ``L_pse + lambda_ent L_ent`` (``ncljax.losses.pseudo_classification_loss``: the
  image prediction against the caption's argmax, and an entropy term in ``entropy_mode``).
  Each step writes its train-mode image predictions into the network's prediction bank at
  the pairs' global ids.
* **Co-divide** (every co-training epoch, before any update): an eval-mode pass of both
  networks over the training set gives each pair's ``l_b`` and image prediction ``p``. Per
  network: the loss GMM (``w``, the split with NCR's 1% rule), the prediction
  oscillation ``o = KL(bank || p)`` (Eq. 7) and its own GMM (``w_o`` and its split); in
  ``bank_mode='paper'`` the bank then becomes this pass's predictions. An oscillation
  without spread (all equal) turns the rectification off for the epoch (``w_o = 0``).
* **Co-train** (one pass per network, in turn, each on its peer's division): each step
  takes a batch of the peer's clean set and the next batch of its noisy set (cycled).
  Update 1, the clean batch: the hardest-negative hinge with Eq. 8's margins
  ``alpha (10^y - 1)/9``, ``y = w + (1 - w) 1[w_o >= tau] w_o`` (the peer's estimates), plus
  the pseudo-classification objective. Update 2 (from co-training epoch
  ``pseudo_start_epoch``, the code's ``E_2 = 25``), from the parameters update 1 made: both
  batches are forwarded again in train mode; each noisy image borrows the caption of the
  clean pair whose image prediction is most cosine-similar to its own (Eq. 4), with that
  caption's own word features and length; the hardest-negative hinge on these pseudo
  pairs with the margin of Eq. 5 (0 below the code's cutoff 0.5).
* Evaluation averages the two networks' similarities. Warm-up epochs are never selected;
  the best validation score is forgotten at ``E_2`` (only later epochs can win); a fresh
  Adam starts the co-training; the learning rate is ``lr * 0.1^floor(e / 30)`` in
  co-training epochs ``e``.

Backbones: the SGR (and SAF) head, where ``C`` reads the region embeddings flattened
(``R * D`` inputs) and each caption's word embeddings resampled to ``R`` positions relative
to its batch's longest caption (the code's ``Phi_36``); and the cosine head over
region/token inputs or over global feature vectors, where ``C`` reads the image and caption
embeddings (``D`` inputs). The pseudo-caption similarity is the backbone's own head on
(noisy image, borrowed caption).

Where the official code (``alipay/PC2-NoiseofWeb``) differs from the paper, the paper is
the default and the code a switch: ``bank_mode='code'`` (the reversed KL
``KL(p || bank)``; the bank written only in warm-up and in update 2, at the pairs'
positions inside the clean or noisy subset rather than their ids), ``entropy_mode``
(``'code_sample'``, the default that produced the reported numbers, ``'marginal'``,
``'printed'``), ``margin_indexing='code'`` (the clean update indexes margins by image, the
pseudo-caption update by caption), ``noisy_margin_cutoff`` (0.5; ``None``: the paper),
``detach_noisy_margin=False`` (the code lets the margin's gradient reach ``C``) and
``rectify_indicator='code'`` (the oscillation split with its 1% rule instead of
``w_o >= tau``). The code's pseudo-captions resampled to the noisy batch's length (spec
section 8 item 8) are a bug that is not reproduced.

In neither source: ``classification_start_epoch`` and ``center_targets``. On a cosine head
the paper's objective collapses the classifier to one class (a caption's embedding is
aligned with its image's, so the caption's label is the image's own argmax, and at
initialisation every caption gets the same one); starting the classification after the
warm-up, with batch-centred caption labels and the marginal entropy, keeps the classes
apart (``configs/pc2.py:synthetic``; measurements in ``benchmarks/RESULTS.md``). A refresh
that finds one class for every pair logs a warning.

Spec: ``pc2.md`` of the ncljax specs (sections 3 and 4).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import labels as labels_lib
from ncljax import losses
from ncljax.labels import gmm as gmm_lib
from ncljax.labels import pc2 as pc2_labels
from ncljax.losses.pseudo import ENTROPY_MODES
from ncljax.methods import base, ncr, settings

WARMUP, CLEAN = base.WARMUP, base.MAIN  # warm-up; co-training with the clean update only
CLEAN_PSEUDO = base.MAIN + 1  # co-training with the clean and the pseudo-caption updates
HEAD = "pseudo_classifier"
BANK_MODES = ("paper", "code")
PSEUDO_ASSIGNMENTS = ("predictions", "true_classes")
_SGRAF = ("sgr", "saf")


def pc2(
    *,
    margin: float = 0.2,
    warmup_epochs: int = 5,
    pseudo_start_epoch: int = 25,
    threshold: float = 0.5,
    num_classes: int = 128,
    classifier_hidden: int = 256,
    classification_weight: float = 1.0,
    classification_start_epoch: int = 0,
    entropy_weight: float = 10.0,
    entropy_mode: str = "code_sample",
    noisy_weight: float = 1.0,
    bank_mode: str = "paper",
    margin_indexing: str = "paper",
    noisy_margin_cutoff: float | None = 0.5,
    detach_noisy_margin: bool = True,
    rectify_indicator: str = "paper",
    warmup_selection: bool = False,
    classifier_input: str = "auto",
    center_targets: bool = False,
    pseudo_caption_assignment: str = "predictions",
    gmm_max_iter: int = 10,
    gmm_tol: float = 1e-2,
    gmm_reg_covar: float = 5e-4,
    loss_reduction: str = "sum",
    calibration: str = "data",
    division_min_weight: float = 0.01,
    division_min_separation: float = 0.1,
    model_config=None,
) -> base.Method:
    """PC2 as a method bundle.

    Args:
      margin: ``alpha`` of every hinge loss (0.2); the soft margins are
        ``alpha (10^y - 1) / 9`` (``m = 10``).
      warmup_epochs: warm-up epochs (paper: 5 on F30K, 10 on COCO and NoW; README: 5 on COCO).
      pseudo_start_epoch: first co-training epoch (counted from the end of the warm-up)
        with the pseudo-caption update, the code's ``warmup_epoch_2`` (25); the best
        validation score is forgotten at this epoch.
      threshold: ``tau`` of both GMM splits and of Eq. 8's indicator (0.5).
      num_classes: ``K`` pseudo-classes (128).
      classifier_hidden: hidden width of ``C`` (256).
      classification_weight: ``lambda_pse`` of the pseudo-classification objective (1).
      classification_start_epoch: the first epoch (counted from the start, warm-up
        included) with the pseudo-classification objective; before it the classifier does
        not train (0: from the first warm-up step, as the code).
      entropy_weight: ``lambda_ent`` (10, the run commands).
      entropy_mode: ``'code_sample'`` (default: the code's mean per-sample entropy),
        ``'marginal'`` (the entropy of the batch-mean prediction, maximised) or
        ``'printed'`` (Eq. 3 as printed).
      noisy_weight: ``lambda_n`` of the pseudo-caption update (1); 0 drops that update (the
        paper's Table 7 variant).
      bank_mode: ``'paper'`` (Eq. 7 over successive co-divide passes, the bank at global
        ids) or ``'code'`` (see the module docstring).
      margin_indexing: ``'paper'`` (each hinge term uses its positive pair's margin) or
        ``'code'`` (the clean update by image, the pseudo-caption update by caption).
      noisy_margin_cutoff: Eq. 5's margin is 0 below this cosine (the code's 0.5), or
        ``None`` (the paper: no cutoff).
      detach_noisy_margin: no gradient through Eq. 5's margin (default) or, ``False``, the
        code's gradient into ``C`` through the cosine.
      rectify_indicator: Eq. 8's ``1[w_o >= tau]`` (``'paper'``) or the code's oscillation
        split (``w_o > tau`` with the 1% rule, ``'code'``).
      warmup_selection: the code's ``warmup_sele``: the warm-up ranking sum keeps only the
        ``floor(B / 2)`` pairs of smallest ``l_b`` (off by default, as the code).
      classifier_input: what ``C`` reads: ``'sequences'`` (the ``R`` region embeddings
        flattened, and the word embeddings resampled to ``R`` positions: the paper's, with
        the SGR/SAF heads and available with the cosine head over regions and tokens),
        ``'embeddings'`` (the pooled image and caption embeddings: the cosine head) or
        ``'auto'`` (sequences with SGR/SAF, embeddings with the cosine head).
      center_targets: the captions' hard pseudo-labels from their logits centred on the
        batch (``ncljax.losses.pseudo_label_cross_entropy``; not in the paper or the code).
      pseudo_caption_assignment: ``'predictions'`` (Eq. 4, the default) or
        ``'true_classes'``, a diagnostic in neither source: each noisy image borrows, among
        the clean pairs of its true class, the one of most similar prediction (Eq. 4 among
        those; all clean pairs where the batch has none of its class or the dataset has no
        classes). It separates the classifier's errors from the pseudo-caption update's
        own effect (benchmarks/RESULTS.md).
      gmm_max_iter: EM iterations of both GMMs (10).
      gmm_tol: EM tolerance (1e-2).
      gmm_reg_covar: GMM variance floor (5e-4).
      loss_reduction: ``'sum'`` over the batch (the code; the pseudo-classification terms
        are batch means inside it) or ``'mean'``.
      calibration: ``'data'`` (default) or ``'paper'``. The one absolute constant PC2
        applies to a similarity-derived score is Eq. 5's cutoff on the prediction cosine
        ``s`` (``noisy_margin_cutoff``, the code's 0.5). ``'data'`` replaces
        ``alpha^n = 0 if s < c`` by ``alpha^n = 0 if s < s_bar + c (1 - s_bar)``, with
        ``s_bar`` the mean cosine between the batch's noisy and clean predictions (the
        cosine of unrelated pairs; ``ncljax.labels.pc2.calibrated_cutoff``); ``'paper'``
        keeps ``c`` (the configs of the precomp benchmarks). The GMM splits at ``tau``
        are posteriors (calibrated by the mixtures) and ``margin`` is the hinge's
        hyperparameter.
      division_min_weight: a loss-GMM (or oscillation-GMM) component lighter than this
        makes that division degenerate (``ncljax.labels.gmm.check_division``; 0.01).
      division_min_separation: component means closer than this many standard
        deviations of the normalised values make it degenerate (0.1).
      model_config: the run's ``model`` config section (injected by the trainer): what the
        pseudo-classifier reads depends on ``model.head`` and ``model.embed_dim``.

    Degenerate divisions: a loss co-divide that puts every pair on one side of
    ``threshold`` or whose mixture separates nothing (``ncljax.labels.gmm.check_division``)
    is not used: the network keeps its previous non-degenerate division; before any, its
    peer trains with the warm-up objective (the mean-negative hinge on all pairs, plus the
    pseudo-classification). A degenerate oscillation division turns the rectification off
    for the epoch (``w_o = 0``). Each is logged with "fallback" and reported
    (``division_fallback``, ``osc_division_fallback``).
    """
    hyperparameters = {k: v for k, v in locals().items() if k != "model_config"}
    settings.check(
        "pc2",
        hyperparameters,
        {
            "margin": settings.NON_NEGATIVE,
            "warmup_epochs": settings.NON_NEGATIVE_INT,
            "pseudo_start_epoch": settings.NON_NEGATIVE_INT,
            "threshold": settings.UNIT_INTERVAL,  # a split of GMM posteriors
            "num_classes": settings.int_at_least(2),
            "classifier_hidden": settings.POSITIVE_INT,
            "classification_weight": settings.NON_NEGATIVE,
            "classification_start_epoch": settings.NON_NEGATIVE_INT,
            "entropy_weight": settings.NON_NEGATIVE,
            "entropy_mode": settings.one_of(*ENTROPY_MODES),
            "noisy_weight": settings.NON_NEGATIVE,  # 0: the paper's Table 7 variant
            "bank_mode": settings.one_of(*BANK_MODES),
            "margin_indexing": settings.one_of("paper", "code"),
            "noisy_margin_cutoff": settings.optional(settings.UNIT_INTERVAL, "no cutoff"),
            "detach_noisy_margin": settings.BOOLEAN,
            "rectify_indicator": settings.one_of("paper", "code"),
            "warmup_selection": settings.BOOLEAN,
            "classifier_input": settings.one_of("auto", "sequences", "embeddings"),
            "center_targets": settings.BOOLEAN,
            "pseudo_caption_assignment": settings.one_of(*PSEUDO_ASSIGNMENTS),
            "gmm_max_iter": settings.POSITIVE_INT,
            "gmm_tol": settings.NON_NEGATIVE,
            "gmm_reg_covar": settings.NON_NEGATIVE,
            "loss_reduction": settings.LOSS_REDUCTIONS,
            "calibration": settings.one_of("data", "paper"),
            "division_min_weight": settings.DIVISION_MIN_WEIGHT,
            "division_min_separation": settings.NON_NEGATIVE,
        },
    )
    head_kind = None if model_config is None else model_config.head
    if classifier_input == "auto":
        sequences = head_kind in _SGRAF
    else:
        sequences = classifier_input == "sequences"
    if model_config is not None:
        if head_kind in _SGRAF and not sequences:
            raise ValueError(
                "pc2 classifier_input='embeddings' needs the cosine head: the SGR/SAF models "
                "have no pooled embeddings; use 'sequences' (or 'auto')."
            )
        if sequences and "global" in (model_config.image_input, model_config.text_input):
            raise ValueError(
                "pc2 classifier_input='sequences' reads region and word embeddings: set "
                "model.image_input='regions' and model.text_input='tokens', or use "
                "classifier_input='embeddings' (or 'auto') with global feature vectors."
            )
    divide = functools.partial(
        labels_lib.loss_division,
        threshold=threshold,
        max_iter=gmm_max_iter,
        tol=gmm_tol,
        reg_covar=gmm_reg_covar,
    )
    clean_margin_of = "image" if margin_indexing == "code" else "positive"
    noisy_margin_of = "caption" if margin_indexing == "code" else "positive"
    pseudo_update = noisy_weight > 0

    def heads_fn(info, rngs):
        from ncljax.models import heads  # the models import the losses, not the methods

        if model_config is None:
            raise ValueError("pc2's pseudo-classifier needs the run's model config section.")
        dim = model_config.embed_dim
        in_dim = info.num_regions * dim if sequences else dim
        return {
            HEAD: heads.PseudoClassifier(in_dim, num_classes, hidden=classifier_hidden, rngs=rngs)
        }

    def init_memory(ctx: base.InitContext) -> base.Memory:
        n = ctx.num_samples
        ones, zeros = jnp.ones(n, jnp.float32), jnp.zeros(n, jnp.float32)
        samples = {
            "prob": ones,  # loss-GMM clean probability w
            "clean": ones,  # its split
            "loss": zeros,  # min-max normalised co-divide loss
            "loss_raw": zeros,
            "osc_prob": zeros,  # oscillation-GMM clean probability w_o
            "osc_clean": zeros,
            "osc": zeros,  # min-max normalised oscillation
            "osc_raw": zeros,
            "bank": jnp.full((n, num_classes), 1.0 / num_classes, jnp.float32),
            "bank_valid": zeros,
            "divided": zeros,  # 1 once the network has a non-degenerate loss division
        }
        if bank_mode == "code":
            samples["position"] = jnp.arange(n, dtype=jnp.int32)  # inside its subset
        return base.Memory(samples=samples, state={})

    def plan_fn(epoch: int) -> base.EpochPlan:
        if epoch < warmup_epochs:
            return base.EpochPlan(
                phase=WARMUP, in_turn=True, lr_epoch=0, selectable=False, min_batch=2
            )
        e = epoch - warmup_epochs
        pseudo = pseudo_update and e >= pseudo_start_epoch
        return base.EpochPlan(
            phase=CLEAN_PSEUDO if pseudo else CLEAN,
            refresh=True,
            in_turn=True,
            updates=(0, 1) if pseudo else (0,),
            reset_optimizer=e == 0,
            lr_epoch=e,
            restart_best=e == pseudo_start_epoch,
            min_batch=2,
        )

    def streams_fn(memory, epoch, network):
        if epoch < warmup_epochs:
            return base.Streams()
        peer = (network + 1) % 2
        clean = np.asarray(memory.samples["clean"][peer]) > 0.5
        return base.Streams(main=np.flatnonzero(clean), aux=np.flatnonzero(~clean))

    def classifier_inputs(model, image, text, batch, *, with_text=True):
        """The classifier's image (and caption) inputs on this backbone."""
        if not sequences:
            return image["emb"], (text["emb"] if with_text else None)
        x_image = pc2_labels.flatten_regions(image["regions"])
        if not with_text:
            return x_image, None
        lengths = jnp.where(batch["mask"], batch["length"], 1)
        longest = jnp.max(lengths).astype(jnp.int32)
        fixed = pc2_labels.resample_to_fixed(text["words"], longest, image["regions"].shape[-2])
        return x_image, pc2_labels.flatten_regions(fixed)

    def forward_fn(model, batch, memory_state, *, train, rngs, phase, ctx=None):
        del memory_state
        classifier = model.method_heads[HEAD]
        if ctx is not None and ctx.update == 1:
            return pseudo_caption_forward(model, classifier, batch, ctx.batches[0], rngs)
        out = model(batch, train=train, rngs=rngs)
        with_text = phase != base.STATS
        x_image, x_text = classifier_inputs(
            model, out["image"], out["text"], batch, with_text=with_text
        )
        out["image_logits"] = classifier(x_image)
        if with_text:
            out["text_logits"] = classifier(x_text)
        return out

    def pseudo_caption_forward(model, classifier, noisy, clean, rngs):
        """Update 2's forward: noisy images against borrowed clean captions (Eqs. 4-6)."""
        image = model.encode_image(noisy, train=True, rngs=rngs)
        image_clean = model.encode_image(clean, train=True, rngs=rngs)
        text_clean = model.encode_text(clean, train=True, rngs=rngs)
        x_noisy, _ = classifier_inputs(model, image, None, noisy, with_text=False)
        x_clean, _ = classifier_inputs(model, image_clean, None, clean, with_text=False)
        p_noisy = jax.nn.softmax(classifier(x_noisy), axis=-1)
        p_clean = jax.nn.softmax(classifier(x_clean), axis=-1)
        candidates = None
        if pseudo_caption_assignment == "true_classes":  # a diagnostic (see the docstring)
            image_class = noisy["label_image"][:, None]
            candidates = (image_class >= 0) & (image_class == clean["label_text"][None, :])
        index, cosine = pc2_labels.assign_pseudo_captions(
            p_noisy, p_clean, clean_where=clean["mask"], where=noisy["mask"], candidates=candidates
        )
        borrowed = pc2_labels.gather_rows({k: text_clean[k] for k in model.text_keys}, index)
        if "valid" in text_clean:  # the borrowed captions of real noisy pairs are real
            borrowed["valid"] = noisy["mask"]
        sim = model.similarity(image, borrowed, train=True)
        chance = pc2_labels.chance_cosine(
            p_noisy, p_clean, where=noisy["mask"], clean_where=clean["mask"]
        )
        return {
            "sim": sim,
            "pseudo_chance": chance,
            "pseudo_index": index,
            "pseudo_cosine": cosine,
            "p_noisy": p_noisy,
            "p_clean": p_clean,
        }

    def pseudo_classification(outputs, mask, epoch):
        """Per-example shares of ``lambda_pse L_pse + lambda_ent L_ent`` (Eq. 10)."""
        image, text = outputs["image_logits"], outputs["text_logits"]
        ce = losses.pseudo_label_cross_entropy(
            image, text, where=mask, center_targets=center_targets
        )
        ent = losses.prediction_entropy_loss(image, mode=entropy_mode, where=mask)
        per_example = classification_weight * ce + entropy_weight * ent
        if loss_reduction == "sum":  # L_pse and L_ent are batch means inside the sum
            per_example = per_example / jnp.maximum(mask.sum(), 1)
        return jnp.where(epoch >= classification_start_epoch, per_example, 0.0)

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        sim, mask = outputs["sim"], batch["mask"]
        if ctx.update == 1:
            return pseudo_caption_loss(outputs, batch, ctx)
        p = jax.nn.softmax(outputs["image_logits"], axis=-1)
        pse = pseudo_classification(outputs, mask, ctx.epoch)
        if ctx.phase == WARMUP:
            ranking = losses.triplet_mean(sim, margin, where=mask)
            if warmup_selection:
                ranking = jnp.where(_smallest_half(ranking, mask), ranking, 0.0)
            aux = {
                "metrics": {"loss_ranking": ranking, "loss_pseudo_cls": pse},
                "memory": {"bank": p, "bank_valid": jnp.ones_like(ranking)},
            }
            return ranking + pse, aux
        targets = pc2_labels.clean_soft_label(
            peer_rows["prob"],
            peer_rows["osc_prob"],
            threshold=threshold,
            strict=False,
            osc_clean=(peer_rows["osc_clean"] > 0.5) if rectify_indicator == "code" else None,
        )
        margins = losses.soft_margin(targets, margin, kind="exponential")
        hinge = losses.triplet_hardest(sim, margins, where=mask, margin_of=clean_margin_of)
        undivided = peer_rows["divided"] < 0.5  # the peer has no division yet: fallback
        hinge = jnp.where(undivided, losses.triplet_mean(sim, margin, where=mask), hinge)
        aux = {
            "metrics": {
                "target_clean": targets,
                "loss_clean": hinge,
                "loss_pseudo_cls": pse,
                "max_prediction": p.max(-1),
            },
            "clean_estimates": {"clean": targets},
            "loss_weight": margins,
        }
        return hinge + pse, aux

    def pseudo_caption_loss(outputs, batch, ctx):
        mask = batch["mask"]
        cosine = outputs["pseudo_cosine"]
        cutoff = noisy_margin_cutoff
        if cutoff is not None and calibration == "data":
            cutoff = pc2_labels.calibrated_cutoff(cutoff, outputs["pseudo_chance"])
        margins = pc2_labels.noisy_margin(
            cosine, margin=margin, cutoff=cutoff, detach=detach_noisy_margin
        )
        hinge = losses.triplet_hardest(
            outputs["sim"], margins, where=mask, margin_of=noisy_margin_of
        )
        aux = {
            "metrics": {
                "loss_noisy": hinge,
                "pseudo_cosine": jax.lax.stop_gradient(cosine),
                "pseudo_margin": jax.lax.stop_gradient(margins),
                "pseudo_cutoff": jnp.broadcast_to(
                    jnp.asarray(0.0 if cutoff is None else cutoff), margins.shape
                ),
            },
            "pseudo_caption_index": outputs["pseudo_index"],
            "loss_weight": jax.lax.stop_gradient(margins),
        }
        if bank_mode == "code":
            aux["memory_at"] = code_bank_writes(outputs, batch, ctx)
        return noisy_weight * hinge, aux

    def code_bank_writes(outputs, noisy, ctx):
        """The code's writes of update 2: the noisy then the clean predictions at the pairs'
        positions inside their subsets (the clean write wins where both land)."""
        n = ctx.num_samples
        clean = ctx.batches[0]
        pos_noisy = jnp.where(noisy["mask"], ctx.peer_rows[1]["position"], n)
        pos_clean = jnp.where(clean["mask"], ctx.peer_rows[0]["position"], n)
        overwritten = (pos_noisy[:, None] == pos_clean[None, :]).any(1)
        pos_noisy = jnp.where(overwritten, n, pos_noisy)
        index = jnp.concatenate([pos_noisy, pos_clean])
        bank = jnp.concatenate([outputs["p_noisy"], outputs["p_clean"]])
        rows = {
            "bank": jax.lax.stop_gradient(bank),
            "bank_valid": jnp.ones(index.shape, jnp.float32),
        }
        return index, rows

    def stats_fn(outputs, batch):
        mask = batch["mask"]
        return {
            "loss": losses.triplet_mean(outputs["sim"], margin, where=mask),
            "pred": jax.nn.softmax(outputs["image_logits"], axis=-1),
        }

    check_division = functools.partial(  # the loss and the oscillation divisions alike
        gmm_lib.check_division,
        threshold=threshold,
        min_weight=division_min_weight,
        min_separation=division_min_separation,
    )

    def refresh_fn(memory, stats, ctx):
        samples = dict(memory.samples)
        division = divide(stats["loss"])
        samples.update(
            loss=division.normalised.astype(jnp.float32),
            loss_raw=jnp.asarray(stats["loss"], jnp.float32),
        )
        check = check_division(division.normalised, division.prob, division.gmm)
        fallback = bool(check.degenerate)
        if fallback:
            ncr.warn_division_fallback("pc2", ctx, check, samples["divided"])
        else:
            samples.update(
                prob=division.prob.astype(jnp.float32),
                clean=division.clean.astype(jnp.float32),
                divided=jnp.ones_like(samples["divided"]),
            )
        pred = jnp.asarray(stats["pred"], jnp.float32)
        valid = memory.samples["bank_valid"] > 0.5
        osc = pc2_labels.prediction_oscillation(
            memory.samples["bank"], pred, direction=bank_mode, valid=valid
        )
        osc_division = divide(osc)
        samples.update(osc=osc_division.normalised.astype(jnp.float32), osc_raw=osc)
        osc_check = check_division(osc_division.normalised, osc_division.prob, osc_division.gmm)
        osc_fallback = bool(osc_check.degenerate)
        if osc_fallback:
            what = (
                "are all equal"
                if bool(osc_division.gmm.degenerate)
                else "give a degenerate division (one set, or components that coincide)"
            )
            logging.warning(
                "pc2: network %d's prediction oscillations of epoch %d %s (%d of %d pairs "
                "have a previous prediction); fallback: the rectification is off this "
                "epoch (w_o = 0).",
                ctx.network,
                ctx.epoch,
                what,
                int(valid.sum()),
                valid.size,
            )
            samples.update(osc_prob=jnp.zeros_like(osc), osc_clean=jnp.zeros_like(osc))
        else:
            samples.update(
                osc_prob=osc_division.prob.astype(jnp.float32),
                osc_clean=osc_division.clean.astype(jnp.float32),
            )
        if bank_mode == "paper":
            samples.update(bank=pred, bank_valid=jnp.ones_like(osc))
        else:
            clean = samples["clean"] > 0.5
            samples["position"] = jnp.where(
                clean, jnp.cumsum(clean) - 1, jnp.cumsum(~clean) - 1
            ).astype(jnp.int32)
        gmm, osc_gmm = division.gmm, osc_division.gmm
        used = jnp.bincount(pred.argmax(-1), length=num_classes) > 0
        if int(used.sum()) == 1:
            logging.warning(
                "pc2: network %d's pseudo-classifier predicts one class for every pair at "
                "epoch %d (largest probability %.3f on average): its pseudo-captions are "
                "arbitrary and its oscillations carry little; consider entropy_mode="
                "'marginal' (see ncljax/methods/pc2.py).",
                ctx.network,
                ctx.epoch,
                float(pred.max(-1).mean()),
            )
        diagnostics = {
            "gmm_mean_clean": gmm.means[0],
            "gmm_mean_noisy": gmm.means[1],
            "gmm_converged": gmm.converged,
            "gmm_degenerate": gmm.degenerate,
            "gmm_separation": check.separation,
            "division_fallback": jnp.float32(fallback),
            "osc_division_fallback": jnp.float32(osc_fallback),
            "clean_fraction": samples["clean"].mean(),
            "prob_mean": samples["prob"].mean(),
            "osc_gmm_mean_clean": osc_gmm.means[0],
            "osc_gmm_mean_noisy": osc_gmm.means[1],
            "osc_gmm_converged": osc_gmm.converged,
            "osc_gmm_degenerate": osc_gmm.degenerate,
            "osc_clean_fraction": samples["osc_clean"].mean(),
            "osc_mean": osc.mean(),
            "prediction_max_mean": pred.max(-1).mean(),
            "prediction_classes_used": used.sum(),
        }
        return base.Memory(samples=samples, state=memory.state), diagnostics

    return base.Method(
        name="pc2",
        init_memory=init_memory,
        loss_fn=loss_fn,
        forward_fn=forward_fn,
        refresh_fn=refresh_fn,
        stats_fn=stats_fn,
        plan_fn=plan_fn,
        clean_score_fn=lambda memory: memory.samples["prob"],
        diagnostic_scores_fn=diagnostic_scores,
        num_networks=2,
        streams_fn=streams_fn,
        loss_reduction=loss_reduction,
        heads_fn=heads_fn,
    )


def _smallest_half(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The ``floor(n / 2)`` real entries of smallest value (``n`` real entries; ties by index)."""
    keyed = jnp.where(mask, values, jnp.inf)
    rank = jnp.argsort(jnp.argsort(keyed, stable=True), stable=True)
    return mask & (rank < mask.sum() // 2)


def diagnostic_scores(memory: base.Memory) -> dict:
    """Per-pair scores for the logs (higher means cleaner), each scored against the true mask
    and histogrammed for clean and noisy pairs: the loss GMM's ``prob`` and the oscillation
    GMM's ``osc_prob`` (the two divisions), ``low_loss``/``low_osc`` (1 - the min-max
    normalised co-divide loss and oscillation) and ``neg_loss``/``neg_osc`` (their raw values,
    negated: the per-epoch means of clean and noisy pairs are the notebook's Fig. 2)."""
    s = memory.samples
    return {
        "prob": s["prob"],
        "osc_prob": s["osc_prob"],
        "low_loss": 1.0 - s["loss"],
        "low_osc": 1.0 - s["osc"],
        "neg_loss": -s["loss_raw"],
        "neg_osc": -s["osc_raw"],
    }
