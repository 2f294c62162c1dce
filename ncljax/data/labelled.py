"""Noisy-label benchmarks as TFDS builders: Wikipedia, NUS-WIDE, XMediaNet, INRIA-Websearch.

The four datasets of MRL [1] (and of UOT-RCL, which follows MRL) are released as
precomputed features: a frozen image feature (VGG-19 or AlexNet fc7) and a text feature
(Doc2Vec or LDA) per pair, with a class label for the image and one for the text. Each
dataset is a ``tfds.core.GeneratorBasedBuilder`` over the released file (a manual
download), prepared once to ArrayRecord in file order and read by index through
``as_data_source``. The file is read in chunks of rows, never whole (INRIA's ``.mat``:
one variable at a time, as far as scipy can go).

An example is a pair: ``global_image [d_img]`` and ``global_text [d_txt]`` (float32, or
float16 with ``data.float16``), ``label_image``, ``label_text`` and ``index`` (int64; the
record's position in its split). Feature sizes are read from the file.

Splits. MRL's ``.h5py`` files hold ``train_*`` and ``test_*`` arrays and, optionally,
``valid_*`` arrays, which are used when present. Otherwise ``data.split_rule`` carves out
the validation split:

* ``'test_head'`` (MRL's loader; default): validation = the first ``data.valid_len``
  test rows, test = the remaining ones (231/462 for Wikipedia, 5,000/23,661 for NUS-WIDE,
  4,000/4,000 for XMediaNet);
* ``'train_tail'`` (another public loader): validation = the last ``data.valid_len``
  training rows, which then leave the training split.

INRIA-Websearch's ``.mat`` file holds its own three splits (``split_rule='given'``). The
rule applied is recorded in the prepared dataset's metadata
(``builder.info.metadata['split_rule']``: ``test_head``, ``train_tail``,
``valid_fields`` or ``given``), with the rows each split came from.

Labels. Released labels may be 1-based. MRL subtracts each label array's own minimum;
here the minimum over all splits and both modalities is subtracted (the same for
already 0-based files; robust to a split that lacks class 0), recorded as
``metadata['label_offset']``. The number of classes is one more than the largest shifted
label. INRIA's labels are shifted the same way (MRL leaves them as they are).

A split whose image features, or whose text features, are all zero (a placeholder file)
is refused when preparing; single all-zero rows are kept.

Preparation needs no TensorFlow as long as each split fits TFDS's 1 GB in-memory sort
buffer; all four releases do (NUS-WIDE's training split, the largest, is ~0.76 GB).

References:
  [1] P. Hu, X. Peng, H. Zhu, L. Zhen, J. Lin. Learning Cross-modal Retrieval with
      Noisy Labels. CVPR 2021. Code and data loader: https://github.com/penghu-cs/MRL
      (``src/noisydataset.py``; original data sources in ``paper/dataset.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, NamedTuple

import h5py
import numpy as np
import scipy.io
import scipy.sparse
import tensorflow_datasets as tfds

from ncljax.data import prepared, sources

SPLITS = ("train", "val", "test")
SPLIT_RULES = ("test_head", "train_tail")
_CHUNK = 512  # rows read from the file at a time while preparing


@dataclasses.dataclass(frozen=True)
class _Release:
    """One released file and where it comes from."""

    title: str
    file: str
    kind: str  # 'h5py' (MRL's feature files) or 'mat' (INRIA-Websearch)
    valid_len: int  # default validation size carved out by a split rule (0: given splits)
    origin: str  # the original dataset, as listed by MRL's paper/dataset.md
    mrl_folder: str  # MRL's loader reads data/<mrl_folder>/<file>


_RELEASES = {
    "wiki": _Release(
        "Wikipedia",
        "wiki_deep_doc2vec_data_corr_ae.h5py",
        "h5py",
        231,
        "http://www.svcl.ucsd.edu/projects/crossmodal/",
        "wiki",
    ),
    "nuswide": _Release(
        "NUS-WIDE (10-class subset)",
        "nus_wide_deep_doc2vec_data_42941.h5py",
        "h5py",
        5000,
        "http://lms.comp.nus.edu.sg/research/NUS-WIDE.htm",
        "NUS-WIDE",
    ),
    "xmedianet": _Release(
        "XMediaNet (image and text)",
        "xmedianet_deep_doc2vec_data.h5py",
        "h5py",
        4000,
        "http://www.icst.pku.edu.cn/mipl/XMedia/",
        "XMediaNet",
    ),
    "inria": _Release(
        "INRIA-Websearch",
        "INRIA-Websearch.mat",
        "mat",
        0,
        "https://weiyc.github.io/assets/projects/tcyb.html",
        "INRIA-Websearch",
    ),
}

_LAYOUTS = {
    "h5py": (
        "HDF5 datasets train_imgs_deep [N, d_img], train_text or train_texts [N, d_txt], "
        "train_imgs_labels [N] and train_texts_labels [N] (numeric; integer-valued labels), "
        "the same four with the test_ prefix, and optionally all four with the valid_ prefix"
    ),
    "mat": (
        "MATLAB v5/v7 variables tr_img [N, d_img], tr_txt [N, d_txt], tr_img_lab [N, 1] and "
        "tr_txt_lab [N, 1] (numeric; integer-valued labels), and the same four with the "
        "val_ and te_ prefixes"
    ),
}

# The parts of a file (array name prefixes), each holding four arrays; True: required.
_PARTS = {
    "h5py": {"train": True, "test": True, "valid": False},
    "mat": {"tr": True, "val": True, "te": True},
}


def _candidates(kind: str, prefix: str) -> dict[str, tuple[str, ...]]:
    if kind == "h5py":
        return {
            "image": (f"{prefix}_imgs_deep",),
            "text": (f"{prefix}_text", f"{prefix}_texts"),  # MRL tries _text first
            "label_image": (f"{prefix}_imgs_labels",),
            "label_text": (f"{prefix}_texts_labels",),
        }
    return {
        "image": (f"{prefix}_img",),
        "text": (f"{prefix}_txt",),
        "label_image": (f"{prefix}_img_lab",),
        "label_text": (f"{prefix}_txt_lab",),
    }


def _instructions(name: str) -> str:
    release = _RELEASES[name]
    return (
        f"Put `{release.file}` into the manual directory (ncljax: `data.manual_dir`, default "
        f"`<data_dir>/downloads/manual/{name}`). It is the {release.title} feature file read "
        "by the MRL code, https://github.com/penghu-cs/MRL (its loader src/noisydataset.py "
        f"reads data/{release.mrl_folder}/{release.file}); MRL's paper/dataset.md gives the "
        f"original dataset: {release.origin}. Expected layout: {_LAYOUTS[release.kind]}."
    )


def _missing_file(path: str, release: _Release) -> FileNotFoundError:
    return FileNotFoundError(
        f"{release.title} is not prepared and its released file is missing: expected {path}. "
        f"Put {release.file} (the feature file read by MRL, https://github.com/penghu-cs/MRL, "
        f"as data/{release.mrl_folder}/{release.file}; original data: {release.origin}) in "
        f"{os.path.dirname(path)}, or set data.manual_dir to the folder that holds it. "
        f"Expected layout: {_LAYOUTS[release.kind]}."
    )


def _layout_error(path: str, kind: str, problem: str) -> ValueError:
    return ValueError(f"{path}: {problem}. Expected layout: {_LAYOUTS[kind]}.")


# ------------------------------------------------------------------ reading the file


class _Entry(NamedTuple):
    """What the file says about one array, before reading it."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype or MATLAB class, for messages
    numeric: bool
    sparse: bool


