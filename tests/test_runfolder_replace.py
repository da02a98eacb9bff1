"""Replacing a finished run (``--overwrite``, ``overwrite=True``) in ``fedmosaic.runfolder``: an
interrupted replacement leaves the old run whole, or the new run's interrupted run with no
``results.json`` (nobody calls it done); never one run's results beside another's rows or
checkpoint. The deployed Flower ServerApp takes the run folder's lock."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from helpers.experiments import SMALL, tiny_raw, write_toml

import fedmosaic.api as fm
from fedmosaic.checkpoint import FILENAME, FINAL_FILE
from fedmosaic.cli import main
from fedmosaic.runfolder import FolderLock, RunFolderError


def _raw(**train) -> dict:
    raw = tiny_raw(data=SMALL, train={"rounds": 2, **train}, algorithm={"name": "local"})
    raw["sim"]["check_wire"] = False
    return raw


def _cfg(tmp_path: Path) -> Path:
    return write_toml(tmp_path / "c.toml", _raw())


def _run(cfg: Path, out: Path, *extra: str) -> int:
    return main(["run", str(cfg), "--out", str(out), "--quiet", "--no-save-models", *extra])


def _state(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def _stop_after_round_1(monkeypatch, what: str) -> None:
    """After round 1's record reaches the sinks: ``ctrl-c`` as the first Ctrl-C does (the round
    loop writes a checkpoint and stops), ``kill`` as a second Ctrl-C (KeyboardInterrupt now)."""
    from fedmosaic.core import rounds
    from fedmosaic.report import sinks

    real = sinks.Sinks.__call__

    def stop(self, rec):
        real(self, rec)
        if rec["round"] == 1:
            if what == "kill":
                raise KeyboardInterrupt
            rounds.stop_requested.set()

    monkeypatch.setattr(sinks.Sinks, "__call__", stop)


def test_an_interrupted_overwrite_is_never_reported_done_and_resumes(
    tmp_path: Path, capsys, monkeypatch
):
    """The issue's probe: Ctrl-C after round 1 of ``run B --out o --overwrite`` where ``o``
    holds finished run A."""
    cfg, out = _cfg(tmp_path), tmp_path / "o"
    assert _run(cfg, out) == 0  # A
    with monkeypatch.context() as m:
        _stop_after_round_1(m, "ctrl-c")
        assert _run(cfg, out, "--overwrite", "--set", "train.lr=0.2") == 130  # B
    # B's interrupted run: its rows and checkpoint, and no results.json (A's is gone, not mixed)
    assert not (out / "results.json").exists() and (out / FILENAME).is_file()
    assert _temporaries(out) == []
    rows = (out / "rounds.csv").read_text().splitlines()
    assert len(rows) == 2  # the header and B's round 1
    before = _state(out)
    capsys.readouterr()
    assert _run(cfg, out) == 2  # A: not "already done"; refused naming the interrupted run
    err = capsys.readouterr()
    assert "already done" not in err.out
    assert "interrupted run" in err.err and "--resume" in err.err
    assert _state(out) == before
    assert _run(cfg, out, "--resume", "--set", "train.lr=0.2") == 0  # B continues
    assert "already done" not in capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["train"]["lr"] == 0.2 and [r["round"] for r in doc["rounds"]] == [1, 2]
    assert not (out / FILENAME).exists() and _temporaries(out) == []
    assert len((out / "rounds.csv").read_text().splitlines()) == 3


def test_an_overwrite_stopped_with_nothing_to_resume_leaves_the_old_run_whole(
    tmp_path: Path, capsys, monkeypatch
):
    cfg, out = _cfg(tmp_path), tmp_path / "o"
    assert _run(cfg, out) == 0  # A
    before = _state(out)
    with monkeypatch.context() as m:
        _stop_after_round_1(m, "kill")  # no checkpoint written
        assert _run(cfg, out, "--overwrite", "--set", "train.lr=0.2") == 130
    assert _state(out) == before  # A's results.json and rows, as they were
    capsys.readouterr()
    assert _run(cfg, out) == 0 and "already done" in capsys.readouterr().out
    # the same through the API: on_round raising stops the run; A is put back
    with pytest.raises(RuntimeError, match="stop"):

        def stop(rec):
            raise RuntimeError("stop")

        fm.run(_raw(lr=0.2), out=out, overwrite=True, on_round=stop)
    assert _state(out) == before


def test_an_api_overwrite_interrupted_after_a_checkpoint_is_an_interrupted_run(tmp_path: Path):
    out = tmp_path / "o"
    fm.run(_raw(), out=out)  # A
    b = _raw(lr=0.2, rounds=3)

    def stop_in_round_2(rec):  # before round 2's checkpoint: round 1's is there
        if rec.round == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        fm.run(b, out=out, overwrite=True, checkpoint_every=1, on_round=stop_in_round_2)
    assert not (out / "results.json").exists() and (out / FILENAME).is_file()
    assert _temporaries(out) == []
    with pytest.raises(fm.CheckpointError, match="interrupted run"):
        fm.run(_raw(), out=out)  # A is not returned as finished
    result = fm.run(b, out=out, resume=True)
    assert result.document["config"]["train"]["lr"] == 0.2
    assert [r["round"] for r in result.document["rounds"]] == [1, 2, 3]


def test_a_replaced_runs_models_do_not_stay_beside_the_new_results(tmp_path: Path):
    cfg, out = _cfg(tmp_path), tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    assert (out / FINAL_FILE).is_file()
    assert _run(cfg, out, "--overwrite", "--set", "train.lr=0.2") == 0
    assert not (out / FINAL_FILE).exists() and _temporaries(out) == []
    with pytest.raises(fm.CheckpointError, match="kept no models"):
        fm.load_run(out)


# ---- the deployed Flower ServerApp ------------------------------------------------------------


def _flower_rc(raw: dict, out: Path) -> dict:
    return {"experiment": json.dumps(raw), "results-dir": str(out)}


def test_run_server_is_refused_a_results_dir_in_use(tmp_path: Path):
    pytest.importorskip("flwr")
    from fedmosaic.flower.app import client_app, run_server
    from fedmosaic.flower.local import LocalGrid

    raw = _raw()
    out = tmp_path / "results"
    rc = _flower_rc(raw, out)
    nodes = [{"partition-id": i, "num-partitions": 4} for i in range(4)]
    with FolderLock(out):  # another run holds it (a `fedmosaic run --out`, another ServerApp)
        with pytest.raises(RunFolderError) as err:
            run_server(LocalGrid(client_app, nodes, rc), rc)
        assert {p.name for p in out.iterdir()} == {".fedmosaic.lock"}  # no log, no FAILED
    line = str(err.value)
    assert "\n" not in line and str(out) in line and "in use by another run" in line


def test_two_in_memory_flower_runs_into_one_folder(tmp_path: Path):
    """The first holds the folder (its run_server inside run_flower_in_memory's RunFolder takes
    no second lock); a second run_flower_in_memory, or a bare run_server, into it is refused."""
    pytest.importorskip("flwr")
    from fedmosaic.flower.app import client_app, run_server
    from fedmosaic.flower.local import LocalGrid

    out = tmp_path / "results"
    inside, go = threading.Event(), threading.Event()
    done: dict = {}

    def hold_round_1(rec):
        if rec.round == 1:
            inside.set()
            assert go.wait(120)

    def first():
        try:
            done["doc"] = fm.run_flower_in_memory(_raw(), out, on_round=hold_round_1)
        except BaseException as exc:  # reported below
            done["error"] = exc
            inside.set()

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(300) and "error" not in done, done
        with pytest.raises(RunFolderError, match="in use by another run"):
            fm.run_flower_in_memory(_raw(lr=0.2), out, overwrite=True)
        rc = _flower_rc(_raw(lr=0.2), out)
        nodes = [{"partition-id": i, "num-partitions": 4} for i in range(4)]
        with pytest.raises(RunFolderError, match="in use by another run") as err:
            run_server(LocalGrid(client_app, nodes, rc), rc)
        assert str(out) in str(err.value) and "\n" not in str(err.value)
    finally:
        go.set()
        t.join(300)
    assert "error" not in done, done
    assert json.loads((out / "results.json").read_text())["config"]["train"]["lr"] == 0.05
    assert not (out / ".fedmosaic.lock").exists() and not (out / "FAILED").exists()
