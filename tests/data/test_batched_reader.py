"""The batch reader: a vectors folder's batches read many records per call
(``pipeline.BatchedRecords``) are the per-record path's batches, value for value and dtype
for dtype, for every pass shape the trainer reads (shuffled epochs, streams that cycle,
a resumed start, padding, several processes)."""

import numpy as np
import pytest

from ncljax import config as config_lib
from ncljax.data import noise, pipeline
from tests.data.test_vectors import load, make_arrays, write


def _pairs(tmp_path, *, cpi=5, rate=0.4):
    """A folder's training pairs, with correspondence and label-free noise: pair ``k``'s
    image is the noise's ``image_index[k]``."""
    arrays = make_arrays(cpi=cpi, dtype=np.float16, labels=True)
    split = load(write(tmp_path, arrays)).split("train")
    cfg = config_lib.base_config().noise
    cfg.kind, cfg.rate, cfg.seed = "per_caption", rate, 3
    pairs = pipeline.training_pairs(
        split, cfg, num_classes=4, image_fields=("global_image",), text_fields=("global_text",)
    )
    return pairs, arrays["train"]


def _one_at_a_time(record_fn):
    """The same records without ``many``: the per-record path."""
    return lambda k: record_fn(k)


def _read(dataset):
    with pipeline.reading(dataset) as batches:
        return list(batches)


def _assert_same(got, want):
    """Equal batches; the batched reader's vectors stay float16 (``to_device`` widens
    them), every other field has the per-record dtype."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        for x, y in zip(a, b, strict=True):
            assert set(x) == set(y)
            for key in y:
                vectors = key.startswith("global_")
                assert x[key].dtype == (np.float16 if vectors else y[key].dtype), key
                np.testing.assert_array_equal(x[key].astype(y[key].dtype), y[key], err_msg=key)


def test_many_is_the_records_stacked(tmp_path):
    pairs, train = _pairs(tmp_path)
    record_fn = pairs.record_fn
    assert isinstance(record_fn, pipeline.BatchedRecords)
    ks = np.array([59, 0, 7, 7, 31])
    many = record_fn.many(ks)
    _assert_same([many], [{key: np.stack([record_fn(int(k))[key] for k in ks]) for key in many}])
    image_index = noise.correspondence_noise(60, 5, rate=0.4, seed=3).image_index
    np.testing.assert_array_equal(many["global_image"], train["images"][image_index[ks]])
    np.testing.assert_array_equal(many["global_text"], train["texts"][ks])


def test_to_device_widens_half_floats_exactly():
    import jax

    from ncljax.train import mesh as mesh_lib

    mesh = mesh_lib.make_mesh()
    half = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float16)
    batch = {"global_image": half, "index": np.arange(8, dtype=np.int32)}
    out = pipeline.to_device(batch, mesh_lib.batch_sharding(mesh))
    assert out["global_image"].dtype == np.float32 and out["index"].dtype == np.int32
    np.testing.assert_array_equal(jax.device_get(out["global_image"]), half.astype(np.float32))


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("seed", [None, 4])
def test_batches_are_the_per_record_batches(tmp_path, processes, seed):
    pairs, _ = _pairs(tmp_path)
    for p in range(processes):
        kwargs = dict(
            batch_size=16,  # 60 pairs: the fourth batch holds 12 and 4 padding rows
            num_epochs=2,
            seed=seed,
            num_threads=2,
            process_index=p,
            process_count=processes,
        )
        got = _read(pipeline.batches(pairs.record_fn, 60, **kwargs))
        want = _read(pipeline.batches(_one_at_a_time(pairs.record_fn), 60, **kwargs))
        _assert_same(got, want)
        assert got[3]["mask"].all() == (p < processes - 1)  # the last slice is padded


@pytest.mark.parametrize("processes", [1, 2])
def test_stream_batches_are_the_per_record_batches(tmp_path, processes):
    """Two streams of a pass (one cycles in new shuffles, one ends and pads), from a
    resumed step, on each process."""
    pairs, _ = _pairs(tmp_path)
    streams = [
        pipeline.StreamOrder(np.arange(0, 60, 2), key=(1, 0)),
        pipeline.StreamOrder(np.arange(1, 20, 2), key=(1, 1), cycle=True),
    ]
    for p in range(processes):
        kwargs = dict(batch_size=8, num_steps=6, start=2, process_index=p, process_count=processes)
        got = _read(pipeline.stream_batches(pairs.record_fn, 60, streams, **kwargs))
        want = _read(
            pipeline.stream_batches(_one_at_a_time(pairs.record_fn), 60, streams, **kwargs)
        )
        _assert_same(got, want)


def test_an_index_out_of_range_is_named(tmp_path):
    _pairs(tmp_path)
    split = load(str(tmp_path)).split("train")
    with pytest.raises(IndexError, match="caption index 60 out of range"):
        split.captions_at(np.array([3, 60]))
    with pytest.raises(IndexError, match="image index -1 out of range"):
        split.images_at(np.array([-1]))
    with pytest.raises(ValueError, match="global vectors only"):
        split.images_at(np.array([0]), ("regions",))


@pytest.mark.parametrize("side", ["image", "caption"])
def test_item_records_read_many_at_once_the_items_they_name(tmp_path, side):
    """The evaluator's image and caption records (``image_records``/``caption_records``,
    every item or the items ``rows`` names) batched are the per-record records."""
    arrays = make_arrays(cpi=5, dtype=np.float16, labels=True)
    split = load(write(tmp_path, arrays)).split("train")
    make = pipeline.image_records if side == "image" else pipeline.caption_records
    fields = ("global_image",) if side == "image" else ("global_text",)
    source = arrays["train"]["images" if side == "image" else "texts"]
    n = split.num_images if side == "image" else split.num_captions
    for rows in (None, np.array([n - 1, 0, 3, 3, 2])):
        record_fn = make(split, fields, rows)
        assert isinstance(record_fn, pipeline.BatchedRecords)
        ks = np.array([4, 0, 2]) if rows is not None else np.array([n - 1, 0, 7, 7])
        many = record_fn.many(ks)
        one = {key: np.stack([record_fn(int(k))[key] for k in ks]) for key in many}
        _assert_same([many], [one])
        items = ks if rows is None else rows[ks]
        np.testing.assert_array_equal(many["index"], items)
        np.testing.assert_array_equal(many[fields[0]], source[items])
    batched = _read(pipeline.batches(make(split, fields), n, batch_size=16))
    per_record = _read(pipeline.batches(_one_at_a_time(make(split, fields)), n, batch_size=16))
    _assert_same(batched, per_record)
