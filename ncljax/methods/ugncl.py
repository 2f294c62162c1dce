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

**Calibration** (``calibration='data'``, the default; ``'paper'`` keeps Eqs. 8-11 and 17
as printed, ``configs/ugncl.py`` does on f30k, coco and cc152k). The paper's division
compares ``u`` with ``p = 0.5`` and ``q`` with ``epsilon = 0.5`` and takes a determined
pair as clean only when its counterpart is the most believed of the batch's ``K``. All
three carry the scale of the paper's data: ``u`` moves with the evidence scale and ``K``,
``q`` is a softmax over ``K`` pairs (chance ``1/K``), and the top-1 of ``K`` is a bar that
rises with ``K`` and with how hard the data is. Measured on ``world=small_global`` at 40%
(1,500 pairs, global vectors, batch 100; the first division after the warm-up): the
in-batch top-1 held for 26% of the clean pairs, so 68.5% of all pairs went to the
determined-noisy set with target 0, 60% of them clean; the evidential loss then drove
every evidence down, the mean ``u`` rose from 0.31 to 0.71 and 87% of the pairs were
hard-noisy from the next division on (the issue's real-data run: all of them). The
soft label ranked the pairs far better than ``1 - u`` (noise AUC 0.84 against 0.63).
Calibrated, ``u`` and ``q`` become the posteriors of two-component mixtures over the
training set (``ncljax.labels.ugncl.calibrate_signals``) and a determined pair whose
``q`` the mixture calls clean is clean too (:func:`calibrated_partition`); the factory
docstring lists each replaced equation. A degenerate division is never trained: see
*Fallback* there.

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

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import evidence, losses
from ncljax.labels import ugncl as division
from ncljax.losses import evidential
from ncljax.methods import base, settings

CADENCES = ("epoch", "online")
CALIBRATIONS = ("data", "paper")
VIEW_FUSIONS = ("auto", *division.VIEW_FUSIONS)


def _validate(kwargs: dict) -> None:
    """Refuses the bad hyperparameters, one clause each on one line (``settings.check``)."""
    choices = {
        "evidence_fn": evidence.EVIDENCE_FNS,
        "division_mode": division.DIVISION_MODES,
        "view_fusion": VIEW_FUSIONS,
        "bidir_mode": division.BIDIR_MODES,
        "division_cadence": CADENCES,
        "edl_target": division.EDL_TARGETS,
        "edl_view_aggregation": evidential.EDL_VIEW_AGGREGATIONS,
        "calibration": CALIBRATIONS,
    }
    spec = {name: settings.one_of(*allowed) for name, allowed in choices.items()}
    spec |= dict.fromkeys(("tau", "sharpness", "cosine_temperature"), settings.POSITIVE)
    spec |= dict.fromkeys(("xi1", "xi2", "gamma", "delta"), settings.NON_NEGATIVE)
    spec |= dict.fromkeys(("threshold", "epsilon"), settings.UNIT_INTERVAL)
    spec |= dict.fromkeys(("lambda_start", "theta"), settings.POSITIVE_INT)
    spec |= {
        "curve": settings.greater_than(1),
        "cosine_shift": settings.FINITE,
        "warmup_epochs": settings.NON_NEGATIVE_INT,
        "max_log_evidence": settings.optional(settings.POSITIVE, "no clip"),
    }
    settings.check("ugncl", kwargs, spec)


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
    calibration: str = "data",
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
      calibration: ``'data'`` (default) or ``'paper'`` (the paper's constants exactly;
        ``configs/ugncl.py`` sets it on f30k, coco, cc152k). ``'data'`` replaces, per
        division over the training set (or per batch with ``division_cadence='online'``;
        ``ncljax.labels.ugncl.calibrate_signals``):

        * the uncertainty threshold, Eq. 8-9 ``u_i < p`` (``threshold``), by
          ``v_i < 0.5`` with ``v_i`` the posterior of the high component of a
          two-component GMM over the min-max normalised ``u`` of the pairs: ``u``
          depends on the evidence scale ``exp(softplus(R) / tau)`` (with the cosine
          head on ``cosine_shift`` and ``cosine_temperature``) and on the batch's class
          count ``K``; ``v`` is unchanged by ``u -> a u + b``, ``a > 0``. Uncertainties
          of one group (a mixture with Ashman's ``D <= 2`` or that separates nothing,
          e.g. every ``u`` saturated at 0) make no pair hard (``v = 0``), as the paper's
          division is once every ``u < p``;
        * the soft-label threshold, Eq. 11 ``q_i > epsilon`` (``epsilon``), by
          ``w_i > 0.5`` with ``w_i`` the high component's posterior of a GMM over the
          min-max normalised ``log q``: ``q`` is a softmax over the ``K`` pairs of a batch
          (chance ``1/K``); ``w`` is unchanged by ``q -> c q^a`` (a division by ``K``
          included);
        * ``u`` and ``q`` in what the division feeds, Eq. 17's trusted margin
          ``sigma(-+Delta logit u_i)`` (centred on ``u = 0.5``, the paper's ``p``) and
          ``gamma (m^{q_i} - 1) / (m - 1)``, and the hard sets' evidential target
          ``y_i = q_i``: by ``v_i`` and ``w_i``;
        * Eq. 9's prediction, ``argmax_k P_ik = i`` (the pair is the top-1 of the
          batch's ``K``: a bar that rises with ``K`` and with the data's difficulty), by
          ``argmax_k P_ik = i`` or ``w_i > 0.5`` (:func:`calibrated_partition`).

        ``threshold`` and ``epsilon`` are then unread. ``cosine_shift`` and
        ``cosine_temperature`` stay: they set the evidence the losses train, and the
        division reads them only through ``u`` and ``q``, whose thresholds are
        calibrated.

        **Fallback** (both calibrations): a division that puts every pair in one set,
        trusts no pair (``S_C`` and ``S_H^C`` empty) or, calibrated, whose soft labels'
        mixture separates nothing (``ncljax.labels.check_division``) is not used: the previous
        usable division is kept, and before any the epoch trains the warm-up objective;
        the refresh logs a warning with "fallback" and reports ``division_fallback``
        (1). Online, a degenerate batch division trains that batch on the warm-up
        objective (the step metric ``division_fallback``).
      model_config: the run's ``model`` config section (given by the trainer, not a
        hyperparameter): the head decides what ``R`` is at evaluation.
    """
    _validate({k: v for k, v in locals().items() if k != "model_config"})
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
    calibrated = calibration == "data"

    def divide(u, prediction, q, where=None):
        """``(codes, u', q', degenerate)``: the division and the uncertainty and soft label
        its margins and targets read (``v``, ``w`` calibrated; ``u``, ``q`` as the paper).
        ``degenerate``: a mixture separates nothing, every pair is in one set, or no pair
        is trusted (``S_C`` and ``S_H^C`` empty)."""
        valid = jnp.ones(u.shape, bool) if where is None else jnp.asarray(where, bool)
        if calibrated:
            cal = division.calibrate_signals(u, q, where=valid)
            u, q, bad = cal.hard_posterior, cal.clean_posterior, cal.degenerate
            codes = calibrated_partition(u, prediction, q)
        else:
            codes, bad = split(u, prediction, q), jnp.bool_(False)
        count = jnp.maximum(valid.sum(), 1)
        shares = jnp.stack([((codes == c) & valid).sum() for c in range(4)]) / count
        trusted = shares[division.CLEAN] + shares[division.HARD_CLEAN]
        bad = bad | (trusted == 0) | (shares.max() >= 1.0)
        return codes, u, q, bad

    divide_jit = jax.jit(divide)

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
            # What the margins and targets read: (v, w) calibrated, (u, q) as the paper.
            "division_uncertainty": jnp.ones(n, jnp.float32),
            "division_soft_label": jnp.zeros(n, jnp.float32),
            # 1 until a division was usable: the fallback trains the warm-up objective.
            "fallback_warmup": jnp.ones(n, jnp.float32),
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
        warm_shares, warm_terms = losses.ugncl_loss(
            log_e,
            sim,
            num_negatives=lam,
            warmup=True,
            margin=gamma,
            kl_weight=xi1,
            robust_weight=xi2,
            where=mask,
        )
        if warmup:
            shares, terms = warm_shares, warm_terms
        else:
            fallback = None
            if division_cadence == "online":
                signals = signals_of(jax.lax.stop_gradient(log_e), where=mask)
                prediction = signals.prediction
                codes, u, q, bad = divide(
                    signals.uncertainty, prediction, signals.soft_label, where=mask
                )
                fallback = jnp.broadcast_to(bad, mask.shape)
                aux["memory"] = {
                    "uncertainty": signals.uncertainty,
                    "prediction": prediction.astype(jnp.float32),
                    "soft_label": signals.soft_label,
                    "codes": codes.astype(jnp.int32),
                    "division_uncertainty": u,
                    "division_soft_label": q,
                    "fallback_warmup": fallback.astype(jnp.float32),
                }
            else:
                prediction = rows["prediction"] > 0.5
                if calibrated:
                    u, q = rows["division_uncertainty"], rows["division_soft_label"]
                    codes = calibrated_partition(u, prediction, q)
                else:
                    u, q = rows["uncertainty"], rows["soft_label"]
                    codes = split(u, prediction, q)
                if "fallback_warmup" in rows:
                    fallback = rows["fallback_warmup"] > 0.5
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
            if fallback is not None:  # no usable division yet: the warm-up objective
                shares = jnp.where(fallback, warm_shares, shares)
                terms = jax.tree.map(lambda a, b: jnp.where(fallback, a, b), warm_terms, terms)
                metrics["division_fallback"] = fallback.astype(jnp.float32)
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
        fallback = False
        if stats is not None:
            prediction = stats["prediction"] > 0.5
            codes, u, q, bad = divide_jit(stats["uncertainty"], prediction, stats["soft_label"])
            new = dict(stats)
            new |= {
                "codes": codes.astype(jnp.int32),
                "division_uncertainty": u,
                "division_soft_label": q,
                "fallback_warmup": jnp.zeros_like(u),
            }
            fractions = _fractions(codes)
            fallback = bool(bad)
            if fallback:
                warm = bool(np.asarray(samples["fallback_warmup"]).max() > 0.5)
                logging.warning(
                    "ugncl: the division before epoch %d is degenerate (%s; %s): every pair "
                    "in one set, no trusted pair, or a mixture that separates nothing. "
                    "fallback: %s. Check method_kwargs.threshold=%s and epsilon=%s "
                    "(calibration=%r).",
                    ctx.epoch,
                    ", ".join(f"{k} {v:.3f}" for k, v in fractions.items()),
                    "the trusted robust loss would train on no pair"
                    if fractions["clean"] + fractions["hard_clean"] == 0
                    else "it cannot tell pairs apart",
                    "no usable division yet, the warm-up objective"
                    if warm
                    else "the previous usable division",
                    threshold,
                    epsilon,
                    calibration,
                )
            else:
                samples.update(new)
        fractions = _fractions(samples["codes"])
        u = np.asarray(samples["uncertainty"])
        diagnostics = {f"division_{name}": v for name, v in fractions.items()}
        diagnostics["division_uncertainty_mean"] = float(u.mean())
        diagnostics["division_fallback"] = float(fallback)
        diagnostics["division_warmup"] = float(np.asarray(samples["fallback_warmup"]).mean())
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


def calibrated_partition(hard_posterior, prediction, clean_posterior) -> jax.Array:
    """The division of ``calibration='data'``: :func:`ncljax.labels.ugd_partition` of the
    calibrated ``v``, ``w`` at 0.5, with a determined pair predicted when its counterpart is
    the most believed of the ``K`` (Eq. 9) or its ``w > 0.5``: the argmax over a batch's
    ``K`` pairs is a threshold that rises with ``K`` and with the data's difficulty."""
    prediction = jnp.asarray(prediction, bool) | (jnp.asarray(clean_posterior) > 0.5)
    return division.ugd_partition(hard_posterior, prediction, clean_posterior)


def _fractions(codes) -> dict[str, float]:
    codes = np.asarray(codes)
    return {name: float((codes == c).mean()) for c, name in enumerate(division.SET_NAMES)}


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
