"""SREM's top-level functions one by one (``ncljax.methods.srem``), against hand-written
tables and a numpy evaluation of the warm-up objective (Eq. 13 with uniform complementary
labels), without building the method through the registry."""

import inspect
import logging
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.methods import base, srem
from ncljax.train import step as step_lib
from tests.labels.test_srem_calibration import _otsu_oracle


def _ctx(phase, epoch=3):
    zero = jnp.zeros((), jnp.int32)
    return base.LossContext(zero, jnp.asarray(epoch, jnp.int32), phase, 10, zero, None)


def _logits(b=6, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, b)) * 1.5
    logits[np.arange(b), np.arange(b)] += 3.0
    return logits.astype(np.float32)


def test_settings_are_the_factory_signature():
    params = inspect.signature(srem.srem).parameters
    assert {k: p.default for k, p in params.items()} == srem.Settings()._asdict()
    assert set(srem.CHECKS) == set(srem.Settings._fields)
    s = srem.srem(tau=-3.0, warmup_epochs=1).settings
    assert s == srem.Settings(tau=-3.0, warmup_epochs=1)


def test_plan_by_hand():
    s = srem.Settings(warmup_epochs=2)
    # epoch: (phase, refresh, lr_epoch)
    table = {
        0: (base.WARMUP, False, 0),
        1: (base.WARMUP, True, 0),
        2: (base.MAIN, True, 0),
        3: (base.MAIN, True, 1),
        7: (base.MAIN, True, 5),
    }
    for epoch, (phase, refresh, lr_epoch) in table.items():
        plan = srem.plan(s, epoch)
        assert (plan.phase, plan.refresh, plan.lr_epoch) == (phase, refresh, lr_epoch), epoch
        assert plan.selectable and plan.drop_remainder and plan.min_batch == 2
    assert srem.plan(srem.Settings(warmup_epochs=0), 0).phase == base.MAIN
    # the partner test's p-value holds for any batch: its last partial batch trains too
    for epoch in (0, 3):
        assert not srem.plan(srem.Settings(division="partner"), epoch).drop_remainder


def test_logits_of_each_head():
    s = srem.Settings(cosine_shift=0.4, cosine_temperature=0.2)
    cos = np.array([[0.9, 0.1], [0.0, 0.6]], np.float32)
    np.testing.assert_allclose(srem.logits(s, {"sim": cos}), (cos - 0.4) / 0.2, rtol=1e-6)
    logit = jnp.ones((2, 2))
    assert srem.logits(s, {"logit": logit, "sim": cos}) is logit


def _warmup_oracle(logits, mask):
    """Pair i's share: ``-sum_{j != i} log(1 - P_ij)`` of its image query (row ``i`` of
    ``F``) plus its caption query's (row ``i`` of ``F.T``), ``P`` the softmax over the real
    candidates (uniform ``Q`` over ``|A_i|`` negatives times ``kappa_i = |A_i|``)."""
    logits = logits.astype(np.float64)
    real = np.flatnonzero(mask)
    total = np.zeros(len(mask))
    for view in (logits, logits.T):
        for i in real:
            row = view[i, real]
            p = np.exp(row - row.max())
            p /= p.sum()
            total[i] += -sum(np.log1p(-p[k]) for k, j in enumerate(real) if j != i)
    return total


def test_warmup_loss_against_numpy_and_its_memory_rows():
    s = srem.Settings()  # uniform complementary labels in the warm-up
    logits = _logits()
    mask = np.array([True, True, True, False, True, True])
    loss_fn = jax.jit(lambda o, b: srem.loss(s, o, b, {}, {}, _ctx(base.WARMUP)))
    loss, aux = loss_fn({"logit": jnp.asarray(logits)}, {"mask": jnp.asarray(mask)})
    assert isinstance(aux, base.Aux)
    np.testing.assert_allclose(loss, _warmup_oracle(logits, mask), rtol=1e-5, atol=1e-6)
    real = np.flatnonzero(mask)
    for d, view in (("i2t", logits), ("t2i", logits.T)):
        rows = view[np.ix_(real, real)].astype(np.float64)
        energy = -np.log(np.exp(rows).sum(1))  # Eq. 1 over the real candidates
        np.testing.assert_allclose(np.asarray(aux.memory[f"energy_{d}"])[real], energy, rtol=1e-5)
    np.testing.assert_array_equal(aux.memory["energy_epoch"], np.full(6, 3.0))
    assert aux.applied_weight is None  # no hinge in the warm-up
    assert set(aux.clean_estimates) == {"i2t", "t2i"}
    assert "loss_hinge" not in aux.metrics


