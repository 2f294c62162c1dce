"""Epochs as plans: streams, in-turn passes, sequential updates, resets, schedules, resume."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from ncljax import config as config_lib
from ncljax import methods, models, optim
from ncljax.data import pipeline, synthetic
from ncljax.methods import base
from ncljax.train import loop, passes, train_and_evaluate
from ncljax.train import mesh as mesh_lib
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib
from tests.train.test_loop import load_config, read_metrics, tiny

N, B = 40, 8


def toy_record(k):
    return {"x": np.full(3, k, np.float32), "index": np.int32(k), "mask": np.bool_(True)}


def real_indices(batch):
    return batch["index"][batch["mask"]].tolist()


# ----------------------------------------------------------------------- streams


def test_main_stream_once_aux_stream_cycles_and_resume_replays():
    main = np.array([3, 5, 7, 11, 13, 17, 19, 23, 29, 31])  # 10 pairs: batches 4, 4, 2
    aux = np.array([0, 2, 4, 6, 8, 10, 12])  # 7 pairs: 4 + 3 per cycle
    streams = (
        pipeline.StreamOrder(main, (1, 2), False),
        pipeline.StreamOrder(aux, (1, 2, 1), True),
    )
    got = list(
        pipeline.stream_batches(toy_record, N, streams, batch_size=4, num_steps=3, num_threads=1)
    )
    seen_main = [i for m, _ in got for i in real_indices(m)]
    assert sorted(seen_main) == sorted(main.tolist())  # each main pair exactly once
    seen_aux = [real_indices(a) for _, a in got]
    assert [len(s) for s in seen_aux] == [4, 3, 4]
    assert sorted(seen_aux[0] + seen_aux[1]) == sorted(aux.tolist())  # a whole cycle
    assert set(seen_aux[2]) <= set(aux.tolist())
    assert seen_aux[2] != streams[1].order(0)[:4].tolist()  # cycle 2 is reshuffled
    for m, a in got:  # padding: masked copies of record 0 at index N
        for part in (m, a):
            assert (part["index"][~part["mask"]] == N).all()
            assert part["x"].shape == (4, 3)
    resumed = list(
        pipeline.stream_batches(
            toy_record, N, streams, batch_size=4, num_steps=3, start=1, num_threads=1
        )
    )
    for (m, a), (m2, a2) in zip(got[1:], resumed, strict=True):
        np.testing.assert_array_equal(m["index"], m2["index"])
        np.testing.assert_array_equal(a["index"], a2["index"])
    # Two processes each read their half of every global batch.
    halves = [
        list(
            pipeline.stream_batches(
                toy_record,
                N,
                streams,
                batch_size=4,
                num_steps=3,
                num_threads=1,
                process_index=p,
                process_count=2,
            )
        )
        for p in range(2)
    ]
    for b in range(3):
        for s in range(2):
            joined = np.concatenate([halves[0][b][s]["index"], halves[1][b][s]["index"]])
            np.testing.assert_array_equal(joined, got[b][s]["index"])


def test_the_classic_epoch_order_is_kept():
    """Pass 0 over all pairs reads the batches ``pipeline.batches`` reads (same results)."""
    plan = base.EpochPlan()
    (one,) = passes.plan_passes(
        methods.build_method("vse"),
        plan,
        [base.Streams(np.arange(N), None)],
        epoch=3,
        batch_size=B,
        seed=7,
    )
    new = [
        b[0]
        for b in pipeline.stream_batches(
            toy_record, N, one.streams, batch_size=B, num_steps=one.num_steps, num_threads=1
        )
    ]
    classic = list(pipeline.batches(toy_record, N, batch_size=B, num_epochs=4, seed=7))[-5:]
    assert len(new) == 5
    for a, b in zip(new, classic, strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])


def test_min_batch_ends_a_pass_and_drop_remainder_keeps_full_batches():
    method = methods.build_method("vse")
    sets = [base.Streams(np.arange(9), np.arange(20, 25))]  # main 4,4,1; aux 4,1,4,...
    plan = base.EpochPlan(updates=(0, 1))
    assert passes.plan_passes(method, plan, sets, epoch=0, batch_size=4, seed=0)[0].num_steps == 3
    short = plan._replace(min_batch=2)
    assert passes.plan_passes(method, short, sets, epoch=0, batch_size=4, seed=0)[0].num_steps == 1
    only_main = [base.Streams(np.arange(9), None)]
    one_update = short._replace(updates=(0,))
    got = passes.plan_passes(method, one_update, only_main, epoch=0, batch_size=4, seed=0)
    assert got[0].num_steps == 2
    full = plan._replace(drop_remainder=True)
    got = passes.plan_passes(method, full, sets, epoch=0, batch_size=4, seed=0)[0]
    assert got.num_steps == 2
    sizes = pipeline.batch_sizes(got.streams[1], 4, 4)
    np.testing.assert_array_equal(sizes, [4, 4, 4, 4])  # the aux cycle's remainder is skipped
    with pytest.raises(ValueError, match="no auxiliary stream"):
        passes.plan_passes(method, plan, only_main, epoch=0, batch_size=4, seed=0)


def test_streams_round_trip_through_checkpoint_arrays():
    sets = [base.Streams(np.array([4, 1, 3]), np.array([0, 2])), base.Streams(np.arange(5), None)]
    decoded = passes.decode_streams(passes.encode_streams(sets, 2, 5))
    for got, want in zip(decoded, sets, strict=True):
        np.testing.assert_array_equal(got.main, want.main)
        assert (got.aux is None) == (want.aux is None)
        if want.aux is not None:
            np.testing.assert_array_equal(got.aux, want.aux)
    with pytest.raises(ValueError, match="at most N"):
        passes.method_streams(
            methods.build_method("vse")._replace(
                streams_fn=lambda m, e, k: base.Streams(np.array([0, 9]))
            ),
            None,
            base.EpochPlan(),
            None,
            5,
        )


# ----------------------------------------------------------------------- steps


@pytest.fixture(scope="module")
def setup():
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test = 8, 4, 4  # 40 training pairs
    ds = synthetic.SyntheticDataset(cfg)
    model_cfg = config_lib.base_config().model
    model_cfg.embed_dim, model_cfg.tokens.word_dim = 16, 8
    record = pipeline.pair_records(
        ds.split("train"), image_fields=("regions",), text_fields=("tokens", "length")
    )
    return ds.info, model_cfg, record


def _state(setup, method, tx, num_devices=1):
    info, model_cfg, _ = setup
    mesh = mesh_lib.make_mesh(num_devices)
    init = base.InitContext(N, info, None, None, model_cfg.embed_dim)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(model_cfg, info, rngs),
        tx=tx,
        memory=method.init_memory(init),
        num_networks=method.num_networks,
        seed=0,
    )
    step = jax.jit(step_lib.make_train_step(graphdef, method, tx, num_samples=N), static_argnums=2)
    return graphdef, mesh, mesh_lib.replicate(state, mesh), step


def _batches(setup, main, aux=None, steps=None, key=(0, 0)):
    _, _, record = setup
    streams = [pipeline.StreamOrder(np.asarray(main), key, False)]
    if aux is not None:
        streams.append(pipeline.StreamOrder(np.asarray(aux), (*key, 1), True))
    steps = steps or streams[0].batches_per_cycle(B)
    return [
        tuple(b)
        for b in pipeline.stream_batches(
            record, N, streams, batch_size=B, num_steps=steps, num_threads=1
        )
    ]


def _slice(tree, k):
    return jax.device_get(state_lib.network(tree, k))


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _dual_vse(**plan):
    vse = methods.build_method("vse", {"num_networks": 2})
    return vse._replace(plan_fn=lambda epoch: base.EpochPlan(**plan))


def test_in_turn_step_leaves_the_peer_bit_identical(setup):
    method = _dual_vse(in_turn=True)
    tx = optax.adam(1e-2)
    _, _, state, step = _state(setup, method, tx)
    before = jax.device_get(state)
    spec = step_lib.StepSpec(in_turn=True)
    for batch in _batches(setup, np.arange(N)):
        state, _ = step(state, batch, spec, None, np.int32(0))
    after = jax.device_get(state)
    for field in ("params", "model_state", "opt_state", "memory"):
        _equal(_slice(getattr(before, field), 1), _slice(getattr(after, field), 1))
    moved = jax.tree.map(
        lambda a, b: np.abs(a - b).max(), _slice(after.params, 0), _slice(before.params, 0)
    )
    assert max(jax.tree.leaves(moved)) > 1e-4


def _peer_probe():
    """A method whose loss reads its frozen peer's eval-mode similarity (``prepare_fn``)."""
    vse = methods.build_method("vse", {"num_networks": 2})

    def prepare_fn(model, peer, batches, ctx):
        return {"peer_diag": jnp.diagonal(peer(batches[0])["sim"])}

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        loss, _ = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        return loss, base.Aux(metrics={"peer_diag": ctx.prepared["peer_diag"]})

    return vse._replace(prepare_fn=prepare_fn, loss_fn=loss_fn)


