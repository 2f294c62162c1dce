"""Retrieval with a trained model (``ncljax.retrieve``): its rankings are the order of the
evaluator's similarity matrix, the exported embeddings reproduce that matrix, and the
command prints the top K or one line for a user's mistake.

The oracle is the evaluator's own path: the split encoded by the best checkpoint
(``ensemble.load_run``) and its pooled ``sim_fn`` over the whole split at once, whose
brute-force rSum is the run's test rSum; rankings are numpy argsorts of its rows and
columns."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax import evaluate, retrieve
from ncljax.config import presets
from ncljax.config.fields import reset_unread
from ncljax.data import vectors
from ncljax.train import ensemble, train_and_evaluate
from ncljax.train import mesh as mesh_lib
from tests.train.test_ensemble import _brute_force
from tests.train.test_loop import ROOT, load_config, tiny


def _oracle(workdir, split="test"):
    """The evaluator's similarity matrix ``[n_img, n_txt]`` of ``split``, in one block."""
    mesh = mesh_lib.make_mesh(1)
    with jax.set_mesh(mesh):
        evaluator, state = ensemble.load_run(str(workdir), mesh)
        run = evaluator.encode(state, split)
        return np.asarray(run.sim_fn(run.params, run.images, run.texts)), run.captions_per_image


def _loaded(workdir):
    sim, cpi = _oracle(workdir)
    with open(os.path.join(workdir, "results.json")) as f:
        test_rsum = json.load(f)["rsum"]
    # The oracle is the matrix the run's test rSum comes from.
    assert _brute_force(sim, cpi)["rsum"] == pytest.approx(test_rsum, abs=1e-9)
    return workdir, retrieve.load(str(workdir), "test"), sim


