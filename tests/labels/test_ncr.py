"""NCR's estimators and losses against numpy transcriptions of the official code and paper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.mixture import GaussianMixture

from ncljax import labels, losses


def official_costs(scores, margin):
    """The official ``ContrastiveLoss`` costs: ``margin`` scalar, ``[B, 1]`` or ``[B]``."""
    diagonal = np.diag(scores)[:, None]
    cost_s = np.maximum(margin + scores - diagonal, 0)
    cost_im = np.maximum(margin + scores - diagonal.T, 0)
    eye = np.eye(len(scores), dtype=bool)
    cost_s[eye], cost_im[eye] = 0, 0
    return cost_s, cost_im


def scores(b=7, seed=0):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(0.0, 0.7, (b, b))
    sim[np.diag_indices(b)] += rng.uniform(0.0, 0.4, b)
    return sim


def test_soft_margins_hand_worked():
    y = jnp.array([0.0, 0.5, 0.8, 1.0])
    np.testing.assert_allclose(losses.soft_margin(y), [0.0, 0.0480506, 0.1179910, 0.2], atol=1e-6)
    np.testing.assert_allclose(losses.soft_margin(y, kind="linear"), 0.2 * np.asarray(y))
    np.testing.assert_allclose(
        losses.soft_margin(y, kind="sin"),
        [0.0, 0.1, 0.2 * (np.sin(0.3 * np.pi) + 1) / 2, 0.2],
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="kind"):
        losses.soft_margin(y, kind="cubic")


@pytest.mark.parametrize("margin_of", ["positive", "image", "caption"])
def test_margin_indexing_matches_the_broadcasts(margin_of):
    sim = scores()
    mu = np.linspace(0.05, 0.3, 7)
    got = losses.triplet_hardest(jnp.asarray(sim), jnp.asarray(mu), margin_of=margin_of)
    if margin_of == "positive":  # loop over each term's own pair
        want = np.zeros(7)
        for b in range(7):
            neg = [c for c in range(7) if c != b]
            want[b] = max(max(mu[b] + sim[b, c] - sim[b, b], 0) for c in neg) + max(
                max(mu[b] + sim[i, b] - sim[b, b], 0) for i in neg
            )
    else:  # the official broadcasts: [B, 1] for the image's, [B] for the caption's
        cost_s, cost_im = official_costs(sim, mu[:, None] if margin_of == "image" else mu)
        want = cost_s.max(1) + cost_im.max(0)
    np.testing.assert_allclose(got, want, atol=1e-6)
    summed = losses.triplet_sum(jnp.asarray(sim), jnp.asarray(mu), margin_of=margin_of)
    if margin_of != "positive":
        np.testing.assert_allclose(summed, cost_s.sum(1) + cost_im.sum(0), atol=1e-6)
    with pytest.raises(ValueError, match="margin_of"):
        losses.hinge_costs(sim, mu, margin_of="row")


def test_padding_never_reaches_a_margin_variant():
    sim, mu = scores(), np.linspace(0.05, 0.3, 7)
    where = np.array([True] * 5 + [False] * 2)
    for margin_of in ("positive", "image", "caption"):
        padded = losses.triplet_hardest(sim, mu, where=where, margin_of=margin_of)
        alone = losses.triplet_hardest(sim[:5, :5], mu[:5], margin_of=margin_of)
        np.testing.assert_allclose(padded[:5], alone, atol=1e-6)
        np.testing.assert_array_equal(padded[5:], 0.0)


def test_triplet_mean_is_the_official_eval_loss_and_ignores_padding():
    sim = scores()
    cost_s, cost_im = official_costs(sim, 0.2)
    np.testing.assert_allclose(
        losses.triplet_mean(sim), cost_s.mean(1) + cost_im.mean(0), atol=1e-6
    )
    where = np.array([True] * 5 + [False] * 2)
    padded = losses.triplet_mean(sim, where=where)
    np.testing.assert_allclose(padded[:5], losses.triplet_mean(sim[:5, :5]), atol=1e-6)
    np.testing.assert_array_equal(padded[5:], 0.0)


def official_predict(sim, margin=0.2):
    cost_s, cost_im = official_costs(sim, margin)
    p = np.clip(margin - (cost_s.mean(1) + cost_im.mean(0)) / 2, 0, margin)
    ratio = len(sim) // 10 + 1
    p = p / np.mean(p[np.argsort(p)[-ratio:]])
    return np.clip(p, 0, 1)


@pytest.mark.parametrize("b", [7, 24])
def test_correspondence_prediction_matches_official_predict(b):
    sim = scores(b, seed=b)
    got = labels.correspondence_prediction(jnp.asarray(sim))
    np.testing.assert_allclose(got, official_predict(sim), atol=1e-5)
    where = np.arange(b) < b - 3
    padded = labels.correspondence_prediction(jnp.asarray(sim), where=where)
    np.testing.assert_allclose(padded[: b - 3], official_predict(sim[: b - 3, : b - 3]), atol=1e-5)
    np.testing.assert_array_equal(padded[b - 3 :], 0.0)
    jitted = jax.jit(labels.correspondence_prediction)(jnp.asarray(sim), where=where)
    np.testing.assert_allclose(jitted, padded, atol=1e-6)


def test_correspondence_prediction_without_any_confident_pair_is_zero_not_nan():
    # Every positive far below its negatives: every p is 0 (the official code: 0 / 0).
    got = labels.correspondence_prediction(1.0 - 2.0 * jnp.eye(5))
    np.testing.assert_array_equal(got, 0.0)
    # All similarities equal: every pair alike, each at the top tenth's level.
    np.testing.assert_allclose(labels.correspondence_prediction(jnp.zeros((5, 5))), 1.0)


def test_rectified_labels_equation():
    w, p = np.array([0.9, 0.6, 1.0]), np.array([0.2, 0.5, 0.0])
    np.testing.assert_allclose(labels.rectified_labels(w, p), w + (1 - w) * p, rtol=1e-6)
    np.testing.assert_allclose(labels.rectified_labels(w, p, 0.0), (1 - w) * p, rtol=1e-6)


def test_split_clean_threshold_and_one_percent_rule():
    prob = np.array([0.2, 0.9, 0.51, 0.5, 0.7])
    np.testing.assert_array_equal(labels.split_clean(prob), prob > 0.5)
    rng = np.random.default_rng(0)
    high = rng.uniform(0.6, 1.0, 300)  # nothing would be noisy
    want = high > np.sort(high)[300 // 100]
    got = np.asarray(labels.split_clean(high))
    np.testing.assert_array_equal(got, want)
    assert (~got).sum() == 4  # the 4 smallest (distinct values)
    where = np.arange(310) < 300
    padded = np.concatenate([high, np.full(10, 0.01)])
    np.testing.assert_array_equal(labels.split_clean(padded, where=where)[:300], want)
    assert not np.asarray(labels.split_clean(padded, where=where))[300:].any()


def sklearn_low_loss_posterior(x, max_iter=10, tol=1e-2, reg=5e-4):
    """The official co-divide's ``GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4)``
    (float64, best of four k-means++ starts): the posterior of the low-mean component."""
    gmm = GaussianMixture(2, max_iter=max_iter, tol=tol, reg_covar=reg, n_init=4, random_state=0)
    gmm.fit(x[:, None])
    return gmm.predict_proba(x[:, None])[:, np.argmin(gmm.means_[:, 0])]


def test_loss_division_clean_are_the_low_losses():
    rng = np.random.default_rng(3)
    clean = rng.random(2000) < 0.6
    loss = np.where(clean, rng.normal(0.05, 0.02, 2000), rng.normal(0.3, 0.06, 2000))
    division = jax.jit(labels.loss_division)(jnp.asarray(loss, jnp.float32))
    x = (loss - loss.min()) / (loss.max() - loss.min())
    np.testing.assert_allclose(division.normalised, x, atol=1e-6)
    np.testing.assert_allclose(division.prob, sklearn_low_loss_posterior(x), atol=1e-4)
    assert np.mean(np.asarray(division.clean) == clean) > 0.99
    assert float(division.gmm.means[0]) < float(division.gmm.means[1])


def test_gradients_of_the_soft_margin_losses_are_finite():
    sim = jnp.asarray(scores(), jnp.float32)
    mu = losses.soft_margin(jnp.linspace(0.0, 1.0, 7))

    def total(s):
        return (losses.triplet_hardest(s, mu, margin_of="image") + losses.triplet_mean(s)).sum()

    grad = jax.grad(total)(sim)
    assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).max() > 0
