"""ncljax: cross-modal retrieval that stays correct when its training data lies."""

import contextlib as _contextlib
import os as _os
import signal as _signal
import sys as _sys

__version__ = "0.1.0"


def _interrupted_while_starting(signum, frame):
    """Ctrl-C while a command is still importing (jax takes seconds): one line, exit 130,
    instead of a traceback through the import machinery. Nothing has been written yet."""
    with _contextlib.suppress(Exception):  # stderr may be gone at interpreter exit
        _sys.stderr.write("Interrupted while starting; nothing was done.\n")
        _sys.stderr.flush()
    _os._exit(130)


def _quiet_until_started() -> None:
    """Makes Ctrl-C quiet until the command's flags are parsed (``cli.started`` gives
    SIGINT back to Python's ``KeyboardInterrupt``, which each command catches itself)."""
    with _contextlib.suppress(ValueError):  # not the main thread: leave the handler alone
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)


if _sys.argv[:1] == ["-m"]:  # ``python -m ncljax.<command>`` is locating its module
    _quiet_until_started()
