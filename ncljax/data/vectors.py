r"""A folder of your own vectors: image and caption embeddings from any encoder, no code.

``data.name='vectors'`` reads ``data.folder``, which holds, for each split ``train``,
``val`` and ``test``:

=========================  ==========================================================
file                       content
=========================  ==========================================================
``{split}_images.npy``     float16/float32 ``[num_images, D_img]``
``{split}_texts.npy``      float16/float32 ``[num_images * captions_per_image, D_txt]``;
                           caption ``k`` describes image ``k // captions_per_image``
``{split}_labels.npy``     optional: int ``[num_images]`` class ids ``0 .. C-1``, ``C``
                           at most the folder's number of images (mAP and the
                           noisy-label methods); in every split or in none
``{split}_captions.txt``   optional: one caption per line (UTF-8), in the rows' order
``{split}_image_ids.txt``  optional: one image id per line (a file name or URL)
=========================  ==========================================================

``captions_per_image`` is inferred (text rows / image rows, the same whole number in
every split), ``num_classes`` too (the largest label + 1). The text files may end their
lines with ``\n``, ``\r\n`` or ``\r``, and a leading UTF-8 byte-order mark is dropped;
they are read only for display and export (``display_texts``); the training pairs are
the folder's own, so a crawl's mismatched pairs are in the folder itself
(``from_synthetic`` writes one).

Nothing is prepared and nothing is written into the folder: ``.npy`` arrays are already
random-access, so they are memory-mapped (``np.memmap``) and a training pair reads two
rows. Opening the folder checks every file and refuses a malformed one with one message
naming the file and the problem (a missing or unreadable file, a pickled array: nothing
is unpickled, a header that promises more data than the file holds, shape, dtype,
dimensions that differ between splits, NaN/inf values, all-zero rows, line counts or
labels that disagree with the arrays). The value checks read each array once in chunks
of ``CHUNK_BYTES`` with plain file reads, so the process holds one chunk at a time and
not the mapped file (measured in ``benchmarks/vectors_reader.py``: about a second per
2 GB from the page cache).
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import mmap
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ncljax.data import sources

EXTENSIONS = {
    "images": "_images.npy",
    "texts": "_texts.npy",
    "labels": "_labels.npy",
    "captions": "_captions.txt",
    "image_ids": "_image_ids.txt",
}
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
CHUNK_BYTES = 16 << 20  # the value checks read this much of an array at a time
_SHOWN = 5  # indices named in a message
LAYOUT = (
    "a vectors folder holds {split}_images.npy (float16/float32 [num_images, D_img]) and "
    "{split}_texts.npy ([num_images * captions_per_image, D_txt]) for the splits train, val "
    "and test, optionally {split}_labels.npy, {split}_captions.txt and {split}_image_ids.txt"
)


def default_config(name: str = "vectors"):
    """The ``data`` config section of a vectors folder.

    Fields: ``name``; ``folder`` (the folder of ``.npy`` files; see the module docstring);
    ``require_labels`` (refuse a folder without ``{split}_labels.npy``: set by the
    noisy-label configs, which evaluate mAP over the labels).
    """
    import ml_collections

    if name != "vectors":
        raise ValueError(f"Unknown vectors dataset {name!r}; the only one is 'vectors'.")
    return ml_collections.ConfigDict(dict(name="vectors", folder="", require_labels=False))


def path_of(folder: str, split: str, kind: str) -> str:
    """The path of file ``kind`` (``images``, ``texts``, ``labels``, ``captions``,
    ``image_ids``) of ``split`` in ``folder``."""
    return os.path.join(folder, split + EXTENSIONS[kind])


def size_hint(cfg, split: str, needed: int) -> str:
    """What sizes ``split`` (see ``sources.size_hint``): the rows of its files."""
    return (
        f"put at least {needed} images (and their captions) in {split}_images.npy and "
        f"{split}_texts.npy of data.folder={cfg.folder}"
    )


def _folder(data_config) -> str:
    """``data.folder``, checked: set, and an existing directory."""
    if isinstance(data_config, (str, os.PathLike)):
        folder = os.fspath(data_config)
    else:
        folder = data_config.folder
    if not folder:
        raise ValueError(
            "data.folder is empty: pass the folder of your vectors with "
            f"--config.data.folder=DIR ({LAYOUT})."
        )
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"data.folder={folder} is not a directory: pass the folder of your vectors ({LAYOUT})."
        )
    _check_readable(folder)
    return folder


def _present(path: str) -> bool:
    """Whether the file ``path`` of a folder is there: a regular file (or a link to one),
    False where nothing is.

    Raises:
      ValueError: something else holds its name (a folder, a link to nothing, a pipe), so
        that it is neither read as absent nor opened (a pipe would block).
    """
    if os.path.isfile(path):
        return True
    if not os.path.lexists(path):
        return False
    if os.path.isdir(path):
        what = "a folder"
    elif os.path.islink(path) and not os.path.exists(path):
        what = f"a link to {os.readlink(path)}, which does not exist"
    else:
        what = "not a regular file"
    raise ValueError(f"{path} is {what}: put the file itself there, or remove it.")


def _check_readable(path: str) -> None:
    """Refuses a file, or a folder, that this process may not read (its permissions):
    the files of a folder without them would look absent.

    Raises:
      PermissionError: naming ``path``.
    """
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionError(
                f"The folder {path} cannot be read (permission denied): give the user running "
                f"this read and search access to it (e.g. chmod a+rx {path})."
            )
    elif not os.access(path, os.R_OK):
        raise PermissionError(
            f"{path} cannot be read (permission denied): give the user running this read "
            f"access to it (e.g. chmod a+r {path})."
        )


# ----------------------------------------------------------------------------- arrays


@dataclasses.dataclass(frozen=True)
class NpyHeader:
    """What the header of ``.npy`` file ``path`` says; the data starts at byte ``offset``."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int


