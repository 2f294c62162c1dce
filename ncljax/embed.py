r"""From raw pairs to a vectors folder: images and captions embedded by a pretrained
image-text encoder, ready for ``ncljax train --config=<method>:vectors``.

  ncljax embed --pairs=pairs.tsv --images=photos/ --out=my_pairs \
      --encoder=open_clip:ViT-B-32:laion2b_s34b_b79k      # pip install 'ncljax[embed]'

``--pairs`` is a tab-separated file, one pair per line: ``image<TAB>caption``, or
``split<TAB>image<TAB>caption`` with the split ``train``, ``val`` or ``test`` (a first
line ``image<TAB>caption`` or ``split<TAB>image<TAB>caption`` is read as a header).
``image`` is a path under ``--images``. Without a split column the images are split at
random (``--val_fraction``, ``--test_fraction``, ``--seed``; every caption of an image
goes with it). A vectors folder holds the same number of captions for every image of a
split: each image keeps its first ``--captions_per_image`` captions (default: the
smallest count among the images), and an image with fewer is left out (the command says
how many).

The folder gets ``{split}_images.npy`` and ``{split}_texts.npy`` (float16, each vector of
unit length), ``{split}_image_ids.txt`` (the image paths), ``{split}_captions.txt`` and
``embedding.json`` (the encoder, and ``shared_space``: whether images and captions are
vectors of one space, as CLIP's are, so that ``ncljax audit`` also ranks the pairs by
their raw cosine). Encoding runs in batches (``--batch_size``) with a progress bar, and
is resumable: every ``--chunk`` items are saved under ``--out``/``.embed/``, and running
the same command again after a stop encodes only what is missing.

Encoders (``--encoder``):

- ``open_clip:<model>:<pretrained>``: an open_clip model and its weights (``pip install
  'ncljax[embed]'``; the weights are downloaded once by open_clip, to its cache; e.g.
  ``open_clip:ViT-B-32:laion2b_s34b_b79k``). ``open_clip:<model>:none`` is the model
  randomly initialised (no download: for trying the command offline).
- ``random:<dim>``: a fixed random projection of 32 x 32 pixels and of hashed words,
  ``<dim>``-wide; no dependency beyond Pillow. It sees nothing of meaning: use it to try
  the pipeline, never to train.

A missing image, an unreadable line or a bad flag is reported in one line.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import sys
import zlib
from collections.abc import Sequence

import numpy as np

from ncljax.data import vectors

SPLITS = ("train", "val", "test")
SPACE_FILE = "embedding.json"  # read by ncljax.audit (shares_space)
_WORK = ".embed"  # under --out: the saved chunks of an embedding in progress


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The pairs of one split: its images (paths) and each image's captions."""

    images: list[str]
    captions: list[list[str]]


def read_pairs(path: str) -> list[tuple[str | None, str, str]]:
    """``(split or None, image, caption)`` per line of the pairs file.

    Raises:
      ValueError: a line that is not ``image<TAB>caption`` or
        ``split<TAB>image<TAB>caption``, an unknown split, an empty caption.
    """
    rows = []
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for number, fields in enumerate(csv.reader(f, delimiter="\t"), start=1):
                if not fields or not any(x.strip() for x in fields):
                    continue
                if number == 1 and [x.strip().lower() for x in fields] in (
                    ["image", "caption"],
                    ["split", "image", "caption"],
                ):
                    continue
                if len(fields) == 2:
                    split, image, caption = None, *fields
                elif len(fields) == 3:
                    split, image, caption = fields
                    if split not in SPLITS:
                        raise ValueError(
                            f"{path} line {number}: split {split!r} is not one of {SPLITS}."
                        )
                else:
                    raise ValueError(
                        f"{path} line {number} has {len(fields)} tab-separated fields; write "
                        "image<TAB>caption or split<TAB>image<TAB>caption."
                    )
                caption = " ".join(caption.split())
                if not caption or not image.strip():
                    raise ValueError(f"{path} line {number}: an empty image or caption.")
                rows.append((split, image.strip(), caption))
    except OSError as e:
        raise ValueError(f"--pairs={path} cannot be read ({e.strerror or e}).") from None
    if not rows:
        raise ValueError(f"--pairs={path} holds no pairs.")
    if len({r[0] is None for r in rows}) > 1:
        raise ValueError(f"{path}: give the split on every line or on none.")
    return rows


