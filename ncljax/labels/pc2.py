r"""PC2's estimators: classifier inputs, prediction oscillation, soft labels, pseudo-captions.

* :func:`resample_to_fixed` (the caption input :math:`\Phi_{36}` of the pseudo-classifier,
  with the batch's maximum length traced, so a new length does not recompile) and
  :func:`flatten_regions` (:math:`\mathrm{vec}`, region-major);
* :func:`prediction_oscillation` (Eq. 7, or the official code's reversed KL),
  :func:`top_classes` and :func:`bank_probabilities` (a prediction bank kept as each
  pair's most probable classes, ncljax's), and :func:`clean_soft_label` (Eq. 8's
  :math:`\hat y`, the correspondence rectification);
* :func:`assign_pseudo_captions` (Eq. 4), :func:`noisy_margin` (Eq. 5) and
  :func:`gather_pseudo_captions` / :func:`gather_rows` (the pseudo-caption of each noisy
  image: the clean caption's own word features and length).

The loss GMM, its split with the 1% rule and the oscillation GMM are NCR's:
``ncljax.labels.gmm`` and ``ncljax.labels.ncr`` (``loss_division``, ``split_clean``); the
margin curve is ``ncljax.losses.ranking.soft_margin`` and the ranking losses
``ncljax.losses.ranking.triplet_hardest`` / ``triplet_mean``.

Equations: PC2 (Duan et al., ACM MM 2024), Secs. 4.3-4.4 (Eqs. 4, 5, 7 and 8) and
Appendix B; the classifier inputs, which the paper does not describe, follow the official
code (``alipay/PC2-NoiseofWeb``, ``pc2/model.py``, ``SGRAF.train``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ncljax import masking
from ncljax.losses import ranking

_SG = jax.lax.stop_gradient
KL_DIRECTIONS = ("paper", "code")


def _float(x: ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    return x.astype(jnp.result_type(x, jnp.float32))


_rows = masking.valid_rows


def _index(index: ArrayLike) -> jax.Array:
    index = jnp.asarray(index)
    if index.ndim != 1 or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"index must be a 1-D integer array, got {index.dtype}{index.shape}")
    return index


def resample_to_fixed(
    features: ArrayLike, batch_max_len: ArrayLike, out_len: int = 36
) -> jax.Array:
    r"""Resample a batch of word features to ``out_len`` positions (:math:`\Phi_{36}`).

    The paper does not describe this input. The official code (``pc2/model.py``,
    ``SGRAF.train``) resamples its ``[B, L_b, D]`` batch tensor, ``L_b`` the longest caption
    of the batch, along the sequence axis. With ``n = out_len``:

    * ``L_b > n``: linear interpolation, PyTorch ``interpolate(mode='linear',
      align_corners=False)``: for :math:`t = 0, \dots, n-1`

      .. math::
        s_t = \max\!\big(0, (t + \tfrac12)\tfrac{L_b}{n} - \tfrac12\big),\quad
        i_0 = \lfloor s_t \rfloor,\quad i_1 = \min(i_0 + 1, L_b - 1),\quad
        \lambda_t = s_t - i_0,\quad
        \Phi(G)_{\cdot t} = (1 - \lambda_t)\,G_{\cdot i_0} + \lambda_t\,G_{\cdot i_1}

      (for :math:`L_b = 40`: :math:`(i_0, i_1, \lambda) = (0, 1, 0.0556)` at ``t = 0`` and
      :math:`(38, 39, 0.9444)` at ``t = 35``);
    * ``L_b < n``: symmetric zero padding, :math:`\lfloor (n - L_b)/2 \rfloor` zero rows
      before and :math:`\lceil (n - L_b)/2 \rceil` after;
    * ``L_b = n``: identity.

    :math:`s_t = ((2t + 1) L_b - n) / 2n` is split into :math:`i_0` and :math:`\lambda_t` in
    integer arithmetic, exactly; PyTorch rounds :math:`s_t` in float32 first, a difference of a
    few float32 ulps of :math:`s_t` in :math:`\lambda_t` (about :math:`10^{-6}`), continuous
    across a floor.

    Here the batch is statically padded to ``L >= L_b`` positions and ``L_b`` is a traced
    scalar: the result is index arithmetic and two gathers, so a batch of another maximum
    length reuses the compiled program. Positions ``>= L_b`` are absent (never read; their
    values, even NaN, do not matter and get no gradient). The rows between a caption's own
    length and ``L_b`` are used as they are, so they must be zero (as the text encoder
    outputs): a caption's input depends on the other captions of its batch, as in the code.

    The classifier then reads :func:`flatten_regions` of the result (``[B, n * D]``).

    Args:
      features: ``[B, L, D]`` word features ``G`` (gradient flows).
      batch_max_len: int scalar :math:`L_b`, ``1 <= L_b <= L`` (may be traced; a concrete
        value outside the range raises).
      out_len: ``n`` (36, static).

    Returns:
      ``[B, out_len, D]``.

    References:
      Duan et al., ACM MM 2024, official code (``pc2/model.py``); PyTorch
      ``torch.nn.functional.interpolate`` (linear, ``align_corners=False``).
    """
    features = _float(features)
    if features.ndim != 3 or features.shape[1] < 1:
        raise ValueError(f"features must be [B, L, D] with L >= 1, got {features.shape}")
    if not isinstance(out_len, int | np.integer) or out_len < 1:
        raise ValueError(f"out_len must be a positive int, got {out_len!r}")
    length = jnp.asarray(batch_max_len)
    if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
        raise ValueError(f"batch_max_len must be an int scalar, got {length.dtype}{length.shape}")
    num_pos = features.shape[1]
    try:
        concrete = int(length)
    except jax.errors.ConcretizationTypeError:  # traced: checked by the caller
        concrete = None
    if concrete is not None and not 1 <= concrete <= num_pos:
        raise ValueError(f"batch_max_len must be in [1, {num_pos}], got {concrete}")
    length = length.astype(jnp.int32)
    dtype = features.dtype
    present = jnp.arange(num_pos) < length
    features = jnp.where(present[None, :, None], features, 0.0)
    t = jnp.arange(out_len)

    # L_b > n: s_t = ((2t + 1) L_b - n) / 2n, floored and split in integers (exact).
    twice_n = 2 * out_len
    numerator = jnp.maximum((2 * t + 1) * length - out_len, 0)
    i0 = jnp.minimum(numerator // twice_n, length - 1)
    i1 = jnp.minimum(i0 + 1, length - 1)
    lam = jnp.clip((numerator - i0 * twice_n).astype(dtype) / twice_n, 0.0, 1.0)

    # L_b <= n: output t reads input t - before, or zero outside [0, L_b).
    shifted = t - (out_len - length) // 2
    inside = (shifted >= 0) & (shifted < length)
    shifted = jnp.clip(shifted, 0, num_pos - 1)

    interpolate = length > out_len
    idx0 = jnp.where(interpolate, i0, shifted)
    idx1 = jnp.where(interpolate, i1, shifted)
    w0 = jnp.where(interpolate, 1.0 - lam, inside.astype(dtype))
    w1 = jnp.where(interpolate, lam, 0.0)
    return w0[None, :, None] * features[:, idx0] + w1[None, :, None] * features[:, idx1]


def flatten_regions(x: ArrayLike) -> jax.Array:
    r"""The classifier input :math:`\mathrm{vec}(F)`: ``[..., R, D] -> [..., R * D]``, region-major.

    Entry ``r * D + d`` holds region (or resampled word position) ``r``, feature ``d``: the
    row-major flattening of the official code's ``view(B, -1)``.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"x must be [..., R, D], got shape {x.shape}")
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def prediction_oscillation(
    p_prev: ArrayLike,
    p_now: ArrayLike,
    *,
    direction: str = "paper",
    eps: float = 1e-8,
    valid: ArrayLike | None = None,
) -> jax.Array:
    r"""Prediction oscillation of each sample between two epochs (Eq. 7, CR module).

    ``'paper'`` (Eq. 7) and ``'code'`` (the official code, the reversed direction, ``p_prev``
    being its bank entry :math:`\beta`):

    .. math::
      o_i = D_{KL}(p^{prev}_i \,\|\, p^{now}_i) \;(\texttt{'paper'}), \qquad
      o_i = D_{KL}(p^{now}_i \,\|\, p^{prev}_i) \;(\texttt{'code'}), \qquad
      D_{KL}(a \| b) = \sum_k a_k \big(\log\max(a_k, \epsilon) - \log\max(b_k, \epsilon)\big)

    (a class with :math:`a_k = 0` contributes 0). The oscillations are then min-max
    normalised over the training set and fitted with a two-component GMM
    (``ncljax.labels.ncr.loss_division``) to give :math:`w^o`.

    Args:
      p_prev: ``[N, K]`` the previous predictions (probabilities; the bank).
      p_now: ``[N, K]`` the current predictions.
      direction: ``'paper'`` (default) or ``'code'``.
      eps: the clamp inside the logs (``1e-8``).
      valid: optional bool ``[N]``; ``False`` for a sample missing from the bank (its
        oscillation is 0, whatever its rows hold).

    Returns:
      ``[N]`` oscillations, >= 0 up to rounding (no gradient).

    References:
      Duan et al., ACM MM 2024, Sec. 4.4, Eq. 7 and Appendix B; the official code
      (``pc2/co_train.py``, ``eval_train``) computes the reversed KL against its prediction
      bank.
    """
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"direction must be one of {KL_DIRECTIONS}, got {direction!r}")
    p_prev, p_now = _SG(_float(p_prev)), _SG(_float(p_now))
    if p_prev.ndim != 2 or p_prev.shape != p_now.shape:
        raise ValueError(
            f"p_prev and p_now must be [N, K] alike, got {p_prev.shape}, {p_now.shape}"
        )
    ok = _rows(p_prev.shape[0], valid, "valid")
    a, b = (p_prev, p_now) if direction == "paper" else (p_now, p_prev)
    a = jnp.where(ok[:, None], a, 0.0)
    b = jnp.where(ok[:, None], b, 1.0)
    kl = jnp.sum(a * (jnp.log(jnp.maximum(a, eps)) - jnp.log(jnp.maximum(b, eps))), axis=1)
    return jnp.where(ok, kl, 0.0)


