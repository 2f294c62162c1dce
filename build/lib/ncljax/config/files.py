"""Where config files are: the ones shipped inside the package, found by name.

``--config=gsc:vectors`` (a shipped file by name, with its argument), ``--config=gsc.py``,
``--config=configs/gsc.py:vectors`` (a path; in a checkout ``configs/`` is the shipped
folder) and ``--config=my/own.py:arg`` (any file) all work: ``resolve`` turns a name that
is not a file into the shipped file's path.
"""

from __future__ import annotations

import os

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
