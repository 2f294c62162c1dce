"""ncljax.models.linear.dot_general: nnx.Linear's product with its own backward pass,
against float64 numpy (``y = x W``, ``dx = g W^T``, ``dW = x^T g`` summed over every
leading axis), under vmap over networks as the train step maps them, and the other
products passed to lax.dot_general unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ncljax.models import linear

IN, OUT = 5, 3


def _data(lead, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(*lead, IN)).astype(np.float32)
    w = rng.normal(size=(IN, OUT)).astype(np.float32)
    g = rng.normal(size=(*lead, OUT)).astype(np.float32)  # the loss's cotangent of y
    return x, w, g


def _np_grads(x, w, g):
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    dx = g64 @ w64.T
    dw = x64.reshape(-1, IN).T @ g64.reshape(-1, OUT)
    return dx, dw


def _product(x, w):
    return linear.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


@pytest.mark.parametrize("lead", [(7,), (2, 4), ()], ids=["rows", "batch-of-rows", "vector"])
def test_value_and_gradients_against_numpy(lead):
    x, w, g = _data(lead)
    y, pull = jax.vjp(_product, jnp.asarray(x), jnp.asarray(w))
    dx, dw = pull(jnp.asarray(g))
    np_dx, np_dw = _np_grads(x, w, g)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, np_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, np_dw, rtol=1e-5, atol=1e-5)
    assert dw.shape == w.shape and dx.shape == x.shape


@pytest.mark.parametrize("shared_input", [True, False], ids=["shared-x", "own-x"])
def test_vmapped_over_networks_against_numpy(shared_input):
    """Two networks' weights (and, past the first layer, their own inputs) under vmap."""
    nets = 2
    xs = [_data((6,), seed=s)[0] for s in range(nets)]
    ws = [_data((6,), seed=10 + s)[1] for s in range(nets)]
    gs = [_data((6,), seed=20 + s)[2] for s in range(nets)]
    if shared_input:
        xs = [xs[0]] * nets
    x = jnp.asarray(xs[0]) if shared_input else jnp.asarray(np.stack(xs))

    def loss(w, x, g):
        return jnp.sum(_product(x, w) * g)  # its gradient in y is g

    grads = jax.jit(
        jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None if shared_input else 0, 0))
    )(jnp.asarray(np.stack(ws)), x, jnp.asarray(np.stack(gs)))
    for k in range(nets):
        np_dx, np_dw = _np_grads(xs[k], ws[k], gs[k])
        np.testing.assert_allclose(grads[0][k], np_dw, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(grads[1][k], np_dx, rtol=1e-5, atol=1e-5)


def test_linear_layer_matches_lax_dot_general():
    """The layer the models build: value and parameter gradients as with lax.dot_general."""
    layer = nnx.Linear(IN, OUT, dot_general=linear.dot_general, rngs=nnx.Rngs(0))
    plain = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    x = jnp.asarray(_data((4,))[0])

    def loss(model):
        return jnp.sum(jnp.tanh(model(x)) ** 2)

    for a, b in zip(
        jax.tree.leaves(nnx.grad(loss)(layer)), jax.tree.leaves(nnx.grad(loss)(plain)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(layer(x), plain(x))


def test_other_products_go_to_lax():
    """Another contraction, a precision or mixed dtypes: lax.dot_general's own result."""
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(4, IN)).astype(np.float32))
    b = jnp.asarray(rng.normal(size=(OUT, IN)).astype(np.float32))
    numbers = (((1,), (1,)), ((), ()))  # a b^T: not the layer's contraction
    np.testing.assert_array_equal(
        linear.dot_general(a, b, numbers), jax.lax.dot_general(a, b, numbers)
    )
    w = b.T
    layer = (((1,), (0,)), ((), ()))
    high = linear.dot_general(a, w, layer, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(
        high, jax.lax.dot_general(a, w, layer, precision=jax.lax.Precision.HIGHEST)
    )
    mixed = linear.dot_general(a.astype(jnp.bfloat16), w, layer)
    assert mixed.dtype == jax.lax.dot_general(a.astype(jnp.bfloat16), w, layer).dtype
