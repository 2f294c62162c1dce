"""A division raced against none (``train.division='race'``): the method trained twice, as it
divides and with every division off, and the division kept where its best model validates
higher than the undivided run's beyond the validation split's noise.

Why. A division pays where pairs lie and costs where they do not: it sets aside the pairs
the model places worst, and on a small or weakly paired folder those are clean pairs the
model has not learnt yet. Whether the pairs the model places worst lie or are hard cannot
be read from the scores: a set of partner p-values with density ``f`` is a mixture of a
uniform share ``pi`` (mismatched pairs) and something else for every ``pi`` up to
``min f``, so a weak model's clean pairs read as a share of lies (the held-out share of a
clean validation split reads 0.26-0.50 on 400 clean synthetic pairs, as it does on noisy
folders). Which of the two models retrieves better is a question the validation split
answers, clean or as noisy as the training pairs (a mismatched validation pair is as
unretrievable for both models). The undivided run is the method's own objective on every
pair (its warm-up is the same run's), so the race costs one more run.

The decision (:func:`decide`). Each run writes its best model's share of the validation
rSum by image (:data:`SHARES`: an image's query and its captions' queries,
``ncljax.evaluate.rsum_by_image``), so the two runs' shares are paired by image. The
division is kept where Student's one-sided paired t-test of the differences reads a
p-value under ``train.race_alpha`` (0.05) that the divided run validates higher; else the
undivided run is the run's (0.5: the higher rSum wins). The division is what must earn its
place: where pairs lie it wins by far more than the split's noise (on the 100-pair
validation split of the cancer halves at 40% and 60% mismatched by 35-114 rSum, p below
0.001), and where they do not the two runs are a coin on a split of a few hundred pairs,
or the division costs. Measured (three seeds; ``benchmarks/race_alpha.py``,
``benchmarks/RESULTS.md``): on the 400-pair ``vec_few_regions`` at 0%, whose divisions
cost 10-26 test rSum, the undivided runs validated higher on 13 of 15 seeds, by up to 31
on its 100-pair split but at p 0.01-0.37 (a test the other way round kept divisions there
and lost 7-17); on the clean cancer halves UGNCL's undivided run validated 3 and 2 higher
(p 0.25, 0.21) and tested 8 lower and 2 higher, which the higher rSum alone followed to
InfoNCE - 6.0, and this rule to -4.7.

Layout. The divided run trains in the workdir, as any run, and writes its test figures to
``divided_results.json``; the undivided run trains in ``<workdir>/undivided/`` (its own
``config.json`` with ``train.division='off'``, checkpoints, ``results.json``); each
writes its :data:`SHARES`. Then the workdir's ``results.json`` is the winner's figures,
with ``race_undivided`` (1.0 where the undivided run won), ``race_p_value`` (the test's;
absent where the runs were one run) and both runs' best validation values
(``race_val_<metric>_divided``, ``..._undivided``). Rerunning the command resumes
whichever run has not finished. The audit and retrieval read the winner's model
(:func:`model_workdir`).

A divided run that switched every division off at every refresh (:func:`never_divided`:
a clean folder whose pairs the model places well) trained exactly as its undivided run
would: the switch's ``'off'`` is the same code path as ``train.division='off'``, which
only skips the estimate. The undivided run is then not trained again (``race_same_run``
1.0, both validation values the divided run's). Measured: on the clean digits, MNIST and
cancer halves (three seeds) 24 of 45 races had such a divided run (NCR and PC2 on every
folder, SREM on two), and each undivided run trained beside it gave the same validation
curve and test figures to the last digit. UGNCL's first refresh always divides, so its
races always train both runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from ncljax.config import base as config_base
from ncljax.train import rundir

UNDIVIDED = "undivided"  # the undivided run's folder inside the workdir
DIVIDED_RESULTS = "divided_results.json"  # the divided run's test figures
RESULTS = "results.json"
WON = "race_undivided"  # results.json: 1.0 where the undivided run won
SAME = "race_same_run"  # results.json: 1.0 where the divided run never divided
METRICS = "metrics.jsonl"
SHARES = "val_rsum_by_image.npy"  # each validation image's share of the best model's rSum
P_VALUE = "race_p_value"  # results.json: p-value that the divided run validates higher


def racing(config) -> bool:
    """Whether ``config`` races its division against none."""
    return config.train.get("division", "on") == "race"


def divides(config) -> bool:
    """Whether a run of ``config`` may divide (``False`` under ``train.division='off'``)."""
    return config.train.get("division", "on") != "off"


def compares(config) -> bool:
    """Whether a run of ``config`` writes its best model's validation rSum shares
    (:data:`SHARES`, :func:`write_shares`) for a paired comparison with another run on the
    same split: each run of a race, and a run with ``train.division='off'`` (recall
    evaluation only)."""
    return config.train.get("division", "on") != "on" and config.eval.kind == "recall"


def results_file(config) -> str:
    """The name of the file a run of ``config`` writes its test figures to."""
    return DIVIDED_RESULTS if racing(config) else RESULTS


def undivided_config(config) -> ml_collections.ConfigDict:
    """``config`` with every division off: the race's other run."""
    other = ml_collections.ConfigDict(config.to_dict())
    other.train.division = "off"
    if "race_alpha" in other.train:  # read by the race, not by its runs
        other.train.race_alpha = config_base.base_config().train.race_alpha
    return other


