"""Logged ratios whose denominator is 0 are undefined (NaN, ``null`` in metrics.jsonl), and
the others exact: SREM's noisy gradient ratio (``noisy_weight_share``), the step precisions
and recalls, and UOT-RCL's corrected-label accuracy."""

import json
import logging
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.methods import base
from ncljax.train import diagnostics, writers
from ncljax.train import loop as loop_lib
from ncljax.train import step as step_lib
from tests.methods.steps import train_steps
from tests.methods.test_srem import _ctx, _logits

N = 40  # training images of the data fixture


def _srem_step(data, tau):
    """One SREM main-phase step (paper constants, threshold ``tau``) on the first batch."""
    info, batches = data
    method = methods.build_method("srem", {"tau": tau, "calibration": "paper"})
    cfg = config_lib.base_config().model
    cfg.embed_dim, cfg.tokens.word_dim = 32, 16
    _, metrics = train_steps(method, cfg, info, batches[:1], num_devices=1, num_samples=N)
    return metrics


@pytest.mark.parametrize("mean_fn", [diagnostics.mean_of_sums, loop_lib.mean_of_sums])
def test_accumulated_means_are_exact_and_undefined_over_nothing(mean_fn):
    """Hand-worked: a pull of total 0.6 with 0.3 on noisy pairs is a share of 1/2 (not
    0.3 / max(0.6, 1)); a precision over no selected pair is NaN (not 0)."""
    got = mean_fn(
        {
            "noisy_weight_share": jnp.array([0.3, 0.6]),
            "noisy_weight_share_none": jnp.array([0.0, 0.0]),
            "step_clean_precision": jnp.array([3.0, 4.0]),
            "step_clean_precision_none": jnp.array([0.0, 0.0]),
            "loss": jnp.array([5.0, 2.0]),
        }
    )
    assert got["noisy_weight_share"] == pytest.approx(0.5, rel=1e-7)
    assert got["step_clean_precision"] == pytest.approx(0.75, rel=1e-7)
    assert got["loss"] == pytest.approx(2.5, rel=1e-7)
    assert math.isnan(got["noisy_weight_share_none"])
    assert math.isnan(got["step_clean_precision_none"])


def test_srem_step_that_pulls_nothing_logs_an_undefined_share(data, tmp_path):
    metrics = _srem_step(data, tau=-1e4)  # no energy below: nothing selected, nothing pulled
    np.testing.assert_array_equal(metrics["noisy_weight_share"], [0.0, 0.0])
    mean = diagnostics.mean_of_sums(metrics)
    assert math.isnan(mean["noisy_weight_share"])
    for d in ("i2t", "t2i"):
        assert mean[f"selected_{d}"] == 0.0
        assert math.isnan(mean[f"step_clean_precision_{d}"])  # no selected pair
        assert mean[f"step_clean_recall_{d}"] == 0.0  # clean pairs exist, none found
    assert np.isfinite(mean["loss"])  # the loss itself is defined
    writer = writers.MetricWriter(str(tmp_path))
    writer.write(step=1, epoch=1, split="train", metrics=mean)
    writer.close()
    with open(tmp_path / "metrics.jsonl") as f:
        row = json.loads(f.read())  # strict JSON
    assert row["noisy_weight_share"] is None and row["loss"] is not None


def test_srem_share_of_a_pull_below_one_is_exact():
    """Four pairs, one pulled (weight 0.76 < 1) and noisy: the share is 1 (the old
    ``noisy / max(total, 1)`` logged 0.76)."""
    method = methods.build_method("srem", {"tau": -3.0, "calibration": "paper"})
    logit = _logits(3, b=4)
    batch = {"mask": jnp.ones(4, bool), "index": jnp.arange(4)}
    outputs = {"logit": logit, "sim": jax.nn.sigmoid(logit)}
    _, aux = method.loss_fn(outputs, batch, {}, {}, _ctx(base.MAIN))
    weight = np.asarray(aux.applied_weight, np.float64)
    assert np.count_nonzero(weight) == 1 and 0.0 < weight[2] < 1.0  # the case is reached
    clean = jnp.array([True, True, False, True])
    metrics = step_lib._diagnostic_metrics(aux, batch, clean)  # the trainer's [noisy, total]
    np.testing.assert_allclose(metrics["noisy_weight_share"], [weight[2], weight[2]], rtol=1e-7)
    assert diagnostics.mean_of_sums(metrics)["noisy_weight_share"] == pytest.approx(1.0)


def test_srem_warns_that_an_epoch_without_selection_pulled_nothing(caplog):
    method = methods.build_method("srem", {"warmup_epochs": 1, "calibration": "paper"})
    rows = {
        "energy_i2t": jnp.full(10, -1.0),
        "energy_t2i": jnp.full(10, -1.0),
        "clean_i2t": jnp.zeros(10),
        "clean_t2i": jnp.zeros(10),
    }
    ctx = base.RefreshContext(2, 10, 0, jax.random.key(0), None)  # epoch 1 was main
    with caplog.at_level(logging.WARNING):
        method.refresh_fn(base.Memory(rows, {}), None, ctx)
    message = caplog.records[0].getMessage()
    assert "selected no clean pair in epoch 1" in message
    assert "noisy_weight_share is undefined" in message


def test_corrected_accuracy_is_undefined_when_no_label_is_trusted():
    true = np.array([0, 1, 2, 1])
    pairs = types.SimpleNamespace(true_labels=true, labels_image=true, labels_text=true)
    state = types.SimpleNamespace(memory={"x": jnp.zeros((1, 4))})

    def method(selected):
        return types.SimpleNamespace(
            label_estimate_fn=lambda memory: (jnp.array([0, 1, 0, 0]), jnp.asarray(selected))
        )

    none = diagnostics.label_diagnostics(method([False] * 4), state, pairs)
    assert math.isnan(none["corrected_accuracy"]) and none["selected_fraction"] == 0.0
    some = diagnostics.label_diagnostics(method([True, True, True, False]), state, pairs)
    assert some["corrected_accuracy"] == pytest.approx(2 / 3)
