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
    Verdict,
)

# Name -> factory (``settings.factory``), in the order tables list them. Everything a tool
# or a test lists per method (the report's families, the audit's verdict, the model fields
# a method reads) comes from here: see ``family``, ``model_fields`` and ``Method.verdict``.
REGISTRY: dict[str, Callable[..., Method]] = {
    factory.__name__: factory  # settings.factory's name
    for factory in (
        baselines.vse,
        baselines.infonce,
        ncr.ncr,
        gsc.gsc,
        srem.srem,
        ugncl.ugncl,
        pc2.pc2,
        baselines.ce,
        uot_rcl.uot_rcl,
    )
}

# A factory parameter of this name is not a hyperparameter: the trainer passes the run's
# ``model`` config section to factories that declare it (a method that reads the head).
MODEL_CONFIG = settings.MODEL_CONFIG


def family(name: str) -> str:
    """The problem method ``name`` solves: ``'pairs'`` (noisy correspondence) or
    ``'labels'`` (noisy labels); a factory that declares none solves ``'pairs'``."""
    return getattr(REGISTRY[name], "family", "pairs")


def of_family(kind: str) -> tuple[str, ...]:
    """The registered methods of family ``kind``, in the registry's order."""
    return tuple(n for n in REGISTRY if family(n) == kind)


def model_fields(name: str) -> tuple[str, ...]:
    """The ``model`` config fields only method ``name`` reads (e.g. UGNCL's ``views``)."""
    return tuple(getattr(REGISTRY[name], "model_fields", ()))


def plan_problems(name: str, kwargs: Mapping | None, epochs: int) -> list[str]:
    """What is wrong with method ``name``'s plan over a run of ``epochs`` epochs
    (the ``plan_problems`` its factory declares); nothing where its hyperparameters are
    refused (the factory says so when the run builds it) or the method checks no plan."""
    check = getattr(REGISTRY[name], "plan_problems", None)
    return [] if check is None else check(dict(kwargs or {}), epochs)


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
    "REGISTRY",
    "Aux",
    "EpochPlan",
    "InitContext",
    "LossContext",
    "Memory",
    "Method",
    "RefreshContext",
    "Streams",
    "Verdict",
    "build_method",
    "family",
    "hyperparameters",
    "model_fields",
    "of_family",
    "plan_problems",
]
