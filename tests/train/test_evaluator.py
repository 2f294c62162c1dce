"""Collapse warnings at validation: constant representations, all-equal similarities."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ncljax import evaluate, methods, models
from ncljax.data import sources
from ncljax.methods import base
from ncljax.train import evaluator as evaluator_lib
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from tests.train import test_loop


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_warn_if_collapsed_flags_constant_leaves_only(caplog):
    rng = np.random.default_rng(0)
    varied = rng.normal(size=(12, 2, 3, 4)).astype(np.float32)
    constant = np.broadcast_to(rng.normal(size=(1, 2, 5)), (12, 2, 5)).astype(np.float32)
    one_network = np.stack([rng.normal(size=(12, 5)), np.full((12, 5), 0.3)], 1)
    with caplog.at_level(logging.WARNING):
        evaluator_lib.warn_if_collapsed(
            {"image": {"regions": varied, "mask": np.ones((12, 2, 3), bool)}}, "val"
        )
        evaluator_lib.warn_if_collapsed({"image": {"emb": varied[:1]}}, "val")  # one item
        evaluator_lib.warn_if_collapsed({}, "val")
        assert not _messages(caplog)
        evaluator_lib.warn_if_collapsed(
            {
                "image": {"regions": varied, "glob": jnp.asarray(constant)},
                "text": {"emb": np.zeros((12, 1, 5), np.float32)},
            },
            "test",
        )
        evaluator_lib.warn_if_collapsed({"text": {"emb": one_network.astype(np.float32)}}, "val")
    image, zero, second_network = _messages(caplog)
    assert "image representations of split 'test'" in image
    assert "glob" in image and "regions" not in image
    assert "text representations of split 'test'" in zero and "emb 0" in zero
    assert "text representations of split 'val'" in second_network
    # Small but real spread (relative variance ~1e-4) is not a collapse.
    caplog.clear()
    nearly = np.full((12, 1, 5), 1.0, np.float32) + 1e-2 * rng.normal(size=(12, 1, 5))
    with caplog.at_level(logging.WARNING):
        evaluator_lib.warn_if_collapsed({"image": {"emb": nearly.astype(np.float32)}}, "val")
    assert not _messages(caplog)


@pytest.fixture(scope="module")
def evaluator_and_state():
    config = test_loop.tiny(test_loop.load_config("ce", "synthetic"), epochs=1)
    config.eval.kind = "recall"  # also exercises the all-equal similarity warning
    config.eval.batch_size = 16
    dataset = sources.load_dataset(config.data)
    method = methods.build_method(config.method, config.method_kwargs)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(config.model, dataset.info, rngs),
        tx=optax.identity(),
        memory=method.init_memory(base.InitContext(1, dataset.info, None, None)),
        num_networks=method.num_networks,
        seed=0,
    )
    mesh = mesh_lib.make_mesh(1)
    evaluator = evaluator_lib.Evaluator(
        graphdef,
        dataset,
        config,
        mesh,
        transform=method.eval_transform,
        fields=models.input_fields(config.model),
    )
    return evaluator, state, mesh, config.data.num_val


def test_evaluator_warns_on_collapsed_image_encoder(evaluator_and_state, caplog):
    evaluator, state, mesh, num_val = evaluator_and_state
    with jax.set_mesh(mesh), caplog.at_level(logging.WARNING):
        evaluator(state, "val")
    assert not _messages(caplog)
    # The image encoder's last layer ignores its input: every image embeds to one vector.
    last = state.params["image_encoder"]["layers"][2]
    params = {**state.params}
    params["image_encoder"] = {
        "layers": {
            **state.params["image_encoder"]["layers"],
            2: {"kernel": jnp.zeros_like(last["kernel"]), "bias": jnp.ones_like(last["bias"])},
        }
    }
    with jax.set_mesh(mesh), caplog.at_level(logging.WARNING):
        collapsed = evaluator(state._replace(params=params), "val")
    image, retrieval = _messages(caplog)
    assert "image representations of split 'val'" in image and "emb" in image
    assert f"0 of {num_val} image->text and {num_val} of {num_val} text->image" in retrieval
    # Every caption's images tie: text->image is chance level, not 100.
    for k in (1, 5, 10):
        assert collapsed[f"t2i_r{k}"] == pytest.approx(100 * min(k, num_val) / num_val)


def _encoded(pool):
    emb = np.eye(3, dtype=np.float32)[:, None]  # [n, K, D]
    labels = np.arange(3)
    return evaluator_lib.Encoded({"emb": emb}, {"emb": emb}, labels, labels, 1, None, None, pool)


def test_pools_are_checked_and_an_ensemble_needs_one_rule():
    with pytest.raises(ValueError, match=r"Unknown evaluation pool 'max'.*logmeanexp"):
        evaluator_lib.Evaluator(None, None, None, None, transform=None, fields=None, pool="max")
    x = np.log(np.array([[1.0], [3.0]], np.float32))
    np.testing.assert_allclose(evaluator_lib.POOLS["logmeanexp"](x), np.log([2.0]), rtol=1e-6)
    np.testing.assert_allclose(evaluator_lib.POOLS["mean"](x), x.mean(0), rtol=1e-6)
    config = test_loop.tiny(test_loop.load_config("ce", "synthetic"), epochs=1)
    with pytest.raises(ValueError, match=r"\(mean vs logmeanexp\); an ensemble needs one rule"):
        evaluator_lib.score([_encoded("mean"), _encoded("logmeanexp")], config, None, "val")
    config.eval.kind = "map"
    with pytest.raises(ValueError, match="eval_pool is 'mean'"):
        evaluator_lib.score([_encoded("logmeanexp")], config, None, "val")


def test_held_out_share_is_storeys_share_of_the_text_to_image_p_values():
    """A caption's p-value is (1 + images above or tied with its own) / images; the share
    is #{p > 1/2} / (n / 2), clipped at 1 (a numpy loop over a similarity matrix)."""
    rng = np.random.default_rng(0)
    n_img, cpi = 40, 2
    sim = rng.normal(size=(n_img, n_img * cpi))
    own = np.repeat(np.arange(n_img), cpi)
    sim[own[:50], np.arange(50)] += 3.0  # the first 50 captions clearly matched
    sim[0, 1] = sim[5, 1]  # a tie with the partner counts against it
    images, texts = jnp.asarray(sim, jnp.float32), jnp.eye(n_img * cpi)  # image @ text = sim
    sim = np.asarray(images)
    ranks = evaluate.retrieval_ranks(lambda a, b: a @ b.T, images, texts, captions_per_image=cpi)
    p = [
        (1 + sum(sim[k, j] >= sim[own[j], j] for k in range(n_img) if k != own[j])) / n_img
        for j in range(n_img * cpi)
    ]
    want = min(1.0, sum(v > 0.5 for v in p) / (len(p) * 0.5))
    assert 0 < want < 1
    assert evaluator_lib.held_out_share(ranks) == pytest.approx(want, abs=1e-6)


