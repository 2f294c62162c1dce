"""SREM's calibrated energy division (``ncljax.labels.srem.calibrate_energy``) against a
numpy loop, its equivariance under an affine change of the energies, and degenerate
divisions."""

import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.labels import srem as selection


def _otsu_oracle(values):
    """Every cut between distinct sorted values, by brute force: the one with the largest
    between-class sum of squares (the first on a tie), its midpoint and class means."""
    x = np.sort(np.asarray(values, np.float64))
    best, result = -1.0, None
    for k in range(1, len(x)):
        if x[k] == x[k - 1]:
            continue
        low, high = x[:k], x[k:]
        between = k * (len(x) - k) * (low.mean() - high.mean()) ** 2
        if between > best * (1 + 1e-9):
            best = between
            result = (0.5 * (x[k - 1] + x[k]), low.mean(), high.mean(), k / len(x))
    return result


def _energies(seed, n=300):
    rng = np.random.default_rng(seed)
    clean = rng.normal(-3.0, 0.6, size=n // 2)
    noisy = rng.normal(-0.5, 0.8, size=n - n // 2)
    return rng.permutation(np.concatenate([clean, noisy])).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calibrated_threshold_and_margins_match_a_numpy_loop(seed):
    energies = _energies(seed)
    where = np.random.default_rng(seed + 10).random(energies.shape) < 0.8
    fit = selection.calibrate_energy(energies, where=where)
    tau, m_clean, m_noisy, fraction = _otsu_oracle(energies[where])
    assert not bool(fit.degenerate)
    np.testing.assert_allclose(fit.threshold, tau, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fit.m_clean, m_clean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fit.m_noisy, m_noisy, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fit.clean_fraction, fraction, rtol=1e-6)
    # The split is a threshold: the low class is exactly the energies below it.
    np.testing.assert_allclose((energies[where] < float(fit.threshold)).mean(), fraction)


def test_calibration_on_hand_worked_values_never_splits_ties():
    fit = selection.calibrate_energy(jnp.array([-4.0, -4.0, -3.0, 0.0, 1.0]))
    # cuts: {-4,-4 | ...} 2*3*(−4−(−2/3))^2 = 66.7; {-4,-4,-3 | 0,1} 3*2*(−11/3−1/2)^2 = 104.2
    np.testing.assert_allclose(fit.threshold, -1.5)
    np.testing.assert_allclose(fit.m_clean, -11 / 3, rtol=1e-6)
    np.testing.assert_allclose(fit.m_noisy, 0.5, rtol=1e-6)
    np.testing.assert_allclose(fit.clean_fraction, 0.6)


@pytest.mark.parametrize(("scale", "shift"), [(1.0, 3.0), (1.0, -np.log(128.0)), (2.5, -1.0)])
def test_calibration_moves_with_an_affine_change_of_the_energies(scale, shift):
    """A shift of every logit by c shifts every energy by -c; a batch size adds -log B: the
    threshold and margins follow, so the division is unchanged."""
    energies = _energies(3)
    fit = selection.calibrate_energy(energies)
    moved = selection.calibrate_energy(scale * energies + shift)
    for name in ("threshold", "m_clean", "m_noisy"):
        np.testing.assert_allclose(
            getattr(moved, name), scale * getattr(fit, name) + shift, rtol=1e-4, atol=1e-4
        )
    np.testing.assert_allclose(moved.clean_fraction, fit.clean_fraction)


def test_the_division_is_invariant_to_a_shift_of_the_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(16, 16)).astype(np.float32) * 2
    logits[np.arange(16), np.arange(16)] += rng.uniform(0, 5, 16)
    for c in (0.0, 2.0, -7.0):
        shifted = jnp.asarray(logits + c)
        energies = selection.energy(shifted)
        fit = selection.calibrate_energy(energies)
        mask = selection.clean_mask(shifted, fit.threshold)
        if c == 0.0:
            reference = mask
        np.testing.assert_array_equal(mask, reference)
    assert 0 < int(reference.sum()) < 16


def test_constant_energies_are_degenerate():
    fit = selection.calibrate_energy(jnp.full(7, -2.0))
    assert bool(fit.degenerate)
    assert float(fit.clean_fraction) == 0.0
    fit = selection.calibrate_energy(jnp.array([1.0, 5.0, 1.0]), where=jnp.array([1, 0, 1], bool))
    assert bool(fit.degenerate)


def test_degenerate_division_flags_none_and_all():
    where = jnp.array([True, True, True, False])
    assert bool(selection.degenerate_division(jnp.array([0, 0, 0, 1], bool), where=where))
    assert bool(selection.degenerate_division(jnp.array([1, 1, 1, 0], bool), where=where))
    assert not bool(selection.degenerate_division(jnp.array([1, 0, 1, 1], bool), where=where))
    assert not bool(selection.degenerate_division(jnp.zeros(4, bool), where=jnp.zeros(4, bool)))
