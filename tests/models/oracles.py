"""Float64 numpy forward passes of the encoders, one example and one time step at a time.

They read the parameters out of the Flax modules and recompute every output from the
equations in the encoders' docstrings, sharing no code with ``ncljax.models``.
"""

import numpy as np


def np_l2(x, eps=1e-8):
    """``x / max(||x||, eps)`` of one vector."""
    x = np.asarray(x, np.float64)
    return x / max(np.sqrt(np.sum(x * x)), eps)


def np_unit_rows(x):
    return np.stack([np_l2(row) for row in x])


def np_linear_params(layers):
    """``[(kernel, bias), ...]`` in float64 from a sequence of ``nnx.Linear``."""
    return [
        (np.asarray(layer.kernel[...], np.float64), np.asarray(layer.bias[...], np.float64))
        for layer in layers
    ]


def np_mlp(params, x):
    """Linear layers with ReLU between them, none after the last (one vector ``x``)."""
    x = np.asarray(x, np.float64)
    for i, (kernel, bias) in enumerate(params):
        x = x @ kernel + bias
        if i < len(params) - 1:
            x = np.maximum(x, 0.0)
    return x


def np_mlp_encoder(model, x):
    """``MLPEncoder``: ``[B, out_dim]``."""
    params = np_linear_params(model.layers)
    return np.stack([np_l2(np_mlp(params, row)) for row in x])


def np_region_encoder(model, regions):
    """``RegionEncoder``: per-region unit features ``[B, R, out]``, pooled ``[B, out]``."""
    params = np_linear_params(model.layers)
    out_dim = params[-1][0].shape[1]
    features = np.zeros((*regions.shape[:2], out_dim))
    pooled = np.zeros((regions.shape[0], out_dim))
    for b in range(regions.shape[0]):
        projected = np.stack([np_mlp(params, r) for r in regions[b]])
        features[b] = np_unit_rows(projected)
        pooled[b] = np_l2(projected.mean(0))
    return features, pooled


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_gru_params(gru):
    """``(W_i [in, 3H], b_i [3H], W_h [H, 3H], b_h [3H])`` of one direction of a ``GRU``."""
    return tuple(
        np.asarray(p[...], np.float64)
        for p in (gru.input_kernel, gru.input_bias, gru.hidden_kernel, gru.hidden_bias)
    )


def np_gru_step(params, h, x):
    """PyTorch's GRU; the gates r, z, n are the kernels' output thirds, in that order.

    r = sigmoid(x W_ir + b_ir + h W_hr + b_hr), z = sigmoid(x W_iz + b_iz + h W_hz + b_hz),
    n = tanh(x W_in + b_in + r * (h W_hn + b_hn)), h' = (1 - z) n + z h.
    """
    w_i, b_i, w_h, b_h = params
    xi_r, xi_z, xi_n = np.split(x @ w_i + b_i, 3)
    hh_r, hh_z, hh_n = np.split(h @ w_h + b_h, 3)
    r = _sigmoid(xi_r + hh_r)
    z = _sigmoid(xi_z + hh_z)
    n = np.tanh(xi_n + r * hh_n)
    return (1.0 - z) * n + z * h


def np_gru_encoder(model, tokens, lengths, embedded=None):
    """``GRUTextEncoder``: word features ``[B, L, H]`` (zero when padded), pooled ``[B, H]``.

    The forward GRU reads the valid tokens in order, the backward GRU from the last valid
    token to the first, both from h = 0. ``embedded`` ``[B, L, W]`` replaces the lookup.
    """
    table = np.asarray(model.embed.embedding[...], np.float64)
    forward = np_gru_params(model.forward_gru)
    backward = None if model.backward_gru is None else np_gru_params(model.backward_gru)
    hidden = forward[2].shape[0]
    num, max_len = tokens.shape
    words = np.zeros((num, max_len, hidden))
    pooled = np.zeros((num, hidden))
    for b in range(num):
        n = int(lengths[b])
        x = table[tokens[b]] if embedded is None else np.asarray(embedded[b], np.float64)
        states = np.zeros((n, hidden))
        h = np.zeros(hidden)
        for t in range(n):
            h = np_gru_step(forward, h, x[t])
            states[t] = h
        if backward is not None:
            h = np.zeros(hidden)
            for t in reversed(range(n)):
                h = np_gru_step(backward, h, x[t])
                states[t] = (states[t] + h) / 2
        for t in range(n):
            words[b, t] = np_l2(states[t])
        pooled[b] = np_l2(states.mean(0))
    return words, pooled


