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

The threshold and margins are constants (``calibration='paper'``: the paper's margins,
Fig. 4, and a threshold inferred between them) or calibrated on the energies of the
previous epoch (``'data'``, the default, re-measured before every epoch; ``'warmup'``:
frozen after the warm-up; see ``Settings``); a batch
whose division selects no pair or every pair trains the warm-up objective. The warm-up's
complementary labels are uniform (``warmup_rectify``).

``warmup_epochs`` of complementary learning alone, then the main objective
``(L_w^i2t + L_w^t2i) / 2 + lambda1 (L_u^i2t + L_u^t2i) + lambda2 (L_c^i2t + L_c^t2i)``
(:func:`srem_loss`). Every batch is full (``drop_remainder``) where the energy split
divides: the energy carries ``-log B``, so the paper's ``tau`` and margins hold for one
batch size (the calibrated ones for every batch size); the partner test's p-value holds
for any batch, and with it the last partial batch trains too. The learning
rate schedule reads epochs counted from the end of the warm-up (the paper: x0.1 after 25
of the 50 main epochs, ``optim.step.every=25``). Every epoch, warm-up included, may be
selected as best on validation (NCR's protocol, whose training settings the paper
adopts, validates after each).

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
direction's clean split per step (``step_clean_precision_i2t``, ...), the fraction
selected (``selected_i2t``, ``selected_t2i``), the share of the hinge's positive pull that
reaches mismatched pairs (``noisy_weight_share``, the paper's noisy gradient ratio: noisy
pull over total pull, ``null`` in a logging window that pulled nothing), and
after every epoch the energies of clean and noisy pairs (histograms in
``workdir/diagnostics/``, from per-pair memory rows written by the training steps; a
pair the epoch's last partial batch skipped keeps its previous values).

No official code was released: every value the paper leaves open is a field of
:class:`Settings`, with a default inferred from the codebases the paper follows (NCR,
SGRAF), the method it generalises (RCL) or the loss it cites (MS).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ncljax import masking
from ncljax.labels import share as share_lib
from ncljax.labels import srem as selection
from ncljax.losses import srem as srem_losses
from ncljax.methods import base, settings

_DIRECTIONS = ("i2t", "t2i")
_ROWS = (
    "energy_i2t",
    "energy_t2i",
    "partner_i2t",
    "partner_t2i",
    "clean_i2t",
    "clean_t2i",
    "division_fallback",
)
CALIBRATIONS = ("data", "warmup", "paper")


class Settings(NamedTuple):
    r"""SREM's hyperparameters (``config.method_kwargs``): the factory's arguments. [paper]
    values are the paper's ("Implementation Details", Fig. 4); [inferred] a value inferred
    where the paper says nothing (from NCR, SGRAF, RCL or the MS loss, as noted).

    **Calibration** (``calibration='data'``, the default; ``'paper'`` keeps the constants
    ``tau``, ``m_clean``, ``m_noisy`` below exactly, as the configs do on f30k, coco and
    cc152k). The energy :math:`E_i = -\log\sum_j e^{F_{ij}}` has no fixed scale: it carries
    ``-log B`` (a batch of flat logits sits at ``-log B``) and every shift of the logits
    (the cosine head's ``cosine_shift``, an SGR head's bias) moves it one for one, so a
    constant threshold selects everything on one backbone and nothing on another. The
    refresh splits each direction's energies, as the training steps of the previous epoch
    wrote them (the warm-up's included), into its two optimal classes
    (``ncljax.labels.srem.calibrate_energy``: Otsu's threshold, the exact 2-means split
    of the sorted energies), and the epoch's steps use, per direction:

    * Eq. 2, :math:`E_i < \tau` with :math:`\tau = -2` becomes :math:`E_i < \hat\tau`,
      :math:`\hat\tau` the cut between the low-energy and the high-energy class;
    * Eq. 3, :math:`[E_i - m_{clean}]_+^2` with :math:`m_{clean} = -4` uses
      :math:`\hat m_{clean}`, the low class's mean energy, and
      :math:`[m_{noisy} - E_i]_+^2` with :math:`m_{noisy} = 0` uses
      :math:`\hat m_{noisy}`, the high class's mean (the paper's margins sit 2 either
      side of its threshold; these at the two classes' centres).

    With ``calibration='data'`` the three are re-measured before every epoch on the
    energies of the epoch that ended, so the division follows the model; with
    ``'warmup'`` they are measured up to the first main epoch (last on the final warm-up
    epoch's energies) and then frozen, as the paper's constants are. A frozen division
    does not follow energies that drift: on real folders (scikit-learn's digits, top and
    bottom halves as the two sides, 40% of the pairs mismatched) the energies rose from
    -2.3 to +1.7 in the first main epoch, above the frozen threshold, the selected share
    fell to 0-3% and 89-100% of every later epoch's batches fell back to the warm-up
    objective (test rSum 208 against InfoNCE's 260). A re-measured division has the
    opposite weakness when the energy-bounded loss is on: its margins sit at the two
    classes' centres, so some of the noisy class is always below ``m_noisy`` and pushed
    up, the centres rise with it and the push has no fixed point. The noisy class's push
    lowers every logit of its rows, which the complementary loss (invariant to a row's
    shift) does not oppose (measured on ``large_global`` at 60% noise: the energies rose
    from -2 to +7 in 10 main epochs, the image and caption embeddings drifted apart until
    every sigmoid score was ~0 and the hinge stalled at its margin; on the digits folder
    from -2.3 to +8.7, test rSum 170). With a re-measured division use ``lambda1=0``
    (the energies then divide, they are not pushed; ``configs/srem.py:vectors``), or
    ``'warmup'`` to keep the energy-bounded loss.

    All three move with the energies under :math:`E \to aE + c`, so the division is
    invariant to a shift of the logits and to the batch size's ``-log B``. The first epoch
    of a run without warm-up has no energies yet and uses the constants. The cosine head's
    ``cosine_temperature`` and ``cosine_shift`` stay fixed: with the calibrated division
    the shift only moves the sigmoid scores ``S`` of the hinge (Eq. 6) and of the
    selection probabilities (Eq. 10, whose offset ``b = 0.5`` expects a score in
    ``(0, 1)``), and the temperature 0.1 is InfoNCE's, the scale at which the softmax,
    entropy (Eq. 4) and complementary probabilities (Eq. 13) are read.

    **Fallback**: a main-phase batch whose clean split in a direction holds no real pair,
    or every one, divides nothing (its hinge would train no pair, or every noisy one, and
    its energy loss would push every energy one way). With ``calibration='data'`` that
    direction is first divided by the Otsu split of the batch's own energies
    (:func:`batch_division`: the energies can outrun a division measured on the previous
    epoch); a direction that still divides nothing, and every such direction under
    ``'warmup'`` and ``'paper'``, trains its warm-up objective (complementary learning
    over every negative) instead,
    ``division_fallback`` in the step metrics. The refresh says so once per epoch with a
    warning ("fallback"), as it does when an epoch's energies hold fewer than two distinct
    values (the previous calibration is kept); the refresh diagnostic
    ``division_fallback`` is 1 for such an epoch.

    **The partner test** (``division='partner'``, ncljax's; ``configs/srem.py:vectors``).
    Eq. 2 keeps a pair whose energy is below the threshold and whose partner ranks first
    in its row. Both cut clean pairs off on data without mismatches: the two-class energy
    split cuts a share off whatever the data (on clean real folders it kept 11-50% of
    the pairs), and a weak model ranks many true partners second or fifth. The partner
    test keeps a pair when its partner's logit beats the row's negatives at a level:
    the in-batch permutation p-value (``ncljax.labels.srem.partner_p_value``) is at most
    ``partner_level``, so at 0.05 a mismatched pair (its partner exchangeable with the
    negatives) passes with probability at most 5%, and a batch without mismatched pairs
    may be kept whole (then it is no degenerate division: it trains the main objective).
    The threshold ``tau`` and the calibration's threshold are then unused (the
    calibration's margins still set the energy-bounded loss when ``lambda1 > 0``).

    **The clean pairs' ranking term** (``ranking``). The paper's (Eq. 7) is the weighted
    hinge on the hardest negative; ``'contrastive'`` (ncljax's, as ``ncljax.methods.ncr``'s
    switch) trains each clean query with the InfoNCE of its row of logits ``F`` instead
    (``-log softmax(F_i)_i``, the direction's share, times the swapped weight's place
    taken by 1), the objective the baselines train with on clean data. Measured on real
    folders (``configs/srem.py:vectors``; the digits, MNIST and breast cancer feature
    halves of the robustness report, three seeds, test rSum against InfoNCE's): the
    energy split with the hinge lost 23-28 at 0% mismatched; the partner test with the
    contrastive term (cosine temperature 0.07) is within 6 of InfoNCE on two of the three
    clean folders (17 below on the breast cancer features) and gains 16-31 over the
    energy split at 40% and 31-58 at 60%.

    **Warm-up from a random start.** Eq. 10 weights a negative by
    :math:`\exp(\beta(S_{ij} - b))` with the absolute offset ``b = 0.5`` on the sigmoid
    score. With the model's scores well below ``b`` (the cosine head's at cosines near 0,
    as on ``small_global``) ``Q`` is uniform and the warm-up is plain complementary learning; once
    the scores of a random model sit near or above ``b`` (the cosine head's common level
    is free under the row softmax and drifts there on some data: energies of -5.5 at
    ``B = 64``, -7.5 at ``B = 256``), ``Q`` is biased by up to a factor ``e`` towards
    whatever the random model ranks high. Near a flat softmax the positive's pull is only
    :math:`p_{ii} \approx 1/B`, and the gradient of the biased term instead moves 85-93%
    of the negatives *up* (towards the ones ``Q`` favours), about four times the
    positive's pull summed over a row: the warm-up equalises the similarities instead of
    learning them (``synthetic,world=strong_classes`` at 40% noise: validation rSum 248
    after epoch 0, 183 after epoch 1; the loss flat at its uniform value ~2.0). With
    uniform complementary labels in the warm-up it learns (326, then 378) and the main
    phase, which rectifies with ``rectify``, starts from a model whose similarities mean
    something (test rSum 186 -> 269 on that world; 237 -> 437 on ``large_global``).

    Attributes:
      tau: energy threshold of the clean split (Eq. 2) [inferred: -2, between the
        paper's margins; worth a sweep over -4..0]; with ``calibration='data'`` only for the
        first epoch of a run without warm-up. A threshold that selects nothing is allowed;
        an epoch that selected nothing is logged as a warning.
      m_clean: energy margin of clean pairs (Eq. 3) [paper, Fig. 4: -4]; likewise.
      m_noisy: energy margin of noisy pairs [paper, Fig. 4: 0]; ``m_clean <= m_noisy``.
      alpha: hinge margin (Eq. 6) [inferred: 0.2, NCR/SGRAF's].
      ms_beta: sharpness of the selection probabilities (Eq. 10) [inferred: 50, MS's].
      ms_b: their offset [inferred: 0.5, MS's].
      lambda1: weight of the energy-bounded loss [inferred: 0.05; the paper: in [0, 1]].
      lambda2: weight of the complementary loss [inferred: 1.0; the paper: in [0, 1]].
      cl_reduction: ``'sum'`` (each query's complementary terms summed, RCL's scale) or
        ``'mean'`` (the literal expectation) [inferred: 'sum', RCL's scale].
      cl_prob: the probability pushed down by the complementary loss: ``'softmax'`` of the
        row of logits [inferred, as RCL's], ``'sigmoid'`` score (collapses in warm-up, logged) or
        ``'rcl'`` (``softmax(sigmoid(F) / rcl_tau)``, RCL's).
      rcl_tau: temperature of ``cl_prob='rcl'`` [RCL: 0.05].
      rectify: ``'biased'`` (Eqs. 10-12) [inferred], ``'uniform'`` (the "without label
        rectification" ablation), ``'matmul_PQ'``/``'matmul_QtP'`` (literal, degenerate
        readings of Eq. 12, ablations only).
      sgw_indicator: ``'literal'`` (the swapped weight carries the other direction's
        indicator, Eqs. 5-6 as printed) [inferred] or ``'loss_direction'`` (the entropy is
        swapped, the indicator is the loss's own).
      gradient_weighting: swapped gradient weighting; ``False`` is the paper's "without
        gradient weighting" ablation (``omega = 1``); it weights the hinge,
        so with ``ranking='contrastive'`` ``omega = 1`` too.
      clean_set: ``'per_direction'`` [inferred], ``'and'`` or ``'or'`` of the two splits.
      warmup_epochs: epochs of complementary learning alone [paper: 5].
      warmup_lambda2: multiply the warm-up loss by ``lambda2`` [inferred: no; unstated].
      cosine_temperature: cosine head only, ``F = (cos - cosine_shift) / cosine_temperature``
        (see the module docstring) [ncljax: 0.1].
      cosine_shift: cosine head only [ncljax: 0.5].
      calibration: ``'data'`` (threshold and margins re-measured before every epoch on
        the previous epoch's energies, see above) [ncljax], ``'warmup'`` (measured up to
        the first main epoch, then frozen) or ``'paper'`` (``tau``, ``m_clean``,
        ``m_noisy`` as given).
      warmup_rectify: the complementary labels of the warm-up, ``'uniform'`` [ncljax; see
        "Warm-up from a random start" above] or ``'biased'`` (``rectify``'s Eqs. 10-12
        from the first step, the paper's reading; the configs of f30k, coco and cc152k);
        the main phase uses ``rectify``.
      division: the clean split, ``'energy'`` (Eq. 2: energy threshold and the partner
        ranked first) [paper] or ``'partner'`` (the partner test, see above) [ncljax].
      partner_level: the partner test's level in ``(0, 1]`` (``division='partner'``)
        [ncljax: 0.05].
      ranking: the clean pairs' term, ``'hinge'`` (Eq. 7) [paper] or ``'contrastive'``
        (InfoNCE of the logits, see above) [ncljax].
      noise_share: ``'none'`` [paper] or ``'partner'`` [ncljax; ``division='partner'``
        only]: every step writes each pair's partner p-value (image to caption), and an
        epoch whose previous epoch's p-values bound the mismatched share below
        ``noise_floor``, where the validation split's estimate agrees
        (``ncljax.labels.share.switch_off``), runs the partner test at level 1, i.e.
        keeps every pair: with next to no mismatched pair, the test's rejections are
        hard clean pairs (the breast cancer halves at 0%: 17 below InfoNCE with it).
      noise_floor: that floor [ncljax: 0.05].
      partner_rule: the partner test's level from one epoch to the next, ``'level'``
        (``partner_level`` throughout) or ``'share'`` [ncljax; ``noise_share='partner'``
        only]: the level at which the last epoch's p-values keep all but the share of
        pairs its bound allows to be mismatched (their ``1 - bound`` quantile), never
        below ``partner_level``. A model that places matched pairs weakly gives them
        p-values well above 0.05: at a fixed level the test then keeps few pairs
        (11-34% of the clean pairs of a weak synthetic world in the first main epochs),
        and those it rejects train no pull towards their partner. The bound errs high
        on such a model, so the rule keeps no more pairs than are clean; where the
        model places its matched pairs first, the quantile falls below
        ``partner_level`` and the rule is the fixed level. Where the model has learnt
        mismatched pairs the bound errs low and the rule keeps some of them (the MNIST
        halves at 60%: levels of 0.07-0.12 in the first three main epochs, then 0.05).
        Measured (benchmarks/RESULTS.md, "SREM's partner test at the level the share
        bound sets"): a weak synthetic world 40.4 -> 51.7 rSum at 0% (InfoNCE 49.8),
        24.1 -> 28.1 at 40%; the real halves -1.4 on average at 40-60%.
      block_rows: each direction's ``[B, B]`` terms are computed this many query rows at a
        time where the batch is a larger multiple of it (``srem_loss``'s ``block_rows``;
        0: the whole batch at once) [ncljax: 256]. The same objective to
        round-off; at ``B = 4096`` on the :vectors path its loss and gradient take
        0.82 s instead of 1.75 s on a 2-core CPU (benchmarks/RESULTS.md). Batches of 256
        pairs or fewer (the papers' 128) are one block whatever it is.
    """

    tau: float = -2.0
    m_clean: float = -4.0
    m_noisy: float = 0.0
    alpha: float = 0.2
    ms_beta: float = 50.0
    ms_b: float = 0.5
    lambda1: float = 0.05
    lambda2: float = 1.0
    cl_reduction: str = "sum"
    cl_prob: str = "softmax"
    rcl_tau: float = 0.05
    rectify: str = "biased"
    sgw_indicator: str = "literal"
    gradient_weighting: bool = True
    clean_set: str = "per_direction"
    warmup_epochs: int = 5
    warmup_lambda2: bool = False
    cosine_temperature: float = 0.1
    cosine_shift: float = 0.5
    calibration: str = "data"
    warmup_rectify: str = "uniform"
    division: str = "energy"
    partner_level: float = 0.05
    ranking: str = "hinge"
    noise_share: str = "none"
    noise_floor: float = 0.05
    partner_rule: str = "level"
    block_rows: int = 256


RANKINGS = ("hinge", "contrastive")
_CHOICES = {
    "cl_reduction": srem_losses.CL_REDUCTIONS,
    "cl_prob": srem_losses.CL_PROBS,
    "rectify": srem_losses.RECTIFY,
    "warmup_rectify": srem_losses.RECTIFY,
    "sgw_indicator": selection.SGW_INDICATORS,
    "clean_set": selection.CLEAN_SETS,
    "calibration": CALIBRATIONS,
    "division": selection.DIVISIONS,
    "ranking": RANKINGS,
    "noise_share": share_lib.MODES,
    "partner_rule": ("level", "share"),
}
# The rule of each setting (``settings.check``), in the order its messages are joined.
CHECKS = {name: settings.one_of(*allowed) for name, allowed in _CHOICES.items()}
CHECKS |= dict.fromkeys(("tau", "m_clean", "m_noisy", "ms_b", "cosine_shift"), settings.FINITE)
CHECKS |= dict.fromkeys(("alpha", "lambda1", "lambda2"), settings.NON_NEGATIVE)
CHECKS |= dict.fromkeys(("ms_beta", "rcl_tau", "cosine_temperature"), settings.POSITIVE)
CHECKS |= dict.fromkeys(("gradient_weighting", "warmup_lambda2"), settings.BOOLEAN)
CHECKS["warmup_epochs"] = settings.NON_NEGATIVE_INT
CHECKS["partner_level"] = settings.interval(0, 1, low_open=True)
CHECKS["noise_floor"] = settings.UNIT_INTERVAL
CHECKS["block_rows"] = settings.NON_NEGATIVE_INT


def validate(values) -> None:
    """Refuses ``m_clean > m_noisy`` and ``noise_share='partner'`` without the partner
    test (after every setting passed its own rule)."""
    settings.require(
        values["m_clean"] <= values["m_noisy"],
        "srem",
        "m_clean",
        f"<= m_noisy={values['m_noisy']} (clean energies are pushed below it, noisy above)",
        values["m_clean"],
    )
    settings.require(
        values["noise_share"] == "none" or values["division"] == "partner",
        "srem",
        "noise_share",
        "'none' unless division='partner' (it switches the partner test off)",
        values["noise_share"],
    )
    settings.require(
        values["partner_rule"] == "level" or values["noise_share"] == "partner",
        "srem",
        "partner_rule",
        "'level' unless noise_share='partner' (the share rule reads its bound)",
        values["partner_rule"],
    )


def calibrated(s: Settings) -> bool:
    """Whether the division is measured on the data (``calibration='data'`` or ``'warmup'``)."""
    return s.calibration != "paper"


def paper_division(s: Settings) -> jax.Array:
    """The given threshold and margins, ``[direction, (tau, m_clean, m_noisy)]`` ``[2, 3]``."""
    return jnp.asarray([[s.tau, s.m_clean, s.m_noisy]] * 2, jnp.float32)


def init_memory(s: Settings, ctx: base.InitContext) -> base.Memory:
    """Zero energies and splits per pair (``energy_epoch`` -1: written by no epoch yet) and
    the given division as the calibration."""
    zeros = jnp.zeros(ctx.num_samples, jnp.float32)
    samples = {name: zeros for name in _ROWS}
    samples["energy_epoch"] = jnp.full(ctx.num_samples, -1.0, jnp.float32)
    state = {"calibration": paper_division(s)}
    if s.noise_share == "partner":  # p-values of 1 and the test on until an epoch is seen
        samples["partner_p"] = jnp.ones(ctx.num_samples, jnp.float32)
        state["division_off"] = jnp.zeros((), jnp.float32)
    if s.partner_rule == "share":  # the test's level, set by each refresh
        state["partner_level"] = jnp.asarray(s.partner_level, jnp.float32)
    return base.Memory(samples=samples, state=state)


def logits(s: Settings, outputs) -> jax.Array:
    """``F`` ``[B, B]``: the head's logit, or the cosine head's shifted, scaled cosine."""
    if "logit" in outputs:
        return outputs["logit"]
    return (outputs["sim"] - s.cosine_shift) / s.cosine_temperature


def objective(s: Settings, logit, *, warmup: bool, division, where, level=None):
    """``srem_loss`` with the settings and the division ``[2, 3]`` in use (the partner
    test at ``level``, default ``partner_level``)."""
    return srem_loss(
        logit,
        warmup=warmup,
        threshold=division[:, 0],
        m_clean=division[:, 1],
        m_noisy=division[:, 2],
        where=where,
        margin=s.alpha,
        beta=s.ms_beta,
        offset=s.ms_b,
        lambda1=s.lambda1,
        lambda2=s.lambda2,
        cl_reduction=s.cl_reduction,
        cl_prob=s.cl_prob,
        rcl_temperature=s.rcl_tau,
        rectify=s.rectify,
        sgw_indicator=s.sgw_indicator,
        gradient_weighting=s.gradient_weighting,
        clean_set=s.clean_set,
        warmup_lambda2=s.warmup_lambda2,
        fallback=True,
        warmup_rectify=s.warmup_rectify,
        division=s.division,
        partner_level=s.partner_level if level is None else level,
        ranking=s.ranking,
        block_rows=s.block_rows,
    )


def loss(s: Settings, outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """The per-pair objective, its terms and splits as metrics, and the memory rows
    (energies, splits, fallback, the epoch that wrote them)."""
    del rows, peer_rows
    warmup = ctx.phase == base.WARMUP
    paper = paper_division(s)
    state = ctx.memory_state or {}
    division = state.get("calibration", paper) if calibrated(s) else paper
    f = logits(s, outputs)
    if s.calibration == "data" and s.division == "energy" and not warmup:
        division = batch_division(s, f, division, batch["mask"])
    level = None
    if s.noise_share == "partner":  # the division off: the test at level 1 keeps every pair
        level = jnp.where(
            state["division_off"] > 0.5, 1.0, state.get("partner_level", s.partner_level)
        )
    per_pair, views = objective(
        s, f, warmup=warmup, division=division, where=batch["mask"], level=level
    )
    i2t, t2i = views["i2t"], views["t2i"]
    partner = jax.lax.stop_gradient(jnp.diagonal(f))  # log p_ii = F_ii - logsumexp_j F_ij
    clean_i2t, clean_t2i = i2t.clean.astype(jnp.float32), t2i.clean.astype(jnp.float32)
    fell_back = jnp.asarray(i2t.fallback | t2i.fallback, jnp.float32)
    fell_back = jnp.broadcast_to(fell_back, clean_i2t.shape)
    metrics = {
        "selected_i2t": clean_i2t,
        "selected_t2i": clean_t2i,
        "energy_i2t": i2t.energy,
        "energy_t2i": t2i.energy,
        "loss_complementary": i2t.complementary + t2i.complementary,
    }
    memory = {
        "energy_i2t": i2t.energy,
        "energy_t2i": t2i.energy,
        "partner_i2t": partner + i2t.energy,
        "partner_t2i": partner + t2i.energy,
        "clean_i2t": clean_i2t,
        "clean_t2i": clean_t2i,
        "division_fallback": fell_back,
        "energy_epoch": jnp.broadcast_to(jnp.asarray(ctx.epoch, jnp.float32), clean_i2t.shape),
    }
    if s.noise_share == "partner":  # the partner test's own p-values (image to caption)
        memory["partner_p"] = i2t.partner_p
    applied = None
    if not warmup:
        metrics |= {
            "loss_hinge": 0.5 * (i2t.hinge + t2i.hinge),
            "loss_energy": i2t.energy_loss + t2i.energy_loss,
            "weight_i2t": i2t.weight,
            "weight_t2i": t2i.weight,
            "division_fallback": fell_back,
        }
        applied = i2t.pull + t2i.pull
    aux = base.Aux(
        metrics=metrics,
        memory=memory,
        clean_estimates={"i2t": clean_i2t, "t2i": clean_t2i},
        applied_weight=applied,
    )
    return per_pair, aux


def batch_division(s: Settings, f, division, mask):
    """The epoch's division, re-measured on the batch's own energies in each direction
    whose split under it would be degenerate (no pair or every pair selected).

    The epoch's division is measured on the previous epoch's energies; the energies can
    move faster than that within an epoch (on real folders they rose by 4 in the first main
    epoch, past the threshold, and 10-17% of the main phase's steps fell back). A batch
    that the epoch's threshold does not divide is divided by the Otsu split of its own
    energies (``ncljax.labels.srem.calibrate_energy``) before any fallback; only a batch
    that divides nothing under that too trains the warm-up objective.

    Args:
      s: the settings (``clean_set``).
      f: ``[B, B]`` logits ``F`` (image-to-text rows).
      division: ``[2, 3]`` the epoch's division.
      mask: bool ``[B]``, the real pairs.
    """
    f = jax.lax.stop_gradient(f)
    views = (f, f.T)
    clean = [selection.clean_mask(v, division[i, 0], where=mask) for i, v in enumerate(views)]
    clean = selection.combine_clean_masks(*clean, s.clean_set)
    rows = []
    for i, view in enumerate(views):
        fit = selection.calibrate_energy(selection.energy(view, where=mask), where=mask)
        own = jnp.stack([fit.threshold, fit.m_clean, fit.m_noisy])
        stale = selection.degenerate_division(clean[i], where=mask) & ~fit.degenerate
        rows.append(jnp.where(stale, own, division[i]))
    return jnp.stack(rows).astype(division.dtype)


def calibrate(s: Settings, memory: base.Memory, epoch: int):
    """The division calibrated on the energies the previous epoch's steps wrote, or the
    previous one where they divide nothing: ``(division [2, 3], degenerate, diagnostics)``."""
    samples = memory.samples
    previous = memory.state.get("calibration", paper_division(s))
    if not calibrated(s):
        return previous, False, {}
    if s.calibration == "warmup" and epoch > max(s.warmup_epochs, 1):
        return previous, False, {}  # frozen since the first main epoch
    last = None
    if "energy_epoch" in samples:  # the pairs the epoch that ended trained on
        last = np.asarray(samples["energy_epoch"]) == epoch - 1
    rows, degenerate, diagnostics = [], False, {}
    for i, d in enumerate(_DIRECTIONS):
        fit = selection.calibrate_energy(samples[f"energy_{d}"], where=last)
        diagnostics[f"calibrated_clean_fraction_{d}"] = float(fit.clean_fraction)
        diagnostics[f"calibrated_separation_{d}"] = float(fit.separation)
        if bool(fit.degenerate):
            degenerate = True
            rows.append(previous[i])
            continue
        rows.append(jnp.stack([fit.threshold, fit.m_clean, fit.m_noisy]))
    division = jnp.stack(rows).astype(jnp.float32)
    return division, degenerate, diagnostics


def division_diagnostics(division) -> dict[str, float]:
    """``calibrated_<tau|m_clean|m_noisy>_<direction>`` of a division ``[2, 3]``."""
    diagnostics = {}
    for i, d in enumerate(_DIRECTIONS):
        for j, name in enumerate(("tau", "m_clean", "m_noisy")):
            diagnostics[f"calibrated_{name}_{d}"] = float(division[i, j])
    return diagnostics


def fallback_reasons(
    s: Settings, epoch: int, fractions: dict, batches_fell_back: float, degenerate: bool
) -> list[str]:
    """Why the epoch that ended (``epoch - 1``) divided nothing or fell back, one clause
    each (empty: it divided)."""
    # From the last warm-up epoch on: its (logged) selection is what the main phase meets.
    divides = epoch >= max(s.warmup_epochs, 1)
    reasons = []
    if divides and not any(fractions.values()):
        threshold = "calibrated" if calibrated(s) else s.tau
        # The main phase's hinge then pulled no pair: its noisy share is 0 / 0.
        pulled = (
            "; nothing was pulled, so its noisy_weight_share is undefined (logged null)"
            if epoch - 1 >= s.warmup_epochs
            else ""
        )
        reasons.append(
            f"selected no clean pair in epoch {epoch - 1} (tau={threshold}): a main "
            f"batch that selects none trains the warm-up objective (fallback){pulled}. "
            "Raise method_kwargs.tau or use method_kwargs.calibration='data'"
        )
    elif divides and batches_fell_back > 0:
        reasons.append(
            f"{batches_fell_back:.1%} of the pairs of epoch {epoch - 1} were in "
            "batches whose division selected no pair or every pair: those batches "
            "trained the warm-up objective (fallback)"
        )
    if degenerate:
        reasons.append(
            f"the energies of epoch {epoch - 1} hold fewer than two distinct values: "
            "the previous calibrated threshold and margins are kept (fallback)"
        )
    return reasons


def refresh(s: Settings, memory: base.Memory, stats, ctx) -> tuple[base.Memory, dict]:
    """Calibrates the division (``calibration='data'``: before every epoch; ``'warmup'``:
    up to the first main epoch), warns when the epoch that ended selected nothing or fell
    back, and reports its selection."""
    del stats
    samples = memory.samples
    fractions = {d: float(np.asarray(samples[f"clean_{d}"]).mean()) for d in _DIRECTIONS}
    fell_back = np.asarray(samples.get("division_fallback", np.zeros(1)))
    if "energy_epoch" in samples:  # the pairs the epoch that ended trained on
        fell_back = fell_back[np.asarray(samples["energy_epoch"]) == ctx.epoch - 1]
    batches_fell_back = float(fell_back.mean()) if fell_back.size else 0.0
    division, degenerate, diagnostics = calibrate(s, memory, ctx.epoch)
    reasons = fallback_reasons(s, ctx.epoch, fractions, batches_fell_back, degenerate)
    if reasons:
        logging.warning("srem: network %d %s.", ctx.network, "; ".join(reasons))
    if calibrated(s):
        diagnostics |= division_diagnostics(division)
    diagnostics |= {f"selected_fraction_{d}": v for d, v in fractions.items()}
    diagnostics["division_fallback"] = float(bool(reasons))
    state = dict(memory.state) | {"calibration": division}
    if s.noise_share == "partner":
        last = np.asarray(samples["energy_epoch"]) == ctx.epoch - 1
        share = share_lib.noise_share(samples["partner_p"], where=last)
        off, held = share_lib.switch_off(
            share, s.noise_floor, ctx.held_out, divide=share_lib.divides(ctx)
        )
        state["division_off"] = jnp.asarray(off, jnp.float32)
        if s.partner_rule == "share":
            p, level = np.asarray(samples["partner_p"])[last], s.partner_level
            if p.size:  # keep all but the bounded share: the 1 - bound quantile
                level = max(level, float(np.quantile(p, 1.0 - float(share.bound))))
            state["partner_level"] = jnp.asarray(level, jnp.float32)
            diagnostics["partner_level"] = level
        diagnostics |= {k: float(v) for k, v in share_lib.diagnostics(share, off, held).items()}
    return base.Memory(samples=samples, state=state), diagnostics


def plan_problems(s: Settings, name: str, epochs: int) -> list[str]:
    """A run must outlast the warm-up (``base.warmup_problems``)."""
    return base.warmup_problems(name, s.warmup_epochs, epochs)


def plan(s: Settings, epoch: int) -> base.EpochPlan:
    """``warmup_epochs`` of warm-up, then the main phase; a refresh before every epoch but
    the first; the learning rate's epochs counted from the end of the warm-up; full batches
    where the energy split divides (the energy carries ``-log B``, so its threshold and
    margins hold for one batch size). The partner test reads a p-value, which holds for
    any batch, so with ``division='partner'`` the last partial batch trains too (on the
    breast cancer halves' 369 training pairs at batch 128 full batches skip 113 pairs, a
    third of every epoch: at 0% mismatched SREM then lost 12.3 rSum to InfoNCE, three
    seeds)."""
    return base.EpochPlan(
        phase=base.WARMUP if epoch < s.warmup_epochs else base.MAIN,
        refresh=epoch > 0,
        lr_epoch=max(0, epoch - s.warmup_epochs),
        min_batch=2,
        drop_remainder=s.division != "partner",
    )


def energy_score(memory: base.Memory, *, tau: float) -> jax.Array:
    """``sigmoid(tau - E)`` of the mean energy of a pair's two queries, ``tau`` the mean of
    the two directions' thresholds in use (``memory.state['calibration']``; the given one
    without it): above 1/2 where the energy half of Eq. 2 selects the pair (a diagnostic:
    the run's clean score is ``partner_score``)."""
    s = memory.samples
    if "calibration" in memory.state:
        tau = jnp.mean(memory.state["calibration"][:, 0])
    return jax.nn.sigmoid(tau - 0.5 * (s["energy_i2t"] + s["energy_t2i"]))


def partner_score(memory: base.Memory) -> jax.Array:
    """The geometric mean of the pair's two partner probabilities, as the training steps
    last saw them: ``sqrt(p_ii^{i2t} p_ii^{t2i})`` with ``p_ii = softmax(F_i:)_i`` of the
    query's row of in-batch logits (the ``B``-way classification SREM reads each row as).

    The clean split of Eq. 2 asks two things of a pair, a low energy (a confident row) and
    its partner ranked first; ``log p_ii = F_ii + E_i`` is the soft form of both at once.
    The energy alone measures how confident a query is about *some* candidate, not whether
    that candidate is its partner: on real data with class structure a mismatched image
    sits as confidently among its class's captions as a matched one, and ranking pairs by
    ``sigmoid(tau - E)`` (``energy_score``) found the mismatched pairs at chance (AUC 0.54
    on 40%-mismatched digits halves, where this score gives 0.69-0.95 across the real and
    synthetic folders measured). The logs' ``clean_precision`` and ``clean_recall`` cut it
    at 1/2: the pairs whose partner holds more than half of both its rows' probability
    (few early in training; null where none does).
    """
    s = memory.samples
    return jnp.exp(0.5 * (s["partner_i2t"] + s["partner_t2i"]))


def diagnostic_scores(memory: base.Memory) -> dict:
    """Per-pair scores for the logs and the notebook (higher means cleaner): the negative
    energies of the image and caption queries and each direction's clean split, as the
    training steps last saw them."""
    s = memory.samples
    return {
        "partner": partner_score(memory),
        "neg_energy_i2t": -s["energy_i2t"],
        "neg_energy_t2i": -s["energy_t2i"],
        "selected_i2t": s["clean_i2t"],
        "selected_t2i": s["clean_t2i"],
    }


def log_settings(s: Settings) -> None:
    """Logs the values the paper does not give, and warns of a sigmoid warm-up."""
    if s.cl_prob == "sigmoid" and s.warmup_epochs:
        logging.warning(
            "srem: cl_prob='sigmoid' in a warm-up of complementary learning alone has the "
            "trivial solution 'every similarity -> 0' (RCL's softmax ties negatives to the "
            "positive)."
        )
    logging.info(
        "srem: values the paper does not give (inferred defaults): tau=%s alpha=%s ms_beta=%s "
        "ms_b=%s lambda1=%s lambda2=%s cl_reduction=%s cl_prob=%s sgw_indicator=%s "
        "clean_set=%s",
        s.tau,
        s.alpha,
        s.ms_beta,
        s.ms_b,
        s.lambda1,
        s.lambda2,
        s.cl_reduction,
        s.cl_prob,
        s.sgw_indicator,
        s.clean_set,
    )


VERDICT = base.Verdict(
    "the geometric mean of the pair's two in-batch partner probabilities softmax(F)_ii",
    None,
    "SREM divides each batch by energy and argmax (Eq. 2); no cut on this score",
)


def bind(s: Settings) -> base.Method:
    """SREM's bundle: the functions above with the settings ``s`` bound."""
    log_settings(s)
    return base.bind_module(
        sys.modules[__name__],
        s,
        clean_score_fn=partner_score,
        verdict=VERDICT,
        diagnostic_scores_fn=diagnostic_scores,
    )


srem = settings.factory(
    "srem", Settings, CHECKS, bind, validate=validate, plan_problems=plan_problems
)


# --- the objective of both directions (the estimators of ncljax.labels.srem composed with
# the losses of ncljax.losses.srem) ------------------------------------------------------


class SREMDirection(NamedTuple):
    """The per-batch quantities of one retrieval direction (all ``[B]`` unless noted).

    Attributes:
      energy: :math:`E` (Eq. 1).
      clean: bool, the clean split the losses use (Eq. 2 and ``clean_set``; in warm-up the
        selection Eq. 2 would make, for the logs only).
      hard_negative: int, :math:`\\phi`.
      entropy: normalised entropy :math:`e` (Eq. 4); 0 with ``ranking='contrastive'``.
      argument: hinge argument :math:`a` (Eq. 5).
      weight: swapped weight :math:`\\omega` used by this direction's hinge (Eq. 6).
      mask: bool ``[B, B]``, complementary candidates :math:`\\mathcal A` (Eq. 11); ``None``
        where the objective was computed in blocks of rows (``block_rows``).
      q: ``[B, B]``, :math:`\\mathbf Q` (Eq. 12); ``None`` likewise.
      hinge: shares of :math:`L_w` (0 in warm-up).
      energy_loss: shares of :math:`L_u` (0 in warm-up).
      complementary: per-query :math:`L_c` terms.
      pull: positive gradient of the hinge, :math:`-\\partial L_w/\\partial S_{ii}` of the
        summed hinge (0 in warm-up; the noisy gradient ratio's numerator on noisy pairs).
      fallback: bool scalar, this direction's division was degenerate and it trained the
        warm-up objective instead (``fallback=True`` of :func:`srem_loss` only).
      partner_p: ``[B]`` the partner test's p-values (``division='partner'``; else ``None``).
    """

    energy: jax.Array
    clean: jax.Array
    hard_negative: jax.Array
    entropy: jax.Array
    argument: jax.Array
    weight: jax.Array
    mask: jax.Array
    q: jax.Array
    hinge: jax.Array
    energy_loss: jax.Array
    complementary: jax.Array
    pull: jax.Array
    fallback: jax.Array | bool = False
    partner_p: jax.Array | None = None


def srem_loss(
    logits: ArrayLike,
    *,
    warmup: bool = False,
    threshold: ArrayLike = -2.0,
    m_clean: ArrayLike = -4.0,
    m_noisy: ArrayLike = 0.0,
    margin: float = 0.2,
    beta: float = 50.0,
    offset: float = 0.5,
    lambda1: float = 0.05,
    lambda2: float = 1.0,
    cl_reduction: str = "sum",
    cl_prob: str = "softmax",
    rcl_temperature: float = 0.05,
    rectify: str = "biased",
    sgw_indicator: str = "literal",
    gradient_weighting: bool = True,
    clean_set: str = "per_direction",
    warmup_lambda2: bool = False,
    fallback: bool = False,
    warmup_rectify: str | None = None,
    division: str = "energy",
    partner_level: float = 0.05,
    ranking: str = "hinge",
    where: ArrayLike | None = None,
    block_rows: int | None = None,
) -> tuple[jax.Array, dict[str, SREMDirection]]:
    r"""SREM's total objective over both retrieval directions, per pair.

    Main training (the paper's total objective, Sec. "Model Optimization"):

    .. math::
      L = \tfrac12(L_w^{i2t} + L_w^{t2i}) + \lambda_1(L_u^{i2t} + L_u^{t2i})
        + \lambda_2(L_c^{i2t} + L_c^{t2i})

    Warm-up: :math:`L_c^{i2t} + L_c^{t2i}` with no row clean (every negative is a complementary
    candidate), times :math:`\lambda_2` only with ``warmup_lambda2``. Pair ``i``'s share sums
    its image query's terms (row ``i`` of ``F``) and its caption query's (row ``i`` of
    ``F.T``).

    The clean split is Eq. 2's (``division='energy'``) or the partner test
    (``'partner'``: ``ncljax.labels.srem.partner_test_mask`` at ``partner_level``, ncljax's),
    and the clean pairs' ranking term the weighted hinge of Eq. 7 (``ranking='hinge'``) or
    the InfoNCE of the direction's row of logits, :math:`-\log\mathrm{softmax}(F_i)_i`
    (``'contrastive'``, ncljax's).

    Fallback (``fallback=True``, main training only): a direction whose clean set (after
    ``clean_set``) holds no real pair of the batch, or every one (under the energy
    split; the partner test may keep a batch whole), divides nothing; its hinge
    would train nothing (or every noisy pair) and its energy loss would push every energy
    one way. That direction trains its warm-up term instead (:math:`L_c` with no row
    clean, weighted as in warm-up) and flags ``fallback``.

    Args:
      logits: ``[B, B]`` logits ``F`` (rows images, columns captions, pairs on the diagonal).
      warmup: the warm-up objective (static).
      threshold: energy threshold :math:`\tau` of the clean split (-2): a scalar, or ``[2]``
        (image-to-text, text-to-image) for one per direction; may be traced.
      m_clean: clean energy margin (-4), scalar or ``[2]`` likewise.
      m_noisy: noisy energy margin (0), scalar or ``[2]`` likewise.
      margin: hinge margin :math:`\alpha` (0.2).
      beta: sharpness :math:`\beta` of the selection probabilities (50).
      offset: offset :math:`b` of the selection probabilities (0.5).
      lambda1: weight of :math:`L_u` (0.05).
      lambda2: weight of :math:`L_c` (1.0).
      cl_reduction: ``'sum'`` or ``'mean'`` (see :func:`ncljax.losses.complementary_loss`).
      cl_prob: ``'softmax'``, ``'sigmoid'`` or ``'rcl'`` (the same).
      rcl_temperature: temperature of ``cl_prob='rcl'`` (0.05).
      rectify: ``'biased'`` (Eqs. 10-12), ``'uniform'`` (no label rectification),
        ``'matmul_PQ'`` or ``'matmul_QtP'`` (literal Eq. 12 readings with the biased ``Q``).
      sgw_indicator: ``'literal'`` or ``'loss_direction'`` (see
        ``ncljax.labels.srem.swap_weights``).
      gradient_weighting: swapped gradient weighting of the hinge; ``False``, or
        ``ranking='contrastive'``: :math:`\omega \equiv 1`.
      clean_set: ``'per_direction'``, ``'and'`` or ``'or'``.
      warmup_lambda2: multiply the warm-up loss by :math:`\lambda_2`.
      fallback: a degenerate division trains the warm-up objective (see above; static).
      warmup_rectify: ``rectify`` of the warm-up objective (``None``: ``rectify``).
      division: ``'energy'`` (Eq. 2) or ``'partner'`` (the partner test; static).
      partner_level: the partner test's level (0.05).
      ranking: ``'hinge'`` (Eq. 7) or ``'contrastive'`` (static).
      where: optional bool ``[B]``, the real pairs.
      block_rows: compute each direction's ``[B, B]`` terms ``block_rows`` query rows at a
        time (static; ``None`` or 0: all at once). Every term but the fallback's batch-wide test
        and the subset means is a function of one query's row, so the values are the same
        to round-off; what changes is the memory traffic: each block's passes stay in
        cache, and nothing ``[B, B]`` but the logits, their transpose and their gradient is
        written (the directions' ``mask`` and ``q`` are then ``None``). Used where ``B``
        is a multiple of ``block_rows`` larger than it, with ``form='expectation'``
        (``rectify`` not a ``matmul`` reading); otherwise one block. With
        ``cl_prob='softmax'`` a block's energies and complementary terms are then one
        function with its gradient written by hand (``_fused_terms``): fewer passes over
        the block, the same values, gradients equal to round-off.

    Returns:
      ``(loss, directions)``: ``[B]`` shares whose mean over the real pairs is :math:`L`, and
      ``{'i2t': SREMDirection, 't2i': SREMDirection}``.

    References:
      Dang et al., "Noisy Correspondence Learning with Self-Reinforcing Errors Mitigation",
      AAAI 2024, Sec. "Model Optimization".
    """
    if warmup and warmup_rectify is not None:
        rectify = warmup_rectify
    if rectify not in srem_losses.RECTIFY:
        raise ValueError(f"rectify must be one of {srem_losses.RECTIFY}, got {rectify!r}")
    if division not in selection.DIVISIONS:
        raise ValueError(f"division must be one of {selection.DIVISIONS}, got {division!r}")
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}")
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.result_type(logits, jnp.float32))
    num = logits.shape[0]
    valid = selection.valid_rows(num, where)
    views = {"i2t": logits, "t2i": logits.T}
    per_direction = {
        name: dict(
            zip(views, jnp.broadcast_to(jnp.asarray(value, logits.dtype), (2,)), strict=True)
        )
        for name, value in (("threshold", threshold), ("m_clean", m_clean), ("m_noisy", m_noisy))
    }
    matmul = rectify.startswith("matmul")
    block = num if matmul else masking.row_block(num, block_rows)
    estimates = _batch_estimates(
        views,
        valid,
        per_direction["threshold"],
        margin=margin,
        clean_set=clean_set,
        # the swapped weights weight the hinge only: the contrastive term pulls each clean
        # query with weight 1, and their entropies would be computed for nothing
        gradient_weighting=gradient_weighting and ranking != "contrastive",
        sgw_indicator=sgw_indicator,
        partner_level=partner_level if division == "partner" else None,
        entropies=ranking != "contrastive",
        block=block,
    )
    terms = functools.partial(
        _direction_terms,
        valid=valid,
        warmup=warmup,
        fallback=fallback,
        margin=margin,
        beta=beta,
        offset=offset,
        lambda1=lambda1,
        lambda2=lambda2,
        warmup_weight=lambda2 if warmup_lambda2 else 1.0,
        rectify=rectify,
        every_degenerate=division == "energy",
        contrastive=ranking == "contrastive",
        complementary=dict(
            reduction=cl_reduction,
            prob=cl_prob,
            rcl_temperature=rcl_temperature,
            form=rectify if matmul else "expectation",
            where=valid,
        ),
        block=block,
    )
    total = jnp.zeros(num, logits.dtype)
    directions = {}
    for d, f in views.items():
        bounds = {k: per_direction[k][d] for k in ("m_clean", "m_noisy")}
        share, directions[d] = terms(f, estimates[d], **bounds)
        total = total + share
    return jnp.where(valid, total, 0.0), directions


