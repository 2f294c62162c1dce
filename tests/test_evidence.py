"""Evidence, Dirichlet opinions and Dempster-Shafer fusion (ncljax.evidence) against float64.

The oracles below are written from UGNCL's equations (Secs. 3.2.1-3.2.3, Eqs. 3-7 and 12-15):
evidence, subjective-logic opinions, the combination rule with its conflict ``C`` as the
double sum over ``k != l``, the expected squared error and the Dirichlet KL with
``scipy.special.gammaln`` / ``digamma``. They never call the library, and are the building
blocks of the division's and the objective's oracles (tests/labels/test_ugncl.py,
tests/losses/test_evidential.py).
"""

import decimal
import functools
import math
import types
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import digamma, gammaln

from ncljax import evidence
from ncljax.losses import edl_loss

RTOL, ATOL = 2e-5, 1e-6
FAST_COMPILE = {"xla_backend_optimization_level": 0}
WHERE = np.array([True, True, False, True, True, True, False])  # padding classes 2 and 6
EXTREMES = np.array([1e4, -1e4, 50.0, -50.0, 0.0], np.float32)
ALL = np.ones(7, bool)


def jit(fn):
    """``jax.jit`` without XLA's optimisations (the programs compile faster; results change
    by rounding only). The gamma-function terms are slow to compile op by op, so every KL
    check goes through one compiled program per shape."""
    return jax.jit(fn, compiler_options=FAST_COMPILE)


KL = jit(lambda log_a, where: evidence.dirichlet_kl_uniform(log_a, where=where))
# The functions under test, compiled (one small program per shape compiles faster than their
# operations one by one); test_jit_equals_no_jit checks the main ones against eager calls.
_STATIC = {
    "log_evidence": ("temperature", "evidence_fn", "max_log_evidence"),
    "fuse_log_evidence": ("axis",),
    "log_mean_evidence": ("axis",),
    "edl_squared_error": ("axis",),
}
ev = types.SimpleNamespace(
    **{
        name: jax.jit(
            getattr(evidence, name),
            static_argnames=_STATIC.get(name, ()),
            compiler_options=FAST_COMPILE,
        )
        for name in (
            "log_evidence",
            "log_alpha",
            "dirichlet_opinion",
            "ds_combine",
            "opinion_to_alpha",
            "fuse_log_evidence",
            "edl_squared_error",
            "log_mean_evidence",
        )
    }
)
EDL = jit(lambda log_e, y, where, w: edl_loss(log_e, y, kl_weight=w, where=where))


# ---------------------------------------------------------------------------------------------
# Oracles: float64, explicit loops over the classes.


def central_differences(fn, x, step=1e-5):
    """The gradient of a float64 scalar ``fn`` at ``x``, entry by entry."""
    x64 = np.asarray(x, np.float64)
    out = np.zeros_like(x64)
    for index in np.ndindex(*x64.shape):
        up, down = x64.copy(), x64.copy()
        up[index] += step
        down[index] -= step
        out[index] = (fn(up) - fn(down)) / (2 * step)
    return out


def real_of(where):
    return [k for k in range(len(where)) if where[k]]


def np_softplus(x):
    return np.logaddexp(0.0, np.asarray(x, np.float64))


def np_log_evidence(raw, temperature=0.1, evidence_fn="exp_softplus"):
    """Eq. 3 (``exp_softplus``) or DECL's ``exp(tanh(R) / tau)``, as ``log e``."""
    raw = np.asarray(raw, np.float64)
    if evidence_fn == "exp_softplus":
        return np_softplus(raw) / temperature
    return np.tanh(raw) / temperature


def np_opinion(e, where=None):
    """Eqs. 5-6 per row of the evidence ``e [Q, K]``: ``(b [Q, K], u [Q], Lambda [Q])`` over
    the real classes (``b = 0`` on padding)."""
    e = np.atleast_2d(np.asarray(e, np.float64))
    where = np.ones(e.shape[-1], bool) if where is None else where
    real = real_of(where)
    b, u, strength = np.zeros(e.shape), np.zeros(len(e)), np.zeros(len(e))
    for q in range(len(e)):
        strength[q] = sum(e[q, k] + 1.0 for k in real)
        for k in real:
            b[q, k] = e[q, k] / strength[q]
        u[q] = len(real) / strength[q]
    return b, u, strength


def np_ds(b1, u1, b2, u2):
    """Eq. 7 for one query: ``C`` as the sum over ``k != m``; returns ``(b, u, C)``."""
    num = len(b1)
    conflict = sum(b1[k] * b2[m] for k in range(num) for m in range(num) if k != m)
    b = np.array([(b1[k] * b2[k] + b1[k] * u2 + b2[k] * u1) / (1.0 - conflict) for k in range(num)])
    return b, u1 * u2 / (1.0 - conflict), conflict


def np_ds_rows(b1, u1, b2, u2):
    out = [np_ds(b1[q], u1[q], b2[q], u2[q]) for q in range(len(b1))]
    return np.array([o[0] for o in out]), np.array([o[1] for o in out])


