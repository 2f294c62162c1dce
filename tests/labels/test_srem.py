"""SREM's estimators (ncljax.labels.srem) against float64 numpy loops.

The oracles below are written from the equations of the paper's "Methodology" (Eqs. 1-13),
one python loop over the queries and one over the candidates, and never call the library.
They are also the building blocks of the objective's oracle in ``tests/losses/test_srem.py``.
"""

import functools
import math

import jax
import numpy as np
import pytest

import ncljax.labels as labels

RTOL, ATOL = 1e-5, 1e-6
TAU = -2.0
ALPHA = 0.2
BETA, OFFSET = 50.0, 0.5
# The test programs compile faster without XLA's optimisations, which change no result here
# beyond rounding.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ---------------------------------------------------------------------------------------------
# Oracles: float64, one loop over the queries i and one over the candidates j.


def real_of(where):
    return [j for j in range(len(where)) if where[j]]


def np_lse(values):
    values = [float(v) for v in values]
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _first_argmax(row, columns):
    """The first column of ``columns`` holding the row's maximum (``np.argmax`` ties)."""
    best = None
    for j in columns:
        if best is None or float(row[j]) > float(row[best]):
            best = j
    return best


def sigmoid64(x):
    x = float(x)
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def np_sigmoid(matrix):
    num = len(matrix)
    return np.array([[sigmoid64(matrix[i][j]) for j in range(num)] for i in range(num)])


def np_energy(logits, where):
    out = np.zeros(len(where))
    real = real_of(where)
    for i in real:
        out[i] = -np_lse([logits[i][j] for j in real])
    return out


def np_clean(logits, tau, where):
    out = np.zeros(len(where), bool)
    real = real_of(where)
    energies = np_energy(logits, where)
    for i in real:
        out[i] = energies[i] < tau and _first_argmax(logits[i], real) == i
    return out


def np_combine(clean_i2t, clean_t2i, mode):
    out_i2t, out_t2i = [], []
    for a, b in zip(clean_i2t, clean_t2i, strict=True):
        if mode == "per_direction":
            out_i2t.append(bool(a))
            out_t2i.append(bool(b))
        elif mode == "and":
            out_i2t.append(bool(a and b))
            out_t2i.append(bool(a and b))
        else:
            out_i2t.append(bool(a or b))
            out_t2i.append(bool(a or b))
    return np.array(out_i2t), np.array(out_t2i)


def np_entropy(logits, where):
    out = np.zeros(len(where))
    real = real_of(where)
    if len(real) < 2:
        return out
    for i in real:
        norm = np_lse([logits[i][j] for j in real])
        total = 0.0
        for j in real:
            log_p = float(logits[i][j]) - norm
            total -= math.exp(log_p) * log_p
        out[i] = total / math.log(len(real))
    return out


def np_hard_negative(logits, where):
    real = real_of(where)
    out = np.arange(len(where))
    for i in real:
        negatives = [j for j in real if j != i]
        if negatives:
            out[i] = _first_argmax(logits[i], negatives)
    return out


def np_hinge_argument(scores, phi, alpha):
    return np.array([alpha - scores[i][i] + scores[i][phi[i]] for i in range(len(phi))])


def np_sgw(entropy, argument):
    return np.array([1.0 - e if a > 0 else 1.0 for e, a in zip(entropy, argument, strict=True)])


def np_swap(e_i2t, e_t2i, a_i2t, a_t2i, indicator):
    if indicator == "literal":
        return np_sgw(e_t2i, a_t2i), np_sgw(e_i2t, a_i2t)
    return np_sgw(e_t2i, a_i2t), np_sgw(e_i2t, a_t2i)


def np_comp_mask(clean, phi, where):
    num = len(where)
    out = np.zeros((num, num), bool)
    real = real_of(where)
    for i in real:
        for j in real:
            out[i, j] = j != i and not (clean[i] and j == phi[i])
    return out


def np_ms(scores, beta, offset, where):
    num = len(where)
    out = np.zeros((num, num))
    real = real_of(where)
    for i in real:
        denom = 1.0 + sum(math.exp(beta * (scores[i][k] - offset)) for k in real if k != i)
        for j in real:
            if j != i:
                out[i, j] = math.exp(beta * (scores[i][j] - offset)) / denom
    return out


