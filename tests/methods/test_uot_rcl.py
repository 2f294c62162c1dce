"""The UOT-RCL method bundle: loss against a numpy oracle of Eqs. 15-19, gradients, the
per-epoch refresh, 1 device against 8, and end-to-end label correction on synthetic data."""

import json
import logging
import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ncljax import config as config_lib
from ncljax import methods, models
from ncljax.config import presets
from ncljax.config.fields import reset_unread
from ncljax.data import pipeline, synthetic
from ncljax.labels import correction, ot
from ncljax.methods import base, uot_rcl
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib
from ncljax.train import train_and_evaluate

WARMUP, MAIN = 0, 1
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIGS = os.path.join(ROOT, "configs")


def load_config(name, arg=""):
    return config_lib.load_file(os.path.join(CONFIGS, f"{name}.py"), arg)


def _ctx(phase, n=50):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, zero, phase, n, zero, jax.random.key(0))


# ----------------------------------------------------------------------------- numpy oracle


def np_log_softmax(x, axis=-1):
    x = x - x.max(axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis, keepdims=True))


def np_unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def np_jsd(p, q):
    m = 0.5 * (p + q)

    def kl(a, b):
        return sum(a[k] * np.log(a[k] / b[k]) for k in range(a.size) if a[k] > 0)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def np_sinkhorn(cost, eps, iters=20000):
    """Balanced entropic OT with uniform marginals, log-domain, float64, to convergence."""
    n = cost.shape[0]
    log_a = np.full(n, -np.log(n))
    f, g = np.zeros(n), np.zeros(n)
    for _ in range(iters):
        f = -eps * np.logaddexp.reduce((g[None, :] - cost) / eps + log_a[None, :], axis=1)
        g = -eps * np.logaddexp.reduce((f[:, None] - cost) / eps + log_a[:, None], axis=0)
    return np.exp((f[:, None] + g[None, :] - cost) / eps + log_a[:, None] + log_a[None, :])


def np_uot_loss(logit_v, logit_t, q, z_v, z_t, g_v, g_t, g_mask, *, lam, eps, tau2, tau3):
    """Eq. 19 after warm-up, written out per example from the paper's equations."""
    b = z_v.shape[0]
    plc = -(q * (np_log_softmax(logit_v) + np_log_softmax(logit_t))).sum(1)  # Eq. 15

    def relation(z, g):  # Eq. 16 (sigma = +1), masked anchors excluded
        cos = np_unit(z) @ np_unit(g).T / tau2
        w = np.where(g_mask[None, :], np.exp(cos), 0.0)
        return w / w.sum(1, keepdims=True)

    r_v, r_t = relation(z_v, g_v), relation(z_t, g_t)
    cost = np.array([[np_jsd(r_v[i], r_t[j]) for j in range(b)] for i in range(b)])  # Eq. 17
    m = np_sinkhorn(cost / cost.max(), eps)
    m_v2t = m / m.sum(1, keepdims=True)
    m_t2v = m.T / m.T.sum(1, keepdims=True)
    logits = z_v @ z_t.T / tau3
    bhg = -(m_v2t * np_log_softmax(logits, 1)).sum(1) - (m_t2v * np_log_softmax(logits.T, 1)).sum(1)
    return plc + lam * bhg, plc, bhg


def _loss_inputs(seed, b=6, k=3, g=6, d=4):
    rng = np.random.default_rng(seed)
    z_v = np_unit(rng.normal(size=(b, d)))
    z_t = np_unit(rng.normal(size=(b, d)))
    anchors_v = np_unit(rng.normal(size=(g, d)))
    anchors_t = np_unit(rng.normal(size=(g, d)))
    g_mask = np.array([True] * (g - 1) + [False])
    q = rng.dirichlet(np.ones(k), size=b) * rng.uniform(0, 1, size=(b, 1))  # rows sum <= 1
    logit_v, logit_t = rng.normal(size=(b, k)), rng.normal(size=(b, k))
    return logit_v, logit_t, q, z_v, z_t, anchors_v, anchors_t, g_mask


