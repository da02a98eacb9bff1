"""The run folder's lifecycle (``fedmosaic.runfolder``) through ``fedmosaic run``: one run per
folder at a time, a finished run kept, refusals that change nothing, file-system errors in one
line with the previous state intact."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic.checkpoint import FILENAME, FINAL_FILE
from fedmosaic.cli import main
from fedmosaic.runfolder import LOCK_FILE, FolderLock, RunFolderError

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"synthetic_shape": [1, 16, 16]}


def _cfg(tmp_path: Path, rounds: int = 1) -> Path:
    raw = tiny_raw(data=SMALL, train={"rounds": rounds}, algorithm={"name": "local"})
    raw["sim"]["check_wire"] = False
    return write_toml(tmp_path / "c.toml", raw)


def _state(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every entry under ``folder``: its bytes (None for a folder) and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def _run(cfg: Path, out: Path, *extra: str) -> int:
    return main(["run", str(cfg), "--out", str(out), "--quiet", "--no-save-models", *extra])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s lock (a run in progress), once it says so."""
    code = (
        "import sys, time\n"
        "from fedmosaic.runfolder import FolderLock\n"
        "FolderLock(sys.argv[1]).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(300)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_ones_lock_taken_over(
    tmp_path: Path, capsys
):
    cfg, out = _cfg(tmp_path), tmp_path / "out"
    assert _run(cfg, out, "--set", "train.lr=0.2") == 0  # another config's finished run
    holder = _holder(out)
    try:
        before = _state(out)
        capsys.readouterr()
        for extra in ([], ["--overwrite"], ["--resume"]):
            assert _run(cfg, out, *extra) == 2, extra
            line = _one_line(capsys)
            assert str(out) in line and f"pid {holder.pid}" in line and "in use" in line, line
            assert _state(out) == before, extra  # nothing changed, not even the lock file
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the flock
        holder.wait()
    assert (out / LOCK_FILE).read_text().strip() == str(holder.pid)  # left behind, stale
    assert _run(cfg, out, "--overwrite") == 0  # taken over
    assert json.loads((out / "results.json").read_text())["config"]["train"]["lr"] == 0.05
    assert not (out / LOCK_FILE).exists()  # released with the run


def test_the_lock_refuses_in_one_process_too_and_leaves_no_folder_behind(tmp_path: Path):
    out = tmp_path / "a" / "b"
    with FolderLock(out):
        assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(RunFolderError, match=r"in use by another run \(pid \d+\)"):
            FolderLock(out).acquire()
        assert (out / LOCK_FILE).is_file()  # the refusal did not remove the holder's file
    assert not (tmp_path / "a").exists()  # made by the lock, empty again: removed
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunFolderError, match="is a file, not a folder"):
        FolderLock(f).acquire()


def test_a_finished_run_of_the_same_config_is_kept_and_reported(tmp_path: Path, capsys):
    cfg, out = _cfg(tmp_path), tmp_path / "out"
    assert _run(cfg, out) == 0
    before = _state(out)
    capsys.readouterr()
    for extra in ([], ["--resume"], ["--checkpoint-every", "1"]):
        assert _run(cfg, out, *extra) == 0, extra
        assert "already done" in capsys.readouterr().out, extra
        assert _state(out) == before, extra  # rounds.csv not truncated, nothing rewritten
    assert _run(cfg, out, "--overwrite") == 0  # runs it again
    assert (out / "results.json").stat().st_mtime_ns > before["results.json"][1]


def test_an_interrupted_run_asks_for_resume_and_changes_nothing(tmp_path: Path, capsys):
    cfg, out = _cfg(tmp_path, rounds=2), tmp_path / "out"
    assert _run(cfg, out) == 0
    (out / "results.json").unlink()  # as a run killed after its checkpoint
    (out / FILENAME).write_bytes(b"a checkpoint")
    before = _state(out)
    capsys.readouterr()
    assert _run(cfg, out) == 2
    assert "--resume" in _one_line(capsys) and _state(out) == before


def test_a_refused_extend_leaves_nothing_behind(tmp_path: Path, capsys):
    cfg, out = _cfg(tmp_path), tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    before = _state(out)
    capsys.readouterr()
    bad = ["--extend", "--set", "train.rounds=2", "--set", "train.lr=0.2"]
    assert main(["run", str(cfg), "--out", str(out), "--quiet", *bad]) == 2
    assert "different configuration" in _one_line(capsys)
    assert _state(out) == before and not (out / FILENAME).exists()
    # ... so the original config's plain re-run is the finished run, not "an interrupted run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    assert "already done" in capsys.readouterr().out and _state(out) == before
    assert (out / FINAL_FILE).exists()


