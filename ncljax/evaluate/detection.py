"""Noise-detection quality: how well a method's per-pair clean score separates the clean
training pairs from the noisy ones, against the known noise mask (diagnostics only; no method
may read the mask)."""

import numpy as np
from jax.typing import ArrayLike


def noise_detection_metrics(
    clean_score: ArrayLike, clean_mask: ArrayLike, *, threshold: float = 0.5
) -> dict[str, float]:
    r"""How well a per-pair clean score separates clean from noisy training pairs (host numpy).

    ROC AUC for the clean class by the Mann-Whitney statistic with average ranks for ties
    (``scipy.stats.rankdata``),
    :math:`\mathrm{AUC} = (\sum_{k \in C} R_k - |C|(|C|+1)/2) / (|C|\,|N|)`, i.e. the
    probability that a random clean pair scores above a random noisy one (ties count 1/2, the
    expectation under a random order of tied scores, so ties favour neither class).
    Predicted clean means ``clean_score > threshold``; precision and recall are those of the
    predicted-clean set against the truly clean pairs. O(N log N), float64.

    Args:
      clean_score: ``[N]`` estimate that each pair is clean (higher is cleaner), e.g. a GMM
        posterior.
      clean_mask: ``[N]`` bool (or 0/1) truth, True for clean pairs. Diagnostics only.
      threshold: the cut for predicted clean (default 0.5).

    Returns:
      ``noise_auc`` (how well the score ranks clean pairs above noisy ones; NaN if only
      one class is present), ``clean_precision`` (the share of truly clean pairs among those
      predicted clean, ``score > threshold``; NaN if nothing is predicted clean; at the
      start, when every pair is predicted clean, it is ``1 - noise rate``),
      ``clean_recall`` (the share of the clean pairs predicted clean; NaN if nothing is
      clean), ``noise_accuracy``.
    """
    score = np.asarray(clean_score, dtype=np.float64)
    mask = np.asarray(clean_mask)
    if score.ndim != 1 or mask.shape != score.shape or not score.size:
        raise ValueError(
            f"clean_score and clean_mask must be [N] with N > 0, got {score.shape}, {mask.shape}"
        )
    if mask.dtype != bool and not np.isin(mask, (0, 1)).all():
        raise ValueError("clean_mask must be bool or 0/1")
    if not np.isfinite(score).all():
        raise ValueError("clean_score contains NaN or Inf")
    mask = mask.astype(bool)
    num_clean = int(mask.sum())
    num_noisy = mask.size - num_clean
    if num_clean and num_noisy:
        import scipy.stats  # here, not at load: it takes half a second every command would pay

        clean_rank_sum = scipy.stats.rankdata(score, method="average")[mask].sum()
        auc = (clean_rank_sum - num_clean * (num_clean + 1) / 2.0) / (num_clean * num_noisy)
    else:
        auc = float("nan")
    predicted = score > threshold
    true_positive = int(np.sum(predicted & mask))
    num_predicted = int(predicted.sum())
    return {
        "noise_auc": float(auc),
        "clean_precision": true_positive / num_predicted if num_predicted else float("nan"),
        "clean_recall": true_positive / num_clean if num_clean else float("nan"),
        "noise_accuracy": float(np.mean(predicted == mask)),
    }
