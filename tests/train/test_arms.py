"""``train.division='race'`` (``ncljax.train.arms``): the method trained divided and
undivided, the division kept where it validates higher beyond the split's noise; the
audit and retrieval read the winner's model; ``'off'`` and ``'race'`` refused where no
division has a switch."""

import json
import os

import numpy as np
import pytest

from ncljax import audit, retrieve
from ncljax.config import fields
from ncljax.data import vectors
from ncljax.train import arms, train_and_evaluate
from tests.train.test_loop import load_config, read_metrics


def _read(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "divided, undivided, won",
    [
        (200.0, 210.0, True),
        (210.0, 200.0, False),
        (200.0, 200.0, False),  # a tie keeps the division
        (377.3333333333333, 377.33333333333337, False),  # so does round-off (measured)
    ],
)
def test_the_run_that_validates_higher_wins(tmp_path, divided, undivided, won):
    config = load_config("gsc", "vectors")
    trained = []

    def train(c, workdir):
        trained.append((c.train.division, workdir))
        value = undivided if c.train.division == "off" else divided
        return {"rsum": value + 1.0, "val_rsum": value, "best_epoch": 3}

    results = arms.race(config, str(tmp_path), train, "rsum")
    assert trained == [("race", str(tmp_path)), ("off", str(tmp_path / "undivided"))]
    assert results["race_undivided"] == float(won)
    assert results["race_same_run"] == 0.0  # the divided run logged no refresh: both trained
    assert results["rsum"] == (undivided if won else divided) + 1.0
    assert (results["race_val_rsum_divided"], results["race_val_rsum_undivided"]) == (
        divided,
        undivided,
    )
    assert _read(tmp_path / "results.json") == results
    assert arms.model_workdir(str(tmp_path)) == str(tmp_path / "undivided" if won else tmp_path)


def test_paired_p_value_is_students_one_sided_test_of_the_differences():
    # Closed forms of Student's t upper tail: df = 1, p = 1/2 - atan(t) / pi; df = 2,
    # p = 1/2 - t / (2 sqrt(2 + t^2)); t = mean(d) / (sd(d) / sqrt(n)).
    base = np.array([10.0, 20.0, 30.0])
    d = np.array([1.0, 2.0, 3.0])  # mean 2, sd 1: t = 2 sqrt(3)
    t = 2.0 * np.sqrt(3.0)
    want = 0.5 - t / (2.0 * np.sqrt(2.0 + t * t))
    assert arms.paired_p_value(base + d, base) == pytest.approx(want, rel=1e-9)
    assert arms.paired_p_value(base, base + d) == pytest.approx(1.0 - want, rel=1e-9)
    d = np.array([0.5, 3.5])  # mean 2, sd 2.1213: t = 2 / (1.5) = 1.3333
    t = 2.0 / (np.std(d, ddof=1) / np.sqrt(2.0))
    want = 0.5 - np.arctan(t) / np.pi
    assert arms.paired_p_value(base[:2] + d, base[:2]) == pytest.approx(want, rel=1e-9)
    assert arms.paired_p_value(base, base) == 1.0  # the same retrieval: no evidence
    with pytest.raises(ValueError, match="not paired"):
        arms.paired_p_value(base, base[:2])


def _shares_trainer(divided, undivided, trained):
    """A stub ``train`` whose runs write validation shares and return their sums."""

    def train(c, workdir):
        trained.append(c.train.division)
        shares = np.asarray(undivided if c.train.division == "off" else divided, float)
        os.makedirs(workdir, exist_ok=True)
        arms.write_shares(workdir, shares)
        return {"rsum": float(shares.sum()) + 1.0, "val_rsum": float(shares.sum())}

    return train


# 100 images, the divided run 2 rSum higher: on 10 images (p = 0.0006), or by 12 on 20
# images and -10 on 20 others (p = 0.29, a coin on a split this small).
FEW = np.r_[np.full(10, 0.2), np.zeros(90)]
MIXED = np.r_[np.full(20, 0.6), np.full(20, -0.5), np.zeros(60)]