def _outputs(logit_v, logit_t, z_v, z_t, g_v, g_t, g_mask):
    f = lambda x: jnp.asarray(x, jnp.float32)
    return {
        "image_logits": f(logit_v),
        "text_logits": f(logit_t),
        "image": {"emb": f(z_v)},
        "text": {"emb": f(z_t)},
        "anchor_z_image": f(g_v),
        "anchor_z_text": f(g_t),
        "anchor_mask": jnp.asarray(g_mask),
    }


@pytest.mark.parametrize("lam,tau2,tau3", [(0.4, 1.0, 1.0), (1.0, 0.2, 0.5)])
def test_loss_matches_numpy_oracle(lam, tau2, tau3):
    logit_v, logit_t, q, z_v, z_t, g_v, g_t, g_mask = _loss_inputs(0)
    method = methods.build_method(
        "uot_rcl",
        {
            "relation_weight": lam,
            "relation_temperature": tau2,
            "match_temperature": tau3,
            "relation_threshold": 1e-6,
            "relation_max_iterations": 20000,
        },
    )
    outputs = _outputs(logit_v, logit_t, z_v, z_t, g_v, g_t, g_mask)
    batch = {"mask": jnp.ones(6, bool)}
    rows = {"labels": jnp.asarray(q, jnp.float32)}
    loss_fn = jax.jit(lambda o, b, r: method.loss_fn(o, b, r, {}, _ctx(MAIN)))
    loss, aux = loss_fn(outputs, batch, rows)
    want, plc, bhg = np_uot_loss(
        logit_v, logit_t, q, z_v, z_t, g_v, g_t, g_mask, lam=lam, eps=0.1, tau2=tau2, tau3=tau3
    )
    np.testing.assert_allclose(aux.metrics["loss_plc"], plc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux.metrics["loss_bhg"], bhg, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss, want, rtol=1e-4, atol=1e-5)
    assert float(aux.metrics["relation_converged"].min()) == 1.0
    # the plan's Sinkhorn iterations, as ot.relation_plan counts them (ott checks every 10)
    plan = ot.relation_plan(
        correction.jensen_shannon_pairwise(
            correction.relation_scores(z_v, g_v, anchor_mask=g_mask, temperature=tau2),
            correction.relation_scores(z_t, g_t, anchor_mask=g_mask, temperature=tau2),
        ),
        threshold=1e-6,
        max_iterations=20000,
    )
    iterations = np.asarray(aux.metrics["relation_iterations"])
    assert np.all(iterations == int(plan.n_iters)) and iterations[0] > 0
    assert iterations[0] % 10 == 0


def test_padded_pairs_do_not_change_real_losses():
    logit_v, logit_t, q, z_v, z_t, g_v, g_t, g_mask = _loss_inputs(1)
    method = methods.build_method("uot_rcl")
    full = _outputs(logit_v, logit_t, z_v, z_t, g_v, g_t, g_mask)
    loss, _ = method.loss_fn(
        full, {"mask": jnp.ones(6, bool)}, {"labels": jnp.asarray(q)}, {}, _ctx(MAIN)
    )
    # Two garbage pairs appended as padding.
    pad = lambda x: np.concatenate([x, 7 * np.ones((2, *x.shape[1:]))])
    padded = _outputs(pad(logit_v), pad(logit_t), pad(z_v), pad(z_t), g_v, g_t, g_mask)
    mask = jnp.asarray([True] * 6 + [False] * 2)
    loss_p, _ = method.loss_fn(
        padded, {"mask": mask}, {"labels": jnp.asarray(pad(q))}, {}, _ctx(MAIN)
    )
    np.testing.assert_allclose(loss_p[:6], loss, rtol=1e-5, atol=1e-6)


