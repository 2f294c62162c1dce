"""Baselines without noise handling: VSE triplet, symmetric InfoNCE, prototype CE.

Each accepts ``num_networks=2`` to train two independently initialised networks side by
side (the dual-network code path of GSC/PC2 without any label exchange); evaluation then
averages their similarities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ncljax import losses
from ncljax.methods import base, settings


def vse(*, margin: float = 0.2, negatives: str = "hardest", num_networks: int = 1) -> base.Method:
    """Hinge triplet ranking (VSE++ with ``negatives='hardest'``, VSE0 with ``'sum'``).

    Args:
      margin: the ranking margin ``alpha``.
      negatives: ``'hardest'`` (Faghri et al. 2018, Eq. 5) or ``'sum'`` over the batch.
      num_networks: 1, or 2 to train two networks side by side.
    """
    settings.check(
        "vse",
        locals(),
        {
            "margin": settings.NON_NEGATIVE,
            "negatives": settings.one_of("hardest", "sum"),
            "num_networks": settings.NUM_NETWORKS,
        },
    )
    triplet = {"hardest": losses.triplet_hardest, "sum": losses.triplet_sum}
    triplet_fn = triplet[negatives]

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        del rows, peer_rows, ctx
        return triplet_fn(outputs["sim"], margin, where=batch["mask"]), {}

    return base.Method(
        name="vse", init_memory=base.empty_memory, loss_fn=loss_fn, num_networks=num_networks
    )


def infonce(*, temperature: float = 0.07, num_networks: int = 1) -> base.Method:
    """Symmetric InfoNCE over the in-batch image-caption similarities (CLIP-style).

    Args:
      temperature: softmax temperature applied to the similarities.
      num_networks: 1, or 2 to train two networks side by side.
    """
    settings.check(
        "infonce",
        locals(),
        {"temperature": settings.POSITIVE, "num_networks": settings.NUM_NETWORKS},
    )

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
        del rows, peer_rows, ctx
        loss = losses.symmetric_info_nce(
            outputs["sim"], temperature=temperature, where=batch["mask"]
        )
        return loss, {}

    return base.Method(
        name="infonce", init_memory=base.empty_memory, loss_fn=loss_fn, num_networks=num_networks
    )


def ce(*, num_networks: int = 1) -> base.Method:
    """Prototype cross-entropy on the observed (possibly noisy) labels (UOT-RCL Eq. 2).

    ``-(log p^v[y^v] + log p^t[y^t])`` per pair, with class posteriors from unit
    prototypes; needs ``model.classifier=True``. Logs the training accuracy of each
    modality against the observed labels.

    Args:
      num_networks: 1, or 2 to train two networks side by side.
    """
    settings.check("ce", locals(), {"num_networks": settings.NUM_NETWORKS})

    def loss_fn(outputs, batch, rows, peer_rows, ctx):
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
            "acc_image": (outputs["image_logits"].argmax(-1) == batch["label_image"]).astype(
                jnp.float32
            ),
            "acc_text": (outputs["text_logits"].argmax(-1) == batch["label_text"]).astype(
                jnp.float32
            ),
        }
        return loss, {"metrics": metrics}

    return base.Method(
        name="ce", init_memory=base.empty_memory, loss_fn=loss_fn, num_networks=num_networks
    )
