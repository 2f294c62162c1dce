"""Tests for ncljax.backend: per-backend compiler options."""

import jax
import jax.numpy as jnp
import numpy as np

from ncljax import backend


def test_no_options_off_cpu():
    assert backend.compiler_options("gpu") == {}
    assert backend.compiler_options("tpu") == {}


def test_cpu_options_compile_and_change_no_result():
    options = backend.compiler_options("cpu")
    # This jaxlib knows the option: every matrix product is its own kernel on CPU.
    assert options == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(48, 32)), jnp.float32)

    def f(x, w):
        return jnp.tanh(jnp.exp(-x) @ w).sum(0)

    fused = jax.jit(f)(x, w)
    separate = jax.jit(f, compiler_options=options)(x, w)
    np.testing.assert_allclose(separate, fused, rtol=1e-5, atol=1e-5)
    expected = np.tanh(np.exp(-np.asarray(x)) @ np.asarray(w)).sum(0)
    np.testing.assert_allclose(separate, expected, rtol=1e-4)


def test_jit_wrapper_reads_the_options_at_the_first_call():
    calls = []

    @backend.jit(static_argnames="n")
    def power(x, n):
        calls.append(n)  # traced once per n
        return x**n

    assert float(power(jnp.float32(3.0), n=2)) == 9.0
    assert float(power(jnp.float32(2.0), n=2)) == 4.0
    assert calls == [2]