def test_warmup_phase_is_cross_entropy_on_observed_labels():
    logit_v, logit_t, q, z_v, z_t, g_v, g_t, g_mask = _loss_inputs(2)
    outputs = _outputs(logit_v, logit_t, z_v, z_t, g_v, g_t, g_mask)
    labels_v, labels_t = np.array([0, 1, 2, 0, 1, 2]), np.array([2, 2, 0, 0, 1, 1])
    batch = {
        "mask": jnp.ones(6, bool),
        "label_image": jnp.asarray(labels_v),
        "label_text": jnp.asarray(labels_t),
    }
    loss, _ = methods.build_method("uot_rcl").loss_fn(
        outputs, batch, {"labels": jnp.asarray(q)}, {}, _ctx(WARMUP)
    )
    want = (
        -np_log_softmax(logit_v)[np.arange(6), labels_v]
        - np_log_softmax(logit_t)[np.arange(6), labels_t]
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)


# ------------------------------------------------------------------------ model and gradients


@pytest.fixture(scope="module")
def labelled():
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test, cfg.captions_per_image = 40, 4, 4, 1
    ds = synthetic.SyntheticDataset(cfg)
    pairs = pipeline.training_pairs(
        ds.split("train"),
        config_lib.base_config().noise,
        num_classes=ds.info.num_classes,
        image_fields=("global_image",),
        text_fields=("global_text",),
    )
    batches = list(pipeline.batches(pairs.record_fn, 40, batch_size=32, seed=0))
    return ds.info, pairs, batches


def _model_cfg():
    config = config_lib.base_config()
    presets.use_mrl(config, hidden=(16,), out_dim=8)
    return config.model


def _main_memory(method, info, pairs, key):
    """The method's memory after a refresh on random statistics (labels, anchors set)."""
    n, k = pairs.num_records, info.num_classes
    ctx = base.InitContext(n, info, pairs.labels_image, pairs.labels_text, 8)
    memory = method.init_memory(ctx)
    k1, k2, k3 = jax.random.split(key, 3)
    stats = {
        "z_image": jax.random.normal(k1, (n, 8)),
        "z_text": jax.random.normal(k2, (n, 8)),
        "logits_image": jax.random.normal(k3, (n, k)),
        "logits_text": jax.random.normal(k3, (n, k)) + 0.5,
    }
    records = [pairs.record_fn(i) for i in range(n)]

    def fetch(index):
        index = np.asarray(index)
        return {f: jnp.asarray(np.stack([records[i][f] for i in index])) for f in records[0]}

    refresh = base.RefreshContext(2, 10, 0, jax.random.key(1), fetch)
    memory, diagnostics = method.refresh_fn(memory, stats, refresh)
    return memory, diagnostics, stats


def test_refresh_fills_targets_labels_anchors_and_diagnostics(labelled):
    info, pairs, _ = labelled
    method = methods.build_method("uot_rcl", {"neighbours": 5, "per_class": 2})
    memory, diag, stats = _main_memory(method, info, pairs, jax.random.key(0))
    n, k = pairs.num_records, info.num_classes
    samples, state = memory.samples, memory.state
    # Targets: one momentum step from the observed one-hot labels (Eq. 9).
    observed = np.eye(k)[pairs.labels_image]
    t = np.asarray(samples["targets_image"])
    np.testing.assert_allclose(t.sum(1), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.maximum(t - 0.99 * observed, 0).sum(1), 0.01, atol=1e-6)
    # Labels: N * plan of a partial OT of mass s_2 = 0.2 (first post-warm-up epoch).
    q = np.asarray(samples["labels"])
    assert q.shape == (n, k) and q.min() >= 0 and q.sum(1).max() <= 1 + 1e-4
    assert q.sum() / n == pytest.approx(0.2, abs=1e-3)
    assert diag["mass"] == pytest.approx(0.2) and diag["ot_converged"] == 1.0
    assert diag["transported_mass"] == pytest.approx(0.2, abs=1e-3)
    # Anchors are the raw features of the confident pairs, fetched by index.
    confident = correction.confident_set(
        jax.nn.softmax(stats["logits_image"]), jax.nn.softmax(stats["logits_text"]), per_class=2
    )
    index = np.asarray(confident.index)
    want = np.stack([pairs.record_fn(i)["global_image"] for i in index])
    np.testing.assert_allclose(state["anchors_image"], want)
    assert state["anchor_mask"].shape == (2 * k,)
    assert diag["confident_pairs"] == float(np.asarray(state["anchor_mask"]).sum())
    # Selection read-out for the diagnostics: argmax of Q where the row mass exceeds 1/2.
    labels, selected = method.label_estimate_fn(memory)
    np.testing.assert_array_equal(labels, q.argmax(1))
    np.testing.assert_array_equal(selected, q.sum(1) > 0.5)


