"""What each config field must be, and when a run reads it.

Two tables, one rule:

- ``FIELDS``: one row per field every run has (train, eval, optim, model, data's
  pipeline, noise), each with its ``check`` (a ``ncljax.rules.Rule``; None accepts any
  value) and, where it relates to other fields, a ``rule`` (the warm-up against the run's
  length, a noise file against the noise kind);
- the kinds (``ncljax.config.kinds``): each field that picks a kind (``model.head``,
  ``optim.schedule``, ``eval.kind``, ``noise.kind``...) accepts its kinds' names, and each
  kind's sections carry their own rules (``ncljax.rules.Setting``).

The one read rule: a run reads the sections and fields of the kinds it chose, and no
others. A non-default value where the run does not read would change nothing, silently,
so the config is refused (or, when a command-line choice left a config file's value
unread, warned about): honest flags.

``value_problems`` applies the checks and rules, ``ignored_fields`` the read rule,
``unknown_fields`` refuses a field no run has (a typo, or an old name set in code, which
would otherwise change nothing, silently); ``ncljax.config.validation.check`` runs all
three before anything is read. ``reset_unread``
puts what a config does not read back to its defaults, for code that adapts a config
(``presets.apply_world``). The data section's fields other than the pipeline's are the
dataset's, checked when it is loaded, and ``method_kwargs`` are checked by the method's
factory.

A new field every run reads: its default goes in ``base.base_config()``, its row here. A
field of a kind: a ``Setting`` in the kind's section, where the kind is declared.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator

import ml_collections

from ncljax import methods, rules
from ncljax.config import base as config_lib
from ncljax.config import kinds, renames

Rule = Callable[[ml_collections.ConfigDict], list[str]]
Check = rules.Rule


@dataclasses.dataclass(frozen=True)
class Field:
    """One row of ``FIELDS``: a field (``'section.name'``), its check and its rule.

    Attributes:
      name: the field, e.g. ``'train.epochs'``.
      check: its accepted values; None accepts any.
      rule: ``config -> problems`` relating the field to others.
    """

    name: str
    check: Check | None = None
    rule: Rule | None = None


def get(config, field: str):
    """``config``'s value at the dotted path ``field``."""
    for part in field.split("."):
        config = config[part]
    return config


POSITIVE_INT = rules.int_at_least(1, "a positive integer")
NON_NEGATIVE_INT = rules.NON_NEGATIVE_INT
NON_NEGATIVE = rules.NON_NEGATIVE
FRACTION = rules.FRACTION
# numpy's generators take no negative seed, and JAX's keys none beyond int64.
SEED = Check(lambda x: rules.is_int(x) and 0 <= x < 2**63, "an integer in [0, 2**63)")


def _positive(what: str = "a positive number") -> Check:
    return Check(lambda x: rules.is_number(x) and x > 0, what)


def _plan_within_run(config) -> list[str]:
    """The method checks its own plan against the run's length (``Method.plan_problems_fn``:
    e.g. a warm-up as long as the run never reaches the method's objective)."""
    if config.method not in methods.REGISTRY or not rules.is_int(config.train.epochs):
        return []
    return methods.plan_problems(config.method, config.method_kwargs, config.train.epochs)


def _rate_without_noise(config) -> list[str]:
    """Warns only: ``noise.kind='none'`` is the usual way to switch the noise off."""
    if config.noise.kind == "none" and config.noise.rate:
        logging.warning(
            "noise.rate=%s has no effect with noise.kind='none': the run trains on the data's "
            "own pairs and labels.",
            config.noise.rate,
        )
    return []


def _file_only_with_file_kind(config) -> list[str]:
    """``noise.file.path`` is read only with ``noise.kind='file'``: refused otherwise, also
    when the kind came from the command line (a file is never set by accident)."""
    noise = config.noise
    if noise.kind != "file" and noise.file.path:
        return [
            f"noise.file.path={noise.file.path!r} is only read with noise.kind='file', not "
            f"{noise.kind!r}; set noise.kind='file' or noise.file.path=''"
        ]
    return []