def test_second_network_trains_against_the_first_ones_end_of_pass_state(setup):
    method = _peer_probe()
    graphdef, _, state, step = _state(setup, method, optax.adam(1e-2))
    batches = _batches(setup, np.arange(N))
    in_turn = step_lib.StepSpec(in_turn=True)
    start = state
    for batch in batches:  # network 0's pass
        state, _ = step(state, batch, in_turn, None, np.int32(0))
    _, metrics = step(state, batches[0], in_turn, None, np.int32(1))  # network 1's first step

    def peer_diag(params, model_state):
        model = nnx.merge(graphdef, params, model_state)
        sim = model(jax.tree.map(jnp.asarray, batches[0][0]))["sim"]
        return float(jnp.diagonal(sim)[batches[0][0]["mask"]].mean())

    got = float(metrics["peer_diag"][0] / metrics["peer_diag"][1])
    end_of_pass = peer_diag(*_slice((state.params, state.model_state), 0))
    initial = peer_diag(*_slice((start.params, start.model_state), 0))
    assert got == pytest.approx(end_of_pass, abs=1e-5)
    assert abs(got - initial) > 1e-3  # the lockstep schedule would have used this one


def test_two_updates_in_one_step_equal_two_steps(setup):
    method = methods.build_method("vse", {"num_networks": 2})
    tx = optax.adam(1e-2)
    _, _, state, step = _state(setup, method, tx)
    (b0, b1), _ = _batches(setup, np.arange(16), np.arange(16, 40), steps=2)
    two = step_lib.StepSpec(updates=(0, 1), in_turn=True)
    one = step_lib.StepSpec(in_turn=True)
    joint, metrics = step(state, (b0, b1), two, None, np.int32(1))
    split, _ = step(state, (b0,), one, None, np.int32(1))
    split, _ = step(split, (b1,), one, None, np.int32(1))
    for field in ("params", "opt_state"):
        a, b = jax.device_get(getattr(joint, field)), jax.device_get(getattr(split, field))
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), a, b)
    assert set(metrics) >= {"loss", "loss_update1"}
    assert int(metrics["loss"][1]) == B and int(metrics["loss_update1"][1]) == B


