r"""Retrieval metrics (Recall@K, rSum, mAP@all) and noise-detection quality.

Recall@K follows the SCAN / VSE++ protocol: every test image has ``captions_per_image``
captions, caption ``k`` belongs to image ``k // captions_per_image``, and a query's 0-based rank
is the number of candidates placed before its (best) ground truth. The image-by-caption
similarity matrix is never built in host memory: a pairwise ``sim_fn`` is evaluated on device in
blocks of at most ``image_chunk x text_chunk`` pairs and only per-row counts come back to the
host.

Ties favour nothing. Every metric is its expected value when tied candidates are put in a
uniformly random order: Recall@K and ranks from the counts of strictly better and of tied
negatives (exact, closed form), mAP@all from the tie groups of the sorted database (exact), the
noise AUC with average ranks. A collapsed model (every similarity equal) therefore scores chance
level, not a perfect rSum of 600, and a warning is logged when whole queries are tied.

mAP@all follows MRL / UOT-RCL (category retrieval with cosine similarity over the whole
database). Noise-detection quality compares a method's per-pair clean score with the known noise
mask (diagnostics only; no method may read the mask).

Placement. Every block is put on device with ``jax.device_put``: on ``jax.devices()[0]`` by
default, so inputs that are already sharded (e.g. with a ``NamedSharding`` over a mesh) are
gathered block by block and give the same result as host inputs. With ``mesh=...`` the image
(query) rows of each block are sharded over all the mesh's axes and the caption (database) block
is replicated, so the similarity work is split across devices; results do not change.

References:
  Lee et al., "Stacked Cross Attention for Image-Text Matching" (SCAN), ECCV 2018: the
  ``i2t``/``t2i`` rank code (``evaluation.py``) that NCR, DECL and GSC reuse.
  Faghri et al., "VSE++: Improving Visual-Semantic Embeddings with Hard Negatives", BMVC 2018:
  COCO 5-fold 1K protocol.
  Hu et al., "Learning Cross-Modal Retrieval with Noisy Labels" (MRL), CVPR 2021: mAP@all.
  McSherry and Najork, "Computing Information Retrieval Performance Measures Efficiently in the
  Presence of Tied Scores", ECIR 2008: tie-aware (expected) precision and AP.
"""

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from ncljax import backend

SimFn = Callable[[Any, Any], jax.Array]
RECALL_KS = (1, 5, 10)
COCO_FOLD_IMAGES = 1000  # images per fold of the COCO 1K protocol
# Similarities closer than TIE_ATOL + TIE_RTOL * max(|s|, |g|) to a ground-truth value g are ties.
# Measured on CPU (float32): the ground-truth kernel ([1, cpi] blocks) and the sweep ([ci, ct]
# blocks) give values of one cosine pair up to ~1.1e-7 apart in absolute terms, up to 1.5e-4
# apart relative to a value near 0 (cancellation), and one SGR/SAF head output up to 2 ulps
# (1.4e-7) apart. Without a tolerance a collapsed model wins or loses every tie by rounding.
TIE_ATOL = 1e-6
TIE_RTOL = 1e-6


# ----------------------------------------------------------------------------------- helpers


def _as_array(x: Any) -> Any:
    """A numpy array, or the jax Array itself (no host round trip)."""
    return x if isinstance(x, jax.Array) else np.asarray(x)


def _as_arrays(tree: Any) -> Any:
    return jax.tree.map(_as_array, tree)


def _leading_size(tree: Any, name: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"{name} is an empty pytree; pass arrays with a leading item axis")
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(x.shape) for x in leaves]
        raise ValueError(f"every leaf of {name} needs the same leading axis; got shapes {shapes}")
    return sizes.pop()


