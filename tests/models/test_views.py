"""Image views (UGNCL): W independent image projections sharing the text side and the head,
and the evaluator's pooling of the views' and networks' similarities."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ncljax import evaluate
from ncljax.config import base_config
from ncljax.data.sources import DatasetInfo
from ncljax.models import build_model
from ncljax.models.sgraf import SGRAFModel
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib

REGION_DIM, FEATURE_DIM, DIM, WORD_DIM, SIM_DIM = 10, 6, 16, 8, 8
VOCAB, MAX_LEN, REGIONS = 13, 5, 3
LENGTHS = np.array([3, 1, 5, 2])
BATCH = len(LENGTHS)
TOL = 1e-5
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

INFO = DatasetInfo(
    name="toy",
    captions_per_image=1,
    num_classes=3,
    vocab_size=VOCAB,
    max_length=MAX_LEN,
    num_regions=REGIONS,
    region_dim=REGION_DIM,
    image_dim=FEATURE_DIM,
    text_dim=FEATURE_DIM,
    split_sizes={"train": (BATCH, BATCH)},
)


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "regions": jnp.asarray(rng.normal(size=(BATCH, REGIONS, REGION_DIM)), jnp.float32),
        "global_image": jnp.asarray(rng.normal(size=(BATCH, FEATURE_DIM)), jnp.float32),
        "global_text": jnp.asarray(rng.normal(size=(BATCH, FEATURE_DIM)), jnp.float32),
        "tokens": jnp.asarray(rng.integers(1, VOCAB, size=(BATCH, MAX_LEN)), jnp.int32),
        "length": jnp.asarray(LENGTHS, jnp.int32),
    }


def sgraf(kind, **views):
    return SGRAFModel(
        REGION_DIM,
        VOCAB,
        embed_dim=DIM,
        word_dim=WORD_DIM,
        sim_dim=SIM_DIM,
        num_regions=REGIONS,
        kind=kind,
        dropout=0.0,
        rngs=nnx.Rngs(0),
        **views,
    )


def cosine(image_input, **overrides):
    cfg = base_config().model
    cfg.update(dict(embed_dim=DIM, word_dim=WORD_DIM, image_input=image_input, **overrides))
    return build_model(cfg, INFO, nnx.Rngs(0))


@functools.partial(jax.jit, static_argnames=("graphdef", "train"), compiler_options=FAST_COMPILE)
def _forward(graphdef, state, batch, *, train):
    model = nnx.merge(graphdef, state)
    out = model(batch, train=train)
    return out, nnx.state(model)


def forward(model, batch, *, train=False):
    """``model(batch)`` jitted; BatchNorm statistics are written back to ``model``."""
    graphdef, state = nnx.split(model)
    out, state = _forward(graphdef, state, batch, train=train)
    nnx.update(model, state)
    return out


def paths(model):
    state = nnx.to_pure_dict(nnx.state(model))
    return {p: np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def one_view(model, w, make):
    """A one-view model with ``model``'s shared parameters and view ``w``'s projection."""
    single = make()
    attr = "image_fc" if isinstance(model, SGRAFModel) else "image_encoder"
    if w > 0:
        nnx.update(getattr(single, attr), nnx.state(model.image_views[w - 1]))
    return single


@pytest.mark.parametrize(
    "make",
    [
        lambda **v: sgraf("saf", **v),
        lambda **v: cosine("regions", **v),
        lambda **v: cosine("global", text_input="global", **v),
    ],
    ids=["saf", "cosine-regions", "cosine-global"],
)
def test_one_view_is_the_model_without_views(make):
    plain, one = make(), make(views=1)
    assert one.num_views == 1 and len(one.image_views) == 0
    assert paths(one) == paths(plain)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(one), nnx.state(plain))
    # Extra views are built last: every parameter of the one-view model starts the same.
    two = make(views=2)
    shared = nnx.to_pure_dict(nnx.state(two))
    del shared["image_views"]
    jax.tree.map(np.testing.assert_array_equal, shared, nnx.to_pure_dict(nnx.state(one)))


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["sgr", pytest.param("saf", marks=pytest.mark.slow)])
def test_sgraf_views_are_the_head_on_each_projection(kind):
    batch = make_batch()
    model = sgraf(kind, views=2)
    out = forward(model, batch)
    assert out["image"]["regions"].shape == (BATCH, 2, REGIONS, DIM)
    assert out["image"]["glob"].shape == (BATCH, 2, DIM)
    assert out["logit"].shape == out["sim"].shape == (2, BATCH, BATCH)
    sim = model.similarity(out["image"], out["text"])
    np.testing.assert_allclose(sim, out["sim"], rtol=TOL, atol=TOL)
    for w in range(2):
        single = forward(one_view(model, w, lambda: sgraf(kind)), batch)
        for key in ("logit", "sim"):
            np.testing.assert_allclose(out[key][w], single[key], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(out["image"]["glob"][:, w], single["image"]["glob"], atol=TOL)
    assert not np.allclose(out["logit"][0], out["logit"][1], atol=1e-3)  # independent views
    with pytest.raises(ValueError, match="not available with image views"):
        model.image_similarity(out["image"])
    with pytest.raises(ValueError, match="not available with image views"):
        model.text_similarity(out["text"])


def _running(model):
    modules = [model.visual_sa.local_bn, model.visual_sa.glob_bn]
    if model.head.kind == "saf":
        modules.append(model.head.attn_bn)
    return [np.asarray(x[...]) for m in modules for x in (m.mean, m.var)]


@pytest.mark.parametrize("kind", ["sgr", pytest.param("saf", marks=pytest.mark.slow)])
def test_two_views_update_the_shared_batchnorms_once_per_view(kind):
    batch = {**make_batch(1), "mask": jnp.ones(BATCH, bool)}
    model = sgraf(kind, views=2)
    forward(model, batch, train=True)
    # The same updates by hand: a one-view copy trained on view 0's projection, then on
    # view 1's (the shared BatchNorms see view 0's batch first).
    single = sgraf(kind)
    forward(single, batch, train=True)
    once = _running(single)
    nnx.update(single.image_fc, nnx.state(model.image_views[0]))
    forward(single, batch, train=True)
    for got, want, first in zip(_running(model), _running(single), once, strict=True):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
        assert not np.allclose(got, first, rtol=1e-4, atol=1e-6)  # not a single update


@pytest.mark.parametrize(
    ("image_input", "text_input"), [("regions", "tokens"), ("global", "global")]
)
def test_cosine_views_are_the_cosine_of_each_encoder(image_input, text_input):
    batch = make_batch(2)
    make = functools.partial(cosine, image_input, text_input=text_input)
    model = make(views=2)
    out = model(batch)
    assert out["image"]["emb"].shape == (BATCH, 2, DIM)
    if image_input == "regions":
        assert out["image"]["regions"].shape == (BATCH, 2, REGIONS, DIM)
    assert out["sim"].shape == (2, BATCH, BATCH)
    for w in range(2):
        single = one_view(model, w, make)(batch)
        np.testing.assert_allclose(out["sim"][w], single["sim"], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(out["image"]["emb"][:, w], single["image"]["emb"], atol=TOL)
    assert not np.allclose(out["sim"][0], out["sim"][1], atol=1e-3)


def test_a_classifier_with_views_is_refused():
    with pytest.raises(ValueError, match=r"model\.classifier is not available with image views"):
        cosine("global", classifier=True, views=2)


def _log_mean_exp(x, axis=0):
    return np.log(np.mean(np.exp(np.asarray(x, np.float64)), axis=axis))


def test_network_similarity_pools_every_view_of_every_network():
    """Two networks of a two-view cosine model, pooled over the 4 (network, view) pairs."""
    cfg = base_config().model
    cfg.update(embed_dim=DIM, image_input="global", text_input="global", views=2)
    graphdef, params, model_state = state_lib.init_networks(
        lambda rngs: build_model(cfg, INFO, rngs), 2, jax.random.key(0)
    )
    batch = make_batch(3)

    def encode(fn):  # [K, n, ...] -> [n, K, ...] as the evaluator keeps them
        out = step_lib.make_forward(graphdef, fn)(params, model_state, batch)
        return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), out)

    images, texts = encode(evaluator_lib._image_repr), encode(evaluator_lib._text_repr)
    assert images["emb"].shape == (BATCH, 2, 2, DIM) and texts["emb"].shape == (BATCH, 2, DIM)

    def transform(s):
        return 4.0 * s - 1.0

    emb_i, emb_t = np.asarray(images["emb"], np.float64), np.asarray(texts["emb"], np.float64)
    oracle = 4.0 * np.einsum("nkwd,mkd->kwnm", emb_i, emb_t) - 1.0  # [K, W, n, m]
    oracle = oracle.reshape(4, BATCH, BATCH)
    wanted = {"mean": oracle.mean(0), "logmeanexp": _log_mean_exp(oracle)}
    assert not np.allclose(wanted["mean"], wanted["logmeanexp"], atol=1e-3)
    for pool, want in wanted.items():
        sim_fn = functools.partial(evaluator_lib._network_similarity, graphdef, transform, pool)
        got = sim_fn((params, model_state), images, texts)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
        # Scored in blocks along the item axis, as the evaluator does.
        metrics = evaluate.retrieval_metrics(
            sim_fn,
            images,
            texts,
            captions_per_image=1,
            image_chunk=3,
            text_chunk=3,
            params=(params, model_state),
        )
        want = jnp.asarray(want, jnp.float32)
        dense = evaluate.retrieval_metrics(
            lambda i, t, s=want: s[i][:, t],
            np.arange(BATCH),
            np.arange(BATCH),
            captions_per_image=1,
        )
        assert metrics == pytest.approx(dense)
