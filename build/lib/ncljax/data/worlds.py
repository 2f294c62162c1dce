"""A zoo of synthetic worlds: named presets of the embedded generator that vary what real
data varies, so that a method is checked on data nobody tuned it on.

A world changes only the data (the generator's sizes and structure, the inputs the model
reads: region features and tokens, or global feature vectors) and the batch size; the
method's hyperparameters stay those of its config file. Select one with the config
file's argument: ``--config=configs/ncr.py:synthetic,world=small_global``. Every config
file that takes ``:synthetic`` takes ``world=``; the world must fit the file's problem
(``pairs``: noisy correspondence, Recall@K; ``labels``: noisy labels, mAP).

Global-vector worlds give the cosine head MLP encoders (one hidden layer of 512, 128-d
embeddings), as a researcher's own embeddings would be trained; region/token worlds keep
the synthetic preset's region encoder and Bi-GRU.

``ncljax.config.presets.apply_world`` puts a world into a config; ``python -m
ncljax.report`` runs methods x worlds x noise rates x seeds and tabulates them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

PAIRS, LABELS = "pairs", "labels"


@dataclasses.dataclass(frozen=True)
class World:
    """One synthetic world.

    Attributes:
      doc: what the world is, in one line.
      family: ``'pairs'`` (noisy correspondence) or ``'labels'`` (noisy labels).
      inputs: ``'regions'`` (region features and tokens) or ``'global'`` (feature vectors).
      batch_size: the training batch.
      data: ``data.*`` fields of the synthetic generator that differ from the preset's.
    """

    doc: str
    family: str
    inputs: str
    batch_size: int
    data: Mapping[str, object] = dataclasses.field(default_factory=dict)


# Global vectors of an off-the-shelf encoder carry the instance: the image vector pools
# the concept regions only (no background clutter), one noun per concept.
_EMBEDDINGS = dict(num_regions=4, synonyms=1)


def _world(doc, family, inputs, batch_size, **data) -> World:
    return World(doc, family, inputs, batch_size, MappingProxyType(data))


WORLDS: Mapping[str, World] = MappingProxyType(
    {
        # Noisy correspondence (Recall@K).
        "default": _world(
            "the preset: 4,000 images x 5 captions (20,000 pairs), regions and tokens, batch 128",
            PAIRS,
            "regions",
            128,
        ),
        "small_global": _world(
            "1,500 images x 1 caption, global vectors through MLPs, batch 100 (a small real "
            "dataset of off-the-shelf embeddings)",
            PAIRS,
            "global",
            100,
            num_train=1500,
            num_val=200,
            num_test=500,
            captions_per_image=1,
            **_EMBEDDINGS,
        ),
        "few_regions": _world(
            "400 images x 5 captions (2,000 pairs), regions and tokens, batch 32",
            PAIRS,
            "regions",
            32,
            num_train=400,
            num_val=100,
            num_test=200,
        ),
        "large_global": _world(
            "5,000 images x 5 captions (25,000 pairs), global vectors, batch 256",
            PAIRS,
            "global",
            256,
            num_train=5000,
            num_val=200,
            num_test=500,
            **_EMBEDDINGS,
        ),
        "weak_classes": _world(
            "2,000 images x 2 captions with almost no class structure (purity 0.1), regions "
            "and tokens, batch 64",
            PAIRS,
            "regions",
            64,
            num_train=2000,
            num_val=200,
            num_test=500,
            captions_per_image=2,
            class_purity=0.1,
        ),
        "strong_classes": _world(
            "2,000 images x 1 caption in 10 tight classes (every concept from a 6-concept "
            "core: many near-duplicates, hard negatives), global vectors, batch 64",
            PAIRS,
            "global",
            64,
            num_train=2000,
            num_val=200,
            num_test=500,
            captions_per_image=1,
            class_purity=1.0,
            core_concepts=6,
            **_EMBEDDINGS,
        ),
        "blurred": _world(
            "3,000 images x 1 caption, 256-d features with heavy feature noise and few "
            "mentions (compressed similarities), global vectors, batch 256",
            PAIRS,
            "global",
            256,
            num_train=3000,
            num_val=200,
            num_test=500,
            captions_per_image=1,
            region_dim=128,
            image_dim=256,
            text_dim=256,
            region_noise=0.9,
            global_noise=0.3,
            attribute_weight=0.4,
            mention_prob=0.6,
            **_EMBEDDINGS,
        ),
        # Noisy labels (mAP).
        "labels_default": _world(
            "the labels preset: 10,000 pairs, 10 classes (purity 0.9), global vectors, batch 100",
            LABELS,
            "global",
            100,
        ),
        "labels_small": _world(
            "2,000 pairs, 10 classes, global vectors, batch 48",
            LABELS,
            "global",
            48,
            num_train=2000,
            num_val=300,
            num_test=500,
        ),
        "labels_many_classes": _world(
            "10,000 pairs in 30 classes of 6-concept cores, global vectors, batch 200",
            LABELS,
            "global",
            200,
            num_classes=30,
            core_concepts=6,
        ),
        "labels_weak": _world(
            "10,000 pairs, 10 loose classes (purity 0.6), global vectors, batch 100",
            LABELS,
            "global",
            100,
            class_purity=0.6,
        ),
    }
)


def names(family: str | None = None) -> tuple[str, ...]:
    """The worlds' names, of one family if given."""
    return tuple(n for n, w in WORLDS.items() if family in (None, w.family))


def describe(family: str | None = None) -> str:
    """One line per world: its name and what it is."""
    return "\n".join(f"{n}: {WORLDS[n].doc}" for n in names(family))


def get(name: str) -> World:
    if name not in WORLDS:
        raise ValueError(f"Unknown world {name!r}. The synthetic worlds are:\n{describe()}")
    return WORLDS[name]
