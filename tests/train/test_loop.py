"""End to end: train_and_evaluate trains, resumes after a crash, and refuses bad input."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import evaluate, methods
from ncljax.data import sources, synthetic
from ncljax.methods import base
from ncljax.train import loop, train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(name: str, arg: str = ""):
    """``get_config(arg)`` of ``configs/<name>.py``."""
    return config_lib.load_file(os.path.join(ROOT, "configs", f"{name}.py"), arg)


def tiny(config, *, epochs=2):
    """A few-second run of any config."""
    config.data.num_train, config.data.num_val, config.data.num_test = 64, 16, 16
    config.train.epochs = epochs
    config.train.batch_size = 32
    config.train.log_every_steps = 4
    config.train.progress_bar = False
    config.eval.batch_size = 32
    return config


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def chance_rsum(num_images: int, cpi: int) -> float:
    """Expected rSum of a random ranking: i2t hits one of cpi captions, t2i its one image."""
    num_captions = num_images * cpi
    total = 0.0
    for k in (1, 5, 10):
        miss = math.comb(num_captions - cpi, k) / math.comb(num_captions, k)
        total += 100 * (1 - miss) + 100 * min(k, num_images) / num_images
    return total


@pytest.mark.heavy
def test_quickstart_quick_learns(tmp_path):
    config = load_config("quickstart", "quick")
    config.train.progress_bar = False
    config.train.epochs = 3  # of the preset's 5: rSum about 3x chance already
    # One device, as the README's command on a CPU; the 8 fake devices would add only their
    # collectives (the sharded loop: the methods' test_one_device_equals_eight).
    config.train.num_devices = 1
    results = train_and_evaluate(config, str(tmp_path))
    chance = chance_rsum(config.data.num_test, config.data.captions_per_image)
    assert results["rsum"] > 2.5 * chance, (results["rsum"], chance)
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["rsum"] == pytest.approx(results["rsum"])
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    assert saved["noise"]["rate"] == 0.4 and len(saved["noise_checksum"]) == 64
    assert saved["noise_realised_rate"] == pytest.approx(0.4)
    rows = read_metrics(tmp_path)
    splits = {r["split"] for r in rows}
    assert splits == {"train", "refresh", "val", "test"}  # refresh: GSC's per-epoch labels
    refreshes = [r for r in rows if r["split"] == "refresh"]
    assert refreshes and all(r["refresh_seconds"] > 0 for r in refreshes)  # timed apart
    val = [r for r in rows if r["split"] == "val"]
    assert [r["epoch"] for r in val] == list(range(config.train.epochs))
    assert all({"step", "epoch", "rsum", "i2t_r1", "t2i_r1"} <= r.keys() for r in val)
    assert results["best_epoch"] == int(np.argmax([r["rsum"] for r in val]))


# Slow: tests/train/test_faults.py resumes the same kind of run (text dropout, two batch
# widths, killed after an epoch) to the uninterrupted run's results and rows in the default
# run (test_full_disk_during_a_save..., test_damaged_latest_checkpoint...).
@pytest.mark.slow
def test_crash_and_resume_matches_uninterrupted_run(tmp_path):
    config = tiny(load_config("vse", "synthetic"), epochs=3)
    config.model.embed_dim, config.model.tokens.word_dim = 32, 16
    config.model.tokens.dropout = 0.2  # randomness must resume exactly too
    config.data.length_buckets = (10, 12)  # batches of two widths: one compilation each
    straight = train_and_evaluate(config, str(tmp_path / "straight"))

    class Crash(Exception):
        pass

    def crash_after_first_epoch(epoch, metrics):
        if epoch == 0:
            raise Crash

    with pytest.raises(Crash):
        train_and_evaluate(config, str(tmp_path / "resumed"), callbacks=[crash_after_first_epoch])
    resumed = train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed == pytest.approx(straight, abs=1e-9)
    rows_a, rows_b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    key = lambda r: (r["split"], r["step"])
    assert sorted(map(key, rows_a)) == sorted(map(key, rows_b))  # nothing logged twice
    val_a = [r["rsum"] for r in rows_a if r["split"] == "val"]
    val_b = [r["rsum"] for r in rows_b if r["split"] == "val"]
    np.testing.assert_allclose(val_a, val_b, atol=1e-9)


@pytest.mark.slow  # 45 s on 2 cores; the dual path is covered fast by the GSC and step tests
def test_dual_network_baseline_trains(tmp_path):
    config = load_config("quickstart", "quick")
    config.method = "vse"  # the quickstart trains GSC; this is the VSE++ baseline's dual path
    config.method_kwargs = ml_collections.ConfigDict(
        {"margin": 0.2, "negatives": "hardest", "num_networks": 2}
    )
    config.train.epochs = 3
    config.train.progress_bar = False
    dual = train_and_evaluate(config, str(tmp_path / "dual"))
    assert dual["rsum"] > 2 * chance_rsum(config.data.num_test, 5)


@pytest.mark.heavy
def test_ce_learns_categories(tmp_path):
    config = load_config("ce", "synthetic,quick")
    config.noise.kind = "none"
    config.train.epochs = 6
    config.train.num_devices = 4  # batch 100 splits over 4 of the 8 test devices
    config.train.progress_bar = False
    ce = train_and_evaluate(config, str(tmp_path))
    # Chance: the same mAP computation on random embeddings of the test labels.
    labels = synthetic.SyntheticDataset(config.data).split("test").image_labels()
    rng = np.random.default_rng(0)
    chance = evaluate.category_retrieval_metrics(
        rng.normal(size=(labels.size, 8)), labels, rng.normal(size=(labels.size, 8)), labels
    )["map_avg"]
    assert ce["map_avg"] > 2 * chance, (ce["map_avg"], chance)


class _PoisonedSplit:
    """A synthetic split whose image regions turn NaN once ``poisoned`` is set."""

    poisoned = False

    def __init__(self, split):
        self._split = split
        self.num_images, self.num_captions = split.num_images, split.num_captions
        self.captions_per_image = split.captions_per_image

    def image(self, index, fields):
        out = dict(self._split.image(index, fields))
        if _PoisonedSplit.poisoned and "regions" in out:
            out["regions"] = np.full_like(out["regions"], np.nan)
        return out

    def caption(self, index, fields):
        return self._split.caption(index, fields)

    def image_labels(self):
        return self._split.image_labels()


class _PoisonedDataset:
    def __init__(self, cfg):
        cfg = cfg.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.name = "synthetic"
        self._inner = synthetic.SyntheticDataset(cfg)
        self.info = self._inner.info

    def split(self, name):
        return _PoisonedSplit(self._inner.split(name))


def test_nan_inputs_stop_with_step_and_keep_last_checkpoint(tmp_path):
    sources.register("poisoned_synthetic")(_PoisonedDataset)
    config = tiny(load_config("vse", "synthetic"), epochs=3)
    config.data.name = "poisoned_synthetic"
    config.data.cache = False
    config.train.num_devices = 1

    def poison(epoch, metrics):
        _PoisonedSplit.poisoned = True

    _PoisonedSplit.poisoned = False
    try:
        # 10 steps per epoch; batches read ahead before the poisoning are still clean.
        with pytest.raises(
            FloatingPointError, match=r"step 1\d \(epoch 1\).*checkpoint \(step 10\)"
        ):
            train_and_evaluate(config, str(tmp_path), callbacks=[poison])
    finally:
        _PoisonedSplit.poisoned = False
    assert sorted(os.listdir(tmp_path / "checkpoints" / "latest")) == ["10"]
    # The stop names the fix: the same command with a lower learning rate resumes.
    config.optim.learning_rate = config.optim.learning_rate / 10
    results = train_and_evaluate(config, str(tmp_path))
    assert results["rsum"] > 0
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["optim"]["learning_rate"] == config.optim.learning_rate


def test_bad_config_errors(tmp_path):
    config = tiny(load_config("vse", "synthetic"))
    config.train.batch_size = 1000
    with pytest.raises(ValueError, match="larger than the training split"):
        train_and_evaluate(config, str(tmp_path / "a"))
    config = tiny(load_config("vse", "synthetic"))
    config.noise.kind = "file"
    config.noise.file.path = str(tmp_path / "noise.npy")
    np.save(config.noise.file.path, np.zeros(7, np.int64))
    with pytest.raises(ValueError, match="320"):  # 64 images x 5 captions expected
        train_and_evaluate(config, str(tmp_path / "b"))
    config = tiny(load_config("vse", "synthetic"), epochs=1)
    config.train.num_devices = 1
    train_and_evaluate(config, str(tmp_path / "c"))
    config.noise.rate = 0.2
    with pytest.raises(ValueError, match="different config"):
        train_and_evaluate(config, str(tmp_path / "c"))
    config = tiny(load_config("vse", "synthetic"))
    config.method_kwargs.margin = 0.1
    with config.unlocked():
        config.method_kwargs.tau = 0.5
    with pytest.raises(ValueError, match=r"does not take \['tau'\]"):
        train_and_evaluate(config, str(tmp_path / "d"))


def test_cli_refuses_unknown_config_key(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config=" + os.path.join(ROOT, "configs", "quickstart.py") + ":quick",
        "--config.train.epoch=3",
        f"--workdir={tmp_path}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert "Unknown config field in ['--config.train.epoch=3']" in out.stderr
    assert 'Did you mean "epochs"' in out.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def _loss_ranking_method(*, margin=0.2, negatives="hardest", num_networks=1):
    """VSE that remembers each pair's last loss and calls low-loss pairs clean."""
    vse = methods.build_method(
        "vse", {"margin": margin, "negatives": negatives, "num_networks": num_networks}
    )

    def init_memory(ctx):
        return base.Memory(samples={"last_loss": jnp.zeros(ctx.num_samples)}, state={})

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        loss, _ = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        return loss, base.Aux(memory={"last_loss": jax.lax.stop_gradient(loss)})

    return vse._replace(
        name="loss_ranking",
        init_memory=init_memory,
        loss_fn=loss_fn,
        clean_score_fn=lambda memory: -memory.samples["last_loss"],
    )


