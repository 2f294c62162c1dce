"""PC2's calibrated Eq. 5 cutoff: the chance cosine against a numpy loop, the cutoff's
equation, its limits, and the pseudo-caption loss in both calibrations."""

import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.labels import pc2 as pc2_labels
from ncljax.methods import pc2
from tests.methods import test_pc2


def _chance_numpy(p_noisy, p_clean, rows, cols):
    total, count = 0.0, 0
    for i in np.flatnonzero(rows):
        for j in np.flatnonzero(cols):
            a, b = np.asarray(p_noisy[i], np.float64), np.asarray(p_clean[j], np.float64)
            total += a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
            count += 1
    return total / count


def test_chance_cosine_matches_a_numpy_loop():
    rng = np.random.default_rng(0)
    p_noisy = test_pc2._softmax(rng.normal(size=(6, 5)) * 2)
    p_clean = test_pc2._softmax(rng.normal(size=(4, 5)) * 2)
    rows = np.array([1, 1, 0, 1, 1, 1], bool)
    cols = np.array([1, 0, 1, 1], bool)
    got = pc2_labels.chance_cosine(p_noisy, p_clean, where=rows, clean_where=cols)
    assert float(got) == pytest.approx(_chance_numpy(p_noisy, p_clean, rows, cols), rel=1e-5)
    assert float(pc2_labels.chance_cosine(p_noisy, p_clean)) == pytest.approx(
        _chance_numpy(p_noisy, p_clean, np.ones(6, bool), np.ones(4, bool)), rel=1e-5
    )


def test_cutoff_equation_and_its_limits():
    assert float(pc2_labels.calibrated_cutoff(0.5, 0.3)) == pytest.approx(0.3 + 0.5 * 0.7)
    onehot = np.eye(4, dtype=np.float32)  # confident predictions on disjoint classes
    chance = pc2_labels.chance_cosine(onehot[:2], onehot[2:])
    assert float(pc2_labels.calibrated_cutoff(0.5, chance)) == pytest.approx(0.5)  # the code's
    flat = np.full((3, 4), 0.25, np.float32)  # flat predictions: every cosine 1
    chance = pc2_labels.chance_cosine(flat, flat)
    assert float(pc2_labels.calibrated_cutoff(0.5, chance)) == pytest.approx(1.0)


@pytest.mark.parametrize("calibration", ["data", "paper"])
def test_pseudo_caption_margins_use_the_calibrated_cutoff(calibration):
    method = test_pc2._method(noisy_weight=1.0, calibration=calibration)
    sim = test_pc2._sim(7)
    cosine = jnp.array([0.3, 0.5, 0.9, 0.99, 0.6, 0.75, 0.68])
    out = {
        "sim": sim,
        "pseudo_cosine": cosine,
        "pseudo_index": jnp.zeros(7, jnp.int32),
        "pseudo_chance": jnp.asarray(0.4),
    }
    per, aux = method.loss_fn(
        out, {"mask": test_pc2.MASK}, {}, {}, test_pc2._ctx(pc2.CLEAN_PSEUDO, 1)
    )
    cut = 0.4 + 0.5 * 0.6 if calibration == "data" else 0.5
    c = np.asarray(cosine)
    margins = np.where(c < cut, 0.0, 0.2 * (10.0**c - 1) / 9)
    want = test_pc2._hardest(sim, margins, np.asarray(test_pc2.MASK))
    np.testing.assert_allclose(float(jnp.where(test_pc2.MASK, per, 0).sum()), want, rtol=1e-5)
    np.testing.assert_allclose(aux.metrics["pseudo_cutoff"], np.full(7, cut), rtol=1e-6)


def test_rejects_an_unknown_calibration():
    with pytest.raises(ValueError, match="calibration"):
        test_pc2._method(calibration="constant")
