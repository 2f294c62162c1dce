"""UOT-RCL's label correction with the embeddings on disk, in memory bounded by the chunk.

:func:`ncljax.labels.uot_rcl.correct_labels` holds every pair's embeddings of both
modalities, their unit copies and (with the block search) a copy in block order: about
``6 N D`` floats, 60 GB at ``10^7`` pairs of 256 dimensions. :func:`correct_labels_on_disk`
computes the same correction from ``[N, D]`` arrays on the host, normally memory-mapped
files (``numpy.memmap``, ``numpy.load(..., mmap_mode='r')``), reading them ``chunk`` rows
at a time:

* the modal consistency (Eq. 7) of each chunk against the confident pairs' rows;
* the neighbour search (Eq. 8) of each chunk, exact (a running top-``k`` over the
  candidates in chunks) or among nearby pairs (the k-means order of
  :func:`ncljax.labels.knn_cosine_blocks`, its unit rows written once in block order to a
  file in ``scratch``, each block then reading the blocks it searches);
* each pair's neighbour vote as soon as its neighbours are known, so the ``[N, k]``
  neighbours are never held.

What stays in memory grows with ``N K`` (``K`` classes), not with ``N D``: the logits,
posteriors, targets, votes, cost and plan of the partial OT (each ``[N, K]``), the block
order (``[N]`` int32) and the block search's k-means sample (``sample / block`` of the
rows, 1/32 by default). Each jitted piece is the one ``correct_labels`` runs, so the two
agree to round-off (``tests/labels/test_disk.py``).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np

from ncljax.labels import correction, uot_rcl
from ncljax.labels.uot_rcl import LabelCorrection, _refuse_non_finite, check_options, correct_labels

# correct_labels' keyword arguments and defaults, which correct_labels_on_disk takes too
_OPTIONS = {
    name: p.default
    for name, p in inspect.signature(correct_labels).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("mass", "key")
}


def read_rows(z, index) -> np.ndarray:
    """``z[index]`` as float32, read in the order of the rows (sequential on disk) and
    returned in the order of ``index``."""
    index = np.asarray(index)
    order = np.argsort(index, kind="stable")
    rows = np.empty((index.shape[0], z.shape[1]), np.float32)
    rows[order] = z[index[order]]
    return rows


def _chunks(num_samples: int, chunk: int):
    for start in range(0, num_samples, chunk):
        yield start, min(start + chunk, num_samples)


def _padded_unit(z, start: int, stop: int, rows: int, name: str) -> jax.Array:
    """Unit rows ``start:stop`` of ``z`` padded with zero rows to ``rows`` (one shape for
    every chunk: one compilation); refuses a NaN or infinite value."""
    block = np.zeros((rows, z.shape[1]), np.float32)
    block[: stop - start] = z[start:stop]
    if not np.isfinite(block).all():
        _refuse_non_finite(**{name: block})
    return _unit(block)


_unit = jax.jit(correction.embeddings)


@functools.partial(jax.jit, static_argnames=("num_samples", "exclude_self"))
def _merge(top, query, key, key_start, rows, *, num_samples, exclude_self):
    return correction.merge_top(top, query, key, key_start, rows, num_samples, exclude_self)


@functools.partial(jax.jit, static_argnames=("num_samples", "k", "exclude_self"))
def _search_and_vote(
    query, probe_rows, column, b, position, targets, *, num_samples, k, exclude_self
):
    similarity, found = correction.search_block(
        query, probe_rows, column, b, position, num_samples, k, exclude_self
    )
    return correction.neighbour_vote(found, similarity, targets)


_vote = jax.jit(correction.neighbour_vote)


def _exact_votes(z, targets, *, k, exclude_self, chunk, key_chunk, name):
    """Each row's vote from its exact top-``k`` (``correction.knn_cosine``): every chunk of
    queries against every chunk of candidates."""
    num_samples = z.shape[0]
    chunk = max(1, min(chunk, num_samples))
    key_chunk = max(1, min(key_chunk or chunk, num_samples))
    votes = np.empty((num_samples, targets.shape[1]), np.float32)
    for start, stop in _chunks(num_samples, chunk):
        query = _padded_unit(z, start, stop, chunk, name)
        rows = start + jnp.arange(chunk, dtype=jnp.int32)
        top = correction.empty_top(chunk, k, num_samples, query.dtype)
        for key_start, key_stop in _chunks(num_samples, key_chunk):
            key = _padded_unit(z, key_start, key_stop, key_chunk, name)
            top = _merge(
                top,
                query,
                key,
                np.int32(key_start),
                rows,
                num_samples=num_samples,
                exclude_self=exclude_self,
            )
        votes[start:stop] = np.asarray(_vote(top[1], top[0], targets))[: stop - start]
    return votes


_kmeans_draw = jax.jit(correction.kmeans_draw, static_argnums=(1, 2, 3))
_lloyd = jax.jit(correction.lloyd_centroids, static_argnames="iterations")
_nearest = jax.jit(correction.nearest_centroid)
_block_centres = jax.jit(lambda rows: jnp.sum(rows, axis=1))
_unit_centres = jax.jit(correction._unit_rows)
_probe_blocks = jax.jit(correction.knn_cosine, static_argnames=("k", "exclude_self"))


_tree_draw = jax.jit(correction.tree_draw, static_argnums=(1, 3, 4))
_group_centroids = jax.jit(correction.group_centroids, static_argnames=("clusters", "iterations"))
_nearest_in_node = jax.jit(correction.nearest_in_node, static_argnames=("rows", "window"))


def _block_order(z, num_blocks, key, *, sample, iterations, fanout, chunk, name) -> np.ndarray:
    """``correction._block_order`` over rows on disk: the k-means (or the k-means tree,
    level by level) of the same draws, each row's nearest centroid a chunk at a time (in
    the order of the rows; in the tree, of the rows sorted by node, in the one-array
    form's chunks), then a stable sort by centroid (or leaf)."""
    num_samples = z.shape[0]
    if num_blocks == 1:
        return np.arange(num_samples, dtype=np.int32)
    fans = correction.tree_fans(num_blocks, fanout)
    if fans is None:
        chosen, start = _kmeans_draw(key, num_samples, num_blocks, sample)
        points = _unit(read_rows(z, np.asarray(chosen)))
        centroids = _lloyd(points, points[start], iterations=iterations)
        del points
        cluster = np.empty(num_samples, np.int32)
        for first, stop in _chunks(num_samples, chunk):
            unit = _padded_unit(z, first, stop, chunk, name)
            cluster[first:stop] = np.asarray(_nearest(unit, centroids))[: stop - first]
        return np.argsort(cluster, kind="stable").astype(np.int32)
    leaf = np.zeros(num_samples, np.int32)
    for level, fan in enumerate(fans):
        members = np.argsort(leaf, kind="stable")
        counts = np.bincount(leaf, minlength=math.prod(fans[:level]))
        slots = np.asarray(_tree_draw(key, level, counts, fan, sample))
        points = _unit(read_rows(z, members[slots].reshape(-1))).reshape(*slots.shape, -1)
        centroids = _group_centroids(points, clusters=fan, iterations=iterations)
        del points
        cluster = np.empty(num_samples, np.int32)
        # in node order, in reads of whole chunks of nearest_in_node's (so that its
        # chunks are the one-array form's), each padded with its last row
        read = max(
            correction.NODE_ROWS,
            min(chunk, num_samples) // correction.NODE_ROWS * correction.NODE_ROWS,
        )
        for first, stop in _chunks(num_samples, read):
            some = members[first:stop]
            some = np.concatenate([some, np.full(read - some.size, some[-1], some.dtype)])
            unit = _unit(read_rows(z, some))
            found = _nearest_in_node(unit, leaf[some], centroids, rows=correction.NODE_ROWS)
            cluster[members[first:stop]] = np.asarray(found)[: stop - first]
        del members
        leaf = leaf * fan + cluster
    return np.argsort(leaf, kind="stable").astype(np.int32)


