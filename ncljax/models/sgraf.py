r"""SGRAF (Diao et al., AAAI 2021): the SGR and SAF similarity heads of NCR, DECL, GSC, PC2...

An image is 36 region vectors, a caption its word vectors; the similarity of a pair is
reasoned over *similarity vectors*:

* global vectors by self-attention: ``v_hat`` over regions (with the region-as-channel
  BatchNorm of the official code), ``u_hat`` over valid words;
* SCAN text-to-image attention of each word over the regions (smoothing 9), and one
  local similarity vector per word ``s_l = l2(W_loc (a_l - u_l)^2)``, plus the global one
  ``s_0 = l2(W_glo (v_hat - u_hat)^2)``;
* SGR: three graph-reasoning steps over the nodes ``[s_0; s_1..s_L]``, read at node 0;
  or SAF: sigmoid-gated attention filtration (BatchNorm(1) per caption, L1 over nodes);
* a final linear layer to the raw logit ``h``; heads that follow SGRAF apply a sigmoid.

Everything is batched: the ``[n_img, n_txt]`` similarity of a batch is one computation
over caption chunks (``lax.map``; rematerialised in training when asked) with padded
words, attention and graph nodes masked. The image-image and text-text variants of
GSC reuse the same parameters. Equations: SGRAF (Diao et al., AAAI 2021) and its official
code (``Paranioar/SGRAF``, ``model.py``), as reused by the official PC2 code
(``pc2/model.py``) and GSC code (``GSC+/model/SGRAF.py``, with the intra-modal variants).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ncljax.models import encoders, linear

_l2 = encoders.l2_normalize
_XAVIER = jax.nn.initializers.glorot_uniform()
_INTRA_EPS = 1e-6  # GSC's intra-modal passes add it to squared differences / contexts


def _linear(in_dim: int, out_dim: int, rngs: nnx.Rngs) -> nnx.Linear:
    """SGRAF's init: Xavier-uniform weights, zero bias."""
    return nnx.Linear(
        in_dim, out_dim, kernel_init=_XAVIER, dot_general=linear.dot_general, rngs=rngs
    )


