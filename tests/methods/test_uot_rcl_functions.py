"""UOT-RCL's settings and pure functions, called alone, against hand tables and numpy."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

from ncljax import methods
from ncljax.methods import base, baselines, uot_rcl
from tests.methods import test_uot_rcl  # the model outputs a main-phase loss reads

WARMUP, MAIN = base.WARMUP, base.MAIN
F32 = lambda x: jnp.asarray(x, jnp.float32)


def _ctx(phase):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, zero, phase, 8, zero, jax.random.key(0))


def test_settings_are_the_factory_signature():
    signature = {k: p.default for k, p in methods.hyperparameters("uot_rcl").items()}
    assert uot_rcl.Settings()._asdict() == signature
    assert list(uot_rcl.CHECKS) == list(uot_rcl.Settings._fields)
    assert uot_rcl.uot_rcl(neighbours=7).settings == uot_rcl.Settings(neighbours=7)


def test_plan_against_a_table():
    plans = [uot_rcl.plan(uot_rcl.Settings(warmup_epochs=2), e) for e in range(4)]
    assert [p.phase for p in plans] == [WARMUP, WARMUP, MAIN, MAIN]
    assert [p.refresh for p in plans] == [False, False, True, True]  # a correction per epoch


@pytest.mark.parametrize("marginal", ["uniform", "empirical"])
def test_init_memory(marginal):
    info = types.SimpleNamespace(num_classes=3, image_dim=5, text_dim=4)
    labels_image, labels_text = np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1])
    ctx = base.InitContext(4, info, labels_image, labels_text, 6)
    s = uot_rcl.Settings(per_class=2, class_marginal=marginal)
    memory = uot_rcl.init_memory(s, ctx)
    np.testing.assert_array_equal(memory.samples["targets_image"], np.eye(3)[labels_image])
    np.testing.assert_array_equal(memory.samples["targets_text"], np.eye(3)[labels_text])
    np.testing.assert_array_equal(memory.samples["labels"], np.zeros((4, 3)))
    assert memory.state["anchors_image"].shape == (6, 5)  # 3 classes x 2 per class
    assert memory.state["anchor_z_text"].shape == (6, 6)
    assert not memory.state["anchor_mask"].any()
    # Observed label counts over both modalities: class 0 three times, 1 four, 2 once.
    want = [1 / 3] * 3 if marginal == "uniform" else [3 / 8, 4 / 8, 1 / 8]
    np.testing.assert_allclose(memory.state["class_marginal"], want, rtol=1e-6)
    one_class = base.InitContext(4, types.SimpleNamespace(num_classes=1), None, None, 6)
    with pytest.raises(ValueError, match="needs class labels"):
        uot_rcl.init_memory(s, one_class)


def _np_relation_plan(z_image, z_text, anchors_image, anchors_text, anchor_mask, tau, eps):
    """Eqs. 16-17 and the balanced entropic OT on the max-scaled cost, float64."""

    def relation(z, g):
        cos = z @ (g / np.linalg.norm(g, axis=1, keepdims=True)).T
        cos /= np.linalg.norm(z, axis=1, keepdims=True)
        w = np.where(anchor_mask, np.exp(cos / tau), 0.0)
        return w / w.sum(1, keepdims=True)

    def kl(p, q):
        ratio = np.divide(p, q, out=np.ones_like(p), where=p > 0)  # 0 log 0 = 0
        return (p * np.log(ratio)).sum(-1)

    r_image, r_text = relation(z_image, anchors_image), relation(z_text, anchors_text)
    p, q = np.broadcast_arrays(r_image[:, None, :], r_text[None, :, :])
    cost = 0.5 * kl(p, 0.5 * (p + q)) + 0.5 * kl(q, 0.5 * (p + q))
    cost = cost / cost.max()
    n = len(cost)
    f, g = np.zeros(n), np.zeros(n)
    for _ in range(5000):
        f = -eps * logsumexp((g[None, :] - cost) / eps, axis=1) + eps * np.log(n)
        g = -eps * logsumexp((f[:, None] - cost) / eps, axis=0) + eps * np.log(n)
    plan = np.exp((f[:, None] + g[None, :] - cost) / eps) / n**2
    return plan / plan.sum(1, keepdims=True), plan.T / plan.T.sum(1, keepdims=True)


@pytest.mark.parametrize("anderson", [0, 5])
def test_loss_against_numpy(anderson):
    rng = np.random.default_rng(9)
    b, k, g, d = 5, 3, 4, 4
    z_image, z_text = (rng.normal(size=(b, d)) for _ in range(2))
    z_image /= np.linalg.norm(z_image, axis=1, keepdims=True)
    z_text /= np.linalg.norm(z_text, axis=1, keepdims=True)
    anchors_image, anchors_text = rng.normal(size=(g, d)), rng.normal(size=(g, d))
    anchor_mask = np.array([True, True, True, False])
    logits_image, logits_text = rng.normal(size=(b, k)), rng.normal(size=(b, k))
    q = rng.dirichlet(np.ones(k), size=b) * 0.7
    outputs = test_uot_rcl._outputs(
        logits_image, logits_text, z_image, z_text, anchors_image, anchors_text, anchor_mask
    )
    s = uot_rcl.Settings(
        relation_weight=0.5,
        relation_temperature=0.5,
        match_temperature=0.25,
        relation_threshold=1e-6,
        relation_max_iterations=5000,
        relation_anderson=anderson,
    )
    batch = {"mask": jnp.ones(b, bool)}
    loss_fn = jax.jit(lambda o, r: uot_rcl.loss(s, o, batch, r, {}, _ctx(MAIN)))
    loss, aux = loss_fn(outputs, {"labels": F32(q)})
    log_softmax = lambda x: x - logsumexp(x, axis=1, keepdims=True)
    plc = -(q * (log_softmax(logits_image) + log_softmax(logits_text))).sum(1)  # Eq. 15
    i2t, t2i = _np_relation_plan(
        z_image, z_text, anchors_image, anchors_text, anchor_mask, 0.5, 0.1
    )
    logits = z_image @ z_text.T / 0.25
    bhg = -(i2t * log_softmax(logits)).sum(1) - (t2i * log_softmax(logits.T)).sum(1)  # Eq. 18
    np.testing.assert_allclose(aux.metrics["loss_plc"], plc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux.metrics["loss_bhg"], bhg, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss, plc + 0.5 * bhg, rtol=1e-4, atol=1e-5)
    assert float(aux.metrics["relation_converged"].min()) == 1.0


def test_warmup_loss_is_the_ce_baseline():
    rng = np.random.default_rng(10)
    logits_image, logits_text = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    outputs = {"image_logits": F32(logits_image), "text_logits": F32(logits_text)}
    batch = {"label_image": jnp.array([0, 1, 1]), "label_text": jnp.array([1, 1, 0])}
    got = uot_rcl.loss(uot_rcl.Settings(), outputs, batch, {}, {}, _ctx(WARMUP))
    want = baselines.ce_loss(outputs, batch, {}, {}, None)
    np.testing.assert_array_equal(got[0], want[0])
    for name, values in want[1].metrics.items():  # the training accuracies
        np.testing.assert_array_equal(got[1].metrics[name], values)


class _Model:
    """A stand-in MRL model: the encoders double their inputs."""

    def __call__(self, batch, *, train, rngs):
        return {"sim": jnp.zeros((1, 1))}

    def encode_image(self, inputs):
        return {"emb": 2.0 * inputs["global_image"]}

    def encode_text(self, inputs):
        return {"emb": 2.0 * inputs["global_text"]}


@pytest.mark.parametrize("anchors", ["current", "snapshot"])
def test_forward_brings_the_confident_set_to_main_training_steps(anchors):
    state = {
        "anchors_image": jnp.ones((2, 3)),
        "anchors_text": jnp.full((2, 3), 3.0),
        "anchor_z_image": jnp.full((2, 3), 5.0),
        "anchor_z_text": jnp.full((2, 3), 7.0),
        "anchor_mask": jnp.array([True, False]),
    }
    s = uot_rcl.Settings(anchors=anchors)
    call = lambda **kw: uot_rcl.forward(s, _Model(), {}, state, rngs=None, **kw)
    out = call(train=True, phase=MAIN)
    want_image, want_text = (2.0, 6.0) if anchors == "current" else (5.0, 7.0)
    np.testing.assert_array_equal(out["anchor_z_image"], np.full((2, 3), want_image))
    np.testing.assert_array_equal(out["anchor_z_text"], np.full((2, 3), want_text))
    np.testing.assert_array_equal(out["anchor_mask"], [True, False])
    assert set(call(train=True, phase=WARMUP)) == {"sim"}
    assert set(call(train=False, phase=MAIN)) == {"sim"}


def test_stats_and_label_estimate():
    outputs = {
        "image": {"emb": 1},
        "text": {"emb": 2},
        "image_logits": 3,
        "text_logits": 4,
    }
    stats = uot_rcl.stats(uot_rcl.Settings(), outputs, {})
    assert stats == {"z_image": 1, "z_text": 2, "logits_image": 3, "logits_text": 4}
    labels = jnp.array([[0.1, 0.7, 0.0], [0.2, 0.1, 0.1], [0.0, 0.0, 0.0], [0.3, 0.0, 0.4]])
    memory = base.Memory({"labels": labels}, {})
    corrected, selected = uot_rcl.label_estimate(memory)
    np.testing.assert_array_equal(corrected, [1, 0, 0, 2])
    np.testing.assert_array_equal(selected, [True, False, False, True])


def test_refresh_during_warmup_changes_nothing():
    memory = base.Memory({}, {})
    ctx = base.RefreshContext(1, 10, 0, None, None)
    out, diagnostics = uot_rcl.refresh(uot_rcl.Settings(warmup_epochs=2), memory, {}, ctx)
    assert out is memory and diagnostics == {}