def test_main_loss_reads_the_division_in_use():
    """Calibrated, the division comes from the memory state in the loss context (as given
    with ``'warmup'``; ``'data'`` re-measures a degenerate one, see the next test); with
    ``calibration='paper'`` from the settings (Eq. 2 at ``tau``), whatever the state holds."""
    logits = jnp.asarray(_logits(seed=1))
    mask = jnp.ones(6, bool)
    division = jnp.asarray([[-1.0, -3.0, 1.0], [-1.5, -2.5, 0.5]], jnp.float32)
    outputs = {"logit": logits}
    paper = srem.Settings(calibration="paper", tau=-4.0)

    @jax.jit
    def both(outputs):  # one program: the method's losses and the library's
        ctx = _ctx(base.MAIN)._replace(memory_state={"calibration": division})
        batch = {"mask": mask}
        calibrated = srem.loss(srem.Settings(calibration="warmup"), outputs, batch, {}, {}, ctx)
        given = srem.loss(paper, outputs, batch, {}, {}, ctx)[1]
        thresholds = dict(threshold=division[:, 0], m_clean=division[:, 1], m_noisy=division[:, 2])
        want = srem.srem_loss(logits, **thresholds, fallback=True, where=mask)
        return calibrated, given, want

    (loss, aux), given, (want, views) = both(outputs)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(aux.applied_weight, views["i2t"].pull + views["t2i"].pull)
    f = np.asarray(logits, np.float64)
    for d, view in (("i2t", f), ("t2i", f.T)):
        energy = -np.log(np.exp(view).sum(1))
        clean = (energy < -4.0) & (view.argmax(1) == np.arange(6))  # Eq. 2
        np.testing.assert_array_equal(given.clean_estimates[d], clean)
    assert 0 < clean.sum() < 6  # the threshold splits the batch


def test_init_memory_carries_the_given_division_and_the_step_hands_it_to_the_loss():
    s = srem.Settings(tau=-1.0, m_clean=-3.0, m_noisy=2.0)
    memory = srem.init_memory(s, base.InitContext(4, None, None, None))
    np.testing.assert_array_equal(memory.state["calibration"], [[-1.0, -3.0, 2.0]] * 2)
    np.testing.assert_array_equal(memory.samples["energy_epoch"], [-1.0] * 4)
    seen = []
    step = step_lib._Step(None, base.Method("spy", None, None), None, 4)
    update = lambda trained, *args: (trained, jnp.array(True), seen.append(args[-2]) or {})
    net = (None, None, None, memory.state)
    peer = (None, None, {}, 0)
    batches = ({"index": jnp.arange(2), "mask": jnp.ones(2, bool)},)
    with mock.patch.object(step_lib._Step, "update", lambda self, *a: update(*a)):
        step.network_step(
            net, peer, None, 0, batches, step_lib.StepSpec(0), _ctx(0), None, own=({}, None)
        )
    assert seen[0].memory_state is memory.state


def test_division_diagnostics_by_hand():
    division = np.array([[-1.0, -2.0, -3.0], [4.0, 5.0, 6.0]])
    assert srem.division_diagnostics(division) == {
        "calibrated_tau_i2t": -1.0,
        "calibrated_m_clean_i2t": -2.0,
        "calibrated_m_noisy_i2t": -3.0,
        "calibrated_tau_t2i": 4.0,
        "calibrated_m_clean_t2i": 5.0,
        "calibrated_m_noisy_t2i": 6.0,
    }


def test_fallback_reasons_by_hand():
    s = srem.Settings(warmup_epochs=2, calibration="paper", tau=-2.0)
    none = {"i2t": 0.0, "t2i": 0.0}
    some = {"i2t": 0.3, "t2i": 0.0}
    assert srem.fallback_reasons(s, 1, none, 0.0, False) == []  # the warm-up divides nothing
    (reason,) = srem.fallback_reasons(s, 2, none, 0.0, False)
    assert reason.startswith("selected no clean pair in epoch 1 (tau=-2.0)")
    assert "undefined" not in reason  # epoch 1 was a warm-up epoch: nothing to pull
    (reason,) = srem.fallback_reasons(s, 3, none, 0.5, False)
    assert "noisy_weight_share is undefined" in reason
    (reason,) = srem.fallback_reasons(s, 3, some, 0.25, False)
    assert reason.startswith("25.0% of the pairs of epoch 2")
    reasons = srem.fallback_reasons(srem.Settings(), 3, some, 0.0, True)
    assert len(reasons) == 1 and "fewer than two distinct values" in reasons[0]


