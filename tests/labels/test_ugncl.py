"""UGNCL's uncertainty-guided division and label rules (ncljax.labels.ugncl) against float64.

The oracles are python loops over the pairs and classes written from the paper's Secs. 3.1-3.3
(Eqs. 2, 8-11, 16-17), the released code (``qxzha/UGNCL``) and DECL's per-epoch
division (``QinYang79/DECL``) that it builds on (the division signals of both modes, the
partition, the targets, the trusted soft margins, the hard-negative schedule); the
subjective-logic pieces come from tests/test_evidence.py. They never call the library and
are reused by tests/losses/test_evidential.py.
"""

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ncljax.labels as labels
from ncljax.labels.ugncl import CLEAN, HARD_CLEAN, HARD_NOISY, NOISY
from tests.test_evidence import (
    FAST_COMPILE,
    WHERE,
    np_ds,
    np_log_evidence,
    np_opinion,
    np_softplus,
    real_of,
)

RTOL, ATOL = 2e-5, 1e-6
ALL = np.ones(7, bool)
MODES = [
    ("decl_lineage", "mean", "sum"),
    ("decl_lineage", "dst", "sum"),
    ("paper", "dst", "sum"),
    ("paper", "dst", "mean"),
    ("paper", "mean", "sum"),
    ("paper", "mean", "mean"),
]


# ---------------------------------------------------------------------------------------------
# Oracles: float64, loops over the pairs i and the classes k.


def _first_argmax(row, columns):
    best = None
    for k in columns:
        if best is None or row[k] > row[best]:
            best = k
    return best


def _gap(row, i, columns):
    """How far the own class is from the decision: ``row_i - max_{k != i} row_k``."""
    others = [row[k] for k in columns if k != i]
    return row[i] - max(others) if others else math.inf


def np_division(log_e_views, where=None, mode="decl_lineage", view_fusion=None, bidir="sum"):
    """The division (Eqs. 8-11, or DECL's reading over the views) from the ``[W, K, K]``
    log-evidence (rows images): ``(u, prediction, q, gap)`` per pair; padding pairs ``u = 1``,
    no prediction, ``q = 0``. ``gap`` is the margin of the argmax decision (near-ties make
    float32 and float64 disagree)."""
    log_e = np.asarray(log_e_views, np.float64)
    log_e = log_e[None] if log_e.ndim == 2 else log_e
    num_views, num = log_e.shape[0], log_e.shape[-1]
    where = np.ones(num, bool) if where is None else where
    real = real_of(where)
    classes = len(real)
    fusion = view_fusion or ("mean" if mode == "decl_lineage" else "dst")
    evid = np.exp(log_e)
    u, prob = np.zeros(num), np.zeros((num, num))
    if mode == "decl_lineage":
        if fusion == "dst":  # e = K (prod_w (1 + e_w / K) - 1), elementwise
            fused = np.ones((num, num))
            for w in range(num_views):
                fused = fused * (1.0 + evid[w] / classes)
            evid = (classes * (fused - 1.0))[None]
        for e in evid:
            for i in real:
                rows = sum(e[i, k] + 1.0 for k in real)
                cols = sum(e[k, i] + 1.0 for k in real)
                u[i] += (classes / rows + classes / cols) / len(evid)
                total = sum(e[i, k] + e[k, i] for k in real)
                for k in real:
                    prob[i, k] += (e[i, k] + e[k, i]) / total / len(evid)
    else:
        scale = 1.0 if bidir == "sum" else 0.5
        for i in real:
            opinions = []
            for e in evid:
                bidir_e = np.array([scale * (e[i, k] + e[k, i]) for k in range(num)])
                b, uw, _ = np_opinion(bidir_e, where)
                opinions.append((b[0], uw[0]))
            if fusion == "dst":
                b, ui = opinions[0]
                for bw, uw in opinions[1:]:
                    b, ui, _ = np_ds(b, ui, bw, uw)
            else:
                b = sum(o[0] for o in opinions) / len(opinions)
                ui = sum(o[1] for o in opinions) / len(opinions)
            u[i], prob[i] = ui, b
    pred, q, gap = np.zeros(num, bool), np.zeros(num), np.full(num, math.inf)
    u[~where] = 1.0
    for i in real:
        pred[i] = _first_argmax(prob[i], real) == i
        q[i] = prob[i, i]
        gap[i] = _gap(prob[i], i, real)
    return u, pred, q, gap