def _take_rows(tree: Any, start: int, size: int) -> Any:
    """Rows ``[start, start + size)`` of every leaf; rows past the end repeat the last row.

    Repeating a real row (rather than zeros) keeps padded inputs finite for any ``sim_fn``
    (a zero row would give NaN under cosine normalisation); padded results are masked anyway.
    """

    def take(x):
        stop = start + size
        if isinstance(x, np.ndarray) and stop <= x.shape[0]:
            return x[start:stop]
        return x[np.minimum(np.arange(start, stop), x.shape[0] - 1)]

    return jax.tree.map(take, tree)


def _to_host(tree: Any) -> Any:
    """Numpy copies of (possibly sharded) results; gathered from every process if needed."""
    if jax.process_count() > 1:  # shards on other hosts are not addressable here
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return jax.device_get(tree)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _placements(mesh: Mesh | None) -> tuple[Any, Any, int]:
    """(placement of query rows, placement of database/caption blocks, row multiple)."""
    if mesh is None:
        device = jax.devices()[0]
        return device, device, 1
    return NamedSharding(mesh, P(tuple(mesh.axis_names))), NamedSharding(mesh, P()), mesh.size


def _check_block_shape(sim: jax.Array, expected: tuple[int, int]) -> None:
    if sim.shape != expected:
        raise ValueError(
            f"sim_fn must return [images, captions] = {expected} for its blocks, got {sim.shape}"
        )


# ---------------------------------------------------------------------------------- kernels


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
    num_images = _leading_size(images, "images")
    num_texts = _leading_size(texts, "texts")
    if num_images == 0:
        raise ValueError("images has no items")
    if num_texts != captions_per_image * num_images:
        raise ValueError(
            f"texts must hold captions_per_image * n_img = {captions_per_image} * {num_images} = "
            f"{captions_per_image * num_images} captions (caption k belongs to image "
            f"k // captions_per_image), got {num_texts}"
        )
    return num_images, num_texts


