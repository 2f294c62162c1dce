"""Tests for ncljax.data.pipeline.

Oracles: the documented epoch order ``np.random.default_rng((0x5F1E, seed, epoch)).permutation(N)``
with ``ceil(N / B)`` fixed-size batches padded by masked copies of record 0; records
rebuilt directly from the source split; noise rebuilt by ``ncljax.data.noise`` with the
same arguments.
"""

import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ncljax import config as config_lib
from ncljax.data import noise as noise_lib
from ncljax.data import pipeline, synthetic

IMAGE_FIELDS = ("regions", "global_image")
TEXT_FIELDS = ("tokens", "length", "global_text")


def toy_record(k):
    return {"index": np.int32(k), "mask": np.bool_(True), "x": np.float32(10 * k + 1)}


def collect(dataset):
    return [{key: np.asarray(value) for key, value in batch.items()} for batch in dataset]


def concat(batches, key):
    return np.concatenate([b[key] for b in batches])


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype, key
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def synthetic_split(num_train=40, captions_per_image=5, **overrides):
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test = num_train, 10, 10
    cfg.captions_per_image = captions_per_image
    for key, value in overrides.items():
        cfg[key] = value
    return synthetic.SyntheticDataset(cfg).split("train")


def noise_config(**fields):
    """The noise section with ``fields`` set (a dict value updates a kind's section)."""
    cfg = config_lib.base_config().noise
    for key, value in fields.items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("num_records", [23, 25])
def test_epochs_follow_the_documented_order_with_padding(num_records):
    batch_size, num_epochs, seed = 5, 3, 7
    per_epoch = math.ceil(num_records / batch_size)
    out = collect(
        pipeline.batches(
            toy_record, num_records, batch_size=batch_size, num_epochs=num_epochs, seed=seed
        )
    )
    assert pipeline.num_batches(num_records, batch_size) == per_epoch
    assert len(out) == num_epochs * per_epoch
    orders = []
    for epoch in range(num_epochs):
        epoch_batches = out[epoch * per_epoch : (epoch + 1) * per_epoch]
        for b in epoch_batches:
            assert {k: v.shape for k, v in b.items()} == {
                "index": (batch_size,),
                "mask": (batch_size,),
                "x": (batch_size,),
            }
            assert (b["index"].dtype, b["mask"].dtype, b["x"].dtype) == (
                np.int32,
                np.bool_,
                np.float32,
            )
        index, mask, x = (concat(epoch_batches, key) for key in ("index", "mask", "x"))
        expected = np.random.default_rng((0x5F1E, seed, epoch)).permutation(num_records)
        np.testing.assert_array_equal(index[mask], expected)
        np.testing.assert_array_equal(np.sort(index[mask]), np.arange(num_records))
        np.testing.assert_array_equal(x[mask], 10 * expected + 1)
        # Padding: masked copies of record 0 with index N, at the end of the last batch only.
        num_padded = per_epoch * batch_size - num_records
        np.testing.assert_array_equal(mask, np.arange(per_epoch * batch_size) < num_records)
        np.testing.assert_array_equal(index[~mask], np.full(num_padded, num_records))
        np.testing.assert_array_equal(x[~mask], np.full(num_padded, 1.0, np.float32))
        orders.append(index[mask])
    for a in range(num_epochs):
        for b in range(a + 1, num_epochs):
            assert not np.array_equal(orders[a], orders[b])


def test_no_seed_keeps_natural_order_every_epoch():
    out = collect(pipeline.batches(toy_record, 11, batch_size=4, num_epochs=2, seed=None))
    assert len(out) == 6
    for epoch in range(2):
        index = concat(out[3 * epoch : 3 * epoch + 3], "index")
        mask = concat(out[3 * epoch : 3 * epoch + 3], "mask")
        np.testing.assert_array_equal(index, [*range(11), 11])
        np.testing.assert_array_equal(mask, [True] * 11 + [False])


def test_same_seed_same_batches_whatever_the_threads():
    make = lambda seed, threads: collect(
        pipeline.batches(
            toy_record, 37, batch_size=8, num_epochs=2, seed=seed, num_threads=threads, prefetch=2
        )
    )
    reference = make(3, 1)
    assert_batches_equal(make(3, 1), reference)
    assert_batches_equal(make(3, 4), reference)
    other = make(4, 2)
    assert not np.array_equal(concat(other, "index"), concat(reference, "index"))