def test_noise_detection_is_logged_per_epoch(tmp_path, monkeypatch):
    monkeypatch.setitem(methods.REGISTRY, "loss_ranking", _loss_ranking_method)
    config = tiny(load_config("vse", "synthetic"))
    config.method = "loss_ranking"
    config.train.num_devices = 1
    train_and_evaluate(config, str(tmp_path))
    val = [r for r in read_metrics(tmp_path) if r["split"] == "val"]
    assert len(val) == config.train.epochs
    assert all({"noise_auc", "clean_precision", "clean_recall"} <= r.keys() for r in val)
    assert all(0.0 <= r["noise_auc"] <= 1.0 for r in val)


class _FlakySplit(_PoisonedSplit):
    """Raises once, the first time caption ``fail_at`` is read after ``armed`` is set."""

    armed = False
    fail_at = 7

    def caption(self, index, fields):
        if _FlakySplit.armed and index == _FlakySplit.fail_at:
            _FlakySplit.armed = False
            raise RuntimeError("simulated crash while reading the data")
        return super().caption(index, fields)


class _FlakyDataset(_PoisonedDataset):
    def split(self, name):
        return _FlakySplit(self._inner.split(name)) if name == "train" else self._inner.split(name)


# Slow: a mid-epoch resume from a step checkpoint to the uninterrupted run's results and
# rows is tested in the default run by test_faults.py::test_mid_pass_resume_logs_the_rows...
# and test_plans.py::test_resume_mid_pass_gives_the_uninterrupted_run.
@pytest.mark.slow
def test_mid_epoch_crash_resumes_from_step_checkpoint(tmp_path):
    sources.register("flaky_synthetic")(_FlakyDataset)
    config = tiny(load_config("vse", "synthetic"), epochs=2)
    config.data.name = "flaky_synthetic"
    config.train.checkpoint_every_steps = 3
    _FlakySplit.armed = False
    straight = train_and_evaluate(config, str(tmp_path / "straight"))

    # Fail on a caption read late in epoch 1 (batch 8 of 10), past Grain's read-ahead.
    _FlakySplit.fail_at = int(np.random.default_rng((config.seed, 1)).permutation(320)[260])

    def arm(epoch, metrics):
        _FlakySplit.armed = True

    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_evaluate(config, str(tmp_path / "resumed"), callbacks=[arm])
    steps = sorted(int(s) for s in os.listdir(tmp_path / "resumed" / "checkpoints" / "latest"))
    assert steps and steps[-1] > 10  # a mid-epoch checkpoint of epoch 1 (10 steps per epoch)
    resumed = train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed == pytest.approx(straight, abs=1e-9)


