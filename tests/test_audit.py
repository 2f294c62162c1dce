"""``python -m ncljax.audit``: a run's verdict on each training pair, exported.

Tiny GSC and NCR runs on the synthetic data (module-scoped: trained once) are audited and
the exported scores checked against an independent pairwise AUC and the run's own
``noise_auc``; the ground-truth noise is rebuilt from the run's config with
``ncljax.data.noise`` (it is deterministic in ``noise.seed``), never read by the audit.
"""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ncljax import audit, models
from ncljax.data import noise, pipeline, sources
from ncljax.methods import coteaching, ugncl
from ncljax.train import ensemble, train_and_evaluate, trajectory
from tests.train.test_faults import _truncate
from tests.train.test_loop import ROOT, load_config, read_metrics, tiny


def _train(workdir, name, *, epochs=2, **sizes):
    config = tiny(load_config(name, "synthetic,quick"), epochs=epochs)
    config.train.num_devices = 1
    for field, value in sizes.items():
        setattr(config.data, field, value)
    train_and_evaluate(config, str(workdir))
    return str(workdir)


class _Runs(dict):
    """Finished tiny runs, each trained when a test first asks for it: GSC+ (2 networks,
    2 epochs), NCR (a warm-up epoch, then co-divide)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, method):
        epochs = {"gsc": 2, "ncr": 3}[method]
        self[method] = _train(self.root / method, method, epochs=epochs)
        return self[method]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory.mktemp("audit"))


def _pairwise_auc(score, clean):
    """P(a clean pair scores above a noisy one), ties 1/2: every clean-noisy pair compared."""
    above = score[clean][:, None] > score[~clean][None, :]
    tied = score[clean][:, None] == score[~clean][None, :]
    return (above.sum() + 0.5 * tied.sum()) / above.size


def _true_clean(workdir):
    """The run's ground truth: which training caption kept its own image."""
    config = ensemble.load_config(workdir)
    split = sources.load_dataset(config.data).split("train")
    made = noise.correspondence_noise(
        split.num_captions,
        split.captions_per_image,
        rate=config.noise.rate,
        seed=config.noise.seed,
        protocol=config.noise.kind,
        exact=config.noise.pairs.exact,
    )
    return made.image_index == np.arange(split.num_captions) // split.captions_per_image


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _scores_by_index(rows, column="clean_score"):
    score = np.full(len(rows), np.nan)
    for row in rows:
        score[int(row["index"])] = float(row[column])
    return score


def _best_model_similarity(workdir):
    """The similarity the run's best model gives each training pair, read off the whole
    ``[images, captions]`` similarity matrix of the training split (the evaluator's
    retrieval path), at the image each caption was trained with."""
    import jax

    from ncljax.train import mesh as mesh_lib

    config = ensemble.load_config(workdir)
    split = sources.load_dataset(config.data).split("train")
    mesh = mesh_lib.evaluation_mesh(config)
    with jax.set_mesh(mesh):
        evaluator, state = ensemble.load_run(workdir, mesh)
        enc = evaluator.encode(state, "train")
        full = np.asarray(enc.sim_fn(enc.params, enc.images, enc.texts), np.float64)
    image_index = pipeline.paired_images(split, config.noise)
    return full[image_index, np.arange(split.num_captions)]


