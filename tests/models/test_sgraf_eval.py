"""Evaluation at scale through the SGR head: chunked equals unchunked, 1 device equals 8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ncljax import evaluate
from ncljax.models import sgraf
from ncljax.train import mesh as mesh_lib

N_IMG, CPI, L = 6, 5, 7


@pytest.fixture(scope="module")
def encoded():
    model = sgraf.SGRAFModel(
        12, 40, embed_dim=16, word_dim=8, sim_dim=8, num_regions=5, rngs=nnx.Rngs(3)
    )
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, L + 1, size=N_IMG * CPI)
    tokens = rng.integers(4, 40, size=(N_IMG * CPI, L)) * (np.arange(L) < lengths[:, None])
    images = model.encode_image({"regions": jnp.asarray(rng.normal(size=(N_IMG, 5, 12)))})
    texts = model.encode_text({"tokens": jnp.asarray(tokens), "length": jnp.asarray(lengths)})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = (nnx.to_pure_dict(params), nnx.to_pure_dict(rest))
    full = np.asarray(model.similarity(images, texts))
    return graphdef, state, images, texts, full


def _sim_fn(graphdef):
    def sim(state, image, text):
        return nnx.merge(graphdef, *state).similarity(image, text)

    return sim


def _brute_force(sims):
    """Ranks from the whole matrix with argsort, as the SCAN evaluation code."""
    i2t = np.array([np.where(np.argsort(-row) // CPI == i)[0].min() for i, row in enumerate(sims)])
    t2i = np.array(
        [np.where(np.argsort(-sims[:, k]) == k // CPI)[0][0] for k in range(sims.shape[1])]
    )
    return evaluate.rank_metrics(i2t, t2i)


@pytest.mark.heavy
def test_sgr_similarity_matrix_is_the_pairwise_head(encoded):
    graphdef, state, images, texts, full = encoded
    model = nnx.merge(graphdef, *state)
    for i in (0, 3):
        for k in (0, 11, 29):
            one = model.similarity(
                jax.tree.map(lambda x, i=i: x[i : i + 1], images),
                jax.tree.map(lambda x, k=k: x[k : k + 1], texts),
            )
            np.testing.assert_allclose(one[0, 0], full[i, k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "image_chunk,text_chunk,pair_chunk",
    [  # (4, 7, 3) chunks every axis unevenly; the others are slow
        pytest.param(6, 30, 0, marks=pytest.mark.slow),
        (4, 7, 3),
        pytest.param(1, 5, 1, marks=pytest.mark.slow),
    ],
)
def test_chunked_evaluation_equals_unchunked(encoded, image_chunk, text_chunk, pair_chunk):
    graphdef, state, images, texts, full = encoded
    model = nnx.merge(graphdef, *state)
    model.head.chunk = pair_chunk
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = (nnx.to_pure_dict(params), nnx.to_pure_dict(rest))
    metrics = evaluate.retrieval_metrics(
        _sim_fn(graphdef),
        images,
        texts,
        captions_per_image=CPI,
        image_chunk=image_chunk,
        text_chunk=text_chunk,
        params=state,
    )
    assert metrics == pytest.approx(_brute_force(full), abs=1e-9)


def test_eight_devices_equal_one(encoded, devices):
    graphdef, state, images, texts, full = encoded
    mesh = mesh_lib.make_mesh(8)
    with jax.set_mesh(mesh):
        metrics = evaluate.retrieval_metrics(
            _sim_fn(graphdef),
            images,
            texts,
            captions_per_image=CPI,
            image_chunk=3,
            text_chunk=10,
            mesh=mesh,
            params=mesh_lib.replicate(state, mesh),
        )
    assert metrics == pytest.approx(_brute_force(full), abs=1e-9)
