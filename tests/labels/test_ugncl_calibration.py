"""UGNCL's data-calibrated division (``calibration='data'``): the mixture posteriors that
replace the thresholds ``p`` and ``epsilon``, and the bimodality gate of the hard set,
against a float64 numpy EM
(tests/labels/test_gmm.py's oracle, itself checked against scikit-learn), their invariance
to the scale of the scores, and the degenerate flag."""

import math

import jax
import numpy as np
import pytest

from ncljax.labels import ugncl as division
from ncljax.methods.ugncl import calibrated_partition
from tests.labels.test_gmm import _numpy_em

calibrate = jax.jit(division.calibrate_signals)


def _signals(seed=0, n=200):
    """Uncertainties of two clusters (determined, hard) and soft labels spread over four
    decades (``q`` of a softmax over ~100 classes: clean pairs high, noisy ones near 1/K)."""
    rng = np.random.default_rng(seed)
    u = np.concatenate([rng.normal(0.2, 0.05, n * 3 // 5), rng.normal(0.6, 0.08, n * 2 // 5)])
    log_q = np.concatenate([rng.normal(-1.0, 0.6, n // 2), rng.normal(-5.0, 0.8, n // 2)])
    perm = rng.permutation(n)
    return np.clip(u, 0.01, 0.99)[rng.permutation(n)], np.exp(log_q)[perm]


def _minmax(x):
    return (x - x.min()) / (x.max() - x.min())


def _ashman_d(fit):
    (m0, m1), (s0, s1) = fit["means"], fit["variances"]
    return math.sqrt(2.0) * abs(m1 - m0) / math.sqrt(s0 + s1)


def _oracle(u, q):
    """``(v, w)``: the high component's posterior of the numpy EM over min-max normalised
    ``u`` (0 everywhere when the mixture is not bimodal, Ashman's ``D <= 2``) and
    ``log q``."""
    fit = _numpy_em(_minmax(np.asarray(u, np.float64)))
    v = fit["posteriors"][:, 1] if _ashman_d(fit) > 2 else np.zeros(len(u))
    w = _numpy_em(_minmax(np.log(np.asarray(q, np.float64))))["posteriors"][:, 1]
    return v, w


def test_posteriors_match_a_numpy_em_of_the_same_scores():
    u, q = _signals()
    got = calibrate(u.astype(np.float32), q.astype(np.float32))
    v, w = _oracle(u.astype(np.float32), q.astype(np.float32))
    np.testing.assert_allclose(got.hard_posterior, v, atol=2e-4)
    np.testing.assert_allclose(got.clean_posterior, w, atol=2e-4)
    assert not bool(got.degenerate)
    # The calibrated thresholds: the determined set is a lower set of u, the hard-clean
    # one an upper set of q, and they lie between the clusters (0.2 and 0.6; e^-5, e^-1).
    determined, clean = v < 0.5, w > 0.5
    p_data = u[~determined].min()
    assert u[determined].max() < p_data and 0.3 < p_data < 0.5
    eps_data = q[clean].min()
    assert q[~clean].max() < eps_data and np.exp(-4) < eps_data < np.exp(-2)


def test_partition_of_the_posteriors_matches_the_rule_in_numpy():
    u, q = _signals(1)
    rng = np.random.default_rng(1)
    prediction = rng.random(u.shape) < 0.3
    got = calibrate(u.astype(np.float32), q.astype(np.float32))
    codes = np.asarray(calibrated_partition(got.hard_posterior, prediction, got.clean_posterior))
    v, w = _oracle(u.astype(np.float32), q.astype(np.float32))
    want = []
    for vi, wi, pi in zip(v, w, prediction, strict=True):
        if vi < 0.5:  # determined: clean if the top-1 or calibrated clean (Eq. 9)
            want.append(division.CLEAN if (pi or wi > 0.5) else division.NOISY)
        else:  # hard: Eq. 11 at the calibrated epsilon
            want.append(division.HARD_CLEAN if wi > 0.5 else division.HARD_NOISY)
    np.testing.assert_array_equal(codes, want)
    assert len(set(want)) == 4


@pytest.mark.parametrize(("scale", "shift", "power"), [(3.0, -0.4, 1.0), (0.01, 2.0, 2.5)])
def test_invariant_to_an_affine_map_of_u_and_a_power_law_of_q(scale, shift, power):
    u, q = _signals(2)
    u, q = u.astype(np.float32), q.astype(np.float32)
    base = calibrate(u, q)
    # q -> c q^a: e.g. a normalisation by the batch's class count K (c = K), or a
    # temperature of the evidence (a); u -> a u + b.
    moved = calibrate(scale * u + shift, (q**power * 100.0).astype(np.float32))
    np.testing.assert_allclose(moved.hard_posterior, base.hard_posterior, atol=1e-4)
    np.testing.assert_allclose(moved.clean_posterior, base.clean_posterior, atol=1e-4)


def test_where_fits_on_the_real_pairs_only():
    u, q = _signals(3, n=100)
    where = np.ones(110, bool)
    where[100:] = False
    pad_u = np.concatenate([u, np.full(10, 50.0)]).astype(np.float32)
    pad_q = np.concatenate([q, np.full(10, 1e-20)]).astype(np.float32)
    got = calibrate(pad_u, pad_q, where=where)
    want = calibrate(u.astype(np.float32), q.astype(np.float32))
    np.testing.assert_allclose(got.hard_posterior[:100], want.hard_posterior, atol=1e-5)
    np.testing.assert_allclose(got.clean_posterior[:100], want.clean_posterior, atol=1e-5)


def test_soft_labels_of_one_group_are_degenerate():
    u, q = _signals(4)
    got = calibrate(u.astype(np.float32), np.full_like(q, 0.01, np.float32))
    assert bool(got.degenerate) and not bool(got.one_level)
    assert np.isfinite(np.asarray(got.clean_posterior)).all()


@pytest.mark.parametrize("level", [0.0, 0.3])
def test_uncertainties_of_one_group_make_every_pair_determined(level):
    """``u`` saturated at 0 (every row holds a pair of overwhelming evidence) or all equal:
    no pair is singled out as uncertain, ``v = 0``; the soft labels still divide."""
    u, q = _signals(4)
    got = calibrate(np.full_like(u, level, np.float32), q.astype(np.float32))
    assert bool(got.one_level) and not bool(got.degenerate)
    np.testing.assert_array_equal(got.hard_posterior, 0.0)
    _, w = _oracle(u, q.astype(np.float32))
    np.testing.assert_allclose(got.clean_posterior, w, atol=2e-4)


def test_a_single_group_of_uncertainties_makes_no_hard_set():
    """A two-component fit of one normal group has Ashman's ``D <= 2``: no pair is hard;
    two groups (the test data) have ``D > 2``."""
    u, q = _signals(6)
    single = np.random.default_rng(6).normal(0.3, 0.05, u.shape).astype(np.float32)
    fit = _numpy_em(_minmax(single.astype(np.float64)))
    assert _ashman_d(fit) <= 2
    got = calibrate(single, q.astype(np.float32))
    assert bool(got.one_level)
    np.testing.assert_array_equal(got.hard_posterior, 0.0)
    assert _ashman_d(_numpy_em(_minmax(u.astype(np.float64)))) > 2
    assert not bool(calibrate(u.astype(np.float32), q.astype(np.float32)).one_level)


def test_zero_soft_labels_are_floored():
    u, q = _signals(5)
    q[:5] = 0.0
    got = calibrate(u.astype(np.float32), q.astype(np.float32))
    assert np.isfinite(np.asarray(got.clean_posterior)).all()
    assert (np.asarray(got.clean_posterior)[:5] < 0.5).all()
