"""Per-round logging sinks: a CSV file always, TensorBoard when it is installed.

``rounds.csv`` grows one row per round while the run goes (the fixed ``ROUND_COLUMNS``); at the end
``write_results`` rewrites it with exactly the columns the run has (plus per-mode accuracies such
as ``acc_head``). One file, readable at any time. On resume, rows after the checkpoint's round are
dropped first, so a killed and resumed run leaves the same file as an uninterrupted one (timing
columns aside).
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

from fedmosaic.report.results import ROUND_COLUMNS

log = logging.getLogger("fedmosaic")
PROGRESS_FILE = "rounds.csv"


class CSVSink:
    """Appends each round's record (the fixed ``ROUND_COLUMNS``) to ``rounds.csv``."""

    def __init__(self, out_dir: str | Path, keep_rounds: int = 0) -> None:
        self.path = Path(out_dir) / PROGRESS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[list[str]] = []
        if keep_rounds > 0 and self.path.exists():
            with open(self.path, newline="") as fh:
                reader = csv.reader(fh)
                header = next(reader, None)
                if header == list(ROUND_COLUMNS):
                    rows = [r for r in reader if r and r[0].isdigit() and int(r[0]) <= keep_rounds]
        with open(self.path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(ROUND_COLUMNS)
            w.writerows(rows)

    def __call__(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([_cell(rec.get(c)) for c in ROUND_COLUMNS])

    def close(self) -> None:
        pass


def _cell(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return v


class TensorBoardSink:
    """Scalars per round under ``tb/`` (accuracy, loss, bytes, seconds)."""

    def __init__(self, out_dir: str | Path, writer_cls: Any) -> None:
        self.writer = writer_cls(log_dir=str(Path(out_dir) / "tb"))

    def __call__(self, rec: dict[str, Any]) -> None:
        t = int(rec["round"])
        for key, value in rec.items():
            if key == "round" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue
            group = (
                "acc"
                if "acc" in key
                else "comm"
                if "bytes" in key
                else "time"
                if "seconds" in key
                else "train"
            )
            self.writer.add_scalar(f"{group}/{key}", value, t)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_writer() -> Any | None:
    """``SummaryWriter`` when the ``tensorboard`` package is installed, else None."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class Sinks:
    """All sinks of one run as a single ``on_round`` callback."""

    def __init__(self, out_dir: str | Path, keep_rounds: int = 0, tensorboard: bool = True) -> None:
        self.sinks: list[Any] = [CSVSink(out_dir, keep_rounds)]
        writer = tensorboard_writer() if tensorboard else None
        if writer is not None:
            self.sinks.append(TensorBoardSink(out_dir, writer))

    def __call__(self, rec: dict[str, Any]) -> None:
        for sink in self.sinks:
            try:
                sink(rec)
            except OSError as exc:  # logging must never kill a run
                log.warning("logging sink %s failed: %s", type(sink).__name__, exc)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
