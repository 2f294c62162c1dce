"""Optimiser and learning-rate schedules from the ``optim`` config section.

``optim.name`` picks the optimiser (``NAME``: ``adamw`` reads ``optim.adamw``) and
``optim.schedule`` the schedule (``SCHEDULE``: ``step`` reads ``optim.step``); each kind's
section, with its defaults and rules, is declared here (``ncljax.rules``).

The learning rate is a function of the *epoch*, not of the step: epochs may differ in
length (NCR's co-training epoch is one pass over a clean set whose size changes every
epoch) and a method's plan names the epoch the schedule reads (e.g. epochs since the end
of a warm-up). The optimiser is wrapped in ``optax.inject_hyperparams`` so its state holds
the learning rate, which the trainer sets before each epoch with ``set_learning_rate``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from ncljax import rules
from ncljax.rules import Setting

ADAMW = {"weight_decay": Setting(0.0, rules.NON_NEGATIVE, "decoupled weight decay")}
STEP = {
    "factor": Setting(
        0.1,
        rules.Rule(lambda v: rules.is_number(v) and 0 < v <= 1, "in (0, 1]"),
        "the learning rate's factor at each decay",
    ),
    "every": Setting(10, rules.int_at_least(1, "a positive integer"), "epochs between decays"),
}
NAME = rules.Choice(
    "optim.name",
    "adam",
    (rules.Kind("adam", doc="Adam"), rules.Kind("adamw", {"optim.adamw": ADAMW}, doc="AdamW")),
)
SCHEDULE = rules.Choice(
    "optim.schedule",
    "constant",
    (
        rules.Kind("constant", doc="a constant learning rate"),
        rules.Kind("step", {"optim.step": STEP}, doc="x factor every few epochs"),
        rules.Kind("cosine", doc="cosine annealing over the run"),
    ),
)
CHOICES = (NAME, SCHEDULE)

# Each schedule: ``(cfg, num_epochs) -> optax schedule over epochs``.
SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    "constant": lambda cfg, num_epochs: optax.constant_schedule(cfg.learning_rate),
    # NCR/GSC/PC2 step decay: lr * step.factor ** floor(epoch / step.every).
    "step": lambda cfg, num_epochs: optax.exponential_decay(
        cfg.learning_rate,
        transition_steps=cfg.step.every,
        decay_rate=cfg.step.factor,
        staircase=True,
    ),
    # PyTorch's CosineAnnealingLR stepped once per epoch, as MRL/UOT-RCL.
    "cosine": lambda cfg, num_epochs: optax.cosine_decay_schedule(
        cfg.learning_rate, decay_steps=num_epochs
    ),
}
# Each optimiser: ``(cfg, learning_rate) -> optax.GradientTransformation``.
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adam": lambda cfg, lr: optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
    "adamw": lambda cfg, lr: optax.adamw(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.adamw.weight_decay
    ),
}


def learning_rate_schedule(cfg, *, num_epochs: int) -> optax.Schedule:
    """The learning rate as a function of the epoch (an optax schedule over epochs).

    ``constant``: ``lr``. ``step``: ``lr * step.factor ** floor(epoch / step.every)``
    (``optax.exponential_decay`` with ``staircase``). ``cosine``:
    ``lr * (1 + cos(pi * epoch / num_epochs)) / 2`` (``optax.cosine_decay_schedule``).
    """
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {tuple(SCHEDULES)}, got {cfg.schedule!r}.")
    return SCHEDULES[cfg.schedule](cfg, num_epochs)


def make_optimizer(cfg) -> optax.GradientTransformation:
    """``cfg.name`` (``OPTIMIZERS``) with optional global-norm clipping (``grad_clip > 0``),
    whose learning rate lives in its state (``optax.inject_hyperparams``; set it with
    ``set_learning_rate``). It starts at ``cfg.learning_rate``."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optim.name must be one of {tuple(OPTIMIZERS)}, got {cfg.name!r}.")

    def build(learning_rate):
        opt = OPTIMIZERS[cfg.name](cfg, learning_rate)
        if cfg.grad_clip > 0:
            return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
        return opt

    return optax.inject_hyperparams(build)(learning_rate=cfg.learning_rate)


def set_learning_rate(opt_state, value: float):
    """``opt_state`` (of ``make_optimizer``, leaves ``[K, ...]``) with learning rate ``value``."""
    current = opt_state.hyperparams["learning_rate"]
    new = jnp.full(current.shape, value, current.dtype)
    if isinstance(current, jax.Array) and hasattr(current, "sharding"):
        new = jax.device_put(new, current.sharding)
    return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": new})


def learning_rate(opt_state) -> float:
    """The learning rate held in ``opt_state`` (network 0's)."""
    return float(jnp.ravel(opt_state.hyperparams["learning_rate"])[0])
