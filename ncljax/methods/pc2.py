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
``w_o >= tau``). The code's pseudo-captions resampled to the noisy batch's length
(``pc2/model.py``, ``SGRAF.train``; tokens misalign when the two batches' maximum lengths
differ) are a bug that is not reproduced.

In neither source: ``classification_start_epoch`` and ``center_targets``. On a cosine head
the paper's objective collapses the classifier to one class (a caption's embedding is
aligned with its image's, so the caption's label is the image's own argmax, and at
initialisation every caption gets the same one); starting the classification after the
warm-up, with batch-centred caption labels and the marginal entropy, keeps the classes
apart (``configs/pc2.py:synthetic``; measurements in ``benchmarks/RESULTS.md``). A refresh
that finds one class for every pair logs a warning.

The co-teaching skeleton (the plan, the streams, the co-divide and its fallback) is
``ncljax.methods.coteaching``'s; this module adds PC2's own: the pseudo-classifier and what
it reads, the prediction bank and its oscillation division, Eq. 8's rectified targets, the
pseudo-caption update, and the borrowed captions' class accuracy (:func:`step_metrics`).

Sources: the paper (Duan et al., ACM MM 2024, Sec. 4 and Appendix B) and the official code
(``pc2/co_train.py`` for the warm-up, co-dividing and co-training loop, ``pc2/model.py`` for
the losses and the pseudo-classifier).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys

import jax
import jax.numpy as jnp

from ncljax import losses, masking
from ncljax.labels import pc2 as pc2_labels
from ncljax.losses.pseudo import ENTROPY_MODES
from ncljax.methods import base, coteaching, settings

WARMUP, CLEAN = coteaching.WARMUP, coteaching.MAIN  # warm-up; co-training, clean update only
CLEAN_PSEUDO = coteaching.SECOND  # co-training with the clean and the pseudo-caption updates
HEAD = "pseudo_classifier"
BANK_MODES = ("paper", "code")
PSEUDO_ASSIGNMENTS = ("predictions", "true_classes")
_SGRAF = ("sgr", "saf")


@dataclasses.dataclass(frozen=True)
class Settings(coteaching.Settings):
    """PC2's hyperparameters (``config.method_kwargs``): the co-teaching settings
    (``ncljax.methods.coteaching.Settings``) and PC2's own.

    Of the co-teaching settings, in PC2: ``margin`` is ``alpha`` of every hinge loss, whose
    soft margins are ``alpha (10^y - 1) / 9`` (``m = 10``); ``warmup_epochs`` (paper: 5 on
    F30K, 10 on COCO and NoW; README: 5 on COCO); ``threshold`` is ``tau`` of both GMM
    splits and of Eq. 8's indicator (0.5); ``gmm_max_iter``, ``gmm_tol`` and
    ``gmm_reg_covar`` set both GMMs; ``loss_reduction`` is ``'sum'`` (the code; the
    pseudo-classification terms are batch means inside it) or ``'mean'``;
    ``division_min_weight`` and ``division_min_separation`` make a loss-GMM or an
    oscillation-GMM division degenerate alike.

    Attributes:
      pseudo_start_epoch: first co-training epoch (counted from the end of the warm-up)
        with the pseudo-caption update, the code's ``warmup_epoch_2`` (25); the best
        validation score is forgotten at this epoch.
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
      bank_classes: ``None`` (default: the bank keeps every class of each prediction,
        ``4 K`` bytes per pair and network) or ``k``: it keeps each pair's ``k`` most
        probable classes and the rest of its mass spread evenly over the others
        (``ncljax.labels.pc2.top_classes``, ``bank_probabilities``; ``8 k`` bytes), the
        oscillation compares the pass's full prediction with that (ncljax's, for folders
        of millions of pairs: 128 classes cost 1 KB per pair for both networks).
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
      calibration: ``'data'`` (default) or ``'paper'``. The one absolute constant PC2
        applies to a similarity-derived score is Eq. 5's cutoff on the prediction cosine
        ``s`` (``noisy_margin_cutoff``, the code's 0.5). ``'data'`` replaces
        ``alpha^n = 0 if s < c`` by ``alpha^n = 0 if s < s_bar + c (1 - s_bar)``, with
        ``s_bar`` the mean cosine between the batch's noisy and clean predictions (the
        cosine of unrelated pairs; ``ncljax.labels.pc2.calibrated_cutoff``); ``'paper'``
        keeps ``c`` (the configs of the precomp benchmarks). The GMM splits at ``tau``
        are posteriors (calibrated by the mixtures) and ``margin`` is the hinge's
        hyperparameter.

    The factory also takes ``model_config``, the run's ``model`` config section (injected
    by the trainer): what the pseudo-classifier reads depends on ``model.head`` and
    ``model.embed_dim`` (:func:`reads_sequences`, :func:`check_model`).

    Degenerate divisions: a loss co-divide that puts every pair on one side of
    ``threshold`` or whose mixture separates nothing (``ncljax.labels.gmm.check_division``)
    is not used: the network keeps its previous non-degenerate division; before any, its
    peer trains with the warm-up objective (the mean-negative hinge on all pairs, plus the
    pseudo-classification). A degenerate oscillation division turns the rectification off
    for the epoch (``w_o = 0``). Each is logged with "fallback" and reported
    (``division_fallback``, ``osc_division_fallback``).
    """

    pseudo_start_epoch: int = 25
    num_classes: int = 128
    classifier_hidden: int = 256
    classification_weight: float = 1.0
    classification_start_epoch: int = 0
    entropy_weight: float = 10.0
    entropy_mode: str = "code_sample"
    noisy_weight: float = 1.0
    bank_mode: str = "paper"
    bank_classes: int | None = None
    margin_indexing: str = "paper"
    noisy_margin_cutoff: float | None = 0.5
    detach_noisy_margin: bool = True
    rectify_indicator: str = "paper"
    warmup_selection: bool = False
    classifier_input: str = "auto"
    center_targets: bool = False
    pseudo_caption_assignment: str = "predictions"
    calibration: str = "data"


