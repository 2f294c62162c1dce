"""The jitted train step: device-count invariance, no retracing, memory, dual networks, NaN."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ncljax import config as config_lib
from ncljax import methods, models
from ncljax.data import pipeline, synthetic
from ncljax.methods import base
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib

B = 32


@pytest.fixture(scope="module")
def data():
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test = 40, 4, 4
    ds = synthetic.SyntheticDataset(cfg)
    split = ds.split("train")
    record = pipeline.pair_records(
        split, image_fields=("regions",), text_fields=("tokens", "length")
    )
    batches = list(pipeline.batches(record, 40, batch_size=B, seed=0))  # 2 batches, 2nd padded
    return ds.info, batches


def _model_cfg():
    cfg = config_lib.base_config().model
    cfg.embed_dim, cfg.tokens.word_dim = 32, 16
    return cfg


def _setup(info, method, *, num_devices, num_samples=40, seed=0, tx=None):
    mesh = mesh_lib.make_mesh(num_devices)
    tx = tx or optax.adam(1e-2)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(_model_cfg(), info, rngs),
        tx=tx,
        memory=method.init_memory(base.InitContext(num_samples, info, None, None)),
        num_networks=method.num_networks,
        seed=seed,
    )
    state = jax.device_put(state, mesh_lib.replicated(mesh))
    fn = step_lib.make_train_step(graphdef, method, tx, num_samples=num_samples)
    return mesh, state, jax.jit(fn, static_argnums=2)


def _run(info, method, batches, *, num_devices, tx=None):
    mesh, state, train_step = _setup(info, method, num_devices=num_devices, tx=tx)
    metrics = []
    with jax.set_mesh(mesh):
        for batch in batches:
            state, m = train_step(
                state, pipeline.to_device(batch, mesh_lib.batch_sharding(mesh)), 0
            )
            metrics.append(m)
    return jax.device_get(state), jax.device_get(metrics)


def _close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _recording_method():
    """Writes, for every pair of the batch, the peer network's row and the step into memory."""

    def init_memory(ctx):
        num_samples = ctx.num_samples
        return base.Memory(
            samples={
                "label": jnp.zeros(num_samples),
                "got_peer": jnp.full(num_samples, -1.0),
                "seen_at": jnp.full(num_samples, -1, jnp.int32),
            },
            state={},
        )

    vse = methods.build_method("vse")

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        loss, _ = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        memory = {
            "got_peer": peer_rows["label"],
            "seen_at": jnp.full(loss.shape, ctx.step, jnp.int32),
        }
        return loss, base.Aux(memory=memory, metrics={"own": rows["label"]})

    return base.Method(name="rec", init_memory=init_memory, loss_fn=loss_fn, num_networks=2)


def test_one_device_equals_eight(data, devices):
    info, batches = data
    method = methods.build_method("vse")
    # SGD is linear in the gradient; Adam's first steps (~lr * sign(g)) would turn
    # last-ulp differences of near-zero gradients into visible ones.
    tx = optax.sgd(0.5)
    one = _run(info, method, batches, num_devices=1, tx=tx)
    eight = _run(info, method, batches, num_devices=8, tx=tx)
    _close(one[1], eight[1])  # per-step (sum, count) of the loss
    _close(one[0].params, eight[0].params)
    _close(one[0].opt_state, eight[0].opt_state)
    # The step really trains: parameters moved and the loss is a real number.
    _, fresh, _ = _setup(info, method, num_devices=1, tx=tx)
    moved = jax.tree.map(
        lambda a, b: np.abs(a - b).max(), one[0].params, jax.device_get(fresh.params)
    )
    assert max(jax.tree.leaves(moved)) > 1e-3
    assert one[1][0]["loss"][1] == B and one[1][1]["loss"][1] == 40 - B  # padding not counted


def test_memory_rows_scatter_and_peer_exchange_on_eight_devices(data, devices):
    info, batches = data
    method = _recording_method()
    mesh, state, train_step = _setup(info, method, num_devices=8)
    labels = jnp.stack([jnp.full(40, 0.25), jnp.full(40, 0.75)])
    samples = dict(state.memory.samples, label=labels)
    state = state._replace(memory=base.Memory(samples, {}))
    with jax.set_mesh(mesh):
        for batch in batches:
            state, metrics = train_step(
                state, pipeline.to_device(batch, mesh_lib.batch_sharding(mesh)), 0
            )
    got = np.asarray(state.memory.samples["got_peer"])
    np.testing.assert_array_equal(got[0], 0.75)  # network 0 read network 1's rows
    np.testing.assert_array_equal(got[1], 0.25)
    seen = np.asarray(state.memory.samples["seen_at"])
    first = batches[0]["index"]
    second = batches[1]["index"][batches[1]["mask"]]
    np.testing.assert_array_equal(seen[:, first], 0)
    np.testing.assert_array_equal(seen[:, second], 1)
    assert (seen >= 0).all()  # every real sample written exactly by its batch; padding dropped
    # Metrics average the gathered rows over both networks and valid pairs only.
    own = jax.device_get(metrics["own"])
    np.testing.assert_allclose(own[0] / own[1], 0.5, atol=1e-6)
    assert own[1] == 2 * (40 - B)


