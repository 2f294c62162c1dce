"""Tests for ncljax.losses.contrastive against numpy loop oracles and hand-worked values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from ncljax.losses import info_nce, info_nce_directions, symmetric_info_nce

RTOL = ATOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Oracles: loops over queries b and candidates c, in float64.


def np_info_nce(logits, targets, where):
    num = logits.shape[0]
    if targets is None:
        targets = np.eye(num)
    loss = np.zeros(num)
    for b in range(num):
        if not where[b]:
            continue
        candidates = [c for c in range(num) if where[c]]
        top = max(logits[b, c] for c in candidates)
        log_normaliser = top + np.log(sum(np.exp(logits[b, c] - top) for c in candidates))
        for c in candidates:
            loss[b] -= targets[b, c] * (logits[b, c] - log_normaliser)
    return loss


def np_symmetric_info_nce(sim, temperature, targets, targets_t2i, where):
    num = sim.shape[0]
    if targets is None:
        targets = np.eye(num)
    if targets_t2i is None:
        targets_t2i = targets.T
    # Written separately from np_info_nce: caption b is the query over images i = column b of sim.
    loss = np.zeros(num)
    for b in range(num):
        if not where[b]:
            continue
        real = [c for c in range(num) if where[c]]
        lse_i2t = np.log(sum(np.exp(sim[b, c] / temperature) for c in real))
        lse_t2i = np.log(sum(np.exp(sim[i, b] / temperature) for i in real))
        i2t = -sum(targets[b, c] * (sim[b, c] / temperature - lse_i2t) for c in real)
        t2i = -sum(targets_t2i[b, i] * (sim[i, b] / temperature - lse_t2i) for i in real)
        loss[b] = 0.5 * (i2t + t2i)
    return loss


def random_case(seed, num, masked):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(-1.0, 1.0, size=(num, num)).astype(np.float32)
    targets = rng.uniform(0.0, 1.0, size=(num, num)).astype(np.float32)
    where = np.ones(num, dtype=bool)
    if masked and num > 1:
        where[rng.choice(num, size=max(1, num // 3), replace=False)] = False
    return sim, targets, where


# ---------------------------------------------------------------------------------------------
# Hand-worked values.


def test_hand_worked_symmetric():
    # sim = [[2, 0], [1, 1]], temperature 1, hard targets.
    #   i2t pair 0: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)
    #   i2t pair 1: -log(e^1 / (e^1 + e^1)) = log 2
    #   t2i pair 0 (column 0 = [2, 1]): -log(e^2 / (e^2 + e^1)) = log(1 + e^-1)
    #   t2i pair 1 (column 1 = [0, 1]): -log(e^1 / (e^0 + e^1)) = log(1 + e^-1)
    sim = np.array([[2.0, 0.0], [1.0, 1.0]], np.float32)
    want = [
        0.5 * (np.log1p(np.exp(-2.0)) + np.log1p(np.exp(-1.0))),
        0.5 * (np.log(2.0) + np.log1p(np.exp(-1.0))),
    ]
    np.testing.assert_allclose(symmetric_info_nce(sim), want, rtol=RTOL, atol=ATOL)
    # Temperature 0.5 doubles the logits: sim / 0.5 = [[4, 0], [2, 2]].
    want_half = [
        0.5 * (np.log1p(np.exp(-4.0)) + np.log1p(np.exp(-2.0))),
        0.5 * (np.log(2.0) + np.log1p(np.exp(-2.0))),
    ]
    np.testing.assert_allclose(
        symmetric_info_nce(sim, temperature=0.5), want_half, rtol=RTOL, atol=ATOL
    )


def test_hand_worked_soft_targets_and_mask():
    # All-zero logits: every candidate has probability 1/n, so loss_b = (sum_c y_bc) * log n.
    logits = np.zeros((3, 3), np.float32)
    targets = np.array([[0.5, 0.5, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    # Unmasked: n = 3; rows hold mass 2, 2 and 0 (not renormalised).
    np.testing.assert_allclose(
        info_nce(logits, targets), [2 * np.log(3), 2 * np.log(3), 0.0], rtol=RTOL, atol=ATOL
    )
    # Column 2 masked: n = 2, its target mass (1.0 in row 0) is ignored, row 2 returns 0.
    where = np.array([True, True, False])
    np.testing.assert_allclose(
        info_nce(logits, targets, where=where),
        [np.log(2), 2 * np.log(2), 0.0],
        rtol=RTOL,
        atol=ATOL,
    )


def test_single_example_has_zero_loss():
    np.testing.assert_allclose(info_nce(np.array([[3.0]], np.float32)), [0.0], atol=ATOL)
    np.testing.assert_allclose(
        symmetric_info_nce(np.array([[-3.0]], np.float32), temperature=0.07), [0.0], atol=ATOL
    )


# ---------------------------------------------------------------------------------------------
# Against the oracles on random inputs.


@pytest.mark.parametrize("num", [1, 2, 5, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("soft", [False, True])
def test_info_nce_matches_oracle(num, masked, soft):
    sim, targets, where = random_case(num, num, masked)
    logits = sim * 5.0
    got = info_nce(logits, targets if soft else None, where=where if masked else None)
    want = np_info_nce(logits.astype(np.float64), targets if soft else None, where)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("num", "masked"), [(1, False), (5, True), (16, False), (16, True)])
def test_both_directions_match_the_oracle_and_the_transposed_form(num, masked):
    sim, _, where = random_case(num, num, masked)
    logits = sim * 5.0
    mask = where if masked else None
    i2t, t2i = info_nce_directions(logits, where=mask)
    np.testing.assert_allclose(
        i2t, np_info_nce(logits.astype(np.float64), None, where), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        t2i, np_info_nce(logits.T.astype(np.float64), None, where), rtol=RTOL, atol=ATOL
    )

    def down_the_columns(x):
        return info_nce_directions(x, where=mask)[1].sum()

    def transposed(x):
        return info_nce(x.T, where=mask).sum()

    np.testing.assert_allclose(
        jax.grad(down_the_columns)(logits), jax.grad(transposed)(logits), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("num", [1, 2, 5, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("targets_kind", ["hard", "soft", "soft_both"])
def test_symmetric_matches_oracle(num, masked, targets_kind):
    sim, targets, where = random_case(50 + num, num, masked)
    targets_t2i = np.random.default_rng(num).uniform(0.0, 1.0, size=(num, num)).astype(np.float32)
    kwargs = {}
    if targets_kind != "hard":
        kwargs["targets"] = targets
    if targets_kind == "soft_both":
        kwargs["targets_t2i"] = targets_t2i
    got = symmetric_info_nce(sim, temperature=0.2, where=where if masked else None, **kwargs)
    want = np_symmetric_info_nce(
        sim.astype(np.float64),
        0.2,
        kwargs.get("targets"),
        kwargs.get("targets_t2i"),
        where,
    )
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_symmetric_is_gsc_cross_modal_term():
    # GSC Eqs. 3 and 6, on sigmoid similarities S with t = 0.07:
    #   p_i2t_b = e^{S_bb/t} / sum_c e^{S_bc/t},  p_t2i_b = e^{S_bb/t} / sum_c e^{S_cb/t},
    #   per-pair term -(log p_i2t_b + log p_t2i_b) / 2.
    rng = np.random.default_rng(0)
    sim = 1.0 / (1.0 + np.exp(-rng.normal(size=(6, 6))))
    tau = 0.07
    p_i2t = np.array([np.exp(sim[b, b] / tau) / np.exp(sim[b] / tau).sum() for b in range(6)])
    p_t2i = np.array([np.exp(sim[b, b] / tau) / np.exp(sim[:, b] / tau).sum() for b in range(6)])
    want = -0.5 * (np.log(p_i2t) + np.log(p_t2i))
    with jax.enable_x64(True):
        got = symmetric_info_nce(sim, temperature=tau)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_float64_matches_oracle_tightly():
    sim, targets, where = random_case(9, 7, masked=True)
    with jax.enable_x64(True):
        got = info_nce(sim.astype(np.float64) * 10, targets.astype(np.float64), where=where)
        assert got.dtype == jnp.float64
        want = np_info_nce(sim.astype(np.float64) * 10, targets.astype(np.float64), where)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Targets, masking, transforms.


@pytest.mark.parametrize("masked", [False, True])
def test_identity_soft_targets_equal_hard(masked):
    """Hard targets take the log-sum-exp form (logsumexp(row) - x_bb), soft ones the
    target-weighted log-softmax: equal to round-off, with the same gradients."""
    sim, _, where = random_case(21, 6, masked)
    where = where if masked else None
    eye = np.eye(6, dtype=np.float32)
    np.testing.assert_allclose(
        info_nce(sim, eye, where=where), info_nce(sim, None, where=where), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        symmetric_info_nce(sim, temperature=0.1, targets=eye, where=where),
        symmetric_info_nce(sim, temperature=0.1, where=where),
        rtol=1e-6,
        atol=1e-7,
    )
    grads = [
        jax.grad(
            lambda x, t=t: symmetric_info_nce(x, temperature=0.1, targets=t, where=where).sum()
        )(jnp.asarray(sim))
        for t in (eye, None)
    ]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_targets_t2i_defaults_to_transpose():
    sim, targets, _ = random_case(22, 5, masked=False)
    default = symmetric_info_nce(sim, targets=targets)
    explicit = symmetric_info_nce(sim, targets=targets, targets_t2i=targets.T)
    np.testing.assert_allclose(default, explicit, rtol=0, atol=0)
    # Swapping the modalities swaps the roles of the two target matrices.
    swapped = symmetric_info_nce(sim.T, targets=targets.T, targets_t2i=targets)
    np.testing.assert_allclose(swapped, default, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fn_name", ["info_nce", "symmetric"])
def test_masked_example_contributes_nothing(fn_name):
    sim, targets, _ = random_case(23, 7, masked=False)
    where = np.ones(7, dtype=bool)
    where[[1, 4]] = False

    def fn(s):
        if fn_name == "info_nce":
            return info_nce(s, targets, where=where)
        return symmetric_info_nce(s, temperature=0.1, targets=targets, where=where)

    base = fn(sim)
    poisoned = sim.copy()
    poisoned[[1, 4], :] = 1e4
    poisoned[:, [1, 4]] = -1e4
    got = fn(poisoned)
    np.testing.assert_allclose(got, base, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(got)[[1, 4]], 0.0)
    assert np.all(np.asarray(got)[where] > 0.0)

    keep = np.flatnonzero(where)
    sub_targets = targets[np.ix_(keep, keep)]
    sub_sim = sim[np.ix_(keep, keep)]
    if fn_name == "info_nce":
        dropped = info_nce(sub_sim, sub_targets)
    else:
        dropped = symmetric_info_nce(sub_sim, temperature=0.1, targets=sub_targets)
    np.testing.assert_allclose(np.asarray(got)[keep], dropped, rtol=RTOL, atol=ATOL)

    grad = jax.grad(lambda s: jnp.sum(fn(s)))(poisoned)
    np.testing.assert_array_equal(np.asarray(grad)[[1, 4], :], 0.0)
    np.testing.assert_array_equal(np.asarray(grad)[:, [1, 4]], 0.0)


def test_masked_targets_get_zero_grad():
    sim, targets, _ = random_case(29, 6, masked=False)
    where = np.array([True, False, True, True, False, True])

    def total(s, t):
        return jnp.sum(info_nce(s * 5.0, t, where=where))

    grad_targets = np.asarray(jax.grad(total, argnums=1)(sim, targets))
    real = np.outer(where, where)
    np.testing.assert_array_equal(grad_targets[~real], 0.0)
    # d loss_b / d y_bc = -log p_bc > 0 for every real query and candidate.
    assert np.all(grad_targets[real] > 0.0)


def test_all_masked_batch_is_zero_with_finite_grad():
    sim, targets, _ = random_case(24, 4, masked=False)
    where = np.zeros(4, dtype=bool)

    def mean_loss(s, t):
        return jnp.mean(symmetric_info_nce(s, targets=t, where=where))

    np.testing.assert_array_equal(symmetric_info_nce(sim, where=where), 0.0)
    grads = jax.grad(mean_loss, argnums=(0, 1))(sim, targets)
    for grad in grads:
        np.testing.assert_array_equal(grad, 0.0)


def test_jit_equals_no_jit():
    sim, targets, where = random_case(25, 8, masked=True)

    def fn(s, t, w):
        return symmetric_info_nce(s, temperature=0.07, targets=t, where=w)

    np.testing.assert_allclose(
        jax.jit(fn)(sim, targets, where), fn(sim, targets, where), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        jax.jit(info_nce)(sim, targets, where=where),
        info_nce(sim, targets, where=where),
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("masked", [False, True])
def test_grad_is_finite(scale, masked):
    sim, targets, where = random_case(26, 8, masked)
    sim = sim * scale
    where = where if masked else None

    def mean_loss(s, t):
        return jnp.mean(symmetric_info_nce(s, temperature=0.07, targets=t, where=where))

    value = mean_loss(sim, targets)
    grad_sim, grad_targets = jax.jit(jax.grad(mean_loss, argnums=(0, 1)))(sim, targets)
    assert np.isfinite(value)
    assert np.all(np.isfinite(grad_sim)) and np.all(np.isfinite(grad_targets))
    assert float(jnp.abs(grad_sim).sum()) > 0.0


def test_large_logits_are_stable():
    # Logit gap of 200: naive exp overflows in float32, log_softmax must not.
    logits = np.array([[100.0, -100.0], [100.0, -100.0]], np.float32)
    np.testing.assert_allclose(info_nce(logits), [0.0, 200.0], rtol=RTOL, atol=ATOL)


def test_grad_matches_finite_differences():
    sim, targets, where = random_case(27, 5, masked=True)
    with jax.enable_x64(True):
        sim64, targets64 = sim.astype(np.float64), targets.astype(np.float64)

        def fn(s, t):
            return symmetric_info_nce(s, temperature=0.3, targets=t, where=where)

        check_grads(jax.jit(fn), (sim64, targets64), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_one_device_equals_eight(devices):
    sim, targets, where = random_case(28, 16, masked=True)

    def fn(s, t, w):
        return symmetric_info_nce(s, temperature=0.07, targets=t, where=w)

    fn = jax.jit(fn)
    single = fn(sim, targets, where)
    # Auto axes: the loss mixes row- and column-sharded views of sim (sim.T), which only an
    # Auto mesh lets the compiler resolve without explicit reshards.
    mesh = jax.make_mesh((8,), ("data",), (AxisType.Auto,), devices=devices)
    rows = NamedSharding(mesh, P("data"))
    sharded = fn(
        jax.device_put(sim, rows), jax.device_put(targets, rows), jax.device_put(where, rows)
    )
    np.testing.assert_allclose(sharded, single, rtol=RTOL, atol=ATOL)
