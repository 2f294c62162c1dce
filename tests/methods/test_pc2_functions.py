"""PC2's top-level functions, each called alone with its ``Settings``: the settings
against the factory, the plan against a hand-written table, the classifier's inputs per
backbone, each update's loss against numpy evaluations of its equation, the borrowed
captions' class accuracy, and the refresh's oscillation division and bank."""

import dataclasses
import inspect
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from ncljax import methods
from ncljax.methods import base, coteaching, pc2

MASK = np.array([True, True, False, True, True, True, True])


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sim(seed, b=7):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(0.1, 0.6, (b, b))
    sim[np.diag_indices(b)] += rng.uniform(0.0, 0.5, b)
    return sim.astype(np.float32)


def _hardest_numpy(sim, margins, mask, margin_of="positive"):
    """Per-pair hardest-negative hinge: ``max_c [m + s(i_b, t_c) - s_bb]_+`` plus
    ``max_i [m + s(i_i, t_b) - s_bb]_+`` over the real negatives, with the margin of the
    positive pair, of the negative caption (``'caption'``, i2t) or image (``'image'``, t2i)."""
    sim, m = np.asarray(sim, np.float64), np.asarray(margins, np.float64)
    b = len(sim)
    own, other = m[:, None] * np.ones((1, b)), np.ones((b, 1)) * m[None, :]
    m_i2t = other if margin_of == "caption" else own
    m_t2i = other if margin_of == "image" else own
    d = np.diag(sim)[:, None]
    i2t = np.maximum(m_i2t + sim - d, 0.0)
    t2i = np.maximum(m_t2i + sim.T - d, 0.0)
    negative = mask[None, :] & ~np.eye(b, dtype=bool)
    per = np.where(negative, i2t, 0.0).max(1) + np.where(negative, t2i, 0.0).max(1)
    return np.where(mask, per, 0.0)


# --- settings and plan -------------------------------------------------------------------------


def test_settings_are_the_factorys_arguments_with_its_defaults_and_rules():
    fields = {f.name: f.default for f in dataclasses.fields(pc2.Settings)}
    assert fields == {k: p.default for k, p in methods.hyperparameters("pc2").items()}
    assert "model_config" in inspect.signature(pc2.pc2).parameters
    assert set(pc2.CHECKS) == set(fields)
    assert issubclass(pc2.Settings, coteaching.Settings)
    s = pc2.Settings()
    assert (s.margin, s.warmup_epochs, s.pseudo_start_epoch, s.num_classes) == (0.2, 5, 25, 128)
    assert (s.entropy_weight, s.noisy_margin_cutoff, s.calibration) == (10.0, 0.5, "data")
    method = pc2.pc2(num_classes=16, bank_mode="code")
    assert method.settings == pc2.Settings(num_classes=16, bank_mode="code")
    assert (pc2.WARMUP, pc2.CLEAN, pc2.CLEAN_PSEUDO) == (0, 1, coteaching.SECOND)


# epoch: (phase, updates, lr_epoch, reset_optimizer, restart_best), warm-up 2, E_2 = 3
PLAN = {
    0: (0, (0,), 0, False, False),
    1: (0, (0,), 0, False, False),
    2: (1, (0,), 0, True, False),
    3: (1, (0,), 1, False, False),
    4: (1, (0,), 2, False, False),
    5: (2, (0, 1), 3, False, True),
    6: (2, (0, 1), 4, False, False),
}


@pytest.mark.parametrize("noisy_weight", [1.0, 0.0])
def test_plan_against_a_table(noisy_weight):
    s = pc2.Settings(warmup_epochs=2, pseudo_start_epoch=3, noisy_weight=noisy_weight)
    for epoch, (phase, updates, lr_epoch, reset, restart) in PLAN.items():
        if noisy_weight == 0 and phase == 2:  # lambda_n = 0: no pseudo-caption update
            phase, updates = 1, (0,)
        plan = pc2.plan(s, epoch)
        got = (plan.phase, plan.updates, plan.lr_epoch, plan.reset_optimizer, plan.restart_best)
        assert got == (phase, updates, lr_epoch, reset, restart), epoch
        assert plan.refresh == plan.selectable == (epoch >= 2)
        assert plan.in_turn and plan.min_batch == 2


def test_streams_walk_the_peers_division_after_the_warmup():
    s = pc2.Settings(warmup_epochs=1)
    clean = jnp.array([[1, 0, 1, 1], [0, 1, 1, 0]], jnp.float32)
    memory = base.Memory({"clean": clean}, {})
    assert pc2.streams(s, memory, pc2.plan(s, 0), 0) == base.Streams()
    streams = pc2.streams(s, memory, pc2.plan(s, 1), 0)  # network 0 walks network 1's
    np.testing.assert_array_equal(streams.main, [1, 2])
    np.testing.assert_array_equal(streams.aux, [0, 3])


