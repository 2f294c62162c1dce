r"""UGNCL: uncertainty-guided noisy correspondence learning (SIGIR 2024).

Zha et al., "UGNCL: Uncertainty-Guided Noisy Correspondence Learning for Efficient
Cross-Modal Matching". A batch of ``K`` pairs is a ``K``-way classification in both
retrieval directions. Each of ``W`` image views (``model.views``: ``W`` independent
projections of the image input, one shared text encoder and head) scores every pair; a
raw score ``R`` gives evidence ``exp(softplus(R) / tau)`` and a Dirichlet opinion
(``ncljax.evidence``). One network, no GMM:

* **Uncertainty-guided division** (``ncljax.labels.ugncl``): from the views' evidence,
  each pair's uncertainty ``u``, whether its counterpart is the most believed class, and
  its soft label ``q`` split the pairs into determined-clean, determined-noisy,
  hard-clean and hard-noisy sets, once per epoch over the training set before the epoch
  (``division_cadence='epoch'``: the trainer's statistics pass, eval mode, in shuffled
  batches of the training size; the values are stored per pair) or from each training
  batch's own forward (``'online'``).
* **Losses** (``ncljax.losses.ugncl_loss``, Eq. 18): the evidential loss of both
  directions with the pair's label as target (Eqs. 12-14), plus ``xi2`` times the trusted
  robust loss (Eq. 16): hardest-negative triplet on the determined-clean pairs, the mean
  of the ``lambda`` hardest negatives with the trusted soft margin (Eq. 17) on the hard
  pairs, nothing on the determined-noisy ones; ``lambda`` anneals per optimisation step.
* **Warm-up**: every label 1, the top-``lambda`` loss on every pair.
* **Evaluation**: the mean evidence of the views (``log-mean-exp`` of the
  log-evidences, ``eval_pool='logmeanexp'``); UGNCL* (SGR + SAF) is the ensemble of two
  runs under the same rule (``python -m ncljax.train.ensemble``).

**What ``R`` and ``S`` are.** SGR and SAF (the paper): ``R`` is the head's raw logit
(``model.sim_output='raw'``, required) and the ranking loss reads ``S = tanh(R)``. The
cosine head (over region/token inputs or over global feature vectors) has no logit:
``R = (cos - cosine_shift) / cosine_temperature`` (0.2, 0.1: unrelated pairs, cosine
near 0, carry evidence ``e^{softplus(-2) / tau} = 3.6``, matching ones at 0.5 ``e^30``),
and the ranking loss reads the cosine itself, already in ``(-1, 1)`` like ``tanh(R)``:
with ``tanh`` of the scaled cosine every matching pair would saturate.

**The KL term and the cosine head.** The KL term pulls every non-target evidence towards
its floor 1, ``R -> -inf``. An SGRAF head meets it with its output layer; a cosine head
only by opening a gap between the modalities, which lowers every cross-modal cosine,
matching pairs' included. Measured on the synthetic data (8,000 pairs, two warm-up
epochs): with ``xi1 = 0.1`` the median cosine of matching pairs fell to -0.14 (negatives
-0.32) for every shift and temperature tried (0-0.5, 0.02-0.25), the division then put
every pair in the hard-noisy set and training collapsed; centring the cosines on the
batch mean stopped the drift but squeezed every cosine into a band of 0.1. With
``xi1 = 0`` matching pairs sat at 0.19 and negatives at -0.04. Building the method with
the cosine head and ``xi1 > 0`` logs a warning; ``configs/ugncl.py:synthetic`` sets
``xi1 = 0``.

The training script was never released: the loop is the spec's reconstruction
(``ugncl.md`` Sec. 4), and every choice it marks is an argument below with the spec's
default (recorded in the run's ``config.json``). Where the released code is wrong (the
trusted margin's NaN, the text-to-image orientation of the ranking terms) the intended
form is implemented with no switch.

Diagnostics (logs only, against the true mask): per step the fraction of each set
(``set_clean``, ``set_noisy``, ``set_hard_clean``, ``set_hard_noisy``), the precision and
recall of the determined-clean set (``step_noise_precision_clean``, ...), of the
hard-clean set (``..._hard_clean``) and of the noisy sets as noisy
(``step_noisy_precision_noisy``, ``..._hard_noisy``), the loss terms and ``lambda``;
after every epoch the uncertainty of clean and noisy pairs (histograms of
``certainty = 1 - u`` in ``workdir/diagnostics/``).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import evidence, losses
from ncljax.labels import ugncl as division
from ncljax.losses import evidential
from ncljax.methods import base

_ROWS = ("uncertainty", "prediction", "soft_label", "codes")
CADENCES = ("epoch", "online")
VIEW_FUSIONS = ("auto", *division.VIEW_FUSIONS)


def _check(condition: bool, name: str, requirement: str, value) -> None:
    if not condition:
        raise ValueError(
            f"ugncl {name} must be {requirement}, got {value!r} (method_kwargs.{name})."
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(kwargs: dict) -> None:
    """One clear error per bad hyperparameter."""
    for name in ("tau", "sharpness", "cosine_temperature"):
        _check(_is_number(kwargs[name]) and kwargs[name] > 0, name, "a number > 0", kwargs[name])
    for name in ("xi1", "xi2", "gamma", "delta"):
        _check(_is_number(kwargs[name]) and kwargs[name] >= 0, name, "a number >= 0", kwargs[name])
    curve = kwargs["curve"]
    _check(_is_number(curve) and curve > 1, "curve", "a number > 1", curve)
    for name in ("threshold", "epsilon"):
        _check(_is_number(kwargs[name]) and 0 <= kwargs[name] <= 1, name, "in [0, 1]", kwargs[name])
    shift = kwargs["cosine_shift"]
    _check(_is_number(shift), "cosine_shift", "a finite number", shift)
    for name in ("warmup_epochs",):
        _check(_is_int(kwargs[name]) and kwargs[name] >= 0, name, "an integer >= 0", kwargs[name])
    for name in ("lambda_start", "theta"):
        _check(_is_int(kwargs[name]) and kwargs[name] >= 1, name, "an integer >= 1", kwargs[name])
    max_log = kwargs["max_log_evidence"]
    _check(
        max_log is None or (_is_number(max_log) and max_log > 0),
        "max_log_evidence",
        "None (no clip) or a number > 0",
        max_log,
    )
    choices = {
        "evidence_fn": evidence.EVIDENCE_FNS,
        "division_mode": division.DIVISION_MODES,
        "view_fusion": VIEW_FUSIONS,
        "bidir_mode": division.BIDIR_MODES,
        "division_cadence": CADENCES,
        "edl_target": division.EDL_TARGETS,
        "edl_view_aggregation": evidential.EDL_VIEW_AGGREGATIONS,
    }
    for name, allowed in choices.items():
        _check(kwargs[name] in allowed, name, f"one of {allowed}", kwargs[name])


def _check_model(model_config) -> None:
    if model_config is None:
        return
    if model_config.head in ("sgr", "saf") and model_config.sim_output != "raw":
        raise ValueError(
            f"ugncl reads the {model_config.head.upper()} head's raw score (its evidence and "
            "its tanh): set model.sim_output='raw' (configs/ugncl.py does)."
        )


def ugncl(
    *,
    tau: float = 0.1,
    evidence_fn: str = "exp_softplus",
    max_log_evidence: float | None = None,
    division_mode: str = "decl_lineage",
    view_fusion: str = "auto",
    bidir_mode: str = "sum",
    division_cadence: str = "epoch",
    threshold: float = 0.5,
    epsilon: float = 0.5,
    edl_target: str = "paper_soft",
    edl_view_aggregation: str = "per_view_mean",
    xi1: float = 0.1,
    xi2: float = 0.8,
    gamma: float = 0.2,
    curve: float = 10.0,
    sharpness: float = 10.0,
    lambda_start: int = 128,
    delta: float = 0.025,
    theta: int = 5,
    warmup_epochs: int = 5,
    cosine_temperature: float = 0.1,
    cosine_shift: float = 0.2,
    model_config=None,
) -> base.Method:
    """UGNCL as a method bundle. [paper], [code] (the released model file), [DECL] (the code
    lineage) and [spec] (the spec's reconstruction) mark where each default comes from
    (``ugncl.md`` Sec. 5.3, 8).

    Args:
      tau: evidence temperature [paper, code: 0.1].
      evidence_fn: ``'exp_softplus'`` [paper, code] or ``'exp_tanh'`` [DECL].
      max_log_evidence: clip the log-evidence (``None``: no clip [ncljax]; every
        evidential function is exact in log space without it).
      division_mode: ``'decl_lineage'`` [spec] or ``'paper'`` (Eqs. 8-11 as printed: never
        a hard set at ``threshold=0.5``).
      view_fusion: fusion of the views in the division: ``'auto'`` (the mode's own:
        ``'mean'`` for decl_lineage, ``'dst'`` for paper), ``'mean'`` or ``'dst'``.
      bidir_mode: ``'paper'`` division's bidirectional evidence, ``'sum'`` [paper] or
        ``'mean'`` [code, commented out].
      division_cadence: ``'epoch'`` (a statistics pass before each epoch) [spec, DECL] or
        ``'online'`` (each batch's own forward, no gradient) [the code's signature].
      threshold: uncertainty threshold ``p`` of determined vs hard [paper: 0.5].
      epsilon: soft-label threshold of hard-clean vs hard-noisy [paper: 0.5].
      edl_target: ``'paper_soft'`` (1, 0 or ``q``) [paper, spec] or ``'binary_pred'``
        [code, DECL].
      edl_view_aggregation: ``'per_view_mean'`` [code, spec] or ``'dst'`` [paper].
      xi1: KL weight [paper, code: 0.1; with the cosine head 0, see the module docstring].
      xi2: trusted robust loss weight [paper: 0.8; code: 0.2].
      gamma: margin [paper: 0.2].
      curve: ``m`` of the soft margin [paper: 10].
      sharpness: ``Delta`` of the trusted margin [paper: 10].
      lambda_start: the nominal batch the hard-negative count starts from [code: 128].
      delta: its decrease per optimisation step [code, DECL: 0.025; the paper's 0.25 "per
        epoch" would leave ~120 negatives for the whole run].
      theta: its floor [paper: 5].
      warmup_epochs: warm-up epochs [paper: 5; COCO 2].
      cosine_temperature: cosine head only,
        ``R = (cos - cosine_shift) / cosine_temperature`` [ncljax: 0.1].
      cosine_shift: cosine head only [ncljax: 0.2].
      model_config: the run's ``model`` config section (given by the trainer, not a
        hyperparameter): the head decides what ``R`` is at evaluation.
    """
    kwargs = dict(locals())
    _validate(kwargs)
    _check_model(model_config)
    cosine = model_config is not None and model_config.head == "cosine"
    if cosine and xi1 > 0:
        logging.warning(
            "ugncl: with the cosine head the KL term (xi1=%s) lowers every cross-modal cosine, "
            "matching pairs' included, and the division can then find no certain pair "
            "(measured on the synthetic data; see ncljax/methods/ugncl.py). Set "
            "method_kwargs.xi1=0 unless you mean to study it.",
            xi1,
        )
    fusion = None if view_fusion == "auto" else view_fusion
    log_evidence = functools.partial(
        evidence.log_evidence,
        temperature=tau,
        evidence_fn=evidence_fn,
        max_log_evidence=max_log_evidence,
    )
    signals_of = functools.partial(
        division.division_signals, mode=division_mode, view_fusion=fusion, bidir_mode=bidir_mode
    )
    split = functools.partial(division.ugd_partition, threshold=threshold, epsilon=epsilon)
    logging.info(
        "ugncl: reconstructed choices (ugncl.md Sec. 4, 8): division_mode=%s view_fusion=%s "
        "division_cadence=%s edl_target=%s edl_view_aggregation=%s xi2=%s delta=%s per step "
        "evidence_fn=%s max_log_evidence=%s",
        division_mode,
        view_fusion,
        division_cadence,
        edl_target,
        edl_view_aggregation,
        xi2,
        delta,
        evidence_fn,
        max_log_evidence,
    )

    def scores(outputs, mask):
        """``(R, S)`` ``[W, B, B]``: raw scores and the ranking loss's similarities."""
        if "logit" in outputs:
            raw = outputs["logit"]
            sim = jnp.tanh(raw)
        else:
            sim = outputs["sim"]
            sim = sim[None] if sim.ndim == 2 else sim
            raw = (sim - cosine_shift) / cosine_temperature
        if raw.ndim == 2:
            raw, sim = raw[None], sim[None]
        return raw, sim

    def init_memory(ctx: base.InitContext) -> base.Memory:
        n = ctx.num_samples
        samples = {
            "uncertainty": jnp.ones(n, jnp.float32),
            "prediction": jnp.zeros(n, jnp.float32),
            "soft_label": jnp.zeros(n, jnp.float32),
            "codes": jnp.full(n, division.HARD_NOISY, jnp.int32),
        }
        return base.Memory(samples=samples, state={})

    def stats_fn(outputs, batch):
        raw, _ = scores(outputs, batch["mask"])
        signals = signals_of(log_evidence(raw), where=batch["mask"])
        return {
            "uncertainty": signals.uncertainty,
            "prediction": signals.prediction.astype(jnp.float32),
            "soft_label": signals.soft_label,
        }

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        del peer_rows
        mask = batch["mask"]
        raw, sim = scores(outputs, mask)
        log_e = log_evidence(raw)
        real = mask.sum()
        lam = division.num_hard_negatives(
            ctx.step + 1, start=lambda_start, rate=delta, floor=theta, num_real=real
        )
        warmup = ctx.phase == base.WARMUP
        metrics = {"num_negatives": jnp.broadcast_to(lam.astype(jnp.float32), mask.shape)}
        aux = {"metrics": metrics}
        if warmup:
            shares, terms = losses.ugncl_loss(
                log_e,
                sim,
                num_negatives=lam,
                warmup=True,
                margin=gamma,
                kl_weight=xi1,
                robust_weight=xi2,
                where=mask,
            )
        else:
            if division_cadence == "online":
                signals = signals_of(jax.lax.stop_gradient(log_e), where=mask)
                u, q = signals.uncertainty, signals.soft_label
                prediction = signals.prediction
                aux["memory"] = {
                    "uncertainty": u,
                    "prediction": prediction.astype(jnp.float32),
                    "soft_label": q,
                    "codes": split(u, prediction, q).astype(jnp.int32),
                }
            else:
                u, q = rows["uncertainty"], rows["soft_label"]
                prediction = rows["prediction"] > 0.5
            codes = split(u, prediction, q)
            labels = division.edl_targets(codes, q, prediction, kind=edl_target)
            margins = division.trusted_margins(
                codes, u, q, margin=gamma, curve=curve, sharpness=sharpness
            )
            shares, terms = losses.ugncl_loss(
                log_e,
                sim,
                labels=labels,
                codes=codes,
                margins=margins,
                num_negatives=lam,
                kl_weight=xi1,
                robust_weight=xi2,
                edl_view_aggregation=edl_view_aggregation,
                where=mask,
            )
            member = {name: codes == c for c, name in enumerate(division.SET_NAMES)}
            as_float = {name: m.astype(jnp.float32) for name, m in member.items()}
            metrics |= {f"set_{name}": value for name, value in as_float.items()}
            metrics |= {"uncertainty": u, "label": labels, "margin": margins}
            aux["clean_estimates"] = {
                "clean": as_float["clean"],
                "hard_clean": as_float["hard_clean"],
            }
            aux["noisy_estimates"] = {
                "noisy": as_float["noisy"],
                "hard_noisy": as_float["hard_noisy"],
            }
            aux["loss_weight"] = labels
        metrics |= {"loss_evidential": terms.evidential, "loss_robust": terms.robust}
        return shares, aux

    def refresh_fn(memory, stats, ctx):
        samples = dict(memory.samples)
        if stats is not None:
            samples.update(stats)
            prediction = stats["prediction"] > 0.5
            samples["codes"] = split(stats["uncertainty"], prediction, stats["soft_label"]).astype(
                jnp.int32
            )
        codes = np.asarray(samples["codes"])
        fractions = {name: float((codes == c).mean()) for c, name in enumerate(division.SET_NAMES)}
        trusted = fractions["clean"] + fractions["hard_clean"]
        if stats is not None and (trusted == 0 or max(fractions.values()) == 1.0):
            logging.warning(
                "ugncl: the division before epoch %d put every pair in one set (%s); the "
                "trusted robust loss %s. Check method_kwargs.threshold=%s and epsilon=%s.",
                ctx.epoch,
                ", ".join(f"{k} {v:.3f}" for k, v in fractions.items()),
                "trains on no pair" if trusted == 0 else "cannot tell pairs apart",
                threshold,
                epsilon,
            )
        u = np.asarray(samples["uncertainty"])
        diagnostics = {f"division_{name}": v for name, v in fractions.items()}
        diagnostics["division_uncertainty_mean"] = float(u.mean())
        return base.Memory(samples=samples, state=memory.state), diagnostics

    def plan_fn(epoch: int) -> base.EpochPlan:
        warm = epoch < warmup_epochs
        return base.EpochPlan(
            phase=base.WARMUP if warm else base.MAIN,
            refresh=not warm,
            lr_epoch=max(0, epoch - warmup_epochs),
            selectable=not warm,
            min_batch=2,
            drop_remainder=True,
        )

    def eval_transform(sim):
        if cosine:
            sim = (sim - cosine_shift) / cosine_temperature
        return log_evidence(sim)

    return base.Method(
        name="ugncl",
        init_memory=init_memory,
        loss_fn=loss_fn,
        refresh_fn=refresh_fn,
        stats_fn=stats_fn if division_cadence == "epoch" else None,
        plan_fn=plan_fn,
        clean_score_fn=certainty,
        diagnostic_scores_fn=diagnostic_scores,
        eval_transform=eval_transform,
        eval_pool="logmeanexp",
    )


def certainty(memory: base.Memory) -> jax.Array:
    """``1 - u``: ranks pairs by the division's uncertainty (the noise AUC)."""
    return 1.0 - memory.samples["uncertainty"]


def diagnostic_scores(memory: base.Memory) -> dict:
    """Per-pair scores for the logs and the notebook (higher means cleaner): the certainty
    ``1 - u``, the soft label ``q``, and membership of the trusted sets."""
    s = memory.samples
    codes = s["codes"]
    return {
        "certainty": 1.0 - s["uncertainty"],
        "soft_label": s["soft_label"],
        "determined_clean": (codes == division.CLEAN).astype(jnp.float32),
        "hard": ((codes == division.HARD_CLEAN) | (codes == division.HARD_NOISY)).astype(
            jnp.float32
        ),
    }
