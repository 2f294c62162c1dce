"""NCR: the plan, streams, co-rectified targets and losses against numpy transcriptions of
the official training step, 1 device against 8, and end to end against the baselines."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import methods
from ncljax.config.fields import reset_unread
from ncljax.methods import base, ncr
from ncljax.train import train_and_evaluate
from tests.train.test_loop import chance_rsum, read_metrics, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ncr_config(arg="synthetic"):
    return config_lib.load_file(os.path.join(ROOT, "configs", "ncr.py"), arg)


# --- numpy transcription of the official ContrastiveLoss (NCR/model.py) ------------------


def official_costs(scores, margin):
    """``cost_s``, ``cost_im`` with ``margin`` a scalar or a ``[B, 1]`` column."""
    diagonal = np.diag(scores)[:, None]
    cost_s = np.maximum(margin + scores - diagonal, 0)  # d1: the row's positive
    cost_im = np.maximum(margin + scores - diagonal.T, 0)  # d2: the column's positive
    eye = np.eye(len(scores), dtype=bool)
    cost_s[eye] = 0
    cost_im[eye] = 0
    return cost_s, cost_im


def official_predict(scores, margin=0.2):
    cost_s, cost_im = official_costs(scores, margin)
    p = margin - (cost_s.mean(1) + cost_im.mean(0)) / 2
    p = np.clip(p, 0, margin)
    ratio = len(scores) // 10 + 1
    p = p / np.mean(np.sort(p)[-ratio:])
    return np.clip(p, 0, 1)


def official_train_loss(scores, labels, margin=0.2):
    """Hardest-negative loss with exponential soft margins on the code's labels: ``[B]`` ones
    viewed as ``[B, 1]`` (the noisy batch), or the clean batch's ``[B, B]`` broadcast."""
    soft = margin * (10.0 ** labels.reshape(len(scores), -1) - 1) / 9
    cost_s, cost_im = official_costs(scores, soft)
    return cost_s.max(1).sum() + cost_im.max(0).sum()


def paper_train_loss(scores, labels, margin=0.2):
    """Eq. 5: each hinge term uses its own positive pair's soft margin."""
    soft = margin * (10.0**labels - 1) / 9
    b = len(scores)
    total = 0.0
    for i in range(b):
        neg = [j for j in range(b) if j != i]
        total += max(max(soft[i] + scores[i, j] - scores[i, i], 0) for j in neg)
        total += max(max(soft[i] + scores[j, i] - scores[i, i], 0) for j in neg)
    return total


@pytest.fixture
def sims():
    rng = np.random.default_rng(0)
    base_sim = rng.uniform(0.1, 0.6, (6, 6))
    base_sim[np.diag_indices(6)] += rng.uniform(0.0, 0.5, 6)
    peer = np.clip(base_sim + rng.normal(0, 0.05, (6, 6)), 0, 1)
    return base_sim.astype(np.float32), peer.astype(np.float32)


def _ctx(phase, update, prepared):
    return base.LossContext(
        step=jnp.zeros((), jnp.int32),
        epoch=jnp.zeros((), jnp.int32),
        phase=phase,
        num_samples=6,
        network=jnp.zeros((), jnp.int32),
        rng=jax.random.key(0),
        update=update,
        prepared=prepared,
    )


class _Fixed:
    """A 'model' returning fixed similarities (eval mode), for ``prepare_fn``."""

    def __init__(self, sim):
        self.sim = jnp.asarray(sim)

    def __call__(self, batch, train=False):
        assert not train
        return {"sim": self.sim}


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_clean_and_noisy_updates_match_the_official_step(sims, variant):
    own, peer = sims
    code = variant == "code"
    method = methods.build_method(
        "ncr",
        {
            "margin_of": "image" if code else "positive",
            "target_prediction": "broadcast" if code else "pair",
        },
    )
    batch = {"mask": np.ones(6, bool), "index": np.arange(6)}
    prepared = method.prepare_fn(
        _Fixed(own), _Fixed(peer), (batch, batch), _ctx(ncr.CLEAN_NOISY, 0, None)
    )
    p_own, p_peer = (
        official_predict(own.astype(np.float64)),
        official_predict(peer.astype(np.float64)),
    )
    np.testing.assert_allclose(prepared["clean"], p_own, atol=1e-5)
    np.testing.assert_allclose(prepared["noisy"], (p_own + p_peer) / 2, atol=1e-5)  # Eq. 7
    # Update 0: the peer's clean probability w, co-rectified with the own prediction (Eq. 6).
    w = np.array([0.9, 0.7, 0.99, 0.6, 0.8, 0.95], np.float32)
    rows = {"prob": jnp.asarray(w), "divided": jnp.ones(6)}
    outputs = {"sim": jnp.asarray(own)}
    loss, aux = method.loss_fn(outputs, batch, rows, rows, _ctx(ncr.CLEAN_NOISY, 0, prepared))
    target = w + (1 - w) * p_own
    np.testing.assert_allclose(aux.metrics["target_clean"], target, atol=1e-5)
    if code:  # the code's [B, 1] * [B, 1] + [B, 1] * [B]: w_i + (1 - w_i) P_j
        target = w[:, None] * np.ones((6, 1)) + (1 - w[:, None]) * p_own
    oracle = official_train_loss if code else paper_train_loss
    assert float(loss.sum()) == pytest.approx(oracle(own.astype(np.float64), target), abs=1e-4)
    # Update 1: the noisy batch with the two networks' mean prediction.
    loss, aux = method.loss_fn(outputs, batch, rows, rows, _ctx(ncr.CLEAN_NOISY, 1, prepared))
    noisy_target = (p_own + p_peer) / 2
    assert float(loss.sum()) == pytest.approx(
        oracle(own.astype(np.float64), noisy_target), abs=1e-4
    )
    assert set(aux.clean_estimates) == {"noisy"}


