"""The GSC method: loss and buffers, label exchange, per-epoch refresh, 1 vs 8 devices."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ncljax import config as config_lib
from ncljax import labels as labels_lib
from ncljax import losses, methods, models
from ncljax.data import pipeline
from ncljax.methods import base
from ncljax.methods import gsc as gsc_lib
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib
from ncljax.train import train_and_evaluate

B, N = 32, 40
MAIN, WARMUP = 1, 0


def _ctx(phase=MAIN):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, zero, phase, N, zero, jax.random.key(0))


def _outputs(seed, b=6):
    rng = np.random.default_rng(seed)
    u = lambda: jnp.asarray(rng.uniform(0.05, 0.95, size=(b, b)).astype(np.float32))
    return {"sim": u(), "sim_image": u(), "sim_text": u()}


def _rows(values):
    return {name: jnp.asarray(values, jnp.float32) for name in gsc_lib._BUFFERS}


@pytest.mark.parametrize("exchange", [True, False])
def test_loss_uses_peer_labels_and_writes_own_buffers(exchange):
    method = methods.build_method(
        "gsc", {"intra_weight": 0.3, "exchange_labels": exchange, "num_networks": 2}
    )
    outputs = _outputs(0)
    mask = jnp.array([True, True, True, False, True, True])
    own = _rows([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    peer = _rows([0.0, 0.2, 1.0, 0.3, 0.4, 1.0])
    loss, aux = method.loss_fn(outputs, {"mask": mask}, own, peer, _ctx())
    y = (peer if exchange else own)["labels"]
    want = losses.gsc_loss(
        outputs["sim"], outputs["sim_image"], outputs["sim_text"], y, intra_weight=0.3, where=mask
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(
        aux.memory["cross"],
        labels_lib.gsc_cross_modal_indicator(outputs["sim"], where=mask),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        aux.memory["intra"],
        labels_lib.gsc_intra_modal_score(outputs["sim_image"], outputs["sim_text"], y, where=mask),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(aux.clean_estimate, own["labels"])  # own belief, logged
    if exchange:
        assert loss[0] == 0.0  # the peer judged pair 0 fully noisy


def test_warmup_phases():
    outputs, mask = _outputs(1), jnp.ones(6, bool)
    rows = _rows(np.zeros(6))  # ignored in warm-up
    unit = methods.build_method("gsc", {"warmup_epochs": 2})
    loss, aux = unit.loss_fn(outputs, {"mask": mask}, rows, rows, _ctx(WARMUP))
    want = losses.gsc_loss(outputs["sim"], outputs["sim_image"], outputs["sim_text"], jnp.ones(6))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert not aux.memory  # no buffer writes
    i2t = methods.build_method("gsc", {"warmup_epochs": 2, "warmup_loss": "infonce_i2t"})
    loss, _ = i2t.loss_fn({"sim": outputs["sim"]}, {"mask": mask}, rows, rows, _ctx(WARMUP))
    np.testing.assert_allclose(loss, losses.info_nce(outputs["sim"] / 0.07), rtol=1e-6)
    plans = [unit.plan_fn(e) for e in range(4)]
    assert [p.phase for p in plans] == [WARMUP, WARMUP, MAIN, MAIN]
    assert [p.refresh for p in plans] == [False, False, False, True]
    default = methods.build_method("gsc")
    assert [default.plan_fn(e).refresh for e in range(3)] == [False, True, True]


def test_equal_intra_scores_keep_the_previous_labels_with_a_warning(caplog):
    method = methods.build_method("gsc")
    memory = method.init_memory(base.InitContext(N, None, None, None))
    previous = np.where(np.arange(N) % 4 == 0, 0.2, 0.9).astype(np.float32)
    samples = dict(
        memory.samples,
        ema_cross=previous,
        ema_intra=previous,
        labels=previous,
        cross=jnp.full(N, 0.5),
        intra=jnp.full(N, 0.3),
    )
    ctx = base.RefreshContext(4, 10, 0, None, None)
    with caplog.at_level(logging.WARNING):
        new, diagnostics = method.refresh_fn(base.Memory(samples, {}), None, ctx)
    assert "network 0's intra-modal scores of epoch 4 are all equal" in caplog.text
    np.testing.assert_array_equal(new.samples["labels"], previous)
    assert diagnostics["gmm_degenerate"]


def test_refresh_updates_labels_from_buffers():
    method = methods.build_method("gsc", {"cross_momentum": 0.6, "intra_momentum": 0.8})
    memory = method.init_memory(base.InitContext(N, None, None, None))
    rng = np.random.default_rng(0)
    clean = rng.random(N) < 0.6
    cross = np.where(clean, 0.9, 0.1).astype(np.float32)
    intra = np.where(clean, rng.normal(0.8, 0.03, N), rng.normal(0.3, 0.05, N)).astype(np.float32)
    samples = dict(memory.samples, cross=jnp.asarray(cross), intra=jnp.asarray(intra))
    new, diagnostics = method.refresh_fn(base.Memory(samples, {}), None, None)
    s = jax.device_get(new.samples)
    want_cross = 0.6 * cross + 0.4 * 1.0
    np.testing.assert_allclose(s["ema_cross"], want_cross, rtol=1e-6)
    np.testing.assert_allclose(s["ema_intra"], 0.8 * s["intra_posterior"] + 0.2, rtol=1e-6)
    np.testing.assert_allclose(s["labels"], np.minimum(s["ema_cross"], s["ema_intra"]))
    np.testing.assert_array_equal((s["labels"] > 0.5), clean)
    np.testing.assert_array_equal(s["cross"], cross)  # buffers are overwritten by training
    assert diagnostics["gmm_mean_high"] > diagnostics["gmm_mean_low"]
    assert float(diagnostics["label_clean_fraction"]) == pytest.approx(clean.mean())
    scores = gsc_lib.diagnostic_scores(new)
    assert set(scores) == {
        "label",
        "cross_label",
        "intra_label",
        "cross_indicator",
        "intra_score",
        "intra_fitted",
        "intra_posterior",
    }


def test_bad_options_say_what_to_set():
    with pytest.raises(ValueError, match="warmup_loss"):
        methods.build_method("gsc", {"warmup_loss": "triplet"})
    with pytest.raises(ValueError, match="num_networks"):
        methods.build_method("gsc", {"num_networks": 3})


# --- the jitted train step -------------------------------------------------------------


def _model_cfg(head="cosine"):
    cfg = config_lib.base_config().model
    cfg.embed_dim, cfg.tokens.word_dim = 32, 16
    if head == "sgr":
        cfg.head, cfg.sgraf.sim_dim, cfg.tokens.dropout = "sgr", 16, 0.0
    return cfg


def _setup(info, method, *, num_devices, head="cosine", labels=None):
    mesh = mesh_lib.make_mesh(num_devices)
    tx = optax.sgd(0.5)  # linear in the gradient (see tests/train/test_step.py)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(_model_cfg(head), info, rngs),
        tx=tx,
        memory=method.init_memory(base.InitContext(N, info, None, None)),
        num_networks=method.num_networks,
        seed=0,
    )
    if labels is not None:
        samples = dict(state.memory.samples, labels=jnp.asarray(labels, jnp.float32))
        state = state._replace(memory=base.Memory(samples, state.memory.state))
    state = jax.device_put(state, mesh_lib.replicated(mesh))
    fn = step_lib.make_train_step(graphdef, method, tx, num_samples=N)
    return mesh, state, jax.jit(fn, static_argnums=2)


def _train(info, method, batches, **kwargs):
    mesh, state, train_step = _setup(info, method, **kwargs)
    metrics = []
    with jax.set_mesh(mesh):
        for batch in batches:
            state, m = train_step(
                state, pipeline.to_device(batch, mesh_lib.batch_sharding(mesh)), 1
            )
            metrics.append(m)
    return jax.device_get(state), jax.device_get(metrics)


def _max_change(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


@pytest.mark.parametrize("exchange", [True, False])
def test_each_network_trains_with_the_other_networks_labels(data, exchange):
    """Network 0 holds labels 1, network 1 labels 0. With the exchange, network 0 trains
    with zero weights (its parameters stay put) and masks its structures away (its
    intra-modal scores are 0), while network 1 trains; without it, the other way round."""
    info, batches = data
    method = methods.build_method("gsc", {"exchange_labels": exchange, "num_networks": 2})
    labels = np.stack([np.ones(N), np.zeros(N)])
    _, fresh, _ = _setup(info, method, num_devices=1, labels=labels)
    state, _ = _train(info, method, batches[:1], num_devices=1, labels=labels)
    fresh = jax.device_get(fresh)
    frozen, trained = (0, 1) if exchange else (1, 0)
    net = lambda tree, k: state_lib.network(tree, k)
    assert _max_change(net(state.params, frozen), net(fresh.params, frozen)) == 0.0
    assert _max_change(net(state.params, trained), net(fresh.params, trained)) > 1e-3
    seen = batches[0]["index"]
    intra = state.memory.samples["intra"]
    np.testing.assert_array_equal(intra[frozen, seen], 0.0)
    assert (np.abs(intra[trained, seen]) > 1e-4).all()
    cross = state.memory.samples["cross"]  # each network writes its own indicator
    assert (cross[:, seen] > 0).all() and (cross[:, seen] < 1).all()
    assert np.abs(cross[0, seen] - cross[1, seen]).max() > 1e-4


@pytest.mark.parametrize("head", ["cosine", pytest.param("sgr", marks=pytest.mark.slow)])
def test_one_device_equals_eight(data, devices, head):
    info, batches = data
    method = methods.build_method("gsc", {"num_networks": 2, "intra_weight": 0.5})
    rng = np.random.default_rng(0)
    labels = rng.uniform(0, 1, size=(2, N))  # masks and weights matter
    steps = batches if head == "cosine" else batches[:1]
    # The SGR graph (BatchNorm over the sharded batch, three reasoning steps) reorders more
    # float32 sums across devices than the cosine model.
    rtol, atol = (2e-5, 2e-6) if head == "cosine" else (2e-4, 2e-5)
    one = _train(info, method, steps, num_devices=1, head=head, labels=labels)
    eight = _train(info, method, steps, num_devices=8, head=head, labels=labels)
    for a, b in [
        (one[1], eight[1]),
        (one[0].params, eight[0].params),
        (one[0].memory, eight[0].memory),
    ]:
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
    assert one[1][0]["loss_intra"][1] == 2 * B  # two networks, real pairs only


def test_gsc_trains_end_to_end_and_saves_label_diagnostics(tmp_path):
    config = config_lib.base_config()
    config.method = "gsc"
    config.method_kwargs = config_lib.method_kwargs("gsc")
    config.noise.kind, config.noise.rate = "per_caption", 0.4
    config.model.embed_dim, config.model.tokens.word_dim = 32, 16
    config.data.num_train, config.data.num_val, config.data.num_test = 64, 16, 16
    config.train.epochs, config.train.batch_size = 2, 32
    config.train.progress_bar, config.train.num_devices = False, 1
    config.eval.batch_size = 32
    results = train_and_evaluate(config, str(tmp_path))
    assert {"rsum", "noise_auc", "clean_precision", "clean_recall"} <= results.keys()
    files = sorted(glob.glob(os.path.join(tmp_path, "diagnostics", "*.npz")))
    assert [os.path.basename(f) for f in files] == ["epoch_0000.npz", "epoch_0001.npz"]
    with np.load(files[1]) as npz:
        num = config.data.num_train * config.data.captions_per_image
        for name in ("label", "cross_label", "intra_label", "intra_fitted"):
            total = npz[f"{name}_hist_clean"].sum(1) + npz[f"{name}_hist_noisy"].sum(1)
            np.testing.assert_array_equal(total, [num, num])  # per network
        assert npz["clean_tracked"].mean() == pytest.approx(0.5)
    import json

    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    refresh = [r for r in rows if r["split"] == "refresh"]
    assert [r["epoch"] for r in refresh] == [1]
    assert {"gmm_mean_high_net0", "gmm_mean_low_net1", "label_mean_net1"} <= refresh[0].keys()
    val = [r for r in rows if r["split"] == "val"]
    for name in ("label", "cross_label", "intra_label"):
        assert all(f"noise_auc_{name}" in r for r in val)
    assert val[0]["noise_auc_label"] == 0.5  # epoch 0 trains with all labels 1


def _load_config(name, arg=""):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return config_lib.load_file(os.path.join(root, "configs", f"{name}.py"), arg)


@pytest.mark.slow
def test_gsc_beats_vse_and_detects_the_noise_on_synthetic_data(tmp_path):
    """40% per-caption noise, 20,000 pairs, 12 epochs, same encoders, optimiser and data
    (the quickstart, single-network GSC; ``vse.py:synthetic``): about 2 minutes each."""
    results = {}
    for name, arg in (("quickstart", ""), ("vse", "synthetic")):
        config = _load_config(name, arg)
        config.train.progress_bar = False
        config.train.num_devices = 1  # 8 fake devices on 2 cores only add overhead here
        results[name] = train_and_evaluate(config, str(tmp_path / name))
    gsc, vse = results["quickstart"], results["vse"]
    assert gsc["rsum"] > vse["rsum"] + 100, (gsc["rsum"], vse["rsum"])
    assert gsc["noise_auc"] >= 0.9, gsc
    assert gsc["clean_precision"] >= 0.9, gsc


@pytest.mark.parametrize(
    ("kind", "text_form"),
    [
        pytest.param("sgr", "attention", marks=pytest.mark.slow),  # SAF holds every BatchNorm
        ("saf", "attention"),
        pytest.param("saf", "aligned", marks=pytest.mark.slow),
    ],
)
def test_intra_modal_passes_keep_padding_out_of_batchnorm(kind, text_form):
    """GSC's intra-modal passes (fresh VisualSA global vectors, SGRAF's image-image and
    text-text heads) on a padded batch equal those on its real pairs alone, running
    BatchNorm statistics included."""
    from flax import nnx

    from tests.models import test_sgraf as sgraf_tests

    batch = sgraf_tests.make_batch(seed=60)
    real = {**batch, "mask": np.ones(len(batch["length"]), bool)}
    results = []
    for inputs in (real, sgraf_tests.pad_batch(batch, 3)):
        model = sgraf_tests.make_model(kind, seed=60, dropout=0.0)
        graphdef, state = nnx.split(model)

        @jax.jit
        def passes(state, inputs, graphdef=graphdef):
            model = nnx.merge(graphdef, state)
            outputs = model(inputs, train=True)
            image_sim, text_sim = gsc_lib.intra_similarities(
                model, outputs, recompute=True, text_form=text_form
            )
            return image_sim, text_sim, nnx.state(model)

        image_sim, text_sim, state = passes(state, jax.tree.map(jnp.asarray, inputs))
        nnx.update(model, state)
        k = len(batch["length"])
        results.append(
            (
                np.asarray(image_sim)[:k, :k],
                np.asarray(text_sim)[:k, :k],
                *sgraf_tests.batchnorm_statistics(model),
            )
        )
    for got, want in zip(results[1], results[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