@pytest.fixture(scope="module")
def vse(tmp_path_factory):
    """VSE++ on the synthetic regions and tokens, cosine head, one network (~12 s)."""
    config = load_config("vse", "synthetic,quick")
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = tmp_path_factory.mktemp("retrieve") / "vse"
    train_and_evaluate(config, str(workdir))
    return _loaded(workdir)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A vectors folder with ids and captions, 20% of its training pairs mismatched."""
    folder = str(tmp_path_factory.mktemp("retrieve") / "vectors")
    vectors.from_synthetic(folder, num_train=256, num_val=32, num_test=64, noise_rate=0.2)
    return folder


@pytest.fixture(scope="module")
def gsc(tmp_path_factory, folder):
    """GSC (two networks exchanging labels) on the vectors folder (~12 s)."""
    config = presets.start("vectors")
    config.method = "gsc"
    config.method_kwargs = config_lib.method_kwargs("gsc")
    config.data.folder = folder
    config.model.cosine.image_hidden = config.model.text_mlp.hidden = (128,)
    config.model.embed_dim = 64
    config.optim.learning_rate = 2e-3
    config.train.epochs, config.train.batch_size, config.eval.batch_size = 2, 64, 64
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = tmp_path_factory.mktemp("retrieve") / "gsc"
    train_and_evaluate(config, str(workdir))
    return _loaded(workdir)


def _assert_matrix_order(ranking, values):
    """``ranking`` orders every candidate by ``values`` (the oracle's row or column), most
    similar first, except that similarities the evaluator counts as tied (within its tie
    tolerance, ~1e-6: rounding of a block shape) may come in either order; its scores are
    ``values`` to that tolerance."""
    np.testing.assert_array_equal(np.sort(ranking.index), np.arange(values.size))
    ordered = values[ranking.index]
    tol = evaluate.TIE_ATOL + evaluate.TIE_RTOL * np.abs(ordered)
    assert np.all(ordered - np.minimum.accumulate(ordered) <= tol)  # no inversion beyond it
    np.testing.assert_allclose(ranking.score, ordered, rtol=0, atol=evaluate.TIE_ATOL)


def _check_rankings(run, sim):
    """Every image's and caption's ranking is the order of its row or column: the numpy
    argsort of it, except that two similarities the evaluator counts as tied (within its
    tolerance, ``evaluate.TIE_ATOL``/``TIE_RTOL``) may come in either order (one pair did,
    under jax 0.10.2 on the 2-core machine: 0.6% of one row)."""

    def same_order(index, values):
        exact = np.argsort(-values, kind="stable")
        swapped = index != exact
        np.testing.assert_allclose(
            values[index[swapped]],
            values[exact[swapped]],
            rtol=evaluate.TIE_RTOL,
            atol=evaluate.TIE_ATOL,
        )

    for i in range(run.num_images):
        ranking = retrieve.rank_captions(run, i)
        _assert_matrix_order(ranking, sim[i])
        same_order(ranking.index, sim[i])
    for k in range(run.num_captions):
        ranking = retrieve.rank_images(run, k)
        _assert_matrix_order(ranking, sim[:, k])
        same_order(ranking.index, sim[:, k])


@pytest.mark.parametrize("name", ["vse", "gsc"])
def test_rankings_are_the_order_of_the_evaluators_matrix(request, name):
    _, run, sim = request.getfixturevalue(name)
    assert run.encoded.images["emb"].shape[1] == (2 if name == "gsc" else 1)  # both networks
    _check_rankings(run, sim)
    # Where the evaluator ranks an image's own caption first, so does retrieval.
    cpi = run.captions_per_image
    firsts = [i for i in range(run.num_images) if np.argmax(sim[i]) // cpi == i]
    assert firsts, "the trained model ranks no ground truth first"
    for i in firsts:
        assert retrieve.rank_captions(run, i).index[0] // cpi == i


def test_rankings_on_eight_devices_equal_one(vse, tmp_path):
    """The query blocks are placed over the mesh as the evaluator's sweep places them."""
    workdir, _, sim = vse
    copy = tmp_path / "eight"
    shutil.copytree(workdir, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["train"]["num_devices"] = 8
    (copy / "config.json").write_text(json.dumps(saved))
    run = retrieve.load(str(copy))
    assert run.mesh.size == 8
    for i in (0, 17, 63):  # rows sharded over 8 devices round differently: ties may swap
        _assert_matrix_order(retrieve.rank_captions(run, i), sim[i])
    for k in (0, 101, 319):
        _assert_matrix_order(retrieve.rank_images(run, k), sim[:, k])


def test_a_run_trained_on_more_devices_than_visible_is_retrieved_and_ensembled(vse, tmp_path):
    # A run trained on 16 devices, read on a machine with the tests' 8: retrieval and
    # ensembles were refused ("train.num_devices=16 but 8 devices are visible; use 0 ...",
    # a field the reader cannot set).
    workdir, _, sim = vse
    copy = tmp_path / "sixteen"
    shutil.copytree(workdir, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["train"]["num_devices"] = 16
    (copy / "config.json").write_text(json.dumps(saved))
    run = retrieve.load(str(copy))
    assert run.mesh.size == 8
    for i in (0, 63):
        _assert_matrix_order(retrieve.rank_captions(run, i), sim[i])
    alone = json.loads((copy / "results.json").read_text())
    pooled = ensemble.evaluate_ensemble([str(copy)])
    assert pooled == pytest.approx({k: alone[k] for k in pooled}, abs=1e-6)


def test_candidates_are_reranked_in_the_matrix_order(vse):
    _, run, sim = vse
    captions = np.array([300, 5, 17, 16, 15, 250])
    ranking = retrieve.rank_captions(run, 3, captions)
    np.testing.assert_array_equal(ranking.index, captions[np.argsort(-sim[3, captions])])
    images = np.array([40, 3, 0, 63])
    ranking = retrieve.rank_images(run, 17, images)
    np.testing.assert_array_equal(ranking.index, images[np.argsort(-sim[images, 17])])
    for bad, message in [
        ([1, 64], "candidate image 64 is out of range"),
        ([2, 2], "candidate image 2 is listed twice"),
        ([], "non-empty list"),
    ]:
        with pytest.raises(ValueError, match=message):
            retrieve.rank_images(run, 0, bad)
    with pytest.raises(ValueError, match=r"caption 320 is out of range: split 'test' holds 320"):
        retrieve.rank_images(run, 320)


@pytest.mark.parametrize("name", ["vse", "gsc"])
def test_exported_embeddings_reproduce_the_similarity(request, tmp_path, name):
    workdir, run, sim = request.getfixturevalue(name)
    if name == "vse":  # the function of a workdir (it loads the run itself)
        image_emb, text_emb = retrieve.embed(str(workdir), "test")
    else:
        image_emb, text_emb = retrieve.embeddings(run)
    assert image_emb.dtype == text_emb.dtype == np.float32
    for emb in (image_emb, text_emb):
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(image_emb @ text_emb.T, sim, atol=1e-6)
    paths = retrieve.export(run, str(tmp_path / "export"))
    np.testing.assert_array_equal(np.load(tmp_path / "export" / "test_image_emb.npy"), image_emb)
    np.testing.assert_array_equal(np.load(tmp_path / "export" / "test_text_emb.npy"), text_emb)
    manifest = json.loads((tmp_path / "export" / "test_export.json").read_text())
    assert manifest["num_networks"] == (2 if name == "gsc" else 1)
    assert manifest["dim"] == image_emb.shape[1]
    names = sorted(os.path.basename(p) for p in paths)
    if name == "gsc":  # the folder's ids and captions travel with the vectors
        assert names == [
            "test_captions.txt",
            "test_export.json",
            "test_image_emb.npy",
            "test_image_ids.txt",
            "test_text_emb.npy",
        ]
        for kind in ("captions", "image_ids"):
            exported = (tmp_path / "export" / f"test_{kind}.txt").read_text()
            with open(vectors.path_of(run.config.data.folder, "test", kind)) as f:
                assert exported == f.read()
    else:
        assert names == ["test_export.json", "test_image_emb.npy", "test_text_emb.npy"]


def test_queries_by_id_and_their_refusals(vse, gsc):
    _, run, _ = gsc
    assert retrieve.image_of_id(run, "test/000042") == 42
    with pytest.raises(ValueError, match=r"^Image id 'test/999' is not in test_image_ids.txt"):
        retrieve.image_of_id(run, "test/999")
    with pytest.raises(ValueError, match=r"only a vectors folder has image ids"):
        retrieve.run_query(vse[1], "id:test/000042")
    for query in ("image", "image:", "text:3", "image:-1", "caption:x"):
        with pytest.raises(ValueError, match=r"^--query="):
            retrieve.parse_query(query)
    assert retrieve.parse_candidates("4, 90,311") == [4, 90, 311]
    for text in ("1,x", "", "-1"):
        with pytest.raises(ValueError, match=r"^--candidates=.* is not a list of indices"):
            retrieve.parse_candidates(text)


def test_candidates_from_a_file_that_is_not_text_name_the_file(tmp_path):
    # A binary file was "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff ...",
    # naming neither the file nor the flag.
    path = tmp_path / "shortlist.bin"
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match=rf"^--candidates={path} cannot be read \(not UTF-8"):
        retrieve.parse_candidates(str(path))
    path.write_text("4 90\n311, x\n")
    with pytest.raises(ValueError, match=rf"^--candidates={path}: the file .* is not a list"):
        retrieve.parse_candidates(str(path))
    path.write_text("4 90\n311\n")
    assert retrieve.parse_candidates(str(path)) == [4, 90, 311]


def test_an_export_into_the_runs_own_folder_is_refused(gsc, folder):
    # --export=<the run's data.folder> replaced its test_captions.txt and
    # test_image_ids.txt; with other line ends than the export's the run's fingerprint no
    # longer matched, and the run could not be audited or retrieved with any more.
    _, run, _ = gsc

    def contents():
        return {name: pathlib.Path(folder, name).read_bytes() for name in os.listdir(folder)}

    before = contents()
    with pytest.raises(ValueError, match=r"^--export=\S+ is the run's data.folder"):
        retrieve.export(run, os.path.join(folder, "."))
    assert contents() == before


def test_an_export_folder_that_cannot_be_written_is_one_line(gsc, tmp_path):
    # Was "FileExistsError: [Errno 17] File exists: '...'", with nothing to do about it.
    _, run, _ = gsc
    path = tmp_path / "a_file"
    path.write_text("")
    with pytest.raises(OSError, match=rf"^--export={path} is a file, not a folder .*: pass a"):
        retrieve.export(run, str(path))


def _command(*args):
    out = subprocess.run(
        [sys.executable, "-m", "ncljax.retrieve", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return out.returncode, out.stdout, out.stderr


def test_the_command_prints_the_top_k_with_ids_and_captions(gsc, folder, tmp_path):
    workdir, run, _ = gsc
    code, stdout, stderr = _command(
        f"--workdir={workdir}", "--query=id:test/000007", "--k=3", f"--export={tmp_path}"
    )
    assert code == 0 and stderr == "", stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert [line.startswith("wrote ") for line in lines] == [True] * 5 + [False] * 4
    header, results = lines[5], lines[6:]
    captions = vectors.read_lines(vectors.path_of(folder, "test", "captions"))
    assert header == (
        "split 'test', image 7 (test/000007): top 3 of 64 captions, most similar first (* its own)"
    )
    top = retrieve.rank_captions(run, 7).index[:3]
    for rank, (line, k) in enumerate(zip(results, top, strict=True), 1):
        fields = line.split()
        assert fields[:3] == [str(rank), "caption", str(k) + ("*" if k == 7 else "")]
        assert line.endswith(f"  image {k}  test/{k:06d}  {captions[k]}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--query=picture:3"], "ValueError: --query='picture:3' is not a query; use image:N"),
        (["--query=id:test/nope"], "ValueError: Image id 'test/nope' is not in test_image_ids"),
        (["--query=image:²"], "ValueError: --query='image:²': image needs a non-negative integer"),
        (["--query=image:1", "--candidates=1,²"], "ValueError: --candidates='1,²' is not a list"),
    ],
)
def test_command_errors_are_one_line(gsc, args, message):
    code, stdout, stderr = _command(f"--workdir={gsc[0]}", *args)
    lines = stderr.strip().splitlines()
    assert code != 0 and stdout == ""
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith(message), lines[0]


def test_a_missing_run_is_one_line(tmp_path):
    code, _, stderr = _command(f"--workdir={tmp_path / 'none'}", "--query=image:0")
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("FileNotFoundError: ") and "is not a finished ncljax run" in lines[0]


def test_an_unfinished_run_is_refused(vse, tmp_path):
    copy = tmp_path / "unfinished"
    shutil.copytree(vse[0], copy)
    os.remove(copy / "results.json")
    with pytest.raises(FileNotFoundError, match=r"has not finished training .* retrieve with it"):
        retrieve.load(str(copy))


@pytest.mark.slow  # an SGR run and its whole-split queries: about a minute on 2 CPU cores
def test_sgr_reranks_candidates_in_the_matrix_order(tmp_path):
    config = tiny(load_config("vse", "synthetic"), epochs=1)
    config.model.head = "sgr"
    config.model.embed_dim, config.model.tokens.word_dim, config.model.sgraf.sim_dim = 16, 8, 8
    config.model.sgr.steps, config.model.sgraf.remat, config.model.sgraf.length_groups = (
        1,
        "none",
        1,
    )
    reset_unread(config)
    config.train.num_devices = 1
    train_and_evaluate(config, str(tmp_path / "sgr"))
    _, run, sim = _loaded(tmp_path / "sgr")
    _check_rankings(run, sim)  # 16 images, 80 captions: one evaluation block, ranked whole
    captions = np.array([70, 2, 33, 9, 1])
    ranking = retrieve.rank_captions(run, 0, captions)
    np.testing.assert_array_equal(ranking.index, captions[np.argsort(-sim[0, captions])])
    np.testing.assert_allclose(ranking.score, sim[0, ranking.index], atol=evaluate.TIE_ATOL)
    small = run.config.copy_and_resolve_references()
    small.eval.recall.text_chunk = 40
    with pytest.raises(ValueError, match=r"^The SGR head scores every pair .*--candidates="):
        retrieve.rank_captions(run._replace(config=small), 0)
    with pytest.raises(ValueError, match=r"has no embedding export: its SGR head"):
        retrieve.embeddings(run)


def test_text_that_is_not_printable_is_printed_escaped():
    # A clear-screen, a hyperlink (OSC 8), a carriage return, a bidi override: escaped;
    # letters of any script and spaces as they are.
    assert retrieve.printable("\x1b[2Jgone") == "\\x1b[2Jgone"
    link = "\x1b]8;;http://x\x07click\x1b]8;;\x07"
    assert retrieve.printable(link) == "\\x1b]8;;http://x\\x07click\\x1b]8;;\\x07"
    assert retrieve.printable("a\rb\tc\u202ed") == "a\\rb\\tc\\u202ed"
    assert retrieve.printable("un chat noir, 黒い猫 ²") == "un chat noir, 黒い猫 ²"


def test_the_command_prints_escape_sequences_in_captions_escaped(tmp_path):
    folder = str(tmp_path / "folder")
    vectors.from_synthetic(folder, num_train=64, num_val=16, num_test=16, noise_rate=0.0)
    path = vectors.path_of(folder, "test", "captions")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    lines[0] = "\x1b[2J\x1b]8;;http://evil\x07a caption"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    config = presets.start("vectors")
    config.method = "infonce"
    config.method_kwargs = config_lib.method_kwargs("infonce")
    config.data.folder = folder
    config.model.cosine.image_hidden = config.model.text_mlp.hidden = (32,)
    config.model.embed_dim = 16
    config.train.epochs, config.train.batch_size, config.eval.batch_size = 1, 32, 16
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    code, stdout, stderr = _command(f"--workdir={workdir}", "--query=caption:0", "--k=16")
    assert code == 0, stderr[-2000:]
    assert "\x1b" not in stdout and "\x07" not in stdout
    assert '"\\x1b[2J\\x1b]8;;http://evil\\x07a caption"' in stdout
