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
    SIGINT back to Python's ``KeyboardInterrupt``, which each command catches itself).

    Called first by every command, so a command process first takes its large buffers
    from huge pages (:func:`_huge_pages_environment`, which may restart it)."""
    _restart_with_huge_pages()
    with _contextlib.suppress(ValueError):  # not the main thread: leave the handler alone
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)


_HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def _huge_pages_environment(environ, platform: str, libc: tuple, thp_mode: str | None):
    """The environment to restart a command with so its large buffers sit on huge pages,
    or ``None`` to run as it is.

    XLA's CPU runtime allocates a step's temporary buffers afresh at every execution, and
    glibc maps an allocation that large anew each time: every 4 KiB page of a step's
    ``[B, B]`` matrices (gigabytes at batch 4096) then faults and is zeroed by the kernel,
    at every step. With glibc's ``glibc.malloc.hugetlb=1`` tunable, malloc asks for
    transparent huge pages (``madvise``), 512 times fewer faults: a ``4096 x 4096``
    float32 product by 2 takes 0.33 instead of 1.53 ns per element, UGNCL's ``:vectors``
    step at batch 4096 about a quarter less (``benchmarks/RESULTS.md``). Glibc reads its
    tunables when a process starts, hence the restart; only where the kernel gives huge
    pages on request (``madvise``: with ``always`` every large mapping already gets them,
    with ``never`` none does), with glibc 2.35 or later, and unless the user set the
    tunable or ``NCLJAX_HUGE_PAGES=0``."""
    if platform != "linux" or environ.get("NCLJAX_HUGE_PAGES", "1") == "0":
        return None
    if thp_mode != "madvise" or libc[0] != "glibc":
        return None
    try:
        version = tuple(int(part) for part in libc[1].split(".")[:2])
    except ValueError:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if version < (2, 35) or "glibc.malloc.hugetlb" in tunables:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{_HUGE_PAGES_TUNABLE}" if tunables else _HUGE_PAGES_TUNABLE
    return env


def _transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _restart_with_huge_pages() -> None:
    """Restarts the command (the same interpreter, arguments and process id) with the
    environment of :func:`_huge_pages_environment`, where it gives one."""
    import platform

    env = _huge_pages_environment(
        _os.environ, _sys.platform, platform.libc_ver(), _transparent_huge_pages()
    )
    if env is None or not getattr(_sys, "orig_argv", None) or not _sys.executable:
        return
    with _contextlib.suppress(Exception):
        _sys.stdout.flush()
        _sys.stderr.flush()
    with _contextlib.suppress(OSError):  # cannot restart: run on as it is
        _os.execve(_sys.executable, _sys.orig_argv, env)


if _sys.argv[:1] == ["-m"]:  # ``python -m ncljax.<command>`` is locating its module
    _quiet_until_started()