def recall_min_images(captions_per_image: int, ks: tuple[int, ...] = RECALL_KS) -> int:
    r"""The fewest images a split needs for every Recall@K of ``ks`` to depend on the model.

    A query's rank is below :math:`K` by construction when it has fewer than :math:`K`
    wrong candidates. A text->image query ranks the split's :math:`n` images (one right,
    :math:`n - 1` wrong); an image->text query ranks its :math:`n \cdot \mathrm{cpi}`
    captions (:math:`\mathrm{cpi}` right, :math:`(n - 1)\,\mathrm{cpi}` wrong). Both need at
    least :math:`K_{\max}` wrong candidates:

    .. math::

        n \ge \max(K_{\max} + 1,\ \lceil K_{\max} / \mathrm{cpi} \rceil + 1) = K_{\max} + 1,

    i.e. 11 images for R@10 whatever ``cpi``: with 10 or fewer, text->image R@10 is 100.

    Args:
      captions_per_image: ``cpi >= 1``.
      ks: the cutoffs reported (default ``RECALL_KS``).

    Returns:
      The minimum number of images.
    """
    k = max(ks)
    return max(k + 1, -(-k // captions_per_image) + 1)


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
    num_images = _leading_size(images, "images")
    parts = []
    for start in range(0, num_images, chunk):
        image_block = jax.device_put(_take_rows(images, start, chunk), rows)
        captions = _take_rows(texts, start * cpi, chunk * cpi)
        groups = jax.tree.map(lambda x: x.reshape(chunk, cpi, *x.shape[1:]), captions)
        groups = jax.device_put(groups, rows)
        parts.append(_ground_truth_block(sim_fn, params, image_block, groups))
    return np.concatenate(_to_host(parts))[:num_images].reshape(-1)


class RankCounts(NamedTuple):
    r"""Where the ground truth of each query ranks, up to the order of tied candidates.

    For a query, :math:`g` negatives are strictly more similar than its (best) ground truth,
    :math:`t` negatives are tied with it and :math:`m \ge 1` ground-truth candidates share that
    best value (image->text: the image's captions; always 1 for text->image). With the
    :math:`t + m` tied candidates in a uniformly random order, the 0-based rank is
    :math:`g + X`, :math:`X` the number of tied negatives placed before the first tied ground
    truth:

    .. math::

        P(X \ge x) = \binom{t}{x} \Big/ \binom{t + m}{x}
            = \prod_{j=0}^{x-1} \frac{t - j}{t + m - j}, \qquad
        E[X] = \frac{t}{m + 1}, \qquad
        P(g + X < K) = 1 - P(X \ge K - g) \ \ (K > g; \text{ else } 0).

    For :math:`m = 1`, :math:`P(g + X < K) = \mathrm{clip}((K - g) / (t + 1), 0, 1)`. Without
    ties (:math:`t = 0`) the rank is :math:`g` and every formula is the plain indicator.

    Attributes:
      greater: ``[n]`` int64 :math:`g`, negatives strictly above the ground truth.
      tied: ``[n]`` int64 :math:`t`, negatives tied with it.
      ground_truth_ties: ``[n]`` int64 :math:`m \ge 1`, ground truths at the best value.
    """

    greater: np.ndarray
    tied: np.ndarray
    ground_truth_ties: np.ndarray

    @classmethod
    def from_ranks(cls, ranks: ArrayLike) -> "RankCounts":
        """Counts of plain 0-based integer ranks (no ties): ``(ranks, 0, 1)``."""
        ranks = np.asarray(ranks)
        if ranks.ndim != 1 or np.any(ranks < 0) or np.any(ranks != np.round(ranks)):
            raise ValueError(f"ranks must be [n] non-negative integers, got {ranks!r}")
        ranks = ranks.astype(np.int64)
        return cls(ranks, np.zeros_like(ranks), np.ones_like(ranks))

    def expected_rank(self) -> np.ndarray:
        """``[n]`` float64 expected 0-based rank, :math:`g + t / (m + 1)`."""
        return self.greater + self.tied / (self.ground_truth_ties + 1.0)

    def hit_probability(self, k: int) -> np.ndarray:
        """``[n]`` float64 probability that the ground truth ranks in the top ``k``."""
        g, t, m = (np.asarray(x, np.int64)[:, None] for x in self)
        j = np.arange(k)
        # Factor j of P(X >= x); it is 0 once j >= t, where the denominator may reach 0.
        factors = np.maximum(t - j, 0) / np.maximum(t + m - j, 1)
        survival = np.concatenate([np.ones_like(factors[:, :1]), np.cumprod(factors, 1)], 1)
        need = np.clip(k - g[:, 0], 0, k)  # the rank is below k iff X < need
        miss = np.take_along_axis(survival, need[:, None], 1)[:, 0]
        return np.where(need > 0, 1.0 - miss, 0.0)


class RetrievalRanks(NamedTuple):
    """:class:`RankCounts` of the image->text (``[n_img]``) and text->image (``[n_txt]``)
    queries."""

    i2t: RankCounts
    t2i: RankCounts


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
    images, texts = _as_arrays(images), _as_arrays(texts)
    cpi = captions_per_image
    num_images, num_texts = _check_retrieval_inputs(images, texts, cpi)
    placement = _placements(mesh)
    rows, columns, multiple = placement
    ci = _round_up(min(image_chunk, num_images), multiple)
    ct = min(text_chunk, num_texts)
    gi = _round_up(max(1, min(image_chunk, text_chunk // cpi, num_images)), multiple)

    text_gt = _ground_truth(sim_fn, params, images, texts, cpi, gi, placement)
    if not np.all(np.isfinite(text_gt.astype(np.float32))):
        raise ValueError("sim_fn gave non-finite ground-truth similarities; check the features")
    tolerance = (float(tie_atol), float(tie_rtol))
    image_best, gt_ties = _best_ground_truth(text_gt, cpi, *tolerance)
    i2t = np.zeros((2, num_images), np.int64)  # (greater, tied) per image
    t2i = np.zeros((2, num_texts), np.int64)  # (greater, tied) per caption
    for i0 in range(0, num_images, ci):
        image_block = jax.device_put(_take_rows(images, i0, ci), rows)
        best_block = jax.device_put(_take_rows(image_best, i0, ci), rows)
        row_parts = []
        for t0 in range(0, num_texts, ct):
            text_block = jax.device_put(_take_rows(texts, t0, ct), columns)
            gt = jax.device_put(_take_rows(text_gt, t0, ct), columns)
            offsets = (i0, t0, num_images, cpi)
            counts = _count_block(
                sim_fn, params, image_block, text_block, best_block, gt, offsets, tolerance
            )
            row_parts.append((t0, counts))
        # One sync per image chunk bounds the blocks in flight to one row of the sweep.
        for (t0, _), counts in zip(row_parts, _to_host([c for _, c in row_parts]), strict=True):
            if counts.nonfinite:
                raise ValueError(
                    f"sim_fn gave {counts.nonfinite} non-finite similarities in block (images "
                    f"{i0}.., captions {t0}..); check the features and the model"
                )
            i2t[:, i0 : i0 + ci] += counts.i2t[:, : num_images - i0]
            t2i[:, t0 : t0 + ct] += counts.t2i[:, : num_texts - t0]
    ranks = RetrievalRanks(
        i2t=RankCounts(i2t[0], i2t[1], gt_ties),
        t2i=RankCounts(t2i[0], t2i[1], np.ones(num_texts, np.int64)),
    )
    _warn_if_all_tied(ranks, num_images, cpi)
    return ranks


def _as_counts(ranks: Any) -> RankCounts:
    if isinstance(ranks, RankCounts):
        return RankCounts(*(np.asarray(x, np.int64) for x in ranks))
    return RankCounts.from_ranks(ranks)


def rank_metrics(i2t_rank: Any, t2i_rank: Any) -> dict[str, float]:
    r"""Expected Recall@{1,5,10}, rSum, median and mean rank (SCAN conventions, fair ties).

    With :math:`r_q` the 0-based rank of query :math:`q` under a uniformly random order of
    tied candidates (:class:`RankCounts`):

    .. math::

        \mathrm{R@K} = \frac{100}{N} \sum_q P(r_q < K), \quad
        \mathrm{rSum} = \sum_{d \in \{i2t, t2i\}} \sum_{K \in \{1,5,10\}} \mathrm{R@K}_d,

        \mathrm{medr} = \lfloor \mathrm{median}_q (E[r_q] + 1) \rfloor, \quad
        \mathrm{meanr} = \frac{1}{N} \sum_q (E[r_q] + 1).

    Without ties :math:`r_q` is fixed and these are SCAN's values exactly; ``medr`` is the
    median of the expected 1-based ranks, floored (SCAN floors the median rank).

    Args:
      i2t_rank: :class:`RankCounts` of the ``n_img`` image->text queries (as returned by
        :func:`retrieval_ranks`), or ``[n_img]`` plain 0-based integer ranks.
      t2i_rank: the same for the ``n_txt`` text->image queries.

    Returns:
      ``i2t_r1, i2t_r5, i2t_r10, t2i_r1, t2i_r5, t2i_r10, rsum, i2t_medr, i2t_meanr, t2i_medr,
      t2i_meanr`` as python floats (recalls in percent).
    """
    counts = {"i2t": _as_counts(i2t_rank), "t2i": _as_counts(t2i_rank)}
    metrics = {
        f"{name}_r{k}": 100.0 * float(np.mean(c.hit_probability(k)))
        for name, c in counts.items()
        for k in RECALL_KS
    }
    metrics["rsum"] = float(sum(metrics.values()))
    for name, c in counts.items():
        rank = c.expected_rank() + 1.0
        metrics[f"{name}_medr"] = float(np.floor(np.median(rank)))
        metrics[f"{name}_meanr"] = float(np.mean(rank))
    return metrics


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
    ``rsum`` is the sum of the fold-averaged recalls (GSC spec 6.3).

    Args:
      sim_fn, images, texts, captions_per_image: as in :func:`retrieval_metrics`.
      fold_images: images per fold (default 1000); must divide ``n_img``.
      **chunks: ``image_chunk``, ``text_chunk``, ``mesh``, ``params``, ``tie_atol``,
        ``tie_rtol`` for :func:`retrieval_metrics`.

    Returns:
      The keys of :func:`retrieval_metrics`, averaged over folds.
    """
    images, texts = _as_arrays(images), _as_arrays(texts)
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


# ---------------------------------------------------------------------------------- mAP@all


def _unit_rows(x: jax.Array) -> jax.Array:
    """Rows scaled to unit L2 norm; all-zero rows stay zero (similarity 0 to everything)."""
    x = x.astype(jnp.result_type(x, float))
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x / jnp.maximum(norm, jnp.finfo(x.dtype).tiny)


_unit_rows_jit = jax.jit(_unit_rows)


@jax.jit
def _average_precision_block(
    queries: jax.Array,
    query_labels: jax.Array,
    database: jax.Array,
    database_labels: jax.Array,
) -> jax.Array:
    """``[c]`` expected AP over the whole database for a block of queries (``database`` unit
    rows), tied database items in a uniformly random order (see :func:`mean_average_precision`).
    """
    sim = jnp.matmul(_unit_rows(queries), database.T, precision=jax.lax.Precision.HIGHEST)
    # XLA sorts floats in total order (-0.0 < +0.0); make zero one key so such ties stay ties.
    key = jnp.where(sim == 0, 0.0, -sim)
    relevant = (database_labels[None, :] == query_labels[:, None]).astype(jnp.int32)
    key, relevant = jax.lax.sort((key, relevant), dimension=1, num_keys=1)
    num_items = sim.shape[1]
    position = jnp.arange(num_items)
    opens = jnp.ones_like(key[:, :1], bool)
    starts = jnp.concatenate([opens, key[:, 1:] != key[:, :-1]], axis=1)
    ends = jnp.concatenate([starts[:, 1:], opens], axis=1)
    # First and last position of each item's tie group.
    first = jax.lax.cummax(jnp.where(starts, position, 0), axis=1)
    last = jax.lax.cummin(jnp.where(ends, position, num_items - 1), axis=1, reverse=True)
    hits = jnp.cumsum(relevant, axis=1, dtype=jnp.int32)
    before = jnp.take_along_axis(hits - relevant, first, axis=1)  # relevant before the group
    in_group = jnp.take_along_axis(hits, last, axis=1) - before
    size = last - first + 1
    # Given a relevant item at this position, the other relevant items of its group fall
    # before it at rate (r - 1) / (n - 1).
    rate = jnp.where(size > 1, (in_group - 1) / jnp.maximum(size - 1, 1), 0.0).astype(sim.dtype)
    expected_hits = before + 1 + (position - first) * rate
    # Without ties: (0 or 1) * (hits / j), bit for bit the untied AP.
    rank = jnp.arange(1, num_items + 1, dtype=sim.dtype)
    precision = (in_group / size).astype(sim.dtype) * (expected_hits / rank)
    precision_sum = jnp.sum(precision, axis=1)
    num_relevant = hits[:, -1]
    return jnp.where(num_relevant > 0, precision_sum / jnp.maximum(num_relevant, 1), 0.0)


def _check_embeddings(emb: Any, labels: Any, name: str) -> tuple[Any, Any]:
    emb, labels = _as_array(emb), _as_array(labels)
    if emb.ndim != 2 or labels.ndim != 1 or labels.shape[0] != emb.shape[0] or not emb.shape[0]:
        raise ValueError(
            f"{name} must be [N, L] embeddings with [N] labels (N > 0), got {tuple(emb.shape)} "
            f"and {tuple(labels.shape)}"
        )
    finite = np.isfinite(emb).all() if isinstance(emb, np.ndarray) else jnp.isfinite(emb).all()
    if not bool(finite):
        raise ValueError(f"{name} embeddings contain NaN or Inf")
    return emb, labels


def mean_average_precision(
    queries: ArrayLike,
    query_labels: ArrayLike,
    database: ArrayLike,
    database_labels: ArrayLike,
    *,
    chunk: int = 1024,
    mesh: Mesh | None = None,
) -> float:
    r"""mAP@all with cosine similarity and single-label relevance (MRL protocol).

    For query :math:`q`, the database is sorted by cosine similarity descending (:math:`\pi`),
    :math:`\mathrm{rel}_j = \mathbb 1[y_{\pi(j)} = y_q]` and

    .. math::

        \mathrm{AP}(q) = \frac{\sum_{j=1}^{N_d} \mathrm{rel}_j
            \frac{\sum_{l \le j} \mathrm{rel}_l}{j}}{\sum_{j=1}^{N_d} \mathrm{rel}_j}
        \quad (\mathrm{AP} = 0 \text{ without relevant items}), \qquad
        \mathrm{mAP} = \frac{1}{N_q} \sum_q \mathrm{AP}(q).

    Ties favour nothing: AP is its expectation over a uniformly random order within each group
    of database items with equal similarity (``-0.0`` and ``+0.0`` are one value), computed
    exactly (MRL's numpy argsort leaves their order unspecified, a stable sort would favour
    database order). A group of :math:`n` items after :math:`o` others, holding :math:`r`
    relevant items with :math:`h` relevant before it, adds to the precision sum

    .. math::

        \sum_{j=1}^{n} \frac{r}{n} \cdot
            \frac{h + 1 + (j - 1) \frac{r - 1}{n - 1}}{o + j}
        \quad (\text{the } \tfrac{r - 1}{n - 1} \text{ term is 0 for } n = 1):

    position :math:`o + j` is relevant with probability :math:`r / n`, and then each of the
    :math:`j - 1` group positions before it holds one of the other :math:`r - 1` relevant items
    with probability :math:`(r - 1) / (n - 1)`. Without ties this is the AP above. All-zero
    query or database embeddings give the AP of a random ranking. Ties are exact equality:
    identical database rows give bitwise-equal similarities (one matmul). Rows are
    L2-normalised with zero-norm rows kept at zero (similarity 0 to everything). Queries run on
    device in blocks of ``chunk`` rows (last block padded, so one compilation) against the
    whole database.

    Args:
      queries: ``[N_q, L]`` query embeddings.
      query_labels: ``[N_q]`` integer class labels.
      database: ``[N_d, L]`` database embeddings.
      database_labels: ``[N_d]`` integer class labels.
      chunk: queries per block (default 1024; clipped to ``N_q``).
      mesh: optional mesh; query rows are sharded over all its axes and the database is
        replicated. Default: ``jax.devices()[0]``.

    Returns:
      mAP in ``[0, 1]`` as a python float.

    References:
      Hu et al., "Learning Cross-Modal Retrieval with Noisy Labels" (MRL), CVPR 2021;
      UOT-RCL spec section 7 (the paper's Eq. 20 is a mis-statement of this AP).
      McSherry and Najork, ECIR 2008 (AP under tied scores).
    """
    queries, query_labels = _check_embeddings(queries, query_labels, "queries")
    database, database_labels = _check_embeddings(database, database_labels, "database")
    if queries.shape[1] != database.shape[1]:
        raise ValueError(f"embedding widths differ: {queries.shape[1]} vs {database.shape[1]}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    rows, replicated, multiple = _placements(mesh)
    num_queries = queries.shape[0]
    block = _round_up(min(chunk, num_queries), multiple)
    database = _unit_rows_jit(jax.device_put(database, replicated))
    database_labels = jax.device_put(database_labels, replicated)
    parts = []
    for start in range(0, num_queries, block):
        query_block, label_block = jax.device_put(
            _take_rows((queries, query_labels), start, block), rows
        )
        parts.append(_average_precision_block(query_block, label_block, database, database_labels))
    ap = np.concatenate(_to_host(parts))[:num_queries]
    return float(np.mean(ap, dtype=np.float64))


def category_retrieval_metrics(
    image_emb: ArrayLike,
    image_labels: ArrayLike,
    text_emb: ArrayLike,
    text_labels: ArrayLike,
    *,
    chunk: int = 1024,
    mesh: Mesh | None = None,
) -> dict[str, float]:
    """mAP@all in both directions: image queries over texts and text queries over images.

    Args:
      image_emb: ``[N_i, L]`` image embeddings; image_labels: ``[N_i]``.
      text_emb: ``[N_t, L]`` text embeddings; text_labels: ``[N_t]``.
      chunk, mesh: as in :func:`mean_average_precision`.

    Returns:
      ``{'map_i2t', 'map_t2i', 'map_avg'}``; ``map_avg`` (their mean) is the UOT-RCL model
      selection criterion.
    """
    kwargs = {"chunk": chunk, "mesh": mesh}
    map_i2t = mean_average_precision(image_emb, image_labels, text_emb, text_labels, **kwargs)
    map_t2i = mean_average_precision(text_emb, text_labels, image_emb, image_labels, **kwargs)
    return {"map_i2t": map_i2t, "map_t2i": map_t2i, "map_avg": 0.5 * (map_i2t + map_t2i)}


# --------------------------------------------------------------------------- noise detection


def noise_detection_metrics(
    clean_score: ArrayLike, clean_mask: ArrayLike, *, threshold: float = 0.5
) -> dict[str, float]:
    r"""How well a per-pair clean score separates clean from noisy training pairs (host numpy).

    ROC AUC for the clean class by the Mann-Whitney statistic with average ranks for ties
    (``scipy.stats.rankdata``),
    :math:`\mathrm{AUC} = (\sum_{k \in C} R_k - |C|(|C|+1)/2) / (|C|\,|N|)`, i.e. the
    probability that a random clean pair scores above a random noisy one (ties count 1/2, the
    expectation under a random order of tied scores, so ties favour neither class).
    Predicted clean means ``clean_score > threshold``; precision and recall are those of the
    predicted-clean set against the truly clean pairs. O(N log N), float64.

    Args:
      clean_score: ``[N]`` estimate that each pair is clean (higher is cleaner), e.g. a GMM
        posterior.
      clean_mask: ``[N]`` bool (or 0/1) truth, True for clean pairs. Diagnostics only.
      threshold: the cut for predicted clean (default 0.5).

    Returns:
      ``noise_auc`` (NaN if only one class is present), ``noise_precision`` (NaN if nothing is
      predicted clean), ``noise_recall`` (NaN if nothing is clean), ``noise_accuracy``.
    """
    score = np.asarray(clean_score, dtype=np.float64)
    mask = np.asarray(clean_mask)
    if score.ndim != 1 or mask.shape != score.shape or not score.size:
        raise ValueError(
            f"clean_score and clean_mask must be [N] with N > 0, got {score.shape}, {mask.shape}"
        )
    if mask.dtype != bool and not np.isin(mask, (0, 1)).all():
        raise ValueError("clean_mask must be bool or 0/1")
    if not np.isfinite(score).all():
        raise ValueError("clean_score contains NaN or Inf")
    mask = mask.astype(bool)
    num_clean = int(mask.sum())
    num_noisy = mask.size - num_clean
    if num_clean and num_noisy:
        clean_rank_sum = scipy.stats.rankdata(score, method="average")[mask].sum()
        auc = (clean_rank_sum - num_clean * (num_clean + 1) / 2.0) / (num_clean * num_noisy)
    else:
        auc = float("nan")
    predicted = score > threshold
    true_positive = int(np.sum(predicted & mask))
    num_predicted = int(predicted.sum())
    return {
        "noise_auc": float(auc),
        "noise_precision": true_positive / num_predicted if num_predicted else float("nan"),
        "noise_recall": true_positive / num_clean if num_clean else float("nan"),
        "noise_accuracy": float(np.mean(predicted == mask)),
    }
