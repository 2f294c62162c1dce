"""UOT-RCL label estimation: confident set, consistent cost, targets, relation scores.

The per-epoch pieces of UOT-RCL (the paper's Secs. IV-A and IV-B1, Eqs. 4-9) and the
per-batch relation scores (Sec. IV-C, Eqs. 16-17):

* :func:`jensen_shannon` / :func:`jensen_shannon_pairwise`: the divergence used for
  the confident set (Eq. 4) and for the relation cost (Eq. 17).
* :func:`confident_set`: the ``per_class`` most cross-modally consistent pairs of
  each predicted class (Eqs. 4-5); :func:`random_confident_set` for the ablation.
* :func:`knn_cosine`: chunked top-k cosine neighbours (the sets N_i of Eq. 8);
  :func:`knn_cosine_blocks`, an approximate search among nearby rows for large ``N``.
* :func:`modal_consistency`: the ratios C^v, C^t of Eq. 7, clipped.
* :func:`consistent_cost`: the cost C_S of Eq. 8, floored and shifted to ``>= 0``.
* :func:`update_targets`: the momentum update of the soft targets (Eq. 9).
* :func:`relation_scores`: masked softmax over the confident anchors (Eq. 16).

Every function is pure and jittable; sizes (``per_class``, ``k``, ``chunk``,
``num_samples``, ...) are keyword python ints and must be static under ``jit``.
Per-epoch similarities use ``Precision.HIGHEST`` (as ``ncljax.evaluate`` does) so
neighbour and nearest-anchor rankings do not depend on the accelerator's default
matmul precision; :func:`relation_scores` runs inside the train step and keeps the
default precision.

References:
  Han, Luo, Liu, Nan, "A Unified Optimal Transport Framework for Cross-Modal
  Retrieval with Noisy Labels" (UOT-RCL), arXiv 2403.13480; equation and section
  numbers are the paper's (no official code was released).
"""

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

_LOG_2 = math.log(2.0)
_HIGHEST = lax.Precision.HIGHEST


class ConfidentSet(NamedTuple):
    """A fixed-shape confident set :math:`\\mathcal{G}` (Eq. 5).

    Slots are class-major: slot ``k * per_class + j`` holds the ``j``-th most
    consistent sample predicted as class ``k``.

    Attributes:
      index: int32 ``[K * per_class]`` dataset positions; 0 in masked slots.
      mask: bool ``[K * per_class]``; False for slots of classes with fewer than
        ``per_class`` predicted members.
    """

    index: jax.Array
    mask: jax.Array


