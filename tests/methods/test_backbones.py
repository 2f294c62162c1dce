"""Every pair method's jitted train step on each SGRAF head, one step per case.

The end-to-end runs of the methods on the SGR and SAF heads are ``slow`` (20-50 s each on
2 cores); here each (method, head) cell runs one step of the method's main training phase,
the way the training loop would in a steady post-warm-up epoch, on a shrunk model: the
method, its hyperparameters and its model section come from ``configs/<method>.py:f30k``
(the paper's backbone), with the head under test and the sizes of ``tests/test_configs.py``
(``_shrink``), on 8 pairs of the ``data`` fixture (a step of two updates: 8 more pairs
for its auxiliary batch), on one device: 3-13 s a cell, mostly compilation, so the default
run takes one head per method and the slow run the other (``_cells``). A method whose main
step reads what the epoch's refresh wrote (NCR's and PC2's co-divide, UGNCL's division,
GSC's labels) starts from a memory holding such a division (``POST_REFRESH``), not the
initial one, under which they would train their warm-up objective (or GSC's all-ones
labels).

Each case checks that the model really is the SGRAF head under test (its similarity head
holds SGR's graph-reasoning layers or SAF's attention filter, not the other's), that every
loss the step logs is finite, that the stepping network's parameters moved (the similarity
head's among them: its gradient reaches the loss) and, for a co-taught (in-turn) method,
that the frozen peer did not move.

Not covered: ``ce`` and ``uot_rcl`` train class prototypes (``model.classifier=True``),
which the SGRAF model refuses, so they have no SGRAF cell. CE steps here on region/token
inputs (``test_ce_steps_on_regions_and_tokens``): ``configs/ce.py:synthetic`` switched from
global vectors to regions and tokens, on the cosine head with its prototypes, on the
labelled pairs of the ``data`` fixture; UOT-RCL trains on them in
``tests/methods/test_uot_rcl.py`` (``test_trains_on_regions_and_tokens``).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ncljax import config as config_lib
from ncljax import methods, models
from ncljax.config.fields import reset_unread
from ncljax.methods import base
from ncljax.models import encoders, heads
from ncljax.train import state as state_lib
from ncljax.train import step as step_lib
from tests.methods.conftest import N
from tests.methods.steps import train_steps

pytestmark = pytest.mark.heavy  # out of the default run; CI runs it (see pyproject.toml)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METHODS = methods.of_family("pairs")  # every correspondence method trains on SGR and SAF
HEADS = ("sgr", "saf")
PAIRS = 8  # pairs per batch: SGRAF's work grows with B x B
STEADY_EPOCH = 1000  # past every warm-up and start epoch of the f30k schedules


def _divided(n):
    """A co-divide as a refresh leaves it: every other pair clean, probabilities in (0, 1)."""
    prob = np.where(np.arange(n) % 2 == 0, 0.9, 0.2).astype(np.float32)
    clean = (prob > 0.5).astype(np.float32)
    return {"prob": prob, "clean": clean, "divided": np.ones(n, np.float32)}


def _ugncl_division(n):
    """A stored division with no warm-up fallback: certain and uncertain, matched and
    mismatched pairs (the four sets of the paper's partition)."""
    i = np.arange(n)
    u = np.where(i % 2 == 0, 0.2, 0.8).astype(np.float32)
    q = np.where(i % 4 < 2, 0.8, 0.3).astype(np.float32)
    prediction = (i % 3 > 0).astype(np.float32)
    return {
        "uncertainty": u,
        "division_uncertainty": u,
        "soft_label": q,
        "division_soft_label": q,
        "prediction": prediction,
        "fallback_warmup": np.zeros(n, np.float32),
    }


# The memory rows a refresh writes before a main epoch, for the methods whose main step
# reads them: with the initial memory NCR, PC2 and UGNCL train the warm-up objective until a
# division exists, and GSC's labels are all 1. SREM divides each batch by its own energies,
# VSE and InfoNCE have no memory.
POST_REFRESH = {
    "gsc": lambda n: {"labels": np.where(np.arange(n) % 3 > 0, 0.9, 0.1).astype(np.float32)},
    "ncr": _divided,
    "pc2": lambda n: _divided(n) | {f"osc_{k}": _divided(n)[k] for k in ("prob", "clean")},
    "ugncl": _ugncl_division,
}
# The parameters only one of the two heads has (ncljax/models/sgraf.py SimilarityHead).
OWN = {"sgr": "query", "saf": "attn"}


def _method_and_model(name, head):
    """The method and shrunk model section of ``configs/<name>.py:f30k`` on ``head``."""
    config = config_lib.load_file(f"{ROOT}/configs/{name}.py", "f30k")
    m = config.model
    assert m.head == "sgr" and not m.classifier  # the paper's backbone, no prototypes
    m.head = head
    m.embed_dim, m.tokens.word_dim = 16, 8
    m.sgraf.sim_dim, m.sgr.steps, m.sgraf.remat, m.sgraf.length_groups = 8, 1, "none", 1
    method = methods.build_method(config.method, config.method_kwargs, model_config=m)
    if name in POST_REFRESH:
        init = method.init_memory

        def init_memory(ctx):
            memory = init(ctx)
            rows = POST_REFRESH[name](ctx.num_samples)
            assert rows.keys() <= memory.samples.keys(), sorted(memory.samples)
            samples = memory.samples | {k: jnp.asarray(v) for k, v in rows.items()}
            return memory._replace(samples=samples)

        method = method._replace(init_memory=init_memory)
    return method, m


def _pairs(batch, start):
    """Pairs ``start .. start + PAIRS`` of a full batch (every array's leading axis)."""
    assert batch["mask"][start : start + PAIRS].all()
    return {k: v[start : start + PAIRS] for k, v in batch.items()}


def _fresh_params(method, cfg, info):
    """The parameters ``train_steps`` starts from (same model, memory and seed)."""
    _, state = state_lib.create(
        model_fn=lambda rngs: models.build_model(cfg, info, rngs, heads_fn=method.heads_fn),
        tx=optax.sgd(0.5),
        memory=method.init_memory(base.InitContext(N, info, None, None)),
        num_networks=method.num_networks,
        seed=0,
    )
    return jax.device_get(state.params)


def _leaves(params):
    return {
        jax.tree_util.keystr(path): np.asarray(x)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
    }


def _cells():
    """Every (method, head) cell. The default run steps each method on one head, the heads
    alternating over the methods (both heads with about half the methods each); the other
    head of each method is in the slow run (``-m slow``). The heads' own code is tested in
    ``tests/models/test_sgraf.py``; a cell tests what the method's step reads of the head."""
    cells = []
    for i, name in enumerate(METHODS):
        for j, head in enumerate(HEADS):
            default = (i + j) % len(HEADS) == 0
            cells.append(pytest.param(name, head, marks=() if default else pytest.mark.slow))
    return cells


@pytest.mark.parametrize(("name", "head"), _cells())
def test_main_step_runs_on_the_sgraf_head(data, name, head):
    info, batches = data
    method, cfg = _method_and_model(name, head)
    assert cfg.head == head
    plan = method.plan_fn(STEADY_EPOCH)  # the last phase (NCR, PC2: both updates)
    single = all(method.plan_fn(e).phase == plan.phase for e in range(STEADY_EPOCH))
    assert plan.phase >= base.MAIN or single  # past the warm-up, or the only phase
    spec = step_lib.StepSpec(phase=plan.phase, updates=tuple(plan.updates), in_turn=plan.in_turn)
    # One batch per stream the updates read (main, auxiliary), disjoint pairs.
    step_batches = tuple(_pairs(batches[0], PAIRS * s) for s in range(max(spec.updates) + 1))
    state, metrics = train_steps(
        method,
        cfg,
        info,
        [step_batches if len(step_batches) > 1 else step_batches[0]],
        num_devices=1,
        num_samples=N,
        phase=spec,
        networks=method.num_networks,
    )
    fresh = _fresh_params(method, cfg, info)

    # The model is the SGRAF model with the head under test.
    names = _leaves(fresh)
    other = OWN["saf" if head == "sgr" else "sgr"]
    assert any(f"['head']['{OWN[head]}']" in k for k in names), sorted(names)
    assert not any(f"['head']['{other}']" in k for k in names)

    # Every logged loss is finite, over the step's real pairs.
    losses = {k: np.asarray(v) for k, v in metrics.items() if k.startswith("loss")}
    assert "loss" in losses
    for u in range(1, len(spec.updates)):
        assert f"loss_update{u}" in losses, sorted(metrics)
    stepping = 1 if spec.in_turn else method.num_networks  # together: summed over networks
    for k, (total, count) in losses.items():
        assert count == PAIRS * stepping and np.isfinite(total), (k, total, count)

    # The stepping network moved, its similarity head included; a frozen peer did not.
    before, after = names, _leaves(state.params)
    assert before.keys() == after.keys()
    for net in range(stepping):
        moved = {k for k in before if not np.array_equal(before[k][net], after[k][net])}
        assert any("['head']" in k for k in moved), (net, sorted(moved))
        assert any("['image_fc']" in k for k in moved), (net, sorted(moved))
    for k in before:
        assert np.isfinite(after[k]).all(), k
        np.testing.assert_array_equal(after[k][stepping:], before[k][stepping:], err_msg=k)


def _ce_method_and_model():
    """CE and the shrunk model section of ``configs/ce.py:synthetic`` switched to
    region/token inputs (the cosine head, class prototypes)."""
    config = config_lib.load_file(f"{ROOT}/configs/ce.py", "synthetic")
    m = config.model
    assert m.classifier and m.head == "cosine"
    assert (m.image_input, m.text_input) == ("global", "global")  # the config's backbone
    m.image_input, m.text_input = "regions", "tokens"
    reset_unread(config)  # the global-vector sizes
    m.embed_dim, m.tokens.word_dim, m.sgraf.length_groups, m.sgraf.remat = 16, 8, 1, "none"
    return methods.build_method(config.method, config.method_kwargs, model_config=m), m


def test_ce_steps_on_regions_and_tokens(data):
    info, batches = data
    assert info.num_classes > 1
    assert {"label_image", "label_text", "regions", "tokens"} <= batches[0].keys()
    method, cfg = _ce_method_and_model()
    plan = method.plan_fn(STEADY_EPOCH)
    assert plan.phase >= base.MAIN or all(
        method.plan_fn(e).phase == plan.phase for e in range(STEADY_EPOCH)
    )
    spec = step_lib.StepSpec(phase=plan.phase, updates=tuple(plan.updates), in_turn=plan.in_turn)
    assert spec.updates == (0,) and method.num_networks == 1
    state, metrics = train_steps(
        method,
        cfg,
        info,
        [_pairs(batches[0], 0)],
        num_devices=1,
        num_samples=N,
        phase=spec,
        networks=1,
    )
    fresh = _fresh_params(method, cfg, info)
    before, after = _leaves(fresh), _leaves(state.params)

    # Class prototypes over the region encoder and the GRU text encoder.
    model = models.build_model(cfg, info, nnx.Rngs(0), heads_fn=method.heads_fn)
    assert isinstance(model.classifier, heads.Prototypes)
    assert isinstance(model.image_encoder, encoders.RegionEncoder)
    assert isinstance(model.text_encoder, encoders.GRUTextEncoder)
    assert "['classifier']['prototypes']" in before, sorted(before)
    assert any("['text_encoder']['forward_gru']" in k for k in before), sorted(before)

    # Every logged loss is finite, over the step's real pairs.
    losses = {k: np.asarray(v) for k, v in metrics.items() if k.startswith("loss")}
    assert "loss" in losses
    for k, (total, count) in losses.items():
        assert count == PAIRS and np.isfinite(total), (k, total, count)

    # The parameters moved: the prototypes and both encoders among them.
    assert before.keys() == after.keys()
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert "['classifier']['prototypes']" in moved, sorted(moved)
    assert any("['image_encoder']" in k for k in moved), sorted(moved)
    assert any("['text_encoder']" in k for k in moved), sorted(moved)
    for k in after:
        assert np.isfinite(after[k]).all(), k
