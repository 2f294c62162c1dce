"""The released files of Wikipedia, NUS-WIDE, XMediaNet and INRIA-Websearch (MRL's features).

Where each file goes, what it holds, and how it is read, checked and split. The four
datasets of MRL [1] (and of UOT-RCL, which follows MRL) are released as precomputed
features: a frozen image feature (VGG-19 or AlexNet fc7) and a text feature (Doc2Vec or
LDA) per pair, with a class label for the image and one for the text, in one file per
dataset put in ``data.manual_dir``. ``ncljax.data.builders`` prepares it with the
functions here and ``ncljax.data.labelled`` reads the prepared data. The file is read
in chunks of rows, never whole (INRIA's ``.mat``: one variable at a time, as far as
scipy can go). Feature sizes are read from the file.

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
label; a file of a single class is refused. INRIA's labels are shifted the same way (MRL
leaves them as they are).

A split whose image features, or whose text features, are all zero (a placeholder file)
is refused; single all-zero rows are kept.

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
from collections.abc import Callable, Iterator
from typing import NamedTuple

import h5py
import numpy as np
import scipy.io
import scipy.sparse

from ncljax.data.sources import SPLITS

SPLIT_RULES = ("test_head", "train_tail")
_CHUNK = 512  # rows read from the file at a time while preparing


@dataclasses.dataclass(frozen=True)
class Release:
    """One released file and where it comes from.

    Attributes:
      name: registry name (``data.name``), also the prepared data's TFDS name.
      title: the dataset, for messages.
      file: the released file name.
      kind: ``'h5py'`` (MRL's feature files) or ``'mat'`` (INRIA-Websearch).
      valid_len: default validation size carved out by a split rule (0: given splits).
      origin: the original dataset, as listed by MRL's ``paper/dataset.md``.
      mrl_folder: MRL's loader reads ``data/<mrl_folder>/<file>``.
    """

    name: str
    title: str
    file: str
    kind: str
    valid_len: int
    origin: str
    mrl_folder: str


RELEASES = {
    "wiki": Release(
        name="wiki",
        title="Wikipedia",
        file="wiki_deep_doc2vec_data_corr_ae.h5py",
        kind="h5py",
        valid_len=231,
        origin="http://www.svcl.ucsd.edu/projects/crossmodal/",
        mrl_folder="wiki",
    ),
    "nuswide": Release(
        name="nuswide",
        title="NUS-WIDE (10-class subset)",
        file="nus_wide_deep_doc2vec_data_42941.h5py",
        kind="h5py",
        valid_len=5000,
        origin="http://lms.comp.nus.edu.sg/research/NUS-WIDE.htm",
        mrl_folder="NUS-WIDE",
    ),
    "xmedianet": Release(
        name="xmedianet",
        title="XMediaNet (image and text)",
        file="xmedianet_deep_doc2vec_data.h5py",
        kind="h5py",
        valid_len=4000,
        origin="http://www.icst.pku.edu.cn/mipl/XMedia/",
        mrl_folder="XMediaNet",
    ),
    "inria": Release(
        name="inria",
        title="INRIA-Websearch",
        file="INRIA-Websearch.mat",
        kind="mat",
        valid_len=0,
        origin="https://weiyc.github.io/assets/projects/tcyb.html",
        mrl_folder="INRIA-Websearch",
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


def instructions(release: Release) -> str:
    """Where to put the released file, where it comes from and what it holds."""
    return (
        f"Put `{release.file}` into the manual directory (ncljax: `data.manual_dir`, default "
        f"`<data_dir>/downloads/manual/{release.name}`). It is the {release.title} feature "
        "file read by the MRL code, https://github.com/penghu-cs/MRL (its loader "
        f"src/noisydataset.py reads data/{release.mrl_folder}/{release.file}); MRL's "
        f"paper/dataset.md gives the original dataset: {release.origin}. Expected layout: "
        f"{_LAYOUTS[release.kind]}."
    )


def missing_file(path: str, release: Release) -> FileNotFoundError:
    """The error for a released file missing at ``path``."""
    return FileNotFoundError(
        f"{release.title} is not prepared and its released file is missing: expected {path}. "
        f"Put {release.file} (the feature file read by MRL, https://github.com/penghu-cs/MRL, "
        f"as data/{release.mrl_folder}/{release.file}; original data: {release.origin}) in "
        f"{os.path.dirname(path)}, or set data.manual_dir to the folder that holds it. "
        f"Expected layout: {_LAYOUTS[release.kind]}."
    )


def _layout_error(path: str, kind: str, problem: str) -> ValueError:
    return ValueError(f"{path}: {problem}. Expected layout: {_LAYOUTS[kind]}.")


# ------------------------------------------------------------------ HDF5 and MATLAB files


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


class Part(NamedTuple):
    """Rows ``[start, stop)`` of a file part, making up one split of the prepared data."""

    image: str
    text: str
    start: int
    stop: int
    labels_image: np.ndarray  # int64 [stop - start], shifted to start at 0
    labels_text: np.ndarray


class Plan(NamedTuple):
    """Where each split's rows are in the file, and what preparation records about it."""

    parts: dict[str, Part]  # split -> where its rows are
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


def plan(path: str, kind: str, *, split_rule: str, valid_len: int, float16: bool) -> Plan:
    """Checks ``path`` against the released layout and plans the three splits.

    Args:
      path: the released file.
      kind: its ``Release.kind``.
      split_rule: ``data.split_rule`` (ignored for a file with given validation rows).
      valid_len: ``data.valid_len``.
      float16: whether the features are stored as float16 (recorded in the metadata).

    Returns:
      Each split's rows and labels, and the metadata preparation records: the source
      file and its SHA-256, the split rule applied and each split's origin, the label
      offset, the class count, the feature sizes and every split's image labels.

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
    if num_classes < 2:
        fields = sorted(parts[prefix].fields[role] for prefix, role in labels)
        raise ValueError(
            f"{path}: every label ({', '.join(fields)}) is class {offset}: the file holds a "
            "single class, and category retrieval (mAP) and label noise need at least 2; "
            "check that these fields hold the class ids, or use the released file."
        )
    rows, rule = _split_rows(path, kind, parts, split_rule, valid_len)
    splits, origin = {}, {}
    for split, (part, start, stop) in rows.items():
        splits[split] = Part(
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
        "float16": bool(float16),
        # Kept here as well as in the records so that a run reads them without a pass over
        # the split (seconds for NUS-WIDE).
        "image_labels": {split: part.labels_image.tolist() for split, part in splits.items()},
    }
    return Plan(splits, metadata)


# ------------------------------------------------------------------ reading the pairs


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


def read_pairs(
    path: str, kind: str, split: str, part: Part, *, float16: bool
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yields ``(index, image, text)`` for the rows of ``part`` in order.

    ``index`` counts from 0 within the split; the features are float32 (float16 if
    ``float16``), checked: finite, and neither modality all zero. An all-zero row may be
    legitimate; a split whose image (or text) features are all zero is a placeholder, on
    which a collapsed model would score perfectly, and is refused once its last pair has
    been yielded (the one pass that reads the file).

    Raises:
      ValueError: naming the file, the array and the rows.
    """
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
                yield start - part.start + j, images[j], texts[j]
    for name, nonzero in seen_nonzero.items():
        if not nonzero:
            raise ValueError(
                f"{path}: the features of split '{split}' ({name}, rows {part.start} to "
                f"{part.stop - 1}) are all zero; the file is probably a placeholder or was "
                "not written completely: download it again or re-extract the features."
            )
