"""Tests for ncljax.labels.ot against float64 numpy Sinkhorn/Dykstra loops and an exact LP.

References written here (standard algorithms for UOT-RCL's partial OT, Sec. IV-B2, Eqs. 10-14):
  R1 ``_np_sinkhorn``: balanced log-domain Sinkhorn (the augmented problem of Eq. 14).
  R2 ``_np_partial_dykstra``: entropic partial OT by Dykstra / Bregman projections
     (Benamou et al. 2015, as POT's ``entropic_partial_wasserstein``).
  R3 ``_lp_partial`` / ``_lp_balanced``: exact LPs with scipy HiGHS (tiny sizes only).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import optimize, special

from ncljax.labels import (
    PartialOTOutput,
    RelationPlan,
    mass_schedule,
    partial_ot_labels,
    relation_plan,
)

F64_ATOL = 1e-8
F32_ATOL = 1e-5

# Eager calls retrace the Sinkhorn loop on every call; jit once per setting instead.
# test_jit_equals_eager_and_traces_once covers the eager path.
_partial_jit = jax.jit(partial_ot_labels, static_argnames=("threshold", "max_iterations", "shift"))
relation_jit = jax.jit(relation_plan, static_argnames=("threshold", "max_iterations", "anderson"))


def partial_jit(cost, *, mass, epsilon, corner=None, **kwargs):
    """Passes every traced scalar as a Python float: one compile per shape and static setting."""
    if corner is not None:
        kwargs["corner"] = float(corner)
    return _partial_jit(cost, mass=float(mass), epsilon=float(epsilon), **kwargs)


# --------------------------------------------------------------------------- references


def _np_sinkhorn(cost, a, b, eps, tol=1e-12, max_iter=200_000):
    """R1: log-domain Sinkhorn in float64, g then f, until the column L1 error < tol."""
    cost = np.asarray(cost, np.float64)
    with np.errstate(divide="ignore"):
        log_a, log_b = np.log(a), np.log(b)
    f, g = np.zeros(len(a)), np.zeros(len(b))
    for _ in range(max_iter):
        g = eps * log_b - eps * special.logsumexp((f[:, None] - cost) / eps, axis=0)
        f = eps * log_a - eps * special.logsumexp((g[None, :] - cost) / eps, axis=1)
        plan = np.exp((f[:, None] + g[None, :] - cost) / eps)
        if np.abs(plan.sum(0) - b).sum() < tol:
            return plan
    raise RuntimeError("reference Sinkhorn did not converge")


def _augment(cost, mass, r, corner=0.0):
    n, k = cost.shape
    cost_aug = np.zeros((n + 1, k + 1))
    cost_aug[:n, :k] = cost
    cost_aug[n, k] = corner
    a = np.concatenate([np.full(n, 1.0 / n), [1.0 - mass]])
    b = np.concatenate([r, [1.0 - mass]])
    return cost_aug, a, b


def _np_partial_sinkhorn(cost, mass, eps, r=None, corner=None, tol=1e-12):
    """R1 on the dummy-point augmented problem (corner ``None``: the library's default
    ``30 eps``); returns the real block [N, K]."""
    n, k = cost.shape
    r = np.full(k, 1.0 / k) if r is None else r
    corner = 30 * eps if corner is None else corner
    return _np_sinkhorn(*_augment(cost, mass, r, corner), eps, tol=tol)[:n, :k]


def _np_partial_dykstra(cost, a, b, mass, eps, tol=1e-13, max_iter=200_000):
    """R2: entropic partial OT, Dykstra in the log domain with vector corrections."""
    ell = -np.asarray(cost, np.float64) / eps
    ell = ell + np.log(mass) - special.logsumexp(ell)
    q1, q2, q3 = np.zeros(len(a)), np.zeros(len(b)), 0.0
    prev = np.exp(ell)
    for _ in range(max_iter):
        t = ell + q1[:, None]
        d1 = np.minimum(0.0, np.log(a) - special.logsumexp(t, axis=1))
        ell, q1 = t + d1[:, None], -d1
        t = ell + q2[None, :]
        d2 = np.minimum(0.0, np.log(b) - special.logsumexp(t, axis=0))
        ell, q2 = t + d2[None, :], -d2
        t = ell + q3
        d3 = np.log(mass) - special.logsumexp(t)
        ell, q3 = t + d3, -d3
        plan = np.exp(ell)
        if np.abs(plan - prev).sum() < tol:
            return plan
        prev = plan
    raise RuntimeError("reference Dykstra did not converge")


def _marginal_matrices(n, k):
    rows = np.kron(np.eye(n), np.ones((1, k)))
    cols = np.kron(np.ones((1, n)), np.eye(k))
    return rows, cols


def _lp_partial(cost, a, b, mass):
    """R3: min <P, C> s.t. P >= 0, P 1 <= a, P^T 1 <= b, 1^T P 1 = mass."""
    rows, cols = _marginal_matrices(*cost.shape)
    res = optimize.linprog(
        cost.ravel(),
        A_ub=np.vstack([rows, cols]),
        b_ub=np.concatenate([a, b]),
        A_eq=np.ones((1, cost.size)),
        b_eq=[mass],
        bounds=(0, None),
        method="highs",
    )
    assert res.status == 0, res.message
    return res.x.reshape(cost.shape)


def _lp_balanced(cost, a, b):
    """R3 (augmented form): min <P, C> over P >= 0 with P 1 = a, P^T 1 = b."""
    rows, cols = _marginal_matrices(*cost.shape)
    res = optimize.linprog(
        cost.ravel(),
        A_eq=np.vstack([rows, cols]),
        b_eq=np.concatenate([a, b]),
        bounds=(0, None),
        method="highs",
    )
    assert res.status == 0, res.message
    return res.x.reshape(cost.shape)


def _vote_cost(rng, n, k, temperature=3.0):
    """A -log(vote) cost like C_S: range ~[0, 18], one cheap class per row."""
    return -special.log_softmax(temperature * rng.standard_normal((n, k)), axis=1)


# --------------------------------------------------------------------------- mass schedule


@pytest.mark.parametrize(
    ("epoch", "expected"),
    [(0, 0.2), (1, 0.2), (2, 0.2), (3, 0.2 + 0.6 / 97), (50, 0.2 + 0.6 * 48 / 97), (99, 0.8)],
)
def test_mass_schedule_hand_values(epoch, expected):
    s = mass_schedule(epoch, num_epochs=100, warmup_epochs=2)
    assert isinstance(s, float)
    assert s == pytest.approx(expected, abs=1e-12)


def test_mass_schedule_custom_range_and_degenerate_span():
    assert mass_schedule(7, num_epochs=10, warmup_epochs=0, start=0.1, end=1.0) == pytest.approx(
        0.8, abs=1e-12
    )
    assert mass_schedule(150, num_epochs=100, warmup_epochs=2) == pytest.approx(0.8, abs=1e-12)
    # One post-warm-up epoch: the span is clamped to 1, so that epoch gets `start`.
    assert mass_schedule(2, num_epochs=3, warmup_epochs=2) == pytest.approx(0.2, abs=1e-12)


# --------------------------------------------------------------------------- partial OT


@pytest.mark.parametrize(
    ("epsilon", "corner_is_max", "prior"),
    [(0.1, False, False), (0.05, False, True), (0.05, True, False), (0.01, False, False)],
)
def test_partial_matches_numpy_sinkhorn_float64(epsilon, corner_is_max, prior):
    rng = np.random.default_rng(0)
    n, k, mass = 40, 5, 0.45
    cost = rng.uniform(0.5, 3.0, (n, k))
    r = rng.dirichlet(np.full(k, 5.0)) if prior else None
    shifted = cost - cost.min()
    corner = shifted.max() if corner_is_max else 0.0
    ref = _np_partial_sinkhorn(shifted, mass, epsilon, r=r, corner=corner)
    with jax.enable_x64(True):
        out = partial_jit(
            jnp.asarray(cost),
            mass=mass,
            class_marginal=None if r is None else 3.0 * jnp.asarray(r),  # normalised inside
            epsilon=epsilon,
            corner=corner,
            threshold=1e-12,
            max_iterations=100_000,
        )
        assert isinstance(out, PartialOTOutput)
        assert out.labels.dtype == jnp.float64
        assert bool(out.converged)
    np.testing.assert_allclose(out.labels, n * ref, atol=F64_ATOL, rtol=0)
    np.testing.assert_allclose(out.selection, n * ref.sum(1), atol=F64_ATOL, rtol=0)
    np.testing.assert_allclose(out.mass, ref.sum(), atol=F64_ATOL, rtol=0)


def test_partial_matches_numpy_sinkhorn_float32():
    rng = np.random.default_rng(1)
    n, k, mass, epsilon = 300, 10, 0.5, 0.05
    cost = _vote_cost(rng, n, k)
    ref = _np_partial_sinkhorn(cost - cost.min(), mass, epsilon)
    out = partial_jit(jnp.asarray(cost, jnp.float32), mass=mass, epsilon=epsilon)
    assert out.labels.dtype == jnp.float32
    assert bool(out.converged)
    assert 0 < int(out.n_iters) < 5000
    np.testing.assert_allclose(out.labels, n * ref, atol=F32_ATOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("epsilon", [0.1, 0.05])
@pytest.mark.parametrize("mass", [0.2, 0.5, 0.8])
def test_partial_feasibility(seed, epsilon, mass):
    rng = np.random.default_rng(seed)
    n, k = 300, 10
    cost = jnp.asarray(_vote_cost(rng, n, k), jnp.float32)
    r = np.full(k, 1.0 / k)
    max_shifted = float(cost.max() - cost.min())
    for corner in (0.0, max_shifted):
        out = partial_jit(cost, mass=mass, epsilon=epsilon, corner=corner)
        assert bool(out.converged)
        plan = np.asarray(out.labels, np.float64) / n
        assert plan.min() >= 0.0
        assert np.all(plan.sum(1) <= (1.0 + 1e-4) / n)
        assert np.all(plan.sum(0) <= r * (1.0 + 1e-4))
        selection = np.asarray(out.selection)
        assert selection.min() >= 0.0
        assert selection.max() <= 1.0 + 1e-4
        np.testing.assert_allclose(selection, np.asarray(out.labels).sum(1), atol=1e-6)
        np.testing.assert_allclose(out.mass, plan.sum(), atol=1e-6)
        # The slack (corner mass) is non-negative: at least `mass` is transported.
        assert float(out.mass) >= mass - 1e-5
    # Strict partial corner (A = max C): no leakage through the corner, mass exact.
    assert abs(float(out.mass) - mass) <= 1e-3


def test_partial_corner_zero_leakage_vanishes_with_epsilon():
    """Entropic leakage through the corner: with A = 0 the entropic slack shrinks as epsilon
    decreases."""
    rng = np.random.default_rng(0)
    cost = jnp.asarray(_vote_cost(rng, 300, 10), jnp.float32)
    excess = [
        float(partial_jit(cost, mass=0.2, epsilon=eps, corner=0.0).mass) - 0.2
        for eps in (0.1, 0.05, 0.01)
    ]
    assert excess[0] > 1e-3  # visible leakage at epsilon = 0.1 for a small mass
    assert excess[0] > excess[1] > abs(excess[2])
    assert abs(excess[2]) <= 1e-4


@pytest.mark.parametrize("epsilon", [0.01, 0.05, 0.1])
@pytest.mark.parametrize("kind", ["all_tied", "tied_near_min"])
def test_partial_default_corner_transports_exactly_s_on_tied_costs(kind, epsilon):
    """With the paper's zero corner, costs tied at the minimum make extra mass free (0.56
    instead of 0.2 when every cost ties); the default corner (30 epsilon) transports s, and
    the exact LP of the partial problem does too."""
    rng = np.random.default_rng(0)
    n, k, mass = 300, 10, 0.2
    # All tied, or a vote-like cost rounded to 0.1: many entries tie at and near the minimum.
    tied = kind == "all_tied"
    cost = np.zeros((n, k)) if tied else np.round(rng.exponential(0.5, (n, k)), 1)
    c32 = jnp.asarray(cost, jnp.float32)
    zero = float(partial_jit(c32, mass=mass, epsilon=epsilon, corner=0.0).mass)
    assert zero > mass + 0.05
    out = partial_jit(c32, mass=mass, epsilon=epsilon)
    assert bool(out.converged)
    assert float(out.mass) == pytest.approx(mass, abs=1e-5)
    lp = _lp_partial(cost - cost.min(), np.full(n, 1.0 / n), np.full(k, 1.0 / k), mass)
    assert lp.sum() == pytest.approx(mass, abs=1e-9)


def test_partial_approaches_lp_as_epsilon_shrinks():
    rng = np.random.default_rng(0)
    n, k, mass = 60, 5, 0.5
    cost = rng.uniform(0.0, 1.0, (n, k))
    shifted = cost - cost.min()
    a, b = np.full(n, 1.0 / n), np.full(k, 1.0 / k)
    lp = _lp_partial(shifted, a, b, mass)
    assert lp.sum() == pytest.approx(mass, abs=1e-9)
    epsilons = (0.1, 0.05, 0.02, 0.01)
    ours, dykstra = [], []
    for eps in epsilons:
        out = partial_jit(jnp.asarray(cost, jnp.float32), mass=mass, epsilon=eps)
        assert bool(out.converged)
        ours.append(np.abs(np.asarray(out.labels, np.float64) / n - lp).sum())
        dykstra.append(np.abs(_np_partial_dykstra(shifted, a, b, mass, eps) - lp).sum())
    assert all(d1 > d2 for d1, d2 in itertools.pairwise(ours)), ours
    assert all(d1 > d2 for d1, d2 in itertools.pairwise(dykstra)), dykstra
    # Both entropic problems share the LP limit; at 0.01 each is well on its way.
    assert ours[-1] < 0.3 * ours[0]
    assert dykstra[-1] < 0.3 * dykstra[0]
    # At small epsilon the LP objective is approached too.
    out = partial_jit(jnp.asarray(cost, jnp.float32), mass=mass, epsilon=0.01)
    ours_obj = float(np.sum(np.asarray(out.labels, np.float64) / n * shifted))
    assert ours_obj == pytest.approx(float(np.sum(lp * shifted)), rel=0.05)


def test_partial_negative_cost_regression():
    """Negative costs with the paper's zero dummy costs (Eq. 14) inflate the transported mass."""
    rng = np.random.default_rng(0)
    n, k, mass = 300, 10, 0.3
    cost = _vote_cost(rng, n, k)
    negative = rng.random((n, k)) < 0.1
    cost = np.where(negative, -rng.uniform(0.0, 1.0, (n, k)), cost)
    # The exact LP of the raw augmented problem already transports far more than s:
    # every row holding a negative entry is worth moving (about 1 - 0.9^K of them).
    raw_lp = _lp_balanced(*_augment(cost, mass, np.full(k, 1.0 / k)))
    assert raw_lp[:n, :k].sum() > mass + 0.3
    cost32 = jnp.asarray(cost, jnp.float32)
    raw = partial_jit(cost32, mass=mass, epsilon=0.05, corner=0.0, shift=False)
    shifted = partial_jit(cost32, mass=mass, epsilon=0.05, corner=0.0, shift=True)
    assert bool(raw.converged)
    assert bool(shifted.converged)
    assert float(raw.mass) > mass + 0.3
    assert float(raw.mass) == pytest.approx(raw_lp[:n, :k].sum(), abs=0.05)
    assert abs(float(shifted.mass) - mass) <= 1e-3