def test_dual_networks_train_independently(data):
    """Network k of a dual step equals a single-network step from network k's parameters."""
    info, batches = data
    dual = methods.build_method("vse", {"num_networks": 2})
    single = methods.build_method("vse")
    tx = optax.sgd(0.5)  # linear in the gradient, see test_one_device_equals_eight
    mesh, state2, step2 = _setup(info, dual, num_devices=1, tx=tx)
    _, state1, step1 = _setup(info, single, num_devices=1, tx=tx)
    batch = pipeline.to_device(batches[0], mesh_lib.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        new2, _ = step2(state2, batch, 0)
        for k in range(2):
            start = state1._replace(
                params=jax.tree.map(lambda x, k=k: x[k : k + 1], state2.params),
                opt_state=jax.tree.map(lambda x, k=k: x[k : k + 1], state2.opt_state),
            )
            new1, _ = step1(start, batch, 0)
            _close(
                jax.tree.map(lambda x, k=k: x[k : k + 1], jax.device_get(new2.params)),
                jax.device_get(new1.params),
            )
    a, b = (state_lib.network(jax.device_get(new2.params), k) for k in range(2))
    assert max(jax.tree.leaves(jax.tree.map(lambda x, y: np.abs(x - y).max(), a, b))) > 1e-3


def test_no_retrace_across_steps(data):
    info, batches = data
    traces = []
    vse = methods.build_method("vse")

    def loss_fn(*args):
        traces.append(1)  # runs at trace time only
        return vse.loss_fn(*args)

    method = vse._replace(loss_fn=loss_fn)
    mesh, state, train_step = _setup(info, method, num_devices=2)
    with jax.set_mesh(mesh):
        for batch in batches * 3:
            state, _ = train_step(
                state, pipeline.to_device(batch, mesh_lib.batch_sharding(mesh)), 0
            )
    assert int(state.step) == 6
    assert len(traces) == 1
    with jax.set_mesh(mesh):  # a new static phase compiles once more, then is cached too
        for batch in batches:
            state, _ = train_step(
                state, pipeline.to_device(batch, mesh_lib.batch_sharding(mesh)), 1
            )
    assert len(traces) == 2


@pytest.mark.parametrize("field", ["regions", "loss"])
def test_nonfinite_step_is_skipped_and_recorded(data, field):
    info, batches = data
    method = methods.build_method("vse")
    if field == "loss":
        vse = method

        def loss_fn(outputs, batch, rows, peer_rows, ctx):
            loss, aux = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
            return jnp.where(ctx.step == 1, jnp.nan, loss), aux

        method = method._replace(loss_fn=loss_fn)
    mesh, state, train_step = _setup(info, method, num_devices=1)
    bad = dict(batches[1])
    if field == "regions":
        bad["regions"] = bad["regions"].copy()
        bad["regions"][3, 0, 0] = np.nan
    sharding = mesh_lib.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        state, _ = train_step(state, pipeline.to_device(batches[0], sharding), 0)
        good = jax.device_get(state)
        state, _ = train_step(state, pipeline.to_device(bad, sharding), 0)
    after = jax.device_get(state)
    assert int(after.step) == 2 and int(after.nonfinite_step) == 1
    _close(after.params, good.params, rtol=0, atol=0)
    _close(after.opt_state, good.opt_state, rtol=0, atol=0)
    assert int(good.nonfinite_step) == -1


def test_networks_draw_different_dropout_keys(data):
    """Two networks with identical parameters diverge only through their dropout masks."""
    info, batches = data
    dual = methods.build_method("vse", {"num_networks": 2})
    cfg = _model_cfg()
    cfg.tokens.dropout = 0.5
    tx = optax.sgd(0.5)
    mesh = mesh_lib.make_mesh(1)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(cfg, info, rngs),
        tx=tx,
        memory=dual.init_memory(base.InitContext(40, info, None, None)),
        num_networks=2,
        seed=0,
    )
    twin = jax.tree.map(lambda x: jnp.stack([x[0], x[0]]), state.params)
    state = state._replace(params=twin, opt_state=jax.vmap(tx.init)(twin))
    step = jax.jit(
        step_lib.make_train_step(graphdef, dual, tx, num_samples=40),
        static_argnums=2,
    )
    with jax.set_mesh(mesh):
        new, _ = step(state, pipeline.to_device(batches[0], mesh_lib.batch_sharding(mesh)), 0)
    a, b = (state_lib.network(jax.device_get(new.params), k) for k in range(2))
    gap = max(jax.tree.leaves(jax.tree.map(lambda x, y: np.abs(x - y).max(), a, b)))
    assert gap > 1e-4


