"""``base.any_network`` and ``base.compute_if``: a loss term skipped where no pair of the
step needs it, under the trainer's named vmap over networks, with the values and
gradients of computing it everywhere."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from ncljax.methods import base

CTX = base.LossContext(jnp.int32(0), jnp.int32(0), base.MAIN, 4, jnp.int32(0), None)
NAMED = CTX._replace(network_axis=base.NETWORK_AXIS)


def test_any_network_is_one_unbatched_flag_under_the_named_vmap():
    flags = jnp.array([[False, False], [False, True], [False, False]])
    assert not base.any_network(flags[0], CTX) and base.any_network(flags[1], CTX)
    for rows, want in ((flags, True), (flags[::2], False)):
        got = jax.vmap(lambda f: base.any_network(f, NAMED), axis_name=base.NETWORK_AXIS)(rows)
        np.testing.assert_array_equal(got, np.full(len(rows), want))


def _term(x, y, scale):
    """A term with intermediates worth keeping for its gradient (an outer product)."""
    m = jnp.tanh(x[:, None] * y[None, :]) * scale
    return {"sum": jnp.sum(m**2), "rows": jnp.logaddexp(m, 0.0).mean(1)}


def _loss(x, y, flag, ctx):
    pred = base.any_network(flag, ctx)
    out = base.compute_if(pred, _term, (x, y), (jnp.float32(1.5),))
    return out["sum"] + jnp.sum(out["rows"] * jnp.arange(x.shape[0]))


def _oracle(x, y, flag):
    """The term computed everywhere and masked: numpy of its value, autodiff of its own."""
    full = _term(x, y, 1.5)
    return jnp.where(jnp.any(flag), full["sum"] + jnp.sum(full["rows"] * jnp.arange(4)), 0.0)


def test_compute_if_gives_the_term_and_its_gradient_or_zeros():
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(4,)), jnp.float32) for _ in range(2))
    for flag in (jnp.array([False, True]), jnp.array([False, False])):
        value, grads = jax.jit(jax.value_and_grad(lambda x, y, f: _loss(x, y, f, CTX), (0, 1)))(
            x, y, flag
        )
        want, want_grads = jax.value_and_grad(_oracle, (0, 1))(x, y, flag)
        np.testing.assert_allclose(value, want, rtol=1e-6)
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    # The hand-worked term at one point: m = tanh(1 * 2) * 1.5.
    m = np.tanh(2.0) * 1.5
    got = _term(jnp.ones(1), jnp.full(1, 2.0), 1.5)
    np.testing.assert_allclose(got["sum"], m**2, rtol=1e-6)
    np.testing.assert_allclose(got["rows"], np.log1p(np.exp(m)), rtol=1e-6)


def test_compute_if_is_a_branch_under_the_networks_vmap():
    """Two networks, one of which needs the term: each gets its own value and gradient,
    and the gradient program holds a branch on one unbatched predicate (no select)."""
    rng = np.random.default_rng(1)
    xs, ys = (jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(2))
    flags = jnp.array([[True, False], [False, False]])
    step = jax.vmap(
        jax.value_and_grad(lambda x, y, f: _loss(x, y, f, NAMED), (0, 1)),
        axis_name=base.NETWORK_AXIS,
    )
    values, (gx, gy) = jax.jit(step)(xs, ys, flags)
    # Network 1's flag is false but network 0's is true: the term is computed for both.
    for k in range(2):
        want, (wx, wy) = jax.value_and_grad(_oracle, (0, 1))(xs[k], ys[k], flags.any(0))
        np.testing.assert_allclose(values[k], want, rtol=1e-6)
        np.testing.assert_allclose(gx[k], wx, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(gy[k], wy, rtol=1e-6, atol=1e-7)
    values, (gx, _) = jax.jit(step)(xs, ys, jnp.zeros_like(flags))
    np.testing.assert_array_equal(values, 0.0)
    np.testing.assert_array_equal(gx, 0.0)
    outside, conds = _primitives(jax.make_jaxpr(step)(xs, ys, flags).jaxpr)
    assert conds >= 2  # the forward's and the backward's
    assert "tanh" not in outside and "select_n" not in outside  # the term only in them


def _primitives(jaxpr) -> tuple[set, int]:
    """The primitives a program runs outside its conds' branches, and how many conds."""
    names, conds = set(), 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            conds += 1
            continue
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            inner, count = _primitives(sub)
            names |= inner
            conds += count
    return names, conds