def test_partial_full_mass_is_balanced_ot():
    """s = 1: the dummy marginals are 0 and the plan is the balanced entropic plan."""
    rng = np.random.default_rng(3)
    n, k, epsilon = 60, 5, 0.05
    cost = rng.uniform(0.0, 2.0, (n, k))
    ref = _np_sinkhorn(cost - cost.min(), np.full(n, 1.0 / n), np.full(k, 1.0 / k), epsilon)
    out = partial_jit(jnp.asarray(cost, jnp.float32), mass=1.0, epsilon=epsilon)
    assert bool(out.converged)
    np.testing.assert_allclose(out.labels, n * ref, atol=F32_ATOL, rtol=0)
    np.testing.assert_allclose(out.selection, np.ones(n), atol=F32_ATOL)


# --------------------------------------------------------------------------- relation plan


@pytest.mark.parametrize("anderson", [0, 5])
def test_relation_matches_numpy_sinkhorn_float64(anderson):
    rng = np.random.default_rng(0)
    batch, epsilon = 24, 0.1
    cost = rng.uniform(1e-3, 7e-3, (batch, batch))  # relation-JSD scale
    uniform = np.full(batch, 1.0 / batch)
    ref = _np_sinkhorn(cost / cost.max(), uniform, uniform, epsilon)
    with jax.enable_x64(True):
        out = relation_jit(
            jnp.asarray(cost),
            epsilon=epsilon,
            threshold=1e-12,
            max_iterations=100_000,
            anderson=anderson,
        )
        assert isinstance(out, RelationPlan)
        assert out.plan.dtype == jnp.float64
        assert bool(out.converged)
    np.testing.assert_allclose(out.plan, ref, atol=F64_ATOL, rtol=0)
    np.testing.assert_allclose(
        out.image_to_text, ref / ref.sum(1, keepdims=True), atol=F64_ATOL, rtol=0
    )
    np.testing.assert_allclose(
        out.text_to_image, ref.T / ref.T.sum(1, keepdims=True), atol=F64_ATOL, rtol=0
    )


