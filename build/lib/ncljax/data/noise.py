"""Deterministic training noise for both problem families (host side, plain numpy).

Noise is applied by the input pipeline, never baked into the prepared data:

* **Noisy correspondence** is a mapping ``image_index[k]``: the image that caption
  ``k`` is paired with during training. Caption ``k`` truly describes image
  ``k // captions_per_image``. Two protocols exist in the literature:
  ``per_caption`` (NCR, BiCro, PC2: captions are shuffled) and ``per_image``
  (DECL, RCL: whole images are shuffled, so all captions of an image move
  together). Official index files of either kind can be loaded; their kind is
  detected, and a file of the other kind than the config asks for is refused.
* **Noisy labels** are observed class labels per modality, made by symmetric or
  asymmetric corruption (the MRL protocol, with its off-by-one bug fixed).

The config's ``noise.kind`` picks one (``KIND``, the kinds and the config sections they
read: ``noise.pairs`` for correspondence noise, ``noise.labels`` and
``noise.symmetric`` for label noise, ``noise.file`` for an index file; ``noise.seed`` for
noise made from a rate).

Every noise is a pure function of its arguments and an integer ``seed``. The
``clean`` masks are for diagnostics and evaluation only: no method may read them.

References:
  Huang et al., "Learning with Noisy Correspondence for Cross-modal Matching",
  NeurIPS 2021 (NCR).
  Qin et al., "Deep Evidential Learning with Noisy Correspondence for Cross-modal
  Retrieval", ACM MM 2022 (DECL).
  Hu et al., "Learning Cross-modal Retrieval with Noisy Labels", CVPR 2021 (MRL).
"""

from __future__ import annotations

import hashlib
import math
import os
from fractions import Fraction
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ncljax import rules
from ncljax.rules import Setting

CORRESPONDENCE_PROTOCOLS = ("none", "per_caption", "per_image")
LABEL_NOISE_KINDS = ("none", "symmetric", "asymmetric")


class CorrespondenceNoise(NamedTuple):
    """Caption-to-image pairing used for training.

    Attributes:
      image_index: int64 ``[num_captions]``; caption ``k`` is paired with image
        ``image_index[k]`` during training.
      clean: bool ``[num_captions]``; ``image_index[k] == k // captions_per_image``.
        Diagnostics only.
      protocol: ``'none'``, ``'per_caption'`` or ``'per_image'`` (for a file, its
        detected kind).
    """

    image_index: np.ndarray
    clean: np.ndarray
    protocol: str


class LabelNoise(NamedTuple):
    """Observed (possibly corrupted) class labels of the training pairs.

    Attributes:
      labels_image: int64 ``[N]``, observed label of each image.
      labels_text: int64 ``[N]``, observed label of each text.
      clean_image: bool ``[N]``, ``labels_image == true labels``. Diagnostics only.
      clean_text: bool ``[N]``, ``labels_text == true labels``. Diagnostics only.
    """

    labels_image: np.ndarray
    labels_text: np.ndarray
    clean_image: np.ndarray
    clean_text: np.ndarray


def _check_rate(rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"noise rate must be in [0, 1], got {rate!r}.")


def _num_noisy(rate: float, n: int) -> int:
    """``floor(rate * n)`` on the decimal the user wrote, so 0.29 * 100 gives 29, not 28."""
    return math.floor(Fraction(str(float(rate))) * n)