def _refreshing_method(*, num_networks=2):
    """A toy method that exercises the per-epoch path: stats pass, refresh, fetch, phases."""
    vse = methods.build_method("vse", {"num_networks": num_networks})

    def init_memory(ctx):
        return base.Memory(
            samples={"pair_sim": jnp.zeros(ctx.num_samples)},
            state={"fetched": jnp.full(3, -1, jnp.int32)},
        )

    def stats_fn(outputs, batch, rows):  # rows: the memory's stats_rows at the batch's pairs
        return {
            "index": batch["index"],
            "pair_sim": jnp.diagonal(outputs["sim"]),
            "remembered": rows["pair_sim"],
        }

    def refresh_fn(memory, stats, ctx):
        n, before = memory.samples["pair_sim"].shape[0], memory.samples["pair_sim"]
        wanted = np.array([0, 5, ctx.epoch])
        fetched = ctx.fetch(wanted)
        memory = base.Memory(
            samples={"pair_sim": stats["pair_sim"]},
            state={"fetched": fetched["index"].astype(jnp.int32)},
        )
        diagnostics = {
            "order_ok": float(np.array_equal(np.asarray(stats["index"]), np.arange(n))),
            "fetch_ok": float(np.array_equal(np.asarray(fetched["index"]), wanted)),
            "rows_ok": float(np.array_equal(stats["remembered"], before)),
            "held_out": -1.0 if ctx.held_out is None else ctx.held_out(),
            "network": float(ctx.network),
            "mean_pair_sim": float(stats["pair_sim"].mean()),
        }
        return memory, diagnostics

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        loss, _ = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        phase = jnp.full(loss.shape, float(ctx.phase))
        return loss, base.Aux(metrics={"phase": phase, "remembered": rows["pair_sim"]})

    return vse._replace(
        name="refreshing",
        init_memory=init_memory,
        loss_fn=loss_fn,
        stats_fn=stats_fn,
        stats_rows=("pair_sim",),
        refresh_fn=refresh_fn,
        plan_fn=lambda epoch: base.EpochPlan(phase=int(epoch > 0), refresh=epoch > 0),
    )


