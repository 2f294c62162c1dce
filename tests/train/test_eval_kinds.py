"""The evaluators registered by ``eval.kind``: selection metric, summary line, lookup."""

import ml_collections
import pytest

from ncljax.train import evaluator


def _config(kind):
    return ml_collections.ConfigDict({"eval": {"kind": kind}})


def test_each_kind_names_its_selection_metric_and_summary():
    recall, category = evaluator.eval_kind(_config("recall")), evaluator.eval_kind(_config("map"))
    assert (recall.selection, category.selection) == ("rsum", "map_avg")
    assert recall.selection in recall.summary_keys and category.selection in category.summary_keys
    metrics = {"rsum": 501.25, "i2t_r1": 80.0, "t2i_r1": 60.5, "noise_auc": 0.91234, "other": 1}
    # Its own keys in its order, then the noise-detection ones; absent keys are skipped.
    assert recall.summary(metrics) == "rsum=501.2 i2t_r1=80 t2i_r1=60.5 noise_auc=0.9123"
    assert category.summary({"map_t2i": 0.5, "map_avg": 0.25}) == "map_avg=0.25 map_t2i=0.5"


def test_an_unknown_kind_is_one_clear_error():
    with pytest.raises(ValueError, match=r"eval.kind must be one of \('recall', 'map'\), got 'x'"):
        evaluator.eval_kind(_config("x"))