def group(
    rows: Sequence[tuple[str | None, str, str]],
    *,
    captions_per_image: int = 0,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    seed: int = 0,
) -> tuple[dict[str, Pairs], int, int]:
    """The splits' images and captions; ``(splits, captions per image, images left out)``.

    Images are in the order of their first line; without a split column they are split at
    random by ``seed`` (at least one image in each split).

    Raises:
      ValueError: a split without images, or fractions that leave no training image.
    """
    captions = collections.OrderedDict()
    split_of = {}
    for split, image, caption in rows:
        captions.setdefault(image, []).append(caption)
        if split is not None and split_of.setdefault(image, split) != split:
            raise ValueError(f"Image {image!r} is in two splits ({split_of[image]}, {split}).")
    images = list(captions)
    if not split_of:
        split_of = _random_split(images, val_fraction, test_fraction, seed)
    cpi = captions_per_image or min(len(c) for c in captions.values())
    kept = {s: Pairs([], []) for s in SPLITS}
    dropped = 0
    for image in images:
        if len(captions[image]) < cpi:
            dropped += 1
            continue
        kept[split_of[image]].images.append(image)
        kept[split_of[image]].captions.append(captions[image][:cpi])
    empty = [s for s in SPLITS if not kept[s].images]
    if empty:
        raise ValueError(
            f"No image with {cpi} captions in the {', '.join(empty)} split(s); give more "
            "pairs, other fractions, or --captions_per_image."
        )
    return kept, cpi, dropped


def _random_split(images, val_fraction, test_fraction, seed) -> dict[str, str]:
    n = len(images)
    if not (val_fraction >= 0 and test_fraction >= 0 and val_fraction + test_fraction < 1):
        raise ValueError("--val_fraction and --test_fraction must be >= 0 and sum below 1.")
    num_val = max(1, round(val_fraction * n))
    num_test = max(1, round(test_fraction * n))
    if num_val + num_test >= n:
        raise ValueError(f"{n} images are too few for a train, a val and a test split.")
    order = np.random.default_rng(seed).permutation(n)
    split_of = {}
    for position, i in enumerate(order):
        split_of[images[i]] = (
            "val" if position < num_val else "test" if position < num_val + num_test else "train"
        )
    return split_of


# --- encoders --------------------------------------------------------------------------


class RandomEncoder:
    """A fixed random projection of 32 x 32 RGB pixels and of hashed words (``random:D``):
    the pipeline's stand-in for a real encoder; no meaning, no download."""

    shared_space = False

    def __init__(self, dim: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.dim = dim
        self._pixels = rng.normal(size=(32 * 32 * 3, dim)).astype(np.float32) / 55.4
        self._words = rng.normal(size=(4096, dim)).astype(np.float32)

    def images(self, paths: Sequence[str]) -> np.ndarray:
        from PIL import Image

        rows = []
        for path in paths:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB").resize((32, 32)), np.float32)
            rows.append(pixels.reshape(-1) / 255.0 - 0.5)
        return np.stack(rows) @ self._pixels

    def texts(self, captions: Sequence[str]) -> np.ndarray:
        counts = np.zeros((len(captions), 4096), np.float32)
        for row, caption in enumerate(captions):
            for word in caption.lower().split():
                counts[row, zlib.crc32(word.encode()) % 4096] += 1.0
        return counts @ self._words


class OpenClipEncoder:
    """An open_clip model (``open_clip:<model>:<pretrained>``; ``none``: random weights)."""

    shared_space = True

    def __init__(self, model: str, pretrained: str):
        try:
            import open_clip
            import torch
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "--encoder=open_clip:... needs open_clip: pip install 'ncljax[embed]'."
            ) from None
        self._torch = torch
        weights = None if pretrained.lower() == "none" else pretrained
        self._model, _, self._preprocess = open_clip.create_model_and_transforms(
            model, pretrained=weights
        )
        self._model.eval()
        self._tokenizer = open_clip.get_tokenizer(model)

    def images(self, paths: Sequence[str]) -> np.ndarray:
        from PIL import Image

        batch = []
        for path in paths:
            with Image.open(path) as image:
                batch.append(self._preprocess(image.convert("RGB")))
        with self._torch.no_grad():
            return self._model.encode_image(self._torch.stack(batch)).float().numpy()

    def texts(self, captions: Sequence[str]) -> np.ndarray:
        with self._torch.no_grad():
            return self._model.encode_text(self._tokenizer(list(captions))).float().numpy()


