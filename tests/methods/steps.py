"""A method's jitted train step over a few batches, on 1 or 8 devices (the 1-vs-8 tests)."""

import jax
import jax.numpy as jnp
import optax

from ncljax import models
from ncljax.data import pipeline
from ncljax.methods import base
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib


def train_steps(
    method, model_cfg, info, batches, *, num_devices, num_samples, phase=base.MAIN, networks=1
):
    """``networks`` networks of ``method`` on a model built from ``model_cfg`` (with the
    method's heads), SGD 0.5, one step per batch (a dict, or a tuple of a step's batches) in
    ``phase`` (an int or a ``StepSpec``; network 0 steps in an in-turn one); the true mask is
    every third pair noisy (the diagnostics run too).

    Returns:
      ``(state, metrics)`` of the last step, on the host.
    """
    mesh = mesh_lib.make_mesh(num_devices)
    tx = optax.sgd(0.5)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(model_cfg, info, rngs, heads_fn=method.heads_fn),
        tx=tx,
        memory=method.init_memory(base.InitContext(num_samples, info, None, None)),
        num_networks=networks,
        seed=0,
    )
    state = jax.device_put(state, mesh_lib.replicated(mesh))
    step = jax.jit(
        step_lib.make_train_step(graphdef, method, tx, num_samples=num_samples),
        static_argnums=2,
    )
    clean = jnp.arange(num_samples) % 3 > 0
    with jax.set_mesh(mesh):
        for batch in batches:
            sharded = jax.tree.map(
                lambda b: pipeline.to_device(b, mesh_lib.batch_sharding(mesh)),
                batch,
                is_leaf=lambda b: isinstance(b, dict),
            )
            state, metrics = step(state, sharded, phase, clean)
    return jax.device_get(state), jax.device_get(metrics)
