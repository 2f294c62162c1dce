"""UOT-RCL's label correction with the embeddings on disk (``ncljax.labels.disk``): the
same votes, consistency and corrected labels as the one-array form, from ``.npy`` files
read a chunk at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import labels
from ncljax.labels import correction, disk


def _write(tmp_path, name, array):
    path = tmp_path / f"{name}.npy"
    np.save(path, array)
    return np.load(path, mmap_mode="r")


@pytest.fixture(scope="module")
def world():
    """Clustered embeddings (so the block search has regions to find), class logits that
    follow the clusters, noisy observed labels."""
    rng = np.random.default_rng(3)
    n, d, k = 203, 6, 4
    centres = rng.normal(size=(k, d)) * 2.0
    cls = rng.integers(0, k, n)
    z_image = (centres[cls] + rng.normal(size=(n, d))).astype(np.float32)
    z_text = (z_image + 0.5 * rng.normal(size=(n, d))).astype(np.float32)
    logits_image = (np.eye(k)[cls] * 2 + rng.normal(size=(n, k))).astype(np.float32)
    logits_text = (logits_image + rng.normal(size=(n, k))).astype(np.float32)
    flipped = np.where(rng.random(n) < 0.3, rng.integers(0, k, n), cls)
    observed = np.eye(k, dtype=np.float32)[flipped]
    return z_image, z_text, logits_image, logits_text, observed


@pytest.mark.parametrize(
    "chunk, key_chunk, exclude_self", [(64, None, True), (50, 17, True), (203, None, False)]
)
def test_exact_votes_are_the_votes_of_the_exact_neighbours(
    tmp_path, world, chunk, key_chunk, exclude_self
):
    z = world[0]
    targets = jnp.asarray(world[4])
    # two equal rows: a tie, which both forms give to the lower row
    z = z.copy()
    z[10] = z[150]
    index, similarity = correction.knn_cosine(z, k=7, exclude_self=exclude_self)
    want = correction.neighbour_vote(index, similarity, targets)
    got = disk.neighbour_votes(
        _write(tmp_path, "z", z),
        targets,
        k=7,
        exclude_self=exclude_self,
        chunk=chunk,
        key_chunk=key_chunk,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # and by hand for one row: the mean of its 7 most similar rows' targets, weighted
    unit = z / np.linalg.norm(z, axis=1, keepdims=True)
    sim = unit @ unit[42]
    if exclude_self:
        sim[42] = -np.inf
    near = np.argsort(-sim, kind="stable")[:7]
    np.testing.assert_allclose(
        got[42], (sim[near, None] * world[4][near]).sum(0) / 7, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "block, probes, chunk, fanout",
    [(16, 3, 64, 64), (32, 2, 40, 64), (64, 8, 256, 64), (8, 4, 50, 4)],
)
def test_block_votes_are_the_votes_of_the_block_search(
    tmp_path, world, block, probes, chunk, fanout
):
    """One k-means of every block (``fanout`` 64), or a k-means tree (``fanout`` 4: ``(4,
    3, 3)`` centroids a level)."""
    z, targets = world[1], jnp.asarray(world[4])
    key = jax.random.key(5)
    index, similarity = correction.knn_cosine_blocks(
        z, k=9, key=key, block=block, probes=probes, fanout=fanout
    )
    want = correction.neighbour_vote(index, similarity, targets)
    got = disk.neighbour_votes(
        _write(tmp_path, "z", z),
        targets,
        k=9,
        knn="blocks",
        key=key,
        block=block,
        probes=probes,
        fanout=fanout,
        chunk=chunk,
        scratch=str(tmp_path),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.npy"]  # the block copy is gone


@pytest.mark.parametrize(
    "knn, chunk, key_chunk", [("exact", 2048, None), ("exact", 48, 31), ("blocks", 64, None)]
)
def test_correct_labels_on_disk_is_correct_labels(tmp_path, world, knn, chunk, key_chunk):
    z_image, z_text, logits_image, logits_text, observed = world
    marginal = jnp.full(4, 0.25)
    options = dict(
        mass=0.6,
        key=jax.random.key(1),
        per_class=3,
        neighbours=5,
        knn=knn,
        knn_block=32,
        knn_probes=3,
        knn_chunk=chunk,
        knn_key_chunk=key_chunk,
    )
    want = labels.correct_labels(
        z_image, z_text, logits_image, logits_text, observed, observed, marginal, **options
    )
    got = disk.correct_labels_on_disk(
        _write(tmp_path, "image", z_image),
        _write(tmp_path, "text", z_text),
        logits_image,
        logits_text,
        observed,
        observed,
        marginal,
        scratch=str(tmp_path),
        **options,
    )
    np.testing.assert_array_equal(got.confident_set.index, want.confident_set.index)
    np.testing.assert_allclose(got.targets_image, want.targets_image, rtol=1e-6)
    np.testing.assert_allclose(got.labels, want.labels, rtol=1e-4, atol=1e-6)
    assert bool(got.ot.converged) and float(got.ot.mass) == pytest.approx(float(want.ot.mass))


def test_half_float_files_are_read_as_float32(tmp_path, world):
    z = world[0].astype(np.float16)
    targets = jnp.asarray(world[4])
    index, similarity = correction.knn_cosine(z.astype(np.float32), k=4)
    want = correction.neighbour_vote(index, similarity, targets)
    got = disk.neighbour_votes(_write(tmp_path, "z", z), targets, k=4, chunk=70)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_input_is_one_error(tmp_path, world):
    z = world[0].copy()
    z[77, 2] = np.nan
    targets = jnp.asarray(world[4])
    with pytest.raises(ValueError, match="NaN or infinite"):
        disk.neighbour_votes(_write(tmp_path, "z", z), targets, k=3, chunk=50)
    with pytest.raises(ValueError, match="k=9 neighbours must be in"):
        disk.neighbour_votes(
            world[0],
            targets,
            k=9,
            knn="blocks",
            key=jax.random.key(0),
            block=4,
            probes=2,
            scratch=str(tmp_path),
        )
    with pytest.raises(ValueError, match="knn must be"):
        disk.neighbour_votes(world[0], targets, k=3, knn="ivf")
    with pytest.raises(ValueError, match="needs a key and a scratch"):
        disk.neighbour_votes(world[0], targets, k=3, knn="blocks")
    blocks = dict(k=3, knn="blocks", key=jax.random.key(0), scratch=str(tmp_path))
    with pytest.raises(ValueError, match=r"^sample must be a positive integer, got 0"):
        disk.neighbour_votes(world[0], targets, sample=0, **blocks)
    with pytest.raises(ValueError, match=r"^fanout must be an integer of at least 2, got 1"):
        disk.neighbour_votes(world[0], targets, fanout=1, **blocks)


def test_correct_labels_on_disk_takes_correct_labels_arguments_only(world):
    z_image, z_text, logits_image, logits_text, observed = world
    args = (z_image, z_text, logits_image, logits_text, observed, observed, jnp.full(4, 0.25))
    with pytest.raises(TypeError, match=r"unknown arguments \['neighbors'\]"):
        disk.correct_labels_on_disk(*args, mass=0.5, neighbors=5)
    with pytest.raises(ValueError, match="knn='blocks' needs a key"):
        disk.correct_labels_on_disk(*args, mass=0.5, knn="blocks")
    with pytest.raises(ValueError, match="one shape"):
        disk.correct_labels_on_disk(z_image, z_text[:, :3], *args[2:], mass=0.5)
