r"""UGNCL's uncertainty-guided division (UGD) of a batch into four sets, and its label rules.

From the per-view log-evidence matrices ``[W, K, K]`` of a batch (rows images, columns
captions; ``ncljax.evidence``), :func:`division_signals` computes per pair an uncertainty
``u``, whether its own counterpart is the most believed one (``prediction``) and a soft
label ``q``; :func:`ugd_partition` splits the pairs into the determined-clean ``S_C``
(``u < p``, predicted), determined-noisy ``S_N`` (``u < p``, not predicted), hard-clean
``S_H^C`` (``u >= p``, ``q > epsilon``) and hard-noisy ``S_H^N`` sets.

Two readings (``division_mode``; the paper's Sec. 3.2.2, and the per-epoch division of
DECL's code, ``QinYang79/DECL``, on which the official UGNCL code builds):

* ``'decl_lineage'`` (default): DECL's per-direction uncertainties summed,
  ``u^w_i = K / sum_k(E_ik + 1) + K / sum_k(E_ki + 1)``, and the normalised bidirectional
  evidence ``P^w_ik = (E_ik + E_ki) / sum_k' (E_ik' + E_k'i)``; over views the mean
  (``view_fusion='mean'``) or the Dempster-Shafer fusion of the evidence (``'dst'``).
  ``prediction_i = argmax_k P_ik == i``, ``q_i = P_ii``.
* ``'paper'``: Eqs. 4-11 as printed: the bidirectional evidence ``E_ik + E_ki`` (or their
  mean, ``bidir_mode``), a subjective-logic opinion per view, the views fused by
  Dempster-Shafer (or averaged), ``prediction_i = argmax_k b_ik == i``, ``q_i = b_ii``.
  With UGNCL's evidence ``e >= 1`` (Eq. 3) every such uncertainty is at most ``1/5``
  (each ``alpha >= 3``, so each view's ``u = K / sum_k alpha_k <= 1/3``, and Eq. 7 fuses
  two of them into at most ``1/5``), so at ``p = 0.5`` no hard set ever forms.

The targets of the evidential loss (:func:`edl_targets`), the trusted soft margins of the
trusted robust loss (:func:`trusted_margins`, Eq. 17) and the annealed number of hard
negatives (:func:`num_hard_negatives`) complete the rules. All outputs are constants of the
loss (``stop_gradient``).
"""

from __future__ import annotations

import fractions
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import evidence, masking
from ncljax.labels import gmm as gmm_lib
from ncljax.losses.evidential import CLEAN, HARD_CLEAN, HARD_NOISY, NOISY

_SG = jax.lax.stop_gradient
DIVISION_MODES = ("decl_lineage", "paper")
VIEW_FUSIONS = ("mean", "dst")
BIDIR_MODES = ("sum", "mean")
EDL_TARGETS = ("paper_soft", "binary_pred")
SET_NAMES = ("clean", "noisy", "hard_clean", "hard_noisy")


class DivisionSignals(NamedTuple):
    """Per pair ``[K]``: ``uncertainty`` ``u``, ``prediction`` (bool: the pair's own
    counterpart is the most believed class) and ``soft_label`` ``q`` (its own belief)."""

    uncertainty: jax.Array
    prediction: jax.Array
    soft_label: jax.Array


def _views(log_e_views: ArrayLike) -> jax.Array:
    log_e_views = jnp.asarray(log_e_views)
    log_e_views = log_e_views.astype(jnp.result_type(log_e_views, jnp.float32))
    if log_e_views.ndim == 2:
        log_e_views = log_e_views[None]
    if log_e_views.ndim != 3 or log_e_views.shape[1] != log_e_views.shape[2]:
        raise ValueError(
            f"log_e_views must be [W, K, K] (views, images, captions), got {log_e_views.shape}"
        )
    return log_e_views


