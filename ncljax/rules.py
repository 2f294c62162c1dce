"""The one vocabulary of value checks: a :class:`Rule` says what a value must be.

Method hyperparameters (``ncljax.methods.settings``) and config fields
(``ncljax.train.fields``) are checked with these rules, and refused in one line that
completes "``<name>`` must be <phrase>". Numbers must be finite (NaN and infinities are
refused), integers must be integers (not a ``bool``, not a float such as ``2.0``), and
flags must be ``True`` or ``False``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple


class Rule(NamedTuple):
    """What an argument accepts: ``accepts(value) -> bool`` and the phrase that says it
    (completing "``<method> <name>`` must be ...")."""

    accepts: Callable[[Any], bool]
    phrase: str


def is_number(value) -> bool:
    """A finite real number (an ``int`` or a float; not a ``bool``)."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def is_int(value) -> bool:
    """An integer (not a ``bool``, not a float with an integral value)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def interval(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
    """A finite number between ``low`` and ``high`` (each end included unless open)."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def accepts(value) -> bool:
        if not is_number(value):
            return False
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return above and below

    return Rule(accepts, f"in {left}{low!r}, {high!r}{right}")


def greater_than(bound: float) -> Rule:
    """A finite number ``> bound``."""
    return Rule(lambda v: is_number(v) and v > bound, f"a number > {bound!r}")


def at_least(bound: float) -> Rule:
    """A finite number ``>= bound``."""
    return Rule(lambda v: is_number(v) and v >= bound, f"a number >= {bound!r}")


def int_at_least(bound: int, phrase: str | None = None) -> Rule:
    """An integer ``>= bound`` (said ``phrase``, by default "an integer >= bound")."""
    return Rule(lambda v: is_int(v) and v >= bound, phrase or f"an integer >= {bound}")


def one_of(*choices) -> Rule:
    """One of ``choices``, of the same kind: a ``bool`` never stands in for 1 or 0, nor a
    float for an integer choice (an integer may stand in for a float choice)."""

    def accepts(value) -> bool:
        return any(_same_kind(value, c) and value == c for c in choices)

    return Rule(accepts, f"one of {tuple(choices)}")


def _kind(value) -> type:
    if isinstance(value, bool):
        return bool
    if isinstance(value, numbers.Integral):
        return int
    if isinstance(value, numbers.Real):
        return float
    return type(value)


def _same_kind(value, choice) -> bool:
    kind, wanted = _kind(value), _kind(choice)
    return kind is wanted or (wanted is float and kind is int)


def optional(rule: Rule, meaning: str) -> Rule:
    """``None`` (which means ``meaning``) or what ``rule`` accepts."""
    return Rule(lambda v: v is None or rule.accepts(v), f"None ({meaning}) or {rule.phrase}")


def noted(rule: Rule, note: str) -> Rule:
    """``rule`` with ``note`` after its phrase (e.g. which choice replaced an old one)."""
    return Rule(rule.accepts, f"{rule.phrase} ({note})")


FINITE = Rule(is_number, "a finite number")
POSITIVE = greater_than(0)
NON_NEGATIVE = at_least(0)
UNIT_INTERVAL = interval(0, 1)
BOOLEAN = Rule(lambda v: isinstance(v, bool), "True or False")
NON_NEGATIVE_INT = int_at_least(0)
POSITIVE_INT = int_at_least(1)
