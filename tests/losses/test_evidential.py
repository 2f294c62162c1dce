"""UGNCL's objectives (ncljax.losses.evidential) against float64 numpy loops.

The oracles are written from the paper's Secs. 3.2.3-3.3 (Eqs. 12-18) and the released
``model/UGNCL.py`` (``qxzha/UGNCL``) with python loops over the pairs and never call the
library: the evidential loss (Eqs. 12-14, from tests/test_evidence.py), the trusted robust
loss in its intended per-pair form (Eq. 16 on the hard sets, Eq. 1's hardest negative on the
determined-clean pairs, the determined-noisy ones left out as in the released code) and, to
pin the orientation, the released code's reading of it (its three text-to-image deviations,
(a)-(c) of ``np_trl_released``), the warm-up loss and the overall objective (Eq. 18).
Labels, codes and margins come from tests/labels/test_ugncl.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ncljax import evidence
from ncljax.labels.ugncl import CLEAN, HARD_CLEAN, HARD_NOISY, NOISY
from ncljax.losses import (
    edl_loss,
    top_k_mean,
    trl_warmup_loss,
    trusted_contrastive_loss,
    trusted_robust_loss,
    ugncl_loss,
)
from tests.labels.test_ugncl import np_targets, np_trusted_margins
from tests.test_evidence import (
    FAST_COMPILE,
    WHERE,
    np_edl,
    np_fused_evidence,
    np_log_evidence,
    real_of,
)

RTOL, ATOL = 2e-5, 1e-5
ALL = np.ones(7, bool)
HARD = (HARD_CLEAN, HARD_NOISY)


def jit(fn=None, **kwargs):
    if fn is None:
        return functools.partial(jit, **kwargs)
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


# ---------------------------------------------------------------------------------------------
# Oracles: float64, loops over the pairs i and the negatives j.


def _relu(x):
    return max(float(x), 0.0)


def np_top_k_mean(costs, k):
    out = np.zeros(len(costs))
    for i, row in enumerate(np.asarray(costs, np.float64)):
        out[i] = sum(sorted(row.tolist(), reverse=True)[:k]) / max(k, 1)
    return out


def _top_mean(values, lam):
    """``Top_lambda(v) / lambda``: the zeroed diagonal and the zeros count as entries."""
    return sum(sorted(values, reverse=True)[:lam]) / lam


def np_violations(sim, i, g, real):
    """``a_ij = [g - S_ii + S_ij]_+`` (image i, negative caption j) and
    ``c_ij = [g - S_ii + S_ji]_+`` (caption i, negative image j); ``a_ii = c_ii = 0``."""
    s = np.asarray(sim, np.float64)
    a = [_relu(g - s[i, i] + s[i, j]) if j != i else 0.0 for j in real]
    c = [_relu(g - s[i, i] + s[j, i]) if j != i else 0.0 for j in real]
    return a, c


def np_trl(sim, codes, margins, lam, where):
    """Eq. 16, intended form, per pair: hardest negatives on S_C, top-lambda means on the
    hard sets, 0 on S_N, each pair with its own margin."""
    real = real_of(where)
    out = np.zeros(len(where))
    for i in real:
        if codes[i] == NOISY:
            continue
        a, c = np_violations(sim, i, float(margins[i]), real)
        out[i] = max(a) + max(c) if codes[i] == CLEAN else _top_mean(a, lam) + _top_mean(c, lam)
    return out


def np_trl_released(sim, codes, margins, lam, where, a=True, b=True, c=True):
    """The released code's reading (``model/UGNCL.py``) as a batch total; each flag one of its
    deviations, all off = the intended form. (c) the margins are a ``[K, 1]`` column, so
    caption ``j``'s cost against image ``i``, ``[g - S_jj + S_ij]_+``, carries the negative
    image's margin ``g_i`` (intended: the caption's own ``g_j``); (a) the determined-clean
    caption term takes, for every caption column, the max over the clean image rows
    (intended: for each clean caption, the max over all its negative images); (b) the hard
    set's caption term takes the top-lambda along the hard image's row of that cost matrix
    (intended: along the hard caption's column)."""
    s = np.asarray(sim, np.float64)
    real = real_of(where)
    g = [float(m) for m in margins]

    def cost_s(i, j):  # image i against caption j, the image's margin
        return _relu(g[i] - s[i, i] + s[i, j]) if i != j else 0.0

    def cost_im(i, j):  # caption j against image i
        return _relu((g[i] if c else g[j]) - s[j, j] + s[i, j]) if i != j else 0.0

    clean = [i for i in real if codes[i] == CLEAN]
    hard = [i for i in real if codes[i] in HARD]
    total = sum(max(cost_s(i, j) for j in real) for i in clean)
    if a:
        total += sum(max([cost_im(i, j) for i in clean], default=0.0) for j in real)
    else:
        total += sum(max(cost_im(i, j) for i in real) for j in clean)
    for i in hard:
        total += _top_mean([cost_s(i, j) for j in real], lam)
        total += _top_mean([cost_im(i, j) if b else cost_im(j, i) for j in real], lam)
    return total


def np_trl_warmup(sim, lam, margin, where):
    real = real_of(where)
    out = np.zeros(len(where))
    for i in real:
        a, c = np_violations(sim, i, margin, real)
        out[i] = _top_mean(a, lam) + _top_mean(c, lam)
    return out


def np_trusted_contrastive(sim, codes, margins, where, margin=0.2, temperature=0.07):
    """Per pair: the pair's weight (1 on S_C or in the warm-up, ``min(margin_i / gamma, 1)``
    on the hard sets, 0 on S_N) times the mean of its image's and its caption's
    ``-log softmax`` over the real pairs, one loop per pair."""
    sim = np.asarray(sim, np.float64)
    real = real_of(where)
    out = np.zeros(len(where))
    for i in real:
        if codes is None or codes[i] == CLEAN:
            weight = 1.0
        elif codes[i] in (HARD_CLEAN, HARD_NOISY):
            weight = min(float(margins[i]) / margin, 1.0)
        else:
            weight = 0.0
        row = sim[i, real] / temperature
        col = sim[real, i] / temperature
        k = list(real).index(i)
        i2t = -(row[k] - np.log(np.exp(row).sum()))
        t2i = -(col[k] - np.log(np.exp(col).sum()))
        out[i] = weight * 0.5 * (i2t + t2i)
    return out


def np_evidential(evid, y, where, kl_weight):
    """``L_edl(alpha^{i2t}_i, y_i) + L_edl(alpha^{t2i}_i, y_i)`` per pair of one evidence
    matrix (rows images), the target ``y_i`` on class ``i``."""
    target = np.diag(np.asarray(y, np.float64))
    i2t = np_edl(evid + 1.0, target, where, kl_weight)[0]
    t2i = np_edl(evid.T + 1.0, target, where, kl_weight)[0]
    return i2t + t2i


def np_ugncl(
    log_e_views,
    sim_views,
    where,
    lam,
    labels=None,
    codes=None,
    margins=None,
    warmup=False,
    aggregation="per_view_mean",
    margin=0.2,
    kl_weight=0.1,
    robust_weight=0.8,
    ranking="trusted",
):
    """Eq. 18: ``(total, shares, evidential, robust)`` with ``total = L_e + xi2 sum_w sum_i
    l^w_i`` and ``shares_i = L^e_i + xi2 K sum_w l^w_i`` (mean over the real pairs = total)."""
    evid = np.exp(np.asarray(log_e_views, np.float64))
    views, num = evid.shape[0], len(where)
    real = real_of(where)
    y = np.ones(num) if warmup else np.asarray(labels, np.float64)
    if aggregation == "dst" and views > 1:  # the views' opinions fused per direction (Eq. 7)
        target = np.diag(y)
        i2t = np_fused_evidence(evid, where)
        t2i = np_fused_evidence(np.transpose(evid, (0, 2, 1)), where)
        evidential = np_edl(i2t + 1.0, target, where, kl_weight)[0]
        evidential += np_edl(t2i + 1.0, target, where, kl_weight)[0]
    else:
        per_view = [np_evidential(e, y, where, kl_weight) for e in evid]
        evidential = sum(per_view) / (1.0 if warmup else views)
    robust = np.zeros(num)
    for s in sim_views:
        if ranking == "contrastive":
            robust += np_trusted_contrastive(
                s, None if warmup else codes, margins, where, margin=margin
            )
        elif warmup:
            robust += np_trl_warmup(s, lam, margin, where)
        else:
            robust += np_trl(s, codes, margins, lam, where)
    evidential[~where] = 0.0
    total = evidential[real].mean() + robust_weight * robust.sum()
    shares = evidential + robust_weight * len(real) * robust
    return total, shares, evidential, robust


# ---------------------------------------------------------------------------------------------
# Inputs.


def similarities(seed, num=7, views=None):
    rng = np.random.default_rng(seed)
    shape = (num, num) if views is None else (views, num, num)
    raw = rng.normal(0.0, 0.6, shape)
    raw[..., np.arange(num), np.arange(num)] += 0.3
    return np.tanh(raw).astype(np.float32)


def batch(seed, views, num=7):
    """Moderate log-evidence (evidence <= ~3e4: scipy's float64 KL is exact enough), tanh
    similarities, and labels, codes (all four sets) and trusted margins."""
    rng = np.random.default_rng(seed)
    raw = rng.uniform(-3.0, 0.6, (views, num, num)).astype(np.float32)
    log_e = np_log_evidence(raw).astype(np.float32)
    sim = similarities(seed + 1, num, views)
    codes = np.array(([CLEAN, NOISY, HARD_CLEAN, HARD_NOISY] * num)[:num], np.int8)
    rng.shuffle(codes)
    if num == 7:  # every set among the real pairs of WHERE (padding 2 and 6)
        codes = np.array([HARD_NOISY, CLEAN, NOISY, HARD_CLEAN, NOISY, CLEAN, CLEAN], np.int8)
    u = rng.uniform(0.5, 0.7, num).astype(np.float32)
    q = rng.uniform(0.0, 1.0, num).astype(np.float32)
    pred = rng.uniform(size=num) < 0.5
    labels = np_targets(codes, q, pred).astype(np.float32)
    margins = np_trusted_margins(codes, u, q).astype(np.float32)
    return log_e, sim, labels, codes, margins


# ---------------------------------------------------------------------------------------------
# Evidential loss (Eq. 14).

EDL = jit(lambda log_e, y, where: edl_loss(log_e, y, where=where))


@pytest.mark.parametrize("target", ["soft", "soft_diagonal", "one_hot", "zero"])
@pytest.mark.parametrize("masked", [False, True])
def test_edl_loss_matches_oracle(target, masked):
    where = WHERE if masked else ALL
    rng = np.random.default_rng(200)
    log_e = np_log_evidence(rng.uniform(-3.0, 1.0, (7, 7))).astype(np.float32)
    y = {
        "soft": rng.uniform(0.02, 0.98, (7, 7)),
        "soft_diagonal": np.diag(rng.uniform(0.02, 0.98, 7)),
        "one_hot": np.eye(7),
        "zero": np.zeros((7, 7)),
    }[target].astype(np.float32)
    got = EDL(log_e, y, where)
    alpha = np.exp(log_e.astype(np.float64)) + 1.0
    want = np_edl(alpha, y.astype(np.float64), where, 0.1)[0]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("masked", [False, True])
def test_edl_loss_without_the_kl_term_matches_oracle_and_computes_no_log_gamma(masked):
    """``kl_weight=0`` (the cosine head's UGNCL): the oracle at weight 0, the same values
    and gradients as the full loss times a zero weight, and no log-gamma or digamma in the
    compiled program (the term is skipped, not multiplied by 0)."""
    where = WHERE if masked else ALL
    rng = np.random.default_rng(202)
    log_e = np_log_evidence(rng.uniform(-3.0, 1.0, (7, 7))).astype(np.float32)
    y = rng.uniform(0.02, 0.98, (7, 7)).astype(np.float32)

    def skipped(e):
        return edl_loss(e, y, kl_weight=0.0, where=where)

    def kept(e, w):  # a traced weight keeps the term, times 0
        return edl_loss(e, y, kl_weight=w, where=where)

    alpha = np.exp(log_e.astype(np.float64)) + 1.0
    want = np_edl(alpha, y.astype(np.float64), where, 0.0)[0]
    np.testing.assert_allclose(skipped(log_e), want, rtol=RTOL, atol=ATOL)
    zero = jnp.float32(0.0)
    np.testing.assert_allclose(skipped(log_e), kept(log_e, zero), rtol=1e-6, atol=1e-7)
    grads = [jit(jax.grad(lambda e: skipped(e).sum()))(log_e)]
    grads.append(jit(jax.grad(lambda e: kept(e, zero).sum()))(log_e))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-7)
    text = jax.jit(lambda e: edl_loss(e, y, kl_weight=0.0, where=where)).lower(log_e).as_text()
    assert "lgamma" not in text and "digamma" not in text
    full = jax.jit(lambda e: edl_loss(e, y, kl_weight=0.1, where=where)).lower(log_e).as_text()
    assert "lgamma" in full


