"""The package's commands' flag errors in one line (absl's are two, and its usage error for
a stray argument prints the whole help).

Every command (``train.py``, ``python -m ncljax.audit``, ``ncljax.retrieve``,
``ncljax.train.ensemble``, ``ncljax.report``) parses its flags with :func:`flags_parser`:
a missing required flag, an unknown flag, a value of the wrong type and an argument that
is not a flag each stop the command with one line that names the flag (or the argument)
and says what to pass.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable, Sequence

from absl import flags


def _article(word: str) -> str:
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def describe_flag_error(error: flags.Error, program: str) -> str:
    """One line for absl's flag-parsing ``error`` of ``program`` (e.g. ``python -m
    ncljax.audit``): what is wrong, with which flag, and what to pass."""
    text = " ".join(str(error).split()).removeprefix("ERROR:: ").rstrip(".")
    helps = f"{program} --helpshort lists the flags"
    required = re.fullmatch(
        r"flag --(\S+?)=None: Flag --\1 must have a value other than None", text
    )
    if required:
        name = required[1]
        return f"--{name} is required: pass --{name}=... ({helps})."
    if text.startswith("Unknown command line flag"):
        return f"{text}: check its spelling ({helps})."
    if text.startswith("Missing value for flag"):
        return f"{text}: write it as --flag=value ({helps})."
    value = re.match(r"flag --(\S+?)=", text)
    if value and value[1] in flags.FLAGS and "should be one of" not in text:
        kind = flags.FLAGS[value[1]].flag_type()
        return f"{text}: --{value[1]} takes {_article(kind)} ({helps})."
    return f"{text} ({helps})."


def unexpected_arguments(arguments: Sequence[str], program: str) -> str:
    """One line for arguments that are not flags (absl's usage error prints the help)."""
    return (
        f"Unexpected arguments {list(arguments)}: {program} takes only flags (--name=value; "
        f"quote a value that holds spaces; {program} --helpshort lists them)."
    )


def started() -> None:
    """Gives Ctrl-C back to ``KeyboardInterrupt`` once a command's imports are done (until
    then ``ncljax._interrupted_while_starting`` ends the command in one line)."""
    import ncljax

    if signal.getsignal(signal.SIGINT) is ncljax._interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
    """An ``app.run`` ``flags_parser`` for ``program``: absl's parsing, each error in one
    line (:func:`describe_flag_error`, :func:`unexpected_arguments`) and exit status 1."""

    def parse(argv: list[str]) -> list[str]:
        try:
            rest = flags.FLAGS(argv)
        except flags.Error as e:
            sys.exit(describe_flag_error(e, program))
        if len(rest) > 1:
            sys.exit(unexpected_arguments(rest[1:], program))
        return rest

    return parse