def _h5_entries(path: str) -> dict[str, _Entry]:
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise _layout_error(path, "h5py", f"cannot be read as an HDF5 file ({err})") from err
    entries = {}
    with f:
        for name, value in f.items():
            if isinstance(value, h5py.Dataset):
                numeric = value.dtype.kind in "fiu"
                entries[name] = _Entry(tuple(value.shape), str(value.dtype), numeric, False)
            else:
                entries[name] = _Entry((), "group", False, False)
    return entries


_MAT_NUMERIC = {"double", "single", "sparse"} | {
    f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)
}


def _mat_entries(path: str) -> dict[str, _Entry]:
    try:
        listing = scipy.io.whosmat(path)
    except NotImplementedError as err:  # scipy's answer to MATLAB v7.3 (HDF5) files
        raise _layout_error(
            path,
            "mat",
            f"is a MATLAB v7.3 file, which scipy cannot read ({err}); save it "
            "again with save(..., '-v7')",
        ) from err
    except Exception as err:  # scipy raises several types for files that are not .mat
        raise _layout_error(path, "mat", f"cannot be read as a MATLAB file ({err!r})") from err
    return {
        name: _Entry(tuple(shape), cls, cls in _MAT_NUMERIC, cls == "sparse")
        for name, shape, cls in listing
    }


