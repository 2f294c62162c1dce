"""The random-access interface every dataset implements, and the dataset registry.

A dataset has splits (``train``, ``val``, ``test``). Each split is a ``SplitSource``:
random access to images by image index and to captions by caption index, with
caption ``k`` describing image ``k // captions_per_image``. Noise is not part of a
source: the pipeline pairs caption ``k`` with image ``noise.image_index[k]`` and
replaces labels with observed labels (see ``ncljax.data.noise``).

Image examples carry ``regions`` ``[R, D]`` and/or ``global_image`` ``[D_img]``;
caption examples carry ``tokens`` ``[L]`` with ``length`` and/or ``global_text``
``[D_txt]``; both carry ``label`` (an int class id, ``-1`` when unknown).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

SPLITS = ("train", "val", "test")
IMAGE_FIELDS = ("regions", "global_image")
TEXT_FIELDS = ("tokens", "length", "global_text")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """Static facts about a dataset that models and methods are built from.

    Attributes:
      name: registry name.
      captions_per_image: captions per image in every split (5 for Flickr30K/COCO, 1 otherwise).
      num_classes: number of category labels (0 when the dataset has none).
      vocab_size: size of the token vocabulary (0 when there are no tokens).
      max_length: padded caption length ``L`` (tokens include ``<start>`` and ``<end>``).
      num_regions: regions per image ``R`` (0 when there are no region features).
      region_dim: region feature size ``D``.
      image_dim: global image feature size (0 when absent).
      text_dim: global text feature size (0 when absent).
      split_sizes: ``{split: (num_images, num_captions)}``.
    """

    name: str
    captions_per_image: int
    num_classes: int
    vocab_size: int
    max_length: int
    num_regions: int
    region_dim: int
    image_dim: int
    text_dim: int
    split_sizes: dict[str, tuple[int, int]]


class SplitSource(Protocol):
    """Random access to one split of a dataset."""

    num_images: int
    num_captions: int
    captions_per_image: int

    def image(self, index: int, fields: Sequence[str]) -> dict[str, np.ndarray]:
        """Image ``index`` with the requested fields and ``label``."""
        ...

    def caption(self, index: int, fields: Sequence[str]) -> dict[str, np.ndarray]:
        """Caption ``index`` with the requested fields and ``label``."""
        ...

    def image_labels(self) -> np.ndarray:
        """True class labels of all images, int64 ``[num_images]`` (``-1`` if unknown)."""
        ...

    def caption_lengths(self) -> np.ndarray:
        """Token count of every caption, int ``[num_captions]`` (token datasets only)."""
        ...


class Dataset(Protocol):
    info: DatasetInfo

    def split(self, name: str) -> SplitSource: ...


_REGISTRY: dict[str, Callable[..., Dataset]] = {}
# Datasets whose module is imported on first use (TFDS and h5py load only when needed).
_MODULES = {
    "synthetic": "ncljax.data.synthetic",
    "f30k": "ncljax.data.precomp",
    "coco": "ncljax.data.precomp",
    "cc152k": "ncljax.data.precomp",
    "now": "ncljax.data.precomp",
    "wiki": "ncljax.data.labelled",
    "nuswide": "ncljax.data.labelled",
    "xmedianet": "ncljax.data.labelled",
    "inria": "ncljax.data.labelled",
    "vectors": "ncljax.data.vectors",
}


def register(name: str):
    """Registers a dataset constructor ``fn(data_config) -> Dataset`` under ``name``."""

    def wrap(fn):
        _REGISTRY[name] = fn
        return fn

    return wrap


DATASETS = tuple(_MODULES)


def default_config(name: str):
    """The ``data`` config section of dataset ``name`` with that dataset's defaults.

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if name not in _MODULES:
        raise ValueError(f"Unknown dataset {name!r} (config field data.name); known: {DATASETS}.")
    module = importlib.import_module(_MODULES[name])
    return module.default_config() if name == "synthetic" else module.default_config(name)


def size_hint(data_config, split: str, needed: int) -> str:
    """What to change so that ``split`` of dataset ``data_config.name`` holds at least
    ``needed`` images: the config field that sets its size (e.g. ``'set data.num_val to at
    least 11'``), or the files it comes from. A dataset module may define
    ``size_hint(data_config, split, needed)``; otherwise the hint is generic."""
    name = data_config.name
    if name in _MODULES:
        hint = getattr(importlib.import_module(_MODULES[name]), "size_hint", None)
        if hint is not None:
            return hint(data_config, split, needed)
    return f"give dataset {name!r} a {split} split of at least {needed} images"


def load_dataset(data_config) -> Dataset:
    """Builds the dataset named ``data_config.name``.

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    name = data_config.name
    if name not in _REGISTRY and name in _MODULES:
        importlib.import_module(_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown dataset {name!r} (config field data.name). Known datasets: "
            f"{sorted(set(_REGISTRY) | set(_MODULES))}."
        )
    return _REGISTRY[name](data_config)
