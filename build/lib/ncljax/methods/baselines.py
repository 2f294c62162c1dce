"""Baselines without noise handling: VSE triplet, symmetric InfoNCE, prototype CE.

Each accepts ``num_networks=2`` to train two independently initialised networks side by
side (the dual-network code path of GSC/PC2 without any label exchange); evaluation then
averages their similarities. Each is a frozen settings type (``VSESettings``,
``InfoNCESettings``, ``CESettings``), its rules, one loss function and the registry
factory that binds them (:func:`vse`, :func:`infonce`, :func:`ce`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ncljax import losses
from ncljax.methods import base, settings


class VSESettings(NamedTuple):
    """Hinge triplet ranking (VSE++ with ``negatives='hardest'``, VSE0 with ``'sum'``).

    Attributes:
      margin: the ranking margin ``alpha`` (0.2).
      negatives: ``'hardest'`` (Faghri et al. 2018, Eq. 5) or ``'sum'`` over the batch.
      num_networks: 1, or 2 to train two networks side by side.
    """

    margin: float = 0.2
    negatives: str = "hardest"
    num_networks: int = 1


VSE_CHECKS = {
    "margin": settings.NON_NEGATIVE,
    "negatives": settings.one_of("hardest", "sum"),
    "num_networks": settings.NUM_NETWORKS,
}


class InfoNCESettings(NamedTuple):
    """Symmetric InfoNCE over the in-batch image-caption similarities (CLIP-style).

    Attributes:
      temperature: softmax temperature applied to the similarities (0.07).
      num_networks: 1, or 2 to train two networks side by side.
    """

    temperature: float = 0.07
    num_networks: int = 1


INFONCE_CHECKS = {"temperature": settings.POSITIVE, "num_networks": settings.NUM_NETWORKS}


class CESettings(NamedTuple):
    """Prototype cross-entropy on the observed (possibly noisy) labels (UOT-RCL Eq. 2).

    ``-(log p^v[y^v] + log p^t[y^t])`` per pair, with class posteriors from unit
    prototypes; needs ``model.classifier=True``. Logs the training accuracy of each
    modality against the observed labels.

    Attributes:
      num_networks: 1, or 2 to train two networks side by side.
    """

    num_networks: int = 1


CE_CHECKS = {"num_networks": settings.NUM_NETWORKS}

# The triplet loss of each choice of ``VSESettings.negatives``.
_TRIPLET = {"hardest": losses.triplet_hardest, "sum": losses.triplet_sum}


def vse_loss(s: VSESettings, outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """The hinge triplet loss ``[B]`` of the batch's similarities ``outputs['sim']``
    (``ncljax.losses.triplet_hardest`` or ``triplet_sum``, margin ``s.margin``)."""
    del rows, peer_rows, ctx
    return _TRIPLET[s.negatives](outputs["sim"], s.margin, where=batch["mask"]), base.Aux()


def infonce_loss(
    s: InfoNCESettings, outputs, batch, rows, peer_rows, ctx
) -> tuple[jax.Array, base.Aux]:
    """The symmetric InfoNCE ``[B]`` of ``outputs['sim'] / s.temperature``
    (``ncljax.losses.symmetric_info_nce``)."""
    del rows, peer_rows, ctx
    loss = losses.symmetric_info_nce(outputs["sim"], temperature=s.temperature, where=batch["mask"])
    return loss, base.Aux()


def _accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return (logits.argmax(-1) == labels).astype(jnp.float32)


def ce_loss(outputs, batch, rows, peer_rows, ctx) -> tuple[jax.Array, base.Aux]:
    """``-(log p^v[y^v] + log p^t[y^t])`` ``[B]`` on the observed labels, with the
    training accuracy of each modality (``acc_image``, ``acc_text``) as metrics.

    Raises:
      ValueError: where the model has no class logits (``model.classifier=False``).
    """
    del rows, peer_rows, ctx
    if "image_logits" not in outputs:
        raise ValueError("Method 'ce' needs class logits: set model.classifier=True.")
    num_classes = outputs["image_logits"].shape[-1]
    labels_image = jax.nn.one_hot(batch["label_image"], num_classes)
    labels_text = jax.nn.one_hot(batch["label_text"], num_classes)
    loss = losses.soft_cross_entropy(
        outputs["image_logits"], labels_image
    ) + losses.soft_cross_entropy(outputs["text_logits"], labels_text)
    metrics = {
        "acc_image": _accuracy(outputs["image_logits"], batch["label_image"]),
        "acc_text": _accuracy(outputs["text_logits"], batch["label_text"]),
    }
    return loss, base.Aux(metrics=metrics)


def _bundle(name: str, loss_fn: Callable, s) -> base.Method:
    """A baseline's bundle: one loss, no per-sample memory, ``s.num_networks`` networks."""
    return base.Method(
        name=name,
        init_memory=base.empty_memory,
        loss_fn=loss_fn,
        num_networks=s.num_networks,
        settings=s,
    )


def bind_vse(s: VSESettings) -> base.Method:
    """VSE's bundle with the settings ``s`` bound."""
    return _bundle("vse", functools.partial(vse_loss, s), s)


def bind_infonce(s: InfoNCESettings) -> base.Method:
    """InfoNCE's bundle with the settings ``s`` bound."""
    return _bundle("infonce", functools.partial(infonce_loss, s), s)


def bind_ce(s: CESettings) -> base.Method:
    """CE's bundle (the loss reads no setting)."""
    return _bundle("ce", ce_loss, s)


vse = settings.factory("vse", VSESettings, VSE_CHECKS, bind_vse)
infonce = settings.factory("infonce", InfoNCESettings, INFONCE_CHECKS, bind_infonce)
ce = settings.factory("ce", CESettings, CE_CHECKS, bind_ce, family="labels")