@pytest.mark.parametrize("name", ["results.json", "rounds.csv", FILENAME])
def test_a_directory_where_a_file_goes_is_refused_before_training(
    tmp_path: Path, capsys, monkeypatch, name: str
):
    from fedmosaic import experiment

    cfg, out = _cfg(tmp_path), tmp_path / "out"
    assert _run(cfg, out, "--set", "train.lr=0.2") == 0  # another config's rounds.csv
    (out / "results.json").unlink()
    (out / name).unlink(missing_ok=True)
    (out / name).mkdir()
    (out / name / "keep").write_text("x")
    before = _state(out)
    monkeypatch.setattr(experiment, "build_federation", lambda *a, **k: pytest.fail("trained"))
    capsys.readouterr()
    assert _run(cfg, out) == 2
    line = _one_line(capsys)
    assert str(out / name) in line and " is a directory, where the run writes a file" in line, line
    assert _state(out) == before


def _full_disk(monkeypatch, name: str) -> None:
    """Writes to files whose name starts with ``name`` fail as on a full disk: the file is
    created, then the write fails (ENOSPC carries no file name, as from write(2))."""
    real = io.open

    def fake(file, mode="r", *args, **kwargs):
        if any(m in mode for m in "wax") and Path(str(file)).name.startswith(name):
            real(file, mode, *args, **kwargs).close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", fake)  # pathlib's
    monkeypatch.setattr(builtins, "open", fake)


def test_a_full_disk_at_the_end_is_one_line_and_keeps_the_previous_results(
    tmp_path: Path, capsys, monkeypatch
):
    cfg, out = _cfg(tmp_path), tmp_path / "out"
    assert _run(cfg, out, "--set", "train.lr=0.2") == 0
    previous = (out / "results.json").read_bytes()
    _full_disk(monkeypatch, "results.json")
    capsys.readouterr()
    assert _run(cfg, out, "--overwrite") == 2
    line = _one_line(capsys)
    assert str(out / "results.json") in line and "No space left" in line, line
    assert (out / "results.json").read_bytes() == previous
    assert sorted(p.name for p in out.iterdir() if ".tmp" in p.name) == []  # no temporaries


def _read_only(monkeypatch, folder: Path) -> None:
    """``folder`` read-only. Root ignores permission bits (the tests may run as root), so there
    the calls that create or write files under it fail with EROFS, as on a read-only mount."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return
    inside = str(folder.resolve())
    real_open, real_io_open, real_mkdir = os.open, io.open, os.mkdir

    def under(path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(inside)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def fake_os_open(path, flags, *args, **kwargs):
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        if flags & writes and under(path):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def fake_io_open(file, mode="r", *args, **kwargs):
        if any(m in mode for m in "wax+") and under(file):
            refuse(file)
        return real_io_open(file, mode, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if under(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(io, "open", fake_io_open)  # pathlib's
    monkeypatch.setattr(builtins, "open", fake_io_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def test_a_read_only_folder_is_one_line_and_changes_nothing(tmp_path: Path, capsys, monkeypatch):
    cfg, out = _cfg(tmp_path), tmp_path / "out"
    assert _run(cfg, out, "--set", "train.lr=0.2") == 0
    before = _state(out)
    _read_only(monkeypatch, out)
    capsys.readouterr()
    try:
        for target in (out, out / "new"):
            assert _run(cfg, target, "--overwrite") == 2
            line = _one_line(capsys)
            assert str(out) in line and ("Read-only" in line or "Permission" in line), line
    finally:
        out.chmod(0o755)
    assert _state(out) == before


@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_where_the_lock_goes_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, capsys, dangling: bool
) -> None:
    """``out/.fedmosaic.lock`` a symbolic link to a file outside the folder: refused by name; the
    file it names is neither overwritten nor (dangling) created."""
    cfg = _cfg(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    precious = tmp_path / "precious"
    if not dangling:
        precious.write_text("keep me\n")
    (out / LOCK_FILE).symlink_to(Path("..") / "precious")
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 2
    assert "is a symbolic link where the run's lock goes" in capsys.readouterr().err
    if dangling:
        assert not precious.exists()
    else:
        assert precious.read_text() == "keep me\n"
    assert {p.name for p in out.iterdir()} == {LOCK_FILE}


def test_a_link_where_a_run_file_goes_is_refused(tmp_path: Path, capsys) -> None:
    cfg = _cfg(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    target = tmp_path / "elsewhere.csv"
    target.write_text("mine\n")
    (out / "rounds.csv").symlink_to(target)
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 2
    assert "rounds.csv is a symbolic link where the run writes a file" in capsys.readouterr().err
    assert target.read_text() == "mine\n"


def test_a_run_deletes_only_its_own_dead_temporaries(tmp_path: Path) -> None:
    """The user's files named like temporaries stay; a killed writer's temporary goes."""
    cfg = _cfg(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    mine = ["notes.tmp-old", "results.json.tmp", "rounds.csv.tmp", f"data.tmp-{dead}-zz"]
    for name in mine:
        (out / name).write_text("user\n")
    junk = out / f"results.json.tmp-{dead}-0123abcd"
    junk.write_text("half a write")
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    assert not junk.exists()
    for name in mine:
        assert (out / name).read_text() == "user\n", name
