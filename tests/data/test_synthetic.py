"""Tests for ncljax.data.synthetic and the dataset registry.

The oracle is the documented generative world: an image's latent (class, concepts,
attributes) and the world's parameters (``concept``, ``attribute``, ``background``,
``mix``, ``image_view``, ``word_view`` and the vocabulary offsets) determine what its
regions and captions may contain. Tests read these documented internals through
``split._latent`` and ``split._world``.
"""

import numpy as np
import pytest

from ncljax.data import sources, synthetic
from ncljax.data.synthetic import END, PAD, START

INDICES = (0, 7, 33, 59, 12)


def small_config(**overrides):
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test = 60, 20, 20
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def split_of(split="train", **overrides):
    return synthetic.SyntheticDataset(small_config(**overrides)).split(split)


def assert_example_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert np.asarray(a[key]).dtype == np.asarray(b[key]).dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def word_kind(word, world, cfg):
    """('noun', concept) / ('attribute', attribute) / ('filler', id) from the vocabulary layout."""
    if world.noun0 <= word < world.attr0:
        return "noun", (word - world.noun0) // cfg.synonyms
    if world.attr0 <= word < world.filler0:
        return "attribute", word - world.attr0
    if world.filler0 <= word < world.filler0 + cfg.filler_words:
        return "filler", word - world.filler0
    return "other", word


# ---------------------------------------------------------------- determinism


def test_examples_are_a_pure_function_of_seed_split_and_index():
    first = split_of()
    images = {i: first.image(i) for i in INDICES}
    captions = {k: first.caption(k) for k in (5 * i + 2 for i in INDICES)}
    # A fresh dataset, captions before images, indices in reverse order.
    fresh = split_of()
    for k in sorted(captions, reverse=True):
        assert_example_equal(fresh.caption(k), captions[k])
    for i in sorted(images, reverse=True):
        assert_example_equal(fresh.image(i), images[i])
    # Re-reading the first object, after other indices were touched, gives the same.
    for i in INDICES:
        first.image((i + 1) % first.num_images)
        assert_example_equal(first.image(i), images[i])


def test_cache_does_not_change_examples():
    cached, uncached = split_of(cache=True), split_of(cache=False)
    for i in INDICES:
        assert_example_equal(cached.image(i), uncached.image(i))
        assert_example_equal(cached.image(i), cached.image(i))
        for k in range(5 * i, 5 * i + 5):
            assert_example_equal(cached.caption(k), uncached.caption(k))
    np.testing.assert_array_equal(cached.image_labels(), uncached.image_labels())


def test_data_seed_changes_examples():
    a, b = split_of(seed=0), split_of(seed=1)
    for i in INDICES:
        assert not np.array_equal(a.image(i)["regions"], b.image(i)["regions"])
        assert not np.array_equal(a.image(i)["global_image"], b.image(i)["global_image"])
        assert not np.array_equal(a.caption(i)["global_text"], b.caption(i)["global_text"])
    tokens_a = np.stack([a.caption(k)["tokens"] for k in range(100)])
    tokens_b = np.stack([b.caption(k)["tokens"] for k in range(100)])
    assert (tokens_a != tokens_b).any(axis=1).mean() > 0.9


def test_splits_differ():
    ds = synthetic.SyntheticDataset(small_config())
    splits = [ds.split(name) for name in ("train", "val", "test")]
    for i in range(20):
        regions = [s.image(i)["regions"] for s in splits]
        for a in range(3):
            for b in range(a + 1, 3):
                assert not np.array_equal(regions[a], regions[b])
    tokens = [np.stack([s.caption(k)["tokens"] for k in range(100)]) for s in splits]
    for a in range(3):
        for b in range(a + 1, 3):
            assert (tokens[a] != tokens[b]).any(axis=1).mean() > 0.9
    labels = [s.image_labels()[:20] for s in splits]
    assert not np.array_equal(labels[0], labels[1])
    assert not np.array_equal(labels[0], labels[2])


# ---------------------------------------------------------------- captions


