"""Issue 29 item 5 on two worlds (slow): with each method's shipped synthetic
hyperparameters, every noisy-correspondence method reaches, in the mean over three seeds,
at least InfoNCE trained the same way at 40% and 60% noise, and at least VSE++ at 0%.

The sweep is ``python -m ncljax.report``'s (separate ``train.py`` processes, two at a
time): about 40 minutes on 2 CPU cores. ``NCLJAX_HOLD_OUT=<dir>`` keeps its runs there
(finished runs are skipped on the next call).
"""

import os

import pytest

from ncljax import report

WORLDS = ("small_global", "strong_classes")
METHODS = report.FAMILIES["pairs"].methods
# Measured exceptions (issue 29's closing note and benchmarks/RESULTS.md): UGNCL's warm-up
# trains on every pair for two unselectable epochs, by when InfoNCE's best epoch (epoch
# 1-4 at 40-60% noise on these worlds) is past and the noise is memorised: UGNCL 80.3 +- 5.3
# against InfoNCE 80.9 +- 6.5 on small_global at 60%, 226.8 / 151.7 against 234.9 / 168.2
# on strong_classes at 40 / 60% (three seeds). Listed so the test fails on any new
# exception; remove an entry when the method holds there.
KNOWN_SHORT = {
    ("small_global", 0.6, "ugncl"),
    ("strong_classes", 0.4, "ugncl"),
    ("strong_classes", 0.6, "ugncl"),
}


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_every_method_holds_on_the_world(tmp_path, world):
    out = os.environ.get("NCLJAX_HOLD_OUT") or str(tmp_path / "report")
    runs = report.plan("pairs", METHODS, (world,), rates=(0.0, 0.4, 0.6), seeds=(0, 1, 2))
    outcomes = report.sweep(runs, out, jobs=2)
    failed = [(o.run, o.log) for o in outcomes if o.returncode not in (None, 0)]
    assert not failed, failed
    finished, _ = report.collect(out, "pairs")
    finished = [r for r in finished if r["world"] == world and r["method"] in METHODS]
    rows = report.summarise(finished, "pairs")
    checks = report.below_baseline(rows, "pairs")
    assert {(c["rate"]) for c in checks} == {0.0, 0.4, 0.6}
    below = [
        (c["rate"], c["baseline"], round(c["mean"], 1), method, round(mean, 1))
        for c in checks
        for method, mean in c["below"]
        if (world, c["rate"], method) not in KNOWN_SHORT
    ]
    assert not below, below