def test_warmup_loss_is_the_official_mean_negative_sum(sims):
    own, _ = sims
    method = methods.build_method("ncr")
    batch = {"mask": np.ones(6, bool), "index": np.arange(6)}
    loss, _ = method.loss_fn({"sim": jnp.asarray(own)}, batch, {}, {}, _ctx(ncr.WARMUP, 0, {}))
    cost_s, cost_im = official_costs(own.astype(np.float64), 0.2)
    assert float(loss.sum()) == pytest.approx(
        cost_s.mean(1).sum() + cost_im.mean(0).sum(), abs=1e-5
    )
    stats = method.stats_fn({"sim": jnp.asarray(own)}, batch)  # co-divide: per pair, eval_loss
    np.testing.assert_allclose(stats["loss"], cost_s.mean(1) + cost_im.mean(0), atol=1e-6)


def test_plan_streams_and_refresh():
    method = methods.build_method("ncr", {"warmup_epochs": 2, "noisy_start_epoch": 3})
    plans = [method.plan_fn(e) for e in range(7)]
    assert [p.phase for p in plans] == [0, 0, 1, 1, 1, 2, 2]
    assert [p.lr_epoch for p in plans] == [0, 0, 0, 1, 2, 3, 4]
    assert [p.selectable for p in plans] == [False, False, True, True, True, True, True]
    assert [p.refresh for p in plans] == [False, False, True, True, True, True, True]
    assert all(p.in_turn and p.min_batch == 2 for p in plans)
    assert [p.updates for p in plans[4:]] == [(0,), (0, 1), (0, 1)]
    clean = jnp.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 0]], jnp.float32)
    memory = base.Memory({"clean": clean, "prob": clean, "loss": clean, "divided": clean}, {})
    for network, peer in ((0, 1), (1, 0)):  # each network walks its peer's division
        streams = method.streams_fn(memory, method.plan_fn(2), network)
        np.testing.assert_array_equal(streams.main, np.flatnonzero(clean[peer]))
        np.testing.assert_array_equal(streams.aux, np.flatnonzero(1 - clean[peer]))
    assert method.streams_fn(memory, method.plan_fn(1), 0) == base.Streams()  # warm-up: all pairs
    # Refresh: a bimodal loss splits into the low-loss (clean) and high-loss sets.
    rng = np.random.default_rng(1)
    losses = np.concatenate([rng.normal(0.1, 0.02, 300), rng.normal(0.6, 0.05, 100)])
    memory = method.init_memory(base.InitContext(400, None, None, None))
    new, diagnostics = method.refresh_fn(memory, {"loss": jnp.asarray(losses)}, None)
    np.testing.assert_array_equal(np.asarray(new.samples["clean"]) > 0.5, np.arange(400) < 300)
    assert float(diagnostics["clean_fraction"]) == pytest.approx(0.75)


def test_equal_losses_keep_the_previous_division_with_a_warning(caplog):
    method = methods.build_method("ncr")
    previous = (np.arange(40) % 3 != 0).astype(np.float32)
    samples = {"clean": previous, "prob": previous, "loss": previous * 0, "divided": previous}
    memory = base.Memory(samples, {})
    ctx = base.RefreshContext(3, 10, 1, None, None)
    with caplog.at_level(logging.WARNING):
        new, diagnostics = method.refresh_fn(memory, {"loss": jnp.full(40, 0.7)}, ctx)
    assert "network 1's per-pair losses of epoch 3 are all equal" in caplog.text
    np.testing.assert_array_equal(new.samples["clean"], previous)
    np.testing.assert_array_equal(new.samples["prob"], previous)
    assert diagnostics["gmm_degenerate"] and diagnostics["clean_fraction"] == pytest.approx(
        previous.mean()
    )


def _two_epochs(config):
    """A warm-up epoch, then one co-training epoch with both updates (every step variant of
    NCR but the clean-only one, compiled once each)."""
    config = tiny(config, epochs=2)
    config.method_kwargs.warmup_epochs, config.method_kwargs.noisy_start_epoch = 1, 0
    return config


