"""What each config field must be, and when a run reads it: the one table of field checks.

``FIELDS`` has one row per field that has something to check, in sections per concern
(train, eval, optim, model, data, noise). A row gives:

- ``check``: the type and range of an accepted value (a ``Check``); None for a field any
  value of which is accepted here (the booleans, ``model.smooth``);
- ``read``: the condition under which a run reads the field (a ``Read``); None for a
  field every run reads. Several fields are read only under a choice made elsewhere in
  the config: the MLP widths only by the cosine head, the SGRAF sizes only by the SGRAF
  heads, the decay fields only by the step schedule, the evaluation chunks only by
  Recall@K, and so on. A non-default value of a field its run does not read would change
  nothing, silently, so the config is refused (or, when a command-line choice left a
  config file's value unread, warned about): honest flags;
- ``rule``: a check relating the field to others (the warm-up to the run's length,
  ``noise.file`` to ``noise.kind``).

``value_problems`` applies the checks and rules, ``ignored_fields`` the read conditions
(``CONDITIONAL_FIELDS`` groups the conditional fields by condition);
``ncljax.train.validation.check`` runs both before anything is read. ``reset_unread``
puts the fields a config does not read back to their defaults, for code that adapts a
config (``presets.apply_world``). The defaults themselves are ``config.base_config()``'s. The
data section's fields other than the pipeline's are the dataset's, checked when it is
loaded, and ``method_kwargs`` are checked by the method's factory.

A new field: its default goes in ``config.base_config()``, its row (if it has a range or
is read only sometimes) here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import ml_collections

from ncljax import methods, rules
from ncljax.train import config as config_lib
from ncljax.train import evaluator, optim

NOISE_KINDS = ("none", "per_caption", "per_image", "file", "symmetric", "asymmetric")
EVAL_KINDS = tuple(evaluator.EVAL_KINDS)
OPTIMIZERS = tuple(optim.OPTIMIZERS)
SCHEDULES = tuple(optim.SCHEDULES)
HEADS = ("cosine", "sgr", "saf")
REMAT_CHOICES = ("auto", "full", "projections", "none")

Rule = Callable[[ml_collections.ConfigDict], list[str]]


# An accepted value (ncljax.rules, the vocabulary the methods' settings use too): its
# phrase completes "``field=value`` must be".
Check = rules.Rule


@dataclasses.dataclass(frozen=True, eq=False)
class Read:
    """When a run reads a field.

    Attributes:
      deciders: the fields ``reads`` depends on; the message gives their values, and a
        field that the config file set is only warned about when the command line
        overrode one of them.
      reads: ``config -> bool``, true when the run reads the field.
      when: the condition, as the message says it.
    """

    deciders: tuple[str, ...]
    reads: Callable[[ml_collections.ConfigDict], Any]
    when: str


@dataclasses.dataclass(frozen=True)
class Field:
    """One row of ``FIELDS``: a field (``'section.name'``), its check and when it is read.

    Attributes:
      name: the field, e.g. ``'model.sim_dim'``.
      check: its accepted values; None accepts any.
      read: when a run reads it; None: always.
      rule: ``config -> problems`` relating the field to others (it may log a warning
        instead of refusing).
    """

    name: str
    check: Check | None = None
    read: Read | None = None
    rule: Rule | None = None


class Conditional(NamedTuple):
    """The fields of ``FIELDS`` read only under ``read``."""

    read: Read
    fields: tuple[str, ...]


def _get(config, field: str):
    for part in field.split("."):
        config = config[part]
    return config


_is_int = rules.is_int


def _integer(low: int, what: str) -> Check:
    return rules.int_at_least(low, what)


def _number(ok: Callable[[float], bool], what: str) -> Check:
    return Check(lambda x: rules.is_number(x) and ok(x), what)


def _choice(choices: Sequence[str], what: str = "") -> Check:
    return Check(lambda x: x in choices, what or f"one of {tuple(choices)}")


def _widths(what: str) -> Check:
    return Check(
        lambda x: isinstance(x, (tuple, list)) and all(_is_int(w) and w >= 1 for w in x), what
    )


POSITIVE_INT = rules.int_at_least(1, "a positive integer")
NON_NEGATIVE_INT = rules.NON_NEGATIVE_INT
NON_NEGATIVE = rules.NON_NEGATIVE
FRACTION = rules.interval(0, 1, high_open=True)
# numpy's generators take no negative seed, and JAX's keys none beyond int64.
SEED = Check(lambda x: _is_int(x) and 0 <= x < 2**63, "an integer in [0, 2**63)")


def _is(field: str, *values) -> Read:
    """Read when ``field`` holds one of ``values`` (said ``field='a' or 'b'``)."""
    when = f"{field}={values[0]!r}" + "".join(f" or {v!r}" for v in values[1:])
    return Read((field,), lambda c: _get(c, field) in values, when)


def _both(first: Read, second: Read, note: str = "") -> Read:
    """Read when both conditions hold."""
    return Read(
        first.deciders + second.deciders,
        lambda c: first.reads(c) and second.reads(c),
        f"{first.when} with {second.when}{note}",
    )


def _multi_view(c) -> bool:
    return c.method in methods.REGISTRY and "views" in methods.model_fields(c.method)


# The read conditions, in the order their unread fields are reported.
COSINE = _is("model.head", "cosine")
COSINE_GLOBAL_TEXT = _both(COSINE, _is("model.text_input", "global"))
TOKENS = _is("model.text_input", "tokens")
COSINE_TOKENS = _both(COSINE, TOKENS, " (SGRAF's GRU is always bidirectional)")
CLASSIFIER = _both(
    COSINE, Read(("model.classifier",), lambda c: c.model.classifier, "model.classifier=True")
)
SGRAF = _is("model.head", "sgr", "saf")
SGR = _is("model.head", "sgr")
MULTI_VIEW = Read(("method",), _multi_view, "a method with image views (model_fields 'views')")
ADAMW = _is("optim.name", "adamw")
STEP_SCHEDULE = _is("optim.schedule", "step")
RECALL = _is("eval.kind", "recall")
NOISE_FILE = _is("noise.kind", "file")
PAIR_NOISE = _is("noise.kind", "per_caption", "per_image")
LABEL_NOISE = _is("noise.kind", "symmetric", "asymmetric")
SYMMETRIC_NOISE = _is("noise.kind", "symmetric")
DRAWN_NOISE = Read(
    ("noise.kind",),
    lambda c: c.noise.kind not in ("none", "file"),
    "noise made from a rate (not noise.kind='none' or 'file')",
)
CONDITIONS = (
    COSINE,
    COSINE_GLOBAL_TEXT,
    TOKENS,
    COSINE_TOKENS,
    CLASSIFIER,
    SGRAF,
    SGR,
    MULTI_VIEW,
    ADAMW,
    STEP_SCHEDULE,
    RECALL,
    NOISE_FILE,
    PAIR_NOISE,
    LABEL_NOISE,
    SYMMETRIC_NOISE,
    DRAWN_NOISE,
)


def _plan_within_run(config) -> list[str]:
    """The method checks its own plan against the run's length (``Method.plan_problems_fn``:
    e.g. a warm-up as long as the run never reaches the method's objective)."""
    if config.method not in methods.REGISTRY or not _is_int(config.train.epochs):
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
    """``noise.file`` is read only with ``noise.kind='file'``: refused otherwise, also when
    the kind came from the command line (a file is never set by accident)."""
    noise = config.noise
    if noise.kind != "file" and noise.file:
        return [
            f"noise.file={noise.file!r} is only read with noise.kind='file', not "
            f"{noise.kind!r}; set noise.kind='file' or noise.file=''"
        ]
    return []