def test_seed_zero_is_a_seed_not_natural_order():
    out = collect(pipeline.batches(toy_record, 30, batch_size=10, seed=0))
    index = concat(out, "index")
    np.testing.assert_array_equal(index, np.random.default_rng((0x5F1E, 0, 0)).permutation(30))
    assert not np.array_equal(index, np.arange(30))


def test_empty_split_is_refused():
    with pytest.raises(ValueError, match="0 records"):
        pipeline.batches(toy_record, 0, batch_size=4)


# ---------------------------------------------------------------- processes


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(process_count):
    kwargs = dict(batch_size=8, num_epochs=2, seed=5)
    global_batches = collect(
        pipeline.batches(toy_record, 29, process_index=0, process_count=1, **kwargs)
    )
    local = [
        collect(
            pipeline.batches(toy_record, 29, process_index=p, process_count=process_count, **kwargs)
        )
        for p in range(process_count)
    ]
    assert len(global_batches) == 2 * 4
    for p in range(process_count):
        assert len(local[p]) == len(global_batches)
    for b, expected in enumerate(global_batches):
        for key in expected:
            assert local[0][b][key].shape == (8 // process_count,)
            joined = np.concatenate([local[p][b][key] for p in range(process_count)])
            np.testing.assert_array_equal(joined, expected[key], err_msg=f"{key} batch {b}")


def test_batch_size_must_divide_among_processes():
    with pytest.raises(ValueError, match="not divisible"):
        pipeline.batches(toy_record, 20, batch_size=5, process_index=0, process_count=2)


# ---------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("consumed", [1, 4, 7, 11])
def test_iterator_state_restores_the_remaining_batches(consumed):
    make = lambda: pipeline.batches(toy_record, 22, batch_size=4, num_epochs=2, seed=9)
    everything = collect(make())
    assert len(everything) == 12
    iterator = iter(make())
    for _ in range(consumed):
        next(iterator)
    state = iterator.get_state()
    rest = collect(iterator)
    assert_batches_equal(rest, everything[consumed:])
    # A new pipeline (as after a restart) resumes from the saved state.
    restored = iter(make())
    restored.set_state(state)
    assert_batches_equal(collect(restored), everything[consumed:])


# ---------------------------------------------------------------- records


def test_pair_records_read_the_paired_image_and_the_caption():
    split = synthetic_split(num_train=12)
    rng = np.random.default_rng(0)
    image_index = rng.integers(split.num_images, size=split.num_captions)
    record_fn = pipeline.pair_records(
        split, image_fields=IMAGE_FIELDS, text_fields=TEXT_FIELDS, image_index=image_index
    )
    labels_differ = 0
    for k in range(split.num_captions):
        record = record_fn(k)
        image, caption = split.image(int(image_index[k])), split.caption(k)
        assert set(record) == {*IMAGE_FIELDS, *TEXT_FIELDS, "label_image", "label_text"} | {
            "index",
            "mask",
        }
        for key in IMAGE_FIELDS:
            np.testing.assert_array_equal(record[key], image[key])
        for key in TEXT_FIELDS:
            np.testing.assert_array_equal(record[key], caption[key])
        assert record["label_image"] == image["label"]
        assert record["label_text"] == split.image(k // 5)["label"]
        assert record["index"] == k and bool(record["mask"])
        assert record["label_image"].dtype == record["label_text"].dtype == np.int32
        assert record["index"].dtype == np.int32 and record["mask"].dtype == np.bool_
        labels_differ += int(record["label_image"] != record["label_text"])
    assert labels_differ > 0  # the check above can tell the two labels apart


def test_pair_records_defaults_to_the_true_image_and_uses_given_labels():
    split = synthetic_split(num_train=12)
    n = split.num_captions
    labels_image = (np.arange(n) * 3) % 10
    labels_text = (np.arange(n) * 7 + 1) % 10
    record_fn = pipeline.pair_records(
        split,
        image_fields=("regions",),
        text_fields=("tokens",),
        labels_image=labels_image,
        labels_text=labels_text,
    )
    only_image = pipeline.pair_records(
        split, image_fields=("regions",), text_fields=("tokens",), labels_image=labels_image
    )
    for k in range(n):
        record = record_fn(k)
        assert set(record) == {"regions", "tokens", "label_image", "label_text", "index", "mask"}
        np.testing.assert_array_equal(record["regions"], split.image(k // 5)["regions"])
        np.testing.assert_array_equal(record["tokens"], split.caption(k)["tokens"])
        assert record["label_image"] == labels_image[k]
        assert record["label_text"] == labels_text[k]
        assert only_image(k)["label_text"] == split.image(k // 5)["label"]


def test_image_and_caption_records():
    split = synthetic_split(num_train=12)
    image_fn = pipeline.image_records(split, ["global_image"])
    caption_fn = pipeline.caption_records(split, ["tokens", "length"])
    for i in range(split.num_images):
        record = image_fn(np.int64(i))
        assert set(record) == {"global_image", "label", "index", "mask"}
        np.testing.assert_array_equal(record["global_image"], split.image(i)["global_image"])
        assert record["label"] == split.image_labels()[i] and record["label"].dtype == np.int32
        assert record["index"] == i and record["index"].dtype == np.int32
        assert record["mask"].dtype == np.bool_ and bool(record["mask"])
    for k in range(split.num_captions):
        record = caption_fn(k)
        assert set(record) == {"tokens", "length", "label", "index", "mask"}
        caption = split.caption(k)
        np.testing.assert_array_equal(record["tokens"], caption["tokens"])
        assert record["length"] == caption["length"]
        assert record["label"] == split.image_labels()[k // 5]
        assert record["index"] == k and bool(record["mask"])


def test_padding_of_real_records_is_a_masked_copy_of_record_zero():
    split = synthetic_split(num_train=5)  # 25 captions
    record_fn = pipeline.pair_records(split, image_fields=IMAGE_FIELDS, text_fields=TEXT_FIELDS)
    out = collect(pipeline.batches(record_fn, 25, batch_size=8, seed=1))
    last = out[-1]
    np.testing.assert_array_equal(last["mask"], [True] + [False] * 7)
    np.testing.assert_array_equal(last["index"][1:], np.full(7, 25))
    first = record_fn(0)
    for key in (*IMAGE_FIELDS, *TEXT_FIELDS, "label_image", "label_text"):
        for j in range(1, 8):
            np.testing.assert_array_equal(last[key][j], first[key], err_msg=key)


# ---------------------------------------------------------------- noise


def regions_of_records(pairs):
    return np.stack([pairs.record_fn(k)["regions"] for k in range(pairs.num_records)])


def true_regions(split):
    images = np.stack([split.image(i)["regions"] for i in range(split.num_images)])
    return np.repeat(images, split.captions_per_image, axis=0)


def make_pairs(split, noise_cfg):
    return pipeline.training_pairs(
        split,
        noise_cfg,
        num_classes=10,
        image_fields=("regions",),
        text_fields=("tokens",),
    )


def test_no_noise_is_the_identity():
    split = synthetic_split(num_train=20)
    pairs = make_pairs(split, noise_config(kind="none", rate=0.6, seed=3))
    n = split.num_captions
    assert pairs.num_records == n
    assert pairs.clean.dtype == np.bool_ and pairs.clean.all() and pairs.clean.shape == (n,)
    assert pairs.realised_rate == 0.0
    np.testing.assert_array_equal(regions_of_records(pairs), true_regions(split))
    identity = noise_lib.CorrespondenceNoise(np.arange(n) // 5, np.ones(n, bool), "none")
    assert pairs.checksum == noise_lib.noise_checksum(identity)


@pytest.mark.parametrize(
    ("protocol", "num_noisy"),
    [("per_caption", math.floor(0.4 * 123)), ("per_image", math.floor(0.4 * 41) * 3)],
)
def test_correspondence_noise_is_applied_to_the_records(protocol, num_noisy):
    split = synthetic_split(num_train=41, captions_per_image=3)
    n = split.num_captions  # 123
    pairs = make_pairs(split, noise_config(kind=protocol, rate=0.4, seed=11, pairs={"exact": True}))
    assert pairs.realised_rate == num_noisy / n
    records = regions_of_records(pairs)
    # Clean exactly when the record shows its caption's true image.
    shows_true_image = (records == true_regions(split)).all(axis=(1, 2))
    np.testing.assert_array_equal(pairs.clean, shows_true_image)
    assert np.count_nonzero(~pairs.clean) == num_noisy
    made = noise_lib.correspondence_noise(n, 3, rate=0.4, seed=11, protocol=protocol, exact=True)
    np.testing.assert_array_equal(records, true_regions(split)[made.image_index * 3])
    assert pairs.checksum == noise_lib.noise_checksum(made)
    other = make_pairs(split, noise_config(kind=protocol, rate=0.4, seed=12, pairs={"exact": True}))
    assert other.checksum != pairs.checksum


@pytest.mark.parametrize("kind", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("shared", [True, False])
def test_label_noise_is_applied_to_the_records(kind, shared):
    """5 captions per image: an image's label is corrupted once, for all its captions."""
    split = synthetic_split(num_train=40)
    n = split.num_captions
    cfg = noise_config(
        kind=kind, rate=0.5, seed=4, labels={"shared": shared}, symmetric={"exclude_true": False}
    )
    pairs = make_pairs(split, cfg)
    image_true = np.array([split.image(i)["label"] for i in range(split.num_images)])
    true_labels = image_true[np.arange(n) // 5]
    kwargs = dict(rate=0.5, seed=4, kind=kind)
    per_image = noise_lib.label_noise(image_true, 10, shared=True, **kwargs)
    expected_image = per_image.labels_image[np.arange(n) // 5]
    expected_text = (
        expected_image
        if shared
        else noise_lib.label_noise(true_labels, 10, shared=False, **kwargs).labels_text
    )
    records = [pairs.record_fn(k) for k in range(n)]
    observed_image = np.array([r["label_image"] for r in records])
    observed_text = np.array([r["label_text"] for r in records])
    np.testing.assert_array_equal(observed_image, expected_image)
    np.testing.assert_array_equal(observed_text, expected_text)
    np.testing.assert_array_equal(pairs.labels_image, expected_image)
    np.testing.assert_array_equal(pairs.labels_text, expected_text)
    assert (observed_image.reshape(-1, 5) == observed_image[::5, None]).all()
    assert (observed_image != true_labels).any()
    assert shared == np.array_equal(observed_image, observed_text)
    # Correspondence is untouched.
    np.testing.assert_array_equal(regions_of_records(pairs), true_regions(split))
    clean = (observed_image == true_labels) & (observed_text == true_labels)
    np.testing.assert_array_equal(pairs.clean, clean)
    image_rate = np.mean(observed_image != true_labels)
    text_rate = np.mean(observed_text != true_labels)
    assert pairs.realised_rate == pytest.approx((image_rate + text_rate) / 2, abs=1e-12)


@pytest.mark.parametrize("shared", [True, False])
def test_label_noise_with_one_caption_per_image_is_per_pair(shared):
    split = synthetic_split(num_train=60, captions_per_image=1)
    cfg = noise_config(kind="symmetric", rate=0.4, seed=1, labels={"shared": shared})
    pairs = make_pairs(split, cfg)
    true_labels = np.array([split.image(i)["label"] for i in range(split.num_images)])
    made = noise_lib.label_noise(true_labels, 10, rate=0.4, seed=1, shared=shared)
    np.testing.assert_array_equal(pairs.labels_image, made.labels_image)
    np.testing.assert_array_equal(pairs.labels_text, made.labels_text)
    assert pairs.checksum == noise_lib.noise_checksum(made)


def test_noise_file_is_used(tmp_path):
    split = synthetic_split(num_train=20)
    n = split.num_captions
    image_index = np.random.default_rng(2).integers(split.num_images, size=n).astype(np.int64)
    image_index[:10] = np.arange(10) // 5  # a few clean pairs
    path = tmp_path / "synthetic_precomp_0.5.npy"
    np.save(path, image_index)
    pairs = make_pairs(split, noise_config(kind="file", file={"path": str(path)}))
    images = np.stack([split.image(i)["regions"] for i in range(split.num_images)])
    np.testing.assert_array_equal(regions_of_records(pairs), images[image_index])
    truth = np.arange(n) // 5
    np.testing.assert_array_equal(pairs.clean, image_index == truth)
    assert pairs.realised_rate == np.mean(image_index != truth)
    expected = noise_lib.CorrespondenceNoise(image_index, image_index == truth, "file")
    assert pairs.checksum == noise_lib.noise_checksum(expected)


def test_noise_file_of_the_wrong_length_is_refused(tmp_path):
    split = synthetic_split(num_train=20)
    path = tmp_path / "wrong.npy"
    np.save(path, np.zeros(split.num_captions + 1, np.int64))
    with pytest.raises(ValueError, match=rf"length {split.num_captions}\b"):
        make_pairs(split, noise_config(kind="file", file={"path": str(path)}))
    with pytest.raises(ValueError, match=r"noise\.file"):
        make_pairs(split, noise_config(kind="file", file={"path": ""}))


# ---------------------------------------------------------------- devices


def test_to_device_shards_the_batch_over_eight_devices(devices):
    split = synthetic_split(num_train=8)
    record_fn = pipeline.pair_records(split, image_fields=IMAGE_FIELDS, text_fields=TEXT_FIELDS)
    batch = next(iter(pipeline.batches(record_fn, split.num_captions, batch_size=16, seed=0)))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    on_device = pipeline.to_device(batch, sharding)
    assert on_device.keys() == batch.keys()
    for key, value in batch.items():
        array = on_device[key]
        assert array.shape == value.shape and array.dtype == value.dtype, key
        assert array.sharding.is_equivalent_to(sharding, value.ndim)
        assert array.sharding.device_set == set(devices)
        np.testing.assert_array_equal(np.asarray(array), value, err_msg=key)
        shards = array.addressable_shards
        assert len(shards) == 8
        for shard in shards:
            assert shard.data.shape[0] == 2
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


@pytest.mark.parametrize("process_count", [1, 2])
def test_length_buckets_cut_only_padding_and_agree_across_processes(process_count):
    n, batch_size = 23, 8
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 20, size=n)
    lengths[0] = 19  # record 0 pads the last batch

    def record(k):
        tokens = np.zeros(20, np.int32)
        tokens[: lengths[k]] = 7
        return {"tokens": tokens, "index": np.int32(k), "mask": np.bool_(True)}

    buckets = (4, 8, 12, 16)
    per_process = [
        list(
            pipeline.batches(
                record,
                n,
                batch_size=batch_size,
                num_epochs=2,
                seed=3,
                process_index=p,
                process_count=process_count,
                lengths=lengths,
                length_buckets=buckets,
            )
        )
        for p in range(process_count)
    ]
    for b, parts in enumerate(zip(*per_process, strict=True)):
        widths = {part["tokens"].shape[1] for part in parts}
        assert len(widths) == 1  # every process cuts the global batch alike
        index = np.concatenate([part["index"] for part in parts])
        longest = max(lengths[i] if i < n else lengths[0] for i in index)
        fits = [x for x in buckets if x >= longest]
        assert widths.pop() == (fits[0] if fits else 20), b
        for part in parts:  # only zeros were cut
            full = np.stack([record(i if i < n else 0)["tokens"] for i in part["index"]])
            width = part["tokens"].shape[1]
            np.testing.assert_array_equal(part["tokens"], full[:, :width])
            assert not full[:, width:].any()


def test_epoch_zero_does_not_visit_the_noisy_pairs_first():
    """Regression: ``default_rng((seed, 0))`` is ``default_rng(seed)`` (trailing zero words do
    not count), the generator that picks the noisy captions: epoch 0 visited them first."""
    from ncljax.data import noise

    n = 500
    clean = noise.correspondence_noise(n, 5, rate=0.4, seed=0).clean
    index = concat(collect(pipeline.batches(toy_record, n, batch_size=n, seed=0)), "index")
    first = index[: int(0.4 * n)]
    assert 0.45 < clean[first].mean() < 0.75  # about the 60% clean of the whole set


@pytest.mark.parametrize("size", [1, 2, 3, 10])
def test_prefetch_to_device_puts_ahead_and_keeps_order(size):
    events = []

    def source():
        for k in range(5):
            events.append(("read", k))
            yield k

    def put(k):
        events.append(("put", k))
        return {"x": np.full(3, k)}

    out = []
    for batch in pipeline.prefetch_to_device(source(), put, size=size):
        events.append(("step", int(batch["x"][0])))
        out.append(int(batch["x"][0]))
    assert out == [0, 1, 2, 3, 4]
    ahead = max(min(size, 5), 1)
    for k in range(5):
        # Batch k is handed out after batch min(k + size - 1, 4) was put, never later.
        before_step = events[: events.index(("step", k))]
        assert ("put", min(k + ahead - 1, 4)) in before_step
        if k + ahead <= 4:
            assert ("put", k + ahead) not in before_step


@pytest.mark.parametrize("num", [0, 1, 7, 1000, 65_537])
def test_a_shuffle_is_numpys_permutation_in_int32(num):
    """The epoch orders are int32 (half the memory of int64) and the very permutation
    ``Generator.permutation`` gives for the same key, so runs and checkpoints made before
    keep their batches."""
    for key in ((0, 0), (3, 5, 1), (3, 5, 1, 2)):
        order = pipeline.shuffled(num, key)
        oracle = np.random.default_rng((pipeline.SHUFFLE_STREAM, *key)).permutation(num)
        assert order.dtype == np.int32
        np.testing.assert_array_equal(order, oracle)
    assert pipeline.index_dtype(2**31 - 1) == np.int32
    assert pipeline.index_dtype(2**31) == np.int64