class _Estimates(NamedTuple):
    """One direction's estimates on the batch (``ncljax.labels.srem``; no gradient)."""

    clean: jax.Array
    hard_negative: jax.Array
    entropy: jax.Array
    argument: jax.Array
    weight: jax.Array
    partner_p: jax.Array | None


def _batch_estimates(
    views,
    valid,
    thresholds,
    *,
    margin,
    clean_set,
    gradient_weighting,
    sgw_indicator,
    partner_level=None,
    entropies=True,
    block,
) -> dict[str, _Estimates]:
    """Each direction's clean set (Eq. 2, or the partner test at ``partner_level``; after
    ``clean_set``), hardest negatives, entropies, hinge arguments and swapped weights (1
    without ``gradient_weighting``), and the partner test's p-values; the ``[B, B]`` passes
    ``block`` query rows at a time. The entropies are 0 without ``entropies`` (the
    contrastive ranking, whose weights are 1) and ``gradient_weighting``."""
    num = valid.shape[0]

    def block_estimates(f, rows, *, threshold):
        f = jax.lax.stop_gradient(f)
        at = dict(where=valid, rows=rows)
        if partner_level is None:
            p = jnp.ones(f.shape[0], f.dtype)
            selected = selection.clean_mask(f, threshold, **at)
        else:
            p = selection.partner_p_value(f, **at)
            selected = selection.partner_test(p, partner_level, **at)
        phi = selection.hard_negative_index(f, **at)
        entropy = (
            selection.normalized_entropy(f, **at)
            if entropies or gradient_weighting
            else jnp.zeros(f.shape[0], f.dtype)
        )
        return selected, phi, entropy, p

    found = {
        d: masking.by_row_blocks(
            functools.partial(block_estimates, threshold=thresholds[d]), f, block
        )
        for d, f in views.items()
    }
    clean = {}
    clean["i2t"], clean["t2i"] = selection.combine_clean_masks(
        found["i2t"][0], found["t2i"][0], clean_set
    )
    phi = {d: found[d][1] for d in views}
    entropy = {d: found[d][2] for d in views}
    # selection.hinge_argument of the two scores it reads
    argument = {
        d: jax.lax.stop_gradient(
            margin - jax.nn.sigmoid(jnp.diagonal(f)) + jax.nn.sigmoid(_at(f, phi[d]))
        )
        for d, f in views.items()
    }
    omega = {d: jnp.ones(num, views[d].dtype) for d in views}
    if gradient_weighting:
        omega["i2t"], omega["t2i"] = selection.swap_weights(
            entropy["i2t"],
            entropy["t2i"],
            argument["i2t"],
            argument["t2i"],
            indicator=sgw_indicator,
        )
    p = {d: found[d][3] if partner_level is not None else None for d in views}
    return {d: _Estimates(clean[d], phi[d], entropy[d], argument[d], omega[d], p[d]) for d in views}