def np_prototype_logits(z, prototypes, temperature):
    """``z @ normalize(P).T / temperature``."""
    return np.asarray(z, np.float64) @ np_unit_rows(prototypes).T / temperature


# ---------------------------------------------------------------------------------------------
# SGRAF (ncljax.models.sgraf), following the official PyTorch code: one caption at a time,
# sliced to its valid length, against every image (``EncoderSimilarity.forward``); no
# padding and no masks anywhere. GSC's intra-modal variants follow the official GSC code
# (``MediaBrain-SJTU/GSC``; the paper's Sec. 3.2): image against image region by region
# without attention, caption against caption through SCAN attention, each with its 1e-6
# terms.

SGRAF_BN_EPS = 1e-5
SGRAF_BN_MOMENTUM = 0.1
GSC_INTRA_EPS = 1e-6


def np_sgraf_l2(x, eps=1e-8):
    """The official ``l2norm``: ``x / (||x|| + eps)`` of one vector."""
    x = np.asarray(x, np.float64)
    return x / (np.sqrt(np.sum(x * x)) + eps)


def _np_linear(layer):
    return (
        np.asarray(layer.kernel[...], np.float64),
        np.asarray(layer.bias[...], np.float64),
    )


def _np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def np_bn_params(bn):
    """``(scale, bias, running_mean, running_var)`` of a ``TorchBatchNorm`` in float64."""
    return tuple(np.asarray(p[...], np.float64) for p in (bn.scale, bn.bias, bn.mean, bn.var))


def np_torch_batchnorm(params, x, channel_axis, train):
    """PyTorch ``BatchNorm1d``: per channel, statistics over every other axis.

    Training normalises with the batch mean and the biased variance and moves the
    running statistics by momentum 0.1 towards the batch mean and the *unbiased* variance;
    evaluation normalises with the running statistics. Returns ``(y, mean, var)``, the
    running statistics after the call.
    """
    scale, bias, mean, var = params
    x = np.moveaxis(np.asarray(x, np.float64), channel_axis, 0)
    y = np.empty_like(x)
    new_mean, new_var = mean.copy(), var.copy()
    m = SGRAF_BN_MOMENTUM
    for c in range(x.shape[0]):
        values = x[c].ravel()
        if train:
            mu = values.sum() / values.size
            squares = np.sum((values - mu) ** 2)
            norm_mean, norm_var = mu, squares / values.size
            new_mean[c] = (1 - m) * mean[c] + m * mu
            new_var[c] = (1 - m) * var[c] + m * squares / (values.size - 1)
        else:
            norm_mean, norm_var = mean[c], var[c]
        y[c] = (x[c] - norm_mean) / np.sqrt(norm_var + SGRAF_BN_EPS) * scale[c] + bias[c]
    return np.moveaxis(y, 0, channel_axis), new_mean, new_var


