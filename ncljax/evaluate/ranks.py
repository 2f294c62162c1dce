r"""Tie-aware ranks: where each query's ground truth ranks up to the order of tied candidates,
and the expected Recall@K, rSum, median and mean rank that follow (host numpy, SCAN
conventions).

Ties favour nothing: every metric is its expected value when tied candidates are put in a
uniformly random order, from the counts of strictly better and of tied negatives (exact,
closed form). A collapsed model (every similarity equal) therefore scores chance level, not a
perfect rSum of 600.

References:
  Lee et al., "Stacked Cross Attention for Image-Text Matching" (SCAN), ECCV 2018: Recall@K,
  rSum, medr and meanr.
  McSherry and Najork, "Computing Information Retrieval Performance Measures Efficiently in the
  Presence of Tied Scores", ECIR 2008.
"""

from typing import Any, NamedTuple

import numpy as np
from jax.typing import ArrayLike

RECALL_KS = (1, 5, 10)


def recall_min_images(captions_per_image: int, ks: tuple[int, ...] = RECALL_KS) -> int:
    r"""The fewest images a split needs for every Recall@K of ``ks`` to depend on the model.

    A query's rank is below :math:`K` by construction when it has fewer than :math:`K`
    wrong candidates. A text->image query ranks the split's :math:`n` images (one right,
    :math:`n - 1` wrong); an image->text query ranks its :math:`n \cdot \mathrm{cpi}`
    captions (:math:`\mathrm{cpi}` right, :math:`(n - 1)\,\mathrm{cpi}` wrong). Both need at
    least :math:`K_{\max}` wrong candidates:

    .. math::

        n \ge \max(K_{\max} + 1,\ \lceil K_{\max} / \mathrm{cpi} \rceil + 1) = K_{\max} + 1,

    i.e. 11 images for R@10 whatever ``cpi``: with 10 or fewer, text->image R@10 is 100.

    Args:
      captions_per_image: ``cpi >= 1``.
      ks: the cutoffs reported (default ``RECALL_KS``).

    Returns:
      The minimum number of images.
    """
    k = max(ks)
    return max(k + 1, -(-k // captions_per_image) + 1)


class RankCounts(NamedTuple):
    r"""Where the ground truth of each query ranks, up to the order of tied candidates.

    For a query, :math:`g` negatives are strictly more similar than its (best) ground truth,
    :math:`t` negatives are tied with it and :math:`m \ge 1` ground-truth candidates share that
    best value (image->text: the image's captions; always 1 for text->image). With the
    :math:`t + m` tied candidates in a uniformly random order, the 0-based rank is
    :math:`g + X`, :math:`X` the number of tied negatives placed before the first tied ground
    truth:

    .. math::

        P(X \ge x) = \binom{t}{x} \Big/ \binom{t + m}{x}
            = \prod_{j=0}^{x-1} \frac{t - j}{t + m - j}, \qquad
        E[X] = \frac{t}{m + 1}, \qquad
        P(g + X < K) = 1 - P(X \ge K - g) \ \ (K > g; \text{ else } 0).

    For :math:`m = 1`, :math:`P(g + X < K) = \mathrm{clip}((K - g) / (t + 1), 0, 1)`. Without
    ties (:math:`t = 0`) the rank is :math:`g` and every formula is the plain indicator.

    Attributes:
      greater: ``[n]`` int64 :math:`g`, negatives strictly above the ground truth.
      tied: ``[n]`` int64 :math:`t`, negatives tied with it.
      ground_truth_ties: ``[n]`` int64 :math:`m \ge 1`, ground truths at the best value.
    """

    greater: np.ndarray
    tied: np.ndarray
    ground_truth_ties: np.ndarray

    @classmethod
    def from_ranks(cls, ranks: ArrayLike) -> "RankCounts":
        """Counts of plain 0-based integer ranks (no ties): ``(ranks, 0, 1)``."""
        ranks = np.asarray(ranks)
        if ranks.ndim != 1 or np.any(ranks < 0) or np.any(ranks != np.round(ranks)):
            raise ValueError(f"ranks must be [n] non-negative integers, got {ranks!r}")
        ranks = ranks.astype(np.int64)
        return cls(ranks, np.zeros_like(ranks), np.ones_like(ranks))

    def expected_rank(self) -> np.ndarray:
        """``[n]`` float64 expected 0-based rank, :math:`g + t / (m + 1)`."""
        return self.greater + self.tied / (self.ground_truth_ties + 1.0)

    def hit_probability(self, k: int) -> np.ndarray:
        """``[n]`` float64 probability that the ground truth ranks in the top ``k``."""
        g, t, m = (np.asarray(x, np.int64)[:, None] for x in self)
        j = np.arange(k)
        # Factor j of P(X >= x); it is 0 once j >= t, where the denominator may reach 0.
        factors = np.maximum(t - j, 0) / np.maximum(t + m - j, 1)
        survival = np.concatenate([np.ones_like(factors[:, :1]), np.cumprod(factors, 1)], 1)
        need = np.clip(k - g[:, 0], 0, k)  # the rank is below k iff X < need
        miss = np.take_along_axis(survival, need[:, None], 1)[:, 0]
        return np.where(need > 0, 1.0 - miss, 0.0)


class RetrievalRanks(NamedTuple):
    """:class:`RankCounts` of the image->text (``[n_img]``) and text->image (``[n_txt]``)
    queries."""

    i2t: RankCounts
    t2i: RankCounts


def _as_counts(ranks: Any) -> RankCounts:
    if isinstance(ranks, RankCounts):
        return RankCounts(*(np.asarray(x, np.int64) for x in ranks))
    return RankCounts.from_ranks(ranks)


def rank_metrics(i2t_rank: Any, t2i_rank: Any) -> dict[str, float]:
    r"""Expected Recall@{1,5,10}, rSum, median and mean rank (SCAN conventions, fair ties).

    With :math:`r_q` the 0-based rank of query :math:`q` under a uniformly random order of
    tied candidates (:class:`RankCounts`):

    .. math::

        \mathrm{R@K} = \frac{100}{N} \sum_q P(r_q < K), \quad
        \mathrm{rSum} = \sum_{d \in \{i2t, t2i\}} \sum_{K \in \{1,5,10\}} \mathrm{R@K}_d,

        \mathrm{medr} = \lfloor \mathrm{median}_q (E[r_q] + 1) \rfloor, \quad
        \mathrm{meanr} = \frac{1}{N} \sum_q (E[r_q] + 1).

    Without ties :math:`r_q` is fixed and these are SCAN's values exactly; ``medr`` is the
    median of the expected 1-based ranks, floored (SCAN floors the median rank).

    Args:
      i2t_rank: :class:`RankCounts` of the ``n_img`` image->text queries (as returned by
        :func:`retrieval_ranks`), or ``[n_img]`` plain 0-based integer ranks.
      t2i_rank: the same for the ``n_txt`` text->image queries.

    Returns:
      ``i2t_r1, i2t_r5, i2t_r10, t2i_r1, t2i_r5, t2i_r10, rsum, i2t_medr, i2t_meanr, t2i_medr,
      t2i_meanr`` as python floats (recalls in percent).
    """
    counts = {"i2t": _as_counts(i2t_rank), "t2i": _as_counts(t2i_rank)}
    metrics = {
        f"{name}_r{k}": 100.0 * float(np.mean(c.hit_probability(k)))
        for name, c in counts.items()
        for k in RECALL_KS
    }
    metrics["rsum"] = float(sum(metrics.values()))
    for name, c in counts.items():
        rank = c.expected_rank() + 1.0
        metrics[f"{name}_medr"] = float(np.floor(np.median(rank)))
        metrics[f"{name}_meanr"] = float(np.mean(rank))
    return metrics


def rsum_by_image(i2t_rank: Any, t2i_rank: Any, captions_per_image: int) -> np.ndarray:
    r"""Each image's share of the rSum: its image->text query's expected hits and its
    captions' text->image ones, so that the shares sum to :func:`rank_metrics`' rSum.

    With :math:`h^{i2t}_i = \sum_{K \in \{1,5,10\}} P(r_i < K)` the image's expected hits,
    :math:`h^{t2i}_k` a caption's, and :math:`\mu(k) = \lfloor k / \mathrm{cpi} \rfloor`
    the image of caption :math:`k` (the caption order of :func:`retrieval_ranks`):

    .. math::

        s_i = \frac{100}{n_{img}} \Big( h^{i2t}_i
            + \frac{1}{\mathrm{cpi}} \sum_{k : \mu(k) = i} h^{t2i}_k \Big), \qquad
        \sum_i s_i = \mathrm{rSum}.

    An image and its captions are one unit of a split: two models scored on the same
    split give paired shares, whose differences a paired test reads
    (``ncljax.train.arms``).

    Args:
      i2t_rank: :class:`RankCounts` (or plain 0-based ranks) of the ``n_img`` image
        queries.
      t2i_rank: the same for the ``n_img * captions_per_image`` caption queries.
      captions_per_image: ``cpi >= 1``.

    Returns:
      ``[n_img]`` float64 shares.

    Raises:
      ValueError: where the caption count is not ``n_img * captions_per_image``.
    """
    i2t, t2i = _as_counts(i2t_rank), _as_counts(t2i_rank)
    n_img = i2t.greater.size
    if captions_per_image < 1 or t2i.greater.size != n_img * captions_per_image:
        raise ValueError(
            f"{t2i.greater.size} caption queries for {n_img} images is not "
            f"{captions_per_image} captions per image"
        )
    image_hits = sum(i2t.hit_probability(k) for k in RECALL_KS)
    caption_hits = sum(t2i.hit_probability(k) for k in RECALL_KS)
    caption_hits = caption_hits.reshape(n_img, captions_per_image).mean(axis=1)
    return 100.0 / max(n_img, 1) * (image_hits + caption_hits)