def _block_votes(
    z,
    targets,
    *,
    k,
    key,
    block,
    probes,
    exclude_self,
    sample,
    iterations,
    fanout,
    chunk,
    scratch,
    name,
):
    """Each row's vote from its top-``k`` among nearby rows
    (``correction.knn_cosine_blocks``, the same blocks and neighbours): the unit rows are
    written once in block order to ``scratch``, then each block reads the blocks it
    searches."""
    num_samples, dim = z.shape
    correction.check_block_k(num_samples, k, block, probes, exclude_self=exclude_self)
    block = min(block, num_samples)
    num_blocks = -(-num_samples // block)
    probes = min(probes, num_blocks)
    order = _block_order(
        z,
        num_blocks,
        key,
        sample=sample,
        iterations=iterations,
        fanout=fanout,
        chunk=chunk,
        name=name,
    )
    padded = num_blocks * block
    position = np.full(padded, num_samples, np.int32)
    position[:num_samples] = order
    del order
    path = os.path.join(scratch, f"{name}_blocks.f32")
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(padded, dim))
    centres = np.empty((num_blocks, dim), np.float32)
    group = max(1, chunk // block)  # blocks written at a time
    for first in range(0, num_blocks, group):
        last = min(first + group, num_blocks)
        slots = position[first * block : last * block]
        real = slots < num_samples
        values = np.zeros((slots.shape[0], dim), np.float32)
        values[real] = read_rows(z, slots[real])
        if not np.isfinite(values).all():
            _refuse_non_finite(**{name: values})
        unit = _unit(values).reshape(last - first, block, dim)  # zero rows stay zero
        rows[first * block : last * block] = np.asarray(unit).reshape(-1, dim)
        centres[first:last] = np.asarray(_block_centres(unit))
    rows.flush()
    near, _ = _probe_blocks(_unit_centres(centres), k=probes, exclude_self=False)
    near = np.asarray(near)
    position_device = jnp.asarray(position)
    within = np.arange(block, dtype=np.int32)
    votes = np.empty((num_samples, targets.shape[1]), np.float32)
    for b in range(num_blocks):
        probe = near[b]
        probe_rows = np.concatenate([rows[p * block : (p + 1) * block] for p in probe])
        column = (probe[:, None] * block + within).reshape(-1).astype(np.int32)
        vote = _search_and_vote(
            np.asarray(rows[b * block : (b + 1) * block]),
            probe_rows,
            column,
            np.int32(b),
            position_device,
            targets,
            num_samples=num_samples,
            k=k,
            exclude_self=exclude_self,
        )
        slots = position[b * block : (b + 1) * block]
        real = slots < num_samples
        votes[slots[real]] = np.asarray(vote)[real]
    del rows
    os.remove(path)
    return votes


def neighbour_votes(
    z,
    targets,
    *,
    k: int,
    knn: str = "exact",
    key: jax.Array | None = None,
    exclude_self: bool = True,
    chunk: int = 2048,
    key_chunk: int | None = None,
    block: int = 1024,
    probes: int = 16,
    sample: int = 32,
    iterations: int = 10,
    fanout: int = 64,
    scratch: str | None = None,
    name: str = "z",
) -> np.ndarray:
    """Each pair's neighbour vote of Eq. 8 (``correction.neighbour_vote`` of its top-``k``
    cosine neighbours, weighted by their similarities) from ``[N, D]`` embeddings on the
    host, read ``chunk`` rows at a time.

    Args:
      z: ``[N, D]`` embeddings (a memory-mapped file, or any array numpy can slice).
      targets: ``[N, K]`` the targets the neighbours vote with.
      k: neighbours per pair.
      knn: ``'exact'`` (the neighbours of :func:`correction.knn_cosine`) or ``'blocks'``
        (those of :func:`correction.knn_cosine_blocks` with ``key``, ``block``,
        ``probes``, ``sample``, ``iterations``, ``fanout``).
      exclude_self: a pair is not its own neighbour.
      chunk: rows read at a time (the query rows of the exact search).
      key_chunk: candidate rows per step of the exact search (``None``: ``chunk``).
      scratch: a directory for the block search's rows in block order (``N D`` float32,
        deleted before the function returns).
      name: the array's name in an error.

    Returns:
      ``[N, K]`` float32 votes.
    """
    n = z.shape[0]
    if len(z.shape) != 2:
        raise ValueError(f"{name} must be [N, D] embeddings, got shape {z.shape}")
    limit = n - 1 if exclude_self else n
    if knn == "exact":
        if not 1 <= k <= limit:
            raise ValueError(f"k={k} must be in [1, {limit}] for N={n}")
        return _exact_votes(
            z, targets, k=k, exclude_self=exclude_self, chunk=chunk, key_chunk=key_chunk, name=name
        )
    if knn != "blocks":
        raise ValueError(f"knn must be 'exact' or 'blocks', got {knn!r}.")
    if key is None or scratch is None:
        raise ValueError("knn='blocks' needs a key and a scratch directory.")
    correction._positive_ints(block=block, probes=probes, sample=sample, iterations=iterations)
    correction.check_fanout(fanout)
    return _block_votes(
        z,
        targets,
        k=k,
        key=key,
        block=block,
        probes=probes,
        exclude_self=exclude_self,
        sample=sample,
        iterations=iterations,
        fanout=fanout,
        chunk=chunk,
        scratch=scratch,
        name=name,
    )


_front = jax.jit(uot_rcl.confident_and_targets, static_argnames=("per_class", "confident"))


_consistency = jax.jit(correction.consistency_rows)


_transport = jax.jit(
    uot_rcl.transport_votes,
    static_argnames=("normalise", "epsilon", "corner", "threshold", "max_iterations"),
)


def correct_labels_on_disk(
    z_image,
    z_text,
    logits_image,
    logits_text,
    targets_image,
    targets_text,
    class_marginal,
    *,
    mass,
    key: jax.Array | None = None,
    scratch: str | None = None,
    **options,
) -> LabelCorrection:
    """:func:`ncljax.labels.uot_rcl.correct_labels` with ``z_image``, ``z_text`` ``[N, D]``
    on the host (memory-mapped files), read ``knn_chunk`` rows at a time: the same
    arguments (``options``: its keyword arguments, with its defaults), the same result to
    round-off; ``scratch`` is a directory for the block search's rows in block order
    (``knn='blocks'``).

    Not jittable (a host loop over chunks of jitted pieces).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"correct_labels_on_disk() got unknown arguments {unknown}.")
    o = types.SimpleNamespace(**(_OPTIONS | options))
    check_options(o.confident, o.knn, key)
    if z_image.shape != z_text.shape or len(z_image.shape) != 2:
        raise ValueError(
            f"z_image and z_text must be [N, D] of one shape, got {z_image.shape} and "
            f"{z_text.shape}."
        )
    _refuse_non_finite(logits_image=logits_image, logits_text=logits_text)
    logits_image = jnp.asarray(logits_image, jnp.float32)
    logits_text = jnp.asarray(logits_text, jnp.float32)
    confident_set, new_image, new_text = _front(
        logits_image,
        logits_text,
        jnp.asarray(targets_image, jnp.float32),
        jnp.asarray(targets_text, jnp.float32),
        key,
        per_class=o.per_class,
        confident=o.confident,
        momentum=o.momentum,
    )
    num_samples = z_image.shape[0]
    chunk = max(1, min(o.knn_chunk, num_samples))
    index = np.asarray(confident_set.index)
    anchors_image = _unit(read_rows(z_image, index))
    anchors_text = _unit(read_rows(z_text, index))
    c_image = np.empty(num_samples, np.float32)
    c_text = np.empty(num_samples, np.float32)
    for start, stop in _chunks(num_samples, chunk):
        image = _padded_unit(z_image, start, stop, chunk, "z_image")
        text = _padded_unit(z_text, start, stop, chunk, "z_text")
        ratio_image, ratio_text = _consistency(
            image, text, anchors_image, anchors_text, confident_set.mask
        )
        c_image[start:stop] = np.asarray(ratio_image)[: stop - start]
        c_text[start:stop] = np.asarray(ratio_text)[: stop - start]
    search = functools.partial(
        neighbour_votes,
        k=o.neighbours,
        knn=o.knn,
        exclude_self=o.exclude_self,
        chunk=chunk,
        key_chunk=o.knn_key_chunk,
        block=o.knn_block,
        probes=o.knn_probes,
        scratch=scratch,
    )
    side_key = (lambda side: None) if key is None else functools.partial(jax.random.fold_in, key)
    vote_image = search(z_image, new_image, key=side_key(0), name="z_image")
    vote_text = search(z_text, new_text, key=side_key(1), name="z_text")
    result = _transport(
        c_image,
        c_text,
        vote_image,
        vote_text,
        jnp.asarray(class_marginal, jnp.float32),
        mass,
        normalise=o.vote_normalise,
        epsilon=o.epsilon,
        corner=o.corner,
        threshold=o.threshold,
        max_iterations=o.max_iterations,
    )
    return LabelCorrection(result.labels, new_image, new_text, confident_set, result)