def np_visual_self_attention(module, regions, train=False):
    """``VisualSA`` (no dropout) of ``regions`` ``[B, R, D]``: ``v_hat`` ``[B, D]``.

    ``l_r = tanh(BN_R(W_l v_r + b_l))`` with the regions as BatchNorm channels,
    ``g = tanh(BN_D(W_g mean_r v_r + b_g))``, ``a = softmax_r(w_c (l_r * g) + b_c)``,
    ``v_hat = l2(sum_r a_r v_r)``. BatchNorm is skipped in training for a single image.
    Returns ``(v_hat, {'local': (mean, var), 'glob': (mean, var)})``, the running
    statistics after the call.
    """
    regions = np.asarray(regions, np.float64)
    w_l, b_l = _np_linear(module.local)
    w_g, b_g = _np_linear(module.glob)
    w_c, b_c = _np_linear(module.common)
    num, num_regions, _ = regions.shape
    local = np.stack([[regions[b, r] @ w_l + b_l for r in range(num_regions)] for b in range(num)])
    glob = np.stack([regions[b].mean(0) @ w_g + b_g for b in range(num)])
    local_params, glob_params = np_bn_params(module.local_bn), np_bn_params(module.glob_bn)
    stats = {"local": local_params[2:], "glob": glob_params[2:]}
    if num > 1 or not train:
        local, *stats["local"] = np_torch_batchnorm(local_params, local, 1, train)
        glob, *stats["glob"] = np_torch_batchnorm(glob_params, glob, 1, train)
    local, glob = np.tanh(local), np.tanh(glob)
    out = np.zeros((num, regions.shape[2]))
    for b in range(num):
        logits = [(local[b, r] * glob[b]) @ w_c[:, 0] + b_c[0] for r in range(num_regions)]
        weights = _np_softmax(logits)
        out[b] = np_sgraf_l2(sum(weights[r] * regions[b, r] for r in range(num_regions)))
    return out, {k: tuple(v) for k, v in stats.items()}


def np_text_self_attention(module, words):
    """``TextSA`` (no dropout) of one caption's valid words ``[L, D]``: ``u_hat`` ``[D]``."""
    words = np.asarray(words, np.float64)
    w_l, b_l = _np_linear(module.local)
    w_g, b_g = _np_linear(module.glob)
    w_c, b_c = _np_linear(module.common)
    glob = np.tanh(words.mean(0) @ w_g + b_g)
    logits = [np.tanh(u @ w_l + b_l) * glob @ w_c[:, 0] + b_c[0] for u in words]
    weights = _np_softmax(logits)
    return np_sgraf_l2(sum(a * u for a, u in zip(weights, words, strict=True)))


def np_scan_attention(query, context, smooth=9.0):
    """The official ``SCAN_attention`` of query items ``[m, D]`` over context items ``[n, D]``.

    ``A_kl = LeakyReLU_0.1(c_k . q_l)``, each context row L2-normalised over the queries
    (``+1e-8``), ``alpha_l = softmax_k(smooth A_kl)``, ``a_l = l2(sum_k alpha_lk c_k)``.
    """
    query, context = np.asarray(query, np.float64), np.asarray(context, np.float64)
    attn = np.zeros((len(context), len(query)))
    for k, c in enumerate(context):
        for w, q in enumerate(query):
            dot = c @ q
            attn[k, w] = dot if dot > 0 else 0.1 * dot
        attn[k] /= np.sqrt(np.sum(attn[k] ** 2)) + 1e-8
    return np.stack(
        [np_sgraf_l2(_np_softmax(smooth * attn[:, w]) @ context) for w in range(len(query))]
    )


def np_sgraf_head_params(head):
    """Float64 copies of a ``SimilarityHead``'s weights (and SAF's running statistics)."""
    params = {
        "kind": head.kind,
        "local": _np_linear(head.local),
        "glob": _np_linear(head.glob),
        "out": _np_linear(head.out),
    }
    if head.kind == "sgr":
        params["steps"] = [
            (_np_linear(q), _np_linear(k), _np_linear(u))
            for q, k, u in zip(head.query, head.key, head.update, strict=True)
        ]
    else:
        params["attn"] = _np_linear(head.attn)
        params["bn"] = np_bn_params(head.attn_bn)
    return params


def np_sgraf_nodes(params, local_sq, glob_sq):
    """``[s_glo; s_loc_1..m]`` ``[1 + m, S]`` from ``(a_l - q_l)^2`` ``[m, D]`` and the
    global squared difference ``[D]``: ``s = l2(W x + b)``."""
    (w_loc, b_loc), (w_glo, b_glo) = params["local"], params["glob"]
    nodes = [np_sgraf_l2(glob_sq @ w_glo + b_glo)]
    nodes += [np_sgraf_l2(x @ w_loc + b_loc) for x in local_sq]
    return np.stack(nodes)


