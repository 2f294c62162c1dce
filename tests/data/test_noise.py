"""Tests for ncljax.data.noise: oracles are numpy re-implementations of the documented protocols."""

import collections
import hashlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ncljax.data import noise as noise_lib

RATES = (0.2, 0.4, 0.6, 0.8)
PROTOCOLS = ("per_caption", "per_image")
REPO_ROOT = Path(__file__).resolve().parents[2]


def true_image(num_captions, captions_per_image):
    return np.arange(num_captions) // captions_per_image


def noisy_count(rate, n):
    """floor(rate * n) for the decimal rates used here (round() absorbs float error)."""
    return math.floor(round(rate * n, 9))


def selected_first(seed, n, rate):
    """The documented chosen set: the first draw of default_rng(seed) is permutation(n)."""
    return np.random.default_rng(seed).permutation(n)[: noisy_count(rate, n)]


# ---------------------------------------------------------------- correspondence


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("exact", [True, False])
def test_correspondence_is_deterministic_in_seed(protocol, exact):
    make = lambda seed: noise_lib.correspondence_noise(
        500, 5, rate=0.4, seed=seed, protocol=protocol, exact=exact
    )
    a, b, c = make(3), make(3), make(4)
    np.testing.assert_array_equal(a.image_index, b.image_index)
    np.testing.assert_array_equal(a.clean, b.clean)
    assert not np.array_equal(a.image_index, c.image_index)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("captions_per_image", [1, 5])
@pytest.mark.parametrize("num_images", [10, 45, 1000])
@pytest.mark.parametrize("rate", RATES)
def test_exact_noise_has_exactly_the_requested_rate(protocol, captions_per_image, num_images, rate):
    num_captions = num_images * captions_per_image
    for seed in range(3):
        noise = noise_lib.correspondence_noise(
            num_captions, captions_per_image, rate=rate, seed=seed, protocol=protocol
        )
        # rate * num_images is an integer for every case here, so floor(...) / N == rate.
        assert np.count_nonzero(~noise.clean) / num_captions == rate
        assert noise_lib.realised_rate(noise) == rate
        np.testing.assert_array_equal(
            noise.clean, noise.image_index == true_image(num_captions, captions_per_image)
        )
        plain = noise_lib.correspondence_noise(
            num_captions, captions_per_image, rate=rate, seed=seed, protocol=protocol, exact=False
        )
        assert noise_lib.realised_rate(plain) <= rate


def test_rate_count_uses_the_written_decimal():
    # 0.29 * 100 == 28.999999999999996 in floating point; the user asked for 29.
    noise = noise_lib.correspondence_noise(100, 1, rate=0.29, seed=0)
    assert np.count_nonzero(~noise.clean) == 29


@pytest.mark.parametrize("captions_per_image", [1, 5])
@pytest.mark.parametrize("rate", RATES)
def test_per_caption_permutes_the_selected_captions_only(captions_per_image, rate):
    num_captions, seed = 1000, 11
    truth = true_image(num_captions, captions_per_image)
    noise = noise_lib.correspondence_noise(num_captions, captions_per_image, rate=rate, seed=seed)
    selected = selected_first(seed, num_captions, rate)
    assert selected.size == noisy_count(rate, num_captions)
    untouched = np.setdiff1d(np.arange(num_captions), selected)
    np.testing.assert_array_equal(noise.image_index[untouched], truth[untouched])
    # Exact: every selected caption is mismatched, and only those.
    np.testing.assert_array_equal(np.flatnonzero(~noise.clean), np.sort(selected))
    # A permutation of the selected captions' images: the multiset is unchanged.
    np.testing.assert_array_equal(np.sort(noise.image_index[selected]), np.sort(truth[selected]))
    np.testing.assert_array_equal(np.sort(noise.image_index), truth)
    assert noise.image_index.dtype == np.int64
    assert noise.protocol == "per_caption"


@pytest.mark.parametrize("captions_per_image", [1, 5])
def test_per_caption_plain_shuffle_matches_ncr_oracle(captions_per_image):
    num_captions, rate, seed = 600, 0.6, 5
    rng = np.random.default_rng(seed)
    selected = rng.permutation(num_captions)[:360]
    expected = true_image(num_captions, captions_per_image)
    expected[selected] = rng.permutation(expected[selected])
    noise = noise_lib.correspondence_noise(
        num_captions, captions_per_image, rate=rate, seed=seed, exact=False
    )
    np.testing.assert_array_equal(noise.image_index, expected)


