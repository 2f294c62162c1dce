"""A command restarts itself with glibc's huge-page tunable (``ncljax/__init__.py``): when
it does, what the restarted process sees, and when it leaves the process alone."""

import os
import subprocess
import sys

import pytest

import ncljax

GLIBC = ("glibc", "2.36")
TUNABLE = "glibc.malloc.hugetlb=1"


def test_the_environment_adds_the_tunable_where_the_kernel_gives_huge_pages_on_request():
    env = ncljax._huge_pages_environment({"PATH": "/bin"}, "linux", GLIBC, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE}
    # the user's own tunables are kept, the new one appended
    own = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    env = ncljax._huge_pages_environment(own, "linux", GLIBC, "madvise")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert own == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}  # not modified in place


@pytest.mark.parametrize(
    ("environ", "platform", "libc", "thp"),
    [
        ({}, "darwin", ("", ""), None),  # not Linux
        ({}, "linux", ("musl", "1.2"), "madvise"),  # not glibc
        ({}, "linux", ("glibc", "2.31"), "madvise"),  # glibc without the tunable
        ({}, "linux", ("glibc", "unknown"), "madvise"),
        ({}, "linux", GLIBC, "always"),  # every large mapping gets huge pages already
        ({}, "linux", GLIBC, "never"),
        ({}, "linux", GLIBC, None),  # no transparent huge pages at all
        ({"NCLJAX_HUGE_PAGES": "0"}, "linux", GLIBC, "madvise"),  # the user's opt-out
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", GLIBC, "madvise"),  # set
        ({"GLIBC_TUNABLES": TUNABLE}, "linux", GLIBC, "madvise"),  # restarted already
    ],
)
def test_the_process_is_left_alone(environ, platform, libc, thp):
    assert ncljax._huge_pages_environment(environ, platform, libc, thp) is None


def _start(env):
    """A process that imports ncljax as ``python -m ncljax.<command>`` does (its first
    argument ``-m`` while the package loads): it writes its process id to stderr before
    the import and its tunables after it. Returns ``(ids written, tunables)``."""
    code = (
        "import os, sys; print(os.getpid(), file=sys.stderr, flush=True); sys.argv = ['-m']; "
        "import ncljax; print(os.environ.get('GLIBC_TUNABLES'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stderr.split(), out.stdout.strip()


def test_a_command_restarts_with_the_tunable_as_the_same_process():
    import platform

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "NCLJAX_HUGE_PAGES")}
    expected = ncljax._huge_pages_environment(
        env, sys.platform, platform.libc_ver(), ncljax._transparent_huge_pages()
    )
    ids, tunables = _start(env)
    if expected is None:  # this machine gives no huge pages on request: nothing to restart
        assert (len(ids), tunables) == (1, "None")
        return
    # restarted once: the code ran twice, in the same process, the second time with the
    # tunable (and that run did not restart again)
    assert len(ids) == 2 and ids[0] == ids[1]
    assert tunables == TUNABLE
    ids, tunables = _start({**env, "NCLJAX_HUGE_PAGES": "0"})
    assert (len(ids), tunables) == (1, "None")
