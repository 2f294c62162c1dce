"""The README's Python path, run as written: a config by name, train, audit, the pair
scores, and new vectors embedded and queried with the trained run (``retrieve.encode``,
``retrieve.query``), checked against the run's own split embeddings."""

import os
import re

import numpy as np
import pytest

import ncljax.config
from ncljax import retrieve
from ncljax.data import vectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_block() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## From Python: train, audit, retrieve") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The README block run in a folder holding ``my_pairs`` and two new-vector files (the
    test split's first images and captions, so their embeddings are known)."""
    here = tmp_path_factory.mktemp("api")
    vectors.from_synthetic(str(here / "my_pairs"), world="small_global", noise_rate=0.4, seed=0)
    np.save(here / "new_images.npy", np.load(here / "my_pairs" / "test_images.npy")[:3])
    np.save(here / "new_texts.npy", np.load(here / "my_pairs" / "test_texts.npy")[:4])
    code = _readme_block().replace('"train.epochs": 8', '"train.epochs": 2')
    code = code.replace(
        '"data.folder": "my_pairs"', '"data.folder": "my_pairs", "train.progress_bar": False'
    )
    cwd = os.getcwd()
    os.chdir(here)
    try:
        namespace = {}
        exec(compile(code, "README.md", "exec"), namespace)  # the README's own code
    finally:
        os.chdir(cwd)
    return here, namespace


def test_the_readme_block_trains_audits_and_retrieves(trained):
    here, ns = trained
    assert ns["results"]["rsum"] > 0
    assert os.path.isfile(here / "runs" / "mine" / "audit" / "pairs.csv")
    assert ns["verdict"]["num_pairs"] == ns["scores"].clean_score.size
    assert sorted(ns["scores"].rank[ns["suspicious"]]) == list(range(1, 11))


def test_new_vectors_embed_as_the_split_does(trained):
    _, ns = trained
    run = ns["run"]
    image_emb, text_emb = retrieve.embeddings(run)
    np.testing.assert_allclose(ns["image_emb"], image_emb[:3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ns["text_emb"], text_emb[:4], rtol=1e-5, atol=1e-6)
    ranking = ns["captions"]
    expected = np.argsort(-(text_emb @ image_emb[0]), kind="stable")
    np.testing.assert_array_equal(ranking.index, expected)
    # Image 0's query ranks the captions as the split's own row does (to rounding).
    own = retrieve.rank_captions(run, 0)
    np.testing.assert_allclose(np.sort(ranking.score), np.sort(own.score), atol=1e-5)


def test_new_vectors_that_do_not_fit_are_refused_in_one_line(trained):
    _, ns = trained
    run = ns["run"]
    width = ns["new_images"].shape[1]
    with pytest.raises(
        ValueError, match=rf"shape \(2, 3\); the run's model reads global_image vectors of {width}"
    ):
        retrieve.encode(run, images=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN or infinite"):
        retrieve.encode(run, texts=np.full((1, ns["new_texts"].shape[1]), np.nan))
    with pytest.raises(ValueError, match="one new item"):
        retrieve.query(run)


def test_a_config_by_name_with_overrides():
    config = ncljax.config.get("vse:synthetic,quick", {"train.epochs": 3, "optim.step.every": 2})
    assert config.train.epochs == 3 and config.optim.step.every == 2 and config.method == "vse"
    with pytest.raises(ValueError, match=r"model\.sim_dim is now model\.sgraf\.sim_dim"):
        ncljax.config.get("gsc:vectors", {"model.sim_dim": 8})
    with pytest.raises(ValueError, match=r"train\.epoch is not a field; train has"):
        ncljax.config.get("gsc:vectors", {"train.epoch": 8})
    with pytest.raises(FileNotFoundError, match="Config file nosuch not found"):
        ncljax.config.get("nosuch:vectors")


def test_the_retrieve_command_takes_a_new_vector(trained, tmp_path):
    import subprocess
    import sys

    here, ns = trained
    path = tmp_path / "one.npy"
    np.save(path, ns["new_images"][0])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ncljax.retrieve",
            f"--workdir={here / 'runs' / 'mine'}",
            f"--query=image_vector:{path}",
            "--k=3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, XLA_FLAGS=""),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"a new image ({path}): top 3 of ")
    shown = [int(line.split()[2]) for line in lines[1:]]
    assert shown == list(ns["captions"].index[:3])
    np.save(path, np.zeros((2, 3)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ncljax.retrieve",
            f"--workdir={here / 'runs' / 'mine'}",
            f"--query=caption_vector:{path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, XLA_FLAGS=""),
    )
    assert out.returncode != 0
    assert out.stderr.strip() == (
        f"ValueError: --query: {path} holds an array of shape (2, 3); save one vector ([D])."
    )