@pytest.mark.parametrize(
    "gain, alpha, won",
    [
        (FEW, 0.05, False),  # the division validates higher beyond the noise: kept
        (MIXED, 0.05, True),
        (MIXED, 0.2, True),
        (MIXED, 0.5, False),  # at 0.5 the higher rSum wins
        (-FEW, 0.5, True),
        (np.zeros(100), 0.5, True),  # the same retrieval: nothing earns the division
    ],
)
def test_the_division_is_kept_only_beyond_the_splits_noise(tmp_path, gain, alpha, won):
    config = load_config("gsc", "vectors")
    config.train.race_alpha = alpha
    undivided = np.random.default_rng(0).uniform(0, 6, 100)
    trained = []
    train = _shares_trainer(undivided + gain, undivided, trained)
    results = arms.race(config, str(tmp_path), train, "rsum")
    assert trained == ["race", "off"]
    assert results["race_undivided"] == float(won)
    t = gain.mean() / (gain.std(ddof=1) / 10.0) if gain.any() else 0.0  # the t statistic
    p = results["race_p_value"]
    assert p == pytest.approx(arms.paired_p_value(undivided + gain, undivided))
    assert (p < 0.5) == (t > 0) and (p < alpha) != won
    assert results["rsum"] == pytest.approx((undivided if won else undivided + gain).sum() + 1)
    assert _read(tmp_path / "results.json") == results


def _write_metrics(workdir, rows, tail=""):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(tail)


VAL = {"split": "val", "step": 10, "rsum": 100.0}
OFF2 = {"split": "refresh", "step": 10, "division_off_net0": 1.0, "division_off_net1": 1.0}


@pytest.mark.parametrize(
    "rows, tail, never",
    [
        ([VAL, OFF2, VAL, {**OFF2, "step": 20}], "", True),
        ([{"split": "refresh", "step": 10, "division_off": 1.0}], "", True),  # one network
        ([VAL, OFF2, {**OFF2, "step": 20, "division_off_net1": 0.0}], "", False),
        ([VAL, {"split": "refresh", "step": 10, "division_off": 0.0}, OFF2], "", False),
        ([VAL], "", False),  # no refresh: nothing to go by
        ([{"split": "refresh", "step": 10, "clean_fraction": 0.4}], "", False),  # no switch
        ([VAL, OFF2], '{"split": "refr', False),  # a damaged line
    ],
)
def test_never_divided_reads_every_refresh_of_the_run(tmp_path, rows, tail, never):
    _write_metrics(str(tmp_path), rows, tail)
    assert arms.never_divided(str(tmp_path)) is never
    assert arms.never_divided(str(tmp_path / "absent")) is False


def test_a_run_that_never_divided_is_its_own_undivided_run(tmp_path):
    config = load_config("ncr", "vectors")
    trained = []

    def train(c, workdir):
        trained.append(c.train.division)
        _write_metrics(workdir, [VAL, OFF2, {**OFF2, "step": 20}])
        return {"rsum": 401.0, "val_rsum": 380.0, "best_epoch": 3}

    results = arms.race(config, str(tmp_path), train, "rsum")
    assert trained == ["race"]  # the undivided run is not trained
    assert not os.path.exists(tmp_path / "undivided")
    assert results == {
        "rsum": 401.0,
        "val_rsum": 380.0,
        "best_epoch": 3,
        "race_undivided": 0.0,
        "race_same_run": 1.0,
        "race_val_rsum_divided": 380.0,
        "race_val_rsum_undivided": 380.0,
    }
    assert _read(tmp_path / "results.json") == results
    assert arms.model_workdir(str(tmp_path)) == str(tmp_path)


def test_model_workdir_of_a_run_that_did_not_race_or_has_not_finished(tmp_path):
    assert arms.model_workdir(str(tmp_path)) == str(tmp_path)  # no results.json yet
    (tmp_path / "results.json").write_text("{not json")
    assert arms.model_workdir(str(tmp_path)) == str(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"rsum": 1.0}))
    assert arms.model_workdir(str(tmp_path)) == str(tmp_path)