def np_sgr_logit(params, nodes):
    """Three ``GraphReasoning`` steps on one pair's nodes, then ``w_e . N_0 + c_e``."""
    for (w_q, b_q), (w_k, b_k), (w_u, b_u) in params["steps"]:
        query, key = nodes @ w_q + b_q, nodes @ w_k + b_k
        edges = np.stack([_np_softmax(key @ q) for q in query])
        nodes = np.maximum((edges @ nodes) @ w_u + b_u, 0.0)
    w_e, b_e = params["out"]
    return nodes[0] @ w_e[:, 0] + b_e[0]


def np_saf_logits(params, group, running, train):
    """``AttentionFiltration`` of one query's call over all its contexts.

    ``group`` ``[X, 1 + m, S]`` holds the nodes of every context; the BatchNorm(1) batch is
    all ``X (1 + m)`` attention scores. ``beta = l1(sigmoid(BN(w_a . N_n + b_a)))`` over
    nodes, ``s = l2(sum_n beta_n N_n)``, logit ``w_e . s + c_e``. Returns ``(logits [X],
    running)``, the running statistics after the call.
    """
    (w_a, b_a), (w_e, b_e) = params["attn"], params["out"]
    scale, bias = params["bn"][:2]
    scores = np.stack([[n @ w_a[:, 0] + b_a[0] for n in nodes] for nodes in group])
    scores, mean, var = np_torch_batchnorm((scale, bias, *running), scores[:, None], 1, train)
    logits = np.zeros(len(group))
    for x, nodes in enumerate(group):
        gate = 1.0 / (1.0 + np.exp(-scores[x, 0]))
        gate = gate / (np.abs(gate).sum() + 1e-8)
        logits[x] = np_sgraf_l2(gate @ nodes) @ w_e[:, 0] + b_e[0]
    return logits, (mean, var)


def _np_sgraf_pairs(head, num_queries, query_nodes, train):
    """Logits ``[X, Q]`` from ``query_nodes(params, i) -> [X, 1 + m_i, S]``, one query at
    a time in order (SAF's running statistics move once per query, as the official loop).
    Returns ``(logits, (mean, var))``; the statistics are SAF's (``None`` for SGR)."""
    params = np_sgraf_head_params(head)
    running = params["bn"][2:] if params["kind"] == "saf" else None
    columns = []
    for i in range(num_queries):
        group = query_nodes(params, i)
        if params["kind"] == "sgr":
            columns.append([np_sgr_logit(params, nodes) for nodes in group])
        else:
            logits, running = np_saf_logits(params, group, running, train)
            columns.append(logits)
    return np.array(columns).T, running


def np_sgraf_cross(head, regions, img_glob, words, lengths, txt_glob, *, train=False):
    """``h(I_b, T_c)`` ``[n_img, n_txt]`` by the official per-caption loop.

    Caption ``c`` is sliced to ``words[c, :lengths[c]]``; each word attends over image
    ``b``'s regions (SCAN, smoothing 9); nodes from ``(a_l - u_l)^2`` and
    ``(v_hat_b - u_hat_c)^2``. Returns ``(logits, saf_running)``.
    """
    regions, img_glob = np.asarray(regions, np.float64), np.asarray(img_glob, np.float64)
    words, txt_glob = np.asarray(words, np.float64), np.asarray(txt_glob, np.float64)

    def nodes(params, c):
        query = words[c, : int(lengths[c])]
        group = []
        for b in range(len(regions)):
            attended = np_scan_attention(query, regions[b], head.smooth)
            diff = (img_glob[b] - txt_glob[c]) ** 2
            group.append(np_sgraf_nodes(params, (attended - query) ** 2, diff))
        return np.stack(group)

    return _np_sgraf_pairs(head, len(words), nodes, train)


