"""``calibrate_energy``'s ``separation``: the share of the energies' variance its split
explains, against a numpy search over every cut and the values known in closed form."""

import jax.numpy as jnp
import numpy as np
import pytest

from ncljax.labels import srem


def _best_share(x):
    """max over cuts of (between-class sum of squares) / (total sum of squares)."""
    x = np.sort(np.asarray(x, np.float64))
    total = ((x - x.mean()) ** 2).sum()
    best = 0.0
    for k in range(1, x.size):
        if x[k] == x[k - 1]:
            continue
        low, high = x[:k], x[k:]
        between = k * low.mean() ** 2 + (x.size - k) * high.mean() ** 2 - x.size * x.mean() ** 2
        best = max(best, between / total)
    return best


@pytest.mark.parametrize("seed", [0, 1])
def test_separation_is_the_explained_share_of_variance(seed):
    rng = np.random.default_rng(seed)
    x = np.r_[rng.normal(0, 1, 300), rng.normal(3, 0.5, 100)].astype(np.float32)
    where = rng.random(x.size) > 0.1
    fit = srem.calibrate_energy(jnp.asarray(x), where=jnp.asarray(where))
    assert float(fit.separation) == pytest.approx(_best_share(x[where]), rel=1e-4)
    shifted = srem.calibrate_energy(jnp.asarray(3 * x - 7), where=jnp.asarray(where))
    assert float(shifted.separation) == pytest.approx(float(fit.separation), rel=1e-4)


def test_separation_of_known_distributions_and_a_degenerate_one():
    grid = (np.arange(20000) + 0.5) / 20000  # a uniform: the split at 1/2 explains 3/4
    assert float(srem.calibrate_energy(jnp.asarray(grid)).separation) == pytest.approx(0.75, 1e-3)
    normal = np.sqrt(2) * _erfinv(2 * grid - 1)  # a standard normal's quantiles: 2 / pi
    assert float(srem.calibrate_energy(jnp.asarray(normal)).separation) == pytest.approx(
        2 / np.pi, abs=2e-3
    )
    assert float(srem.calibrate_energy(jnp.ones(5)).separation) == 0.0


def _erfinv(y):
    from scipy.special import erfinv

    return erfinv(y)
