"""SGRAF-style ensembles of finished runs: the mean of their similarity matrices."""

import json
import os

import jax
import numpy as np
import pytest

from ncljax import evaluate
from ncljax.config.fields import reset_unread
from ncljax.train import ensemble, train_and_evaluate
from ncljax.train import mesh as mesh_lib
from tests.train import test_loop


def _tiny_run(workdir, head, seed):
    config = test_loop.tiny(test_loop.load_config("vse", "synthetic"), epochs=1)
    config.model.head, config.seed = head, seed
    config.model.embed_dim, config.model.tokens.word_dim, config.model.sgraf.sim_dim = 16, 8, 8
    config.model.sgr.steps, config.model.sgraf.remat = 1, "none"  # compiles in a fraction
    config.model.sgraf.length_groups = 1
    reset_unread(config)  # the SGRAF sizes, with the cosine head
    config.train.num_devices = 1
    train_and_evaluate(config, str(workdir))
    return config


def _brute_force(sims, cpi):
    i2t = np.array([np.where(np.argsort(-r) // cpi == i)[0].min() for i, r in enumerate(sims)])
    t2i = np.array(
        [np.where(np.argsort(-sims[:, k]) == k // cpi)[0][0] for k in range(sims.shape[1])]
    )
    return evaluate.rank_metrics(i2t, t2i)


@pytest.mark.parametrize(
    "heads",
    [
        ("cosine", "cosine"),  # two seeds
        pytest.param(("sgr", "saf"), marks=pytest.mark.slow),  # SGRAF itself; 60 s on 2 cores
    ],
)
def test_ensemble_scores_the_mean_similarity(tmp_path, heads):
    workdirs = [tmp_path / "a", tmp_path / "b"]
    for seed, (workdir, head) in enumerate(zip(workdirs, heads, strict=True)):
        _tiny_run(workdir, head, seed)
    mesh = mesh_lib.make_mesh(1)
    matrices = []
    with jax.set_mesh(mesh):
        for workdir in workdirs:
            evaluator, state = ensemble.load_run(str(workdir), mesh)
            run = evaluator.encode(state, "test")
            matrices.append(np.asarray(run.sim_fn(run.params, run.images, run.texts)))
            # One run alone reproduces its own test result.
            with open(workdir / "results.json") as f:
                alone = json.load(f)
            assert _brute_force(matrices[-1], 5)["rsum"] == pytest.approx(alone["rsum"])
    assert not np.allclose(matrices[0], matrices[1])
    results = ensemble.evaluate_ensemble([str(w) for w in workdirs], "test")
    share = results.pop("noise_share_estimate")  # the held-out share: test_evaluator.py
    assert 0 <= share <= 1
    mean = (matrices[0] + matrices[1]) / 2
    own = mean[np.arange(mean.shape[1]) // 5, np.arange(mean.shape[1])]  # [n_txt]
    below = (mean < own).sum(0) + 0.5 * ((mean == own).sum(0) - 1)
    want_auc = float(np.mean(below / (mean.shape[0] - 1)))  # each caption's own image's AUC
    assert results.pop("pair_auc") == pytest.approx(want_auc, abs=1e-6)
    assert results == pytest.approx(_brute_force(mean, 5), abs=1e-9)


def test_ensemble_refuses_runs_on_different_data(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        config = test_loop.load_config("vse", "synthetic")
        config.data.seed = seed
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config.to_json_best_effort())
    with pytest.raises(ValueError, match="differ in config section 'data'"):
        ensemble.evaluate_ensemble([str(tmp_path / "a"), str(tmp_path / "b")])


@pytest.mark.heavy
def test_a_uot_rcl_run_loads_for_retrieval_and_ensembles(tmp_path):
    # load_run builds a one-pair memory: UOT-RCL's reads observed labels (it raised
    # TypeError on None), so no UOT-RCL run could be retrieved or ensembled.
    config = test_loop.load_config("uot_rcl", "synthetic,quick")
    config.train.num_devices, config.train.progress_bar = 1, False
    workdir = str(tmp_path / "uot")
    train_and_evaluate(config, workdir)
    mesh = mesh_lib.make_mesh(1)
    with jax.set_mesh(mesh):
        ensemble.load_run(workdir, mesh)
    with open(os.path.join(workdir, "results.json")) as f:
        results = json.load(f)
    scores = ensemble.evaluate_ensemble([workdir])  # one run: the run's own test scores
    assert scores["map_avg"] == pytest.approx(results["map_avg"], abs=1e-6)
