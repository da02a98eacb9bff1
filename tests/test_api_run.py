"""``fedmosaic.api.run(config, out=..., on_round=...)``: the CLI's run folder from Python, and a
typed per-round callback on every runtime the API offers."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.experiments import SMALL, TIMING, numbers, tiny_raw, write_toml

import fedmosaic.api as fm
from fedmosaic.cli import main
from fedmosaic.report import sinks
from fedmosaic.report.results import TEMP_MARK
from fedmosaic.runfolder import LOCK_FILE


def _raw(**sections: Any) -> dict[str, Any]:
    raw = tiny_raw(data=SMALL, **sections)
    raw["sim"].update(threads=1, check_wire=False)
    return raw


def _csv_numbers(folder: Path) -> list[dict[str, str]]:
    with open(folder / "rounds.csv", newline="") as fh:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(fh)]


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path (``tb/`` where TensorBoard is installed)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def test_out_writes_the_folder_the_cli_writes(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """Same config and seed: the same files, the same results.json and rounds.csv (timings and
    the provenance's clock aside), kept models that load_run reads back."""
    cfg = write_toml(tmp_path / "c.toml", _raw(train={"rounds": 2}))
    cli, api = tmp_path / "cli", tmp_path / "api"
    assert main(["run", str(cfg), "--out", str(cli), "--quiet", "--save-models"]) == 0
    result = fm.run(cfg, out=api, save_models=True)
    assert result.out == api
    assert _files(api) == _files(cli)
    assert {"results.json", "rounds.csv", "curve.png", "final.safetensors"} <= _files(api)
    a, c = (json.loads((f / "results.json").read_text()) for f in (api, cli))
    assert numbers(a) == numbers(c) and a["config"] == c["config"]
    clock = {"started", "finished"}
    assert {k: v for k, v in a["provenance"].items() if k not in clock} == {
        k: v for k, v in c["provenance"].items() if k not in clock
    }
    assert set(a) - {"wall_seconds"} == set(c) - {"wall_seconds"}
    assert _csv_numbers(api) == _csv_numbers(cli)
    assert json.loads(json.dumps(result.document)) == a  # (JSON keys are strings)
    kept = fm.load_run(api)
    assert kept.rounds_done == 2 and kept.document == a

    # Its lifecycle is the CLI's: this config's finished run is kept (nothing runs again) ...
    before = (api / "results.json").read_bytes()
    with caplog.at_level("WARNING", logger="fedmosaic"):
        again = fm.run(cfg, out=api, on_round=lambda r: pytest.fail("ran again"))
    assert again.document == a and len(again.models) == 4 and again.out == api
    assert "finished run: returned as it is, nothing trained" in caplog.text  # not silent
    assert (api / "results.json").read_bytes() == before
    # ... another config's is refused with nothing written, unless overwrite.
    with pytest.raises(fm.ConfigError, match="another configuration"):
        fm.run(cfg, ["train.lr=0.2"], out=api)
    assert (api / "results.json").read_bytes() == before
    assert fm.run(cfg, ["train.lr=0.2"], out=api, overwrite=True)["config"]["train"]["lr"] == 0.2
    # Folder options without a folder are one-line errors, not silently ignored.
    with pytest.raises(fm.ConfigError, match="out="):
        fm.run(cfg, save_models=True)


@pytest.mark.parametrize("backend", ["serial", "processes", "flower"])
def test_on_round_sees_every_round_as_the_history_has_it(backend: str, tmp_path: Path):
    raw = _raw(train={"rounds": 3, "eval_every": 2})
    seen: list[fm.RoundRecord] = []
    if backend == "flower":
        pytest.importorskip("flwr")
        doc = fm.run_flower_in_memory(raw, tmp_path / "fl", on_round=seen.append)
    else:
        raw["sim"].update(backend=backend, workers=2)
        doc = fm.run(raw, on_round=seen.append).document
    assert [r.round for r in seen] == [1, 2, 3] and {r.rounds for r in seen} == {3}
    assert [r.evaluated for r in seen] == [False, True, True]  # eval_every=2; the last always
    assert [r.acc for r in seen] == [h.get("acc_weighted") for h in doc["rounds"]]
    assert [r.acc_mean for r in seen] == [h.get("acc_mean") for h in doc["rounds"]]
    assert [r.train_loss for r in seen] == [h["train_loss"] for h in doc["rounds"]]
    assert [r.metrics for r in seen] == doc["rounds"]
    assert all(r.seconds > 0 for r in seen)
    assert all(a.elapsed < b.elapsed for a, b in zip(seen, seen[1:]))


class Enough(Exception):
    pass


def _stop_at(n: int):
    def on_round(rec: fm.RoundRecord) -> None:
        if rec.round == n:
            raise Enough(f"stop at round {n}")

    return on_round


class EventWriter:
    """TensorBoard's writer as far as the folder sees it: one new event file per run in ``tb/``
    (so the test does not depend on whether tensorboard is installed)."""

    runs = 0

    def __init__(self, log_dir: str) -> None:
        EventWriter.runs += 1
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.file = Path(log_dir) / f"events.out.tfevents.{EventWriter.runs}"
        self.file.write_bytes(b"")

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with open(self.file, "ab") as fh:
            fh.write(f"{tag} {step} {value}\n".encode())

    def add_hparams(self, *args: Any, **kwargs: Any) -> None:
        self.add_scalar("hparams", 0, 0)

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_a_raising_callback_stops_the_run_and_leaves_no_half_written_folder(
    tmp_path: Path, monkeypatch
):
    monkeypatch.setattr(sinks, "tensorboard_writer", lambda: EventWriter)
    raw = _raw(train={"rounds": 3})
    out = tmp_path / "new" / "out"
    with pytest.raises(Enough):
        fm.run(raw, out=out, on_round=_stop_at(2))
    assert not (tmp_path / "new").exists()  # the folders the run made: gone with it
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(Enough):
        fm.run(raw, out=mine, on_round=_stop_at(1))
    assert _files(mine) == {"notes.txt"}  # as it was: no rounds.csv claiming a run
    fm.run(raw, out=mine)  # and nothing stands in the way of running there
    assert "results.json" in _files(mine) and "tb" in _files(mine)
    # Over a finished run (overwrite): stopped, the old run's files are left as they were,
    # rounds.csv included (the sinks had rewritten it with the stopped run's rows).
    before = _contents(mine)
    with pytest.raises(Enough):
        fm.run(_raw(train={"rounds": 4}), out=mine, overwrite=True, on_round=_stop_at(2))
    assert _contents(mine) == before


def test_a_raising_callback_after_a_checkpoint_leaves_a_resumable_run(tmp_path: Path):
    raw = _raw(train={"rounds": 3})
    out = tmp_path / "out"
    with pytest.raises(Enough):
        fm.run(raw, out=out, on_round=_stop_at(3), checkpoint_every=1)
    # An interrupted run: round 2's checkpoint, no results, no lock, no temporaries.
    files = _files(out)
    assert "checkpoint.safetensors" in files and "results.json" not in files
    assert LOCK_FILE not in files and not any(TEMP_MARK in f for f in files)
    with pytest.raises(fm.CheckpointError, match="interrupted run"):
        fm.run(raw, out=out)
    seen: list[int] = []
    resumed = fm.run(raw, out=out, resume=True, on_round=lambda r: seen.append(r.round))
    assert seen == [3]
    assert numbers(resumed.document) == numbers(fm.run(raw).document)
    assert [r["round"] for r in _csv_numbers(out)] == ["1", "2", "3"]


@pytest.mark.parametrize("out", ["", "   ", 3])
def test_an_empty_or_odd_out_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch, out
):
    """``out=""`` would be the current directory: refused in one line, nothing written there."""
    cfg = write_toml(tmp_path / "c.toml", _raw(train={"rounds": 1}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fm.ConfigError, match="out = .*: name a folder"):
        fm.run(cfg, out=out)
    assert _files(tmp_path) == {"c.toml"}


def test_the_in_memory_flower_run_warns_of_nothing_when_nothing_is_wrong(
    tmp_path: Path, caplog
) -> None:
    """The in-process grid binds each node to its partition (the allow-list a deployment sets):
    an honest run logs no warning, the tutorial's output included."""
    import logging

    pytest.importorskip("flwr")
    cfg = write_toml(tmp_path / "c.toml", _raw(train={"rounds": 1}))
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        fm.run_flower_in_memory(cfg, tmp_path / "fl")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
