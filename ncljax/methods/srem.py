r"""SREM: self-reinforcing errors mitigation for noisy correspondence (AAAI 2024).

Dang et al., "Noisy Correspondence Learning with Self-Reinforcing Errors Mitigation". Each
query's row of in-batch logits ``F`` is read as a ``B``-way classification, in both
retrieval directions (``F`` for image-to-text, ``F.T`` for text-to-image), and everything
is per batch (no per-epoch pass over the training set, no GMM, one network):

* **Energy-guided filtration**: a pair is clean in a direction when its query's energy
  ``-logsumexp(F_i:)`` is below ``tau`` and its partner is the row's argmax (Eq. 2); the
  energy-bounded loss pushes clean energies below ``m_clean`` and noisy ones above
  ``m_noisy`` (Eq. 3).
* **Swapped gradient weighting**: the hardest-negative hinge on the clean pairs, whose
  positive term is weighted by one minus the *other* direction's normalised entropy
  (Eqs. 4-7).
* **Cross-modal biased complementary learning**: every in-batch negative is a
  complementary label, weighted towards the hard ones (multi-similarity probabilities,
  Eqs. 10-12), pushed down by ``-log(1 - P)`` (Eq. 13).

``warmup_epochs`` of complementary learning alone, then the main objective
``(L_w^i2t + L_w^t2i) / 2 + lambda1 (L_u^i2t + L_u^t2i) + lambda2 (L_c^i2t + L_c^t2i)``
(``ncljax.losses.srem_loss``). Every batch is full (``drop_remainder``): the energy
carries ``-log B``, so ``tau`` and the margins hold for one batch size. The learning
rate schedule reads epochs counted from the end of the warm-up (the paper: x0.1 after 25
of the 50 main epochs, ``optim.decay_every=25``). Every epoch, warm-up included, may be
selected as best on validation (the spec's algorithm validates after each).

**What ``F`` is.** SGR and SAF (the paper's SGRAF, two runs averaged at evaluation with
``python -m ncljax.train.ensemble``): the head's raw logit ``h`` before its sigmoid, and
``S = sigmoid(F)`` is the similarity the model scores with. The cosine head (over region
and token inputs, or over global feature vectors) has no logit:
``F = (cos - cosine_shift) / cosine_temperature``, the cosine as a logit of a sigmoid
similarity. A temperature alone would not do: the energy is not shift invariant, and
with ``F = cos / t`` a row of unrelated captions (cosines near 0) would sit at energy
``-log B`` whatever ``t``, below ``tau = -2``, so no row could be pushed above
``m_noisy = 0``. The defaults (0.1, 0.5) put matching pairs (cosine 0.7-0.9) at logits 2
to 4 and unrelated ones (cosine 0-0.2) at -5 to -3, the range of SGRAF's logits for
which the paper's margins were set; softmax, entropy and argmax only see the temperature.

Diagnostics (logs only, against the true mask): the precision and recall of each
direction's clean split per step (``step_noise_precision_i2t``, ...), the fraction
selected (``selected_i2t``, ``selected_t2i``), the share of the hinge's positive pull that
reaches mismatched pairs (``noisy_weight_share``, the paper's noisy gradient ratio), and
after every epoch the energies of clean and noisy pairs (histograms in
``workdir/diagnostics/``, from per-pair memory rows written by the training steps; a
pair the epoch's last partial batch skipped keeps its previous values).

No official code was released: every value the spec marks inferred or unknown is an
argument below with the spec's suggestion (``srem.md`` Sec. 5.3, 8).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import losses
from ncljax.labels import srem as selection
from ncljax.losses import srem as srem_losses
from ncljax.methods import base

_ROWS = ("energy_i2t", "energy_t2i", "clean_i2t", "clean_t2i")


def _check(condition: bool, name: str, requirement: str, value) -> None:
    if not condition:
        raise ValueError(
            f"srem {name} must be {requirement}, got {value!r} (method_kwargs.{name})."
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate(kwargs: dict) -> None:
    """One clear error per bad hyperparameter."""
    for name in ("tau", "m_clean", "m_noisy", "ms_b", "cosine_shift"):
        _check(_is_number(kwargs[name]), name, "a finite number", kwargs[name])
    for name in ("alpha", "lambda1", "lambda2"):
        _check(_is_number(kwargs[name]) and kwargs[name] >= 0, name, "a number >= 0", kwargs[name])
    for name in ("ms_beta", "rcl_tau", "cosine_temperature"):
        _check(_is_number(kwargs[name]) and kwargs[name] > 0, name, "a number > 0", kwargs[name])
    _check(
        kwargs["m_clean"] <= kwargs["m_noisy"],
        "m_clean",
        f"<= m_noisy={kwargs['m_noisy']} (clean energies are pushed below it, noisy above)",
        kwargs["m_clean"],
    )
    choices = {
        "cl_reduction": srem_losses.CL_REDUCTIONS,
        "cl_prob": srem_losses.CL_PROBS,
        "rectify": srem_losses.RECTIFY,
        "sgw_indicator": selection.SGW_INDICATORS,
        "clean_set": selection.CLEAN_SETS,
    }
    for name, allowed in choices.items():
        _check(kwargs[name] in allowed, name, f"one of {allowed}", kwargs[name])
    for name in ("gradient_weighting", "warmup_lambda2"):
        _check(isinstance(kwargs[name], bool), name, "True or False", kwargs[name])
    warmup = kwargs["warmup_epochs"]
    _check(
        isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0,
        "warmup_epochs",
        "an integer >= 0",
        warmup,
    )


def srem(
    *,
    tau: float = -2.0,
    m_clean: float = -4.0,
    m_noisy: float = 0.0,
    alpha: float = 0.2,
    ms_beta: float = 50.0,
    ms_b: float = 0.5,
    lambda1: float = 0.05,
    lambda2: float = 1.0,
    cl_reduction: str = "sum",
    cl_prob: str = "softmax",
    rcl_tau: float = 0.05,
    rectify: str = "biased",
    sgw_indicator: str = "literal",
    gradient_weighting: bool = True,
    clean_set: str = "per_direction",
    warmup_epochs: int = 5,
    warmup_lambda2: bool = False,
    cosine_temperature: float = 0.1,
    cosine_shift: float = 0.5,
) -> base.Method:
    """SREM as a method bundle. [paper] values are the paper's; [spec] the spec's inference
    or suggestion where the paper says nothing (``srem.md`` Sec. 5.3, 8).

    Args:
      tau: energy threshold of the clean split (Eq. 2) [spec: -2, between the margins;
        the spec suggests a sweep over -4..0]. A threshold that selects nothing is allowed;
        an epoch that selected nothing is logged as a warning.
      m_clean: energy margin of clean pairs (Eq. 3) [paper, Fig. 4: -4].
      m_noisy: energy margin of noisy pairs [paper, Fig. 4: 0]; ``m_clean <= m_noisy``.
      alpha: hinge margin (Eq. 6) [spec: 0.2, NCR/SGRAF's].
      ms_beta: sharpness of the selection probabilities (Eq. 10) [spec: 50].
      ms_b: their offset [spec: 0.5].
      lambda1: weight of the energy-bounded loss [spec: 0.05; the paper: in [0, 1]].
      lambda2: weight of the complementary loss [spec: 1.0].
      cl_reduction: ``'sum'`` (each query's complementary terms summed, RCL's scale) or
        ``'mean'`` (the literal expectation) [spec: 'sum'].
      cl_prob: the probability pushed down by the complementary loss: ``'softmax'`` of the
        row of logits [spec], ``'sigmoid'`` score (collapses in warm-up, logged) or
        ``'rcl'`` (``softmax(sigmoid(F) / rcl_tau)``, RCL's).
      rcl_tau: temperature of ``cl_prob='rcl'`` [RCL: 0.05].
      rectify: ``'biased'`` (Eqs. 10-12) [spec], ``'uniform'`` (the "without label
        rectification" ablation), ``'matmul_PQ'``/``'matmul_QtP'`` (literal, degenerate
        readings of Eq. 12, ablations only).
      sgw_indicator: ``'literal'`` (the swapped weight carries the other direction's
        indicator, Eqs. 5-6 as printed) [spec] or ``'loss_direction'`` (the entropy is
        swapped, the indicator is the loss's own).
      gradient_weighting: swapped gradient weighting; ``False`` is the paper's "without
        gradient weighting" ablation (``omega = 1``).
      clean_set: ``'per_direction'`` [spec], ``'and'`` or ``'or'`` of the two splits.
      warmup_epochs: epochs of complementary learning alone [paper: 5].
      warmup_lambda2: multiply the warm-up loss by ``lambda2`` [spec: no; unstated].
      cosine_temperature: cosine head only, ``F = (cos - cosine_shift) / cosine_temperature``
        (see the module docstring) [ncljax: 0.1].
      cosine_shift: cosine head only [ncljax: 0.5].
    """
    kwargs = dict(locals())
    _validate(kwargs)
    if cl_prob == "sigmoid" and warmup_epochs:
        logging.warning(
            "srem: cl_prob='sigmoid' in a warm-up of complementary learning alone has the "
            "trivial solution 'every similarity -> 0' (srem.md Sec. 8, item 10)."
        )
    logging.info(
        "srem: values the paper does not give (srem.md Sec. 8): tau=%s alpha=%s ms_beta=%s "
        "ms_b=%s lambda1=%s lambda2=%s cl_reduction=%s cl_prob=%s sgw_indicator=%s "
        "clean_set=%s",
        tau,
        alpha,
        ms_beta,
        ms_b,
        lambda1,
        lambda2,
        cl_reduction,
        cl_prob,
        sgw_indicator,
        clean_set,
    )
    objective = functools.partial(
        losses.srem_loss,
        threshold=tau,
        m_clean=m_clean,
        m_noisy=m_noisy,
        margin=alpha,
        beta=ms_beta,
        offset=ms_b,
        lambda1=lambda1,
        lambda2=lambda2,
        cl_reduction=cl_reduction,
        cl_prob=cl_prob,
        rcl_temperature=rcl_tau,
        rectify=rectify,
        sgw_indicator=sgw_indicator,
        gradient_weighting=gradient_weighting,
        clean_set=clean_set,
        warmup_lambda2=warmup_lambda2,
    )

    def init_memory(ctx: base.InitContext) -> base.Memory:
        zeros = jnp.zeros(ctx.num_samples, jnp.float32)
        return base.Memory(samples={name: zeros for name in _ROWS}, state={})

    def logits_of(outputs):
        if "logit" in outputs:
            return outputs["logit"]
        return (outputs["sim"] - cosine_shift) / cosine_temperature

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        del rows, peer_rows
        warmup = ctx.phase == base.WARMUP
        loss, views = objective(logits_of(outputs), warmup=warmup, where=batch["mask"])
        i2t, t2i = views["i2t"], views["t2i"]
        clean_i2t, clean_t2i = i2t.clean.astype(jnp.float32), t2i.clean.astype(jnp.float32)
        metrics = {
            "selected_i2t": clean_i2t,
            "selected_t2i": clean_t2i,
            "energy_i2t": i2t.energy,
            "energy_t2i": t2i.energy,
            "loss_complementary": i2t.complementary + t2i.complementary,
        }
        aux = {
            "metrics": metrics,
            "memory": {
                "energy_i2t": i2t.energy,
                "energy_t2i": t2i.energy,
                "clean_i2t": clean_i2t,
                "clean_t2i": clean_t2i,
            },
            "clean_estimates": {"i2t": clean_i2t, "t2i": clean_t2i},
        }
        if not warmup:
            metrics |= {
                "loss_hinge": 0.5 * (i2t.hinge + t2i.hinge),
                "loss_energy": i2t.energy_loss + t2i.energy_loss,
                "weight_i2t": i2t.weight,
                "weight_t2i": t2i.weight,
            }
            aux["loss_weight"] = i2t.pull + t2i.pull
        return loss, aux

    def refresh_fn(memory, stats, ctx):
        del stats
        s = memory.samples
        fractions = {d: float(np.asarray(s[f"clean_{d}"]).mean()) for d in ("i2t", "t2i")}
        if ctx.epoch >= max(warmup_epochs, 1) and not any(fractions.values()):
            logging.warning(
                "srem: network %d selected no clean pair in epoch %d (tau=%s): the hinge "
                "trains nothing and the energy loss pushes every energy up. Raise "
                "method_kwargs.tau.",
                ctx.network,
                ctx.epoch - 1,
                tau,
            )
        diagnostics = {f"selected_fraction_{d}": v for d, v in fractions.items()}
        return memory, diagnostics

    def plan_fn(epoch: int) -> base.EpochPlan:
        return base.EpochPlan(
            phase=base.WARMUP if epoch < warmup_epochs else base.MAIN,
            refresh=epoch > 0,
            lr_epoch=max(0, epoch - warmup_epochs),
            min_batch=2,
            drop_remainder=True,
        )

    return base.Method(
        name="srem",
        init_memory=init_memory,
        loss_fn=loss_fn,
        refresh_fn=refresh_fn,
        plan_fn=plan_fn,
        clean_score_fn=functools.partial(energy_score, tau=tau),
        diagnostic_scores_fn=diagnostic_scores,
    )


def energy_score(memory: base.Memory, *, tau: float) -> jax.Array:
    """``sigmoid(tau - E)`` of the mean energy of a pair's two queries: ranks pairs by energy
    (the noise AUC) and is above 1/2 where the energy half of Eq. 2 selects them."""
    s = memory.samples
    return jax.nn.sigmoid(tau - 0.5 * (s["energy_i2t"] + s["energy_t2i"]))


def diagnostic_scores(memory: base.Memory) -> dict:
    """Per-pair scores for the logs and the notebook (higher means cleaner): the negative
    energies of the image and caption queries and each direction's clean split, as the
    training steps last saw them."""
    s = memory.samples
    return {
        "neg_energy_i2t": -s["energy_i2t"],
        "neg_energy_t2i": -s["energy_t2i"],
        "selected_i2t": s["clean_i2t"],
        "selected_t2i": s["clean_t2i"],
    }