FIELDS = (
    Field("seed", SEED),
    # train
    Field("train.epochs", POSITIVE_INT, rule=_plan_within_run),
    Field("train.batch_size", _integer(2, "an integer >= 2")),
    Field("train.num_devices", NON_NEGATIVE_INT),
    Field("train.log_every_steps", POSITIVE_INT),
    Field(
        "train.checkpoint_every_steps",
        _integer(0, "an integer >= 0 (0: at the end of every epoch)"),
    ),
    # eval
    Field("eval.kind", _choice(EVAL_KINDS)),
    Field("eval.batch_size", POSITIVE_INT),
    Field("eval.image_chunk", POSITIVE_INT, RECALL),
    Field("eval.text_chunk", POSITIVE_INT, RECALL),
    Field("eval.coco_5fold", read=RECALL),
    # optim
    Field("optim.name", _choice(OPTIMIZERS)),
    Field("optim.schedule", _choice(SCHEDULES)),
    Field(
        "optim.learning_rate",
        _number(lambda x: x > 0, "a positive number (a negative one would ascend the loss)"),
    ),
    Field("optim.b1", FRACTION),
    Field("optim.b2", FRACTION),
    Field("optim.eps", NON_NEGATIVE),
    Field("optim.weight_decay", NON_NEGATIVE, ADAMW),
    Field("optim.grad_clip", _number(lambda x: x >= 0, "a number >= 0 (0 disables clipping)")),
    Field("optim.decay_factor", _number(lambda x: 0 < x <= 1, "in (0, 1]"), STEP_SCHEDULE),
    Field("optim.decay_every", POSITIVE_INT, STEP_SCHEDULE),
    # model
    Field("model.head", _choice(HEADS)),
    Field("model.image_input", _choice(("regions", "global"), "'regions' or 'global'")),
    Field("model.text_input", _choice(("tokens", "global"), "'tokens' or 'global'")),
    Field("model.embed_dim", POSITIVE_INT),
    Field("model.word_dim", POSITIVE_INT, TOKENS),
    Field("model.sim_dim", POSITIVE_INT, SGRAF),
    Field("model.smooth", read=SGRAF),
    Field("model.sim_output", read=SGRAF),
    Field("model.sgr_steps", POSITIVE_INT, SGR),
    Field("model.pair_chunk", POSITIVE_INT, SGRAF),
    Field("model.views", _integer(1, "an integer >= 1"), MULTI_VIEW),
    Field(
        "model.remat",
        _choice(REMAT_CHOICES, f"one of {REMAT_CHOICES} (what the SGRAF backward pass recomputes)"),
        SGRAF,
    ),
    Field("model.length_groups", _integer(1, "an integer >= 1"), SGRAF),
    Field(
        "model.compute_dtype",
        _choice(
            ("float32", "bfloat16"),
            "'float32' or 'bfloat16' (bfloat16 matrix products for accelerators)",
        ),
        SGRAF,
    ),
    Field(
        "model.image_hidden",
        _widths("a tuple of positive integers, e.g. '(1024,)' or '()'"),
        COSINE,
    ),
    Field(
        "model.text_hidden",
        _widths("a tuple of positive integers, e.g. '(1024,)' or '()'"),
        COSINE_GLOBAL_TEXT,
    ),
    Field("model.text_dropout", FRACTION, TOKENS),
    Field("model.bidirectional", read=COSINE_TOKENS),
    Field("model.temperature", _number(lambda x: x > 0, "a positive number"), CLASSIFIER),
    # data: the pipeline's fields (the dataset checks its own)
    Field(
        "data.length_buckets",
        _widths("a tuple of positive token counts, e.g. '(16, 32, 64)' or '()'"),
        TOKENS,
    ),
    Field("data.num_threads", NON_NEGATIVE_INT),
    Field("data.prefetch", NON_NEGATIVE_INT),
    Field(
        "data.device_prefetch",
        _integer(1, "an integer >= 1 (1: each batch is put on the devices when its step starts)"),
    ),
    # noise
    Field("noise.kind", _choice(NOISE_KINDS)),
    Field("noise.rate", _number(lambda x: 0 <= x <= 1, "in [0, 1]"), rule=_rate_without_noise),
    Field("noise.file", rule=_file_only_with_file_kind),
    Field("noise.file_kind", read=NOISE_FILE),
    Field("noise.exact", read=PAIR_NOISE),
    Field("noise.shared_label", read=LABEL_NOISE),
    Field("noise.exclude_true", read=SYMMETRIC_NOISE),
    Field("noise.seed", SEED, DRAWN_NOISE),
)


