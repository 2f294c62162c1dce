"""Per-epoch diagnostics of a method's per-pair scores against the true noise mask.

For methods with a ``diagnostic_scores_fn`` (e.g. GSC's cross-modal, intra-modal and final
labels), after every epoch: noise-detection AUC, precision and recall of each score, its
mean over clean and over noisy pairs (logged in ``metrics.jsonl``), and histograms for
clean and noisy pairs plus the values of a fixed subset of pairs, saved to
``workdir/diagnostics/epoch_XXXX.npz`` for the notebooks. The true mask is read here
only; nothing flows back into training.

A logged mean over no items (a precision when nothing was selected, the noisy share of a
pull that pulled nothing, the accuracy of an empty set) is undefined: it is NaN here
(``null`` in ``metrics.jsonl``), never 0.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from ncljax import evaluate
from ncljax.train import state as state_lib

NUM_BINS = 50
NUM_TRACKED = 256


def ratio(total: float, count: float) -> float:
    """``total / count`` exactly, NaN when ``count`` is 0 (a mean over no items)."""
    return float(total) / float(count) if count != 0 else math.nan


def mean_of_sums(accumulated: dict) -> dict[str, float]:
    """The logged means of accumulated ``[2]`` ``(sum, count)`` step metrics.

    ``count`` is a number of items or a total weight (``noisy_weight_share``: the noisy
    part and the total of a loss weight): the mean is ``sum / count`` exactly, also for a
    total below 1, and NaN where ``count`` is 0. Logged metrics only; the trainer's
    finiteness check reads the loss and gradients, never these.
    """
    host = jax.device_get(accumulated)
    return {k: ratio(*np.asarray(v, np.float64)) for k, v in host.items()}


def fallback_share(rows, main_epochs) -> float:
    """The share of the main-phase training steps that trained a fallback objective.

    A method reports a degenerate division in one of two ways (``ncljax.methods.base``): per
    step, as the train metric ``division_fallback`` (SREM: the share of a logging window's
    steps whose batch divided nothing), or per epoch, as ``division_fallback`` (0 or 1) of
    the refresh before the epoch (the co-divide, GSC, UGNCL: the whole epoch trains the
    fallback rule). A train row stands for the steps since the row before it (``step``
    counts the run's steps); an epoch whose train rows carry the metric is read from them,
    any other from its refresh.

    Args:
      rows: the run's ``metrics.jsonl`` rows, in order.
      main_epochs: the epochs of the main phase (``EpochPlan.phase`` not the warm-up).

    Returns:
      fallback steps / main-phase steps; NaN for a run with no main-phase step.
    """
    main_epochs = set(main_epochs)
    steps, per_step, flagged, refreshed = {}, {}, {}, {}
    previous = 0
    for row in rows:
        step, epoch, split = row["step"], row.get("epoch"), row["split"]
        if split == "train" and epoch in main_epochs:
            weight = max(step - previous, 0)
            steps[epoch] = steps.get(epoch, 0) + weight
            value = row.get("division_fallback")
            if value is not None:
                per_step[epoch] = per_step.get(epoch, 0.0) + weight * float(value)
                flagged[epoch] = True
        if split == "refresh" and row.get("division_fallback") is not None:
            refreshed[epoch] = refreshed.get(epoch, False) or float(row["division_fallback"]) > 0
        previous = step
    total = sum(steps.values())
    fell_back = sum(
        per_step.get(e, 0.0) if flagged.get(e) else steps[e] * refreshed.get(e, False)
        for e in steps
    )
    return ratio(fell_back, total)


def tracked_pairs(clean: np.ndarray, num: int = NUM_TRACKED) -> np.ndarray:
    """A fixed, seeded subset of pair indices (half clean, half noisy where possible)."""
    rng = np.random.default_rng(0)
    picks = []
    for group in (np.flatnonzero(clean), np.flatnonzero(~clean)):
        picks.append(rng.choice(group, size=min(num // 2, group.size), replace=False))
    return np.sort(np.concatenate(picks))


def score_diagnostics(method, state, clean: np.ndarray, workdir: str, epoch: int) -> dict:
    """Scores ``method.diagnostic_scores_fn`` against ``clean``.

    Returns the logged metrics of the scores averaged over networks (``noise_auc_<name>``,
    ``clean_precision_<name>``, ``clean_recall_<name>``, ``<name>_mean_clean``,
    ``<name>_mean_noisy``) and writes, per network (leading axis ``K``), the histograms
    (``<name>_hist_clean``/``<name>_hist_noisy`` ``[K, bins]`` over ``<name>_edges``) and
    the values of the tracked pairs (``<name>_tracked`` ``[K, T]``, with
    ``index_tracked``/``clean_tracked`` ``[T]``).
    """
    clean = np.asarray(clean, bool)
    if method.diagnostic_scores_fn is None or clean.all() or not clean.any():
        return {}
    num_networks = jax.tree.leaves(state.params)[0].shape[0]
    per_network = [
        jax.device_get(method.diagnostic_scores_fn(state_lib.network(state.memory, k)))
        for k in range(num_networks)
    ]
    tracked = tracked_pairs(clean)
    arrays = {"index_tracked": tracked, "clean_tracked": clean[tracked]}
    metrics = {}
    for name in per_network[0]:
        scores = np.stack([np.asarray(p[name], np.float64) for p in per_network])
        score = scores.mean(0)
        quality = evaluate.noise_detection_metrics(score, clean)
        for key in ("noise_auc", "clean_precision", "clean_recall"):
            metrics[f"{key}_{name}"] = quality[key]
        metrics[f"{name}_mean_clean"] = float(score[clean].mean())
        metrics[f"{name}_mean_noisy"] = float(score[~clean].mean())
        edges = np.linspace(min(0.0, scores.min()), max(1.0, scores.max()), NUM_BINS + 1)
        arrays[f"{name}_edges"] = edges
        arrays[f"{name}_hist_clean"] = np.stack([np.histogram(s[clean], edges)[0] for s in scores])
        arrays[f"{name}_hist_noisy"] = np.stack([np.histogram(s[~clean], edges)[0] for s in scores])
        arrays[f"{name}_tracked"] = scores[:, tracked]
    if jax.process_index() == 0:
        directory = os.path.join(workdir, "diagnostics")
        os.makedirs(directory, exist_ok=True)
        np.savez(os.path.join(directory, f"epoch_{epoch:04d}.npz"), **arrays)
    return metrics


def label_diagnostics(method, state, pairs) -> dict[str, float]:
    """Accuracy of the method's corrected labels on the pairs it trusts (true labels known;
    NaN when it trusts none)."""
    true = pairs.true_labels
    if method.label_estimate_fn is None or (true < 0).any():
        return {}
    labels, selected = method.label_estimate_fn(state_lib.network(state.memory, 0))
    labels, selected = np.asarray(labels), np.asarray(selected, bool)
    observed = np.concatenate([pairs.labels_image == true, pairs.labels_text == true])
    return {
        "corrected_accuracy": ratio((labels == true)[selected].sum(), selected.sum()),
        "selected_fraction": float(selected.mean()),
        "observed_accuracy": float(observed.mean()),
    }


def noise_diagnostics(method, state, clean: np.ndarray) -> dict[str, float]:
    """Noise-detection quality of the method's clean estimate: of the mean over networks,
    and with several networks of each one (``noise_auc_net0``, ...)."""
    if method.clean_score_fn is None or clean.all() or not clean.any():
        return {}
    num_networks = jax.tree.leaves(state.params)[0].shape[0]
    scores = [
        np.asarray(method.clean_score_fn(state_lib.network(state.memory, k)))
        for k in range(num_networks)
    ]
    out = evaluate.noise_detection_metrics(np.mean(scores, 0), clean)
    if num_networks > 1:
        for k, score in enumerate(scores):
            quality = evaluate.noise_detection_metrics(score, clean)
            out.update({f"{name}_net{k}": value for name, value in quality.items()})
    return out
