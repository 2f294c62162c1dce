"""Training methods as bundles of pure functions, and their registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

from ncljax.methods import baselines, gsc, ncr, pc2, settings, srem, ugncl, uot_rcl
from ncljax.methods.base import (
    Aux,
    EpochPlan,
    InitContext,
    LossContext,
    Memory,
    Method,
    RefreshContext,
    Streams,
)

REGISTRY: dict[str, Callable[..., Method]] = {
    "vse": baselines.vse,
    "infonce": baselines.infonce,
    "ce": baselines.ce,
    "uot_rcl": uot_rcl.uot_rcl,
    "gsc": gsc.gsc,
    "ncr": ncr.ncr,
    "srem": srem.srem,
    "ugncl": ugncl.ugncl,
    "pc2": pc2.pc2,
}

# A factory parameter of this name is not a hyperparameter: the trainer passes the run's
# ``model`` config section to factories that declare it (a method that reads the head).
MODEL_CONFIG = settings.MODEL_CONFIG

# Methods whose models have image views (config field model.views); no other reads it.
MULTI_VIEW = frozenset({"ugncl"})


def hyperparameters(name: str) -> dict[str, inspect.Parameter]:
    """The hyperparameters of method ``name``'s factory (its keyword parameters)."""
    params = inspect.signature(REGISTRY[name]).parameters
    return {k: p for k, p in params.items() if k != MODEL_CONFIG}


def build_method(name: str, kwargs: Mapping | None = None, model_config=None) -> Method:
    """Builds the method ``name`` with hyperparameters ``kwargs`` (``config.method_kwargs``).

    ``model_config`` (the run's ``model`` section) reaches the factories that take it.

    Raises:
      ValueError: for an unknown method, a hyperparameter the method does not take, or
        values out of their range (``ncljax.methods.settings``; one line naming each).
    """
    if name not in REGISTRY:
        raise ValueError(
            f"Unknown method {name!r} (config field method). Known: {sorted(REGISTRY)}."
        )
    factory = REGISTRY[name]
    kwargs = dict(kwargs or {})
    accepted = hyperparameters(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"Method {name!r} does not take {unknown} (config field method_kwargs). "
            f"Its hyperparameters are {sorted(accepted)}."
        )
    if MODEL_CONFIG in inspect.signature(factory).parameters:
        kwargs[MODEL_CONFIG] = model_config
    return factory(**kwargs)


__all__ = [
    "MULTI_VIEW",
    "REGISTRY",
    "Aux",
    "EpochPlan",
    "InitContext",
    "LossContext",
    "Memory",
    "Method",
    "RefreshContext",
    "Streams",
    "build_method",
    "hyperparameters",
]