def _division_switch(config) -> list[str]:
    """``train.division`` other than ``'on'`` needs a method whose division has a switch
    (a ``noise_share`` hyperparameter at ``'partner'``)."""
    division = config.train.division
    if division not in ("off", "race") or config.method not in methods.REGISTRY:
        return []
    params = methods.hyperparameters(config.method)
    if "noise_share" in params:
        share = dict(config.method_kwargs or {}).get("noise_share", params["noise_share"].default)
        if share == "partner":
            return []
        return [
            f"train.division={division!r} switches {config.method}'s division off, which its "
            f"noise_share={share!r} cannot: set method_kwargs.noise_share='partner' (as "
            f"configs/{config.method}.py:vectors does) or train.division='on'"
        ]
    dividing = [
        n for n in methods.of_family("pairs") if "noise_share" in methods.hyperparameters(n)
    ]
    return [
        f"train.division={division!r} switches a division off, and {config.method} has none "
        f"to switch: use it with {', '.join(dividing)}, or set train.division='on'"
    ]


def _race_alpha_with_race(config) -> list[str]:
    """``train.race_alpha`` is read by a race alone: refused at another value otherwise."""
    alpha, default = config.train.race_alpha, config_lib.base_config().train.race_alpha
    if config.train.division != "race" and alpha != default:
        return [
            f"train.race_alpha={alpha!r} is only read with train.division='race', not "
            f"{config.train.division!r}; set train.division='race' or leave race_alpha at "
            f"{default}"
        ]
    return []


FIELDS = (
    Field("seed", SEED),
    # train
    Field("train.epochs", POSITIVE_INT, rule=_plan_within_run),
    Field("train.batch_size", rules.int_at_least(2, "an integer >= 2")),
    Field("train.num_devices", NON_NEGATIVE_INT),
    Field("train.division", rules.one_of("on", "off", "race"), rule=_division_switch),
    Field(
        "train.race_alpha",
        rules.interval(0, 0.5, low_open=True),
        rule=_race_alpha_with_race,
    ),
    Field("train.log_every_steps", POSITIVE_INT),
    Field(
        "train.checkpoint_every_steps",
        rules.int_at_least(0, "an integer >= 0 (0: at the end of every epoch)"),
    ),
    # eval
    Field("eval.batch_size", POSITIVE_INT),
    # optim
    Field(
        "optim.learning_rate",
        _positive("a positive number (a negative one would ascend the loss)"),
    ),
    Field("optim.b1", FRACTION),
    Field("optim.b2", FRACTION),
    Field("optim.eps", NON_NEGATIVE),
    Field(
        "optim.grad_clip",
        Check(lambda x: rules.is_number(x) and x >= 0, "a number >= 0 (0 disables clipping)"),
    ),
    # model
    Field("model.embed_dim", POSITIVE_INT),
    Field("model.views", rules.int_at_least(1, "an integer >= 1")),
    # data: the pipeline's fields (the dataset checks its own)
    Field("data.length_buckets", rules.widths("'(16, 32, 64)' or '()'")),
    Field("data.num_threads", NON_NEGATIVE_INT),
    Field("data.prefetch", NON_NEGATIVE_INT),
    Field(
        "data.device_prefetch",
        rules.int_at_least(
            1, "an integer >= 1 (1: each batch is put on the devices when its step starts)"
        ),
    ),
    # noise
    Field(
        "noise.rate",
        Check(lambda x: rules.is_number(x) and 0 <= x <= 1, "in [0, 1]"),
        rule=_rate_without_noise,
    ),
    Field("noise.seed", SEED),
    Field("noise.kind", rule=_file_only_with_file_kind),  # checked as a choice too
)


