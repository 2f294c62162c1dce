"""The matrix product of every ``nnx.Linear`` of ncljax, with its weight gradient written
in the weight's own layout.

``nnx.Linear`` computes ``y = x W`` (``x [..., in]``, ``W [in, out]``) with
``lax.dot_general``. Under ``vmap`` over networks (the train step maps every network's
update, ``ncljax.train.step``), JAX's transpose rule of the batched product returns
``dW`` as the product ``[net, out, in]`` followed by a transpose; XLA's CPU backend fuses
that transpose into the optimiser's elementwise update, which then reads the gradient
down its columns. With 1,024 rows of 4 KiB that read is strided by a power of two and
runs at a tenth of the memory's pace: in UOT-RCL's ``:vectors`` step at batch 1,024 (MLPs
256 -> 1024 -> 1024 -> 256) the six updates of the two ``1,024 x 1,024`` weights and
their Adam moments took 9-11 ms each, 59 ms of a 242 ms step (``benchmarks/RESULTS.md``).

:func:`dot_general` is a drop-in ``dot_general`` for ``nnx.Linear`` whose backward pass
computes ``dx = g W^T`` and ``dW = x^T g`` itself (a ``jax.custom_vjp``): the batched
weight gradient is then a product ``[net, in, out]`` in the weight's layout. The
forward pass and both products are the ones autodiff writes; only the summation order of
the batched weight gradient can differ (round-off). Every other product (another
contraction, a ``precision``, a ``preferred_element_type``, an output sharding, mixed
dtypes) goes to ``lax.dot_general`` unchanged. Being a ``custom_vjp``, the product has no
forward-mode derivative (``jax.jvp``, ``jax.jacfwd``); a layer built with the default
``lax.dot_general`` has one.
"""

from __future__ import annotations

import jax
from jax import lax


def _is_linear(lhs, rhs, dimension_numbers) -> bool:
    """``nnx.Linear``'s contraction: the input's last axis against a matrix's first."""
    return (
        getattr(rhs, "ndim", None) == 2
        and getattr(lhs, "ndim", 0) >= 1
        and dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ()))
    )


@jax.custom_vjp
def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _forward(x, w):
    return _product(x, w), (x, w)


def _backward(residuals, g):
    x, w = residuals
    dx = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))
    rows = tuple(range(x.ndim - 1))  # every axis of x but its features
    dw = lax.dot_general(x, g, ((rows, rows), ((), ())))  # [in, out]: the kernel's layout
    return dx, dw


_product.defvjp(_forward, _backward)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """``lax.dot_general`` with the weight gradient of ``nnx.Linear``'s product in the
    weight's layout (module docstring); pass it as ``nnx.Linear(..., dot_general=...)``."""
    if (
        _is_linear(lhs, rhs, dimension_numbers)
        and precision is None
        and preferred_element_type is None
        and out_sharding is None
        and lhs.dtype == rhs.dtype
    ):
        return _product(lhs, rhs)
    return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