def test_exact_derangement_stays_random():
    # All 4 captions selected, one caption per image: the 9 derangements of 4 items.
    seen = collections.Counter(
        tuple(noise_lib.correspondence_noise(4, 1, rate=1.0, seed=s).image_index)
        for s in range(900)
    )
    derangements = {
        p
        for p in (
            (a, b, c, d) for a in range(4) for b in range(4) for c in range(4) for d in range(4)
        )
        if sorted(p) == [0, 1, 2, 3] and all(p[i] != i for i in range(4))
    }
    assert set(seen) == derangements
    assert min(seen.values()) > 0.04 * 900


@pytest.mark.parametrize("rate", RATES)
def test_per_image_moves_whole_images(rate):
    num_images, cpi, seed = 300, 5, 2
    noise = noise_lib.correspondence_noise(
        num_images * cpi, cpi, rate=rate, seed=seed, protocol="per_image"
    )
    by_image = noise.image_index.reshape(num_images, cpi)
    # All captions of one image share one new image.
    np.testing.assert_array_equal(by_image, np.repeat(by_image[:, :1], cpi, axis=1))
    image_map = by_image[:, 0]
    np.testing.assert_array_equal(np.sort(image_map), np.arange(num_images))
    moved = np.flatnonzero(image_map != np.arange(num_images))
    np.testing.assert_array_equal(moved, np.sort(selected_first(seed, num_images, rate)))
    assert moved.size == noisy_count(rate, num_images)


def test_per_image_plain_shuffle_matches_decl_oracle():
    num_images, cpi, seed = 200, 5, 8
    rng = np.random.default_rng(seed)
    selected = rng.permutation(num_images)[:80]
    image_map = np.arange(num_images)
    image_map[selected] = rng.permutation(selected)
    noise = noise_lib.correspondence_noise(
        num_images * cpi, cpi, rate=0.4, seed=seed, protocol="per_image", exact=False
    )
    np.testing.assert_array_equal(noise.image_index, np.repeat(image_map, cpi))


@pytest.mark.parametrize(
    "kwargs", [dict(rate=0.0, protocol="per_caption"), dict(rate=0.6, protocol="none")]
)
def test_identity_when_no_noise(kwargs):
    noise = noise_lib.correspondence_noise(50, 5, seed=0, **kwargs)
    np.testing.assert_array_equal(noise.image_index, true_image(50, 5))
    assert noise.clean.all()
    assert noise_lib.realised_rate(noise) == 0.0


def test_correspondence_rejects_bad_arguments():
    with pytest.raises(ValueError, match="per_caption, per_image"):
        noise_lib.correspondence_noise(50, 5, rate=0.2, seed=0, protocol="shuffle")
    with pytest.raises(ValueError, match="load_correspondence_noise_file"):
        noise_lib.correspondence_noise(50, 5, rate=0.2, seed=0, protocol="file")
    for rate in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            noise_lib.correspondence_noise(50, 5, rate=rate, seed=0)
    with pytest.raises(ValueError, match="multiple of captions_per_image"):
        noise_lib.correspondence_noise(52, 5, rate=0.2, seed=0)


def test_exact_impossible_is_refused_but_plain_shuffle_works():
    # One image with 5 captions: no caption can get another image.
    with pytest.raises(ValueError, match="exact=False"):
        noise_lib.correspondence_noise(5, 5, rate=1.0, seed=0)
    plain = noise_lib.correspondence_noise(5, 5, rate=1.0, seed=0, exact=False)
    assert plain.clean.all()
    # A single chosen image cannot be moved.
    with pytest.raises(ValueError, match="at least 2 images"):
        noise_lib.correspondence_noise(50, 5, rate=0.1, seed=0, protocol="per_image")


# ---------------------------------------------------------------- noise files


@pytest.mark.parametrize("captions_per_image", [1, 5])
def test_per_caption_file_round_trip(tmp_path, captions_per_image):
    made = noise_lib.correspondence_noise(200, captions_per_image, rate=0.4, seed=1)
    path = tmp_path / "f30k_precomp_0.4.npy"
    np.save(path, made.image_index)
    loaded = noise_lib.load_correspondence_noise_file(path, 200, captions_per_image)
    np.testing.assert_array_equal(loaded.image_index, made.image_index)
    np.testing.assert_array_equal(loaded.clean, made.clean)
    assert loaded.protocol == "per_caption"
    assert noise_lib.noise_checksum(loaded) == noise_lib.noise_checksum(made)