@pytest.mark.heavy
def test_regions_and_tokens_keep_the_confident_sets_own_inputs():
    """On region/token inputs the confident set keeps its pairs' regions, tokens and lengths
    (fetched by index), and the main-phase forward encodes exactly those pairs."""
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test, cfg.captions_per_image = 40, 4, 4, 1
    ds = synthetic.SyntheticDataset(cfg)
    info = ds.info
    pairs = pipeline.training_pairs(
        ds.split("train"),
        config_lib.base_config().noise,
        num_classes=info.num_classes,
        image_fields=("regions",),
        text_fields=("tokens", "length"),
    )
    model_cfg = config_lib.base_config().model
    model_cfg.classifier, model_cfg.embed_dim, model_cfg.tokens.word_dim = True, 8, 8
    assert (model_cfg.image_input, model_cfg.text_input) == ("regions", "tokens")
    method = methods.build_method(
        "uot_rcl", {"neighbours": 5, "per_class": 2}, model_config=model_cfg
    )
    memory, _, stats = _main_memory(method, info, pairs, jax.random.key(0))
    state = memory.state
    assert "anchors_image" not in state and "anchors_text" not in state
    confident = correction.confident_set(
        jax.nn.softmax(stats["logits_image"]), jax.nn.softmax(stats["logits_text"]), per_class=2
    )
    records = [pairs.record_fn(int(i)) for i in np.asarray(confident.index)]
    want = {f: np.stack([r[f] for r in records]) for f in ("regions", "tokens", "length")}
    np.testing.assert_array_equal(state["anchors_regions"], want["regions"])
    np.testing.assert_array_equal(state["anchors_tokens"], want["tokens"])
    np.testing.assert_array_equal(state["anchors_length"], want["length"])
    assert state["anchors_tokens"].dtype == jnp.int32 and want["length"].min() > 0

    model = models.build_model(model_cfg, info, nnx.Rngs(0))
    batch = {k: jnp.asarray(np.stack([v] * 2)) for k, v in pairs.record_fn(0).items()}
    outputs = method.forward_fn(model, batch, state, train=True, rngs=nnx.Rngs(1), phase=base.MAIN)
    np.testing.assert_allclose(
        outputs["anchor_z_image"], model.encode_image({"regions": want["regions"]})["emb"]
    )
    text = {"tokens": want["tokens"], "length": want["length"]}
    np.testing.assert_allclose(outputs["anchor_z_text"], model.encode_text(text)["emb"])


@pytest.mark.heavy
def test_trains_on_regions_and_tokens(tmp_path):
    """The cosine head over region/token inputs: a warm-up epoch, then a refresh and a
    corrected epoch whose steps encode the confident set's regions and tokens."""
    config = load_config("uot_rcl", "synthetic,quick")
    config.model.image_input, config.model.text_input = "regions", "tokens"
    reset_unread(config)  # the global-vector sizes
    config.model.embed_dim, config.model.tokens.word_dim = 16, 8
    config.data.num_train, config.data.num_val, config.data.num_test = 100, 20, 20
    config.train.epochs, config.method_kwargs.warmup_epochs = 2, 1
    config.method_kwargs.neighbours = 5
    config.train.num_devices, config.train.progress_bar = 1, False
    results = train_and_evaluate(config, str(tmp_path))
    refresh = [r for r in _read(str(tmp_path)) if r.get("split") == "refresh"]
    assert [r["epoch"] for r in refresh] == [1] and refresh[0]["ot_converged"] == 1.0
    assert refresh[0]["confident_pairs"] > 0
    assert 0 < results["map_i2t"] <= 1 and 0 < results["map_t2i"] <= 1


