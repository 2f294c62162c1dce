r"""Recall@K, rSum and the COCO 5-fold 1K protocol, swept block by block on device.

Recall@K follows the SCAN / VSE++ protocol: every test image has ``captions_per_image``
captions, caption ``k`` belongs to image ``k // captions_per_image``, and a query's 0-based rank
is the number of candidates placed before its (best) ground truth. The image-by-caption
similarity matrix is never built in host memory: a pairwise ``sim_fn`` is evaluated on device in
blocks of at most ``image_chunk x text_chunk`` pairs and only per-row counts come back to the
host. Ties favour nothing: the counts of strictly better and of tied negatives give the
expected Recall@K and ranks in closed form (``ncljax.evaluate.ranks``).

With ``mesh=...`` the image (query) rows of each block are sharded over all the mesh's axes and
the caption (database) block is replicated, so the similarity work is split across devices;
results do not change (``ncljax.evaluate.blocks``).

References:
  Lee et al., "Stacked Cross Attention for Image-Text Matching" (SCAN), ECCV 2018: the
  ``i2t``/``t2i`` rank code (``evaluation.py``) that NCR, DECL and GSC reuse.
  Faghri et al., "VSE++: Improving Visual-Semantic Embeddings with Hard Negatives", BMVC 2018:
  COCO 5-fold 1K protocol.
"""

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import ArrayLike

from ncljax import backend
from ncljax.evaluate import blocks
from ncljax.evaluate.ranks import RECALL_KS, RankCounts, RetrievalRanks, rank_metrics

SimFn = Callable[[Any, Any], jax.Array]
COCO_FOLD_IMAGES = 1000  # images per fold of the COCO 1K protocol
# Similarities closer than TIE_ATOL + TIE_RTOL * max(|s|, |g|) to a ground-truth value g are ties.
# Measured on CPU (float32): the ground-truth kernel ([1, cpi] blocks) and the sweep ([ci, ct]
# blocks) give values of one cosine pair up to ~1.1e-7 apart in absolute terms, up to 1.5e-4
# apart relative to a value near 0 (cancellation), and one SGR/SAF head output up to 2 ulps
# (1.4e-7) apart. Without a tolerance a collapsed model wins or loses every tie by rounding.
TIE_ATOL = 1e-6
TIE_RTOL = 1e-6


# ---------------------------------------------------------------------------------- kernels


def _check_block_shape(sim: jax.Array, expected: tuple[int, int]) -> None:
    if sim.shape != expected:
        raise ValueError(
            f"sim_fn must return [images, captions] = {expected} for its blocks, got {sim.shape}"
        )


def _similarity(sim_fn: SimFn, params: Any, image_block: Any, text_block: Any) -> jax.Array:
    """``sim_fn(image_block, text_block)``, or ``sim_fn(params, ...)`` when params are given."""
    if params is None:
        return sim_fn(image_block, text_block)
    return sim_fn(params, image_block, text_block)


@backend.jit(static_argnames="sim_fn")
def _ground_truth_block(
    sim_fn: SimFn, params: Any, image_block: Any, caption_groups: Any
) -> jax.Array:
    """``[gi, cpi]`` similarity of each image with its own captions (the block diagonal)."""
    cpi = jax.tree.leaves(caption_groups)[0].shape[1]

    def own_captions(image, captions):
        sim = _similarity(sim_fn, params, jax.tree.map(lambda x: x[None], image), captions)
        _check_block_shape(sim, (1, cpi))
        return sim[0]

    return jax.vmap(own_captions)(image_block, caption_groups)


class _BlockCounts(NamedTuple):
    """Counts of one sweep block (device arrays)."""

    i2t: jax.Array  # [2, ci] negatives above / tied with each image's best ground truth
    t2i: jax.Array  # [2, ct] negative images above / tied with each caption's ground truth
    nonfinite: jax.Array  # [] non-finite similarities among the real pairs


def _compare(sim: jax.Array, reference: jax.Array, atol, rtol) -> tuple[jax.Array, jax.Array]:
    """``(sim > reference, sim ~ reference)`` beyond / within ``atol + rtol * max(|.|, |.|)``."""
    diff = sim - reference
    tol = atol + rtol * jnp.maximum(jnp.abs(sim), jnp.abs(reference))
    return diff > tol, jnp.abs(diff) <= tol