def np_fused_evidence(e_views, where=None):
    """Evidence of the Dempster-Shafer fold of the views' opinions (each row a query over the
    classes), through Eq. 7: ``Lambda = K / u``, ``e_k = b_k Lambda``; 0 on padding."""
    e_views = np.asarray(e_views, np.float64)
    where = np.ones(e_views.shape[-1], bool) if where is None else where
    num = len(real_of(where))
    out = np.zeros(e_views.shape[1:])
    for q in range(e_views.shape[1]):
        b, u, _ = np_opinion(e_views[0, q], where)
        b, u = b[0], u[0]
        for w in range(1, len(e_views)):
            bw, uw, _ = np_opinion(e_views[w, q], where)
            b, u, _ = np_ds(b, u, bw[0], uw[0])
        out[q] = b * num / u
    return out


def np_edl_squared(alpha, y, where=None):
    """Eq. 12 per row over the real classes."""
    alpha, y = np.atleast_2d(alpha), np.atleast_2d(y)
    where = np.ones(alpha.shape[-1], bool) if where is None else where
    out = np.zeros(len(alpha))
    for q in range(len(alpha)):
        strength = sum(alpha[q, k] for k in real_of(where))
        for k in real_of(where):
            a = alpha[q, k]
            out[q] += (y[q, k] - a / strength) ** 2
            out[q] += a * (strength - a) / (strength**2 * (strength + 1.0))
    return out


def np_kl(alpha, where=None):
    """Eq. 13, ``KL[Dir(alpha) || Dir(1)]`` per row over the real classes (scipy)."""
    alpha = np.atleast_2d(np.asarray(alpha, np.float64))
    where = np.ones(alpha.shape[-1], bool) if where is None else where
    out = np.zeros(len(alpha))
    for q in range(len(alpha)):
        a = alpha[q, where]
        strength = a.sum()
        out[q] = gammaln(strength) - gammaln(len(a)) - gammaln(a).sum()
        out[q] += ((a - 1.0) * (digamma(a) - digamma(strength))).sum()
    return out


def np_edl(alpha, y, where=None, kl_weight=0.1):
    """Eq. 14 with ``alpha-tilde = y + (1 - y) alpha``; returns ``(L_edl, L_ls, L_kl)``."""
    alpha, y = np.atleast_2d(alpha), np.atleast_2d(y)
    squared = np_edl_squared(alpha, y, where)
    kl = np_kl(y + (1.0 - y) * alpha, where)
    return squared + kl_weight * kl, squared, kl


# High-precision Eq. 13 (60 digits; Stirling series with the upward recurrence): the reference
# where float64 itself cancels (alphas ~1e12 give lgamma ~1e13 against a KL of ~1e2).
_BERNOULLI = [Fraction(1, 6), Fraction(-1, 30), Fraction(1, 42), Fraction(-1, 30), Fraction(5, 66)]
_BERNOULLI += [Fraction(-691, 2730), Fraction(7, 6), Fraction(-3617, 510), Fraction(43867, 798)]
_CTX = decimal.Context(prec=60)


def _dec(x):
    return _CTX.create_decimal(x) if not isinstance(x, decimal.Decimal) else x


def _dec_lgamma(x):
    x, shift = _dec(x), _dec(0)
    while x < 40:
        shift, x = _CTX.add(shift, _CTX.ln(x)), _CTX.add(x, 1)
    pi2 = _dec("6.28318530717958647692528676655900576839433879875021164194989")
    s = (x - _dec("0.5")) * _CTX.ln(x) - x + _CTX.ln(pi2) / 2
    for n, b in enumerate(_BERNOULLI, 1):
        s += _dec(b.numerator) / _dec(b.denominator) / (2 * n * (2 * n - 1) * x ** (2 * n - 1))
    return s - shift


def _dec_digamma(x):
    x, shift = _dec(x), _dec(0)
    while x < 40:
        shift, x = shift + 1 / x, x + 1
    s = _CTX.ln(x) - 1 / (2 * x)
    for n, b in enumerate(_BERNOULLI, 1):
        s -= _dec(b.numerator) / _dec(b.denominator) / (2 * n * x ** (2 * n))
    return s - shift


def dec_kl(alpha):
    with decimal.localcontext(_CTX):
        a = [_dec(float(v)) for v in alpha]
        strength = sum(a)
        psi = _dec_digamma(strength)
        out = _dec_lgamma(strength) - _dec_lgamma(len(a)) - sum(_dec_lgamma(v) for v in a)
        out += sum((v - 1) * (_dec_digamma(v) - psi) for v in a)
        return float(out)


# ---------------------------------------------------------------------------------------------
# Inputs.


def raw_scores(seed, shape, low=-3.0, high=1.2):
    """Moderate raw similarities: ``l = softplus(R) / 0.1 <= 15``, evidence below ~3e6."""
    return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)


def f32_log_e(raw, **kwargs):
    return np.asarray(ev.log_evidence(raw, **kwargs))


# ---------------------------------------------------------------------------------------------
# Evidence (Eq. 3) and Dirichlet parameters.