def test_calibrate_is_frozen_after_the_first_main_epoch_with_warmup_calibration():
    s = srem.Settings(warmup_epochs=1, calibration="warmup")
    previous = jnp.asarray([[-1.0, -2.0, 0.0]] * 2, jnp.float32)
    memory = base.Memory({"energy_i2t": jnp.zeros(4), "energy_t2i": jnp.zeros(4)}, {})
    memory = memory._replace(state={"calibration": previous})
    for epoch in (2, 5):
        division, degenerate, diagnostics = srem.calibrate(s, memory, epoch)
        assert division is previous and not degenerate and diagnostics == {}
    paper = srem.Settings(calibration="paper")
    assert srem.calibrate(paper, memory, 1)[0] is previous
    # 'data' re-measures in the main phase: constant energies divide nothing, so the
    # previous division is kept and the epoch is degenerate.
    division, degenerate, diagnostics = srem.calibrate(srem.Settings(warmup_epochs=1), memory, 5)
    assert degenerate and "calibrated_clean_fraction_i2t" in diagnostics
    np.testing.assert_array_equal(division, previous)


def test_energy_score_uses_the_mean_threshold_in_use():
    samples = {"energy_i2t": jnp.asarray([-3.0, 0.0]), "energy_t2i": jnp.asarray([-1.0, 2.0])}
    memory = base.Memory(samples, {"calibration": jnp.asarray([[-1.0, 0, 0], [-3.0, 0, 0]])})
    mean_energy = np.array([-2.0, 1.0])
    want = 1 / (1 + np.exp(-(-2.0 - mean_energy)))
    np.testing.assert_allclose(srem.energy_score(memory, tau=9.0), want, rtol=1e-6)
    bare = base.Memory(samples, {})
    want = 1 / (1 + np.exp(-(-1.0 - mean_energy)))
    np.testing.assert_allclose(srem.energy_score(bare, tau=-1.0), want, rtol=1e-6)


def test_validate_and_log_settings(caplog):
    ok = {
        "m_clean": -1.0,
        "m_noisy": -1.0,
        "noise_share": "none",
        "division": "energy",
        "partner_rule": "level",
    }
    srem.validate(ok)
    srem.validate(ok | {"noise_share": "partner", "division": "partner"})
    with pytest.raises(ValueError, match=r"^srem m_clean must be <= m_noisy=-2.0 "):
        srem.validate(ok | {"m_noisy": -2.0})
    with pytest.raises(ValueError, match=r"^srem noise_share must be 'none' unless division"):
        srem.validate(ok | {"noise_share": "partner"})
    srem.validate(ok | {"noise_share": "partner", "division": "partner", "partner_rule": "share"})
    with pytest.raises(ValueError, match=r"^srem partner_rule must be 'level' unless noise_share"):
        srem.validate(ok | {"partner_rule": "share"})
    with caplog.at_level(logging.WARNING):
        srem.log_settings(srem.Settings(cl_prob="sigmoid", warmup_epochs=0))
        assert not caplog.records
        srem.log_settings(srem.Settings(cl_prob="sigmoid"))
    assert "trivial solution" in caplog.text


def test_bind_binds_the_settings():
    s = srem.Settings(warmup_epochs=3)
    method = srem.bind(s)
    assert method.settings is s and method.name == "srem"
    assert method.plan_fn(3) == srem.plan(s, 3)
    assert method.forward_fn is base.default_forward  # the division reaches it in ctx


def test_a_batch_the_epochs_division_does_not_divide_is_divided_by_its_own_energies():
    """``calibration='data'``: a direction whose split under the epoch's threshold selects
    no pair (or every pair) takes the Otsu split of the batch's own energies (the oracle of
    ``tests.labels.test_srem_calibration``); a direction it divides keeps it."""
    logits = jnp.asarray(_logits(seed=3, b=16))
    mask = jnp.ones(16, bool)
    f = np.asarray(logits, np.float64)
    energies = {"i2t": -np.log(np.exp(f).sum(1)), "t2i": -np.log(np.exp(f.T).sum(1))}
    s = srem.Settings()
    # i2t: a threshold below every energy (selects nothing); t2i: the Otsu cut, which divides.
    t2i = _otsu_oracle(energies["t2i"])[:3]
    epoch = jnp.asarray([[energies["i2t"].min() - 1.0, -9.0, -8.0], t2i], jnp.float32)
    got = np.asarray(srem.batch_division(s, logits, epoch, mask))
    np.testing.assert_allclose(got[0], _otsu_oracle(energies["i2t"])[:3], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], np.asarray(epoch[1]), rtol=1e-6)
    # The step trains the re-measured division: no fallback in either direction.
    outputs = {"logit": logits}
    ctx = _ctx(base.MAIN)._replace(memory_state={"calibration": epoch})
    _, aux = srem.loss(s, outputs, {"mask": mask}, {}, {}, ctx)
    assert float(np.asarray(aux.metrics["division_fallback"]).max()) == 0.0
    _, frozen = srem.loss(srem.Settings(calibration="warmup"), outputs, {"mask": mask}, {}, {}, ctx)
    assert float(np.asarray(frozen.metrics["division_fallback"]).max()) == 1.0