def _block_cost(rng, batch=64, block=16):
    group = np.arange(batch) // block
    same = group[:, None] == group[None, :]
    # Noisy within and across blocks, JSD-like scale (~1e-3).
    cost = np.where(same, rng.uniform(0.0, 0.4, same.shape), rng.uniform(0.5, 1.0, same.shape))
    return 1e-3 * cost, same


def test_relation_block_structure_and_marginals():
    rng = np.random.default_rng(0)
    cost, same = _block_cost(rng)
    batch = cost.shape[0]
    out = relation_jit(jnp.asarray(cost, jnp.float32))
    assert bool(out.converged)
    plan = np.asarray(out.plan, np.float64)
    assert plan.min() >= 0.0
    np.testing.assert_allclose(plan.sum(1), np.full(batch, 1.0 / batch), atol=1e-6, rtol=0)
    assert np.abs(plan.sum(0) - 1.0 / batch).sum() <= 2e-5  # threshold 1e-5, float32
    for targets in (out.image_to_text, out.text_to_image):
        targets = np.asarray(targets, np.float64)
        np.testing.assert_allclose(targets.sum(1), np.ones(batch), atol=1e-5)
        assert (targets * same).sum(1).min() >= 0.9
    np.testing.assert_allclose(out.image_to_text, batch * plan, atol=1e-4)
    np.testing.assert_allclose(out.text_to_image, batch * plan.T, atol=1e-4)


