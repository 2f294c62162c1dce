"""Flickr30K, MS-COCO, CC152K and NoW in the SCAN/NCR "precomp" layout, as TFDS builders.

The released files are put in ``data.manual_dir`` once (see each builder's
``MANUAL_DOWNLOAD_INSTRUCTIONS``); the first run checks them and prepares two TFDS
datasets per benchmark in ``data.data_dir``, written in index order to ArrayRecord:

* config ``images`` (or ``images_float16``): ``regions`` ``[36, D]`` and ``index``;
* config ``captions`` (NoW: ``captions_{tokenizer}``): ``tokens`` (variable length,
  ``<start> ... <end>``), ``image_index`` and ``index``,

so reading a caption never decodes an image. Later runs read them with
``as_data_source`` by random access; nothing is loaded whole into memory.

Released layouts (splits ``train``, ``val`` and ``test`` come from the file prefixes
``train``, ``dev`` and ``test``; MS-COCO's ``test`` is ``testall``, its 5K images; the 1K
protocol is the evaluator's 5-fold option):

* ``{prefix}_ims.npy``: float ``[n_img, 36, 2048]`` BUTD region features (NoW: 768).
* Flickr30K, MS-COCO: ``{prefix}_caps.txt``, one caption per line, 5 per image
  (caption ``k`` describes image ``k // 5``).
* CC152K: ``{prefix}_caps.tsv``, tab-separated with the caption in column 1 (read with
  Python's ``csv`` module as NCR does), one caption per image.
* NoW: ``{prefix}_caps_{tokenizer}.txt``, one caption per line as comma-separated token
  ids (empty fields ignored), one caption per image; ``<start>`` and ``<end>`` ids come
  from its vocabulary.
* Vocabularies ``vocab/{f30k,coco,cc152k}_precomp_vocab.json`` and
  ``vocab/now100k_precomp_vocab_{tokenizer}.json`` (``ncljax.data.vocab``). Without the
  vocabulary file (not NoW) one is built from the training captions, keeping the words
  seen at least ``data.vocab_threshold`` times, and recorded with the prepared data.

Preparation reads one image at a time from the memory-mapped ``.npy`` files and needs
no TensorFlow; its memory peaks at about 1.1 GB (TFDS's in-memory sort buffer), whatever
the size of the split. Regions are stored as raw float32 (or float16: half the disk)
bytes, which ArrayRecord compresses.

Nothing is silently truncated: ``data.max_length`` is the padded caption length (0:
the longest caption) and a shorter positive value is an error. A split whose region
features are all zero (a placeholder file) is refused. Validation uses the
first ``data.val_images`` images of ``dev`` and their captions (NCR: 1000 images for
Flickr30K and MS-COCO).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from ncljax.data import prepared, sources
from ncljax.data import vocab as vocab_lib

NUM_REGIONS = 36
SPLITS = ("train", "val", "test")
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
      folder: the released folder name; ``aliases`` are other accepted names.
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
        if self.captions == "ids":
            return f"{prefix}_caps_{tokenizer}.txt"
        return f"{prefix}_caps.{self.captions}"

    def layout(self, tokenizer: str = "{tokenizer}") -> str:
        """The expected files, for instructions and error messages."""
        cpi = self.captions_per_image
        kind = {
            "txt": f"one caption per line, {cpi} lines per image (caption k describes image "
            f"k // {cpi})",
            "tsv": "tab-separated 'id<TAB>caption', one line per image",
            "ids": "one caption per line as comma-separated token ids, one line per image",
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


# ---------------------------------------------------------------- the released files


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
        raise _missing(release, first, looked, tokenizer)
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
        f"{release.name}: {path} is malformed: {problem}. Expected layout: {release.layout()}"
    )


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


def read_token_ids(release: Release, path: str, vocab_size: int) -> list[list[int]]:
    """Token ids of a NoW ``_caps_{tokenizer}.txt`` file, checked against the vocabulary."""
    captions = []
    for line_number, line in enumerate(read_lines(release, path), 1):
        try:
            ids = [int(field) for field in line.split(",") if field.strip()]
        except ValueError as err:
            raise _malformed(
                release, path, f"line {line_number} is not comma-separated integers ({err})"
            ) from err
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


# ---------------------------------------------------------------- TFDS builders


@dataclasses.dataclass(eq=False)
class PrecompConfig(tfds.core.BuilderConfig):
    """``part``: ``'images'`` or ``'captions'``; ``float16``: store regions as float16;
    ``tokenizer``: NoW's caption files."""

    part: str = "images"
    float16: bool = False
    tokenizer: str = ""


