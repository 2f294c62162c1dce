"""The share of a run's main-phase steps that trained a fallback, read from its metrics
rows (``diagnostics.fallback_share``) and reported in ``results.json``."""

import json
import math

import pytest

from ncljax import methods
from ncljax.train import loop
from ncljax.train.diagnostics import fallback_share
from tests.train.test_loop import load_config, tiny


def _row(step, epoch, split, **metrics):
    return {"step": step, "epoch": epoch, "split": split, **metrics}


def test_per_step_rows_weigh_the_steps_since_the_previous_row():
    # Epoch 0 (warm-up): 4 steps, not counted. Epoch 1: rows after 3 and 5 more steps, the
    # first window 1/3 fallback, the second none. Epoch 2: 4 steps, all fallback.
    rows = [
        _row(4, 0, "train", loss=1.0),
        _row(4, 0, "val", rsum=1.0),
        _row(4, 1, "refresh", division_fallback=1.0),  # SREM: about the epoch before
        _row(7, 1, "train", division_fallback=1 / 3),
        _row(12, 1, "train", division_fallback=0.0),
        _row(12, 1, "val", rsum=1.0),
        _row(16, 2, "train", division_fallback=1.0),
        _row(16, 2, "val", rsum=1.0),
    ]
    # (3 * 1/3 + 5 * 0 + 4 * 1) / (3 + 5 + 4), by hand.
    assert fallback_share(rows, [1, 2]) == pytest.approx(5 / 12)


def test_per_epoch_refresh_flags_cover_their_whole_epoch():
    # Co-teaching: two refreshes (one per network) before each epoch, two passes per epoch.
    rows = [
        _row(0, 0, "refresh", division_fallback=0.0),
        _row(0, 0, "refresh", division_fallback=1.0),  # network 1's division degenerated
        _row(6, 0, "train", loss=1.0, network=0),
        _row(10, 0, "train", loss=1.0, network=1),
        _row(10, 0, "val", rsum=1.0),
        _row(10, 1, "refresh", division_fallback=0.0),
        _row(20, 1, "train", loss=1.0, network=0),
        _row(30, 1, "train", loss=1.0, network=1),
        _row(30, 1, "val", rsum=1.0),
    ]
    assert fallback_share(rows, [0, 1]) == pytest.approx(10 / 30)
    assert fallback_share(rows, [1]) == 0.0
    assert math.isnan(fallback_share(rows, []))  # no main phase: undefined


@pytest.mark.heavy
def test_results_report_the_fallback_share_of_a_run(tmp_path):
    config = tiny(load_config("srem", "synthetic,quick"), epochs=2)
    with config.unlocked():
        config.method_kwargs.warmup_epochs = 1
        config.train.num_devices = 1
        config.train.progress_bar = False
    loop.train_and_evaluate(config, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert results["fallback_share"] == pytest.approx(fallback_share(rows, [1]))
    main = [r for r in rows if r["split"] == "train" and r["epoch"] == 1]
    assert main and all("division_fallback" in r for r in main)


@pytest.mark.heavy
@pytest.mark.parametrize("every_epoch", [True])
def test_selection_among_every_epoch_includes_the_warm_up(tmp_path, every_epoch):
    """``train.select_every_epoch``: the best epoch is the argmax of the validation rSum
    over every epoch (the earliest of ties), warm-up included; off, over the epochs the
    method's plan lets be selected (NCR: not its warm-up)."""
    # A warm-up epoch, then co-training, on the tiny data.
    config = tiny(load_config("ncr", "synthetic,quick"), epochs=2)
    with config.unlocked():
        config.train.select_every_epoch = every_epoch
        config.train.num_devices = 1
        config.train.progress_bar = False
    loop.train_and_evaluate(config, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["epoch"]: r["rsum"] for r in rows if r["split"] == "val"}
    method = methods.build_method("ncr", dict(config.method_kwargs))
    allowed = [e for e in sorted(val) if every_epoch or method.plan_fn(e).selectable]
    assert 0 in allowed if every_epoch else 0 not in allowed
    assert results["best_epoch"] == max(allowed, key=lambda e: (val[e], -e))
