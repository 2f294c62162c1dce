"""Reading the prepared Flickr30K, MS-COCO, CC152K and NoW ("precomp") benchmarks.

The released files are put in ``data.manual_dir`` once: their layouts, and where they
are published, are in ``ncljax.data.layouts_precomp`` (and each builder's
``MANUAL_DOWNLOAD_INSTRUCTIONS``). The first run checks them and prepares two TFDS
datasets per benchmark in ``data.data_dir``, images and captions
(``ncljax.data.builders``); later runs read them with ``as_data_source`` by random
access, and nothing is loaded whole into memory.

Nothing is silently truncated: ``data.max_length`` is the padded caption length (0:
the longest caption) and a shorter positive value is an error. Validation uses the
first ``data.val_images`` images of ``dev`` and their captions (NCR: 1000 images for
Flickr30K and MS-COCO).

A wrong vocabulary does not go unnoticed: a split whose caption words are all ``<unk>`` is
refused when prepared, and one where more than ``vocab.UNK_WARNING_FRACTION`` (5%) of
them are is warned about, naming the vocabulary file, each time the data is opened.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ncljax.data import builders, prepared, sources
from ncljax.data import vocab as vocab_lib
from ncljax.data.layouts_precomp import NUM_REGIONS, RELEASES, TOKENIZERS, Release, locate

BUILDERS = builders.PRECOMP
# The builder classes by name, for callers that name one.
F30kPrecomp = BUILDERS["f30k"]
CocoPrecomp = BUILDERS["coco"]
Cc152kPrecomp = BUILDERS["cc152k"]
Now100kPrecomp = BUILDERS["now"]


class PrecompSplit:
    """One split of a prepared precomp dataset; implements ``sources.SplitSource``.

    Args:
      images, captions: the records of the split (``prepared.SplitRecords``).
      num_images: images exposed (the first ``num_images`` of the prepared split).
      captions_per_image: captions per image.
      max_length: padded caption length.
      name: for error messages.
    """

    def __init__(self, images, captions, num_images, captions_per_image, max_length, name):
        self._images, self._captions = images, captions
        self._max_length, self._name = max_length, name
        self.num_images = num_images
        self.captions_per_image = captions_per_image
        self.num_captions = num_images * captions_per_image

    def _check(self, index: int, size: int, what: str, fields, known) -> None:
        if not 0 <= index < size:
            raise IndexError(f"{self._name}: {what} index {index} out of range [0, {size}).")
        unknown = set(fields) - set(known)
        if unknown:
            raise ValueError(
                f"{self._name} has no {what} fields {sorted(unknown)}, only {list(known)} "
                "(precomp data has region features and token ids; set model.image_input="
                "'regions' and model.text_input='tokens')."
            )

    def image(self, index: int, fields: Sequence[str] = ("regions",)) -> dict:
        """Image ``index``: ``regions`` float32 ``[36, D]`` if asked, and ``label`` -1."""
        index = int(index)
        self._check(index, self.num_images, "image", fields, ("regions",))
        out = {"label": np.int64(-1)}
        if "regions" in fields:
            out["regions"] = np.asarray(self._images[index]["regions"], np.float32)
        return out

    def caption(self, index: int, fields: Sequence[str] = ("tokens", "length")) -> dict:
        """Caption ``index``: ``tokens`` int32 ``[max_length]`` zero-padded, ``length``."""
        index = int(index)
        self._check(index, self.num_captions, "caption", fields, ("tokens", "length"))
        out = {"label": np.int64(-1)}
        if "tokens" in fields or "length" in fields:
            tokens = np.asarray(self._captions[index]["tokens"], np.int32)
            padded = np.zeros(self._max_length, np.int32)
            padded[: tokens.size] = tokens
            out["tokens"] = padded
            out["length"] = np.int32(tokens.size)
        return out

    def caption_lengths(self) -> np.ndarray:
        """Token counts (with ``<start>`` and ``<end>``) read from the caption records."""
        return np.array(
            [len(self._captions[k]["tokens"]) for k in range(self.num_captions)], np.int32
        )

    def image_labels(self) -> np.ndarray:
        """No category labels: ``-1`` for every image."""
        return np.full(self.num_images, -1, np.int64)


def _check_config(cfg, release: Release) -> str:
    """Checks the ``data`` section; returns the tokenizer (``''`` unless NoW)."""
    tokenizer = cfg.tokenizer if release.captions == "ids" else ""
    if release.captions == "ids" and tokenizer not in TOKENIZERS:
        raise ValueError(f"data.tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}.")
    for field, low in (("max_length", 0), ("val_images", 0), ("vocab_threshold", 1)):
        if cfg[field] < low:
            raise ValueError(f"data.{field} must be at least {low}, got {cfg[field]}.")
    return tokenizer


def _check_vocab(cfg, meta, captions_dir: str) -> None:
    built_with = meta["vocab_threshold"]
    if built_with and built_with != cfg.vocab_threshold:
        raise ValueError(
            f"The prepared captions in {captions_dir} use a vocabulary built with threshold "
            f"{built_with} (no vocabulary file was given), but data.vocab_threshold="
            f"{cfg.vocab_threshold}. Set data.vocab_threshold={built_with}, or delete "
            f"{captions_dir} to prepare them again."
        )


def _resolve_max_length(cfg, meta, name: str) -> int:
    split, longest = max(meta["max_length"].items(), key=lambda item: item[1])
    if cfg.max_length and cfg.max_length < longest:
        raise ValueError(
            f"data.max_length={cfg.max_length} is shorter than the longest caption of {name} "
            f"({longest} tokens with <start> and <end>, in split {split}); set "
            f"data.max_length={longest} or 0 (the longest caption). Captions are never "
            "truncated."
        )
    return cfg.max_length or longest


def prepare(cfg) -> tuple[dict, dict, dict, dict]:
    """Prepares benchmark ``cfg.name`` if needed (both configs) and checks the result.

    Returns:
      The ``images`` and ``captions`` sources (``{split: source}``) and their metadata.
    """
    release = RELEASES[cfg.name]
    tokenizer = _check_config(cfg, release)
    manual = prepared.manual_dir(cfg, release.name)
    configs = ("images_float16" if cfg.float16 else "images",)
    configs += (f"captions_{tokenizer}" if tokenizer else "captions",)
    tfds_builders = [
        BUILDERS[release.name](
            config=config,
            data_dir=prepared.data_dir(cfg),
            file_format="array_record",
            vocab_threshold=cfg.vocab_threshold,
        )
        for config in configs
    ]
    if not all(b.is_prepared() for b in tfds_builders):
        locate(release, manual, tokenizer)  # fail before any slow preparation
    # The captions first: preparing them reads the image files' headers and every caption,
    # so a malformed file fails in seconds, not after the images (up to tens of GB) are written.
    caption_sources = prepared.prepare(tfds_builders[1], manual)
    image_sources = prepared.prepare(tfds_builders[0], manual)
    image_meta, caption_meta = (b.info.metadata for b in tfds_builders)
    if dict(image_meta["num_images"]) != dict(caption_meta["num_images"]):
        raise ValueError(
            f"The prepared images ({tfds_builders[0].data_dir}) and captions "
            f"({tfds_builders[1].data_dir}) of {release.name} have different numbers of images "
            f"({dict(image_meta['num_images'])} vs {dict(caption_meta['num_images'])}): "
            "they were prepared from different files. Delete both and prepare again."
        )
    _check_vocab(cfg, caption_meta, os.fspath(tfds_builders[1].data_dir))
    return image_sources, caption_sources, image_meta, caption_meta


def _num_images(cfg, split: str, prepared_images: int) -> int:
    """Images of ``split`` exposed: validation keeps the first ``data.val_images``."""
    if split != "val" or not cfg.val_images:
        return prepared_images
    if cfg.val_images > prepared_images:
        raise ValueError(
            f"data.val_images={cfg.val_images} exceeds the {prepared_images} images of "
            f"{cfg.name}'s dev split; set it to at most {prepared_images} (0: all)."
        )
    return cfg.val_images


def size_hint(cfg, split: str, needed: int) -> str:
    """What sizes ``split`` (see ``sources.size_hint``): ``data.val_images`` for validation,
    otherwise the released files."""
    if split == "val" and cfg.val_images:
        return f"set data.val_images (now {cfg.val_images}) to at least {needed} (0: all of dev)"
    images = "all the dev images" if split == "val" else "the test images"
    return (
        f"the {split} split is {images} of the release in data.manual_dir "
        f"({cfg.manual_dir or 'the default'}); put the full release there"
    )


class PrecompDataset:
    """A prepared precomp benchmark; implements ``sources.Dataset``.

    Prepares the TFDS datasets from ``data.manual_dir`` on first use (see the module
    docstring), then reads them by random access.

    Args:
      cfg: the ``data`` config section (see ``default_config``).
    """

    def __init__(self, cfg):
        release = RELEASES[cfg.name]
        image_sources, caption_sources, _, caption_meta = prepare(cfg)
        self._caption_meta = caption_meta
        if "unknown_words" in caption_meta:  # recorded since the <unk> check
            source = caption_meta.get("vocab_file") or caption_meta["vocab_source"]
            vocab_lib.check_unknown(dict(caption_meta["unknown_words"]), source)
        max_length = _resolve_max_length(cfg, caption_meta, release.name)
        cpi = release.captions_per_image
        self._splits = {
            split: PrecompSplit(
                image_sources[split],
                caption_sources[split],
                _num_images(cfg, split, caption_meta["num_images"][split]),
                cpi,
                max_length,
                f"{release.name}/{split}",
            )
            for split in sources.SPLITS
        }
        self.info = sources.DatasetInfo(
            name=release.name,
            captions_per_image=cpi,
            num_classes=0,
            vocab_size=int(caption_meta["vocab_size"]),
            max_length=max_length,
            num_regions=NUM_REGIONS,
            region_dim=release.region_dim,
            image_dim=0,
            text_dim=0,
            split_sizes={k: (s.num_images, s.num_captions) for k, s in self._splits.items()},
        )

    def split(self, name: str) -> PrecompSplit:
        if name not in self._splits:
            raise ValueError(f"Unknown split {name!r}; {self.info.name} has {list(self._splits)}.")
        return self._splits[name]

    def vocabulary(self) -> vocab_lib.Vocabulary:
        """The vocabulary the captions were encoded with (recorded with the prepared data)."""
        meta = self._caption_meta
        return vocab_lib.Vocabulary(
            dict(meta["vocab"]), int(meta["vocab_size"]), meta["vocab_source"]
        )


for _name in RELEASES:
    sources.register(_name)(PrecompDataset)


def default_config(name: str):
    """The ``data`` config section of precomp benchmark ``name`` (f30k, coco, cc152k, now).

    Fields: ``name``; ``manual_dir`` (the released files; default
    ``<data_dir>/downloads/manual/<name>``); ``data_dir`` (prepared data; default
    ``~/tensorflow_datasets``); ``float16`` (store regions as float16: half the disk,
    float16 precision); ``max_length`` (padded caption length, 0: the longest caption);
    ``vocab_threshold`` (when no vocabulary file is given); ``tokenizer`` (NoW's caption
    files: bpe, bert or jieba; default jieba, PC2's main table); ``val_images`` (validation
    images, the first of ``dev``; 0: all; default 1000 on Flickr30K and MS-COCO as in NCR,
    0 on CC152K and NoW, whose dev splits are validated whole).
    """
    import ml_collections

    if name not in RELEASES:
        raise ValueError(f"Unknown precomp dataset {name!r}; known: {sorted(RELEASES)}.")
    release = RELEASES[name]
    return ml_collections.ConfigDict(
        dict(
            name=name,
            manual_dir="",
            data_dir="",
            float16=False,
            max_length=0,
            vocab_threshold=4,
            tokenizer="jieba" if release.captions == "ids" else "",
            val_images=release.val_images,
        )
    )