def read_header(path: str, save_as: str = "float32") -> NpyHeader:
    """The header of ``.npy`` file ``path``, without reading its data.

    Args:
      path: the file.
      save_as: the numpy dtype that the advice to save a refused pickled array names.

    Raises:
      PermissionError: the file may not be read.
      ValueError: the file is not a ``.npy`` array, is a pickled array of Python objects
        (nothing is unpickled), or its header is impossible: a negative dimension, or more
        data than the file holds.
    """
    _check_readable(path)
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read is None:
                raise ValueError(f"format version {version}, which numpy cannot map")
            shape, fortran_order, dtype = read(f)
        except ValueError as e:
            raise ValueError(
                f"{path} is not a .npy array file: {e}; write the array with np.save(path, array)."
            ) from None
        offset = f.tell()
    header = NpyHeader(path, tuple(shape), np.dtype(dtype), fortran_order, offset)
    if header.dtype.hasobject:
        raise ValueError(
            f"{path} holds a pickled array of Python objects (dtype {header.dtype}), refused "
            "for safety: unpickling a file can run code; save a plain numeric array with "
            f"np.save(path, np.asarray(array, np.{save_as}), allow_pickle=False)."
        )
    if any(d < 0 for d in header.shape):
        raise ValueError(
            f"{path} has a damaged header: its shape {header.shape} has a negative dimension; "
            "write it again with np.save."
        )
    # Python integers: a damaged header's huge shape cannot wrap around to a small size.
    nbytes = math.prod(header.shape) * header.dtype.itemsize
    size = os.path.getsize(path) - offset
    if size < nbytes:
        raise ValueError(
            f"{path} is truncated: its header says shape {header.shape} {header.dtype} "
            f"({nbytes} bytes of data) but it holds {size} bytes; write it again."
        )
    return header


def _check_matrix(header: NpyHeader, what: str) -> None:
    """A non-empty 2-D float16/float32 array, C-ordered."""
    path, shape = header.path, header.shape
    if len(shape) != 2:
        raise ValueError(
            f"{path} holds an array of shape {shape}; expected a 2-D array {what} "
            "(one vector per row)."
        )
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"{path} holds an empty array of shape {shape}; expected {what}.")
    if header.dtype.fields is not None or header.dtype.subdtype is not None:
        raise ValueError(
            f"{path} has the structured dtype {header.dtype}; expected a plain float16 or "
            "float32 array (numpy.lib.recfunctions.structured_to_unstructured converts one)."
        )
    if header.dtype not in FLOAT_DTYPES or header.dtype.byteorder == ">":
        raise ValueError(
            f"{path} has dtype {header.dtype}; expected float16 or float32 (convert it, e.g. "
            "np.save(path, array.astype(np.float32)))."
        )
    if header.fortran_order and shape[0] > 1 and shape[1] > 1:
        raise ValueError(
            f"{path} is stored column-major (Fortran order), so a row is not contiguous and "
            "random access would read the whole file; save np.ascontiguousarray(array)."
        )


def _memmap(header: NpyHeader) -> np.memmap:
    return np.memmap(
        header.path, dtype=header.dtype, mode="r", offset=header.offset, shape=header.shape
    )


def _first(indices: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in indices[:_SHOWN])
    return shown + (", ..." if indices.size > _SHOWN else "")


