"""Training methods as bundles of pure functions, and their registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

from ncljax.methods import baselines, gsc, ncr, srem, uot_rcl
from ncljax.methods.base import (
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
}


def build_method(name: str, kwargs: Mapping | None = None) -> Method:
    """Builds the method ``name`` with hyperparameters ``kwargs`` (``config.method_kwargs``).

    Raises:
      ValueError: for an unknown method or a hyperparameter the method does not take.
    """
    if name not in REGISTRY:
        raise ValueError(
            f"Unknown method {name!r} (config field method). Known: {sorted(REGISTRY)}."
        )
    factory = REGISTRY[name]
    kwargs = dict(kwargs or {})
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"Method {name!r} does not take {unknown} (config field method_kwargs). "
            f"Its hyperparameters are {sorted(accepted)}."
        )
    return factory(**kwargs)


__all__ = [
    "REGISTRY",
    "EpochPlan",
    "InitContext",
    "LossContext",
    "Memory",
    "Method",
    "RefreshContext",
    "Streams",
    "build_method",
]