def _results(workdir):
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("method", ["gsc", "ncr"])
def test_one_row_per_training_pair_sorted_by_rank(runs, method):
    workdir = runs[method]
    summary = audit.audit(workdir)
    rows = _read_csv(os.path.join(workdir, "audit", "pairs.csv"))
    clean = _true_clean(workdir)
    assert len(rows) == clean.size == summary["num_pairs"]
    assert [int(r["rank"]) for r in rows] == list(range(1, clean.size + 1))
    assert sorted(int(r["index"]) for r in rows) == list(range(clean.size))
    # Most suspicious first: scores never fall along the ranks, ties in index order.
    keys = [(float(r["clean_score"]), int(r["index"])) for r in rows]
    assert keys == sorted(keys)
    assert {r["image_id"] for r in rows} == {r["caption"] for r in rows} == {""}
    with open(os.path.join(workdir, "audit", "pairs.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert [str(v) for row in lines for v in row.values()] == [
        v for row in rows for v in row.values()
    ]
    assert os.path.getsize(os.path.join(workdir, "audit", "scores.png")) > 0


@pytest.mark.parametrize("method", ["gsc", "ncr"])
def test_exported_scores_give_the_runs_own_noise_auc(runs, method):
    """``method_score`` is the method's own belief (the run's ``noise_auc``); with
    ``rank_by='method'`` it is also ``clean_score``, the one the ranks order."""
    workdir = runs[method]
    for rank_by, column in (("model", "method_score"), ("method", "clean_score")):
        summary = audit.audit(workdir, rank_by=rank_by)
        assert summary["ranked_by"] == rank_by
        rows = _read_csv(os.path.join(workdir, "audit", "pairs.csv"))
        assert ("method_score" in rows[0]) == (rank_by == "model")
        score = _scores_by_index(rows, column)
        clean = _true_clean(workdir)
        assert 0 < clean.sum() < clean.size and np.ptp(score) > 0
        auc = _pairwise_auc(score, clean)
        assert auc == pytest.approx(_results(workdir)["noise_auc"], abs=1e-9)
        if method == "ncr":  # co-divide after a warm-up finds the mismatched pairs
            assert auc > 0.6


@pytest.mark.parametrize("method", ["gsc", "ncr"])
def test_by_default_the_ranks_are_the_best_models_similarity_of_each_pair(runs, method):
    workdir = runs[method]
    summary = audit.audit(workdir)
    rows = _read_csv(os.path.join(workdir, "audit", "pairs.csv"))
    score = _scores_by_index(rows)
    np.testing.assert_allclose(score, _best_model_similarity(workdir), rtol=1e-5, atol=1e-6)
    assert summary["score"].startswith(audit.MODEL_SCORE)  # the ranks' order: the test above
    best_epoch = _results(workdir)["best_epoch"]
    best_step = [m for m in read_metrics(workdir) if m["split"] == "val"][best_epoch]["step"]
    assert summary["checkpoint"]["model_checkpoint"] == "best"
    assert summary["checkpoint"]["model_step"] == best_step
    with pytest.raises(ValueError, match="rank_by"):
        audit.pair_scores(workdir, rank_by="loss")


def test_the_record_names_the_final_checkpoint(runs, monkeypatch):
    workdir = runs["ncr"]
    # A method whose belief was measured weak on a real folder (UGNCL's caveat, here on
    # NCR's score): the record says so and what to use.
    caveat = ugncl.verdict(ugncl.Settings()).caveat
    assert "UGNCL's belief was weak" in caveat and "gsc.py:vectors" in caveat
    # measured with the trusted robust loss: the contrastive form (:vectors) has no caveat
    assert ugncl.verdict(ugncl.Settings(ranking="contrastive")).caveat == ""
    with_caveat = coteaching.verdict
    monkeypatch.setattr(coteaching, "verdict", lambda s: with_caveat(s)._replace(caveat=caveat))
    audit.audit(workdir)
    with open(os.path.join(workdir, "audit", "audit.json")) as f:
        record = json.load(f)
    last_val = [m for m in read_metrics(workdir) if m["split"] == "val"][-1]
    held = audit.separation_note(record["held_out"], "ncr")  # a tiny run: likely weak
    assert record["notes"] == [caveat] + ([held] if held else [])
    assert record["checkpoint"].pop("model_checkpoint") == "best"  # and its model_step
    assert record["checkpoint"].pop("model_step") <= last_val["step"]
    assert record["checkpoint"] == {
        "step": last_val["step"],
        "epochs_completed": 3,
        "num_epochs": 3,
        "mid_epoch": False,
        "finished": True,
    }
    assert record["method"] == "ncr" and record["threshold"] == 0.5
    own = _scores_by_index(_read_csv(os.path.join(workdir, "audit", "pairs.csv")), "method_score")
    assert record["at_or_below_threshold"] == int((own <= 0.5).sum())


def _interrupted_copy(workdir, target):
    """``workdir`` as if killed before its last epoch: no results.json, only the older of
    the two checkpoints it keeps."""
    shutil.copytree(workdir, target, ignore=shutil.ignore_patterns("audit"))
    os.remove(target / "results.json")
    latest = target / "checkpoints" / "latest"
    steps = sorted(int(s) for s in os.listdir(latest))
    for step in steps[1:]:
        shutil.rmtree(latest / str(step))
    return str(target), steps


def test_an_interrupted_run_is_audited_from_its_last_checkpoint(runs, tmp_path):
    workdir, steps = _interrupted_copy(runs["ncr"], tmp_path / "ncr")
    scores = audit.pair_scores(workdir)
    checkpoint = dict(scores.checkpoint)
    assert checkpoint.pop("model_checkpoint") == "best" and "model_step" in checkpoint
    del checkpoint["model_step"]
    assert checkpoint == {
        "step": steps[0],
        "epochs_completed": 2,
        "num_epochs": 3,
        "mid_epoch": False,
        "finished": False,
    }
    # The checkpoint holds the memory its epoch's validation line was scored on.
    val = next(m for m in read_metrics(workdir) if m["split"] == "val" and m["epoch"] == 1)
    assert val["step"] == steps[0]
    clean = _true_clean(workdir)
    assert np.ptp(scores.method_score) > 0
    assert _pairwise_auc(scores.method_score, clean) == pytest.approx(val["noise_auc"], abs=1e-9)
    assert not os.path.exists(os.path.join(workdir, "audit"))  # pair_scores writes nothing


def test_a_damaged_newest_checkpoint_falls_back_with_a_note(runs, tmp_path):
    workdir = tmp_path / "ncr"
    shutil.copytree(runs["ncr"], workdir)
    latest = workdir / "checkpoints" / "latest"
    steps = sorted(int(s) for s in os.listdir(latest))
    _truncate(latest / str(steps[-1]) / "meta" / "metadata")
    scores = audit.pair_scores(str(workdir))
    assert scores.checkpoint["step"] == steps[0]
    assert f"step {steps[-1]} cannot be read" in scores.notes[0]
    held = audit.separation_note(scores.held_out, "ncr")
    assert len(scores.notes) == 1 + (held is not None)  # and the held-out note of a tiny run
    assert sorted(int(s) for s in os.listdir(latest)) == steps  # read only: nothing moved


def test_a_run_without_a_checkpoint_is_one_error(tmp_path):
    config = load_config("gsc", "synthetic,quick")
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    with pytest.raises(FileNotFoundError, match="no checkpoint yet"):
        audit.pair_scores(str(tmp_path))


@pytest.mark.parametrize("method", ["vse", "infonce", "ce"])
def test_a_baseline_scores_no_pair(tmp_path, method):
    config = load_config(method, "synthetic")
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    with pytest.raises(audit.NothingToAudit, match=f"{method} is a baseline"):
        audit.audit(str(tmp_path))
    assert not os.path.exists(tmp_path / "audit")


def _cli(workdir):
    out = subprocess.run(
        [sys.executable, "-m", "ncljax.audit", f"--workdir={workdir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return out.returncode, out.stdout, out.stderr


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_command_line(runs, tmp_path):
    code, stdout, stderr = _cli(runs["gsc"])
    assert code == 0, stderr[-3000:]
    assert stdout.startswith("Audit of gsc (finished; step ") and "pairs.csv" in stdout
    assert stderr == ""  # no orbax log lines

    (tmp_path / "vse").mkdir()
    config = load_config("vse", "synthetic")
    (tmp_path / "vse" / "config.json").write_text(config.to_json_best_effort())
    code, stdout, stderr = _cli(tmp_path / "vse")
    assert code == audit.NOTHING_TO_AUDIT == 3
    assert _one_line(stderr).startswith("vse is a baseline: it estimates nothing")

    code, _, stderr = _cli(tmp_path / "nowhere")
    assert code == 1
    assert _one_line(stderr) == (
        f"FileNotFoundError: --workdir={tmp_path / 'nowhere'}: no such directory; give the "
        "directory of a train.py run (its --workdir)."
    )


def test_paired_images_are_those_the_trainer_reads():
    config = load_config("gsc", "synthetic,quick")
    config.data.num_train = 16
    split = sources.load_dataset(config.data).split("train")
    image_fields, text_fields = models.input_fields(config.model)
    pairs = pipeline.training_pairs(
        split, config.noise, num_classes=0, image_fields=image_fields, text_fields=text_fields
    )
    image_index = pipeline.paired_images(split, config.noise)
    assert (image_index != np.arange(split.num_captions) // split.captions_per_image).any()
    for k in range(split.num_captions):
        record = pairs.record_fn(k)
        image = split.image(int(image_index[k]), image_fields)
        for field in image_fields:
            np.testing.assert_array_equal(record[field], image[field])


def test_ranks_break_ties_by_confidence_then_index():
    score = np.array([0.5, 0.0, 0.0, 0.9, 0.0])
    assert audit.rank_of(score).tolist() == [4, 1, 2, 5, 3]
    confidence = np.array([0.1, 0.2, 0.9, 0.5, 0.2])
    assert audit.rank_of(score, confidence).tolist() == [4, 2, 1, 5, 3]


def test_noisy_label_run_exports_observed_and_corrected_labels(tmp_path):
    workdir = _train(tmp_path / "uot_rcl", "uot_rcl", epochs=3, num_train=100)
    summary = audit.audit(workdir)
    rows = _read_csv(os.path.join(workdir, "audit", "pairs.csv"))
    assert list(rows[0]) == list(audit.PAIR_FIELDS + audit.LABEL_FIELDS)
    config = ensemble.load_config(workdir)
    dataset = sources.load_dataset(config.data)
    split = dataset.split("train")
    assert len(rows) == split.num_captions == summary["num_pairs"]
    rows.sort(key=lambda r: int(r["index"]))
    image_fields, text_fields = models.input_fields(config.model)
    pairs = pipeline.training_pairs(
        split,
        config.noise,
        num_classes=dataset.info.num_classes,
        image_fields=image_fields,
        text_fields=text_fields,
    )
    observed = np.array([int(r["observed_label_text"]) for r in rows])
    np.testing.assert_array_equal(observed, pairs.labels_text)
    true = split.image_labels()[np.arange(split.num_captions) // split.captions_per_image]
    assert (observed != true).any()
    # The exported corrected labels score as the trainer's label diagnostics of the run's
    # last epoch (the same memory).
    corrected = np.array([int(r["corrected_label"]) for r in rows])
    trusted = np.array([r["trusted"] == "True" for r in rows])
    last = [m for m in read_metrics(workdir) if m["split"] == "val"][-1]
    assert trusted.mean() == pytest.approx(last["selected_fraction"])
    assert (corrected == true)[trusted].mean() == pytest.approx(last["corrected_accuracy"])
    confidence = np.array([float(r["confidence"]) for r in rows])
    assert ((confidence >= 0) & (confidence <= 1 + 1e-6)).all()


@pytest.fixture(scope="module")
def lying_folder(tmp_path_factory):
    """A vectors folder whose training split holds 40% mismatched captions, and the mask."""
    vectors = pytest.importorskip("ncljax.data.vectors")
    folder = str(tmp_path_factory.mktemp("vectors"))
    mismatched = vectors.from_synthetic(
        folder, num_train=64, num_val=16, num_test=16, noise_rate=0.4, seed=0
    )
    return folder, mismatched


def test_a_vectors_run_exports_its_ids_and_captions(lying_folder, tmp_path):
    from ncljax.data import vectors

    folder, mismatched = lying_folder
    config = load_config("gsc", "vectors,quick")
    config.data.folder = folder
    config.train.epochs = 2  # GSC divides from its second epoch
    config.train.division = "on"  # one run (the race: tests/train/test_arms.py)
    config.train.batch_size = config.eval.batch_size = 32
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    summary = audit.audit(workdir)
    rows = _read_csv(os.path.join(workdir, "audit", "pairs.csv"))
    assert len(rows) == mismatched.size
    # The :vectors settings record each pair's similarity after every epoch, and the
    # ranks follow its mean over the epochs up to the best model's; the best model's own
    # similarity is the model_score column.
    best_epoch = _results(workdir)["best_epoch"]
    files = [np.load(trajectory.epoch_path(workdir, e)) for e in range(config.train.epochs)]
    assert summary["ranked_by"] == "trajectory"
    assert summary["checkpoint"]["trajectory_epochs"] == best_epoch + 1
    want = np.mean(np.stack(files[: best_epoch + 1]).astype(np.float64), 0)
    np.testing.assert_allclose(_scores_by_index(rows), want, rtol=1e-6, atol=1e-7)
    best = _best_model_similarity(workdir)
    np.testing.assert_allclose(_scores_by_index(rows, "model_score"), best, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(files[best_epoch], best, rtol=1e-5, atol=1e-6)
    by_model = audit.pair_scores(workdir, rank_by="model")
    assert by_model.ranked_by == "model" and by_model.model_score is None
    np.testing.assert_allclose(by_model.clean_score, best, rtol=1e-5, atol=1e-6)
    os.remove(trajectory.epoch_path(workdir, 0))  # a file lost: the model ranks, and says so
    lost = audit.pair_scores(workdir)
    assert lost.ranked_by == "model"
    np.testing.assert_allclose(lost.clean_score, best, rtol=1e-5, atol=1e-6)
    assert any("epoch_0000.npy is missing" in note for note in lost.notes)
    image_ids, captions = vectors.display_texts(folder, "train")
    cpi = mismatched.size // len(image_ids)
    for row in rows:
        k = int(row["index"])
        assert (row["image_id"], row["caption"]) == (image_ids[k // cpi], captions[k])
    score = _scores_by_index(rows)
    assert np.ptp(score) > 0
    # The folder lies and the run does not know it: no noise_auc of its own.
    assert "noise_auc" not in _results(workdir)


def test_simulated_noise_on_vectors_names_the_image_each_pair_trained_with(lying_folder):
    from ncljax.data import vectors

    folder, _ = lying_folder
    config = load_config("gsc", "vectors,quick")
    config.data.folder = folder
    config.noise.kind, config.noise.rate, config.noise.seed = "per_caption", 0.5, 3
    split = sources.load_dataset(config.data).split("train")
    pairs = pipeline.training_pairs(
        split, config.noise, num_classes=0, image_fields=("global_image",), text_fields=()
    )
    image_ids, captions = audit._display(config, split)
    ids, lines = vectors.display_texts(folder, "train")
    assert list(captions) == list(lines)
    assert sum(a != ids[k // split.captions_per_image] for k, a in enumerate(image_ids)) > 0
    for k, image_id in enumerate(image_ids):  # the id of the image the record holds
        i = ids.index(image_id)
        np.testing.assert_array_equal(
            pairs.record_fn(k)["global_image"], split.image(i, ("global_image",))["global_image"]
        )


def test_without_matplotlib_the_tables_are_written(runs, monkeypatch):
    workdir = runs["gsc"]
    audit.audit(workdir)
    png = os.path.join(workdir, "audit", "scores.png")
    assert os.path.exists(png)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    result = audit.audit(workdir)
    assert result["plot_error"].startswith("scores.png needs matplotlib: pip install")
    assert "\n" not in result["plot_error"]
    assert set(result["paths"]) == {"pairs.csv", "pairs.jsonl", "audit.json"}
    assert not os.path.exists(png)  # not the plot of an earlier audit


def test_a_dataset_that_no_longer_gives_the_runs_pairs_is_refused(runs, tmp_path):
    workdir = tmp_path / "ncr"
    shutil.copytree(runs["ncr"], workdir, ignore=shutil.ignore_patterns("audit"))
    with open(workdir / "config.json") as f:
        config = json.load(f)
    config["noise"]["seed"] += 1  # as if the noise were drawn again
    (workdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no longer gives the run's training pairs"):
        audit.pair_scores(str(workdir))


def _scores(captions, image_ids, step=7):
    n = len(captions)
    return audit.PairScores(
        method="gsc",
        clean_score=np.linspace(-1.0, 1.0, n),
        rank=np.arange(1, n + 1),
        threshold=None,
        score="s",
        threshold_rule="r",
        image_ids=image_ids,
        captions=captions,
        labels=None,
        checkpoint={"step": step, "epochs_completed": 1, "num_epochs": 2},
        notes=(),
    )


def test_formulas_in_captions_are_text_in_the_csv_and_exact_in_the_jsonl(tmp_path):
    captions = [
        '=HYPERLINK("http://x","y")',
        "=cmd|' /C calc'!A0",
        "+1+2",
        "-3",
        "@SUM(A1)",
        "\tx",
        "a dog, =not at the start",
    ]
    ids = ["=id", "plain", "+p", "-m", "@a", "t", "ok"]
    paths = audit.write_tables(_scores(captions, ids), str(tmp_path))
    rows = _read_csv(paths["pairs.csv"])
    assert [r["caption"] for r in rows] == ["'" + c for c in captions[:6]] + [captions[6]]
    assert [r["image_id"] for r in rows] == ["'=id", "plain", "'+p", "'-m", "'@a", "t", "ok"]
    assert float(rows[0]["clean_score"]) == -1.0  # numbers are not text: never prefixed
    with open(paths["pairs.jsonl"], encoding="utf-8") as f:
        exact = [json.loads(line) for line in f]
    assert [r["caption"] for r in exact] == captions and [r["image_id"] for r in exact] == ids
    assert {r["step"] for r in exact} == {7} and {r["step"] for r in rows} == {"7"}


def _contents(folder):
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("fault", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_audit_stopped_while_writing_leaves_the_previous_one_whole(
    runs, tmp_path, monkeypatch, fault
):
    workdir = str(tmp_path / "gsc")
    shutil.copytree(runs["gsc"], workdir, ignore=shutil.ignore_patterns("audit"))
    audit.audit(workdir)
    out = os.path.join(workdir, "audit")
    before = _contents(out)
    written = []

    def failing(f):  # the second table fails after the first was written in full
        written.append(True)
        raise fault

    original = audit._replace
    monkeypatch.setattr(
        audit,
        "_replace",
        lambda path, fn: original(path, failing if path.endswith(".jsonl") else fn),
    )
    with pytest.raises(type(fault)) as e:
        audit.audit(workdir)
    assert written
    assert _contents(out) == before  # the old set, whole: no new pairs.csv beside it
    assert not [n for n in os.listdir(workdir) if n.startswith(".audit-")]
    if isinstance(fault, OSError):
        assert str(e.value).startswith(f"The audit could not be written into {out} (No space")
        assert "previous audit is kept whole" in str(e.value)


def test_what_a_killed_audit_left_is_removed_by_the_next(runs, tmp_path):
    workdir = str(tmp_path / "gsc")
    shutil.copytree(runs["gsc"], workdir, ignore=shutil.ignore_patterns("audit"))
    stale = os.path.join(workdir, ".audit-new-12345")
    os.makedirs(stale)
    open(os.path.join(stale, "pairs.csv"), "w").close()
    result = audit.audit(workdir)
    assert not os.path.exists(stale)
    step = result["checkpoint"]["step"]
    rows = _read_csv(os.path.join(workdir, "audit", "pairs.csv"))
    assert {r["step"] for r in rows} == {str(step)}
    with open(os.path.join(workdir, "audit", "audit.json")) as f:
        assert json.load(f)["checkpoint"]["step"] == step


def test_rows_in_chunks_are_the_rows_at_once():
    captions = [f"caption {k}" for k in range(11)]
    ids = [f"img{k % 4}" for k in range(11)]
    scores = _scores(captions, ids)._replace(
        rank=np.array([5, 1, 11, 2, 9, 3, 10, 4, 8, 6, 7]), raw_cosine=np.linspace(0, 1, 11)
    )
    whole = list(audit.rows(scores, chunk=11))
    assert [r["index"] for r in whole] == list(np.argsort(scores.rank))
    for chunk in (1, 3, 4, 64):
        assert list(audit.rows(scores, chunk=chunk)) == whole


def test_audit_json_holds_the_pair_auc_of_the_model_it_ranks_by(runs):
    """``held_out`` is the last validation row's ``pair_auc`` at or before the step of the
    model the ranking comes from (the best model's; the checkpoint's when ranked by the
    method), read back from ``metrics.jsonl``."""
    workdir = runs["gsc"]
    summary = audit.audit(workdir)
    val = [r for r in read_metrics(workdir) if r["split"] == "val"]
    step = summary["checkpoint"]["model_step"]
    last = max((r for r in val if r["step"] <= step), key=lambda r: r["step"])
    assert 0.5 <= last["pair_auc"] <= 1
    want = {"split": "val", "step": last["step"], "pair_auc": last["pair_auc"]}
    assert summary["held_out"] == want
    with open(os.path.join(workdir, "audit", "audit.json")) as f:
        assert json.load(f)["held_out"] == want


def test_held_out_is_that_of_the_model_the_ranking_comes_from(runs, tmp_path):
    """The tiny NCR run's best model is its epoch 1, its newest checkpoint epoch 2: the
    model's ranking reports the best model's validation, the method's ranking its
    checkpoint's (a model that memorises lies after its best epoch reads lower later)."""
    workdir = str(tmp_path / "ncr")
    shutil.copytree(runs["ncr"], workdir, ignore=shutil.ignore_patterns("audit"))
    by_model = audit.pair_scores(workdir, rank_by="model")
    by_method = audit.pair_scores(workdir, rank_by="method")
    model_step, step = by_model.checkpoint["model_step"], by_method.checkpoint["step"]
    assert model_step != step  # else this test could not tell the two apart
    val = {r["step"]: r["pair_auc"] for r in read_metrics(workdir) if r["split"] == "val"}
    for scores, at in ((by_model, model_step), (by_method, step)):
        last = max(s for s in val if s <= at)
        assert scores.held_out == {"split": "val", "step": last, "pair_auc": val[last]}


def test_held_out_separation_reads_the_last_validation_before_the_step(tmp_path):
    """Rows after the step, of other splits, without ``pair_auc`` or damaged are skipped;
    a weak separation gives a note naming its AUC, and a run without any gives None."""
    rows = [
        {"step": 10, "split": "val", "pair_auc": 0.9},
        {"step": 20, "split": "train", "pair_auc": 0.1},
        {"step": 20, "split": "val", "pair_auc": 0.71},
        {"step": 25, "split": "val", "pair_auc": None},
        {"step": 30, "split": "val", "pair_auc": 0.99},
        {"step": 30, "split": "test", "pair_auc": 0.2},
    ]
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, '{"step": 21, "split": "val", "pair_')  # a partly written line
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    got = audit.held_out_separation(str(tmp_path), step=29)
    assert got == {"split": "val", "step": 20, "pair_auc": 0.71}
    assert audit.held_out_separation(str(tmp_path), step=5) is None
    assert audit.held_out_separation(str(tmp_path / "none"), step=5) is None
    assert got["pair_auc"] < audit.WEAK_SEPARATION
    assert "AUC 0.71" in audit.weak_separation_note(got)


@pytest.mark.parametrize(
    ("pair_auc", "note"),
    [(0.5, "weak"), (0.8499, "weak"), (0.85, "doubtful"), (0.8999, "doubtful"), (0.9, None)],
)
def test_the_held_out_note_has_two_bars(pair_auc, note):
    """Below 0.85 the ranking is weak; from 0.85 to 0.90 it may be (a verdict on the
    training pairs read up to 0.06 below the held-out figure); from 0.90 no note. SREM and
    UGNCL, whose verdicts read below GSC's on such data, are told to audit with GSC; GSC,
    NCR and PC2 (level with it where the figure is 0.85-0.90) to check by eye."""
    held_out = {"split": "val", "step": 7, "pair_auc": pair_auc}
    for method in ("", "gsc", "ncr", "pc2", "srem", "ugncl"):
        got = audit.separation_note(held_out, method)
        if note is None:
            assert got is None
        elif note == "weak":
            assert got == audit.weak_separation_note(held_out, method)
            assert "read this ranking as weak" in got
            assert ("gsc.py:vectors" in got) == (method in ("srem", "ugncl"))
        else:
            assert got == audit.doubtful_separation_note(held_out, method)
            assert f"AUC {pair_auc:.2f}" in got and "below 0.9)" in got
            if method in ("srem", "ugncl"):
                assert "gsc.py:vectors" in got
            else:
                assert "gsc.py:vectors" not in got
                assert got.endswith("Check a sample of the lowest-ranked pairs by eye")
    assert audit.separation_note(None) is None


def test_before_its_first_best_model_the_newest_model_scores_with_a_note(runs, tmp_path):
    workdir, steps = _interrupted_copy(runs["ncr"], tmp_path / "ncr")
    shutil.rmtree(os.path.join(workdir, "checkpoints", "best"))
    scores = audit.pair_scores(workdir)
    assert scores.checkpoint["model_checkpoint"] == "latest"
    assert scores.checkpoint["model_step"] == scores.checkpoint["step"] == steps[0]
    assert any("no readable best model yet" in note for note in scores.notes)
    assert np.ptp(scores.clean_score) > 0
