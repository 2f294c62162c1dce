"""Per-backend XLA compiler options for the library's jitted steps and evaluation.

On CPU, XLA (jaxlib 0.10) fuses elementwise producers and reductions into its YNNPACK
matrix-product kernels; for the SGRAF heads these fused kernels run well below the
library's own standalone matrix products (``benchmarks/RESULTS.md``: the SGR train step
takes 17-19 s instead of 21 s at batch 128 when every matrix product is its own kernel).
``compiler_options()`` asks for that on CPU and nothing elsewhere; the options are
per compilation (``jax.jit(..., compiler_options=...)``), so the process's ``XLA_FLAGS``
and the user's own jitted code are left as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_CPU = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def compiler_options(backend: str | None = None) -> dict[str, str]:
    """XLA options for ``backend`` (default: JAX's default backend); ``{}`` where none
    apply or the installed XLA does not know them."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return {}
    try:
        jax.jit(lambda x: x @ x, compiler_options=_CPU).lower(jnp.ones((2, 2))).compile()
    except jax.errors.JaxRuntimeError:  # an XLA without the option: its own defaults
        return {}
    return dict(_CPU)


def jit(fn=None, **kwargs):
    """``jax.jit`` with ``compiler_options()`` (decorator or call, as ``jax.jit``); the
    options are read when the function is first called, not at import."""
    if fn is None:
        return functools.partial(jit, **kwargs)
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        nonlocal compiled
        if compiled is None:
            compiled = jax.jit(fn, compiler_options=compiler_options(), **kwargs)
        return compiled(*args, **kw)

    return wrapper
