"""Tests for ncljax.labels.correction against float64 numpy loops and hand values."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.labels.correction import (
    ConfidentSet,
    blocks_capacity,
    confident_set,
    consistent_cost,
    jensen_shannon,
    jensen_shannon_pairwise,
    knn_cosine,
    knn_cosine_blocks,
    lloyd_centroids,
    modal_consistency,
    nearest_centroid,
    nearest_in_node,
    random_confident_set,
    relation_scores,
    tree_draw,
    tree_fans,
    update_targets,
)

# The oracle tests call jitted copies (one compile per setting; eager dispatch is slow);
# test_jit_equals_no_jit covers the eager path.
_jensen_shannon = jax.jit(jensen_shannon, static_argnames=("axis",))
_jensen_shannon_pairwise = jax.jit(jensen_shannon_pairwise)
_confident_set = jax.jit(confident_set, static_argnames=("per_class",))
_random_confident_set = jax.jit(
    random_confident_set, static_argnames=("num_samples", "num_classes", "per_class")
)
_knn_cosine = jax.jit(knn_cosine, static_argnames=("k", "chunk", "exclude_self", "key_chunk"))
_knn_cosine_blocks = jax.jit(
    knn_cosine_blocks,
    static_argnames=("k", "block", "probes", "exclude_self", "sample", "iterations", "fanout"),
)
_modal_consistency = jax.jit(modal_consistency)
_consistent_cost = jax.jit(consistent_cost, static_argnames=("shift", "normalise"))
_update_targets = jax.jit(update_targets)
_relation_scores = jax.jit(relation_scores)

ATOL = 1e-5  # float32 against float64 oracles
LOG2 = math.log(2.0)


def _rng(seed):
    return np.random.default_rng(seed)


def _simplex(rng, shape, zero_frac=0.0):
    x = rng.gamma(1.0, size=shape)
    if zero_frac:
        x = np.where(rng.random(shape) < zero_frac, 0.0, x)
        x[..., 0] += 1e-3  # no all-zero row
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------- numpy oracles


def np_jsd(p, q):
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    total = 0.0
    for pk, qk in zip(p, q, strict=True):
        mk = 0.5 * (pk + qk)
        if pk > 0:
            total += 0.5 * pk * math.log(pk / mk)
        if qk > 0:
            total += 0.5 * qk * math.log(qk / mk)
    return total


def np_unit(x):
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for i, row in enumerate(x):
        norm = math.sqrt(float(row @ row))
        if norm > 1e-12:
            out[i] = row / norm
    return out


def np_confident(p_image, p_text, per_class):
    n, num_classes = p_image.shape
    d = [np_jsd(p_image[i], p_text[i]) for i in range(n)]
    avg = (np.asarray(p_image, np.float64) + p_text) / 2
    predicted = [int(np.argmax(avg[i])) for i in range(n)]
    index, mask = [], []
    for k in range(num_classes):
        members = sorted((i for i in range(n) if predicted[i] == k), key=lambda i: (d[i], i))
        for slot in range(per_class):
            mask.append(slot < len(members))
            index.append(members[slot] if slot < len(members) else -1)
    return np.array(index), np.array(mask)


def np_knn(z, k, exclude_self):
    unit = np_unit(z)
    n = len(unit)
    index, sim = np.zeros((n, k), int), np.zeros((n, k))
    for i in range(n):
        cands = [(-(unit[i] @ unit[j]), j) for j in range(n) if not (exclude_self and j == i)]
        cands.sort()
        index[i] = [j for _, j in cands[:k]]
        sim[i] = [-s for s, _ in cands[:k]]
    return index, sim


def np_modal_consistency(z_image, z_text, index, mask, den_floor, ratio_max):
    image, text = np_unit(z_image), np_unit(z_text)

    def ratio(same, other, i):
        best, best_sim = None, -np.inf
        for slot, (g, valid) in enumerate(zip(index, mask, strict=True)):
            s = same[i] @ same[g]
            if valid and s > best_sim:
                best, best_sim = slot, s
        g = index[best]
        num, den = same[i] @ same[g], other[i] @ other[g]
        return min(max(num / max(den, den_floor), 0.0), ratio_max)

    n = len(image)
    return (
        np.array([ratio(image, text, i) for i in range(n)]),
        np.array([ratio(text, image, i) for i in range(n)]),
    )


def np_consistent_cost(c_v, c_t, knn_v, knn_t, y_v, y_t, vote_floor, shift, normalise=False):
    n, num_classes = y_v.shape
    cost = np.zeros((n, num_classes))
    for i in range(n):
        votes = []
        for c in range(num_classes):
            b = 0.0
            for weight, (index, sim), y in ((c_v[i], knn_v, y_v), (c_t[i], knn_t, y_t)):
                k = index.shape[1]
                b += weight * sum(float(sim[i, j]) * float(y[index[i, j], c]) for j in range(k)) / k
            votes.append(max(b, vote_floor))
        if normalise and max(votes) > vote_floor:  # a row without a vote keeps the floor
            votes = [max(v / sum(votes), vote_floor) for v in votes]
        cost[i] = [-math.log(v) for v in votes]
    return cost - cost.min() if shift else cost


def np_update_targets(targets, z_image, z_text, prototypes, momentum):
    """Eq. 9 from the embeddings and unit prototypes, as the paper writes it."""
    mu = np_unit(prototypes)
    out = np.array(targets, np.float64)
    for i in range(len(out)):
        k = int(np.argmax(mu @ (np.float64(z_image[i]) + z_text[i])))
        out[i] = momentum * out[i] + (1 - momentum) * np.eye(len(mu))[k]
    return out


def _scores(z_image, z_text, prototypes, temperature=0.5):
    """The summed prototype logits ``mu . z_v / tau + mu . z_t / tau`` (what the method has)."""
    mu = np_unit(prototypes)
    return ((z_image @ mu.T + z_text @ mu.T) / temperature).astype(np.float32)


def np_relation_scores(z, anchors, mask, temperature, sign):
    zu, au = np_unit(z), np_unit(anchors)
    out = np.zeros((len(zu), len(au)))
    for i in range(len(zu)):
        logits = [sign * (zu[i] @ au[j]) / temperature for j in range(len(au))]
        valid = [logits[j] for j in range(len(au)) if mask[j]]
        if not valid:
            continue
        top = max(valid)
        total = sum(math.exp(v - top) for v in valid)
        for j in range(len(au)):
            out[i, j] = math.exp(logits[j] - top) / total if mask[j] else 0.0
    return out


# ---------------------------------------------------------------- Jensen-Shannon


def test_jsd_hand_values():
    p = jnp.array([[0.3, 0.7], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    q = jnp.array([[0.3, 0.7], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    # [0.5, 0.5] vs [1, 0]: m = [3/4, 1/4]; KL(p|m) = 0.5 log(4/3), KL(q|m) = log(4/3).
    expected = [0.0, LOG2, 0.75 * math.log(4.0 / 3.0), 0.0]
    np.testing.assert_allclose(_jensen_shannon(p, q), expected, atol=1e-6)
    np.testing.assert_allclose(_jensen_shannon(q, p), expected, atol=1e-6)


def test_jsd_matches_numpy_with_zeros_and_axis():
    rng = _rng(0)
    p, q = _simplex(rng, (12, 7), 0.4), _simplex(rng, (12, 7), 0.4)
    expected = [np_jsd(p[i], q[i]) for i in range(12)]
    got = _jensen_shannon(p, q)
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert np.all((np.asarray(got) >= 0) & (np.asarray(got) <= LOG2))
    np.testing.assert_allclose(_jensen_shannon(p.T, q.T, axis=0), expected, atol=ATOL)


def test_jsd_accurate_for_nearly_equal_distributions():
    # UOT-RCL's posteriors are flat (tau_1 = 1, unit vectors), so d_i ~ 1e-4 and the
    # confident-set ranking needs a relative accuracy that log(p / m) loses in float32.
    rng = _rng(21)
    logits = rng.uniform(-1, 1, size=(64, 200))
    soft = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    p = soft(logits).astype(np.float32)
    q = soft(logits + 0.05 * rng.normal(size=logits.shape)).astype(np.float32)
    expected = np.array([np_jsd(p[i], q[i]) for i in range(64)])
    np.testing.assert_allclose(_jensen_shannon(p, q), expected, rtol=2e-6, atol=0)


def test_jsd_gradient_finite_at_zeros():
    rng = _rng(1)
    p, q = _simplex(rng, (6, 5), 0.5), _simplex(rng, (6, 5), 0.5)
    grads = jax.grad(lambda a, b: jnp.sum(_jensen_shannon(a, b)), argnums=(0, 1))(p, q)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_jsd_pairwise_matches_numpy():
    rng = _rng(2)
    p, q = _simplex(rng, (4, 9), 0.3), _simplex(rng, (5, 9), 0.3)
    expected = np.array([[np_jsd(p[i], q[j]) for j in range(5)] for i in range(4)])
    np.testing.assert_allclose(_jensen_shannon_pairwise(p, q), expected, atol=ATOL)


def test_jsd_pairwise_of_relation_scores_to_1e_8_with_zero_columns():
    """Softmaxes of cosines over 50 anchors (UOT-RCL's relation scores at ``tau_2 = 1``:
    divergences of 1e-3 to 1e-2) with two masked anchors (columns of zeros), against the
    float64 per-pair oracle; its gradient is finite at the zeros."""
    rng = _rng(40)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    z, anchors = unit(rng.normal(size=(96, 16))), unit(rng.normal(size=(50, 16)))
    logits = z @ anchors.T
    p = np.exp(logits) * (np.arange(50) < 48)
    p = p / p.sum(1, keepdims=True)
    q = np.exp(unit(z + 0.5 * rng.normal(size=z.shape)) @ anchors.T) * (np.arange(50) < 48)
    q = q / q.sum(1, keepdims=True)
    expected = np.array([[np_jsd(p[i], q[j]) for j in range(96)] for i in range(96)])
    got = _jensen_shannon_pairwise(np.float32(p), np.float32(q))
    assert expected.max() > 1e-3
    np.testing.assert_allclose(got, expected, atol=1e-8 + 1e-6 * expected.max())
    grad = jax.grad(lambda p: jnp.sum(jensen_shannon_pairwise(p, np.float32(q))))(np.float32(p))
    assert np.all(np.isfinite(grad))
    # d/dp_ik sum_j JSD(p_i, q_j) = sum_j log(p_ik / m_ijk) / 2, from the per-pair form
    want = jax.grad(
        lambda p: jnp.sum(jensen_shannon(p[:, None, :], np.float64(q)[None, :, :], axis=-1))
    )(np.float64(p))
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- confident set


def _posteriors_for_classes(rng, classes, num_classes, noise=0.5):
    onehot = np.eye(num_classes)[classes]
    logits_v = 3.0 * onehot + noise * rng.normal(size=onehot.shape)
    logits_t = 3.0 * onehot + noise * rng.normal(size=onehot.shape)
    soft = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    return soft(logits_v).astype(np.float32), soft(logits_t).astype(np.float32)


def _check_against_oracle(result, p_image, p_text, per_class):
    index, mask = np_confident(p_image, p_text, per_class)
    np.testing.assert_array_equal(result.mask, mask)
    np.testing.assert_array_equal(np.asarray(result.index)[mask], index[mask])
    assert np.all((np.asarray(result.index) >= 0) & (np.asarray(result.index) < len(p_image)))
    assert result.index.dtype == jnp.int32


def test_confident_set_ties_short_and_empty_classes():
    rng = _rng(3)
    # 4 classes, per_class 3: class 0 has 15 members, 1 has 10, 2 has one, 3 none.
    classes = np.array([0] * 15 + [1] * 10 + [2])
    rng.shuffle(classes)
    p_image, p_text = _posteriors_for_classes(rng, classes, 4)
    class0 = np.flatnonzero(classes == 0)
    # Four class-0 pairs with identical posteriors (d = 0): the lowest three indices win.
    zero_d = np.sort(rng.choice(class0, 4, replace=False))
    p_text[zero_d] = p_image[zero_d]
    # Two class-1 duplicates with the smallest non-zero d: both kept, lower index first.
    class1 = np.flatnonzero(classes == 1)
    a, b = np.sort(rng.choice(class1, 2, replace=False))
    p_image[b], p_text[b] = p_image[a], p_text[a]
    p_text[a] = p_text[b] = 0.999 * p_image[a] + 0.001 * p_text[a]

    result = _confident_set(p_image, p_text, per_class=3)
    _check_against_oracle(result, p_image, p_text, 3)
    index, mask = np.asarray(result.index), np.asarray(result.mask)
    np.testing.assert_array_equal(index[:3], zero_d[:3])
    np.testing.assert_array_equal(index[3:5], [a, b])
    np.testing.assert_array_equal(mask, [True] * 7 + [False] * 5)
    assert index[6] == np.flatnonzero(classes == 2)[0]


@pytest.mark.parametrize("seed", [4, 5])
def test_confident_set_random_matches_numpy(seed):
    rng = _rng(seed)
    p_image, p_text = _simplex(rng, (60, 5)), _simplex(rng, (60, 5))
    _check_against_oracle(_confident_set(p_image, p_text, per_class=4), p_image, p_text, 4)


def test_random_confident_set():
    key = jax.random.key(0)
    full = _random_confident_set(key, 100, num_classes=4, per_class=5)
    index = np.asarray(full.index)
    assert np.all(full.mask) and len(set(index.tolist())) == 20
    assert index.min() >= 0 and index.max() < 100
    again = _random_confident_set(key, 100, num_classes=4, per_class=5)
    np.testing.assert_array_equal(again.index, index)
    short = _random_confident_set(key, 7, num_classes=2, per_class=5)
    np.testing.assert_array_equal(short.mask, [True] * 7 + [False] * 3)
    assert sorted(np.asarray(short.index)[:7].tolist()) == list(range(7))


# ---------------------------------------------------------------- kNN


@pytest.mark.parametrize("exclude_self", [True, False])
@pytest.mark.parametrize(("chunk", "key_chunk"), [(8, None), (2048, None), (8, 6), (5, 37), (8, 1)])
def test_knn_matches_numpy_with_zero_rows(exclude_self, chunk, key_chunk):
    """The query-chunked search, and with ``key_chunk`` the key-chunked one (a running
    top-k merged block by block: padded candidate blocks, one-row blocks), against a
    numpy sort over the whole set; the zero rows' ties go to the lowest indices in both."""
    rng = _rng(6)
    z = rng.normal(size=(37, 6)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(37, 1))
    z[[4, 20]] = 0.0
    z = z.astype(np.float32)
    index, sim = _knn_cosine(z, k=5, chunk=chunk, exclude_self=exclude_self, key_chunk=key_chunk)
    ref_index, ref_sim = np_knn(z, 5, exclude_self)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(sim, ref_sim, atol=ATOL)
    assert index.dtype == jnp.int32
    # A zero row is equally (0) similar to everything: the lowest indices win.
    expected_zero = [0, 1, 2, 3, 5] if exclude_self else [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(index[4], expected_zero)
    if exclude_self:
        assert not np.any(np.asarray(index) == np.arange(37)[:, None])
    else:
        nonzero = np.setdiff1d(np.arange(37), [4, 20])
        np.testing.assert_array_equal(np.asarray(index)[nonzero, 0], nonzero)


def test_knn_rejects_bad_k():
    z = jnp.ones((5, 3))
    with pytest.raises(ValueError):
        _knn_cosine(z, k=5, exclude_self=True)
    _knn_cosine(z, k=5, exclude_self=False)


@pytest.mark.parametrize(("chunk", "key_chunk"), [(0, None), (2.5, None), (4, 0), (4, True)])
def test_knn_refuses_chunks_that_are_not_positive_integers(chunk, key_chunk):
    with pytest.raises(ValueError, match=r"chunk must be a positive integer, got"):
        knn_cosine(jnp.ones((5, 3)), k=2, chunk=chunk, key_chunk=key_chunk)


@pytest.mark.parametrize("exclude_self", [True, False])
@pytest.mark.parametrize("block, fanout", [(5, 64), (8, 64), (37, 64), (3, 2)])
def test_knn_blocks_searching_every_block_is_exact(exclude_self, block, fanout):
    """With ``probes`` the number of blocks (a partial last block with ``block=5, 8``,
    one block with 37; ordered by one k-means, or by a k-means tree with ``fanout`` 2) every
    row searches every other: the numpy oracle's neighbours and similarities (no
    ties in these rows)."""
    z = _rng(7).normal(size=(37, 6)).astype(np.float32)
    blocks = -(-37 // block)
    index, sim = _knn_cosine_blocks(
        z,
        k=5,
        key=jax.random.key(0),
        block=block,
        probes=blocks,
        exclude_self=exclude_self,
        fanout=fanout,
    )
    ref_index, ref_sim = np_knn(z, 5, exclude_self)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_allclose(sim, ref_sim, atol=ATOL)
    assert index.dtype == jnp.int32


def _clusters(n, dim, classes, spread, seed):
    rng = _rng(seed)
    centres = rng.normal(size=(classes, dim))
    return (centres[rng.integers(0, classes, n)] + spread * rng.normal(size=(n, dim))).astype(
        np.float32
    )


@pytest.mark.parametrize("fanout", [64, 3])
def test_knn_blocks_finds_most_neighbours_among_nearby_blocks(fanout):
    """Searching 4 of 24 blocks: each returned neighbour is another row at its true
    cosine, in descending order, and most of the exact neighbours are found (clustered
    rows, as a trained model's embeddings are; measured 0.93 with one k-means of 24
    centroids, 0.92 with a tree of three levels of 3)."""
    z = _clusters(3000, 64, 50, 0.5, seed=8)
    index, sim = _knn_cosine_blocks(
        z, k=10, key=jax.random.key(1), block=128, probes=4, fanout=fanout
    )
    index, sim = np.asarray(index), np.asarray(sim)
    exact, _ = _knn_cosine(z, k=10, chunk=512, exclude_self=True, key_chunk=None)
    recall = (
        np.mean([len(set(a) & set(b)) for a, b in zip(index, np.asarray(exact), strict=True)]) / 10
    )
    assert 0.9 < recall < 1.0  # approximate, and close
    unit = np_unit(z.astype(np.float64))
    rows = np.arange(3000)[:, None]
    np.testing.assert_allclose(sim, np.sum(unit[rows] * unit[index], -1), atol=ATOL)
    assert not np.any(index == rows)
    assert np.all(np.diff(sim, axis=1) <= 0)
    assert all(len(set(r)) == 10 for r in index)


def test_knn_blocks_rejects_more_neighbours_than_a_block_searches():
    z = _rng(9).normal(size=(37, 6)).astype(np.float32)
    # block 8, 2 probes: the fewest rows searched are 8 + 5 (the last block), 12 without self
    assert blocks_capacity(37, 8, 2) == 12 and blocks_capacity(37, 8, 2, exclude_self=False) == 13
    _knn_cosine_blocks(z, k=12, key=jax.random.key(0), block=8, probes=2)
    with pytest.raises(ValueError, match=r"k=13 neighbours must be in \[1, 12\].*raise block or"):
        _knn_cosine_blocks(z, k=13, key=jax.random.key(0), block=8, probes=2)
    with pytest.raises(
        ValueError, match=r"k=37 neighbours must be in \[1, 36\]: N=37 .* per row\."
    ):
        _knn_cosine_blocks(z, k=37, key=jax.random.key(0), block=8, probes=5)
    # one probe past a multiple of the block: the last block holds one row
    with pytest.raises(ValueError, match=r"k=1 neighbours must be in \[1, 0\].*raise block or"):
        _knn_cosine_blocks(z[:17], k=1, key=jax.random.key(0), block=8, probes=1)


def test_blocks_capacity_is_the_fewest_rows_a_block_searches():
    """Against the blocks counted by hand: ``ceil(N / block)`` blocks of ``block`` sorted
    rows, the last one short, and the ``probes`` smallest of them; never below
    ``(probes - 1) * block`` where it is below ``N - 1``."""
    for n in range(1, 90):
        for block in (1, 2, 3, 7, 8, 16, 100):
            for probes in (1, 2, 3, 5):
                sizes = np.diff(np.minimum(np.arange(0, n + block, block), n))
                sizes = sizes[sizes > 0]
                fewest = n if probes >= sizes.size else int(np.sort(sizes)[:probes].sum())
                got = blocks_capacity(n, block, probes)
                assert got == fewest - 1, (n, block, probes)
                assert blocks_capacity(n, block, probes, exclude_self=False) == fewest
                if got < n - 1:
                    assert got >= (probes - 1) * block, (n, block, probes)


@pytest.mark.parametrize("rows", [7, 64, 4096])
def test_nearest_centroid_is_the_numpy_argmin_in_any_chunks(rows):
    x = _rng(14).normal(size=(50, 5))
    centroids = _rng(15).normal(size=(9, 5))
    want = np.argmin(((x[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    got = nearest_centroid(x.astype(np.float32), centroids.astype(np.float32), rows=rows)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32


@pytest.mark.parametrize("iterations", [1, 3, 10])
def test_lloyd_centroids_are_scikit_learns_lloyd_steps(iterations):
    """scikit-learn's ``KMeans(algorithm='lloyd')`` from the same first centroids, run for
    exactly ``iterations`` steps (``tol=0``; well-separated clusters, so no centroid is left
    without points, which scikit-learn would move elsewhere)."""
    from sklearn.cluster import KMeans

    points = _clusters(600, 6, 8, 0.6, seed=16).astype(np.float64)
    start = points[_rng(17).choice(600, 8, replace=False)]
    want = KMeans(8, init=start, n_init=1, max_iter=iterations, tol=0, algorithm="lloyd")
    want = want.fit(points).cluster_centers_
    got = lloyd_centroids(np.float32(points), np.float32(start), iterations=iterations)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_lloyd_centroids_keep_a_centroid_without_points_in_place():
    points = np.array([[0.0, 0.0], [0.2, 0.0], [5.0, 5.0]], np.float32)
    start = np.array([[0.1, 0.0], [5.0, 4.0], [100.0, 100.0]], np.float32)
    got = lloyd_centroids(points, start, iterations=2)
    np.testing.assert_allclose(got, [[0.1, 0.0], [5.0, 5.0], [100.0, 100.0]], atol=1e-6)


@pytest.mark.parametrize("exclude_self", [True, False])
def test_knn_blocks_break_ties_by_the_lower_row_as_the_exact_search(exclude_self):
    """Duplicated rows (equal similarities): searching every block gives the exact
    search's neighbours, each tie to the lower row, whatever order the k-means put them in."""
    rng = _rng(12)
    distinct = rng.normal(size=(6, 5)).astype(np.float32)
    z = distinct[rng.integers(0, 6, 40)]
    exact, exact_sim = _knn_cosine(z, k=7, chunk=16, exclude_self=exclude_self, key_chunk=None)
    for seed in range(3):
        index, sim = _knn_cosine_blocks(
            z, k=7, key=jax.random.key(seed), block=8, probes=5, exclude_self=exclude_self
        )
        np.testing.assert_array_equal(index, exact)
        np.testing.assert_allclose(sim, exact_sim, atol=ATOL)


def test_tree_fans_are_the_fewest_levels_of_the_fewest_centroids():
    """By hand: 9,766 blocks (10^7 rows in blocks of 1,024) with ``fanout`` 64 are 64
    centroids, then 13 and 13 in each node (64^2 < 9,766 <= 64^3; each first-level node
    needs ceil(9,766 / 64) = 153 leaves, 12^2 < 153 <= 13^2); and the rule over a grid."""
    assert tree_fans(9766, 64) == (64, 13, 13)
    assert tree_fans(977, 64) == (64, 16)
    assert tree_fans(98, 64) == (64, 2)
    assert tree_fans(64, 64) is None
    for clusters in range(2, 5000, 7):
        for fanout in (2, 3, 5, 64):
            got = tree_fans(clusters, fanout)
            if clusters <= fanout:
                assert got is None
                continue
            levels = next(lv for lv in range(1, 64) if fanout**lv >= clusters)
            rest = -(-clusters // fanout)
            fan = next(f for f in range(2, rest + 2) if f ** (levels - 1) >= rest)
            assert got == (fanout,) + (fan,) * (levels - 1), (clusters, fanout)
            assert math.prod(got) >= clusters


def test_tree_draw_draws_each_nodes_own_rows():
    """Nodes of 5, 0, 7 and 1 rows (their slots 0-4, none, 5-11, 12): each node's draws
    fall among its own slots, all of them drawn where there are many draws; the empty
    node draws the slot where its rows would start; each level draws anew."""
    counts = np.array([5, 0, 7, 1])
    slots = np.asarray(tree_draw(jax.random.key(2), 1, counts, 4, 50))
    assert slots.shape == (4, 200) and slots.dtype == np.int32
    assert set(slots[0]) == set(range(5)) and set(slots[2]) == set(range(5, 12))
    assert set(slots[1]) == {5} and set(slots[3]) == {12}
    again = np.asarray(tree_draw(jax.random.key(2), 2, counts, 4, 50))
    assert not np.array_equal(again, slots)
    last = np.asarray(tree_draw(jax.random.key(2), 1, np.array([3, 0]), 2, 4))
    assert set(last[1]) == {2}  # an empty last node: clipped to the last row


@pytest.mark.parametrize("rows, window", [(7, 4), (16, 2), (64, 1), (1024, 4)])
def test_nearest_in_node_is_the_numpy_argmin_among_the_rows_own_centroids(rows, window):
    """Rows sorted by node, nodes of 0 to 30 rows: chunks that meet at most ``window``
    nodes take the product path, the others the gathered one; both against numpy."""
    x = _rng(18).normal(size=(200, 5))
    centroids = _rng(19).normal(size=(12, 3, 5))
    node = np.sort(_rng(20).choice(12, 200, p=np.arange(12) / 66))  # node 0 empty
    want = np.argmin(((x[:, None, :] - centroids[node]) ** 2).sum(-1), axis=1)
    got = nearest_in_node(np.float32(x), node, np.float32(centroids), rows=rows, window=window)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32 and got.shape == (200,)
    # the same rows read through an index from an array in another order
    shuffle = _rng(21).permutation(200)
    stored = np.empty_like(x)
    stored[shuffle] = x
    got = nearest_in_node(
        np.float32(stored), node, np.float32(centroids), index=shuffle, rows=rows, window=window
    )
    np.testing.assert_array_equal(got, want)


def _np_lloyd(points, centroids, iterations):
    for _ in range(iterations):
        cluster = np.argmin(((points[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
        for c in range(centroids.shape[0]):
            if np.any(cluster == c):
                centroids[c] = points[cluster == c].mean(0)
    return centroids


@pytest.mark.parametrize("n, clusters, fanout", [(2000, 40, 4), (1999, 30, 8)])
def test_block_order_of_the_tree_is_each_nodes_kmeans_level_by_level(n, clusters, fanout):
    """The k-means tree's order against a float64 numpy loop over levels and nodes, from
    the same draws (:func:`tree_draw`): each node's Lloyd steps from its first drawn rows,
    each of its rows to its nearest centroid, the leaf a row reaches, the rows sorted
    stably by leaf."""
    from ncljax.labels.correction import _block_order

    z = _clusters(n, 8, 12, 0.8, seed=21)
    key = jax.random.key(4)
    fans = tree_fans(clusters, fanout)
    unit = np_unit(z.astype(np.float64))
    leaf = np.zeros(n, np.int64)
    for level, fan in enumerate(fans):
        members = np.argsort(leaf, kind="stable")
        counts = np.bincount(leaf, minlength=math.prod(fans[:level]))
        slots = np.asarray(tree_draw(key, level, counts, fan, 32))
        cluster = np.zeros(n, np.int64)
        for node in np.flatnonzero(counts):
            points = unit[members[slots[node]]]
            centroids = _np_lloyd(points, points[:fan].copy(), 10)
            rows = np.flatnonzero(leaf == node)
            dist = ((unit[rows][:, None] - centroids[None]) ** 2).sum(-1)
            cluster[rows] = np.argmin(dist, axis=1)
        leaf = leaf * fan + cluster
    want = np.argsort(leaf, kind="stable")
    got = jax.jit(_block_order, static_argnums=(1, 3, 4, 5))(
        jnp.asarray(np.float32(unit)), clusters, key, 32, 10, fanout
    )
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("value", [1, 0, 2.0, True])
def test_knn_blocks_refuses_a_fanout_below_two(value):
    z = _rng(13).normal(size=(20, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^fanout must be an integer of at least 2, got"):
        knn_cosine_blocks(z, k=3, key=jax.random.key(0), block=8, probes=2, fanout=value)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("block", 0), ("probes", -1), ("sample", 2.5), ("iterations", 0), ("block", True)],
)
def test_knn_blocks_refuses_a_setting_that_is_not_a_positive_integer(argument, value):
    z = _rng(13).normal(size=(20, 4)).astype(np.float32)
    kwargs = dict(k=3, key=jax.random.key(0), block=8, probes=2) | {argument: value}
    with pytest.raises(ValueError, match=rf"^{argument} must be a positive integer, got"):
        knn_cosine_blocks(z, **kwargs)
    with pytest.raises(ValueError, match=r"z must be \[N, D\] embeddings, got shape \(20,\)"):
        knn_cosine_blocks(z[:, 0], k=3, key=jax.random.key(0))


# ---------------------------------------------------------------- modal consistency


def _unit2(x):
    return [x, math.sqrt(1.0 - x * x)]


def test_modal_consistency_hand_floor_clip_and_mask():
    # Sample 0 is the only valid confident pair; slot 1 (sample 1) is masked out.
    z_image = np.array(
        [[1, 0], [0, 1], _unit2(0.9), _unit2(0.99), _unit2(-0.5), [0, 3]], np.float32
    )
    z_text = np.array([[1, 0], [0, 1], _unit2(0.2), _unit2(0.05), _unit2(0.5), [0, 3]], np.float32)
    confident = ConfidentSet(index=jnp.array([0, 1], jnp.int32), mask=jnp.array([True, False]))

    c_image, c_text = _modal_consistency(z_image, z_text, confident)
    # Row 0: self-match, 1. Rows 1 and 5 are orthogonal to the only valid anchor: 0/floor = 0
    # (the masked slot would give 1). Row 2: 0.9/0.2. Row 3: 0.99/0.05 = 19.8 -> ratio_max.
    # Row 4: -0.5/0.5 clipped to 0.
    np.testing.assert_allclose(c_image, [1, 0, 4.5, 10, 0, 0], atol=ATOL)
    # Row 4: den -0.5 < floor, 0.5/1e-6 -> ratio_max.
    np.testing.assert_allclose(c_text, [1, 0, 0.2 / 0.9, 0.05 / 0.99, 10, 0], atol=ATOL)

    c_image, c_text = _modal_consistency(z_image, z_text, confident, den_floor=0.5, ratio_max=3.0)
    np.testing.assert_allclose(c_image, [1, 0, 0.9 / 0.5, 0.99 / 0.5, 0, 0], atol=ATOL)
    np.testing.assert_allclose(c_text, [1, 0, 0.2 / 0.9, 0.05 / 0.99, 1, 0], atol=ATOL)
    ref = np_modal_consistency(z_image, z_text, [0, 1], [True, False], 0.5, 3.0)
    np.testing.assert_allclose(c_image, ref[0], atol=ATOL)
    np.testing.assert_allclose(c_text, ref[1], atol=ATOL)


def test_modal_consistency_matches_numpy():
    rng = _rng(7)
    z_image = rng.normal(size=(30, 5)).astype(np.float32)
    z_text = (z_image + 0.7 * rng.normal(size=(30, 5))).astype(np.float32)
    index = rng.choice(30, 8, replace=False)
    mask = np.array([True, True, False, True, True, False, True, True])
    c_image, c_text = _modal_consistency(
        z_image, z_text, ConfidentSet(jnp.asarray(index, jnp.int32), jnp.asarray(mask))
    )
    ref_image, ref_text = np_modal_consistency(z_image, z_text, index, mask, 1e-6, 10.0)
    np.testing.assert_allclose(c_image, ref_image, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(c_text, ref_text, atol=1e-4, rtol=1e-5)
    for kept in index[mask]:
        assert c_image[kept] == pytest.approx(1.0, abs=ATOL)
        assert c_text[kept] == pytest.approx(1.0, abs=ATOL)


@pytest.mark.parametrize("chunk", [1, 7, 8, 29, 30, 64])
def test_modal_consistency_in_row_chunks_matches_numpy(chunk):
    # chunks that divide N, that leave a partial last block, of one row, and larger than N
    rng = _rng(9)
    z_image = rng.normal(size=(30, 5)).astype(np.float32)
    z_text = (z_image + 0.7 * rng.normal(size=(30, 5))).astype(np.float32)
    index = rng.choice(30, 8, replace=False)
    mask = np.array([True, True, False, True, True, False, True, True])
    confident = ConfidentSet(jnp.asarray(index, jnp.int32), jnp.asarray(mask))
    fn = jax.jit(functools.partial(modal_consistency, chunk=chunk))
    c_image, c_text = fn(z_image, z_text, confident)
    ref_image, ref_text = np_modal_consistency(z_image, z_text, index, mask, 1e-6, 10.0)
    np.testing.assert_allclose(c_image, ref_image, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(c_text, ref_text, atol=1e-4, rtol=1e-5)
    whole = _modal_consistency(z_image, z_text, confident)  # the one block: to round-off
    np.testing.assert_allclose(c_image, whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c_text, whole[1], rtol=1e-5, atol=1e-6)


def test_modal_consistency_no_valid_slot_is_neutral():
    rng = _rng(8)
    z = rng.normal(size=(6, 3)).astype(np.float32)
    confident = ConfidentSet(jnp.zeros(2, jnp.int32), jnp.zeros(2, bool))
    c_image, c_text = _modal_consistency(z, -z, confident)
    np.testing.assert_array_equal(c_image, np.ones(6))
    np.testing.assert_array_equal(c_text, np.ones(6))


# ---------------------------------------------------------------- consistent cost


def _cost_inputs(seed, n=23, num_classes=4, k_image=3, k_text=5):
    rng = _rng(seed)
    knn = lambda k: (
        rng.integers(0, n, size=(n, k)).astype(np.int32),
        rng.uniform(-0.3, 1.0, size=(n, k)).astype(np.float32),
    )
    y_v, y_t = _simplex(rng, (n, num_classes), 0.3), _simplex(rng, (n, num_classes), 0.3)
    y_v[:, 2] = y_t[:, 2] = 0.0  # class 2 never voted: b = 0 underflows to the floor
    c_v, c_t = (rng.uniform(0, 3, size=n).astype(np.float32) for _ in range(2))
    return c_v, c_t, knn(k_image), knn(k_text), y_v, y_t


@pytest.mark.parametrize("shift", [True, False])
def test_consistent_cost_matches_numpy(shift):
    args = _cost_inputs(9)
    got = np.asarray(_consistent_cost(*args, shift=shift))
    ref = np_consistent_cost(*args, vote_floor=1e-8, shift=shift)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-5)
    floor_cost = -math.log(1e-8)
    if shift:
        assert got.min() == 0.0
        unshifted = np.asarray(_consistent_cost(*args, shift=False))
        np.testing.assert_allclose(got, unshifted - unshifted.min(), atol=1e-5)
    else:
        np.testing.assert_allclose(got[:, 2], floor_cost, rtol=1e-6)
        assert got.max() == pytest.approx(floor_cost, rel=1e-6)
        assert got.min() < 0  # b > 1 somewhere: the negative costs the shift removes


@pytest.mark.parametrize("shift", [True, False])
def test_normalised_consistent_cost_matches_numpy(shift):
    args = _cost_inputs(12)
    got = np.asarray(_consistent_cost(*args, shift=shift, normalise=True))
    ref = np_consistent_cost(*args, vote_floor=1e-8, shift=shift, normalise=True)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-5)
    if not shift:  # every row is -log of a distribution over classes
        np.testing.assert_allclose(np.exp(-got).sum(-1), 1.0, rtol=1e-5)


def test_normalised_cost_of_a_sample_without_votes_is_the_maximum():
    """A sample whose neighbours all vote 0 (or negatively) has no class to be concentrated
    on: its row costs -log(floor) everywhere, the most expensive, not the uniform log K."""
    knn = (jnp.array([[1], [0], [0]]), jnp.array([[0.5], [0.5], [-0.4]]))
    y = jnp.array([[0.0, 0.0, 0.0], [0.2, 0.5, 0.3], [0.9, 0.1, 0.0]])
    ones = jnp.ones(3)
    cost = np.asarray(_consistent_cost(ones, ones, knn, knn, y, y, shift=False, normalise=True))
    floor_cost = -math.log(1e-8)
    # Row 0 votes with sample 1's targets; row 1 with sample 0's (all zero); row 2 with
    # sample 0's at a negative similarity.
    np.testing.assert_allclose(cost[0], -np.log([0.2, 0.5, 0.3]), atol=1e-5)
    np.testing.assert_allclose(cost[1], floor_cost, rtol=1e-6)
    np.testing.assert_allclose(cost[2], floor_cost, rtol=1e-6)
    assert cost[1].min() > cost[0].max()
    args = [np.asarray(a) for a in (ones, ones)] + [
        tuple(np.asarray(x) for x in knn),
        tuple(np.asarray(x) for x in knn),
        np.asarray(y),
        np.asarray(y),
    ]
    ref = np_consistent_cost(*args, vote_floor=1e-8, shift=True, normalise=True)
    got = np.asarray(_consistent_cost(ones, ones, knn, knn, y, y, shift=True, normalise=True))
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_normalised_cost_ignores_the_vote_scale():
    """Scaling a sample's consistency ratios moves its raw cost row, not the normalised one."""
    knn = (jnp.array([[1], [0]]), jnp.array([[0.5], [0.5]]))
    y = jnp.array([[0.6, 0.4], [0.3, 0.7]])
    ones = jnp.ones(2)
    scaled = jnp.array([1.0, 8.0])
    raw_one = _consistent_cost(ones, ones, knn, knn, y, y, shift=False)
    raw_scaled = _consistent_cost(scaled, scaled, knn, knn, y, y, shift=False)
    np.testing.assert_allclose(raw_one[1] - raw_scaled[1], math.log(8.0), atol=1e-5)
    norm_one = _consistent_cost(ones, ones, knn, knn, y, y, shift=False, normalise=True)
    norm_scaled = _consistent_cost(scaled, scaled, knn, knn, y, y, shift=False, normalise=True)
    np.testing.assert_allclose(norm_one, norm_scaled, atol=1e-6)
    # b_0 = y_1 = [0.3, 0.7] already sums to one: -log of it.
    np.testing.assert_allclose(norm_one[0], -np.log([0.3, 0.7]), atol=1e-6)


def test_consistent_cost_hand_value():
    knn = (jnp.array([[1], [0]]), jnp.array([[0.5], [0.5]]))
    y = jnp.eye(2)
    ones = jnp.ones(2)
    # b_0 = 0.5 y_1 + 0.5 y_1 = [0, 1], b_1 = [1, 0].
    cost = _consistent_cost(ones, ones, knn, knn, y, y, vote_floor=1e-8)
    np.testing.assert_allclose(cost, [[-math.log(1e-8), 0], [0, -math.log(1e-8)]], atol=1e-5)
    # c_t = 3: b_0 = 0.5 y_1 + 1.5 y_1 = [0, 2], b_1 = [2, 0]; b > 1 gives a negative cost.
    cost = _consistent_cost(ones, 3 * ones, knn, knn, y, y, vote_floor=1e-3, shift=False)
    high, low = -math.log(1e-3), -math.log(2.0)
    np.testing.assert_allclose(cost, [[high, low], [low, high]], atol=1e-5)


def test_consistent_cost_has_zero_gradient():
    c_v, c_t, (i_v, s_v), (i_t, s_t), y_v, y_t = _cost_inputs(10)

    def total(c_v, c_t, s_v, s_t, y_v, y_t):
        return jnp.sum(_consistent_cost(c_v, c_t, (i_v, s_v), (i_t, s_t), y_v, y_t) ** 2)

    grads = jax.grad(total, argnums=tuple(range(6)))(c_v, c_t, s_v, s_t, y_v, y_t)
    for g in grads:
        np.testing.assert_array_equal(g, np.zeros_like(g))


# ---------------------------------------------------------------- target update


def _target_inputs(seed, n=15, num_classes=4, dim=6):
    rng = _rng(seed)
    targets = np.eye(num_classes, dtype=np.float32)[rng.integers(0, num_classes, n)]
    z_image, z_text = (np_unit(rng.normal(size=(n, dim))).astype(np.float32) for _ in range(2))
    prototypes = (3.0 * rng.normal(size=(num_classes, dim))).astype(np.float32)
    return targets, z_image, z_text, prototypes


@pytest.mark.parametrize("momentum", [0.0, 0.7, 0.99, 1.0])
def test_update_targets_matches_numpy(momentum):
    args = _target_inputs(11)
    got = _update_targets(args[0], _scores(*args[1:]), momentum=momentum)
    ref = np_update_targets(*args, momentum)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, atol=1e-6)
    if momentum == 1.0:
        np.testing.assert_array_equal(got, args[0])
    if momentum == 0.0:
        assert set(np.unique(np.asarray(got)).tolist()) == {0.0, 1.0}


def test_update_targets_breaks_ties_to_the_lower_class():
    got = _update_targets(
        np.array([[0.0, 0.0, 1.0]], np.float32), np.array([[2.0, 2.0, 1.0]]), momentum=0.0
    )
    np.testing.assert_array_equal(got, [[1.0, 0.0, 0.0]])


# ---------------------------------------------------------------- relation scores


def _relation_inputs(seed, b=7, g=9, dim=5):
    rng = _rng(seed)
    z = rng.normal(size=(b, dim)).astype(np.float32)
    z[3] = 0.0
    anchors = rng.normal(size=(g, dim)).astype(np.float32)
    mask = np.array([True, False, True, True, False, True, True, True, False])
    return z, anchors, mask


@pytest.mark.parametrize(("temperature", "sign"), [(1.0, 1.0), (0.5, -1.0), (0.05, 1.0)])
def test_relation_scores_matches_numpy(temperature, sign):
    z, anchors, mask = _relation_inputs(12)
    got = np.asarray(_relation_scores(z, anchors, mask, temperature=temperature, sign=sign))
    ref = np_relation_scores(z, anchors, mask, temperature, sign)
    np.testing.assert_allclose(got, ref, atol=ATOL)
    assert np.all(got[:, ~mask] == 0.0)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-6)
    # Zero row: cos 0 to every anchor, uniform over the 6 valid ones.
    np.testing.assert_allclose(got[3, mask], 1.0 / 6.0, atol=1e-6)


def test_relation_scores_sign_switch():
    z, anchors, mask = _relation_inputs(13)
    literal = _relation_scores(z, anchors, mask, sign=-1.0)
    np.testing.assert_allclose(literal, _relation_scores(z, -anchors, mask), atol=1e-6)
    default = np.asarray(_relation_scores(z, anchors, mask))
    cos = np_unit(z) @ np_unit(anchors).T
    nonzero = [0, 1, 2, 4, 5, 6]
    best = np.argmax(np.where(mask, cos, -np.inf), axis=1)[nonzero]
    # The default puts the most mass on the most similar anchor, the literal form the least.
    np.testing.assert_array_equal(np.argmax(default, axis=1)[nonzero], best)
    assert np.all(np.asarray(literal)[nonzero, best] < default[nonzero, best])


def test_relation_scores_all_masked_row_is_zero():
    z, anchors, _ = _relation_inputs(14)
    got = _relation_scores(z, anchors, np.zeros(9, bool))
    np.testing.assert_array_equal(got, np.zeros((7, 9)))


def test_relation_scores_all_masked_row_has_zero_grad():
    z, anchors, _ = _relation_inputs(21)
    mask = np.zeros(9, bool)
    weights = _rng(22).normal(size=(7, 9)).astype(np.float32)

    def loss(z, anchors):
        return jnp.sum(weights * relation_scores(z, anchors, mask, temperature=0.01))

    for fn in (loss, jax.jit(loss)):
        for grad in jax.grad(fn, argnums=(0, 1))(z, anchors):
            np.testing.assert_array_equal(grad, 0.0)


def test_relation_scores_gradients_finite():
    z, anchors, mask = _relation_inputs(15)
    weights = _rng(16).normal(size=(7, 9)).astype(np.float32)

    def loss(z, anchors):
        r = _relation_scores(z, anchors, mask, temperature=0.01)
        return jnp.sum(weights * r)

    grad_z, grad_anchors = jax.grad(loss, argnums=(0, 1))(z, anchors)
    assert np.all(np.isfinite(grad_z)) and np.all(np.isfinite(grad_anchors))
    np.testing.assert_array_equal(np.asarray(grad_anchors)[~mask], 0.0)
    assert np.any(np.asarray(grad_z) != 0.0)


# ---------------------------------------------------------------- jit


def _jit_cases():
    rng = _rng(17)
    p, q = _simplex(rng, (20, 4), 0.2), _simplex(rng, (20, 4), 0.2)
    z_image = rng.normal(size=(20, 5)).astype(np.float32)
    z_text = rng.normal(size=(20, 5)).astype(np.float32)
    confident = ConfidentSet(jnp.array([1, 5, 7, 0], jnp.int32), jnp.array([1, 1, 0, 1], bool))
    cost_args = _cost_inputs(18, n=20)
    target_args = _target_inputs(19)
    relation_args = _relation_inputs(20)
    return {
        "jensen_shannon": (jensen_shannon, (p, q), {}),
        "jensen_shannon_pairwise": (jensen_shannon_pairwise, (p[:6], q), {}),
        "confident_set": (confident_set, (p, q), {"per_class": 3}),
        "random_confident_set": (
            random_confident_set,
            (jax.random.key(1),),
            {"num_samples": 20, "num_classes": 3, "per_class": 2},
        ),
        "knn_cosine": (knn_cosine, (z_image,), {"k": 4, "chunk": 6, "exclude_self": True}),
        "modal_consistency": (modal_consistency, (z_image, z_text, confident), {"ratio_max": 5.0}),
        "consistent_cost": (consistent_cost, cost_args, {"shift": True}),
        "update_targets": (
            update_targets,
            (target_args[0], _scores(*target_args[1:])),
            {"momentum": 0.9},
        ),
        "relation_scores": (relation_scores, relation_args, {"temperature": 0.5, "sign": -1.0}),
    }


_STATIC = ("per_class", "num_samples", "num_classes", "k", "chunk", "exclude_self", "shift")


@pytest.mark.parametrize("name", list(_jit_cases()))
def test_jit_equals_no_jit(name):
    fn, args, kwargs = _jit_cases()[name]
    static = tuple(key for key in kwargs if key in _STATIC)
    eager = fn(*args, **kwargs)
    jitted = jax.jit(fn, static_argnames=static)(*args, **kwargs)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