def check_values(header: NpyHeader) -> None:
    """Refuses NaN/inf values and all-zero rows of a float16/float32 matrix, read in
    chunks of ``CHUNK_BYTES`` with file reads (not through a mapping: the process then
    holds one chunk, not the pages of the whole file).

    A value is finite exactly when its exponent bits are not all ones, and zero when all
    its bits but the sign are zero, so one masked maximum per row decides both.

    Raises:
      ValueError: naming the file, how many rows are bad and the first of them.
    """
    rows, dim = header.shape
    unsigned = np.dtype(f"<u{header.dtype.itemsize}")
    exponent, magnitude = {2: (0x7C00, 0x7FFF), 4: (0x7F800000, 0x7FFFFFFF)}[unsigned.itemsize]
    chunk_rows = max(1, CHUNK_BYTES // (dim * unsigned.itemsize))
    buffer = np.empty((min(chunk_rows, rows), dim), unsigned)
    not_finite, zero = [], []
    with open(header.path, "rb") as f:
        f.seek(header.offset)
        for start in range(0, rows, chunk_rows):
            part = buffer[: min(chunk_rows, rows - start)]
            f.readinto(memoryview(part).cast("B"))
            np.bitwise_and(part, magnitude, out=part)
            largest = part.max(axis=1)
            not_finite.append(start + np.flatnonzero(largest >= exponent))
            zero.append(start + np.flatnonzero(largest == 0))
    not_finite, zero = np.concatenate(not_finite), np.concatenate(zero)
    if not_finite.size:
        raise ValueError(
            f"{header.path} holds NaN or infinite values in {not_finite.size} of its {rows} "
            f"rows (first: {_first(not_finite)}); recompute or drop those vectors."
        )
    if zero.size:
        raise ValueError(
            f"{header.path} has {zero.size} all-zero rows of {rows} (first: {_first(zero)}); "
            "a zero vector has no direction for the cosine: drop those pairs or give them "
            "their real vectors."
        )


# ----------------------------------------------------------------------------- text files


def _breaks(data: bytes, after: bytes) -> int:
    """Line breaks in ``data``, which follows the byte ``after``: each ``\\n``, ``\\r\\n``
    and lone ``\\r`` counts one, so a ``\\n`` right after an ``after`` of ``\\r`` none."""
    completes = after == b"\r" and data.startswith(b"\n")
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n") - completes


def count_lines(path: str) -> int:
    """Lines of a UTF-8 text file, read in chunks: line breaks (``\\n``, ``\\r\\n`` or
    ``\\r``), plus one for a last line without one (so ``'a\\nb'`` and ``'a\\nb\\n'`` both
    hold 2 lines); a leading byte-order mark is skipped.

    Raises:
      PermissionError: the file may not be read.
      ValueError: the file is not UTF-8 (naming the line).
    """
    _check_readable(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines, tail = 0, b""  # tail: the last byte read (a CRLF may span two chunks)
    with open(path, "rb") as f:
        if f.read(len(codecs.BOM_UTF8)) != codecs.BOM_UTF8:
            f.seek(0)
        while chunk := f.read(CHUNK_BYTES):
            held = len(decoder.getstate()[0])  # a character's first bytes, from the last chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                line = lines + _breaks(chunk[: max(0, e.start - held)], tail) + 1
                raise ValueError(f"{path} is not UTF-8 (line {line}); save it as UTF-8.") from None
            lines += _breaks(chunk, tail)
            tail = chunk[-1:]
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 (its last line); save it as UTF-8.") from None
    return lines + (tail not in (b"", b"\n", b"\r"))


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file as ``count_lines`` counts them, without their line
    breaks and without a leading byte-order mark."""
    _check_readable(path)
    # newline=None reads \r\n and \r as \n; utf-8-sig drops a leading byte-order mark.
    with open(path, encoding="utf-8-sig", newline=None) as f:
        lines = f.read().split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _line_starts(data: np.ndarray) -> np.ndarray:
    """Where each line of the bytes ``data`` begins, and where the last one ends: int64
    ``[lines + 1]``, lines as :func:`count_lines` counts them (a leading byte-order mark
    skipped). Scans ``CHUNK_BYTES`` at a time: the temporaries are the chunk's."""
    size = data.size
    first = len(codecs.BOM_UTF8) if data[: len(codecs.BOM_UTF8)].tobytes() == codecs.BOM_UTF8 else 0
    parts = [np.array([first], np.int64)]
    for lo in range(first, size, CHUNK_BYTES):
        chunk = data[lo : min(lo + CHUNK_BYTES, size)]
        feeds, returns = np.flatnonzero(chunk == 10), np.flatnonzero(chunk == 13)
        after = returns + (lo + 1)  # a \r that a \n follows breaks with the \n
        crlf = np.zeros(returns.size, bool)
        crlf[after < size] = data[after[after < size]] == 10
        parts.append(np.union1d(feeds, returns[~crlf]).astype(np.int64) + (lo + 1))
    starts = np.concatenate(parts)
    return starts if starts[-1] == size else np.append(starts, np.int64(size))


_LINES_AT_ONCE = 1 << 16  # lines decoded at a time when iterating or searching


class TextLines(Sequence):
    """The lines of a UTF-8 text file, each read from the memory-mapped file when asked
    for: the process keeps one int64 offset per line, not the text (a crawl's captions
    held as Python strings cost over 100 bytes each). The lines are :func:`read_lines`'s
    (line breaks ``\\n``, ``\\r\\n`` or ``\\r``, a leading byte-order mark dropped); an
    integer gives a ``str``, a slice a ``list``, and :meth:`take` many lines at once. The
    file is not checked here: the folder's checks (:func:`display_texts`) read it once as
    UTF-8 first.

    Raises:
      PermissionError: the file may not be read.
    """

    def __init__(self, path: str):
        _check_readable(path)
        self.path = path
        if os.path.getsize(path) == 0:  # mmap refuses an empty file
            self._buffer, self._bytes = b"", np.zeros(0, np.uint8)
        else:
            with open(path, "rb") as f:
                self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._bytes = np.frombuffer(self._buffer, np.uint8)
        self._starts = _line_starts(self._bytes)

    def __len__(self) -> int:
        return self._starts.size - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        return self.take([index])[0]

    def take(self, indices) -> list[str]:
        """The lines at ``indices`` (integers; negative ones count from the end)."""
        n = len(self)
        k = np.asarray(indices, np.int64).reshape(-1)
        k = np.where(k < 0, k + n, k)
        if k.size and (k.min() < 0 or k.max() >= n):
            bad = np.asarray(indices).reshape(-1)[(k < 0) | (k >= n)][0]
            raise IndexError(f"line {bad} of {n} in {self.path}")
        start, stop = self._starts[k], self._starts[k + 1]
        if k.size:  # the line break at the end: \r\n, \n or \r
            last = self._bytes[np.maximum(stop - 1, 0)]
            before = self._bytes[np.maximum(stop - 2, 0)]
            crlf = (last == 10) & (before == 13) & (stop - 2 >= start)
            stop = stop - np.where(crlf, 2, ((last == 10) | (last == 13)).astype(np.int64))
        text = self._buffer
        return [
            text[a:b].decode("utf-8") for a, b in zip(start.tolist(), stop.tolist(), strict=True)
        ]

    def __iter__(self):
        for lo in range(0, len(self), _LINES_AT_ONCE):
            yield from self.take(np.arange(lo, min(lo + _LINES_AT_ONCE, len(self))))

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        """The first line equal to ``value`` in ``[start, stop)``, read in blocks.

        Raises:
          ValueError: no such line.
        """
        first, last, _ = slice(start, stop).indices(len(self))
        for lo in range(first, last, _LINES_AT_ONCE):
            block = self.take(np.arange(lo, min(lo + _LINES_AT_ONCE, last)))
            if value in block:
                return lo + block.index(value)
        raise ValueError(f"{value!r} is not a line of {self.path}")

    def __repr__(self) -> str:
        return f"TextLines({self.path!r}, {len(self)} lines)"


# ----------------------------------------------------------------------------- the folder


@dataclasses.dataclass(frozen=True)
class _SplitFiles:
    images: NpyHeader
    texts: NpyHeader
    labels: str | None  # path, when present
    captions: str | None
    image_ids: str | None


def _read_vectors(folder: str, split: str) -> tuple[NpyHeader, NpyHeader]:
    """The checked headers of ``split``'s image and text vectors."""
    images = read_header(path_of(folder, split, "images"))
    _check_matrix(images, "[num_images, D_img]")
    texts = read_header(path_of(folder, split, "texts"))
    _check_matrix(texts, "[num_images * captions_per_image, D_txt]")
    return images, texts


def _locate(folder: str, require_labels: bool) -> dict[str, _SplitFiles]:
    """The files of every split, their headers read and checked one by one."""
    required = ["images", "texts"] + (["labels"] if require_labels else [])
    missing = [
        split + EXTENSIONS[kind]
        for split in sources.SPLITS
        for kind in required
        if not _present(path_of(folder, split, kind))
    ]
    if missing:
        why = " (this config evaluates over class labels: data.require_labels=True)"
        raise FileNotFoundError(
            f"data.folder={folder} lacks {', '.join(missing)}"
            f"{why if require_labels and any('labels' in m for m in missing) else ''}: "
            f"{LAYOUT}."
        )
    with_labels = [s for s in sources.SPLITS if _present(path_of(folder, s, "labels"))]
    if with_labels and len(with_labels) < len(sources.SPLITS):
        absent = [s + EXTENSIONS["labels"] for s in sources.SPLITS if s not in with_labels]
        raise FileNotFoundError(
            f"data.folder={folder} has labels for {', '.join(with_labels)} but lacks "
            f"{', '.join(absent)}: give {{split}}_labels.npy in every split or in none."
        )
    files = {}
    for split in sources.SPLITS:
        images, texts = _read_vectors(folder, split)
        optional = {
            kind: path if _present(path := path_of(folder, split, kind)) else None
            for kind in ("labels", "captions", "image_ids")
        }
        files[split] = _SplitFiles(images, texts, **optional)
    return files


def _check_dims(folder: str, files: Mapping[str, _SplitFiles]) -> None:
    for kind in ("images", "texts"):
        headers = [getattr(f, kind) for f in files.values()]
        dims = {h.shape[1] for h in headers}
        if len(dims) > 1:
            listed = ", ".join(f"{os.path.basename(h.path)} {h.shape}" for h in headers)
            raise ValueError(
                f"The {kind} vectors of the splits in {folder} have different dimensions "
                f"({listed}): every split must come from the same encoder."
            )


def _captions_per_image(folder: str, files: Mapping[str, _SplitFiles]) -> int:
    """Text rows / image rows: the same whole number in every split."""
    ratios = {s: f.texts.shape[0] / f.images.shape[0] for s, f in files.items()}
    if len(set(ratios.values())) == 1 and next(iter(ratios.values())).is_integer():
        return int(next(iter(ratios.values())))
    listed = "; ".join(
        f"{os.path.basename(f.texts.path)} {f.texts.shape} / "
        f"{os.path.basename(f.images.path)} {f.images.shape} = {ratios[s]:g}"
        for s, f in files.items()
    )
    raise ValueError(
        "captions_per_image (text rows / image rows) must be the same whole number in every "
        f"split, caption k describing image k // captions_per_image; in {folder}: {listed}."
    )


def _check_lines(split_files: _SplitFiles) -> None:
    for kind, header, unit in (
        ("captions", split_files.texts, "caption"),
        ("image_ids", split_files.images, "image id"),
    ):
        path = getattr(split_files, kind)
        if path is None:
            continue
        lines, rows = count_lines(path), header.shape[0]
        if lines != rows:
            raise ValueError(
                f"{path} has {lines} lines but {os.path.basename(header.path)} has {rows} "
                f"rows: one {unit} per line, in the order of the rows (a line break inside "
                "one counts as two lines)."
            )


def _read_labels(path: str, num_images: int, max_classes: int) -> np.ndarray:
    """The class ids of ``path``: int64 ``[num_images]``, each in ``[0, max_classes)``
    (the folder's number of images: a larger id is a numbering to redo, not a number of
    classes to allocate)."""
    header = read_header(path, save_as="int64")
    if header.shape != (num_images,):
        raise ValueError(
            f"{path} holds an array of shape {header.shape}; expected ({num_images},): one "
            "class id per image (row) of the split's images."
        )
    if header.dtype.kind not in "iu":
        raise ValueError(
            f"{path} has dtype {header.dtype}; expected integer class ids (e.g. "
            "np.save(path, labels.astype(np.int64)))."
        )
    labels = np.load(path, allow_pickle=False)
    negative = np.flatnonzero(labels < 0)
    if negative.size:
        raise ValueError(
            f"{path} holds {negative.size} negative labels (first at rows {_first(negative)}); "
            "class ids are 0, 1, ..., num_classes - 1."
        )
    # Compared unsigned (all are >= 0): a uint64 id above 2**63 stays large.
    too_large = np.flatnonzero(labels.astype(np.uint64) >= max_classes)
    if too_large.size:
        raise ValueError(
            f"{path} holds {too_large.size} class ids of {max_classes} or more (first at rows "
            f"{_first(too_large)}; the largest is {labels.max()}), but the folder's "
            f"{max_classes} images hold at most {max_classes} classes: number the classes "
            "0, 1, ..., num_classes - 1, alike in every split (e.g. np.unique of all the "
            "splits' labels with return_inverse=True)."
        )
    labels = labels.astype(np.int64)
    labels.flags.writeable = False
    return labels


class VectorsSplit:
    """One split of a vectors folder; implements ``sources.SplitSource``.

    Attributes:
      images: the memory-mapped image vectors ``[num_images, D_img]`` (float16/float32,
        read-only), for code that reads them in bulk (embedding export).
      texts: the memory-mapped caption vectors ``[num_captions, D_txt]``.
    """

    def __init__(self, images: np.memmap, texts: np.memmap, labels: np.ndarray | None, name):
        self.images, self.texts, self._name = images, texts, name
        # Rows of plain views: indexing an np.memmap runs its subclass hooks on every row.
        self._image_rows, self._text_rows = images.view(np.ndarray), texts.view(np.ndarray)
        self.num_images, self.num_captions = images.shape[0], texts.shape[0]
        self.captions_per_image = self.num_captions // self.num_images
        if labels is None:
            labels = np.full(self.num_images, -1, np.int64)
            labels.flags.writeable = False
        self._labels = labels

    def _check(self, index: int, size: int, what: str, fields, allowed: str, option: str):
        if not 0 <= index < size:
            raise IndexError(f"{self._name}: {what} index {index} out of range [0, {size}).")
        self._check_fields(fields, allowed, option)

    def _check_fields(self, fields, allowed: str, option: str):
        unknown = [f for f in fields if f != allowed]
        if unknown:
            raise ValueError(
                f"{self._name} holds global vectors only: {unknown} are not available; set "
                f"{option}."
            )

    def image(self, index: int, fields: Sequence[str] = ("global_image",)) -> dict:
        """Image ``index``: ``label`` (int64, -1 without labels) and ``global_image``
        (float32 ``[D_img]``)."""
        index = int(index)
        self._check(
            index, self.num_images, "image", fields, "global_image", "model.image_input='global'"
        )
        out = {"label": np.int64(self._labels[index])}
        if "global_image" in fields:
            out["global_image"] = np.array(self._image_rows[index], np.float32)
        return out

    def caption(self, index: int, fields: Sequence[str] = ("global_text",)) -> dict:
        """Caption ``index``: its image's ``label`` and ``global_text`` (float32
        ``[D_txt]``)."""
        index = int(index)
        self._check(
            index, self.num_captions, "caption", fields, "global_text", "model.text_input='global'"
        )
        out = {"label": np.int64(self._labels[index // self.captions_per_image])}
        if "global_text" in fields:
            out["global_text"] = np.array(self._text_rows[index], np.float32)
        return out

    def images_at(self, indices: np.ndarray, fields: Sequence[str] = ("global_image",)) -> dict:
        """Images ``indices`` at once: what :meth:`image` gives for each, stacked, with
        the vectors in the folder's dtype (float16 stays float16: numpy widens half floats
        at about 1.3 million 512-d rows per second on one core, five times slower than the
        gather, so ``pipeline.to_device`` widens them on the device instead)."""
        indices = self._indices(indices, self.num_images, "image")
        self._check_fields(fields, "global_image", "model.image_input='global'")
        out = {"label": self._labels[indices]}
        if "global_image" in fields:
            out["global_image"] = self._image_rows[indices]
        return out

    def captions_at(self, indices: np.ndarray, fields: Sequence[str] = ("global_text",)) -> dict:
        """Captions ``indices`` at once: what :meth:`caption` gives for each, stacked, with
        the vectors in the folder's dtype."""
        indices = self._indices(indices, self.num_captions, "caption")
        self._check_fields(fields, "global_text", "model.text_input='global'")
        out = {"label": self._labels[indices // self.captions_per_image]}
        if "global_text" in fields:
            out["global_text"] = self._text_rows[indices]
        return out

    def _indices(self, indices, size: int, what: str) -> np.ndarray:
        indices = np.asarray(indices, np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= size):
            bad = indices[(indices < 0) | (indices >= size)][0]
            raise IndexError(f"{self._name}: {what} index {bad} out of range [0, {size}).")
        return indices

    def image_labels(self) -> np.ndarray:
        """Image labels, int64 ``[num_images]`` (``-1`` without labels; read-only)."""
        return self._labels


class VectorsDataset:
    """A checked vectors folder; implements ``sources.Dataset``.

    Args:
      cfg: the ``data`` config section (see ``default_config``).

    Raises:
      FileNotFoundError: ``data.folder`` or a required file is missing.
      ValueError: a malformed file (one message naming it and the problem).
    """

    def __init__(self, cfg):
        self.folder = _folder(cfg)
        files = _locate(self.folder, cfg.get("require_labels", False))
        _check_dims(self.folder, files)
        cpi = _captions_per_image(self.folder, files)
        num_images = sum(f.images.shape[0] for f in files.values())
        labels = {}
        for split, split_files in files.items():
            _check_lines(split_files)
            if split_files.labels is not None:
                labels[split] = _read_labels(
                    split_files.labels, split_files.images.shape[0], num_images
                )
        for split_files in files.values():
            check_values(split_files.images)
            check_values(split_files.texts)
        self._splits = {
            split: VectorsSplit(
                _memmap(f.images), _memmap(f.texts), labels.get(split), f"vectors/{split}"
            )
            for split, f in files.items()
        }
        num_classes = max((int(x.max()) + 1 for x in labels.values()), default=0)
        self.info = sources.DatasetInfo(
            name="vectors",
            captions_per_image=cpi,
            num_classes=num_classes,
            vocab_size=0,
            max_length=0,
            num_regions=0,
            region_dim=0,
            image_dim=files["train"].images.shape[1],
            text_dim=files["train"].texts.shape[1],
            split_sizes={s: (x.num_images, x.num_captions) for s, x in self._splits.items()},
        )

    def split(self, name: str) -> VectorsSplit:
        if name not in self._splits:
            raise ValueError(f"Unknown split {name!r}; a vectors folder has {list(self._splits)}.")
        return self._splits[name]


@sources.register("vectors")
def _make(cfg) -> VectorsDataset:
    return VectorsDataset(cfg)


def display_texts(data_config, split: str) -> tuple[TextLines | None, TextLines | None]:
    """The image ids and captions of ``split`` for display and export.

    Args:
      data_config: the ``data`` config section (or the folder's path).
      split: ``train``, ``val`` or ``test``.

    Returns:
      ``(image_ids, captions)``: the lines of ``{split}_image_ids.txt`` (one per image)
      and ``{split}_captions.txt`` (one per caption) as :class:`TextLines` (each line
      read when asked for), each None when the file is absent.

    Raises:
      FileNotFoundError: the folder or the split's vectors are missing.
      PermissionError: a file or the folder may not be read.
      ValueError: a malformed array header or text file, or a line count that disagrees
        with the split's arrays (checked against their headers; the values are not read).
    """
    if split not in sources.SPLITS:
        raise ValueError(f"Unknown split {split!r}; a vectors folder has {list(sources.SPLITS)}.")
    folder = _folder(data_config)
    files = {
        kind: path_of(folder, split, kind) for kind in ("images", "texts", "captions", "image_ids")
    }
    present = {k: p if _present(p) else None for k, p in files.items()}
    for kind in ("images", "texts"):
        if present[kind] is None:
            raise FileNotFoundError(f"data.folder={folder} lacks {os.path.basename(files[kind])}.")
    split_files = _SplitFiles(
        *_read_vectors(folder, split), None, present["captions"], present["image_ids"]
    )
    _check_lines(split_files)
    return tuple(
        None if p is None else TextLines(p) for p in (present["image_ids"], present["captions"])
    )


# ----------------------------------------------------------------------------- writing


def write_folder(folder: str, splits: Mapping[str, Mapping], *, dtype=None) -> str:
    """Writes a vectors folder from arrays (the tests' and the README's helper).

    Args:
      folder: created if needed; files of the same names are replaced.
      splits: ``{split: dict(images=[n, D_img], texts=[n * cpi, D_txt], labels=None or int
        [n], captions=None or [n * cpi] strings, image_ids=None or [n] strings)}``; only
        ``images`` and ``texts`` are required.
      dtype: cast the vectors to this dtype (``np.float16`` halves the files); None keeps
        the arrays' own.

    Returns:
      ``folder``.

    Raises:
      ValueError: a caption or id with a line break (it would count as two lines).
    """
    os.makedirs(folder, exist_ok=True)
    for split, arrays in splits.items():
        for kind in ("images", "texts"):
            array = np.asarray(arrays[kind])
            np.save(path_of(folder, split, kind), array if dtype is None else array.astype(dtype))
        if arrays.get("labels") is not None:
            np.save(path_of(folder, split, "labels"), np.asarray(arrays["labels"]))
        for kind in ("captions", "image_ids"):
            lines = arrays.get(kind)
            if lines is None:
                continue
            broken = [i for i, line in enumerate(lines) if "\n" in line or "\r" in line]
            if broken:
                raise ValueError(
                    f"{split} {kind} {broken[:_SHOWN]} hold a line break; the file holds one "
                    "per line: replace line breaks with spaces."
                )
            with open(path_of(folder, split, kind), "w", encoding="utf-8", newline="\n") as f:
                f.writelines(line + "\n" for line in lines)
    return folder


def _render(tokens: np.ndarray, length: int, world, cfg) -> str:
    """A synthetic caption's words: ``attribute<a>``, ``object<c>``, ``filler<f>``."""
    words = []
    for t in tokens[1 : length - 1]:  # without <start> and <end>
        t = int(t)
        if t < world.attr0:
            words.append(f"object{(t - world.noun0) // cfg.synonyms}")
        elif t < world.filler0:
            words.append(f"attribute{t - world.attr0}")
        else:
            words.append(f"filler{t - world.filler0}")
    return " ".join(words)


def mismatch_texts(num_captions: int, captions_per_image: int, *, rate: float, seed: int):
    """Which caption's text each row of a lying folder holds, and which rows lie.

    The draw is ``noise.correspondence_noise``'s per-caption protocol (exact: every chosen
    caption is paired with another image): caption ``k`` goes with image
    ``image_index[k]``. Row ``k`` of the written texts then holds a caption of image
    ``image_index[k]``, the chosen captions' texts permuted among the chosen rows (the
    ``i``-th chosen row for image ``m`` takes the ``i``-th chosen caption of ``m``), so no
    text is duplicated or lost.

    Returns:
      ``(source, mismatched)``: int64 ``[num_captions]``, the caption whose text row ``k``
      holds, and bool ``[num_captions]``, row ``k`` does not describe image
      ``k // captions_per_image``.
    """
    from ncljax.data import noise

    made = noise.correspondence_noise(
        num_captions, captions_per_image, rate=rate, seed=seed, protocol="per_caption"
    )
    own = np.arange(num_captions) // captions_per_image
    chosen = np.flatnonzero(made.image_index != own)
    source = np.arange(num_captions, dtype=np.int64)
    # Both orders group the chosen rows by image; matching them pairs each row with a
    # caption of its new image (the counts per image agree: a permutation of images).
    by_target = chosen[np.argsort(made.image_index[chosen], kind="stable")]
    source[by_target] = chosen  # chosen is sorted, hence grouped by its own image
    return source, ~made.clean


def from_synthetic(
    folder: str,
    *,
    world: str = "small_global",
    num_train: int | None = None,
    num_val: int | None = None,
    num_test: int | None = None,
    noise_rate: float = 0.2,
    seed: int = 0,
    labels: bool = False,
    dtype=np.float32,
) -> np.ndarray:
    """Writes a vectors folder of the synthetic world's global vectors whose training
    split lies: a ``noise_rate`` share of its captions describe another image.

    The vectors are the embedded generator's ``global_image`` / ``global_text``
    (``ncljax.data.synthetic``) under the data settings of world ``world``
    (``ncljax.data.worlds``); ``captions`` render each caption's words
    (``attribute3 object17 ...``) and ``image_ids`` name the images (``train/000042``).
    Validation and test are clean. The mismatches are ``mismatch_texts``'s.

    Args:
      folder: where to write (created if needed).
      world: a world of ``ncljax.data.worlds`` (its ``data`` fields and sizes).
      num_train, num_val, num_test: images per split (None: the world's).
      noise_rate: share of the training captions that describe another image.
      seed: the generator's and the mismatches' seed.
      labels: also write ``{split}_labels.npy`` (the latent classes).
      dtype: of the written vectors.

    Returns:
      bool ``[num_train * captions_per_image]``: training pair ``k`` is mismatched (the
      ground truth, which no method may read).
    """
    from ncljax.data import synthetic, worlds

    cfg = synthetic.default_config()
    cfg.update(dict(worlds.get(world).data))
    cfg.seed, cfg.cache = seed, False
    for field, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
        if value is not None:
            cfg[field] = value
    dataset = synthetic.SyntheticDataset(cfg)
    splits, mismatched = {}, None
    for split in sources.SPLITS:
        source = dataset.split(split)
        images = np.stack(
            [source.image(i, ("global_image",))["global_image"] for i in range(source.num_images)]
        )
        texts, captions = [], []
        for k in range(source.num_captions):
            caption = source.caption(k, ("tokens", "length", "global_text"))
            texts.append(caption["global_text"])
            captions.append(_render(caption["tokens"], caption["length"], dataset._world, cfg))
        texts, captions = np.stack(texts), np.array(captions, dtype=object)
        if split == "train":
            order, mismatched = mismatch_texts(
                source.num_captions, source.captions_per_image, rate=noise_rate, seed=seed
            )
            texts, captions = texts[order], captions[order]
        splits[split] = dict(
            images=images,
            texts=texts,
            captions=list(captions),
            image_ids=[f"{split}/{i:06d}" for i in range(source.num_images)],
            labels=source.image_labels() if labels else None,
        )
    write_folder(folder, splits, dtype=dtype)
    return mismatched
