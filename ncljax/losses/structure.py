r"""GSC's purified objectives: cross-modal InfoNCE and intra-modal structure alignment.

Geometrical structure consistency (GSC, Zhao et al., CVPR 2024) trains on three in-batch
similarity matrices, all in the (0, 1) range of a sigmoid head:

* ``sim`` ``[B, B]``: :math:`\mathbf S_{bc} = \langle I_b, T_c\rangle`, rows images;
* ``sim_image`` ``[B, B]``: :math:`\mathbf G^I_{ji} = \langle I_j, I_i\rangle`, row ``j`` is
  the *intra-image structure* of sample ``j``;
* ``sim_text`` ``[B, B]``: :math:`\mathbf G^T_{ji} = \langle T_j, T_i\rangle` (caption ``j``
  the context, ``i`` the query; not symmetric with the SGR head).

Each pair carries a soft correspondence label :math:`y_b \in [0, 1]` estimated by
``ncljax.labels`` (``gsc_*``). Labels are constants: every function here stops their
gradient. Every loss is per example ``[B]``; the batch mean of the returned values is the
paper's objective (Eqs. 6, 7 and 9 divide by ``B``, not by the label sum). ``where`` masks
padding: a masked pair is neither a negative nor a structure column, and its loss is 0.

Equations: GSC (Zhao et al., CVPR 2024), Sec. 3.3, Eqs. 6-9.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax import masking
from ncljax.losses.contrastive import info_nce, symmetric_info_nce


def _square(x: ArrayLike, name: str) -> jax.Array:
    x = jnp.asarray(x)
    x = x.astype(jnp.result_type(x, jnp.float32))
    if x.ndim != 2 or x.shape[0] != x.shape[1]:
        raise ValueError(f"{name} must be square [B, B], got {x.shape}")
    return x


def _labels(y: ArrayLike, num: int, dtype, where: ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    """Constant labels ``[B]`` (zero at padding) and the validity mask ``[B]``."""
    y = jax.lax.stop_gradient(jnp.asarray(y, dtype))
    if y.shape != (num,):
        raise ValueError(f"labels must have shape ({num},), got {y.shape}")
    valid = masking.valid_rows(num, where)
    return jnp.where(valid, y, 0.0), valid


def mask_structures(
    sim_image: ArrayLike, sim_text: ArrayLike, labels: ArrayLike, *, where: ArrayLike | None = None
) -> tuple[jax.Array, jax.Array]:
    r"""GSC's purified intra-modal structures: columns scaled by the labels (Eq. 8 inputs).

    .. math::
      \mathbf A_{ji} = \mathbf G^I_{ji}\, y_i, \qquad \mathbf C_{ji} = \mathbf G^T_{ji}\, y_i

    Row ``j`` of ``A`` (``C``) is sample ``j``'s image (text) structure with the likely
    noisy samples ``i`` masked out. Padding columns are zero.

    Args:
      sim_image: ``[B, B]`` intra-image similarities :math:`\mathbf G^I`.
      sim_text: ``[B, B]`` intra-text similarities :math:`\mathbf G^T` (row: context).
      labels: ``[B]`` soft correspondence labels :math:`y` (constants; gradient stopped).
      where: optional bool ``[B]``, True for real pairs.

    Returns:
      ``(A, C)``, each ``[B, B]``.

    References:
      Zhao et al., "Mitigating Noisy Correspondence by Geometrical Structure Consistency
      Learning", CVPR 2024, Sec. 3.3 (Eqs. 7-8).
    """
    g_image, g_text = _square(sim_image, "sim_image"), _square(sim_text, "sim_text")
    if g_image.shape != g_text.shape:
        raise ValueError(f"sim_image {g_image.shape} and sim_text {g_text.shape} differ")
    y, _ = _labels(labels, g_image.shape[0], g_image.dtype, where)
    return g_image * y[None, :], g_text * y[None, :]


def gsc_cross_modal_loss(
    sim: ArrayLike,
    labels: ArrayLike,
    *,
    temperature: float = 0.07,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""GSC's purified cross-modal loss per pair (Eq. 6): label-weighted symmetric InfoNCE.

    .. math::
      \ell^{CM}_b = y_b\cdot\tfrac12\big[-\log p^{i2t}_b - \log p^{t2i}_b\big],\quad
      p^{i2t}_b = \frac{e^{\mathbf S_{bb}/\tau_1}}{\sum_c e^{\mathbf S_{bc}/\tau_1}},\quad
      p^{t2i}_b = \frac{e^{\mathbf S_{bb}/\tau_1}}{\sum_c e^{\mathbf S_{cb}/\tau_1}}

    computed with ``log_softmax``. The batch mean is :math:`\mathcal L_{CM}`.

    Args:
      sim: ``[B, B]`` image-by-caption similarities :math:`\mathbf S` (sigmoid outputs in GSC).
      labels: ``[B]`` soft correspondence labels (constants).
      temperature: :math:`\tau_1` (0.07).
      where: optional bool ``[B]``, True for real pairs.

    Returns:
      ``[B]`` per-pair loss (0 at padding).

    References:
      GSC (Zhao et al., CVPR 2024), Sec. 3.3, Eq. 6.
    """
    sim = _square(sim, "sim")
    y, valid = _labels(labels, sim.shape[0], sim.dtype, where)
    logits = sim / temperature
    nll = symmetric_info_nce(logits, where=valid)
    return y * nll