def _at(f: jax.Array, columns: jax.Array) -> jax.Array:
    """``[B]``: row ``i`` of ``f`` at ``columns[i]`` (gradient flows)."""
    return f[jnp.arange(f.shape[0]), columns]


def _direction_terms(
    f,
    est: _Estimates,
    *,
    valid,
    warmup,
    fallback,
    margin,
    beta,
    offset,
    lambda1,
    lambda2,
    warmup_weight,
    rectify,
    every_degenerate,
    contrastive,
    complementary,
    block,
    m_clean,
    m_noisy,
) -> tuple[jax.Array, SREMDirection]:
    """One direction's share of the objective ``[B]`` (warm-up: the weighted
    complementary term; main: hinge, energy and complementary terms, or the warm-up term
    where ``fallback`` finds the division degenerate) and its :class:`SREMDirection`."""
    num = valid.shape[0]
    zeros = jnp.zeros(num, f.dtype)
    degenerate = jnp.asarray(False)
    if fallback and not warmup:
        degenerate = selection.degenerate_division(est.clean, where=valid, every=every_degenerate)
    used = jnp.zeros(num, bool) if warmup else est.clean & ~degenerate

    def block_terms(f, rows, used, phi):
        at = dict(where=valid, rows=rows)
        energy = selection.energy(f, **at)
        mask = selection.complementary_mask(used, phi, **at)
        probs = selection.ms_selection_probs(jax.nn.sigmoid(f), beta, offset, **at)
        q = selection.rectified_complementary_dist(probs, mask, rectify=rectify != "uniform")
        comp = srem_losses.complementary_loss(f, q, mask, rows=rows, **complementary)
        return (energy, comp) if rows is not None else (energy, comp, mask, q)

    if (
        block < num
        and complementary["prob"] == "softmax"
        and complementary["form"] == "expectation"
    ):
        # the same terms in fewer passes, with their gradient by hand: nothing [B, B] is
        # kept but the blocks themselves, and nothing is recomputed row-wise
        def fused(f, rows, used, phi):
            biased = rectify != "uniform"
            return _fused_terms(
                f, rows, used, phi, valid, beta, offset, biased, complementary["reduction"]
            )

        out = masking.by_row_blocks(fused, f, block, used, est.hard_negative)
    else:
        out = masking.by_row_blocks(block_terms, f, block, used, est.hard_negative, checkpoint=True)
    energy, comp = out[:2]
    mask, q = out[2:] if len(out) == 4 else (None, None)
    if warmup:
        hinge = energy_loss = pull = zeros
        share = warmup_weight * comp
    else:
        phi, omega = est.hard_negative, est.weight
        pair = jnp.diagonal(f)
        if contrastive:
            # InfoNCE of the row, -log softmax(F_i:)_i = lse_j F_ij - F_ii = -E_i - F_ii over
            # the same real candidates: the energy's log-sum-exp, computed once
            hinge = jnp.where(used, -energy - pair, 0.0)
            pull = jnp.where(used, 1.0, 0.0).astype(f.dtype)  # each clean query, weight 1
        else:
            negative = jax.nn.sigmoid(_at(f, phi))
            positive = jax.nn.sigmoid(pair)
            hinge = srem_losses.weighted_hinge_shares(
                positive, negative, phi, omega, used, margin=margin, where=valid
            )
            pull = selection.positive_pull_of_scores(positive, negative, phi, omega, used, margin)
        energy_loss = srem_losses.energy_bounded_loss(
            energy, used, m_clean=m_clean, m_noisy=m_noisy, where=valid
        )
        share = 0.5 * hinge + lambda2 * comp
        if not (isinstance(lambda1, int | float) and lambda1 == 0):
            # a Python weight of 0 (the :vectors setting) skips the term and its gradient;
            # the energy loss is still reported
            share = share + lambda1 * energy_loss
        if fallback:
            hinge, energy_loss, pull = (
                jnp.where(degenerate, 0.0, v) for v in (hinge, energy_loss, pull)
            )
            share = jnp.where(degenerate, warmup_weight * comp, share)
    direction = SREMDirection(
        energy=energy,
        clean=est.clean,
        hard_negative=est.hard_negative,
        entropy=est.entropy,
        argument=est.argument,
        weight=est.weight,
        mask=mask,
        q=q,
        hinge=hinge,
        energy_loss=energy_loss,
        complementary=comp,
        pull=pull,
        fallback=degenerate,
        partner_p=est.partner_p,
    )
    return share, direction


