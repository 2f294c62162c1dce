"""NCR's ``,code`` clean update against a float64 numpy transcription of the official step.

The official ``co_train.train`` builds the clean labels with
``ptl = batch_prob_l * batch_labels_l + (1 - batch_prob_l) * pl`` from ``[B, 1]``
probabilities, ``[B, 1]`` labels and a ``[B]`` prediction: a ``[B, B]`` matrix
``w_i + (1 - w_i) P_j``. Its ``ContrastiveLoss`` (exponential soft margin, hardest negative)
then uses entry ``(i, j)`` for image ``i`` against caption ``j`` (``cost_s``, max over the
row) and for caption ``j`` against image ``i`` (``cost_im``, max over the column). The
transcription below is written with loops, one hinge term at a time.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import losses, methods
from ncljax.labels import ncr as ncr_labels
from ncljax.methods import base, ncr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARGIN = 0.2


def official_labels(prob, pl):
    """The official broadcast, with the shapes the official loaders give."""
    batch_prob_l = np.asarray(prob, np.float64).reshape(-1, 1)  # torch.Tensor([prob]) stacked
    batch_labels_l = np.ones_like(batch_prob_l)  # torch.Tensor([1]) stacked
    pl = np.asarray(pl, np.float64)  # predict: [B]
    return batch_prob_l * batch_labels_l + (1 - batch_prob_l) * pl


def official_hardest_loss(scores, labels, margin=MARGIN):
    """Per-pair ``cost_s.max(1) + cost_im.max(0)`` with the exponential soft margin, by loops."""
    num = len(scores)
    soft = margin * (np.power(10.0, labels) - 1) / 9
    loss = np.zeros(num)
    for b in range(num):
        i2t = [
            max(soft[b, c] + scores[b, c] - scores[b, b], 0.0) for c in range(num) if c != b
        ]  # cost_s[b, c]: image b, caption c
        t2i = [
            max(soft[i, b] + scores[i, b] - scores[b, b], 0.0) for i in range(num) if i != b
        ]  # cost_im[i, b]: caption b against image i
        loss[b] = max(i2t) + max(t2i)
    return loss


def official_hardest_grad(scores, labels, margin=MARGIN):
    """d(sum of the loss)/d(scores): +1 at each active hardest negative, -1 at its positive."""
    num = len(scores)
    soft = margin * (np.power(10.0, labels) - 1) / 9
    grad = np.zeros((num, num))
    for b in range(num):
        i2t = {c: soft[b, c] + scores[b, c] - scores[b, b] for c in range(num) if c != b}
        c = max(i2t, key=i2t.get)
        if i2t[c] > 0:
            grad[b, c] += 1
            grad[b, b] -= 1
        t2i = {i: soft[i, b] + scores[i, b] - scores[b, b] for i in range(num) if i != b}
        i = max(t2i, key=t2i.get)
        if t2i[i] > 0:
            grad[i, b] += 1
            grad[b, b] -= 1
    return grad


def inputs(num, seed):
    """SGR-like similarities in (0, 1), clean probabilities ``w`` in [0, 1] (most near 1,
    some exact 0 and 1) and predictions ``P`` in [0, 1] (some exact 1, as ``predict``'s
    top tenth)."""
    rng = np.random.default_rng(seed)
    sim = rng.uniform(0.05, 0.6, (num, num))
    sim[np.diag_indices(num)] += rng.uniform(0.0, 0.35, num)
    w = rng.beta(5.0, 1.0, num)
    w[:2] = (0.0, 1.0)
    p = rng.uniform(0.0, 1.0, num)
    p[rng.choice(num, num // 10 + 1, replace=False)] = 1.0
    return sim.astype(np.float32), w.astype(np.float32), p.astype(np.float32)


def code_method():
    config = config_lib.load_file(os.path.join(ROOT, "configs", "ncr.py"), "synthetic,code")
    return methods.build_method("ncr", dict(config.method_kwargs))


def clean_ctx(num, prediction):
    return base.LossContext(
        step=jnp.zeros((), jnp.int32),
        epoch=jnp.zeros((), jnp.int32),
        phase=ncr.CLEAN_NOISY,
        num_samples=num,
        network=jnp.zeros((), jnp.int32),
        rng=jax.random.key(0),
        update=0,
        prepared={"clean": jnp.asarray(prediction)},
    )


def test_code_config_selects_the_official_broadcast():
    config = config_lib.load_file(os.path.join(ROOT, "configs", "ncr.py"), "f30k,code")
    assert config.method_kwargs.target_prediction == "broadcast"
    assert config.method_kwargs.margin_of == "image"  # the noisy batch's [B, 1] margins
    paper = config_lib.load_file(os.path.join(ROOT, "configs", "ncr.py"), "f30k")
    assert paper.method_kwargs.get("target_prediction", "pair") == "pair"


@pytest.mark.parametrize("num,seed", [(8, 0), (8, 1), (128, 2), (128, 3)])
def test_label_matrix_is_the_official_broadcast(num, seed):
    _, w, p = inputs(num, seed)
    got = ncr_labels.rectified_label_matrix(jnp.asarray(w), jnp.asarray(p))
    want = official_labels(w, p)
    assert got.shape == (num, num)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.diag(want), w + (1 - w) * p, rtol=1e-6)  # Eq. 6


@pytest.mark.parametrize("num,seed", [(8, 0), (8, 1), (128, 2), (128, 3)])
def test_code_clean_update_is_the_official_loss(num, seed):
    sim, w, p = inputs(num, seed)
    want = official_hardest_loss(sim.astype(np.float64), official_labels(w, p))
    method = code_method()
    batch = {"mask": np.ones(num, bool), "index": np.arange(num)}
    rows = {"prob": jnp.asarray(w), "divided": jnp.ones(num)}
    ctx = clean_ctx(num, p)
    loss, aux = method.loss_fn({"sim": jnp.asarray(sim)}, batch, rows, rows, ctx)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(loss.sum()), want.sum(), rtol=1e-5)
    np.testing.assert_allclose(aux.metrics["target_clean"], w + (1 - w) * p, atol=1e-6)

    def total(s):
        return method.loss_fn({"sim": s}, batch, rows, rows, ctx)[0].sum()

    grad = jax.grad(total)(jnp.asarray(sim))  # the same hardest negatives win
    np.testing.assert_array_equal(
        grad, official_hardest_grad(sim.astype(np.float64), official_labels(w, p))
    )


@pytest.mark.parametrize("num,seed", [(8, 0), (128, 2)])
def test_the_former_first_prediction_form_is_not_the_official_loss(num, seed):
    """The check above can tell the forms apart: ``w_i + (1 - w_i) P_0`` on ``[B, 1]``
    margins (the former ``'first'``) and Eq. 6 per pair both miss the official loss."""
    sim, w, p = inputs(num, seed)
    want = official_hardest_loss(sim.astype(np.float64), official_labels(w, p))
    for targets in (w + (1 - w) * p[0], w + (1 - w) * p):
        margins = losses.soft_margin(jnp.asarray(targets), MARGIN)
        other = losses.triplet_hardest(jnp.asarray(sim), margins, margin_of="image")
        assert not np.allclose(other, want, rtol=1e-5, atol=1e-6)


def test_padding_leaves_the_real_pairs_official():
    sim, w, p = inputs(8, 4)
    want = official_hardest_loss(sim.astype(np.float64), official_labels(w, p))
    pad = 3
    sim_p = np.pad(sim, ((0, pad), (0, pad)), constant_values=0.9)  # would win if used
    w_p, p_p = np.pad(w, (0, pad), constant_values=0.5), np.pad(p, (0, pad))
    mask = np.arange(8 + pad) < 8
    labels = ncr_labels.rectified_label_matrix(jnp.asarray(w_p), jnp.asarray(p_p))
    got = losses.triplet_hardest(jnp.asarray(sim_p), losses.soft_margin(labels), where=mask)
    np.testing.assert_allclose(got[:8], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[8:], 0.0)
