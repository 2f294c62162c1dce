"""Where config files are: the ones shipped inside the package, found by name.

``--config=gsc:vectors`` (a shipped file by name, with its argument), ``--config=gsc.py``,
``--config=configs/gsc.py:vectors`` (a path; in a checkout ``configs/`` is the shipped
folder) and ``--config=my/own.py:arg`` (any file) all work: ``resolve`` turns a name that
is not a file into the shipped file's path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ml_collections

# The shipped config files (ncljax/configs; a checkout's configs/ links to it).
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def names() -> list[str]:
    """The shipped config files' names (``gsc``, ``quickstart``, ...), sorted."""
    return sorted(
        f.removesuffix(".py")
        for f in os.listdir(CONFIG_DIR)
        if f.endswith(".py") and not f.startswith("_")
    )


def split(spec: str) -> tuple[str, str]:
    """``'path[:arg]'`` -> ``(path, arg)`` (a path that exists keeps any colon in it)."""
    if os.path.isfile(spec) or ":" not in os.path.basename(spec):
        return spec, ""
    cut = spec.rindex(":")
    return spec[:cut], spec[cut + 1 :]


def shipped(path: str) -> str | None:
    """The shipped file that ``path`` names when ``path`` is not a file itself: a name
    (``gsc``), a file name (``gsc.py``) or a path into a ``configs/`` folder that is not
    here (``configs/gsc.py`` run from another directory); None otherwise."""
    if os.path.isfile(path):
        return None
    name = os.path.basename(path).removesuffix(".py")
    parent = os.path.basename(os.path.dirname(path))
    if name in names() and parent in ("", "configs"):
        return os.path.join(CONFIG_DIR, f"{name}.py")
    return None


def resolve(spec: str) -> str:
    """``spec`` (``--config``'s value) with a shipped file's name replaced by its path;
    anything else unchanged (a missing file is refused where it is loaded)."""
    path, arg = split(spec)
    found = shipped(path)
    if found is None:
        return spec
    return f"{found}:{arg}" if arg else found


def load(spec: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
    """The config ``spec`` names, as ``ncljax train --config=<spec>`` builds it, with
    ``overrides`` applied as ``--config.<field>=<value>`` would be.

    Args:
      spec: a shipped config by name or a config file's path, then ``:`` and its argument
        (``'gsc:vectors'``, ``'vse:synthetic,quick'``, ``'my/config.py:arg'``).
      overrides: ``{'data.folder': 'my_pairs', 'train.epochs': 5, ...}``; ``data.name``
        switches the dataset first (its section from that dataset's defaults).

    Returns:
      The config, not yet checked (``train_and_evaluate`` checks it).

    Raises:
      FileNotFoundError: no such config file or name.
      ValueError: a field that does not exist (or was renamed), or a value of another type.
    """
    from ncljax.config import base, renames

    path, arg = split(resolve(spec))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Config file {path} not found; pass an existing file or a shipped config by name "
            f"({', '.join(names())})."
        )
    config = base.load_file(path, arg)
    overrides = dict(overrides or {})
    if "data.name" in overrides:  # the data fields are set below, on the new section
        base.switch_dataset(config, overrides.pop("data.name"))
    for field, value in overrides.items():
        old = renames.refusal(field, "")
        if old is not None:
            raise ValueError(old)
        *parents, name = field.split(".")
        node = config
        for depth, part in enumerate(parents):
            if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
                where = ".".join(parents[:depth]) or "the config"
                raise ValueError(f"{field}: {where} has no section {part!r}.")
            node = node[part]
        if name not in node:
            raise ValueError(
                f"{field} is not a field; {'.'.join(parents) or 'the config'} has "
                f"{sorted(node.keys())}."
            )
        try:
            node[name] = value
        except TypeError as e:
            raise ValueError(f"{field}={value!r}: {e}") from None
    return config