# ------------------------------------------------------------------ a block's terms, fused


def _fused_forward(f, rows, used, phi, columns, beta, offset, rectify, reduction):
    """A block's energies and complementary terms (prob ``'softmax'``, the expectation form)
    and the per-row numbers their gradient needs (:func:`_fused_terms`)."""
    num = f.shape[1]
    valid = columns[rows]
    iota = jnp.arange(num, dtype=jnp.int32)[None, :]
    candidates = valid[:, None] & columns[None, :]
    own = iota == rows[:, None]
    negatives = candidates & ~own
    # the log-sum-exp of each row over its candidates: the energy (Eq. 1, negated) and the
    # softmax P of the complementary loss, with the row's top candidate from the same max
    masked = jnp.where(candidates, f, -jnp.inf)
    top_value = masked.max(1)
    shift = jnp.where(jnp.isfinite(top_value), top_value, 0.0)
    lse = shift + jnp.log(jnp.sum(jnp.exp(masked - shift[:, None]), 1))
    top_index = jnp.min(jnp.where(masked == top_value[:, None], iota, num), 1)
    top = iota == top_index[:, None]
    count = jnp.sum(columns)
    has_rest = valid & (count >= 2)
    rest = jnp.where(has_rest[:, None], jnp.where(candidates & ~top, f, -jnp.inf), 0.0)
    lse_rest = jax.nn.logsumexp(rest, axis=1)
    # the complementary candidates (Eq. 11), the selection probabilities (Eq. 10) and Q
    # (Eq. 12), none differentiated
    mask = selection.complementary_mask(used, phi, where=columns, rows=rows)
    scores = jax.nn.sigmoid(f)
    z = jnp.where(negatives, beta * (scores - offset), -jnp.inf)
    log_norm = jnp.logaddexp(0.0, jax.nn.logsumexp(z, axis=1))
    chosen = jnp.where(negatives, jnp.exp(z - log_norm[:, None]), 0.0)
    q_logits = jnp.where(mask, chosen if rectify else 0.0, -jnp.inf)
    q_max = jnp.max(q_logits, 1)
    q_shift = jnp.where(jnp.isfinite(q_max), q_max, 0.0)
    q_sum = jnp.sum(jnp.where(mask, jnp.exp(q_logits - q_shift[:, None]), 0.0), 1)
    q_sum = jnp.where(q_sum > 0, q_sum, 1.0)
    q = jnp.where(mask, jnp.exp(q_logits - q_shift[:, None]) / q_sum[:, None], 0.0)
    # log(1 - P), exact at the top candidate (ncljax.losses.srem._log1m_softmax)
    log_p = jnp.where(candidates & ~top, f - lse[:, None], -1.0)
    at_top = jnp.where(has_rest, lse_rest - lse, -jnp.inf)
    log1m = jnp.where(top, at_top[:, None], jnp.log1p(-jnp.exp(log_p)))
    size = mask.sum(1).astype(f.dtype)
    kappa = jnp.where(valid, size if reduction == "sum" else 1.0, 0.0)
    comp = kappa * -jnp.sum(jnp.where(mask, q * log1m, 0.0), 1)
    energy = jnp.where(valid, -lse, 0.0)
    saved = (shift, lse, lse_rest, top_index, log_norm, q_shift, q_sum, kappa)
    return (energy, comp), saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _fused_terms(f, rows, used, phi, columns, beta, offset, rectify, reduction):
    r"""``(energy [b], complementary [b])`` of a block of query rows ``f [b, B]`` (rows
    ``rows`` of the direction's logits; ``columns``, the batch's real pairs): the values of
    :func:`ncljax.labels.srem.energy` and :func:`ncljax.losses.srem.complementary_loss`
    (``prob='softmax'``, the expectation form) over the mask and ``Q`` of Eqs. 10-12, in
    fewer passes: one maximum for the energy, the softmax and the top candidate, and a
    gradient by hand,

    .. math::
      \frac{\partial L_{c,i}}{\partial F_{ik}} = \kappa_i \big(r_{ik} - P_{ik}
        \textstyle\sum_j r_{ij}\big),\qquad
      r_{ij} = \mathbf Q_{ij} \frac{P_{ij}}{1 - P_{ij}},\qquad
      \frac{\partial E_i}{\partial F_{ik}} = -P_{ik}

    (``P / (1 - P)`` at the row's top candidate as :math:`\exp(F_{ij} - \mathrm{lse}_{k
    \ne j} F_{ik})`), from per-row numbers: the backward pass reads the block once more
    and recomputes no row-wise quantity but two sums."""
    return _fused_forward(f, rows, used, phi, columns, beta, offset, rectify, reduction)[0]