def top_classes(p: ArrayLike, k: int) -> tuple[jax.Array, jax.Array]:
    """Each row's ``k`` most probable classes: ``(probabilities [N, k], classes [N, k])``,
    most probable first (ties to the lower class; ``jax.lax.top_k``). The compact form of a
    prediction bank (:func:`bank_probabilities` reads it back)."""
    p = _SG(_float(p))
    if p.ndim != 2 or not 1 <= k <= p.shape[1]:
        raise ValueError(f"p must be [N, K] with 1 <= k <= K, got {p.shape} and k={k}")
    values, classes = jax.lax.top_k(p, k)
    return values, classes.astype(jnp.int32)


def bank_probabilities(probs: ArrayLike, classes: ArrayLike, num_classes: int) -> jax.Array:
    r"""The distributions ``[N, num_classes]`` a compact bank stands for: each row's kept
    classes at their probabilities, and the rest of its mass spread evenly over the
    classes it did not keep,

    .. math:: \tilde p_{ic} = p_{ic} \;(c \in T_i), \qquad
      \tilde p_{ic} = \frac{1 - \sum_{t \in T_i} p_{it}}{K - |T_i|} \;(c \notin T_i).

    With every class kept (``k = num_classes``) the rows are the probabilities as stored.
    The rest is clipped at 0 (rounding can make the kept mass exceed 1 by an ulp).

    Args:
      probs: ``[N, k]`` kept probabilities (:func:`top_classes`).
      classes: int ``[N, k]`` their classes, distinct within a row.
      num_classes: ``K``.
    """
    probs, classes = _float(probs), jnp.asarray(classes, jnp.int32)
    if probs.ndim != 2 or probs.shape != classes.shape or probs.shape[1] > num_classes:
        raise ValueError(
            f"probs and classes must be [N, k] alike with k <= {num_classes}, got "
            f"{probs.shape} and {classes.shape}"
        )
    n, k = probs.shape
    rest = jnp.maximum(1.0 - probs.sum(1), 0.0) / max(num_classes - k, 1)
    dense = jnp.broadcast_to(rest[:, None], (n, num_classes))
    return dense.at[jnp.arange(n)[:, None], classes].set(probs)


