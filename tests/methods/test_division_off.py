"""``train.division='off'`` (``RefreshContext.divide=False``): every method whose division has
a switch trains every pair as clean at every refresh, whatever its partner p-values show
(here uniform ones, a share of lies near 1, which keep the division on otherwise), and asks
the validation split nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ncljax import methods
from ncljax.labels import ugncl as ugncl_division
from ncljax.methods import base, coteaching, gsc, ncr, pc2
from tests.methods import test_gsc_functions as gsc_tests
from tests.methods import test_srem_calibration as srem_tests
from tests.methods import test_ugncl_calibration as ugncl_cal
from tests.methods.test_ugncl import _ctx_refresh

UNIFORM = np.linspace(0.0025, 1.0, 400, dtype=np.float32)  # Storey's estimate near 1


def _never_asked():
    raise AssertionError("the validation split was asked while every division is off")


def _off(ctx):
    return ctx._replace(divide=False, held_out=_never_asked)


@pytest.mark.parametrize("settings_type", [ncr.Settings, pc2.Settings], ids=["ncr", "pc2"])
def test_co_divide(settings_type):
    s = settings_type(noise_share="partner")
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.normal(0.1, 0.02, 300), rng.normal(0.6, 0.05, 100)])
    ctx = base.RefreshContext(epoch=3, num_epochs=5, network=0, rng=None, fetch=None)
    samples = coteaching.init_samples(400)
    stats = {"loss": values, "partner_p": UNIFORM}
    on, _, _, _, extra = coteaching.co_divide(s, "m", samples, stats, ctx)
    assert float(extra["division_off"]) == 0.0 and on["clean"].min() == 0.0
    off, _, _, fallback, extra = coteaching.co_divide(s, "m", samples, stats, _off(ctx))
    assert not fallback and float(extra["division_off"]) == 1.0
    assert "held_out_share" not in extra
    for name in ("prob", "clean", "divided"):
        np.testing.assert_array_equal(off[name], 1.0)
    # the estimate is still measured and logged
    assert float(extra["noise_share_estimate"]) == pytest.approx(1.0, abs=0.01)


def test_gsc():
    n = gsc_tests.N
    rng = np.random.default_rng(8)
    clean = np.arange(n) < 120
    cross = np.where(clean, 0.8, 0.2).astype(np.float32)
    intra = np.where(clean, rng.normal(0.9, 0.02, n), rng.normal(0.2, 0.05, n)).astype(np.float32)
    uniform = np.linspace(0.005, 1.0, n, dtype=np.float32)
    memory = gsc_tests._shared_memory(cross, intra, uniform)
    ctx = base.RefreshContext(3, 10, 0, None, None)
    on, diag = gsc.refresh(gsc_tests.SHARED, memory, None, ctx)
    assert float(diag["division_off"]) == 0.0 and float(on.samples["labels"].min()) < 1.0
    off, diag = gsc.refresh(gsc_tests.SHARED, memory, None, _off(ctx))
    assert float(diag["division_off"]) == 1.0 and "held_out_share" not in diag
    np.testing.assert_array_equal(off.samples["labels"], 1.0)
    np.testing.assert_allclose(off.samples["ema_intra"], on.samples["ema_intra"], rtol=1e-6)


def test_srem():
    kwargs = {"division": "partner", "ranking": "contrastive", "noise_share": "partner"}
    method = methods.build_method("srem", kwargs)
    memory, _ = srem_tests._trained_memory(method, n=400, epoch=4)
    memory = base.Memory(dict(memory.samples, partner_p=jnp.asarray(UNIFORM)), memory.state)
    on, diag = method.refresh_fn(memory, None, srem_tests._refresh_ctx(4))
    assert float(on.state["division_off"]) == 0.0
    off, diag = method.refresh_fn(memory, None, _off(srem_tests._refresh_ctx(4)))
    assert float(off.state["division_off"]) == 1.0 and diag["division_off"] == 1.0
    assert "held_out_share" not in diag


def test_ugncl():
    method = methods.build_method("ugncl", {"noise_share": "partner"})
    stats = {**ugncl_cal._stats(1), "partner_p": jnp.ones(ugncl_cal.N, jnp.float32)}
    memory = ugncl_cal._memory(method)
    _, diag = method.refresh_fn(memory, stats, _ctx_refresh(2))
    assert diag["division_off"] == 0.0
    memory = ugncl_cal._memory(method)
    for epoch in (2, 3):  # off from the first refresh on, with no bound before it
        memory, diag = method.refresh_fn(memory, stats, _off(_ctx_refresh(epoch)))
        assert diag["division_off"] == 1.0 and "held_out_share" not in diag
        np.testing.assert_array_equal(memory.samples["codes"], ugncl_division.CLEAN)
        np.testing.assert_array_equal(memory.samples["division_soft_label"], 1.0)


def test_the_refresh_context_divides_by_default():
    ctx = base.RefreshContext(0, 1, 0, jax.random.key(0), None)
    assert ctx.divide is True