def _fused_terms_fwd(f, rows, used, phi, columns, beta, offset, rectify, reduction):
    out, saved = _fused_forward(f, rows, used, phi, columns, beta, offset, rectify, reduction)
    return out, (f, rows, used, phi, columns, beta, offset, saved)


def _fused_terms_bwd(rectify, reduction, residuals, cotangents):
    del reduction  # in kappa
    f, rows, used, phi, columns, beta, offset, saved = residuals
    shift, lse, lse_rest, top_index, log_norm, q_shift, q_sum, kappa = saved
    g_energy, g_comp = cotangents
    num = f.shape[1]
    valid = columns[rows]
    iota = jnp.arange(num, dtype=jnp.int32)[None, :]
    candidates = valid[:, None] & columns[None, :]
    mask = selection.complementary_mask(used, phi, where=columns, rows=rows)
    top = iota == top_index[:, None]
    p = jnp.where(candidates, jnp.exp(f - lse[:, None]), 0.0)
    z = beta * (jax.nn.sigmoid(f) - offset)
    chosen = jnp.exp(z - log_norm[:, None])
    q = jnp.exp((chosen if rectify else 0.0) - q_shift[:, None]) / q_sum[:, None]
    # With r_j = Q_j P_j / (1 - P_j) and R its row sum, the loss's gradient is r_k - P_k R.
    # At the top candidate P may be 1 to round-off and r huge; its part is taken apart:
    # r_t (1 - P_t) = Q_t P_t, and P_k r_t = Q_t P_t exp(F_k - lse_{j != t} F_j) for k != t.
    # Below the top P <= 1/2, so P / (1 - P) is exact.
    rest = mask & ~top
    r = jnp.where(rest, q * p / (1.0 - p), 0.0)
    r_rest = jnp.sum(r, 1)
    q_top = jnp.sum(jnp.where(mask & top, q, 0.0), 1)  # 0 where the top is no candidate
    safe_rest = jnp.where(jnp.isfinite(lse_rest), lse_rest, 0.0)
    top_pull = (q_top * jnp.exp(shift - lse))[:, None]  # Q_t P_t
    off_top = r - top_pull * jnp.exp(f - safe_rest[:, None])
    comp_grad = jnp.where(top, top_pull, off_top) - p * r_rest[:, None]
    weight = g_comp * kappa
    grad = -g_energy[:, None] * p + weight[:, None] * comp_grad
    grad = jnp.where(candidates, grad, 0.0).astype(f.dtype)
    return grad, None, None, None, None, None, None


_fused_terms.defvjp(_fused_terms_fwd, _fused_terms_bwd)
