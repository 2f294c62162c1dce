r"""GSC's correspondence estimators: cross- and intra-modal indicators, GMM, ensembling.

Per batch, from the training forward pass (detached):

* :func:`gsc_cross_modal_indicator` (Eq. 3): the mean of the in-batch softmax
  probabilities of a pair's own caption (i2t) and own image (t2i);
* :func:`gsc_intra_modal_score` (Eq. 8): the cosine between a sample's label-masked
  image structure and its label-masked text structure.

Per epoch, over the whole training set (:func:`gsc_update_labels`): min-max
normalisation of the intra-modal scores, a two-component GMM whose high-mean posterior is
the intra-modal indicator (Eq. 4), temporal ensembling of both indicators (Eq. 10) and the
final label as their minimum (Eq. 5). All jittable; labels are constants (no gradient).

Equations: GSC (Zhao et al., CVPR 2024), Sec. 3.3 (Eqs. 3-5 and 8) and Sec. 3.4 (Eq. 10).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax.labels import gmm as gmm_lib
from ncljax.losses.contrastive import info_nce_directions
from ncljax.losses.structure import mask_structures


def gsc_cross_modal_indicator(
    sim: ArrayLike, *, temperature: float = 0.07, where: ArrayLike | None = None
) -> jax.Array:
    r"""GSC's cross-modal correspondence indicator per pair (Eq. 3, batch version).

    .. math::
      \hat y^{CM}_b = \tfrac12\Big(
        \frac{e^{\mathbf S_{bb}/\tau_1}}{\sum_c e^{\mathbf S_{bc}/\tau_1}} +
        \frac{e^{\mathbf S_{bb}/\tau_1}}{\sum_c e^{\mathbf S_{cb}/\tau_1}}\Big)

    Args:
      sim: ``[B, B]`` image-by-caption similarities (sigmoid outputs in GSC).
      temperature: :math:`\tau_1` (0.07).
      where: optional bool ``[B]``, True for real pairs; padding is no candidate.

    Returns:
      ``[B]`` values in ``(0, 1]``, gradient stopped (0 at padding).

    References:
      Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure Consistency
      Learning", CVPR 2024, Sec. 3.3, Eq. 3.
    """
    sim = jax.lax.stop_gradient(jnp.asarray(sim))
    sim = sim.astype(jnp.result_type(sim, jnp.float32))
    valid = jnp.ones(sim.shape[:1], bool) if where is None else jnp.asarray(where, bool)
    logits = sim / temperature
    nll_i2t, nll_t2i = info_nce_directions(logits, where=valid)
    p_i2t, p_t2i = jnp.exp(-nll_i2t), jnp.exp(-nll_t2i)
    return jnp.where(valid, 0.5 * (p_i2t + p_t2i), 0.0)


def gsc_intra_modal_score(
    sim_image: ArrayLike,
    sim_text: ArrayLike,
    labels: ArrayLike,
    *,
    eps: float = 1e-8,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""GSC's intra-modal consistency score per sample (Eq. 8, batch version).

    .. math::
      s^{IM}_j = \frac{\mathbf A_{j:}\cdot\mathbf C_{j:}}
                      {\max(\lVert\mathbf A_{j:}\rVert\,\lVert\mathbf C_{j:}\rVert, \epsilon)},
      \qquad \mathbf A_{ji} = \langle I_j, I_i\rangle y_i,\
             \mathbf C_{ji} = \langle T_j, T_i\rangle y_i

    (the product of the norms is clamped, as ``torch.cosine_similarity``).

    Args:
      sim_image: ``[B, B]`` intra-image similarities.
      sim_text: ``[B, B]`` intra-text similarities (row: context caption).
      labels: ``[B]`` soft correspondence labels masking the structure columns.
      eps: :math:`\epsilon` (1e-8).
      where: optional bool ``[B]``, True for real pairs.

    Returns:
      ``[B]`` scores in ``[-1, 1]`` (``[0, 1]`` for sigmoid similarities), gradient
      stopped, 0 at padding.

    References:
      GSC (Zhao et al., CVPR 2024), Sec. 3.3, Eq. 8.
    """
    a, c = mask_structures(
        jax.lax.stop_gradient(jnp.asarray(sim_image)),
        jax.lax.stop_gradient(jnp.asarray(sim_text)),
        labels,
        where=where,
    )
    norms = jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(c, axis=-1)
    score = (a * c).sum(-1) / jnp.maximum(norms, eps)
    return score if where is None else jnp.where(jnp.asarray(where, bool), score, 0.0)


def ema_update(new: ArrayLike, old: ArrayLike, momentum: float) -> jax.Array:
    r"""Temporal ensembling (Eq. 10): :math:`\beta\,\text{new} + (1 - \beta)\,\text{old}`."""
    return momentum * jnp.asarray(new) + (1.0 - momentum) * jnp.asarray(old)