@pytest.mark.parametrize("anderson", [0, 5])
def test_relation_padding_equals_unpadded_subset(anderson):
    rng = np.random.default_rng(1)
    cost, _ = _block_cost(rng, batch=40, block=8)
    valid = rng.random(40) < 0.75
    assert 0 < valid.sum() < 40
    padded = np.where(valid[:, None] & valid[None, :], cost, np.nan)  # padding must not leak
    padded[~valid, 0] = 1e6
    sub = cost[valid][:, valid]
    uniform = np.full(sub.shape[0], 1.0 / sub.shape[0])
    ref = _np_sinkhorn(sub / sub.max(), uniform, uniform, 0.1)  # max over real entries only
    expected = {
        "plan": ref,
        "image_to_text": ref / ref.sum(1, keepdims=True),
        "text_to_image": ref.T / ref.T.sum(1, keepdims=True),
    }
    with jax.enable_x64(True):
        out64 = relation_jit(
            jnp.asarray(padded),
            where=valid,
            threshold=1e-12,
            max_iterations=100_000,
            anderson=anderson,
        )
    out32 = relation_jit(
        jnp.asarray(padded, jnp.float32), where=jnp.asarray(valid), anderson=anderson
    )
    assert bool(out64.converged)
    assert bool(out32.converged)
    for out, atol in ((out64, F64_ATOL), (out32, 1e-4)):  # float32: threshold-limited
        for field, ref_field in expected.items():
            full = np.asarray(getattr(out, field))
            assert np.isfinite(full).all()
            assert np.all(full[~valid] == 0.0)
            assert np.all(full[:, ~valid] == 0.0)
            np.testing.assert_allclose(full[valid][:, valid], ref_field, atol=atol, rtol=0)
        np.testing.assert_allclose(np.asarray(out.image_to_text).sum(1)[valid], 1.0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out.text_to_image).sum(1)[valid], 1.0, atol=1e-5)
        row_mass = np.asarray(out.plan).sum(1)[valid]
        np.testing.assert_allclose(row_mass, 1.0 / valid.sum(), atol=1e-6)