# --- what the classifier reads -------------------------------------------------------------------


def _model(head, inputs):
    image, text = ("global", "global") if inputs == "global" else ("regions", "tokens")
    return ConfigDict({"head": head, "image_input": image, "text_input": text, "embed_dim": 4})


@pytest.mark.parametrize(
    ("head", "inputs", "choice", "want"),
    [
        ("sgr", "regions", "auto", True),
        ("saf", "regions", "auto", True),
        ("cosine", "regions", "auto", False),
        ("cosine", "global", "auto", False),
        ("cosine", "regions", "sequences", True),
        ("sgr", "regions", "embeddings", "needs the cosine head"),
        ("cosine", "global", "sequences", "image_input='regions'"),
    ],
)
def test_classifier_input_per_backbone(head, inputs, choice, want):
    s, model = pc2.Settings(classifier_input=choice), _model(head, inputs)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            pc2.check_model(s, model)
        return
    pc2.check_model(s, model)
    assert pc2.reads_sequences(s, model) is want
    image = {"emb": jnp.ones((2, 4)), "regions": jnp.ones((2, 3, 4))}
    text = {"emb": jnp.zeros((2, 4)), "words": jnp.zeros((2, 5, 4))}
    batch = {"mask": jnp.array([True, True]), "length": jnp.array([5, 2])}
    x_image, x_text = pc2.classifier_inputs(image, text, batch, sequences=want)
    assert x_image.shape == x_text.shape == ((2, 12) if want else (2, 4))


# --- the losses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_pseudo_classification_against_numpy(reduction):
    s = pc2.Settings(classification_weight=0.5, entropy_weight=2.0, classification_start_epoch=3)
    s = dataclasses.replace(s, loss_reduction=reduction)
    rng = np.random.default_rng(0)
    image, text = rng.normal(size=(7, 5)) * 2, rng.normal(size=(7, 5)) * 2
    outputs = {"image_logits": jnp.asarray(image, jnp.float32), "text_logits": jnp.asarray(text)}
    p = _softmax(image)[MASK]
    ce = -np.log(p[np.arange(len(p)), text[MASK].argmax(1)]).mean()
    negative_entropy = (p * np.log(p)).sum(1).mean()  # the code's per-sample mean
    want = 0.5 * ce + 2.0 * negative_entropy
    mask = jnp.asarray(MASK)
    before = pc2.pseudo_classification(s, outputs, mask, jnp.int32(2))
    assert not np.any(before)
    per = np.asarray(pc2.pseudo_classification(s, outputs, mask, jnp.int32(3)))
    total = per[MASK].sum() if reduction == "sum" else per[MASK].mean()
    np.testing.assert_allclose(total, want, rtol=1e-5)


@pytest.mark.parametrize("code", [False, True])
def test_clean_loss_is_eq_8s_rectified_hinge(code):
    kwargs = {"margin_indexing": "code", "rectify_indicator": "code"} if code else {}
    s = pc2.Settings(**kwargs)
    rng = np.random.default_rng(1)
    w = rng.uniform(0.3, 1.0, 7)
    w_o = np.array([0.2, 0.5, 0.7, 0.49, 0.9, 0.51, 0.3])
    split = np.array([0, 0, 1, 1, 1, 0, 0], np.float32)
    peer = {"prob": w, "osc_prob": w_o, "osc_clean": split, "divided": np.ones(7)}
    peer = {k: jnp.asarray(v, jnp.float32) for k, v in peer.items()}
    sim, pse = _sim(2), jnp.full(7, 0.25)
    p = jnp.asarray(_softmax(rng.normal(size=(7, 4))), jnp.float32)
    per, aux = pc2.clean_loss(s, jnp.asarray(sim), jnp.asarray(MASK), p, pse, peer)
    indicator = split > 0.5 if code else w_o >= 0.5
    y = w + (1 - w) * indicator * w_o  # Eq. 8
    margins = 0.2 * (10.0**y - 1) / 9
    hinge = _hardest_numpy(sim, margins, MASK, "image" if code else "positive")
    np.testing.assert_allclose(np.asarray(per)[MASK], (hinge + 0.25)[MASK], rtol=1e-5)
    np.testing.assert_allclose(aux.clean_estimates["clean"], y, rtol=1e-6)
    np.testing.assert_allclose(aux.applied_weight, margins, rtol=1e-5)
    assert aux.extra is None and aux.memory_at is None