def _conditional(fields: Sequence[Field]) -> tuple[Conditional, ...]:
    """The conditional fields grouped by condition: ``CONDITIONS``' order, then any other
    condition in the order of ``fields``."""
    reads = list(CONDITIONS)
    reads += [f.read for f in fields if f.read is not None and f.read not in reads]
    groups = (Conditional(r, tuple(f.name for f in fields if f.read is r)) for r in reads)
    return tuple(group for group in groups if group.fields)


CONDITIONAL_FIELDS = _conditional(FIELDS)


def value_problems(config) -> list[str]:
    """The problems of ``config``'s values, in the order of ``FIELDS``: one message per
    field outside its range (``field=value must be ...``) and per broken rule."""
    problems = []
    for field in FIELDS:
        value = _get(config, field.name)
        if field.check is not None and not field.check.accepts(value):
            problems.append(f"{field.name}={value!r} must be {field.check.phrase}")
        if field.rule is not None:
            problems += field.rule(config)
    return problems


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return tuple(a) == tuple(b)
    return a == b


def _unread(config, defaults):
    """``(condition, field, value, default)`` of each non-default field ``config`` does not
    read, in the order of ``CONDITIONAL_FIELDS``."""
    for read, names in CONDITIONAL_FIELDS:
        if read.reads(config):
            continue
        for name in names:
            value, default = _get(config, name), _get(defaults, name)
            if not _same(value, default):
                yield read, name, value, default


def ignored_fields(
    config, overridden: Collection[str] | None = None
) -> tuple[list[str], list[str]]:
    """The non-default fields that ``config`` does not read.

    Args:
      config: the run's config.
      overridden: the fields set on the command line, when known (``train.py``). A field
        the config file set is only *warned* about when what makes it unread was
        overridden (e.g. ``--config.optim.schedule=cosine`` on a file with a step decay);
        without ``overridden`` every ignored field is refused.

    Returns:
      ``(refused, warned)``: lists of messages, one per field.
    """
    refused, warned = [], []
    for read, name, value, default in _unread(config, config_lib.base_config()):
        deciders = ", ".join(f"{d}={_get(config, d)!r}" for d in read.deciders)
        message = (
            f"{name}={value!r} is read only with {read.when}, not with {deciders}; "
            f"remove it or set it to its default {default!r}"
        )
        overrode_decider = overridden is not None and any(d in overridden for d in read.deciders)
        if overrode_decider and name not in overridden:
            warned.append(message)
        else:
            refused.append(message)
    return refused, warned


def reset_unread(config) -> list[str]:
    """Sets every field ``config`` does not read back to its default, e.g. after switching
    ``model.head`` or the inputs in code; returns the names of the fields reset."""
    reset = []
    for _, name, _, default in _unread(config, config_lib.base_config()):
        section, field = name.split(".")
        config[section][field] = default
        reset.append(name)
    return reset