def _matmul(subscripts: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """``einsum`` with operands in the compute ``dtype`` and float32 accumulation/result."""
    if dtype is None or jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(subscripts, a, b)
    return jnp.einsum(
        subscripts, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32
    )


def _dense(layer: nnx.Linear, x: jax.Array, dtype) -> jax.Array:
    """``layer(x)`` with its matrix product in the compute ``dtype`` (float32 result)."""
    if dtype is None or jnp.dtype(dtype) == jnp.float32:
        return layer(x)
    return _matmul("...i,io->...o", x, layer.kernel[...], dtype) + layer.bias[...]


def _masked_softmax(logits: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
    logits = jnp.where(mask, logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=axis, where=mask)


class TorchBatchNorm(nnx.Module):
    """BatchNorm with PyTorch's semantics (the official code's ``BatchNorm1d``).

    Normalises with the biased batch variance; the running variance is updated with the
    unbiased one, momentum 0.1, epsilon 1e-5. ``axis`` is the channel axis; statistics run
    over all other axes. With a ``mask`` over the batch (axis 0) in training, statistics
    use the valid rows only (padding rows are normalised with them but count nowhere); with
    fewer than two valid rows the layer is the identity and keeps its statistics (PyTorch
    refuses such a batch; the official SGRAF code skips BatchNorm for a batch of one).
    """

    def __init__(self, num_features: int, *, axis: int = -1, momentum: float = 0.1):
        self.scale = nnx.Param(jnp.ones(num_features))
        self.bias = nnx.Param(jnp.zeros(num_features))
        self.mean = nnx.BatchStat(jnp.zeros(num_features))
        self.var = nnx.BatchStat(jnp.ones(num_features))
        self.axis = axis
        self.momentum = momentum
        self.epsilon = 1e-5

    def _shape(self, x, v):
        shape = [1] * x.ndim
        shape[self.axis] = v.shape[0]
        return v.reshape(shape)

    def _normalise(self, x, mean, var):
        x = (x - self._shape(x, mean)) * jax.lax.rsqrt(self._shape(x, var) + self.epsilon)
        return x * self._shape(x, self.scale[...]) + self._shape(x, self.bias[...])

    def _update(self, mean, unbiased, keep=None):
        m = self.momentum
        new_mean = (1 - m) * self.mean[...] + m * jax.lax.stop_gradient(mean)
        new_var = (1 - m) * self.var[...] + m * jax.lax.stop_gradient(unbiased)
        if keep is not None:
            new_mean = jnp.where(keep, self.mean[...], new_mean)
            new_var = jnp.where(keep, self.var[...], new_var)
        self.mean[...], self.var[...] = new_mean, new_var

    def __call__(self, x: jax.Array, *, train: bool, mask: jax.Array | None = None) -> jax.Array:
        axis = self.axis % x.ndim
        if not train:
            return self._normalise(x, self.mean[...], self.var[...])
        reduce = tuple(a for a in range(x.ndim) if a != axis)
        if mask is None:
            mean, var = x.mean(reduce), x.var(reduce)
            n = x.size // x.shape[axis]
            self._update(mean, var * n / max(n - 1, 1))
            return self._normalise(x, mean, var)
        rows = jnp.asarray(mask, bool)
        weight = rows.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
        valid = rows.sum()
        n = (valid * (x.size // (x.shape[0] * x.shape[axis]))).astype(x.dtype)
        mean = (x * weight).sum(reduce) / jnp.maximum(n, 1)
        var = ((x - self._shape(x, mean)) ** 2 * weight).sum(reduce) / jnp.maximum(n, 1)
        few = valid < 2
        self._update(mean, var * n / jnp.maximum(n - 1, 1), keep=few)
        return jnp.where(few, x, self._normalise(x, mean, var))


class VisualSelfAttention(nnx.Module):
    """Global image vector ``v_hat = l2(sum_r a_r v_r)`` with region-as-channel BatchNorm."""

    def __init__(self, dim: int, num_regions: int, dropout: float, *, rngs: nnx.Rngs):
        self.local = _linear(dim, dim, rngs)
        self.local_bn = TorchBatchNorm(num_regions, axis=1)
        self.glob = _linear(dim, dim, rngs)
        self.glob_bn = TorchBatchNorm(dim)
        self.common = _linear(dim, 1, rngs)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, regions: jax.Array, *, train: bool, rngs=None, mask=None) -> jax.Array:
        """``regions`` ``[B, R, D]`` (L2-normalised) -> ``[B, D]``; ``mask`` ``[B]`` marks the
        real images of a padded batch (padding never enters the BatchNorm statistics)."""
        drop = lambda x: self.dropout(x, deterministic=not train, rngs=rngs)
        # The official code skips BatchNorm in training for a batch of one image.
        use_bn = not train or regions.shape[0] > 1
        local, glob = self.local(regions), self.glob(regions.mean(1))
        if use_bn:
            local = self.local_bn(local, train=train, mask=mask)
            glob = self.glob_bn(glob, train=train, mask=mask)
        local, glob = drop(jnp.tanh(local)), drop(jnp.tanh(glob))
        weights = jax.nn.softmax(self.common(local * glob[:, None])[..., 0], axis=1)
        return _l2((weights[..., None] * regions).sum(1))


class TextSelfAttention(nnx.Module):
    """Global caption vector ``u_hat = l2(sum_l a_l u_l)`` over the valid words (no BatchNorm)."""

    def __init__(self, dim: int, dropout: float, *, rngs: nnx.Rngs):
        self.local = _linear(dim, dim, rngs)
        self.glob = _linear(dim, dim, rngs)
        self.common = _linear(dim, 1, rngs)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, words: jax.Array, mask: jax.Array, *, train: bool, rngs=None):
        """``words`` ``[B, L, D]`` with ``mask`` ``[B, L]`` -> ``[B, D]``."""
        drop = lambda x: self.dropout(x, deterministic=not train, rngs=rngs)
        local = drop(jnp.tanh(self.local(words)))
        mean = encoders.masked_mean(words, mask)
        glob = drop(jnp.tanh(self.glob(mean)))
        logits = self.common(local * glob[:, None])[..., 0]
        weights = _masked_softmax(logits, mask, axis=1)
        return _l2((weights[..., None] * words).sum(1))


def _attend(context, context_mask, query, query_mask, smooth, dtype=None, save=None):
    """SCAN attention of every query item over every context item set.

    ``context`` ``[X, C, D]`` with ``context_mask`` ``[X, C]``, ``query`` ``[Q, L, D]`` with
    ``query_mask`` ``[Q, L]``: ``A = LeakyReLU_0.1(c . q)``, L2-normalised over the valid
    query words, softmax over the valid context items of ``smooth * A``. Returns the
    attended vectors ``l2(sum_c alpha c)`` ``[X, Q, L, D]``, context-major: the weighted
    sum is then one matrix product per context whose result needs no transposition. The
    two contractions run in the compute ``dtype`` (float32 accumulation); normalisations
    and softmax in float32.
    """
    attn = jax.nn.leaky_relu(_matmul("xcd,qld->xqlc", context, query, dtype), 0.1)
    attn = jnp.where(query_mask[None, :, :, None], attn, 0.0)
    attn = attn / (jnp.sqrt((attn * attn).sum(2, keepdims=True)) + 1e-8)
    alpha = _masked_softmax(smooth * attn, context_mask[:, None, None, :], axis=-1)
    alpha = _saved(alpha, "sgraf_attention", save)
    return _l2(_matmul("xqlc,xcd->xqld", alpha, context, dtype))


def group_lengths(max_length: int, groups: int) -> tuple[int, ...]:
    """The static lengths a chunk of captions may be cut to: ``groups`` evenly spaced
    lengths up to ``max_length`` (rounded up, duplicates dropped); ``groups <= 1``: the
    padded length only."""
    if groups <= 1 or max_length <= 1:
        return (max_length,)
    return tuple(sorted({-(-max_length * k // groups) for k in range(1, groups + 1)}))


def _map_chunks(fn, tree, chunk: int, remat, *, lengths=None, limits=(None,)):
    """``fn(limit, tree_chunk)`` over chunks of ``chunk`` items along the leading axis.

    The tail is padded with copies of the first item (their outputs are dropped), so
    every chunk has the same shape. ``remat``: ``False`` stores each chunk's forward for
    the backward pass; ``True`` recomputes it; a ``jax.checkpoint`` policy saves what it
    names and recomputes the rest.

    Length grouping: with ``lengths`` ``[n]`` (each item's needed length) and several
    static ``limits``, the items are sorted by length (stably), each chunk runs the branch
    of the shortest limit that holds its longest item (``lax.switch``: one branch
    executes), and the outputs are put back in the original order. ``fn`` receives the
    chunk's limit (``None`` without grouping) and cuts what it computes to it.
    """
    n = jax.tree.leaves(tree)[0].shape[0]
    chunk = n if chunk <= 0 else min(chunk, n)
    pad = -n % chunk
    grouped = lengths is not None and len(limits) > 1
    if grouped:
        order = jnp.argsort(lengths, stable=True)
        tree = jax.tree.map(lambda x: x[order], tree)
        longest = lengths[order][jnp.minimum(jnp.arange(chunk, n + pad + 1, chunk), n) - 1]
        branch = jnp.minimum(jnp.searchsorted(jnp.asarray(limits), longest), len(limits) - 1)

    def prepare(x):
        x = jnp.concatenate([x, jnp.repeat(x[:1], pad, axis=0)]) if pad else x
        return x.reshape(-1, chunk, *x.shape[1:])

    def checkpointed(f):
        if remat is True:
            return jax.checkpoint(f)
        return jax.checkpoint(f, policy=remat) if remat else f

    if grouped:
        # Each branch is checkpointed on its own: its residuals are then its inputs, the
        # same for every branch, so the switch carries no per-length residuals.
        branches = [checkpointed(functools.partial(fn, limit)) for limit in limits]
        body = lambda a: jax.lax.switch(a[0], branches, a[1])
        xs = (branch, jax.tree.map(prepare, tree))
    else:
        body = checkpointed(functools.partial(fn, limits[-1]))
        xs = jax.tree.map(prepare, tree)
    out = jax.lax.map(body, xs)
    out = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:n], out)
    if grouped:
        restore = jnp.argsort(order)
        out = jax.tree.map(lambda y: y[restore], out)
    return out


_NAMED_POLICIES = ("projections",)
REMAT_POLICIES = {
    # Everything but the 1024-wide per-word tensors is stored: the attention weights,
    # the local similarity vectors (1024 -> 256 per word and pair), the reasoning steps'
    # projections and edge weights; the backward pass recomputes the attended vectors
    # and their squared differences from the stored attention weights.
    "projections": jax.checkpoint_policies.save_only_these_names(
        "sgraf_attention", "sgraf_local", "sgraf_reasoning"
    ),
    # Matrix products without batch dimensions are stored (with length groups, each
    # group's residuals have their own shapes: memory grows with the groups).
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _saved(x: jax.Array, name: str, size: int | None, axes=(2,)) -> jax.Array:
    """``x`` named for a checkpoint policy (``REMAT_POLICIES``). With ``size``, the name
    is put on ``x`` padded along ``axes`` (words or nodes) to ``size``: every length group
    of a ``lax.switch`` then stores a residual of one shape, which the switch shares
    between its branches instead of holding one per branch."""
    if size is None or all(x.shape[a] == size for a in axes):
        return checkpoint_name(x, name)
    pad = [(0, 0)] * x.ndim
    for a in axes:
        pad[a] = (0, size - x.shape[a])
    saved = checkpoint_name(jnp.pad(x, pad), name)
    return saved[tuple(slice(0, n) for n in x.shape)]


def _cut(tree: dict, limit) -> dict:
    """A query chunk's word axis cut to ``limit`` (``None``: as it is)."""
    if limit is None:
        return tree
    return {k: v[:, :limit] if k in ("words", "mask") else v for k, v in tree.items()}


def _needed_length(mask: jax.Array) -> jax.Array:
    """Per caption, one past its last valid word (0 for none) ``[n]``."""
    positions = jnp.arange(1, mask.shape[1] + 1)
    return jnp.max(jnp.where(mask, positions, 0), axis=1)


class SimilarityHead(nnx.Module):
    """Similarity vectors and SGR / SAF reasoning to a raw logit per pair.

    Pairs are (query, context): the caption attends over an image's regions (cross-modal),
    caption ``i`` over caption ``j``'s words, or image ``i`` aligned with image ``j``
    (GSC's intra-modal structures). Computation runs in chunks of ``chunk`` queries.

    Args:
      dim: joint embedding size ``D`` (1024 in SGRAF).
      sim_dim: similarity-vector size (256).
      kind: ``'sgr'`` (graph reasoning) or ``'saf'`` (attention filtration).
      steps: SGR reasoning steps (3).
      smooth: SCAN's softmax smoothing (9).
      chunk: queries per chunk (0: all at once).
      remat: in training, ``False`` stores each chunk's forward for the backward pass,
        ``True`` recomputes all of it, a ``jax.checkpoint`` policy (or the name of one in
        ``REMAT_POLICIES``) saves what it names and recomputes the rest.
      length_groups: caption queries (cross-modal and text-text passes) are sorted by
        length and each chunk is computed at the shortest of ``length_groups`` static
        lengths (evenly spaced up to the padded length) that holds its longest caption,
        so the work follows the real token count; ``1``: every chunk at the padded
        length. Exact: padded words are masked everywhere, so the results equal the
        padded computation up to float32 summation order.
      compute_dtype: dtype of the operands of the head's matrix products (attention,
        similarity vectors, reasoning): ``'float32'``, or ``'bfloat16'`` for accelerators
        (float32 accumulation; softmax, norms and BatchNorm stay float32).
    """

    def __init__(
        self,
        dim: int,
        sim_dim: int = 256,
        *,
        kind: str = "sgr",
        steps: int = 3,
        smooth: float = 9.0,
        chunk: int = 0,
        remat=False,
        length_groups: int = 4,
        compute_dtype: str = "float32",
        rngs: nnx.Rngs,
    ):
        if kind not in ("sgr", "saf"):
            raise ValueError(f"model.head must be 'sgr' or 'saf' here, got {kind!r}.")
        if compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"model.sgraf.compute_dtype must be 'float32' or 'bfloat16', got {compute_dtype!r}."
            )
        if isinstance(remat, str) and remat not in REMAT_POLICIES:
            raise ValueError(
                f"model.sgraf.remat must be true, false or one of {sorted(REMAT_POLICIES)}, "
                f"got {remat!r}."
            )
        self.kind, self.smooth, self.chunk, self.remat = kind, smooth, chunk, remat
        self.length_groups = int(length_groups)
        self.compute_dtype = compute_dtype
        self.local = _linear(dim, sim_dim, rngs)
        self.glob = _linear(dim, sim_dim, rngs)
        if kind == "sgr":
            self.query = nnx.List([_linear(sim_dim, sim_dim, rngs) for _ in range(steps)])
            self.key = nnx.List([_linear(sim_dim, sim_dim, rngs) for _ in range(steps)])
            self.update = nnx.List([_linear(sim_dim, sim_dim, rngs) for _ in range(steps)])
        else:
            self.attn = _linear(sim_dim, 1, rngs)
            self.attn_bn = TorchBatchNorm(1)
        self.out = _linear(sim_dim, 1, rngs)

    def _nodes(
        self, attended, query, query_mask, context_glob, query_glob, local_eps, glob_eps, save=None
    ):
        """Nodes ``[X, Q, 1 + L, S]`` (context-major, global node first) and their mask
        ``[Q, 1 + L]``; ``attended`` ``[X, Q, L, D]`` (or broadcastable), ``query``
        ``[Q, L, D]``. ``save``: the word count stored residuals are padded to
        (``_saved``; the nodes are padded to one more)."""
        dtype = self.compute_dtype
        local = _dense(self.local, (attended - query[None]) ** 2 + local_eps, dtype)
        local = _l2(_saved(local, "sgraf_local", save))
        diff = (context_glob[:, None] - query_glob[None]) ** 2 + glob_eps
        nodes = jnp.concatenate([_l2(_dense(self.glob, diff, dtype))[:, :, None], local], axis=2)
        mask = jnp.concatenate([jnp.ones_like(query_mask[:, :1]), query_mask], axis=1)
        return nodes, mask

    def _reason(self, nodes, mask, *, train: bool, context_valid=None, save=None):
        """Raw logits ``[X, Q]`` of nodes ``[X, Q, N, S]``, and for SAF in training the
        BatchNorm statistics of each query's group ``[Q]`` (the official code calls SAF
        once per caption, over all images); ``context_valid`` ``[X]`` keeps padding
        contexts out of those statistics."""
        mask = jnp.broadcast_to(mask[None], nodes.shape[:3])
        if self.kind == "sgr":
            return self._graph_reasoning(nodes, mask, save and save + 1), None
        scores = self.attn(nodes)[..., 0]  # [X, Q, N]
        bn = self.attn_bn
        if train:
            counted = mask if context_valid is None else mask & context_valid[:, None, None]
            count = counted.sum((0, 2))
            total = jnp.maximum(count, 1)  # a batch of padding only: no NaN, nothing counts
            mean = jnp.where(counted, scores, 0.0).sum((0, 2)) / total
            var = jnp.where(counted, (scores - mean[None, :, None]) ** 2, 0.0).sum((0, 2)) / total
            stats = (mean, var * count / jnp.maximum(count - 1, 1))
        else:
            mean, var, stats = bn.mean[...], bn.var[...], None
        scores = (scores - mean.reshape(1, -1, 1)) * jax.lax.rsqrt(
            var.reshape(1, -1, 1) + bn.epsilon
        )
        scores = scores * bn.scale[...] + bn.bias[...]
        gate = jnp.where(mask, jax.nn.sigmoid(scores), 0.0)
        gate = gate / (jnp.abs(gate).sum(-1, keepdims=True) + 1e-8)
        return self.out(_l2((gate[..., None] * nodes).sum(2)))[..., 0], stats

    def _graph_reasoning(self, nodes, mask, save=None):
        """SGR: ``N <- ReLU(W_r softmax_row((W_q N + b_q)(W_k N + b_k)^T) N + b_r)``, read at
        node 0 after the last step.

        Computed exactly but cheaper: within a row softmax the query-key logits equal
        ``N_n (W_q W_k^T) N_m^T + (W_k b_q) . N_m`` (terms constant along a row cancel), so
        each step needs one projection instead of two; and the last step is evaluated for
        node 0 only, the one that is read. ``nodes`` ``[X, Q, N, S]`` -> logits ``[X, Q]``.
        """
        dt = self.compute_dtype
        steps = list(zip(self.query, self.key, self.update, strict=True))
        key_mask = mask[:, :, None, :]
        for t, (query, key, update) in enumerate(steps):
            pair = query.kernel[...] @ key.kernel[...].T  # [S, S]
            shift = nodes @ (key.kernel[...] @ query.bias[...])  # [X, Q, N]
            if t == len(steps) - 1:
                projected = _matmul("xqd,de->xqe", nodes[:, :, 0], pair, dt)
                logits = _matmul("xqd,xqmd->xqm", projected, nodes, dt) + shift
                edges = _saved(_masked_softmax(logits, mask, axis=-1), "sgraf_reasoning", save)
                read = _matmul("xqm,xqmd->xqd", edges, nodes, dt)
                return self.out(jax.nn.relu(_dense(update, read, dt)))[..., 0]
            projected = _saved(_matmul("xqnd,de->xqne", nodes, pair, dt), "sgraf_reasoning", save)
            logits = _matmul("xqnd,xqmd->xqnm", projected, nodes, dt) + shift[:, :, None]
            edges = _masked_softmax(logits, key_mask, axis=-1)
            edges = _saved(edges, "sgraf_reasoning", save, axes=(2, 3))
            read = _matmul("xqnm,xqmd->xqnd", edges, nodes, dt)
            nodes = jax.nn.relu(_saved(_dense(update, read, dt), "sgraf_reasoning", save))
        raise AssertionError("unreachable")

    def _update_saf_statistics(self, stats, valid=None) -> None:
        """Running statistics after one update per query group, in order (as the official
        per-caption loop): ``r <- (1 - m)^G r + sum_g m (1 - m)^(G - 1 - g) s_g``, over the
        valid groups only when ``valid`` ``[G]`` is given (padding captions do not exist)."""
        if stats is None:
            return
        bn, m = self.attn_bn, self.attn_bn.momentum
        mean, var = (jax.lax.stop_gradient(x) for x in stats)
        if valid is None:
            valid = jnp.ones(mean.shape[0], bool)
        v = valid.astype(jnp.int32)
        after = jnp.cumsum(v[::-1])[::-1] - v  # valid groups updated after group g
        decay = jnp.where(valid, m * (1 - m) ** after, 0.0)
        kept = (1 - m) ** v.sum()
        mean, var = jnp.where(valid, mean, 0.0), jnp.where(valid, var, 0.0)
        bn.mean[...] = kept * bn.mean[...] + (decay * mean).sum()
        bn.var[...] = kept * bn.var[...] + (decay * var).sum()

    def _pairs(
        self, make_nodes, queries, *, train, query_valid=None, context_valid=None, words=False
    ):
        """Logits ``[n_query, n_context]`` over chunks of queries; ``words``: the queries
        are captions (``words``, ``mask``), grouped by length (``length_groups``)."""

        remat = REMAT_POLICIES.get(self.remat, self.remat) if train else False
        grouping, save = {}, None
        if words:
            padded = queries["words"].shape[1]
            limits = group_lengths(padded, self.length_groups)
            if len(limits) > 1:
                grouping = dict(lengths=_needed_length(queries["mask"]), limits=limits)
                if train and self.remat in _NAMED_POLICIES:
                    save = padded  # every group's saved residuals get one shape

        def chunk_logits(limit, query):
            with jax.named_scope("similarity_vectors"):
                nodes, mask = make_nodes(_cut(query, limit), save)
            with jax.named_scope("reasoning"):
                logits, stats = self._reason(
                    nodes, mask, train=train, context_valid=context_valid, save=save
                )
            return logits.T, stats  # [chunk, n_context]

        with jax.named_scope("pairwise_head"):
            logits, stats = _map_chunks(chunk_logits, queries, self.chunk, remat, **grouping)
        self._update_saf_statistics(stats, query_valid)
        return logits

    def cross(self, image: dict, text: dict, *, train: bool = False) -> jax.Array:
        """Raw logits ``[n_img, n_txt]``: ``h(I_i, T_c)`` for every image and caption.

        ``image``: ``regions`` ``[n_img, R, D]``, ``glob`` ``[n_img, D]``; ``text``:
        ``words`` ``[n_txt, L, D]``, ``mask`` ``[n_txt, L]``, ``glob`` ``[n_txt, D]``.
        """
        regions, v_glob = image["regions"], image["glob"]
        all_regions = jnp.ones(regions.shape[:2], bool)

        def make_nodes(t, save):
            attended = _attend(
                regions, all_regions, t["words"], t["mask"], self.smooth, self.compute_dtype, save
            )
            return self._nodes(attended, t["words"], t["mask"], v_glob, t["glob"], 0.0, 0.0, save)

        valid = dict(query_valid=text.get("valid"), context_valid=image.get("valid"))
        return self._pairs(make_nodes, _queries(text), train=train, words=True, **valid).T

    def image_image(self, image: dict, *, train: bool = False) -> jax.Array:
        """GSC's ``h_II(I_j, I_i)`` ``[B, B]`` (row ``j``): region-aligned, no attention."""
        regions, v_glob = image["regions"], image["glob"]

        def make_nodes(q, save):
            mask = jnp.ones(q["regions"].shape[:2], bool)
            return self._nodes(
                regions[:, None], q["regions"], mask, v_glob, q["glob"], _INTRA_EPS, _INTRA_EPS
            )

        valid = dict(query_valid=image.get("valid"), context_valid=image.get("valid"))
        return self._pairs(make_nodes, _queries(image), train=train, **valid).T

    def text_text(self, text: dict, *, train: bool = False) -> jax.Array:
        """GSC's ``h_TT(T_j | T_i)`` ``[B, B]`` (row ``j`` the context, column ``i`` the
        query): caption ``i``'s words attend over caption ``j``'s words."""
        context = text["words"] + _INTRA_EPS

        def make_nodes(q, save):
            attended = _attend(
                context, text["mask"], q["words"], q["mask"], self.smooth, self.compute_dtype, save
            )
            return self._nodes(
                attended, q["words"], q["mask"], text["glob"], q["glob"], 0.0, _INTRA_EPS, save
            )

        valid = dict(query_valid=text.get("valid"), context_valid=text.get("valid"))
        return self._pairs(make_nodes, _queries(text), train=train, words=True, **valid).T

    def text_text_aligned(self, text: dict, *, train: bool = False) -> jax.Array:
        """GSC+'s ``h_TT(T_j, T_i)`` ``[B, B]``: word-position-aligned, no attention.

        The dual-network official code (``GSC+/model/SGRAF.py``, ``forward_topology``)
        compares the captions word by word over the batch's padded length ``L_b`` (its
        longest caption): local nodes ``(u_jl - u_il)^2 + 1e-6`` for ``l < L_b``, the
        padded words being zero vectors, and the global node ``(u_hat_j - u_hat_i)^2 +
        1e-6``; every one of the ``L_b + 1`` nodes enters the graph (no padding mask). The
        result is symmetric and depends on ``L_b``: adding a longer caption to the batch
        adds constant nodes to every pair. Positions at or beyond ``L_b`` (the fixed
        padding of ncljax's batches) are masked, so they change nothing; ``L_b`` counts the
        real captions of a padded batch only. With SAF in training, the official code
        normalises the attention scores of all ``B^2`` pairs as one BatchNorm group; here
        each query caption is a group, as in the other passes (SGR has no BatchNorm).
        """
        text = dict(text, words=text["words"] * text["mask"][..., None])  # zero padding
        words, glob = text["words"], text["glob"]
        valid = text.get("valid")
        live = text["mask"] if valid is None else text["mask"] & valid[:, None]
        in_batch = jnp.any(live, axis=0)  # [L]: l < L_b, the batch's longest caption

        def make_nodes(q, save):
            mask = jnp.broadcast_to(in_batch, q["words"].shape[:2])
            return self._nodes(
                words[:, None], q["words"], mask, glob, q["glob"], _INTRA_EPS, _INTRA_EPS
            )

        valid = dict(query_valid=valid, context_valid=valid)
        return self._pairs(make_nodes, _queries(text), train=train, **valid).T


def _queries(tree: dict) -> dict:
    """The per-item arrays a pairwise pass chunks over (the batch mask is not one)."""
    return {k: v for k, v in tree.items() if k != "valid"}


class SGRAFModel(nnx.Module):
    """The SGRAF retrieval model: region and Bi-GRU encoders, an SGR or SAF head.

    Image encoder ``v_r = l2(W x_r + c)`` (Xavier-uniform); text encoder: 300-d word
    embeddings, dropout, a bidirectional PyTorch-style GRU, directions averaged and L2
    normalised; the self-attention global vectors are part of each side's encoding.
    ``sim`` is the head's logit, or its sigmoid with ``sigmoid=True`` (SGRAF's output,
    used by NCR-style triplet losses and by GSC); a forward pass also returns the raw
    ``logit`` ``[B, B]`` (methods that read logits, e.g. SREM's energies).

    Image views (UGNCL): with ``views = W > 1`` the image side has ``W`` independently
    initialised region projections ``l2(W_w x_r + c_w)`` (view 0 is ``image_fc``, views
    ``1..W-1`` are ``image_views``); the visual self-attention and the similarity head are
    shared and applied once per view, in view order (so in training their BatchNorm
    statistics update once per view), against one encoding of the captions.
    ``encode_image`` then returns ``regions`` ``[B, W, R, D]`` and ``glob`` ``[B, W, D]``
    (the view axis after the item axis); ``similarity``, ``logit`` and ``sim`` are
    ``[W, n_img, n_txt]``, view ``w``'s first. The GSC intra-modal passes
    (``image_similarity``, ``text_similarity``) are not available with views.
    """

    image_keys = ("regions", "glob")
    text_keys = ("words", "mask", "glob")

    def __init__(
        self,
        region_dim: int,
        vocab_size: int,
        *,
        embed_dim: int = 1024,
        word_dim: int = 300,
        sim_dim: int = 256,
        num_regions: int = 36,
        kind: str = "sgr",
        steps: int = 3,
        smooth: float = 9.0,
        dropout: float = 0.4,
        bidirectional: bool = True,
        sigmoid: bool = True,
        chunk: int = 0,
        remat=False,
        length_groups: int = 4,
        compute_dtype: str = "float32",
        views: int = 1,
        rngs: nnx.Rngs,
    ):
        if views < 1:
            raise ValueError(f"views must be at least 1, got {views}.")
        self.image_fc = _linear(region_dim, embed_dim, rngs)
        self.text_encoder = encoders.GRUTextEncoder(
            vocab_size, word_dim, embed_dim, dropout=dropout, bidirectional=bidirectional, rngs=rngs
        )
        self.visual_sa = VisualSelfAttention(embed_dim, num_regions, dropout, rngs=rngs)
        self.text_sa = TextSelfAttention(embed_dim, dropout, rngs=rngs)
        self.head = SimilarityHead(
            embed_dim,
            sim_dim,
            kind=kind,
            steps=steps,
            smooth=smooth,
            chunk=chunk,
            remat=remat,
            length_groups=length_groups,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )
        self.sigmoid = sigmoid
        self.classifier = None
        self.num_views = views
        # Built last, so the other parameters are initialised as without views.
        self.image_views = nnx.List(
            [_linear(region_dim, embed_dim, rngs) for _ in range(views - 1)]
        )

    def encode_image(self, batch: dict, *, train: bool = False, rngs=None) -> dict:
        """``regions``, ``glob`` (with views: ``[B, W, ...]``); in training with a batch
        ``mask``, also ``valid`` ``[B]`` (the real images, which alone enter the BatchNorm
        statistics of this and later passes)."""
        valid = batch.get("mask") if train else None
        views = []
        for fc in (self.image_fc, *self.image_views):
            regions = _l2(fc(batch["regions"]))
            glob = self.visual_sa(regions, train=train, rngs=rngs, mask=valid)
            views.append((regions, glob))
        regions, glob = views[0]
        if self.num_views > 1:
            regions, glob = (jnp.stack(xs, axis=1) for xs in zip(*views, strict=True))
        out = {"regions": regions, "glob": glob}
        if valid is not None:
            out["valid"] = valid
        return out

    def encode_text(self, batch: dict, *, train: bool = False, rngs=None) -> dict:
        """``words``, ``mask`` (valid words), ``glob``; in training also ``valid`` (the real
        captions of a padded batch)."""
        words, mask, _ = self.text_encoder(batch["tokens"], batch["length"], train=train, rngs=rngs)
        glob = self.text_sa(words, mask, train=train, rngs=rngs)
        out = {"words": words, "mask": mask, "glob": glob}
        if train and batch.get("mask") is not None:
            out["valid"] = batch["mask"]
        return out

    def _output(self, logits):
        return jax.nn.sigmoid(logits) if self.sigmoid else logits

    def _cross(self, image: dict, text: dict, *, train: bool) -> jax.Array:
        """The head's logits ``[n_img, n_txt]``, or ``[W, n_img, n_txt]``: one call per view."""
        if self.num_views == 1:
            return self.head.cross(image, text, train=train)
        logits = [
            self.head.cross(
                dict(image, regions=image["regions"][:, w], glob=image["glob"][:, w]),
                text,
                train=train,
            )
            for w in range(self.num_views)
        ]
        return jnp.stack(logits)

    def _no_views(self, name: str) -> None:
        if self.num_views > 1:
            raise ValueError(
                f"{name} (GSC's intra-modal structure) is not available with image views "
                f"(views={self.num_views})."
            )

    def similarity(self, image: dict, text: dict, *, train: bool = False) -> jax.Array:
        """``[n_img, n_txt]`` similarity (sigmoid of the head's logit, or the logit); with
        views ``[W, n_img, n_txt]``."""
        return self._output(self._cross(image, text, train=train))

    def image_similarity(self, image: dict, *, train: bool = False) -> jax.Array:
        """GSC's image-image structure ``[B, B]`` (same head, same output map).

        Uses the global vectors of ``image``. The official GSC code recomputes them for
        this pass (fresh dropout masks, one more BatchNorm update): pass a fresh
        ``encode_image(batch, train=True, ...)`` to reproduce that.

        Raises:
          ValueError: with image views.
        """
        self._no_views("image_similarity")
        return self._output(self.head.image_image(image, train=train))

    def text_similarity(
        self, text: dict, *, train: bool = False, form: str = "attention"
    ) -> jax.Array:
        """GSC's text-text structure ``[B, B]`` (row: context caption, column: query).

        ``form='attention'``: the single-network GSC code's ``h_TT(T_j | T_i)`` (SCAN
        attention of caption ``i``'s words over caption ``j``'s); ``'aligned'``: the GSC+
        code's word-position-aligned, symmetric form (``SimilarityHead.text_text_aligned``).
        Uses the global vectors of ``text``; pass a fresh ``encode_text(...)`` to draw new
        dropout masks, as the official GSC code does for this pass.

        Raises:
          ValueError: for an unknown ``form``, or with image views.
        """
        self._no_views("text_similarity")
        if form == "attention":
            return self._output(self.head.text_text(text, train=train))
        if form == "aligned":
            return self._output(self.head.text_text_aligned(text, train=train))
        raise ValueError(f"text structure form must be 'attention' or 'aligned', got {form!r}.")

    def __call__(self, batch: dict, *, train: bool = False, rngs=None) -> dict:
        image = self.encode_image(batch, train=train, rngs=rngs)
        text = self.encode_text(batch, train=train, rngs=rngs)
        logit = self._cross(image, text, train=train)
        return {"image": image, "text": text, "logit": logit, "sim": self._output(logit)}
