"""``ncljax embed``: a folder of images and a pairs file -> a vectors folder, batched and
resumable (offline, with the random encoder; ``open_clip`` where installed). CI trains,
audits and queries such a folder from the installed wheel (``.ci/run``)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ncljax import embed
from ncljax.data import sources, vectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pictures(folder, count, seed=0):
    """``count`` small PNGs with different colours; their relative paths."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder / "img", exist_ok=True)
    paths = []
    for i in range(count):
        pixels = (rng.random((20, 24, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / "img" / f"{i:03d}.png")
        paths.append(f"img/{i:03d}.png")
    return paths


def _pairs_file(folder, paths, captions_per_image=2, extra_for=()):
    lines = ["image\tcaption"]
    for i, path in enumerate(paths):
        count = captions_per_image + (1 if i in extra_for else 0)
        lines += [f"{path}\ta photo number {i} variant {c}" for c in range(count)]
    (folder / "pairs.tsv").write_text("\n".join(lines) + "\n")
    return str(folder / "pairs.tsv")


def test_embed_writes_a_vectors_folder_that_opens(tmp_path):
    paths = _pictures(tmp_path, 30)
    pairs = _pairs_file(tmp_path, paths, extra_for=(3,))  # image 3 has a third caption
    out = tmp_path / "folder"
    record = embed.embed_folder(
        pairs,
        str(tmp_path),
        str(out),
        encoder="random:16",
        chunk=7,
        batch_size=4,
        val_fraction=0.2,
        test_fraction=0.2,
        progress=False,
    )
    assert record["captions_per_image"] == 2 and record["shared_space"] is False
    cfg = vectors.default_config()
    cfg.folder = str(out)
    data = sources.load_dataset(cfg)
    sizes = {s: data.split(s).num_images for s in embed.SPLITS}
    assert sizes == {"train": 18, "val": 6, "test": 6}
    ids = {s: (out / f"{s}_image_ids.txt").read_text().split() for s in embed.SPLITS}
    assert sorted(p for s in embed.SPLITS for p in ids[s]) == paths  # each image once
    train = np.load(out / "train_texts.npy")
    assert train.dtype == np.float16 and train.shape == (36, 16)
    np.testing.assert_allclose(np.linalg.norm(train.astype(np.float32), axis=1), 1, atol=2e-3)
    # The vectors are the encoder's: image i of the train split, encoded alone.
    encoder = embed.RandomEncoder(16)
    first = ids["train"][0]
    alone = encoder.images([str(tmp_path / first)])[0]
    np.testing.assert_allclose(
        np.load(out / "train_images.npy")[0].astype(np.float32),
        alone / np.linalg.norm(alone),
        atol=2e-3,
    )
    captions = (out / "train_captions.txt").read_text().splitlines()
    number = int(first.split("/")[1][:3])
    assert captions[:2] == [f"a photo number {number} variant {c}" for c in range(2)]
    with open(out / embed.SPACE_FILE) as f:
        assert json.load(f)["encoder"] == "random:16"
    assert not os.path.exists(out / ".embed")


class Stop(Exception):
    """The embedding stopped (a kill, Ctrl-C) partway."""


def test_a_stopped_embedding_resumes_from_its_saved_chunks(tmp_path, monkeypatch):
    paths = _pictures(tmp_path, 20)
    pairs = _pairs_file(tmp_path, [f"{p}" for p in paths])
    calls, stopped = [], []
    original = embed.RandomEncoder.texts

    def failing(self, captions):
        calls.append(len(captions))
        if len(calls) == 3 and not stopped:  # the first run stops at its third text batch
            stopped.append(True)
            raise Stop
        return original(self, captions)

    monkeypatch.setattr(embed.RandomEncoder, "texts", failing)
    out = tmp_path / "folder"
    kwargs = dict(
        encoder="random:8",
        chunk=4,
        batch_size=4,
        val_fraction=0.2,
        test_fraction=0.2,
        progress=False,
    )
    with pytest.raises(Stop):
        embed.embed_folder(pairs, str(tmp_path), str(out), **kwargs)
    saved = sorted(os.listdir(out / ".embed"))
    assert "train_texts_000000.npy" in saved and "train_texts_000001.npy" in saved
    calls.clear()
    embed.embed_folder(pairs, str(tmp_path), str(out), **kwargs)
    assert sum(calls) == 24 + 8 + 8 - 8  # the two saved train chunks are not encoded again
    monkeypatch.undo()
    fresh = tmp_path / "fresh"
    embed.embed_folder(pairs, str(tmp_path), str(fresh), **kwargs)
    for name in ("train_texts.npy", "val_images.npy", "test_texts.npy"):
        np.testing.assert_array_equal(np.load(out / name), np.load(fresh / name))


def test_bad_inputs_are_one_line_and_the_folder_opens(tmp_path):
    paths = _pictures(tmp_path, 50)
    pairs = _pairs_file(tmp_path, paths)

    def command(*args):
        return subprocess.run(
            [sys.executable, "-m", "ncljax", "embed", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            env=dict(os.environ, XLA_FLAGS=""),
        )

    out = command(f"--pairs={pairs}", "--images=nowhere", "--out=f", "--encoder=random:8")
    assert out.returncode != 0
    assert out.stderr.strip().startswith("ValueError: 50 images of")
    out = command(f"--pairs={pairs}", "--out=f", "--encoder=clip")
    assert out.stderr.strip().startswith("ValueError: --encoder='clip': use open_clip:")
    (tmp_path / "bad.tsv").write_text("a\tb\tc\td\n")
    out = command("--pairs=bad.tsv", "--out=f", "--encoder=random:8")
    assert "has 4 tab-separated fields" in out.stderr and len(out.stderr.splitlines()) == 1
    out = command(
        f"--pairs={pairs}",
        "--out=f",
        "--encoder=random:8",
        "--progress_bar=False",
        "--val_fraction=0.25",
        "--test_fraction=0.25",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(
        "Next: ncljax train --config=gsc:vectors --config.data.folder=f"
    )
    cfg = vectors.default_config()
    cfg.folder = str(tmp_path / "f")
    assert sources.load_dataset(cfg).split("val").num_images == 12  # it opens; CI trains on it


def test_open_clip_with_random_weights_when_installed(tmp_path):
    pytest.importorskip("open_clip")
    paths = _pictures(tmp_path, 10)
    pairs = _pairs_file(tmp_path, paths)
    record = embed.embed_folder(
        pairs,
        str(tmp_path),
        str(tmp_path / "f"),
        encoder="open_clip:RN50:none",
        val_fraction=0.2,
        test_fraction=0.2,
        progress=False,
    )
    assert record["shared_space"] is True
    assert (
        np.load(tmp_path / "f" / "train_images.npy").shape[1]
        == np.load(tmp_path / "f" / "train_texts.npy").shape[1]
    )