def np_sgraf_image_image(head, regions, img_glob, *, train=False, eps=GSC_INTRA_EPS):
    """GSC's ``h_II(I_j, I_i)`` ``[B, B]`` (row ``j`` context, column ``i`` query).

    No attention: region-index-aligned ``(v_jr - v_ir)^2 + eps`` and
    ``(v_hat_j - v_hat_i)^2 + eps``.
    """
    regions, img_glob = np.asarray(regions, np.float64), np.asarray(img_glob, np.float64)

    def nodes(params, i):
        group = []
        for j in range(len(regions)):
            local = (regions[j] - regions[i]) ** 2 + eps
            glob = (img_glob[j] - img_glob[i]) ** 2 + eps
            group.append(np_sgraf_nodes(params, local, glob))
        return np.stack(group)

    return _np_sgraf_pairs(head, len(regions), nodes, train)


def np_sgraf_text_text(head, words, lengths, txt_glob, *, train=False, eps=GSC_INTRA_EPS):
    """GSC's ``h_TT(T_j | T_i)`` ``[B, B]`` (row ``j`` context, column ``i`` query).

    Caption ``i``'s words attend over caption ``j``'s valid words plus ``eps``; nodes from
    ``(a_l - u_il)^2`` (no eps) and ``(u_hat_j - u_hat_i)^2 + eps``.
    """
    words, txt_glob = np.asarray(words, np.float64), np.asarray(txt_glob, np.float64)

    def nodes(params, i):
        query = words[i, : int(lengths[i])]
        group = []
        for j in range(len(words)):
            context = words[j, : int(lengths[j])] + eps
            attended = np_scan_attention(query, context, head.smooth)
            glob = (txt_glob[j] - txt_glob[i]) ** 2 + eps
            group.append(np_sgraf_nodes(params, (attended - query) ** 2, glob))
        return np.stack(group)

    return _np_sgraf_pairs(head, len(words), nodes, train)


def np_gsc_plus_text_text(head, words, lengths, txt_glob, *, train=False):
    """GSC+'s ``h_TT`` ``[B, B]``, transcribed from the dual-network official code
    (``forward_topology``): the batch padded to its longest caption ``L_b`` with zero
    word vectors (``pad_packed_sequence``), pair ``(a, b)`` with local nodes
    ``(u_bl - u_al)^2 + 1e-6`` for every ``l < L_b`` and the global node
    ``(u_hat_b - u_hat_a)^2 + 1e-6``; no attention, no mask. SGR, or SAF in evaluation.
    """
    lengths = np.asarray(lengths)
    longest = int(lengths.max())
    words = np.asarray(words, np.float64)[:, :longest].copy()
    for k, n in enumerate(lengths):
        words[k, int(n) :] = 0.0
    txt_glob = np.asarray(txt_glob, np.float64)
    assert not train or head.kind == "sgr", "SAF batch statistics: one group of B^2 pairs"

    def nodes(params, a):
        group = []
        for b in range(len(words)):
            local = (words[b] - words[a]) ** 2 + 1e-6
            glob = (txt_glob[b] - txt_glob[a]) ** 2 + 1e-6
            group.append(np_sgraf_nodes(params, local, glob))
        return np.stack(group)

    return _np_sgraf_pairs(head, len(words), nodes, train)[0]


def np_sgraf_model(model, batch):
    """``SGRAFModel`` in evaluation mode from raw inputs: encodings and raw logits.

    Regions ``l2(W x_r + c)`` (official ``l2norm``), the Bi-GRU words of
    ``np_gru_encoder``, ``v_hat`` over the image batch, ``u_hat`` per sliced caption (as
    the official loop computes it), then ``np_sgraf_cross``.
    """
    w, c = _np_linear(model.image_fc)
    x = np.asarray(batch["regions"], np.float64)
    regions = np.stack([[np_sgraf_l2(r @ w + c) for r in image] for image in x])
    img_glob, _ = np_visual_self_attention(model.visual_sa, regions)
    lengths = np.asarray(batch["length"])
    words, _ = np_gru_encoder(model.text_encoder, np.asarray(batch["tokens"]), lengths)
    txt_glob = np.stack(
        [np_text_self_attention(model.text_sa, words[k, : lengths[k]]) for k in range(len(words))]
    )
    logits, _ = np_sgraf_cross(model.head, regions, img_glob, words, lengths, txt_glob)
    return {
        "regions": regions,
        "img_glob": img_glob,
        "words": words,
        "txt_glob": txt_glob,
        "logits": logits,
    }