CHECKS = {
    **coteaching.CHECKS,
    "pseudo_start_epoch": settings.NON_NEGATIVE_INT,
    "num_classes": settings.int_at_least(2),
    "classifier_hidden": settings.POSITIVE_INT,
    "classification_weight": settings.NON_NEGATIVE,
    "classification_start_epoch": settings.NON_NEGATIVE_INT,
    "entropy_weight": settings.NON_NEGATIVE,
    "entropy_mode": settings.one_of(*ENTROPY_MODES),
    "noisy_weight": settings.NON_NEGATIVE,  # 0: the paper's Table 7 variant
    "bank_mode": settings.one_of(*BANK_MODES),
    "bank_classes": settings.optional(settings.POSITIVE_INT, "every class"),
    "margin_indexing": settings.one_of("paper", "code"),
    "noisy_margin_cutoff": settings.optional(settings.UNIT_INTERVAL, "no cutoff"),
    "detach_noisy_margin": settings.BOOLEAN,
    "rectify_indicator": settings.one_of("paper", "code"),
    "warmup_selection": settings.BOOLEAN,
    "classifier_input": settings.one_of("auto", "sequences", "embeddings"),
    "center_targets": settings.BOOLEAN,
    "pseudo_caption_assignment": settings.one_of(*PSEUDO_ASSIGNMENTS),
    "calibration": settings.one_of("data", "paper"),
}


# --- the pseudo-classifier and what it reads ---------------------------------------------------


def reads_sequences(s: Settings, model_config) -> bool:
    """Whether ``C`` reads the region and word sequences (else the pooled embeddings):
    ``classifier_input``, where ``'auto'`` means sequences with the SGR/SAF heads."""
    if s.classifier_input == "auto":
        return (None if model_config is None else model_config.head) in _SGRAF
    return s.classifier_input == "sequences"


def check_model(s: Settings, model_config) -> None:
    """Refuses a ``classifier_input`` the backbone cannot give (no check without a model
    config), and a bank that keeps more classes than there are.

    Raises:
      ValueError: ``'embeddings'`` with the SGR/SAF heads, sequences over global
        feature vectors, or ``bank_classes > num_classes``.
    """
    if s.bank_classes is not None and s.bank_classes > s.num_classes:
        raise ValueError(
            f"pc2 bank_classes={s.bank_classes} keeps more classes than the "
            f"num_classes={s.num_classes} there are: set it at most {s.num_classes}, or None "
            "to keep every class."
        )
    if model_config is None:
        return
    sequences = reads_sequences(s, model_config)
    if model_config.head in _SGRAF and not sequences:
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