def gsc_intra_modal_indicator(
    scores: ArrayLike,
    *,
    where: ArrayLike | None = None,
    max_iter: int = 10,
    tol: float = 1e-2,
    reg_covar: float = 5e-4,
) -> tuple[jax.Array, jax.Array, gmm_lib.GaussianMixture1D]:
    r"""GSC's intra-modal indicator over the training set (Eq. 4).

    Min-max normalises the scores :math:`\bar u = (u - \min u)/(\max u - \min u)`, fits a
    two-component GMM by EM (:func:`ncljax.labels.fit_gmm_1d`: sklearn's estimator,
    started from the optimal 2-means partition instead of a random k-means++ one) and
    returns the posterior of the component with the larger mean, the clean one.

    Args:
      scores: ``[N]`` intra-modal scores (``topo_buf``).
      where: optional bool ``[N]``; False marks entries to ignore.
      max_iter: EM iterations (10, as the official sklearn call).
      tol: EM tolerance on the mean log-likelihood (1e-2).
      reg_covar: added to each variance (5e-4).

    Returns:
      ``(indicator [N] in [0, 1], normalised scores [N], fitted mixture)``.

    References:
      GSC (Zhao et al., CVPR 2024), Sec. 3.3, Eq. 4.
    """
    normalised = gmm_lib.minmax_normalize(scores, where=where)
    mixture = gmm_lib.fit_gmm_1d(
        normalised, where=where, max_iter=max_iter, tol=tol, reg_covar=reg_covar
    )
    return gmm_lib.high_mean_posterior(normalised, mixture), normalised, mixture


class GSCLabels(NamedTuple):
    r"""The per-sample label state of one GSC network, all ``[N]``.

    Attributes:
      ema_cross: :math:`Y_{CM}`, the ensembled cross-modal indicator.
      ema_intra: :math:`Y_{IM}`, the ensembled intra-modal indicator.
      labels: :math:`y = \min(Y_{CM}, Y_{IM})`, the labels of the next epoch.
      intra_posterior: this epoch's GMM posterior :math:`\hat y_{IM}` (before ensembling).
      intra_normalised: the min-max normalised scores the GMM was fitted on.
    """

    ema_cross: jax.Array
    ema_intra: jax.Array
    labels: jax.Array
    intra_posterior: jax.Array
    intra_normalised: jax.Array


def gsc_update_labels(
    ema_cross: ArrayLike,
    ema_intra: ArrayLike,
    cross: ArrayLike,
    intra: ArrayLike,
    *,
    cross_momentum: float = 0.7,
    intra_momentum: float = 0.7,
    where: ArrayLike | None = None,
    max_iter: int = 10,
    tol: float = 1e-2,
    reg_covar: float = 5e-4,
) -> tuple[GSCLabels, gmm_lib.GaussianMixture1D]:
    r"""GSC's per-epoch label estimation (Eqs. 4, 10 and 5).

    .. math::
      Y_{CM} \leftarrow \beta_1\,\hat y_{CM} + (1-\beta_1)\,Y_{CM},\qquad
      Y_{IM} \leftarrow \beta_2\,\mathrm{GMM}_{\text{high}}(\bar u) + (1-\beta_2)\,Y_{IM},\qquad
      y = \min(Y_{CM}, Y_{IM})

    The raw cross-modal indicators enter the ensemble directly; only the intra-modal
    scores go through the GMM (:func:`gsc_intra_modal_indicator`).

    A degenerate buffer (all valid intra-modal scores equal: the GMM has no two clusters
    and its "clean" posterior is meaningless, about 0 everywhere) keeps the previous
    state: both ensembles, hence the labels, are returned unchanged (the returned
    mixture's ``degenerate`` flag says so; the GSC method logs a warning).

    Args:
      ema_cross: ``[N]`` previous :math:`Y_{CM}` (ones before the first update).
      ema_intra: ``[N]`` previous :math:`Y_{IM}` (ones before the first update).
      cross: ``[N]`` this epoch's cross-modal indicators (``pred_buf``).
      intra: ``[N]`` this epoch's intra-modal scores (``topo_buf``).
      cross_momentum: :math:`\beta_1` (0.7).
      intra_momentum: :math:`\beta_2` (0.7; the official code uses one ``beta`` for both).
      where: optional bool ``[N]`` of entries to fit the GMM on.
      max_iter: EM iterations (10).
      tol: EM tolerance (1e-2).
      reg_covar: GMM variance floor (5e-4).

    Returns:
      ``(GSCLabels, fitted mixture)``.

    References:
      GSC (Zhao et al., CVPR 2024), Secs. 3.3-3.4, Eqs. 4, 5 and 10.
    """
    posterior, normalised, mixture = gsc_intra_modal_indicator(
        intra, where=where, max_iter=max_iter, tol=tol, reg_covar=reg_covar
    )
    keep = mixture.degenerate
    new_cross = jnp.where(keep, ema_cross, ema_update(cross, ema_cross, cross_momentum))
    new_intra = jnp.where(keep, ema_intra, ema_update(posterior, ema_intra, intra_momentum))
    state = GSCLabels(
        ema_cross=new_cross,
        ema_intra=new_intra,
        labels=jnp.minimum(new_cross, new_intra),
        intra_posterior=posterior,
        intra_normalised=normalised,
    )
    return jax.tree.map(jax.lax.stop_gradient, state), mixture
