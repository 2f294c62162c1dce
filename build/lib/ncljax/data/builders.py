"""The TFDS builders of the real benchmarks, one class per dataset, generated from a table.

A dataset's builder differs from the others of its family only in class attributes (its
release, TFDS name, configs and instructions), so the classes are made from the rows of
``_PRECOMP`` and ``_LABELLED`` with the release tables of ``ncljax.data.layouts_precomp``
and ``ncljax.data.layouts_labelled``, which also read and check the released files.
Every builder writes its splits to ArrayRecord in index order (``ncljax.data.prepared``)
under ``<data_dir>/<TFDS name>/<config>/1.0.0``; ``ncljax.data.precomp`` and
``ncljax.data.labelled`` read them.

Precomp benchmarks (TFDS name: the released folder, e.g. ``f30k_precomp``; registered
with TFDS) are prepared as two TFDS datasets each:

* config ``images`` (or ``images_float16``): ``regions`` ``[36, D]`` and ``index``;
* config ``captions`` (NoW: ``captions_{tokenizer}``): ``tokens`` (variable length,
  ``<start> ... <end>``), ``image_index`` and ``index``,

so reading a caption never decodes an image. Preparation reads one image at a time and
needs no TensorFlow; its memory peaks at about 1.1 GB (TFDS's in-memory sort buffer),
whatever the size of the split. Regions are stored as raw float32 (or float16: half the
disk) bytes, which ArrayRecord compresses. A vocabulary built from the training captions
is recorded with the prepared captions.

Labelled datasets (TFDS name: the registry name, e.g. ``wiki``; not registered with
TFDS) are prepared as one TFDS dataset per split rule, validation size and precision
(config ``test_head_231_float32``, ``given_float32``, ...). An example is a pair:
``global_image [d_img]`` and ``global_text [d_txt]`` (float32, or float16),
``label_image``, ``label_text`` and ``index`` (int64; the record's position in its
split). Preparation needs no TensorFlow as long as each split fits TFDS's 1 GB in-memory
sort buffer; all four releases do (NUS-WIDE's training split, the largest, is ~0.76 GB).
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from ncljax.data import layouts_labelled, layouts_precomp, prepared
from ncljax.data import vocab as vocab_lib
from ncljax.data.sources import SPLITS

# ---------------------------------------------------------------- precomp benchmarks


@dataclasses.dataclass(eq=False)
class PrecompConfig(tfds.core.BuilderConfig):
    """``part``: ``'images'`` or ``'captions'``; ``float16``: store regions as float16;
    ``tokenizer``: NoW's caption files."""

    part: str = "images"
    float16: bool = False
    tokenizer: str = ""


def _precomp_configs(release: layouts_precomp.Release) -> list[PrecompConfig]:
    configs = [
        PrecompConfig(name="images", description="region features, float32"),
        PrecompConfig(name="images_float16", float16=True, description="regions, float16"),
    ]
    tokenizers = layouts_precomp.TOKENIZERS if release.captions == "ids" else ("",)
    for tokenizer in tokenizers:
        name = f"captions_{tokenizer}" if tokenizer else "captions"
        configs.append(PrecompConfig(name=name, part="captions", tokenizer=tokenizer))
    return configs