def test_per_image_file_is_expanded_to_captions(tmp_path):
    made = noise_lib.correspondence_noise(200, 5, rate=0.4, seed=1, protocol="per_image")
    path = tmp_path / "noise_inx_0.4.npy"
    np.save(path, made.image_index[::5].astype(np.int32))
    loaded = noise_lib.load_correspondence_noise_file(str(path), 200, 5)
    np.testing.assert_array_equal(loaded.image_index, made.image_index)
    np.testing.assert_array_equal(loaded.clean, made.clean)
    assert loaded.image_index.dtype == np.int64
    assert noise_lib.realised_rate(loaded) == 0.4
    assert loaded.protocol == "per_image"


@pytest.mark.parametrize(
    ("array", "error", "expected_parts"),
    [
        (np.arange(30) // 5, ValueError, ["length 50", "or 10", "50 captions", "10 images"]),
        (np.zeros(50, np.float32), ValueError, ["float32", "integer"]),
        (np.zeros((10, 5), np.int64), ValueError, ["(10, 5)", "length 50", "or 10"]),
        (np.full(50, 10), ValueError, ["[10, 10]", "[0, 10)"]),
        (np.full(10, -1), ValueError, ["[-1, -1]", "[0, 10)"]),
    ],
    ids=["wrong_length", "float", "2d", "too_large", "negative"],
)
def test_refused_noise_files(tmp_path, array, error, expected_parts):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(error) as info:
        noise_lib.load_correspondence_noise_file(path, 50, 5)
    message = str(info.value)
    assert str(path) in message
    for part in expected_parts:
        assert part in message


def test_refused_missing_and_non_npy_files(tmp_path):
    missing = tmp_path / "nowhere" / "coco_precomp_0.2.npy"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        noise_lib.load_correspondence_noise_file(missing, 50, 5)
    assert str(missing) in str(info.value)

    text = tmp_path / "noise.txt"
    np.savetxt(text, np.arange(50) // 5, fmt="%d")
    with pytest.raises(ValueError, match=r"not a \.npy file") as info:
        noise_lib.load_correspondence_noise_file(text, 50, 5)
    assert str(text) in str(info.value)

    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"definitely not numpy")
    with pytest.raises(ValueError, match="could not be read") as info:
        noise_lib.load_correspondence_noise_file(garbage, 50, 5)
    assert str(garbage) in str(info.value)


# ---------------------------------------------------------------- noise-file kinds

# Hand-made files for 4 images x 3 captions (caption k describes image k // 3).
CAPTION_LEVEL = [0, 2, 0, 1, 1, 3, 2, 2, 0, 3, 1, 3]  # image 0's captions -> 0, 2, 0
IMAGE_LEVEL = [2, 0, 1, 3]  # images 0 and 1 and 2 rotated, image 3 kept
IMAGE_LEVEL_EXPANDED = [2, 2, 2, 0, 0, 0, 1, 1, 1, 3, 3, 3]


def save(tmp_path, name, values):
    path = tmp_path / name
    np.save(path, np.asarray(values, np.int64))
    return path


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        (CAPTION_LEVEL, "per_caption"),
        (IMAGE_LEVEL, "per_image"),
        (IMAGE_LEVEL_EXPANDED, "per_image"),
    ],
    ids=["caption_level", "image_level", "image_level_expanded"],
)
def test_file_kind_is_detected(tmp_path, values, kind):
    path = save(tmp_path, "noise.npy", values)
    for expected in ("auto", kind):
        loaded = noise_lib.load_correspondence_noise_file(path, 12, 3, expected=expected)
        assert loaded.protocol == kind
        image_index = np.repeat(values, 3) if len(values) == 4 else np.asarray(values)
        np.testing.assert_array_equal(loaded.image_index, image_index)
        np.testing.assert_array_equal(loaded.clean, image_index == np.arange(12) // 3)


def test_caption_level_file_is_refused_where_image_level_is_asked(tmp_path):
    path = save(tmp_path, "f30k_precomp_0.4.npy", CAPTION_LEVEL)
    with pytest.raises(ValueError) as info:
        noise_lib.load_correspondence_noise_file(path, 12, 3, expected="per_image")
    message = str(info.value)
    assert str(path) in message
    assert "is caption-level (NCR, BiCro, PC2" in message
    assert "the 3 captions of image 0 are paired with images [0, 2, 0]" in message
    assert "noise.file.layout='per_image' asks for image-level (DECL, RCL" in message
    assert "all captions of an image move together" in message
    assert "not comparable" in message
    assert "Set noise.file.layout='per_caption' (or 'auto')" in message


@pytest.mark.parametrize("values", [IMAGE_LEVEL, IMAGE_LEVEL_EXPANDED])
def test_image_level_file_is_refused_where_caption_level_is_asked(tmp_path, values):
    path = save(tmp_path, "noise_inx_0.4.npy", values)
    with pytest.raises(ValueError) as info:
        noise_lib.load_correspondence_noise_file(path, 12, 3, expected="per_caption")
    message = str(info.value)
    assert str(path) in message
    assert "is image-level (DECL, RCL" in message
    assert "asks for caption-level (NCR, BiCro, PC2" in message
    assert "captions are shuffled independently" in message
    if len(values) == 4:
        assert "it holds one image index per image (4 entries)" in message
    else:
        assert "its 12 entries are constant within each block of 3 captions" in message
    assert "Set noise.file.layout='per_image' (or 'auto')" in message


def test_generated_files_of_both_protocols_are_told_apart(tmp_path):
    for protocol in PROTOCOLS:
        made = noise_lib.correspondence_noise(500, 5, rate=0.4, seed=2, protocol=protocol)
        path = save(tmp_path, f"{protocol}.npy", made.image_index)
        loaded = noise_lib.load_correspondence_noise_file(path, 500, 5)
        assert loaded.protocol == protocol
        np.testing.assert_array_equal(loaded.image_index, made.image_index)


def test_one_caption_per_image_makes_the_kinds_coincide(tmp_path):
    path = save(tmp_path, "cc152k.npy", [1, 0, 2, 3])
    auto = noise_lib.load_correspondence_noise_file(path, 4, 1)
    assert auto.protocol == "per_caption"
    for expected in PROTOCOLS:
        loaded = noise_lib.load_correspondence_noise_file(path, 4, 1, expected=expected)
        assert loaded.protocol == expected
        np.testing.assert_array_equal(loaded.image_index, [1, 0, 2, 3])


def test_noise_free_file_is_either_kind(tmp_path):
    for values in (np.arange(4), np.arange(12) // 3):
        path = save(tmp_path, "identity.npy", values)
        for expected in PROTOCOLS:
            loaded = noise_lib.load_correspondence_noise_file(path, 12, 3, expected=expected)
            assert loaded.protocol == expected and loaded.clean.all()


def test_file_kind_argument_and_length_are_checked(tmp_path):
    path = save(tmp_path, "noise.npy", CAPTION_LEVEL)
    with pytest.raises(ValueError, match=r"noise\.file\.layout must be one of auto, per_caption"):
        noise_lib.load_correspondence_noise_file(path, 12, 3, expected="caption")
    with pytest.raises(ValueError, match=r"length 15 .* or 5 \(one per image, image-level\)"):
        noise_lib.load_correspondence_noise_file(path, 15, 3, expected="per_image")


def test_training_pairs_pass_the_configured_file_kind(tmp_path):
    from ncljax import config as config_lib
    from ncljax.data import pipeline, synthetic

    data = synthetic.default_config()
    data.num_train, data.num_val, data.num_test = 4, 2, 2
    data.captions_per_image = 3
    split = synthetic.SyntheticDataset(data).split("train")
    noise_cfg = config_lib.base_config().noise
    noise_cfg.kind, noise_cfg.file.path = "file", str(save(tmp_path, "noise.npy", CAPTION_LEVEL))

    def pairs():
        return pipeline.training_pairs(
            split, noise_cfg, num_classes=10, image_fields=("regions",), text_fields=("tokens",)
        )

    np.testing.assert_array_equal(pairs().clean, np.asarray(CAPTION_LEVEL) == np.arange(12) // 3)
    noise_cfg.file.layout = "per_image"
    with pytest.raises(ValueError, match="is caption-level"):
        pairs()


# ---------------------------------------------------------------- label noise


def oracle_streams(seed):
    """The documented streams: (class map, image modality, text modality)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]


def oracle_half_permutation(perm):
    transition = list(range(len(perm)))
    half = len(perm) // 2
    for i in range(half):
        transition[perm[i]] = perm[half + i]
    return np.array(transition)


@pytest.fixture
def labels():
    return np.random.default_rng(123).integers(0, 10, size=4000)


@pytest.mark.parametrize("rate", RATES)
def test_symmetric_noise_matches_protocol_oracle(labels, rate):
    num = labels.size
    noise = noise_lib.label_noise(labels, 10, rate=rate, seed=9)
    _, rng, _ = oracle_streams(9)
    selected = rng.permutation(num)[: noisy_count(rate, num)]
    draws = rng.integers(0, 10, size=selected.size)
    expected = labels.copy()
    expected[selected] = draws
    np.testing.assert_array_equal(noise.labels_image, expected)
    # Realised noise is exactly the selected samples whose draw differed ...
    changed = np.count_nonzero(draws != labels[selected])
    assert np.count_nonzero(~noise.clean_image) == changed
    np.testing.assert_array_equal(noise.clean_image, noise.labels_image == labels)
    # ... which is about rate * (K - 1) / K (binomial, 5 standard deviations).
    p = 9 / 10
    assert abs(changed - selected.size * p) < 5 * math.sqrt(selected.size * p * (1 - p))
    assert noise.labels_image.min() >= 0 and noise.labels_image.max() < 10


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("num_classes", [2, 10])
def test_symmetric_exclude_true_has_exact_rate(rate, num_classes):
    labels = np.random.default_rng(0).integers(0, num_classes, size=1500)
    noise = noise_lib.label_noise(
        labels, num_classes, rate=rate, seed=4, shared=False, exclude_true=True
    )
    for observed, clean in [
        (noise.labels_image, noise.clean_image),
        (noise.labels_text, noise.clean_text),
    ]:
        assert np.count_nonzero(~clean) == noisy_count(rate, labels.size)
        assert observed.min() >= 0 and observed.max() < num_classes
    assert noise_lib.realised_rate(noise) == rate


def test_exclude_true_draws_every_other_class(labels):
    noise = noise_lib.label_noise(labels, 10, rate=1.0, seed=0, exclude_true=True)
    moved_from_zero = noise.labels_image[labels == 0]
    assert set(moved_from_zero.tolist()) == set(range(1, 10))


@pytest.mark.parametrize("num_classes", [5, 10])
@pytest.mark.parametrize("rate", [0.4, 1.0])
def test_asymmetric_is_the_half_permutation_map(num_classes, rate):
    labels = np.random.default_rng(1).integers(0, num_classes, size=3000)
    noise = noise_lib.label_noise(labels, num_classes, rate=rate, seed=6, kind="asymmetric")
    perm_rng, rng, _ = oracle_streams(6)
    transition = oracle_half_permutation(perm_rng.permutation(num_classes))
    selected = rng.permutation(labels.size)[: noisy_count(rate, labels.size)]
    expected = labels.copy()
    expected[selected] = transition[labels[selected]]
    np.testing.assert_array_equal(noise.labels_image, expected)
    np.testing.assert_array_equal(noise.labels_text, expected)

    # Stream-free check: the observed flips form one map with K//2 sources and
    # K//2 distinct targets, disjoint from the sources.
    changed = noise.labels_image != labels
    pairs = set(zip(labels[changed].tolist(), noise.labels_image[changed].tolist(), strict=True))
    sources = {s for s, _ in pairs}
    targets = {t for _, t in pairs}
    assert len(pairs) == len(sources) == len(targets) == num_classes // 2
    assert not sources & targets
    if rate == 1.0:
        np.testing.assert_array_equal(changed, np.isin(labels, list(sources)))


def test_shared_and_independent_modalities(labels):
    shared = noise_lib.label_noise(labels, 10, rate=0.5, seed=2, exclude_true=True)
    np.testing.assert_array_equal(shared.labels_image, shared.labels_text)
    np.testing.assert_array_equal(shared.clean_image, shared.clean_text)

    separate = noise_lib.label_noise(labels, 10, rate=0.5, seed=2, exclude_true=True, shared=False)
    noisy_image, noisy_text = ~separate.clean_image, ~separate.clean_text
    assert noisy_image.sum() == noisy_text.sum() == labels.size // 2
    # Independent choices overlap in about rate**2 of the samples.
    overlap = np.count_nonzero(noisy_image & noisy_text) / labels.size
    assert abs(overlap - 0.25) < 0.04
    image_rate = np.count_nonzero(noisy_image) / labels.size
    text_rate = np.count_nonzero(noisy_text) / labels.size
    assert noise_lib.realised_rate(separate) == pytest.approx((image_rate + text_rate) / 2)


def test_label_noise_is_deterministic_in_seed(labels):
    make = lambda seed: noise_lib.label_noise(labels, 10, rate=0.4, seed=seed, shared=False)
    a, b, c = make(0), make(0), make(1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.labels_image, c.labels_image)


@pytest.mark.parametrize("kwargs", [dict(kind="none", rate=0.6), dict(kind="symmetric", rate=0.0)])
def test_no_label_noise_keeps_true_labels(labels, kwargs):
    noise = noise_lib.label_noise(labels, 10, seed=0, shared=False, **kwargs)
    np.testing.assert_array_equal(noise.labels_image, labels)
    np.testing.assert_array_equal(noise.labels_text, labels)
    assert noise.clean_image.all() and noise.clean_text.all()


def test_label_noise_rejects_bad_arguments(labels):
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        noise_lib.label_noise(labels + 1, 10, rate=0.2, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        noise_lib.label_noise(labels - 1, 10, rate=0.2, seed=0)
    with pytest.raises(ValueError, match="1-D integer"):
        noise_lib.label_noise(labels.astype(float), 10, rate=0.2, seed=0)
    with pytest.raises(ValueError, match="1-D integer"):
        noise_lib.label_noise(labels.reshape(2, -1), 10, rate=0.2, seed=0)
    with pytest.raises(ValueError, match="symmetric, asymmetric"):
        noise_lib.label_noise(labels, 10, rate=0.2, seed=0, kind="pairflip")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        noise_lib.label_noise(labels, 10, rate=1.2, seed=0)
    with pytest.raises(ValueError, match="exclude_true"):
        noise_lib.label_noise(labels, 10, rate=0.2, seed=0, kind="asymmetric", exclude_true=True)


# ---------------------------------------------------------------- checksum


def oracle_digest(type_name, arrays):
    digest = hashlib.sha256(type_name.encode())
    for name, array in arrays:
        digest.update(f";{name}:{len(array)}:".encode())
        digest.update(b"".join(int(v).to_bytes(8, "little", signed=True) for v in array))
    return digest.hexdigest()


def test_checksum_is_stable(labels):
    corr = noise_lib.correspondence_noise(100, 5, rate=0.4, seed=0)
    assert noise_lib.noise_checksum(corr) == oracle_digest(
        "CorrespondenceNoise", [("image_index", corr.image_index)]
    )
    lab = noise_lib.label_noise(labels, 10, rate=0.4, seed=0, shared=False)
    assert noise_lib.noise_checksum(lab) == oracle_digest(
        "LabelNoise", [("labels_image", lab.labels_image), ("labels_text", lab.labels_text)]
    )
    # Same digest from a fresh process (no hash randomisation or global state).
    code = (
        "from ncljax.data import noise as n;"
        "print(n.noise_checksum(n.correspondence_noise(100, 5, rate=0.4, seed=0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == noise_lib.noise_checksum(corr)
    # dtype of the stored array does not matter, only the values.
    narrow = corr._replace(image_index=corr.image_index.astype(np.int32))
    assert noise_lib.noise_checksum(narrow) == noise_lib.noise_checksum(corr)


def test_checksum_is_sensitive(labels):
    corr = noise_lib.correspondence_noise(100, 5, rate=0.4, seed=0)
    base = noise_lib.noise_checksum(corr)
    other_seed = noise_lib.correspondence_noise(100, 5, rate=0.4, seed=1)
    assert noise_lib.noise_checksum(other_seed) != base
    one_changed = corr.image_index.copy()
    one_changed[7] = (one_changed[7] + 1) % 20
    assert noise_lib.noise_checksum(corr._replace(image_index=one_changed)) != base
    swapped = corr.image_index.copy()
    i, j = np.flatnonzero(swapped != swapped[0])[0], 0
    swapped[[i, j]] = swapped[[j, i]]
    assert noise_lib.noise_checksum(corr._replace(image_index=swapped)) != base

    lab = noise_lib.label_noise(labels, 10, rate=0.4, seed=0, shared=False)
    flipped = lab._replace(labels_image=lab.labels_text, labels_text=lab.labels_image)
    assert noise_lib.noise_checksum(flipped) != noise_lib.noise_checksum(lab)
    # The same integers as a different kind of noise hash differently.
    as_labels = noise_lib.LabelNoise(corr.image_index, corr.image_index, corr.clean, corr.clean)
    assert noise_lib.noise_checksum(as_labels) != base
    with pytest.raises(TypeError):
        noise_lib.noise_checksum(corr.image_index)
