"""Fingerprints of the files a run trained on, so that what reads the run later (the
audit, retrieval, an ensemble, a resume) can tell when they have changed.

A vectors folder is the user's own and may be re-exported in place: the same shapes in
another row order, captions edited. The training pairs are the folder's rows, so a run's
per-pair memory (the audit's scores) and its display texts mean nothing against other
rows. The run records :func:`data_fingerprint` of its data in ``config.json``
(``data_fingerprint``) and :func:`check_unchanged` refuses, in one line naming the
files, to read it against files that differ.

A file's digest is BLAKE2b over its size and its bytes: all of them for a file up to
``EXACT_BYTES``; above that ``SAMPLES`` blocks of ``BLOCK`` bytes at evenly spaced offsets
(the first and last included), so a 20 GB folder is fingerprinted in well under a second
from the page cache. A re-ordered or re-encoded array changes every block; an edit
confined to bytes between the sampled blocks of a file above ``EXACT_BYTES`` is not seen.
Datasets other than a vectors folder have no fingerprint: they are prepared from fixed
releases, and their noise is checked by the run's ``noise_checksum``.
"""

from __future__ import annotations

import hashlib
import os

EXACT_BYTES = 256 << 20
SAMPLES = 256
BLOCK = 64 << 10
KEY = "data_fingerprint"  # the config.json entry


def file_digest(path: str) -> str:
    """The hex digest of ``path``: its size and bytes (sampled above ``EXACT_BYTES``)."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= EXACT_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            for k in range(SAMPLES):
                f.seek((size - BLOCK) * k // (SAMPLES - 1))
                digest.update(f.read(BLOCK))
    return digest.hexdigest()


def data_fingerprint(data_config) -> dict[str, str] | None:
    """``{'<split>_<kind>': digest}`` of the files of a vectors folder
    (``data.name='vectors'``; ``ncljax.data.vectors.path_of``) that exist, or ``None``
    for any other dataset. The keys hold no dot: ``config.json`` is read back as a
    ``ConfigDict``."""
    if data_config.get("name") != "vectors":
        return None
    from ncljax.data import sources, vectors

    paths = {
        f"{split}_{kind}": vectors.path_of(data_config.folder, split, kind)
        for split in sources.SPLITS
        for kind in vectors.EXTENSIONS
    }
    return {key: file_digest(path) for key, path in paths.items() if os.path.isfile(path)}


def changed_files(recorded: dict, current: dict) -> list[str]:
    """The names of the files whose digests differ, or that one side has and the other
    lacks (``train_texts.npy``)."""
    return [
        file_name(k)
        for k in sorted(recorded.keys() | current.keys())
        if recorded.get(k) != current.get(k)
    ]


def file_name(key: str) -> str:
    """The file name of a fingerprint key: ``'train_image_ids'`` -> ``'train_image_ids.txt'``."""
    from ncljax.data import vectors

    split, kind = key.split("_", 1)
    return os.path.basename(vectors.path_of("", split, kind))


def check_unchanged(config, workdir: str, reader: str) -> None:
    """Refuses to read the run in ``workdir`` against data files other than those it
    trained on (its ``config.json``'s ``data_fingerprint``; a run made before runs
    recorded one is not checked).

    Args:
      config: the run's resolved config.
      workdir: the run directory (for the message).
      reader: what is reading the run (``'audit'``, ``'retrieve'``...), for the message.

    Raises:
      ValueError: one line naming the folder and the files that changed.
    """
    recorded = config.get(KEY)
    if recorded is None:
        return
    recorded = dict(recorded)
    changed = changed_files(recorded, data_fingerprint(config.data) or {})
    if changed:
        raise ValueError(
            f"The files of {config.data.folder} changed since {workdir} trained on them "
            f"({', '.join(changed)}): its scores and captions belong to the rows it trained "
            f"on, so the {reader} would pair them with other rows. Restore the folder the run "
            "trained on, or train again on this one."
        )