class PrecompBuilder(prepared.Builder, skip_registration=True):
    """Builder of a precomp benchmark; a generated subclass sets ``RELEASE``."""

    RELEASE: ClassVar[layouts_precomp.Release]
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}

    def __init__(self, *, vocab_threshold: int = 4, **kwargs):
        """``vocab_threshold``: words kept when the vocabulary is built (no vocab file)."""
        self._vocab_threshold = vocab_threshold
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        config = self.builder_config
        if config.part == "images":
            dtype = np.float16 if config.float16 else np.float32
            shape = (layouts_precomp.NUM_REGIONS, self.RELEASE.region_dim)
            # Raw bytes: a FloatList proto would cost ~20 ms per image to write and read.
            regions = tfds.features.Tensor(shape=shape, dtype=dtype, encoding="bytes")
            features = {"regions": regions}
        else:
            features = {
                "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32, encoding="bytes"),
                "image_index": np.int64,
            }
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"{self.RELEASE.folder} ({config.name}); see ncljax.data.precomp.",
            features=tfds.features.FeaturesDict({**features, "index": np.int64}),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,  # record position == index
        )

    def _split_generators(self, dl_manager):
        config, release = self.builder_config, self.RELEASE
        images = config.part == "images"
        manual = os.fspath(dl_manager.manual_dir)
        files = layouts_precomp.locate(release, manual, config.tokenizer, captions=not images)
        inspected = {s: layouts_precomp.inspect_images(release, p) for s, p in files.images.items()}
        num_images = {s: int(shape[0]) for s, (shape, _) in inspected.items()}
        self.info.metadata.update(
            release=release.folder,
            num_images=num_images,
            captions_per_image=release.captions_per_image,
        )
        if images:
            self.info.metadata.update(
                region_dim=release.region_dim,
                num_regions=layouts_precomp.NUM_REGIONS,
                float16=config.float16,
                source_dtype={s: str(dtype) for s, (_, dtype) in inspected.items()},
            )
            return {
                s: self._generate_examples(split=s, path=p, num_images=num_images[s])
                for s, p in files.images.items()
            }
        captions, vocab = layouts_precomp.encode_captions(
            release, files, num_images, self._vocab_threshold
        )
        unknown = {s: vocab_lib.count_unknown(caps, vocab) for s, caps in captions.items()}
        # Every word <unk>: refused before anything is written (more than a few: a warning
        # each time the data is opened, ncljax.data.precomp).
        vocab_lib.check_unknown(unknown, files.vocab or vocab.source, warn=False)
        self.info.metadata.update(
            vocab_size=vocab.size,
            vocab=dict(vocab.word2idx),
            vocab_source=vocab.source,
            vocab_file=files.vocab or "",
            unknown_words={s: list(counts) for s, counts in unknown.items()},
            vocab_threshold=0 if files.vocab else self._vocab_threshold,
            tokenizer=config.tokenizer,
            max_length={s: max(len(c) for c in caps) for s, caps in captions.items()},
        )
        return {s: self._generate_examples(captions=caps) for s, caps in captions.items()}

    def _generate_examples(self, *, split="", path="", num_images=0, captions=()):
        """The checked images of ``path`` (``images`` configs; see
        ``layouts_precomp.read_images``) or the encoded ``captions``, in order."""
        config = self.builder_config
        if config.part == "images":
            images = layouts_precomp.read_images(self.RELEASE, split, path, float16=config.float16)
            for i, regions in enumerate(images):
                yield prepared.ordered_key(i, num_images), {"regions": regions, "index": i}
            return
        cpi = self.RELEASE.captions_per_image
        for k, tokens in enumerate(captions):
            example = {"tokens": np.asarray(tokens, np.int32), "image_index": k // cpi, "index": k}
            yield prepared.ordered_key(k, len(captions)), example


# ---------------------------------------------------------------- labelled datasets


@dataclasses.dataclass(eq=False)
class LabelledConfig(tfds.core.BuilderConfig):
    """How a release is prepared.

    Attributes:
      float16: store features as float16 (half the disk; reads return float32).
      split_rule: ``'test_head'`` or ``'train_tail'`` for the ``.h5py`` files without
        ``valid_*`` fields (see ``ncljax.data.layouts_labelled``); ``'given'`` for
        INRIA-Websearch.
      valid_len: rows the split rule moves to the validation split (0 for ``'given'``).
    """

    float16: bool = False
    split_rule: str = "test_head"
    valid_len: int = 0


def labelled_config(name: str, *, float16: bool, split_rule: str, valid_len: int):
    """The ``LabelledConfig`` of dataset ``name``, named after its settings.

    Raises:
      ValueError: for a rule or validation size the dataset cannot use.
    """
    release = layouts_labelled.RELEASES[name]
    if release.kind == "mat":
        if split_rule != "given" or valid_len:
            raise ValueError(
                f"{release.file} holds its own train/val/test arrays: set data.split_rule="
                f"'given' and data.valid_len=0 for {name!r} (got {split_rule!r}, {valid_len})."
            )
        config_name = f"given_{'float16' if float16 else 'float32'}"
    else:
        rules = layouts_labelled.SPLIT_RULES
        if split_rule not in rules:
            raise ValueError(
                f"data.split_rule must be one of {rules} for {name!r}, got {split_rule!r}."
            )
        if isinstance(valid_len, bool) or not isinstance(valid_len, int) or valid_len < 1:
            raise ValueError(f"data.valid_len must be a positive integer, got {valid_len!r}.")
        config_name = f"{split_rule}_{valid_len}_{'float16' if float16 else 'float32'}"
    return LabelledConfig(
        name=config_name,
        description=f"split_rule={split_rule}, valid_len={valid_len}, float16={bool(float16)}",
        float16=bool(float16),
        split_rule=split_rule,
        valid_len=int(valid_len),
    )


def _default_labelled_config(release: layouts_labelled.Release) -> LabelledConfig:
    rule = "given" if release.kind == "mat" else "test_head"
    return labelled_config(
        release.name, float16=False, split_rule=rule, valid_len=release.valid_len
    )


def _manual_path(dl_manager, release: layouts_labelled.Release) -> str:
    try:
        manual = dl_manager.manual_dir
    except AssertionError as err:  # TFDS's answer to a missing or empty manual directory
        manual = getattr(dl_manager, "_manual_dir", None) or "<manual_dir>"
        path = os.path.join(os.fspath(manual), release.file)
        raise layouts_labelled.missing_file(path, release) from err
    path = os.path.join(os.fspath(manual), release.file)
    if not os.path.isfile(path):
        raise layouts_labelled.missing_file(path, release)
    return path


class LabelledBuilder(prepared.Builder, skip_registration=True):
    """Builder of a labelled dataset; a generated subclass sets ``RELEASE``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Image-text feature pairs with both labels, in file order."
    }
    RELEASE: ClassVar[layouts_labelled.Release]

    def _info(self) -> tfds.core.DatasetInfo:
        dtype = np.float16 if self.builder_config.float16 else np.float32

        def vector():
            # Raw bytes: several times faster to write and read than a float list.
            return tfds.features.Tensor(
                shape=(None,), dtype=dtype, encoding=tfds.features.Encoding.BYTES
            )

        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                f"{self.RELEASE.title} as released for MRL: pairs of image and text features "
                "with an image and a text class label; record i of a split has index i."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "global_image": vector(),
                    "global_text": vector(),
                    "label_image": tfds.features.Scalar(dtype=np.int64),
                    "label_text": tfds.features.Scalar(dtype=np.int64),
                    "index": tfds.features.Scalar(dtype=np.int64),
                }
            ),
            homepage="https://github.com/penghu-cs/MRL",
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        release, config = self.RELEASE, self.builder_config
        path = _manual_path(dl_manager, release)
        plan = layouts_labelled.plan(
            path,
            release.kind,
            split_rule=config.split_rule,
            valid_len=config.valid_len,
            float16=config.float16,
        )
        self.info.metadata.update(plan.metadata)
        return {split: self._generate_examples(path, split, plan.parts[split]) for split in SPLITS}

    def _generate_examples(self, path: str, split: str, part: layouts_labelled.Part):
        """The checked pairs of ``split`` (``layouts_labelled.read_pairs``), in order."""
        float16 = self.builder_config.float16
        pairs = layouts_labelled.read_pairs(path, self.RELEASE.kind, split, part, float16=float16)
        num_pairs = part.stop - part.start
        for index, image, text in pairs:
            example = {
                "global_image": image,
                "global_text": text,
                "label_image": part.labels_image[index],
                "label_text": part.labels_text[index],
                "index": index,
            }
            yield prepared.ordered_key(index, num_pairs), example


# ---------------------------------------------------------------- the generated classes

# Registry name -> (builder class name, class docstring); the rest of each class comes
# from the dataset's release.
_PRECOMP = {
    "f30k": (
        "F30kPrecomp",
        "Flickr30K: 29,000 / 1,014 (dev) / 1,000 images, 5 captions each, BUTD regions.",
    ),
    "coco": (
        "CocoPrecomp",
        "MS-COCO: 113,287 / 5,000 (dev) / 5,000 (testall) images, 5 captions each.",
    ),
    "cc152k": (
        "Cc152kPrecomp",
        "CC152K (NCR's Conceptual Captions subset, real noise): 150,000 / 1,000 / 1,000 pairs.",
    ),
    "now": (
        "Now100kPrecomp",
        "NoW (PC2's Noise of Web): 98,000 / 1,000 / 1,000 pairs, 768-d regions, token ids.",
    ),
}
_LABELLED = {
    "wiki": (
        "Wikipedia",
        "Wikipedia (Corr-AE split; 10 classes), MRL's VGG-19 / Doc2Vec feature file.",
    ),
    "nuswide": (
        "NusWide",
        "NUS-WIDE (10-class single-label subset), MRL's VGG-19 / Doc2Vec feature file.",
    ),
    "xmedianet": (
        "XMediaNet",
        "XMediaNet (images and texts; 200 classes), MRL's VGG-19 / Doc2Vec feature file.",
    ),
    "inria": (
        "InriaWebsearch",
        "INRIA-Websearch (100 classes), AlexNet fc7 / LDA features in a MATLAB file.",
    ),
}


def _subclass(base: type, class_name: str, doc: str, *, register: bool, **attrs) -> type:
    """A subclass of ``base`` defined in this module, with class attributes ``attrs``.

    TFDS registers a builder class as it is created, under its ``name`` attribute
    (the prepared data's directory name), unless ``register`` is False.
    """
    namespace = {"__module__": __name__, "__qualname__": class_name, "__doc__": doc, **attrs}
    keywords = {} if register else {"skip_registration": True}
    return types.new_class(class_name, (base,), keywords, lambda ns: ns.update(namespace))


def _precomp_builder(name: str, class_name: str, doc: str) -> type[PrecompBuilder]:
    release = layouts_precomp.RELEASES[name]
    return _subclass(
        PrecompBuilder,
        class_name,
        doc,
        register=True,
        name=release.folder,
        RELEASE=release,
        MANUAL_DOWNLOAD_INSTRUCTIONS=layouts_precomp.instructions(release),
        BUILDER_CONFIGS=_precomp_configs(release),
    )


def _labelled_builder(name: str, class_name: str, doc: str) -> type[LabelledBuilder]:
    release = layouts_labelled.RELEASES[name]
    return _subclass(
        LabelledBuilder,
        class_name,
        doc,
        register=False,
        name=release.name,
        RELEASE=release,
        MANUAL_DOWNLOAD_INSTRUCTIONS=layouts_labelled.instructions(release),
        BUILDER_CONFIGS=[_default_labelled_config(release)],
    )


PRECOMP = {name: _precomp_builder(name, *row) for name, row in _PRECOMP.items()}
LABELLED = {name: _labelled_builder(name, *row) for name, row in _LABELLED.items()}
