"""Input pipeline: random-access sources into Grain, then batches onto the device mesh.

Records are dicts of numpy arrays. Training records are pairs: caption ``k`` with the
image the (possibly noisy) correspondence gives it, the observed labels, ``index = k``
and ``mask = True``.

Batches have a fixed global size ``B``: an epoch of ``N`` records is ``ceil(N / B)``
batches, the last one padded with masked copies of record 0 (``mask = False``,
``index = N``) so that shapes stay static and nothing is dropped. Epoch ``e`` visits
the records in the order ``permutation(seed, e)``; batch ``b`` of epoch ``e`` is the
same whatever the number of devices or processes. Each process reads its contiguous
slice of every global batch (``B / process_count`` records), and ``to_device``
assembles the global array with a ``NamedSharding`` on the ``data`` axis. A resumed
run does not restore an iterator: its checkpoint holds the epoch's index sets (the
streams of every pass, ``ncljax.train.passes.encode_streams``), the pass and the step
position within it, and the batches from there are rebuilt from the seed, so a resumed
epoch walks the same batches.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import grain
import jax
import numpy as np

from ncljax.data import noise, sources

Record = dict[str, np.ndarray]


def pair_records(
    split: sources.SplitSource,
    *,
    image_fields: Sequence[str],
    text_fields: Sequence[str],
    image_index: np.ndarray | None = None,
    labels_image: np.ndarray | None = None,
    labels_text: np.ndarray | None = None,
) -> Callable[[int], Record]:
    """Returns ``record(k)``: caption ``k`` paired with image ``image_index[k]``.

    Args:
      split: the source split.
      image_fields: image fields to read (``regions``, ``global_image``).
      text_fields: caption fields to read (``tokens``, ``length``, ``global_text``).
      image_index: int ``[num_captions]`` image of each training pair (noisy
        correspondence); default: the true image ``k // captions_per_image``.
      labels_image: observed image labels per pair ``[num_captions]`` (noisy labels);
        default: the true label of the paired image.
      labels_text: observed caption labels per pair; default: the true caption label.
    """
    if image_index is None:
        image_index = np.arange(split.num_captions) // split.captions_per_image
    image_fields, text_fields = tuple(image_fields), tuple(text_fields)
    image_index = np.asarray(image_index)

    def record(k: int) -> Record:
        k = int(k)
        image = split.image(int(image_index[k]), image_fields)
        caption = split.caption(k, text_fields)
        out = {f: image[f] for f in image_fields}
        out.update({f: caption[f] for f in text_fields})
        out["label_image"] = np.int32(image["label"] if labels_image is None else labels_image[k])
        out["label_text"] = np.int32(caption["label"] if labels_text is None else labels_text[k])
        out["index"] = np.int32(k)
        out["mask"] = np.bool_(True)
        return out

    if not (hasattr(split, "images_at") and hasattr(split, "captions_at")):
        return record
    labels_image = None if labels_image is None else np.asarray(labels_image)
    labels_text = None if labels_text is None else np.asarray(labels_text)

    def many(ks: np.ndarray) -> Record:
        ks = np.asarray(ks, np.int64)
        image = split.images_at(image_index[ks], image_fields)
        caption = split.captions_at(ks, text_fields)
        out = {f: image[f] for f in image_fields}
        out.update({f: caption[f] for f in text_fields})
        observed_image = image["label"] if labels_image is None else labels_image[ks]
        observed_text = caption["label"] if labels_text is None else labels_text[ks]
        out["label_image"] = np.asarray(observed_image, np.int32)
        out["label_text"] = np.asarray(observed_text, np.int32)
        out["index"] = ks.astype(np.int32)
        out["mask"] = np.ones(ks.shape, np.bool_)
        return out

    return BatchedRecords(record, many)


class BatchedRecords:
    """Random access to records one at a time (``records(k)``) and many at a time
    (``records.many(ks)``: the records of ``ks`` stacked, as ``np.stack`` of
    ``records(k)`` would give them, except that float vectors may keep their source's
    float16, which ``to_device`` widens). The batch readers below read a batch in one
    ``many`` call, a few vectorised gathers, instead of one Python call per record; the
    batches hold the same records in the same order."""

    def __init__(self, one: Callable[[int], Record], many: Callable[[np.ndarray], Record]):
        self._one, self.many = one, many

    def __call__(self, k: int) -> Record:
        return self._one(k)


def _stacked(record_fn: Callable[[int], Record], ks: np.ndarray, pad: Record, size: int) -> Record:
    """The records of ``ks`` then ``size - len(ks)`` copies of ``pad``, stacked (``size``
    rows), read in one ``record_fn.many`` call."""
    got = record_fn.many(np.asarray(ks, np.int64))  # zero rows when ks is empty
    missing = size - len(ks)
    if not missing:
        return got
    padding = {k: np.broadcast_to(v, (missing, *np.shape(v))) for k, v in pad.items()}
    return {k: np.concatenate([got[k], padding[k].astype(got[k].dtype)]) for k in got}


def _item_records(
    split: sources.SplitSource, fields: Sequence[str], side: str, rows: np.ndarray | None
) -> Callable[[int], Record]:
    """``record(i)`` for item ``rows[i]`` (default ``i``) of a split's ``side`` (``'image'``
    or ``'caption'``), with ``label``, ``index`` (the item's own) and ``mask``; batched
    (``BatchedRecords``) where the split reads many items at once."""
    fields = tuple(fields)
    get = split.image if side == "image" else split.caption
    rows = None if rows is None else np.asarray(rows, np.int64)

    def record(i: int) -> Record:
        item = int(i if rows is None else rows[int(i)])
        got = get(item, fields)
        out = {f: got[f] for f in fields}
        out.update(label=np.int32(got["label"]), index=np.int32(item), mask=np.bool_(True))
        return out

    get_many = getattr(split, "images_at" if side == "image" else "captions_at", None)
    if get_many is None:
        return record

    def many(ks: np.ndarray) -> Record:
        items = np.asarray(ks, np.int64) if rows is None else rows[np.asarray(ks, np.int64)]
        got = get_many(items, fields)
        out = {f: got[f] for f in fields}
        out.update(
            label=np.asarray(got["label"], np.int32),
            index=items.astype(np.int32),
            mask=np.ones(items.shape, np.bool_),
        )
        return out

    return BatchedRecords(record, many)


def image_records(
    split: sources.SplitSource, fields: Sequence[str], rows: np.ndarray | None = None
) -> Callable[[int], Record]:
    """Returns ``record(i)`` for image ``i`` of ``split`` (with ``label``, ``index``,
    ``mask``), or for image ``rows[i]``."""
    return _item_records(split, fields, "image", rows)


def caption_records(
    split: sources.SplitSource, fields: Sequence[str], rows: np.ndarray | None = None
) -> Callable[[int], Record]:
    """Returns ``record(k)`` for caption ``k`` of ``split`` (``label``, ``index``,
    ``mask``), or for caption ``rows[k]``."""
    return _item_records(split, fields, "caption", rows)


def num_batches(num_records: int, batch_size: int) -> int:
    """Batches per epoch: ``ceil(num_records / batch_size)``; the last one is padded."""
    return -(-num_records // batch_size)


def _padding(record_fn: Callable[[int], Record], num_records: int) -> Record:
    # A copy of a real record, masked out: models see ordinary inputs (no zero-length
    # caption, no all-zero features whose gradients are undefined).
    pad = dict(record_fn(0))
    pad["index"] = np.int32(num_records)
    pad["mask"] = np.bool_(False)
    return pad


def batches(
    record_fn: Callable[[int], Record],
    num_records: int,
    *,
    batch_size: int,
    num_epochs: int = 1,
    seed: int | None = None,
    num_threads: int = 2,
    prefetch: int = 4,
    process_index: int | None = None,
    process_count: int | None = None,
    lengths: np.ndarray | None = None,
    length_buckets: Sequence[int] = (),
) -> grain.IterDataset:
    """Fixed-size batches of ``num_epochs`` passes over ``record_fn(0..num_records-1)``.

    Args:
      record_fn: random access to records.
      num_records: ``N``.
      batch_size: the global batch size ``B``; must be divisible by the process count.
      num_epochs: number of passes; batches never straddle two epochs.
      seed: epoch ``e`` visits records in ``shuffled(N, (seed, e))`` order; ``None`` keeps
        the natural order (evaluation and statistics passes).
      num_threads: Grain reader threads.
      prefetch: batches to read ahead.
      process_index: this process (default ``jax.process_index()``).
      process_count: number of processes (default ``jax.process_count()``).
      lengths: token count of every record ``[num_records]``; with ``length_buckets``,
        each batch's ``tokens`` are cut to the smallest bucket that holds the longest
        caption of the *global* batch (every process cuts alike; only padding is cut),
        so a step pays for the batch's captions, not the dataset's longest one. The step
        then compiles once per bucket in use.
      length_buckets: increasing token lengths; lengths beyond the last keep the full
        padded length.

    Returns:
      A Grain ``IterDataset`` of per-process batches (``B / process_count`` records each)
      whose iterators are checkpointable.
    """
    if num_records < 1:
        raise ValueError("Cannot batch an empty split: it has 0 records.")
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if batch_size % process_count:
        raise ValueError(
            f"Batch size {batch_size} is not divisible by the {process_count} processes."
        )
    local = batch_size // process_count
    per_epoch = num_batches(num_records, batch_size)
    pad = _padding(record_fn, num_records)

    @functools.lru_cache(maxsize=2)
    def order(epoch: int) -> np.ndarray:
        if seed is None:
            return np.arange(num_records)
        return shuffled(num_records, (seed, epoch))

    def slot(i: int) -> Record:
        epoch, rest = divmod(int(i), per_epoch * local)
        b, j = divmod(rest, local)
        position = b * batch_size + process_index * local + j
        if position >= num_records:
            return pad
        return record_fn(order(epoch)[position])

    def batch(g: int) -> Record:
        epoch, b = divmod(int(g), per_epoch)
        first = b * batch_size + process_index * local
        positions = np.arange(first, min(first + local, num_records))
        return _stacked(record_fn, order(epoch)[positions], pad, local)

    if hasattr(record_fn, "many"):
        ds = grain.MapDataset.range(num_epochs * per_epoch).map(batch)
    else:
        ds = grain.MapDataset.range(num_epochs * per_epoch * local).map(slot).batch(local)
    if length_buckets:
        if lengths is None:
            raise ValueError("length_buckets need the token count of every record (lengths).")
        buckets = np.asarray(sorted(length_buckets))

        def bucket(b: int) -> int:
            """Bucket of global batch ``b`` (its longest caption over all processes)."""
            epoch, batch = divmod(b, per_epoch)
            positions = np.arange(batch * batch_size, min((batch + 1) * batch_size, num_records))
            longest = int(lengths[order(epoch)[positions]].max())
            if positions.size < batch_size:  # the padding copies record 0
                longest = max(longest, int(lengths[0]))
            fits = buckets[buckets >= longest]
            return int(fits[0]) if fits.size else -1

        def cut(b: int, batch: Record) -> Record:
            size = bucket(b)
            if size < 0 or size >= batch["tokens"].shape[1]:
                return batch
            return {**batch, "tokens": batch["tokens"][:, :size]}

        ds = ds.map_with_index(cut)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return ds.to_iter_dataset(options)


# Shuffles draw from ``default_rng((SHUFFLE_STREAM, *key))``. Without the tag a key with a
# trailing 0, such as ``(seed, epoch=0)``, seeds the same generator as ``default_rng(seed)``
# (numpy's SeedSequence ignores trailing zero words), the noise's generator
# (``ncljax.data.noise``): epoch 0 would visit the noisy pairs first.
SHUFFLE_STREAM = 0x5F1E


def index_dtype(num: int) -> np.dtype:
    """The integer type of indices into ``num`` records: int32 where it holds them (half
    the memory of int64 for an epoch's orders and streams), int64 beyond."""
    return np.dtype(np.int32 if num <= np.iinfo(np.int32).max else np.int64)


def shuffled(num: int, key: tuple[int, ...]) -> np.ndarray:
    """The permutation of ``range(num)`` of shuffle ``key`` (an epoch, a pass, a cycle), in
    :func:`index_dtype`: ``Generator.shuffle`` of ``arange(num)``, the permutation that
    ``Generator.permutation(num)`` gives (the same draws whatever the integer type)."""
    order = np.arange(num, dtype=index_dtype(num))
    np.random.default_rng((SHUFFLE_STREAM, *key)).shuffle(order)
    return order


class StreamOrder(NamedTuple):
    """The visiting order of one stream of a pass: which records, in which order.

    Attributes:
      indices: record indices of the stream ``[M]``.
      key: seed sequence of its shuffles; ``None`` keeps ``indices`` in order.
      cycle: the stream restarts in a new shuffle when exhausted (auxiliary streams).
      drop_remainder: batches are full; a stream's (or cycle's) last partial batch is
        skipped, unless the stream holds less than one batch.
    """

    indices: np.ndarray
    key: tuple[int, ...] | None
    cycle: bool = False
    drop_remainder: bool = False

    def batches_per_cycle(self, batch_size: int) -> int:
        m = len(self.indices)
        if self.drop_remainder and m >= batch_size:
            return m // batch_size
        return num_batches(m, batch_size) if m else 0

    def order(self, cycle: int) -> np.ndarray:
        if self.key is None:
            return self.indices
        key = self.key if cycle == 0 else (*self.key, cycle)
        return self.indices[shuffled(len(self.indices), key)]

    def locate(self, b: int, batch_size: int) -> tuple[int, int]:
        """``(cycle, batch within the cycle)`` of global batch ``b``."""
        per = self.batches_per_cycle(batch_size)
        if per == 0 or not self.cycle:
            return 0, b
        return divmod(b, per)


def batch_sizes(stream: StreamOrder, num: int, batch_size: int) -> np.ndarray:
    """Number of real records in each of the first ``num`` global batches of ``stream``."""
    per = stream.batches_per_cycle(batch_size)
    if per == 0:
        return np.zeros(num, np.int64)
    b = np.arange(num) % per if stream.cycle else np.arange(num)
    return np.clip(len(stream.indices) - b * batch_size, 0, batch_size)


def stream_batches(
    record_fn: Callable[[int], Record],
    num_records: int,
    streams: Sequence[StreamOrder],
    *,
    batch_size: int,
    num_steps: int,
    start: int = 0,
    num_threads: int = 2,
    prefetch: int = 4,
    process_index: int | None = None,
    process_count: int | None = None,
    lengths: np.ndarray | None = None,
    length_buckets: Sequence[int] = (),
) -> grain.IterDataset:
    """Steps ``start .. num_steps - 1`` of a pass: per step, one batch of each stream.

    Step ``b`` reads global batch ``b`` of every stream (cycled streams wrap around in a
    new shuffle). A batch is padded to ``batch_size`` with masked copies of record 0
    (``mask = False``, ``index = num_records``). Batch ``b`` is a pure function of the
    streams and ``b``: a run resumed at ``start`` reads what an uninterrupted run would.
    Each process reads its contiguous slice of every global batch; ``lengths`` and
    ``length_buckets`` cut each batch's tokens as in ``batches``.

    Returns:
      A Grain ``IterDataset`` of tuples of per-process batches (one per stream).
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if batch_size % process_count:
        raise ValueError(
            f"Batch size {batch_size} is not divisible by the {process_count} processes."
        )
    local = batch_size // process_count
    pad = _padding(record_fn, num_records)

    @functools.lru_cache(maxsize=8)
    def order(s: int, cycle: int) -> np.ndarray:
        return streams[s].order(cycle)

    def positions(s: int, b: int) -> np.ndarray:
        cycle, b = streams[s].locate(b, batch_size)
        return order(s, cycle)[b * batch_size : (b + 1) * batch_size]

    def slot(i: int) -> tuple[Record, ...]:
        b, j = divmod(int(i), local)
        j += process_index * local
        out = []
        for s in range(len(streams)):
            chosen = positions(s, b)
            out.append(record_fn(chosen[j]) if j < chosen.size else pad)
        return tuple(out)

    def step(b: int) -> tuple[Record, ...]:
        first = process_index * local
        return tuple(
            _stacked(record_fn, positions(s, int(b))[first : first + local], pad, local)
            for s in range(len(streams))
        )

    if hasattr(record_fn, "many"):
        ds = grain.MapDataset.range(start, num_steps).map(step)
    else:
        ds = grain.MapDataset.range(start * local, num_steps * local).map(slot).batch(local)
    if length_buckets:
        if lengths is None:
            raise ValueError("length_buckets need the token count of every record (lengths).")
        buckets = np.asarray(sorted(length_buckets))

        def cut(i: int, batch: tuple[Record, ...]) -> tuple[Record, ...]:
            out = []
            for s, part in enumerate(batch):
                chosen = positions(s, start + i)
                longest = int(lengths[chosen].max()) if chosen.size else 0
                if chosen.size < batch_size:  # the padding copies record 0
                    longest = max(longest, int(lengths[0]))
                fits = buckets[buckets >= longest]
                size = int(fits[0]) if fits.size else -1
                if 0 <= size < part["tokens"].shape[1]:
                    part = {**part, "tokens": part["tokens"][:, :size]}
                out.append(part)
            return tuple(out)

        ds = ds.map_with_index(cut)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return ds.to_iter_dataset(options)


@contextlib.contextmanager
def reading(dataset: grain.IterDataset) -> Iterator[Iterator]:
    """Iterates ``dataset``; its reader threads stop when the block ends, also when the
    block ends with an error (an exception must not leave threads reading behind it)."""
    iterator = iter(dataset)
    try:
        yield iterator
    finally:
        iterator.close()


def to_device(batch: Record, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Assembles per-process batches into global arrays sharded by ``sharding``.

    A float16 field (a vectors folder's, as ``BatchedRecords.many`` reads it) is widened to
    float32 on the device, exactly: every model sees float32 inputs, and the host copies
    and transfers half the bytes.
    """
    out = {}
    for k, v in batch.items():
        array = jax.make_array_from_process_local_data(sharding, np.asarray(v))
        out[k] = array.astype(np.float32) if array.dtype == np.float16 else array
    return out


def prefetch_to_device(batches: Iterable, put: Callable, size: int = 2) -> Iterator:
    """``put(batch)`` for each of ``batches``, ``size`` batches ahead of the consumer.

    The transfer of the next batches is started (JAX transfers asynchronously) before the
    current one is handed out, so the device finds its next input in place when a step
    ends. ``size <= 1``: each batch is put when it is asked for.
    """
    queue = collections.deque()
    iterator = iter(batches)
    for batch in iterator:
        queue.append(put(batch))
        if len(queue) >= max(size, 1):
            yield queue.popleft()
    while queue:
        yield queue.popleft()


class TrainingPairs(NamedTuple):
    """The noisy training pairs of a run.

    Attributes:
      record_fn: ``record(k)`` of training pair ``k``.
      num_records: number of pairs ``N``.
      labels_image: observed image label of each pair, int64 ``[N]`` (what methods see).
      labels_text: observed caption label of each pair, int64 ``[N]``.
      clean: bool ``[N]``: pair ``k`` is truly matched and correctly labelled
        (diagnostics only; no method may read it).
      true_labels: the true class of each pair's caption, int64 ``[N]`` (``-1`` when the
        dataset has no labels; diagnostics only).
      checksum: sha256 of the noise, logged with the run's config.
      realised_rate: fraction of noisy pairs (or labels).
    """

    record_fn: Callable[[int], Record]
    num_records: int
    labels_image: np.ndarray
    labels_text: np.ndarray
    clean: np.ndarray
    true_labels: np.ndarray
    checksum: str
    realised_rate: float


def _label_noise(split, noise_cfg, num_classes: int) -> noise.LabelNoise:
    """Observed labels per pair. Images are corrupted once per image (all captions of an
    image see the same observed image label); captions inherit that label
    (``shared_label``) or are corrupted independently per caption."""
    cpi = split.captions_per_image
    kwargs = dict(
        rate=noise_cfg.rate,
        seed=noise_cfg.seed,
        kind=noise_cfg.kind,
        exclude_true=noise_cfg.symmetric.exclude_true,
    )
    image_labels = split.image_labels()
    if cpi == 1:
        return noise.label_noise(
            image_labels, num_classes, shared=noise_cfg.labels.shared, **kwargs
        )
    per_image = noise.label_noise(image_labels, num_classes, shared=True, **kwargs)
    image_of = np.arange(split.num_captions) // cpi
    labels_image = per_image.labels_image[image_of]
    clean_image = per_image.clean_image[image_of]
    if noise_cfg.labels.shared:
        labels_text, clean_text = labels_image, clean_image
    else:
        per_caption = noise.label_noise(image_labels[image_of], num_classes, shared=False, **kwargs)
        labels_text, clean_text = per_caption.labels_text, per_caption.clean_text
    return noise.LabelNoise(labels_image, labels_text, clean_image, clean_text)


def paired_images(split, noise_cfg) -> np.ndarray:
    """The image each training caption of ``split`` is paired with under ``noise_cfg``: int64
    ``[num_captions]``, the pairs :func:`training_pairs` gives (with correspondence noise,
    the moved ones)."""
    n, cpi = split.num_captions, split.captions_per_image
    if noise_cfg.kind == "file":
        made = noise.load_correspondence_noise_file(
            noise_cfg.file.path, n, cpi, expected=noise_cfg.file.layout
        )
        return made.image_index
    if noise_cfg.kind in ("per_caption", "per_image"):
        made = noise.correspondence_noise(
            n,
            cpi,
            rate=noise_cfg.rate,
            seed=noise_cfg.seed,
            protocol=noise_cfg.kind,
            exact=noise_cfg.pairs.exact,
        )
        return made.image_index
    return np.arange(n) // cpi  # no correspondence noise: the pairs as the dataset gives them


def training_pairs(
    split: sources.SplitSource,
    noise_cfg,
    *,
    num_classes: int,
    image_fields: Sequence[str],
    text_fields: Sequence[str],
) -> TrainingPairs:
    """Applies the ``noise`` config section to a training split.

    ``noise_cfg.kind``: ``none``; ``per_caption`` / ``per_image`` correspondence noise
    (rate, seed, ``pairs.exact``); ``file`` (``file.path``, an official index file);
    ``symmetric`` / ``asymmetric`` label noise (rate, seed, ``labels.shared``,
    ``symmetric.exclude_true``).
    """
    n, cpi = split.num_captions, split.captions_per_image
    kind = noise_cfg.kind
    true_labels = split.image_labels()
    if kind in ("symmetric", "asymmetric"):
        made = _label_noise(split, noise_cfg, num_classes)
        image_index = np.arange(n) // cpi
        labels_image, labels_text = made.labels_image, made.labels_text
        clean = made.clean_image & made.clean_text
    else:
        if kind == "file":
            if not noise_cfg.file.path:
                raise ValueError(
                    "noise.kind='file' needs noise.file.path, the path of a .npy index file."
                )
            made = noise.load_correspondence_noise_file(
                noise_cfg.file.path, n, cpi, expected=noise_cfg.file.layout
            )
        else:
            made = noise.correspondence_noise(
                n,
                cpi,
                rate=noise_cfg.rate if kind != "none" else 0.0,
                seed=noise_cfg.seed,
                protocol=kind,
                exact=noise_cfg.pairs.exact,
            )
        image_index = made.image_index
        labels_image = true_labels[image_index]  # the label of the image it is paired with
        labels_text = true_labels[np.arange(n) // cpi]
        clean = made.clean
    record_fn = pair_records(
        split,
        image_fields=image_fields,
        text_fields=text_fields,
        image_index=image_index,
        labels_image=labels_image,
        labels_text=labels_text,
    )
    return TrainingPairs(
        record_fn=record_fn,
        num_records=n,
        labels_image=np.asarray(labels_image, np.int64),
        labels_text=np.asarray(labels_text, np.int64),
        clean=np.asarray(clean, bool),
        true_labels=np.asarray(true_labels[np.arange(n) // cpi], np.int64),
        checksum=noise.noise_checksum(made),
        realised_rate=noise.realised_rate(made),
    )
