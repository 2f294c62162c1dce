"""Tests for ncljax.evaluate against hand-worked values and brute-force numpy oracles."""

import itertools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn import metrics as sklearn_metrics

from ncljax import evaluate

HIGHEST = jax.lax.Precision.HIGHEST


def dot_sim(image_block, text_block):
    return jnp.matmul(image_block, text_block.T, precision=HIGHEST)


def region_sim(image_block, text_block):
    """Max over an image's regions of the region-caption dot product, scaled per caption."""
    per_region = jnp.einsum("ird,td->itr", image_block["v"], text_block["w"], precision=HIGHEST)
    return per_region.max(axis=-1) * text_block["scale"][None, :]


# ------------------------------------------------------------------------------- oracles


def brute_force_ranks(sim, cpi):
    """Full matrix, one argsort per row/column; rank = position of the (best) ground truth."""
    num_images, num_texts = sim.shape
    i2t = np.array(
        [np.flatnonzero(np.argsort(-sim[i]) // cpi == i).min() for i in range(num_images)]
    )
    t2i = np.array(
        [np.flatnonzero(np.argsort(-sim[:, k]) == k // cpi)[0] for k in range(num_texts)]
    )
    return i2t, t2i


def brute_force_metrics(sim, cpi):
    """SCAN ``i2t``/``t2i`` reductions, written out independently of ``rank_metrics``."""
    out = {}
    for name, ranks in zip(("i2t", "t2i"), brute_force_ranks(sim, cpi), strict=True):
        for k in (1, 5, 10):
            out[f"{name}_r{k}"] = 100.0 * np.sum(ranks < k) / len(ranks)
        out[f"{name}_medr"] = np.floor(np.median(ranks)) + 1
        out[f"{name}_meanr"] = ranks.mean() + 1
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    return out


def assert_no_near_ties(sim, cpi, gap=1e-5):
    """Precondition for exact rank equality with a float32 evaluator."""
    num_images, num_texts = sim.shape
    owner = np.arange(num_texts) // cpi
    negative = owner[None, :] != np.arange(num_images)[:, None]
    best = np.array([sim[i, owner == i].max() for i in range(num_images)])
    gt = sim[owner, np.arange(num_texts)]
    assert np.abs(sim - best[:, None])[negative].min() > gap
    assert np.abs(sim - gt[None, :])[negative].min() > gap


def assert_metrics_close(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-9, err_msg=key)


def random_embeddings(seed, num_images, cpi, dim=16):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(num_images, dim))
    # Captions near their image, so that recalls sit strictly between 0 and 100.
    texts = images.repeat(cpi, axis=0) + 2.0 * rng.normal(size=(num_images * cpi, dim))
    return images.astype(np.float32), texts.astype(np.float32)


def tied_embeddings(seed, num_images, cpi, dim=3):
    """Small-integer embeddings: dot products are exact small integers, so ties abound."""
    rng = np.random.default_rng(seed)
    images = rng.integers(-1, 2, size=(num_images, dim))
    noise = rng.integers(-1, 2, size=(num_images * cpi, dim))
    texts = images.repeat(cpi, axis=0) + noise * (rng.random((num_images * cpi, 1)) < 0.5)
    return images.astype(np.float32), texts.astype(np.float32)


def enumerated_rank(values, is_ground_truth):
    """Exact distribution of a query's 0-based rank over every order of its tied candidates.

    Candidates above the best ground-truth value ``b`` always come first and those below ``b``
    after every ground truth at ``b``, so only the order of the group tied at ``b`` matters.
    Each of its ``(t + m)!`` orders is equally likely, and the first ground truth's position
    depends only on the set of positions the ``m`` ground truths take: enumerating all
    ``C(t + m, m)`` sets (each standing for ``m! t!`` orders) is the full enumeration.

    Returns the ``[C(t + m, m)]`` equally likely ranks.
    """
    best = values[is_ground_truth].max()
    above = np.sum(values > best)
    group = values == best
    size, m = int(group.sum()), int(np.sum(group & is_ground_truth))
    firsts = [min(positions) for positions in itertools.combinations(range(size), m)]
    return above + np.array(firsts)


def enumerated_metrics(sim, cpi):
    """Expected SCAN metrics from :func:`enumerated_rank`, and the per-query expectations."""
    num_images, num_texts = sim.shape
    owner = np.arange(num_texts) // cpi
    ranks = {
        "i2t": [enumerated_rank(sim[i], owner == i) for i in range(num_images)],
        "t2i": [
            enumerated_rank(sim[:, k], np.arange(num_images) == owner[k]) for k in range(num_texts)
        ],
    }
    out, per_query = {}, {}
    for name, dists in ranks.items():
        hits = {k: np.array([np.mean(d < k) for d in dists]) for k in (1, 5, 10)}
        expected = np.array([d.mean() for d in dists])
        per_query[name] = (hits, expected)
        for k in (1, 5, 10):
            out[f"{name}_r{k}"] = 100.0 * hits[k].mean()
        out[f"{name}_medr"] = np.floor(np.median(expected + 1))
        out[f"{name}_meanr"] = np.mean(expected + 1)
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    return out, per_query


# ------------------------------------------------------------------------------ Recall@K


def test_recall_hand_worked_two_captions_per_image():
    # Rows: images 0-2; columns: captions 0-5; captions 2i and 2i+1 belong to image i.
    sim = np.array(
        [
            [0.9, 0.1, 0.8, 0.3, 0.2, 0.4],
            [0.7, 0.6, 0.5, 0.2, 0.9, 0.1],
            [0.3, 0.2, 0.1, 0.4, 0.6, 0.05],
        ],
        np.float32,
    )
    # i2t: img0 best GT 0.9 (cap0), nothing higher -> 0; img1 best GT 0.5 (cap2), higher are
    # 0.7, 0.6, 0.9 -> 3; img2 best GT 0.6 (cap4), nothing higher -> 0.
    # t2i: cap0 g=0.9 col (.9,.7,.3) -> 0; cap1 g=0.1 col (.1,.6,.2) -> 2; cap2 g=0.5 col
    # (.8,.5,.1) -> 1; cap3 g=0.2 col (.3,.2,.4) -> 2; cap4 g=0.6 col (.2,.9,.6) -> 1;
    # cap5 g=0.05 col (.4,.1,.05) -> 2.
    images = np.eye(3, dtype=np.float32)  # one-hot images make sim_fn return texts.T exactly
    texts = sim.T.copy()
    i2t, t2i = evaluate.retrieval_ranks(dot_sim, images, texts, captions_per_image=2)
    np.testing.assert_array_equal(i2t.greater, [0, 3, 0])
    np.testing.assert_array_equal(t2i.greater, [0, 2, 1, 2, 1, 2])
    for counts in (i2t, t2i):  # no ties: the rank is the count of better negatives
        assert not counts.tied.any() and (counts.ground_truth_ties == 1).all()
        np.testing.assert_array_equal(counts.expected_rank(), counts.greater)
    got = evaluate.retrieval_metrics(
        dot_sim, images, texts, captions_per_image=2, image_chunk=2, text_chunk=4
    )
    want = {
        "i2t_r1": 200 / 3,
        "i2t_r5": 100.0,
        "i2t_r10": 100.0,
        "t2i_r1": 100 / 6,
        "t2i_r5": 100.0,
        "t2i_r10": 100.0,
        "rsum": 200 / 3 + 100 / 6 + 400.0,
        "i2t_medr": 1.0,  # ranks+1 = (1, 4, 1)
        "i2t_meanr": 2.0,
        "t2i_medr": 2.0,  # ranks+1 = (1, 3, 2, 3, 2, 3): median 2.5, floored
        "t2i_meanr": 14 / 6,
    }
    assert_metrics_close(got, want)


def test_recall_hand_worked_one_caption_per_image_ties_are_fair():
    # Was "ties favour the ground truth" (img0 ranked 0); a tie is now a coin flip.
    sim = np.array([[0.5, 0.5, 0.1], [0.6, 0.2, 0.3], [0.1, 0.9, 0.7]], np.float32)
    # i2t: img0 GT 0.5 ties cap1 -> greater 0, tied 1: rank 0 or 1, each with probability 1/2;
    # img1 GT 0.2 < 0.6, 0.3 -> 2; img2 GT 0.7 < 0.9 -> 1.
    # t2i: cap0 GT 0.5 < 0.6 -> 1; cap1 GT 0.2 < 0.5, 0.9 -> 2; cap2 GT 0.7 highest -> 0.
    images = np.eye(3, dtype=np.float32)
    i2t, t2i = evaluate.retrieval_ranks(dot_sim, images, sim.T.copy(), captions_per_image=1)
    np.testing.assert_array_equal(i2t.greater, [0, 2, 1])
    np.testing.assert_array_equal(i2t.tied, [1, 0, 0])
    np.testing.assert_array_equal(t2i.greater, [1, 2, 0])
    np.testing.assert_array_equal(t2i.tied, [0, 0, 0])
    np.testing.assert_allclose(i2t.expected_rank(), [0.5, 2, 1])
    np.testing.assert_allclose(i2t.hit_probability(1), [0.5, 0, 0])
    got = evaluate.retrieval_metrics(dot_sim, images, sim.T.copy(), captions_per_image=1)
    assert got["i2t_r1"] == pytest.approx(100 / 6, abs=1e-9)  # (1/2 + 0 + 0) / 3
    assert got["t2i_r1"] == pytest.approx(100 / 3, abs=1e-9)
    assert got["i2t_meanr"] == pytest.approx(6.5 / 3, abs=1e-12)  # (1.5 + 3 + 2) / 3
    assert got["i2t_medr"] == 2.0
    assert got["t2i_meanr"] == pytest.approx(2.0, abs=1e-12)
    assert got["t2i_medr"] == 2.0
    for name in ("i2t", "t2i"):
        assert got[f"{name}_r5"] == got[f"{name}_r10"] == 100.0


@pytest.mark.parametrize(
    ("image_chunk", "text_chunk"),
    [(8, 13), (100, 1000), (1, 7), (5, 3), (37, 185), (1000, 5000)],
)
def test_ranks_match_brute_force(image_chunk, text_chunk):
    cpi = 5
    images, texts = random_embeddings(0, 37, cpi)
    sim = images.astype(np.float64) @ texts.astype(np.float64).T
    assert_no_near_ties(sim, cpi)
    i2t, t2i = evaluate.retrieval_ranks(
        dot_sim,
        images,
        texts,
        captions_per_image=cpi,
        image_chunk=image_chunk,
        text_chunk=text_chunk,
    )
    want_i2t, want_t2i = brute_force_ranks(sim, cpi)
    np.testing.assert_array_equal(i2t.greater, want_i2t)
    np.testing.assert_array_equal(t2i.greater, want_t2i)
    assert not i2t.tied.any() and not t2i.tied.any()
    got = evaluate.retrieval_metrics(
        dot_sim,
        images,
        texts,
        captions_per_image=cpi,
        image_chunk=image_chunk,
        text_chunk=text_chunk,
    )
    assert_metrics_close(got, brute_force_metrics(sim, cpi))
    assert 0.0 < got["i2t_r1"] < 100.0 and 0.0 < got["t2i_r1"] < 100.0  # non-trivial data


@pytest.mark.parametrize("cpi", [1, 2, 5])
@pytest.mark.parametrize("ks", [(1, 5, 10), (1, 5), (1,)])
def test_recall_min_images_is_the_first_size_where_every_recall_can_miss(cpi, ks):
    """Oracle: the adversarial ranking (every ground truth below every negative) through the
    brute-force SCAN ranks; below the minimum some R@K is 100 even then."""

    def can_miss(num_images):
        sim = 1.0 + np.random.default_rng(num_images).random((num_images, num_images * cpi))
        sim[np.arange(num_images * cpi) // cpi, np.arange(num_images * cpi)] = 0.0
        out = brute_force_metrics(sim, cpi)
        return all(out[f"{d}_r{k}"] < 100 for d in ("i2t", "t2i") for k in ks)

    first = next(n for n in range(1, 30) if can_miss(n))
    assert all(can_miss(n) for n in range(first, first + 5))
    assert evaluate.recall_min_images(cpi, ks) == first


def test_pytree_blocks_with_region_max_similarity():
    rng = np.random.default_rng(1)
    num_images, cpi, dim = 11, 3, 8
    images = {"v": rng.normal(size=(num_images, 3, dim)).astype(np.float32)}
    texts = {
        "w": rng.normal(size=(num_images * cpi, dim)).astype(np.float32),
        "scale": rng.uniform(0.5, 2.0, size=num_images * cpi).astype(np.float32),
    }
    v, w = images["v"].astype(np.float64), texts["w"].astype(np.float64)
    sim = np.einsum("ird,td->itr", v, w).max(axis=-1) * texts["scale"][None, :]
    assert_no_near_ties(sim, cpi)
    got = evaluate.retrieval_metrics(
        region_sim, images, texts, captions_per_image=cpi, image_chunk=4, text_chunk=7
    )
    assert_metrics_close(got, brute_force_metrics(sim, cpi))


def test_coco_5fold_is_mean_over_folds():
    cpi, fold_images = 5, 12
    images, texts = random_embeddings(2, 2 * fold_images, cpi, dim=4)
    folds = []
    for f in range(2):
        img = images[f * fold_images : (f + 1) * fold_images].astype(np.float64)
        txt = texts[f * fold_images * cpi : (f + 1) * fold_images * cpi].astype(np.float64)
        sim = img @ txt.T
        assert_no_near_ties(sim, cpi)
        folds.append(brute_force_metrics(sim, cpi))
    want = {key: np.mean([fold[key] for fold in folds]) for key in folds[0]}
    got = evaluate.coco_5fold_metrics(
        dot_sim, images, texts, fold_images=fold_images, image_chunk=5, text_chunk=17
    )
    assert_metrics_close(got, want)
    recalls = [got[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10)]
    assert got["rsum"] == pytest.approx(sum(recalls), abs=1e-9)
    # One fold over everything differs: folds restrict the candidate sets.
    full = evaluate.retrieval_metrics(dot_sim, images, texts, captions_per_image=cpi)
    assert full["rsum"] < got["rsum"]


def test_block_kernels_compile_once_per_shape():
    traces = []

    def counting_sim(image_block, text_block):
        traces.append((image_block.shape, text_block.shape))  # runs at trace time only
        return jnp.matmul(image_block, text_block.T, precision=HIGHEST)

    images, texts = random_embeddings(3, 37, 5)
    kwargs = {"captions_per_image": 5, "image_chunk": 8, "text_chunk": 13}
    first = evaluate.retrieval_metrics(counting_sim, images, texts, **kwargs)
    # One trace for the ground-truth kernel ([1, 2] vmapped blocks) and one for the sweep
    # ([8, 13] blocks), although the last image and caption blocks are partial.
    assert sorted(traces) == [((1, 16), (5, 16)), ((8, 16), (13, 16))]
    images2, texts2 = random_embeddings(4, 37, 5)
    evaluate.retrieval_metrics(counting_sim, images2, texts2, **kwargs)
    again = evaluate.retrieval_metrics(counting_sim, images, texts, **kwargs)
    assert len(traces) == 2
    assert again == first


def test_sharded_inputs_and_mesh_match_single_device(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    cpi = 5
    images, texts = random_embeddings(5, 40, cpi)
    rows = NamedSharding(mesh, P("data"))
    sharded_images = jax.device_put(images, rows)
    sharded_texts = jax.device_put(texts, rows)
    assert len(sharded_texts.sharding.device_set) == 8
    kwargs = {"captions_per_image": cpi, "image_chunk": 12, "text_chunk": 30}
    want = evaluate.retrieval_metrics(dot_sim, images, texts, **kwargs)
    # Sharded inputs, default placement: blocks are gathered onto one device.
    assert evaluate.retrieval_metrics(dot_sim, sharded_images, sharded_texts, **kwargs) == want
    # mesh=...: image rows of each block (12 -> 16) sharded over the 8 devices.
    assert evaluate.retrieval_metrics(dot_sim, images, texts, mesh=mesh, **kwargs) == want
    assert (
        evaluate.retrieval_metrics(dot_sim, sharded_images, sharded_texts, mesh=mesh, **kwargs)
        == want
    )
    sim = images.astype(np.float64) @ texts.astype(np.float64).T
    assert_no_near_ties(sim, cpi)
    assert_metrics_close(want, brute_force_metrics(sim, cpi))


def test_ties_with_mesh_match_single_device(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    images, texts = tied_embeddings(10, 10, 2)
    kwargs = {"captions_per_image": 2, "image_chunk": 4, "text_chunk": 6}
    want = evaluate.retrieval_ranks(dot_sim, images, texts, **kwargs)
    assert want.i2t.tied.any() and want.t2i.tied.any()
    got = evaluate.retrieval_ranks(dot_sim, images, texts, mesh=mesh, **kwargs)
    for want_counts, got_counts in zip(want, got, strict=True):
        for want_array, got_array in zip(want_counts, got_counts, strict=True):
            np.testing.assert_array_equal(got_array, want_array)


def test_retrieval_input_errors():
    images, texts = random_embeddings(6, 4, 5)
    with pytest.raises(ValueError, match="captions_per_image \\* n_img"):
        evaluate.retrieval_metrics(dot_sim, images, texts[:-1], captions_per_image=5)
    with pytest.raises(ValueError, match="same leading axis"):
        evaluate.retrieval_metrics(
            dot_sim, {"a": images, "b": images[:3]}, texts, captions_per_image=5
        )
    with pytest.raises(ValueError, match="multiple of fold_images"):
        evaluate.coco_5fold_metrics(dot_sim, images, texts, fold_images=3)
    with pytest.raises(ValueError, match="sim_fn must return"):
        evaluate.retrieval_metrics(lambda i, t: t @ i.T, images, texts, captions_per_image=5)
    bad = images.copy()
    bad[2, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        evaluate.retrieval_metrics(dot_sim, bad, texts, captions_per_image=5)


@pytest.mark.parametrize(("num_images", "cpi", "seed"), [(9, 1, 10), (6, 2, 10), (3, 5, 11)])
def test_recall_with_ties_matches_enumeration(num_images, cpi, seed):
    images, texts = tied_embeddings(seed, num_images, cpi)
    sim = images.astype(np.float64) @ texts.astype(np.float64).T
    want, per_query = enumerated_metrics(sim, cpi)
    kwargs = {"captions_per_image": cpi, "image_chunk": 2, "text_chunk": 4}
    ranks = evaluate.retrieval_ranks(dot_sim, images, texts, **kwargs)
    assert ranks.i2t.tied.any() and ranks.t2i.tied.any()  # the data does tie
    if cpi > 1:
        assert (ranks.i2t.ground_truth_ties > 1).any()
    for name, counts in ranks._asdict().items():
        hits, expected = per_query[name]
        np.testing.assert_allclose(counts.expected_rank(), expected, rtol=0, atol=1e-12)
        for k in (1, 5, 10):
            np.testing.assert_allclose(counts.hit_probability(k), hits[k], rtol=0, atol=1e-12)
    assert_metrics_close(evaluate.retrieval_metrics(dot_sim, images, texts, **kwargs), want)
    assert_metrics_close(evaluate.rank_metrics(*ranks), want)


@pytest.mark.parametrize(("num_images", "cpi"), [(20, 1), (4, 5)])
def test_all_zero_embeddings_score_chance_level(num_images, cpi, caplog):
    images = np.zeros((num_images, 4), np.float32)
    texts = np.zeros((num_images * cpi, 4), np.float32)
    with caplog.at_level(logging.WARNING):
        got = evaluate.retrieval_metrics(
            dot_sim, images, texts, captions_per_image=cpi, image_chunk=3, text_chunk=7
        )
    num_texts = num_images * cpi
    chance = 0.0
    for k in (1, 5, 10):
        # i2t: one of the image's cpi captions among the first k of a random order.
        i2t = 100 * (1 - math.comb(num_texts - cpi, k) / math.comb(num_texts, k))
        t2i = 100 * min(k, num_images) / num_images
        assert got[f"i2t_r{k}"] == pytest.approx(i2t, abs=1e-9)
        assert got[f"t2i_r{k}"] == pytest.approx(t2i, abs=1e-9)
        chance += i2t + t2i
    assert got["rsum"] == pytest.approx(chance, abs=1e-9)  # not 600
    # Expected 1-based rank of the first of cpi ground truths among num_texts: (n + 1)/(cpi + 1).
    assert got["i2t_meanr"] == pytest.approx((num_texts + 1) / (cpi + 1), abs=1e-12)
    assert got["t2i_meanr"] == pytest.approx((num_images + 1) / 2, abs=1e-12)
    assert got["t2i_medr"] == np.floor((num_images + 1) / 2)
    warnings = [r for r in caplog.records if "all-equal similarities" in r.getMessage()]
    assert len(warnings) == 1
    assert f"{num_images} of {num_images} image->text" in warnings[0].getMessage()
    assert f"{num_texts} of {num_texts} text->image" in warnings[0].getMessage()


def test_random_data_logs_no_collapse_warning(caplog):
    images, texts = random_embeddings(0, 37, 5)
    with caplog.at_level(logging.WARNING):
        evaluate.retrieval_metrics(dot_sim, images, texts, captions_per_image=5)
    assert not caplog.records


def test_collapsed_images_warn_for_text_to_image_only(caplog):
    # Every image is the same vector: each caption's column is all-equal, image rows are not.
    _, texts = random_embeddings(1, 6, 2, dim=4)
    images = np.tile(np.float32([[1, 0, 0, 0]]), (6, 1))
    with caplog.at_level(logging.WARNING):
        got = evaluate.retrieval_metrics(dot_sim, images, texts, captions_per_image=2)
    assert "0 of 6 image->text and 12 of 12 text->image" in caplog.records[0].getMessage()
    assert got["t2i_r1"] == pytest.approx(100 / 6, abs=1e-9)


def test_tie_tolerance_absorbs_cross_kernel_rounding():
    """A ground-truth kernel that rounds up must not win every tie of a collapsed model."""
    cpi, num_images = 2, 5

    def rounds_up_on_ground_truth(image_block, text_block):
        sim = jnp.matmul(image_block, text_block.T, precision=HIGHEST)
        # The ground-truth kernel sees [1, cpi] blocks, the sweep [image_chunk, ...] blocks:
        # nudge the former, as a different summation order could.
        return sim * (1 + 3e-7) + 1e-7 if image_block.shape[0] == 1 else sim

    images = np.zeros((num_images, 3), np.float32)
    texts = np.zeros((num_images * cpi, 3), np.float32)
    kwargs = {"captions_per_image": cpi, "image_chunk": 5}
    exact = evaluate.retrieval_metrics(
        rounds_up_on_ground_truth, images, texts, tie_atol=0.0, tie_rtol=0.0, **kwargs
    )
    assert exact["rsum"] == 600.0  # the bug: rounding decides every tie
    want = evaluate.retrieval_metrics(dot_sim, images, texts, **kwargs)
    assert want["t2i_r1"] == pytest.approx(20.0)
    got = evaluate.retrieval_metrics(rounds_up_on_ground_truth, images, texts, **kwargs)
    assert got == pytest.approx(want, abs=1e-9)
    # Large similarities: the relative part of the tolerance takes over.
    images = np.full((num_images, 3), 30.0, np.float32)
    texts = np.full((num_images * cpi, 3), 40.0, np.float32)
    got = evaluate.retrieval_metrics(
        rounds_up_on_ground_truth, images, texts, tie_atol=0.0, **kwargs
    )
    assert got == pytest.approx(want, abs=1e-9)
    with pytest.raises(ValueError, match="tolerances"):
        evaluate.retrieval_metrics(dot_sim, images, texts, tie_atol=-1.0, **kwargs)


def test_rank_metrics_of_plain_ranks_and_counts():
    ranks = np.array([0, 3, 0, 12, 7])
    counts = evaluate.RankCounts.from_ranks(ranks)
    plain = evaluate.rank_metrics(ranks, ranks)
    assert plain == evaluate.rank_metrics(counts, counts)
    assert plain["i2t_r1"] == 40.0 and plain["i2t_r5"] == 60.0 and plain["i2t_r10"] == 80.0
    assert plain["i2t_medr"] == 4.0 and plain["i2t_meanr"] == pytest.approx(5.4)
    # g = 2 above, t = 6 tied, m = 3 tied ground truths: P(X >= x) = C(6, x) / C(9, x).
    tied = evaluate.RankCounts(np.array([2]), np.array([6]), np.array([3]))
    for k, want in ((1, 0.0), (2, 0.0), (3, 1 - 6 / 9), (5, 1 - 20 / 84), (9, 1.0)):
        assert tied.hit_probability(k)[0] == pytest.approx(want, abs=1e-12)
    assert tied.expected_rank()[0] == pytest.approx(2 + 6 / 4)
    with pytest.raises(ValueError, match="integers"):
        evaluate.rank_metrics(np.array([0.5]), np.array([0]))


def test_rsum_by_image_sums_to_the_rsum_and_pairs_each_image_with_its_captions():
    # Hand-worked: 2 images, 2 captions each, plain ranks. Image 0 ranks its best caption
    # 0 (hits at K = 1, 5, 10: 3), image 1 at 7 (hits at 10: 1); captions 0, 1 (image 0)
    # rank 0 and 5 (3 and 1 hits), captions 2, 3 (image 1) rank 1 and 12 (2 and 0 hits).
    shares = evaluate.rsum_by_image(np.array([0, 7]), np.array([0, 5, 1, 12]), 2)
    np.testing.assert_allclose(shares, [100 / 2 * (3 + 2), 100 / 2 * (1 + 1)])
    metrics = evaluate.rank_metrics(np.array([0, 7]), np.array([0, 5, 1, 12]))
    assert shares.sum() == pytest.approx(metrics["rsum"], abs=1e-12)
    # Random counts with ties: the shares sum to rank_metrics' rSum for cpi 1 and 5.
    rng = np.random.default_rng(0)
    for cpi in (1, 5):
        n = 40
        i2t = evaluate.RankCounts(
            rng.integers(0, 20, n), rng.integers(0, 4, n), rng.integers(1, cpi + 1, n)
        )
        t2i = evaluate.RankCounts(
            rng.integers(0, 20, n * cpi), rng.integers(0, 4, n * cpi), np.ones(n * cpi, int)
        )
        shares = evaluate.rsum_by_image(i2t, t2i, cpi)
        assert shares.shape == (n,)
        assert shares.sum() == pytest.approx(evaluate.rank_metrics(i2t, t2i)["rsum"], abs=1e-9)
    with pytest.raises(ValueError, match="3 caption queries for 2 images"):
        evaluate.rsum_by_image(np.array([0, 1]), np.array([0, 1, 2]), 2)


# ---------------------------------------------------------------------------------- mAP@all


def unit_rows(x):
    x = np.asarray(x, np.float64)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


def average_precision(relevant):
    """AP of one ranking given as a bool vector in rank order (0 without relevant items)."""
    if not relevant.any():
        return 0.0
    hit_positions = np.flatnonzero(relevant) + 1  # 1-based ranks of relevant items
    return float(np.mean(np.arange(1, len(hit_positions) + 1) / hit_positions))


def enumerated_ap(sim_row, relevant):
    """Mean AP over EVERY order of the tied database items (all permutations of each tie group).

    Each combination of per-group permutations is a tie-breaking priority; sorting by
    (-similarity, priority) gives one ranking, and all of them are equally likely. Groups of
    only relevant or only irrelevant items are skipped: their order does not change AP.
    """
    values, group = np.unique(sim_row, return_inverse=True)
    groups = [np.flatnonzero(group == g) for g in range(len(values))]
    groups = [g for g in groups if 0 < relevant[g].sum() < len(g)]
    assert math.prod(math.factorial(len(g)) for g in groups) <= 10**5, "too many orders"
    aps = []
    for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
        priority = np.zeros(len(sim_row))
        for members, order in zip(groups, orders, strict=True):
            priority[list(order)] = np.arange(len(members))
        ranking = np.lexsort((priority, -sim_row))
        aps.append(average_precision(relevant[ranking]))
    return float(np.mean(aps))


def numpy_map(queries, query_labels, database, database_labels):
    """Loop oracle: cosine in float64, AP averaged over every order of tied items."""
    sim = unit_rows(queries) @ unit_rows(database).T
    database_labels = np.asarray(database_labels)
    return float(
        np.mean(
            [enumerated_ap(sim[q], database_labels == query_labels[q]) for q in range(len(sim))]
        )
    )


def test_map_hand_worked():
    # Cosines to q0 = (1, 0): a=1, b=0.8, c=0.6, d=0. To q1 = (0, 1): d=1, c=0.8, b=0.6, a=0.
    database = np.array([[0.6, 0.8], [0.0, 1.0], [1.0, 0.0], [0.8, 0.6]])  # c, d, a, b
    database_labels = np.array([0, 1, 0, 1])  # a and c are class 0
    queries = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    query_labels = np.array([0, 0, 2])
    # q0 ranks a, b, c, d -> rel 1, 0, 1, 0 -> AP = (1/1 + 2/3) / 2 = 5/6.
    # q1 ranks d, c, b, a -> rel 0, 1, 0, 1 -> AP = (1/2 + 2/4) / 2 = 1/2.
    # q2 has label 2, nothing relevant -> AP = 0.
    for chunk in (1, 2, 1024):
        got = evaluate.mean_average_precision(
            queries, query_labels, database, database_labels, chunk=chunk
        )
        assert got == pytest.approx((5 / 6 + 1 / 2 + 0) / 3, abs=1e-6)
    single = evaluate.mean_average_precision(queries[:1], [0], database, database_labels)
    assert single == pytest.approx(5 / 6, abs=1e-6)
    assert evaluate.mean_average_precision(queries[2:], [2], database, database_labels) == 0.0


def test_map_ties_are_fair():
    # Was "ties keep database order" (AP 0.5 or 1.0 depending on the order of the twins).
    query = np.array([[1.0, 0.0]])
    twins = np.array([[1.0, 0.0], [1.0, 0.0]])
    # Both items tie at cosine 1: the relevant one is first or second, AP 1 or 1/2.
    assert evaluate.mean_average_precision(query, [0], twins, np.array([1, 0])) == 0.75
    assert evaluate.mean_average_precision(query, [0], twins, np.array([0, 1])) == 0.75
    # A zero query ties everything at 0 (+0.0 and -0.0 alike): orders rrn, rnr, nrr of two
    # relevant items and one other give AP 1, (1 + 2/3)/2, (1/2 + 2/3)/2.
    zero = np.zeros((1, 2))
    database = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    want = (1 + 5 / 6 + 7 / 12) / 3
    for labels in ([1, 0, 0], [0, 1, 0], [0, 0, 1]):
        got = evaluate.mean_average_precision(zero, [0], database, np.array(labels))
        assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("chunk", [2, 16])
def test_map_with_ties_matches_enumeration(chunk):
    rng = np.random.default_rng(22)  # 9 of the 10 queries have mixed tie groups
    # Axis vectors, diagonals and zero: cosines tied exactly between duplicates in float32 and
    # float64 alike; a zero query meets +0.0 and -0.0 (the (-1, -1) atom) similarities.
    atoms = np.array([[1, 0], [0, 1], [-1, 0], [1, 1], [-1, -1], [0, 0]], np.float32)
    database = atoms[rng.integers(0, 6, size=7)]
    database_labels = rng.integers(0, 2, size=7)
    queries = np.concatenate([atoms, atoms[rng.integers(0, 6, size=4)]])
    query_labels = rng.integers(0, 3, size=10)  # label 2: nothing relevant
    want = numpy_map(queries, query_labels, database, database_labels)
    got = evaluate.mean_average_precision(
        queries, query_labels, database, database_labels, chunk=chunk
    )
    assert got == pytest.approx(want, abs=1e-6)
    # All-zero embeddings: one tie group, the AP of a random ranking, whatever the order.
    zeros = np.zeros((7, 2), np.float32)
    want = numpy_map(zeros[:1], [1], zeros, database_labels)
    for perm in (np.arange(7), rng.permutation(7)):
        got = evaluate.mean_average_precision(zeros[:3], [1, 1, 1], zeros, database_labels[perm])
        assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("chunk", [7, 64])
def test_map_matches_numpy_oracle(chunk):
    rng = np.random.default_rng(7)
    database = rng.normal(size=(50, 16)).astype(np.float32)
    database[40:] = database[:10]  # exact duplicates: tied pairs of items
    database_labels = rng.integers(0, 4, size=50)
    database_labels[40:] = (database_labels[:10] + 1) % 4
    queries = rng.normal(size=(30, 16)).astype(np.float32)
    query_labels = rng.integers(0, 5, size=30)  # class 4 has no relevant items
    assert (query_labels == 4).any()
    want = numpy_map(queries, query_labels, database, database_labels)
    got = evaluate.mean_average_precision(
        queries, query_labels, database, database_labels, chunk=chunk
    )
    assert got == pytest.approx(want, abs=1e-6)
    both = evaluate.category_retrieval_metrics(
        queries, query_labels, database, database_labels, chunk=chunk
    )
    reverse = numpy_map(database, database_labels, queries, query_labels)
    assert both["map_i2t"] == pytest.approx(want, abs=1e-6)
    assert both["map_t2i"] == pytest.approx(reverse, abs=1e-6)
    assert both["map_avg"] == pytest.approx((want + reverse) / 2, abs=1e-6)


def test_map_sharded_matches_single_device(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(8)
    queries = rng.normal(size=(24, 8)).astype(np.float32)
    queries[:3] = 0.0  # every item tied
    database = rng.normal(size=(32, 8)).astype(np.float32)
    database[20:] = database[:12]  # tied pairs
    query_labels, database_labels = rng.integers(0, 3, 24), rng.integers(0, 3, 32)
    want = evaluate.mean_average_precision(queries, query_labels, database, database_labels)
    rows = NamedSharding(mesh, P("data"))
    sharded = [jax.device_put(x, rows) for x in (queries, database)]
    got = evaluate.mean_average_precision(sharded[0], query_labels, sharded[1], database_labels)
    assert got == want
    got = evaluate.mean_average_precision(
        queries, query_labels, database, database_labels, chunk=5, mesh=mesh
    )
    assert got == pytest.approx(want, abs=1e-7)
    # The oracle enumerates tie orders: not the 32! orders of the zero queries.
    rest = evaluate.mean_average_precision(queries[3:], query_labels[3:], database, database_labels)
    assert rest == pytest.approx(
        numpy_map(queries[3:], query_labels[3:], database, database_labels), abs=1e-6
    )


# --------------------------------------------------------------------------- noise detection


def pairwise_auc(score, clean):
    """O(N^2) oracle: P(clean score > noisy score), ties count 1/2."""
    pos, neg = score[clean][:, None], score[~clean][None, :]
    return (np.sum(pos > neg) + 0.5 * np.sum(pos == neg)) / (pos.size * neg.size)


def test_noise_auc_matches_pair_counting_with_ties():
    rng = np.random.default_rng(9)
    clean = rng.random(300) < 0.6
    score = np.round(np.clip(rng.normal(clean * 0.3 + 0.4, 0.25), 0, 1), 1)  # heavy ties
    assert len(np.unique(score)) < 15
    got = evaluate.noise_detection_metrics(score, clean)
    assert got["noise_auc"] == pytest.approx(pairwise_auc(score, clean), abs=1e-12)
    assert 0.5 < got["noise_auc"] < 1.0
    assert got["noise_auc"] == pytest.approx(sklearn_metrics.roc_auc_score(clean, score), abs=1e-12)
    flipped = evaluate.noise_detection_metrics(-score, clean)
    assert flipped["noise_auc"] == pytest.approx(1.0 - got["noise_auc"], abs=1e-12)
    # Every score tied: no separation, AUC 1/2.
    assert evaluate.noise_detection_metrics(np.zeros(300), clean)["noise_auc"] == 0.5


def test_clean_precision_recall_hand_worked():
    score = np.array([0.9, 0.8, 0.6, 0.5, 0.3, 0.1])
    clean = np.array([True, False, True, True, False, False])
    # Predicted clean (> 0.5): pairs 0, 1, 2. TP = {0, 2}: precision 2/3, recall 2/3 (pair 3
    # sits on the threshold and is missed). Correct: 0, 2, 4, 5 -> accuracy 4/6.
    # AUC: clean scores (.9, .6, .5) beat noisy (.8, .3, .1) in 3 + 2 + 2 of 9 pairs.
    got = evaluate.noise_detection_metrics(score, clean)
    assert got["clean_precision"] == pytest.approx(2 / 3, abs=1e-12)
    assert got["clean_recall"] == pytest.approx(2 / 3, abs=1e-12)
    assert got["noise_accuracy"] == pytest.approx(4 / 6, abs=1e-12)
    assert got["noise_auc"] == pytest.approx(7 / 9, abs=1e-12)
    one_class = evaluate.noise_detection_metrics(score, np.ones(6, bool), threshold=0.95)
    assert np.isnan(one_class["noise_auc"])
    assert np.isnan(one_class["clean_precision"])  # nothing predicted clean
    assert one_class["clean_recall"] == 0.0
    with pytest.raises(ValueError, match=r"\[N\]"):
        evaluate.noise_detection_metrics(score, clean[:5])


def test_params_are_traced_and_passed_first():
    """``params`` reaches ``sim_fn`` as its first argument and new values reuse the compilation."""
    rng = np.random.default_rng(3)
    images = rng.normal(size=(12, 6)).astype(np.float32)
    texts = rng.normal(size=(24, 6)).astype(np.float32)
    traces = []

    def scaled(params, i, t):
        traces.append(1)
        return (i * params["scale"]) @ t.T

    ev = evaluate
    expected = ev.retrieval_metrics(lambda i, t: i @ t.T, images, texts, captions_per_image=2)
    for scale in (1.0, 2.0, 3.0):  # a positive scale of the images leaves every rank unchanged
        got = ev.retrieval_metrics(
            scaled,
            images,
            texts,
            captions_per_image=2,
            image_chunk=5,
            text_chunk=7,
            params={"scale": jnp.float32(scale)},
        )
        assert got == pytest.approx(expected, abs=1e-9)
    assert len(traces) == 2  # one ground-truth kernel and one sweep kernel, whatever the scale
    flipped = ev.retrieval_metrics(
        scaled, images, texts, captions_per_image=2, params={"scale": jnp.float32(-1.0)}
    )
    assert flipped["rsum"] != pytest.approx(expected["rsum"])
