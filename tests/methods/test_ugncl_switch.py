"""UGNCL's ``noise_share='partner'`` (the ``:vectors`` config): the statistics pass's
partner p-values of the pooled views, and a division switched off only where a divided
epoch did not raise the bound on the mismatched share."""

import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import methods
from ncljax.labels import ugncl as division
from ncljax.methods import base
from tests.methods.test_ugncl import MASK, _ctx_refresh, _raw
from tests.methods.test_ugncl_calibration import N, _memory, _stats


def _partner_p(above: int, n: int = N) -> jnp.ndarray:
    """P-values of ``n`` pairs, ``above`` of them above 1/2 (Storey's count)."""
    p = np.full(n, 0.1, np.float32)
    p[:above] = 0.9
    return jnp.asarray(p)


def test_stats_give_the_partner_p_value_of_the_pooled_views():
    method = methods.build_method("ugncl", {"noise_share": "partner"})
    raw = _raw(4)
    rows = method.stats_fn({"logit": raw}, {"mask": MASK})
    s = method.settings
    # oracle: the views' log-evidence summed in probability space, each real row's rank of
    # its partner among the real columns, ties against the partner
    log_e = np.logaddexp(0.0, np.asarray(raw, np.float64)) / s.tau  # exp(softplus(R) / tau)
    pooled = np.log(np.exp(log_e).sum(0))
    real = np.asarray(MASK, bool)
    n = real.sum()
    want = np.ones(len(real))
    for i in np.flatnonzero(real):
        others = [j for j in np.flatnonzero(real) if j != i]
        want[i] = (1 + sum(pooled[i, j] >= pooled[i, i] for j in others)) / n
    np.testing.assert_allclose(rows["partner_p"], want, rtol=1e-6)
    assert "partner_p" not in methods.build_method("ugncl").stats_fn({"logit": raw}, {"mask": MASK})


def test_the_division_is_off_only_after_a_divided_epoch_did_not_raise_the_bound():
    method = methods.build_method("ugncl", {"noise_share": "partner"})
    memory = _memory(method)
    stats = _stats(1)
    plain = methods.build_method("ugncl").refresh_fn(_memory(method), stats, _ctx_refresh(2))[0]
    offs, bounds = [], []
    # bounds (N = 200, floor 0.05): 0 above 1/2 -> 0.027, 1 -> 0.044, 3 -> 0.075
    for epoch, above in enumerate((0, 1, 1, 1, 0, 3, 0, 0, 0), start=2):
        memory, diag = method.refresh_fn(
            memory, {**stats, "partner_p": _partner_p(above)}, _ctx_refresh(epoch)
        )
        offs.append(diag["division_off"])
        bounds.append(float(diag["noise_share_bound"]))
        codes = np.asarray(memory.samples["codes"])
        if diag["division_off"]:  # every pair determined-clean, target 1
            np.testing.assert_array_equal(codes, division.CLEAN)
            np.testing.assert_array_equal(memory.samples["division_soft_label"], 1.0)
            np.testing.assert_array_equal(memory.samples["division_uncertainty"], 0.0)
        else:  # the division of the statistics, as without the switch
            np.testing.assert_array_equal(codes, plain.samples["codes"])
        # the signals are measured either way (the audit reads the soft label)
        np.testing.assert_array_equal(memory.samples["soft_label"], stats["soft_label"])
        np.testing.assert_array_equal(memory.samples["fallback_warmup"], 0.0)
        assert set(memory.samples) == set(plain.samples)
    assert bounds[0] < bounds[1] < 0.05 < bounds[5]
    # no bound before the first; the second rose; the third did not: off; stays off while
    # below; a bound above the floor turns it on, and it stays on for the run
    np.testing.assert_array_equal(offs, [0, 0, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(memory.state["noise_bound_max"], bounds[5])


def test_the_validation_split_must_agree():
    method = methods.build_method("ugncl", {"noise_share": "partner"})
    memory, stats = _memory(method), {**_stats(1), "partner_p": _partner_p(0)}
    ctx = _ctx_refresh(2)._replace(held_out=lambda: 0.2)
    for epoch in (2, 3):
        memory, diag = method.refresh_fn(memory, stats, ctx._replace(epoch=epoch))
    assert diag["division_off"] == 0.0 and diag["held_out_share"] == pytest.approx(0.2)


def test_noise_share_needs_the_epoch_division():
    with pytest.raises(ValueError, match="noise_share must be 'none' unless division_cadence"):
        methods.build_method("ugncl", {"noise_share": "partner", "division_cadence": "online"})
    assert (
        methods.build_method("ugncl").init_memory(base.InitContext(3, None, None, None)).state == {}
    )


def test_the_contrastive_ranking_needs_a_margin():
    # Its hard-set weight is the trusted margin over gamma: 0/0 at gamma=0.
    with pytest.raises(ValueError, match="gamma must be above 0 with ranking='contrastive'"):
        methods.build_method("ugncl", {"ranking": "contrastive", "gamma": 0.0})
    methods.build_method("ugncl", {"ranking": "trusted", "gamma": 0.0})