@pytest.mark.parametrize("evidence_fn", ["exp_softplus", "exp_tanh"])
@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_log_evidence_closed_form(evidence_fn, temperature):
    raw = raw_scores(0, (5, 7), -6.0, 4.0)
    got = ev.log_evidence(raw, temperature=temperature, evidence_fn=evidence_fn)
    want = np_log_evidence(raw, temperature, evidence_fn)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    clipped = ev.log_evidence(
        raw, temperature=temperature, evidence_fn=evidence_fn, max_log_evidence=3.0
    )
    np.testing.assert_allclose(clipped, np.minimum(want, 3.0), rtol=1e-6, atol=1e-6)
    if evidence_fn == "exp_softplus":  # e = exp(l) >= 1
        assert (np.asarray(got) >= 0).all()
    with pytest.raises(ValueError, match="evidence_fn"):
        ev.log_evidence(raw, evidence_fn="sigmoid")


def test_log_alpha_and_directions():
    log_e = f32_log_e(raw_scores(1, (7, 7)))
    np.testing.assert_allclose(
        np.exp(np.asarray(ev.log_alpha(log_e), np.float64)),
        np.exp(log_e.astype(np.float64)) + 1.0,
        rtol=RTOL,
    )
    i2t, t2i = evidence.directional_log_evidence(log_e)
    np.testing.assert_array_equal(i2t, log_e)
    np.testing.assert_array_equal(t2i, log_e.T)
    with pytest.raises(ValueError, match="square"):
        evidence.directional_log_evidence(log_e[:, :4])


