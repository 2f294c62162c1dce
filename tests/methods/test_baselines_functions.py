"""The baselines' settings and loss functions, called alone, against numpy."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import methods
from ncljax.methods import base, baselines

CTX = None  # the baselines' losses read no context


@pytest.mark.parametrize(
    ("name", "settings_type", "checks"),
    [
        ("vse", baselines.VSESettings, baselines.VSE_CHECKS),
        ("infonce", baselines.InfoNCESettings, baselines.INFONCE_CHECKS),
        ("ce", baselines.CESettings, baselines.CE_CHECKS),
    ],
)
def test_settings_are_the_factory_signature(name, settings_type, checks):
    signature = {k: p.default for k, p in methods.hyperparameters(name).items()}
    assert settings_type()._asdict() == signature
    assert set(checks) == set(settings_type._fields)
    assert all(
        p.kind is inspect.Parameter.KEYWORD_ONLY for p in methods.hyperparameters(name).values()
    )
    method = methods.build_method(name, {"num_networks": 2})
    assert method.settings == settings_type(num_networks=2) and method.num_networks == 2


def _np_hinge(sim, margin, valid, reduce):
    """Per pair: reduce over the valid negatives of max(0, margin + S_neg - S_pos), both
    directions."""
    out = np.zeros(len(sim))
    real = np.flatnonzero(valid)
    for i in real:
        i2t = [max(0.0, margin + sim[i, c] - sim[i, i]) for c in real if c != i]
        t2i = [max(0.0, margin + sim[j, i] - sim[i, i]) for j in real if j != i]
        out[i] = reduce(i2t) + reduce(t2i)
    return out


@pytest.mark.parametrize(("negatives", "reduce"), [("hardest", max), ("sum", sum)])
def test_vse_loss_is_the_hinge_triplet(negatives, reduce):
    rng = np.random.default_rng(3)
    sim = rng.uniform(-1, 1, size=(5, 5)).astype(np.float32)
    valid = np.array([True, False, True, True, True])
    s = baselines.VSESettings(margin=0.25, negatives=negatives)
    loss, aux = baselines.vse_loss(s, {"sim": jnp.asarray(sim)}, {"mask": valid}, {}, {}, CTX)
    np.testing.assert_allclose(loss, _np_hinge(sim, 0.25, valid, reduce), atol=1e-6)
    assert aux == base.Aux()


def test_infonce_loss_is_the_mean_of_both_directions():
    rng = np.random.default_rng(4)
    sim = rng.uniform(-1, 1, size=(4, 4))
    s = baselines.InfoNCESettings(temperature=0.2)
    loss, _ = baselines.infonce_loss(
        s, {"sim": jnp.asarray(sim, jnp.float32)}, {"mask": np.ones(4, bool)}, {}, {}, CTX
    )
    e = np.exp(sim / 0.2)
    want = -0.5 * (np.log(np.diag(e) / e.sum(1)) + np.log(np.diag(e) / e.sum(0)))
    np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_ce_loss_and_accuracies():
    logits_image = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0]], np.float32)
    logits_text = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], np.float32)
    batch = {"label_image": jnp.array([0, 1]), "label_text": jnp.array([2, 1])}
    outputs = {"image_logits": jnp.asarray(logits_image), "text_logits": jnp.asarray(logits_text)}
    loss, aux = baselines.ce_loss(outputs, batch, {}, {}, CTX)
    p_image = np.exp(logits_image) / np.exp(logits_image).sum(1, keepdims=True)
    p_text = np.exp(logits_text) / np.exp(logits_text).sum(1, keepdims=True)
    want = -np.log([p_image[0, 0] * p_text[0, 2], p_image[1, 1] * p_text[1, 1]])
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_array_equal(aux.metrics["acc_image"], [1.0, 0.0])
    np.testing.assert_array_equal(aux.metrics["acc_text"], [1.0, 0.0])
    assert list(aux.metrics) == ["acc_image", "acc_text"]


def test_bind_keeps_the_settings_and_no_memory():
    s = baselines.VSESettings(margin=0.1, negatives="sum", num_networks=2)
    method = baselines.bind_vse(s)
    assert (method.name, method.settings, method.num_networks) == ("vse", s, 2)
    assert method.init_memory is base.empty_memory
    sim = jax.random.uniform(jax.random.key(0), (3, 3))
    batch = {"mask": jnp.ones(3, bool)}
    np.testing.assert_array_equal(
        method.loss_fn({"sim": sim}, batch, {}, {}, CTX)[0],
        baselines.vse_loss(s, {"sim": sim}, batch, {}, {}, CTX)[0],
    )