def test_a_network_with_an_all_padding_batch_does_not_move(setup):
    method = methods.build_method("vse", {"num_networks": 2})
    _, _, state, step = _state(setup, method, optax.adam(1e-2))
    ((batch,),) = _batches(setup, np.arange(B), steps=1)
    empty = dict(batch, mask=np.zeros_like(batch["mask"]), index=np.full_like(batch["index"], N))
    before = jax.device_get(state)
    after, metrics = step(state, (empty,), step_lib.StepSpec(), None, np.int32(0))
    after = jax.device_get(after)
    _equal(before.params, after.params)
    _equal(before.opt_state, after.opt_state)
    assert int(after.step) == 1 and float(metrics["loss"][1]) == 0.0


@pytest.mark.heavy
def test_padding_reaches_no_loss_memory_row_or_batchnorm_statistic(setup):
    """Two sequential updates on a padded main batch (5 real pairs of 8) and aux batch (6 of
    8) move the parameters, BatchNorm statistics, optimiser state and memory exactly as the
    same updates on the real pairs alone (batch size 5 and 6, no padding). SAF has every
    kind of BatchNorm of the SGRAF heads (VisualSA's two and the per-caption one)."""
    info, model_cfg, record = setup
    model_cfg = model_cfg.copy_and_resolve_references()
    model_cfg.head, model_cfg.sgraf.sim_dim = "saf", 8
    model_cfg.tokens.dropout, model_cfg.sgraf.pair_chunk, model_cfg.sgraf.remat = 0.0, 0, "none"
    model_cfg.sgraf.length_groups = 1  # compiles faster; length grouping is tested in tests/models
    method = _turns()
    # SGD: Adam's first step, g / (|g| + eps), would blow round-off up into the parameters
    # whose gradient is zero in exact arithmetic (a softmax's shift).
    tx = optax.sgd(0.1, momentum=0.9)
    init = base.InitContext(N, info, None, None, model_cfg.embed_dim)
    graphdef, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(model_cfg, info, rngs),
        tx=tx,
        memory=method.init_memory(init),
        num_networks=2,
        seed=0,
    )
    step = jax.jit(step_lib.make_train_step(graphdef, method, tx, num_samples=N), static_argnums=2)
    spec = step_lib.StepSpec(phase=1, updates=(0, 1), in_turn=True)

    def batch_of(indices, size):
        records = [record(int(i)) for i in indices] + [record(0)] * (size - len(indices))
        batch = {k: np.stack([r[k] for r in records]) for k in records[0]}
        batch["mask"] = np.arange(size) < len(indices)
        batch["index"] = np.where(batch["mask"], batch["index"], N)
        return batch

    main, aux = [3, 9, 14, 20, 31], [0, 5, 7, 22, 27, 39]
    padded, _ = step(state, (batch_of(main, B), batch_of(aux, B)), spec, None, np.int32(0))
    alone, _ = step(state, (batch_of(main, 5), batch_of(aux, 6)), spec, None, np.int32(0))
    padded, alone = jax.device_get((padded, alone))
    stats = [x for x in jax.tree.leaves(alone.model_state) if x.ndim == 2]  # [K, C]
    assert stats and all(np.abs(x[0] - x[1]).max() > 0 for x in stats)  # BatchNorm moved
    for field in ("params", "model_state", "opt_state", "memory"):
        for got, want in zip(
            jax.tree.leaves(getattr(padded, field)),
            jax.tree.leaves(getattr(alone, field)),
            strict=True,
        ):
            # Round-off of sums over 5 rows against 8 (3 masked) reaches 8e-5 of a leaf's
            # largest entry in the optimiser's momentum on AVX-512 CPUs; a padded row that
            # leaked into a loss or a BatchNorm statistic moves entries by O(that entry).
            atol = 1e-5 + 2e-4 * float(np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=field)
    seen = padded.memory.samples["seen"][0]
    np.testing.assert_array_equal(np.flatnonzero(seen), sorted(main + aux))  # rows written