def heads(s: Settings, model_config, info, rngs) -> dict:
    """The method head: the pseudo-classifier ``C`` over ``R * D`` inputs (sequences) or
    ``D`` (embeddings)."""
    from ncljax.models import heads as heads_lib  # the models import the losses, not the methods

    if model_config is None:
        raise ValueError("pc2's pseudo-classifier needs the run's model config section.")
    dim = model_config.embed_dim
    in_dim = info.num_regions * dim if reads_sequences(s, model_config) else dim
    classifier = heads_lib.PseudoClassifier(
        in_dim, s.num_classes, hidden=s.classifier_hidden, rngs=rngs
    )
    return {HEAD: classifier}


def classifier_inputs(image, text, batch, *, sequences: bool, with_text: bool = True):
    """The classifier's image (and caption) inputs on this backbone: the embeddings, or the
    flattened regions and the word embeddings resampled to ``R`` positions relative to the
    batch's longest caption."""
    if not sequences:
        return image["emb"], (text["emb"] if with_text else None)
    x_image = pc2_labels.flatten_regions(image["regions"])
    if not with_text:
        return x_image, None
    lengths = jnp.where(batch["mask"], batch["length"], 1)
    longest = jnp.max(lengths).astype(jnp.int32)
    fixed = pc2_labels.resample_to_fixed(text["words"], longest, image["regions"].shape[-2])
    return x_image, pc2_labels.flatten_regions(fixed)


# --- memory, plan, streams ---------------------------------------------------------------------


def init_memory(s: Settings, ctx: base.InitContext) -> base.Memory:
    """The co-teaching division memory (``coteaching.init_samples``) and PC2's rows: the
    oscillation GMM's ``osc_prob`` (``w_o``) and ``osc_clean`` (its split), ``osc`` (the
    min-max normalised oscillation) and ``osc_raw``, the prediction ``bank`` (uniform) and
    ``bank_valid`` (:func:`bank_rows`); with ``bank_mode='code'``, each pair's ``position``
    inside its subset."""
    n = ctx.num_samples
    zeros = jnp.zeros(n, jnp.float32)
    samples = coteaching.init_samples(n)
    samples.update(
        osc_prob=zeros,
        osc_clean=zeros,
        osc=zeros,
        osc_raw=zeros,
        **empty_bank(s, n),
        bank_valid=zeros,
    )
    if s.bank_mode == "code":
        samples["position"] = jnp.arange(n, dtype=jnp.int32)  # inside its subset
    return base.Memory(samples=samples, state={})


def plan_problems(s: Settings, name: str, epochs: int) -> list[str]:
    """A run must outlast the warm-up (``base.warmup_problems``)."""
    return base.warmup_problems(name, s.warmup_epochs, epochs)


def plan(s: Settings, epoch: int) -> base.EpochPlan:
    """Warm-up epochs, then co-training from a fresh optimiser; the pseudo-caption update
    (phase ``CLEAN_PSEUDO``) from co-training epoch ``pseudo_start_epoch`` on, unless
    ``noisy_weight`` is 0, and the best validation score forgotten at that epoch."""
    e = epoch - s.warmup_epochs
    return coteaching.plan(
        s,
        epoch,
        second=s.noisy_weight > 0 and e >= s.pseudo_start_epoch,
        reset_at_start=True,
        restart_best=e == s.pseudo_start_epoch,
    )


def streams(s: Settings, memory, plan: base.EpochPlan, network: int) -> base.Streams:
    """The peer's clean set, with its noisy set alongside (``coteaching.streams``)."""
    del s
    return coteaching.streams(memory, plan, network)


# --- forward -------------------------------------------------------------------------------------


