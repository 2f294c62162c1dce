"""Reading the prepared noisy-label benchmarks: Wikipedia, NUS-WIDE, XMediaNet, INRIA-Websearch.

Each dataset is one released feature file put in ``data.manual_dir`` (its layout, split
rules and label conventions: ``ncljax.data.layouts_labelled``), prepared once to
ArrayRecord in file order (``ncljax.data.builders``) and read by index through
``as_data_source``. A pair ``i`` of a split is image ``i`` and text ``i``, read from
record ``i``: global feature vectors only, float32, with a class label each.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np

from ncljax.data import builders, layouts_labelled, prepared, sources
from ncljax.data.layouts_labelled import RELEASES, missing_file

BUILDERS = builders.LABELLED


def default_config(name: str):
    """The ``data`` config section of dataset ``name`` (``wiki``, ``nuswide``,
    ``xmedianet`` or ``inria``), with MRL's split convention.

    Fields: ``name``; ``manual_dir`` (the folder holding the released file; default
    ``<data_dir>/downloads/manual/<name>``); ``data_dir`` (prepared data; default
    ``~/tensorflow_datasets``); ``float16``; ``split_rule``; ``valid_len``.
    """
    import ml_collections

    if name not in RELEASES:
        raise ValueError(f"Unknown labelled dataset {name!r}; known: {sorted(RELEASES)}.")
    release = RELEASES[name]
    return ml_collections.ConfigDict(
        dict(
            name=name,
            manual_dir="",
            data_dir="",
            float16=False,
            split_rule="given" if release.kind == "mat" else "test_head",
            valid_len=release.valid_len,
        )
    )


def size_hint(cfg, split: str, needed: int) -> str:
    """What sizes ``split`` (see ``sources.size_hint``): ``data.valid_len`` for a carved
    validation split, otherwise the rows of the released file."""
    carved = cfg.split_rule in layouts_labelled.SPLIT_RULES
    if split == "val" and carved:
        return f"set data.valid_len (now {cfg.valid_len}) to at least {needed}"
    if split == "test" and cfg.split_rule == "test_head":
        return (
            f"the test split is the file's test rows after the first data.valid_len="
            f"{cfg.valid_len} (the validation rows): lower data.valid_len"
        )
    return f"the {split} split is the released file's {split} rows; use the full file"


def builder(cfg) -> builders.LabelledBuilder:
    """The TFDS builder of the ``data`` config section ``cfg`` (not prepared yet)."""
    if cfg.name not in BUILDERS:
        raise ValueError(f"Unknown labelled dataset {cfg.name!r}; known: {sorted(BUILDERS)}.")
    cls = BUILDERS[cfg.name]
    config = builders.labelled_config(
        cfg.name, float16=cfg.float16, split_rule=cfg.split_rule, valid_len=cfg.valid_len
    )
    if config.name in cls.builder_configs:  # TFDS refuses a new object under a listed name
        config = config.name
    return cls(config=config, data_dir=prepared.data_dir(cfg), file_format="array_record")


def _read_only(record: dict) -> dict:
    for value in record.values():
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    return record


class LabelledSplit:
    """One prepared split; implements ``sources.SplitSource`` (one text per image).

    Image ``i`` and text ``i`` form pair ``i``; both read record ``i`` of the split.
    """

    captions_per_image = 1

    def __init__(self, source, name: str, image_labels: Sequence[int]):
        self._source = source
        self._name = name
        self.num_images = self.num_captions = len(source)
        self._labels = np.array(image_labels, np.int64)
        self._labels.flags.writeable = False
        if self._labels.shape != (self.num_images,):
            raise ValueError(
                f"Prepared split {name} holds {self.num_images} records but its metadata "
                f"{self._labels.size} labels. Delete the prepared directory and prepare it again."
            )
        # A pair's image and text are read one after the other: decode the record once.
        self._record = functools.lru_cache(maxsize=256)(self._read)

    def _read(self, index: int) -> dict:
        return _read_only(dict(self._source[index]))

    def _get(self, index: int, what: str) -> dict:
        index = int(index)
        if not 0 <= index < self.num_images:
            raise IndexError(
                f"{what} index {index} out of range [0, {self.num_images}) of {self._name}."
            )
        return self._record(index)

    def _fields(self, fields: Sequence[str], allowed: str, option: str) -> None:
        unknown = [f for f in fields if f != allowed]
        if unknown:
            raise ValueError(
                f"{self._name} has only global feature vectors: {unknown} are not available; "
                f"set {option}."
            )

    def image(self, index: int, fields: Sequence[str] = ("global_image",)) -> dict:
        """Image ``index``: ``label`` (int64) and ``global_image`` (float32 ``[d_img]``)."""
        self._fields(fields, "global_image", "model.image_input='global'")
        record = self._get(index, "image")
        out = {"label": np.int64(record["label_image"])}
        if "global_image" in fields:
            out["global_image"] = np.asarray(record["global_image"], np.float32)
        return out

    def caption(self, index: int, fields: Sequence[str] = ("global_text",)) -> dict:
        """Text ``index``: ``label`` (int64) and ``global_text`` (float32 ``[d_txt]``)."""
        self._fields(fields, "global_text", "model.text_input='global'")
        record = self._get(index, "text")
        out = {"label": np.int64(record["label_text"])}
        if "global_text" in fields:
            out["global_text"] = np.asarray(record["global_text"], np.float32)
        return out

    def image_labels(self) -> np.ndarray:
        """Image labels, int64 ``[num_images]`` (read-only; recorded when preparing)."""
        return self._labels


class LabelledDataset:
    """A prepared labelled dataset; implements ``sources.Dataset``.

    Attributes:
      info: ``sources.DatasetInfo`` (one text per image, global features only).
      metadata: what preparation recorded (split rule and rows, label offset, image
        labels, ...).
    """

    def __init__(self, name: str, data_sources: dict, metadata: dict):
        self._splits = {
            s: LabelledSplit(data_sources[s], f"{name}/{s}", metadata["image_labels"][s])
            for s in sources.SPLITS
        }
        self.metadata = dict(metadata)
        self.info = sources.DatasetInfo(
            name=name,
            captions_per_image=1,
            num_classes=int(metadata["num_classes"]),
            vocab_size=0,
            max_length=0,
            num_regions=0,
            region_dim=0,
            image_dim=int(metadata["image_dim"]),
            text_dim=int(metadata["text_dim"]),
            split_sizes={
                s: (split.num_images, split.num_captions) for s, split in self._splits.items()
            },
        )

    def split(self, name: str) -> LabelledSplit:
        if name not in self._splits:
            raise ValueError(f"Unknown split {name!r}; {self.info.name} has {list(self._splits)}.")
        return self._splits[name]


def load(cfg) -> LabelledDataset:
    """Prepares dataset ``cfg.name`` from ``cfg.manual_dir`` once, then opens it.

    Raises:
      FileNotFoundError: the data is not prepared and the released file is missing; the
        message names the expected path and where the file is published.
      ValueError: the file does not have the released layout (naming the file and field).
    """
    tfds_builder = builder(cfg)
    manual = prepared.manual_dir(cfg, cfg.name)
    if not tfds_builder.is_prepared():
        # Checked here too so that a missing folder gives this message, not TFDS's.
        path = os.path.join(manual, RELEASES[cfg.name].file)
        if not os.path.isfile(path):
            raise missing_file(path, RELEASES[cfg.name])
    data_sources = prepared.prepare(tfds_builder, manual)
    metadata = tfds_builder.info.metadata
    if int(metadata["num_classes"]) < 2:  # prepared before single-class files were refused
        raise ValueError(
            f"The prepared {cfg.name} in {tfds_builder.data_dir} holds a single class; "
            "category retrieval (mAP) and label noise need at least 2. Delete it and prepare "
            "the released file again."
        )
    return LabelledDataset(cfg.name, data_sources, metadata)


for _name in RELEASES:
    sources.register(_name)(load)
