"""Per-example objectives: a loss never reduces the batch.

The rule: a loss of one term returns ``[B]`` (one value per pair or row); an objective of
several terms returns ``([B] total, its terms)`` (``ugncl_loss``: a NamedTuple of ``[B]``;
likewise ``ncljax.methods.srem.srem_loss`` and ``ncljax.methods.uot_rcl.uot_rcl_loss``,
which compose estimators and so live with their methods). Each takes a ``where`` mask of
the real rows where the batch may be padded.
"""

from ncljax.losses.classification import (
    prototype_cross_entropy,
    prototype_logits,
    soft_cross_entropy,
)
from ncljax.losses.contrastive import info_nce, info_nce_directions, symmetric_info_nce
from ncljax.losses.evidential import (
    UGNCLTerms,
    edl_loss,
    top_k_mean,
    trl_warmup_loss,
    trusted_contrastive_loss,
    trusted_robust_loss,
    ugncl_loss,
)
from ncljax.losses.pseudo import (
    prediction_entropy_loss,
    pseudo_classification_loss,
    pseudo_label_cross_entropy,
)
from ncljax.losses.ranking import (
    hinge_costs,
    soft_margin,
    triplet_hardest,
    triplet_mean,
    triplet_sum,
)
from ncljax.losses.srem import (
    complementary_loss,
    energy_bounded_loss,
    weighted_hinge_loss,
)
from ncljax.losses.structure import (
    gsc_cross_modal_loss,
    gsc_intra_modal_loss,
    gsc_loss,
    mask_structures,
)

__all__ = [
    "UGNCLTerms",
    "complementary_loss",
    "edl_loss",
    "energy_bounded_loss",
    "gsc_cross_modal_loss",
    "gsc_intra_modal_loss",
    "gsc_loss",
    "hinge_costs",
    "info_nce",
    "info_nce_directions",
    "mask_structures",
    "prediction_entropy_loss",
    "prototype_cross_entropy",
    "prototype_logits",
    "pseudo_classification_loss",
    "pseudo_label_cross_entropy",
    "soft_cross_entropy",
    "soft_margin",
    "symmetric_info_nce",
    "top_k_mean",
    "triplet_hardest",
    "triplet_mean",
    "triplet_sum",
    "trl_warmup_loss",
    "trusted_contrastive_loss",
    "trusted_robust_loss",
    "ugncl_loss",
    "weighted_hinge_loss",
]