# ---------------------------------------------------------------------------------------------
# Opinions (Eqs. 5-6).


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("evidence_fn", ["exp_softplus", "exp_tanh"])
def test_dirichlet_opinion_closed_form(masked, evidence_fn):
    where = WHERE if masked else None
    log_e = f32_log_e(raw_scores(2, (5, 7)), evidence_fn=evidence_fn)
    got = ev.dirichlet_opinion(log_e, where=where)
    b, u, strength = np_opinion(np.exp(log_e.astype(np.float64)), where)
    np.testing.assert_allclose(got.belief, b, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(got.uncertainty, u, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(got.log_strength, np.log(strength), rtol=1e-6, atol=1e-5)
    if masked:
        assert (np.asarray(got.belief)[:, ~WHERE] == 0).all()
    np.testing.assert_allclose(np.asarray(got.belief).sum(-1) + got.uncertainty, 1.0, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_belief_plus_uncertainty_is_one(masked):
    where = WHERE if masked else None
    rng = np.random.default_rng(3)
    for scale in (1.0, 3.0):
        raw = (scale * rng.standard_normal((5, 7))).astype(np.float32)
        raw[0] = -1e4  # no evidence anywhere: u = K / (2K) = 1/2
        raw[1] = rng.choice(EXTREMES[1:], 7)  # -1e4, +-50, 0
        raw[2] = 50.0
        for fn in ("exp_softplus", "exp_tanh"):
            op = ev.dirichlet_opinion(ev.log_evidence(raw, evidence_fn=fn), where=where)
            total = np.asarray(op.belief, np.float64).sum(-1) + np.asarray(op.uncertainty)
            # Log-evidence 500 (raw 50) is resolved to ~3e-5 in float32.
            tol = np.where(np.abs(raw).max(1) >= 50, 5e-5, 1e-5)
            assert (np.abs(total - 1.0) <= tol).all(), total
            assert np.isfinite(op.log_strength).all()
        op = ev.dirichlet_opinion(ev.log_evidence(raw), where=where)
        np.testing.assert_allclose(op.uncertainty[0], 0.5, rtol=1e-6)


def test_belief_plus_uncertainty_is_one_saturated():
    # Raw 1e4 gives l = 1e5; two saturated classes must share the belief 1/2 : 1/2.
    raw = np.array([[1e4, 1e4, -50.0, 0.0, 0.0], [1e4] * 5], np.float32)
    op = ev.dirichlet_opinion(ev.log_evidence(raw))
    np.testing.assert_allclose(op.belief[0, :2], 0.5, rtol=1e-5)  # got 0.4989185
    total = np.asarray(op.belief, np.float64).sum(-1) + np.asarray(op.uncertainty)
    np.testing.assert_allclose(total, 1.0, atol=1e-5)  # got 0.997837, 1.000063


# ---------------------------------------------------------------------------------------------
# Dempster-Shafer combination (Eq. 7).


def test_ds_reference_vector_k4():
    """Worked by hand from Eq. 7: alpha1 = (5,2,2,3), alpha2 = (3,3,2,2) -> (9,4.5,3.25,4.5)."""
    alpha1, alpha2 = np.array([5.0, 2, 2, 3]), np.array([3.0, 3, 2, 2])
    b1, u1 = ev.dirichlet_opinion(np.log(alpha1 - 1.0).astype(np.float32))[:2]
    b2, u2 = ev.dirichlet_opinion(np.log(alpha2 - 1.0).astype(np.float32))[:2]
    np.testing.assert_allclose(b1, [1 / 3, 1 / 12, 1 / 12, 1 / 6], rtol=1e-6)
    np.testing.assert_allclose(u1, 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(b2, [0.2, 0.2, 0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(u2, 0.4, rtol=1e-6)
    b, u = ev.ds_combine(b1, u1, b2, u2)
    np.testing.assert_allclose(b, [0.376471, 0.164706, 0.105882, 0.164706], atol=1e-6)
    np.testing.assert_allclose(u, 0.188235, atol=1e-6)
    conflict = 1.0 - float(u1) * float(u2) / float(u)  # u = u1 u2 / (1 - C)
    np.testing.assert_allclose(conflict, 0.291667, atol=1e-6)
    np.testing.assert_allclose(ev.opinion_to_alpha(b, u), [9, 4.5, 3.25, 4.5], rtol=1e-6)
    # The oracle agrees with the hand-worked numbers too.
    want_b, want_u, want_c = np_ds(np.asarray(b1, np.float64), 1 / 3, [0.2, 0.2, 0.1, 0.1], 0.4)
    np.testing.assert_allclose(want_c, 7 / 24)
    np.testing.assert_allclose(want_b * 4 / want_u + 1, [9, 4.5, 3.25, 4.5], rtol=1e-6)


def test_ds_combine_by_hand_three_classes():
    # b1 = (0.5, 0.2, 0.1), u1 = 0.2; b2 = (0.3, 0.3, 0.1), u2 = 0.3.
    # C = sum_{k != l} b1_k b2_l = 0.8 * 0.7 - (0.15 + 0.06 + 0.01) = 0.34, 1 - C = 0.66.
    # b_0 = (0.15 + 0.5 * 0.3 + 0.3 * 0.2) / 0.66 = 0.36 / 0.66 = 6/11
    # b_1 = (0.06 + 0.2 * 0.3 + 0.3 * 0.2) / 0.66 = 0.18 / 0.66 = 3/11
    # b_2 = (0.01 + 0.1 * 0.3 + 0.1 * 0.2) / 0.66 = 0.06 / 0.66 = 1/11
    # u = 0.2 * 0.3 / 0.66 = 1/11; alpha = b K / u + 1 = (19, 10, 4).
    b1, u1 = np.array([0.5, 0.2, 0.1], np.float32), np.float32(0.2)
    b2, u2 = np.array([0.3, 0.3, 0.1], np.float32), np.float32(0.3)
    b, u = ev.ds_combine(b1, u1, b2, u2)
    np.testing.assert_allclose(b, [6 / 11, 3 / 11, 1 / 11], rtol=1e-6)
    np.testing.assert_allclose(u, 1 / 11, rtol=1e-6)
    np.testing.assert_allclose(ev.opinion_to_alpha(b, u), [19.0, 10.0, 4.0], rtol=1e-6)
    want_b, want_u, want_c = np_ds([0.5, 0.2, 0.1], 0.2, [0.3, 0.3, 0.1], 0.3)
    np.testing.assert_allclose(want_c, 0.34)
    np.testing.assert_allclose(want_b, [6 / 11, 3 / 11, 1 / 11])
    np.testing.assert_allclose(want_u, 1 / 11)


def _random_opinions(seed, count, rows=5, num=7):
    """Opinions of evidence up to e^5 (rounding in ``1 - C`` stays small: see the xfail
    test below for strongly conflicting ones)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        log_e = rng.uniform(-2.0, 5.0, (rows, num)).astype(np.float32)
        b, u = ev.dirichlet_opinion(log_e)[:2]
        out.append((np.asarray(b), np.asarray(u)))
    return out


def test_ds_combine_random_commutative_associative():
    (b1, u1), (b2, u2), (b3, u3) = _random_opinions(4, 3)
    b, u = ev.ds_combine(b1, u1, b2, u2)
    want_b, want_u = np_ds_rows(b1, u1, b2, u2)
    np.testing.assert_allclose(b, want_b, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(u, want_u, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(np.asarray(b, np.float64).sum(-1) + u, 1.0, atol=5e-6)
    b_swap, u_swap = ev.ds_combine(b2, u2, b1, u1)
    np.testing.assert_allclose(b_swap, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(u_swap, u, rtol=1e-6, atol=1e-7)
    left = ev.ds_combine(*ev.ds_combine(b1, u1, b2, u2), b3, u3)
    right = ev.ds_combine(b1, u1, *ev.ds_combine(b2, u2, b3, u3))
    for x, y in zip(left, right, strict=True):
        np.testing.assert_allclose(x, y, rtol=5e-5, atol=1e-7)


def test_ds_combine_conflicting_confident_opinions():
    # Log-evidence 20 on class 0 in one view, on class 1 in the other: the fused opinion
    # splits the belief evenly between them (fuse_log_evidence gets this right).
    log_e = np.array([[[20.0, 0.0, 0.0]], [[0.0, 20.0, 0.0]]], np.float32)
    (b1, u1), (b2, u2) = (ev.dirichlet_opinion(x)[:2] for x in log_e)
    e = np.exp(log_e.astype(np.float64))
    want_b, want_u, _ = np_ds(
        *[x[0] for x in np_opinion(e[0])[:2]], *[x[0] for x in np_opinion(e[1])[:2]]
    )
    b, u = ev.ds_combine(b1, u1, b2, u2)  # got inf, inf
    np.testing.assert_allclose(b[0], want_b, rtol=1e-4)
    np.testing.assert_allclose(u[0], want_u, rtol=1e-4)


def test_opinion_to_alpha_closed_form():
    ((b, u),) = _random_opinions(5, 1)
    want = b.astype(np.float64) * b.shape[-1] / u.astype(np.float64)[:, None] + 1.0
    np.testing.assert_allclose(ev.opinion_to_alpha(b, u), want, rtol=1e-6)


@pytest.mark.parametrize("views", [2, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_fuse_log_evidence_is_pairwise_ds(views, masked):
    where = WHERE if masked else np.ones(7, bool)
    real = real_of(where)
    log_e = f32_log_e(raw_scores(6 + views, (views, 5, 7)))
    got = np.asarray(ev.fuse_log_evidence(log_e, int(where.sum()) if masked else None))
    # Library composition: fold ds_combine over the views' opinions, alpha - 1 = evidence.
    b, u = ev.dirichlet_opinion(log_e[0], where=where)[:2]
    for w in range(1, views):
        b, u = ev.ds_combine(b, u, *ev.dirichlet_opinion(log_e[w], where=where)[:2])
    folded = np.asarray(ev.opinion_to_alpha(np.asarray(b)[:, real], u)) - 1.0
    np.testing.assert_allclose(np.exp(got[:, real]), folded, rtol=1e-4)
    # The float64 oracle: Eq. 7 folded with the conflict as a double sum.
    want = np_fused_evidence(np.exp(log_e.astype(np.float64)), where)
    np.testing.assert_allclose(got[:, real], np.log(want[:, real]), rtol=1e-5, atol=2e-5)
    # And the elementwise closed form 1 + e / K = prod_w (1 + e_w / K).
    num = len(real)
    prod = np.prod(1.0 + np.exp(log_e.astype(np.float64)) / num, axis=0)
    np.testing.assert_allclose(got[:, real], np.log(num * (prod - 1.0))[:, real], rtol=1e-5)
    # axis: the views on another axis.
    moved = ev.fuse_log_evidence(np.moveaxis(log_e, 0, 2), num, axis=2)
    np.testing.assert_allclose(moved, got, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Evidential loss terms (Eqs. 12-14).


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("evidence_fn", ["exp_softplus", "exp_tanh"])
def test_edl_squared_error_closed_form(masked, evidence_fn):
    where = WHERE if masked else None
    log_e = f32_log_e(raw_scores(10, (5, 7)), evidence_fn=evidence_fn)
    alpha = np.exp(log_e.astype(np.float64)) + 1.0
    rng = np.random.default_rng(11)
    for y in (np.eye(5, 7), rng.uniform(0, 1, (5, 7)), np.zeros((5, 7))):
        got = ev.edl_squared_error(log_e, y.astype(np.float32), where=where)
        np.testing.assert_allclose(got, np_edl_squared(alpha, y, where), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("masked", [False, True])
def test_edl_squared_error_gradient_matches_finite_differences(masked, axis):
    """The gradient in the log-evidence, against central differences of the float64
    oracle's terms summed class by class (rows as queries; ``axis=0`` reads columns)."""
    where = WHERE if masked else None
    log_e = np.asarray(ev.log_evidence(raw_scores(15, (7, 7), low=-1.0, high=0.3)))
    y = np.random.default_rng(16).uniform(0.05, 0.95, 7) * np.eye(7)
    weights = np.random.default_rng(17).uniform(0.5, 1.5, 7)

    def oracle(x):
        x = x.T if axis == 0 else x
        target = y.T if axis == 0 else y
        return float(weights @ np_edl_squared(np.exp(x) + 1.0, target, where))

    def weighted(x):
        per_query = evidence.edl_squared_error(x, y, where=where, axis=axis)
        return jnp.dot(jnp.asarray(weights, jnp.float32), per_query)

    got = jit(jax.grad(weighted))(jnp.asarray(log_e))
    want = central_differences(oracle, log_e)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)
    assert np.abs(want).max() > 1e-3  # the check reads a gradient that is not 0


DIAGONAL = jit(lambda log_e, y, where: evidence.diagonal_edl_squared_error(log_e, y, where=where))


def _diagonal_case(seed, scale):
    """``[7, 7]`` log-evidence from raw scores of spread ``scale`` (the pairs' own higher),
    and targets 1, 0 and in between."""
    rng = np.random.default_rng(seed)
    raw = rng.normal(-1.0, scale, (7, 7)) + np.diag(np.full(7, scale))
    log_e = np.asarray(ev.log_evidence(raw.astype(np.float32)))
    y = rng.uniform(0.05, 0.95, 7).astype(np.float32)
    y[[0, 4]] = 1.0, 0.0
    return log_e, y


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scale", [0.5, 2.0, 8.0])
def test_diagonal_edl_squared_error_matches_the_oracle(masked, scale):
    """Each row and each column against Eq. 12 in float64, the query's target on its own
    class; at ``scale`` 8 the evidence reaches ``e^80`` and a query's own share ``1 - 1e-30``."""
    log_e, y = _diagonal_case(40 + int(scale), scale)
    where = WHERE if masked else ALL
    rows, columns = DIAGONAL(log_e, y, where)
    alpha = np.exp(log_e.astype(np.float64)) + 1.0
    target = np.diag(y.astype(np.float64))
    real = where if masked else ALL
    np.testing.assert_allclose(
        np.asarray(rows)[real], np_edl_squared(alpha, target, where)[real], rtol=RTOL, atol=1e-7
    )
    np.testing.assert_allclose(
        np.asarray(columns)[real],
        np_edl_squared(alpha.T, target, where)[real],
        rtol=RTOL,
        atol=1e-7,
    )
    assert np.isfinite(rows).all() and np.isfinite(columns).all()  # padding queries too


@pytest.mark.parametrize("masked", [False, True])
def test_diagonal_edl_squared_error_gradient_matches_finite_differences(masked):
    """The custom gradient in the log-evidence, against central differences of the float64
    oracle's rows and columns, each weighted; padding queries weigh 0, padding classes get
    no gradient."""
    log_e, y = _diagonal_case(47, 1.0)
    where = WHERE if masked else ALL
    rng = np.random.default_rng(48)
    w_rows, w_cols = (rng.uniform(0.5, 1.5, 7) * where for _ in range(2))
    target = np.diag(y.astype(np.float64))

    def oracle(x):
        alpha = np.exp(x) + 1.0
        return float(
            w_rows @ np_edl_squared(alpha, target, where)
            + w_cols @ np_edl_squared(alpha.T, target, where)
        )

    def weighted(x):
        rows, columns = evidence.diagonal_edl_squared_error(x, y, where=where)
        return jnp.dot(jnp.asarray(w_rows, jnp.float32), rows) + jnp.dot(
            jnp.asarray(w_cols, jnp.float32), columns
        )

    got = np.asarray(jit(jax.grad(weighted))(jnp.asarray(log_e)))
    want = central_differences(oracle, log_e)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)
    assert np.abs(want).max() > 1e-3
    if masked:  # a padding class is no candidate of any query; a padding query weighs 0
        assert not got[~where].any() and not got[:, ~where].any()


@pytest.mark.parametrize("scale", [0.5, 8.0, 30.0])
def test_diagonal_edl_squared_error_equals_the_dense_form(scale):
    """Values and gradients equal :func:`edl_squared_error` of the rows and of the columns
    with the diagonal targets (padded), also where the evidence overflows float32 (``scale``
    30: raw scores to 100, log-evidence to 1000) and finite differences cannot reach."""
    log_e, y = _diagonal_case(50 + int(scale), scale)
    target = np.diag(y)
    rng = np.random.default_rng(51)
    w_rows, w_cols = (jnp.asarray(rng.uniform(0.5, 1.5, 7) * WHERE, jnp.float32) for _ in "rc")

    def dense(x):
        rows = evidence.edl_squared_error(x, target, where=WHERE)
        columns = evidence.edl_squared_error(x, target, where=WHERE, axis=0)
        return rows, columns

    def diagonal(x):
        return evidence.diagonal_edl_squared_error(x, y, where=WHERE)

    for a, b in zip(jit(dense)(log_e), jit(diagonal)(log_e), strict=True):
        np.testing.assert_allclose(np.asarray(b)[WHERE], np.asarray(a)[WHERE], rtol=1e-5, atol=1e-7)
    grads = [
        jit(jax.grad(lambda x, f=f: w_rows @ f(x)[0] + w_cols @ f(x)[1]))(log_e)
        for f in (dense, diagonal)
    ]
    assert np.isfinite(grads[1]).all()
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-4, atol=1e-7)
    # the targets are constants
    target_grad = jax.grad(lambda t: diagonal_sum(log_e, t))(y)
    assert not np.asarray(target_grad).any()


def diagonal_sum(log_e, y):
    rows, columns = evidence.diagonal_edl_squared_error(log_e, y)
    return rows.sum() + columns.sum()


def test_diagonal_edl_squared_error_refuses_a_non_square_matrix():
    with pytest.raises(ValueError, match="square"):
        evidence.diagonal_edl_squared_error(np.zeros((3, 4), np.float32), np.ones(3))
    with pytest.raises(ValueError, match="where"):
        evidence.diagonal_edl_squared_error(np.zeros((3, 3)), np.ones(3), where=np.ones(4, bool))


@pytest.mark.parametrize("masked", [False, True])
def test_dirichlet_kl_uniform_closed_form(masked):
    where = WHERE if masked else None
    log_a = np.array(ev.log_alpha(f32_log_e(raw_scores(12, (5, 7)))))
    log_a[0, :] = 0.0  # alpha = 1: the uniform Dirichlet itself, KL 0
    log_a[1, 3] = 0.0  # a target class (alpha-tilde = 1)
    log_a[2, :] = np.log(np.float32(1.5))  # small alphas (the exact branch)
    got = KL(log_a, WHERE if masked else ALL)
    want = np_kl(np.exp(log_a.astype(np.float64)), where)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=3e-5)
    assert abs(float(got[0])) < 1e-5
    assert (np.asarray(got) >= -1e-5).all()


@pytest.mark.parametrize("masked", [False, True])
def test_edl_loss_closed_form(masked):
    where = WHERE if masked else None
    log_e = f32_log_e(raw_scores(13, (5, 7)))
    alpha = np.exp(log_e.astype(np.float64)) + 1.0
    y = np.random.default_rng(14).uniform(0.05, 0.95, (5, 7)) * np.eye(5, 7)
    for target in (y, np.eye(5, 7), np.zeros((5, 7))):
        got = EDL(log_e, target.astype(np.float32), WHERE if masked else ALL, 0.3)
        want = np_edl(alpha, target.astype(np.float32).astype(np.float64), where, 0.3)[0]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=3e-5)


@pytest.mark.parametrize(
    ("target", "ls", "kl", "edl", "ls_atol"),
    [
        ([1.0, 0, 0, 0], 1.94e-10, 21.681662, 2.168166, 1e-9),
        ([0.0, 0, 0, 0], 0.999980, 50.972143, 6.097195, 1e-6),
    ],
)
def test_edl_reference_vector(target, ls, kl, edl, ls_atol):
    """Reference values worked by hand from Eqs. 3 and 12-14: R = (2, -1, 0.5, -3), tau = 0.1."""
    raw = np.array([2.0, -1.0, 0.5, -3.0], np.float32)
    log_e = ev.log_evidence(raw)[None]
    np.testing.assert_allclose(
        np.exp(np.asarray(log_e[0], np.float64)),
        [1.726358e9, 22.93392, 16996.62, 1.625594],
        rtol=1e-5,
    )
    y = np.array([target], np.float32)
    np.testing.assert_allclose(ev.edl_squared_error(log_e, y), [ls], atol=ls_atol)
    # KL and L_edl through the compiled [5, 7] programs: the row padded with 3 padding classes.
    where = np.arange(7) < 4
    padded_log_e = np.zeros((5, 7), np.float32)
    padded_log_e[:, :4] = log_e
    padded_y = np.zeros((5, 7), np.float32)
    padded_y[:, :4] = y
    log_a_tilde = np.where(padded_y == 1, 0.0, np.asarray(ev.log_alpha(padded_log_e)))
    np.testing.assert_allclose(KL(log_a_tilde, where), [kl] * 5, rtol=1e-6)
    np.testing.assert_allclose(EDL(padded_log_e, padded_y, where, 0.1), [edl] * 5, rtol=1e-6)
    # The oracle reproduces the reference values.
    alpha = np.exp(np_log_evidence(raw)) + 1.0
    want = np_edl(alpha, np.array(target))
    np.testing.assert_allclose([w[0] for w in want], [edl, ls, kl], rtol=1e-6, atol=ls_atol)


# ---------------------------------------------------------------------------------------------
# Extreme inputs in float32.


def test_kl_large_alphas_matches_float64():
    """Alphas up to 1e12 against Eq. 13 evaluated in 60 digits (rel 1e-5). scipy's float64
    value cancels (lgamma ~1e13 and (alpha - 1) digamma ~1e13 against a KL of ~1e2) by up to
    ~2e-4 there, so it is the reference at 1e-5 up to alphas of 1e8 only."""
    rng = np.random.default_rng(15)
    log_a = rng.uniform(0.0, np.log(1e12), (5, 7)).astype(np.float32)
    log_a[0, 0] = 0.0
    log_a[1] = np.log(1e12)
    log_a[2, :4] = np.log(1e12)
    alpha = np.exp(log_a.astype(np.float64))
    exact = np.array([dec_kl(a) for a in alpha])
    got = KL(log_a, ALL)
    np.testing.assert_allclose(got, exact, rtol=1e-5)
    np.testing.assert_allclose(np_kl(alpha), exact, rtol=1e-3)  # the float64 value's error
    small = (log_a * np.float32(np.log(1e8) / np.log(1e12))).astype(np.float32)
    want = np_kl(np.exp(small.astype(np.float64)))
    np.testing.assert_allclose(KL(small, ALL), want, rtol=1e-5)
    np.testing.assert_allclose(
        want, [dec_kl(a) for a in np.exp(small.astype(np.float64))], rtol=1e-6
    )


@jit
def _kl_and_grad(log_a, where):
    kl = evidence.dirichlet_kl_uniform(log_a, where=where)
    grad = jax.grad(lambda x: evidence.dirichlet_kl_uniform(x, where=where).sum())(log_a)
    return kl, grad


def test_kl_huge_alphas_finite_and_nonnegative():
    rng = np.random.default_rng(16)
    log_a = rng.uniform(0.0, 1e4, (5, 7)).astype(np.float32)
    log_a[0] = 1e4  # all equal and huge
    log_a[1, 1:] = 0.0  # one huge class
    log_a[2, 0] = 0.0
    for where in (ALL, WHERE):
        kl, grad = _kl_and_grad(log_a, where)
        assert np.isfinite(kl).all() and (np.asarray(kl) >= -1e-4).all()
        assert np.isfinite(grad).all()
    # Far from 1 every r(a) = lgamma(a) - (a - 1) psi(a) + a -> log(a)/2 + (1 + log 2 pi)/2 and
    # psi(Lambda) -> log Lambda (Stirling), so
    # KL -> (K - 1/2) log Lambda - sum_k log(alpha_k) / 2 - (K - 1)(1 + log 2 pi)/2 - lgamma K.
    big = rng.uniform(1e3, 1e4, (5, 7)).astype(np.float32)
    x = big.astype(np.float64)
    log_strength = np.logaddexp.reduce(x, axis=-1)
    num = x.shape[-1]
    want = (num - 0.5) * log_strength - 0.5 * x.sum(-1)
    want -= (num - 1) * 0.5 * (1.0 + math.log(2 * math.pi)) + math.lgamma(num)
    np.testing.assert_allclose(_kl_and_grad(big, ALL)[0], want, rtol=1e-5)


def _extreme_parts(raw, y, where, evidence_fn):
    log_e = evidence.log_evidence(raw, evidence_fn=evidence_fn)
    op = evidence.dirichlet_opinion(log_e, where=where)
    squared = evidence.edl_squared_error(log_e, y, where=where)
    kl = evidence.dirichlet_kl_uniform(evidence.log_alpha(log_e), where=where)
    edl = edl_loss(log_e, y, where=where)
    return op.belief, op.uncertainty, op.log_strength, squared, kl, edl


@functools.partial(jax.jit, static_argnums=3, compiler_options=FAST_COMPILE)
def _extreme_values_and_grad(raw, y, where, evidence_fn):
    """The parts and the gradient of a positive combination of all of them (a non-finite
    gradient of any part makes it non-finite)."""
    weights = (0.7, 1.3, 0.9, 1.1, 0.8, 1.2)

    def combined(r):
        parts = _extreme_parts(r, y, where, evidence_fn)
        return sum(w * p.sum() for w, p in zip(weights, parts, strict=True))

    return _extreme_parts(raw, y, where, evidence_fn), jax.grad(combined)(raw)


@pytest.mark.parametrize("evidence_fn", ["exp_softplus", "exp_tanh"])
def test_extreme_raw_scores_finite(evidence_fn):
    rng = np.random.default_rng(17)
    raw = rng.choice(EXTREMES, (5, 5)).astype(np.float32)
    raw[0] = EXTREMES  # every extreme value in one row
    raw[1] = 1e4
    raw[2] = -1e4
    y = np.eye(5, dtype=np.float32)
    y[3, 3] = 0.4
    for where in (ALL[:5], WHERE[:5]):
        parts, grad = _extreme_values_and_grad(raw, y, where, evidence_fn)
        assert np.isfinite(grad).all()
        for index, out in enumerate(parts):
            assert np.isfinite(out).all(), index
        b, u = np.asarray(parts[0], np.float64), np.asarray(parts[1], np.float64)
        # Within float32's resolution of log-evidence ~1e5 (test_..._saturated above).
        np.testing.assert_allclose(b.sum(-1) + u, 1.0, atol=5e-3)
        assert (np.asarray(parts[3]) >= 0).all() and (np.asarray(parts[4]) >= -1e-4).all()
    if evidence_fn == "exp_tanh":  # bounded evidence: the exact identity
        np.testing.assert_allclose(b.sum(-1) + u, 1.0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Retrieval score and jit.


def test_log_mean_evidence():
    log_e = f32_log_e(raw_scores(19, (2, 5, 7)))
    x = log_e.astype(np.float64)
    np.testing.assert_allclose(
        ev.log_mean_evidence(log_e), np.log(np.exp(x).mean(0)), rtol=1e-6, atol=1e-5
    )
    np.testing.assert_allclose(
        ev.log_mean_evidence(log_e, axis=2), np.log(np.exp(x).mean(2)), rtol=1e-6
    )
    huge = np.full((2, 5, 7), 1e5, np.float32)  # exp overflows; the mean of equals is itself
    np.testing.assert_allclose(ev.log_mean_evidence(huge), 1e5, rtol=1e-7)


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _all_jitted(raw, y, b1, u1, b2, u2):
    return _all(raw, y, b1, u1, b2, u2)


def _all(raw, y, b1, u1, b2, u2):
    log_e = evidence.log_evidence(raw)
    op = evidence.dirichlet_opinion(log_e[0, :5], where=WHERE)
    return (
        *op,
        *evidence.ds_combine(b1, u1, b2, u2),
        evidence.opinion_to_alpha(b1, u1),
        evidence.fuse_log_evidence(log_e),
        evidence.edl_squared_error(log_e[0], y, where=WHERE),
        evidence.dirichlet_kl_uniform(evidence.log_alpha(log_e[1])),
        edl_loss(log_e[1], y),
    )


def test_jit_equals_no_jit():
    raw = raw_scores(20, (2, 7, 7))
    y = np.eye(7, dtype=np.float32) * np.float32(0.7)
    (b1, u1), (b2, u2) = _random_opinions(21, 2)
    args = (raw, y, b1, u1, b2, u2)
    for got, want in zip(_all_jitted(*args), _all(*args), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_opinion_to_alpha_of_a_padded_opinion_counts_the_real_classes():
    e = np.array([4.0, 1.0, 1.0, 2.0, 7.0])
    where = np.array([True, True, True, True, False])
    op = ev.dirichlet_opinion(np.log(e).astype(np.float32), where=where)
    alpha = ev.opinion_to_alpha(op.belief, op.uncertainty, int(where.sum()))
    np.testing.assert_allclose(alpha[:4], e[:4] + 1.0, rtol=1e-6)  # the padding class: 1
