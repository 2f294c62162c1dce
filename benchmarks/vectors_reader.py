r"""The vectors folder reader (``data.name='vectors'``) on a 1,000,000-pair folder of float16.

  python benchmarks/vectors_reader.py                      # 200,000 images x 5 captions
  python benchmarks/vectors_reader.py --images=1000000 --captions_per_image=1
  python benchmarks/vectors_reader.py --dir=/data/bench --cleanup

Writes ``--dir/vectors_<images>x<cpi>/`` (``ncljax.data.vectors``'s layout: D=512 image
and text vectors in float16, written in chunks; captions and image ids as text; val and
test of ``--eval_images`` images), then, in a fresh process, measures and prints one JSON
line each:

* ``validate``: opening the folder (``sources.load_dataset``: every header, line count and
  value checked; the median of ``--repeats`` opens), and the value scan of the train
  arrays alone (``vectors.check_values``);
* ``source``: random pairs read through the train ``SplitSource`` (``image(k // cpi)`` and
  ``caption(k)``, one thread), pairs/s;
* ``pipeline``: the training pipeline's batches (``pipeline.training_pairs`` and
  ``pipeline.batches`` with ``data.num_threads`` reader threads, batch 128, shuffled),
  pairs/s, once per reader: ``batched`` (the folder's records read a batch per call,
  ``pipeline.BatchedRecords.many``, what training uses) and ``per_record`` (one Python call
  per record, the reader before; ``--pipeline_batches`` of each, the batched reader
  ``--batched_factor`` times as many);
* ``memory``: the reading process's peak resident memory (``VmHWM``; Linux carries
  ``ru_maxrss`` over from the parent, so both are printed) and, at the end, its anonymous
  memory (``RssAnon``: what the process itself holds) apart from the mapped file pages
  (``RssFile``: the page cache the reads touched, shared and dropped by the kernel under
  memory pressure), beside the folder's size.

The page cache is warm (the folder was just written, or read by an earlier run): the
figures are the reader's, not the disk's. Files are reused by later runs of the same
size; ``--cleanup`` deletes them at the end.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

DIM = 512


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _emit(**record) -> None:
    print(json.dumps(record), flush=True)


def _write_matrix(path: str, rows: int, rng, chunk: int = 1 << 14) -> None:
    """A float16 ``[rows, DIM]`` .npy written chunk by chunk (bounded memory)."""
    with open(path + ".tmp", "wb") as f:
        header = {"descr": "<f2", "fortran_order": False, "shape": (rows, DIM)}
        np.lib.format.write_array_header_1_0(f, header)
        for start in range(0, rows, chunk):
            block = rng.standard_normal((min(chunk, rows - start), DIM), np.float32)
            f.write(block.astype(np.float16).tobytes())
    os.replace(path + ".tmp", path)


def _write_lines(path: str, lines) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def write(folder: str, images: int, cpi: int, eval_images: int) -> float:
    """Writes the folder (unless a complete one is there); returns the seconds spent."""
    from ncljax.data import vectors

    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return 0.0
    tic = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", images), ("val", eval_images), ("test", eval_images)):
        _write_matrix(vectors.path_of(folder, split, "images"), n, rng)
        _write_matrix(vectors.path_of(folder, split, "texts"), n * cpi, rng)
        _write_lines(vectors.path_of(folder, split, "image_ids"), (f"{i}.jpg" for i in range(n)))
        _write_lines(
            vectors.path_of(folder, split, "captions"),
            (f"caption {k} of image {k // cpi}" for k in range(n * cpi)),
        )
    open(done, "w").close()
    return time.perf_counter() - tic


def measure(folder: str, args) -> None:
    """The read phase (run in a fresh process: its peak memory is the reader's)."""
    from ncljax import config as config_lib
    from ncljax.data import pipeline, sources, vectors

    start_rss = _status_mib("VmRSS")
    data = sources.default_config("vectors")
    data.folder = folder
    times = []
    for _ in range(args.repeats):
        tic = time.perf_counter()
        dataset = sources.load_dataset(data)
        times.append(time.perf_counter() - tic)
    tic = time.perf_counter()
    for kind in ("images", "texts"):
        vectors.check_values(vectors.read_header(vectors.path_of(folder, "train", kind)))
    scan = time.perf_counter() - tic
    train = dataset.split("train")
    data_bytes = train.images.nbytes + train.texts.nbytes
    _emit(
        phase="validate",
        open_s=float(np.median(times)),
        open_all_s=[round(t, 3) for t in times],
        train_value_scan_s=scan,
        train_bytes=data_bytes,
        scan_gb_per_s=data_bytes / scan / 1e9,
        rss_mib=_status_mib("VmRSS"),
    )

    rng = np.random.default_rng(1)
    index = rng.integers(train.num_captions, size=args.source_pairs)
    cpi = train.captions_per_image
    tic = time.perf_counter()
    for k in index:
        train.image(k // cpi)
        train.caption(k)
    seconds = time.perf_counter() - tic
    _emit(phase="source", pairs=int(index.size), seconds=seconds, pairs_per_s=index.size / seconds)

    noise = config_lib.base_config().noise  # the folder's own pairs
    pairs = pipeline.training_pairs(
        train,
        noise,
        num_classes=0,
        image_fields=("global_image",),
        text_fields=("global_text",),
    )
    readers = {
        "batched": (pairs.record_fn, args.pipeline_batches * args.batched_factor),
        "per_record": (lambda k: pairs.record_fn(k), args.pipeline_batches),
    }
    for reader, (record_fn, num) in readers.items():
        batches = pipeline.batches(
            record_fn,
            pairs.num_records,
            batch_size=args.batch_size,
            seed=0,
            num_threads=args.num_threads,
            process_index=0,
            process_count=1,
        )
        read = 0
        with pipeline.reading(batches) as iterator:
            next(iterator)  # threads started
            tic = time.perf_counter()
            for _, batch in zip(range(num), iterator, strict=False):
                read += int(batch["mask"].sum())
            seconds = time.perf_counter() - tic
        _emit(
            phase="pipeline",
            reader=reader,
            batch_size=args.batch_size,
            num_threads=args.num_threads,
            pairs=read,
            seconds=seconds,
            pairs_per_s=read / seconds,
        )
    _emit(
        phase="memory",
        folder_mib=sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        / 2**20,
        train_arrays_mib=data_bytes / 2**20,
        rss_after_imports_mib=start_rss,
        peak_vmhwm_mib=_status_mib("VmHWM"),
        ru_maxrss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        rss_anon_mib=_status_mib("RssAnon"),
        rss_file_mib=_status_mib("RssFile"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp", help="where the folder is written")
    parser.add_argument("--images", type=int, default=200_000)
    parser.add_argument("--captions_per_image", type=int, default=5)
    parser.add_argument("--eval_images", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="opens of the folder timed")
    parser.add_argument("--source_pairs", type=int, default=200_000)
    parser.add_argument("--pipeline_batches", type=int, default=1000)
    parser.add_argument("--batched_factor", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_threads", type=int, default=2, help="data.num_threads")
    parser.add_argument("--phase", choices=("all", "read"), default="all")
    parser.add_argument("--cleanup", action="store_true")
    args = parser.parse_args()
    folder = os.path.join(args.dir, f"vectors_{args.images}x{args.captions_per_image}")
    if args.phase == "read":
        measure(folder, args)
        return
    seconds = write(folder, args.images, args.captions_per_image, args.eval_images)
    _emit(
        phase="write",
        folder=folder,
        images=args.images,
        pairs=args.images * args.captions_per_image,
        dim=DIM,
        dtype="float16",
        seconds=seconds,
        reused=seconds == 0.0,
    )
    try:
        subprocess.run([sys.executable, *sys.argv, "--phase=read"], check=True)
    finally:
        if args.cleanup:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