def test_optimizer_reset_zeroes_the_moments(setup):
    method = _dual_vse(reset_optimizer=True)
    cfg = config_lib.base_config().optim
    tx = optim.make_optimizer(cfg)
    _, _, state, step = _state(setup, method, tx)
    for batch in _batches(setup, np.arange(N)):
        state, _ = step(state, batch, step_lib.StepSpec(), None, np.int32(0))
    moments = lambda s: [x for x in jax.tree.leaves(s.opt_state) if x.ndim > 1]
    assert max(float(np.abs(x).max()) for x in moments(state)) > 0
    run = loop._Run(*([None] * 10), tx=tx, schedule=None)
    fresh = loop._start_epoch(run, state, None, 1, method.plan_fn(1))
    assert all(float(np.abs(x).max()) == 0 for x in moments(fresh))
    counts = [x for x in jax.tree.leaves(fresh.opt_state) if x.dtype == jnp.int32]
    assert all(int(np.max(c)) == 0 for c in counts)
    assert int(fresh.epoch) == 1
    kept = loop._start_epoch(run, state, None, 1, base.EpochPlan())
    _equal(jax.device_get(kept.opt_state), jax.device_get(state.opt_state))


# ----------------------------------------------------------------------- schedules


@pytest.mark.parametrize("schedule", ["constant", "step", "cosine"])
def test_epoch_keyed_schedules_match_hand_computed_rates(schedule):
    cfg = config_lib.base_config().optim
    cfg.learning_rate, cfg.schedule, cfg.step.factor, cfg.step.every = 2e-4, schedule, 0.1, 3
    fn = optim.learning_rate_schedule(cfg, num_epochs=8)
    want = {
        "constant": [2e-4] * 9,
        "step": [2e-4] * 3 + [2e-5] * 3 + [2e-6] * 3,
        "cosine": [2e-4 * 0.5 * (1 + np.cos(np.pi * e / 8)) for e in range(9)],
    }[schedule]
    np.testing.assert_allclose([float(fn(e)) for e in range(9)], want, rtol=1e-5, atol=1e-12)
    tx = optim.make_optimizer(cfg)
    state = optim.set_learning_rate(jax.vmap(tx.init)({"w": jnp.ones((2, 3))}), 1.5e-5)
    assert optim.learning_rate(state) == pytest.approx(1.5e-5)