def _shuffle_avoiding_own(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random permutation ``out`` of ``values`` with ``out[i] != values[i]`` for every ``i``.

    A random permutation is drawn, then each position that kept its own value is
    swapped with a random position ``j`` such that the swap resolves it without
    creating a new conflict (``out[j] != v`` and ``values[j] != v`` for the
    conflicting value ``v``). Such a ``j`` exists whenever no value fills more than
    half of the positions, which the caller checks; each swap removes at least
    one conflict and creates none, so the loop ends. The result is random but not
    exactly uniform over such permutations (rejection sampling would be, at the
    cost of an unbounded number of redraws).
    """
    out = rng.permutation(values)
    for i in np.flatnonzero(out == values):
        value = values[i]
        if out[i] != value:  # already resolved by an earlier swap
            continue
        candidates = np.flatnonzero((out != value) & (values != value))
        j = candidates[rng.integers(candidates.size)]
        out[i], out[j] = out[j], value
    return out


def _per_caption(
    num_captions: int, captions_per_image: int, rate: float, rng: np.random.Generator, exact: bool
) -> np.ndarray:
    image_index = np.arange(num_captions, dtype=np.int64) // captions_per_image
    selected = rng.permutation(num_captions)[: _num_noisy(rate, num_captions)]
    own = image_index[selected]
    if not exact:
        image_index[selected] = rng.permutation(own)
        return image_index
    if own.size:
        images, counts = np.unique(own, return_counts=True)
        if 2 * counts.max() > own.size:
            raise ValueError(
                f"exact per_caption noise is impossible here: image {images[counts.argmax()]} "
                f"holds {counts.max()} of the {own.size} selected captions (more than half), "
                "so one of them must keep its own image. Use exact=False, or a larger rate "
                "or dataset."
            )
    image_index[selected] = _shuffle_avoiding_own(own, rng)
    return image_index


def _per_image(
    num_captions: int, captions_per_image: int, rate: float, rng: np.random.Generator, exact: bool
) -> np.ndarray:
    num_images = num_captions // captions_per_image
    image_map = np.arange(num_images, dtype=np.int64)
    selected = rng.permutation(num_images)[: _num_noisy(rate, num_images)]
    if exact and selected.size == 1:
        raise ValueError(
            f"exact per_image noise needs at least 2 images to permute, but floor(rate * "
            f"num_images) = 1 (rate={rate}, num_images={num_images}). Use exact=False, "
            "rate=0 or a larger rate."
        )
    if exact:
        image_map[selected] = _shuffle_avoiding_own(selected, rng)
    else:
        image_map[selected] = rng.permutation(selected)
    return np.repeat(image_map, captions_per_image)


_CORRESPONDENCE_FNS = {"per_caption": _per_caption, "per_image": _per_image}


def _correspondence(
    image_index: np.ndarray, captions_per_image: int, protocol: str
) -> CorrespondenceNoise:
    true_image = np.arange(image_index.size, dtype=np.int64) // captions_per_image
    return CorrespondenceNoise(image_index, image_index == true_image, protocol)


def _check_sizes(num_captions: int, captions_per_image: int) -> None:
    if captions_per_image < 1 or num_captions < 1 or num_captions % captions_per_image:
        raise ValueError(
            f"num_captions ({num_captions}) must be a positive multiple of "
            f"captions_per_image ({captions_per_image})."
        )


def correspondence_noise(
    num_captions: int,
    captions_per_image: int,
    *,
    rate: float,
    seed: int,
    protocol: str = "per_caption",
    exact: bool = True,
) -> CorrespondenceNoise:
    """Simulated noisy correspondence: which image each training caption is paired with.

    Caption ``k`` truly describes image ``img(k) = k // captions_per_image``.

    * ``per_caption`` (NCR, BiCro, PC2): ``n = floor(rate * num_captions)`` captions
      are chosen uniformly at random and their images are permuted among them.
      With ``exact=True`` no chosen caption gets its own image back, so exactly
      ``n`` captions are mismatched. With ``exact=False`` this is NCR's plain
      shuffle, where some chosen captions keep their image by chance and the
      realised rate is slightly below ``rate``.
    * ``per_image`` (DECL, RCL): ``n = floor(rate * num_images)`` images are chosen
      and permuted among themselves by ``pi`` (a derangement with ``exact=True``);
      every caption of image ``m`` is paired with image ``pi[m]``.
    * ``none``, or ``rate=0``: the identity.

    Randomness: ``rng = np.random.default_rng(seed)``; the chosen set is
    ``rng.permutation(num_captions)[:n]`` (``num_images`` for ``per_image``),
    followed by the shuffle.

    Args:
      num_captions: number of training captions ``N``.
      captions_per_image: captions per image (5 for Flickr30K/COCO, 1 for CC152K).
      rate: requested noise rate in ``[0, 1]``.
      seed: integer seed.
      protocol: ``'per_caption'`` (default), ``'per_image'`` or ``'none'``.
      exact: forbid chosen captions/images from keeping their own image, so the
        realised rate is exactly ``n / N``.

    Returns:
      A ``CorrespondenceNoise`` with ``image_index`` int64 ``[N]`` and ``clean`` bool ``[N]``.

    Raises:
      ValueError: unknown protocol, rate outside ``[0, 1]``, sizes that do not fit,
        or ``exact=True`` when no derangement of the chosen set exists.

    References:
      Huang et al., NeurIPS 2021 (NCR), Sec. 4 (noise simulation); Qin et al.,
      ACM MM 2022 (DECL), Sec. 4.1.
    """
    if protocol not in CORRESPONDENCE_PROTOCOLS:
        hint = (
            " (read official files with load_correspondence_noise_file)"
            if protocol == "file"
            else ""
        )
        raise ValueError(
            f"unknown correspondence noise protocol {protocol!r}; valid ones are "
            f"{', '.join(CORRESPONDENCE_PROTOCOLS)}{hint}."
        )
    _check_rate(rate)
    _check_sizes(num_captions, captions_per_image)
    if protocol == "none" or rate == 0:
        image_index = np.arange(num_captions, dtype=np.int64) // captions_per_image
    else:
        rng = np.random.default_rng(seed)
        make_fn = _CORRESPONDENCE_FNS[protocol]
        image_index = make_fn(num_captions, captions_per_image, rate, rng, exact)
    return _correspondence(image_index, captions_per_image, protocol)


FILE_KINDS = ("auto", "per_caption", "per_image")

PAIRS = {"exact": Setting(True, rules.BOOLEAN, "no pair keeps its own image by chance")}
LABELS = {"shared": Setting(True, rules.BOOLEAN, "one noisy label per pair for both sides")}
SYMMETRIC = {"exclude_true": Setting(False, rules.BOOLEAN, "never redraw the true label")}
FILE = {
    "path": Setting("", None, "an official .npy index file"),
    "layout": Setting(
        "auto", rules.one_of(*FILE_KINDS), "what the file must be ('auto': detected)"
    ),
}
_DRAWN = ("noise.seed",)  # noise.rate: every kind (warned about with 'none')
KIND = rules.Choice(
    "noise.kind",
    "none",
    (
        rules.Kind("none", doc="the data's own pairs and labels"),
        rules.Kind("per_caption", {"noise.pairs": PAIRS}, _DRAWN, "captions moved (NCR)"),
        rules.Kind("per_image", {"noise.pairs": PAIRS}, _DRAWN, "images moved (DECL)"),
        # The file decides the noise; noise.rate records it (checked against the file).
        rules.Kind("file", {"noise.file": FILE}, doc="an official index file"),
        rules.Kind(
            "symmetric",
            {"noise.labels": LABELS, "noise.symmetric": SYMMETRIC},
            _DRAWN,
            "labels redrawn uniformly (MRL)",
        ),
        rules.Kind("asymmetric", {"noise.labels": LABELS}, _DRAWN, "labels flipped (MRL)"),
    ),
)
CHOICES = (KIND,)

_KIND_MEANING = {
    "per_caption": "caption-level (NCR, BiCro, PC2: captions are shuffled independently, "
    "so the captions of one image can be paired with different images)",
    "per_image": "image-level (DECL, RCL: whole images are shuffled, so all captions of an "
    "image move together to the same image)",
}


def _file_kind(index: np.ndarray, num_captions: int, captions_per_image: int) -> str:
    """``'per_image'`` when every block of ``captions_per_image`` captions is paired with
    one image (or the array has one entry per image), else ``'per_caption'``."""
    if index.size != num_captions:
        return "per_image"
    blocks = index.reshape(-1, captions_per_image)
    return "per_image" if (blocks == blocks[:, :1]).all() else "per_caption"


def _kind_mismatch(
    path: str, found: str, expected: str, index: np.ndarray, captions_per_image: int, size: int
) -> ValueError:
    """The refusal of a file of kind ``found`` where ``expected`` was asked for.

    ``index`` is the file's array expanded to captions; ``size`` its length in the file.
    """
    blocks = index.reshape(-1, captions_per_image)
    if found == "per_caption":
        image = int(np.flatnonzero((blocks != blocks[:, :1]).any(axis=1))[0])
        evidence = (
            f"; e.g. the {captions_per_image} captions of image {image} are paired with "
            f"images {blocks[image].tolist()}"
        )
    elif size == blocks.shape[0]:
        evidence = f"; it holds one image index per image ({size} entries)"
    else:
        evidence = (
            f"; its {size} entries are constant within each block of {captions_per_image} "
            "captions of an image"
        )
    return ValueError(
        f"noise file {path} is {_KIND_MEANING[found]}{evidence}; but noise.file.layout="
        f"'{expected}' asks for {_KIND_MEANING[expected]}. The two protocols give different "
        f"noise, and results under them are not comparable. Set noise.file.layout='{found}' "
        "(or 'auto') to use this file, or pass a file of the kind you asked for."
    )


def load_correspondence_noise_file(
    path: str | os.PathLike,
    num_captions: int,
    captions_per_image: int,
    *,
    expected: str = "auto",
) -> CorrespondenceNoise:
    """Reads an official noisy-correspondence index file (``.npy``) and tells its kind.

    Two kinds of file exist; the kind is detected from the array:

    * **image-level** (DECL, RCL: ``noise_inx_{r}.npy``): one image index per image,
      length ``num_captions // captions_per_image``; caption ``k`` is paired with image
      ``index[k // captions_per_image]``. An array of length ``num_captions`` whose
      values are constant within each block of ``captions_per_image`` captions is the
      same noise expanded to captions, and is image-level too.
    * **caption-level** (NCR, BiCro, PC2: ``{name}_precomp_{r}.npy``): one image index per
      caption, length ``num_captions``, not constant within some block.

    With one caption per image (CC152K, NoW, the labelled datasets) the two kinds
    coincide: every file is both, none is refused for its kind, and the protocol
    returned is ``expected`` (``'per_caption'`` for ``'auto'``). A noise-free
    (identity) file is both kinds too: it is never refused for its kind, and its
    protocol is ``expected`` when one is given.

    Args:
      path: the ``.npy`` file.
      num_captions: number of training captions of the dataset.
      captions_per_image: captions per image of the dataset.
      expected: ``'auto'`` (accept either kind), ``'per_caption'`` or ``'per_image'``
        (the config's ``noise.file.layout``): refuse a file of the other kind.

    Returns:
      A ``CorrespondenceNoise`` with ``image_index`` ``[num_captions]`` and the detected
      kind as ``protocol`` (``'per_caption'`` or ``'per_image'``).

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: the file is not a readable ``.npy`` array of integer image indices in
        ``[0, num_images)`` with one of the two accepted lengths, or its kind is not
        ``expected``.
    """
    if expected not in FILE_KINDS:
        raise ValueError(
            f"noise.file.layout must be one of {', '.join(FILE_KINDS)}, got {expected!r}."
        )
    _check_sizes(num_captions, captions_per_image)
    num_images = num_captions // captions_per_image
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"noise file {path} does not exist; pass the path of the .npy index file "
            "(noise.file.path) or use a generated protocol such as noise.kind='per_caption'."
        )
    if not path.endswith(".npy"):
        raise ValueError(
            f"noise file {path} is not a .npy file; save the index array with np.save."
        )
    try:
        index = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(
            f"noise file {path} could not be read as a .npy array ({err}); re-create it "
            "with np.save(path, index_array)."
        ) from err
    dataset = (
        f"the training split has {num_captions} captions ({num_images} images x "
        f"{captions_per_image} captions per image)"
    )
    if not np.issubdtype(index.dtype, np.integer):
        raise ValueError(
            f"noise file {path} holds {index.dtype} values; expected integer image "
            "indices (int64). Re-save it with index.astype(np.int64)."
        )
    if index.ndim != 1 or index.size not in (num_captions, num_images):
        raise ValueError(
            f"noise file {path} holds an array of shape {index.shape}, but {dataset}: "
            f"expected a 1-D array of length {num_captions} (one image index per caption, "
            f"caption-level or image-level) or {num_images} (one per image, image-level). "
            "Check that the file was made for this dataset and split."
        )
    if index.size and (index.min() < 0 or index.max() >= num_images):
        raise ValueError(
            f"noise file {path} holds image indices in [{index.min()}, {index.max()}], "
            f"but {dataset}: expected indices in [0, {num_images}). Check that the file "
            "was made for this dataset and split."
        )
    index, size = index.astype(np.int64), index.size
    kind = _file_kind(index, num_captions, captions_per_image)
    if index.size != num_captions:
        index = np.repeat(index, captions_per_image)
    identity = np.array_equal(index, np.arange(num_captions) // captions_per_image)
    if captions_per_image == 1:  # both kinds at once
        kind = "per_caption" if expected == "auto" else expected
    elif identity:  # no noise: both kinds at once
        kind = kind if expected == "auto" else expected
    elif expected not in ("auto", kind):
        raise _kind_mismatch(path, kind, expected, index, captions_per_image, size)
    return _correspondence(index, captions_per_image, kind)


def _asymmetric_transition(num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Class map ``pi[i] -> pi[K//2 + i]`` for ``i < K//2``; every other class to itself."""
    perm = rng.permutation(num_classes)
    half = num_classes // 2
    transition = np.arange(num_classes, dtype=np.int64)
    transition[perm[:half]] = perm[half : 2 * half]
    return transition


def _corrupt(
    labels: np.ndarray,
    num_classes: int,
    rate: float,
    kind: str,
    exclude_true: bool,
    transition: np.ndarray | None,
    rng: np.random.Generator,
) -> np.ndarray:
    selected = rng.permutation(labels.size)[: _num_noisy(rate, labels.size)]
    noisy = labels.copy()
    if kind == "asymmetric":
        noisy[selected] = transition[labels[selected]]
    elif exclude_true:
        offset = rng.integers(1, num_classes, size=selected.size)
        noisy[selected] = (labels[selected] + offset) % num_classes
    else:
        noisy[selected] = rng.integers(0, num_classes, size=selected.size)
    return noisy


def label_noise(
    labels: npt.ArrayLike,
    num_classes: int,
    *,
    rate: float,
    seed: int,
    kind: str = "symmetric",
    shared: bool = True,
    exclude_true: bool = False,
) -> LabelNoise:
    """Simulated noisy labels for category-level cross-modal retrieval.

    ``n = floor(rate * N)`` samples are chosen uniformly at random; each gets

    * ``symmetric``: a label uniform over ``{0..K-1}``. It may equal the true label,
      so the realised rate is about ``rate * (K-1) / K``. With ``exclude_true=True``
      it is uniform over the other ``K-1`` classes and the realised rate is exactly
      ``n / N``. MRL's code draws from ``{0..K}`` inclusive (an off-by-one that can
      create a class ``K``); that bug is fixed here.
    * ``asymmetric``: ``T(y)`` for a random class permutation ``pi``, with
      ``T(pi[i]) = pi[K//2 + i]`` for ``i < K//2`` and ``T(c) = c`` otherwise.
    * ``none``, or ``rate=0``: the true labels.

    ``shared=True`` corrupts once and uses the result for both modalities (one
    label per pair, as in the UOT-RCL equations). ``shared=False`` corrupts each
    modality independently (the MRL protocol, used for the numbers UOT-RCL
    reuses); the asymmetric class map ``T`` is one per dataset and common to both
    modalities.

    Randomness: ``np.random.SeedSequence(seed).spawn(3)`` gives independent streams
    for ``T``, the image modality (also used for both when ``shared``) and the
    text modality; each modality draws ``permutation(N)[:n]`` then its labels.

    Args:
      labels: true labels, integers in ``[0, K)``, ``[N]``.
      num_classes: number of classes ``K``.
      rate: fraction of samples to corrupt, in ``[0, 1]``.
      seed: integer seed.
      kind: ``'symmetric'`` (default), ``'asymmetric'`` or ``'none'``.
      shared: one noisy label vector for both modalities (default) or one each.
      exclude_true: symmetric noise only; never redraw the true label.

    Returns:
      A ``LabelNoise`` with int64 observed labels and bool clean masks, ``[N]`` each.

    Raises:
      ValueError: unknown kind, rate outside ``[0, 1]``, labels that are not 1-D
        integers in ``[0, K)``, or ``exclude_true`` with a kind it does not apply to.

    References:
      Hu et al., "Learning Cross-modal Retrieval with Noisy Labels", CVPR 2021
      (MRL), Sec. 4.1 (noise simulation).
    """
    if kind not in LABEL_NOISE_KINDS:
        raise ValueError(
            f"unknown label noise kind {kind!r}; valid ones are {', '.join(LABEL_NOISE_KINDS)}."
        )
    _check_rate(rate)
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a 1-D integer array, got {labels.dtype} of shape {labels.shape}."
        )
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]; "
            "shift 1-based labels to 0-based first."
        )
    if exclude_true and (kind != "symmetric" or num_classes < 2):
        raise ValueError(
            "exclude_true applies to symmetric noise with at least 2 classes only, got "
            f"kind={kind!r}, num_classes={num_classes}."
        )
    labels = labels.astype(np.int64)
    if kind == "none" or rate == 0:
        labels_image = labels_text = labels
    else:
        transition_ss, image_ss, text_ss = np.random.SeedSequence(seed).spawn(3)
        transition = None
        if kind == "asymmetric":
            transition = _asymmetric_transition(num_classes, np.random.default_rng(transition_ss))
        args = (labels, num_classes, rate, kind, exclude_true, transition)
        labels_image = _corrupt(*args, np.random.default_rng(image_ss))
        labels_text = labels_image if shared else _corrupt(*args, np.random.default_rng(text_ss))
    return LabelNoise(
        labels_image.copy(), labels_text.copy(), labels_image == labels, labels_text == labels
    )


