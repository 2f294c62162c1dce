"""PC2's estimators (ncljax.labels.pc2) against float64 numpy loops.

The oracles are written from the paper's equations (Secs. 4.3-4.4, Eqs. 4-8) and the
official code (``alipay/PC2-NoiseofWeb``: the classifier's text input resampled to 36
positions, the oscillation against the prediction bank) and never call the library. The
resampling oracle restates PyTorch's ``interpolate(mode='linear', align_corners=False)`` and
is itself checked against sanity values worked by hand for ``L_b = 40`` and against
``np.interp``.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.labels import pc2

RTOL, ATOL = 1e-5, 1e-6
OUT = 36
STATIC_LEN = 48
DIM = 3
# The test programs compile faster without XLA's optimisations, which change no result here
# beyond rounding.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ---------------------------------------------------------------------------------------------
# Phi_36 (the official code's resampling of the text input to 36 positions): oracle.


def np_taps(length, out_len=OUT):
    """``(i0, i1, lambda)`` of every output position of the interpolation branch."""
    taps = []
    for t in range(out_len):
        s = max(0.0, (t + 0.5) * length / out_len - 0.5)
        i0 = math.floor(s)
        taps.append((i0, min(i0 + 1, length - 1), s - i0))
    return taps


def np_resample(features, length, out_len=OUT):
    """The three cases (interpolate, centre-pad, identity) over the first ``length`` positions
    of ``features``."""
    features = np.asarray(features, np.float64)[:, :length]
    out = np.zeros((features.shape[0], out_len, features.shape[2]))
    if length > out_len:
        for t, (i0, i1, lam) in enumerate(np_taps(length, out_len)):
            out[:, t] = (1.0 - lam) * features[:, i0] + lam * features[:, i1]
    else:
        before = (out_len - length) // 2
        after = math.ceil((out_len - length) / 2)
        assert before + length + after == out_len
        for pos in range(length):
            out[:, before + pos] = features[:, pos]
    return out


def np_resample_matrix(length, num_pos, out_len=OUT):
    """``W [out_len, num_pos]``: the linear map of the oracle (``out = W @ features``)."""
    return np_resample(np.eye(num_pos)[None], length, out_len)[0]


def make_words(lengths, num_pos=STATIC_LEN, dim=DIM, seed=0):
    """A batch of captions of different lengths: features, zero past each caption's length,
    NaN past the batch's longest (positions the code's tensor does not have)."""
    rng = np.random.default_rng(seed)
    words = rng.normal(size=(len(lengths), num_pos, dim))
    batch_max = max(lengths)
    for b, length in enumerate(lengths):
        words[b, length:batch_max] = 0.0
    words[:, batch_max:] = np.nan
    return words.astype(np.float32)


# The batches: interpolation (48 = L, 40, 37), identity (36), padding (35, 21 odd, 20 even, 1).
BATCHES = {
    48: (48, 30, 12),
    40: (17, 40, 29),
    37: (37, 5, 36),
    36: (36, 20, 9),
    35: (1, 35, 2),
    21: (21, 3, 20),
    20: (7, 20, 20),
    1: (1, 1, 1),
}


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _resample(features, length):
    return pc2.resample_to_fixed(features, length)


def test_oracle_matches_the_spec_sanity_values_and_np_interp():
    taps = np_taps(40)
    want = [(0, 1, 0.0556), (1, 2, 0.1667), (2, 3, 0.2778), (3, 4, 0.3889), (4, 5, 0.5)]
    for (i0, i1, lam), (w0, w1, wl) in zip(taps[:5], want, strict=True):
        assert (i0, i1) == (w0, w1)
        assert abs(lam - wl) < 5e-5
    assert taps[35][:2] == (38, 39) and abs(taps[35][2] - 0.9444) < 5e-5
    # Interpolation at s_t over the positions 0..L_b-1 is np.interp (s_t < L_b - 1 here).
    rng = np.random.default_rng(3)
    for length in (37, 40, 48, 100):
        signal = rng.normal(size=length)
        s = [max(0.0, (t + 0.5) * length / OUT - 0.5) for t in range(OUT)]
        got = np_resample(signal[None, :, None], length)[0, :, 0]
        np.testing.assert_allclose(got, np.interp(s, np.arange(length), signal), rtol=1e-12)


def test_resample_sanity_values_on_a_position_ramp():
    # Feature = position index: the output is the interpolated source position itself.
    ramp = np.broadcast_to(np.arange(STATIC_LEN, dtype=np.float32)[None, :, None], (1, 48, 1))
    got = np.asarray(_resample(np.ascontiguousarray(ramp), 40))[0, :, 0]
    want = [(1 - lam) * i0 + lam * i1 for i0, i1, lam in np_taps(40)]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[:5], [0.0556, 1.1667, 2.2778, 3.3889, 4.5], atol=5e-5)
    np.testing.assert_allclose(got[35], 38.9444, atol=5e-5)
    # Padding: 7 zero rows before positions 0..20, 8 after.
    got = np.asarray(_resample(np.ascontiguousarray(ramp) + 1.0, 21))[0, :, 0]
    np.testing.assert_array_equal(got, [0.0] * 7 + list(range(1, 22)) + [0.0] * 8)


@pytest.mark.parametrize("batch_max", sorted(BATCHES))
def test_resample_matches_oracle(batch_max):
    words = make_words(BATCHES[batch_max], seed=batch_max)
    got = np.asarray(_resample(words, batch_max))
    assert got.shape == (3, OUT, DIM)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np_resample(words, batch_max), rtol=RTOL, atol=ATOL)
    if batch_max == OUT:
        np.testing.assert_array_equal(got, words[:, :OUT])


def test_resample_short_static_padding_and_jit_equals_eager():
    # A static length below out_len: every batch is padded.
    words = make_words((5, 12, 9), num_pos=12, seed=1)
    for length in (12, 7):
        part = np.where(np.arange(12)[None, :, None] < length, np.nan_to_num(words), np.nan)
        got = np.asarray(pc2.resample_to_fixed(part, length))
        np.testing.assert_allclose(got, np_resample(part, length), rtol=RTOL, atol=ATOL)
    for batch_max in (40, 21):
        words = make_words(BATCHES[batch_max], seed=batch_max)
        eager = np.asarray(pc2.resample_to_fixed(words, batch_max))
        np.testing.assert_allclose(eager, _resample(words, batch_max), rtol=1e-6, atol=1e-7)


def test_resample_does_not_recompile_for_another_batch_length():
    traces = []

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def resample(features, length):
        traces.append(1)
        return pc2.resample_to_fixed(features, length)

    for batch_max in (40, 21, 36, 48, 1):
        words = make_words(BATCHES[batch_max], seed=batch_max)
        got = resample(words, jnp.int32(batch_max))
        np.testing.assert_allclose(got, np_resample(words, batch_max), rtol=RTOL, atol=ATOL)
    assert len(traces) == 1
    # A python int is traced too (as a weakly typed int32: one more trace for all values).
    for batch_max in (37, 20):
        words = make_words(BATCHES[batch_max], seed=batch_max)
        got = resample(words, batch_max)
        np.testing.assert_allclose(got, np_resample(words, batch_max), rtol=RTOL, atol=ATOL)
    assert len(traces) == 2


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _resample_vjp(features, length, cotangent):
    _, vjp = jax.vjp(lambda f: pc2.resample_to_fixed(f, length), features)
    return vjp(cotangent)[0]


@pytest.mark.parametrize("batch_max", [40, 21])
def test_resample_gradient_is_the_transposed_map(batch_max):
    words = make_words(BATCHES[batch_max], seed=7)
    cotangent = np.random.default_rng(8).normal(size=(3, OUT, DIM)).astype(np.float32)
    got = np.asarray(_resample_vjp(words, batch_max, cotangent))
    assert np.isfinite(got).all()
    assert (got[:, batch_max:] == 0).all()  # absent positions (NaN there) get no gradient
    weights = np_resample_matrix(batch_max, STATIC_LEN)
    want = np.einsum("tl,btd->bld", weights, cotangent)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_resample_bad_arguments():
    words = make_words((40, 3))
    for bad in (0, 49):
        with pytest.raises(ValueError, match="batch_max_len"):
            pc2.resample_to_fixed(words, bad)
    with pytest.raises(ValueError, match="batch_max_len"):
        pc2.resample_to_fixed(words, 40.0)
    with pytest.raises(ValueError, match="features"):
        pc2.resample_to_fixed(words[0], 40)
    with pytest.raises(ValueError, match="out_len"):
        pc2.resample_to_fixed(words, 40, out_len=0)


def test_flatten_regions_is_region_major():
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    got = np.asarray(pc2.flatten_regions(x))
    assert got.shape == (2, 12)
    for b in range(2):
        for r in range(4):
            for d in range(3):
                assert got[b, r * 3 + d] == x[b, r, d]
    with pytest.raises(ValueError, match="R, D"):
        pc2.flatten_regions(np.zeros(3))


# ---------------------------------------------------------------------------------------------
# Prediction oscillation (Eq. 7) and the clean soft label (Eq. 8): oracles.


def np_kl(a, b, eps=1e-8):
    total = 0.0
    for ak, bk in zip(a, b, strict=True):
        ak, bk = float(ak), float(bk)
        if ak > 0:
            total += ak * (math.log(max(ak, eps)) - math.log(max(bk, eps)))
    return total


def np_oscillation(p_prev, p_now, direction, valid):
    out = np.zeros(len(valid))
    for i in range(len(valid)):
        if valid[i]:
            a, b = (p_prev[i], p_now[i]) if direction == "paper" else (p_now[i], p_prev[i])
            out[i] = np_kl(a, b)
    return out


def np_soft_label(w, w_osc, threshold=0.5, strict=True, osc_clean=None):
    out = []
    for i in range(len(w)):
        if osc_clean is not None:
            on = bool(osc_clean[i])
        else:
            on = w_osc[i] > threshold if strict else w_osc[i] >= threshold
        out.append(float(w[i]) + (1.0 - float(w[i])) * (float(w_osc[i]) if on else 0.0))
    return np.array(out)


def make_banks(seed=0):
    """Six samples over five classes: 3 is missing from the bank (NaN), 4 did not move, 5 has
    exact zeros in both predictions."""
    rng = np.random.default_rng(seed)
    p_prev = rng.dirichlet(np.ones(5), size=6)
    p_now = rng.dirichlet(np.ones(5), size=6)
    p_prev[3] = np.nan
    p_now[4] = p_prev[4]
    p_prev[5] = [0.5, 0.5, 0.0, 0.0, 0.0]
    p_now[5] = [0.7, 0.0, 0.3, 0.0, 0.0]
    valid = np.array([True, True, True, False, True, True])
    return p_prev.astype(np.float32), p_now.astype(np.float32), valid


@pytest.mark.parametrize("direction", ["paper", "code"])
def test_prediction_oscillation_matches_oracle(direction):
    p_prev, p_now, valid = make_banks()
    got = np.asarray(pc2.prediction_oscillation(p_prev, p_now, direction=direction, valid=valid))
    want = np_oscillation(p_prev, p_now, direction, valid)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert got[3] == 0.0 and abs(got[4]) < 1e-7
    assert got[5] > 5  # a class with mass in a and none in b: log(1 / eps)
    assert (got > -1e-6).all()
    everyone = np.asarray(pc2.prediction_oscillation(p_prev[:3], p_now[:3], direction=direction))
    np.testing.assert_allclose(everyone, want[:3], rtol=RTOL, atol=ATOL)


def test_oscillation_directions_differ_on_an_asymmetric_pair():
    p_prev = np.array([[0.9, 0.1]], np.float32)
    p_now = np.array([[0.5, 0.5]], np.float32)
    paper = float(pc2.prediction_oscillation(p_prev, p_now, direction="paper")[0])
    code = float(pc2.prediction_oscillation(p_prev, p_now, direction="code")[0])
    np.testing.assert_allclose(paper, 0.9 * math.log(1.8) + 0.1 * math.log(0.2), rtol=RTOL)
    np.testing.assert_allclose(code, 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0), rtol=RTOL)
    assert abs(paper - code) > 0.1
    with pytest.raises(ValueError, match="direction"):
        pc2.prediction_oscillation(p_prev, p_now, direction="forward")
    with pytest.raises(ValueError, match="valid"):
        pc2.prediction_oscillation(p_prev, p_now, valid=np.ones(2, bool))


def test_clean_soft_label_matches_oracle():
    w = np.array([0.6, 0.9, 0.55, 0.75, 1.0, 0.51], np.float32)
    w_osc = np.array([0.8, 0.2, 0.5, 0.50001, 0.9, 0.0], np.float32)
    strict = np.asarray(pc2.clean_soft_label(w, w_osc))
    np.testing.assert_allclose(strict, np_soft_label(w, w_osc), rtol=RTOL, atol=ATOL)
    assert strict[2] == w[2]  # w_osc == tau: off in the code
    paper = np.asarray(pc2.clean_soft_label(w, w_osc, strict=False))
    np.testing.assert_allclose(paper, np_soft_label(w, w_osc, strict=False), rtol=RTOL)
    np.testing.assert_allclose(paper[2], 0.55 + 0.45 * 0.5, rtol=RTOL)
    np.testing.assert_array_equal(np.delete(paper, 2), np.delete(strict, 2))
    lower = np.asarray(pc2.clean_soft_label(w, w_osc, threshold=0.1))
    np.testing.assert_allclose(lower, np_soft_label(w, w_osc, threshold=0.1), rtol=RTOL)
    split = np.array([True, True, False, False, True, False])
    given = np.asarray(pc2.clean_soft_label(w, w_osc, osc_clean=split))
    np.testing.assert_allclose(given, np_soft_label(w, w_osc, osc_clean=split), rtol=RTOL)
    assert ((strict >= w) & (strict <= 1.0)).all()


def test_clean_soft_label_has_no_gradient():
    w = jnp.array([0.6, 0.9, 0.7])
    w_osc = jnp.array([0.8, 0.2, 0.6])
    grads = jax.grad(lambda a, b: pc2.clean_soft_label(a, b).sum(), argnums=(0, 1))(w, w_osc)
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)
    with pytest.raises(ValueError, match="w_osc"):
        pc2.clean_soft_label(w, w_osc[:2])


# ---------------------------------------------------------------------------------------------
# Pseudo-captioning (Eqs. 4-5): oracles.


def _norm(v):
    return math.sqrt(sum(float(x) ** 2 for x in v))


def np_cosine(a, b, eps=1e-8):
    return sum(float(x) * float(y) for x, y in zip(a, b, strict=True)) / (
        max(_norm(a), eps) * max(_norm(b), eps)
    )


def np_assign(p_noisy, p_clean, clean_where, where):
    index, cosine = np.zeros(len(p_noisy), int), np.zeros(len(p_noisy))
    if not any(clean_where):
        return index, cosine
    for i in range(len(p_noisy)):
        if not where[i]:
            continue
        best = None
        for b in range(len(p_clean)):
            if clean_where[b] and (best is None or np_cosine(p_noisy[i], p_clean[b]) > cosine[i]):
                best, cosine[i] = b, np_cosine(p_noisy[i], p_clean[b])
        index[i] = best
    return index, cosine


def np_assign_gradients(p_noisy, p_clean, index, where):
    """d(sum_i s_i) / d p_noisy and / d p_clean: for s = a.c / (|a||c|),
    ds/da = c / (|a||c|) - s a / |a|^2 (symmetrically for c)."""
    g_noisy, g_clean = np.zeros(p_noisy.shape), np.zeros(p_clean.shape)
    for i in range(len(p_noisy)):
        if not where[i]:
            continue
        a, c = p_noisy[i].astype(np.float64), p_clean[index[i]].astype(np.float64)
        s = np_cosine(a, c)
        g_noisy[i] += c / (_norm(a) * _norm(c)) - s * a / _norm(a) ** 2
        g_clean[index[i]] += a / (_norm(a) * _norm(c)) - s * c / _norm(c) ** 2
    return g_noisy, g_clean


def soft_margin64(y, alpha=0.2, m=10.0):
    return alpha * (m**y - 1.0) / (m - 1.0)


def np_noisy_margin(cosine, margin=0.2, cutoff=0.5):
    return np.array(
        [
            0.0 if cutoff is not None and s < cutoff else soft_margin64(float(s), margin)
            for s in cosine
        ]
    )


def make_predictions(seed=0):
    """Six noisy images (5 is padding, NaN) and seven clean pairs (3 and 6 are padding; 3 is
    an exact copy of noisy image 0, 6 is NaN). Clean 1 and 4 are equal (a tie), and noisy 2 is
    a slightly perturbed copy of them."""
    rng = np.random.default_rng(seed)
    p_noisy = rng.dirichlet(np.ones(6) * 0.5, size=6)
    p_clean = rng.dirichlet(np.ones(6) * 0.5, size=7)
    p_clean[4] = p_clean[1]
    p_noisy[2] = 0.9 * p_clean[1] + 0.1 / 6
    p_clean[3] = p_noisy[0]
    p_clean[6] = np.nan
    p_noisy[5] = np.nan
    where = np.array([True] * 5 + [False])
    clean_where = np.array([True, True, True, False, True, True, False])
    return p_noisy.astype(np.float32), p_clean.astype(np.float32), where, clean_where


P_NOISY, P_CLEAN, NOISY_WHERE, CLEAN_WHERE = make_predictions()


def test_the_predictions_cover_the_cases():
    index, _ = np_assign(P_NOISY, P_CLEAN, CLEAN_WHERE, NOISY_WHERE)
    assert index[2] == 1  # the tie with clean 4 goes to the lowest index
    assert 3 not in index  # the padding copy of noisy 0 is never chosen
    for i in np.flatnonzero(NOISY_WHERE):  # float32 cannot flip an argmax but the tie
        c = sorted(
            (np_cosine(P_NOISY[i], P_CLEAN[b]) for b in np.flatnonzero(CLEAN_WHERE) if b != 4),
            reverse=True,
        )
        assert c[0] - c[1] > 1e-3


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _assign_and_gradients(p_noisy, p_clean, clean_where, where):
    def total(a, c):
        return pc2.assign_pseudo_captions(a, c, clean_where=clean_where, where=where)[1].sum()

    index, cosine = pc2.assign_pseudo_captions(
        p_noisy, p_clean, clean_where=clean_where, where=where
    )
    return index, cosine, jax.grad(total, argnums=(0, 1))(p_noisy, p_clean)


def test_assign_pseudo_captions_matches_oracle():
    index, cosine, (g_noisy, g_clean) = _assign_and_gradients(
        P_NOISY, P_CLEAN, CLEAN_WHERE, NOISY_WHERE
    )
    want_index, want_cosine = np_assign(P_NOISY, P_CLEAN, CLEAN_WHERE, NOISY_WHERE)
    assert index.dtype == np.int32
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_allclose(cosine, want_cosine, rtol=RTOL, atol=ATOL)
    assert index[5] == 0 and cosine[5] == 0.0
    assert ((np.asarray(cosine) >= 0) & (np.asarray(cosine) <= 1 + 1e-6)).all()
    # The cosine keeps its gradient, into both predictions; none reaches padding.
    want_noisy, want_clean = np_assign_gradients(P_NOISY, P_CLEAN, want_index, NOISY_WHERE)
    np.testing.assert_allclose(g_noisy, want_noisy, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_clean, want_clean, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(g_noisy)[:5]).sum(1).min() > 0
    assert (np.asarray(g_noisy)[5] == 0).all() and (np.asarray(g_clean)[[3, 6]] == 0).all()
    # Without masks the padding copy of noisy 0 wins its row (and NaN spreads).
    clean_all = np.nan_to_num(P_CLEAN)
    index_all, cosine_all = pc2.assign_pseudo_captions(np.nan_to_num(P_NOISY), clean_all)
    assert index_all[0] == 3 and abs(float(cosine_all[0]) - 1.0) < 1e-6


def test_assign_among_candidates_matches_oracle():
    """Each noisy image chooses among its candidates; a row without a real candidate
    chooses among all real clean pairs."""
    rng = np.random.default_rng(7)
    candidates = rng.random((len(P_NOISY), len(P_CLEAN))) < 0.4
    candidates[1] = False  # no candidate at all: every real clean pair
    candidates[2] = ~np.asarray(CLEAN_WHERE)  # only padding: every real clean pair
    index, cosine = jax.jit(
        functools.partial(pc2.assign_pseudo_captions, clean_where=CLEAN_WHERE, where=NOISY_WHERE)
    )(P_NOISY, P_CLEAN, candidates=candidates)
    for i in range(len(P_NOISY)):
        if not NOISY_WHERE[i]:
            assert index[i] == 0 and cosine[i] == 0.0
            continue
        own = candidates[i] & np.asarray(CLEAN_WHERE)
        pool = own if own.any() else np.asarray(CLEAN_WHERE)
        want_index, want_cosine = np_assign(P_NOISY[i : i + 1], P_CLEAN, pool, [True])
        assert index[i] == want_index[0], i
        np.testing.assert_allclose(cosine[i], want_cosine[0], rtol=RTOL, atol=ATOL)
    everything = np.ones((len(P_NOISY), len(P_CLEAN)), bool)
    same = pc2.assign_pseudo_captions(
        P_NOISY, P_CLEAN, clean_where=CLEAN_WHERE, where=NOISY_WHERE, candidates=everything
    )
    plain = pc2.assign_pseudo_captions(P_NOISY, P_CLEAN, clean_where=CLEAN_WHERE, where=NOISY_WHERE)
    np.testing.assert_array_equal(same[0], plain[0])
    assert (np.asarray(index) != np.asarray(plain[0])).any()  # the candidates changed a choice
    with pytest.raises(ValueError, match="candidates"):
        pc2.assign_pseudo_captions(P_NOISY, P_CLEAN, candidates=everything[:, :3])


def test_assign_without_a_real_clean_pair_and_bad_shapes():
    index, cosine = pc2.assign_pseudo_captions(
        P_NOISY, P_CLEAN, clean_where=np.zeros(7, bool), where=NOISY_WHERE
    )
    np.testing.assert_array_equal(index, 0)
    np.testing.assert_array_equal(cosine, 0.0)
    with pytest.raises(ValueError, match="share K"):
        pc2.assign_pseudo_captions(P_NOISY, P_CLEAN[:, :4])
    with pytest.raises(ValueError, match="clean_where"):
        pc2.assign_pseudo_captions(P_NOISY, P_CLEAN, clean_where=np.ones(6, bool))


def test_noisy_margin_values_cutoff_and_gradient():
    s = np.array([0.0, 0.3, 0.4999, 0.5, 0.8, 1.0], np.float32)
    np.testing.assert_allclose(pc2.noisy_margin(s), np_noisy_margin(s), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        pc2.noisy_margin(s, cutoff=None), np_noisy_margin(s, cutoff=None), rtol=RTOL, atol=ATOL
    )
    # Reference values of the m = 10 curve (Eq. 5), worked by hand, alpha = 0.2.
    np.testing.assert_allclose(pc2.noisy_margin(s)[3:], [0.048051, 0.117991, 0.2], atol=1e-6)
    np.testing.assert_array_equal(pc2.noisy_margin(s)[:3], 0.0)
    np.testing.assert_allclose(
        pc2.noisy_margin(s, margin=0.4, cutoff=0.3), np_noisy_margin(s, 0.4, 0.3), rtol=RTOL
    )
    detached = jax.grad(lambda c: pc2.noisy_margin(c).sum())(jnp.asarray(s))
    np.testing.assert_array_equal(detached, 0.0)
    live = jax.grad(lambda c: pc2.noisy_margin(c, detach=False).sum())(jnp.asarray(s))
    want = [0.0 if x < 0.5 else 0.2 * math.log(10.0) * 10.0 ** float(x) / 9.0 for x in s]
    np.testing.assert_allclose(live, want, rtol=RTOL, atol=ATOL)


def test_gather_pseudo_captions_keeps_each_caption_and_its_length():
    lengths = np.array([12, 40, 7, 25], np.int32)
    words = np.nan_to_num(make_words(tuple(lengths), seed=4))
    index = np.array([2, 0, 2, 3, 1], np.int32)
    got_words, got_lengths = pc2.gather_pseudo_captions(words, lengths, index)
    for i, j in enumerate(index):
        np.testing.assert_array_equal(got_words[i], words[j])
        assert got_lengths[i] == lengths[j]
        assert (np.asarray(got_words[i])[lengths[j] :] == 0).all()
    mask = np.arange(STATIC_LEN)[None, :] < lengths[:, None]
    tree = pc2.gather_rows({"words": words, "mask": mask, "lengths": lengths}, index)
    np.testing.assert_array_equal(tree["mask"], mask[index])
    np.testing.assert_array_equal(tree["lengths"], lengths[index])
    # The gradient of a gathered caption reaches its clean source (twice for clean 2).
    grad = jax.grad(lambda g: pc2.gather_pseudo_captions(g, lengths, index)[0].sum())(words)
    np.testing.assert_array_equal(np.asarray(grad)[:, 0, 0], [1.0, 1.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="index"):
        pc2.gather_rows(words, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="lengths"):
        pc2.gather_pseudo_captions(words, lengths[:3], index)


# ---------------------------------------------------------------------------------------------
# jit equals eager, for every estimator of this module but the resampling (tested above).


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _estimators(p_prev, p_now, valid, w, w_osc, p_noisy, p_clean, clean_where, where):
    index, cosine = pc2.assign_pseudo_captions(
        p_noisy, p_clean, clean_where=clean_where, where=where
    )
    return {
        "paper": pc2.prediction_oscillation(p_prev, p_now, valid=valid),
        "code": pc2.prediction_oscillation(p_prev, p_now, direction="code", valid=valid),
        "y_hat": pc2.clean_soft_label(w, w_osc),
        "index": index,
        "cosine": cosine,
        "margin": pc2.noisy_margin(cosine),
        "words": pc2.gather_rows(p_clean, index),
    }


def test_jit_equals_eager():
    p_prev, p_now, valid = make_banks(1)
    w = np.array([0.6, 0.9, 0.55, 0.75, 1.0, 0.51], np.float32)
    w_osc = np.array([0.8, 0.2, 0.5, 0.6, 0.9, 0.0], np.float32)
    args = (p_prev, p_now, valid, w, w_osc, P_NOISY, P_CLEAN, CLEAN_WHERE, NOISY_WHERE)
    jitted = _estimators(*args)
    index, cosine = pc2.assign_pseudo_captions(
        P_NOISY, P_CLEAN, clean_where=CLEAN_WHERE, where=NOISY_WHERE
    )
    eager = {
        "paper": pc2.prediction_oscillation(p_prev, p_now, valid=valid),
        "code": pc2.prediction_oscillation(p_prev, p_now, direction="code", valid=valid),
        "y_hat": pc2.clean_soft_label(w, w_osc),
        "index": index,
        "cosine": cosine,
        "margin": pc2.noisy_margin(cosine),
        "words": pc2.gather_rows(P_CLEAN, index),
    }
    for key, value in eager.items():
        np.testing.assert_allclose(jitted[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