def test_unconverged_label_ot_is_logged_as_a_warning(labelled, caplog):
    info, pairs, _ = labelled
    method = methods.build_method("uot_rcl", {"neighbours": 5, "label_max_iterations": 2})
    with caplog.at_level(logging.WARNING):
        _, diag, _ = _main_memory(method, info, pairs, jax.random.key(0))
    assert diag["ot_converged"] == 0.0
    assert "label partial OT of epoch 2 did not converge in" in caplog.text
    caplog.clear()
    method = methods.build_method("uot_rcl", {"neighbours": 5})
    with caplog.at_level(logging.WARNING):
        _main_memory(method, info, pairs, jax.random.key(0))
    assert "did not converge" not in caplog.text


def test_block_search_searching_every_block_gives_the_exact_refresh(labelled, caplog):
    """``knn='blocks'`` with every block searched is the exact search: the same refresh.
    An unknown search is refused; above ``EXACT_SEARCH_WARNING`` pairs the exact search's
    first refresh notes its cost and the block search."""
    info, pairs, _ = labelled
    n = pairs.num_records
    exact = methods.build_method("uot_rcl", {"neighbours": 5, "per_class": 2})
    blocks = methods.build_method(
        "uot_rcl",
        {"neighbours": 5, "per_class": 2, "knn": "blocks", "knn_block": 16, "knn_probes": n},
    )
    warn_above = mock.patch.object(uot_rcl, "EXACT_SEARCH_WARNING", n - 1)
    with warn_above, caplog.at_level(logging.WARNING):
        want, _, _ = _main_memory(exact, info, pairs, jax.random.key(0))
    assert f"every one of the {n} training pairs" in caplog.text
    assert "method_kwargs.knn='blocks'" in caplog.text
    caplog.clear()
    with warn_above, caplog.at_level(logging.WARNING):
        got, _, _ = _main_memory(blocks, info, pairs, jax.random.key(0))
    assert "method_kwargs.knn='blocks'" not in caplog.text  # the block search says nothing
    for name in ("labels", "targets_image", "targets_text"):
        np.testing.assert_allclose(got.samples[name], want.samples[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="knn"):
        methods.build_method("uot_rcl", {"knn": "approximate"})


@pytest.mark.parametrize("anchors", ["current", "snapshot"])
@pytest.mark.parametrize("knn", ["exact", "blocks"])
def test_embeddings_on_disk_give_the_refresh_in_memory(labelled, tmp_path, knn, anchors, caplog):
    """``embeddings='disk'``: the trainer hands the refresh its embeddings as memory-mapped
    files (``disk_stats``) and the refresh reads them a chunk at a time; the new memory is
    the in-memory refresh's. Above ``EMBEDDINGS_WARNING`` bytes the in-memory refresh
    names the switch."""
    info, pairs, _ = labelled
    kwargs = {"neighbours": 5, "per_class": 2, "knn": knn, "knn_block": 16, "knn_probes": 2}
    kwargs |= {"anchors": anchors, "knn_chunk": 24}
    device = methods.build_method("uot_rcl", kwargs)
    on_disk = methods.build_method("uot_rcl", kwargs | {"embeddings": "disk"})
    assert device.disk_stats == () and on_disk.disk_stats == ("z_image", "z_text")
    warn_above = mock.patch.object(uot_rcl, "EMBEDDINGS_WARNING", pairs.num_records * 8 * 8 - 1)
    with warn_above, caplog.at_level(logging.WARNING):
        want, _, stats = _main_memory(device, info, pairs, jax.random.key(0))
    assert "method_kwargs.embeddings='disk' keeps them in files" in caplog.text
    caplog.clear()
    files = {}
    for name in on_disk.disk_stats:
        np.save(tmp_path / f"{name}.npy", np.asarray(stats[name]))
        files[name] = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    ctx = base.InitContext(pairs.num_records, info, pairs.labels_image, pairs.labels_text, 8)
    records = [pairs.record_fn(i) for i in range(pairs.num_records)]

    def fetch(index):
        return {f: jnp.asarray(np.stack([records[i][f] for i in index])) for f in records[0]}

    refresh = base.RefreshContext(2, 10, 0, jax.random.key(1), fetch, scratch=str(tmp_path))
    with warn_above, caplog.at_level(logging.WARNING):
        got, _ = on_disk.refresh_fn(on_disk.init_memory(ctx), stats | files, refresh)
    assert "embeddings='disk'" not in caplog.text
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, a), b in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.heavy
def test_a_run_with_embeddings_on_disk_is_the_run_in_memory(tmp_path, devices):
    """The trainer writes the statistics pass's embeddings to ``workdir/scratch`` (here
    from a batch spread over 2 devices), the refresh reads them there, and the scratch
    directory is gone after it: the run logs what the in-memory run on 1 device logs."""

    def run(name, num_devices, **kwargs):
        config = load_config("uot_rcl", "synthetic,quick")
        config.data.num_train, config.data.num_val, config.data.num_test = 120, 20, 20
        config.train.epochs, config.method_kwargs.warmup_epochs = 2, 1
        config.method_kwargs.update(neighbours=5, knn_chunk=32, **kwargs)
        config.train.num_devices, config.train.progress_bar = num_devices, False
        workdir = str(tmp_path / name)
        train_and_evaluate(config, workdir)
        assert not os.path.exists(os.path.join(workdir, "scratch"))
        return [r for r in _read(workdir) if r.get("split") in ("refresh", "val")]

    want = run("device", 1)
    got = run("disk", 2, embeddings="disk")
    assert [r["split"] for r in got] == [r["split"] for r in want] and len(got) == 3
    for a, b in zip(got, want, strict=True):
        for key in ("selected_fraction", "transported_mass", "confident_pairs", "map_i2t"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_block_search_settings_hold_for_every_number_of_pairs(labelled):
    """More neighbours than a block search is sure to search are refused when the method
    is built, in one line naming the fields; what it accepts refreshes at any ``N``: 40
    pairs in blocks of 13 leave a last block of one pair, and the two smallest blocks
    searched hold 14 pairs, 13 other than the query."""
    kwargs = {"per_class": 2, "knn": "blocks", "knn_block": 13, "knn_probes": 2}
    with pytest.raises(
        ValueError, match=r"^uot_rcl neighbours must be <= \(knn_probes - 1\) \* knn_block = 13 "
    ):
        methods.build_method("uot_rcl", kwargs | {"neighbours": 14})
    methods.build_method("uot_rcl", kwargs | {"neighbours": 14, "exclude_self": False})
    methods.build_method("uot_rcl", kwargs | {"neighbours": 200, "knn": "exact"})
    with pytest.raises(ValueError, match=r"raise knn_probes or knn_block"):
        methods.build_method("uot_rcl", kwargs | {"neighbours": 1, "knn_probes": 1})
    info, pairs, _ = labelled
    method = methods.build_method("uot_rcl", kwargs | {"neighbours": 13})
    memory, _, _ = _main_memory(method, info, pairs, jax.random.key(0))
    assert np.isfinite(np.asarray(memory.samples["targets_image"])).all()


def test_refresh_during_warmup_changes_nothing(labelled):
    info, pairs, _ = labelled
    method = methods.build_method("uot_rcl")
    ctx = base.InitContext(pairs.num_records, info, pairs.labels_image, pairs.labels_text, 8)
    memory = method.init_memory(ctx)
    out, diag = method.refresh_fn(memory, {}, base.RefreshContext(1, 10, 0, None, None))
    assert out is memory and diag == {}
    assert [method.plan_fn(e).phase for e in range(4)] == [WARMUP, WARMUP, MAIN, MAIN]


def _train_setup(info, method, memory, *, num_devices, n=40):
    mesh = mesh_lib.make_mesh(num_devices)
    tx = optax.sgd(0.5)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(_model_cfg(), info, rngs),
        tx=tx,
        memory=memory,
        num_networks=1,
        seed=0,
    )
    state = jax.device_put(state, mesh_lib.replicated(mesh))
    fn = step_lib.make_train_step(graphdef, method, tx, num_samples=n)
    return mesh, state, jax.jit(fn, static_argnums=2)