def np_rectified(selection, mask, rectify):
    num = len(mask)
    out = np.zeros((num, num))
    for i in range(num):
        cols = [j for j in range(num) if mask[i][j]]
        if not cols:
            continue
        if rectify:
            norm = sum(math.exp(selection[i][j]) for j in cols)
            for j in cols:
                out[i, j] = math.exp(selection[i][j]) / norm
        else:
            for j in cols:
                out[i, j] = 1.0 / len(cols)
    return out


def np_pull(scores, phi, omega, clean, alpha):
    out = np.zeros(len(phi))
    for i in range(len(phi)):
        trained = clean[i] and phi[i] != i
        if trained and alpha - omega[i] * scores[i][i] + scores[i][phi[i]] > 0:
            out[i] = omega[i]
    return out


def np_direction(logits, where, tau=TAU, alpha=ALPHA):
    """Every per-direction estimator of one view (the ``F`` or ``F.T`` matrix)."""
    logits = np.asarray(logits, np.float64)
    scores = np_sigmoid(logits)
    phi = np_hard_negative(logits, where)
    return {
        "scores": scores,
        "energy": np_energy(logits, where),
        "clean": np_clean(logits, tau, where),
        "entropy": np_entropy(logits, where),
        "phi": phi,
        "argument": np_hinge_argument(scores, phi, alpha),
    }


# ---------------------------------------------------------------------------------------------
# The batch: 8 slots, padding at 3 (middle) and 7 (end); the padding rows and columns hold huge
# logits, so any leak into a logsumexp, argmax, softmax or normaliser shows.

WHERE = np.array([True, True, True, False, True, True, True, False])
REAL = np.flatnonzero(WHERE)


def make_logits(seed=0):
    rng = np.random.default_rng(seed)
    f = rng.uniform(-1.5, 1.0, size=(8, 8))
    f[0, 0], f[1, 1], f[2, 2], f[4, 4], f[5, 5], f[6, 6] = 4.0, 3.5, 0.2, 4.0, 3.0, 2.0
    f[4, 0] = 4.0  # i2t row 4: the positive ties with the earlier column 0 -> not clean
    f[1, 5] = 3.0  # t2i row 5 (column 5): its positive ties with the earlier row 1 -> not clean
    f[6, 2] = 2.5  # i2t row 6: a negative beats the positive -> not clean
    f[2, 0] = f[2, 4] = 1.2  # i2t row 2: tied hardest negatives -> phi = 0
    f[3, :] = 30.0  # padding row and column
    f[:, 3] = 30.0
    f[7, :] = -20.0
    f[:, 7] = 25.0
    return f.astype(np.float32)


LOGITS = make_logits()
VIEWS = {"i2t": LOGITS, "t2i": np.ascontiguousarray(LOGITS.T)}


