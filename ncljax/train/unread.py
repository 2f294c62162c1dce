"""Fields a run does not read: the rules behind ``config.check_fields``'s honest flags.

Several config fields are read only under a choice made elsewhere in the config: the MLP
widths only by the cosine head, the SGRAF sizes only by the SGRAF heads, the decay
fields only by the step schedule, the evaluation chunks only by Recall@K, and so on
(``CONDITIONAL_FIELDS``). A non-default value of a field its run does not read would
change nothing, silently; ``ignored_fields`` finds them so the config is refused (or,
when a command-line choice left a config file's value unread, warned about), and
``reset_unread`` puts them back to their defaults for code that adapts a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

import ml_collections


@dataclasses.dataclass(frozen=True)
class Conditional:
    """Fields read only when ``reads(config)`` holds, which depends on ``deciders``."""

    fields: tuple[str, ...]
    deciders: tuple[str, ...]
    reads: Callable[[ml_collections.ConfigDict], bool]
    when: str  # the condition, as the message says it


def _sgraf(c) -> bool:
    return c.model.head in ("sgr", "saf")


def _cosine(c) -> bool:
    return c.model.head == "cosine"


def _multi_view(c) -> bool:
    from ncljax.methods import MULTI_VIEW  # late: no import of the method registry at load

    return c.method in MULTI_VIEW


CONDITIONAL_FIELDS = (
    Conditional(("model.image_hidden",), ("model.head",), _cosine, "model.head='cosine'"),
    Conditional(
        ("model.text_hidden",),
        ("model.head", "model.text_input"),
        lambda c: _cosine(c) and c.model.text_input == "global",
        "model.head='cosine' with model.text_input='global'",
    ),
    Conditional(
        ("model.word_dim", "model.text_dropout"),
        ("model.text_input",),
        lambda c: c.model.text_input == "tokens",
        "model.text_input='tokens'",
    ),
    Conditional(
        ("data.length_buckets",),
        ("model.text_input",),
        lambda c: c.model.text_input == "tokens",
        "model.text_input='tokens'",
    ),
    Conditional(
        ("model.bidirectional",),
        ("model.head", "model.text_input"),
        lambda c: _cosine(c) and c.model.text_input == "tokens",
        "model.head='cosine' with model.text_input='tokens' (SGRAF's GRU is always bidirectional)",
    ),
    Conditional(
        ("model.temperature",),
        ("model.head", "model.classifier"),
        lambda c: _cosine(c) and c.model.classifier,
        "model.head='cosine' with model.classifier=True",
    ),
    Conditional(
        (
            "model.sim_dim",
            "model.smooth",
            "model.sim_output",
            "model.pair_chunk",
            "model.remat",
            "model.length_groups",
            "model.compute_dtype",
        ),
        ("model.head",),
        _sgraf,
        "model.head='sgr' or 'saf'",
    ),
    Conditional(
        ("model.sgr_steps",), ("model.head",), lambda c: c.model.head == "sgr", "model.head='sgr'"
    ),
    Conditional(("model.views",), ("method",), _multi_view, "a method with image views (ugncl)"),
    Conditional(
        ("optim.weight_decay",),
        ("optim.name",),
        lambda c: c.optim.name == "adamw",
        "optim.name='adamw'",
    ),
    Conditional(
        ("optim.decay_factor", "optim.decay_every"),
        ("optim.schedule",),
        lambda c: c.optim.schedule == "step",
        "optim.schedule='step'",
    ),
    Conditional(
        ("eval.image_chunk", "eval.text_chunk", "eval.coco_5fold"),
        ("eval.kind",),
        lambda c: c.eval.kind == "recall",
        "eval.kind='recall'",
    ),
    Conditional(
        ("noise.file_kind",), ("noise.kind",), lambda c: c.noise.kind == "file", "noise.kind='file'"
    ),
    Conditional(
        ("noise.exact",),
        ("noise.kind",),
        lambda c: c.noise.kind in ("per_caption", "per_image"),
        "noise.kind='per_caption' or 'per_image'",
    ),
    Conditional(
        ("noise.shared_label",),
        ("noise.kind",),
        lambda c: c.noise.kind in ("symmetric", "asymmetric"),
        "noise.kind='symmetric' or 'asymmetric'",
    ),
    Conditional(
        ("noise.exclude_true",),
        ("noise.kind",),
        lambda c: c.noise.kind == "symmetric",
        "noise.kind='symmetric'",
    ),
    Conditional(
        ("noise.seed",),
        ("noise.kind",),
        lambda c: c.noise.kind not in ("none", "file"),
        "noise made from a rate (not noise.kind='none' or 'file')",
    ),
)


def _get(config, field: str):
    for part in field.split("."):
        config = config[part]
    return config


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return tuple(a) == tuple(b)
    return a == b


def ignored_fields(
    config, defaults, overridden: Collection[str] | None = None
) -> tuple[list[str], list[str]]:
    """The non-default fields that ``config`` does not read.

    Args:
      config: the run's config.
      defaults: the config holding every field's default (``config.base_config()``).
      overridden: the fields set on the command line, when known (``train.py``). A field
        the config file set is only *warned* about when what makes it unread was
        overridden (e.g. ``--config.optim.schedule=cosine`` on a file with a step decay);
        without ``overridden`` every ignored field is refused.

    Returns:
      ``(refused, warned)``: lists of messages, one per field.
    """
    refused, warned = [], []
    for rule in CONDITIONAL_FIELDS:
        if rule.reads(config):
            continue
        for field in rule.fields:
            value = _get(config, field)
            if _same(value, _get(defaults, field)):
                continue
            deciders = ", ".join(f"{d}={_get(config, d)!r}" for d in rule.deciders)
            message = (
                f"{field}={value!r} is read only with {rule.when}, not with {deciders}; "
                f"remove it or set it to its default {_get(defaults, field)!r}"
            )
            overrode_decider = overridden is not None and any(
                d in overridden for d in rule.deciders
            )
            if overridden is not None and field not in overridden and overrode_decider:
                warned.append(message)
            else:
                refused.append(message)
    return refused, warned


def reset_unread(config) -> list[str]:
    """Sets every field ``config`` does not read back to its default, e.g. after switching
    ``model.head`` or the inputs in code; returns the names of the fields reset."""
    from ncljax.train.config import base_config

    defaults, reset = base_config(), []
    for rule in CONDITIONAL_FIELDS:
        if rule.reads(config):
            continue
        for field in rule.fields:
            if not _same(_get(config, field), _get(defaults, field)):
                section, name = field.split(".")
                config[section][name] = _get(defaults, field)
                reset.append(field)
    return reset