@pytest.mark.heavy
@pytest.mark.parametrize("anchors", ["current", "snapshot"])
def test_train_step_one_device_equals_eight(labelled, devices, anchors):
    info, pairs, batches = labelled
    method = methods.build_method("uot_rcl", {"neighbours": 5, "per_class": 2, "anchors": anchors})
    memory = _main_memory(method, info, pairs, jax.random.key(3))[0]
    results = []
    for num_devices in (1, 8):
        mesh, state, train_step = _train_setup(info, method, memory, num_devices=num_devices)
        start = jax.device_get(state.params)
        with jax.set_mesh(mesh):
            for batch in batches:
                state, metrics = train_step(
                    state, pipeline.to_device(batch, mesh_lib.batch_sharding(mesh)), MAIN
                )
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (one, m1), (eight, m8) = results
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    for key in ("loss", "loss_plc", "loss_bhg"):
        np.testing.assert_allclose(m1[key], m8[key], rtol=2e-5, atol=2e-6)
    moved = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(start), strict=True)
    )
    assert moved > 1e-4 and np.isfinite(m1["loss"][0])


def test_value_and_grad_is_finite_and_stops_at_targets_and_anchors(labelled):
    info, pairs, batches = labelled
    method = methods.build_method("uot_rcl", {"neighbours": 5, "per_class": 2})
    memory = _main_memory(method, info, pairs, jax.random.key(4))[0]
    from flax import nnx

    model = models.build_model(_model_cfg(), info, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {k: jnp.asarray(v) for k, v in batches[1].items()}  # the padded batch
    index = jnp.asarray(batch["index"])

    def loss(params, labels, anchors_image):
        m = nnx.merge(graphdef, params, rest)
        state = dict(memory.state, anchors_image=anchors_image)
        outputs = method.forward_fn(m, batch, state, train=True, rngs=None, phase=MAIN)
        rows = {"labels": labels[index]}
        per_example, _ = method.loss_fn(outputs, batch, rows, {}, _ctx(MAIN, 40))
        return jnp.sum(jnp.where(batch["mask"], per_example, 0.0))

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        params, memory.samples["labels"], memory.state["anchors_image"]
    )
    assert np.isfinite(value) and value > 0
    leaves = jax.tree.leaves(grads[0])
    assert all(np.isfinite(x).all() for x in leaves) and max(np.abs(x).max() for x in leaves) > 0
    # Targets and the confident set are data: the loss is linear in Q, but nothing flows
    # back into the estimation step's arrays through the anchors (stop_gradient).
    np.testing.assert_array_equal(grads[2], 0.0)


