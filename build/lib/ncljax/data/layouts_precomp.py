"""The released files of Flickr30K, MS-COCO, CC152K and NoW (the SCAN/NCR "precomp" layout).

Where each file goes, what it holds, and how it is read and checked. The released files
are put in ``data.manual_dir`` once; ``ncljax.data.builders`` prepares them with the
functions here and ``ncljax.data.precomp`` reads the prepared data.

Layouts (splits ``train``, ``val`` and ``test`` come from the file prefixes ``train``,
``dev`` and ``test``; MS-COCO's ``test`` is ``testall``, its 5K images; the 1K protocol
is the evaluator's 5-fold option):

* ``{prefix}_ims.npy``: float ``[n_img, 36, 2048]`` BUTD region features (NoW: 768).
* Flickr30K, MS-COCO: ``{prefix}_caps.txt``, one caption per line, 5 per image
  (caption ``k`` describes image ``k // 5``).
* CC152K: ``{prefix}_caps.tsv``, tab-separated with the caption in column 1 (read with
  Python's ``csv`` module as NCR does), one caption per image.
* NoW: ``{prefix}_caps_{tokenizer}.txt`` (tokenizer ``bpe``, ``bert`` or ``jieba``), one
  caption per line as comma-separated integer token ids (empty fields ignored), one
  caption per image; each caption is ``[<start>, ids as given..., <end>]`` with the
  ``<start>`` and ``<end>`` ids of its vocabulary. ``{prefix}_ids.txt`` (each pair's index
  in the authors' 500K collection) is not read. NoW's README names the folder
  ``h5100k_precomp``, PC2's code ``now100k_precomp``: either is accepted.
* Vocabularies ``vocab/{f30k,coco,cc152k}_precomp_vocab.json`` and
  ``vocab/now100k_precomp_vocab_{tokenizer}.json`` (``ncljax.data.vocab``). The
  embedding-table size is the JSON ``idx`` field (NoW: 10,000 for bpe, 32,702 for bert,
  56,271 for jieba), not ``len(word2idx)``. Without the vocabulary file (not NoW) one is
  built from the training captions, keeping the words seen at least
  ``data.vocab_threshold`` times.

The folders may sit in ``<manual_dir>/`` or ``<manual_dir>/data/``. Images are read one
at a time from the memory-mapped ``.npy`` files. A missing file raises a
``FileNotFoundError`` and a malformed one a ``ValueError``, each naming the file, the
expected layout and where the files are published; a split whose region features are
all zero (a placeholder file) is refused.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
from collections.abc import Iterator, Sequence

import numpy as np

from ncljax.data import vocab as vocab_lib

NUM_REGIONS = 36
TOKENIZERS = ("bpe", "bert", "jieba")
_FLOAT16_MAX = float(np.finfo(np.float16).max)
_SCAN = (
    "the SCAN precomp features and vocabularies (github.com/kuanghuei/SCAN, 'Download "
    "data': data.zip and vocab.zip), also redistributed with NCR's data "
    "(github.com/XLearning-SCU/2021-NeurIPS-NCR, NCR-data.tar)"
)


@dataclasses.dataclass(frozen=True)
class Release:
    """How one benchmark's files are laid out.

    Attributes:
      name: registry name (``data.name``).
      folder: the released folder name (also the prepared data's TFDS name); ``aliases``
        are other accepted names.
      region_dim: region feature size ``D``.
      captions_per_image: captions per image in every split.
      captions: ``'txt'`` (one caption per line), ``'tsv'`` (caption in column 1) or
        ``'ids'`` (comma-separated token ids per line).
      prefixes: ``{split: file prefix}``.
      vocab_file: vocabulary file name (``{tokenizer}`` filled in for NoW).
      published: where the files are published.
      val_images: default ``data.val_images``.
    """

    name: str
    folder: str
    region_dim: int
    captions_per_image: int
    captions: str
    prefixes: dict[str, str]
    vocab_file: str
    published: str
    val_images: int = 0
    aliases: tuple[str, ...] = ()

    def caption_file(self, prefix: str, tokenizer: str) -> str:
        """The caption file name of file prefix ``prefix``."""
        if self.captions == "ids":
            return f"{prefix}_caps_{tokenizer}.txt"
        return f"{prefix}_caps.{self.captions}"

    def layout(self, tokenizer: str = "") -> str:
        """The expected files, for instructions and error messages (NoW: of ``tokenizer``,
        or of every tokenizer when it is empty)."""
        tokenizer = tokenizer or "{" + ",".join(TOKENIZERS) + "}"
        cpi = self.captions_per_image
        kind = {
            "txt": f"one caption per line, {cpi} lines per image (caption k describes image "
            f"k // {cpi})",
            "tsv": "tab-separated 'id<TAB>caption', one line per image",
            "ids": "one caption per line as comma-separated integer token ids (e.g. "
            "'12,507,33'; empty fields are ignored), one line per image (the *_ids.txt "
            "files are not read)",
        }[self.captions]
        names = ", ".join(
            f"{p}_ims.npy, {self.caption_file(p, tokenizer)}" for p in self.prefixes.values()
        )
        vocab_note = (
            "required"
            if self.captions == "ids"
            else "optional: built from the training captions with data.vocab_threshold when absent"
        )
        also = f" (or {', '.join(self.aliases)}/)" if self.aliases else ""
        return (
            f"<manual_dir>/{self.folder}/{also} holding {names}; each *_ims.npy a float "
            f"array [n_img, {NUM_REGIONS}, {self.region_dim}], each caption file {kind}; and "
            f"<manual_dir>/vocab/{self.vocab_file.format(tokenizer=tokenizer)} ({vocab_note}). "
            f"The folders may also sit in <manual_dir>/data/."
        )


_PREFIXES = {"train": "train", "val": "dev", "test": "test"}
RELEASES = {
    "f30k": Release(
        name="f30k",
        folder="f30k_precomp",
        region_dim=2048,
        captions_per_image=5,
        captions="txt",
        prefixes=_PREFIXES,
        vocab_file="f30k_precomp_vocab.json",
        published=_SCAN,
        val_images=1000,
    ),
    "coco": Release(
        name="coco",
        folder="coco_precomp",
        region_dim=2048,
        captions_per_image=5,
        captions="txt",
        prefixes={**_PREFIXES, "test": "testall"},
        vocab_file="coco_precomp_vocab.json",
        published=_SCAN,
        val_images=1000,
    ),
    "cc152k": Release(
        name="cc152k",
        folder="cc152k_precomp",
        region_dim=2048,
        captions_per_image=1,
        captions="tsv",
        prefixes=_PREFIXES,
        vocab_file="cc152k_precomp_vocab.json",
        published="NCR's CC152K release (github.com/XLearning-SCU/2021-NeurIPS-NCR, "
        "NCR-data.tar: data/cc152k_precomp and vocab/cc152k_precomp_vocab.json)",
    ),
    "now": Release(
        name="now",
        folder="now100k_precomp",
        aliases=("h5100k_precomp",),
        region_dim=768,
        captions_per_image=1,
        captions="ids",
        prefixes=_PREFIXES,
        vocab_file="now100k_precomp_vocab_{tokenizer}.json",
        published="the NoW dataset on HuggingFace (huggingface.co/datasets/NJUyued/NoW, "
        "NoW.zip; its README names the folder h5100k_precomp, PC2's code now100k_precomp)",
    ),
}


def instructions(release: Release) -> str:
    """Where to put the released files and where they are published."""
    return (
        f"Put the released files of {release.folder} in the manual directory "
        f"(data.manual_dir): {release.layout()} They are published as {release.published}."
    )


# ---------------------------------------------------------------- finding the files


@dataclasses.dataclass(frozen=True)
class Files:
    """Paths of one release's files: ``images``/``captions`` ``{split: path}``, ``vocab``
    (``None`` when absent)."""

    images: dict[str, str]
    captions: dict[str, str]
    vocab: str | None


def _missing(release: Release, what: str, looked: Sequence[str], tokenizer: str):
    return FileNotFoundError(
        f"{release.name}: {what} not found; looked for {', '.join(looked)}. Expected layout: "
        f"{release.layout(tokenizer)} Download {release.published}."
    )


def locate(release: Release, manual: str, tokenizer: str = "", *, captions: bool = True) -> Files:
    """Finds the released files under ``manual`` (only the ``_ims.npy`` files when
    ``captions`` is False).

    Raises:
      FileNotFoundError: naming the missing file, the expected layout and where the
        files are published.
    """
    manual = os.path.expanduser(manual)
    folders = (release.folder, *release.aliases)
    roots = [os.path.join(manual, *sub, f) for f in folders for sub in ((), ("data",))]
    roots.append(manual)
    first = f"{release.prefixes['train']}_ims.npy"
    root = next((r for r in roots if os.path.isfile(os.path.join(r, first))), None)
    if root is None:
        looked = [os.path.join(r, first) for r in roots]
        where = " or ".join(f"{folder}/" for folder in folders)
        raise _missing(release, f"{first} (in {where})", looked, tokenizer)
    images, caption_files = {}, {}
    for split, prefix in release.prefixes.items():
        wanted = [(images, f"{prefix}_ims.npy")]
        if captions:
            wanted.append((caption_files, release.caption_file(prefix, tokenizer)))
        for table, name in wanted:
            path = os.path.join(root, name)
            if not os.path.isfile(path):
                raise _missing(release, name, [path], tokenizer)
            table[split] = path
    if not captions:
        return Files(images, caption_files, None)
    name = release.vocab_file.format(tokenizer=tokenizer)
    dirs = [os.path.join(manual, "vocab"), os.path.join(manual, "data", "vocab"), root, manual]
    looked = list(dict.fromkeys(os.path.join(d, name) for d in dirs))
    vocab_path = next((p for p in looked if os.path.isfile(p)), None)
    if vocab_path is None and release.captions == "ids":
        raise _missing(release, name, looked, tokenizer)
    return Files(images, caption_files, vocab_path)


def _malformed(release: Release, path: str, problem: str) -> ValueError:
    return ValueError(
        f"{release.name}: {path} is malformed: {problem}. Expected layout: {release.layout()} "
        f"Replace it with the released file: download {release.published} again."
    )


# ---------------------------------------------------------------- the region features


def inspect_images(release: Release, path: str) -> tuple[tuple[int, ...], np.dtype]:
    """Checks a ``{prefix}_ims.npy`` file (its header only: the array is memory-mapped).

    Returns:
      Its shape ``(n_img, 36, D)`` and dtype.
    """
    try:
        ims = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise _malformed(release, path, f"it cannot be read as a .npy array ({err})") from err
    expected = f"[n_img, {NUM_REGIONS}, {release.region_dim}]"
    if ims.ndim != 3 or ims.shape[1:] != (NUM_REGIONS, release.region_dim) or not len(ims):
        raise _malformed(release, path, f"it has shape {list(ims.shape)}, expected {expected}")
    if not np.issubdtype(ims.dtype, np.floating):
        raise _malformed(release, path, f"it holds {ims.dtype}, expected float32 {expected}")
    if not ims.flags.c_contiguous:
        raise _malformed(release, path, "it is stored in Fortran order, expected C order")
    return ims.shape, ims.dtype


def _iter_images(path: str, chunk: int = 256) -> Iterator[np.ndarray]:
    """Yields the images of a ``.npy`` file one at a time as float32 ``[36, D]``.

    Each chunk of images is mapped, copied out and unmapped, so the pages read stay out
    of this process's resident memory (one mapping of the whole file would hold them all).
    """
    header = np.load(path, mmap_mode="r", allow_pickle=False)
    n, row_shape, dtype, offset = len(header), header.shape[1:], header.dtype, header.offset
    row_bytes = int(np.prod(row_shape)) * dtype.itemsize
    del header
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        block = np.memmap(
            path, dtype, "r", offset=offset + start * row_bytes, shape=(count, *row_shape)
        )
        for row in block:
            yield np.array(row, np.float32)
        del block


def read_images(release: Release, split: str, path: str, *, float16: bool) -> Iterator[np.ndarray]:
    """Yields the images of ``path`` in order, ``[36, D]`` float32 (float16 if ``float16``).

    Each is checked: finite, within the float16 range if ``float16``. An all-zero image
    is a legitimate image (padding); a split whose features are all zero is a
    placeholder file, on which a collapsed model would score a perfect recall, and is
    refused once its last image has been yielded (the one pass that reads the file).

    Raises:
      ValueError: naming the file and the image.
    """
    seen_nonzero = False
    for i, regions in enumerate(_iter_images(path)):
        if not np.isfinite(regions).all():
            raise ValueError(
                f"{release.name}: image {i} of {path} holds NaN or Inf values; the "
                "file is corrupt: download it again."
            )
        if float16 and np.abs(regions).max() > _FLOAT16_MAX:
            raise ValueError(
                f"{release.name}: image {i} of {path} holds values beyond the float16 "
                f"range (|x| > {_FLOAT16_MAX:g}); set data.float16=False."
            )
        seen_nonzero = seen_nonzero or bool(regions.any())
        yield regions.astype(np.float16) if float16 else regions
    if not seen_nonzero:
        raise ValueError(
            f"{release.name}: the region features of split '{split}' in {path} are "
            "all zero; the file is probably a placeholder or was not written completely: "
            "download or re-extract the features."
        )


# ---------------------------------------------------------------- the captions


def _read_text(release: Release, path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _malformed(release, path, f"it is not UTF-8 text ({err})") from err


def read_lines(release: Release, path: str) -> list[str]:
    """The lines of a text file, split on ``\n`` only and stripped (as NCR reads them)."""
    lines = _read_text(release, path).split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines]


def read_captions(release: Release, path: str) -> list[str]:
    """Raw captions of a ``_caps.txt`` or ``_caps.tsv`` file, in file order.

    A ``.tsv`` file is read with ``csv.reader(delimiter='\t')``, as NCR reads it (so a
    caption in double quotes loses its quotes).
    """
    if release.captions == "txt":
        return read_lines(release, path)
    rows = csv.reader(io.StringIO(_read_text(release, path), newline=""), delimiter="\t")
    captions = []
    try:
        for row in rows:
            if len(row) < 2:
                raise _malformed(
                    release,
                    path,
                    f"row {rows.line_num} has {len(row)} column(s), expected id<TAB>caption",
                )
            captions.append(row[1].strip())
    except csv.Error as err:
        raise _malformed(release, path, f"row {rows.line_num} is not TSV ({err})") from err
    return captions


def _is_integer(field: str) -> bool:
    """Whether ``int(field)`` succeeds."""
    try:
        int(field)
    except ValueError:
        return False
    return True


def read_token_ids(release: Release, path: str, vocab_size: int) -> list[list[int]]:
    """Token ids of a NoW ``_caps_{tokenizer}.txt`` file, as given, checked against the
    vocabulary: one caption per line, its ids separated by commas; empty fields (``,,``,
    a trailing comma) are ignored, and an empty line is a caption without tokens.

    Raises:
      ValueError: a field that is not an integer, or an id outside ``[0, vocab_size)``.
    """
    captions = []
    for line_number, line in enumerate(read_lines(release, path), 1):
        fields = [field for field in line.split(",") if field.strip()]
        try:
            ids = [int(field) for field in fields]
        except ValueError:
            bad = next(field for field in fields if not _is_integer(field))
            raise _malformed(
                release,
                path,
                f"line {line_number} is not comma-separated integers: field {bad.strip()!r} "
                "is not an integer token id",
            ) from None
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise _malformed(
                release,
                path,
                f"line {line_number} holds token id {bad[0]} outside the vocabulary "
                f"[0, {vocab_size}); check that the caption file and the vocabulary file "
                "come from the same tokenizer",
            )
        captions.append(ids)
    return captions


def _check_count(release: Release, path: str, found: int, num_images: int, ims: str) -> None:
    cpi = release.captions_per_image
    if found != cpi * num_images:
        raise _malformed(
            release,
            path,
            f"it has {found} captions, expected {cpi} x {num_images} images of "
            f"{os.path.basename(ims)} = {cpi * num_images} (caption k describes image k // "
            f"{cpi}); the file may be truncated or belong to another split",
        )


def encode_captions(
    release: Release, files: Files, num_images: dict[str, int], vocab_threshold: int
) -> tuple[dict[str, list[list[int]]], vocab_lib.Vocabulary]:
    """Reads, checks and encodes every split's captions.

    Args:
      release: the benchmark.
      files: its files (``locate``).
      num_images: images per split, for the caption counts.
      vocab_threshold: words kept when the vocabulary is built (no vocabulary file).

    Returns:
      ``{split: token ids of each caption, with <start> and <end>}`` and the vocabulary.
    """
    if release.captions == "ids":
        vocab = vocab_lib.load(files.vocab)
        ids = {s: read_token_ids(release, p, vocab.size) for s, p in files.captions.items()}
        encoded = {s: [[vocab.start, *c, vocab.end] for c in v] for s, v in ids.items()}
    else:
        raw = {s: read_captions(release, p) for s, p in files.captions.items()}
        if files.vocab is None:
            vocab = vocab_lib.build_vocab(raw["train"], vocab_threshold)
        else:
            vocab = vocab_lib.load(files.vocab)
        encoded = {s: [vocab.encode(c) for c in v] for s, v in raw.items()}
    for split, caps in encoded.items():
        path = files.captions[split]
        _check_count(release, path, len(caps), num_images[split], files.images[split])
    return encoded, vocab
