"""Tests for ncljax.models.retrieval: the built model against the encoders' numpy oracles."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ncljax.config import base_config
from ncljax.data.sources import DatasetInfo
from ncljax.models import GRUTextEncoder, MLPEncoder, Prototypes, RegionEncoder, build_model
from tests.models.oracles import (
    np_gru_encoder,
    np_mlp_encoder,
    np_prototype_logits,
    np_region_encoder,
)

RTOL = ATOL = 1e-5
# The shapes of test_encoders.py, so the initialisers compile once per session.
FEATURE_DIM, WIDTH, EMBED_DIM = 6, 5, 4
VOCAB, MAX_LEN, NUM_REGIONS, NUM_CLASSES = 13, 7, 5, 3
LENGTHS = np.array([3, 1, 7, 5, 2, 7, 4, 6])
BATCH = len(LENGTHS)

INFO = DatasetInfo(
    name="toy",
    captions_per_image=1,
    num_classes=NUM_CLASSES,
    vocab_size=VOCAB,
    max_length=MAX_LEN,
    num_regions=NUM_REGIONS,
    region_dim=FEATURE_DIM,
    image_dim=FEATURE_DIM,
    text_dim=FEATURE_DIM,
    split_sizes={"train": (BATCH, BATCH)},
)


def model_config(**overrides):
    cfg = base_config().model
    cfg.embed_dim = EMBED_DIM
    cfg.tokens.word_dim = FEATURE_DIM
    cfg.cosine.image_hidden = (WIDTH,)
    cfg.text_mlp.hidden = (WIDTH,)
    cfg.update(overrides)
    return cfg


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(BATCH, MAX_LEN))
    tokens[np.arange(MAX_LEN)[None, :] >= LENGTHS[:, None]] = 0
    return {
        "regions": rng.normal(size=(BATCH, NUM_REGIONS, FEATURE_DIM)).astype(np.float32),
        "global_image": rng.normal(size=(BATCH, FEATURE_DIM)).astype(np.float32),
        "tokens": tokens.astype(np.int32),
        "length": LENGTHS.astype(np.int32),
        "global_text": rng.normal(size=(BATCH, FEATURE_DIM)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def token_model():
    """The regions/tokens model with dropout, its batch and its eager outputs (eval mode)."""
    model = build_model(model_config(tokens={"dropout": 0.5}), INFO, nnx.Rngs(0))
    batch = make_batch()
    return model, batch, model(batch)


# ---------------------------------------------------------------------------------------------
# Regions and tokens


def test_build_regions_tokens_model(token_model):
    model, _, _ = token_model
    assert isinstance(model.image_encoder, RegionEncoder)
    assert [layer.kernel.shape for layer in model.image_encoder.layers] == [
        (FEATURE_DIM, WIDTH),
        (WIDTH, EMBED_DIM),
    ]
    assert isinstance(model.text_encoder, GRUTextEncoder)
    assert model.text_encoder.embed.embedding.shape == (VOCAB, FEATURE_DIM)
    assert model.text_encoder.forward_gru.hidden_kernel.shape == (EMBED_DIM, 3 * EMBED_DIM)
    assert model.text_encoder.backward_gru is not None
    assert model.text_encoder.dropout.rate == 0.5
    assert model.classifier is None
    forward_only = build_model(model_config(tokens={"bidirectional": False}), INFO, nnx.Rngs(0))
    assert forward_only.text_encoder.backward_gru is None


def test_regions_tokens_outputs_match_numpy(token_model):
    model, batch, out = token_model
    regions, image_emb = np_region_encoder(model.image_encoder, batch["regions"])
    words, text_emb = np_gru_encoder(model.text_encoder, batch["tokens"], batch["length"])
    np.testing.assert_allclose(out["image"]["emb"], image_emb, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["image"]["regions"], regions, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["text"]["emb"], text_emb, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["text"]["words"], words, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(
        out["text"]["mask"], np.arange(MAX_LEN)[None, :] < LENGTHS[:, None]
    )
    np.testing.assert_allclose(out["sim"], image_emb @ text_emb.T, rtol=RTOL, atol=ATOL)
    assert "image_logits" not in out
    assert "text_logits" not in out


def test_sim_is_encode_image_times_encode_text(token_model):
    model, batch, out = token_model
    image, text = model.encode_image(batch), model.encode_text(batch)
    assert set(model.image_keys) <= set(image)
    assert set(model.text_keys) <= set(text)
    expected = np.asarray(image["emb"]) @ np.asarray(text["emb"]).T
    np.testing.assert_allclose(out["sim"], expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(model.similarity(image, text), expected, rtol=RTOL, atol=ATOL)
    # Rows are images: image 0 against caption 1 is <image_0, caption_1>.
    np.testing.assert_allclose(
        out["sim"][0, 1], np.dot(image["emb"][0], text["emb"][1]), rtol=RTOL, atol=ATOL
    )


def test_functional_jit_equals_eager(token_model):
    model, batch, out = token_model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sim_fn = jax.jit(lambda p, r, b: nnx.merge(graphdef, p, r)(b)["sim"])
    np.testing.assert_allclose(sim_fn(params, rest, batch), out["sim"], rtol=RTOL, atol=ATOL)


def test_functional_train_step_matches_numpy(token_model):
    """As the trainer does: pure-dict states, dropout key, value and gradient under jit."""
    model, batch, out = token_model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # The trainer keeps the states as pure dicts; so does this test.
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, BATCH)), jnp.float32)

    def loss_fn(p, r, b, key):
        sim = nnx.merge(graphdef, p, r)(b, train=True, rngs=nnx.Rngs(dropout=key))["sim"]
        return jnp.sum(sim * weights), sim

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    key = jax.random.key(7)
    (_, sim), grads = step(params, rest, batch, key)

    # The oracle on the embeddings dropped by Flax's Dropout from the same key (the same
    # draw as test_encoders.py checks); images have no dropout.
    table = np.asarray(model.text_encoder.embed.embedding[...])[batch["tokens"]]
    dropped = nnx.Dropout(0.5)(jnp.asarray(table), deterministic=False, rngs=nnx.Rngs(dropout=key))
    _, image_emb = np_region_encoder(model.image_encoder, batch["regions"])
    _, text_emb = np_gru_encoder(model.text_encoder, batch["tokens"], batch["length"], dropped)
    np.testing.assert_allclose(sim, image_emb @ text_emb.T, rtol=RTOL, atol=ATOL)
    assert np.abs(np.asarray(sim) - np.asarray(out["sim"])).max() > 1e-3
    (_, other), _ = step(params, rest, batch, jax.random.key(8))
    assert np.abs(np.asarray(other) - np.asarray(sim)).max() > 1e-3

    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(params))
    for leaf in leaves:
        assert np.all(np.isfinite(leaf))
        assert np.abs(leaf).max() > 0


def test_one_device_equals_eight(token_model, devices):
    model, batch, out = token_model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sim_fn = jax.jit(lambda p, r, b: nnx.merge(graphdef, p, r)(b)["sim"])
    mesh = jax.make_mesh((8,), ("data",), (AxisType.Auto,), devices=devices)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    np.testing.assert_allclose(sim_fn(params, rest, sharded), out["sim"], rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Global features with the prototype classifier


def test_global_model_with_classifier_matches_numpy():
    cfg = model_config(image_input="global", text_input="global", classifier=True)
    cfg.prototypes.temperature = 0.5
    model = build_model(cfg, INFO, nnx.Rngs(1))
    assert isinstance(model.image_encoder, MLPEncoder)
    assert isinstance(model.text_encoder, MLPEncoder)
    assert isinstance(model.classifier, Prototypes)
    assert model.classifier.prototypes.shape == (NUM_CLASSES, EMBED_DIM)
    batch = make_batch(2)
    batch = {"global_image": batch["global_image"], "global_text": batch["global_text"]}
    out = model(batch)

    image_emb = np_mlp_encoder(model.image_encoder, batch["global_image"])
    text_emb = np_mlp_encoder(model.text_encoder, batch["global_text"])
    np.testing.assert_allclose(out["image"]["emb"], image_emb, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["text"]["emb"], text_emb, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["sim"], image_emb @ text_emb.T, rtol=RTOL, atol=ATOL)

    prototypes = np.asarray(model.classifier.prototypes[...])
    for logits, emb in (("image_logits", image_emb), ("text_logits", text_emb)):
        np.testing.assert_allclose(
            out[logits], np_prototype_logits(emb, prototypes, 0.5), rtol=RTOL, atol=ATOL
        )
    np.testing.assert_allclose(
        out["image_logits"], model.classifier(out["image"]["emb"]), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        out["text_logits"], model.classifier(out["text"]["emb"]), rtol=RTOL, atol=ATOL
    )


# ---------------------------------------------------------------------------------------------
# Configuration errors


def replace_info(**changes):
    return DatasetInfo(**{**INFO.__dict__, **changes})


@pytest.mark.parametrize(
    ("overrides", "info_changes", "message"),
    [
        ({}, {"num_regions": 0}, "model.image_input='global'"),
        ({"image_input": "global"}, {"image_dim": 0}, "model.image_input='regions'"),
        ({"image_input": "global"}, {"vocab_size": 0}, "model.text_input='global'"),
        ({"image_input": "global", "text_input": "global"}, {"text_dim": 0}, "'tokens'"),
        ({"image_input": "pixels"}, {}, "model.image_input must be 'regions' or 'global'"),
        ({"image_input": "global", "text_input": "bow"}, {}, "model.text_input must be"),
        (
            {"image_input": "global", "text_input": "global", "classifier": True},
            {"num_classes": 0},
            "model.classifier needs class labels",
        ),
    ],
)
def test_build_model_errors(overrides, info_changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_model(model_config(**overrides), replace_info(**info_changes), nnx.Rngs(0))


def test_the_sgraf_text_encoder_reads_model_tokens():
    """``model.tokens`` is the Bi-GRU's section for every head: SGRAF's GRU is built from
    it too (one direction with ``bidirectional=False``)."""
    cfg = model_config(head="saf", tokens={"dropout": 0.25, "bidirectional": False})
    cfg.cosine.image_hidden = ()  # the cosine head's section, unread here
    cfg.sgraf.sim_dim = 8
    model = build_model(cfg, INFO, nnx.Rngs(0))
    assert model.text_encoder.backward_gru is None
    assert model.text_encoder.dropout.rate == 0.25
    assert model.text_encoder.embed.embedding.shape == (VOCAB, FEATURE_DIM)
    cfg.tokens.bidirectional = True
    assert build_model(cfg, INFO, nnx.Rngs(0)).text_encoder.backward_gru is not None