def _configs(tokenizers: Sequence[str] = ()) -> list[PrecompConfig]:
    configs = [
        PrecompConfig(name="images", description="region features, float32"),
        PrecompConfig(name="images_float16", float16=True, description="regions, float16"),
    ]
    for tokenizer in tokenizers or ("",):
        name = f"captions_{tokenizer}" if tokenizer else "captions"
        configs.append(PrecompConfig(name=name, part="captions", tokenizer=tokenizer))
    return configs


class _PrecompBuilder(prepared.Builder, skip_registration=True):
    """Shared code of the precomp builders; a subclass sets ``RELEASE``."""

    RELEASE: ClassVar[Release]
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
            shape = (NUM_REGIONS, self.RELEASE.region_dim)
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
        files = locate(release, manual, config.tokenizer, captions=not images)
        inspected = {s: inspect_images(release, p) for s, p in files.images.items()}
        num_images = {s: int(shape[0]) for s, (shape, _) in inspected.items()}
        self.info.metadata.update(
            release=release.folder,
            num_images=num_images,
            captions_per_image=release.captions_per_image,
        )
        if images:
            self.info.metadata.update(
                region_dim=release.region_dim,
                num_regions=NUM_REGIONS,
                float16=config.float16,
                source_dtype={s: str(dtype) for s, (_, dtype) in inspected.items()},
            )
            return {
                s: self._generate_examples(split=s, path=p, num_images=num_images[s])
                for s, p in files.images.items()
            }
        captions, vocab = self._read_all_captions(files, num_images)
        self.info.metadata.update(
            vocab_size=vocab.size,
            vocab=dict(vocab.word2idx),
            vocab_source=vocab.source,
            vocab_threshold=0 if files.vocab else self._vocab_threshold,
            tokenizer=config.tokenizer,
            max_length={s: max(len(c) for c in caps) for s, caps in captions.items()},
        )
        return {s: self._generate_examples(captions=caps) for s, caps in captions.items()}

    def _read_all_captions(self, files: Files, num_images: dict[str, int]):
        """Reads, checks and encodes every split's captions; returns them and the vocab."""
        release = self.RELEASE
        if release.captions == "ids":
            vocab = vocab_lib.load(files.vocab)
            ids = {s: read_token_ids(release, p, vocab.size) for s, p in files.captions.items()}
            encoded = {s: [[vocab.start, *c, vocab.end] for c in v] for s, v in ids.items()}
        else:
            raw = {s: read_captions(release, p) for s, p in files.captions.items()}
            if files.vocab is None:
                vocab = vocab_lib.build_vocab(raw["train"], self._vocab_threshold)
            else:
                vocab = vocab_lib.load(files.vocab)
            encoded = {s: [vocab.encode(c) for c in v] for s, v in raw.items()}
        for split, caps in encoded.items():
            path = files.captions[split]
            _check_count(release, path, len(caps), num_images[split], files.images[split])
        return encoded, vocab

    def _generate_examples(self, *, split="", path="", num_images=0, captions=()):
        """Images of ``path`` (``images`` configs) or the encoded ``captions``, in order."""
        if self.builder_config.part == "images":
            yield from self._generate_images(split, path, num_images)
            return
        cpi = self.RELEASE.captions_per_image
        for k, tokens in enumerate(captions):
            example = {"tokens": np.asarray(tokens, np.int32), "image_index": k // cpi, "index": k}
            yield prepared.ordered_key(k, len(captions)), example

    def _generate_images(self, split: str, path: str, num_images: int):
        """The images of ``path``, checked: finite, and not all zero.

        An all-zero row is a legitimate image (padding); a split whose features are all
        zero is a placeholder file, on which a collapsed model would score a perfect
        recall. Whether any value is non-zero is known from the one pass that writes.
        """
        float16 = self.builder_config.float16
        seen_nonzero = False
        for i, regions in enumerate(_iter_images(path)):
            if not np.isfinite(regions).all():
                raise ValueError(
                    f"{self.RELEASE.name}: image {i} of {path} holds NaN or Inf values; the "
                    "file is corrupt: download it again."
                )
            if float16 and np.abs(regions).max() > _FLOAT16_MAX:
                raise ValueError(
                    f"{self.RELEASE.name}: image {i} of {path} holds values beyond the float16 "
                    f"range (|x| > {_FLOAT16_MAX:g}); set data.float16=False."
                )
            seen_nonzero = seen_nonzero or bool(regions.any())
            regions = regions.astype(np.float16) if float16 else regions
            yield prepared.ordered_key(i, num_images), {"regions": regions, "index": i}
        if not seen_nonzero:
            raise ValueError(
                f"{self.RELEASE.name}: the region features of split '{split}' in {path} are "
                "all zero; the file is probably a placeholder or was not written completely: "
                "download or re-extract the features."
            )


def _instructions(release: Release) -> str:
    return (
        f"Put the released files of {release.folder} in the manual directory "
        f"(data.manual_dir): {release.layout()} They are published as {release.published}."
    )


class F30kPrecomp(_PrecompBuilder):
    """Flickr30K: 29,000 / 1,014 (dev) / 1,000 images, 5 captions each, BUTD regions."""

    name = "f30k_precomp"
    RELEASE = RELEASES["f30k"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(RELEASE)
    BUILDER_CONFIGS: ClassVar[list[PrecompConfig]] = _configs()


class CocoPrecomp(_PrecompBuilder):
    """MS-COCO: 113,287 / 5,000 (dev) / 5,000 (testall) images, 5 captions each."""

    name = "coco_precomp"
    RELEASE = RELEASES["coco"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(RELEASE)
    BUILDER_CONFIGS: ClassVar[list[PrecompConfig]] = _configs()


class Cc152kPrecomp(_PrecompBuilder):
    """CC152K (NCR's Conceptual Captions subset, real noise): 150,000 / 1,000 / 1,000 pairs."""

    name = "cc152k_precomp"
    RELEASE = RELEASES["cc152k"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(RELEASE)
    BUILDER_CONFIGS: ClassVar[list[PrecompConfig]] = _configs()


class Now100kPrecomp(_PrecompBuilder):
    """NoW (PC2's Noise of Web): 98,000 / 1,000 / 1,000 pairs, 768-d regions, token ids."""

    name = "now100k_precomp"
    RELEASE = RELEASES["now"]
    MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(RELEASE)
    BUILDER_CONFIGS: ClassVar[list[PrecompConfig]] = _configs(TOKENIZERS)


BUILDERS = {
    "f30k": F30kPrecomp,
    "coco": CocoPrecomp,
    "cc152k": Cc152kPrecomp,
    "now": Now100kPrecomp,
}


# ---------------------------------------------------------------- reading


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
    builders = [
        BUILDERS[release.name](
            config=config,
            data_dir=prepared.data_dir(cfg),
            file_format="array_record",
            vocab_threshold=cfg.vocab_threshold,
        )
        for config in configs
    ]
    if not all(b.is_prepared() for b in builders):
        locate(release, manual, tokenizer)  # fail before any slow preparation
    image_sources, caption_sources = (prepared.prepare(b, manual) for b in builders)
    image_meta, caption_meta = (b.info.metadata for b in builders)
    if dict(image_meta["num_images"]) != dict(caption_meta["num_images"]):
        raise ValueError(
            f"The prepared images ({builders[0].data_dir}) and captions "
            f"({builders[1].data_dir}) of {release.name} have different numbers of images "
            f"({dict(image_meta['num_images'])} vs {dict(caption_meta['num_images'])}): "
            "they were prepared from different files. Delete both and prepare again."
        )
    _check_vocab(cfg, caption_meta, os.fspath(builders[1].data_dir))
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
            for split in SPLITS
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


@sources.register("f30k")
def _make_f30k(cfg) -> PrecompDataset:
    return PrecompDataset(cfg)


@sources.register("coco")
def _make_coco(cfg) -> PrecompDataset:
    return PrecompDataset(cfg)


@sources.register("cc152k")
def _make_cc152k(cfg) -> PrecompDataset:
    return PrecompDataset(cfg)


@sources.register("now")
def _make_now(cfg) -> PrecompDataset:
    return PrecompDataset(cfg)


def default_config(name: str):
    """The ``data`` config section of precomp benchmark ``name`` (f30k, coco, cc152k, now).

    Fields: ``name``; ``manual_dir`` (the released files; default
    ``<data_dir>/downloads/manual/<name>``); ``data_dir`` (prepared data; default
    ``~/tensorflow_datasets``); ``float16`` (store regions as float16: half the disk,
    float16 precision); ``max_length`` (padded caption length, 0: the longest caption);
    ``vocab_threshold`` (when no vocabulary file is given); ``tokenizer`` (NoW's caption
    files: bpe, bert or jieba); ``val_images`` (validation images, the first of ``dev``;
    0: all).
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