def clean_soft_label(
    w: ArrayLike,
    w_osc: ArrayLike,
    *,
    threshold: float = 0.5,
    strict: bool = True,
    osc_clean: ArrayLike | None = None,
) -> jax.Array:
    r"""The rectified correspondence label of a clean pair (Eq. 8, CR module).

    .. math:: \hat y_i = w_i + (1 - w_i)\,\mathbb 1[w^o_i > \tau]\,w^o_i

    with ``>`` (``strict=True``, the code, whose indicator is the oscillation split) or ``>=``
    (``strict=False``, the paper). Both ``w`` (loss GMM) and ``w_osc`` (oscillation GMM) are
    the *peer* network's. ``osc_clean`` replaces the indicator by a given split, e.g.
    ``ncljax.labels.ncr.split_clean(w_osc_all, tau)`` over the training set, whose 1% rule
    can lower the threshold. The clean margin is then
    ``ncljax.losses.ranking.soft_margin(y_hat)``.

    Args:
      w: ``[B]`` loss-GMM clean probabilities.
      w_osc: ``[B]`` oscillation-GMM clean probabilities.
      threshold: :math:`\tau` (0.5).
      strict: ``>`` (default, the code) or ``>=`` (the paper).
      osc_clean: optional bool ``[B]``, the indicator itself (overrides ``threshold``).

    Returns:
      ``[B]`` in ``[w, 1]`` (no gradient).

    References:
      Duan et al., ACM MM 2024, Sec. 4.4, Eq. 8.
    """
    w, w_osc = _SG(_float(w)), _SG(_float(w_osc))
    if w.ndim != 1 or w.shape != w_osc.shape:
        raise ValueError(f"w and w_osc must be [B] alike, got {w.shape}, {w_osc.shape}")
    if osc_clean is not None:
        indicator = _rows(w.shape[0], osc_clean, "osc_clean")
    else:
        indicator = w_osc > threshold if strict else w_osc >= threshold
    return w + (1.0 - w) * jnp.where(indicator, w_osc, 0.0)


