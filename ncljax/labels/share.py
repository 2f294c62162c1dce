r"""How many pairs lie: the mismatched share estimated against the batch's own null, and a
division switched off where it is next to nothing (ncljax's).

A method's division (a two-component GMM, an energy split, an uncertainty cut) always
finds two groups: on a folder without a single mismatched pair it still sets aside its
hardest clean pairs, and on a small folder the data it loses costs more than the noise
it could remove. The share of mismatched pairs can instead be read off a null the data
provides. A mismatched pair's caption is one more caption its image has nothing to do
with, exchangeable with the batch's other captions, so its in-batch partner p-value
(``ncljax.labels.srem.partner_p_value``) is uniform; a matched pair's is small. Above a
level :math:`\lambda` lie about :math:`(1-\lambda)` of the mismatched pairs' p-values and
few matched ones, so

.. math:: \hat\pi = \frac{|\{i : p_i > \lambda\}|}{N (1 - \lambda)}

estimates the mismatched share (Storey, "A direct approach to false discovery rates",
JRSS B 2002, Eq. 3, with the matched pairs as the alternatives: the hard matched pairs
above :math:`\lambda` make it err high). :func:`noise_share` returns it with a
one-sided Wilson upper confidence bound, and :func:`no_noise` switches a division off
for an epoch where the bound is below a floor (a few per cent).

The estimate is honest only for pairs the model has not learnt as matches. A network
that fits its training pairs ranks a memorised mismatched pair's caption high too: on
the MNIST halves at 40% mismatched (MLP encoders, 3,000 pairs) GSC's in-batch
p-values put the share at 0.14-0.25 after the first epoch, at 20% at 0.10-0.13 (digits
and cancer halves: 0.17-0.22 at 20%, 0.30-0.36 at 40%). The estimate errs low under
memorisation, so it serves as a test of "next to no mismatched pair" (clean folders:
bounds of 0.002-0.06 from the second epoch), not as a count to cut a division at, and the
test is confirmed on pairs the model never trained on (:func:`switch_off`): on 3,000
pairs of weak, noisy synthetic features at 40% mismatched the networks learnt every pair
and the training bound fell to 0.002 after two epochs, while the validation split's
estimate stayed at 0.05-0.12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

# A method's ``noise_share`` setting: ``'none'`` (the papers) or ``'partner'`` (this test).
MODES = ("none", "partner")


class NoiseShare(NamedTuple):
    """The estimated mismatched share of a set of partner p-values.

    Attributes:
      estimate: Storey's :math:`\\hat\\pi` (clipped to ``[0, 1]``).
      bound: its one-sided upper confidence bound (Wilson score bound of the share of
        p-values above ``lam``, divided by ``1 - lam``; clipped to ``[0, 1]``).
      count: the number of p-values it was estimated from.
    """

    estimate: jax.Array
    bound: jax.Array
    count: jax.Array


def noise_share(
    p_values: ArrayLike,
    *,
    where: ArrayLike | None = None,
    lam: float = 0.5,
    confidence: float = 0.95,
) -> NoiseShare:
    r"""The mismatched share of the pairs whose partner p-values are ``p_values``.

    .. math::
      \hat q = \frac{k}{N},\quad k = |\{i : p_i > \lambda\}|,\qquad
      \hat\pi = \frac{\hat q}{1-\lambda},\qquad
      \pi^{+} = \frac{1}{1-\lambda}\,
        \frac{\hat q + \frac{z^2}{2N} + z\sqrt{\frac{\hat q(1-\hat q)}{N} + \frac{z^2}{4N^2}}}
             {1 + \frac{z^2}{N}}

    with :math:`z` the ``confidence`` quantile of the standard normal (Storey 2002, Eq. 3;
    the Wilson score interval, Wilson 1927). With no valid p-value the share is unknown
    and both are 1 (nothing is capped).

    Args:
      p_values: ``[N]`` partner p-values in ``(0, 1]``.
      where: optional bool ``[N]``, the pairs to count.
      lam: :math:`\lambda` in ``(0, 1)`` (0.5).
      confidence: the bound's one-sided confidence in ``(0, 1)`` (0.95).

    Returns:
      :class:`NoiseShare`.
    """
    p = jnp.asarray(p_values, jnp.float32)
    valid = jnp.ones(p.shape, bool) if where is None else jnp.asarray(where, bool)
    n = jnp.sum(valid).astype(jnp.float32)
    k = jnp.sum(valid & (p > lam)).astype(jnp.float32)
    safe_n = jnp.maximum(n, 1.0)
    q = k / safe_n
    z = jax.scipy.stats.norm.ppf(confidence)
    z2n = z * z / safe_n
    upper = (q + z2n / 2 + z * jnp.sqrt(q * (1 - q) / safe_n + z2n / (4 * safe_n))) / (1 + z2n)
    scale = 1.0 / (1.0 - lam)
    known = n > 0
    estimate = jnp.where(known, jnp.clip(q * scale, 0.0, 1.0), 1.0)
    bound = jnp.where(known, jnp.clip(upper * scale, 0.0, 1.0), 1.0)
    return NoiseShare(*jax.lax.stop_gradient((estimate, bound)), count=n)


def no_noise(share: NoiseShare, floor: float) -> jax.Array:
    """Whether the pairs hold too few mismatched pairs for a division to pay: the
    share's upper bound is below ``floor``. A division always finds two groups; below a
    few per cent of mismatched pairs the clean pairs it sets aside cost more than the
    mismatched pairs it removes, and every pair trains as clean."""
    return share.bound < floor


def switch_off(
    share: NoiseShare,
    floor: float,
    held_out: Callable[[], float | None] | None = None,
    divide: bool = True,
) -> tuple[bool, float | None]:
    """Whether a division is switched off: :func:`no_noise` of the training pairs'
    ``share``, confirmed on pairs the model never trained on. A network that learns its
    mismatched pairs ranks their captions high too, and their share reads near 0 (measured
    on a synthetic world with weak pairing at 40% mismatched: bounds of 0.002-0.03 after
    two epochs), so the switch also needs ``held_out()``, the validation split's estimated
    share (``ncljax.train.evaluator.held_out_share``), below ``floor``; it is asked only
    when the training pairs' test passes. Without ``held_out`` (or where it gives
    ``None``) the training pairs decide alone.

    ``divide=False`` (the trainer's ``train.division='off'``, :func:`divides`) switches the
    division off whatever the pairs show, and asks nothing.

    Returns:
      ``(off, held-out estimate or None)``.
    """
    if not divide:
        return True, None
    off = bool(no_noise(share, floor))
    value = held_out() if off and held_out is not None else None
    if value is not None and not value < floor:
        off = False
    return off, value


def divides(ctx) -> bool:
    """Whether a refresh may divide: ``False`` where the trainer switched every division
    of the run off (``RefreshContext.divide``, ``train.division='off'``); ``True`` without
    a context."""
    return ctx is None or bool(ctx.divide)


def diagnostics(share: NoiseShare, off: ArrayLike, held_out: float | None = None) -> dict:
    """A refresh's logged values: the estimated mismatched share, its bound, whether the
    division was switched off (``division_off``, 1 or 0), and the held-out estimate
    (``held_out_share``) where :func:`switch_off` asked for it."""
    out = {
        "noise_share_estimate": share.estimate,
        "noise_share_bound": share.bound,
        "division_off": jnp.asarray(off, jnp.float32),
    }
    if held_out is not None:
        out["held_out_share"] = jnp.asarray(held_out, jnp.float32)
    return out