def test_the_batch_covers_the_cases():
    i2t = np_direction(VIEWS["i2t"], WHERE)
    t2i = np_direction(VIEWS["t2i"], WHERE)
    np.testing.assert_array_equal(i2t["clean"], [1, 1, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(t2i["clean"], [1, 1, 0, 0, 1, 0, 1, 0])
    assert i2t["phi"][2] == 0
    for d in (i2t, t2i):
        assert np.abs(d["energy"][REAL] - TAU).min() > 0.05  # float32 cannot flip a decision
        assert np.abs(d["argument"][REAL]).min() > 0.01
        assert (d["argument"][REAL] > 0).any() and (d["argument"][REAL] < 0).any()


# ---------------------------------------------------------------------------------------------
# Every estimator of one view in one compiled program (one compilation serves every test; the
# eager path is compared with jit in tests/losses/test_srem.py, after srem_loss has run eagerly).


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _estimate(logits, where, threshold, beta, margin, clean, phi, omega, selection, mask):
    scores = jax.nn.sigmoid(logits)
    return {
        "energy": labels.energy(logits, where=where),
        "clean": labels.clean_mask(logits, threshold, where=where),
        "clean_unpadded": labels.clean_mask(logits, threshold),
        "entropy": labels.normalized_entropy(logits, where=where),
        "phi": labels.hard_negative_index(logits, where=where),
        "argument": labels.hinge_argument(scores, phi, margin),
        "mask": labels.complementary_mask(clean, phi, where=where),
        "selection": labels.ms_selection_probs(scores, beta, OFFSET, where=where),
        "q": labels.rectified_complementary_dist(selection, mask),
        "q_uniform": labels.rectified_complementary_dist(selection, mask, rectify=False),
        "pull": labels.positive_pull(scores, phi, omega, clean, margin),
    }


def estimate(logits, where=WHERE, threshold=TAU, beta=BETA, margin=ALPHA, **inputs):
    """The library's estimators; ``clean``, ``phi``, ``omega``, ``selection`` and ``mask``, the
    inputs of the later ones, default to the oracle's."""
    oracle = np_direction(logits, where, threshold, margin)
    clean = inputs.get("clean", oracle["clean"])
    phi = inputs.get("phi", oracle["phi"])
    selection = inputs.get("selection", np_ms(oracle["scores"], beta, OFFSET, where))
    out = _estimate(
        np.asarray(logits, np.float32),
        np.asarray(where, bool),
        float(threshold),
        float(beta),
        float(margin),
        np.asarray(clean, bool),
        np.asarray(phi, np.int32),
        np.asarray(inputs.get("omega", np.linspace(0.3, 1.0, 8)), np.float32),
        np.asarray(selection, np.float32),
        np.asarray(inputs.get("mask", np_comp_mask(clean, phi, where)), bool),
    )
    return {k: np.asarray(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Eqs. 1-2: energy and the clean split.


@pytest.mark.parametrize("view", ["i2t", "t2i"])
def test_energy_and_clean_mask_match_oracle(view):
    f = VIEWS[view]
    got = estimate(f)
    np.testing.assert_allclose(got["energy"], np_energy(f, WHERE), rtol=RTOL, atol=ATOL)
    assert (got["energy"][~WHERE] == 0).all()
    assert got["clean"].dtype == np.bool_
    np.testing.assert_array_equal(got["clean"], np_clean(f, TAU, WHERE))
    for tau in (-3.5, 0.0):
        np.testing.assert_array_equal(estimate(f, threshold=tau)["clean"], np_clean(f, tau, WHERE))
    # Without padding the huge padding entries take the argmax of every real row.
    np.testing.assert_array_equal(got["clean_unpadded"], np_clean(f, TAU, np.ones(8, bool)))
    assert not got["clean_unpadded"][REAL].any()


def test_tied_positive_is_not_clean_but_a_later_tie_is():
    # Row 0 ties its positive with the later column 2, row 1 with the earlier column 0; the
    # padding column 3 holds a larger value in every row.
    f = np.zeros((8, 8), np.float32)
    np.fill_diagonal(f, 5.0)
    f[0, 2] = f[1, 0] = 5.0
    f[:, 3] = 9.0
    got = estimate(f, threshold=0.0)["clean"]
    np.testing.assert_array_equal(got, [True, False, True, False, True, True, True, False])
    np.testing.assert_array_equal(got, np_clean(f, 0.0, WHERE))


def test_combine_clean_masks():
    a = np.array([True, True, False, False, True])
    b = np.array([True, False, True, False, False])
    for mode in ("per_direction", "and", "or"):
        got = labels.combine_clean_masks(a, b, mode)
        want = np_combine(a, b, mode)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="clean_set"):
        labels.combine_clean_masks(a, b, "xor")


# ---------------------------------------------------------------------------------------------
# Eqs. 4-6: entropy, hard negative, hinge argument, swapped weights.


@pytest.mark.parametrize("view", ["i2t", "t2i"])
def test_entropy_hard_negative_and_argument_match_oracle(view):
    f = VIEWS[view]
    want = np_direction(f, WHERE)
    got = estimate(f)
    np.testing.assert_allclose(got["entropy"], want["entropy"], rtol=RTOL, atol=ATOL)
    assert (got["entropy"][~WHERE] == 0).all()
    assert got["phi"].dtype == np.int32
    np.testing.assert_array_equal(got["phi"], want["phi"])
    np.testing.assert_allclose(got["argument"], want["argument"], rtol=RTOL, atol=ATOL)


def test_entropy_normaliser_counts_the_real_candidates():
    # Flat real rows have entropy log n: normalised by log n (n = 6 real), exactly 1.
    f = np.broadcast_to(np.where(WHERE, 0.0, 40.0), (8, 8)).astype(np.float32)
    got = estimate(f)["entropy"]
    np.testing.assert_allclose(got, np.where(WHERE, 1.0, 0.0), rtol=RTOL, atol=ATOL)


def test_swap_weights_and_sgw_weight():
    i2t = np_direction(VIEWS["i2t"], WHERE)
    t2i = np_direction(VIEWS["t2i"], WHERE)
    args = [np.asarray(i2t["entropy"], np.float32), np.asarray(t2i["entropy"], np.float32)]
    args += [np.asarray(i2t["argument"], np.float32), np.asarray(t2i["argument"], np.float32)]
    np.testing.assert_allclose(
        labels.sgw_weight(args[0], args[2]), np_sgw(*args[::2]), rtol=RTOL, atol=ATOL
    )
    results = {}
    for indicator in ("literal", "loss_direction"):
        got = labels.swap_weights(*args, indicator=indicator)
        want = np_swap(*args, indicator)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
        results[indicator] = np.asarray(got[0])
    assert not np.allclose(results["literal"], results["loss_direction"])
    with pytest.raises(ValueError, match="sgw_indicator"):
        labels.swap_weights(*args, indicator="x")


def test_rows_without_negatives():
    # One real pair among padding: no negative, no complementary candidate, no entropy.
    where = np.zeros(8, bool)
    where[5] = True
    own = np.arange(8)
    f = make_logits(1)
    f[5, 5] = -1.0
    got = estimate(
        f, where=where, threshold=2.0, margin=5.0, clean=where, phi=own, selection=np.ones((8, 8))
    )
    np.testing.assert_array_equal(got["phi"], own)
    np.testing.assert_allclose(got["energy"], np.where(where, 1.0, 0.0), rtol=RTOL)
    np.testing.assert_array_equal(got["clean"], where)  # E = 1 < 2, the only candidate
    np.testing.assert_array_equal(estimate(f, where=where, threshold=0.0)["clean"], False)
    np.testing.assert_array_equal(got["entropy"], 0.0)
    assert not got["mask"].any()
    np.testing.assert_array_equal(got["selection"], 0.0)
    np.testing.assert_array_equal(got["q"], 0.0)
    np.testing.assert_array_equal(got["q_uniform"], 0.0)
    np.testing.assert_allclose(got["argument"], 5.0, rtol=RTOL)  # a = alpha
    np.testing.assert_array_equal(got["pull"], 0.0)  # clean, active, but no negative


# ---------------------------------------------------------------------------------------------
# Eqs. 10-12: complementary candidates, selection probabilities, Q.


@pytest.mark.parametrize("view", ["i2t", "t2i"])
def test_complementary_mask_selection_and_q_match_oracle(view):
    f = VIEWS[view]
    d = np_direction(f, WHERE)
    want_mask = np_comp_mask(d["clean"], d["phi"], WHERE)
    assert want_mask[~WHERE].sum() == 0 and want_mask[:, ~WHERE].sum() == 0
    assert (want_mask.sum(1)[WHERE] == np.where(d["clean"], 4, 5)[WHERE]).all()
    want_sel = np_ms(d["scores"], BETA, OFFSET, WHERE)
    got = estimate(f)
    np.testing.assert_array_equal(got["mask"], want_mask)
    np.testing.assert_allclose(got["selection"], want_sel, rtol=RTOL, atol=ATOL)
    assert (np.diagonal(got["selection"]) == 0).all()
    assert (got["selection"][~WHERE] == 0).all() and (got["selection"][:, ~WHERE] == 0).all()
    for key, rectify in (("q", True), ("q_uniform", False)):
        np.testing.assert_allclose(
            got[key], np_rectified(want_sel, want_mask, rectify), rtol=RTOL, atol=ATOL
        )
        assert (got[key][~want_mask] == 0).all()
        np.testing.assert_allclose(got[key][WHERE].sum(1), 1.0, rtol=RTOL)


def test_selection_probs_do_not_overflow():
    rng = np.random.default_rng(3)
    scores = rng.uniform(0.001, 0.999, size=(8, 8))
    scores[0, 1:] = 0.9999  # exp(beta (S - b)) near its largest for S in (0, 1)
    logits = np.log(scores / (1.0 - scores)).astype(np.float32)
    for beta in (BETA, 500.0):  # 500: exp(250) overflows float32 outside log space
        got = estimate(logits, beta=beta)["selection"]
        assert np.isfinite(got).all()
        want = np_ms(np_sigmoid(logits), beta, OFFSET, WHERE)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_rectified_dist_uniform_and_empty_rows():
    rng = np.random.default_rng(5)
    selection = rng.uniform(0.0, 1.0, size=(8, 8)).astype(np.float32)
    mask = rng.uniform(size=(8, 8)) < 0.5
    mask[2] = False  # an empty row
    mask[4, :] = np.arange(8) == 6  # a single candidate
    got = estimate(LOGITS, selection=selection, mask=mask)
    for key, rectify in (("q", True), ("q_uniform", False)):
        want = np_rectified(selection, mask, rectify)
        np.testing.assert_allclose(got[key], want, rtol=RTOL, atol=ATOL)
        assert (got[key][2] == 0).all() and (got[key][~mask] == 0).all()
        assert got[key][4, 6] == 1.0


def test_positive_pull_matches_oracle():
    omega = np.linspace(0.3, 1.0, 8)
    for view in ("i2t", "t2i"):
        d = np_direction(VIEWS[view], WHERE)
        for margin in (ALPHA, 0.05, 0.9):
            got = estimate(VIEWS[view], margin=margin, omega=omega)["pull"]
            want = np_pull(d["scores"], d["phi"], omega, d["clean"], margin)
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# No gradient through the estimators but the energy.


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _gradients(logits, weights, clean, phi, mask):
    scores = jax.nn.sigmoid(logits)
    checks = {
        "clean_mask": (
            lambda x: labels.clean_mask(x, TAU, where=WHERE).astype(x.dtype) @ weights[0],
            logits,
        ),
        "normalized_entropy": (
            lambda x: labels.normalized_entropy(x, where=WHERE) @ weights[0],
            logits,
        ),
        "ms_selection_probs": (
            lambda x: (labels.ms_selection_probs(x, BETA, OFFSET, where=WHERE) * weights).sum(),
            scores,
        ),
        "rectified_complementary_dist": (
            lambda x: (labels.rectified_complementary_dist(x, mask) * weights).sum(),
            scores,
        ),
        "sgw_weight": (lambda x: labels.sgw_weight(x[0], x[1] - 0.5) @ weights[0], scores),
        "swap_weights": (
            lambda x: (
                labels.swap_weights(x[0], x[1], x[2] - 0.5, x[3] - 0.5)[0] @ weights[0]
                + labels.swap_weights(
                    x[0], x[1], x[2] - 0.5, x[3] - 0.5, indicator="loss_direction"
                )[1]
                @ weights[1]
            ),
            scores,
        ),
        "positive_pull scores": (
            lambda x: labels.positive_pull(x, phi, scores[0], clean, 0.9) @ weights[0],
            scores,
        ),
        "positive_pull weight": (
            lambda w: labels.positive_pull(scores, phi, w, clean, 0.9) @ weights[0],
            scores[0],
        ),
        "energy": (lambda x: labels.energy(x, where=WHERE).sum(), logits),
    }
    return {name: jax.value_and_grad(fn)(x) for name, (fn, x) in checks.items()}


def test_stop_gradient_quantities_have_exactly_zero_gradient():
    d = np_direction(LOGITS, WHERE)
    weights = np.random.default_rng(4).normal(size=(8, 8)).astype(np.float32)
    mask = np_comp_mask(d["clean"], d["phi"], WHERE)
    out = _gradients(LOGITS, weights, d["clean"], d["phi"].astype(np.int32), mask)
    for name, (value, grad) in out.items():
        if name == "energy":
            continue
        assert abs(float(value)) > 0, name  # a non-trivial function of its input
        assert (np.asarray(grad) == 0).all(), name
    # The energy carries gradient: minus the softmax over the real candidates.
    want = np.zeros((8, 8))
    for i in REAL:
        norm = np_lse([LOGITS[i][j] for j in REAL])
        for j in REAL:
            want[i, j] = -math.exp(float(LOGITS[i][j]) - norm)
    np.testing.assert_allclose(out["energy"][1], want, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# The partner test (ncljax's): an in-batch permutation p-value per query.


def np_partner_p_value(logits, where):
    """(1 + the real negatives whose logit is at least the partner's) / the real candidates."""
    real = real_of(where)
    out = []
    for i in range(len(where)):
        if not where[i]:
            out.append(1.0)
            continue
        beaten = sum(1 for j in real if j != i and logits[i][j] >= logits[i][i])
        out.append((1 + beaten) / len(real))
    return np.asarray(out)


def test_partner_p_value_and_test_against_a_loop_with_ties_and_padding():
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(size=(7, 7)), 1)  # rounded: ties between candidates
    logits[2, 5] = logits[2, 2]  # a negative tied with the partner counts against it
    logits[4, 4] = 9.0  # a partner first by far
    where = np.array([True, True, True, True, True, True, False])
    logits[0, 6] = 50.0  # a padding candidate above the partner is no candidate
    expected = np_partner_p_value(logits, where)
    got = np.asarray(labels.partner_p_value(logits, where=where))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)
    assert expected[4] == pytest.approx(1 / 6)
    for level in (1 / 6, 0.5, 1.0):
        mask = np.asarray(labels.partner_test_mask(logits, level, where=where))
        np.testing.assert_array_equal(mask, where & (expected <= level + 1e-9))
    # Six real pairs cannot reach 0.05: the test keeps the partners ranked first (p = 1/6).
    mask = np.asarray(labels.partner_test_mask(logits, 0.05, where=where))
    np.testing.assert_array_equal(mask, where & (expected <= 1 / 6 + 1e-9))
    assert mask[4]


def test_partner_ranked_first_is_the_smallest_p_value_and_eq_2_without_the_energy():
    """At level 1/n the test is Eq. 2's maximum-similarity constraint (no ties here)."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(9, 9))
    logits[np.arange(0, 9, 2), np.arange(0, 9, 2)] += 4.0
    first = np.asarray(labels.clean_mask(logits, np.inf))
    test = np.asarray(labels.partner_test_mask(logits, 1 / 9))
    np.testing.assert_array_equal(first, test)
    assert first.sum() >= 5


def test_a_division_that_keeps_every_pair_is_degenerate_only_for_the_energy_split():
    every = np.array([True, True, True, False])
    where = np.array([True, True, True, False])
    assert bool(labels.degenerate_division(every, where=where))
    assert not bool(labels.degenerate_division(every, where=where, every=False))
    assert bool(labels.degenerate_division(np.zeros(4, bool), where=where, every=False))
    assert not bool(labels.degenerate_division(np.zeros(4, bool), where=np.zeros(4, bool)))


@pytest.mark.parametrize("rows", [[0, 1], [2, 3], [6, 7], [1, 5], [7, 2]])
def test_a_block_of_rows_gives_those_rows_of_the_whole_matrix(rows):
    # Ties (a repeated value in every row) and padding (WHERE); the block's rows traced,
    # consecutive or not.
    f = np.round(LOGITS * 2) / 2
    clean = np.array([True, False, True, True, False, True, True, False])
    phi = np.asarray(labels.hard_negative_index(f, where=WHERE))
    scores = np_sigmoid(f)

    @jax.jit
    def blocked(rows):
        at = dict(where=WHERE, rows=rows)
        block = jax.numpy.asarray(f)[rows]
        return {
            "energy": labels.energy(block, **at),
            "clean": labels.clean_mask(block, 0.5, **at),
            "p": labels.partner_p_value(block, **at),
            "test": labels.partner_test_mask(block, 0.3, **at),
            "entropy": labels.normalized_entropy(block, **at),
            "phi": labels.hard_negative_index(block, **at),
            "mask": labels.complementary_mask(
                jax.numpy.asarray(clean)[rows], jax.numpy.asarray(phi)[rows], **at
            ),
            "probs": labels.ms_selection_probs(jax.numpy.asarray(scores)[rows], BETA, OFFSET, **at),
        }

    whole = {
        "energy": labels.energy(f, where=WHERE),
        "clean": labels.clean_mask(f, 0.5, where=WHERE),
        "p": labels.partner_p_value(f, where=WHERE),
        "test": labels.partner_test_mask(f, 0.3, where=WHERE),
        "entropy": labels.normalized_entropy(f, where=WHERE),
        "phi": phi,
        "mask": labels.complementary_mask(clean, phi, where=WHERE),
        "probs": labels.ms_selection_probs(scores, BETA, OFFSET, where=WHERE),
    }
    rows = np.asarray(rows)
    got = blocked(jax.numpy.asarray(rows))
    for name, want in whole.items():
        np.testing.assert_allclose(
            got[name], np.asarray(want)[rows], rtol=RTOL, atol=ATOL, err_msg=name
        )
    assert np.asarray(whole["clean"]).any() and not np.asarray(whole["clean"]).all()


def test_a_block_of_rows_must_fit_the_matrix():
    with pytest.raises(ValueError, match=r"\[b, B\] with b <= B"):
        labels.energy(np.zeros((4, 3)), rows=np.arange(4))
    with pytest.raises(ValueError, match="needs where"):
        labels.complementary_mask(np.ones(2, bool), np.zeros(2, int), rows=np.arange(2))
