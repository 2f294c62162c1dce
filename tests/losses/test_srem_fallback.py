"""SREM's objective with a degenerate division (the fallback), per-direction thresholds
and margins, and the warm-up's complementary labels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import losses
from ncljax.labels import srem as selection
from ncljax.methods.srem import srem_loss


def _logits(seed, b=8, boost=4.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, b)) * 2
    logits[np.arange(b), np.arange(b)] += boost
    return jnp.asarray(logits, jnp.float32)


@pytest.mark.parametrize("threshold", [-100.0, 100.0])
def test_a_forced_degenerate_division_trains_the_warmup_objective(threshold):
    """No pair selected (tau far below every energy) or every pair selected (far above, the
    diagonal first in every row and column): each direction trains its warm-up term."""
    logits = _logits(5, boost=20.0)  # every pair ranked first in both directions
    where = jnp.array([True] * 7 + [False])
    loss, views = srem_loss(logits, threshold=threshold, fallback=True, where=where)
    warm, _ = srem_loss(logits, warmup=True, where=where)
    np.testing.assert_allclose(loss, warm, rtol=1e-6, atol=1e-7)
    for view in views.values():
        assert bool(view.fallback)
        assert float(jnp.abs(view.hinge).sum() + jnp.abs(view.energy_loss).sum()) == 0.0
        assert float(view.pull.sum()) == 0.0
    assert float(loss.sum()) > 0  # it trains on something
    old, _ = srem_loss(logits, threshold=threshold, where=where)
    assert not np.allclose(old, loss)  # without the fallback it would not


def test_the_fallback_leaves_a_real_division_alone():
    logits = _logits(0)
    where = jnp.array([True] * 6 + [False] * 2)
    new, views = srem_loss(logits, threshold=-3.0, fallback=True, where=where)
    old, _ = srem_loss(logits, threshold=-3.0, where=where)
    assert all(0 < int(v.clean.sum()) < 6 for v in views.values())
    assert not any(bool(v.fallback) for v in views.values())
    np.testing.assert_array_equal(new, old)


def test_per_direction_thresholds_and_margins():
    logits = _logits(1)
    loss, views = srem_loss(
        logits,
        threshold=jnp.array([-3.0, -1.0]),
        m_clean=jnp.array([-5.0, -3.0]),
        m_noisy=jnp.array([-1.0, 0.5]),
    )
    i2t, _ = srem_loss(logits, threshold=-3.0, m_clean=-5.0, m_noisy=-1.0)
    t2i, _ = srem_loss(logits, threshold=-1.0, m_clean=-3.0, m_noisy=0.5)
    _, views_i2t = srem_loss(logits, threshold=-3.0, m_clean=-5.0, m_noisy=-1.0)
    _, views_t2i = srem_loss(logits, threshold=-1.0, m_clean=-3.0, m_noisy=0.5)
    np.testing.assert_array_equal(views["i2t"].clean, views_i2t["i2t"].clean)
    np.testing.assert_array_equal(views["t2i"].clean, views_t2i["t2i"].clean)
    np.testing.assert_allclose(views["i2t"].energy_loss, views_i2t["i2t"].energy_loss)
    np.testing.assert_allclose(views["t2i"].energy_loss, views_t2i["t2i"].energy_loss)
    del i2t, t2i, loss


@pytest.mark.parametrize("warmup", [True, False])
def test_warmup_rectify_changes_the_warmup_only(warmup):
    logits = _logits(6)
    got, _ = srem_loss(logits, warmup=warmup, warmup_rectify="uniform")
    want, _ = srem_loss(logits, warmup=warmup, rectify="uniform" if warmup else "biased")
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(("level", "biased_up"), [(-4.3, False), (0.0, True), (1.3, True)])
def test_biased_labels_at_a_flat_softmax_pull_the_negatives_up(level, biased_up):
    """Why the warm-up is uniform: at a near-flat row (a random model) with scores near or
    above ``b = 0.5`` the biased Q's gradient moves most negatives *up*, more in sum than
    the positive's pull; below ``b`` Q is uniform and nothing of the kind happens."""
    b = 64
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(b, b)) * 0.5 + level, jnp.float32)
    mask = selection.complementary_mask(jnp.zeros(b, bool), jnp.zeros(b, jnp.int32))
    probs = selection.ms_selection_probs(jax.nn.sigmoid(logits), 50.0, 0.5)
    off = ~np.eye(b, dtype=bool)
    for rectify in (True, False):
        q = selection.rectified_complementary_dist(probs, mask, rectify=rectify)
        grad = jax.grad(lambda f, q=q: losses.complementary_loss(f, q, mask).sum())(logits)
        grad = np.asarray(grad)
        pulled_up = (grad[off] < 0).mean()
        negatives_moved = np.abs(grad * off).sum(1).mean()
        positive_pull = -np.diagonal(grad).mean()
        if rectify and biased_up:
            assert pulled_up > 0.8 and negatives_moved > 2 * positive_pull
        else:
            # the row's gradient sums to 0: the negatives only balance the positive
            assert pulled_up < 0.3 and negatives_moved < 1.1 * positive_pull
