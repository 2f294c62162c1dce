"""Metric writers: JSONL in the workdir, TensorBoard when ``tensorboardX`` is installed
(``pip install 'ncljax[tensorboard]'``)."""

from __future__ import annotations

import json
import logging
import math
import os

import jax

from ncljax.train import rundir


def _clean(value):
    """A metric as a JSON number, or ``None`` (``null``) when it is undefined (None, NaN)
    or infinite."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class MetricWriter:
    """Appends one JSON object per line to ``workdir/metrics.jsonl``.

    Each line has ``step``, ``epoch``, ``split`` and metric names; only process 0 writes.
    Lines are strict JSON: an undefined (NaN) or infinite metric is written as ``null``.
    """

    def __init__(self, workdir: str):
        self._active = jax.process_index() == 0
        self._path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if self._active:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                pass
            else:
                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, *, step: int, epoch: int, split: str, metrics: dict) -> None:
        """Appends one row. A ``test`` row replaces the test rows of earlier evaluations."""
        if not self._active:
            return
        row = {"step": int(step), "epoch": int(epoch), "split": split}
        row.update({k: _clean(v) for k, v in metrics.items()})
        line = json.dumps(row, allow_nan=False) + "\n"
        try:
            if split == "test":  # replaced only now that the new result exists
                rows = [text for row, text in self._read() if row["split"] != "test"]
                self._rewrite([*rows, line])
            else:
                with open(self._path, "a") as f:
                    f.write(line)
        except OSError as e:
            raise rundir.unwritable(os.path.dirname(self._path), e) from None
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "epoch", "split") and v is not None:
                    self._tb.add_scalar(f"{split}/{k}", v, int(step))

    def rows(self) -> list[dict]:
        """The rows written so far (process 0; empty elsewhere), in order."""
        return [row for row, _ in self._read()] if self._active else []

    def _read(self) -> list[tuple[dict, str]]:
        """The file's complete rows, parsed and as lines. A damaged row (a partly written
        last line after a power cut or a full disk) is dropped with a warning."""
        if not os.path.exists(self._path):
            return []
        with open(self._path, "rb") as f:
            lines = f.read().split(b"\n")
        rows = []
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode()
                row = json.loads(text)
                if not isinstance(row, dict) or not {"step", "split"} <= row.keys():
                    raise ValueError("not a metrics row")
            except ValueError:
                where = "its last line" if number >= len(lines) - 1 else f"line {number}"
                logging.warning(
                    "Dropped %s of %s, which was only partly written (%r).",
                    where,
                    self._path,
                    raw[:80],
                )
                continue
            rows.append((row, text + "\n"))
        return rows

    def _rewrite(self, rows: list[str]) -> None:
        tmp = self._path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)

    def truncate_after(self, step: int) -> None:
        """Drops the lines a run resumed at ``step`` (-1: from scratch) writes again.

        Those are the lines after ``step`` and a refresh logged at ``step`` itself (an
        epoch boundary: the refresh runs again on resume). A test row at ``step`` stays
        until the new test result replaces it (``write``), so a failed re-evaluation
        leaves ``metrics.jsonl`` and ``results.json`` in agreement. Damaged rows are
        dropped with a warning.
        """
        if not self._active or not os.path.exists(self._path):
            return

        def kept(row):
            if row["step"] > step:
                return False
            return not (row["step"] == step and row["split"] == "refresh")

        try:
            self._rewrite([text for row, text in self._read() if kept(row)])
        except OSError as e:
            raise rundir.unwritable(os.path.dirname(self._path), e) from None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