def _own_is_argmax(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Row ``i``'s argmax over the real classes is ``i`` (ties to the lowest index)."""
    best = jnp.argmax(jnp.where(valid[None, :], scores, -jnp.inf), axis=-1)
    return best == jnp.arange(scores.shape[0])


def division_signals(
    log_e_views: ArrayLike,
    *,
    mode: str = "decl_lineage",
    view_fusion: str | None = None,
    bidir_mode: str = "sum",
    where: ArrayLike | None = None,
) -> DivisionSignals:
    r"""Uncertainty, prediction and soft label of each pair of a batch (UGNCL Eqs. 4-11).

    Args:
      log_e_views: ``[W, K, K]`` (or ``[K, K]``, one view) log-evidence, rows images,
        columns captions, the observed pairs on the diagonal.
      mode: ``'decl_lineage'`` (the default, after DECL's code) or ``'paper'`` (see the
        module doc).
      view_fusion: ``'mean'`` or ``'dst'``; default: ``'mean'`` for ``'decl_lineage'``,
        ``'dst'`` for ``'paper'`` (each mode's own rule).
      bidir_mode: ``'paper'`` mode's bidirectional evidence, ``'sum'`` (the paper) or
        ``'mean'`` (the released code's commented-out line).
      where: optional bool ``[K]``, the real pairs of a padded batch (``K`` counts them).

    Returns:
      :class:`DivisionSignals` (``[K]`` each; padding pairs get ``u = 1``, no prediction,
      ``q = 0``), with no gradient.
    """
    log_e = _views(log_e_views)
    num = log_e.shape[-1]
    if mode not in DIVISION_MODES:
        raise ValueError(f"division mode must be one of {DIVISION_MODES}, got {mode!r}")
    fusion = view_fusion or ("mean" if mode == "decl_lineage" else "dst")
    if fusion not in VIEW_FUSIONS:
        raise ValueError(f"view_fusion must be one of {VIEW_FUSIONS}, got {view_fusion!r}")
    if bidir_mode not in BIDIR_MODES:
        raise ValueError(f"bidir_mode must be one of {BIDIR_MODES}, got {bidir_mode!r}")
    valid = masking.valid_rows(num, where)
    real = valid.sum()
    log_k = jnp.log(real.astype(log_e.dtype))
    cls = valid[None, None, :]
    log_e = _SG(log_e)

    if mode == "decl_lineage":
        if fusion == "dst":
            log_e = evidence.fuse_log_evidence(log_e, real)[None]
        log_a = evidence.log_alpha(log_e)
        strength_rows = jax.nn.logsumexp(jnp.where(cls, log_a, -jnp.inf), axis=-1)
        strength_cols = jax.nn.logsumexp(
            jnp.where(cls, jnp.swapaxes(log_a, 1, 2), -jnp.inf), axis=-1
        )
        u = jnp.exp(log_k - strength_rows) + jnp.exp(log_k - strength_cols)  # [W, K]
        bidir = jnp.logaddexp(log_e, jnp.swapaxes(log_e, 1, 2))
        prob = jax.nn.softmax(jnp.where(cls, bidir, -jnp.inf), axis=-1)
        u, prob = u.mean(0), prob.mean(0)
    else:
        bidir = jnp.logaddexp(log_e, jnp.swapaxes(log_e, 1, 2))
        if bidir_mode == "mean":
            bidir = bidir - jnp.log(2.0)
        if fusion == "dst":
            opinion = evidence.dirichlet_opinion(
                evidence.fuse_log_evidence(bidir, real), where=valid
            )
            u, prob = opinion.uncertainty, opinion.belief
        else:
            opinion = evidence.dirichlet_opinion(bidir, where=valid)
            u, prob = opinion.uncertainty.mean(0), opinion.belief.mean(0)
    prediction = _own_is_argmax(prob, valid) & valid
    soft = jnp.where(valid, jnp.diagonal(prob), 0.0)
    return DivisionSignals(jnp.where(valid, u, 1.0), prediction, soft)


def ugd_partition(
    uncertainty: ArrayLike,
    prediction: ArrayLike,
    soft_label: ArrayLike,
    *,
    threshold: float = 0.5,
    epsilon: float = 0.5,
) -> jax.Array:
    r"""The four UGD sets as codes (int8): ``CLEAN`` 0, ``NOISY`` 1, ``HARD_CLEAN`` 2,
    ``HARD_NOISY`` 3 (UGNCL Eqs. 8-11).

    ``u < threshold``: determined, clean if predicted (Eq. 9-10); ``u >= threshold``: hard,
    hard-clean if ``q > epsilon`` (Eq. 11).

    Args:
      uncertainty, prediction, soft_label: ``[N]`` (:class:`DivisionSignals`).
      threshold: the uncertainty threshold :math:`p` (0.5).
      epsilon: the soft-label threshold :math:`\epsilon` (0.5).
    """
    u, q = jnp.asarray(uncertainty), jnp.asarray(soft_label)
    determined = jnp.where(jnp.asarray(prediction, bool), CLEAN, NOISY)
    hard = jnp.where(q > epsilon, HARD_CLEAN, HARD_NOISY)
    return jnp.where(u < threshold, determined, hard).astype(jnp.int8)


class CalibratedSignals(NamedTuple):
    """Per pair ``[N]``: ``hard_posterior`` :math:`v` (the high-uncertainty component's
    posterior; 0 for every pair when the uncertainties hold no two groups), and
    ``clean_posterior`` :math:`w` (the high-soft-label component's posterior). Bool
    scalars: ``degenerate``, the soft labels' mixture separates nothing
    (``gmm.check_division``); ``one_level``, the uncertainties' mixture separates
    nothing (then no pair is hard)."""

    hard_posterior: jax.Array
    clean_posterior: jax.Array
    degenerate: jax.Array
    one_level: jax.Array


def calibrate_signals(
    uncertainty: ArrayLike,
    soft_label: ArrayLike,
    *,
    where: ArrayLike | None = None,
    floor: float = 1e-30,
    min_bimodality: float = 2.0,
) -> CalibratedSignals:
    r"""Data-calibrated uncertainty and soft label: two-component mixtures over the pairs.

    The paper compares ``u`` with :math:`p = 0.5` and ``q`` with :math:`\epsilon = 0.5`
    (Eqs. 8-11), constants whose meaning moves with the evidence scale
    (:math:`e^{\mathrm{softplus}(R)/\tau}`, the cosine head's shift and temperature) and
    with the number of classes ``K`` of a batch (``q`` is a softmax over ``K``: chance is
    :math:`1/K`). Here each is replaced by the posterior of a two-component 1-D Gaussian
    mixture (``ncljax.labels.fit_gmm_1d``) fitted to the same scores of the pairs:

    .. math::

        v_i = P(\text{high-}u \mid \bar u_i), \quad
        \bar u = \mathrm{minmax}(u); \qquad
        w_i = P(\text{high-}q \mid \bar\ell_i), \quad
        \bar\ell = \mathrm{minmax}(\log\max(q, \text{floor}))

    so that ``u < p`` becomes ``v < 0.5`` and ``q > epsilon`` becomes ``w > 0.5``
    (:func:`ugd_partition` with both thresholds 0.5). Uncertainties that form one group
    single out no pair as uncertain: ``v = 0``, every pair determined, as the paper's
    division is once every ``u < p`` (``u`` saturated at 0 once every row holds a pair of
    overwhelming evidence). One group: the mixture separates nothing
    (``gmm.check_division``) or is not bimodal by Ashman's criterion,

    .. math:: D = \sqrt 2\,|\mu_1 - \mu_0| / \sqrt{\sigma_0^2 + \sigma_1^2} \le 2

    (``min_bimodality``; two components fitted to one normal group overlap, ``D < 2``).
    Soft labels that form one group separate nothing: ``degenerate``, the caller falls
    back. ``v`` is unchanged by any map ``u -> a u + b`` with ``a > 0``; ``w`` by any map
    ``q -> c q^a`` with ``a, c > 0`` (a normalisation by ``K`` included).

    Args:
      uncertainty, soft_label: ``[N]`` (:class:`DivisionSignals`) of the training pairs.
      where: optional bool ``[N]``: the pairs to fit on (others get posteriors too).
      floor: smallest ``q`` before the logarithm.
      min_bimodality: the least Ashman's ``D`` of the uncertainties' mixture that makes
        a hard set (2).

    Returns:
      :class:`CalibratedSignals`, with no gradient.
    """
    u = _SG(jnp.asarray(uncertainty, jnp.float32))
    log_q = jnp.log(jnp.maximum(_SG(jnp.asarray(soft_label, jnp.float32)), floor))

    def posterior(x):
        x = gmm_lib.minmax_normalize(x, where=where)
        mixture = gmm_lib.fit_gmm_1d(x, where=where)
        prob = gmm_lib.high_mean_posterior(x, mixture)
        bad = gmm_lib.check_division(x, prob, mixture, where=where).inseparable
        gap = jnp.abs(mixture.means[1] - mixture.means[0])
        bimodality = jnp.sqrt(2.0) * gap / jnp.sqrt(mixture.variances.sum())
        return prob, bad, bimodality

    v, inseparable, bimodality = posterior(u)
    one_level = inseparable | (bimodality <= min_bimodality)
    w, degenerate, _ = posterior(log_q)
    return CalibratedSignals(jnp.where(one_level, 0.0, v), w, degenerate, one_level)


def edl_targets(
    codes: ArrayLike,
    soft_label: ArrayLike,
    prediction: ArrayLike,
    *,
    kind: str = "paper_soft",
) -> jax.Array:
    r"""The correspondence label :math:`\tilde y_i` each pair's evidential target carries.

    ``'paper_soft'``: 1 on ``S_C``, 0 on ``S_N``, the soft label ``q`` on the hard sets
    (the paper); ``'binary_pred'``: the prediction, 0 or 1, for every pair (the code, DECL).
    """
    if kind not in EDL_TARGETS:
        raise ValueError(f"edl_target must be one of {EDL_TARGETS}, got {kind!r}")
    codes = jnp.asarray(codes)
    q = jnp.asarray(soft_label, jnp.float32)
    if kind == "binary_pred":
        return _SG(jnp.asarray(prediction, bool).astype(q.dtype))
    y = jnp.where(codes == CLEAN, 1.0, jnp.where(codes == NOISY, 0.0, q))
    return _SG(y)


def trusted_margins(
    codes: ArrayLike,
    uncertainty: ArrayLike,
    soft_label: ArrayLike,
    *,
    margin: float = 0.2,
    curve: float = 10.0,
    sharpness: float = 10.0,
) -> jax.Array:
    r"""Trusted soft margins (UGNCL Eq. 17, the paper's logistic form) per pair.

    .. math::

        \hat\gamma_i = \gamma \frac{m^{q_i} - 1}{m - 1}, \qquad
        \tilde\gamma_i = \begin{cases}
            \gamma & i \in S_C \\
            \hat\gamma_i\,\sigma(-\Delta\,\mathrm{logit}\,u_i) & i \in S_H^C \\
            \hat\gamma_i\,\sigma(\Delta\,\mathrm{logit}\,u_i) & i \in S_H^N \\
            0 & i \in S_N \text{ (not in the loss)}
        \end{cases}

    ``u`` is clipped to ``[1e-6, 1 - 1e-6]``. (The released code's
    ``1 / (1 + (-Delta) ** (1/u - 1))`` raises a negative base to a real power, NaN; no
    switch reproduces it.)

    Args:
      codes: ``[K]`` partition codes (:func:`ugd_partition`).
      uncertainty, soft_label: ``[K]``.
      margin: :math:`\gamma` (0.2).
      curve: :math:`m` of the soft margin (10).
      sharpness: :math:`\Delta` (10).

    Returns:
      ``[K]`` margins, constants of the loss.
    """
    codes = jnp.asarray(codes)
    q = jnp.asarray(soft_label, jnp.float32)
    u = jnp.clip(jnp.asarray(uncertainty, jnp.float32), 1e-6, 1.0 - 1e-6)
    soft = margin * (curve**q - 1.0) / (curve - 1.0)
    logit = jnp.log(u) - jnp.log1p(-u)
    hard_clean = soft * jax.nn.sigmoid(-sharpness * logit)
    hard_noisy = soft * jax.nn.sigmoid(sharpness * logit)
    out = jnp.select(
        [codes == CLEAN, codes == HARD_CLEAN, codes == HARD_NOISY],
        [jnp.full_like(q, margin), hard_clean, hard_noisy],
        0.0,
    )
    return _SG(out)


def num_hard_negatives(
    step: ArrayLike,
    *,
    start: int = 128,
    rate: float = 0.025,
    floor: int = 5,
    num_real: ArrayLike | None = None,
) -> jax.Array:
    r"""The annealed number of hard negatives :math:`\lambda` of the trusted robust loss.

    .. math:: \lambda_t = \max(\lfloor \mathrm{start} - \delta\, t \rfloor, \theta)

    with ``t`` the 1-based optimisation step counted from the first warm-up step (the code
    and DECL: ``delta = 0.025`` per step, the nominal batch 128; the paper's Sec. 3.3 counts
    epochs), capped at the real negatives of the batch, ``num_real - 1`` (the released code
    caps it at the batch's hard pairs instead).

    Args:
      step: ``t`` (traced int scalar).
      start: the nominal batch size the count starts from (128).
      rate: :math:`\delta` per step.
      floor: :math:`\theta` (5).
      num_real: real pairs of the batch (``None``: no cap).

    Returns:
      int32 scalar ``>= 1``.
    """
    # In integers: floor(start - rate t) = start - ceil(num t / den) with rate = num / den
    # (a float product could be contracted into a fused multiply-add and round 32 to 31).
    ratio = fractions.Fraction(rate).limit_denominator(10**6)
    num, den = ratio.numerator, ratio.denominator
    t = jnp.asarray(step, jnp.int32)
    if num:  # beyond the step where the floor is reached nothing changes: keep num t small
        t = jnp.minimum(t, (start - floor + 1) * den // num + 1)
    lam = jnp.maximum(start - (num * t + den - 1) // den, floor).astype(jnp.int32)
    if num_real is not None:
        lam = jnp.minimum(lam, jnp.asarray(num_real, jnp.int32) - 1)
    return jnp.maximum(lam, 1)
