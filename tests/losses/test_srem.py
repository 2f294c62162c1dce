"""SREM's objectives (ncljax.losses.srem) against float64 numpy loops.

The loss oracles are written from the paper's equations (Eqs. 3 and 5-13, and the total
objective of its "Model Optimization") with python loops and never call the library; the
estimators' oracles come from tests/labels/test_srem.py. RCL's complementary contrastive
loss (``penghu-cs/RCL``, ``CCL``, ``method='log'``) is reimplemented from its description
to check that CMBCL contains it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ncljax.labels as labels
from ncljax.losses import (
    complementary_loss,
    energy_bounded_loss,
    weighted_hinge_loss,
)
from ncljax.methods.srem import srem_loss
from tests.labels.test_srem import (
    FAST_COMPILE,
    LOGITS,
    REAL,
    WHERE,
    estimate,
    np_combine,
    np_comp_mask,
    np_direction,
    np_hard_negative,
    np_lse,
    np_ms,
    np_pull,
    np_rectified,
    np_sigmoid,
    np_swap,
    real_of,
    sigmoid64,
)

RTOL, ATOL = 1e-5, 1e-6
# The clamp 1 - 1e-6 of Eq. 12's literal matrix-product readings (the ablations, which can
# exceed 1 inside log(1 - S')), as float32 holds it.
CLAMP = float(np.float32(1.0 - 1e-6))


# ---------------------------------------------------------------------------------------------
# Oracles: float64 loops. Each loss returns (objective, per-pair shares).


def _relu(x):
    return x if x > 0 else 0.0


def _softplus(x):
    x = float(x)
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def np_energy_bounded(energies, clean, where, m_clean=-4.0, m_noisy=0.0):
    """Eq. 3: mean over the clean pairs plus mean over the noisy pairs (0 if empty)."""
    real = real_of(where)
    clean_rows = [i for i in real if clean[i]]
    noisy_rows = [i for i in real if not clean[i]]
    terms = np.zeros(len(where))
    for i in clean_rows:
        terms[i] = _relu(float(energies[i]) - m_clean) ** 2
    for i in noisy_rows:
        terms[i] = _relu(m_noisy - float(energies[i])) ** 2
    objective = sum(terms[i] for i in clean_rows) / max(1, len(clean_rows))
    objective += sum(terms[i] for i in noisy_rows) / max(1, len(noisy_rows))
    shares = np.zeros(len(where))
    for i in clean_rows:
        shares[i] = len(real) / max(1, len(clean_rows)) * terms[i]
    for i in noisy_rows:
        shares[i] = len(real) / max(1, len(noisy_rows)) * terms[i]
    return objective, shares


def np_weighted_hinge(scores, phi, omega, clean, where, margin=0.2):
    """Eq. 6 over the clean queries that have a negative."""
    real = real_of(where)
    rows = [i for i in real if clean[i] and phi[i] != i]
    terms = {i: _relu(margin - float(omega[i]) * scores[i][i] + scores[i][phi[i]]) for i in rows}
    shares = np.zeros(len(where))
    for i in rows:
        shares[i] = len(real) / max(1, len(rows)) * terms[i]
    return sum(terms.values()) / max(1, len(rows)), shares


def np_probabilities(logits, where, prob="softmax", temperature=0.05):
    """``(P, log(1 - P))`` on the real candidates, ``log(1 - P)`` of a softmax as
    ``log sum_{k != j} exp(x_k) - log sum_k exp(x_k)``."""
    num = len(where)
    real = real_of(where)
    p, log1m = np.zeros((num, num)), np.zeros((num, num))
    for i in real:
        if prob == "sigmoid":
            for j in real:
                p[i, j] = sigmoid64(logits[i][j])
                log1m[i, j] = -_softplus(logits[i][j])
            continue
        x = {
            j: sigmoid64(logits[i][j]) / temperature if prob == "rcl" else logits[i][j]
            for j in real
        }
        total = np_lse(x.values())
        for j in real:
            p[i, j] = math.exp(x[j] - total)
            others = [x[k] for k in real if k != j]
            log1m[i, j] = np_lse(others) - total if others else -math.inf
    return p, log1m


def np_complementary(
    logits, q, mask, where, reduction="sum", prob="softmax", temperature=0.05, form="expectation"
):
    """Eq. 13 per query (its mean over the real queries is L_c); ``q`` is read on the mask."""
    num = len(where)
    real = real_of(where)
    p, log1m = np_probabilities(logits, where, prob, temperature)

    def q_at(k, j):
        return float(q[k][j]) if mask[k][j] and where[k] and where[j] else 0.0

    out = np.zeros(num)
    for i in real:
        cands = [j for j in real if mask[i][j]]
        if not cands:
            continue
        kappa = len(cands) if reduction == "sum" else 1.0
        if form == "expectation":
            out[i] = -kappa * sum(q_at(i, j) * log1m[i, j] for j in cands)
            continue
        total = 0.0
        for j in cands:
            if form == "matmul_PQ":
                mixed = sum(p[i, k] * q_at(k, j) for k in real)
            else:
                mixed = sum(q_at(k, i) * p[k, j] for k in real)
            total += math.log(1.0 - min(mixed, CLAMP))
        out[i] = -kappa * total / len(cands)
    return out


DEFAULTS = {
    "warmup": False,
    "threshold": -2.0,
    "m_clean": -4.0,
    "m_noisy": 0.0,
    "margin": 0.2,
    "beta": 50.0,
    "offset": 0.5,
    "lambda1": 0.05,
    "lambda2": 1.0,
    "cl_reduction": "sum",
    "cl_prob": "softmax",
    "rcl_temperature": 0.05,
    "rectify": "biased",
    "sgw_indicator": "literal",
    "gradient_weighting": True,
    "clean_set": "per_direction",
    "warmup_lambda2": False,
}


def np_srem(logits, where, **config):
    """The total objective ("Model Optimization") from the oracles, its per-pair shares and
    the constants of each direction (clean set used, phi, omega, A, Q, kappa)."""
    cfg = {**DEFAULTS, **config}
    logits = np.asarray(logits, np.float64)
    views = {"i2t": logits, "t2i": logits.T}
    est = {d: np_direction(f, where, cfg["threshold"], cfg["margin"]) for d, f in views.items()}
    for d in views:
        assert np.abs(est[d]["energy"][where] - cfg["threshold"]).min() > 1e-3
    combined = np_combine(est["i2t"]["clean"], est["t2i"]["clean"], cfg["clean_set"])
    clean = dict(zip(views, combined, strict=True))
    if cfg["gradient_weighting"]:
        omega = np_swap(
            est["i2t"]["entropy"],
            est["t2i"]["entropy"],
            est["i2t"]["argument"],
            est["t2i"]["argument"],
            cfg["sgw_indicator"],
        )
        omega = dict(zip(views, omega, strict=True))
    else:
        omega = {d: np.ones(len(where)) for d in views}
    form = cfg["rectify"] if cfg["rectify"].startswith("matmul") else "expectation"
    total, shares, consts = 0.0, np.zeros(len(where)), {}
    for d, f in views.items():
        used = np.zeros(len(where), bool) if cfg["warmup"] else clean[d]
        mask = np_comp_mask(used, est[d]["phi"], where)
        selection = np_ms(est[d]["scores"], cfg["beta"], cfg["offset"], where)
        q = np_rectified(selection, mask, cfg["rectify"] != "uniform")
        comp = np_complementary(
            f, q, mask, where, cfg["cl_reduction"], cfg["cl_prob"], cfg["rcl_temperature"], form
        )
        kappa = mask.sum(1) if cfg["cl_reduction"] == "sum" else np.ones(len(where))
        consts[d] = {
            **est[d],
            "clean": clean[d],
            "used": used,
            "omega": omega[d],
            "mask": mask,
            "q": q,
            "kappa": kappa,
            "complementary": comp,
        }
        if cfg["warmup"]:
            scale = cfg["lambda2"] if cfg["warmup_lambda2"] else 1.0
            total += scale * comp[where].mean()
            shares += scale * comp
            consts[d]["pull"] = np.zeros(len(where))
            continue
        hinge, hinge_shares = np_weighted_hinge(
            est[d]["scores"], est[d]["phi"], omega[d], used, where, cfg["margin"]
        )
        bounded, bounded_shares = np_energy_bounded(
            est[d]["energy"], used, where, cfg["m_clean"], cfg["m_noisy"]
        )
        total += 0.5 * hinge + cfg["lambda1"] * bounded + cfg["lambda2"] * comp[where].mean()
        shares += 0.5 * hinge_shares + cfg["lambda1"] * bounded_shares + cfg["lambda2"] * comp
        consts[d]["hinge"], consts[d]["energy_loss"] = hinge_shares, bounded_shares
        consts[d]["pull"] = np_pull(est[d]["scores"], est[d]["phi"], omega[d], used, cfg["margin"])
    return total, shares, consts


def np_rcl(scores, tau=0.05):
    """RCL's complementary contrastive loss, ``log`` form, all negatives (``ratio=0``):
    ``p = exp(s / tau) / sum_row exp(s / tau)`` for i2t and for t2i (on ``s.T``), and the loss
    ``-mean_i sum_{j != i} log(1 - p_ij)`` of each, summed."""
    num = len(scores)
    loss = 0.0
    for matrix in (scores, np.transpose(scores)):
        rows = 0.0
        for i in range(num):
            denom = sum(math.exp(float(matrix[i][k]) / tau) for k in range(num))
            for j in range(num):
                if j != i:
                    rows += math.log(1.0 - math.exp(float(matrix[i][j]) / tau) / denom)
        loss += -rows / num
    return loss


# ---------------------------------------------------------------------------------------------
# Energy-bounded loss and weighted hinge (Eqs. 3, 6, 7).

VIEWS = {"i2t": LOGITS, "t2i": np.ascontiguousarray(LOGITS.T)}


@pytest.mark.parametrize("view", ["i2t", "t2i"])
def test_energy_bounded_loss_matches_oracle(view):
    d = np_direction(VIEWS[view], WHERE)
    energies = d["energy"].astype(np.float32)
    for clean in (d["clean"], WHERE.copy(), np.zeros(8, bool)):  # mixed, all clean, none
        for margins in ((-4.0, 0.0), (-3.0, -3.5)):
            got = np.asarray(
                energy_bounded_loss(
                    energies, clean, m_clean=margins[0], m_noisy=margins[1], where=WHERE
                )
            )
            want, shares = np_energy_bounded(energies, clean, WHERE, *margins)
            np.testing.assert_allclose(got[WHERE].mean(), want, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(got, shares, rtol=RTOL, atol=ATOL)
            assert (got[~WHERE] == 0).all()


@pytest.mark.parametrize("view", ["i2t", "t2i"])
def test_weighted_hinge_loss_matches_oracle(view):
    f = VIEWS[view]
    d = np_direction(f, WHERE)
    scores = np.asarray(jax.nn.sigmoid(f))
    omega = np.random.default_rng(1).uniform(0.2, 1.0, 8).astype(np.float32)
    for clean in (d["clean"], WHERE.copy(), np.zeros(8, bool)):
        for margin in (0.2, 0.05):
            got = np.asarray(
                weighted_hinge_loss(scores, d["phi"], omega, clean, margin=margin, where=WHERE)
            )
            want, shares = np_weighted_hinge(d["scores"], d["phi"], omega, clean, WHERE, margin)
            np.testing.assert_allclose(got[WHERE].mean(), want, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(got, shares, rtol=RTOL, atol=ATOL)
            assert (got[~WHERE] == 0).all()
    # A query whose "hard negative" is itself has no negative and contributes nothing.
    own = np.arange(8)
    np.testing.assert_array_equal(
        weighted_hinge_loss(scores, own, omega, WHERE, margin=0.9, where=WHERE), 0.0
    )


def test_weighted_hinge_gradient_is_eq7():
    rng = np.random.default_rng(2)
    scores = rng.uniform(0.2, 0.6, size=(8, 8)).astype(np.float32)
    scores[np.arange(8), np.arange(8)] = rng.uniform(0.3, 0.5, 8)
    scores[~WHERE, :] = scores[:, ~WHERE] = 0.99  # padding: never a hard negative
    phi = np_hard_negative(scores, WHERE)
    omega = rng.uniform(0.3, 1.0, 8).astype(np.float32)
    clean = WHERE.copy()  # every real row clean; margin 0.5 keeps every hinge active
    num_clean, num = clean.sum(), WHERE.sum()
    for i in REAL:
        assert 0.5 - omega[i] * scores[i, i] + scores[i, phi[i]] > 0

    def summed(s):
        shares = weighted_hinge_loss(s, phi, omega, clean, margin=0.5, where=WHERE)
        return shares.sum() * num_clean / num

    def weight_only(w):
        return weighted_hinge_loss(scores, phi, w, clean, margin=0.5, where=WHERE).sum()

    grads = jax.jit(
        lambda s, w: (jax.grad(summed)(s), jax.grad(weight_only)(w)), compiler_options=FAST_COMPILE
    )
    grad, grad_omega = (np.asarray(g) for g in grads(scores, omega))
    want = np.zeros((8, 8))
    for i in REAL:
        want[i, i] = -omega[i]  # -dL/dS_ii = omega_i
        want[i, phi[i]] = 1.0  # -dL/dS_i,phi(i) = -1
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=0)
    assert (grad[want == 0] == 0).all()
    assert (grad_omega == 0).all()  # the weight is a constant of the loss


# ---------------------------------------------------------------------------------------------
# Complementary loss (Eqs. 12-13) and its RCL special case.


def _off_diagonal(where):
    return where[:, None] & where[None, :] & ~np.eye(len(where), dtype=bool)


def _complementary_case(view):
    f = VIEWS[view]
    d = np_direction(f, WHERE)
    mask = np_comp_mask(d["clean"], d["phi"], WHERE)
    q = np_rectified(np_ms(d["scores"], 50.0, 0.5, WHERE), mask, True)
    # Garbage off the mask (padding included) must be ignored.
    q_in = np.where(mask, q, 0.3).astype(np.float32)
    return f, q, q_in, mask


@pytest.mark.parametrize("view", ["i2t", "t2i"])
def test_complementary_loss_matches_oracle(view):
    f, q, q_in, mask = _complementary_case(view)
    for form in ("expectation", "matmul_PQ", "matmul_QtP"):
        for prob in ("softmax", "sigmoid", "rcl"):
            for reduction in ("sum", "mean"):
                got = np.asarray(
                    complementary_loss(
                        f, q_in, mask, reduction=reduction, prob=prob, form=form, where=WHERE
                    )
                )
                want = np_complementary(f, q, mask, WHERE, reduction, prob, 0.05, form)
                np.testing.assert_allclose(
                    got, want, rtol=RTOL, atol=ATOL, err_msg=f"{form} {prob} {reduction}"
                )
                assert (got[~WHERE] == 0).all()
    got = complementary_loss(f, q_in, mask, prob="rcl", rcl_temperature=0.2, where=WHERE)
    want = np_complementary(f, q, mask, WHERE, "sum", "rcl", 0.2)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # Q is a constant of the loss.
    grad_q = jax.jit(
        jax.grad(lambda x: complementary_loss(f, x, mask, where=WHERE).sum()),
        compiler_options=FAST_COMPILE,
    )(q_in)
    assert (np.asarray(grad_q) == 0).all()


def test_matmul_readings_clamp_at_one():
    # Every query puts most of Q on caption 1, so column 1 of Q sums to ~4 and
    # S' = Q^T P exceeds 1 on row 1: log(1 - S') is read at the clamp 1 - 1e-6.
    rng = np.random.default_rng(8)
    f = (2.0 + rng.uniform(-0.5, 0.5, size=(8, 8))).astype(np.float32)
    mask = _off_diagonal(WHERE)
    q = np.where(mask, 0.05, 0.0)
    for k in REAL:
        if k != 1:
            q[k, 1] = 1.0 - 0.05 * (mask[k].sum() - 1)
    q[1] = np.where(mask[1], 1.0 / mask[1].sum(), 0.0)
    p, _ = np_probabilities(f, WHERE, "sigmoid")
    assert sum(q[k, 1] * p[k, 2] for k in REAL) > 1.0
    for form in ("matmul_PQ", "matmul_QtP"):
        for prob in ("sigmoid", "softmax"):
            got = complementary_loss(f, q, mask, prob=prob, form=form, where=WHERE)
            want = np_complementary(f, q, mask, WHERE, "sum", prob, 0.05, form)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{form} {prob}")


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _log1m_and_gradient(logits):
    """Per prob: ``-L`` of every one-hot ``Q`` (``'mean'``: ``log(1 - P_ij)`` at its column),
    ``[shift, row]``, and the gradient of the uniform-``Q`` loss."""
    rows = np.arange(8)
    mask = _off_diagonal(WHERE)
    uniform = np.where(mask, 1.0 / np.maximum(mask.sum(1, keepdims=True), 1), 0.0)
    out = {}
    for prob in ("softmax", "sigmoid", "rcl"):

        def one_hot(shift, prob=prob):
            onehot = (rows[None, :] == (rows[:, None] + shift) % 8).astype(np.float32)
            return -complementary_loss(
                logits, onehot, onehot > 0, reduction="mean", prob=prob, where=WHERE
            )

        def summed(x, prob=prob):
            return complementary_loss(x, uniform, mask, prob=prob, where=WHERE).sum()

        out[prob] = jax.vmap(one_hot)(jnp.arange(8)), jax.grad(summed)(logits)
    for form in ("matmul_PQ", "matmul_QtP"):

        def summed_form(x, form=form):
            return complementary_loss(x, uniform, mask, form=form, where=WHERE).sum()

        out[form] = jax.grad(summed_form)(logits)
    return out


def test_complementary_loss_when_a_negative_dominates():
    # Row 1: one negative at 40 against 0; row 2: two tied negatives at 40; row 5: the
    # positive at 40; the padding column 3 at 40 is no candidate.
    f = np.zeros((8, 8), np.float32)
    f[1, 4] = f[2, 0] = f[2, 5] = f[5, 5] = 40.0
    f[:, 3] = 40.0
    rows = np.arange(8)
    computed = _log1m_and_gradient(f)
    for prob in ("softmax", "sigmoid", "rcl"):
        _, want = np_probabilities(f, WHERE, prob)
        if prob == "softmax":
            assert want[1, 4] < -37.0  # log(5) - log(e^40 + 5): 1 - P is 0 in float32
            assert abs(want[2, 0] + math.log(2.0)) < 1e-9  # two tied maxima: 1 - P ~ 1/2
        by_shift, grad = computed[prob]
        got = np.zeros((8, 8))
        for shift in range(8):
            got[rows, (rows + shift) % 8] = np.asarray(by_shift[shift])
        real = np.ix_(REAL, REAL)
        np.testing.assert_allclose(got[real], want[real], rtol=RTOL, atol=ATOL, err_msg=prob)
        assert got[~WHERE].sum() == 0 and got[:, ~WHERE].sum() == 0
        grad = np.asarray(grad)
        assert np.isfinite(grad).all() and (grad[~WHERE] == 0).all(), prob
    for form in ("matmul_PQ", "matmul_QtP"):
        grad = np.asarray(computed[form])
        assert np.isfinite(grad).all() and (grad[~WHERE] == 0).all(), form


def test_query_without_complementary_candidates_contributes_zero():
    where = np.zeros(8, bool)
    where[5] = True  # one real pair: no negative, A_5 is empty, L_c is 0
    empty = np.zeros((8, 8), bool)
    for prob in ("softmax", "sigmoid", "rcl"):
        got = np.asarray(complementary_loss(LOGITS, empty, empty, prob=prob, where=where))
        np.testing.assert_array_equal(got, 0.0, err_msg=prob)
    for cfg in (CONFIGS["default"], CONFIGS["warmup"]):
        shares = np.asarray(srem_loss(LOGITS, where=where, **cfg)[0])
        np.testing.assert_allclose(shares, np_srem(LOGITS, where, **cfg)[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("padded", [False, True])
def test_rcl_is_a_special_case(padded):
    where = WHERE if padded else np.ones(8, bool)
    rng = np.random.default_rng(6)
    f = rng.uniform(-4.0, 4.0, size=(8, 8)).astype(np.float32)
    real = np.flatnonzero(where)
    want = np_rcl(np_sigmoid(f[np.ix_(real, real)]))
    mask = _off_diagonal(where)  # no clean row: every real negative
    uniform = np.where(mask, 1.0 / max(1, len(real) - 1), 0.0).astype(np.float32)
    kwargs = {"reduction": "sum", "prob": "rcl", "rcl_temperature": 0.05, "where": where}
    both = complementary_loss(f, uniform, mask, **kwargs) + complementary_loss(
        f.T, uniform, mask, **kwargs
    )
    np.testing.assert_allclose(np.asarray(both)[where].mean(), want, rtol=RTOL)
    shares, _ = srem_loss(f, warmup=True, rectify="uniform", cl_prob="rcl", where=where)
    np.testing.assert_allclose(np.asarray(shares)[where].mean(), want, rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# The total objective.

# Each non-default switch is checked against the oracle; a config turns several at once, and
# test_srem_loss_matches_oracle checks that each of them changes the objective on this batch.
CONFIGS = {
    "default": {},
    "literal_and_pq": {"clean_set": "and", "rectify": "matmul_PQ", "cl_reduction": "mean"},
    "loss_direction_or_uniform": {
        "sgw_indicator": "loss_direction",
        "clean_set": "or",
        "rectify": "uniform",
        "cl_prob": "rcl",
    },
    "unweighted_qtp_sigmoid": {
        "gradient_weighting": False,
        "rectify": "matmul_QtP",
        "cl_prob": "sigmoid",
        "lambda1": 0.3,
        "lambda2": 0.7,
    },
    "margins": {"threshold": -3.0, "m_clean": -5.0, "m_noisy": -1.0, "margin": 0.25},
    "warmup": {"warmup": True, "lambda2": 0.5},
    "warmup_lambda2": {"warmup": True, "lambda2": 0.5, "warmup_lambda2": True},
}


@pytest.mark.parametrize(
    ("name", "block_rows"),
    [(name, None) for name in CONFIGS]
    + [(name, 2) for name in ("default", "unweighted_qtp_sigmoid", "warmup")],
)
def test_srem_loss_matches_oracle(name, block_rows):
    # block_rows=2: every [B, B] term two query rows at a time (matmul readings: one block)
    cfg = CONFIGS[name]
    shares, directions = srem_loss(LOGITS, where=WHERE, block_rows=block_rows, **cfg)
    shares = np.asarray(shares)
    want, want_shares, consts = np_srem(LOGITS, WHERE, **cfg)
    np.testing.assert_allclose(shares[WHERE].mean(), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(shares, want_shares, rtol=RTOL, atol=ATOL)
    assert (shares[~WHERE] == 0).all()
    for key in cfg:  # every switch of the config matters on this batch
        others = {k: v for k, v in cfg.items() if k != key}
        if key == "lambda2" and cfg.get("warmup") and not cfg.get("warmup_lambda2"):
            continue  # lambda2 does not weigh the warm-up loss
        assert abs(want - np_srem(LOGITS, WHERE, **others)[0]) > 1e-4, key
    for d in ("i2t", "t2i"):
        got, c = directions[d], consts[d]
        np.testing.assert_array_equal(got.clean, c["clean"])
        np.testing.assert_array_equal(got.hard_negative, c["phi"])
        blocked = block_rows is not None and not cfg.get("rectify", "").startswith("matmul")
        if blocked:  # nothing [B, B] is kept
            assert got.mask is None and got.q is None
        else:
            np.testing.assert_array_equal(got.mask, c["mask"])
            np.testing.assert_allclose(got.q, c["q"], rtol=RTOL, atol=ATOL, err_msg=d)
        for field, key in (
            ("energy", "energy"),
            ("entropy", "entropy"),
            ("argument", "argument"),
            ("weight", "omega"),
            ("complementary", "complementary"),
            ("pull", "pull"),
        ):
            np.testing.assert_allclose(
                getattr(got, field), c[key], rtol=RTOL, atol=ATOL, err_msg=f"{d} {field}"
            )
        if cfg.get("warmup"):
            assert not np.asarray(got.hinge).any() and not np.asarray(got.energy_loss).any()
        else:
            np.testing.assert_allclose(got.hinge, c["hinge"], rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(got.energy_loss, c["energy_loss"], rtol=RTOL, atol=ATOL)


def test_srem_loss_with_two_real_pairs():
    # One negative per query: a clean query's A is empty once its hard negative is removed.
    where = np.zeros(8, bool)
    where[[0, 5]] = True
    for cfg in CONFIGS.values():
        shares, directions = srem_loss(LOGITS, where=where, **cfg)
        want, want_shares, _ = np_srem(LOGITS, where, **cfg)
        np.testing.assert_allclose(np.asarray(shares), want_shares, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(shares)[where].mean(), want, rtol=RTOL, atol=ATOL)
    assert np.asarray(directions["i2t"].clean)[[0, 5]].all()


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="rectify"):
        srem_loss(LOGITS, rectify="matmul")
    mask = _off_diagonal(WHERE)
    with pytest.raises(ValueError, match="cl_reduction"):
        complementary_loss(LOGITS, mask, mask, reduction="max")
    with pytest.raises(ValueError, match="cl_prob"):
        complementary_loss(LOGITS, mask, mask, prob="tanh")
    with pytest.raises(ValueError, match="form"):
        complementary_loss(LOGITS, mask, mask, form="matmul")


def hand_written_loss(logits, consts, cfg):
    """The objective in jax on the real sub-batch, every mask, phi, omega, Q and kappa a numpy
    constant of the oracle: only the energies, S_ii, S_i,phi(i) and P carry gradient
    (softmax probabilities and the expectation form)."""
    cfg = {**DEFAULTS, **cfg}
    local = {int(g): k for k, g in enumerate(REAL)}
    n = len(REAL)
    total = 0.0
    for d, f in (("i2t", logits), ("t2i", logits.T)):
        c = consts[d]
        fr = f[np.ix_(REAL, REAL)]
        p = jax.nn.softmax(fr, axis=1)
        q = c["q"][np.ix_(REAL, REAL)]
        kappa = c["kappa"][REAL]
        lc = jnp.mean(-kappa * jnp.sum(q * jnp.log(1.0 - p), axis=1))
        if cfg["warmup"]:
            total = total + lc
            continue
        used = c["used"][REAL]
        energies = -jax.nn.logsumexp(fr, axis=1)
        pull = jnp.where(used, jax.nn.relu(energies - cfg["m_clean"]) ** 2, 0.0)
        push = jnp.where(~used, jax.nn.relu(cfg["m_noisy"] - energies) ** 2, 0.0)
        lu = pull.sum() / max(1, used.sum()) + push.sum() / max(1, (~used).sum())
        scores = jax.nn.sigmoid(fr)
        phi = np.array([local[int(c["phi"][g])] for g in REAL])
        trained = used & (phi != np.arange(n))
        omega = c["omega"][REAL]
        hinge = jax.nn.relu(
            cfg["margin"] - omega * jnp.diagonal(scores) + scores[np.arange(n), phi]
        )
        lw = jnp.where(trained, hinge, 0.0).sum() / max(1, trained.sum())
        total = total + 0.5 * lw + cfg["lambda1"] * lu + cfg["lambda2"] * lc
    return total


# Gradients of the mean over the real pairs, at the test batch and at logits of magnitude ~50.
GRADIENT_CONFIGS = {
    "default": {},
    "loss_direction_or_uniform": {
        "sgw_indicator": "loss_direction",
        "clean_set": "or",
        "rectify": "uniform",
        "cl_reduction": "mean",
    },
    "warmup": {"warmup": True},
}


def large_logits():
    rng = np.random.default_rng(7)
    f = rng.uniform(-50.0, 50.0, size=(8, 8)).astype(np.float32)
    f[np.arange(8), np.arange(8)] += 20.0  # some clean rows as well
    f[1, 6] = 50.0
    return f


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _srem_gradients(logits):
    def mean_loss(x, cfg):
        shares, directions = srem_loss(x, where=WHERE, **cfg)
        return shares.sum() / WHERE.sum(), (shares, directions)

    return {
        name: jax.value_and_grad(functools.partial(mean_loss, cfg=cfg), has_aux=True)(logits)
        for name, cfg in GRADIENT_CONFIGS.items()
    }


@functools.cache
def srem_gradients(large):
    """``{config: ((value, (shares, directions)), gradient)}`` at ``LOGITS`` or at
    ``large_logits()``, every config in one compiled program."""
    return jax.device_get(_srem_gradients(jnp.asarray(large_logits() if large else LOGITS)))


def test_srem_loss_gradient_matches_hand_written():
    names = ["default", "loss_direction_or_uniform", "warmup"]
    consts = {name: np_srem(LOGITS, WHERE, **GRADIENT_CONFIGS[name])[2] for name in names}

    def hand(logits):
        return [
            jax.grad(lambda x, n=n: hand_written_loss(x, consts[n], GRADIENT_CONFIGS[n]))(logits)
            for n in names
        ]

    wants = jax.jit(hand, compiler_options=FAST_COMPILE)(jnp.asarray(LOGITS))
    for name, want in zip(names, wants, strict=True):
        grad = srem_gradients(large=False)[name][1]
        np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6, err_msg=name)
        assert (grad[~WHERE] == 0).all() and (grad[:, ~WHERE] == 0).all()
        assert np.abs(grad).max() > 1e-3


def test_srem_loss_gradients_are_finite_at_large_logits():
    for name, ((value, (shares, _)), grad) in srem_gradients(large=True).items():
        assert np.isfinite(value) and np.isfinite(shares).all(), name
        assert np.isfinite(grad).all(), name
        assert (grad[~WHERE] == 0).all() and (grad[:, ~WHERE] == 0).all(), name
        assert np.abs(grad).max() > 0, name
    f = large_logits()
    for cfg in CONFIGS.values():
        for prob in ("softmax", "sigmoid", "rcl"):
            cfg = {**cfg, "cl_prob": prob}
            shares = np.asarray(srem_loss(f, where=WHERE, **cfg)[0])
            want = np_srem(f, WHERE, **cfg)[1]
            np.testing.assert_allclose(shares, want, rtol=RTOL, atol=1e-5, err_msg=str(cfg))


def test_jit_equals_no_jit():
    # srem_loss: eagerly against the program that computes its gradients.
    for name, ((value, jitted), _) in srem_gradients(large=False).items():
        eager = srem_loss(LOGITS, where=WHERE, **GRADIENT_CONFIGS[name])
        np.testing.assert_allclose(value, np.asarray(eager[0]).sum() / WHERE.sum(), rtol=1e-6)
        for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
    # complementary_loss, its delicate log(1 - P), with the default compiler options.
    f, _, q_in, mask = _complementary_case("i2t")
    rcl = functools.partial(complementary_loss, prob="rcl", where=WHERE)
    np.testing.assert_allclose(jax.jit(rcl)(f, q_in, mask), rcl(f, q_in, mask), rtol=1e-6)
    # The estimators, eagerly (their operations already compiled by srem_loss) against the
    # compiled program of tests/labels/test_srem.py.
    jitted = estimate(LOGITS)
    d = np_direction(LOGITS, WHERE)
    scores = np.asarray(jax.nn.sigmoid(LOGITS))
    mask = np_comp_mask(d["clean"], d["phi"], WHERE)
    selection = np_ms(d["scores"], 50.0, 0.5, WHERE)
    eager = {
        "energy": labels.energy(LOGITS, where=WHERE),
        "clean": labels.clean_mask(LOGITS, -2.0, where=WHERE),
        "entropy": labels.normalized_entropy(LOGITS, where=WHERE),
        "phi": labels.hard_negative_index(LOGITS, where=WHERE),
        "mask": labels.complementary_mask(d["clean"], d["phi"], where=WHERE),
        "selection": labels.ms_selection_probs(scores, 50.0, 0.5, where=WHERE),
        "q": labels.rectified_complementary_dist(selection, mask),
        "pull": labels.positive_pull(scores, d["phi"], np.linspace(0.3, 1.0, 8), d["clean"], 0.2),
    }
    for key, value in eager.items():
        np.testing.assert_allclose(jitted[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


BLOCKED = {  # each with padding or without
    "hinge": ({}, False),
    "partner_contrastive": (
        {"division": "partner", "ranking": "contrastive", "lambda1": 0.0, "fallback": True},
        True,
    ),
    "weights_and_uniform": ({"sgw_indicator": "loss_direction", "rectify": "uniform"}, True),
    "warmup": ({"warmup": True}, False),
    # no pair below the threshold: both directions fall back to the warm-up objective
    "fallback": ({"threshold": -50.0, "fallback": True, "cl_prob": "rcl"}, True),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(BLOCKED))
def test_blocks_of_rows_give_the_whole_batch_objective_and_gradient(name):
    rng = np.random.default_rng(3)
    b = 16
    logits = rng.normal(size=(b, b)).astype(np.float32) * 2
    logits[np.arange(b), np.arange(b)] += 3 * (rng.random(b) < 0.7)  # some pairs clean
    logits[0, 5] = logits[0, 6]  # a tie for a hard negative
    cfg, padded = BLOCKED[name]
    mask = np.arange(b) % 5 != 4 if padded else None

    def total(f, block_rows):
        shares, directions = srem_loss(f, where=mask, block_rows=block_rows, **cfg)
        return shares.sum(), directions

    results = {
        rows: jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)(
            jnp.asarray(logits), rows
        )
        for rows in (None, 4)
    }
    (whole, whole_dirs), whole_grad = results[None]
    (block, block_dirs), block_grad = results[4]
    np.testing.assert_allclose(block, whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(block_grad, whole_grad, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(whole_grad)).max() > 0
    for d in ("i2t", "t2i"):
        got, want = block_dirs[d], whole_dirs[d]
        assert got.mask is None and got.q is None and want.mask is not None
        for field in got._fields:
            if field in ("mask", "q") or getattr(want, field) is None:
                continue
            np.testing.assert_allclose(
                getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-6, err_msg=field
            )
    if name == "fallback":
        assert bool(whole_dirs["i2t"].fallback) and bool(whole_dirs["t2i"].fallback)


def test_a_batch_that_is_no_multiple_of_the_blocks_is_one_block():
    shares, directions = srem_loss(LOGITS, where=WHERE, block_rows=3)  # 8 rows
    whole, _ = srem_loss(LOGITS, where=WHERE)
    assert directions["i2t"].mask is not None
    np.testing.assert_array_equal(shares, whole)


@pytest.mark.parametrize("cfg", [{}, {"rectify": "uniform", "warmup": True}])
def test_blocks_hand_written_gradient_holds_where_the_top_candidate_takes_all(cfg):
    # Logits up to ~90 apart: a row's top candidate holds P = 1 to round-off, where the
    # hand-written gradient of the blocked terms must not take r_t - P_t R apart by
    # subtraction (it gave errors of 2.5 on gradients of 19 before it was split).
    rng = np.random.default_rng(5)
    b = 16
    logits = (rng.normal(size=(b, b)) * 30).astype(np.float32)
    logits[np.arange(b), np.arange(b)] += 3 * (rng.random(b) < 0.7)
    where = np.arange(b) % 5 != 4
    weights = jnp.linspace(0.5, 1.5, b)

    def total(f, block_rows):
        shares, _ = srem_loss(f, where=where, block_rows=block_rows, **cfg)
        return (shares * weights).sum()

    grad = jax.jit(jax.grad(total), static_argnums=1)
    whole, blocked = (np.asarray(grad(jnp.asarray(logits), rows)) for rows in (None, 4))
    scale = np.abs(whole).max()
    assert scale > 1.0
    np.testing.assert_allclose(blocked, whole, rtol=1e-4, atol=1e-5 * scale)
