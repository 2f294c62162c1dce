"""GSC's purified losses (ncljax.losses.structure) against float64 numpy loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.losses import gsc_cross_modal_loss, gsc_intra_modal_loss, gsc_loss, mask_structures

RTOL, ATOL = 2e-5, 2e-6


def random_case(seed, num=6, masked=False):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(0.05, 0.95, size=(num, num)).astype(np.float32)
    sim_image = rng.uniform(0.05, 0.95, size=(num, num)).astype(np.float32)
    sim_image = (0.5 * (sim_image + sim_image.T)).astype(np.float32)  # SGR's G_I is symmetric
    sim_text = rng.uniform(0.05, 0.95, size=(num, num)).astype(np.float32)
    labels = rng.uniform(0, 1, size=num).astype(np.float32)
    labels[0] = 0.0  # a pair judged fully noisy
    valid = np.ones(num, bool)
    if masked:
        valid[[2, num - 1]] = False
    return sim, sim_image, sim_text, labels, valid


def np_cross(sim, labels, valid, tau):
    """Eq. 6 with explicit sums over the valid candidates."""
    out = np.zeros(len(labels))
    real = [c for c in range(len(labels)) if valid[c]]
    for b in real:
        i2t = math.exp(sim[b, b] / tau) / sum(math.exp(sim[b, c] / tau) for c in real)
        t2i = math.exp(sim[b, b] / tau) / sum(math.exp(sim[c, b] / tau) for c in real)
        out[b] = labels[b] * 0.5 * (-math.log(i2t) - math.log(t2i))
    return out


def np_intra(sim_image, sim_text, labels, valid, tau, row_weight):
    """Eq. 7: K_jl = sum_i y_i^2 G_I[j, i] G_T[l, i]; one-direction row cross-entropy."""
    out = np.zeros(len(labels))
    real = [c for c in range(len(labels)) if valid[c]]

    def k(j, col):
        return sum(labels[i] ** 2 * float(sim_image[j, i]) * float(sim_text[col, i]) for i in real)

    for j in real:
        logsum = math.log(sum(math.exp(k(j, col) / tau) for col in real))
        nll = -(k(j, j) / tau - logsum)
        out[j] = (labels[j] if row_weight else 1.0) * nll
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tau", [0.07, 0.5])
def test_cross_modal_loss_matches_oracle(masked, tau):
    sim, _, _, labels, valid = random_case(0, masked=masked)
    got = gsc_cross_modal_loss(sim, labels, temperature=tau, where=valid)
    np.testing.assert_allclose(got, np_cross(sim, labels, valid, tau), rtol=RTOL, atol=ATOL)
    assert got[0] == 0.0  # label 0: no loss
    np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("row_weight", [True, False])
def test_intra_modal_loss_matches_oracle(masked, row_weight):
    _, sim_image, sim_text, labels, valid = random_case(1, masked=masked)
    got = gsc_intra_modal_loss(
        sim_image, sim_text, labels, temperature=1.0, row_weight=row_weight, where=valid
    )
    want = np_intra(sim_image, sim_text, labels, valid, 1.0, row_weight)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)


def test_intra_modal_loss_temperature_and_padding_columns():
    _, sim_image, sim_text, labels, valid = random_case(2, num=5, masked=True)
    got = gsc_intra_modal_loss(sim_image, sim_text, labels, temperature=0.3, where=valid)
    want = np_intra(sim_image, sim_text, labels, valid, 0.3, True)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # Changing a padded sample's similarities changes nothing.
    sim_image2, sim_text2 = sim_image.copy(), sim_text.copy()
    sim_image2[:, 2] = sim_image2[2, :] = 0.99
    sim_text2[:, 2] = sim_text2[2, :] = 0.01
    again = gsc_intra_modal_loss(sim_image2, sim_text2, labels, temperature=0.3, where=valid)
    np.testing.assert_allclose(again, got, rtol=0, atol=0)


def test_mask_structures_scales_columns_by_labels():
    sim_image = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
    sim_text = np.ones((3, 3), np.float32) / 2
    labels = np.array([1.0, 0.0, 0.5], np.float32)
    a, c = mask_structures(sim_image, sim_text, labels)
    np.testing.assert_allclose(a, [[0.0, 0.0, 0.1], [0.3, 0.0, 0.25], [0.6, 0.0, 0.4]], atol=1e-7)
    np.testing.assert_allclose(c, [[0.5, 0.0, 0.25]] * 3, atol=1e-7)
    a, _ = mask_structures(sim_image, sim_text, labels, where=np.array([True, True, False]))
    np.testing.assert_array_equal(np.asarray(a)[:, 2], 0.0)


def test_total_is_cross_plus_weighted_intra():
    sim, sim_image, sim_text, labels, valid = random_case(3, masked=True)
    got = gsc_loss(sim, sim_image, sim_text, labels, intra_weight=0.05, where=valid)
    want = np_cross(sim, labels, valid, 0.07) + 0.05 * np_intra(
        sim_image, sim_text, labels, valid, 1.0, True
    )
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_structure_logits_of_a_full_batch_do_not_overflow():
    """K reaches B: exp(128) overflows float32, log_softmax does not."""
    num = 128
    ones = np.ones((num, num), np.float32)
    sim_image = ones.copy()
    sim_image[np.arange(num), np.arange(num)] = 1.0
    got = gsc_intra_modal_loss(sim_image, ones, np.ones(num, np.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, math.log(num), rtol=1e-5)


def test_jit_equals_no_jit():
    sim, sim_image, sim_text, labels, valid = random_case(4, masked=True)
    eager = gsc_loss(sim, sim_image, sim_text, labels, where=valid)
    jitted = jax.jit(gsc_loss)(sim, sim_image, sim_text, labels, where=valid)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)


def test_gradients_finite_and_zero_for_labels():
    sim, sim_image, sim_text, labels, valid = random_case(5, masked=True)

    def total(sim, sim_image, sim_text, labels):
        return gsc_loss(sim, sim_image, sim_text, labels, intra_weight=0.5, where=valid).mean()

    grads = jax.grad(total, argnums=(0, 1, 2, 3))(
        *(jnp.asarray(x) for x in (sim, sim_image, sim_text, labels))
    )
    for g in grads:
        assert np.isfinite(g).all()
    for g in grads[:3]:
        assert np.abs(g).max() > 1e-4  # the similarities are trained
    np.testing.assert_array_equal(grads[3], 0.0)  # labels are constants
    # Padded rows and columns receive no gradient.
    for g in grads[:3]:
        np.testing.assert_array_equal(np.asarray(g)[~valid], 0.0)
        np.testing.assert_array_equal(np.asarray(g)[:, ~valid], 0.0)
