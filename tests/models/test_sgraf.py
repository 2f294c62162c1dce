"""Tests for ncljax.models.sgraf against the float64 per-caption loop of the official SGRAF code.

The oracles (``tests/models/oracles.py``) read the weights out of the modules and compute one
caption at a time, sliced to its valid length, against every image, as the PyTorch code
does: no padding, no masks. The vectorised, chunked, padded JAX computation must match them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ncljax.models.sgraf import (
    SGRAFModel,
    SimilarityHead,
    TextSelfAttention,
    TorchBatchNorm,
    VisualSelfAttention,
    group_lengths,
)
from tests.models.oracles import (
    np_bn_params,
    np_gsc_plus_text_text,
    np_sgraf_cross,
    np_sgraf_image_image,
    np_sgraf_model,
    np_sgraf_text_text,
    np_text_self_attention,
    np_torch_batchnorm,
    np_visual_self_attention,
)

RTOL = ATOL = 1e-5  # float32 against the float64 oracle
EXACT = 1e-6  # two float32 computations that should agree up to summation order
F64_TOL = 1e-8  # float64 (jax.enable_x64); l2 of x / max(|x|, eps) vs x / (|x| + eps)
DIM, SIM_DIM, REGIONS, MAX_LEN = 16, 8, 6, 7
REGION_DIM, WORD_DIM, VOCAB = 10, 8, 13
N_IMG = 4
LENGTHS = np.array([3, 1, 7, 5, 2])  # one-word and full-length captions; 5 != N_IMG
N_TXT = len(LENGTHS)
KINDS = ("sgr", "saf")
# Skips XLA:CPU's LLVM optimisation passes: the programs and their float32 semantics are the
# same, compilation (which dominates this file's runtime) is two to three times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ---------------------------------------------------------------------------------------------
# Helpers


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def randomize(module, seed):
    """Random biases (Flax starts them at 0) and BatchNorm affine parameters and running
    statistics, so a missing or misplaced term shows in the outputs."""
    rng = np.random.default_rng(seed)

    def normal(shape, scale):
        return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)

    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Linear):
            node.bias[...] = normal(node.bias.shape, 0.3)
        elif isinstance(node, TorchBatchNorm):
            shape = node.scale.shape
            node.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, shape), jnp.float32)
            node.bias[...] = normal(shape, 0.3)
            node.mean[...] = normal(shape, 0.3)
            node.var[...] = jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)
    return module


def make_head(kind, *, chunk=0, remat=False, steps=3, seed=0):
    head = SimilarityHead(
        DIM, SIM_DIM, kind=kind, steps=steps, chunk=chunk, remat=remat, rngs=nnx.Rngs(seed)
    )
    return randomize(head, seed + 100)


def make_inputs(n_img=N_IMG, lengths=LENGTHS, seed=0, dtype=np.float32):
    """Unit region/word/global vectors; padded word positions are zero, as the encoder's."""
    rng = np.random.default_rng(seed)
    mask = np.arange(MAX_LEN)[None, :] < np.asarray(lengths)[:, None]
    words = unit(rng.normal(size=(len(lengths), MAX_LEN, DIM))) * mask[..., None]
    image = {
        "regions": unit(rng.normal(size=(n_img, REGIONS, DIM))).astype(dtype),
        "glob": unit(rng.normal(size=(n_img, DIM))).astype(dtype),
    }
    text = {
        "words": words.astype(dtype),
        "mask": mask,
        "glob": unit(rng.normal(size=(len(lengths), DIM))).astype(dtype),
    }
    return image, text


def to_jax(tree):
    return jax.tree.map(jnp.asarray, tree)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "method", "train"), compiler_options=FAST_COMPILE
)
def _apply(graphdef, state, args, *, method, train):
    module = nnx.merge(graphdef, state)
    out = getattr(module, method)(*args, train=train)
    return out, nnx.state(module)


def call(module, method, *args, train=False):
    """``module.method(*args, train=train)`` under one jit per (structure, shapes): every
    test with the same graph definition reuses the compilation. State updates (BatchNorm
    running statistics) are written back to ``module``."""
    graphdef, state = nnx.split(module)
    out, state = _apply(graphdef, state, to_jax(args), method=method, train=train)
    nnx.update(module, state)
    return out