def test_edl_loss_target_is_a_constant():
    log_e = np_log_evidence(np.random.default_rng(201).uniform(-3, 1, (7, 7))).astype(np.float32)
    y = np.diag([0.3, 1.0, 0.0, 0.7, 0.5, 1.0, 0.0]).astype(np.float32)
    grad = jit(jax.grad(lambda t, w: edl_loss(log_e, t, where=w).sum()))(y, WHERE)
    np.testing.assert_array_equal(grad, 0.0)


# ---------------------------------------------------------------------------------------------
# Top-k mean with a traced k.


def test_top_k_mean_traced_k_does_not_recompile():
    traces = []

    @jit
    def fn(costs, k):
        traces.append(None)  # runs once per trace
        return top_k_mean(costs, k)

    costs = np.random.default_rng(210).uniform(0.0, 1.0, (5, 7)).astype(np.float32)
    costs[:, 3] = 0.0
    for k in range(0, 10):  # k = 0 -> 0; k > 7 averages every entry over k
        np.testing.assert_allclose(fn(costs, k), np_top_k_mean(costs, k), rtol=1e-6, atol=1e-7)
    assert len(traces) == 1
    assert fn._cache_size() == 1


@pytest.mark.parametrize("max_k", [4, 7, 12])
def test_top_k_mean_with_a_static_bound_selects_instead_of_sorting(max_k):
    """``max_k``: ``lax.top_k`` of ``max_k`` entries per row, masked to a traced ``k <=
    max_k``: the numpy oracle's value, and the sort's gradient (ties included)."""
    costs = np.random.default_rng(211).uniform(0.0, 1.0, (5, 7)).astype(np.float32)
    costs[:, 3] = costs[:, 5]  # ties
    bounded = jit(lambda c, k: top_k_mean(c, k, max_k=max_k))
    for k in range(0, max_k + 1):
        np.testing.assert_allclose(bounded(costs, k), np_top_k_mean(costs, k), rtol=1e-6, atol=1e-7)
        grads = [
            jax.grad(lambda c, m=m, k=k: top_k_mean(c, k, max_k=m).sum())(jnp.asarray(costs))
            for m in (None, max_k)
        ]
        np.testing.assert_allclose(grads[1].sum(-1), grads[0].sum(-1), rtol=1e-6)
        np.testing.assert_allclose(
            np.sort(np.asarray(grads[1]), -1), np.sort(np.asarray(grads[0]), -1), rtol=1e-6
        )