@contextlib.contextmanager
def _h5_arrays(path: str) -> Iterator[Callable[[str], object]]:
    """``get(name)``: a lazily sliced HDF5 dataset."""
    with h5py.File(path, "r") as f:
        yield lambda name: f[name]


@contextlib.contextmanager
def _mat_arrays(path: str) -> Iterator[Callable[[str], object]]:
    """``get(name)``: one MATLAB variable, loaded alone (v5 files cannot be sliced on disk)."""

    def get(name: str):
        value = scipy.io.loadmat(path, variable_names=[name])[name]
        return value.tocsr() if scipy.sparse.issparse(value) else value

    yield get


_ENTRIES = {"h5py": _h5_entries, "mat": _mat_entries}
_ARRAYS = {"h5py": _h5_arrays, "mat": _mat_arrays}


def _read_rows(array, start: int, stop: int) -> np.ndarray:
    rows = array[start:stop]
    return rows.toarray() if scipy.sparse.issparse(rows) else np.asarray(rows)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------ checking the layout


class _FilePart(NamedTuple):
    """The four arrays of one part of the file (e.g. ``test_*``) and their row count."""

    prefix: str
    fields: dict[str, str]  # role -> array name
    rows: int


class _Part(NamedTuple):
    """Rows ``[start, stop)`` of a file part, making up one split of the prepared data."""

    image: str
    text: str
    start: int
    stop: int
    labels_image: np.ndarray  # int64 [stop - start], shifted to start at 0
    labels_text: np.ndarray


class _Layout(NamedTuple):
    parts: dict[str, _Part]  # split -> where its rows are
    metadata: dict


def _find_part(path, kind, entries, prefix, required) -> _FilePart | None:
    candidates = _candidates(kind, prefix)
    fields = {}
    for role, names in candidates.items():
        present = [n for n in names if n in entries]
        if present:
            fields[role] = present[0]
    if not fields and not required:
        return None
    missing = [" or ".join(names) for role, names in candidates.items() if role not in fields]
    if missing:
        note = "" if required else f" (the {prefix}_ fields are optional, but all four or none)"
        raise _layout_error(path, kind, f"the field {missing[0]} is missing{note}")
    _check_part(path, kind, entries, fields)
    return _FilePart(prefix, fields, entries[fields["image"]].shape[0])


def _check_part(path, kind, entries, fields) -> None:
    for role in ("image", "text"):
        name, entry = fields[role], entries[fields[role]]
        if len(entry.shape) != 2:
            raise _layout_error(
                path, kind, f"{name} has shape {entry.shape}; features must be 2-D [N, d]"
            )
        if not entry.numeric:
            raise _layout_error(
                path, kind, f"{name} has dtype {entry.dtype}; features must be numeric"
            )
    for role in ("label_image", "label_text"):
        name, entry = fields[role], entries[fields[role]]
        shape = entry.shape
        if not (len(shape) == 1 or (len(shape) == 2 and 1 in shape)):
            raise _layout_error(
                path, kind, f"{name} has shape {shape}; labels must be 1-D [N] (or [N, 1])"
            )
        if not entry.numeric or entry.sparse:
            raise _layout_error(
                path, kind, f"{name} has dtype {entry.dtype}; labels must be a dense numeric array"
            )
    image = fields["image"]
    rows = entries[image].shape[0]
    if rows == 0:
        raise _layout_error(path, kind, f"{image} has no rows")
    for role in ("text", "label_image", "label_text"):
        name = fields[role]
        shape = entries[name].shape
        found = shape[0] if role == "text" else int(np.prod(shape))
        if found != rows:
            raise _layout_error(
                path,
                kind,
                f"{name} has {found} rows but {image} has {rows}; the four arrays of a split "
                "hold the same N image-text pairs",
            )