def test_the_undivided_run_of_a_race_at_another_level_is_a_valid_config(tmp_path):
    config = load_config("gsc", "vectors")
    config.train.race_alpha = 0.2
    other = arms.undivided_config(config)
    assert other.train.division == "off" and other.train.race_alpha == 0.05
    assert fields.value_problems(other) == []


def test_race_alpha_is_a_level_read_by_a_race_alone():
    config = load_config("gsc", "vectors")
    config.train.race_alpha = 0.5
    assert fields.value_problems(config) == []
    config.train.race_alpha = 0.0
    (problem,) = fields.value_problems(config)
    assert "train.race_alpha=0.0 must be in (0, 0.5]" in problem
    config = load_config("gsc", "synthetic")  # division 'on': the level is not read
    config.train.race_alpha = 0.1
    (problem,) = fields.value_problems(config)
    assert "only read with train.division='race', not 'on'" in problem


@pytest.mark.parametrize(
    "method, arg, division, expected",
    [
        ("infonce", "vectors", "race", "infonce has none to switch: use it with ncr, gsc"),
        ("gsc", "synthetic", "off", "noise_share='none' cannot: set method_kwargs.noise_share"),
        ("gsc", "vectors", "sometimes", "train.division='sometimes' must be one of"),
    ],
)
def test_a_division_that_cannot_be_switched_off_is_refused(method, arg, division, expected):
    config = load_config(method, arg)
    config.train.division = division
    problems = fields.value_problems(config)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_vectors_settings_race_every_dividing_method():
    for method in ("gsc", "ncr", "srem", "ugncl", "pc2"):
        assert load_config(method, "vectors").train.division == "race"
        assert load_config(method, "synthetic").train.division == "on"  # the paper protocol
    assert load_config("infonce", "vectors").train.division == "on"


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """A finished race of GSC's :vectors settings on a small folder whose pairs lie."""
    root = tmp_path_factory.mktemp("race")
    folder = str(root / "pairs")
    vectors.from_synthetic(folder, num_train=160, num_val=40, num_test=40, noise_rate=0.4)
    config = load_config("gsc", "vectors")
    config.data.folder = folder
    config.train.epochs, config.train.batch_size = 3, 32
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = str(root / "run")
    return config, workdir, train_and_evaluate(config, workdir)


@pytest.mark.heavy  # two 3-epoch runs: about 17 s on 2 cores
def test_a_race_trains_both_runs_and_keeps_the_winners_figures(raced):
    config, workdir, results = raced
    divided = _read(os.path.join(workdir, arms.DIVIDED_RESULTS))
    undivided_dir = os.path.join(workdir, arms.UNDIVIDED)
    undivided = _read(os.path.join(undivided_dir, "results.json"))
    assert _read(os.path.join(undivided_dir, "config.json"))["train"]["division"] == "off"
    assert _read(os.path.join(workdir, "config.json"))["train"]["division"] == "race"
    # each run wrote its best model's validation shares, which sum to its validation rSum
    shares = arms.read_shares(workdir), arms.read_shares(undivided_dir)
    assert shares[0].shape == shares[1].shape == (40,)
    assert shares[0].sum() == pytest.approx(divided["val_rsum"], abs=1e-6)
    assert shares[1].sum() == pytest.approx(undivided["val_rsum"], abs=1e-6)
    p = arms.paired_p_value(shares[0], shares[1])  # that the divided run validates higher
    won = not p < config.train.race_alpha
    assert results == _read(os.path.join(workdir, "results.json"))
    assert results["race_undivided"] == float(won)
    assert results["race_p_value"] == p
    winner = undivided if won else divided
    assert {k: v for k, v in results.items() if not k.startswith("race_")} == winner
    # the undivided run divided nothing: every refresh switched the division off, the
    # validation split unasked; the divided run's first refresh divided (40% lie)
    refreshes = [m for m in read_metrics(undivided_dir) if "division_off_net0" in m]
    assert len(refreshes) == 2  # epochs 1 and 2
    assert all(m[f"division_off_net{k}"] == 1.0 for m in refreshes for k in (0, 1))
    assert not any(k.startswith("held_out_share") for m in refreshes for k in m)
    first = next(m for m in read_metrics(workdir) if "division_off_net0" in m)
    assert first["division_off_net0"] == 0.0
    # a rerun resumes both finished runs to the same figures
    again = train_and_evaluate(config, workdir)
    assert again == results