def forward(
    s: Settings, model, batch, memory_state, *, train, rngs, phase, ctx=None, sequences: bool
):
    """The backbone's outputs with the classifier's ``image_logits`` (and ``text_logits``
    but in the statistics pass); update 2's forward is :func:`pseudo_caption_forward`."""
    del memory_state
    classifier = model.method_heads[HEAD]
    if ctx is not None and ctx.update == 1:
        return pseudo_caption_forward(
            s, model, classifier, batch, ctx.batches[0], rngs, sequences=sequences
        )
    out = model(batch, train=train, rngs=rngs)
    with_text = phase != base.STATS
    x_image, x_text = classifier_inputs(
        out["image"], out["text"], batch, sequences=sequences, with_text=with_text
    )
    out["image_logits"] = classifier(x_image)
    if with_text:
        out["text_logits"] = classifier(x_text)
    return out


def pseudo_caption_forward(s: Settings, model, classifier, noisy, clean, rngs, *, sequences):
    """Update 2's forward: noisy images against borrowed clean captions (Eqs. 4-6)."""
    image = model.encode_image(noisy, train=True, rngs=rngs)
    image_clean = model.encode_image(clean, train=True, rngs=rngs)
    text_clean = model.encode_text(clean, train=True, rngs=rngs)
    x_noisy, _ = classifier_inputs(image, None, noisy, sequences=sequences, with_text=False)
    x_clean, _ = classifier_inputs(image_clean, None, clean, sequences=sequences, with_text=False)
    p_noisy = jax.nn.softmax(classifier(x_noisy), axis=-1)
    p_clean = jax.nn.softmax(classifier(x_clean), axis=-1)
    candidates = None
    if s.pseudo_caption_assignment == "true_classes":  # a diagnostic (see Settings)
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


# --- the losses of each update -------------------------------------------------------------------


def pseudo_classification(s: Settings, outputs, mask, epoch):
    """Per-example shares of ``lambda_pse L_pse + lambda_ent L_ent`` (Eq. 10), 0 before
    ``classification_start_epoch``."""
    image, text = outputs["image_logits"], outputs["text_logits"]
    ce = losses.pseudo_label_cross_entropy(image, text, where=mask, center_targets=s.center_targets)
    ent = losses.prediction_entropy_loss(image, mode=s.entropy_mode, where=mask)
    per_example = s.classification_weight * ce + s.entropy_weight * ent
    if s.loss_reduction == "sum":  # L_pse and L_ent are batch means inside the sum
        per_example = per_example / jnp.maximum(mask.sum(), 1)
    return jnp.where(epoch >= s.classification_start_epoch, per_example, 0.0)