def _check_dims(path, kind, entries, parts: list[_FilePart]) -> tuple[int, int]:
    dims = []
    for role in ("image", "text"):
        first = parts[0].fields[role]
        dim = entries[first].shape[1]
        for part in parts[1:]:
            name = part.fields[role]
            if entries[name].shape[1] != dim:
                raise _layout_error(
                    path,
                    kind,
                    f"{name} has {entries[name].shape[1]} columns but {first} has {dim}; "
                    "feature sizes must agree across splits",
                )
        dims.append(int(dim))
    return dims[0], dims[1]


def _read_labels(path, kind, get, name) -> np.ndarray:
    values = np.asarray(get(name)[()]).reshape(-1)
    if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
        raise _layout_error(path, kind, f"{name} holds values that are not integer class ids")
    return values.astype(np.int64)


def _split_rows(path, kind, parts: dict[str, _FilePart], rule: str, valid_len: int):
    """``({split: (file part, start, stop)}, the rule actually applied)``."""
    if kind == "mat":
        rows = {
            split: parts[prefix] for split, prefix in zip(SPLITS, ("tr", "val", "te"), strict=True)
        }
        return {split: (part, 0, part.rows) for split, part in rows.items()}, "given"
    train, test = parts["train"], parts["test"]
    if "valid" in parts:
        rows = {"train": train, "val": parts["valid"], "test": test}
        return {split: (part, 0, part.rows) for split, part in rows.items()}, "valid_fields"
    carved = test if rule == "test_head" else train
    if not 0 < valid_len < carved.rows:
        raise ValueError(
            f"data.valid_len={valid_len} does not fit {path}: split_rule={rule!r} takes the "
            f"validation split from {carved.fields['image']} ({carved.rows} rows), so valid_len "
            f"must be between 1 and {carved.rows - 1}."
        )
    if rule == "test_head":
        rows = {
            "train": (train, 0, train.rows),
            "val": (test, 0, valid_len),
            "test": (test, valid_len, test.rows),
        }
    else:
        cut = train.rows - valid_len
        rows = {"train": (train, 0, cut), "val": (train, cut, train.rows)}
        rows["test"] = (test, 0, test.rows)
    return rows, rule


def _layout(path: str, kind: str, config: LabelledConfig) -> _Layout:
    """Checks ``path`` against the released layout and plans the three splits.

    Raises:
      ValueError: naming the file, the field and the expected layout.
    """
    entries = _ENTRIES[kind](path)
    parts = {}
    for prefix, required in _PARTS[kind].items():
        part = _find_part(path, kind, entries, prefix, required)
        if part is not None:
            parts[prefix] = part
    image_dim, text_dim = _check_dims(path, kind, entries, list(parts.values()))
    with _ARRAYS[kind](path) as get:
        labels = {
            (prefix, role): _read_labels(path, kind, get, part.fields[role])
            for prefix, part in parts.items()
            for role in ("label_image", "label_text")
        }
    offset = int(min(v.min() for v in labels.values()))
    num_classes = int(max(v.max() for v in labels.values())) - offset + 1
    rows, rule = _split_rows(path, kind, parts, config.split_rule, config.valid_len)
    splits, origin = {}, {}
    for split, (part, start, stop) in rows.items():
        splits[split] = _Part(
            image=part.fields["image"],
            text=part.fields["text"],
            start=start,
            stop=stop,
            labels_image=labels[part.prefix, "label_image"][start:stop] - offset,
            labels_text=labels[part.prefix, "label_text"][start:stop] - offset,
        )
        origin[split] = {
            "image": part.fields["image"],
            "text": part.fields["text"],
            "labels": [part.fields["label_image"], part.fields["label_text"]],
            "rows": [start, stop],
        }
    metadata = {
        "source_file": os.path.basename(path),
        "source_sha256": _sha256(path),
        "split_rule": rule,
        "valid_len": rows["val"][2] - rows["val"][1],
        "split_origin": origin,
        "label_offset": offset,
        "num_classes": num_classes,
        "image_dim": image_dim,
        "text_dim": text_dim,
        "float16": bool(config.float16),
        # Kept here as well as in the records so that a run reads them without a pass over
        # the split (seconds for NUS-WIDE).
        "image_labels": {split: part.labels_image.tolist() for split, part in splits.items()},
    }
    return _Layout(splits, metadata)