def test_top_k_mean_below_a_static_floor_selects_only_the_floor():
    """``min_k``: a traced ``k`` at or below it takes the small selection, above it the
    large one, in one compiled program with a conditional; the oracle's value and the
    sort's gradient on both sides (ties included)."""
    costs = np.random.default_rng(212).uniform(0.0, 1.0, (5, 9)).astype(np.float32)
    costs[:, 2] = costs[:, 6]  # ties
    traces = []

    @jit
    def fn(c, k):
        traces.append(None)
        return top_k_mean(c, k, max_k=8, min_k=3)

    assert "conditional" in fn.lower(costs, 1).as_text(dialect="hlo")
    for k in range(0, 9):
        np.testing.assert_allclose(fn(costs, k), np_top_k_mean(costs, k), rtol=1e-6, atol=1e-7)
        grads = [
            jit(jax.grad(lambda c, k, b=b: top_k_mean(c, k, **b).sum()))(costs, k)
            for b in ({}, dict(max_k=8, min_k=3))
        ]
        np.testing.assert_allclose(grads[1].sum(-1), grads[0].sum(-1), rtol=1e-6)
        np.testing.assert_allclose(
            np.sort(np.asarray(grads[1]), -1), np.sort(np.asarray(grads[0]), -1), rtol=1e-6
        )
    assert len(traces) == 1


