"""Baseline methods against numpy oracles, and the method registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import methods
from ncljax.methods import base


def _ctx():
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, zero, 0, 8, zero, jax.random.key(0))


def _sim(seed, b=5):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, size=(b, b)).astype(np.float32)


def _np_vse(sim, margin, valid, reduce):
    b = sim.shape[0]
    out = np.zeros(b)
    for i in range(b):
        if not valid[i]:
            continue
        i2t = [max(0, margin + sim[i, c] - sim[i, i]) for c in range(b) if c != i and valid[c]]
        t2i = [max(0, margin + sim[j, i] - sim[i, i]) for j in range(b) if j != i and valid[j]]
        out[i] = reduce(i2t or [0]) + reduce(t2i or [0])
    return out


@pytest.mark.parametrize("negatives,reduce", [("hardest", max), ("sum", sum)])
def test_vse_matches_numpy(negatives, reduce):
    sim = _sim(0)
    mask = np.array([True, True, False, True, True])
    method = methods.build_method("vse", {"margin": 0.3, "negatives": negatives})
    loss, aux = method.loss_fn(
        {"sim": jnp.asarray(sim)}, {"mask": jnp.asarray(mask)}, {}, {}, _ctx()
    )
    np.testing.assert_allclose(loss, _np_vse(sim, 0.3, mask, reduce), atol=1e-6)
    assert aux == base.Aux()


def test_infonce_matches_numpy():
    sim = _sim(1, 4)
    mask = np.ones(4, bool)
    tau = 0.1
    method = methods.build_method("infonce", {"temperature": tau})
    loss, _ = method.loss_fn({"sim": jnp.asarray(sim)}, {"mask": jnp.asarray(mask)}, {}, {}, _ctx())
    logits = sim / tau
    i2t = -np.array([logits[i, i] - np.log(np.exp(logits[i]).sum()) for i in range(4)])
    t2i = -np.array([logits[i, i] - np.log(np.exp(logits[:, i]).sum()) for i in range(4)])
    np.testing.assert_allclose(loss, 0.5 * (i2t + t2i), rtol=1e-5)


def test_ce_matches_numpy_and_reports_accuracy():
    rng = np.random.default_rng(2)
    logits_v = rng.normal(size=(6, 3)).astype(np.float32)
    logits_t = rng.normal(size=(6, 3)).astype(np.float32)
    labels_v = np.array([0, 1, 2, 0, 1, 2])
    labels_t = np.array([2, 1, 0, 0, 1, 2])
    outputs = {"image_logits": jnp.asarray(logits_v), "text_logits": jnp.asarray(logits_t)}
    batch = {"label_image": jnp.asarray(labels_v), "label_text": jnp.asarray(labels_t)}
    loss, aux = methods.build_method("ce").loss_fn(outputs, batch, {}, {}, _ctx())

    def nll(logits, labels):
        shifted = logits - logits.max(1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        return -logp[np.arange(len(labels)), labels]

    np.testing.assert_allclose(loss, nll(logits_v, labels_v) + nll(logits_t, labels_t), rtol=1e-5)
    np.testing.assert_array_equal(aux.metrics["acc_image"], logits_v.argmax(1) == labels_v)
    np.testing.assert_array_equal(aux.metrics["acc_text"], logits_t.argmax(1) == labels_t)


def test_ce_without_classifier_says_what_to_set():
    with pytest.raises(ValueError, match=r"model\.classifier=True"):
        methods.build_method("ce").loss_fn({"sim": jnp.zeros((2, 2))}, {}, {}, {}, _ctx())


def test_registry_errors_name_the_field():
    with pytest.raises(ValueError, match=r"Unknown method 'gsc\+\+'.*'vse'"):
        methods.build_method("gsc++")
    with pytest.raises(ValueError, match=r"does not take \['tau'\].*'margin'"):
        methods.build_method("vse", {"tau": 1.0})
    with pytest.raises(ValueError, match="negatives must be one of"):
        methods.build_method("vse", {"negatives": "semi-hard"})