def with_padding_garbage(text, seed):
    """``text`` with large random vectors at the padded word positions."""
    rng = np.random.default_rng(seed)
    garbage = 10.0 * rng.normal(size=text["words"].shape).astype(np.float32)
    words = np.where(text["mask"][..., None], text["words"], garbage)
    return {**text, "words": words}


def saf_running(head):
    return tuple(np.asarray(x[...]) for x in (head.attn_bn.mean, head.attn_bn.var))


def oracle_cross(head, image, text, train=False):
    return np_sgraf_cross(
        head, image["regions"], image["glob"], text["words"], LENGTHS, text["glob"], train=train
    )


# ---------------------------------------------------------------------------------------------
# TorchBatchNorm and the self-attention global vectors


@pytest.mark.parametrize("train", [False, True])
def test_torch_batchnorm_regions_as_channels_matches_oracle(train):
    bn = randomize(TorchBatchNorm(REGIONS, axis=1), 1)
    before = np_bn_params(bn)
    x = np.random.default_rng(1).normal(1.0, 2.0, size=(3, REGIONS, DIM)).astype(np.float32)
    got = call(bn, "__call__", x, train=train)
    expected, mean, var = np_torch_batchnorm(before, x, 1, train)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(bn.mean[...], mean, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(bn.var[...], var, rtol=RTOL, atol=ATOL)
    if train:  # hand check of one channel: unbiased variance, momentum 0.1
        values = x[:, 2].astype(np.float64).ravel()
        assert values.size == 3 * DIM
        np.testing.assert_allclose(
            bn.var[...][2], 0.9 * before[3][2] + 0.1 * values.var(ddof=1), rtol=RTOL
        )


def test_visual_self_attention_eval_matches_oracle():
    module = randomize(VisualSelfAttention(DIM, REGIONS, 0.4, rngs=nnx.Rngs(2)), 2)
    regions = make_inputs()[0]["regions"]
    running = [np_bn_params(module.local_bn)[2:], np_bn_params(module.glob_bn)[2:]]
    got = call(module, "__call__", regions)
    expected, _ = np_visual_self_attention(module, regions, train=False)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=RTOL)
    for bn, (mean, var) in zip((module.local_bn, module.glob_bn), running, strict=True):
        np.testing.assert_array_equal(bn.mean[...], mean)  # evaluation leaves them alone
        np.testing.assert_array_equal(bn.var[...], var)