# ---------------------------------------------------------------------------------------------
# Trusted robust loss (Eq. 16, the paper's Sec. 3.3).

TRL = jit(lambda s, c, m, lam, where: trusted_robust_loss(s, c, m, lam, where=where))
WARMUP = jit(lambda s, lam, where: trl_warmup_loss(s, lam, margin=0.25, where=where))


@pytest.mark.parametrize("masked", [False, True])
def test_trusted_robust_loss_matches_oracle(masked):
    where = WHERE if masked else ALL
    _, _, _, codes, margins = batch(220, 1)
    for seed in range(3):
        sim = similarities(221 + seed)
        for lam in (1, 3, 4, 9):  # 9 > the real negatives: zeros fill the top-lambda
            got = TRL(sim, codes, margins, lam, where)
            want = np_trl(sim, codes, margins, lam, where)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
            assert (np.asarray(got)[(codes == NOISY) | ~where] == 0).all()
    assert set(codes[where].tolist()) == {CLEAN, NOISY, HARD_CLEAN, HARD_NOISY}


def test_trusted_robust_loss_orientation_is_intended_not_released():
    """The released code's orientation differs on (a) the clean pairs' caption term,
    (b) the hard pairs' caption top-lambda, (c) the margin of the negative image."""
    sim = np.array(
        [
            [0.6, 0.5, -0.2, 0.1, 0.4],
            [0.7, 0.1, 0.0, -0.3, 0.2],
            [0.3, 0.6, 0.4, 0.5, -0.1],
            [-0.4, 0.2, 0.6, 0.2, 0.3],
            [0.1, 0.0, 0.5, -0.2, 0.5],
        ],
        np.float32,
    )
    codes = np.array([CLEAN, NOISY, HARD_CLEAN, HARD_NOISY, CLEAN], np.int8)
    margins = np.array([0.2, 0.0, 0.03, 0.15, 0.2], np.float32)
    where = np.ones(5, bool)
    intended = np_trl(sim, codes, margins, 2, where).sum()
    released = np_trl_released(sim, codes, margins, 2, where)
    # The released oracle without its deviations is the intended one; each deviation alone
    # changes the value on this batch.
    np.testing.assert_allclose(
        np_trl_released(sim, codes, margins, 2, where, a=False, b=False, c=False), intended
    )
    for flags in ({"a": True}, {"b": True}, {"c": True}):
        flags = {"a": False, "b": False, "c": False, **flags}
        assert abs(np_trl_released(sim, codes, margins, 2, where, **flags) - intended) > 0.01
    assert abs(intended - released) > 0.1
    got = float(np.asarray(TRL(sim, codes, margins, 2, where)).sum())
    np.testing.assert_allclose(got, intended, rtol=1e-5)
    assert abs(got - released) > 0.1


