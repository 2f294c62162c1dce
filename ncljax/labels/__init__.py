"""Correspondence and label estimators (pure JAX, jittable)."""

from ncljax.labels.correction import (
    ConfidentSet,
    confident_set,
    consistent_cost,
    jensen_shannon,
    jensen_shannon_pairwise,
    knn_cosine,
    modal_consistency,
    random_confident_set,
    relation_scores,
    update_targets,
)
from ncljax.labels.gmm import (
    GaussianMixture1D,
    fit_gmm_1d,
    gmm_posteriors,
    high_mean_posterior,
    low_mean_posterior,
    minmax_normalize,
)
from ncljax.labels.gsc import (
    GSCLabels,
    ema_update,
    gsc_cross_modal_indicator,
    gsc_intra_modal_indicator,
    gsc_intra_modal_score,
    gsc_update_labels,
)
from ncljax.labels.ncr import (
    LossDivision,
    correspondence_prediction,
    loss_division,
    rectified_labels,
    split_clean,
)
from ncljax.labels.ot import (
    PartialOTOutput,
    RelationPlan,
    mass_schedule,
    partial_ot_labels,
    relation_plan,
)

__all__ = [
    "ConfidentSet",
    "GSCLabels",
    "GaussianMixture1D",
    "LossDivision",
    "PartialOTOutput",
    "RelationPlan",
    "confident_set",
    "consistent_cost",
    "correspondence_prediction",
    "ema_update",
    "fit_gmm_1d",
    "gmm_posteriors",
    "gsc_cross_modal_indicator",
    "gsc_intra_modal_indicator",
    "gsc_intra_modal_score",
    "gsc_update_labels",
    "high_mean_posterior",
    "jensen_shannon",
    "jensen_shannon_pairwise",
    "knn_cosine",
    "loss_division",
    "low_mean_posterior",
    "mass_schedule",
    "minmax_normalize",
    "modal_consistency",
    "partial_ot_labels",
    "random_confident_set",
    "rectified_labels",
    "relation_plan",
    "relation_scores",
    "split_clean",
    "update_targets",
]