@pytest.mark.parametrize("anderson", [0, 5])
def test_relation_all_padded_is_zero(anderson):
    out = relation_jit(
        jnp.ones((40, 40), jnp.float32), where=jnp.zeros(40, bool), anderson=anderson
    )
    for field in ("plan", "image_to_text", "text_to_image"):
        np.testing.assert_array_equal(getattr(out, field), np.zeros((40, 40)))


@pytest.mark.parametrize("cost", ["zeros", "constant"])
def test_relation_anderson_on_a_flat_cost_is_uniform(cost):
    """A cost without structure converges at the first check; Anderson's extrapolation
    over residuals of zero must not turn the potentials into NaN."""
    flat = jnp.zeros((16, 16)) if cost == "zeros" else jnp.full((16, 16), 3e-3)
    out = relation_jit(flat, anderson=5)
    assert bool(out.converged)
    np.testing.assert_allclose(out.plan, np.full((16, 16), 1 / 256), rtol=1e-6)


def test_relation_anderson_reaches_the_plan_in_fewer_iterations():
    """A sharp plan (small epsilon on a block cost): plain Sinkhorn needs hundreds of
    iterations (580), Anderson memory 5 fewer (170), and both stop within the threshold
    of the float64 plan."""
    rng = np.random.default_rng(4)
    cost, _ = _block_cost(rng, batch=96, block=4)
    batch, epsilon = cost.shape[0], 0.05
    uniform = np.full(batch, 1.0 / batch)
    ref = _np_sinkhorn(cost / cost.max(), uniform, uniform, epsilon, tol=1e-10)
    plain = relation_jit(jnp.asarray(cost, jnp.float32), epsilon=epsilon, anderson=0)
    fast = relation_jit(jnp.asarray(cost, jnp.float32), epsilon=epsilon, anderson=5)
    assert bool(plain.converged) and bool(fast.converged)
    assert int(fast.n_iters) <= int(plain.n_iters) // 2
    for out in (plain, fast):
        assert np.abs(np.asarray(out.plan, np.float64) - ref).sum() <= 1e-4