def loss(s: Settings, outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """Warm-up: the mean-negative hinge plus the pseudo-classification, writing the bank.
    Update 0: Eq. 8's rectified hinge plus the pseudo-classification. Update 1: the
    pseudo-caption hinge (:func:`pseudo_caption_loss`)."""
    del rows
    sim, mask = outputs["sim"], batch["mask"]
    if ctx.update == 1:
        return pseudo_caption_loss(s, outputs, batch, ctx)
    p = jax.nn.softmax(outputs["image_logits"], axis=-1)
    pse = pseudo_classification(s, outputs, mask, ctx.epoch)
    if ctx.phase == WARMUP:
        return warmup_loss(s, sim, mask, p, pse)
    return clean_loss(s, sim, mask, p, pse, peer_rows)


def warmup_loss(s: Settings, sim, mask, p, pse) -> tuple[jax.Array, base.Aux]:
    """The warm-up objective: the mean-negative hinge (of the ``floor(B / 2)`` smallest
    with ``warmup_selection``) plus ``pse``; the image predictions ``p`` go to the bank."""
    ranking = coteaching.warmup_loss(s, sim, mask)
    if s.warmup_selection:
        ranking = jnp.where(_smallest_half(ranking, mask), ranking, 0.0)
    aux = base.Aux(
        metrics={"loss_ranking": ranking, "loss_pseudo_cls": pse},
        memory={**bank_rows(s, p), "bank_valid": jnp.ones_like(ranking)},
    )
    return ranking + pse, aux


def clean_loss(s: Settings, sim, mask, p, pse, peer_rows) -> tuple[jax.Array, base.Aux]:
    """Update 0: the hardest-negative hinge with Eq. 8's margins from the peer's estimates
    (the warm-up objective while the peer has no division), plus ``pse``."""
    osc_clean = (peer_rows["osc_clean"] > 0.5) if s.rectify_indicator == "code" else None
    targets = pc2_labels.clean_soft_label(
        peer_rows["prob"],
        peer_rows["osc_prob"],
        threshold=s.threshold,
        strict=False,
        osc_clean=osc_clean,
    )
    hinge, margins = coteaching.rectified_loss(
        s, sim, targets, mask, kind="exponential", margin_of=clean_margin_of(s)
    )
    hinge = coteaching.unless_undivided(s, hinge, sim, peer_rows, mask)
    aux = base.Aux(
        metrics={
            "target_clean": targets,
            "loss_clean": hinge,
            "loss_pseudo_cls": pse,
            "max_prediction": p.max(-1),
        },
        clean_estimates={"clean": targets},
        applied_weight=margins,
    )
    return hinge + pse, aux


def clean_margin_of(s: Settings) -> str:
    """Whose margin a hinge term of the clean update uses: its positive pair's, or by image
    (``margin_indexing='code'``)."""
    return "image" if s.margin_indexing == "code" else "positive"


def noisy_margin_of(s: Settings) -> str:
    """Whose margin a hinge term of the pseudo-caption update uses: its positive pair's, or
    by caption (``margin_indexing='code'``)."""
    return "caption" if s.margin_indexing == "code" else "positive"


def pseudo_cutoff(s: Settings, outputs):
    """Eq. 5's cutoff: ``noisy_margin_cutoff``, placed between the batch's chance cosine
    (``outputs['pseudo_chance']``) and 1 with ``calibration='data'``; ``None``: no cutoff."""
    cutoff = s.noisy_margin_cutoff
    if cutoff is not None and s.calibration == "data":
        cutoff = pc2_labels.calibrated_cutoff(cutoff, outputs["pseudo_chance"])
    return cutoff


def pseudo_caption_loss(s: Settings, outputs, batch, ctx) -> tuple[jax.Array, base.Aux]:
    """Update 1: the hardest-negative hinge on the pseudo pairs with Eq. 5's margins,
    weighted by ``lambda_n``; the borrowed rows go to ``Aux.extra`` (:func:`step_metrics`)
    and, with ``bank_mode='code'``, the predictions to the bank (:func:`code_bank_writes`)."""
    mask = batch["mask"]
    cosine = outputs["pseudo_cosine"]
    cutoff = pseudo_cutoff(s, outputs)
    margins = pc2_labels.noisy_margin(
        cosine, margin=s.margin, cutoff=cutoff, detach=s.detach_noisy_margin
    )
    if s.ranking == "contrastive":  # Eq. 5's share of alpha (its margin at alpha = 1)
        share = pc2_labels.noisy_margin(cosine, margin=1.0, cutoff=cutoff, detach=True)
        hinge, _ = coteaching.rectified_loss(
            s, outputs["sim"], share, mask, kind="linear", margin_of="positive"
        )
    else:
        hinge = losses.triplet_hardest(
            outputs["sim"], margins, where=mask, margin_of=noisy_margin_of(s)
        )
    aux = base.Aux(
        metrics={
            "loss_noisy": hinge,
            "pseudo_cosine": jax.lax.stop_gradient(cosine),
            "pseudo_margin": jax.lax.stop_gradient(margins),
            "pseudo_cutoff": jnp.broadcast_to(
                jnp.asarray(0.0 if cutoff is None else cutoff), margins.shape
            ),
        },
        applied_weight=jax.lax.stop_gradient(margins),
        memory_at=code_bank_writes(s, outputs, batch, ctx) if s.bank_mode == "code" else None,
        extra={"pseudo_caption_index": outputs["pseudo_index"]},
    )
    return s.noisy_weight * hinge, aux


def code_bank_writes(s: Settings, outputs, noisy, ctx):
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
        **bank_rows(s, jax.lax.stop_gradient(bank)),
        "bank_valid": jnp.ones(index.shape, jnp.float32),
    }
    return index, rows