def _as_float(x: ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _unit_rows(x: ArrayLike, eps: float = 1e-12) -> jax.Array:
    """Rows scaled to unit L2 norm; rows with norm below ``eps`` become ~0, not NaN."""
    x = _as_float(x)
    sq = jnp.sum(x * x, axis=-1, keepdims=True)
    # max() inside rsqrt keeps the gradient finite at a zero row.
    return x * lax.rsqrt(jnp.maximum(sq, eps * eps))


def _positive_ints(**values) -> None:
    """Refuses a static size or count that is not a positive integer, in one line."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def embeddings(z: ArrayLike) -> jax.Array:
    """``[N, D]`` embeddings as unit rows (:func:`_unit_rows`), or one error."""
    unit = _unit_rows(z)
    if unit.ndim != 2:
        raise ValueError(f"z must be [N, D] embeddings, got shape {unit.shape}")
    return unit


def jensen_shannon(p: ArrayLike, q: ArrayLike, *, axis: int = -1) -> jax.Array:
    r"""Jensen-Shannon divergence between distributions along ``axis``.

    .. math::
      \mathrm{JSD}(p,q)=\tfrac12\mathrm{KL}(p\,\|\,m)+\tfrac12\mathrm{KL}(q\,\|\,m),
      \qquad m=\tfrac12(p+q),\qquad \mathrm{KL}(p\|m)=\sum_k p_k\log\frac{p_k}{m_k}

    with the natural log and :math:`0\log 0 := 0`, so zeros in ``p`` or ``q`` are
    allowed and the gradient stays finite there. Each term is evaluated as
    :math:`p_k\log(1+x_k)` with :math:`x_k=(p_k-q_k)/(p_k+q_k)`, which is accurate
    for nearly equal distributions. The result is clipped to
    :math:`[0, \log 2]` to remove rounding below 0 or above ``log 2``.

    Args:
      p: ``[..., K, ...]`` probabilities (non-negative, summing to 1 along ``axis``).
      q: same shape as ``p`` (or broadcastable to it).
      axis: the distribution axis, reduced away.

    Returns:
      ``[...]`` divergences (``p``'s batch shape with ``axis`` removed).

    References:
      UOT-RCL Sec. IV-A, Eq. 4 (the definition, ``d_i``) and Sec. IV-C, Eq. 17.
    """
    p, q = _as_float(p), _as_float(q)
    total = p + q
    # log(p / m) = log1p(x) with x = (p - q) / (p + q). With the flat posteriors of
    # UOT-RCL (d ~ 1e-4) this keeps float32 JSD to ~1e-6 relative error, where
    # log(p / m) loses ~3e-5 to cancellation and reorders near-ties of the confident set.
    x = jnp.where(total > 0, (p - q) / jnp.where(total > 0, total, 1.0), 0.0)
    # The inner where keeps log1p(-1) = -inf (and its gradient) out of dropped terms.
    term_p = jnp.where(p > 0, p * jnp.log1p(jnp.where(p > 0, x, 0.0)), 0.0)
    term_q = jnp.where(q > 0, q * jnp.log1p(jnp.where(q > 0, -x, 0.0)), 0.0)
    divergence = 0.5 * jnp.sum(term_p + term_q, axis=axis)
    return jnp.clip(divergence, 0.0, _LOG_2)


def jensen_shannon_pairwise(p: ArrayLike, q: ArrayLike) -> jax.Array:
    r"""All-pairs JSD between the rows of ``p`` and the rows of ``q``.

    .. math::
      C_{ij} = \mathrm{JSD}(p_i, q_j)
        = \tfrac12 \sum_k \Big(p_{ik}\log\frac{p_{ik}}{c_k} + q_{jk}\log\frac{q_{jk}}{c_k}\Big)
          - \sum_k m_{ijk}\log\frac{m_{ijk}}{c_k},
      \qquad m_{ij} = \tfrac12(p_i + q_j),

    for any positive ``c`` (its terms cancel, as ``m`` sums what ``p`` and ``q`` do); here
    ``c_k`` is the mean of ``p``'s and ``q``'s column ``k``, so that the logarithms are small
    and the difference loses little to cancellation. The per-row sums are computed once,
    leaving one logarithm per ``(i, j, k)`` where :func:`jensen_shannon` takes two and a
    division (3x faster at ``1,024 x 1,024 x 50``). Its absolute error is about ``1e-8``
    in float32, 2e-6 of the largest divergence in UOT-RCL's relation cost at ``tau_2 = 1``
    (:func:`jensen_shannon`'s per-pair form: 2e-7), so divergences far smaller than the
    largest are less accurate than there. ``0 log 0 := 0``, and the gradient stays finite
    at zeros. Clipped to :math:`[0, \log 2]`.

    It broadcasts to a ``[B, B', G]`` intermediate, i.e. ``B * B' * G`` floats
    (``500 * 500 * 1000 = 2.5e8`` floats = 1 GB in float32 with NUS-WIDE's batch of 500
    and XMediaNet's 1000 anchors together, UOT-RCL Sec. V-B; ``100 * 100 * 1000 = 1e7``
    for XMediaNet), fused into the sum where the compiler can. Chunk the rows of ``p``
    with ``lax.map`` if that is too much.

    Args:
      p: ``[B, G]`` row distributions (e.g. image relation scores ``R^v``).
      q: ``[B', G]`` row distributions (e.g. text relation scores ``R^t``).

    Returns:
      ``[B, B']`` divergences in :math:`[0, \log 2]`.

    References:
      UOT-RCL Sec. IV-C, Eq. 17 (the relation cost; the paper's index ``i`` on ``R^t``
      is a typo for ``j``: with it every row of the cost would be constant).
    """
    p, q = _as_float(p), _as_float(q)
    # the result does not depend on c, nor (so) its gradient
    centre = lax.stop_gradient(0.5 * (jnp.mean(p, axis=0) + jnp.mean(q, axis=0)))
    scale = 1.0 / jnp.maximum(centre, jnp.finfo(centre.dtype).tiny)  # x / c <= 2 N

    def plogp(x):  # x log(x / c), 0 at x = 0, with a finite gradient there
        positive = x > 0
        return jnp.where(positive, x * jnp.log(jnp.where(positive, x * scale, 1.0)), 0.0)

    own = 0.5 * (jnp.sum(plogp(p), axis=-1)[:, None] + jnp.sum(plogp(q), axis=-1)[None, :])
    mixed = jnp.sum(plogp(0.5 * (p[:, None, :] + q[None, :, :])), axis=-1)
    return jnp.clip(own - mixed, 0.0, _LOG_2)


def confident_set(p_image: ArrayLike, p_text: ArrayLike, *, per_class: int = 5) -> ConfidentSet:
    r"""The ``per_class`` most cross-modally consistent pairs of each predicted class.

    .. math::
      d_i=\mathrm{JSD}(p_i^v,p_i^t),\qquad
      \hat c_i=\arg\max_k \tfrac12(p^v_{ik}+p^t_{ik}),\qquad
      \mathcal{G}_k=\{\text{the } \min(n_G, |\{i:\hat c_i=k\}|)
      \text{ samples with } \hat c_i=k \text{ and the smallest } d_i\}

    Choices the paper leaves open or only implies (Sec. IV-A): classes are the
    *predicted* ones (the paper's average prediction), not the noisy labels; ties in
    ``d`` are broken by the lower index (and ties in the argmax by the lower class); a
    class with fewer than ``per_class`` predicted members (possibly none) gets masked
    slots. Implemented as one lexicographic sort of ``(class, d, index)``:
    ``O(N log N)``, no ``[K, N]`` buffer.

    Args:
      p_image: ``[N, K]`` image class posteriors :math:`p^v`.
      p_text: ``[N, K]`` text class posteriors :math:`p^t`.
      per_class: :math:`n_G`, slots per class (static; default 5).

    Returns:
      :class:`ConfidentSet` with ``index`` int32 ``[K * per_class]`` (class-major;
      0 where masked) and ``mask`` bool ``[K * per_class]``.

    References:
      UOT-RCL Sec. IV-A, Eqs. 4-5.
    """
    p_image, p_text = _as_float(p_image), _as_float(p_text)
    num_samples, num_classes = p_image.shape
    divergence = jensen_shannon(p_image, p_text)
    predicted = jnp.argmax(p_image + p_text, axis=-1).astype(jnp.int32)
    position = jnp.arange(num_samples, dtype=jnp.int32)
    _, _, order = lax.sort((predicted, divergence, position), num_keys=3)

    counts = jnp.bincount(predicted, length=num_classes)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(per_class)
    mask = slot[None, :] < counts[:, None]
    rows = jnp.clip(starts[:, None] + slot[None, :], 0, num_samples - 1)
    index = jnp.where(mask, order[rows], 0)
    return ConfidentSet(index=index.reshape(-1).astype(jnp.int32), mask=mask.reshape(-1))


def random_confident_set(
    key: jax.Array, num_samples: int, *, num_classes: int, per_class: int = 5
) -> ConfidentSet:
    """A random confident set for the "w/o confident set" ablation (Table IV).

    ``num_classes * per_class`` distinct indices drawn uniformly without
    replacement (the paper only says it selects "random samples" into the confident
    set, Sec. V-F; drawing without replacement avoids duplicate anchors). If
    ``num_samples`` is smaller than the number of slots, every sample is used once and
    the remaining slots are masked.

    Args:
      key: a ``jax.random.key``.
      num_samples: :math:`N`, the dataset size (static).
      num_classes: :math:`K` (static).
      per_class: :math:`n_G` (static; default 5).

    Returns:
      :class:`ConfidentSet` with ``[num_classes * per_class]`` fields.

    References:
      UOT-RCL Sec. V-F, Table IV (ablation).
    """
    size = num_classes * per_class
    order = jax.random.permutation(key, num_samples).astype(jnp.int32)
    taken = min(size, num_samples)
    index = jnp.zeros((size,), jnp.int32).at[:taken].set(order[:taken])
    mask = jnp.arange(size) < taken
    return ConfidentSet(index=index, mask=mask)


def knn_cosine(
    z: ArrayLike,
    *,
    k: int,
    chunk: int = 2048,
    exclude_self: bool = True,
    key_chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Top-``k`` cosine neighbours of every row, computed over query chunks.

    .. math::
      \mathcal{N}_i=\operatorname{top-}k_{j\,(\neq i)}\ \cos(z_i,z_j)

    Rows are normalised first (zero rows stay zero, so their similarity to
    everything is 0). Queries are padded to a multiple of ``chunk`` and processed
    by ``lax.map``, so only a ``[chunk, N]`` similarity block (plus the ``[N, D]``
    embeddings) exists at a time: ``chunk * N`` floats, e.g. ``2048 * 42941`` =
    352 MB in float32 for NUS-WIDE. With ``key_chunk`` the candidates are scanned in
    blocks of that many rows too, a running top-``k`` merged with each block, so the
    similarity block is ``chunk * key_chunk`` floats whatever ``N`` (the result itself,
    ``[N, k]``, remains). Ties are broken by the lower index (``lax.top_k``), in both
    forms: the running top-``k`` holds only lower indices than the block it meets.

    Excluding self is ncljax's choice (the paper does not say); ``exclude_self=False``
    includes it (usually as the first neighbour, with similarity 1).

    Args:
      z: ``[N, D]`` embeddings.
      k: :math:`\kappa`, neighbours per row (static; ``k <= N - 1`` when
        excluding self, ``k <= N`` otherwise).
      chunk: query rows per block (static; clipped to ``N``).
      exclude_self: drop ``j = i`` from the candidates (static).
      key_chunk: candidate rows per block (static), or ``None``: all ``N`` at once.

    Returns:
      ``(index, similarity)``: int32 ``[N, k]`` neighbour positions and ``[N, k]``
      their cosine similarities, in descending order of similarity.

    References:
      UOT-RCL Sec. IV-B1, Eq. 8 (neighbour sets; :math:`\kappa` is about 5 per mille of
      the training set, Sec. V-B, hence a chunked search over the whole set).
    """
    _positive_ints(chunk=chunk, **({} if key_chunk is None else {"key_chunk": key_chunk}))
    unit = embeddings(z)
    num_samples = unit.shape[0]
    limit = num_samples - 1 if exclude_self else num_samples
    if not 1 <= k <= limit:
        raise ValueError(f"k={k} must be in [1, {limit}] for N={num_samples}")
    chunk = max(1, min(chunk, num_samples))
    num_chunks = -(-num_samples // chunk)
    padded = jnp.pad(unit, ((0, num_chunks * chunk - num_samples), (0, 0)))
    queries = padded.reshape(num_chunks, chunk, -1)
    starts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    columns = jnp.arange(num_samples, dtype=jnp.int32)

    def block(args):
        query, start = args
        sim = jnp.matmul(query, unit.T, precision=_HIGHEST)
        if exclude_self:
            rows = start + jnp.arange(chunk, dtype=jnp.int32)
            sim = jnp.where(rows[:, None] == columns[None, :], -jnp.inf, sim)
        return lax.top_k(sim, k)

    if key_chunk is not None:
        block = functools.partial(_knn_block_scan, unit, k, exclude_self, key_chunk, chunk)
    similarity, index = lax.map(block, (queries, starts))
    similarity = similarity.reshape(-1, k)[:num_samples]
    index = index.reshape(-1, k)[:num_samples].astype(jnp.int32)
    return index, similarity


def knn_cosine_blocks(
    z: ArrayLike,
    *,
    k: int,
    key: jax.Array,
    block: int = 1024,
    probes: int = 16,
    exclude_self: bool = True,
    sample: int = 32,
    iterations: int = 10,
    fanout: int = 64,
) -> tuple[jax.Array, jax.Array]:
    r"""Approximate top-``k`` cosine neighbours of every row, searched among nearby rows
    only (an inverted-file search with equal lists; ncljax's).

    The exact search (:func:`knn_cosine`) compares every row with every other: ``N^2 D``
    work, hours at ``10^6`` rows on a CPU. Here the rows are ordered by their nearest of
    ``B = ceil(N / block)`` k-means centroids (Lloyd's algorithm on ``sample`` rows per
    centroid, ``iterations`` steps from centroids drawn among them), so that rows of one
    region of the sphere sit together, and the order is cut into blocks of ``block`` rows
    (the last may be short). The rows of a block search the ``probes`` blocks whose mean
    directions are nearest its own (its own included): ``N * probes * block * D`` work,
    one ``block x probes * block`` similarity at a time, beside the rows in block order
    (``N x D``). One k-means of ``B`` centroids would compare every row with every
    centroid, ``N B D`` work, growing with ``N^2 / block``; where ``B`` is more than
    ``fanout`` the rows are ordered by their leaf of a k-means tree instead
    (:func:`tree_fans`: a k-means of ``fanout`` centroids, then one in each node, level
    by level; at ``10^7`` rows in blocks of 1,024 each row meets 64 + 13 + 13 centroids,
    against 9,766). A neighbour outside the searched blocks is missed; the recall is measured in
    ``benchmarks/RESULTS.md``. With ``probes`` equal to the number of blocks the search
    is exact, ties included: equal similarities go to the lower row, as in
    :func:`knn_cosine`.

    Args:
      z: ``[N, D]`` embeddings (rows normalised first, as :func:`knn_cosine`).
      k: neighbours per row (static; at most the fewest rows a block searches, less one
        excluding self: :func:`blocks_capacity`, at least ``(probes - 1) * block``).
      key: the random sample and centroids of the k-means.
      block: rows per block (static, a positive integer).
      probes: blocks each block searches (static, a positive integer; clipped to the
        number of blocks).
      exclude_self: drop ``j = i`` from the candidates (static).
      sample: k-means rows per centroid (static, a positive integer; clipped to ``N``).
      iterations: Lloyd iterations of the k-means (static, a positive integer).
      fanout: the most centroids of one k-means (static, at least 2): more blocks than
        this are ordered by the k-means tree of :func:`tree_fans`.

    Returns:
      ``(index, similarity)`` as :func:`knn_cosine`: int32 ``[N, k]`` and ``[N, k]`` in
      descending order of similarity.
    """
    _positive_ints(block=block, probes=probes, sample=sample, iterations=iterations)
    check_fanout(fanout)
    unit = embeddings(z)
    num_samples = unit.shape[0]
    check_block_k(num_samples, k, block, probes, exclude_self=exclude_self)
    block = min(block, num_samples)
    num_blocks = -(-num_samples // block)
    probes = min(probes, num_blocks)
    order = _block_order(unit, num_blocks, key, sample, iterations, fanout)
    padded = num_blocks * block
    position = jnp.pad(order, (0, padded - num_samples), constant_values=num_samples)
    rows = jnp.pad(unit, ((0, 1), (0, 0)))[position].reshape(num_blocks, block, -1)
    centres = _unit_rows(jnp.sum(rows, axis=1))  # padding rows are 0
    near, _ = knn_cosine(centres, k=probes, exclude_self=False)  # [blocks, probes]

    def search(args):
        b, probe = args
        column = (probe[:, None] * block + jnp.arange(block)).reshape(-1)  # slots searched
        return search_block(
            rows[b],
            rows.reshape(padded, -1)[column],
            column,
            b,
            position,
            num_samples,
            k,
            exclude_self,
        )

    blocks = jnp.arange(num_blocks, dtype=jnp.int32)
    similarity, found = lax.map(search, (blocks, near))
    similarity, found = similarity.reshape(padded, k), found.reshape(padded, k)
    # back from the sorted order to the rows' own (padding rows are dropped)
    index = jnp.zeros((num_samples, k), jnp.int32).at[position].set(found, mode="drop")
    sims = (
        jnp.full((num_samples, k), -jnp.inf, unit.dtype).at[position].set(similarity, mode="drop")
    )
    return index, sims


def search_block(
    query, probe_rows, column, b, position, num_samples: int, k: int, exclude_self: bool
):
    """One block's top-``k`` in :func:`knn_cosine_blocks`: ``(similarity [block, k],
    rows [block, k])``.

    Args:
      query: ``[block, D]`` the block's unit rows (in block order).
      probe_rows: ``[probes * block, D]`` the unit rows of the blocks it searches, at the
        slots ``column``.
      column: int ``[probes * block]`` those slots (positions in block order).
      b: the block's own number (its slots are ``b * block + [0, block)``).
      position: int ``[blocks * block]`` the row at each slot (``N``: padding).
      num_samples: ``N`` (static).
      k, exclude_self: as :func:`knn_cosine_blocks` (static).
    """
    block = query.shape[0]
    # the candidates in the order of their rows, so that top_k breaks a tie by the lower
    # row (padding last)
    order = jnp.argsort(position[column], stable=True)
    column = column[order]
    sim = jnp.matmul(query, probe_rows[order].T, precision=_HIGHEST)
    drop = position[column][None, :] >= num_samples  # padding
    if exclude_self:
        drop = drop | (column[None, :] == b * block + jnp.arange(block)[:, None])
    top, at = lax.top_k(jnp.where(drop, -jnp.inf, sim), k)
    return top, position[column[at]]


def check_block_k(num_samples: int, k: int, block: int, probes: int, *, exclude_self: bool):
    """One error where ``k`` neighbours are more than :func:`knn_cosine_blocks` can find
    for ``N = num_samples`` rows (:func:`blocks_capacity`), or fewer than one."""
    limit = blocks_capacity(num_samples, block, probes, exclude_self=exclude_self)
    if not 1 <= k <= limit:
        raise ValueError(
            f"k={k} neighbours must be in [1, {limit}]: N={num_samples} rows in blocks of "
            f"{block}, each block searching {probes}, leave at least {limit} "
            "candidates per row"
            + ("" if limit >= num_samples - 1 else "; raise block or probes, or lower k")
            + "."
        )


def blocks_capacity(num_samples: int, block: int, probes: int, *, exclude_self: bool = True):
    """The most neighbours :func:`knn_cosine_blocks` can return per row for ``N =
    num_samples`` rows: the fewest rows any block searches, less one excluding self. That
    is ``N`` where ``probes`` covers every block, else ``probes - 1`` full blocks of
    ``block`` rows and the last block, which may be short (``N - (B - 1) block`` rows of
    ``B = ceil(N / block)`` blocks): at least ``(probes - 1) * block + 1``."""
    block = max(1, min(block, num_samples))
    num_blocks = -(-num_samples // block)
    if min(probes, num_blocks) == num_blocks:
        fewest = num_samples
    else:
        fewest = (probes - 1) * block + num_samples - (num_blocks - 1) * block
    return fewest - (1 if exclude_self else 0)


def _block_order(
    unit, num_clusters: int, key, sample: int, iterations: int, fanout: int
) -> jax.Array:
    """The rows in the block search's order: by their nearest of ``num_clusters`` k-means
    centroids (stable within a centroid; :func:`lloyd_centroids` on ``sample`` rows per
    centroid, from centroids drawn among them), or where that is more than ``fanout``
    centroids, by their leaf of the k-means tree of :func:`tree_fans`."""
    num_samples = unit.shape[0]
    if num_clusters == 1:
        return jnp.arange(num_samples, dtype=jnp.int32)
    fans = tree_fans(num_clusters, fanout)
    if fans is None:
        chosen, start = kmeans_draw(key, num_samples, num_clusters, sample)
        points = unit[chosen]
        centroids = lloyd_centroids(points, points[start], iterations=iterations)
        return jnp.argsort(nearest_centroid(unit, centroids), stable=True).astype(jnp.int32)
    leaf = jnp.zeros(num_samples, jnp.int32)
    for level, fan in enumerate(fans):
        groups = math.prod(fans[:level])
        if level == 0:  # one node (and nothing for XLA to fold at compile time)
            members, counts = jnp.arange(num_samples), jnp.full(1, num_samples)
        else:  # the rows of each node together
            members, counts = jnp.argsort(leaf, stable=True), jnp.bincount(leaf, length=groups)
        slots = tree_draw(key, level, counts, fan, sample)
        centroids = group_centroids(unit[members[slots]], clusters=fan, iterations=iterations)
        found = nearest_in_node(unit, leaf[members], centroids, index=members, rows=NODE_ROWS)
        leaf = leaf * fan + jnp.zeros_like(leaf).at[members].set(found)
    return jnp.argsort(leaf, stable=True).astype(jnp.int32)


# rows per chunk of nearest_in_node in the k-means tree (the form on disk reads whole chunks)
NODE_ROWS = 1024


def check_fanout(fanout) -> None:
    """One error where the k-means tree's ``fanout`` is not an integer of at least 2."""
    if isinstance(fanout, bool) or not isinstance(fanout, numbers.Integral) or fanout < 2:
        raise ValueError(f"fanout must be an integer of at least 2, got {fanout!r}.")


def tree_fans(num_clusters: int, fanout: int) -> tuple[int, ...] | None:
    """The block search's k-means tree for ``num_clusters`` blocks: the centroids of each
    level's k-means, or ``None`` where one k-means orders the rows (``num_clusters <=
    fanout``).

    One k-means compares every row with every centroid, ``N * num_clusters`` work: with
    ``num_clusters = N / block`` it grows with ``N^2``. The tree splits the rows by a
    k-means of ``fanout`` centroids, then the rows of each node by their own k-means of
    ``fan`` centroids, level after level, until there are at least ``num_clusters``
    leaves: ``(fanout, fan, ..., fan)`` with the fewest levels, then the least ``fan``.
    Each row is compared with ``fanout + (levels - 1) fan`` centroids: ``N log N`` work.
    The first level is the widest, so that the regions of the data fall to whole nodes
    before any node is split further (measured in ``benchmarks/RESULTS.md``).
    """
    if num_clusters <= fanout:
        return None
    levels, leaves = 1, fanout
    while leaves < num_clusters:
        levels, leaves = levels + 1, leaves * fanout
    rest = -(-num_clusters // fanout)  # leaves each first-level node needs
    fan = max(2, math.ceil(rest ** (1.0 / (levels - 1))) - 1)
    while fan ** (levels - 1) < rest:
        fan += 1
    return (fanout,) + (fan,) * (levels - 1)


def tree_draw(key, level: int, counts: ArrayLike, fan: int, sample: int) -> jax.Array:
    """The rows of one level of the k-means tree's k-means: for each node, ``sample * fan``
    offsets among its ``counts`` rows, drawn uniformly with replacement (the first
    ``fan`` of them its first centroids), as slots of the rows sorted by node: int32
    ``[nodes, sample * fan]``. An empty node draws the slot where its rows would start
    (its centroids order no row). Keys: ``key`` folded with ``level``."""
    counts = jnp.asarray(counts, jnp.int32)
    size = sample * fan
    u = jax.random.uniform(jax.random.fold_in(key, level), (counts.shape[0], size))
    offset = jnp.minimum(
        jnp.floor(u * counts[:, None]).astype(jnp.int32), jnp.maximum(counts[:, None] - 1, 0)
    )
    first = jnp.cumsum(counts) - counts
    return jnp.minimum(first[:, None] + offset, jnp.sum(counts) - 1)


def group_centroids(points: ArrayLike, *, clusters: int, iterations: int) -> jax.Array:
    """:func:`lloyd_centroids` in each group, from the group's first ``clusters`` points:
    ``points`` ``[G, M, D]``; returns ``[G, clusters, D]``."""
    points = _as_float(points)
    return jax.vmap(lambda p: lloyd_centroids(p, p[:clusters], iterations=iterations))(points)


def nearest_in_node(
    x: ArrayLike,
    node: ArrayLike,
    centroids: ArrayLike,
    *,
    index: ArrayLike | None = None,
    rows: int = 1024,
    window: int = 4,
) -> jax.Array:
    """Each row's nearest centroid of its own node in Euclidean distance (the lower index
    on a tie), for rows sorted by node, ``rows`` rows at a time.

    A chunk of sorted rows meets few nodes: it is compared with the centroids of the
    ``window`` nodes from its first row's (one matrix product, ``rows x window C``); a
    chunk that meets more nodes than that gathers each row's own centroids instead.

    Args:
      x: ``[N, D]`` rows, sorted by ``node``; or with ``index``, any ``[M, D]``.
      node: int ``[N]`` each row's node, non-decreasing.
      centroids: ``[G, C, D]`` each node's centroids.
      index: optional int ``[N]``: the rows are ``x[index]``, read a chunk at a time.
      rows: rows per chunk (static); the last chunk is padded with the last row.
      window: nodes a chunk's product covers (static).

    Returns:
      int32 ``[N]``, in ``[0, C)``.
    """
    x, centroids = _as_float(x), _as_float(centroids)
    node = jnp.asarray(node, jnp.int32)
    num_nodes, num_centroids, dim = centroids.shape
    num_samples = node.shape[0]
    index = jnp.arange(num_samples) if index is None else jnp.asarray(index)
    rows = max(1, min(rows, num_samples))
    window = min(window, num_nodes)
    padded = -(-num_samples // rows) * rows
    index = jnp.pad(index, (0, padded - num_samples), mode="edge").reshape(-1, rows)
    node = jnp.pad(node, (0, padded - num_samples), mode="edge").reshape(-1, rows)
    half_norm = 0.5 * jnp.sum(centroids * centroids, axis=-1)  # [G, C]

    def chunk(args):
        index, node = args
        x_rows = x[index]
        first = jnp.clip(node[0], 0, num_nodes - window)
        local = node - first

        def windowed():
            near = lax.dynamic_slice_in_dim(centroids, first, window)
            scores = jnp.matmul(x_rows, near.reshape(-1, dim).T, precision=_HIGHEST)
            scores = scores.reshape(rows, window, num_centroids)
            scores = scores - lax.dynamic_slice_in_dim(half_norm, first, window)
            own = jnp.take_along_axis(scores, jnp.clip(local, 0, window - 1)[:, None, None], 1)
            return jnp.argmax(own[:, 0], axis=-1).astype(jnp.int32)

        def gathered():
            scores = jnp.einsum("rd,rcd->rc", x_rows, centroids[node], precision=_HIGHEST)
            return jnp.argmax(scores - half_norm[node], axis=-1).astype(jnp.int32)

        fits = jnp.all((local >= 0) & (local < window))
        return lax.cond(fits, windowed, gathered)

    return lax.map(chunk, (index, node)).reshape(-1)[:num_samples]


def kmeans_draw(key, num_samples: int, num_clusters: int, sample: int):
    """The block search's k-means draw: ``(rows, start)``, the ``min(N, sample * C)``
    distinct rows it runs on (int ``[M]``) and the positions among them of its ``C``
    first centroids (int ``[C]``); :func:`knn_cosine_blocks` and its form over rows on
    disk (``ncljax.labels.disk``) draw the same."""
    pick, init = jax.random.split(key)
    size = min(num_samples, max(sample * num_clusters, num_clusters))
    chosen = jax.random.choice(pick, num_samples, (size,), replace=False)
    return chosen, jax.random.choice(init, size, (num_clusters,), replace=False)


def nearest_centroid(x: ArrayLike, centroids: ArrayLike, *, rows: int = 4096) -> jax.Array:
    """Each row's nearest centroid in Euclidean distance (the lower index on a tie), ``rows``
    rows at a time: memory ``rows x C`` whatever ``N``.

    Args:
      x: ``[N, D]``.
      centroids: ``[C, D]``.
      rows: rows per step (static).

    Returns:
      int32 ``[N]``.
    """
    x, centroids = _as_float(x), _as_float(centroids)
    half_norm = 0.5 * jnp.sum(centroids * centroids, axis=-1)

    def nearest(row):  # argmin |x - c|^2 = argmax x.c - |c|^2 / 2
        scores = jnp.matmul(row, centroids.T, precision=_HIGHEST) - half_norm
        return jnp.argmax(scores).astype(jnp.int32)

    return lax.map(nearest, x, batch_size=max(1, min(rows, x.shape[0])))


def lloyd_centroids(points: ArrayLike, start: ArrayLike, *, iterations: int) -> jax.Array:
    """``iterations`` steps of Lloyd's k-means from the centroids ``start``: each point to
    its nearest centroid (:func:`nearest_centroid`), each centroid to the mean of its
    points; a centroid left without points keeps its place.

    ``ott.tools.k_means`` is Lloyd's algorithm too, but holds the whole ``[points, C]`` cost
    matrix (11 GiB for the block search's k-means at ``10^7`` rows in blocks of 1,024,
    :func:`knn_cosine_blocks`); here it is ``4096 x C`` at a time.

    Args:
      points: ``[M, D]``.
      start: ``[C, D]`` the first centroids.
      iterations: Lloyd steps (static).

    Returns:
      ``[C, D]`` centroids.
    """
    points, start = _as_float(points), _as_float(start)
    num_clusters = start.shape[0]
    ones = jnp.ones(points.shape[0], points.dtype)

    def step(centroids, _):
        cluster = nearest_centroid(points, centroids)
        sums = jax.ops.segment_sum(points, cluster, num_clusters)
        counts = jax.ops.segment_sum(ones, cluster, num_clusters)
        mean = sums / jnp.maximum(counts, 1.0)[:, None]
        return jnp.where(counts[:, None] > 0, mean, centroids), None

    centroids, _ = lax.scan(step, start, None, length=iterations)
    return centroids


def _knn_block_scan(unit, k, exclude_self, key_chunk, chunk, args):
    """One query block's top-``k`` over the candidates in blocks of ``key_chunk`` rows:
    ``(similarity [chunk, k], position [chunk, k])`` (:func:`knn_cosine`)."""
    query, start = args
    num_samples = unit.shape[0]
    key_chunk = max(1, min(key_chunk, num_samples))
    num_keys = -(-num_samples // key_chunk)
    keys = jnp.pad(unit, ((0, num_keys * key_chunk - num_samples), (0, 0)))
    keys = keys.reshape(num_keys, key_chunk, -1)
    rows = start + jnp.arange(chunk, dtype=jnp.int32)

    def merge(carry, args):
        key, key_start = args
        return merge_top(carry, query, key, key_start, rows, num_samples, exclude_self), None

    (similarity, index), _ = lax.scan(
        merge, empty_top(chunk, k, num_samples, unit.dtype), (keys, key_starts(num_keys, key_chunk))
    )
    return similarity, index


def key_starts(num_keys: int, key_chunk: int) -> jax.Array:
    """The first row of each of ``num_keys`` candidate blocks of ``key_chunk`` rows."""
    return jnp.arange(num_keys, dtype=jnp.int32) * key_chunk


def empty_top(rows: int, k: int, num_samples: int, dtype) -> tuple[jax.Array, jax.Array]:
    """A running top-``k`` that holds nothing yet: similarities ``-inf`` at row ``N``."""
    return jnp.full((rows, k), -jnp.inf, dtype), jnp.full((rows, k), num_samples, jnp.int32)


def merge_top(top, query, key, key_start, rows, num_samples: int, exclude_self: bool):
    """The running top-``k`` ``top = (similarity, row)`` of the query rows ``rows``
    (unit ``query``) merged with the candidates ``key`` (unit rows ``key_start + [0,
    key_chunk)``; those at ``N`` or beyond are padding). A tie keeps the lower row: the
    running top-``k`` holds only rows below ``key_start``."""
    top_sim, top_index = top
    k = top_sim.shape[1]
    columns = key_start + jnp.arange(key.shape[0], dtype=jnp.int32)
    sim = jnp.matmul(query, key.T, precision=_HIGHEST)
    drop = columns[None, :] >= num_samples  # padding candidates
    if exclude_self:
        drop = drop | (rows[:, None] == columns[None, :])
    sim = jnp.where(drop, -jnp.inf, sim)
    both = jnp.concatenate([top_sim, sim], axis=1)
    positions = jnp.concatenate([top_index, jnp.broadcast_to(columns, sim.shape)], axis=1)
    top_sim, at = lax.top_k(both, k)
    return top_sim, jnp.take_along_axis(positions, at, axis=1)


def modal_consistency(
    z_image: ArrayLike,
    z_text: ArrayLike,
    confident: ConfidentSet,
    *,
    den_floor: float = 1e-6,
    ratio_max: float = 10.0,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Per-sample modal consistency from the nearest confident pair (Eq. 7).

    .. math::
      \lozenge^v_i=\arg\max_{g\in\mathcal{G}}\cos(z_i^v,z_g^v),\qquad
      \mathcal{C}_i^v=\operatorname{clip}\!\left(
      \frac{\cos(z_i^v,z^v_{\lozenge^v_i})}
      {\max(\cos(z_i^t,z^t_{\lozenge^v_i}),\,\delta_{den})},\,0,\,c_{\max}\right)

    and :math:`\mathcal{C}^t_i` with the modalities swapped (nearest confident
    *text*, ratio text over image). The floor and clip are ncljax's safeguards (not
    in the paper): the denominator can be ~0 or negative.

    The nearest confident item is searched among valid (masked-in) slots only and
    in the same modality; the sample itself may be its nearest confident item
    (ratio 1; Eq. 7 does not exclude it). Ties go to the lower slot. If no slot is valid,
    both ratios are 1 (the unweighted vote of Eq. 8). Memory: two ``[N, |G|]``
    similarity blocks (``32000 * 1000`` floats = 128 MB each for XMediaNet; 40 GB each at
    ``10^7`` pairs), or with ``chunk`` two ``[chunk, |G|]`` blocks whatever ``N``: the
    rows are searched ``chunk`` at a time (``lax.map``'s ``batch_size``), each row's
    search the same as in the one block.

    Args:
      z_image: ``[N, D]`` image embeddings :math:`z^v` (normalised inside).
      z_text: ``[N, D]`` text embeddings :math:`z^t` (normalised inside).
      confident: :class:`ConfidentSet` with ``[G]`` fields, indices into ``N``.
      den_floor: :math:`\delta_{den}`, floor of the denominator (default 1e-6).
      ratio_max: :math:`c_{\max}`, upper clip of the ratio (default 10).
      chunk: rows per block (static), or ``None``: all ``N`` at once.

    Returns:
      ``(c_image, c_text)``: ``[N]`` each, in ``[0, ratio_max]``.

    References:
      UOT-RCL Sec. IV-B1, Eqs. 6-7.
    """
    image, text = _unit_rows(z_image), _unit_rows(z_text)
    index = jnp.asarray(confident.index, dtype=jnp.int32)
    return consistency_rows(
        image,
        text,
        image[index],
        text[index],
        confident.mask,
        den_floor=den_floor,
        ratio_max=ratio_max,
        chunk=chunk,
    )


def consistency_rows(
    image, text, anchors_image, anchors_text, mask, *, den_floor=1e-6, ratio_max=10.0, chunk=None
):
    """:func:`modal_consistency` of the unit rows ``image``, ``text`` (``[M, D]``, any ``M``
    of the ``N`` pairs) against the confident set's unit rows ``anchors_*`` (``[G, D]``)
    and ``mask``: each row's ratios depend on that row and the anchors only."""
    mask = jnp.asarray(mask, dtype=bool)
    any_valid = jnp.any(mask)

    def ratio(sim_same, sim_other):
        nearest = jnp.argmax(jnp.where(mask, sim_same, -jnp.inf))
        value = jnp.clip(
            sim_same[nearest] / jnp.maximum(sim_other[nearest], den_floor), 0.0, ratio_max
        )
        return jnp.where(any_valid, value, 1.0)

    def row(pair):  # one pair's search: its similarity to every anchor, [G] per modality
        image_row, text_row = pair
        sim_image = jnp.matmul(anchors_image, image_row, precision=_HIGHEST)
        sim_text = jnp.matmul(anchors_text, text_row, precision=_HIGHEST)
        return ratio(sim_image, sim_text), ratio(sim_text, sim_image)

    if chunk is None:
        return jax.vmap(row)((image, text))
    return lax.map(row, (image, text), batch_size=max(1, chunk))


def neighbour_vote(index: jax.Array, similarity: jax.Array, targets: jax.Array) -> jax.Array:
    """``[M, K]`` (1/k) sum_j sim[i, j] * targets[index[i, j]], one neighbour slot at a time
    (``index``, ``similarity``: ``[M, k]``, any ``M`` rows; ``targets``: ``[N, K]``).

    A loop over the ``k`` slots keeps memory at ``O(N K)`` instead of the
    ``[N, k, K]`` gather (``32000 * 150 * 200`` floats = 3.8 GB for XMediaNet).
    """
    k = index.shape[1]

    def body(j, acc):
        return acc + similarity[:, j, None] * targets[index[:, j]]

    total = lax.fori_loop(0, k, body, jnp.zeros((index.shape[0], targets.shape[1]), targets.dtype))
    return total / k


def consistent_cost(
    c_image: ArrayLike,
    c_text: ArrayLike,
    knn_image: tuple[ArrayLike, ArrayLike],
    knn_text: tuple[ArrayLike, ArrayLike],
    targets_image: ArrayLike,
    targets_text: ArrayLike,
    *,
    vote_floor: float = 1e-8,
    shift: bool = True,
    normalise: bool = False,
) -> jax.Array:
    r"""Cross-modal consistent cost :math:`C_S` (Eq. 8), floored and shifted.

    .. math::
      b_i=\mathcal{C}_i^v\,\frac1\kappa\sum_{j\in\mathcal{N}_i^v}\cos(z_i^v,z_j^v)\,y^v_j
      +\mathcal{C}_i^t\,\frac1\kappa\sum_{j\in\mathcal{N}_i^t}\cos(z_i^t,z_j^t)\,y^t_j,
      \qquad C^S_{ik}=-\log\max(b_{ik},\delta_b)

    then, with ``shift``, :math:`C_S \leftarrow C_S-\min_{ik}C^S_{ik}` so that
    :math:`C_S\ge0`. The floor and the shift are ncljax's safeguards (not in the
    paper): ``b`` can be ``<= 0`` (negative similarities) or ``> 1`` (two votes summed,
    ratios above 1), and negative costs next to the zero-cost dummies of the partial OT
    transport far more than ``s``. With one label per pair pass the same targets twice.
    Everything is under ``stop_gradient``: the cost is data for the OT solver (the paper
    does not say whether gradients flow through it).

    Args:
      c_image: ``[N]`` modal consistency :math:`\mathcal{C}^v` (Eq. 7).
      c_text: ``[N]`` modal consistency :math:`\mathcal{C}^t`.
      knn_image: ``(index int [N, k], similarity [N, k])`` from :func:`knn_cosine`
        on the image embeddings; ``k`` is :math:`\kappa`.
      knn_text: the same for the text embeddings (may have a different ``k``).
      targets_image: ``[N, K]`` soft targets :math:`y^v` (rows of the Eq. 9 state).
      targets_text: ``[N, K]`` soft targets :math:`y^t`.
      vote_floor: :math:`\delta_b` (default 1e-8, so :math:`C^S\le 18.42` before
        the shift).
      shift: subtract the global minimum (static; default True).
      normalise: divide each floored row of ``b`` by its sum before the log (static;
        default False, the paper's Eq. 8). The row then is a distribution over classes,
        and the cost ranks samples by how *concentrated* their vote is rather than by
        its magnitude, which the consistency ratios and neighbour similarities inflate
        (``b_i`` scales with ``C_i`` and the local density); see ``uot_rcl``'s
        ``vote_normalise``. A row with no vote (all entries at or below the floor) keeps
        the maximum cost :math:`-\log\delta_b` in every class.

    Returns:
      ``[N, K]`` cost :math:`C_S`.

    References:
      UOT-RCL Sec. IV-B1, Eq. 8, and Sec. IV-B2 (the zero-cost dummies of Eq. 14).
    """
    sg = lax.stop_gradient
    index_image, sim_image = knn_image
    index_text, sim_text = knn_text
    targets_image, targets_text = sg(_as_float(targets_image)), sg(_as_float(targets_text))
    vote_image = neighbour_vote(
        jnp.asarray(index_image, jnp.int32), sg(_as_float(sim_image)), targets_image
    )
    vote_text = neighbour_vote(
        jnp.asarray(index_text, jnp.int32), sg(_as_float(sim_text)), targets_text
    )
    return cost_from_votes(
        c_image,
        c_text,
        vote_image,
        vote_text,
        vote_floor=vote_floor,
        shift=shift,
        normalise=normalise,
    )


def cost_from_votes(c_image, c_text, vote_image, vote_text, *, vote_floor, shift, normalise):
    """:func:`consistent_cost` from each pair's two neighbour votes (``[N, K]``, the mean
    of its neighbours' similarity-weighted targets), so that a search which meets the
    pairs in another order can vote as it goes (``ncljax.labels.disk``)."""
    sg = lax.stop_gradient
    vote_image, vote_text = sg(_as_float(vote_image)), sg(_as_float(vote_text))
    bracket = (
        sg(_as_float(c_image))[:, None] * vote_image + sg(_as_float(c_text))[:, None] * vote_text
    )
    floored = jnp.maximum(bracket, vote_floor)
    if normalise:
        # A row with no vote at all (every entry at the floor) has no class to be
        # concentrated on: it keeps the floor, the maximum cost, rather than becoming a
        # uniform distribution (cost log K, cheaper than a confident wrong vote).
        empty = jnp.all(bracket <= vote_floor, axis=-1, keepdims=True)
        share = jnp.maximum(floored / jnp.sum(floored, axis=-1, keepdims=True), vote_floor)
        floored = jnp.where(empty, vote_floor, share)
    bracket = floored
    cost = -jnp.log(bracket)
    if shift:
        cost = cost - jnp.min(cost)
    return cost


def update_targets(
    targets: ArrayLike,
    class_scores: ArrayLike,
    *,
    momentum: float = 0.99,
) -> jax.Array:
    r"""Momentum update of the soft targets towards the prototype argmax (Eq. 9).

    .. math::
      y_i\leftarrow\gamma\,y_i+(1-\gamma)\,\upsilon_i,\qquad
      \upsilon_{i}=\mathbf{e}_{\arg\max_k s_{ik}},\qquad
      s_{ik} = \mu_k^\top(z_i^v+z_i^t)

    ``class_scores`` are any positive multiple of :math:`\mu_k^\top(z_i^v+z_i^t)`, e.g.
    the sum of the two modalities' prototype logits (``mu . z / tau_1``), which is what
    the per-epoch statistics pass has. Ties in the argmax go to the lower class.
    ``momentum=1`` keeps the targets, ``momentum=0`` replaces them by the one-hot
    argmax. ncljax runs it once per epoch, before the cost is built (the paper does not
    say when, Sec. IV-B1).

    Args:
      targets: ``[N, K]`` soft targets :math:`y` (initially the noisy one-hots).
      class_scores: ``[N, K]`` scores :math:`s` of the averaged prediction.
      momentum: :math:`\gamma` (default 0.99).

    Returns:
      ``[N, K]`` updated targets (rows still sum to 1 if they did).

    References:
      UOT-RCL Sec. IV-B1, Eq. 9.
    """
    targets = _as_float(targets)
    hard = jax.nn.one_hot(jnp.argmax(class_scores, axis=-1), targets.shape[1], dtype=targets.dtype)
    return momentum * targets + (1.0 - momentum) * hard


def relation_scores(
    z: ArrayLike,
    anchors: ArrayLike,
    anchor_mask: ArrayLike,
    *,
    temperature: float = 1.0,
    sign: float = 1.0,
) -> jax.Array:
    r"""Relation distribution of each sample over the confident anchors (Eq. 16).

    .. math::
      R_{ij}=\frac{\exp(\sigma\cos(z_i,g_j)/\tau_2)}
      {\sum_{j'\ \text{valid}}\exp(\sigma\cos(z_i,g_{j'})/\tau_2)}

    over the valid anchors; masked anchors get probability exactly 0 (logit
    :math:`-\infty`). If no anchor is valid the row is all zeros. The paper writes
    :math:`\exp(-d/\tau_2)` with :math:`d` a cosine *similarity*, which would
    down-weight similar anchors (Eqs. 6-8 use :math:`d` as a similarity); the default
    is :math:`\sigma=+1` (softmax of similarities), and ``sign=-1.0`` gives the paper's
    literal form. Differentiable in ``z`` and ``anchors`` with finite gradients (also
    at masked anchors and zero rows); wrap the anchors in ``stop_gradient`` at the call
    site, as ``uot_rcl``'s default does (the paper does not say).

    Args:
      z: ``[B, D]`` batch embeddings (:math:`z^v` or :math:`z^t`).
      anchors: ``[G, D]`` confident-set embeddings :math:`g` of the same modality.
      anchor_mask: bool ``[G]``, the confident set's ``mask``.
      temperature: :math:`\tau_2` (default 1).
      sign: :math:`\sigma`, ``+1.0`` (default) or ``-1.0`` (paper's literal form).

    Returns:
      ``[B, G]`` rows in the simplex over the valid anchors.

    References:
      UOT-RCL Sec. IV-C, Eq. 16.
    """
    mask = jnp.asarray(anchor_mask, dtype=bool)
    cos = jnp.matmul(_unit_rows(z), _unit_rows(anchors).T)
    logits = sign * cos / temperature
    # Masked anchors get probability 0 and no gradient from the masked softmax. Its support
    # must not be empty (that computes -inf - -inf = NaN before zeroing it): with no valid
    # anchor every (finite) logit is kept and the rows are zeroed afterwards.
    any_valid = jnp.any(mask)
    scores = jax.nn.softmax(logits, axis=-1, where=(mask | ~any_valid)[None, :])
    return jnp.where(any_valid, scores, 0.0)
