r"""Each training pair's similarity at the end of every epoch: the model's trajectory over
the pairs, which the audit averages (``train.pair_trajectory``, on in the ``:vectors``
settings).

A network learns the matched pairs of a noisy training set first and the mismatched ones
later, by memorising them (Arpit et al., "A Closer Look at Memorization in Deep
Networks", ICML 2017). A pair's similarity under one model mixes both; its mean over the
epochs of training counts how long the model took to learn it, the signal of training
dynamics (Pleiss et al., "Identifying Mislabeled Data using the Area Under the Margin
Ranking", NeurIPS 2020, average a sample's margin over epochs the same way). The trainer
writes ``<workdir>/trajectory/epoch_<e>.npy`` after each epoch's validation: float32
``[N]``, the similarity the epoch's model gives each training pair as it evaluates
(``Evaluator.pair_similarity``: every network and view, pooled). ``ncljax.audit`` ranks
by the mean over the epochs up to the best checkpoint's: the history of the model a user
retrieves with.

A crash loses nothing: an epoch's file is written before its checkpoint, and a resumed
run writes the epochs after its checkpoint again (the same values: the run resumes to
the same models), so the files of every epoch a checkpoint has completed are there.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from ncljax.train import rundir

DIRECTORY = "trajectory"


def epoch_path(workdir: str, epoch: int) -> str:
    """The file of epoch ``epoch`` (0-based) in ``workdir``."""
    return os.path.join(workdir, DIRECTORY, f"epoch_{epoch:04d}.npy")


def record(workdir: str, epoch: int, similarity: np.ndarray) -> None:
    """Writes epoch ``epoch``'s similarity of each training pair (process 0; atomically:
    a crash leaves the previous file or none, never a partial one)."""
    if jax.process_index() != 0:
        return
    path = epoch_path(workdir, epoch)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rundir.atomic_save_npy(path, np.asarray(similarity, np.float32))


def mean_until(workdir: str, epoch: int, num_pairs: int) -> tuple[np.ndarray | None, str | None]:
    """The mean similarity of each training pair over epochs ``0 .. epoch``: ``(mean
    float64 [num_pairs], None)``, or ``(None, why)`` where an epoch's file is missing or
    does not fit (the run did not record its trajectory, or a file was removed)."""
    if epoch < 0:
        return None, "no epoch has finished"
    total = np.zeros(num_pairs, np.float64)
    for e in range(epoch + 1):
        path = epoch_path(workdir, e)
        if not os.path.exists(path):
            return None, f"{path} is missing"
        try:
            values = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            return None, f"{path} cannot be read ({err})"
        if values.shape != (num_pairs,) or not np.all(np.isfinite(values)):
            return None, f"{path} does not hold one finite value per training pair"
        total += values
    return total / (epoch + 1), None
