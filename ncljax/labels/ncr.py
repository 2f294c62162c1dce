r"""NCR's estimators: co-divide by a loss GMM, correspondence prediction, co-rectification.

NCR (Huang et al., NeurIPS 2021) trains two networks; once per epoch each network, in
eval mode, computes every training pair's mean-negative hinge loss
(``ncljax.losses.triplet_mean``), and a two-component GMM over the min-max normalised
losses gives each pair's probability of being clean (the low-mean component's posterior).
Its *peer* then trains on the split: the clean set with co-rectified soft labels, the
noisy set with the two networks' averaged correspondence predictions. PC2 inherits the
whole procedure.

* ``loss_division``: min-max, GMM, posterior, split (with the official "keep 1% noisy"
  rule of ``split_clean``).
* ``correspondence_prediction``: the network's own estimate ``P`` of each pair's
  correspondence from its hinge costs (the official ``predict``).
* ``rectified_labels``: ``y_hat = w y + (1 - w) P`` (Eq. 6); ``rectified_label_matrix``: the
  official code's broadcast of the same line into a ``[B, B]`` matrix.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax.labels import gmm as gmm_lib
from ncljax.losses import ranking


class LossDivision(NamedTuple):
    """A network's division of the training pairs.

    Attributes:
      prob: ``[N]`` clean probability ``w`` (posterior of the low-loss component).
      clean: bool ``[N]``: the clean set.
      normalised: ``[N]`` the min-max normalised losses the GMM was fitted on.
      gmm: the fitted ``GaussianMixture1D`` (index 0: the low-mean, clean component).
    """

    prob: jax.Array
    clean: jax.Array
    normalised: jax.Array
    gmm: gmm_lib.GaussianMixture1D


def split_clean(
    prob: ArrayLike, threshold: float = 0.5, *, where: ArrayLike | None = None
) -> jax.Array:
    r"""The clean set ``prob > threshold``, keeping at least about 1% of the pairs noisy.

    If every valid probability exceeds ``threshold`` the threshold becomes the
    :math:`\lfloor N / 100 \rfloor`-th smallest valid probability (0-based), as the official
    ``split_prob``, so the noisy set is never empty.

    Args:
      prob: ``[N]`` clean probabilities.
      threshold: the split (0.5).
      where: optional bool ``[N]``, False for padding (never clean, ignored by the rule).

    Returns:
      bool ``[N]``.

    References:
      NCR official code (``co_train.split_prob``), kept by the official PC2 code
      (``pc2/co_train.py``, ``split_prob``).
    """
    prob = jnp.asarray(prob)
    mask = jnp.ones(prob.shape, bool) if where is None else jnp.asarray(where, bool)
    count = mask.sum()
    ordered = jnp.sort(jnp.where(mask, prob, jnp.inf))  # valid values first
    kth = ordered[jnp.clip(count // 100, 0, prob.shape[0] - 1)]
    lowest = jnp.min(prob, where=mask, initial=jnp.inf)
    cut = jnp.where(lowest > threshold, kth, threshold)
    return mask & (prob > cut)


def loss_division(
    losses: ArrayLike,
    *,
    threshold: float = 0.5,
    max_iter: int = 10,
    tol: float = 1e-2,
    reg_covar: float = 5e-4,
    where: ArrayLike | None = None,
) -> LossDivision:
    r"""NCR's co-divide: a two-component GMM on the min-max normalised per-pair losses.

    .. math::

        \bar\ell_i = \frac{\ell_i - \min_k \ell_k}{\max_k \ell_k - \min_k \ell_k}, \qquad
        w_i = p(\text{low-mean component} \mid \bar\ell_i), \qquad
        \text{clean}_i = w_i > \tau

    Args:
      losses: ``[N]`` per-pair losses of one network (eval mode).
      threshold: :math:`\tau` (0.5), with the 1% rule of ``split_clean``.
      max_iter: EM iterations (10, as the official ``GaussianMixture``).
      tol: EM tolerance on the mean log-likelihood (1e-2).
      reg_covar: variance floor (5e-4).
      where: optional bool ``[N]``, False for padding.

    Returns:
      ``LossDivision``.

    References:
      Huang et al., NeurIPS 2021, the co-divide step (Eq. 3-4).
    """
    normalised = gmm_lib.minmax_normalize(losses, where=where)
    fit = gmm_lib.fit_gmm_1d(
        normalised, where=where, max_iter=max_iter, tol=tol, reg_covar=reg_covar
    )
    prob = gmm_lib.low_mean_posterior(normalised, fit)
    if where is not None:
        prob = jnp.where(jnp.asarray(where, bool), prob, 0.0)
    return LossDivision(prob, split_clean(prob, threshold, where=where), normalised, fit)


def correspondence_prediction(
    sim: ArrayLike, margin: float = 0.2, *, where: ArrayLike | None = None
) -> jax.Array:
    r"""NCR's prediction of each pair's correspondence from the network's own similarities.

    With the mean hinge costs of pair ``b`` (averaged over the ``B`` real pairs, diagonal
    included, as ``triplet_mean``),

    .. math::

        p_b = \mathrm{clip}\Big(\alpha - \tfrac12\big(\bar C^{i2t}_b + \bar C^{t2i}_b\big),
              0, \alpha\Big), \qquad
        P_b = \mathrm{clip}\Big(p_b \big/ \mathrm{mean}(\text{top}_{\lfloor B/10 \rfloor + 1}
              \, p), 0, 1\Big)

    A pair whose caption beats every negative by the margin scores 1; the top tenth of the
    batch sets the scale. When every ``p`` is 0 the official code divides by zero (NaN);
    here the prediction is 0.

    Args:
      sim: ``[B, B]`` image-by-caption similarities (eval mode), positives on the diagonal.
      margin: :math:`\alpha` (0.2).
      where: optional bool ``[B]``, True for real pairs (padding: never a negative, 0).

    Returns:
      ``[B]`` predictions in ``[0, 1]`` (0 for padding).

    References:
      Huang et al., NeurIPS 2021, Sec. 3.3 (co-rectify; the official ``predict`` mode).
    """
    sim = jnp.asarray(sim)
    num = sim.shape[0]
    mask = jnp.ones(num, bool) if where is None else jnp.asarray(where, bool)
    count = mask.sum()
    cost_i2t, cost_t2i = ranking.hinge_costs(sim, margin, where=mask)
    mean_cost = (cost_i2t.sum(1) + cost_t2i.sum(1)) / jnp.maximum(count, 1)
    p = jnp.clip(margin - mean_cost / 2, 0.0, margin)
    p = jnp.where(mask, p, -jnp.inf)  # padding sorts last
    ordered = -jnp.sort(-p)  # descending
    top = jnp.arange(num) < count // 10 + 1
    scale = jnp.where(top, ordered, 0.0).sum() / (count // 10 + 1)
    out = jnp.where(scale > 0, p / jnp.where(scale > 0, scale, 1.0), 0.0)
    return jnp.where(mask, jnp.clip(out, 0.0, 1.0), 0.0)


def rectified_labels(prob: ArrayLike, prediction: ArrayLike, labels: ArrayLike = 1.0) -> jax.Array:
    r"""Co-rectified correspondence labels of the clean set.

    .. math::  \hat y_i = w_i y_i + (1 - w_i) P_i

    Args:
      prob: ``[B]`` the peer network's clean probability :math:`w_i`.
      prediction: ``[B]`` the training network's prediction :math:`P_i`.
      labels: observed labels :math:`y_i` (1 for every pair of a correspondence dataset).

    Returns:
      ``[B]`` soft labels in ``[0, 1]``.

    References:
      Huang et al., NeurIPS 2021, Eq. 6.
    """
    prob = jnp.asarray(prob)
    return prob * labels + (1.0 - prob) * jnp.asarray(prediction)


def rectified_label_matrix(
    prob: ArrayLike, prediction: ArrayLike, labels: ArrayLike = 1.0
) -> jax.Array:
    r"""The official NCR code's co-rectified clean labels: Eq. 6 broadcast to ``[B, B]``.

    .. math::  \hat y_{ij} = w_i y_i + (1 - w_i) P_j

    The official ``co_train.train`` computes ``ptl = batch_prob_l * batch_labels_l + (1 -
    batch_prob_l) * pl`` with ``[B, 1]`` probabilities and labels and a ``[B]`` prediction, so
    its clean labels are a matrix, and its hinge loss gives entry ``(i, j)`` (after the soft
    margin) to both terms that pair image ``i`` with caption ``j``: image ``i`` against
    caption ``j`` and caption ``j`` against image ``i`` (``ncljax.losses.hinge_costs`` with a
    ``[B, B]`` margin). The diagonal is Eq. 6's ``rectified_labels``.

    Args:
      prob: ``[B]`` the peer network's clean probability :math:`w_i`.
      prediction: ``[B]`` the training network's prediction :math:`P_j`.
      labels: observed labels :math:`y_i`, a scalar or ``[B]`` (1 for every pair of a
        correspondence dataset).

    Returns:
      ``[B, B]`` soft labels, rows indexed by image, columns by caption.

    References:
      Huang et al., NeurIPS 2021, Eq. 6; the official code (``co_train.train``, the line
      that builds ``ptl``).
    """
    prob = jnp.asarray(prob)[:, None]
    labels = jnp.broadcast_to(jnp.asarray(labels, prob.dtype), prob.shape[:1])[:, None]
    return prob * labels + (1.0 - prob) * jnp.asarray(prediction)[None, :]
