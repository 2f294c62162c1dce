"""Tests for ncljax.losses.ranking against numpy loop oracles and hand-worked values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ncljax.losses import hinge_costs, triplet_hardest, triplet_sum

RTOL = ATOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Oracles: straight from the equations, one loop over pairs b and one over negatives.


def np_hinge_costs(sim, margin, where):
    num = sim.shape[0]
    margin = np.broadcast_to(np.asarray(margin, np.float64), (num,))
    cost_i2t = np.zeros((num, num))
    cost_t2i = np.zeros((num, num))
    for b in range(num):
        if not where[b]:
            continue
        for c in range(num):
            if c == b or not where[c]:
                continue
            cost_i2t[b, c] = max(0.0, margin[b] + sim[b, c] - sim[b, b])
            cost_t2i[b, c] = max(0.0, margin[b] + sim[c, b] - sim[b, b])
    return cost_i2t, cost_t2i


def np_triplet(sim, margin, where, reduce):
    num = sim.shape[0]
    margin = np.broadcast_to(np.asarray(margin, np.float64), (num,))
    loss = np.zeros(num)
    for b in range(num):
        if not where[b]:
            continue
        image_query, caption_query = [], []
        for c in range(num):
            if c == b or not where[c]:
                continue
            image_query.append(max(0.0, margin[b] + sim[b, c] - sim[b, b]))
            caption_query.append(max(0.0, margin[b] + sim[c, b] - sim[b, b]))
        if reduce == "sum":
            loss[b] = sum(image_query) + sum(caption_query)
        else:
            loss[b] = max(image_query, default=0.0) + max(caption_query, default=0.0)
    return loss


LOSSES = {
    "sum": triplet_sum,
    "hardest": triplet_hardest,
}


def random_case(seed, num, masked):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(-1.0, 1.0, size=(num, num)).astype(np.float32)
    margin = rng.uniform(0.0, 0.5, size=num).astype(np.float32)
    where = np.ones(num, dtype=bool)
    if masked and num > 1:
        where[rng.choice(num, size=max(1, num // 3), replace=False)] = False
    return sim, margin, where


# ---------------------------------------------------------------------------------------------
# Hand-worked values.

# sim (rows images, columns captions), margin 0.2, positives 0.9, 0.6, 0.4; [x]+ = max(0, x):
#   pair 0: i2t [.2+.5-.9]+ = 0,  [.2+.1-.9]+ = 0;  t2i [.2+.8-.9]+ = .1, [.2+.2-.9]+ = 0
#   pair 1: i2t [.2+.8-.6]+ = .4, [.2+.3-.6]+ = 0;  t2i [.2+.5-.6]+ = .1, [.2+.7-.6]+ = .3
#   pair 2: i2t [.2+.2-.4]+ = 0,  [.2+.7-.4]+ = .5; t2i [.2+.1-.4]+ = 0,  [.2+.3-.4]+ = .1
HAND_SIM = np.array([[0.9, 0.5, 0.1], [0.8, 0.6, 0.3], [0.2, 0.7, 0.4]], np.float32)


def test_hand_worked_costs():
    cost_i2t, cost_t2i = hinge_costs(HAND_SIM, 0.2)
    np.testing.assert_allclose(
        cost_i2t, [[0, 0, 0], [0.4, 0, 0], [0, 0.5, 0]], rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        cost_t2i, [[0, 0.1, 0], [0.1, 0, 0.3], [0, 0.1, 0]], rtol=RTOL, atol=ATOL
    )


def test_hand_worked_losses():
    # sum: 0 + 0.1, 0.4 + 0.4, 0.5 + 0.1; hardest: 0 + 0.1, 0.4 + 0.3, 0.5 + 0.1.
    np.testing.assert_allclose(triplet_sum(HAND_SIM, 0.2), [0.1, 0.8, 0.6], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        triplet_hardest(HAND_SIM, 0.2), [0.1, 0.7, 0.6], rtol=RTOL, atol=ATOL
    )


def test_hand_worked_soft_margin_and_mask():
    # Per-pair margins [0.0, 0.5, 0.3], example 0 masked out, so pairs 1 and 2 only see each other:
    #   pair 1: i2t [0.5+0.3-0.6]+ = 0.2; t2i [0.5+0.7-0.6]+ = 0.6  -> 0.8
    #   pair 2: i2t [0.3+0.7-0.4]+ = 0.6; t2i [0.3+0.3-0.4]+ = 0.2  -> 0.8
    where = np.array([False, True, True])
    margin = np.array([0.0, 0.5, 0.3], np.float32)
    for loss_fn in LOSSES.values():
        np.testing.assert_allclose(
            loss_fn(HAND_SIM, margin, where=where), [0.0, 0.8, 0.8], rtol=RTOL, atol=ATOL
        )


# ---------------------------------------------------------------------------------------------
# Against the oracle on random inputs.


@pytest.mark.parametrize("num", [1, 2, 5, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("per_pair_margin", [False, True])
def test_hinge_costs_match_oracle(num, masked, per_pair_margin):
    sim, margin, where = random_case(num, num, masked)
    margin = margin if per_pair_margin else 0.2
    cost_i2t, cost_t2i = hinge_costs(sim, margin, where=where if masked else None)
    want_i2t, want_t2i = np_hinge_costs(sim.astype(np.float64), margin, where)
    np.testing.assert_allclose(cost_i2t, want_i2t, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(cost_t2i, want_t2i, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
@pytest.mark.parametrize("num", [1, 2, 5, 16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("per_pair_margin", [False, True])
def test_triplet_matches_oracle(reduce, num, masked, per_pair_margin):
    sim, margin, where = random_case(100 + num, num, masked)
    margin = margin if per_pair_margin else 0.2
    got = LOSSES[reduce](sim, margin, where=where if masked else None)
    want = np_triplet(sim.astype(np.float64), margin, where, reduce)
    assert got.shape == (num,)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
def test_float64_matches_oracle_tightly(reduce):
    sim, margin, where = random_case(7, 9, masked=True)
    with jax.enable_x64(True):
        sim64 = sim.astype(np.float64)
        got = LOSSES[reduce](sim64, margin.astype(np.float64), where=where)
        assert got.dtype == jnp.float64
        want = np_triplet(sim64, margin.astype(np.float64), where, reduce)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_single_pair_has_no_negatives():
    for loss_fn in LOSSES.values():
        np.testing.assert_array_equal(loss_fn(np.array([[-3.0]], np.float32), 0.2), [0.0])


# ---------------------------------------------------------------------------------------------
# Margins, masking, transforms.


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
def test_constant_margin_array_equals_scalar(reduce):
    sim, _, where = random_case(3, 6, masked=True)
    scalar = LOSSES[reduce](sim, 0.3, where=where)
    array = LOSSES[reduce](sim, np.full(6, 0.3, np.float32), where=where)
    np.testing.assert_allclose(array, scalar, rtol=0, atol=0)
    assert float(jnp.sum(scalar)) > 0.0


def test_margin_of_pair_b_applies_to_both_directions_of_pair_b_only():
    sim, _, _ = random_case(4, 5, masked=False)
    base_i2t, base_t2i = hinge_costs(sim, 0.2)
    margin = np.full(5, 0.2, np.float32)
    margin[3] = 0.9
    cost_i2t, cost_t2i = hinge_costs(sim, margin)
    rows = np.arange(5) != 3
    np.testing.assert_allclose(cost_i2t[rows], base_i2t[rows], rtol=0, atol=0)
    np.testing.assert_allclose(cost_t2i[rows], base_t2i[rows], rtol=0, atol=0)
    assert np.all(np.asarray(cost_i2t[3]) >= np.asarray(base_i2t[3]))
    assert np.all(np.asarray(cost_t2i[3]) >= np.asarray(base_t2i[3]))
    assert float(jnp.sum(cost_i2t[3] + cost_t2i[3])) > float(jnp.sum(base_i2t[3] + base_t2i[3]))


@pytest.mark.parametrize("masked", [False, True])
def test_matrix_margin_matches_oracle_and_the_vector_forms(masked):
    """``margin[i, c]`` serves image ``i`` against caption ``c`` and caption ``c`` against
    image ``i``; a matrix constant along a row (column) is ``margin_of='image'``
    (``'caption'``) of that vector."""
    sim, vector, where = random_case(7, 6, masked)
    matrix = np.random.default_rng(8).uniform(0.0, 0.5, (6, 6)).astype(np.float32)
    cost_i2t, cost_t2i = hinge_costs(sim, matrix, where=where)
    want_i2t, want_t2i = np.zeros((6, 6)), np.zeros((6, 6))
    for b in range(6):
        for c in range(6):
            if b != c and where[b] and where[c]:
                want_i2t[b, c] = max(0.0, matrix[b, c] + sim[b, c] - sim[b, b])
                want_t2i[b, c] = max(0.0, matrix[c, b] + sim[c, b] - sim[b, b])
    np.testing.assert_allclose(cost_i2t, want_i2t, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(cost_t2i, want_t2i, rtol=RTOL, atol=ATOL)
    by_image, by_caption = np.repeat(vector[:, None], 6, 1), np.repeat(vector[None, :], 6, 0)
    for kind, margin in (("image", by_image), ("caption", by_caption)):
        for loss in LOSSES.values():
            np.testing.assert_allclose(
                loss(sim, margin, where=where),
                loss(sim, vector, where=where, margin_of=kind),
                rtol=0,
                atol=0,
            )
    with pytest.raises(ValueError, match="margin_of"):
        hinge_costs(sim, matrix, margin_of="image")
    with pytest.raises(ValueError, match="shape"):
        hinge_costs(sim, matrix[:5, :5])


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
def test_masked_example_contributes_nothing(reduce):
    sim, margin, _ = random_case(5, 7, masked=False)
    where = np.ones(7, dtype=bool)
    where[[2, 5]] = False
    base = LOSSES[reduce](sim, margin, where=where)

    # Make the masked examples the hardest negatives of everyone; nothing may change.
    poisoned = sim.copy()
    poisoned[[2, 5], :] = 50.0
    poisoned[:, [2, 5]] = 50.0
    got = LOSSES[reduce](poisoned, margin, where=where)
    np.testing.assert_allclose(got, base, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(got)[[2, 5]], 0.0)
    # ... and the same as dropping them from the batch.
    keep = np.flatnonzero(where)
    dropped = LOSSES[reduce](sim[np.ix_(keep, keep)], margin[keep])
    np.testing.assert_allclose(np.asarray(got)[keep], dropped, rtol=RTOL, atol=ATOL)

    grad = jax.grad(lambda s: jnp.sum(LOSSES[reduce](s, margin, where=where)))(poisoned)
    np.testing.assert_array_equal(np.asarray(grad)[[2, 5], :], 0.0)
    np.testing.assert_array_equal(np.asarray(grad)[:, [2, 5]], 0.0)


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
def test_jit_equals_no_jit(reduce):
    sim, margin, where = random_case(11, 8, masked=True)
    fn = LOSSES[reduce]
    eager = fn(sim, margin, where=where)
    jitted = jax.jit(lambda s, m, w: fn(s, m, where=w))(sim, margin, where)
    np.testing.assert_allclose(jitted, eager, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("masked", [False, True])
def test_grad_is_finite(reduce, scale, masked):
    sim, margin, where = random_case(13, 8, masked)
    sim = sim * scale
    where = where if masked else None

    def mean_loss(s, m):
        return jnp.mean(LOSSES[reduce](s, m, where=where))

    grad_sim, grad_margin = jax.jit(jax.grad(mean_loss, argnums=(0, 1)))(sim, margin)
    assert np.all(np.isfinite(grad_sim)) and np.all(np.isfinite(grad_margin))
    assert float(jnp.abs(grad_sim).sum()) > 0.0


def test_hardest_grad_matches_hand_derivation():
    # Pair 1 of HAND_SIM: the hardest caption is c=0 (0.4), the hardest image is i=2 (0.3),
    # so d loss_1 / d sim = +1 at (1,0) and (2,1), and -2 at the positive (1,1).
    grad = jax.grad(lambda s: triplet_hardest(s, 0.2)[1])(jnp.asarray(HAND_SIM))
    want = np.zeros((3, 3))
    want[1, 0] = want[2, 1] = 1.0
    want[1, 1] = -2.0
    np.testing.assert_allclose(grad, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduce", ["sum", "hardest"])
def test_one_device_equals_eight(reduce, devices):
    sim, margin, where = random_case(17, 16, masked=True)
    fn = jax.jit(lambda s, m, w: LOSSES[reduce](s, m, where=w))
    single = fn(sim, margin, where)
    # Auto axes: the loss mixes row- and column-sharded views of sim (sim.T), which only an
    # Auto mesh lets the compiler resolve without explicit reshards.
    mesh = jax.make_mesh((8,), ("data",), (AxisType.Auto,), devices=devices)
    rows = NamedSharding(mesh, P("data"))
    sharded = fn(
        jax.device_put(sim, rows), jax.device_put(margin, rows), jax.device_put(where, rows)
    )
    np.testing.assert_allclose(sharded, single, rtol=RTOL, atol=ATOL)