# ----------------------------------------------------------------------------- end to end


def _read(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``uot_synthetic:quick`` trained once, in the layout of the notebook's noise sweep."""
    sweep = tmp_path_factory.mktemp("sweep")
    workdir = sweep / "uot_synthetic_0.4"
    config = load_config("uot_rcl", "synthetic,quick")
    config.train.progress_bar = False
    config.train.num_devices = 4  # batch 100 splits over 4 of the 8 test devices
    return train_and_evaluate(config, str(workdir)), workdir


@pytest.mark.heavy
def test_quick_run_corrects_labels_and_logs_diagnostics(quick_run):
    results, workdir = quick_run
    rows = _read(str(workdir))
    refresh = [r for r in rows if r.get("split") == "refresh"]
    assert [r["epoch"] for r in refresh] == [2, 3]
    for r in refresh:
        assert r["ot_converged"] == 1.0
        assert r["transported_mass"] == pytest.approx(r["mass"], abs=2e-3)
    assert refresh[0]["mass"] == pytest.approx(0.2) and refresh[-1]["mass"] == pytest.approx(0.8)
    val = [r for r in rows if r.get("split") == "val"]
    assert val[-1]["selected_fraction"] == pytest.approx(0.8, abs=0.05)
    # After two warm-up epochs of 10 steps the first 20% transported are far cleaner than
    # the observed labels (the full-size claim is the slow test below).
    first = val[2]
    assert first["selected_fraction"] == pytest.approx(0.2, abs=0.03)
    assert first["corrected_accuracy"] > first["observed_accuracy"] + 0.1, first
    assert results["map_avg"] > 0.15
    # The MRL protocol also tests the last epoch's parameters (use_mrl: eval.test_last_epoch).
    if results["best_epoch"] == 3:
        assert results["last_map_avg"] == results["map_avg"]
    else:
        assert 0 < results["last_map_avg"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("rate,margin,corrected_margin", [(0.4, 0.01, 0.02), (0.6, 0.04, 0.1)])
def test_uot_rcl_beats_ce_under_symmetric_label_noise(tmp_path, rate, margin, corrected_margin):
    """Both trained the same way (same data, backbone, schedule, best-on-validation)."""
    scores = {}
    for name in ("uot_rcl", "ce"):
        config = load_config(name, "synthetic")
        config.noise.rate = rate
        config.data.num_train, config.train.epochs = 3000, 12
        if name == "uot_rcl":
            config.method_kwargs.neighbours = 15
        config.train.progress_bar = False
        config.train.num_devices = 4
        workdir = str(tmp_path / name)
        scores[name] = train_and_evaluate(config, workdir)
        if name == "uot_rcl":
            last = [r for r in _read(workdir) if r.get("split") == "val"][-1]
            assert last["corrected_accuracy"] > last["observed_accuracy"] + corrected_margin, last
    uot, ce = scores["uot_rcl"], scores["ce"]
    for key in ("map_i2t", "map_t2i"):
        assert uot[key] > ce[key] + margin, (key, uot[key], ce[key])
        # Without early stopping CE memorises the noise; UOT-RCL keeps its level.
        assert uot[f"last_{key}"] > ce[f"last_{key}"] + 0.04, (key, uot, ce)


@pytest.mark.heavy
def test_notebook_runs_on_the_quick_run(quick_run):
    """``notebooks/uot_rcl_label_correction.py`` top to bottom: figures and tables."""
    _, workdir = quick_run
    sweep = workdir.parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = ""  # one CPU device for the notebook's own (CE) run
    env.update(
        NCLJAX_WORKDIR=str(workdir),
        NCLJAX_SWEEP_DIR=str(sweep),  # the UOT-RCL point at 0.4 is the quick run itself
        NCLJAX_SWEEP_ARG="quick",
        NCLJAX_NOISE_RATES="0.4",
        MPLBACKEND="Agg",
    )
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "notebooks", "uot_rcl_label_correction.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("label_correction.png", "map_vs_noise.png"):
        assert (workdir / "figures" / name).stat().st_size > 10_000
    assert (sweep / "ce_synthetic_0.4" / "results.json").exists()
    lines = out.stdout.splitlines()
    assert any(line.strip().startswith("0.4 |") for line in lines), out.stdout
    epoch_rows = [line.split() for line in lines if line.split()[:1] == ["3"]]
    assert epoch_rows and float(epoch_rows[0][3]) > 0  # corrected accuracy at epoch 3