def test_captions_follow_the_generative_story():
    cfg = small_config()
    split = synthetic.SyntheticDataset(cfg).split("train")
    world = split._world
    concept_slots = mentioned_concepts = with_attribute = 0
    for k in range(split.num_captions):
        caption = split.caption(k)
        label, concepts, attributes = split._latent(k // cfg.captions_per_image)
        attribute_of = dict(zip(concepts.tolist(), attributes.tolist(), strict=True))
        tokens, length = caption["tokens"], int(caption["length"])
        assert tokens.shape == (cfg.max_length,) and tokens.dtype == np.int32
        assert caption["length"].dtype == np.int32
        assert 3 <= length <= cfg.max_length
        assert tokens[0] == START and tokens[length - 1] == END
        assert (tokens[length:] == PAD).all()
        assert caption["label"] == label == split.image(k // cfg.captions_per_image)["label"]

        kinds = [word_kind(int(w), world, cfg) for w in tokens[1 : length - 1]]
        nouns = [c for kind, c in kinds if kind == "noun"]
        assert all(kind in ("noun", "attribute", "filler") for kind, _ in kinds), kinds
        assert set(nouns) <= set(attribute_of), (nouns, concepts)
        assert len(nouns) >= 1
        assert len(nouns) == len(set(nouns)), "a concept is mentioned at most once"
        assert sum(kind == "filler" for kind, _ in kinds) <= cfg.max_fillers
        for (kind, value), (next_kind, concept) in zip(
            kinds, [*kinds[1:], ("end", None)], strict=True
        ):
            if kind == "attribute":
                assert next_kind == "noun", kinds
                assert value == attribute_of[concept], "the attribute is the concept's own"
        concept_slots += concepts.size
        mentioned_concepts += len(nouns)
        with_attribute += sum(kind == "attribute" for kind, _ in kinds)
    # Frequencies over 300 captions x 4 concepts; the forced mention when none was drawn
    # adds about 0.2**4 / 4 to the mention rate.
    assert abs(mentioned_concepts / concept_slots - cfg.mention_prob) < 0.05
    assert abs(with_attribute / mentioned_concepts - cfg.attribute_mention_prob) < 0.05


def test_all_synonyms_and_all_fillers_are_used():
    cfg = small_config()
    split = synthetic.SyntheticDataset(cfg).split("train")
    world = split._world
    synonym_used, fillers = set(), set()
    for k in range(split.num_captions):
        tokens = split.caption(k)["tokens"]
        for w in tokens[tokens > END]:
            kind, _ = word_kind(int(w), world, cfg)
            if kind == "noun":
                synonym_used.add(int(w - world.noun0) % cfg.synonyms)
            elif kind == "filler":
                fillers.add(int(w))
    assert synonym_used == set(range(cfg.synonyms))
    assert len(fillers) > 0.8 * cfg.filler_words


def test_global_text_is_a_view_of_the_caption_tokens():
    cfg = small_config(global_noise=0.0)
    split = synthetic.SyntheticDataset(cfg).split("train")
    world = split._world
    for k in range(split.num_captions):
        caption = split.caption(k)
        words = caption["tokens"][1 : int(caption["length"]) - 1]
        expected = np.tanh(world.word_view[words].sum(0) / np.sqrt(words.size))
        assert caption["global_text"].shape == (cfg.text_dim,)
        assert caption["global_text"].dtype == np.float32
        np.testing.assert_allclose(caption["global_text"], expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- images


def concept_rows(world, cfg, concepts, attributes):
    latent = world.concept[concepts] + cfg.attribute_weight * world.attribute[attributes]
    return np.tanh(latent @ world.mix).astype(np.float32)


def matches(rows, table, atol=1e-6):
    """bool [len(rows), len(table)]: row i equals table row j."""
    return np.abs(rows[:, None, :] - table[None, :, :]).max(-1) <= atol


def test_regions_are_concept_regions_plus_background_without_noise():
    cfg = small_config(region_noise=0.0, global_noise=0.0)
    split = synthetic.SyntheticDataset(cfg).split("train")
    world = split._world
    background = np.tanh(world.background @ world.mix).astype(np.float32)
    m, r = cfg.concepts_per_image, cfg.num_regions
    concept_positions = set()
    for i in range(split.num_images):
        image = split.image(i)
        regions = image["regions"]
        assert regions.shape == (r, cfg.region_dim) and regions.dtype == np.float32
        _, concepts, attributes = split._latent(i)
        expected = concept_rows(world, cfg, concepts, attributes)
        is_concept = matches(regions, expected)
        # Every concept has exactly one region, each region is at most one concept.
        np.testing.assert_array_equal(is_concept.sum(0), np.ones(m))
        assert is_concept.sum(1).max() == 1
        # The others are background clutter.
        rest = ~is_concept.any(1)
        assert rest.sum() == r - m
        assert matches(regions[rest], background).any(1).all()
        assert not matches(regions[~rest], background).any()
        concept_positions.update(np.flatnonzero(~rest).tolist())
        # The global view of the mean region.
        pooled = np.tanh(regions.astype(np.float64).mean(0) @ world.image_view)
        assert image["global_image"].shape == (cfg.image_dim,)
        assert image["global_image"].dtype == np.float32
        np.testing.assert_allclose(image["global_image"], pooled, rtol=0, atol=1e-5)
    # Region order is random: concept regions are not always the first m rows.
    assert concept_positions == set(range(r))


def test_images_sharing_a_concept_attribute_share_exactly_that_region():
    cfg = small_config(region_noise=0.0, num_train=200)
    split = synthetic.SyntheticDataset(cfg).split("train")
    background = np.tanh(split._world.background @ split._world.mix).astype(np.float32)
    pairs_by_shared = {0: 0, 1: 0}
    for i in range(0, 200, 2):
        for j in range(i + 1, 200, 7):
            a, b = split._latent(i), split._latent(j)
            shared = len(set(zip(a[1], a[2], strict=True)) & set(zip(b[1], b[2], strict=True)))
            if shared > 1 or pairs_by_shared[shared] >= 20:
                continue
            pairs_by_shared[shared] += 1
            ra, rb = split.image(i)["regions"], split.image(j)["regions"]
            common = matches(ra, rb, atol=0.0)
            not_background = ~matches(ra, background).any(1)
            assert common[not_background].sum() == shared, (i, j)
    assert pairs_by_shared == {0: 20, 1: 20}


def test_region_values_are_tanh_bounded_and_noise_makes_every_image_distinct():
    split = split_of()  # default region_noise > 0
    regions = np.stack([split.image(i)["regions"] for i in range(split.num_images)])
    assert np.abs(regions).max() < 1.0
    flat = regions.reshape(-1, regions.shape[-1])
    assert np.unique(flat, axis=0).shape[0] == flat.shape[0]


# ---------------------------------------------------------------- labels and latent


def test_labels_are_balanced_and_image_labels_agree_with_images():
    cfg = small_config(num_train=2000, cache=False)
    split = synthetic.SyntheticDataset(cfg).split("train")
    labels = split.image_labels()
    assert labels.dtype == np.int64 and labels.shape == (2000,)
    expected = np.array([split.image(i, ("regions",))["label"] for i in range(2000)])
    np.testing.assert_array_equal(labels, expected)
    assert labels.min() >= 0 and labels.max() < cfg.num_classes
    counts = np.bincount(labels, minlength=cfg.num_classes)
    mean = 2000 / cfg.num_classes
    assert np.all(np.abs(counts - mean) < 0.4 * mean), counts


def test_latent_concepts_are_distinct_and_mostly_from_the_class_core():
    cfg = small_config(num_train=2000, cache=False)
    split = synthetic.SyntheticDataset(cfg).split("train")
    core = split._world.core
    assert core.shape == (cfg.num_classes, cfg.core_concepts)
    in_core = 0
    for i in range(2000):
        label, concepts, attributes = split._latent(i)
        assert concepts.shape == attributes.shape == (cfg.concepts_per_image,)
        assert np.unique(concepts).size == cfg.concepts_per_image
        assert concepts.min() >= 0 and concepts.max() < cfg.num_concepts
        assert attributes.min() >= 0 and attributes.max() < cfg.num_attributes
        in_core += np.isin(concepts, core[label]).sum()
    purity = cfg.class_purity
    expected = purity + (1 - purity) * cfg.core_concepts / cfg.num_concepts
    assert abs(in_core / (2000 * cfg.concepts_per_image) - expected) < 0.03


# ---------------------------------------------------------------- info and errors


def test_load_dataset_builds_synthetic_with_documented_info():
    cfg = small_config(captions_per_image=3)
    ds = sources.load_dataset(cfg)
    assert isinstance(ds, synthetic.SyntheticDataset)
    info = ds.info
    vocab = 4 + cfg.num_concepts * cfg.synonyms + cfg.num_attributes + cfg.filler_words
    assert info.vocab_size == vocab == ds.split("train")._world.vocab_size
    assert info.split_sizes == {"train": (60, 180), "val": (20, 60), "test": (20, 60)}
    assert (info.captions_per_image, info.num_classes) == (3, cfg.num_classes)
    assert (info.num_regions, info.region_dim) == (cfg.num_regions, cfg.region_dim)
    assert (info.image_dim, info.text_dim, info.max_length) == (64, 64, 16)
    for name in ("train", "val", "test"):
        split = ds.split(name)
        assert (split.num_images, split.num_captions) == info.split_sizes[name]
        assert split.captions_per_image == 3


def test_load_dataset_rejects_unknown_name():
    cfg = small_config()
    cfg.name = "flickr31k"
    with pytest.raises(ValueError, match=r"Unknown dataset 'flickr31k'.*'synthetic'"):
        sources.load_dataset(cfg)


def test_too_many_concepts_for_the_regions_is_refused():
    with pytest.raises(ValueError, match=r"data\.num_regions"):
        synthetic.SyntheticDataset(small_config(num_regions=3, concepts_per_image=4))


@pytest.mark.parametrize("cache", [True, False])
def test_out_of_range_indices_raise_index_error(cache):
    split = split_of(cache=cache)
    for bad in (-1, split.num_images):
        with pytest.raises(IndexError, match="image index"):
            split.image(bad)
    for bad in (-1, split.num_captions):
        with pytest.raises(IndexError, match="caption index"):
            split.caption(bad)
    split.image(split.num_images - 1)
    split.caption(split.num_captions - 1)


def test_unknown_split_is_refused():
    ds = synthetic.SyntheticDataset(small_config())
    with pytest.raises(ValueError, match=r"'dev'.*'train', 'val', 'test'"):
        ds.split("dev")


@pytest.mark.parametrize("field", ["region_dim", "image_dim", "text_dim"])
def test_empty_features_are_refused(field):
    """The generated features are never all zero; size 0 is the one way to make them
    carry nothing."""
    with pytest.raises(ValueError, match=rf"data\.{field} must be positive, got 0"):
        synthetic.SyntheticDataset(small_config(**{field: 0}))


@pytest.mark.parametrize(
    ("config", "field", "value", "message"),
    [
        ("vse", "captions_per_image", 0, "data.captions_per_image must be at least 1, got 0: "),
        ("ce", "num_classes", 0, "data.num_classes must be at least 2, got 0: "),
        ("ce", "num_classes", 1, "data.num_classes must be at least 2, got 1: "),
    ],
)
def test_sizes_without_captions_or_classes_are_refused_by_name(
    tmp_path, config, field, value, message
):
    """Once "train.batch_size=64 is larger than the training split (0 pairs)" and "need at
    least one array to stack": now the field itself, through the public config path."""
    from ncljax.train import train_and_evaluate
    from tests.train.test_loop import load_config

    config = load_config(config, "synthetic,quick")
    config.data[field] = value
    with pytest.raises(ValueError) as err:
        train_and_evaluate(config, str(tmp_path / "run"))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value
    assert not (tmp_path / "run").exists()


def test_too_short_max_length_is_refused_not_truncated():
    with pytest.raises(ValueError, match="raise it to at least 13"):
        synthetic.SyntheticDataset(small_config(max_length=6))


def test_cached_examples_are_read_only_and_fields_may_be_a_list():
    split = synthetic.SyntheticDataset(small_config()).split("train")
    regions = split.image(0, ["regions"])["regions"]
    with pytest.raises(ValueError, match="read-only"):
        regions[:] = 0
    np.testing.assert_array_equal(split.image(0, ("regions",))["regions"], regions)