@backend.jit(static_argnames="sim_fn")
def _count_block(
    sim_fn: SimFn,
    params: Any,
    image_block: Any,
    text_block: Any,
    image_best: jax.Array,
    text_gt: jax.Array,
    offsets: tuple[ArrayLike, ArrayLike, ArrayLike, ArrayLike],
    tolerance: tuple[ArrayLike, ArrayLike],
) -> _BlockCounts:
    """Negatives above and tied with the ground truth in one ``[ci, ct]`` block.

    ``offsets = (image_start, text_start, num_images, captions_per_image)`` and ``tolerance =
    (tie_atol, tie_rtol)`` are traced scalars, so every block of a sweep (and every tolerance)
    shares one compilation.
    """
    image_start, text_start, num_images, captions_per_image = offsets
    tie_atol, tie_rtol = tolerance
    ci, ct = image_best.shape[0], text_gt.shape[0]
    sim = _similarity(sim_fn, params, image_block, text_block)
    _check_block_shape(sim, (ci, ct))
    rows = image_start + jnp.arange(ci)
    cols = text_start + jnp.arange(ct)
    real = (rows < num_images)[:, None] & (cols < num_images * captions_per_image)[None, :]
    # Ground-truth pairs are excluded by index, so a pair never outranks itself even when its
    # block value differs from the ground-truth kernel's value by rounding.
    negative = real & (cols[None, :] // captions_per_image != rows[:, None])
    i2t_greater, i2t_tied = _compare(sim, image_best[:, None], tie_atol, tie_rtol)
    t2i_greater, t2i_tied = _compare(sim, text_gt[None, :], tie_atol, tie_rtol)

    def count(masks, axis):
        return jnp.stack([jnp.sum(negative & m, axis=axis, dtype=jnp.int32) for m in masks])

    return _BlockCounts(
        i2t=count((i2t_greater, i2t_tied), 1),
        t2i=count((t2i_greater, t2i_tied), 0),
        nonfinite=jnp.sum(real & ~jnp.isfinite(sim), dtype=jnp.int32),
    )


# ------------------------------------------------------------------------------ Recall@K


def _check_retrieval_inputs(images: Any, texts: Any, captions_per_image: int) -> tuple[int, int]:
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be >= 1, got {captions_per_image}")
    num_images = blocks.leading_size(images, "images")
    num_texts = blocks.leading_size(texts, "texts")
    if num_images == 0:
        raise ValueError("images has no items")
    if num_texts != captions_per_image * num_images:
        raise ValueError(
            f"texts must hold captions_per_image * n_img = {captions_per_image} * {num_images} = "
            f"{captions_per_image * num_images} captions (caption k belongs to image "
            f"k // captions_per_image), got {num_texts}"
        )
    return num_images, num_texts


def _ground_truth(
    sim_fn: SimFn,
    params: Any,
    images: Any,
    texts: Any,
    cpi: int,
    chunk: int,
    placement: tuple[Any, Any, int],
) -> np.ndarray:
    """Host ``[n_txt]``: similarity of every caption with its own image."""
    rows, _, _ = placement
    num_images = blocks.leading_size(images, "images")
    parts = []
    for start in range(0, num_images, chunk):
        image_block = jax.device_put(blocks.take_rows(images, start, chunk), rows)
        captions = blocks.take_rows(texts, start * cpi, chunk * cpi)
        groups = jax.tree.map(lambda x: x.reshape(chunk, cpi, *x.shape[1:]), captions)
        groups = jax.device_put(groups, rows)
        parts.append(_ground_truth_block(sim_fn, params, image_block, groups))
    return np.concatenate(blocks.to_host(parts))[:num_images].reshape(-1)


def _best_ground_truth(
    text_gt: np.ndarray, cpi: int, tie_atol: float, tie_rtol: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per image: its best ground-truth value ``[n_img]`` and how many of its captions tie at
    that value ``[n_img]`` (int64, at least 1)."""
    groups = text_gt.reshape(-1, cpi).astype(np.float64)
    best = groups.max(axis=1, keepdims=True)
    tol = tie_atol + tie_rtol * np.maximum(np.abs(groups), np.abs(best))
    ties = np.sum(np.abs(groups - best) <= tol, axis=1).astype(np.int64)
    return best[:, 0].astype(text_gt.dtype), ties


def _warn_if_all_tied(ranks: RetrievalRanks, num_images: int, cpi: int) -> None:
    """Logs how many queries have every similarity equal (within the tie tolerance)."""
    negatives = {"i2t": (num_images - 1) * cpi, "t2i": num_images - 1}
    counts = {}
    for name, c in ranks._asdict().items():
        flat = (c.greater == 0) & (c.tied == negatives[name])
        if name == "i2t":
            flat &= c.ground_truth_ties == cpi
        counts[name] = int(flat.sum()) if negatives[name] else 0
    if counts["i2t"] or counts["t2i"]:
        logging.warning(
            "retrieval: %d of %d image->text and %d of %d text->image queries have all-equal "
            "similarities (within the tie tolerance); the model has probably collapsed. Those "
            "queries score chance level.",
            counts["i2t"],
            num_images,
            counts["t2i"],
            num_images * cpi,
        )


def _sweep(
    sim_fn: SimFn,
    params: Any,
    images: Any,
    texts: Any,
    ground_truth: tuple[np.ndarray, np.ndarray],
    cpi: int,
    chunks: tuple[int, int],
    placement: tuple[Any, Any, int],
    tolerance: tuple[float, float],
) -> tuple[np.ndarray, np.ndarray]:
    """Negatives above and tied with the ground truth, summed over every ``[ci, ct]`` block.

    Args:
      ground_truth: host ``(image_best [n_img], text_gt [n_txt])``.
      chunks: ``(ci, ct)``, the block shape.
      placement: from ``blocks.placements``.
      tolerance: ``(tie_atol, tie_rtol)``.

    Returns:
      Host int64 ``(i2t [2, n_img], t2i [2, n_txt])``: (greater, tied) per query.

    Raises:
      ValueError: a block holds non-finite similarities.
    """
    image_best, text_gt = ground_truth
    num_images, num_texts = image_best.shape[0], text_gt.shape[0]
    rows, columns, _ = placement
    ci, ct = chunks
    i2t = np.zeros((2, num_images), np.int64)  # (greater, tied) per image
    t2i = np.zeros((2, num_texts), np.int64)  # (greater, tied) per caption
    for i0 in range(0, num_images, ci):
        image_block = jax.device_put(blocks.take_rows(images, i0, ci), rows)
        best_block = jax.device_put(blocks.take_rows(image_best, i0, ci), rows)
        row_parts = []
        for t0 in range(0, num_texts, ct):
            text_block = jax.device_put(blocks.take_rows(texts, t0, ct), columns)
            gt = jax.device_put(blocks.take_rows(text_gt, t0, ct), columns)
            offsets = (i0, t0, num_images, cpi)
            counts = _count_block(
                sim_fn, params, image_block, text_block, best_block, gt, offsets, tolerance
            )
            row_parts.append((t0, counts))
        # One sync per image chunk bounds the blocks in flight to one row of the sweep.
        on_host = blocks.to_host([c for _, c in row_parts])
        for (t0, _), counts in zip(row_parts, on_host, strict=True):
            if counts.nonfinite:
                raise ValueError(
                    f"sim_fn gave {counts.nonfinite} non-finite similarities in block (images "
                    f"{i0}.., captions {t0}..); check the features and the model"
                )
            i2t[:, i0 : i0 + ci] += counts.i2t[:, : num_images - i0]
            t2i[:, t0 : t0 + ct] += counts.t2i[:, : num_texts - t0]
    return i2t, t2i


def retrieval_ranks(
    sim_fn: SimFn,
    images: Any,
    texts: Any,
    *,
    captions_per_image: int,
    image_chunk: int = 1000,
    text_chunk: int = 5000,
    mesh: Mesh | None = None,
    params: Any = None,
    tie_atol: float = TIE_ATOL,
    tie_rtol: float = TIE_RTOL,
) -> RetrievalRanks:
    r"""Image->text and text->image rank counts, computed block by block on device.

    With :math:`s(i, k)` = ``sim_fn`` of image :math:`i` and caption :math:`k`,
    :math:`\mu(k) = \lfloor k / \mathrm{cpi} \rfloor` the image of caption :math:`k`,
    :math:`g_k = s(\mu(k), k)`, :math:`b_i = \max_{k: \mu(k) = i} g_k`, and
    :math:`a \succ b \iff a - b > \tau(a, b)`, :math:`a \approx b \iff |a - b| \le \tau(a, b)`,
    :math:`\tau(a, b) = \mathrm{atol} + \mathrm{rtol} \max(|a|, |b|)`:

    .. math::

        \mathrm{greater}^{i2t}_i = |\{c : \mu(c) \neq i,\ s(i, c) \succ b_i\}|, \quad
        \mathrm{tied}^{i2t}_i = |\{c : \mu(c) \neq i,\ s(i, c) \approx b_i\}|, \quad
        \mathrm{gt\_ties}^{i2t}_i = |\{k : \mu(k) = i,\ g_k \approx b_i\}|,

        \mathrm{greater}^{t2i}_k = |\{j : j \neq \mu(k),\ s(j, k) \succ g_k\}|, \quad
        \mathrm{tied}^{t2i}_k = |\{j : j \neq \mu(k),\ s(j, k) \approx g_k\}|, \quad
        \mathrm{gt\_ties}^{t2i}_k = 1.

    Image->text ranks the image's best ground-truth caption among all captions, text->image the
    caption's image among all images. Ties favour nothing: :class:`RankCounts` gives the rank
    distribution under a uniformly random order of tied candidates (without ties the rank is
    ``greater``, the SCAN rank). A warning is logged when some query has all its similarities
    tied (a collapsed model).

    Tie tolerance: the ground-truth values :math:`g` come from a different kernel than the
    sweep, so for equal true values the two float32 results differ by rounding (measured on CPU:
    up to ~1e-7 absolute for a unit-vector cosine, however close to 0 the value, so a relative
    tolerance alone does not suffice, and up to 2 ulps for SGR/SAF heads). Within
    ``tie_atol + tie_rtol * max(|s|, |g|)`` values count as tied; the defaults (1e-6 each)
    suit float32 similarities of order one (cosine, sigmoid, logits). Scale ``tie_atol`` with
    the similarity; set both to 0 for exact comparisons; raise them for reduced-precision
    similarities (bfloat16, TF32 matmuls).

    Algorithm: (a) the ground-truth similarities :math:`g` come from the block diagonal only
    (each image against its own ``cpi`` captions, ``sim_fn`` vmapped over ``[1, cpi]`` blocks);
    (b) one sweep over all ``[image_chunk, text_chunk]`` blocks accumulates the counts. The
    last partial blocks are padded to the full chunk size and masked, so each kernel compiles
    once per ``(sim_fn, block shape)``; the kernels are module-level and take ``sim_fn`` as a
    static argument, so a later call with the same function object reuses the compilation.

    Args:
      sim_fn: jittable pure function ``(image_block, text_block) -> [ci, ct]`` similarity
        (higher is more similar), e.g. ``lambda i, t: i @ t.T``. It must be pairwise: entry
        ``[a, b]`` depends only on image ``a`` and caption ``b``.
      images: pytree of arrays with leading axis ``n_img`` (``[n_img, D]`` embeddings, a dict of
        ``[n_img, R, D]`` region features, ...), numpy or jax.
      texts: pytree of arrays with leading axis ``n_txt = captions_per_image * n_img``.
      captions_per_image: captions per image ``cpi`` (5 for Flickr30K/COCO, 1 for CC152K).
      image_chunk: images per block (default 1000; clipped to ``n_img``).
      text_chunk: captions per block (default 5000; clipped to ``n_txt``). Ground-truth blocks
        hold ``max(1, text_chunk // cpi)`` images at most.
      mesh: optional mesh; image rows of each block are sharded over all its axes (chunks are
        rounded up to a multiple of ``mesh.size``) and caption blocks are replicated. Default:
        everything on ``jax.devices()[0]``.
      params: optional pytree (e.g. model parameters); when given, ``sim_fn`` is called as
        ``sim_fn(params, image_block, text_block)``. It is traced, not static, so new values
        (every epoch's parameters) reuse the compilation.
      tie_atol: absolute tie tolerance (default ``TIE_ATOL = 1e-6``).
      tie_rtol: relative tie tolerance (default ``TIE_RTOL = 1e-6``, about 8 float32 ulps).

    Returns:
      ``RetrievalRanks(i2t, t2i)``: :class:`RankCounts` of ``[n_img]`` and ``[n_txt]`` queries
      (int64 numpy arrays).

    Raises:
      ValueError: inconsistent leading axes, ``n_txt != cpi * n_img``, a bad ``sim_fn`` block
        shape, non-finite similarities or negative tolerances.
    """
    if image_chunk < 1 or text_chunk < 1:
        raise ValueError(f"chunks must be >= 1, got {image_chunk=} and {text_chunk=}")
    if not (tie_atol >= 0 and tie_rtol >= 0):
        raise ValueError(f"tie tolerances must be >= 0, got {tie_atol=} and {tie_rtol=}")
    images, texts = blocks.as_arrays(images), blocks.as_arrays(texts)
    cpi = captions_per_image
    num_images, num_texts = _check_retrieval_inputs(images, texts, cpi)
    placement = blocks.placements(mesh)
    multiple = placement[2]
    ci = blocks.round_up(min(image_chunk, num_images), multiple)
    ct = min(text_chunk, num_texts)
    gi = blocks.round_up(max(1, min(image_chunk, text_chunk // cpi, num_images)), multiple)

    text_gt = _ground_truth(sim_fn, params, images, texts, cpi, gi, placement)
    if not np.all(np.isfinite(text_gt.astype(np.float32))):
        raise ValueError("sim_fn gave non-finite ground-truth similarities; check the features")
    tolerance = (float(tie_atol), float(tie_rtol))
    image_best, gt_ties = _best_ground_truth(text_gt, cpi, *tolerance)
    i2t, t2i = _sweep(
        sim_fn, params, images, texts, (image_best, text_gt), cpi, (ci, ct), placement, tolerance
    )
    ranks = RetrievalRanks(
        i2t=RankCounts(i2t[0], i2t[1], gt_ties),
        t2i=RankCounts(t2i[0], t2i[1], np.ones(num_texts, np.int64)),
    )
    _warn_if_all_tied(ranks, num_images, cpi)
    return ranks


def retrieval_metrics(
    sim_fn: SimFn,
    images: Any,
    texts: Any,
    *,
    captions_per_image: int,
    image_chunk: int = 1000,
    text_chunk: int = 5000,
    mesh: Mesh | None = None,
    params: Any = None,
    tie_atol: float = TIE_ATOL,
    tie_rtol: float = TIE_RTOL,
) -> dict[str, float]:
    """Recall@K, rSum, medr and meanr in both directions (SCAN / VSE++ protocol).

    Image->text: an image's rank is the best rank of its ground-truth captions among all
    captions. Text->image: a caption's rank is the rank of its image among all images. Ties
    favour nothing: the metrics are expectations over a uniformly random order of tied
    candidates (all-equal similarities give chance level). See :func:`retrieval_ranks` for the
    formulas, the tie tolerance, the blocking and the arguments, and :func:`rank_metrics` for
    the metrics.

    Returns:
      Python floats: ``i2t_r1, i2t_r5, i2t_r10, t2i_r1, t2i_r5, t2i_r10`` (percent), ``rsum``
      (their sum), ``i2t_medr, i2t_meanr, t2i_medr, t2i_meanr`` (1-based ranks).
    """
    ranks = retrieval_ranks(
        sim_fn,
        images,
        texts,
        captions_per_image=captions_per_image,
        image_chunk=image_chunk,
        text_chunk=text_chunk,
        mesh=mesh,
        params=params,
        tie_atol=tie_atol,
        tie_rtol=tie_rtol,
    )
    return rank_metrics(*ranks)


def coco_5fold_metrics(
    sim_fn: SimFn,
    images: Any,
    texts: Any,
    *,
    captions_per_image: int = 5,
    fold_images: int = COCO_FOLD_IMAGES,
    **chunks: Any,
) -> dict[str, float]:
    """COCO 1K protocol: :func:`retrieval_metrics` on each fold, averaged over the folds.

    Fold ``f`` holds images ``[fold_images * f, fold_images * (f + 1))`` and their captions
    ``[cpi * fold_images * f, cpi * fold_images * (f + 1))``; on COCO ``testall`` (5,000 images)
    the default gives the 5 folds of 1,000 images. Every metric is the mean over the folds and
    ``rsum`` is the sum of the fold-averaged recalls (the 5-fold 1K evaluation of the NCR/SGRAF
    code, ``evalrank(fold5=True)``, that GSC follows, Sec. 4.1).

    Args:
      sim_fn, images, texts, captions_per_image: as in :func:`retrieval_metrics`.
      fold_images: images per fold (default 1000); must divide ``n_img``.
      **chunks: ``image_chunk``, ``text_chunk``, ``mesh``, ``params``, ``tie_atol``,
        ``tie_rtol`` for :func:`retrieval_metrics`.

    Returns:
      The keys of :func:`retrieval_metrics`, averaged over folds.
    """
    images, texts = blocks.as_arrays(images), blocks.as_arrays(texts)
    num_images, _ = _check_retrieval_inputs(images, texts, captions_per_image)
    if fold_images < 1 or num_images % fold_images:
        raise ValueError(f"n_img = {num_images} is not a multiple of {fold_images=}")
    span = captions_per_image * fold_images
    folds = []
    for start in range(0, num_images, fold_images):
        fold_imgs = jax.tree.map(lambda x, s=start: x[s : s + fold_images], images)
        fold_txts = jax.tree.map(lambda x, s=start * captions_per_image: x[s : s + span], texts)
        folds.append(
            retrieval_metrics(
                sim_fn, fold_imgs, fold_txts, captions_per_image=captions_per_image, **chunks
            )
        )
    metrics = {key: float(np.mean([fold[key] for fold in folds])) for key in folds[0]}
    metrics["rsum"] = float(
        sum(metrics[f"{name}_r{k}"] for name in ("i2t", "t2i") for k in RECALL_KS)
    )
    return metrics