@pytest.mark.parametrize("calibration", ["data", "paper"])
def test_pseudo_caption_loss_is_eq_5s_hinge(calibration):
    s = pc2.Settings(noisy_weight=0.5, calibration=calibration, margin_indexing="code")
    cosine = np.array([0.3, 0.55, 0.9, 0.99, 0.49, 0.75, 0.7])
    index = np.array([0, 3, 3, 1, 2, 5, 6])
    outputs = {
        "sim": jnp.asarray(_sim(3)),
        "pseudo_cosine": jnp.asarray(cosine, jnp.float32),
        "pseudo_index": jnp.asarray(index, jnp.int32),
        "pseudo_chance": jnp.asarray(0.4),
    }
    ctx = base.LossContext(None, None, pc2.CLEAN_PSEUDO, 7, None, None, update=1)
    per, aux = pc2.pseudo_caption_loss(s, outputs, {"mask": jnp.asarray(MASK)}, ctx)
    cut = 0.4 + 0.5 * (1 - 0.4) if calibration == "data" else 0.5
    assert float(pc2.pseudo_cutoff(s, outputs)) == pytest.approx(cut)
    margins = np.where(cosine < cut, 0.0, 0.2 * (10.0**cosine - 1) / 9)
    want = 0.5 * _hardest_numpy(outputs["sim"], margins, MASK, "caption")
    np.testing.assert_allclose(np.asarray(per)[MASK], want[MASK], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(aux.extra["pseudo_caption_index"], index)
    assert aux.memory_at is None  # bank_mode='paper'
    assert pc2.pseudo_cutoff(dataclasses.replace(s, noisy_margin_cutoff=None), outputs) is None


def test_step_metrics_score_the_borrowed_captions_class():
    main = {"label_text": jnp.array([3, 1, -1, 2])}  # a caption of unknown class at row 2
    batch = {
        "mask": jnp.array([True, True, True, True, False]),
        "label_image": jnp.array([3, 2, 1, -1, 3]),
    }
    extra = {"pseudo_caption_index": jnp.array([0, 1, 2, 3, 0])}
    got = pc2.step_metrics(extra, batch, (main, batch))["pseudo_caption_accuracy"]
    # Known: rows 0 (3 == 3) and 1 (1 != 2); row 2's caption and row 3's image are unknown.
    np.testing.assert_allclose(got, [1.0, 2.0])


# --- the refresh ---------------------------------------------------------------------------------


def test_code_bank_keeps_positions_inside_each_subset():
    s = pc2.Settings(bank_mode="code")
    samples = {"clean": jnp.array([1, 0, 0, 1, 1, 0], jnp.float32), "bank": jnp.zeros((6, 2))}
    pred = jnp.ones((6, 2))
    samples["bank_valid"] = jnp.zeros(6)
    new = pc2.update_bank(s, samples, {"bank": pred})
    np.testing.assert_array_equal(new["position"], [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(new["bank"], samples["bank"])  # the code's bank stays
    paper = pc2.update_bank(pc2.Settings(), samples, {"bank": pred})
    np.testing.assert_array_equal(paper["bank"], pred)
    np.testing.assert_array_equal(paper["bank_valid"], np.ones(6))


def test_oscillation_division_and_its_fallback(caplog):
    s = pc2.Settings(num_classes=8)
    n = 400  # the shapes of test_pc2's refresh: programs compiled once per session
    memory = pc2.init_memory(s, base.InitContext(n, None, None, None))
    assert set(memory.samples) >= {"prob", "clean", "divided", "osc_prob", "bank", "bank_valid"}
    assert "position" not in memory.samples
    ctx = base.RefreshContext(3, 10, 1, None, None)
    rng = np.random.default_rng(4)
    pred = jnp.asarray(_softmax(rng.normal(size=(n, 8)) * 2), jnp.float32)
    outputs = {"sim": jnp.zeros((n, n)), "image_logits": jnp.log(pred)}
    batch = {"mask": jnp.ones(n, bool), "index": jnp.arange(n)}

    def oscillation(samples):  # the statistics pass, as one batch of every pair
        return pc2.stats(s, outputs, batch, samples)["osc_raw"]

    valid = memory.samples["bank_valid"] > 0.5  # an empty bank: no oscillation anywhere
    osc = oscillation(memory.samples)
    with caplog.at_level(logging.WARNING):
        samples, _, fallback = pc2.oscillation_divide(s, memory.samples, osc, valid, ctx)
    assert fallback and "oscillations of epoch 3 are all equal" in caplog.text
    assert not np.any(osc) and not np.any(samples["osc_prob"])
    bank = np.asarray(pred).copy()
    bank[300:] = _softmax(rng.normal(size=(n - 300, 8)) * 2)  # the last 100 moved
    samples = dict(memory.samples, bank=jnp.asarray(bank, jnp.float32), bank_valid=jnp.ones(n))
    osc = oscillation(samples)
    samples, _, fallback = pc2.oscillation_divide(s, samples, osc, jnp.ones(n, bool), ctx)
    p_now = np.asarray(pred, np.float64)
    kl = (bank * (np.log(bank) - np.log(p_now))).sum(1)  # Eq. 7: KL(bank || p)
    np.testing.assert_allclose(osc, kl, rtol=1e-4, atol=1e-6)
    assert not fallback and np.asarray(samples["osc_clean"])[:300].all()