def value_problems(config) -> list[str]:
    """The problems of ``config``'s values: one message per field outside its range
    (``field=value must be ...``) and per broken rule; ``FIELDS`` first, then each choice
    and its kinds' sections."""
    problems = []
    for field in FIELDS:
        value = get(config, field.name)
        if field.check is not None and not field.check.accepts(value):
            problems.append(f"{field.name}={value!r} must be {field.check.phrase}")
        if field.rule is not None:
            problems += field.rule(config)
    for choice in kinds.CHOICES:
        value = get(config, choice.field)
        if choice.kind(value) is None:
            problems.append(f"{choice.field}={value!r} must be one of {choice.names}")
        for path, section in choice.sections().items():
            for name, setting in section.items():
                value = get(config, f"{path}.{name}")
                if setting.rule is not None and not setting.rule.accepts(value):
                    problems.append(f"{path}.{name}={value!r} must be {setting.rule.phrase}")
    return problems


# Sections whose fields are not the base config's: the dataset's (checked when it is
# loaded) and the method's (checked by its factory).
OPEN_SECTIONS = ("data", "method_kwargs")


def unknown_fields(config) -> list[str]:
    """One message per field of ``config`` that the base config does not have (outside
    ``OPEN_SECTIONS``), naming its new name where the field was renamed."""
    defaults = config_lib.base_config()
    problems = []

    def walk(section, known, path):
        for name in section:
            field = f"{path}{name}"
            if not path and name in OPEN_SECTIONS:
                continue
            value = section[name]
            if name not in known:
                new = renames.renamed(field)
                what = f"set {new} instead" if new else "remove it"
                problems.append(f"{field} is not a config field ({what})")
            elif isinstance(value, ml_collections.ConfigDict) and isinstance(
                known[name], ml_collections.ConfigDict
            ):
                walk(value, known[name], field + ".")

    walk(config, defaults, "")
    return problems


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return tuple(a) == tuple(b)
    return a == b


def _leaves(config, path: str) -> Iterator[str]:
    """The field names under ``path`` (itself when it is a field)."""
    value = get(config, path)
    if isinstance(value, ml_collections.ConfigDict):
        for name in value:
            yield from _leaves(config, f"{path}.{name}")
    else:
        yield path


@dataclasses.dataclass(frozen=True)
class Unread:
    """A non-default field the run does not read: which choice left it unread, the
    choice's value, the kinds that read it, the field, its value and its default."""

    choice: rules.Choice
    chosen: object
    owners: tuple
    name: str
    value: object
    default: object

    def message(self) -> str:
        when = f"{self.choice.field}={self.owners[0]!r}" + "".join(
            f" or {o!r}" for o in self.owners[1:]
        )
        return (
            f"{self.name}={self.value!r} is read only with {when}, not with "
            f"{self.choice.field}={self.chosen!r}; remove it or set it to its default "
            f"{self.default!r}"
        )


def unread(config) -> Iterator[Unread]:
    """Each non-default field that ``config`` does not read, choice by choice."""
    defaults = config_lib.base_config()
    for choice in kinds.all_choices():
        chosen = get(config, choice.field)
        for path in choice.unread(chosen):
            owners = tuple(k.name for k in choice.owners(path))
            for name in _leaves(defaults, path):
                value, default = get(config, name), get(defaults, name)
                if not _same(value, default):
                    yield Unread(choice, chosen, owners, name, value, default)


def ignored_fields(
    config, overridden: Collection[str] | None = None
) -> tuple[list[str], list[str]]:
    """The non-default fields that ``config`` does not read.

    Args:
      config: the run's config.
      overridden: the fields set on the command line, when known (``train.py``). A field
        the config file set is only *warned* about when the choice that leaves it unread
        was overridden (e.g. ``--config.optim.schedule=cosine`` on a file with a step
        decay); without ``overridden`` every ignored field is refused.

    Returns:
      ``(refused, warned)``: lists of messages, one per field.
    """
    refused, warned = [], []
    for found in unread(config):
        overrode_choice = overridden is not None and found.choice.field in overridden
        if overrode_choice and found.name not in overridden:
            warned.append(found.message())
        else:
            refused.append(found.message())
    return refused, warned


def reset_unread(config) -> list[str]:
    """Sets every field ``config`` does not read back to its default, e.g. after switching
    ``model.head`` or the inputs in code; returns the names of the fields reset."""
    reset = []
    for found in list(unread(config)):
        parent, field = found.name.rsplit(".", 1)
        get(config, parent)[field] = found.default
        reset.append(found.name)
    return reset