def assign_pseudo_captions(
    p_noisy: ArrayLike,
    p_clean: ArrayLike,
    *,
    clean_where: ArrayLike | None = None,
    where: ArrayLike | None = None,
    candidates: ArrayLike | None = None,
    eps: float = 1e-8,
) -> tuple[jax.Array, jax.Array]:
    r"""The clean pair whose image prediction is closest to each noisy image's (Eq. 4).

    .. math::
      S^p(p, p') = \frac{p^\top p'}{\max(\|p\|_2, \epsilon)\,\max(\|p'\|_2, \epsilon)},\qquad
      j(i) = \arg\max_{b\ \mathrm{real}} S^p(p^n_i, p^c_b),\qquad s_i = S^p(p^n_i, p^c_{j(i)})

    over the real clean pairs only; ties go to the lowest index. The caption of clean pair
    :math:`j(i)` becomes noisy image ``i``'s pseudo-caption (:func:`gather_pseudo_captions`)
    and :math:`s_i` sets its margin (:func:`noisy_margin`). Between probability vectors
    :math:`s_i \in [0, 1]`.

    Args:
      p_noisy: ``[Bn, K]`` image pseudo-predictions of the noisy batch.
      p_clean: ``[Bc, K]`` image pseudo-predictions of the clean batch.
      clean_where: optional bool ``[Bc]``, the real clean pairs (the only candidates).
      where: optional bool ``[Bn]``, the real noisy pairs.
      candidates: optional bool ``[Bn, Bc]``: each noisy image chooses only among its
        candidates (the real ones); a row without a real candidate chooses among all real
        clean pairs. Not in the paper: PC2's ``pseudo_caption_assignment='true_classes'``
        diagnostic passes the pairs of the noisy image's true class.
      eps: floor of the norms (``1e-8``).

    Returns:
      ``(index, cosine)``: int32 ``[Bn]`` :math:`j` (no gradient) and ``[Bn]`` :math:`s`, whose
      gradient flows into both predictions (the margin function decides whether to keep it).
      A padding noisy row, or a batch without a real clean pair, gets index 0 and cosine 0.

    References:
      Duan et al., ACM MM 2024, Sec. 4.3, Eq. 4.
    """
    p_noisy, p_clean = _float(p_noisy), _float(p_clean)
    if p_noisy.ndim != 2 or p_clean.ndim != 2 or p_noisy.shape[1] != p_clean.shape[1]:
        raise ValueError(
            f"p_noisy [Bn, K] and p_clean [Bc, K] must share K, got {p_noisy.shape}, "
            f"{p_clean.shape}"
        )
    noisy_ok = _rows(p_noisy.shape[0], where)
    clean_ok = _rows(p_clean.shape[0], clean_where, "clean_where")
    p_noisy = jnp.where(noisy_ok[:, None], p_noisy, 0.0)
    p_clean = jnp.where(clean_ok[:, None], p_clean, 0.0)

    def unit(p):
        return p / jnp.maximum(jnp.linalg.norm(p, axis=1, keepdims=True), eps)

    cosine = unit(p_noisy) @ unit(p_clean).T
    allowed = jnp.broadcast_to(clean_ok[None, :], cosine.shape)
    if candidates is not None:
        candidates = jnp.asarray(candidates, bool)
        if candidates.shape != cosine.shape:
            raise ValueError(
                f"candidates must have shape [Bn, Bc] = {cosine.shape}, got {candidates.shape}"
            )
        candidates = candidates & allowed
        allowed = jnp.where(candidates.any(1, keepdims=True), candidates, allowed)
    index = jnp.argmax(jnp.where(allowed, _SG(cosine), -jnp.inf), axis=1)
    found = noisy_ok & clean_ok.any()
    index = jnp.where(found, index, 0).astype(jnp.int32)
    chosen = jnp.take_along_axis(cosine, index[:, None], axis=1)[:, 0]
    return index, jnp.where(found, chosen, 0.0)


