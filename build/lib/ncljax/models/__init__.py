"""Flax NNX encoders, similarity heads and the retrieval model."""

from ncljax.models.encoders import GRUTextEncoder, MLPEncoder, RegionEncoder, l2_normalize
from ncljax.models.heads import Prototypes, PseudoClassifier, cosine_similarity
from ncljax.models.retrieval import RetrievalModel, build_model, input_fields

__all__ = [
    "GRUTextEncoder",
    "MLPEncoder",
    "Prototypes",
    "PseudoClassifier",
    "RegionEncoder",
    "RetrievalModel",
    "build_model",
    "cosine_similarity",
    "input_fields",
    "l2_normalize",
]