def race(
    config: ml_collections.ConfigDict,
    workdir: str,
    train: Callable[[ml_collections.ConfigDict, str], dict],
    selection: str,
) -> dict:
    """Trains the divided run in ``workdir`` and the undivided one in
    ``workdir/undivided`` (``train(config, workdir) -> test metrics``, each run resuming
    from its own checkpoints), and writes and returns the winner's figures (see the
    module's note). ``selection`` is the validation metric both runs chose their best
    epoch by (``'rsum'``)."""
    divided = train(config, workdir)
    same = never_divided(workdir)
    if jax.process_count() > 1:  # process 0 wrote the metrics: every process follows it
        same = bool(multihost_utils.broadcast_one_to_all(np.asarray(same)))
    if same:  # the undivided run would be this run again
        undivided = divided
    else:
        undivided = train(undivided_config(config), os.path.join(workdir, UNDIVIDED))
    key = f"val_{selection}"
    alpha = float(config.train.get("race_alpha", config_base.base_config().train.race_alpha))
    won, p = False, math.nan
    if not same and not compares(config):  # mAP: no shares; the higher value wins
        won = beats(undivided[key], divided[key])
    elif not same:
        if jax.process_index() == 0:  # which wrote the shares
            won, p = decide(workdir, undivided[key], divided[key], alpha)
        if jax.process_count() > 1:  # every process follows process 0
            won, p = multihost_utils.broadcast_one_to_all((np.asarray(won), np.float64(p)))
            won, p = bool(won), float(p)
    results = dict(undivided if won else divided)
    results[WON] = float(won)
    results[SAME] = float(same)
    if not math.isnan(p):  # tested
        results[P_VALUE] = p
    results[f"race_{key}_divided"] = divided[key]
    results[f"race_{key}_undivided"] = undivided[key]
    if jax.process_index() == 0:
        try:
            rundir.atomic_write_json(os.path.join(workdir, RESULTS), results)
        except OSError as e:
            raise rundir.unwritable(workdir, e) from None
        if same:
            print(
                "division race: the run switched its division off at every refresh, so it "
                "is also its undivided run (not trained again); its figures are the run's."
            )
        else:
            winner = "undivided" if won else "divided"
            test = "" if math.isnan(p) else f"; divided higher at p={p:.3g}, level {alpha:g}"
            where = f" ({os.path.join(workdir, UNDIVIDED)})." if won else "."
            print(
                f"division race: the {winner} run's model is kept ({selection} "
                f"{divided[key]:.4g} divided, {undivided[key]:.4g} undivided{test}); its "
                f"figures are the run's{where}"
            )
    return results


