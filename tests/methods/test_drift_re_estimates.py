"""A forced drift of the scores a division reads is re-estimated, not fallen back: every
dividing method's division is fitted anew at each refresh on the statistics of the model
as it is, and is invariant to the drifts those statistics take (a shift and a scale of
the losses, energies or uncertainties), so the drifted division equals the undrifted one
and no fallback is taken. SREM's own test (its calibration following a drift of the
energies, and the frozen 'warmup' calibration falling back) is in
``test_srem_calibration.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.labels import ugncl as ugncl_labels
from ncljax.methods import base, coteaching, gsc, ncr, pc2


def _losses(seed, n=400, noisy=0.4):
    """Two groups of per-pair losses: low for the clean pairs, high for the mismatched."""
    rng = np.random.default_rng(seed)
    mismatched = rng.random(n) < noisy
    return np.where(mismatched, rng.normal(0.8, 0.1, n), rng.normal(0.2, 0.1, n)), mismatched


@pytest.mark.parametrize("settings", [ncr.Settings(), pc2.Settings()], ids=["ncr", "pc2"])
def test_the_co_divide_follows_a_drift_of_the_losses(settings):
    losses, mismatched = _losses(0)
    ctx = base.RefreshContext(3, len(losses), 0, jax.random.key(0), None)
    samples = coteaching.init_samples(len(losses))
    before, _, _, fell_back, _ = coteaching.co_divide(settings, "m", samples, {"loss": losses}, ctx)
    assert not fell_back
    assert (np.asarray(before["clean"]) > 0.5).mean() == pytest.approx(
        1 - mismatched.mean(), abs=0.02
    )
    for scale, shift in ((3.0, 10.0), (0.01, -5.0)):  # the losses drift as the model trains
        drifted = scale * losses + shift
        after, _, _, fell_back, _ = coteaching.co_divide(
            settings, "m", samples, {"loss": drifted}, ctx
        )
        assert not fell_back
        np.testing.assert_array_equal(after["clean"], before["clean"])
        np.testing.assert_allclose(after["prob"], before["prob"], atol=2e-3)


def test_ugncls_calibrated_division_follows_a_drift_of_the_uncertainties():
    rng = np.random.default_rng(1)
    n = 400
    hard = rng.random(n) < 0.4
    u = np.where(hard, rng.normal(0.7, 0.05, n), rng.normal(0.2, 0.05, n))
    q = np.where(rng.random(n) < 0.5, rng.uniform(0.6, 0.9, n), rng.uniform(0.01, 0.1, n))
    before = ugncl_labels.calibrate_signals(jnp.asarray(u), jnp.asarray(q))
    assert not bool(before.degenerate)
    # The evidence scale drifts: u -> a u + b; the batch's class count changes: q -> c q.
    after = ugncl_labels.calibrate_signals(jnp.asarray(0.5 * u + 0.3), jnp.asarray(0.25 * q))
    assert not bool(after.degenerate)
    np.testing.assert_allclose(after.hard_posterior, before.hard_posterior, atol=2e-3)
    np.testing.assert_allclose(after.clean_posterior, before.clean_posterior, atol=2e-3)


def test_gscs_intra_modal_division_follows_a_drift_of_its_scores():
    """GSC's labels: the GMM over the min-max normalised intra-modal scores, fitted at
    every refresh; a drift of the scores (shift and scale, as the similarities' level
    moves) divides the same pairs and falls back on none."""
    s = gsc.Settings()
    intra, mismatched = _losses(2)
    cross = np.where(mismatched, 0.1, 0.9)
    memory = gsc.init_memory(s, base.InitContext(len(intra), None, None, None))
    ctx = base.RefreshContext(2, len(intra), 0, jax.random.key(0), None)
    labels = []
    for scale, shift in ((1.0, 0.0), (4.0, -3.0)):
        samples = dict(memory.samples)
        samples["intra"] = jnp.asarray(scale * -intra + shift, jnp.float32)  # high = clean
        samples["cross"] = jnp.asarray(cross, jnp.float32)
        new, diagnostics = gsc.refresh(s, base.Memory(samples, memory.state), None, ctx)
        assert diagnostics["division_fallback"] == 0.0
        labels.append(np.asarray(new.samples["labels"]))
    np.testing.assert_allclose(labels[1], labels[0], atol=2e-3)
    assert ((labels[0] > 0.5) == ~mismatched).mean() > 0.95