def noisy_margin(
    cosine: ArrayLike,
    *,
    margin: float = 0.2,
    cutoff: ArrayLike | None = 0.5,
    detach: bool = True,
) -> jax.Array:
    r"""The soft margin of each pseudo pair from its prediction cosine (Eq. 5).

    .. math::
      \alpha^n_i = \alpha\,\frac{m^{s_i} - 1}{m - 1}\ (m = 10),\qquad
      \alpha^n_i = 0 \text{ if } s_i < c \ (\text{the code's cutoff } c = 0.5)

    ``cutoff=None`` is the paper (no cutoff). ``detach=True`` (default; ncljax's choice, the
    paper does not say) makes the margin a constant, as every other margin; ``False`` lets its
    gradient reach the pseudo-classifier through :math:`s`, as the official code.

    Args:
      cosine: ``[Bn]`` :math:`s` (:func:`assign_pseudo_captions`).
      margin: :math:`\alpha` (0.2).
      cutoff: :math:`c` (0.5; a scalar array, e.g. :func:`calibrated_cutoff`) or ``None``.
      detach: ``stop_gradient`` on the margin.

    Returns:
      ``[Bn]`` margins in ``[0, margin]`` for ``s`` in ``[0, 1]``, for
      ``ncljax.losses.ranking.triplet_hardest(..., margin_of='positive')`` (or ``'caption'``,
      the code's indexing).

    References:
      Duan et al., ACM MM 2024, Sec. 4.3, Eq. 5; the cutoff and the undetached margin are
      the official code's (``pc2/model.py``, ``SGRAF.train``), which the paper does not
      mention.
    """
    cosine = _float(cosine)
    if detach:
        cosine = _SG(cosine)
    alpha = ranking.soft_margin(cosine, margin, kind="exponential")
    if cutoff is None:
        return alpha
    return jnp.where(cosine < cutoff, 0.0, alpha)


