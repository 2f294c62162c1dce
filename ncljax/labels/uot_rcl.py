"""UOT-RCL's label correction in one call: the six estimators of an epoch, composed.

UOT-RCL ("Robust Cross-modal Retrieval with Noisy Labels via Unbalanced Optimal
Transport"): before each main epoch the labels of every pair are corrected from the
model's embeddings and class scores: the confident set of each class (Sec. IV-A,
Eqs. 4-5: the two modalities' predictions agree, by Jensen-Shannon divergence), the
modal consistency with it (Eqs. 6-7), the momentum targets (Eq. 9), the nearest
neighbours' consistent cost (Sec. IV-B1, Eq. 8) and the partial OT of that cost to the
class marginal (Sec. IV-B2, Eqs. 10-15), whose rows are the corrected soft labels.
:func:`correct_labels` chains them as ``ncljax.methods.uot_rcl`` trains with them; each
step is its own function in ``ncljax.labels`` for research that changes one of them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ncljax.labels import correction, ot


class LabelCorrection(NamedTuple):
    """One epoch's correction.

    Attributes:
      labels: ``[N, K]`` the corrected soft labels ``Q`` (rows sum to the mass each pair
        was transported; a row above 1/2 is a pair the method trains on).
      targets_image: ``[N, K]`` the image side's momentum targets (Eq. 9), for the next
        epoch.
      targets_text: ``[N, K]`` the text side's.
      confident_set: the confident pairs of each class (``correction.ConfidentSet``).
      ot: the partial OT's output (``ot.PartialOTOutput``: plan, mass, convergence).
    """

    labels: jax.Array
    targets_image: jax.Array
    targets_text: jax.Array
    confident_set: correction.ConfidentSet
    ot: ot.PartialOTOutput


def _refuse_non_finite(**arrays: ArrayLike) -> None:
    """One error for an input holding NaN or inf, where the inputs are values (called
    eagerly; under ``jit`` they are traced and the caller checks them): a NaN row would be
    every row's nearest neighbour and vote its NaN into every corrected label."""
    for name, x in arrays.items():
        if isinstance(x, jax.core.Tracer):
            continue
        bad = int(jnp.sum(~jnp.isfinite(jnp.asarray(x))))
        if bad:
            raise ValueError(
                f"{name} holds {bad} NaN or infinite values: pass finite embeddings and "
                "logits (a model that diverged gives none)."
            )


def correct_labels(
    z_image: ArrayLike,
    z_text: ArrayLike,
    logits_image: ArrayLike,
    logits_text: ArrayLike,
    targets_image: ArrayLike,
    targets_text: ArrayLike,
    class_marginal: ArrayLike,
    *,
    mass: ArrayLike,
    key: jax.Array | None = None,
    per_class: int = 5,
    neighbours: int = 10,
    momentum: float = 0.99,
    epsilon: float = 0.05,
    corner: float | None = None,
    threshold: float = 1e-6,
    max_iterations: int = 5000,
    confident: str = "jsd",
    exclude_self: bool = True,
    vote_normalise: bool = True,
    knn_chunk: int = 2048,
    knn_key_chunk: int | None = None,
    knn: str = "exact",
    knn_block: int = 1024,
    knn_probes: int = 16,
) -> LabelCorrection:
    """UOT-RCL's label correction of ``N`` pairs over ``K`` classes (jittable).

    Args:
      z_image, z_text: ``[N, D]`` the pairs' embeddings.
      logits_image, logits_text: ``[N, K]`` their class logits.
      targets_image, targets_text: ``[N, K]`` the previous epoch's momentum targets (the
        one-hot observed labels at the start).
      class_marginal: ``[K]`` the classes' share of the transported mass (uniform, or
        the observed label frequencies).
      mass: the share of the pairs' mass transported this epoch (``ot.mass_schedule``).
      key: the random confident set's key (``confident='random'``, an ablation) and the
        approximate neighbour search's (``knn='blocks'``).
      per_class: confident pairs per class.
      neighbours: ``k`` of the nearest-neighbour votes.
      momentum: of the targets (Eq. 9).
      epsilon: the partial OT's entropic regularisation.
      corner: the cost of the dummies' corner of the partial OT (Eq. 14; None:
        ``ot.partial_ot_labels``' default).
      threshold, max_iterations: Sinkhorn's stopping rule.
      confident: ``'jsd'`` (the paper) or ``'random'``.
      exclude_self: a pair is not its own neighbour.
      vote_normalise: the votes as distributions over classes (else raw sums).
      knn_chunk: query rows per chunk of the exact nearest-neighbour search and of the
        nearest confident pair's (Eq. 7, ``correction.modal_consistency``).
      knn_key_chunk: candidate rows per chunk of it (``None``: all at once); with it the
        search's similarity block is ``knn_chunk x knn_key_chunk``, whatever ``N``.
      knn: ``'exact'`` (:func:`correction.knn_cosine`) or ``'blocks'``, the approximate
        search among nearby pairs (:func:`correction.knn_cosine_blocks`, ``knn_block``
        rows per block, ``knn_probes`` blocks searched by each) for large ``N``.

    Returns:
      The :class:`LabelCorrection`.
    """
    _refuse_non_finite(
        z_image=z_image, z_text=z_text, logits_image=logits_image, logits_text=logits_text
    )
    check_options(confident, knn, key)
    confident_set, new_image, new_text = confident_and_targets(
        logits_image,
        logits_text,
        targets_image,
        targets_text,
        key,
        per_class=per_class,
        confident=confident,
        momentum=momentum,
    )
    c_image, c_text = correction.modal_consistency(z_image, z_text, confident_set, chunk=knn_chunk)

    def search(z, side):
        if knn == "blocks":
            return correction.knn_cosine_blocks(
                z,
                k=neighbours,
                key=jax.random.fold_in(key, side),
                block=knn_block,
                probes=knn_probes,
                exclude_self=exclude_self,
            )
        return correction.knn_cosine(
            z, k=neighbours, chunk=knn_chunk, exclude_self=exclude_self, key_chunk=knn_key_chunk
        )

    result = transport_votes(
        c_image,
        c_text,
        correction.neighbour_vote(*search(z_image, 0), new_image),
        correction.neighbour_vote(*search(z_text, 1), new_text),
        class_marginal,
        mass,
        normalise=vote_normalise,
        epsilon=epsilon,
        corner=corner,
        threshold=threshold,
        max_iterations=max_iterations,
    )
    return LabelCorrection(result.labels, new_image, new_text, confident_set, result)


