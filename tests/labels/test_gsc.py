"""GSC's estimators (ncljax.labels.gsc) against float64 numpy loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.mixture import GaussianMixture

from ncljax.labels import (
    ema_update,
    gsc_cross_modal_indicator,
    gsc_intra_modal_indicator,
    gsc_intra_modal_score,
    gsc_update_labels,
)

RTOL, ATOL = 2e-5, 2e-6

# Eager calls retrace the EM loop on every call; the oracle tests call jitted copies and
# test_jit_equals_no_jit covers the eager path.
update_labels = jax.jit(gsc_update_labels, static_argnames=("cross_momentum", "intra_momentum"))
intra_indicator = jax.jit(gsc_intra_modal_indicator)


def random_case(seed, num=7, masked=False):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(0.05, 0.95, size=(num, num)).astype(np.float32)
    sim_image = rng.uniform(0.05, 0.95, size=(num, num)).astype(np.float32)
    sim_text = rng.uniform(0.05, 0.95, size=(num, num)).astype(np.float32)
    labels = rng.uniform(0, 1, size=num).astype(np.float32)
    valid = np.ones(num, bool)
    if masked:
        valid[[1, 4]] = False
    return sim, sim_image, sim_text, labels, valid


def np_indicator(sim, valid, tau):
    out = np.zeros(len(valid))
    real = [c for c in range(len(valid)) if valid[c]]
    for b in real:
        i2t = math.exp(sim[b, b] / tau) / sum(math.exp(sim[b, c] / tau) for c in real)
        t2i = math.exp(sim[b, b] / tau) / sum(math.exp(sim[c, b] / tau) for c in real)
        out[b] = 0.5 * (i2t + t2i)
    return out


def np_score(sim_image, sim_text, labels, valid, eps=1e-8):
    out = np.zeros(len(labels))
    real = [c for c in range(len(labels)) if valid[c]]
    for j in real:
        a = [labels[i] * float(sim_image[j, i]) for i in real]
        c = [labels[i] * float(sim_text[j, i]) for i in real]
        dot = sum(x * y for x, y in zip(a, c, strict=True))
        norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in c))
        out[j] = dot / max(norms, eps)
    return out


def np_gmm_high_posterior(u, *, max_iter=10, tol=1e-2, reg_covar=5e-4):
    """Min-max in float64, then the official codes' ``sklearn.mixture.GaussianMixture`` (best
    of four k-means++ starts) and the posterior of its larger-mean component (Eq. 4)."""
    u = np.asarray(u, np.float64)
    span = u.max() - u.min()
    x = (u - u.min()) / span if span > 1e-12 else np.zeros_like(u)
    gmm = GaussianMixture(
        2, max_iter=max_iter, tol=tol, reg_covar=reg_covar, n_init=4, random_state=0
    ).fit(x[:, None])
    return gmm.predict_proba(x[:, None])[:, int(np.argmax(gmm.means_[:, 0]))], x


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tau", [0.07, 1.0])
def test_cross_modal_indicator_matches_oracle(masked, tau):
    sim, *_, valid = random_case(0, masked=masked)
    got = gsc_cross_modal_indicator(sim, temperature=tau, where=valid)
    np.testing.assert_allclose(got, np_indicator(sim, valid, tau), rtol=RTOL, atol=ATOL)


def test_cross_modal_indicator_of_a_perfect_match_is_one():
    sim = np.eye(4, dtype=np.float32) * 0.99 + 0.005
    got = gsc_cross_modal_indicator(sim, temperature=0.01)
    np.testing.assert_allclose(got, 1.0, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_intra_modal_score_matches_oracle_with_label_masks(masked):
    _, sim_image, sim_text, labels, valid = random_case(1, masked=masked)
    got = gsc_intra_modal_score(sim_image, sim_text, labels, where=valid)
    np.testing.assert_allclose(
        got, np_score(sim_image, sim_text, labels, valid), rtol=RTOL, atol=ATOL
    )
    # The labels mask columns: a different label of sample 0 changes every score.
    other = labels.copy()
    other[0] = 0.0
    changed = gsc_intra_modal_score(sim_image, sim_text, other, where=valid)
    np.testing.assert_allclose(
        changed, np_score(sim_image, sim_text, other, valid), rtol=RTOL, atol=ATOL
    )
    assert np.abs(np.asarray(changed - got))[valid].min() > 0


def test_intra_modal_score_of_all_zero_labels_is_zero():
    _, sim_image, sim_text, _, _ = random_case(2)
    got = gsc_intra_modal_score(sim_image, sim_text, np.zeros(7, np.float32))
    np.testing.assert_array_equal(got, 0.0)


def test_identical_structures_score_one():
    _, sim_image, _, labels, _ = random_case(3)
    got = gsc_intra_modal_score(sim_image, sim_image, labels)
    np.testing.assert_allclose(got, 1.0, rtol=1e-6)


def bimodal(seed, n=400):
    rng = np.random.default_rng(seed)
    clean = rng.random(n) < 0.6
    scores = np.where(clean, rng.normal(0.8, 0.05, n), rng.normal(0.45, 0.1, n))
    return scores.astype(np.float32), clean


def test_intra_modal_indicator_is_the_high_mean_gmm_posterior():
    scores, clean = bimodal(0)
    posterior, normalised, mixture = intra_indicator(scores)
    want_posterior, want_normalised = np_gmm_high_posterior(scores)
    np.testing.assert_allclose(normalised, want_normalised, atol=1e-6)
    np.testing.assert_allclose(posterior, want_posterior, atol=1e-4)
    assert mixture.means[1] > mixture.means[0]
    assert np.mean((np.asarray(posterior) > 0.5) == clean) > 0.95


def test_update_labels_is_ema_then_minimum():
    scores, _ = bimodal(1, n=50)
    rng = np.random.default_rng(1)
    cross = rng.uniform(0, 1, 50).astype(np.float32)
    ema_cross = rng.uniform(0, 1, 50).astype(np.float32)
    ema_intra = rng.uniform(0, 1, 50).astype(np.float32)
    new, _ = update_labels(
        ema_cross, ema_intra, cross, scores, cross_momentum=0.7, intra_momentum=0.6
    )
    posterior, _ = np_gmm_high_posterior(scores)
    want_cross = [0.7 * c + 0.3 * e for c, e in zip(cross, ema_cross, strict=True)]
    want_intra = [0.6 * p + 0.4 * e for p, e in zip(posterior, ema_intra, strict=True)]
    np.testing.assert_allclose(new.ema_cross, want_cross, rtol=1e-6)
    np.testing.assert_allclose(new.ema_intra, want_intra, atol=1e-4)
    np.testing.assert_allclose(
        new.labels, [min(a, b) for a, b in zip(want_cross, want_intra, strict=True)], atol=1e-4
    )
    np.testing.assert_allclose(new.intra_posterior, posterior, atol=1e-4)


def test_constant_scores_keep_the_previous_labels():
    """All intra-modal scores equal: no two clusters, so the update keeps both ensembles
    and the labels (it used to call every pair noisy) and flags the fit degenerate."""
    rng = np.random.default_rng(3)
    ema_cross, ema_intra = rng.uniform(0.2, 1, (2, 20)).astype(np.float32)
    new, mixture = update_labels(ema_cross, ema_intra, np.full(20, 0.2, np.float32), np.ones(20))
    assert bool(mixture.degenerate)
    np.testing.assert_array_equal(new.ema_cross, ema_cross)
    np.testing.assert_array_equal(new.ema_intra, ema_intra)
    np.testing.assert_array_equal(new.labels, np.minimum(ema_cross, ema_intra))
    for leaf in jax.tree.leaves((new, mixture)):
        assert np.isfinite(np.asarray(leaf, np.float64)).all()
    scores, _ = bimodal(1, n=20)
    assert not bool(update_labels(ema_cross, ema_intra, ema_cross, scores)[1].degenerate)
    # A noisy pair judged noisy every epoch decays as 0.3^t.
    zeros = np.zeros(20, np.float32)
    state = np.ones(20, np.float32)
    for _ in range(3):
        state = ema_update(zeros, state, 0.7)
    np.testing.assert_allclose(state, 0.3**3, rtol=1e-6)


def test_jit_equals_no_jit():
    sim, sim_image, sim_text, labels, valid = random_case(4, masked=True)
    for fn, args in [
        (gsc_cross_modal_indicator, (sim,)),
        (gsc_intra_modal_score, (sim_image, sim_text, labels)),
    ]:
        np.testing.assert_allclose(
            jax.jit(fn)(*args, where=valid), fn(*args, where=valid), rtol=1e-6, atol=1e-7
        )
    scores, _ = bimodal(2, n=64)
    ones = np.ones(64, np.float32)
    eager, _ = gsc_update_labels(ones, ones, ones * 0.5, scores)
    jitted, _ = update_labels(ones, ones, ones * 0.5, scores)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_estimators_carry_no_gradient():
    sim, sim_image, sim_text, labels, _ = random_case(5)

    def through(sim, sim_image, sim_text, labels):
        return (
            gsc_cross_modal_indicator(sim).sum()
            + gsc_intra_modal_score(sim_image, sim_text, labels).sum()
        )

    grads = jax.grad(through, argnums=(0, 1, 2, 3))(
        *(jnp.asarray(x) for x in (sim, sim_image, sim_text, labels))
    )
    for g in grads:
        assert np.isfinite(g).all()
        np.testing.assert_array_equal(g, 0.0)