@pytest.mark.parametrize("n_img", [N_IMG, 1])  # one image: the official code skips BatchNorm
def test_visual_self_attention_train_matches_oracle(n_img):
    module = randomize(VisualSelfAttention(DIM, REGIONS, 0.0, rngs=nnx.Rngs(3)), 3)
    regions = make_inputs(n_img=n_img, seed=3)[0]["regions"]
    expected, stats = np_visual_self_attention(module, regions, train=True)
    got = call(module, "__call__", regions, train=True)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    for bn, name in ((module.local_bn, "local"), (module.glob_bn, "glob")):
        np.testing.assert_allclose(bn.mean[...], stats[name][0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(bn.var[...], stats[name][1], rtol=RTOL, atol=ATOL)
    assert module.local_bn.mean[...].shape == (REGIONS,)


def test_text_self_attention_matches_sliced_oracle():
    module = randomize(TextSelfAttention(DIM, 0.4, rngs=nnx.Rngs(4)), 4)
    _, text = make_inputs(seed=4)
    text = with_padding_garbage(text, 5)  # masked words must not enter the mean or softmax
    got = call(module, "__call__", text["words"], text["mask"])
    expected = [np_text_self_attention(module, text["words"][c, :n]) for c, n in enumerate(LENGTHS)]
    np.testing.assert_allclose(got, np.stack(expected), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# SimilarityHead against the per-pair loop


@pytest.mark.parametrize("kind", KINDS)
def test_cross_eval_matches_per_caption_loop(kind):
    head = make_head(kind, seed=10)
    image, text = make_inputs(seed=10)
    before = saf_running(head) if kind == "saf" else None
    got = call(head, "cross", image, text)
    expected, _ = oracle_cross(head, image, text)
    assert got.shape == (N_IMG, N_TXT)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    assert np.ptp(expected) > 0.1  # the pairs are distinguishable
    if kind == "saf":
        np.testing.assert_array_equal(saf_running(head)[0], before[0])
        np.testing.assert_array_equal(saf_running(head)[1], before[1])


@pytest.mark.parametrize("chunk", [0, 3])
def test_saf_cross_train_batch_statistics_per_caption(chunk):
    # BatchNorm(1) per caption over n_img x (L_c + 1) valid nodes; the running statistics
    # move once per caption, in caption order (the official loop's calls).
    head = make_head("saf", chunk=chunk, seed=11)
    image, text = make_inputs(seed=11)
    expected, (mean, var) = oracle_cross(head, image, text, train=True)
    eval_logits, _ = oracle_cross(head, image, text, train=False)
    got = call(head, "cross", image, text, train=True)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(head.attn_bn.mean[...], mean, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(head.attn_bn.var[...], var, rtol=RTOL, atol=ATOL)
    assert np.abs(expected - eval_logits).max() > 1e-2  # batch statistics do matter


@pytest.mark.parametrize(("kind", "train"), [("sgr", False), ("saf", False), ("saf", True)])
def test_image_image_matches_oracle(kind, train):
    head = make_head(kind, seed=12)
    image, _ = make_inputs(seed=12)
    expected, running = np_sgraf_image_image(head, image["regions"], image["glob"], train=train)
    got = call(head, "image_image", image, train=train)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    if kind == "saf":
        np.testing.assert_allclose(saf_running(head)[0], running[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(saf_running(head)[1], running[1], rtol=RTOL, atol=ATOL)
    if kind == "sgr":  # squared differences are symmetric in (j, i)
        np.testing.assert_allclose(got, np.asarray(got).T, rtol=EXACT, atol=EXACT)


@pytest.mark.parametrize(("kind", "train"), [("sgr", False), ("saf", False), ("saf", True)])
def test_text_text_matches_oracle(kind, train):
    head = make_head(kind, seed=13)
    _, text = make_inputs(seed=13)
    expected, running = np_sgraf_text_text(head, text["words"], LENGTHS, text["glob"], train=train)
    got = call(head, "text_text", text, train=train)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    if kind == "saf":
        np.testing.assert_allclose(saf_running(head)[0], running[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(saf_running(head)[1], running[1], rtol=RTOL, atol=ATOL)
    # G_T is not symmetric: row j = context caption, column i = query caption.
    assert np.abs(expected - expected.T).max() > 1e-2


@pytest.mark.parametrize(("kind", "train"), [("sgr", False), ("sgr", True), ("saf", False)])
def test_gsc_plus_text_text_matches_the_official_transcription(kind, train):
    """The dual-network code's word-aligned ``h_TT``: symmetric, padding-blind inside the
    batch's longest caption, and dependent on that length."""
    head = make_head(kind, seed=17)
    _, text = make_inputs(seed=17)
    garbled = with_padding_garbage(text, 17)  # padded words are zero for the official code
    expected = np_gsc_plus_text_text(head, text["words"], LENGTHS, text["glob"], train=train)
    got = np.asarray(call(head, "text_text_aligned", garbled, train=train))
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, got.T, atol=EXACT)
    assert np.abs(got - np.asarray(call(head, "text_text", text, train=train))).max() > 1e-3
    # Without the longest caption (7 words) the batch is padded to 5: every pair changes,
    # and equals the transcription on that batch.
    keep = np.flatnonzero(LENGTHS.max() > LENGTHS)  # drop the longest caption
    shorter = {k: v[keep] for k, v in text.items()}
    expected_short = np_gsc_plus_text_text(
        head, shorter["words"], LENGTHS[keep], shorter["glob"], train=train
    )
    got_short = np.asarray(call(head, "text_text_aligned", shorter, train=train))
    np.testing.assert_allclose(got_short, expected_short, rtol=RTOL, atol=ATOL)
    assert np.abs(got_short - got[np.ix_(keep, keep)]).max() > 1e-4
    # A padding caption of the batch (valid False) does not count towards L_b.
    padded = {**shorter, "valid": np.ones(len(keep), bool)}
    extra = {k: v[LENGTHS.argmax()][None] for k, v in text.items()}
    padded = {k: np.concatenate([padded[k], extra[k]]) for k in shorter}
    padded["valid"] = np.arange(len(keep) + 1) < len(keep)
    got_padded = np.asarray(call(head, "text_text_aligned", padded, train=train))
    np.testing.assert_allclose(
        got_padded[: len(keep), : len(keep)], expected_short, rtol=RTOL, atol=ATOL
    )


def test_intra_modal_epsilons_in_float64():
    # In float32 the 1e-6 terms are below resolution; in float64 they are resolved, and the
    # oracle without them is far outside the tolerance.
    head = make_head("sgr", seed=14)
    image, text = make_inputs(seed=14, dtype=np.float64)
    with jax.enable_x64(True):
        got_ii = np.asarray(call(head, "image_image", image))
        got_tt = np.asarray(call(head, "text_text", text))
    assert got_ii.dtype == got_tt.dtype == np.float64
    ii, _ = np_sgraf_image_image(head, image["regions"], image["glob"])
    tt, _ = np_sgraf_text_text(head, text["words"], LENGTHS, text["glob"])
    ii_no_eps, _ = np_sgraf_image_image(head, image["regions"], image["glob"], eps=0.0)
    tt_no_eps, _ = np_sgraf_text_text(head, text["words"], LENGTHS, text["glob"], eps=0.0)
    np.testing.assert_allclose(got_ii, ii, rtol=F64_TOL, atol=F64_TOL)
    np.testing.assert_allclose(got_tt, tt, rtol=F64_TOL, atol=F64_TOL)
    assert np.abs(ii - ii_no_eps).max() > 10 * F64_TOL
    assert np.abs(tt - tt_no_eps).max() > 10 * F64_TOL


@pytest.mark.heavy
@pytest.mark.parametrize("kind", KINDS)
def test_cross_gradient_matches_finite_differences_float64(kind):
    head = make_head(kind, seed=15)
    image, text = make_inputs(seed=15, dtype=np.float64)
    weights = np.random.default_rng(15).normal(size=(N_IMG, N_TXT))
    direction = unit(np.random.default_rng(16).normal(size=image["regions"].shape))

    graphdef, state = nnx.split(head)

    def loss_fn(regions):
        model = nnx.merge(graphdef, state)
        return jnp.sum(model.cross({**image, "regions": regions}, text) * weights)

    with jax.enable_x64(True):
        image, text = to_jax((image, text))
        regions = image["regions"]
        grad = jax.jit(jax.grad(loss_fn), compiler_options=FAST_COMPILE)(regions)
        loss = jax.jit(loss_fn, compiler_options=FAST_COMPILE)
        step = 1e-5
        numeric = (loss(regions + step * direction) - loss(regions - step * direction)) / (2 * step)
        np.testing.assert_allclose(jnp.sum(grad * direction), numeric, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# jit, chunking, rematerialisation and padding


def test_cross_jit_equals_eager():
    head = make_head("sgr", chunk=3, seed=19)
    image, text = to_jax(make_inputs(seed=19))
    eager = head.cross(image, text)
    np.testing.assert_allclose(call(head, "cross", image, text), eager, rtol=EXACT, atol=EXACT)


@pytest.mark.parametrize(("kind", "train"), [("sgr", False), ("saf", True)])
def test_cross_chunking_invariance(kind, train):
    image, text = to_jax(make_inputs(seed=20))
    results = {}
    for chunk in (0, 1, 3, N_TXT):
        # Same seed, same weights; one reasoning step keeps the four compilations short.
        head = make_head(kind, chunk=chunk, steps=1, seed=20)
        stats = saf_running(head) if kind == "saf" else ()
        results[chunk] = (call(head, "cross", image, text, train=train), stats)
    for chunk in (1, 3, N_TXT):
        np.testing.assert_allclose(results[chunk][0], results[0][0], rtol=EXACT, atol=EXACT)
        np.testing.assert_allclose(results[chunk][1], results[0][1], rtol=EXACT, atol=EXACT)


def test_remat_gradients_equal_plain_gradients():
    # SAF in training: the rematerialised chunks also return BatchNorm statistics.
    image, text = to_jax(make_inputs(seed=21))
    weights = jnp.asarray(np.random.default_rng(21).normal(size=(N_IMG, N_TXT)), jnp.float32)
    grads = []
    for remat in (False, True):
        head = make_head("saf", chunk=2, remat=remat, steps=1, seed=21)
        graphdef, params, rest = nnx.split(head, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        def loss(params, regions, graphdef=graphdef, rest=rest):
            model = nnx.merge(graphdef, params, rest)
            sim = model.cross({**image, "regions": regions}, text, train=True)
            return jnp.sum(sim * weights)

        grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=FAST_COMPILE)
        grads.append(grad_fn(params, image["regions"]))
    leaves = [jax.tree.leaves(g) for g in grads]
    assert len(leaves[0]) == len(leaves[1])
    for plain, remat in zip(*leaves, strict=True):
        assert np.all(np.isfinite(plain))
        np.testing.assert_allclose(remat, plain, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(grads[0][1])).max() > 1e-3


@pytest.mark.parametrize(("kind", "train"), [("sgr", False), ("saf", False), ("saf", True)])
def test_padded_words_never_matter(kind, train):
    image, text = make_inputs(seed=22)
    garbage = with_padding_garbage(text, 23)
    outputs = []
    for words in (text, garbage):
        head = make_head(kind, seed=22)
        cross = call(head, "cross", image, words, train=train)
        intra = call(head, "text_text", words, train=train)
        outputs.append((cross, intra))
    for clean, noisy in zip(*outputs, strict=True):
        np.testing.assert_allclose(noisy, clean, rtol=EXACT, atol=EXACT)


# ---------------------------------------------------------------------------------------------
# SGRAFModel


def make_model(kind, *, randomized=True, seed=30, dropout=0.4):
    model = SGRAFModel(
        REGION_DIM,
        VOCAB,
        embed_dim=DIM,
        word_dim=WORD_DIM,
        sim_dim=SIM_DIM,
        num_regions=REGIONS,
        kind=kind,
        dropout=dropout,
        rngs=nnx.Rngs(seed),
    )
    return randomize(model, seed + 1) if randomized else model


def make_batch(seed=31):
    rng = np.random.default_rng(seed)
    mask = np.arange(MAX_LEN)[None, :] < LENGTHS[:, None]
    return {
        "regions": rng.normal(size=(N_TXT, REGIONS, REGION_DIM)).astype(np.float32),
        "tokens": (rng.integers(1, VOCAB, size=(N_TXT, MAX_LEN)) * mask).astype(np.int32),
        "length": LENGTHS.astype(np.int32),
    }


@pytest.mark.parametrize("kind", KINDS)
def test_sgraf_model_end_to_end_matches_oracle(kind):
    model = make_model(kind)
    batch = make_batch()
    expected = np_sgraf_model(model, batch)
    # __call__ is similarity(encode_image(batch), encode_text(batch)).
    out = call(model, "__call__", batch)
    image, text, sim = out["image"], out["text"], out["sim"]
    np.testing.assert_allclose(image["regions"], expected["regions"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(image["glob"], expected["img_glob"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(text["words"], expected["words"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(text["glob"], expected["txt_glob"], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(text["mask"], np.arange(MAX_LEN)[None, :] < LENGTHS[:, None])
    logits = expected["logits"]
    np.testing.assert_allclose(sim, 1.0 / (1.0 + np.exp(-logits)), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out["logit"], logits, rtol=RTOL, atol=ATOL)  # e.g. SREM's F
    model.sigmoid = False
    np.testing.assert_allclose(call(model, "similarity", image, text), logits, rtol=RTOL, atol=ATOL)


@pytest.mark.heavy
def test_sgraf_model_train_gradients_through_pure_dicts():
    # GSC's use: cross, image-image and text-text passes in one loss (SGR; SAF's gradients
    # are checked in the head tests above). Default initialisation (zero biases), as the
    # trainer starts: on the diagonal of the intra-modal passes the squared differences are
    # zero and only the 1e-6 terms keep the similarity vectors away from l2(0).
    model = make_model("sgr", randomized=False)
    batch = to_jax(make_batch())
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def loss_fn(params, rest, key):
        model = nnx.merge(graphdef, params, rest)
        out = model(batch, train=True, rngs=nnx.Rngs(dropout=key))
        image_sim = model.image_similarity(out["image"], train=True)
        text_sim = model.text_similarity(out["text"], train=True)
        logits = out["sim"] / 0.07
        loss = -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=1)))
        loss = loss + 0.01 * jnp.mean((image_sim - text_sim) ** 2)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        return loss, nnx.to_pure_dict(new_rest)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), compiler_options=FAST_COMPILE)
    (loss, new_rest), grads = grad_fn(params, rest, jax.random.key(0))
    (loss_other_key, _), _ = grad_fn(params, rest, jax.random.key(1))
    assert np.isfinite(loss)
    assert loss != loss_other_key  # dropout is active in training
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for path, g in flat:
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    for part in ("image_fc", "text_encoder", "visual_sa", "text_sa", "head"):
        assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads[part])), part
    # BatchNorm running statistics moved in the train-mode forwards.
    old, new = rest["visual_sa"]["local_bn"], new_rest["visual_sa"]["local_bn"]
    assert np.abs(np.asarray(new["mean"]) - np.asarray(old["mean"])).max() > 1e-4


# ---------------------------------------------------------------------------------------------
# One device equals eight


@pytest.mark.parametrize(("kind", "train"), [("sgr", False), ("saf", True)])
def test_cross_one_device_equals_eight(devices, kind, train):
    lengths = np.array([3, 1, 7, 5, 2, 7, 4, 6])
    image, text = to_jax(make_inputs(n_img=8, lengths=lengths, seed=40))
    head = make_head(kind, chunk=3, seed=40)
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def cross(params, rest, image, text):
        model = nnx.merge(graphdef, params, rest)
        sim = model.cross(image, text, train=train)
        return sim, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

    single, single_rest = cross(params, rest, image, text)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        shard = NamedSharding(mesh, P("data"))
        sharded_image, sharded_text = jax.device_put((image, text), shard)
        assert sharded_image["regions"].sharding.spec == P("data")
        multi, multi_rest = cross(params, rest, sharded_image, sharded_text)
    assert len(multi.sharding.device_set) == 8
    np.testing.assert_allclose(multi, single, rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves(multi_rest), jax.tree.leaves(single_rest), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    expected, _ = np_sgraf_cross(
        head,
        image["regions"],
        image["glob"],
        text["words"],
        lengths,
        text["glob"],
        train=train,
    )
    np.testing.assert_allclose(single, expected, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Padded batches: padding copies never reach a BatchNorm statistic


def batchnorm_statistics(model):
    """Every running mean and variance of ``model`` (VisualSA's two BatchNorms, SAF's)."""
    return [
        np.asarray(x[...])
        for _, node in nnx.iter_graph(model)
        if isinstance(node, TorchBatchNorm)
        for x in (node.mean, node.var)
    ]


def pad_batch(batch, extra):
    """``batch`` followed by ``extra`` masked copies of its first pair (the pipeline's
    padding), with the batch ``mask``."""
    n = len(batch["length"])
    padded = {k: np.concatenate([v, np.repeat(v[:1], extra, axis=0)]) for k, v in batch.items()}
    padded["mask"] = np.arange(n + extra) < n
    return padded


@pytest.mark.parametrize(
    # SAF holds every kind of BatchNorm of the heads (SGR only VisualSA's); 15-35 s each. The
    # default run checks padding against SAF's BatchNorms in a whole train step
    # (tests/train/test_plans.py).
    "kind",
    [pytest.param("sgr", marks=pytest.mark.slow), pytest.param("saf", marks=pytest.mark.slow)],
)
def test_padding_never_reaches_a_batchnorm_statistic(kind):
    """A train-mode forward of a padded batch equals that of its real pairs alone: the
    similarities among real pairs and every BatchNorm's running statistics, in the cross
    pass and in GSC's intra-modal passes."""
    batch = make_batch(seed=50)
    real = {**batch, "mask": np.ones(N_TXT, bool)}
    padded = pad_batch(batch, 3)
    results = []
    for inputs in (real, padded):
        model = make_model(kind, seed=50, dropout=0.0)
        out = call(model, "__call__", inputs, train=True)
        sims = [out["sim"]]
        if kind == "saf":  # the intra-modal passes update SAF's statistics too
            sims.append(call(model, "image_similarity", out["image"], train=True))
            sims.append(call(model, "text_similarity", out["text"], train=True))
        results.append(([np.asarray(s)[:N_TXT, :N_TXT] for s in sims], batchnorm_statistics(model)))
    (sims_real, stats_real), (sims_pad, stats_pad) = results
    for got, want in zip(sims_pad, sims_real, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(stats_real) == (6 if kind == "saf" else 4)
    for got, want in zip(stats_pad, stats_real, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Without padding, the masked statistics are the plain ones.
    model, unmasked = (make_model(kind, seed=50, dropout=0.0) for _ in range(2))
    np.testing.assert_allclose(
        call(model, "__call__", real, train=True)["sim"],
        call(unmasked, "__call__", batch, train=True)["sim"],
        rtol=1e-6,
        atol=1e-7,
    )
    for got, want in zip(batchnorm_statistics(model), batchnorm_statistics(unmasked), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # ... and so are the gradients through the batch statistics.
    graphdef, params, rest = nnx.split(make_model(kind, seed=50, dropout=0.0), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    weights = jnp.asarray(np.random.default_rng(50).normal(size=(N_TXT, N_TXT)), jnp.float32)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def grad(params, inputs):
        def loss(params):
            sim = nnx.merge(graphdef, params, rest)(inputs, train=True)["sim"]
            return jnp.sum(sim * weights)

        return jax.grad(loss)(params)

    for got, want in zip(
        jax.tree.leaves(grad(params, to_jax(real))),
        jax.tree.leaves(grad(params, to_jax(batch))),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_all_padding_batch_keeps_the_statistics_and_stays_finite():
    model = make_model("saf", seed=51, dropout=0.0)
    before = batchnorm_statistics(model)
    batch = {**make_batch(seed=51), "mask": np.zeros(N_TXT, bool)}
    sim = call(model, "__call__", batch, train=True)["sim"]
    assert np.isfinite(np.asarray(sim)).all()
    for got, want in zip(batchnorm_statistics(model), before, strict=True):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Length grouping and the bfloat16 compute dtype


def test_group_lengths_by_hand():
    assert group_lengths(16, 4) == (4, 8, 12, 16)
    assert group_lengths(7, 4) == (2, 4, 6, 7)  # ceil(7k/4)
    assert group_lengths(3, 8) == (1, 2, 3)  # duplicates dropped
    assert group_lengths(16, 1) == (16,)
    assert group_lengths(1, 4) == (1,)


def _grouped_head(kind, groups, *, chunk=2, remat=False, seed=50):
    head = SimilarityHead(
        DIM,
        SIM_DIM,
        kind=kind,
        steps=2,
        chunk=chunk,
        remat=remat,
        length_groups=groups,
        rngs=nnx.Rngs(seed),
    )
    return randomize(head, seed + 100)


@pytest.mark.parametrize(
    ("kind", "train"),
    [("sgr", False), pytest.param("saf", False, marks=pytest.mark.slow), ("saf", True)],
)
def test_length_grouped_head_equals_padded(kind, train):
    # Lengths 3, 1, 7, 5, 2 in chunks of 2: sorted 1, 2 | 3, 5 | 7 (+ a padding copy), so
    # the chunks run at different static lengths; padding words hold garbage.
    image, text = make_inputs(seed=51)
    text = with_padding_garbage(text, 52)
    results = {}
    for groups in (1, 3, MAX_LEN):
        head = _grouped_head(kind, groups)
        cross = call(head, "cross", image, text, train=train)
        intra = call(head, "text_text", text, train=train)
        results[groups] = (cross, intra, saf_running(head) if kind == "saf" else ())
    expected, _ = oracle_cross(_grouped_head(kind, 1), image, text, train=train)
    np.testing.assert_allclose(results[1][0], expected, rtol=RTOL, atol=ATOL)
    for groups in (3, MAX_LEN):
        for padded, grouped in zip(results[1], results[groups], strict=True):
            np.testing.assert_allclose(grouped, padded, rtol=EXACT, atol=EXACT)


@pytest.mark.parametrize(
    ("kind", "remat"),
    [  # SAF's grouping: test_length_grouped_head_equals_padded; full remat: the next test
        pytest.param("saf", False, marks=pytest.mark.slow),
        pytest.param("sgr", True, marks=pytest.mark.slow),
        ("sgr", "projections"),
    ],
)
def test_length_grouped_gradients_equal_padded(kind, remat):
    # Padded and plain-stored, grouped and rematerialised with the given policy.
    image, text = to_jax(make_inputs(seed=53))
    weights = jnp.asarray(np.random.default_rng(53).normal(size=(N_IMG, N_TXT)), jnp.float32)
    grads = []
    for groups, policy in ((1, False), (MAX_LEN, remat)):
        head = _grouped_head(kind, groups, remat=policy, seed=53)
        graphdef, params, rest = nnx.split(head, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        def loss(params, words, graphdef=graphdef, rest=rest):
            model = nnx.merge(graphdef, params, rest)
            sim = model.cross(image, {**text, "words": words}, train=True)
            return jnp.sum(sim * weights)

        grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=FAST_COMPILE)
        grads.append(grad_fn(params, text["words"]))
    for padded, grouped in zip(*map(jax.tree.leaves, grads), strict=True):
        assert np.all(np.isfinite(padded))
        np.testing.assert_allclose(grouped, padded, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(grads[0][1])).max() > 1e-3


def _sub_jaxprs(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _sub_jaxprs(getattr(inner, "jaxpr", inner))


def test_length_grouping_runs_one_static_length_per_chunk():
    # The grouped head switches between computations cut to lengths 3, 5 and 7 (each
    # branch slices the words to its own length); the padded head has no switch.
    image, text = to_jax(make_inputs(seed=54))
    for groups in (1, 3):
        head = _grouped_head("sgr", groups)
        jaxpr = jax.make_jaxpr(lambda i, t, head=head: head.cross(i, t))(image, text)
        conds = [e for e in _sub_jaxprs(jaxpr.jaxpr) if e.primitive.name == "cond"]
        if groups == 1:
            assert not conds
            continue
        assert len(conds) == 1
        branches = conds[0].params["branches"]
        assert len(branches) == len(group_lengths(MAX_LEN, groups)) == 3
        for limit, branch in zip(group_lengths(MAX_LEN, groups), branches, strict=True):
            slices = [e for e in _sub_jaxprs(branch.jaxpr) if e.primitive.name == "slice"]
            cut = {e.outvars[0].aval.shape[1] for e in slices if e.outvars[0].aval.ndim >= 2}
            assert limit in cut or limit == MAX_LEN


def _bf16_setup(dtype):
    model = SGRAFModel(
        REGION_DIM,
        VOCAB,
        embed_dim=64,
        word_dim=WORD_DIM,
        sim_dim=32,
        num_regions=REGIONS,
        compute_dtype=dtype,
        length_groups=1,  # one branch: compiles faster (grouping is tested above)
        rngs=nnx.Rngs(60),
    )
    return randomize(model, 61)


@pytest.mark.heavy
def test_bfloat16_compute_dtype_stays_close_to_float32():
    """bfloat16 operands (8-bit mantissa, float32 accumulation): the SGR similarities
    within 2e-2 of float32 and the hardest-negative triplet loss within 3% of it."""
    batch = to_jax(make_batch(seed=62))
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = _bf16_setup(dtype)
        graphdef, state = nnx.split(model)

        def loss_fn(state, graphdef=graphdef):
            sim = nnx.merge(graphdef, state)(batch)["sim"][:, : len(LENGTHS)]
            n = min(sim.shape)
            sim = sim[:n, :n]
            pos = jnp.diag(sim)
            eye = jnp.eye(n, dtype=bool)
            cost_t = jnp.where(eye, 0.0, jnp.maximum(0.2 + sim - pos[:, None], 0.0))
            cost_i = jnp.where(eye, 0.0, jnp.maximum(0.2 + sim - pos[None, :], 0.0))
            return cost_t.max(1).sum() + cost_i.max(0).sum(), sim

        fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), compiler_options=FAST_COMPILE)
        (loss, sim), grads = fn(state)
        out[dtype] = (float(loss), np.asarray(sim), grads)
        text = str(jax.make_jaxpr(lambda s, graphdef=graphdef: loss_fn(s, graphdef)[0])(state))
        assert ("bf16[" in text) == (dtype == "bfloat16")
    (l32, s32, _), (l16, s16, g16) = out["float32"], out["bfloat16"]
    assert np.abs(s16 - s32).max() < 2e-2
    assert abs(l16 - l32) <= 0.03 * abs(l32)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(g16))
    assert s16.dtype == np.float32  # results stay float32