def step_metrics(extra, batch, batches) -> dict:
    """``pseudo_caption_accuracy``: the share of real pairs whose borrowed caption (a row of
    the step's main batch ``batches[0]``) has the class of the pair's image, where the
    dataset has classes, as ``(sum, count)``."""

    borrowed = jnp.take(batches[0]["label_text"], extra["pseudo_caption_index"], mode="clip")
    image_class = batch["label_image"]
    known = batch["mask"] & (image_class >= 0) & (borrowed >= 0)
    accuracy = masking.masked_metric((borrowed == image_class).astype(jnp.float32), known)
    return {"pseudo_caption_accuracy": accuracy}


def _smallest_half(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The ``floor(n / 2)`` real entries of smallest value (``n`` real entries; ties by index)."""
    keyed = jnp.where(mask, values, jnp.inf)
    rank = jnp.argsort(jnp.argsort(keyed, stable=True), stable=True)
    return mask & (rank < mask.sum() // 2)


# --- the refresh: the co-divide, the oscillation division and the bank ---------------------------


def bank_rows(s: Settings, p) -> dict:
    """The memory rows that keep predictions ``p`` ``[B, K]`` in the bank: ``bank`` itself,
    or with ``bank_classes=k`` its ``k`` most probable classes (``bank``, ``[B, k]``) and
    which they are (``bank_class``)."""
    if s.bank_classes is None:
        return {"bank": p}
    probs, classes = pc2_labels.top_classes(p, s.bank_classes)
    return {"bank": probs, "bank_class": classes}


def empty_bank(s: Settings, n: int) -> dict:
    """The bank rows of ``n`` pairs before any prediction: uniform (:func:`bank_rows` of
    ``1 / K`` everywhere, without the ``[n, K]`` array where the bank keeps ``k``)."""
    if s.bank_classes is None:
        return {"bank": jnp.full((n, s.num_classes), 1.0 / s.num_classes, jnp.float32)}
    k = s.bank_classes
    return {
        "bank": jnp.full((n, k), 1.0 / s.num_classes, jnp.float32),
        "bank_class": jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (n, k)),
    }


def bank_predictions(s: Settings, rows) -> jax.Array:
    """The predictions ``[B, K]`` the bank ``rows`` hold (:func:`bank_rows`)."""
    if s.bank_classes is None:
        return rows["bank"]
    return pc2_labels.bank_probabilities(rows["bank"], rows["bank_class"], s.num_classes)


def bank_names(s: Settings) -> tuple[str, ...]:
    """The memory rows of the bank (:func:`bank_rows`) and ``bank_valid``."""
    return ("bank", "bank_valid") + (() if s.bank_classes is None else ("bank_class",))


def stats(s: Settings, outputs, batch, rows) -> dict:
    """The co-divide's per-pair statistics in eval mode, batch by batch: the warm-up
    objective's loss and, with ``noise_share='partner'``, the partner p-value
    (``coteaching.stats``); the oscillation ``osc_raw`` of the image predictions ``p``
    against the bank ``rows`` (Eq. 7; 0 where the bank has no entry); ``p``'s class
    ``pred_class`` and probability ``pred_max``; and with ``bank_mode='paper'`` ``p`` as
    bank rows (:func:`bank_rows`), which the refresh stores. Nothing ``[N, K]`` is
    collected beyond that new bank (``[N, k]`` with ``bank_classes=k``)."""
    pred = jax.nn.softmax(outputs["image_logits"], axis=-1)
    osc = pc2_labels.prediction_oscillation(
        bank_predictions(s, rows), pred, direction=s.bank_mode, valid=rows["bank_valid"] > 0.5
    )
    return {
        **coteaching.stats(s, outputs["sim"], batch["mask"]),
        "osc_raw": osc,
        "pred_class": pred.argmax(-1).astype(jnp.int32),
        "pred_max": pred.max(-1),
        **(bank_rows(s, pred) if s.bank_mode == "paper" else {}),
    }


def refresh(s: Settings, memory, stats, ctx):
    """The co-divide (``coteaching.co_divide``), the oscillation division (the statistics
    pass measured each pair's oscillation against the bank), the bank's update, and their
    diagnostics."""
    samples, division, checked, fallback, extra = coteaching.co_divide(
        s, "pc2", memory.samples, stats, ctx
    )
    valid = memory.samples["bank_valid"] > 0.5
    osc = jnp.asarray(stats["osc_raw"], jnp.float32)
    samples, osc_division, osc_fallback = oscillation_divide(s, samples, osc, valid, ctx)
    samples = update_bank(s, samples, stats)
    used = classes_used(s, stats, ctx)
    diagnostics = coteaching.division_diagnostics(division, checked, fallback, samples)
    diagnostics.update(extra)
    osc_gmm = osc_division.gmm
    diagnostics.update(
        osc_division_fallback=jnp.float32(osc_fallback),
        osc_gmm_mean_clean=osc_gmm.means[0],
        osc_gmm_mean_noisy=osc_gmm.means[1],
        osc_gmm_converged=osc_gmm.converged,
        osc_gmm_degenerate=osc_gmm.degenerate,
        osc_clean_fraction=samples["osc_clean"].mean(),
        osc_mean=osc.mean(),
        prediction_max_mean=jnp.asarray(stats["pred_max"]).mean(),
        prediction_classes_used=used.sum(),
    )
    return base.Memory(samples=samples, state=memory.state), diagnostics


def oscillation_divide(s: Settings, samples: dict, osc, valid, ctx):
    """The GMM division (``coteaching.divide``) of the oscillations ``osc`` (Eq. 7, 0 where
    ``valid`` is not), or ``w_o = 0`` with a warning where that division is degenerate.

    Returns:
      ``(samples, division, fallback)``.
    """
    division = coteaching.divide(s, osc)
    samples = dict(samples, osc=division.normalised.astype(jnp.float32), osc_raw=osc)
    fallback = bool(coteaching.check(s, division).degenerate)
    if fallback:
        what = (
            "are all equal"
            if bool(division.gmm.degenerate)
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
            osc_prob=division.prob.astype(jnp.float32),
            osc_clean=division.clean.astype(jnp.float32),
        )
    return samples, division, fallback


def update_bank(s: Settings, samples: dict, stats) -> dict:
    """``bank_mode='paper'``: the bank becomes this pass's predictions (its bank rows in
    ``stats``); ``'code'``: the bank stays, and each pair's ``position`` inside its (new)
    clean or noisy subset."""
    if s.bank_mode == "paper":
        new = {name: stats[name] for name in bank_names(s) if name != "bank_valid"}
        return dict(samples, **new, bank_valid=jnp.ones_like(samples["bank_valid"]))
    clean = samples["clean"] > 0.5
    position = jnp.where(clean, jnp.cumsum(clean) - 1, jnp.cumsum(~clean) - 1)
    return dict(samples, position=position.astype(jnp.int32))


def classes_used(s: Settings, stats, ctx) -> jax.Array:
    """``[K]`` whether each class is some pair's argmax (``stats['pred_class']``); logs a
    warning where one class takes every pair (a collapsed pseudo-classifier)."""
    used = jnp.bincount(jnp.asarray(stats["pred_class"]), length=s.num_classes) > 0
    if int(used.sum()) == 1:
        logging.warning(
            "pc2: network %d's pseudo-classifier predicts one class for every pair at "
            "epoch %d (largest probability %.3f on average): its pseudo-captions are "
            "arbitrary and its oscillations carry little; consider entropy_mode="
            "'marginal' (see ncljax/methods/pc2.py).",
            ctx.network,
            ctx.epoch,
            float(jnp.asarray(stats["pred_max"]).mean()),
        )
    return used


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


def bind(s: Settings, model_config=None) -> base.Method:
    """PC2's bundle with the settings ``s`` and the run's ``model`` config section bound
    (checked by :func:`check_model`)."""
    check_model(s, model_config)
    p = functools.partial
    return base.bind_module(
        sys.modules[__name__],
        s,
        forward_fn=p(forward, s, sequences=reads_sequences(s, model_config)),
        heads_fn=p(heads, s, model_config),
        clean_score_fn=coteaching.clean_score,
        verdict=coteaching.verdict(s),
        diagnostic_scores_fn=diagnostic_scores,
        step_metrics_fn=step_metrics,
        stats_rows=bank_names(s),
        num_networks=2,
        loss_reduction=s.loss_reduction,
    )


pc2 = settings.factory("pc2", Settings, CHECKS, bind, plan_problems=plan_problems)
