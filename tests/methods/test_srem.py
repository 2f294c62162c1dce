"""The SREM method: loss and memory rows, what F is per head, plan, refresh warnings, bad
hyperparameters, 1 vs 8 devices, every backbone, and end to end against the baselines."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.config.fields import reset_unread
from ncljax.methods import base
from ncljax.methods import srem as srem_method
from ncljax.train import train_and_evaluate
from tests.methods.steps import train_steps
from tests.train.test_loop import load_config, read_metrics, tiny

B, N = 32, 40  # as the data fixture


def _ctx(phase):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, zero, phase, N, zero, jax.random.key(0))


def _logits(seed, b=7):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, b)) * 2
    logits[np.arange(b), np.arange(b)] += 4  # most pairs ranked first: a real clean split
    return jnp.asarray(logits, jnp.float32)


@pytest.mark.parametrize("phase", [base.WARMUP, base.MAIN])
def test_loss_reads_the_logit_and_writes_energies_and_splits(phase):
    method = methods.build_method("srem", {"tau": -3.0, "lambda1": 0.1, "warmup_rectify": "biased"})
    logit = _logits(0)
    mask = jnp.array([True, True, False, True, True, True, True])
    outputs = {"logit": logit, "sim": jax.nn.sigmoid(logit)}
    loss, aux = method.loss_fn(outputs, {"mask": mask}, {}, {}, _ctx(phase))
    want, views = srem_method.srem_loss(
        logit, warmup=phase == base.WARMUP, threshold=-3.0, lambda1=0.1, where=mask
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for d in ("i2t", "t2i"):
        np.testing.assert_array_equal(aux.memory[f"energy_{d}"], views[d].energy)
        np.testing.assert_array_equal(aux.clean_estimates[d], views[d].clean)
        assert not views[d].clean[2]  # padding
    assert 0 < float(views["i2t"].clean.sum()) < 6  # the test reaches both branches
    if phase == base.MAIN:
        np.testing.assert_allclose(aux.applied_weight, views["i2t"].pull + views["t2i"].pull)
        assert aux.applied_weight.sum() > 0
    else:  # warm-up: complementary learning alone, no hinge, no pull
        assert aux.applied_weight is None
        comp = views["i2t"].complementary + views["t2i"].complementary
        np.testing.assert_allclose(loss, comp, rtol=1e-6)


def test_cosine_heads_use_the_shifted_scaled_cosine_as_logit():
    method = methods.build_method("srem", {"cosine_temperature": 0.2, "cosine_shift": 0.4})
    rng = np.random.default_rng(1)
    cos = jnp.asarray(rng.uniform(-1, 1, size=(6, 6)), jnp.float32)
    mask = jnp.ones(6, bool)
    loss, _ = method.loss_fn({"sim": cos}, {"mask": mask}, {}, {}, _ctx(base.MAIN))
    want, _ = srem_method.srem_loss((cos - 0.4) / 0.2, fallback=True, where=mask)
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_plan_warms_up_then_decays_from_the_main_phase():
    method = methods.build_method("srem", {"warmup_epochs": 2})
    plans = [method.plan_fn(e) for e in range(5)]
    assert [p.phase for p in plans] == [base.WARMUP] * 2 + [base.MAIN] * 3
    assert [p.lr_epoch for p in plans] == [0, 0, 0, 1, 2]
    assert all(p.drop_remainder and p.selectable for p in plans)
    assert [p.refresh for p in plans] == [False, True, True, True, True]


def _memory(clean):
    rows = {
        "energy_i2t": jnp.full(10, -3.0),
        "energy_t2i": jnp.full(10, -1.0),
        "clean_i2t": jnp.asarray(clean, jnp.float32),
        "clean_t2i": jnp.zeros(10),
    }
    return base.Memory(rows, {})


def test_refresh_warns_when_an_epoch_selected_nothing(caplog):
    method = methods.build_method("srem", {"warmup_epochs": 2, "calibration": "paper"})
    ctx = lambda epoch: base.RefreshContext(epoch, 10, 0, jax.random.key(0), None)
    with caplog.at_level(logging.WARNING):
        _, diag = method.refresh_fn(_memory(np.zeros(10)), None, ctx(1))  # in warm-up
        assert not caplog.records
        _, diag = method.refresh_fn(_memory(np.eye(10)[3]), None, ctx(3))
        assert not caplog.records
        assert diag["selected_fraction_i2t"] == pytest.approx(0.1)
        method.refresh_fn(_memory(np.zeros(10)), None, ctx(2))  # the main phase starts empty
    assert len(caplog.records) == 1
    assert "selected no clean pair in epoch 1" in caplog.records[0].getMessage()
    assert "method_kwargs.tau" in caplog.records[0].getMessage()


def test_clean_score_is_the_geometric_mean_of_the_partner_probabilities():
    """The exported score of a pair is sqrt(p_ii^i2t * p_ii^t2i), p_ii the softmax
    probability of its partner in its query's row of in-batch logits, as the training step
    wrote it; computed here by hand from a batch of logits."""
    method = methods.build_method("srem", {"warmup_epochs": 0})
    logits = np.array([[2.0, 0.0, -1.0], [1.0, 0.5, 3.0], [0.0, 0.0, 0.0]], np.float32)
    outputs = {"logit": jnp.asarray(logits)}
    _, aux = method.loss_fn(outputs, {"mask": jnp.ones(3, bool)}, {}, {}, _ctx(base.MAIN))
    memory = base.Memory(dict(aux.memory), {})
    p_i2t = np.exp(logits).diagonal() / np.exp(logits).sum(1)
    p_t2i = np.exp(logits).diagonal() / np.exp(logits).sum(0)
    np.testing.assert_allclose(method.clean_score_fn(memory), np.sqrt(p_i2t * p_t2i), rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": -0.1}, "srem alpha must be a number >= 0"),
        ({"lambda1": -1.0}, "srem lambda1 must be a number >= 0"),
        ({"ms_beta": 0.0}, "srem ms_beta must be a number > 0"),
        ({"tau": float("nan")}, "srem tau must be a finite number"),
        ({"m_clean": 1.0}, "srem m_clean must be <= m_noisy=0.0"),
        ({"cl_prob": "softplus"}, "srem cl_prob must be one of"),
        ({"rectify": True}, "srem rectify must be one of"),
        ({"clean_set": "both"}, "srem clean_set must be one of"),
        ({"sgw_indicator": "swap"}, "srem sgw_indicator must be one of"),
        ({"warmup_epochs": -1}, "srem warmup_epochs must be an integer >= 0"),
        ({"gradient_weighting": 1}, "srem gradient_weighting must be True or False"),
        ({"cosine_temperature": -0.1}, "srem cosine_temperature must be a number > 0"),
        ({"division": "otsu"}, "srem division must be one of"),
        ({"ranking": "infonce"}, "srem ranking must be one of"),
        ({"partner_level": 0.0}, "srem partner_level must be in (0, 1]"),
        ({"partner_level": 1.5}, "srem partner_level must be in (0, 1]"),
    ],
)
def test_bad_hyperparameters_say_what_to_set(kwargs, message):
    with pytest.raises(ValueError, match="method_kwargs") as error:
        methods.build_method("srem", kwargs)
    assert message in str(error.value)


def test_sigmoid_warmup_is_logged(caplog):
    with caplog.at_level(logging.WARNING):
        methods.build_method("srem", {"cl_prob": "sigmoid"})
    assert "trivial solution" in caplog.text


def _train(info, batches, *, num_devices, head, block_rows=0):
    method = methods.build_method("srem", {"tau": 0.0, "block_rows": block_rows})
    cfg = config_lib.base_config().model
    cfg.embed_dim, cfg.tokens.word_dim = 32, 16
    if head != "cosine":
        cfg.head, cfg.sgraf.sim_dim, cfg.tokens.dropout = head, 16, 0.0
    return train_steps(method, cfg, info, batches, num_devices=num_devices, num_samples=N)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "head, block_rows",
    [("cosine", 0), ("cosine", 8), pytest.param("sgr", 0, marks=pytest.mark.slow)],
)
def test_one_device_equals_eight(data, devices, head, block_rows):
    # block_rows=8: the batch of 32 in four blocks of query rows, the logits sharded
    info, batches = data
    batches = batches[:1]
    one = _train(info, batches, num_devices=1, head=head, block_rows=block_rows)
    eight = _train(info, batches, num_devices=8, head=head, block_rows=block_rows)
    rtol, atol = (2e-5, 2e-6) if head == "cosine" else (2e-4, 2e-5)
    for a, b in [(one[1], eight[1]), (one[0].params, eight[0].params)]:
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
    for x, y in zip(jax.tree.leaves(one[0].memory), jax.tree.leaves(eight[0].memory), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    metrics = one[1]
    assert metrics["selected_i2t"][1] == B
    assert {"noisy_weight_share", "step_clean_precision_i2t", "loss_hinge"} <= metrics.keys()


def srem_config(arg="synthetic,quick"):
    config = load_config("srem", arg)
    config.train.progress_bar = False
    return config


@pytest.mark.heavy
@pytest.mark.parametrize(
    "backbone",
    [
        "global",
        pytest.param("saf", marks=pytest.mark.slow),  # 53 s; the SAF step: tests/models
        pytest.param("sgr", marks=pytest.mark.slow),
        pytest.param("regions", marks=pytest.mark.slow),  # the configs tests run it quick
    ],
)
def test_srem_trains_on_every_backbone_and_logs_its_diagnostics(tmp_path, backbone):
    # SAF: the main phase only (each phase compiles its own SAF step).
    warmup = 0 if backbone == "saf" else 1
    config = tiny(srem_config(), epochs=warmup + 1)
    config.method_kwargs.warmup_epochs = warmup
    if backbone in ("sgr", "saf"):
        config.model.head, config.model.sgraf.sim_dim = backbone, 16
        config.model.embed_dim, config.model.tokens.word_dim = 32, 16
    elif backbone == "global":
        config.model.image_input = config.model.text_input = "global"
    reset_unread(config)
    results = train_and_evaluate(config, str(tmp_path))
    assert np.isfinite(results["rsum"]) and 0 <= results["noise_auc"] <= 1
    rows = read_metrics(tmp_path)
    train = [r for r in rows if r["split"] == "train"]
    assert {r["epoch"] for r in train} == set(range(warmup + 1))
    main = [r for r in train if r["epoch"] == warmup]
    for key in ("selected_i2t", "loss_hinge", "step_clean_precision_t2i", "noisy_weight_share"):
        assert any(key in r for r in main), key
    assert not any("loss_hinge" in r for r in train if r["epoch"] < warmup)
    refresh = [r for r in rows if r["split"] == "refresh"]
    assert [r["epoch"] for r in refresh] == list(range(1, warmup + 1))
    files = sorted(glob.glob(os.path.join(tmp_path, "diagnostics", "*.npz")))
    assert len(files) == warmup + 1
    with np.load(files[-1]) as npz:
        n = config.data.num_train * config.data.captions_per_image
        total = npz["neg_energy_i2t_hist_clean"].sum() + npz["neg_energy_i2t_hist_noisy"].sum()
        assert total == n


@pytest.mark.slow
def test_sgraf_ensemble_of_sgr_and_saf_runs(tmp_path):
    """The paper's SGRAF: an SGR run and an SAF run, scored on the mean of their sigmoid
    similarities by the ensemble evaluation."""
    from ncljax.train import ensemble

    results = {}
    for head in ("sgr", "saf"):
        config = tiny(srem_config(), epochs=2)
        config.method_kwargs.warmup_epochs = 1
        config.model.head, config.model.sgraf.sim_dim = head, 16
        config.model.embed_dim, config.model.tokens.word_dim = 32, 16
        reset_unread(config)
        results[head] = train_and_evaluate(config, str(tmp_path / head))
    both = ensemble.evaluate_ensemble([str(tmp_path / "sgr"), str(tmp_path / "saf")])
    assert np.isfinite(both["rsum"]) and both["rsum"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.4, 0.6])
def test_srem_beats_the_baselines_and_its_selection_sharpens(tmp_path, rate):
    """SREM against VSE++ and InfoNCE trained the same way (``configs/<name>.py:synthetic``:
    backbone, optimiser, batch, 12 epochs); the precision of its clean selection rises
    over the main epochs (no self-reinforcing errors). Measured (test rSum, SREM / InfoNCE
    / VSE++): 484.2 / 448.2 / 275.2 at 40%, 441.5 / 390.3 / 125.1 at 60%. About 2-5
    minutes per run on 2 cores."""
    scores = {}
    for name in ("srem", "vse", "infonce"):
        config = load_config(name, "synthetic")
        config.noise.rate = rate
        config.train.progress_bar = False
        scores[name] = train_and_evaluate(config, str(tmp_path / name))
    print({name: (round(s["rsum"], 1), s["best_epoch"]) for name, s in scores.items()})
    assert scores["srem"]["rsum"] > scores["infonce"]["rsum"] + 10, scores
    assert scores["srem"]["rsum"] > scores["vse"]["rsum"] + 100, scores
    rows = read_metrics(tmp_path / "srem")
    precision = {}
    for r in rows:
        if r["split"] == "train" and r.get("step_clean_precision_i2t") is not None:
            precision.setdefault(r["epoch"], []).append(r["step_clean_precision_i2t"])
    warmup = load_config("srem", "synthetic").method_kwargs.warmup_epochs
    curve = [np.mean(precision[e]) for e in sorted(precision) if e >= warmup]
    print("selection precision per main epoch:", np.round(curve, 3).tolist())
    # Measured: flat at 0.997-1.0 over the main epochs at 40%; at 60% 0.25 and 0.74 in
    # the first two main epochs, then 0.99-1.0 (the early errors are not reinforced).
    # Not reinforced: no drop beyond 0.1 points, the scatter of a curve saturated at 0.999
    # (at 40% a run failed the exact comparison by 0.99891 against 0.99899); a reinforcing
    # error costs whole points, as the 60% curve's first epochs show.
    assert curve[-1] >= max(curve[0] - 1e-3, 0.95), curve
    first, last = np.mean(curve[: len(curve) // 2]), np.mean(curve[len(curve) // 2 :])
    assert last >= first - 1e-3, curve