def _feature_rows(path, kind, name, rows, start, float16) -> np.ndarray:
    """Feature rows ``start, ...`` of array ``name``, checked and cast to the stored dtype."""
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        row = start + int(np.argmin(finite))
        raise _layout_error(
            path, kind, f"{name} row {row} holds NaN or Inf; features must be finite"
        )
    dtype = np.float16 if float16 else np.float32
    with np.errstate(over="ignore"):  # overflow becomes inf, reported below
        cast = rows.astype(dtype)
    finite = np.isfinite(cast).all(axis=1)
    if not finite.all():
        row = start + int(np.argmin(finite))
        fix = "; set data.float16=False to store float32" if float16 else ""
        raise ValueError(
            f"{path}: {name} row {row} holds values beyond the {np.dtype(dtype).name} range "
            f"(|x| > {float(np.finfo(dtype).max):g}){fix}."
        )
    return cast


# ------------------------------------------------------------------ the TFDS builders


@dataclasses.dataclass(eq=False)
class LabelledConfig(tfds.core.BuilderConfig):
    """How a release is prepared.

    Attributes:
      float16: store features as float16 (half the disk; reads return float32).
      split_rule: ``'test_head'`` or ``'train_tail'`` for the ``.h5py`` files without
        ``valid_*`` fields (see the module docstring); ``'given'`` for INRIA-Websearch.
      valid_len: rows the split rule moves to the validation split (0 for ``'given'``).
    """

    float16: bool = False
    split_rule: str = "test_head"
    valid_len: int = 0