def chance_cosine(
    p_noisy: ArrayLike,
    p_clean: ArrayLike,
    *,
    where: ArrayLike | None = None,
    clean_where: ArrayLike | None = None,
    eps: float = 1e-8,
) -> jax.Array:
    r"""The mean prediction cosine of unrelated pairs: every noisy row against every clean one.

    .. math::
      \bar s = \frac{1}{|\mathcal N|\,|\mathcal C|}\sum_{i\in\mathcal N}\sum_{j\in\mathcal C}
        \frac{p_i^\top p_j}{\lVert p_i\rVert\,\lVert p_j\rVert}

    the cosine a noisy image's prediction has with a clean image's prediction by chance
    (about the share of classes two predictions share: near 0 for confident predictions
    spread over many classes, near 1 for flat or collapsed ones).

    Args:
      p_noisy: ``[Bn, K]`` the noisy images' predictions.
      p_clean: ``[Bc, K]`` the clean images' predictions.
      where: optional bool ``[Bn]`` of real noisy rows.
      clean_where: optional bool ``[Bc]`` of real clean rows.
      eps: floor of the norms (1e-8).

    Returns:
      scalar :math:`\bar s` (0 without a real pair on either side), no gradient.
    """
    p_noisy, p_clean = _SG(_float(p_noisy)), _SG(_float(p_clean))
    rows = jnp.ones(p_noisy.shape[0], bool) if where is None else jnp.asarray(where, bool)
    cols = (
        jnp.ones(p_clean.shape[0], bool) if clean_where is None else jnp.asarray(clean_where, bool)
    )

    def unit(p):
        return p / jnp.maximum(jnp.linalg.norm(p, axis=1, keepdims=True), eps)

    cosine = unit(p_noisy) @ unit(p_clean).T
    both = rows[:, None] & cols[None, :]
    return jnp.sum(jnp.where(both, cosine, 0.0)) / jnp.maximum(both.sum(), 1)


def calibrated_cutoff(cutoff: float, chance: ArrayLike) -> jax.Array:
    r"""Eq. 5's margin cutoff placed between the chance cosine and a perfect match.

    .. math::  c' = \bar s + c\,(1 - \bar s)

    replaces the code's absolute :math:`c = 0.5` (``calibration='data'``): the share
    ``c`` of the way from the cosine unrelated predictions have (:func:`chance_cosine`) to
    1. With confident predictions over many classes (:math:`\bar s \approx 0`) it is the
    code's 0.5; with flat or collapsed predictions, where every cosine is near 1 and the
    constant lets every pseudo pair through, it rises with them.

    Args:
      cutoff: :math:`c` in ``[0, 1]`` (0.5).
      chance: scalar :math:`\bar s`.

    Returns:
      scalar :math:`c'`.
    """
    chance = jnp.asarray(chance)
    return chance + cutoff * (1.0 - chance)


def gather_rows(tree: Any, index: ArrayLike) -> Any:
    """Rows ``index`` of every leaf of ``tree`` (a dict, tuple or array of per-caption arrays).

    Args:
      tree: a pytree whose leaves are ``[Bc, ...]`` arrays.
      index: int ``[Bn]`` in ``[0, Bc)`` (out-of-range values are clipped).

    Returns:
      ``tree`` with ``[Bn, ...]`` leaves; the gradient of a gathered row flows back to its
      source row (summed over the noisy images sharing it).
    """
    index = _index(index)
    return jax.tree.map(lambda a: jnp.take(jnp.asarray(a), index, axis=0, mode="clip"), tree)


def gather_pseudo_captions(
    words: ArrayLike, lengths: ArrayLike, index: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    r"""Each noisy image's pseudo-caption: the chosen clean caption's own features and length.

    :math:`T^p_i := T^c_{j(i)}`: the clean caption's contextual word features
    :math:`G^c_{j(i)}` (encoded with gradients) and its own length :math:`L^c_{j(i)}`, in the
    clean batch's static padding (Eq. 4's :math:`T^p_i = T^c_j`: the clean caption itself).
    The official code (``pc2/model.py``, ``SGRAF.train``) instead resamples the clean batch
    to the noisy batch's maximum length and truncates, which misaligns tokens when the two
    maxima differ.

    Args:
      words: ``[Bc, L, D]`` the clean batch's word features (zero past each length).
      lengths: int ``[Bc]`` the clean captions' lengths.
      index: int ``[Bn]`` :math:`j` (:func:`assign_pseudo_captions`).

    Returns:
      ``(words [Bn, L, D], lengths [Bn])``.

    References:
      Duan et al., ACM MM 2024, Sec. 4.3, Eq. 4.
    """
    words, lengths = jnp.asarray(words), jnp.asarray(lengths)
    if words.ndim != 3 or lengths.shape != words.shape[:1]:
        raise ValueError(
            f"words must be [Bc, L, D] and lengths [Bc], got {words.shape}, {lengths.shape}"
        )
    return gather_rows((words, lengths), index)
