"""UOT-RCL's research API: one call for an epoch's label correction
(``ncljax.labels.correct_labels``) and one for the objective
(``ncljax.methods.uot_rcl.uot_rcl_loss``), against the steps they compose and numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import labels
from ncljax.labels import correction, ot
from ncljax.methods import uot_rcl


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    n, k, d = 60, 4, 8
    z_image = _unit(rng.normal(size=(n, d))).astype(np.float32)
    z_text = _unit(z_image + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
    logits_image = rng.normal(size=(n, k)).astype(np.float32) * 2
    logits_text = logits_image + rng.normal(size=(n, k)).astype(np.float32)
    observed = np.eye(k, dtype=np.float32)[rng.integers(0, k, n)]
    return z_image, z_text, logits_image, logits_text, observed


@pytest.mark.heavy
def test_correct_labels_is_the_six_steps_in_order(data):
    z_image, z_text, logits_image, logits_text, observed = data
    marginal = jnp.full(4, 0.25)
    got = jax.jit(lambda *a: labels.correct_labels(*a, mass=0.6, per_class=3, neighbours=5))(
        z_image, z_text, logits_image, logits_text, observed, observed, marginal
    )
    p_i, p_t = jax.nn.softmax(logits_image, -1), jax.nn.softmax(logits_text, -1)
    confident = correction.confident_set(p_i, p_t, per_class=3)
    t_i = correction.update_targets(observed, logits_image + logits_text, momentum=0.99)
    t_t = correction.update_targets(observed, logits_image + logits_text, momentum=0.99)
    c_i, c_t = correction.modal_consistency(z_image, z_text, confident)
    knn = [correction.knn_cosine(z, k=5, chunk=2048, exclude_self=True) for z in (z_image, z_text)]
    cost = correction.consistent_cost(c_i, c_t, *knn, t_i, t_t, normalise=True)
    want = ot.partial_ot_labels(cost, mass=0.6, class_marginal=marginal)
    np.testing.assert_allclose(got.labels, want.labels, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.targets_image, t_i, rtol=1e-6)
    np.testing.assert_array_equal(got.confident_set.index, confident.index)
    assert float(got.labels.sum()) == pytest.approx(0.6 * 60, rel=1e-3)  # Q = N * plan
    # The key-chunked neighbour search (a [chunk, key_chunk] block whatever N): the same.
    inputs = (z_image, z_text, logits_image, logits_text, observed, observed, marginal)
    chunked = labels.correct_labels(
        *inputs,
        mass=0.6,
        per_class=3,
        neighbours=5,
        knn_chunk=16,
        knn_key_chunk=7,
    )
    np.testing.assert_allclose(chunked.labels, got.labels, rtol=1e-5, atol=1e-6)
    # The block search with every block searched (4 blocks of 16 rows): the same labels.
    blocks = jax.jit(
        lambda key, *a: labels.correct_labels(
            *a,
            mass=0.6,
            per_class=3,
            neighbours=5,
            key=key,
            knn="blocks",
            knn_block=16,
            knn_probes=4,
        )
    )(jax.random.key(3), *inputs)
    np.testing.assert_allclose(blocks.labels, got.labels, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs a key"):
        labels.correct_labels(*inputs, mass=0.5, confident="random")
    with pytest.raises(ValueError, match="knn='blocks' needs a key"):
        labels.correct_labels(*inputs, mass=0.5, knn="blocks")
    with pytest.raises(ValueError, match="knn must be"):
        labels.correct_labels(*inputs, mass=0.5, knn="approximate")


@pytest.mark.parametrize("argument", [0, 1, 2, 3])
def test_correct_labels_refuses_non_finite_embeddings_and_logits(data, argument):
    """Called on values, a NaN or inf input is one error naming it (a NaN row would be
    every row's neighbour); under ``jit`` nothing is checked (traced)."""
    z_image, z_text, logits_image, logits_text, observed = data
    inputs = [np.array(x, np.float32) for x in (z_image, z_text, logits_image, logits_text)]
    inputs[argument][3, 1] = np.nan if argument % 2 else np.inf
    name = ("z_image", "z_text", "logits_image", "logits_text")[argument]
    marginal = np.full(observed.shape[1], 1.0 / observed.shape[1], np.float32)
    with pytest.raises(ValueError, match=rf"^{name} holds 1 NaN or infinite values: pass"):
        labels.correct_labels(*inputs, observed, observed, marginal, mass=0.6, neighbours=5)


def test_uot_rcl_loss_terms_against_numpy(data):
    z_image, z_text, logits_image, logits_text, observed = data
    b = 16
    soft = 0.7 * observed[:b] + 0.3 / 4
    where = np.arange(b) < 13  # three padded rows
    anchors = np.arange(8)
    total, terms = uot_rcl.uot_rcl_loss(
        z_image[:b],
        z_text[:b],
        logits_image[:b],
        logits_text[:b],
        soft,
        z_image[anchors],
        z_text[anchors],
        np.ones(8, bool),
        where=where,
        relation_weight=0.4,
    )

    def log_softmax(x):
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    plc = -(soft * log_softmax(logits_image[:b])).sum(1) - (
        soft * log_softmax(logits_text[:b])
    ).sum(1)
    np.testing.assert_allclose(terms.plc, plc, rtol=1e-5)
    np.testing.assert_allclose(total, terms.plc + 0.4 * terms.bhg, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(terms.bhg)[where]))
    assert float(terms.relation_converged[0]) in (0.0, 1.0)