def builder_config(name: str, *, float16: bool, split_rule: str, valid_len: int):
    """The ``LabelledConfig`` of dataset ``name``, named after its settings.

    Raises:
      ValueError: for a rule or validation size the dataset cannot use.
    """
    release = _RELEASES[name]
    if release.kind == "mat":
        if split_rule != "given" or valid_len:
            raise ValueError(
                f"{release.file} holds its own train/val/test arrays: set data.split_rule="
                f"'given' and data.valid_len=0 for {name!r} (got {split_rule!r}, {valid_len})."
            )
        config_name = f"given_{'float16' if float16 else 'float32'}"
    else:
        if split_rule not in SPLIT_RULES:
            raise ValueError(
                f"data.split_rule must be one of {SPLIT_RULES} for {name!r}, got {split_rule!r}."
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


def _manual_path(dl_manager, release: _Release) -> str:
    try:
        manual = dl_manager.manual_dir
    except AssertionError as err:  # TFDS's answer to a missing or empty manual directory
        manual = getattr(dl_manager, "_manual_dir", None) or "<manual_dir>"
        raise _missing_file(os.path.join(os.fspath(manual), release.file), release) from err
    path = os.path.join(os.fspath(manual), release.file)
    if not os.path.isfile(path):
        raise _missing_file(path, release)
    return path


class _LabelledBuilder(prepared.Builder, skip_registration=True):
    """Shared builder of the four releases; subclasses set ``name`` and ``RELEASE``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Image-text feature pairs with both labels, in file order."
    }
    RELEASE: _Release

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
        release = self.RELEASE
        path = _manual_path(dl_manager, release)
        layout = _layout(path, release.kind, self.builder_config)
        self.info.metadata.update(layout.metadata)
        return {
            split: self._generate_examples(path, split, layout.parts[split]) for split in SPLITS
        }

    def _generate_examples(self, path: str, split: str, part: _Part):
        """The pairs of ``split``, checked: finite, and neither modality all zero.

        An all-zero row may be legitimate; a split whose image (or text) features are all
        zero is a placeholder, on which a collapsed model would score perfectly. Whether
        any value is non-zero is known from the one pass that writes.
        """
        kind, float16 = self.RELEASE.kind, self.builder_config.float16
        seen_nonzero = {part.image: False, part.text: False}
        with _ARRAYS[kind](path) as get:
            image, text = get(part.image), get(part.text)
            for start in range(part.start, part.stop, _CHUNK):
                stop = min(start + _CHUNK, part.stop)
                images = _read_rows(image, start, stop)
                texts = _read_rows(text, start, stop)
                for name, rows in ((part.image, images), (part.text, texts)):
                    seen_nonzero[name] = seen_nonzero[name] or bool(rows.any())
                images = _feature_rows(path, kind, part.image, images, start, float16)
                texts = _feature_rows(path, kind, part.text, texts, start, float16)
                for j in range(stop - start):
                    index = start - part.start + j
                    yield (
                        prepared.ordered_key(index, part.stop - part.start),
                        {
                            "global_image": images[j],
                            "global_text": texts[j],
                            "label_image": part.labels_image[index],
                            "label_text": part.labels_text[index],
                            "index": index,
                        },
                    )
        for name, nonzero in seen_nonzero.items():
            if not nonzero:
                raise ValueError(
                    f"{path}: the features of split '{split}' ({name}, rows {part.start} to "
                    f"{part.stop - 1}) are all zero; the file is probably a placeholder or was "
                    "not written completely: download it again or re-extract the features."
                )


def _default_config(name: str) -> LabelledConfig:
    release = _RELEASES[name]
    rule = "given" if release.kind == "mat" else "test_head"
    return builder_config(name, float16=False, split_rule=rule, valid_len=release.valid_len)


class Wikipedia(_LabelledBuilder, skip_registration=True):
    """Wikipedia (Corr-AE split; 10 classes), MRL's VGG-19 / Doc2Vec feature file."""

    name = "wiki"
    RELEASE = _RELEASES["wiki"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(name)
    BUILDER_CONFIGS: ClassVar[list[LabelledConfig]] = [_default_config("wiki")]


class NusWide(_LabelledBuilder, skip_registration=True):
    """NUS-WIDE (10-class single-label subset), MRL's VGG-19 / Doc2Vec feature file."""

    name = "nuswide"
    RELEASE = _RELEASES["nuswide"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(name)
    BUILDER_CONFIGS: ClassVar[list[LabelledConfig]] = [_default_config("nuswide")]


class XMediaNet(_LabelledBuilder, skip_registration=True):
    """XMediaNet (images and texts; 200 classes), MRL's VGG-19 / Doc2Vec feature file."""

    name = "xmedianet"
    RELEASE = _RELEASES["xmedianet"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(name)
    BUILDER_CONFIGS: ClassVar[list[LabelledConfig]] = [_default_config("xmedianet")]


class InriaWebsearch(_LabelledBuilder, skip_registration=True):
    """INRIA-Websearch (100 classes), AlexNet fc7 / LDA features in a MATLAB file."""

    name = "inria"
    RELEASE = _RELEASES["inria"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(name)
    BUILDER_CONFIGS: ClassVar[list[LabelledConfig]] = [_default_config("inria")]


BUILDERS = {"wiki": Wikipedia, "nuswide": NusWide, "xmedianet": XMediaNet, "inria": InriaWebsearch}


# ------------------------------------------------------------------ reading prepared data


def default_config(name: str):
    """The ``data`` config section of dataset ``name`` (``wiki``, ``nuswide``,
    ``xmedianet`` or ``inria``), with MRL's split convention.

    Fields: ``name``; ``manual_dir`` (the folder holding the released file; default
    ``<data_dir>/downloads/manual/<name>``); ``data_dir`` (prepared data; default
    ``~/tensorflow_datasets``); ``float16``; ``split_rule``; ``valid_len``.
    """
    import ml_collections

    if name not in _RELEASES:
        raise ValueError(f"Unknown labelled dataset {name!r}; known: {sorted(_RELEASES)}.")
    release = _RELEASES[name]
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


def builder(cfg) -> _LabelledBuilder:
    """The TFDS builder of the ``data`` config section ``cfg`` (not prepared yet)."""
    if cfg.name not in BUILDERS:
        raise ValueError(f"Unknown labelled dataset {cfg.name!r}; known: {sorted(BUILDERS)}.")
    cls = BUILDERS[cfg.name]
    config = builder_config(
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
            for s in SPLITS
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
        path = os.path.join(manual, _RELEASES[cfg.name].file)
        if not os.path.isfile(path):
            raise _missing_file(path, _RELEASES[cfg.name])
    data_sources = prepared.prepare(tfds_builder, manual)
    return LabelledDataset(cfg.name, data_sources, tfds_builder.info.metadata)


for _name in _RELEASES:
    sources.register(_name)(load)