def make_encoder(spec: str):
    """The encoder ``--encoder`` names (see the module doc).

    Raises:
      ValueError: an unknown or malformed name.
    """
    kind, _, rest = spec.partition(":")
    if kind == "random" and rest.isdigit() and int(rest) > 0:
        return RandomEncoder(int(rest))
    if kind == "open_clip" and rest.count(":") == 1 and all(rest.split(":")):
        return OpenClipEncoder(*rest.split(":"))
    raise ValueError(
        f"--encoder={spec!r}: use open_clip:<model>:<pretrained> (e.g. "
        "open_clip:ViT-B-32:laion2b_s34b_b79k; 'none': random weights) or random:<dim>."
    )


# --- the resumable embedding -----------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float16)


def _encode_resumably(encode, items, work: str, name: str, *, chunk: int, batch: int, bar):
    """``encode`` of every item, ``chunk`` at a time saved as ``work/name_<i>.npy`` (a
    chunk already saved is read back, not encoded again)."""
    parts = []
    for number, start in enumerate(range(0, len(items), chunk)):
        path = os.path.join(work, f"{name}_{number:06d}.npy")
        stop = min(start + chunk, len(items))
        if os.path.exists(path):
            parts.append(np.load(path))
            bar.update(stop - start)
            continue
        rows = []
        for first in range(start, stop, batch):
            rows.append(_unit(np.asarray(encode(items[first : min(first + batch, stop)]))))
            bar.update(min(first + batch, stop) - first)
        part = np.concatenate(rows)
        np.save(f"{path}.tmp.npy", part)
        os.replace(f"{path}.tmp.npy", path)  # a chunk is saved whole or not at all
        parts.append(part)
    return np.concatenate(parts)


