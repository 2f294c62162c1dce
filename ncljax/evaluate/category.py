r"""mAP@all category retrieval (MRL / UOT-RCL protocol): cosine similarity over the whole
database, single-label relevance, tied database items in a uniformly random order.

References:
  Hu et al., "Learning Cross-Modal Retrieval with Noisy Labels" (MRL), CVPR 2021: mAP@all.
  McSherry and Najork, "Computing Information Retrieval Performance Measures Efficiently in the
  Presence of Tied Scores", ECIR 2008: tie-aware (expected) precision and AP.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import ArrayLike

from ncljax.evaluate import blocks


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
    emb, labels = blocks.as_array(emb), blocks.as_array(labels)
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
      Han et al., UOT-RCL (arXiv 2403.13480), Sec. V-A2, and the mAP code of
      ``penghu-cs/MRL``; the paper's Eq. 20 is a mis-statement of this AP.
      McSherry and Najork, ECIR 2008 (AP under tied scores).
    """
    queries, query_labels = _check_embeddings(queries, query_labels, "queries")
    database, database_labels = _check_embeddings(database, database_labels, "database")
    if queries.shape[1] != database.shape[1]:
        raise ValueError(f"embedding widths differ: {queries.shape[1]} vs {database.shape[1]}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    rows, replicated, multiple = blocks.placements(mesh)
    num_queries = queries.shape[0]
    block = blocks.round_up(min(chunk, num_queries), multiple)
    database = _unit_rows_jit(jax.device_put(database, replicated))
    database_labels = jax.device_put(database_labels, replicated)
    parts = []
    for start in range(0, num_queries, block):
        query_block, label_block = jax.device_put(
            blocks.take_rows((queries, query_labels), start, block), rows
        )
        parts.append(_average_precision_block(query_block, label_block, database, database_labels))
    ap = np.concatenate(blocks.to_host(parts))[:num_queries]
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
