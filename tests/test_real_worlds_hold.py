"""Issue 38's bars on the real worlds (slow): every noisy-correspondence method, through
the user's path (``configs/<method>.py:vectors`` on a vectors folder whose pairs lie,
then the audit), with one set of shipped settings, in the mean over three seeds:

- at 40% and 60% mismatched: GSC, SREM, UGNCL and PC2 at least InfoNCE + 20 test rSum,
  NCR at least InfoNCE; the audit's AUC against the true mismatches at least 0.85 (NCR
  0.75);
- in every run with mismatched pairs, under 10% of the main phase's steps trained a
  fallback objective (``fallback_share``);
- at 0% (a clean folder) no harm: every method at least InfoNCE - 5.

The sweep is ``python -m ncljax.report``'s (``train.py`` and audit processes, two at a
time): about 25 minutes on 2 CPU cores before the ``:vectors`` settings raced each
division against none (``train.division='race'``), which trains the dividing methods
twice where their division did not stay off: its runs took 94 minutes of two workers at
e19ab60, beside other work (the 54 runs on the clean folders 36 minutes at 8c69499).
``NCLJAX_HOLD_OUT=<dir>`` keeps its runs there (finished runs and audits are skipped on
the next call).
"""

import os

import pytest

from ncljax import methods, report

WORLDS = ("digits", "mnist5k", "cancer")
BASELINE = report.FAMILIES["pairs"].baseline_noisy  # InfoNCE
# Every correspondence method of the registry that divides its pairs (not the baselines).
DIVIDING = tuple(m for m in methods.of_family("pairs") if m not in ("vse", BASELINE))
METHODS = (BASELINE, *DIVIDING)
RATES = (0.0, 0.4, 0.6)
# The bars: InfoNCE + 20 and AUC 0.85 for every method, NCR's lower; on a clean
# folder InfoNCE - 5 (no audit: no pair is mismatched).
RSUM_MARGIN = {m: 0.0 if m == "ncr" else 20.0 for m in DIVIDING}
CLEAN_MARGIN = -5.0
AUDIT_BAR = {m: 0.75 if m == "ncr" else 0.85 for m in DIVIDING}
# Measured exceptions (benchmarks/RESULTS.md): listed so the test fails on any other;
# remove an entry when the method holds. None since the race's paired test: UGNCL on the
# clean cancer halves read -6.0 when the higher validation rSum won (e19ab60), its
# undivided run validating 3 and 2 higher on a 100-pair split (p 0.25 and 0.21) and
# testing 8 lower and 2 higher; the test keeps its division there (-4.0).
KNOWN_SHORT: set[tuple[str, float, str, str]] = set()


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_every_method_holds_on_the_real_world(tmp_path, world, monkeypatch):
    # The user's path: one CPU device, not the 8 fake devices of the test session (whose
    # collectives deadlocked two processes sharing the 2 cores: their rendezvous waited
    # with the cores idle, a run in 20-40).
    monkeypatch.setenv("XLA_FLAGS", "")
    out = os.environ.get("NCLJAX_HOLD_OUT") or str(tmp_path / "report")
    runs = report.plan("pairs", METHODS, (world,), rates=RATES, seeds=(0, 1, 2))
    outcomes = report.sweep(runs, out, jobs=2)
    failed = [(o.run, o.log) for o in outcomes if o.returncode not in (None, 0)]
    assert not failed, failed
    finished, _ = report.collect(out, "pairs")
    finished = [r for r in finished if r["world"] == world and r["method"] in METHODS]
    rows = {(r["method"], r["rate"]): r for r in report.summarise(finished, "pairs")}
    short = []
    for rate in RATES:
        base = rows[(BASELINE, rate)]["mean"]
        for method, margin in RSUM_MARGIN.items():
            row = rows[(method, rate)]
            assert row["n"] == 3
            if row["mean"] < base + (margin if rate > 0 else CLEAN_MARGIN):
                short.append((world, rate, method, "rsum"))
            if rate == 0:
                continue
            if not row["audit_auc_mean"] >= AUDIT_BAR[method]:
                short.append((world, rate, method, "audit_auc"))
            if not row["fallback_share_max"] < 0.1:
                short.append((world, rate, method, "fallback"))
    assert not [s for s in short if s not in KNOWN_SHORT], short
    assert not [s for s in KNOWN_SHORT if s[0] == world and s not in short], (
        "a listed exception holds now: remove it"
    )