@pytest.fixture(scope="module")
def global_run(tmp_path_factory):
    """``global_run(num_devices)``: ``(config, results, workdir)`` of ``_two_epochs`` NCR on
    global feature vectors (MLP encoders) over that many devices, trained once per module."""
    runs = {}

    def run(num_devices):
        if num_devices not in runs:
            config = _two_epochs(ncr_config("synthetic,quick"))
            config.model.image_input = config.model.text_input = "global"
            reset_unread(config)  # the token sizes
            config.train.num_devices = num_devices
            workdir = tmp_path_factory.mktemp(f"global_{num_devices}")
            runs[num_devices] = config, train_and_evaluate(config, str(workdir)), workdir
        return runs[num_devices]

    return run


@pytest.mark.heavy
@pytest.mark.parametrize(
    "backbone",
    [
        # 50 s on 2 cores; region/token inputs are covered fast by the SGR real configs.
        pytest.param("regions", marks=pytest.mark.slow),
        "global",
    ],
)
def test_ncr_trains_on_cosine_backbones_and_logs_divisions(tmp_path, global_run, backbone):
    if backbone == "global":  # one device: also test_one_device_equals_eight's first run
        config, results, workdir = global_run(1)
    else:
        config, workdir = _two_epochs(ncr_config("synthetic,quick")), tmp_path
        results = train_and_evaluate(config, str(workdir))
    rows = read_metrics(workdir)
    val = [r for r in rows if r["split"] == "val"]
    assert results["best_epoch"] == 1  # warm-up never selected
    n = config.data.num_train * config.data.captions_per_image
    assert val[0]["steps_net0"] == val[0]["steps_net1"] == -(-n // 32)  # all pairs
    for key in ("noise_auc_net0", "noise_auc_net1", "clean_precision_net1", "clean_recall_net0"):
        assert 0 <= val[1][key] <= 1, key
    refresh = [r for r in rows if r["split"] == "refresh"]
    assert [r["epoch"] for r in refresh] == [1]
    assert {"clean_fraction_net0", "clean_fraction_net1"} <= refresh[0].keys()
    for net, peer in ((0, 1), (1, 0)):  # each network walks its peer's clean set
        clean = round(refresh[0][f"clean_fraction_net{peer}"] * n)
        assert val[1][f"main_pairs_net{net}"] == clean
        assert val[1][f"aux_pairs_net{net}"] == n - clean
        assert val[1][f"steps_net{net}"] <= -(-clean // 32)
    train = [r for r in rows if r["split"] == "train" and r["epoch"] == 1]
    assert {r["network"] for r in train} == {0.0, 1.0}
    assert all("loss_noisy" in r and "noisy_weight_share" in r for r in train)
    assert np.isfinite(results["rsum"])  # learning: the slow tests below


def test_one_device_equals_eight(global_run, devices):
    """Global feature vectors (MLP encoders): the sharded in-turn co-training path compiles
    in seconds; the region/token path on 8 devices is covered by the step tests."""
    runs = [global_run(num_devices)[1] for num_devices in (1, 8)]
    for key in ("rsum", "noise_auc", "noise_auc_net0", "val_rsum"):
        assert runs[0][key] == pytest.approx(runs[1][key], abs=0.5 if "rsum" in key else 1e-3), key


@pytest.mark.slow
def test_ncr_learns_on_global_feature_vectors(tmp_path):
    config = ncr_config("synthetic")
    config.model.image_input = config.model.text_input = "global"
    reset_unread(config)  # the token sizes
    config.data.num_train, config.train.progress_bar = 1000, False
    config.method_kwargs.warmup_epochs, config.method_kwargs.noisy_start_epoch = 1, 2
    config.train.epochs = 5
    results = train_and_evaluate(config, str(tmp_path))
    chance = chance_rsum(config.data.num_test, config.data.captions_per_image)
    assert results["rsum"] > 2 * chance, (results["rsum"], chance)


@pytest.mark.slow
@pytest.mark.parametrize(("rate", "margin"), [(0.4, 100.0), (0.6, 40.0)])
def test_ncr_beats_vse_on_synthetic_noise(tmp_path, rate, margin):
    """NCR against VSE++, the hinge loss it rectifies, trained the same way (backbone,
    optimiser, batch, 12 epochs). Measured (benchmarks/synthetic_results.py): test rSum
    440.4 against 296.6 at 40% and 192.0 against 128.9 at 60%. InfoNCE (446.4, 393.3) is
    not beaten on this data: see benchmarks/RESULTS.md."""
    from tests.train.test_loop import load_config

    configs = {"ncr": ncr_config("synthetic"), "vse": load_config("vse", "synthetic")}
    scores = {}
    for name, config in configs.items():
        config.noise.rate = rate
        config.train.progress_bar = False
        scores[name] = train_and_evaluate(config, str(tmp_path / name))
    assert scores["ncr"]["rsum"] > scores["vse"]["rsum"] + margin, scores
    assert scores["ncr"]["best_epoch"] >= configs["ncr"].method_kwargs.warmup_epochs
    assert scores["ncr"]["noise_auc"] > 0.75, scores["ncr"]