def np_partition(u, pred, q, threshold=0.5, epsilon=0.5):
    out = np.zeros(len(u), np.int8)
    for i in range(len(u)):
        if u[i] < threshold:
            out[i] = CLEAN if pred[i] else NOISY
        else:
            out[i] = HARD_CLEAN if q[i] > epsilon else HARD_NOISY
    return out


def np_targets(codes, q, pred, kind="paper_soft"):
    out = np.zeros(len(codes))
    for i, c in enumerate(codes):
        if kind == "binary_pred":
            out[i] = float(pred[i])
        else:
            out[i] = {CLEAN: 1.0, NOISY: 0.0}.get(int(c), float(q[i]))
    return out


def np_soft_margin(q, margin=0.2, curve=10.0):
    return margin * (curve ** float(q) - 1.0) / (curve - 1.0)


def np_trust(u, sharpness=10.0, clean=True):
    """``1 / (1 + (1/u - 1)^(-Delta))`` (hard-clean) or ``1 / (1 + (u / (1 - u))^(-Delta))``
    (hard-noisy), Eq. 17 as printed in the paper's PDF, ``u`` clipped to ``[1e-6, 1 - 1e-6]``."""
    u = min(max(float(u), 1e-6), 1.0 - 1e-6)
    base = 1.0 / u - 1.0 if clean else u / (1.0 - u)
    return 1.0 / (1.0 + base ** (-sharpness))


def np_trusted_margins(codes, u, q, margin=0.2, curve=10.0, sharpness=10.0):
    out = np.zeros(len(codes))
    for i, c in enumerate(codes):
        if c == CLEAN:
            out[i] = margin
        elif c in (HARD_CLEAN, HARD_NOISY):
            trust = np_trust(u[i], sharpness, clean=c == HARD_CLEAN)
            out[i] = np_soft_margin(q[i], margin, curve) * trust
    return out


def np_num_hard_negatives(step, start=128, rate=Fraction(1, 40), floor=5, num_real=None):
    """``max(floor(start - delta t), theta)`` exactly (rational ``delta``), capped at
    ``num_real - 1`` and at least 1."""
    lam = max(math.floor(Fraction(start) - Fraction(rate) * step), floor)
    if num_real is not None:
        lam = min(lam, num_real - 1)
    return max(lam, 1)


# ---------------------------------------------------------------------------------------------
# Inputs.


def raw_views(seed, views, num=7, scale=2.0, shift=0.0):
    rng = np.random.default_rng(seed)
    raw = scale * rng.standard_normal((views, num, num)) + shift
    raw[:, np.arange(num), np.arange(num)] += 1.5  # most pairs matched, some not
    return raw.astype(np.float32)


def log_e_of(raw, evidence_fn="exp_softplus"):
    return np_log_evidence(raw, 0.1, evidence_fn).astype(np.float32)


partition = jax.jit(
    labels.ugd_partition, static_argnames=("threshold", "epsilon"), compiler_options=FAST_COMPILE
)
trusted = jax.jit(
    labels.trusted_margins,
    static_argnames=("margin", "curve", "sharpness"),
    compiler_options=FAST_COMPILE,
)


@functools.partial(
    jax.jit, static_argnames=("mode", "view_fusion", "bidir_mode"), compiler_options=FAST_COMPILE
)
def signals(log_e, where, mode, view_fusion, bidir_mode):
    return labels.division_signals(
        log_e, mode=mode, view_fusion=view_fusion, bidir_mode=bidir_mode, where=where
    )


# ---------------------------------------------------------------------------------------------
# Division signals (Eqs. 8-11).