@pytest.mark.parametrize("masked", [False, True])
def test_trl_warmup_loss_matches_oracle(masked):
    where = WHERE if masked else ALL
    for seed in range(2):
        sim = similarities(230 + seed)
        for lam in (1, 4, 8):
            got = WARMUP(sim, lam, where)
            np.testing.assert_allclose(
                got, np_trl_warmup(sim, lam, 0.25, where), rtol=RTOL, atol=1e-6
            )
    default = trl_warmup_loss(sim, 3)  # margin 0.2, no mask
    np.testing.assert_allclose(default, np_trl_warmup(sim, 3, 0.2, ALL), rtol=RTOL, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The overall objective (Eq. 18, the paper's Sec. 3.3).


@jit(static_argnames=("warmup", "aggregation", "max_negatives"))
def _ugncl(log_e, sim, labels, codes, margins, lam, where, warmup, aggregation, max_negatives=None):
    return ugncl_loss(
        log_e,
        sim,
        labels=labels,
        codes=codes,
        margins=margins,
        num_negatives=lam,
        warmup=warmup,
        edl_view_aggregation=aggregation,
        where=where,
        max_negatives=max_negatives,
    )


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("aggregation", ["per_view_mean", "dst"])
@pytest.mark.parametrize("views", [1, 2])
def test_ugncl_loss_matches_oracle(warmup, aggregation, views):
    log_e, sim, labels, codes, margins = batch(240 + views, views)
    for where in (ALL, WHERE):
        shares, terms = _ugncl(log_e, sim, labels, codes, margins, 3, where, warmup, aggregation)
        bounded, _ = _ugncl(log_e, sim, labels, codes, margins, 3, where, warmup, aggregation, 5)
        np.testing.assert_allclose(bounded, shares, rtol=1e-6, atol=1e-7)
        total, want, evidential, robust = np_ugncl(
            log_e, sim, where, 3, labels, codes, margins, warmup, aggregation
        )
        np.testing.assert_allclose(terms.evidential, evidential, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(terms.robust, robust, rtol=RTOL, atol=1e-6)
        np.testing.assert_allclose(shares, want, rtol=RTOL, atol=ATOL)
        # The trainer's mean over the real pairs is L_e + xi2 sum_w sum_i l^w_i.
        np.testing.assert_allclose(np.asarray(shares)[where].mean(), total, rtol=RTOL)
        assert (np.asarray(shares)[~where] == 0).all()


@pytest.mark.parametrize("masked", [False, True])
def test_trusted_contrastive_loss_matches_oracle(masked):
    """Each set's weight: 1 on S_C, the trusted margin over gamma on the hard sets, 0 on S_N;
    the warm-up (no codes) weights every pair 1; padding is neither a pair nor a negative."""
    _, sim, _, codes, margins = batch(260, 1)
    sim = sim[0]
    where = WHERE if masked else ALL
    fn = jit(trusted_contrastive_loss, static_argnames=("margin", "temperature"))
    got = fn(sim, codes, margins, where=where)
    want = np_trusted_contrastive(sim, codes, margins, where)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
    warm = fn(sim, None, None, where=where, temperature=0.2)
    want = np_trusted_contrastive(sim, None, None, where, temperature=0.2)
    np.testing.assert_allclose(warm, want, rtol=RTOL, atol=1e-6)
    # a hand-worked pair: two real pairs, cosines [[1, 0], [0, 1]], tau 1, a clean pair:
    # each direction -log(e / (e + 1)) = log(1 + 1/e)
    two = trusted_contrastive_loss(np.eye(2, dtype=np.float32), np.array([CLEAN, NOISY]),
                                   np.array([0.2, 0.1], np.float32), temperature=1.0)  # fmt: skip
    np.testing.assert_allclose(two, [np.log1p(np.exp(-1.0)), 0.0], rtol=1e-6)
    # the trusted margins are constants: no gradient flows into them
    grad = jax.grad(lambda m: trusted_contrastive_loss(sim, codes, m).sum())(margins)
    assert not np.asarray(grad).any()


@pytest.mark.parametrize("warmup", [False, True])
def test_ugncl_loss_contrastive_ranking_matches_oracle(warmup):
    """``ranking='contrastive'``: Eq. 18 with the contrastive form in place of Eq. 16 (the
    evidential part unchanged), summed over views and scaled by ``xi2 K`` as the hinge."""
    log_e, sim, labels, codes, margins = batch(270, 2)
    for where in (ALL, WHERE):
        shares, terms = ugncl_loss(
            log_e, sim, labels=labels, codes=codes, margins=margins, num_negatives=3,
            warmup=warmup, ranking="contrastive", where=where,
        )  # fmt: skip
        total, want, evidential, robust = np_ugncl(
            log_e, sim, where, 3, labels, codes, margins, warmup, ranking="contrastive"
        )
        np.testing.assert_allclose(terms.evidential, evidential, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(terms.robust, robust, rtol=RTOL, atol=1e-6)
        np.testing.assert_allclose(shares, want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(shares)[where].mean(), total, rtol=RTOL)
    with pytest.raises(ValueError, match="ranking"):
        ugncl_loss(log_e, sim, warmup=True, num_negatives=3, ranking="hinge")


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("ranking", ["trusted", "contrastive"])
def test_ugncl_loss_without_the_kl_term_matches_oracle(warmup, ranking):
    """``kl_weight=0`` (the cosine head's UGNCL) takes the evidential part from
    ``evidence.diagonal_edl_squared_error``: the oracle at weight 0, values and, through the
    raw scores, gradients equal to the dense form's (``kl_weight`` a traced 0 keeps it)."""
    log_e, sim, labels, codes, margins = batch(300, 2)
    kwargs = dict(labels=labels, codes=codes, margins=margins, num_negatives=3, warmup=warmup,
                  ranking=ranking)  # fmt: skip
    for where in (ALL, WHERE):
        shares, terms = ugncl_loss(log_e, sim, kl_weight=0.0, where=where, **kwargs)
        total, want, evidential, robust = np_ugncl(
            log_e, sim, where, 3, labels, codes, margins, warmup, kl_weight=0.0, ranking=ranking
        )
        np.testing.assert_allclose(terms.evidential, evidential, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(terms.robust, robust, rtol=RTOL, atol=1e-6)
        np.testing.assert_allclose(shares, want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(shares)[where].mean(), total, rtol=RTOL)

    def total_of(raw, weight):
        shares, _ = ugncl_loss(
            evidence.log_evidence(raw), jnp.tanh(raw), kl_weight=weight, where=WHERE, **kwargs
        )
        return shares.mean()

    raw = np.random.default_rng(301).uniform(-3.0, 2.0, (2, 7, 7)).astype(np.float32)
    fast = jax.jit(jax.value_and_grad(lambda r: total_of(r, 0.0)))(raw)
    dense = jax.jit(jax.value_and_grad(total_of))(raw, jnp.float32(0.0))  # traced: dense
    np.testing.assert_allclose(fast[0], dense[0], rtol=1e-6)
    np.testing.assert_allclose(fast[1], dense[1], rtol=1e-4, atol=1e-6)
    assert np.abs(dense[1]).max() > 1e-2


def test_ugncl_loss_takes_the_views_as_a_sequence():
    """A sequence of ``[K, K]`` views (a method that computes each view apart) gives the
    stacked array's values and gradients; views of unequal or non-square shapes are one
    error."""
    log_e, sim, labels, codes, margins = batch(310, 2)
    kwargs = dict(labels=labels, codes=codes, margins=margins, num_negatives=3, where=WHERE,
                  ranking="contrastive", kl_weight=0.0)  # fmt: skip

    def stacked(x):
        return ugncl_loss(x, sim, **kwargs)[0].sum()

    def listed(x):
        return ugncl_loss([x[0], x[1]], (sim[0], sim[1]), **kwargs)[0].sum()

    np.testing.assert_allclose(listed(log_e), stacked(log_e), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(listed)(log_e), jax.grad(stacked)(log_e), rtol=1e-6)
    with pytest.raises(ValueError, match="square"):
        ugncl_loss([log_e[0], log_e[1][:, :5]], sim, warmup=True, num_negatives=3)
    with pytest.raises(ValueError, match="at least one"):
        ugncl_loss([], sim, warmup=True, num_negatives=3)
    with pytest.raises(ValueError, match="must match"):
        ugncl_loss([log_e[0]], sim, warmup=True, num_negatives=3)


def test_ugncl_loss_view_aggregation():
    """Per-view evidential part: summed over views in warm-up, averaged in training."""
    log_e, sim, labels, codes, margins = batch(250, 2)
    ones = np.ones(7, np.float32)
    per_view = [np_evidential(np.exp(x.astype(np.float64)), ones, ALL, 0.1) for x in log_e]
    warm = _ugncl(log_e, sim, ones, codes, margins, 3, ALL, True, "per_view_mean")[1]
    train = _ugncl(log_e, sim, ones, codes, margins, 3, ALL, False, "per_view_mean")[1]
    np.testing.assert_allclose(warm.evidential, per_view[0] + per_view[1], rtol=RTOL)
    np.testing.assert_allclose(train.evidential, (per_view[0] + per_view[1]) / 2, rtol=RTOL)
    with pytest.raises(ValueError, match="edl_view_aggregation"):
        ugncl_loss(log_e, sim, labels=labels, codes=codes, margins=margins, num_negatives=3,
                   edl_view_aggregation="sum")  # fmt: skip
    with pytest.raises(ValueError, match="must match"):
        ugncl_loss(log_e, sim[:1], warmup=True, num_negatives=3)


@jit(static_argnames=("warmup", "aggregation"))
def _raw_grad(raw, labels, codes, margins, warmup, aggregation):
    def total(r):
        shares, _ = ugncl_loss(
            evidence.log_evidence(r),
            jnp.tanh(r),
            labels=labels,
            codes=codes,
            margins=margins,
            num_negatives=3,
            warmup=warmup,
            edl_view_aggregation=aggregation,
        )
        return shares.mean()

    return jax.value_and_grad(total)(raw)


@pytest.mark.parametrize(("warmup", "aggregation"), [(False, "dst"), (True, "per_view_mean")])
def test_gradients_finite_at_large_raw_scores(warmup, aggregation):
    rng = np.random.default_rng(260)
    _, _, labels, codes, margins = batch(261, 2)
    for raw in (
        50.0 * rng.standard_normal((2, 7, 7)),
        50.0 * rng.choice([-1.0, 1.0], (2, 7, 7)),
        np.full((2, 7, 7), -50.0),
    ):
        value, grad = _raw_grad(raw.astype(np.float32), labels, codes, margins, warmup, aggregation)
        assert np.isfinite(value) and np.isfinite(grad).all()


def test_jit_equals_no_jit():
    log_e, sim, labels, codes, margins = batch(270, 2)
    kwargs = {"labels": labels, "codes": codes, "margins": margins, "num_negatives": 3}
    eager = ugncl_loss(log_e, sim, where=WHERE, edl_view_aggregation="dst", **kwargs)
    jitted = _ugncl(log_e, sim, labels, codes, margins, 3, WHERE, False, "dst")
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_one_device_equals_eight(devices):
    log_e, sim, labels, codes, margins = batch(280, 2, num=16)
    where = np.ones(16, bool)
    where[[5, 11]] = False
    args = (log_e, sim, labels, codes, margins, 4, where)
    single = _ugncl(*args, False, "dst")
    # Auto axes: the loss mixes row- and column-sharded views (the t2i transposes).
    mesh = jax.make_mesh((8,), ("data",), (AxisType.Auto,), devices=devices)
    rows = NamedSharding(mesh, P(None, "data"))
    pairs = NamedSharding(mesh, P("data"))
    shardings = (rows, rows, pairs, pairs, pairs, NamedSharding(mesh, P()), pairs)
    sharded = _ugncl(*jax.device_put(args, shardings), False, "dst")
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    total = np_ugncl(log_e, sim, where, 4, labels, codes, margins, aggregation="dst")[0]
    np.testing.assert_allclose(np.asarray(sharded[0])[where].mean(), total, rtol=RTOL)


@pytest.mark.heavy
@pytest.mark.parametrize("kl_weight", [0.0, 0.1])
def test_the_columns_as_queries_equal_the_transposed_rows(kl_weight):
    """``axis=0``: each column of a ``[K, Q]`` matrix is a query, with its values and
    gradients those of the rows of the transpose (which ``ugncl_loss`` no longer copies)."""
    rng = np.random.default_rng(290)
    log_e = rng.uniform(-3.0, 4.0, (6, 9)).astype(np.float32)  # 6 classes, 9 queries
    target = np.zeros((6, 9), np.float32)
    target[rng.integers(0, 6, 9), np.arange(9)] = rng.uniform(0.2, 1.0, 9)
    where = np.array([True, True, False, True, True, True])

    def columns(x):
        return edl_loss(x, target, kl_weight=kl_weight, where=where, axis=0)

    def rows(x):
        return edl_loss(x.T, target.T, kl_weight=kl_weight, where=where)

    np.testing.assert_allclose(columns(log_e), rows(log_e), rtol=1e-6, atol=1e-7)
    grads = [jax.grad(lambda x, f=f: f(x).sum())(log_e) for f in (columns, rows)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert np.abs(grads[0]).max() > 0
    kl = evidence.dirichlet_kl_uniform(np.abs(log_e), where=where, axis=0)
    np.testing.assert_allclose(
        kl, evidence.dirichlet_kl_uniform(np.abs(log_e).T, where=where), rtol=1e-6
    )