@pytest.mark.parametrize("anderson", [-1, 2.0, True])
def test_relation_refuses_a_bad_anderson_memory(anderson):
    with pytest.raises(ValueError, match="anderson must be an integer >= 0"):
        relation_plan(jnp.zeros((4, 4)), anderson=anderson)


# --------------------------------------------------------------------------- jit and grad


def test_jit_equals_eager_and_traces_once():
    rng = np.random.default_rng(2)
    cost = jnp.asarray(_vote_cost(rng, 64, 8), jnp.float32)
    rel_cost = jnp.asarray(_block_cost(rng, batch=16, block=4)[0], jnp.float32)
    traces = []

    def fn(cost, rel_cost, mass, epsilon):
        traces.append(None)
        return partial_ot_labels(cost, mass=mass, epsilon=epsilon), relation_plan(rel_cost)

    jitted = jax.jit(fn)
    eager = (partial_ot_labels(cost, mass=0.3, epsilon=0.05), relation_plan(rel_cost))
    for ours, expected in zip(jitted(cost, rel_cost, 0.3, 0.05), eager, strict=True):
        for a, b in zip(ours, expected, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    # Another mass and epsilon reuse the trace and still match the float64 reference.
    other, _ = jitted(cost, rel_cost, 0.6, 0.1)
    ref = _np_partial_sinkhorn(np.asarray(cost - cost.min(), np.float64), 0.6, 0.1)
    np.testing.assert_allclose(other.labels, 64 * ref, atol=F32_ATOL, rtol=0)
    assert len(traces) == 1


def test_grad_is_finite_and_stops_at_the_plans():
    rng = np.random.default_rng(4)
    n, k, batch = 32, 4, 12
    logits = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    emb = jnp.asarray(rng.standard_normal((batch, 3)), jnp.float32)
    valid = jnp.arange(batch) < 10

    def loss(logits, emb, cost_offset, rel_offset):
        # The offsets reach the loss only through the OT costs, so their gradient is 0.
        log_p = jax.nn.log_softmax(logits)
        out = partial_ot_labels(cost_offset - log_p, mass=0.5)
        sim = emb @ emb.T
        rel = relation_plan(rel_offset + jnp.exp(-sim), where=valid)
        log_match = jax.nn.log_softmax(sim)
        value = -jnp.sum(out.labels * log_p) - jnp.sum(rel.image_to_text * log_match)
        return value + out.mass + jnp.sum(rel.plan**2) + jnp.sum(rel.text_to_image), out.labels

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    offsets = (jnp.zeros((n, k)), jnp.zeros((batch, batch)))
    (value, labels), (g_logits, g_emb, g_cost, g_rel) = grad_fn(logits, emb, *offsets)
    assert np.isfinite(value)
    assert np.isfinite(g_logits).all()
    assert np.isfinite(g_emb).all()
    np.testing.assert_array_equal(g_cost, np.zeros((n, k)))
    np.testing.assert_array_equal(g_rel, np.zeros((batch, batch)))
    # The labels are constants: d/dlogits of -sum Q log softmax = -(Q - rowsum(Q) softmax).
    expected = -(labels - labels.sum(1, keepdims=True) * jax.nn.softmax(logits))
    np.testing.assert_allclose(g_logits, expected, atol=1e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_over_8_devices_equals_single_device(devices, axis_type):
    rng = np.random.default_rng(5)
    cost = jnp.asarray(_vote_cost(rng, 64, 8), jnp.float32)
    rel_cost = jnp.asarray(_block_cost(rng, batch=16, block=4)[0], jnp.float32)
    mesh = jax.make_mesh((8,), ("data",), (axis_type,), devices=devices)
    rows = NamedSharding(mesh, P("data"))
    fn = jax.jit(lambda c, r: (partial_ot_labels(c, mass=0.4), relation_plan(r)))
    single = fn(cost, rel_cost)
    sharded = fn(jax.device_put(cost, rows), jax.device_put(rel_cost, rows))
    for ours, expected in zip(sharded, single, strict=True):
        for a, b in zip(ours, expected, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