def embed_folder(
    pairs: str,
    images: str,
    out: str,
    *,
    encoder: str = "open_clip:ViT-B-32:laion2b_s34b_b79k",
    captions_per_image: int = 0,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    seed: int = 0,
    batch_size: int = 64,
    chunk: int = 4096,
    progress: bool = True,
) -> dict:
    """Writes the vectors folder ``out`` from the pairs file and the images folder (see the
    module doc); returns what ``embedding.json`` records.

    Raises:
      ValueError: a bad pairs file, a missing image, a bad flag (one line each).
      ModuleNotFoundError: the encoder's package is not installed.
    """
    import tqdm

    if batch_size < 1 or chunk < 1:
        raise ValueError("--batch_size and --chunk must be at least 1.")
    splits, cpi, dropped = group(
        read_pairs(pairs),
        captions_per_image=captions_per_image,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        seed=seed,
    )
    missing = [
        p for s in SPLITS for p in splits[s].images if not os.path.isfile(os.path.join(images, p))
    ]
    if missing:
        raise ValueError(
            f"{len(missing)} images of {pairs} are not under --images={images} (e.g. "
            f"{missing[0]!r}); give the folder their paths are relative to."
        )
    model = make_encoder(encoder)
    work = os.path.join(out, _WORK)
    os.makedirs(work, exist_ok=True)
    record = {
        "encoder": encoder,
        "shared_space": bool(model.shared_space),
        "captions_per_image": cpi,
        "images_left_out": dropped,
        "pairs": os.path.abspath(pairs),
    }
    with open(os.path.join(work, "settings.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in record.items() if k != "images_left_out"}, f)
    total = sum(len(splits[s].images) * (1 + cpi) for s in SPLITS)
    arrays = {}
    with tqdm.tqdm(total=total, unit="item", disable=not progress, desc="embedding") as bar:
        for split in SPLITS:
            found = splits[split]
            paths = [os.path.join(images, p) for p in found.images]
            texts = [c for per_image in found.captions for c in per_image]
            arrays[split] = dict(
                images=_encode_resumably(
                    model.images,
                    paths,
                    work,
                    f"{split}_images",
                    chunk=chunk,
                    batch=batch_size,
                    bar=bar,
                ),
                texts=_encode_resumably(
                    model.texts,
                    texts,
                    work,
                    f"{split}_texts",
                    chunk=chunk,
                    batch=batch_size,
                    bar=bar,
                ),
                image_ids=found.images,
                captions=texts,
            )
    vectors.write_folder(out, arrays)
    with open(os.path.join(out, SPACE_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    for name in os.listdir(work):
        os.remove(os.path.join(work, name))
    os.rmdir(work)
    return record


def main(argv):
    from ncljax import cli as _cli

    _cli.started()
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    try:
        record = embed_folder(
            f.pairs,
            f.images,
            f.out,
            encoder=f.encoder,
            captions_per_image=f.captions_per_image,
            val_fraction=f.val_fraction,
            test_fraction=f.test_fraction,
            seed=f.seed,
            batch_size=f.batch_size,
            chunk=f.chunk,
            progress=f.progress_bar,
        )
    except (OSError, ValueError, ModuleNotFoundError) as e:
        if f.verbosity > 0:
            raise
        sys.exit(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:
        print("Interrupted; run the same command to go on from the saved chunks.", file=sys.stderr)
        sys.exit(130)
    left = f" ({record['images_left_out']} images with fewer captions left out)"
    print(
        f"Wrote the vectors folder {f.out}: {record['captions_per_image']} captions per image"
        f"{left if record['images_left_out'] else ''}, encoder {record['encoder']}. Next: "
        f"ncljax train --config=gsc:vectors --config.data.folder={f.out}"
    )


if __name__ == "__main__":
    from absl import app, flags

    from ncljax import cli

    flags.DEFINE_string("pairs", None, "Tab-separated pairs: [split<TAB>]image<TAB>caption.")
    flags.DEFINE_string("images", ".", "The folder the pairs' image paths are relative to.")
    flags.DEFINE_string("out", None, "The vectors folder to write.")
    flags.DEFINE_string(
        "encoder",
        "open_clip:ViT-B-32:laion2b_s34b_b79k",
        "open_clip:<model>:<pretrained> ('none': random weights) or random:<dim>.",
    )
    flags.DEFINE_integer("captions_per_image", 0, "Captions kept per image (0: the fewest).")
    flags.DEFINE_float("val_fraction", 0.05, "Images drawn for val (no split column).")
    flags.DEFINE_float("test_fraction", 0.05, "Images drawn for test (no split column).")
    flags.DEFINE_integer("seed", 0, "Seed of the random split.")
    flags.DEFINE_integer("batch_size", 64, "Items per encoder call.")
    flags.DEFINE_integer("chunk", 4096, "Items per saved chunk (the unit of resumption).")
    flags.DEFINE_boolean("progress_bar", True, "Show a progress bar.")
    flags.mark_flags_as_required(["pairs", "out"])
    app.run(main, flags_parser=cli.flags_parser("python -m ncljax.embed"))