def noise_checksum(noise: CorrespondenceNoise | LabelNoise) -> str:
    """Stable sha256 hex digest of the observed noise, for the run's logged config.

    Hashes the type name and the observed arrays (``image_index``, or
    ``labels_image`` and ``labels_text``) as little-endian int64 with their lengths;
    the clean masks follow from them and the protocol name is not hashed. Equal
    noise gives equal digests on every platform and process.

    Args:
      noise: a ``CorrespondenceNoise`` or a ``LabelNoise``.

    Returns:
      64 hexadecimal characters.
    """
    if isinstance(noise, CorrespondenceNoise):
        arrays = {"image_index": noise.image_index}
    elif isinstance(noise, LabelNoise):
        arrays = {"labels_image": noise.labels_image, "labels_text": noise.labels_text}
    else:
        raise TypeError(f"expected CorrespondenceNoise or LabelNoise, got {type(noise).__name__}.")
    digest = hashlib.sha256(type(noise).__name__.encode())
    for name, array in arrays.items():
        array = np.ascontiguousarray(array, dtype="<i8")
        digest.update(f";{name}:{array.size}:".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def realised_rate(noise: CorrespondenceNoise | LabelNoise) -> float:
    """Fraction of samples whose observed pairing or label is wrong.

    For ``LabelNoise`` the mean of the image and text rates. Diagnostics only.
    """
    if isinstance(noise, CorrespondenceNoise):
        masks = [noise.clean]
    else:
        masks = [noise.clean_image, noise.clean_text]
    rates = [np.count_nonzero(~mask) / mask.size if mask.size else 0.0 for mask in masks]
    return float(sum(rates) / len(rates))