@pytest.mark.heavy
def test_the_audit_and_retrieval_read_the_winners_model(raced):
    _, workdir, results = raced
    path = os.path.join(workdir, "results.json")
    undivided_dir = os.path.join(workdir, arms.UNDIVIDED)
    for won in (0.0, 1.0):  # each winner in turn (the race's own outcome is either)
        with open(path, "w") as f:
            json.dump({**results, "race_undivided": won}, f)
        source = undivided_dir if won else workdir
        scores = audit.pair_scores(workdir)
        alone = audit.pair_scores(source)
        np.testing.assert_array_equal(scores.clean_score, alone.clean_score)
        assert any("undivided run validated higher" in n for n in scores.notes) == bool(won)
        loaded = retrieve.load(workdir, "test")
        assert loaded.workdir == source
    with open(path, "w") as f:
        json.dump(results, f)


class _Crash(Exception):
    pass


@pytest.mark.heavy  # a race stopped in its undivided run, then resumed: about 25 s
def test_a_race_stopped_in_its_undivided_run_resumes_to_the_same_figures(raced, tmp_path):
    config, _, results = raced
    epochs = []

    def crash_in_the_undivided_run(epoch, metrics):
        epochs.append(epoch)
        if len(epochs) == config.train.epochs + 2:  # the undivided run's second epoch
            raise _Crash

    workdir = str(tmp_path / "run")
    with pytest.raises(_Crash):
        train_and_evaluate(config, workdir, callbacks=[crash_in_the_undivided_run])
    assert epochs == [0, 1, 2, 0, 1]
    assert os.path.exists(os.path.join(workdir, arms.DIVIDED_RESULTS))
    assert not os.path.exists(os.path.join(workdir, "results.json"))  # no winner yet
    assert not os.path.exists(os.path.join(workdir, arms.UNDIVIDED, "results.json"))
    assert arms.model_workdir(workdir) == workdir
    resumed = []
    again = train_and_evaluate(config, workdir, callbacks=[lambda e, m: resumed.append(e)])
    assert resumed == [2]  # the finished divided run trains nothing; the other resumes
    assert again == results


@pytest.fixture(scope="module")
def clean_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("clean") / "pairs")
    vectors.from_synthetic(folder, num_train=160, num_val=40, num_test=40, noise_rate=0.0)
    return folder


@pytest.mark.heavy  # two 3-epoch runs a method: about 60 s on 2 cores
@pytest.mark.parametrize("method", ["gsc", "ncr", "pc2", "srem"])
def test_a_race_whose_division_was_always_off_equals_its_undivided_run(
    clean_folder, tmp_path, method
):
    """The shortcut's premise, per method: a divided run whose switch turned its division
    off at every refresh (here forced: ``noise_floor=1.0``) trains exactly as the run with
    ``train.division='off'``."""
    config = load_config(method, "vectors")
    config.data.folder = clean_folder
    config.train.epochs, config.train.batch_size = 3, 32
    config.train.num_devices, config.train.progress_bar = 1, False
    config.method_kwargs.warmup_epochs = 1
    config.method_kwargs.noise_floor = 1.0
    results = train_and_evaluate(config, str(tmp_path / "race"))
    assert results["race_same_run"] == 1.0
    assert not os.path.exists(tmp_path / "race" / arms.UNDIVIDED)
    undivided = train_and_evaluate(arms.undivided_config(config), str(tmp_path / "off"))
    assert {k: v for k, v in results.items() if not k.startswith("race_")} == undivided
    val = lambda w: [(m["step"], m["rsum"]) for m in read_metrics(w) if m["split"] == "val"]
    assert val(str(tmp_path / "race")) == val(str(tmp_path / "off"))
