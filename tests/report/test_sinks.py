"""Logging sinks: the progress CSV (truncated on resume) and TensorBoard when installed."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from fedmosaic.report import sinks
from fedmosaic.report.results import ROUND_COLUMNS


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path)))


def test_csv_sink_appends_and_truncates_on_resume(tmp_path: Path):
    s = sinks.Sinks(tmp_path, tensorboard=False)
    for t in (1, 2, 3):
        s({"round": t, "acc_weighted": t / 10, "train_loss": math.nan, "other": "x"})
    s.close()
    rows = _rows(tmp_path / sinks.PROGRESS_FILE)
    assert list(rows[0]) == list(ROUND_COLUMNS)
    assert [r["round"] for r in rows] == ["1", "2", "3"] and rows[0]["train_loss"] == ""
    # Resumed after round 2's checkpoint: round 3 (logged before the kill) is dropped first.
    s = sinks.Sinks(tmp_path, keep_rounds=2, tensorboard=False)
    s({"round": 3, "acc_weighted": 0.33})
    assert [r["acc_weighted"] for r in _rows(tmp_path / sinks.PROGRESS_FILE)] == [
        "0.1",
        "0.2",
        "0.33",
    ]
    # A fresh run starts a fresh file.
    sinks.Sinks(tmp_path, tensorboard=False)
    assert _rows(tmp_path / sinks.PROGRESS_FILE) == []


def test_tensorboard_sink_when_installed(tmp_path: Path, monkeypatch):
    logged: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            assert log_dir == str(tmp_path / "tb")

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            logged.append((tag, value, step))

        def flush(self) -> None: ...

        def close(self) -> None: ...

    monkeypatch.setattr(sinks, "tensorboard_writer", lambda: Writer)
    s = sinks.Sinks(tmp_path)
    s({"round": 4, "acc_weighted": 0.5, "bytes_up": 10, "seconds": 1.0, "rejected": []})
    assert sorted(logged) == [
        ("acc/acc_weighted", 0.5, 4),
        ("comm/bytes_up", 10, 4),
        ("time/seconds", 1.0, 4),
    ]
    monkeypatch.setattr(sinks, "tensorboard_writer", lambda: None)
    assert len(sinks.Sinks(tmp_path).sinks) == 1  # CSV only without tensorboard
