"""The embedded synthetic cross-modal dataset: generated on the spot, deterministic by seed.

A small generative "world" stands in for images and captions so that every method,
test and notebook runs without downloads, through the same code path as the real
benchmarks:

* ``num_classes`` latent classes; each class prefers a core subset of ``num_concepts``
  visual concepts (objects). An image of class ``c`` shows ``concepts_per_image``
  concepts, each drawn from the class core with probability ``class_purity`` and
  uniformly otherwise, and each carrying one of ``num_attributes`` attributes
  (think "red car"). The concept-attribute set identifies an image instance.
* Image side: ``num_regions`` region features ``[R, D]``; one region per concept,
  ``tanh(A (e_concept + w * e_attribute + noise))`` with a fixed random mixing matrix ``A``,
  the remaining regions are background clutter; region order is random. A global
  feature vector (the MLP path) is a second nonlinear view of the mean region.
* Text side: token ids ``<start> ... <end>``: for each concept, with probability
  ``mention_prob``, a phrase of an attribute word (with probability
  ``attribute_mention_prob``) and one of ``synonyms`` nouns for the concept, plus a few
  filler words, in random order. A global text vector (the MLP path) is a nonlinear
  view of the bag of words.
* Labels: the image's class; captions inherit it. The ground-truth pair is caption
  ``k`` with image ``k // captions_per_image``.

Every example is a pure function of ``(seed, split, index)`` (``np.random.default_rng``
streams), so access is random and the dataset scales to millions of pairs without
being held in memory. ``cache=True`` (the default, for small runs) keeps each generated
example, read-only, so later epochs read memory; set ``data.cache=False`` for large sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ncljax.data import sources

PAD, START, END, UNK = 0, 1, 2, 3
_NUM_SPECIAL = 4
_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}
_NUM_BACKGROUND = 16


def _read_only(fn):
    """Wraps an example generator so that the arrays it returns cannot be modified."""

    def wrapped(*args):
        out = fn(*args)
        for value in out.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        return out

    return wrapped


class _World:
    """Fixed random parameters shared by all splits (a function of ``seed``)."""

    def __init__(self, cfg):
        rng = np.random.default_rng((cfg.seed, 1_000_003))
        c, v, d = cfg.num_classes, cfg.num_concepts, cfg.region_dim
        self.core = np.stack(
            [rng.choice(v, size=cfg.core_concepts, replace=False) for _ in range(c)]
        )
        self.concept = rng.normal(size=(v, d)) / np.sqrt(d) * 2.0
        self.attribute = rng.normal(size=(cfg.num_attributes, d)) / np.sqrt(d) * 2.0
        self.background = rng.normal(size=(_NUM_BACKGROUND, d)) / np.sqrt(d) * 2.0
        self.mix = rng.normal(size=(d, d)) / np.sqrt(d) * 1.5
        self.image_view = rng.normal(size=(d, cfg.image_dim)) / np.sqrt(d) * 3.0
        # Vocabulary: specials, concept nouns (synonyms per concept), attribute words, fillers.
        self.noun0 = _NUM_SPECIAL
        self.attr0 = self.noun0 + v * cfg.synonyms
        self.filler0 = self.attr0 + cfg.num_attributes
        self.vocab_size = self.filler0 + cfg.filler_words
        self.word_view = rng.normal(size=(self.vocab_size, cfg.text_dim)) * 1.5


class SyntheticSplit:
    """One split of the synthetic dataset; implements ``sources.SplitSource``."""

    def __init__(self, cfg, world: _World, split: str, num_images: int):
        self._cfg = cfg
        self._world = world
        self._split_id = _SPLIT_IDS[split]
        self.num_images = num_images
        self.captions_per_image = cfg.captions_per_image
        self.num_captions = num_images * cfg.captions_per_image
        # Captions of one image re-derive its latent; cache recent ones (thread-safe).
        self._latent = functools.lru_cache(maxsize=4096)(self._make_latent)
        self._labels = None
        if cfg.cache:  # generate each example once; later epochs read memory
            self._image = functools.cache(_read_only(self._image))
            self._caption = functools.cache(_read_only(self._caption))

    def _rng(self, stream: int, index: int) -> np.random.Generator:
        return np.random.default_rng((self._cfg.seed, self._split_id, stream, index))

    def _check(self, index: int, size: int, what: str) -> None:
        if not 0 <= index < size:
            raise IndexError(f"{what} index {index} out of range [0, {size}).")

    def _make_latent(self, index: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Class, concepts ``[M]`` and attributes ``[M]`` of image ``index``."""
        cfg, rng = self._cfg, self._rng(0, index)
        label = int(rng.integers(cfg.num_classes))
        m = cfg.concepts_per_image
        from_core = rng.random(m) < cfg.class_purity
        core = rng.choice(self._world.core[label], size=m, replace=False)
        anywhere = rng.choice(cfg.num_concepts, size=m, replace=False)
        concepts = np.where(from_core, core, anywhere)
        # Repeated concepts would make two regions identical; keep the first, redraw others.
        _, first = np.unique(concepts, return_index=True)
        dup = np.setdiff1d(np.arange(m), first)
        if dup.size:
            free = np.setdiff1d(np.arange(cfg.num_concepts), concepts)
            concepts[dup] = rng.choice(free, size=dup.size, replace=False)
        attributes = rng.integers(cfg.num_attributes, size=m)
        return label, concepts, attributes

    def image(self, index: int, fields: Sequence[str] = sources.IMAGE_FIELDS) -> dict:
        """Image ``index``: ``label`` and the requested ``fields`` (read-only if cached)."""
        self._check(index, self.num_images, "image")
        return self._image(int(index), tuple(fields))

    def caption(self, index: int, fields: Sequence[str] = sources.TEXT_FIELDS) -> dict:
        """Caption ``index``: ``label`` and the requested ``fields`` (read-only if cached)."""
        self._check(index, self.num_captions, "caption")
        return self._caption(int(index), tuple(fields))

    def _image(self, index: int, fields: tuple[str, ...]) -> dict:
        cfg, world = self._cfg, self._world
        label, concepts, attributes = self._latent(index)
        rng = self._rng(1, index)
        m, r, d = cfg.concepts_per_image, cfg.num_regions, cfg.region_dim
        latent = np.empty((r, d))
        latent[:m] = world.concept[concepts] + cfg.attribute_weight * world.attribute[attributes]
        latent[m:] = world.background[rng.integers(_NUM_BACKGROUND, size=r - m)]
        latent += cfg.region_noise * rng.normal(size=(r, d)) / np.sqrt(d) * 2.0
        regions = np.tanh(latent @ world.mix)[rng.permutation(r)]
        out = {"label": np.int64(label)}
        if "regions" in fields:
            out["regions"] = regions.astype(np.float32)
        if "global_image" in fields:
            pooled = np.tanh(regions.mean(0) @ world.image_view)
            noise = cfg.global_noise * rng.normal(size=pooled.shape)
            out["global_image"] = (pooled + noise).astype(np.float32)
        return out

    def _caption(self, index: int, fields: tuple[str, ...]) -> dict:
        cfg, world = self._cfg, self._world
        label, concepts, attributes = self._latent(index // cfg.captions_per_image)
        rng = self._rng(2, index)
        mentioned = rng.random(concepts.size) < cfg.mention_prob
        if not mentioned.any():
            mentioned[rng.integers(concepts.size)] = True
        phrases = []
        for concept, attribute in zip(concepts[mentioned], attributes[mentioned], strict=True):
            noun = world.noun0 + concept * cfg.synonyms + rng.integers(cfg.synonyms)
            if rng.random() < cfg.attribute_mention_prob:
                phrases.append([world.attr0 + attribute, noun])
            else:
                phrases.append([noun])
        num_fillers = rng.integers(cfg.max_fillers + 1)
        phrases += [[world.filler0 + f] for f in rng.integers(cfg.filler_words, size=num_fillers)]
        words = [w for p in rng.permutation(len(phrases)) for w in phrases[p]]
        ids = [START, *words, END]  # fits: _validate bounds the longest caption
        out = {"label": np.int64(label)}
        if "tokens" in fields or "length" in fields:
            tokens = np.zeros(cfg.max_length, np.int32)
            tokens[: len(ids)] = ids
            out["tokens"] = tokens
            out["length"] = np.int32(len(ids))
        if "global_text" in fields:
            bag = world.word_view[words].sum(0) / np.sqrt(len(words))
            noise = cfg.global_noise * rng.normal(size=bag.shape)
            out["global_text"] = (np.tanh(bag) + noise).astype(np.float32)
        return out

    def caption_lengths(self) -> np.ndarray:
        return np.array(
            [self.caption(k, ("length",))["length"] for k in range(self.num_captions)], np.int32
        )

    def image_labels(self) -> np.ndarray:
        if self._labels is None:
            labels = [self._make_latent(i)[0] for i in range(self.num_images)]
            self._labels = np.array(labels, np.int64)
        return self._labels


class SyntheticDataset:
    """The embedded synthetic dataset; implements ``sources.Dataset``.

    Args:
      cfg: the ``data`` config section (see ``default_config``).
    """

    def __init__(self, cfg):
        _validate(cfg)
        self._cfg = cfg
        self._world = _World(cfg)
        sizes = {"train": cfg.num_train, "val": cfg.num_val, "test": cfg.num_test}
        self._splits = {
            name: SyntheticSplit(cfg, self._world, name, n) for name, n in sizes.items()
        }
        self.info = sources.DatasetInfo(
            name="synthetic",
            captions_per_image=cfg.captions_per_image,
            num_classes=cfg.num_classes,
            vocab_size=self._world.vocab_size,
            max_length=cfg.max_length,
            num_regions=cfg.num_regions,
            region_dim=cfg.region_dim,
            image_dim=cfg.image_dim,
            text_dim=cfg.text_dim,
            split_sizes={k: (s.num_images, s.num_captions) for k, s in self._splits.items()},
        )

    def split(self, name: str) -> SyntheticSplit:
        if name not in self._splits:
            raise ValueError(
                f"Unknown split {name!r}; the synthetic dataset has {list(self._splits)}."
            )
        return self._splits[name]


_SIZE_FIELDS = {"train": "num_train", "val": "num_val", "test": "num_test"}


def size_hint(cfg, split: str, needed: int) -> str:
    """The field that sizes ``split`` (see ``sources.size_hint``)."""
    field = _SIZE_FIELDS[split]
    return f"set data.{field} (now {cfg[field]}) to at least {needed}"


def _validate(cfg) -> None:
    if cfg.captions_per_image < 1:
        raise ValueError(
            f"data.captions_per_image must be at least 1, got {cfg.captions_per_image}: "
            "every image needs a caption (1 for category retrieval, 5 as in Flickr30K/COCO)."
        )
    if cfg.num_classes < 2:
        raise ValueError(
            f"data.num_classes must be at least 2, got {cfg.num_classes}: the classes are the "
            "labels of category retrieval (mAP), label noise and the classifier, and each "
            "class draws its images' concepts; with one class every label is the same."
        )
    if cfg.concepts_per_image > cfg.num_regions:
        raise ValueError(
            f"data.concepts_per_image={cfg.concepts_per_image} exceeds "
            f"data.num_regions={cfg.num_regions}: each concept needs its own region."
        )
    if cfg.concepts_per_image > cfg.core_concepts or cfg.core_concepts > cfg.num_concepts:
        raise ValueError(
            "Need data.concepts_per_image <= data.core_concepts <= data.num_concepts, got "
            f"{cfg.concepts_per_image}, {cfg.core_concepts}, {cfg.num_concepts}."
        )
    longest = 2 + 2 * cfg.concepts_per_image + cfg.max_fillers
    if cfg.max_length < longest:
        raise ValueError(
            f"data.max_length={cfg.max_length} is shorter than the longest caption "
            f"({longest} tokens: <start>, an attribute and a noun per concept, "
            f"{cfg.max_fillers} fillers, <end>); raise it to at least {longest}."
        )
    for name in ("num_train", "num_val", "num_test"):
        if cfg[name] < 1:
            raise ValueError(f"data.{name} must be positive, got {cfg[name]}.")
    # Features are tanh of random projections, never all zero, unless they are empty: a
    # size-0 feature makes every image (or caption) alike, as all-zero features would.
    for name in ("region_dim", "image_dim", "text_dim"):
        if cfg[name] < 1:
            raise ValueError(f"data.{name} must be positive, got {cfg[name]}.")


@sources.register("synthetic")
def _make(cfg) -> SyntheticDataset:
    return SyntheticDataset(cfg)


def default_config():
    """The ``data`` config section of the synthetic dataset, with the default sizes.

    The default trains the quickstart in about two minutes on 2 CPU cores and is hard
    enough that 40% correspondence noise clearly hurts a non-robust baseline.
    """
    import ml_collections

    return ml_collections.ConfigDict(
        dict(
            name="synthetic",
            manual_dir="",
            data_dir="",
            seed=0,
            cache=True,
            num_train=4000,
            num_val=200,
            num_test=1000,
            captions_per_image=5,
            num_classes=10,
            num_concepts=120,
            core_concepts=12,
            concepts_per_image=4,
            class_purity=0.75,
            num_attributes=8,
            attribute_weight=0.7,
            num_regions=12,
            region_dim=64,
            region_noise=0.6,
            image_dim=64,
            text_dim=64,
            global_noise=0.1,
            synonyms=2,
            filler_words=30,
            max_fillers=3,
            mention_prob=0.8,
            attribute_mention_prob=0.7,
            max_length=16,
        )
    )