def gsc_intra_modal_loss(
    sim_image: ArrayLike,
    sim_text: ArrayLike,
    labels: ArrayLike,
    *,
    temperature: float = 1.0,
    row_weight: bool = True,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""GSC's purified intra-modal (structure alignment) loss per sample (Eq. 7).

    .. math::
      \mathbf K = \mathbf A\mathbf C^\top,\quad
      \mathbf K_{jl} = \sum_i y_i^2\,\langle I_j,I_i\rangle\langle T_l,T_i\rangle,\qquad
      \ell^{IM}_j = y_j\cdot\Big[-\log\frac{e^{\mathbf K_{jj}/\tau_2}}
                                         {\sum_l e^{\mathbf K_{jl}/\tau_2}}\Big]

    One direction only: image structure ``j`` against every text structure ``l``. The
    softmax is a ``log_softmax``: :math:`\mathbf K` reaches about ``B``, and a naive
    ``exp`` overflows float32 at ``B = 128`` and :math:`\tau_2 = 1`.

    Args:
      sim_image: ``[B, B]`` intra-image similarities :math:`\mathbf G^I`.
      sim_text: ``[B, B]`` intra-text similarities :math:`\mathbf G^T`.
      labels: ``[B]`` soft correspondence labels (constants).
      temperature: :math:`\tau_2` (1.0).
      row_weight: multiply row ``j``'s loss by :math:`y_j` (the official code and the
        paper's text, default); ``False`` is the paper's Eq. 7 as printed, which has no
        outer factor (the columns are masked either way).
      where: optional bool ``[B]``, True for real pairs.

    Returns:
      ``[B]`` per-sample loss (0 at padding).

    References:
      GSC (Zhao et al., CVPR 2024), Sec. 3.3, Eq. 7; the official GSC code
      (``GSC+/model/RINCE.py``, ``RINCE.train_batch``) multiplies each row's loss by
      :math:`y_j`, which Eq. 7 does not, and computes only this one direction.
    """
    a, c = mask_structures(sim_image, sim_text, labels, where=where)
    y, valid = _labels(labels, a.shape[0], a.dtype, where)
    nll = info_nce(a @ c.T / temperature, where=valid)
    return y * nll if row_weight else nll


def gsc_loss(
    sim: ArrayLike,
    sim_image: ArrayLike,
    sim_text: ArrayLike,
    labels: ArrayLike,
    *,
    cross_temperature: float = 0.07,
    intra_temperature: float = 1.0,
    intra_weight: float = 0.01,
    row_weight: bool = True,
    where: ArrayLike | None = None,
) -> jax.Array:
    r"""GSC's total objective per pair (Eq. 9): :math:`\ell^{CM}_b + \gamma\,\ell^{IM}_b`.

    The batch mean is :math:`\mathcal L = \mathcal L_{CM} + \gamma\mathcal L_{IM}`.

    Args:
      sim: ``[B, B]`` image-by-caption similarities.
      sim_image: ``[B, B]`` intra-image similarities.
      sim_text: ``[B, B]`` intra-text similarities (row: context caption).
      labels: ``[B]`` soft correspondence labels (constants).
      cross_temperature: :math:`\tau_1` (0.07).
      intra_temperature: :math:`\tau_2` (1.0).
      intra_weight: :math:`\gamma` (0.01; the paper also calls it :math:`\lambda`).
      row_weight: see :func:`gsc_intra_modal_loss`.
      where: optional bool ``[B]``, True for real pairs.

    Returns:
      ``[B]`` per-pair loss.

    References:
      GSC (Zhao et al., CVPR 2024), Sec. 3.3, Eq. 9.
    """
    cross = gsc_cross_modal_loss(sim, labels, temperature=cross_temperature, where=where)
    intra = gsc_intra_modal_loss(
        sim_image,
        sim_text,
        labels,
        temperature=intra_temperature,
        row_weight=row_weight,
        where=where,
    )
    return cross + intra_weight * intra