def confident_and_targets(
    logits_image, logits_text, targets_image, targets_text, key, *, per_class, confident, momentum
):
    """The first steps of :func:`correct_labels`: ``(confident set, new image targets, new
    text targets)`` from the class logits (Eqs. 4-5 and 9)."""
    logits_image, logits_text = jnp.asarray(logits_image), jnp.asarray(logits_text)
    p_image = jax.nn.softmax(logits_image, -1)
    p_text = jax.nn.softmax(logits_text, -1)
    num_samples, num_classes = p_image.shape
    if confident == "jsd":
        confident_set = correction.confident_set(p_image, p_text, per_class=per_class)
    else:
        confident_set = correction.random_confident_set(
            key, num_samples, num_classes=num_classes, per_class=per_class
        )
    # Eq. 9, before the cost: the prototype argmax of z_v + z_t is the argmax of the summed
    # logits (mu_k . z / tau_1 with tau_1 > 0).
    scores = logits_image + logits_text
    new_image = correction.update_targets(targets_image, scores, momentum=momentum)
    new_text = correction.update_targets(targets_text, scores, momentum=momentum)
    return confident_set, new_image, new_text


def transport_votes(
    c_image,
    c_text,
    vote_image,
    vote_text,
    class_marginal,
    mass,
    *,
    normalise,
    epsilon,
    corner,
    threshold,
    max_iterations,
) -> ot.PartialOTOutput:
    """The last steps of :func:`correct_labels`: the consistent cost from the neighbour
    votes (Eq. 8, ``correction.cost_from_votes``) and its partial OT (Eqs. 10-15)."""
    cost = correction.cost_from_votes(
        c_image, c_text, vote_image, vote_text, vote_floor=1e-8, shift=True, normalise=normalise
    )
    return ot.partial_ot_labels(
        cost,
        mass=mass,
        class_marginal=class_marginal,
        epsilon=epsilon,
        corner=corner,
        threshold=threshold,
        max_iterations=max_iterations,
    )


def check_options(confident: str, knn: str, key) -> None:
    """One error for an unknown confident set or neighbour search, or one without the key
    it draws with."""
    if confident not in ("jsd", "random"):
        raise ValueError(f"confident must be 'jsd' or 'random', got {confident!r}.")
    if confident == "random" and key is None:
        raise ValueError("confident='random' needs a key.")
    if knn not in ("exact", "blocks"):
        raise ValueError(f"knn must be 'exact' or 'blocks', got {knn!r}.")
    if knn == "blocks" and key is None:
        raise ValueError("knn='blocks' needs a key (its k-means draws rows and centroids).")
