"""NCR, PC2 and GSC on a degenerate division: each falls back by its documented rule (the
previous division; before any, the warm-up objective), says so once with "fallback" and
reports ``division_fallback``."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import labels as labels_lib
from ncljax import losses, methods
from ncljax.methods import base, ncr
from tests.methods import test_pc2

N = 400


def _ctx(epoch, network=1):
    return base.RefreshContext(epoch, 10, network, None, None)


def _bimodal(seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(
        np.concatenate([rng.normal(0.1, 0.02, 300), rng.normal(0.6, 0.05, N - 300)]), jnp.float32
    )


def _outlier(seed=2):  # one far loss: a GMM component of one pair (weight 1/400)
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.concatenate([rng.normal(0.3, 0.05, N - 1), [5.0]]), jnp.float32)


@pytest.fixture
def one_set(monkeypatch):
    """Forces every co-divide to put every pair in the clean set (posteriors all 0.9)."""
    real = labels_lib.loss_division

    def forced(losses_, **kwargs):
        division = real(losses_, **kwargs)
        prob = jnp.full_like(division.prob, 0.9)
        return division._replace(prob=prob, clean=labels_lib.split_clean(prob))

    monkeypatch.setattr(labels_lib, "loss_division", forced)


def _count(caplog):
    """Fallback warnings of the division (PC2's oscillation division has its own)."""
    return sum(
        "fallback" in r.getMessage() and "oscillations" not in r.getMessage()
        for r in caplog.records
    )


def _sequence(method, stats_fn, caplog):
    """Degenerate (no division yet), then a good division, then degenerate again."""
    memory = method.init_memory(base.InitContext(N, None, None, None))
    with caplog.at_level(logging.WARNING):
        first, diag = method.refresh_fn(memory, stats_fn(_outlier()), _ctx(2))
    assert "fallback" in caplog.text and "warm-up objective" in caplog.text
    assert _count(caplog) == 1 and float(diag["division_fallback"]) == 1.0
    assert not np.any(first.samples["divided"])  # still undivided: the warm-up objective
    np.testing.assert_array_equal(first.samples["clean"], np.ones(N))
    good, diag = method.refresh_fn(first, stats_fn(_bimodal()), _ctx(3))
    assert float(diag["division_fallback"]) == 0.0 and np.all(good.samples["divided"] == 1)
    np.testing.assert_array_equal(np.asarray(good.samples["clean"]) > 0.5, np.arange(N) < 300)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        kept, diag = method.refresh_fn(good, stats_fn(_outlier(5)), _ctx(4))
    assert _count(caplog) == 1 and "keeping its previous division" in caplog.text
    assert float(diag["division_fallback"]) == 1.0
    for key in ("prob", "clean", "divided"):
        np.testing.assert_array_equal(kept.samples[key], good.samples[key])
    return kept


def test_ncr_inseparable_division_falls_back(caplog):
    _sequence(methods.build_method("ncr"), lambda loss: {"loss": loss}, caplog)


def test_pc2_inseparable_division_falls_back(caplog):
    method = test_pc2._method()
    pred = test_pc2._stats(3)["pred"]
    empty = method.init_memory(base.InitContext(N, None, None, None)).samples
    _sequence(
        method, lambda loss: test_pc2._pass(method, {"loss": loss, "pred": pred}, empty), caplog
    )


@pytest.mark.parametrize("name", ["ncr", "pc2"])
def test_every_pair_in_one_set_falls_back(name, one_set, caplog):
    method = methods.build_method("ncr") if name == "ncr" else test_pc2._method()
    memory = method.init_memory(base.InitContext(N, None, None, None))
    stats = {"loss": _bimodal(), "pred": test_pc2._stats(3)["pred"]}
    if name == "pc2":
        stats = test_pc2._pass(method, stats, memory.samples)
    with caplog.at_level(logging.WARNING):
        new, diag = method.refresh_fn(memory, stats, _ctx(2, network=0))
    assert "network 0's co-divide of epoch 2 puts every pair on one side" in caplog.text
    assert float(diag["division_fallback"]) == 1.0
    assert not np.any(new.samples["divided"])


def _ncr_ctx(phase, update, prepared):
    return test_pc2._ctx(phase, update)._replace(prepared=prepared)


def test_ncr_trains_an_undivided_peer_with_the_warmup_objective():
    method = methods.build_method("ncr")
    sim = test_pc2._sim(4)
    mask = test_pc2.MASK
    batch = {"mask": mask}
    prepared = {"clean": jnp.full(7, 0.3)}
    rows = {"prob": jnp.ones(7), "divided": jnp.zeros(7)}
    loss, _ = method.loss_fn({"sim": sim}, batch, rows, rows, _ncr_ctx(ncr.CLEAN, 0, prepared))
    warm, _ = method.loss_fn({"sim": sim}, batch, rows, rows, _ncr_ctx(ncr.WARMUP, 0, None))
    np.testing.assert_allclose(loss, warm, rtol=1e-6)
    np.testing.assert_allclose(loss, losses.triplet_mean(sim, 0.2, where=mask), rtol=1e-6)
    divided = dict(rows, divided=jnp.ones(7))  # once divided: the soft-margin hardest hinge
    loss, _ = method.loss_fn(
        {"sim": sim}, batch, divided, divided, _ncr_ctx(ncr.CLEAN, 0, prepared)
    )
    margins = losses.soft_margin(jnp.ones(7), 0.2, kind="exponential")
    np.testing.assert_allclose(loss, losses.triplet_hardest(sim, margins, where=mask), rtol=1e-6)


def test_pc2_trains_an_undivided_peer_with_the_warmup_objective():
    method = test_pc2._method()
    sim, img, txt = test_pc2._sim(4), test_pc2._logits(5), test_pc2._logits(6)
    out = {"sim": sim, "image_logits": img, "text_logits": txt}
    peer = {
        "prob": jnp.ones(7),
        "osc_prob": jnp.zeros(7),
        "osc_clean": jnp.zeros(7),
        "divided": jnp.zeros(7),
    }
    batch = {"mask": test_pc2.MASK}
    loss, _ = method.loss_fn(out, batch, {}, peer, test_pc2._ctx(test_pc2.pc2.CLEAN))
    warm, _ = method.loss_fn(out, batch, {}, peer, test_pc2._ctx(test_pc2.pc2.WARMUP))
    np.testing.assert_allclose(
        jnp.where(test_pc2.MASK, loss, 0), jnp.where(test_pc2.MASK, warm, 0), rtol=1e-6
    )


def _gsc_samples(method, cross, intra, previous):
    memory = method.init_memory(base.InitContext(N, None, None, None))
    return base.Memory(
        dict(
            memory.samples,
            ema_cross=previous,
            ema_intra=previous,
            labels=previous,
            cross=jnp.asarray(cross, jnp.float32),
            intra=jnp.asarray(intra, jnp.float32),
        ),
        {},
    )


@pytest.mark.parametrize("case", ["inseparable", "one_set"])
def test_gsc_degenerate_estimate_keeps_the_previous_labels(case, caplog, monkeypatch):
    if case == "one_set":  # every intra-modal posterior above 0.5: all pairs clean
        real = labels_lib.gsc_update_labels

        def forced(*args, **kwargs):
            state, mixture = real(*args, **kwargs)
            return state._replace(intra_posterior=jnp.full_like(state.labels, 0.9)), mixture

        monkeypatch.setattr(labels_lib, "gsc_update_labels", forced)
    method = methods.build_method("gsc")
    previous = jnp.asarray((np.arange(N) % 3 != 0).astype(np.float32))
    rng = np.random.default_rng(0)
    if case == "inseparable":  # one far score: a component of one pair
        intra = np.r_[rng.normal(0.5, 0.05, N - 1), -4.0]
    else:
        intra = np.asarray(1.0 - _bimodal())
    memory = _gsc_samples(method, np.full(N, 0.9), intra, previous)
    with caplog.at_level(logging.WARNING):
        new, diag = method.refresh_fn(memory, None, _ctx(4, network=0))
    assert _count(caplog) == 1
    want = "separates nothing" if case == "inseparable" else "puts every pair on one side of 0.5"
    assert f"network 0's intra-modal GMM of epoch 4 {want}" in caplog.text
    assert float(diag["division_fallback"]) == 1.0
    for key in ("labels", "ema_cross", "ema_intra"):
        np.testing.assert_array_equal(new.samples[key], previous)


def test_gsc_good_estimate_reports_no_fallback():
    method = methods.build_method("gsc")
    memory = _gsc_samples(method, np.full(N, 0.9), 1.0 - _bimodal(), jnp.ones(N))
    new, diag = method.refresh_fn(memory, None, _ctx(4))
    assert float(diag["division_fallback"]) == 0.0
    want, _ = labels_lib.gsc_update_labels(
        jnp.ones(N), jnp.ones(N), jnp.full(N, 0.9), 1.0 - _bimodal()
    )
    np.testing.assert_allclose(new.samples["labels"], want.labels, rtol=1e-6)


@pytest.mark.parametrize("name", ["ncr", "pc2", "gsc"])
def test_rejects_bad_division_settings(name):
    kwargs = {"division_min_weight": 0.6}
    with pytest.raises(ValueError, match="division_min_weight"):
        if name == "pc2":
            test_pc2._method(**kwargs)
        else:
            methods.build_method(name, kwargs)