def never_divided(workdir: str) -> bool:
    """Whether the run in ``workdir`` switched every division off at every refresh: its
    ``metrics.jsonl`` holds at least one ``refresh`` row, and every refresh row's
    ``division_off`` values (one per network) read 1. ``False`` where the file cannot be
    read whole (a damaged line), so that the undivided run is then trained."""
    refreshes = 0
    try:
        with open(os.path.join(workdir, METRICS)) as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("split") != "refresh":
                    continue
                off = [v for k, v in row.items() if k.startswith("division_off")]
                if not off or any(v != 1.0 for v in off):
                    return False
                refreshes += 1
    except (OSError, ValueError):
        return False
    return refreshes > 0


def write_shares(workdir: str, shares: np.ndarray) -> None:
    """Writes ``shares`` to ``workdir``'s :data:`SHARES` (process 0; atomically)."""
    if jax.process_index() != 0:
        return
    try:
        rundir.atomic_save_npy(os.path.join(workdir, SHARES), np.asarray(shares, np.float64))
    except OSError as e:
        raise rundir.unwritable(workdir, e) from None


def read_shares(workdir: str) -> np.ndarray | None:
    """``workdir``'s :data:`SHARES`, or ``None`` where it is missing or unreadable."""
    try:
        shares = np.load(os.path.join(workdir, SHARES))
    except (OSError, ValueError):
        return None
    return shares if shares.ndim == 1 else None


def paired_p_value(shares: np.ndarray, other: np.ndarray) -> float:
    r"""The one-sided p-value that the model with validation rSum shares ``shares``
    retrieves better than the one with ``other`` (:func:`ncljax.evaluate.rsum_by_image`,
    the same split's images in the same order): Student's paired t-test of the images'
    differences :math:`d_i = s_i - o_i` (``scipy.stats.ttest_rel``, alternative
    ``'greater'``), whose mean is the rSum difference over :math:`n_{img}`. 1.0 where
    every difference is 0 (the same retrieval)."""
    shares, other = np.asarray(shares, np.float64), np.asarray(other, np.float64)
    if shares.shape != other.shape:
        raise ValueError(f"shares of {shares.shape} and {other.shape} images are not paired")
    if not np.any(shares != other):
        return 1.0
    import scipy.stats  # here, not at load: half a second that only a race decision pays

    p = float(scipy.stats.ttest_rel(shares, other, alternative="greater").pvalue)
    return 1.0 if math.isnan(p) else p


def decide(
    workdir: str, undivided_value: float, divided_value: float, alpha: float
) -> tuple[bool, float]:
    """``(whether the undivided run wins, the paired test's p-value)``: the division is
    kept where its best model validates higher than the undivided run's beyond the
    validation split's noise, :func:`paired_p_value` of the divided run's shares against
    the undivided run's under ``alpha`` (``train.race_alpha``); else the undivided run
    wins. Where either run's shares are missing (a run written before they were), the
    higher validation value wins (:func:`beats`; a tie keeps the division), with a
    warning, and the p-value is NaN."""
    divided = read_shares(workdir)
    undivided = read_shares(os.path.join(workdir, UNDIVIDED))
    if divided is None or undivided is None or divided.shape != undivided.shape:
        logging.warning(
            "division race in %s: a run's validation shares (%s) are missing, so the higher "
            "validation value wins, without a test of the split's noise.",
            workdir,
            SHARES,
        )
        return beats(undivided_value, divided_value), math.nan
    p = paired_p_value(divided, undivided)
    return not p < alpha, p


def beats(value: float, other: float) -> bool:
    """Whether a validation figure ``value`` is higher than ``other``: strictly, beyond
    float round-off (the same recalls summed in another order differ in the last bits:
    377.33333333333337 against 377.3333333333333 is a tie, and a tie keeps the division)."""
    return value > other and not math.isclose(value, other, rel_tol=1e-9, abs_tol=1e-9)


def model_workdir(workdir: str) -> str:
    """The folder of the model a finished run stands for: ``workdir/undivided`` where the
    run is a division race the undivided run won, else ``workdir``."""
    path = os.path.join(workdir, RESULTS)
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError):
        return workdir
    if isinstance(results, dict) and results.get(WON) == 1.0:
        return os.path.join(workdir, UNDIVIDED)
    return workdir