def _refreshing_config():
    """Three epochs of the refreshing method on the flaky synthetic data (never armed, it
    reads as the synthetic data)."""
    config = tiny(load_config("vse", "synthetic"), epochs=3)
    config.data.name = "flaky_synthetic"
    config.method = "refreshing"
    config.method_kwargs = ml_collections.ConfigDict({"num_networks": 2})
    config.train.num_devices = 1  # sharded refreshes: test_ncr.py::test_one_device_equals_eight
    return config


@pytest.fixture(scope="module")
def refreshing_run(tmp_path_factory):
    """The uninterrupted run of ``_refreshing_config()``: (config, results, workdir)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(methods.REGISTRY, "refreshing", _refreshing_method)
        sources.register("flaky_synthetic")(_FlakyDataset)
        _FlakySplit.armed = False
        config = _refreshing_config()
        workdir = tmp_path_factory.mktemp("refreshing") / "straight"
        results = train_and_evaluate(config, str(workdir))
    return config, results, workdir


@pytest.mark.heavy
def test_refresh_runs_stats_pass_per_network_with_phases(refreshing_run):
    _, _, workdir = refreshing_run
    rows = read_metrics(workdir)
    refresh = [r for r in rows if r["split"] == "refresh"]
    assert [r["epoch"] for r in refresh] == [1, 2]  # not before the first epoch
    for r in refresh:
        assert r["order_ok_net0"] == r["order_ok_net1"] == 1.0
        assert r["fetch_ok_net0"] == r["fetch_ok_net1"] == 1.0
        assert r["rows_ok_net0"] == r["rows_ok_net1"] == 1.0  # the memory before the refresh
        # the validation split's share under the model the refresh sees: the last epoch's
        (val,) = [v for v in rows if v["split"] == "val" and v["epoch"] == r["epoch"] - 1]
        assert 0 <= r["held_out_net0"] == r["held_out_net1"] <= 1
        assert r["held_out_net0"] == pytest.approx(val["noise_share_estimate"], abs=1e-6)
        assert (r["network_net0"], r["network_net1"]) == (0.0, 1.0)
        assert r["mean_pair_sim_net0"] != r["mean_pair_sim_net1"]  # each network's own pass
    train = [r for r in rows if r["split"] == "train"]
    assert {r["phase"] for r in train if r["epoch"] == 0} == {0.0}
    assert {r["phase"] for r in train if r["epoch"] > 0} == {1.0}
    assert all(r["remembered"] == 0.0 for r in train if r["epoch"] == 0)
    assert all(r["remembered"] != 0.0 for r in train if r["epoch"] > 0)


def test_rerunning_a_finished_run_reevaluates_without_duplicate_rows(tmp_path):
    config = tiny(load_config("vse", "synthetic"), epochs=1)
    config.train.num_devices = 1
    first = train_and_evaluate(config, str(tmp_path))
    rows = read_metrics(tmp_path)
    again = train_and_evaluate(config, str(tmp_path))
    assert again == pytest.approx(first, abs=1e-9)
    assert read_metrics(tmp_path) == rows


@pytest.mark.heavy
def test_crashes_leave_no_duplicate_or_stale_rows(refreshing_run, tmp_path, monkeypatch):
    """A crash before the first checkpoint, and one inside an epoch that began with a refresh."""
    monkeypatch.setitem(methods.REGISTRY, "refreshing", _refreshing_method)
    sources.register("flaky_synthetic")(_FlakyDataset)
    config, straight, workdir = refreshing_run
    late_in_epoch = int(np.random.default_rng((config.seed, 1)).permutation(320)[260])
    _FlakySplit.armed = False
    expected = read_metrics(workdir)

    def arm(epoch, metrics):
        _FlakySplit.armed = True

    # Crash in epoch 0, before any checkpoint; then in epoch 1, after its refresh was logged.
    _FlakySplit.fail_at, _FlakySplit.armed = late_in_epoch, True
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_evaluate(config, str(tmp_path / "resumed"))
    assert not os.path.exists(tmp_path / "resumed" / "checkpoints" / "latest" / "10")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_evaluate(config, str(tmp_path / "resumed"), callbacks=[arm])
    resumed = train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed == pytest.approx(straight, abs=1e-9)
    rows = read_metrics(tmp_path / "resumed")
    key = lambda r: (r["split"], r["step"])
    assert sorted(map(key, rows)) == sorted(map(key, expected))
    for got, want in zip(sorted(rows, key=key), sorted(expected, key=key), strict=True):
        for name, value in want.items():
            if name not in loop.WALL_CLOCK:
                assert got[name] == pytest.approx(value, abs=1e-9), (got["split"], name)


@pytest.mark.slow
def test_vse_sgr_baseline_trains_on_synthetic_regions_and_tokens(tmp_path):
    """The SGRAF backbone learns through the same region/token path as the real benchmarks."""
    config = load_config("vse", "synthetic,quick")
    config.model.head = "sgr"  # sigmoid output, as SGRAF
    config.model.embed_dim, config.model.tokens.word_dim, config.model.sgraf.sim_dim = 128, 64, 64
    config.method_kwargs.negatives = "sum"  # hardest negatives need far more epochs
    config.noise.kind = "none"
    config.data.num_train, config.data.num_val, config.data.num_test = 300, 64, 64
    config.train.epochs, config.train.batch_size = 4, 64
    config.train.num_devices = 1  # 8 fake devices on 2 cores only add overhead here
    config.optim.learning_rate = 2e-3
    config.train.progress_bar = False
    results = train_and_evaluate(config, str(tmp_path))
    assert results["rsum"] > 3 * chance_rsum(64, 5), results