@pytest.mark.parametrize(("mode", "view_fusion", "bidir"), MODES)
@pytest.mark.parametrize("views", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_division_signals_match_oracle(mode, view_fusion, bidir, views, masked):
    where = WHERE if masked else ALL
    log_e = log_e_of(raw_views(100 + views, views, scale=1.0))
    got = signals(log_e, where, mode, view_fusion, bidir)
    u, pred, q, gap = np_division(log_e, where, mode, view_fusion, bidir)
    np.testing.assert_allclose(got.uncertainty, u, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got.soft_label, q, rtol=RTOL, atol=ATOL)
    assert np.abs(gap[where]).min() > 1e-4  # no near-tie: the decisions are well defined
    np.testing.assert_array_equal(got.prediction, pred)
    assert pred[where].any() and not pred[where].all()  # both outcomes occur
    if masked:
        np.testing.assert_array_equal(np.asarray(got.uncertainty)[~WHERE], 1.0)
        np.testing.assert_array_equal(np.asarray(got.prediction)[~WHERE], False)
        np.testing.assert_array_equal(np.asarray(got.soft_label)[~WHERE], 0.0)


def test_division_signals_defaults_and_single_view():
    log_e = log_e_of(raw_views(110, 2, scale=1.0))
    for mode, fusion in (("decl_lineage", "mean"), ("paper", "dst")):
        default = signals(log_e, ALL, mode, None, "sum")
        explicit = signals(log_e, ALL, mode, fusion, "sum")
        for a, b in zip(default, explicit, strict=True):
            np.testing.assert_array_equal(a, b)
    one = signals(log_e[0], ALL, "decl_lineage", None, "sum")  # [K, K]: one view
    want = np_division(log_e[0])
    np.testing.assert_allclose(one.uncertainty, want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(one.soft_label, want[2], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(one.prediction, want[1])
    for bad in ({"mode": "dst"}, {"view_fusion": "max"}, {"bidir_mode": "max"}):
        with pytest.raises(ValueError):
            labels.division_signals(log_e, **bad)
    with pytest.raises(ValueError, match="where"):
        labels.division_signals(log_e, where=np.ones(3, bool))


def test_decl_lineage_by_hand():
    # K = 3, one view, evidence E = 5 on pairs 0 and 1, E = 1 elsewhere:
    # pair 0: sum_k (E_0k + 1) = 6 + 2 + 2 = 10 in both directions, u = 3/10 + 3/10 = 0.6;
    #         P_0 = (5 + 5, 1 + 1, 1 + 1) / 14, q = 5/7, predicted -> hard-clean.
    # pair 2: sum = 6 both ways, u = 1; P_2 = (2, 2, 2) / 6, q = 1/3, the first argmax is
    #         class 0 -> not predicted; hard-noisy.
    log_e = np.log(np.array([[5.0, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32))
    got = signals(log_e, np.ones(3, bool), "decl_lineage", "mean", "sum")
    np.testing.assert_allclose(got.uncertainty, [0.6, 0.6, 1.0], rtol=1e-6)
    np.testing.assert_allclose(got.soft_label, [5 / 7, 5 / 7, 1 / 3], rtol=1e-6)
    np.testing.assert_array_equal(got.prediction, [True, True, False])
    codes = partition(*got)
    np.testing.assert_array_equal(codes, [HARD_CLEAN, HARD_CLEAN, HARD_NOISY])


@pytest.mark.parametrize(("bidir", "bound"), [("sum", 1 / 5), ("mean", 1 / 3)])
def test_paper_rule_never_gives_a_hard_set(bidir, bound):
    """Worked from Eqs. 3-8: evidence >= 1, so with two views fused by DST ``u <= 1/5`` (bidir
    sum) or ``u < 1/3`` (mean) and no pair reaches ``p = 0.5``; DECL's reading does."""
    rng = np.random.default_rng(120)
    batches = [raw_views(121 + s, 2, 6, scale=sc) for s, sc in enumerate((0.5, 1.0, 3.0, 10.0))]
    batches += [(rng.standard_normal((2, 6, 6)) * 1e4).astype(np.float32)]
    batches += [rng.choice([1e4, -1e4, 50.0, -50.0, 0.0], (2, 6, 6)).astype(np.float32)]
    batches += [np.full((2, 6, 6), v, np.float32) for v in (-50.0, -1e4, 0.0, 50.0)]
    batches += [(rng.uniform(-60, -20, (2, 6, 6))).astype(np.float32) for _ in range(4)]
    for where in (ALL[:6], WHERE[:6]):
        for raw in batches:
            log_e = np.asarray(np_softplus(raw) / 0.1, np.float32)
            got = signals(log_e, where, "paper", "dst", bidir)
            u = np.asarray(got.uncertainty)[where]
            assert u.max() <= bound + 1e-6 and (bidir == "sum" or u.max() < bound)
            codes = np.asarray(partition(*got))[where]
            assert np.isin(codes, [CLEAN, NOISY]).all()
    # Very negative scores (evidence ~1 everywhere): the paper's u stays at its bound, the
    # lineage's u is near 1 and every pair is hard.
    very_negative = np.asarray(np_softplus(np.full((2, 6, 6), -50.0)) / 0.1, np.float32)
    paper = signals(very_negative, ALL[:6], "paper", "dst", bidir)
    lineage = signals(very_negative, ALL[:6], "decl_lineage", "mean", "sum")
    np.testing.assert_array_less(np.asarray(paper.uncertainty), 0.5)
    np.testing.assert_allclose(lineage.uncertainty, 1.0, rtol=1e-6)
    codes = np.asarray(partition(*lineage))
    assert np.isin(codes, [HARD_CLEAN, HARD_NOISY]).all()
    mixed = very_negative.copy()
    mixed[:, 0, 0] = np_softplus(2.0) / 0.1  # one confident pair: determined, the others hard
    codes = np.asarray(partition(*signals(mixed, ALL[:6], "decl_lineage", "dst", "sum")))
    assert codes[0] == CLEAN and np.isin(codes[1:], [HARD_CLEAN, HARD_NOISY]).all()


@pytest.mark.parametrize("mode", ["decl_lineage", "paper"])
def test_division_signals_carry_no_gradient(mode):
    log_e = log_e_of(raw_views(130, 2, scale=1.0))
    weights = np.random.default_rng(131).uniform(0.5, 2.0, (3, 7)).astype(np.float32)

    def scalar(x):
        s = labels.division_signals(x, mode=mode, where=WHERE)
        return (
            (weights[0] * s.uncertainty).sum()
            + (weights[1] * s.soft_label).sum()
            + (weights[2] * s.prediction).sum()
        )

    grad = jax.jit(jax.grad(scalar), compiler_options=FAST_COMPILE)(log_e)
    np.testing.assert_array_equal(grad, 0.0)


# ---------------------------------------------------------------------------------------------
# Partition, targets, margins, schedule.


def test_ugd_partition_matches_loop():
    rng = np.random.default_rng(140)
    u = rng.uniform(0.0, 1.0, 40).astype(np.float32)
    q = rng.uniform(0.0, 1.0, 40).astype(np.float32)
    pred = rng.uniform(size=40) < 0.5
    u[:4], q[:4] = 0.5, [0.5, 0.7, 0.2, 0.5]  # at the thresholds: hard; q = 0.5 hard-noisy
    u[4], q[4], pred[4] = 0.4999, 0.9, False
    for threshold, epsilon in ((0.5, 0.5), (0.3, 0.6)):
        got = labels.ugd_partition(u, pred, q, threshold=threshold, epsilon=epsilon)
        assert got.dtype == jnp.int8
        np.testing.assert_array_equal(got, np_partition(u, pred, q, threshold, epsilon))
    got = np.asarray(labels.ugd_partition(u, pred, q))
    assert set(got.tolist()) == {CLEAN, NOISY, HARD_CLEAN, HARD_NOISY}
    np.testing.assert_array_equal(got[:5], [HARD_NOISY, HARD_CLEAN, HARD_NOISY, HARD_NOISY, NOISY])


@pytest.mark.parametrize("kind", ["paper_soft", "binary_pred"])
def test_edl_targets(kind):
    rng = np.random.default_rng(150)
    codes = np.array([CLEAN, NOISY, HARD_CLEAN, HARD_NOISY] * 3, np.int8)
    q = rng.uniform(0.0, 1.0, 12).astype(np.float32)
    pred = rng.uniform(size=12) < 0.5
    got = labels.edl_targets(codes, q, pred, kind=kind)
    np.testing.assert_allclose(got, np_targets(codes, q, pred, kind), rtol=1e-7)
    if kind == "paper_soft":
        np.testing.assert_array_equal(np.asarray(got)[:4], [1.0, 0.0, q[2], q[3]])
    grad = jax.grad(lambda x: labels.edl_targets(codes, x, pred, kind=kind).sum())(q)
    np.testing.assert_array_equal(grad, 0.0)
    with pytest.raises(ValueError, match="edl_target"):
        labels.edl_targets(codes, q, pred, kind="soft")


@pytest.mark.parametrize(
    ("u", "clean_weight", "noisy_weight"),
    [(0.5, 0.5, 0.5), (0.55, 0.118501, 0.881499), (0.6, 0.017046, 0.982954), (0.9, 2.87e-10, 1.0)],
)
def test_trusted_margin_reference_weights(u, clean_weight, noisy_weight):
    """Eq. 17: sigma(-Delta logit u) / sigma(Delta logit u), reference weights worked by hand;
    with q = 1 the soft margin is gamma, so the margin over gamma is the weight."""
    codes = np.array([HARD_CLEAN, HARD_NOISY, CLEAN, NOISY], np.int8)
    got = np.asarray(trusted(codes, np.full(4, u, np.float32), np.ones(4, np.float32))) / 0.2
    np.testing.assert_allclose(got, [clean_weight, noisy_weight, 1.0, 0.0], rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(np_trust(u, clean=True), clean_weight, rtol=2e-3)
    np.testing.assert_allclose(np_trust(u, clean=False), noisy_weight, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize(("q", "soft"), [(0.0, 0.0), (0.5, 0.048051), (0.8, 0.117991), (1.0, 0.2)])
def test_soft_margin_reference(q, soft):
    # u = 0.5: both trust weights are 1/2.
    codes = np.array([CLEAN, NOISY, HARD_CLEAN, HARD_NOISY], np.int8)
    got = trusted(codes, np.full(4, 0.5, np.float32), np.full(4, q, np.float32))
    np.testing.assert_allclose(got, [0.2, 0.0, soft / 2, soft / 2], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np_soft_margin(q), soft, rtol=1e-5, atol=1e-7)


def test_trusted_margins_match_oracle():
    rng = np.random.default_rng(160)
    codes = rng.integers(0, 4, 30).astype(np.int8)
    u = rng.uniform(0.0, 1.0, 30).astype(np.float32)
    u[:2] = [0.0, 1.0]  # clipped to [1e-6, 1 - 1e-6]
    q = rng.uniform(0.0, 1.0, 30).astype(np.float32)
    for kwargs in ({}, {"margin": 0.3, "curve": 5.0, "sharpness": 4.0}):
        got = trusted(codes, u, q, **kwargs)
        want = np_trusted_margins(codes, u, q, **kwargs)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
        got = np.asarray(got)
        assert (got[codes == CLEAN] == kwargs.get("margin", 0.2)).all()
        assert (got[codes == NOISY] == 0).all()
        assert (got <= kwargs.get("margin", 0.2) + 1e-7).all()
    grad = jax.jit(
        jax.grad(lambda x, y: labels.trusted_margins(codes, x, y).sum(), argnums=(0, 1)),
        compiler_options=FAST_COMPILE,
    )(u, q)
    for g in grad:
        np.testing.assert_array_equal(g, 0.0)


STEPS = np.arange(0, 6001)
SCHEDULE = [np_num_hard_negatives(int(t)) for t in STEPS]


def test_num_hard_negatives_schedule():
    got = np.asarray(labels.num_hard_negatives(STEPS))
    np.testing.assert_array_equal(got, SCHEDULE)
    assert got[0] == 128 and got[1] == 127 and got[40] == 127 and got[41] == 126
    # 128 - 0.025 t = 5 at t = 4920; the floor is 5 from t = 4881 on.
    assert got[4920] == 5 and (got[4920:] == 5).all() and got[4880] == 6 and got[4881] == 5
    # Capped at the real negatives of the batch, traced (no recompilation).
    capped = jax.jit(lambda t, n: labels.num_hard_negatives(t, num_real=n))
    for t, n in ((0, 16), (3999, 16), (3999, 40), (10_000, 3), (10_000, 1), (100, 200)):
        assert int(capped(t, n)) == np_num_hard_negatives(t, num_real=n)
    custom = labels.num_hard_negatives(100, start=64, rate=0.5, floor=3)
    assert int(custom) == np_num_hard_negatives(100, 64, Fraction(1, 2), 3)


def test_num_hard_negatives_schedule_under_jit():
    got = np.asarray(jax.jit(labels.num_hard_negatives)(STEPS))
    np.testing.assert_array_equal(got, SCHEDULE)  # got[3840] == 31, want 32