def test_clean_estimates_are_scored_against_the_true_mask_only_for_logs(data):
    info, batches = data
    vse = methods.build_method("vse")
    seen = []

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        seen.append(sorted(batch))  # the method never receives the clean mask
        loss, _ = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        estimate = (batch["index"] % 3 != 0).astype(jnp.float32)  # "clean" unless index % 3 == 0
        return loss, base.Aux(clean_estimate=estimate)

    method = vse._replace(loss_fn=loss_fn)
    mesh, state, train_step = _setup(info, method, num_devices=2)
    clean = np.arange(40) % 2 == 0
    with jax.set_mesh(mesh):
        sharded = pipeline.to_device(batches[1], mesh_lib.batch_sharding(mesh))
        _, metrics = train_step(state, sharded, 0, jnp.asarray(clean))
    index = batches[1]["index"][batches[1]["mask"]]
    selected, truth = index % 3 != 0, clean[index]
    np.testing.assert_allclose(
        metrics["step_clean_precision"], [(selected & truth).sum(), selected.sum()]
    )
    np.testing.assert_allclose(
        metrics["step_clean_recall"], [(selected & truth).sum(), truth.sum()]
    )
    assert all("clean" not in keys for keys in seen)


def test_the_reduction_applies_the_methods_weights(data):
    """``Aux.weight``: the trainer's reduction multiplies each pair's loss by it (weights
    not renormalised; a zero drops the pair), the same update as a method that weights its
    own losses; the logged loss is the weighted one."""
    info, batches = data
    vse = methods.build_method("vse")

    def weights(batch):
        return (batch["index"] % 3).astype(jnp.float32)  # 0, 1, 2, ...

    def by_the_trainer(outputs, batch, rows, peer_rows, ctx):
        per_example, aux = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        return per_example, dataclasses.replace(aux, weight=weights(batch))

    def by_the_method(outputs, batch, rows, peer_rows, ctx):
        per_example, aux = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        return weights(batch) * per_example, aux

    state_a, metrics_a = _run(info, vse._replace(loss_fn=by_the_trainer), batches, num_devices=2)
    state_b, metrics_b = _run(info, vse._replace(loss_fn=by_the_method), batches, num_devices=2)
    state_c, _ = _run(info, vse, batches, num_devices=2)
    _close(state_a.params, state_b.params)
    _close([m["loss"] for m in metrics_a], [m["loss"] for m in metrics_b])
    differs = jax.tree.leaves(
        jax.tree.map(lambda x, y: np.abs(x - y).max(), state_a.params, state_c.params)
    )
    assert max(differs) > 1e-4  # the weights changed the update


@pytest.mark.parametrize("in_turn", [False, True])
def test_a_nonfinite_update_writes_no_memory_row(data, in_turn):
    """A step writes memory in place at its batch's rows and at the rows its loss names
    (``Aux.memory_at``), each update only if everything it computed is finite: the
    nonfinite network's memory is as before the step (all rows), a finite network of the
    same step keeps its rows (values of the parameters the step started from), and no
    parameter moves."""
    info, batches = data
    recording = _recording_method()

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        loss, aux = recording.loss_fn(outputs, batch, rows, peer_rows, ctx)
        at = (jnp.asarray([7, 31], jnp.int32), {"label": jnp.full((2,), 5.0) + ctx.step})
        bad = (ctx.step == 1) & (ctx.network == 1)  # one network's update only
        return jnp.where(bad, jnp.nan, loss), dataclasses.replace(aux, memory_at=at)

    method = recording._replace(loss_fn=loss_fn)
    mesh, state, train_step = _setup(info, method, num_devices=1)
    spec = step_lib.StepSpec(phase=0, in_turn=in_turn)
    sharding = mesh_lib.batch_sharding(mesh)
    network = 1 if in_turn else 0
    with jax.set_mesh(mesh):
        state, _ = train_step(state, pipeline.to_device(batches[0], sharding), spec, None, network)
        written = jax.device_get(state)
        state, _ = train_step(state, pipeline.to_device(batches[1], sharding), spec, None, network)
    after = jax.device_get(state)
    assert int(after.nonfinite_step) == 1
    _close(after.params, written.params, rtol=0, atol=0)
    _close(after.opt_state, written.opt_state, rtol=0, atol=0)
    first = np.asarray(batches[0]["index"])[np.asarray(batches[0]["mask"])]
    second = np.asarray(batches[1]["index"])[np.asarray(batches[1]["mask"])]
    trained = [network] if in_turn else [0, 1]
    for k in range(2):
        seen = np.asarray(after.memory.samples["seen_at"])[k]
        label = np.asarray(after.memory.samples["label"])[k]
        want_seen, want_label = np.full(40, -1), np.zeros(40)
        if k in trained:
            want_seen[first] = 0
            want_label[[7, 31]] = 5.0
        if k == 0 and not in_turn:  # the finite network of the nonfinite step
            want_seen[second] = 1
            want_label[[7, 31]] = 6.0
        np.testing.assert_array_equal(seen, want_seen)
        np.testing.assert_array_equal(label, want_label)