def _np_info_nce_rows(view, where):
    real = np.flatnonzero(where)
    out = np.zeros(len(where))
    for i in real:
        row = view[i, real].astype(np.float64)
        out[i] = np.log(np.exp(row - row.max()).sum()) + row.max() - view[i, i]
    return out


def test_the_partner_test_with_the_contrastive_term_against_numpy():
    """``division='partner'``: each direction's clean set is the queries whose partner's
    in-batch p-value is at most the level; ``ranking='contrastive'``: a clean query's
    ranking term is the InfoNCE of its row (numpy), the others' is 0, and the pull weight
    the logs read is 1 per clean query."""
    logits = _logits(b=8, seed=5)
    logits[1, 1] -= 6.0  # a partner below every negative: a mismatched-looking pair
    where = np.array([True] * 7 + [False])
    loss, views = srem.srem_loss(
        jnp.asarray(logits),
        division="partner",
        partner_level=2 / 7,
        ranking="contrastive",
        fallback=True,
        where=jnp.asarray(where),
    )
    f = logits.astype(np.float64)
    for d, view in (("i2t", f), ("t2i", f.T)):
        real = np.flatnonzero(where)
        p = np.array(
            [(1 + sum(view[i, j] >= view[i, i] for j in real if j != i)) / 7 for i in range(8)]
        )
        clean = where & (p <= 2 / 7)
        np.testing.assert_array_equal(views[d].clean, clean)
        assert not bool(views[d].fallback)
        want = np.where(clean, _np_info_nce_rows(view, where), 0.0)
        np.testing.assert_allclose(views[d].hinge, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(views[d].pull, clean.astype(np.float32))
    assert not bool(views["i2t"].clean[1])
    assert float(loss[7]) == 0.0
    # the swapped weights weight the hinge only: with the contrastive term they are 1
    for d in ("i2t", "t2i"):
        np.testing.assert_array_equal(views[d].weight, np.ones(8, np.float32))


def test_a_python_zero_energy_weight_skips_the_term_with_the_same_loss_and_gradient():
    """``lambda1=0`` (the :vectors setting) leaves the energy-bounded loss out of the
    objective; a traced 0 keeps it at weight 0: the same values and gradients."""
    logits = jnp.asarray(_logits(b=8, seed=9))
    kwargs = dict(division="partner", ranking="contrastive", fallback=True)

    def total(f, lambda1):
        return srem.srem_loss(f, lambda1=lambda1, **kwargs)[0].sum()

    skipped = jax.value_and_grad(total)(logits, 0.0)
    traced = jax.jit(jax.value_and_grad(total))(logits, jnp.float32(0.0))
    np.testing.assert_allclose(skipped[0], traced[0], rtol=1e-6)
    np.testing.assert_allclose(skipped[1], traced[1], rtol=1e-5, atol=1e-7)
    energy = srem.srem_loss(logits, lambda1=0.0, **kwargs)[1]["i2t"].energy_loss
    assert np.all(np.isfinite(np.asarray(energy)))  # still reported


def test_a_batch_the_partner_test_keeps_whole_trains_the_main_objective():
    """Under the energy split a batch kept whole falls back to the warm-up objective; under
    the partner test it is a batch without mismatched pairs and trains the main one."""
    logits = _logits(b=6, seed=6)
    logits[np.arange(6), np.arange(6)] += 10.0  # every partner first by far
    kwargs = dict(fallback=True, ranking="contrastive")  # level 0.05 < 1/6: ranked first
    _, partner = srem.srem_loss(jnp.asarray(logits), division="partner", **kwargs)
    _, energy = srem.srem_loss(jnp.asarray(logits), threshold=1e6, **kwargs)
    for d in ("i2t", "t2i"):
        assert bool(jnp.all(partner[d].clean)) and bool(jnp.all(energy[d].clean))
        assert not bool(partner[d].fallback) and bool(energy[d].fallback)
        assert float(jnp.sum(partner[d].hinge)) > 0.0
        assert float(jnp.sum(energy[d].hinge)) == 0.0


def test_the_partner_test_skips_the_batch_re_division():
    """``calibration='data'`` re-divides a batch by its own energies only under the energy
    split: the partner test reads no threshold."""
    logits = jnp.asarray(_logits(seed=7))
    s = srem.Settings(division="partner", ranking="contrastive")
    ctx = _ctx(base.MAIN)._replace(memory_state={"calibration": srem.paper_division(s)})
    with mock.patch.object(srem, "batch_division", side_effect=AssertionError("called")):
        _, aux = srem.loss(s, {"logit": logits}, {"mask": jnp.ones(6, bool)}, {}, {}, ctx)
    want = srem.srem_loss(logits, division="partner", ranking="contrastive", fallback=True)[1]
    np.testing.assert_array_equal(aux.clean_estimates["i2t"], want["i2t"].clean)