def test_pair_auc_is_the_mean_per_caption_auc_of_its_own_image_against_the_others():
    """Per caption, scikit-learn's ROC AUC of its own image's similarity (label 1) against
    the other images' (label 0; a tie counts one half), averaged over captions."""
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    n_img, cpi = 30, 2
    sim = np.round(rng.normal(size=(n_img, n_img * cpi)), 1)  # rounded: ties with the partner
    own = np.repeat(np.arange(n_img), cpi)
    sim[own[:40], np.arange(40)] += 1.5
    images, texts = jnp.asarray(sim, jnp.float32), jnp.eye(n_img * cpi)
    sim = np.asarray(images)
    ranks = evaluate.retrieval_ranks(lambda a, b: a @ b.T, images, texts, captions_per_image=cpi)
    want = np.mean(
        [metrics.roc_auc_score(np.arange(n_img) == own[j], sim[:, j]) for j in range(n_img * cpi)]
    )
    assert 0.5 < want < 1
    assert evaluator_lib.pair_auc(ranks) == pytest.approx(want, abs=1e-9)
    single = evaluate.RankCounts.from_ranks([0])
    one = evaluate.RetrievalRanks(single, single)  # one image: nothing to tell it from
    assert np.isnan(evaluator_lib.pair_auc(one))


def _two_network_evaluator(mesh, head):
    """NCR's synthetic config (two networks over regions and tokens) with random weights,
    with ``head``'s similarity."""
    config = test_loop.tiny(test_loop.load_config("ncr", "synthetic"), epochs=1)
    config.eval.batch_size = 8
    config.model.head = head
    dataset = sources.load_dataset(config.data)
    method = methods.build_method(config.method, config.method_kwargs, config.model)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(
            config.model, dataset.info, rngs, heads_fn=method.heads_fn
        ),
        tx=optax.identity(),
        memory=method.init_memory(base.InitContext(1, dataset.info, None, None)),
        num_networks=method.num_networks,
        seed=0,
    )
    state = mesh_lib.replicate(state, mesh)
    return evaluator_lib.Evaluator.of_method(graphdef, dataset, config, mesh, method), state


@pytest.mark.heavy
@pytest.mark.parametrize("num_devices, head", [(1, "cosine"), (8, "cosine"), (1, "sgr")])
def test_pair_similarity_is_the_evaluation_similarity_at_each_pair(num_devices, head, devices):
    mesh = mesh_lib.make_mesh(num_devices)
    with jax.set_mesh(mesh):
        evaluator, state = _two_network_evaluator(mesh, head)
        encoded = evaluator.encode(state, "val")
        full = np.asarray(encoded.sim_fn(encoded.params, encoded.images, encoded.texts))
        num_images, num_captions = full.shape
        image_index = np.random.default_rng(0).integers(0, num_images, num_captions)
        image_index[:5] = np.arange(num_captions)[:5] // encoded.captions_per_image
        # Chunks and blocks that leave partial ones (13 and 6 do not divide 80 captions).
        got = evaluator.pair_similarity(state, "val", image_index, chunk=13, block=6)
    assert got.dtype == np.float64 and got.shape == (num_captions,)
    np.testing.assert_allclose(
        got, full[image_index, np.arange(num_captions)], rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="captions"):
        evaluator.pair_similarity(state, "val", image_index[:-1])