def _turns(num_networks=2):
    """Dual in-turn VSE: warm-up on all pairs, then each network walks a fixed half of the
    pairs (its peer's 'clean' set) with the rest cycled as a second update, an optimiser
    reset when the main phase starts, and the learning rate counted from it."""
    vse = methods.build_method("vse", {"num_networks": num_networks})

    def plan_fn(epoch):
        if epoch == 0:
            return base.EpochPlan(in_turn=True, lr_epoch=0, selectable=False)
        return base.EpochPlan(
            phase=1,
            in_turn=True,
            updates=(0, 1),
            lr_epoch=epoch - 1,
            reset_optimizer=epoch == 1,
            min_batch=2,
        )

    def streams_fn(memory, plan, network):
        if plan.phase == 0:
            return base.Streams()
        n = memory.samples["seen"].shape[1]
        clean = (np.arange(n) + network) % 3 != 0
        return base.Streams(np.flatnonzero(clean), np.flatnonzero(~clean))

    def init_memory(ctx):
        return base.Memory({"seen": jnp.zeros(ctx.num_samples, jnp.float32)}, {})

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        loss, _ = vse.loss_fn(outputs, batch, rows, peer_rows, ctx)
        return loss, base.Aux(memory={"seen": rows["seen"] + 1}, metrics={"seen": rows["seen"]})

    return vse._replace(
        name="turns",
        plan_fn=plan_fn,
        streams_fn=streams_fn,
        init_memory=init_memory,
        loss_fn=loss_fn,
    )


def _turns_config():
    config = tiny(load_config("vse", "synthetic"), epochs=3)
    config.method = "turns"
    config.method_kwargs = ml_collections.ConfigDict({"num_networks": 2})
    config.optim.schedule, config.optim.step.every = "step", 1
    config.train.log_every_steps = 1
    # 20 warm-up steps, then 7 steps per network and epoch: a save inside network 1's
    # pass of epoch 1 (steps 28-34) at step 30, for the mid-pass resume.
    config.train.checkpoint_every_steps = 10
    config.train.num_devices = 1  # the 8-device resumes: tests/train/test_faults.py
    return config


