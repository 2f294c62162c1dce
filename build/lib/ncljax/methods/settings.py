"""Declarative range checks of a method's hyperparameters (``config.method_kwargs``).

Every factory of ``ncljax.methods.REGISTRY`` checks every argument it takes before it
builds anything, with one table that maps each argument to a :class:`Rule`::

    settings.check("vse", locals(), {
        "margin": settings.NON_NEGATIVE,
        "negatives": settings.one_of("hardest", "sum"),
        "num_networks": settings.NUM_NETWORKS,
    })

A bad value is refused with one line that names the argument, its value, what it must
be and the flag that sets it::

    vse margin must be a number >= 0, got -1.0 (--config.method_kwargs.margin=...).

Numbers must be finite (NaN and infinities are refused), integers must be integers (not
a ``bool``, not a float such as ``2.0``), and flags must be ``True`` or ``False``.
Constraints between arguments (SREM's ``m_clean <= m_noisy``) use :func:`require`,
which words its message the same way.

A method module declares its arguments once, as a frozen ``Settings`` NamedTuple (names,
defaults, documentation), with the table ``CHECKS`` of their rules; :func:`factory`
turns them and the module's ``bind(settings) -> Method`` into the registry's factory,
whose signature (keyword arguments with the defaults of ``Settings``) is what
``ncljax.methods.hyperparameters`` and the config files read::

    ncr = settings.factory("ncr", Settings, CHECKS, bind)
    ncr(margin=0.3).settings.margin  # 0.3
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ncljax import rules

# The vocabulary (ncljax.rules), under the names method modules use.
Rule = rules.Rule
is_number, is_int = rules.is_number, rules.is_int
interval, greater_than, at_least = rules.interval, rules.greater_than, rules.at_least
int_at_least, one_of, optional, noted = (
    rules.int_at_least,
    rules.one_of,
    rules.optional,
    rules.noted,
)
FINITE, POSITIVE, NON_NEGATIVE = rules.FINITE, rules.POSITIVE, rules.NON_NEGATIVE
UNIT_INTERVAL, BOOLEAN = rules.UNIT_INTERVAL, rules.BOOLEAN
NON_NEGATIVE_INT, POSITIVE_INT = rules.NON_NEGATIVE_INT, rules.POSITIVE_INT
NUM_NETWORKS = one_of(1, 2)
LOSS_REDUCTIONS = one_of("sum", "mean")
# The degeneracy checks of a GMM division (ncljax.labels.gmm.check_division).
DIVISION_MIN_WEIGHT = interval(0, 0.5, high_open=True)


def _problem(method: str, name: str, requirement: str, value) -> str:
    return (
        f"{method} {name} must be {requirement}, got {value!r} (--config.method_kwargs.{name}=...)"
    )


def check(method: str, kwargs: Mapping[str, Any], spec: Mapping[str, Rule]) -> None:
    """Refuses the hyperparameters ``kwargs`` of ``method`` that ``spec`` does not accept.

    Args:
      method: the method's registry name (the first word of each message).
      kwargs: every hyperparameter of the factory, e.g. its ``locals()`` on entry.
      spec: a rule for each of them, and for nothing else.

    Raises:
      ValueError: one line with a clause per bad argument, each naming the argument, its
        value, what it must be and the ``--config.method_kwargs`` flag that sets it.
      TypeError: where ``spec`` and ``kwargs`` do not name the same arguments (a factory
        that forgot to declare a rule).
    """
    if set(spec) != set(kwargs):
        raise TypeError(
            f"{method}: the settings spec does not match the factory's arguments "
            f"(no rule for {sorted(set(kwargs) - set(spec))}, "
            f"rules for unknown {sorted(set(spec) - set(kwargs))})."
        )
    problems = [
        _problem(method, name, rule.phrase, kwargs[name])
        for name, rule in spec.items()
        if not rule.accepts(kwargs[name])
    ]
    if problems:
        raise ValueError("; ".join(problems) + ".")


def require(ok: bool, method: str, name: str, requirement: str, value) -> None:
    """Refuses ``method``'s argument ``name`` (= ``value``) unless ``ok``, in the words of
    :func:`check` (for constraints between arguments)."""
    if not ok:
        raise ValueError(_problem(method, name, requirement, value) + ".")


# A ``bind`` parameter of this name is not a hyperparameter: the trainer passes the run's
# ``model`` config section to the factories whose ``bind`` declares it.
MODEL_CONFIG = "model_config"
# The problems a method solves: noisy correspondence (Recall@K) or noisy labels (mAP).
FAMILIES = ("pairs", "labels")


def factory(
    name: str,
    settings_type: type,
    rules: Mapping[str, Rule],
    bind: Callable[..., Any],
    *,
    validate: Callable[[Mapping[str, Any]], None] | None = None,
    family: str = "pairs",
    model_fields: tuple[str, ...] = (),
    plan_problems: Callable[[Any, str, int], list[str]] | None = None,
) -> Callable[..., Any]:
    """The registry factory of a method: keyword arguments -> checked ``Settings`` -> bundle.

    Args:
      name: the method's registry name (the first word of every message).
      settings_type: the method's ``Settings``, a NamedTuple or a frozen dataclass (which
        may extend a shared one, e.g. ``ncljax.methods.coteaching.Settings``); every field
        has a default.
      rules: a :class:`Rule` for every field (:func:`check`).
      bind: ``bind(settings) -> Method``, or ``bind(settings, model_config) -> Method``
        for a method that reads the run's ``model`` config section.
      validate: ``validate(values)``, constraints between arguments (:func:`require`),
        run after every argument passed its own rule.
      family: ``'pairs'`` (noisy correspondence, Recall@K) or ``'labels'`` (noisy
        labels, mAP): the problem the method solves, which the report and the tools read
        (``ncljax.methods.family``).
      model_fields: the ``model`` config fields only this method reads (UGNCL's
        ``views``); validation refuses them for other methods.
      plan_problems: ``(settings, name, epochs) -> problems``, what is wrong with the
        method's plan over a run of ``epochs`` epochs (a warm-up as long as the run:
        ``base.warmup_problems``), checked with the config before anything is read.

    Returns:
      ``make(**kwargs) -> Method`` whose signature lists the settings (keyword-only, with
      their defaults) and ``model_config`` where ``bind`` takes it; ``make.family`` and
      ``make.model_fields`` are the arguments of the same names.
    """
    if family not in FAMILIES:
        raise ValueError(f"{name}: family must be one of {FAMILIES}, got {family!r}")
    defaults = _defaults(name, settings_type)
    takes_model = MODEL_CONFIG in inspect.signature(bind).parameters

    def make(**kwargs):
        model_config = kwargs.pop(MODEL_CONFIG, None)
        unknown = sorted(set(kwargs) - set(defaults))
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword arguments {unknown}.")
        values = {field: kwargs.get(field, default) for field, default in defaults.items()}
        check(name, values, rules)
        if validate is not None:
            validate(values)
        s = settings_type(**values)
        method = bind(s, model_config=model_config) if takes_model else bind(s)
        return method._replace(name=name)  # the name is written once: here

    hints = typing.get_type_hints(settings_type)  # a config reads a None field's type here
    params = [
        inspect.Parameter(
            field,
            inspect.Parameter.KEYWORD_ONLY,
            default=default,
            annotation=hints.get(field, inspect.Parameter.empty),
        )
        for field, default in defaults.items()
    ]
    if takes_model:
        params.append(inspect.Parameter(MODEL_CONFIG, inspect.Parameter.KEYWORD_ONLY, default=None))
    make.__signature__ = inspect.Signature(params)
    make.__name__ = make.__qualname__ = name
    make.__doc__ = (
        f"{name} as a method bundle: the keyword arguments are the fields of its "
        f"``{settings_type.__qualname__}`` (checked, then bound).\n\n{settings_type.__doc__ or ''}"
    )
    make.Settings = settings_type
    make.family, make.model_fields = family, tuple(model_fields)

    def problems(kwargs: Mapping[str, Any], epochs: int) -> list[str]:
        """The plan's problems for ``kwargs``; none for arguments the factory refuses (it
        says so when the run builds the method)."""
        values = {field: kwargs.get(field, default) for field, default in defaults.items()}
        try:
            check(name, values, rules)
            if validate is not None:
                validate(values)
        except (ValueError, TypeError):
            return []
        return plan_problems(settings_type(**values), name, epochs)

    make.plan_problems = problems if plan_problems is not None else None
    return make


def _defaults(name: str, settings_type: type) -> dict[str, Any]:
    """The fields of a ``Settings`` type (NamedTuple or dataclass) with their defaults."""
    if dataclasses.is_dataclass(settings_type):
        defaults = {f.name: f.default for f in dataclasses.fields(settings_type)}
    else:
        defaults = {
            f: settings_type._field_defaults.get(f, dataclasses.MISSING)
            for f in settings_type._fields
        }
    missing = [f for f, d in defaults.items() if d is dataclasses.MISSING]
    if missing:
        raise TypeError(
            f"{name}: the fields {missing} of {settings_type.__qualname__} need defaults."
        )
    return defaults
