"""The run's JSON files are strict JSON: an undefined (NaN) or infinite value is ``null``."""

import json
import math

import ml_collections
import pytest

from ncljax.train import rundir, writers


def _strict(text: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_strict_parser_refuses_what_python_writes_by_default():
    with pytest.raises(ValueError, match="NaN is not JSON"):
        _strict(json.dumps({"x": math.nan}))


def test_results_json_writes_non_finite_values_as_null(tmp_path):
    results = {
        "rsum": 412.5,
        "best_epoch": 3,
        "clean_precision": math.nan,  # nothing flagged noisy
        "clean_recall": 0.0,
        "val_rsum": -math.inf,
        "nested": {"a": [1.0, math.inf, "text"], "b": (math.nan, 2)},
        "flag": True,
    }
    path = tmp_path / "results.json"
    rundir.atomic_write_json(str(path), results)
    assert _strict(path.read_text()) == {
        "rsum": 412.5,
        "best_epoch": 3,
        "clean_precision": None,
        "clean_recall": 0.0,
        "val_rsum": None,
        "nested": {"a": [1.0, None, "text"], "b": [None, 2]},
        "flag": True,
    }
    assert not (tmp_path / "results.json.tmp").exists()


def test_metrics_jsonl_lines_are_strict(tmp_path):
    writer = writers.MetricWriter(str(tmp_path))
    writer.write(
        step=10,
        epoch=0,
        split="val",
        metrics={"rsum": 200.0, "precision": math.nan, "ratio": math.inf, "gap": None},
    )
    writer.write(step=20, epoch=1, split="test", metrics={"rsum": 210.0, "auc": -math.inf})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict(line) for line in lines] == [
        {"step": 10, "epoch": 0, "split": "val", "rsum": 200.0, "precision": None}
        | {"ratio": None, "gap": None},
        {"step": 20, "epoch": 1, "split": "test", "rsum": 210.0, "auc": None},
    ]


def test_config_json_is_strict_and_a_non_finite_field_still_resumes(tmp_path):
    """A NaN field (refused by the method factories, but a researcher's method may take it)
    is written as null, and the same config then counts as unchanged on resume."""
    config = ml_collections.ConfigDict({"method_kwargs": {"margin": math.nan}, "seed": 0})
    rundir.write_config(str(tmp_path), config, {"noise_realised_rate": math.nan})
    written = _strict((tmp_path / "config.json").read_text())
    assert written == {"method_kwargs": {"margin": None}, "seed": 0, "noise_realised_rate": None}
    rundir.write_config(str(tmp_path), config, {"noise_realised_rate": math.nan})  # resumes
    config.seed = 1
    with pytest.raises(ValueError, match=r"\['seed'\] differ"):
        rundir.write_config(str(tmp_path), config, {"noise_realised_rate": math.nan})


def test_a_run_written_before_a_field_existed_resumes_with_the_value_it_ran_with(tmp_path):
    """``train.division`` came later: a config.json without it ran with 'on' and resumes
    with 'on'; another value is a change of config."""
    config = ml_collections.ConfigDict({"train": {"division": "on"}, "seed": 0})
    (tmp_path / "config.json").write_text(json.dumps({"train": {}, "seed": 0}))
    rundir.write_config(str(tmp_path), config, {})  # resumes
    (tmp_path / "config.json").write_text(json.dumps({"train": {}, "seed": 0}))
    config.train.division = "race"
    with pytest.raises(ValueError, match=r"\['train.division'\] differ"):
        rundir.write_config(str(tmp_path), config, {})