@pytest.fixture(scope="module")
def turns_run(tmp_path_factory):
    """The uninterrupted run of ``_turns_config()``: (config, results, workdir)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(methods.REGISTRY, "turns", _turns)
        config = _turns_config()
        workdir = tmp_path_factory.mktemp("turns") / "straight"
        results = train_and_evaluate(config, str(workdir))
    return config, results, workdir


@pytest.mark.heavy
def test_in_turn_epochs_log_lengths_rates_and_never_select_warmup(turns_run):
    config, results, workdir = turns_run
    rows = read_metrics(workdir)
    val = [r for r in rows if r["split"] == "val"]
    n = config.data.num_train * 5
    # Warm-up: each network one pass over all pairs; then its peer's set, min_batch 2.
    assert val[0]["steps_net0"] == val[0]["steps_net1"] == n // 32
    clean = [np.flatnonzero((np.arange(n) + k) % 3 != 0).size for k in (0, 1)]
    assert val[1]["main_pairs_net0"] == clean[0] and val[1]["main_pairs_net1"] == clean[1]
    assert val[1]["aux_pairs_net0"] == n - clean[0]
    assert val[1]["steps_net0"] == -(-clean[0] // 32)
    # lr: warm-up at lr_epoch 0, then x0.1 per main epoch counted from 0.
    lr = config.optim.learning_rate
    np.testing.assert_allclose([r["learning_rate"] for r in val], [lr, lr, lr * 0.1], rtol=1e-6)
    assert results["best_epoch"] >= 1
    train = [r for r in rows if r["split"] == "train"]
    assert {r["network"] for r in train} == {0.0, 1.0}
    assert all("loss_update1" in r for r in train if r["epoch"] > 0)


@pytest.mark.heavy
def test_resume_mid_pass_gives_the_uninterrupted_run(turns_run, tmp_path, monkeypatch):
    monkeypatch.setitem(methods.REGISTRY, "turns", _turns)
    config, straight, workdir = turns_run
    every = config.train.checkpoint_every_steps
    expected = read_metrics(workdir)
    # Crash in epoch 1 (the reset epoch), inside network 1's pass, just after a save there.
    steps = [
        int(r["step"])
        for r in expected
        if r["split"] == "train" and r["epoch"] == 1 and r["network"]
    ]
    crash_step = next(s for s in steps[1:] if (s - 1) % every == 0 and s - 1 > steps[0])
    check = loop._check_finite

    def crashing(state, checkpointer):
        if int(state.step) == crash_step and not crashing.done:
            crashing.done = True
            raise RuntimeError("simulated crash")
        check(state, checkpointer)

    crashing.done = False
    monkeypatch.setattr(loop, "_check_finite", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_and_evaluate(config, str(tmp_path / "resumed"))
    with open(
        tmp_path / "resumed" / "checkpoints" / "latest" / str(crash_step - 1) / "meta" / "metadata"
    ) as f:
        progress = json.load(f)
    assert (progress["epoch"], progress["pass"]) == (1, 1) and progress["position"] > 0
    resumed = train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed == pytest.approx(straight, abs=1e-9)
    rows = read_metrics(tmp_path / "resumed")
    key = lambda r: (r["split"], r["step"], r.get("network"))
    assert sorted(map(key, rows)) == sorted(map(key, expected))
    for got, want in zip(sorted(rows, key=key), sorted(expected, key=key), strict=True):
        for name, value in want.items():
            if name not in loop.WALL_CLOCK:
                assert got[name] == pytest.approx(value, abs=1e-9), (got["split"], name)
    assert os.path.exists(tmp_path / "resumed" / "results.json")
