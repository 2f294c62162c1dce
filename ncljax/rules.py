"""The one vocabulary of value checks and configurable kinds.

A :class:`Rule` says what a value must be. Method hyperparameters
(``ncljax.methods.settings``) and config fields (``ncljax.config.fields``) are checked
with these rules, and refused in one line that completes "``<name>`` must be <phrase>".
Numbers must be finite (NaN and infinities are refused), integers must be integers (not a
``bool``, not a float such as ``2.0``), and flags must be ``True`` or ``False``.

A :class:`Choice` is a config field that picks one of several kinds (:class:`Kind`: the head,
the optimiser, the schedule, the evaluation, the noise); each kind owns the config
sections it reads (each field a :class:`Setting` with its default and rule), declared beside the
code that implements it. ``ncljax.config`` builds the base config from the choices and
reads a kind's sections only when the run chose it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
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


def widths(example: str = "'(1024,)' or '()'") -> Rule:
    """A tuple (or list) of positive integers: layer widths, lengths."""
    return Rule(
        lambda v: isinstance(v, (tuple, list)) and all(is_int(w) and w >= 1 for w in v),
        f"a tuple of positive integers, e.g. {example}",
    )


FINITE = Rule(is_number, "a finite number")
POSITIVE = greater_than(0)
NON_NEGATIVE = at_least(0)
UNIT_INTERVAL = interval(0, 1)
BOOLEAN = Rule(lambda v: isinstance(v, bool), "True or False")
NON_NEGATIVE_INT = int_at_least(0)
POSITIVE_INT = int_at_least(1)
FRACTION = interval(0, 1, high_open=True)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of a kind's section: its default, what it accepts (None: anything of the
    default's type) and what it means."""

    default: Any
    rule: Rule | None = None
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Kind:
    """One value of a :class:`Choice` and the config it reads.

    Attributes:
      name: the choice's value (``'sgr'``, ``'step'``, ``True``...).
      sections: ``{path: {field: Setting}}``: the sections this kind reads (e.g.
        ``'model.sgraf'``); kinds of one choice may share a section (the same mapping).
      reads: fields outside any section that this kind reads and some other kinds of its
        choice do not (e.g. ``noise.rate``); their defaults and rules are the base
        config's.
      doc: one line on the kind.
    """

    name: Any
    sections: Mapping[str, Mapping[str, Setting]] = dataclasses.field(default_factory=dict)
    reads: tuple[str, ...] = ()
    doc: str = ""

    def paths(self) -> frozenset[str]:
        """The sections and fields this kind reads beyond its choice's field."""
        return frozenset(self.sections) | frozenset(self.reads)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A config field that picks a :class:`Kind`: ``field`` (e.g. ``'model.head'``), its
    ``default`` and the ``kinds``, in the order the messages list them."""

    field: str
    default: Any
    kinds: tuple[Kind, ...]

    @property
    def names(self) -> tuple:
        return tuple(k.name for k in self.kinds)

    def kind(self, value) -> Kind | None:
        """The kind named ``value`` (None for an unknown one)."""
        for kind in self.kinds:
            if _same_kind(value, kind.name) and kind.name == value:
                return kind
        return None

    def owners(self, path: str) -> tuple[Kind, ...]:
        """The kinds that read ``path``."""
        return tuple(k for k in self.kinds if path in k.paths())

    def unread(self, value) -> tuple[str, ...]:
        """The paths of this choice's kinds that the kind ``value`` does not read (all of
        them, in declaration order, for an unknown value)."""
        kind = self.kind(value)
        chosen = kind.paths() if kind is not None else frozenset()
        seen = []
        for k in self.kinds:
            for path in (*k.sections, *k.reads):
                if path not in chosen and path not in seen:
                    seen.append(path)
        return tuple(seen)

    def sections(self) -> dict[str, Mapping[str, Setting]]:
        """Every section of the choice's kinds, once, in declaration order."""
        found = {}
        for kind in self.kinds:
            for path, section in kind.sections.items():
                if path in found and found[path] is not section:
                    raise ValueError(f"{self.field}: two kinds declare different {path} sections.")
                found[path] = section
        return found
