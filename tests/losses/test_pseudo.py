"""PC2's pseudo-classification losses (ncljax.losses.pseudo) against float64 numpy loops.

The oracles are written from the paper's Sec. 4.2 (Eqs. 2-3, Eq. 3 as printed and with
SCAN's sign) and the official code's entropy term (``alipay/PC2-NoiseofWeb``,
``pc2/model.py``): the objectives directly (means of per-example entropies, the entropy of
the batch-mean prediction) and, separately, the per-example shares, so that "the mean of the
shares is the objective" is a checked claim.
Gradients of the objectives are checked against central differences of the float64 oracles.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.losses import pseudo

RTOL, ATOL = 1e-5, 1e-6
CLAMP = 1e-8
MODES = ("code_sample", "marginal", "printed")
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ---------------------------------------------------------------------------------------------
# Oracles: float64 loops over the real rows i and the classes k.


def real_of(where):
    return [i for i in range(len(where)) if where[i]]


def np_softmax(row):
    row = [float(x) for x in row]
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def np_first_argmax(row):
    best = 0
    for k in range(len(row)):
        if float(row[k]) > float(row[best]):
            best = k
    return best


def np_cross_entropy(image, text, where):
    """Eq. 2: -log p_i[argmax_k q_ik], 0 at padding."""
    out = np.zeros(len(where))
    for i in real_of(where):
        target = np_first_argmax(np_softmax(text[i]))
        out[i] = -math.log(np_softmax(image[i])[target])
    return out


def np_mean_prediction(image, where):
    real = real_of(where)
    probs = [np_softmax(image[i]) for i in real]
    return [sum(p[k] for p in probs) / len(real) for k in range(len(probs[0]))]


def np_entropy_objective(image, where, mode):
    """The objective itself: -mean_i H(p_i) (clamped log), -H(p_bar) or +H(p_bar)."""
    real = real_of(where)
    if mode == "code_sample":
        total = 0.0
        for i in real:
            total += sum(p * math.log(max(p, CLAMP)) for p in np_softmax(image[i]))
        return total / len(real)
    p_bar = np_mean_prediction(image, where)
    neg_entropy = sum(p * math.log(max(p, CLAMP)) for p in p_bar)
    return neg_entropy if mode == "marginal" else -neg_entropy


def np_entropy_shares(image, where, mode):
    """The per-example shares as documented: sum_k p_ik log p_ik (code) or
    +-sum_k p_ik log p_bar_k (the summands of Eq. 3)."""
    out = np.zeros(len(where))
    if mode != "code_sample":
        p_bar = np_mean_prediction(image, where)
    for i in real_of(where):
        p = np_softmax(image[i])
        if mode == "code_sample":
            out[i] = sum(pk * math.log(max(pk, CLAMP)) for pk in p)
        else:
            value = sum(pk * math.log(max(qk, CLAMP)) for pk, qk in zip(p, p_bar, strict=True))
            out[i] = value if mode == "marginal" else -value
    return out


def central_difference(fn, x, h=1e-5):
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (fn(up) - fn(down)) / (2 * h)
    return grad


# ---------------------------------------------------------------------------------------------
# The batch: 7 pairs over 5 classes, padding at 2 (NaN) and 6 (huge logits).

WHERE = np.array([True, True, False, True, True, True, False])
REAL = np.flatnonzero(WHERE)


def make_logits(seed=0):
    rng = np.random.default_rng(seed)
    image = rng.normal(scale=1.5, size=(7, 5))
    text = rng.normal(scale=1.5, size=(7, 5))
    text[0, 1] = text[0, 3] = 9.0  # a tie for the pseudo-label: class 1
    image[4] = [12.0, -3.0, 0.0, 1.0, -20.0]  # a confident row (p_4 near one-hot)
    image[2] = text[2] = np.nan
    image[6] = [80.0, -80.0, 0.0, 0.0, 0.0]
    text[6] = 50.0
    return image.astype(np.float32), text.astype(np.float32)


IMAGE, TEXT = make_logits()


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _losses(image, text, where):
    out = {"ce": pseudo.pseudo_label_cross_entropy(image, text, where=where)}
    for mode in MODES:
        out[mode] = pseudo.prediction_entropy_loss(image, mode=mode, where=where)
    out["total"] = pseudo.pseudo_classification_loss(image, text, where=where)
    out["total_marginal"] = pseudo.pseudo_classification_loss(
        image, text, entropy_weight=2.5, entropy_mode="marginal", where=where
    )
    return out


def losses(image=IMAGE, text=TEXT, where=WHERE):
    return {k: np.asarray(v) for k, v in _losses(image, text, where).items()}


def test_cross_entropy_matches_oracle():
    got = losses()["ce"]
    np.testing.assert_allclose(got, np_cross_entropy(IMAGE, TEXT, WHERE), rtol=RTOL, atol=ATOL)
    assert (got[~WHERE] == 0).all() and (got[WHERE] > 0).all()
    # The tie of row 0 goes to class 1.
    np.testing.assert_allclose(got[0], -math.log(np_softmax(IMAGE[0])[1]), rtol=RTOL)


def np_centered_cross_entropy(image, text, where):
    """The centred variant: the argmax of each real caption's logits minus their mean over
    the real captions (per class), looped."""
    real = real_of(where)
    k = len(text[real[0]])
    mean = [sum(float(text[i][c]) for i in real) / len(real) for c in range(k)]
    out = np.zeros(len(where))
    for i in real:
        target = np_first_argmax([float(text[i][c]) - mean[c] for c in range(k)])
        out[i] = -math.log(np_softmax(image[i])[target])
    return out


def test_centred_targets_match_oracle_and_ignore_a_class_every_caption_favours():
    image, text = make_logits(3)
    text[WHERE] = np.nan_to_num(text[WHERE])
    text[:, 4] += 40.0  # a bias-like class every caption favours: the plain labels are all 4
    got = np.asarray(
        pseudo.pseudo_label_cross_entropy(image, text, where=WHERE, center_targets=True)
    )
    want = np_centered_cross_entropy(image, text, WHERE)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    plain = np.asarray(pseudo.pseudo_label_cross_entropy(image, text, where=WHERE))
    want_plain = [-math.log(np_softmax(image[i])[4]) for i in REAL]
    np.testing.assert_allclose(plain[WHERE], want_plain, rtol=RTOL, atol=ATOL)
    assert not np.allclose(got[WHERE], plain[WHERE])
    total = pseudo.pseudo_classification_loss(image, text, where=WHERE, center_targets=True)
    ent = pseudo.prediction_entropy_loss(image, where=WHERE)
    np.testing.assert_allclose(total, got + 10.0 * np.asarray(ent), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_entropy_shares_match_oracle_and_average_to_the_objective(mode):
    got = losses()[mode]
    assert np.isfinite(got).all() and (got[~WHERE] == 0).all()
    np.testing.assert_allclose(got, np_entropy_shares(IMAGE, WHERE, mode), rtol=RTOL, atol=ATOL)
    objective = np_entropy_objective(IMAGE, WHERE, mode)
    np.testing.assert_allclose(got[WHERE].mean(), objective, rtol=RTOL, atol=ATOL)


def test_entropy_forms_relate_as_the_spec_says():
    got = losses()
    np.testing.assert_array_equal(got["printed"], -got["marginal"])
    k = IMAGE.shape[1]
    assert -math.log(k) - 1e-6 <= got["marginal"][WHERE].mean() <= 0  # -H(p_bar) in [-log K, 0]
    assert (got["code_sample"][WHERE] <= 1e-7).all()  # -H(p_i) <= 0
    # Jensen: the mean of per-example entropies is at most the entropy of the mean.
    assert got["code_sample"][WHERE].mean() >= got["marginal"][WHERE].mean()
    # Flat predictions: every form sits at its extreme, log K.
    flat = losses(np.zeros((7, k), np.float32), TEXT)
    for mode, sign in (("code_sample", -1), ("marginal", -1), ("printed", 1)):
        np.testing.assert_allclose(flat[mode][WHERE], sign * math.log(k), rtol=RTOL)


def test_total_is_ce_plus_weighted_entropy():
    got = losses()
    np.testing.assert_allclose(got["total"], got["ce"] + 10.0 * got["code_sample"], rtol=RTOL)
    np.testing.assert_allclose(
        got["total_marginal"], got["ce"] + 2.5 * got["marginal"], rtol=RTOL, atol=ATOL
    )


def test_jit_equals_eager():
    got = losses()
    eager = {"ce": pseudo.pseudo_label_cross_entropy(IMAGE, TEXT, where=WHERE)}
    for mode in MODES:
        eager[mode] = pseudo.prediction_entropy_loss(IMAGE, mode=mode, where=WHERE)
    eager["total"] = pseudo.pseudo_classification_loss(IMAGE, TEXT, where=WHERE)
    for key, value in eager.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def test_without_where_every_row_is_real():
    image, text = np.nan_to_num(IMAGE[:5]), np.nan_to_num(TEXT[:5])
    every = np.ones(5, bool)
    got = pseudo.pseudo_classification_loss(image, text, entropy_mode="marginal")
    want = np_cross_entropy(image, text, every) + 10.0 * np_entropy_shares(image, every, "marginal")
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Gradients.


@functools.partial(jax.jit, static_argnames="mode", compiler_options=FAST_COMPILE)
def _objective_grads(image, text, where, mode):
    def objective(image_logits, text_logits):
        shares = pseudo.pseudo_classification_loss(
            image_logits, text_logits, entropy_mode=mode, where=where
        )
        return shares.sum() / where.sum()

    return jax.grad(objective, argnums=(0, 1))(image, text)


@pytest.mark.parametrize("mode", MODES)
def test_objective_gradient_matches_finite_differences(mode):
    g_image, g_text = (np.asarray(g) for g in _objective_grads(IMAGE, TEXT, WHERE, mode))
    assert np.isfinite(g_image).all()
    # No gradient through the pseudo-label: the text path only supplies the target.
    np.testing.assert_array_equal(g_text, 0.0)
    np.testing.assert_array_equal(g_image[~WHERE], 0.0)

    targets = {i: np_first_argmax(TEXT[i]) for i in REAL}

    def oracle(image_real):
        image = np.array(IMAGE, np.float64)
        image[REAL] = image_real
        ce = sum(-math.log(np_softmax(image[i])[targets[i]]) for i in REAL) / len(REAL)
        return ce + 10.0 * np_entropy_objective(image, WHERE, mode)

    want = central_difference(oracle, IMAGE[REAL])
    np.testing.assert_allclose(g_image[REAL], want, rtol=1e-3, atol=2e-4)


def test_cross_entropy_gradient_is_softmax_minus_one_hot():
    def total(image, text):
        return pseudo.pseudo_label_cross_entropy(image, text, where=WHERE).sum()

    g_image, g_text = jax.grad(total, argnums=(0, 1))(jnp.asarray(IMAGE), jnp.asarray(TEXT))
    np.testing.assert_array_equal(g_text, 0.0)
    for i in range(len(WHERE)):
        want = np.zeros(5)
        if WHERE[i]:
            want = np.array(np_softmax(IMAGE[i]))
            want[np_first_argmax(TEXT[i])] -= 1.0
        np.testing.assert_allclose(g_image[i], want, rtol=RTOL, atol=ATOL)


def test_code_entropy_optimum_of_one_sample():
    # Worked from Eq. 2 and the code's entropy term: with K = 128 and weight 10,
    # -log p_q - 10 H(p) is minimal near p_q = 0.05 (the rest flat), the pseudo-label keeping
    # the argmax.
    k = 128
    z = np.linspace(0.0, 6.0, 601, dtype=np.float32)
    image = np.zeros((len(z), k), np.float32)
    image[:, 0] = z
    text = np.zeros((len(z), k), np.float32)
    text[:, 0] = 1.0
    per_sample = np.asarray(pseudo.pseudo_classification_loss(image, text))
    best = z[np.argmin(per_sample)]
    p_best = math.exp(best) / (math.exp(best) + k - 1)
    assert 0.045 < p_best < 0.06


def test_bad_arguments():
    with pytest.raises(ValueError, match="entropy_mode"):
        pseudo.prediction_entropy_loss(IMAGE, mode="scan")
    with pytest.raises(ValueError, match="entropy_mode"):
        pseudo.pseudo_classification_loss(IMAGE, TEXT, entropy_mode="sample")
    with pytest.raises(ValueError, match="text_logits"):
        pseudo.pseudo_label_cross_entropy(IMAGE, TEXT[:, :4])
    with pytest.raises(ValueError, match="image_logits"):
        pseudo.prediction_entropy_loss(IMAGE[0])
    with pytest.raises(ValueError, match="where"):
        pseudo.pseudo_label_cross_entropy(IMAGE, TEXT, where=WHERE[:3])
