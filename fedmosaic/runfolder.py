"""One run folder's lifecycle: ``fedmosaic run`` (``--resume``, ``--extend``, ``--overwrite``),
each ``fedmosaic compare`` cell and ``fedmosaic.api`` go through it.

1. **Lock** (:class:`FolderLock`): an exclusive ``fcntl.flock`` on ``.fedmosaic.lock`` in the
   folder, which holds the owner's pid. A second run into the folder is refused at once, naming
   the holder; the kernel drops the lock of a process that dies, so a killed run's lock is simply
   taken over (and its temporary files, whose names carry its pid, are removed). The lock file
   is removed on release, and a folder the lock created is removed again if nothing was written.
   :func:`hold` takes it unless this thread has the folder open as a :class:`RunFolder` (the
   deployed Flower ServerApp's ``run_server`` inside ``fedmosaic.api.run_flower_in_memory``'s
   RunFolder): re-entrant for that run only, refused for every other holder.
2. **Check** (:meth:`RunFolder.check`), nothing written yet: every file a run writes must be a
   file or absent (``results.json`` being a directory is refused before training); a finished
   run of the same config is kept and reported (``Start.done``) unless ``overwrite``; another
   config's finished run needs ``overwrite``; a checkpoint (an interrupted run) needs ``resume``;
   ``resume``/``extend`` verify the checkpoint in full (digest, config, round) before anything
   changes.
3. **Run** (:meth:`RunFolder.run`): the sinks (``rounds.csv``, TensorBoard, W&B) and the round
   loop; a start that fails before its first round leaves the folder as it was, and so does a
   run stopped by its ``on_round`` callback raising, unless a checkpoint (an earlier round's,
   or the one resumed from) is there to continue from: then the folder is an interrupted run's.
4. **Finish** (:meth:`RunFolder.finish`): ``rounds.csv``, the curve and ``results.json`` written
   to temporaries of this writer and renamed, ``results.json`` last; the checkpoint is kept as
   ``final.safetensors`` or removed.

**Replacing a finished run** (``overwrite``, a compare cell run again; not ``extend``, which
continues the finished run and leaves its files until it completes): ``results.json`` is what
every reader takes for "done" (:meth:`RunFolder.check`, :func:`read_results`,
``fedmosaic.api.load_run``, ``suite_runner.cell_status``), so the folder must never hold one
run's ``results.json`` beside another run's rows or checkpoint. Before the new run writes
anything, the finished run's files (``results.json`` first, then ``rounds.csv``, the curve and
``final.safetensors``) are renamed aside to temporaries of this writer (atomic renames, nothing
copied). Then:

- the new run finishes: its own files are written and the old ones aside are deleted;
- it fails or is stopped (an exception, Ctrl-C, ``on_round`` raising, a full disk while writing
  its results) with no checkpoint of its own: everything it wrote is removed and the old run's
  files are renamed back (``results.json`` last), so the old run is whole again, as if the
  start had been refused;
- it is interrupted with a checkpoint of its own: the old run's files aside are deleted and the
  folder is the new run's interrupted run (its rows and checkpoint, no ``results.json``): no
  reader calls it done, a plain start of any config is refused naming the checkpoint, and
  ``--resume`` with the new config continues it;
- the process is killed mid-run: the folder has no ``results.json`` either (an interrupted
  run), and the old files aside, named as this writer's temporaries, are removed when the folder
  is next locked.

A refused start (:meth:`RunFolder.check`) changes nothing, as before.

A file-system error (read-only, full, a directory where a file goes) is a :class:`RunFolderError`:
one line naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from fedmosaic.checkpoint import FILENAME as CHECKPOINT_FILE
from fedmosaic.checkpoint import (
    FINAL_FILE,
    Checkpointer,
    CheckpointError,
    CheckpointPolicy,
    config_fingerprint,
    config_hash,
)
from fedmosaic.config import ConfigError, ExperimentConfig
from fedmosaic.experiment import Trained, run_experiment
from fedmosaic.report.results import (
    TEMP_MARK,
    replace_all,
    temp_path,
    write_atomic,
    write_results,
    write_temp,
)
from fedmosaic.report.sinks import PROGRESS_FILE, Sinks

log = logging.getLogger("fedmosaic")

LOCK_FILE = ".fedmosaic.lock"
RESULTS_FILE = "results.json"
# Every file a run writes into its folder: each must be a regular file or absent at the start.
RUN_FILES = (
    RESULTS_FILE,
    PROGRESS_FILE,
    "curve.png",
    "curve.svg",
    "curve.pdf",
    CHECKPOINT_FILE,
    FINAL_FILE,
)
# A finished run's files, set aside (results.json first) while another run replaces it.
PRODUCT_FILES = (
    RESULTS_FILE,
    PROGRESS_FILE,
    "curve.png",
    "curve.svg",
    "curve.pdf",
    FINAL_FILE,
)


class RunFolderError(ValueError):
    """A run folder this start may not use (in use, a file where the folder goes, a directory
    where a file goes, a file-system error), in one line naming the path."""


def fs_error(exc: OSError, path: Path) -> RunFolderError:
    """``exc`` as one line naming the path it concerns (its own, else ``path``)."""
    where = exc.filename if exc.filename is not None else path
    return RunFolderError(f"{where}: {exc.strerror or exc}")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# exactly what temp_path makes: <name>.tmp-<pid>-<8 hex digits>
_TEMP_NAME = re.compile(rf"(.+){re.escape(TEMP_MARK)}(\d+)-[0-9a-f]{{8}}")


def remove_dead_temps(folder: Path) -> list[Path]:
    """Remove the temporaries ``temp_path`` made (``<name>.tmp-<pid>-<8 hex digits>``, a file
    the run writes under its temporary name) in ``folder`` whose writer is dead (killed
    mid-write); a live writer's are left alone, and so is every other file, whatever its name
    (a user's ``notes.tmp-old`` or ``results.json.tmp``). Returns what was removed."""
    removed = []
    for p in folder.iterdir():
        m = _TEMP_NAME.fullmatch(p.name)
        if m is None or pid_alive(int(m.group(2))):
            continue
        if p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# The run folders each thread has open (resolved path -> its RunFolder): hold() takes no lock
# twice for the run that holds it already (run_flower_in_memory's RunFolder around run_server).
_open = threading.local()


def _open_here() -> dict[Path, RunFolder]:
    if not hasattr(_open, "folders"):
        _open.folders = {}
    return _open.folders


@contextlib.contextmanager
def hold(folder: str | Path, flag: str = "--out") -> Iterator[None]:
    """``folder``'s lock for the duration of the block, unless this thread has it open as a
    :class:`RunFolder` already (the same run: nothing is taken twice, nor released at the
    end). Any other holder, another process, another thread or a bare :class:`FolderLock`, is
    refused in one line naming the folder (RunFolderError)."""
    if Path(folder).resolve() in _open_here():
        yield
        return
    with FolderLock(folder, flag):
        yield


class FolderLock:
    """An exclusive lock on ``folder`` (created when missing) while held; ``flag`` names the
    option the folder came from, for the messages (``--out``, ``results_dir``, a cell)."""

    def __init__(self, folder: str | Path, flag: str = "--out") -> None:
        self.folder = Path(folder)
        self.flag = flag
        self.fd: int | None = None
        self.created: list[Path] = []  # folders this lock made, deepest first

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def acquire(self) -> None:
        """Lock, or a RunFolderError naming the folder and the holder; nothing is left behind
        by a refusal."""
        folder = self.folder
        if folder.exists() and not folder.is_dir():
            raise RunFolderError(f"{self.flag} {folder} is a file, not a folder")
        missing = []
        for p in (folder, *folder.parents):
            if p.exists():
                break
            missing.append(p)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._remove_created(missing)
            raise fs_error(exc, folder) from exc
        self.created = missing
        try:
            self.fd = self._lock(folder / LOCK_FILE)
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())
            remove_dead_temps(folder)  # we hold the lock: a dead writer's temporaries are junk
        except BaseException as exc:
            self.release()
            if isinstance(exc, OSError):
                raise fs_error(exc, folder) from exc
            raise

    def _lock(self, path: Path) -> int:
        for _ in range(100):
            try:  # never through a link: the pid would be written into whatever it names
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise RunFolderError(
                        f"{path} is a symbolic link where the run's lock goes: refused (a run "
                        f"writes nothing through a link); remove it or choose another {self.flag}"
                    ) from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                who = f"pid {holder}" if holder.isdigit() else "pid unknown"
                raise RunFolderError(
                    f"{self.folder} is in use by another run ({who}): wait for it to finish, "
                    f"or choose another {self.flag}"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder removes the file as it releases: a lock on that unlinked file would
            # exclude nobody, so lock the file that is there now.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
        raise RunFolderError(f"{path}: could not be locked (removed and recreated under us)")

    def release(self) -> None:
        """Unlock and remove the lock file (and the folders the lock made, if still empty)."""
        if self.fd is not None:
            try:
                (self.folder / LOCK_FILE).unlink(missing_ok=True)  # before the lock goes
            except OSError:  # a folder that turned read-only: the stale file is harmless
                pass
            os.close(self.fd)
            self.fd = None
        self._remove_created(self.created)
        self.created = []

    @staticmethod
    def _remove_created(folders: list[Path]) -> None:
        for p in folders:
            try:
                p.rmdir()  # only when empty: what a run wrote stays
            except OSError:
                break


@dataclass
class Start:
    """What :meth:`RunFolder.check` found: ``done``, the finished results of this very config
    (nothing to run); else the rounds the checkpoint already holds (``keep``) and, for
    ``extend``, the finished run's state to continue from (``source``)."""

    done: dict[str, Any] | None = None
    keep: int = 0
    source: Path | None = None


def read_results(path: Path) -> dict[str, Any] | None:
    """The results document at ``path``, or None when it is not one (unreadable, not JSON)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class _Replacing:
    """A finished run set aside while another replaces it (the module's "Replacing"): the
    temporaries and the names they go back to, what the folder held once they were moved
    (``before``, ``prior_rows``), and whether the new run trained a round."""

    aside: list[tuple[Path, Path]] = field(default_factory=list)
    before: set[str] | None = None
    prior_rows: bytes | None = None
    started: bool = False


@dataclass(frozen=True)
class RunOptions:
    """How a run goes in its folder, decided once by the caller (``fedmosaic run``,
    ``fedmosaic.api.run(out=...)``, a suite's cell): the progress display, a checkpoint every
    ``checkpoint_every`` rounds (0: none), continuing from the folder's checkpoint (``resume``)
    or past a finished run's last round (``extend``), keeping the final state
    (``keep_final``: ``final.safetensors``), and a callback on each round's record after the
    sinks."""

    progress: bool = False
    checkpoint_every: int = 0
    resume: bool = False
    extend: bool = False
    keep_final: bool = False
    on_round: Callable[[dict[str, Any]], None] | None = None


class RunFolder:
    """One run's output folder, locked while open (``with RunFolder(out) as folder``)."""

    def __init__(self, path: str | Path, flag: str = "--out") -> None:
        self.path = Path(path)
        self.flag = flag
        self.lock = FolderLock(self.path, flag)
        self.replacing: _Replacing | None = None  # a finished run set aside, until finish
        self.key: Path | None = None  # the resolved path, while open (hold())

    def __enter__(self) -> RunFolder:
        self.lock.acquire()
        self.key = self.path.resolve()
        _open_here().setdefault(self.key, self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.replacing is not None:  # run() returned but finish() never wrote
                self._abandon()
        finally:
            folders = _open_here()
            if self.key is not None and folders.get(self.key) is self:
                del folders[self.key]
            self.key = None
            self.lock.release()

    def check_files(self) -> None:
        """Every file a run writes is a regular file or absent (a directory named
        ``results.json`` fails now, not after training)."""
        for name in RUN_FILES:
            p = self.path / name
            if p.is_symlink():
                raise RunFolderError(
                    f"{p} is a symbolic link where the run writes a file: refused (a run writes "
                    f"nothing through a link); remove it or choose another {self.flag}"
                )
            if p.exists() and not p.is_file():
                kind = "a directory" if p.is_dir() else "not a regular file"
                raise RunFolderError(
                    f"{p} is {kind}, where the run writes a file: remove it or choose "
                    f"another {self.flag}"
                )

    def check(
        self,
        cfg: ExperimentConfig,
        *,
        overwrite: bool = False,
        resume: bool = False,
        extend: bool = False,
    ) -> Start:
        """What this start may do with the folder, before anything in it changes: refusals are
        one line (ConfigError, CheckpointError, RunFolderError); see the module's step 2."""
        self.check_files()
        results = self.path / RESULTS_FILE
        # the CLI's flag, or the API's parameter (its folders are named by a parameter: out=...)
        again = "--overwrite" if self.flag.startswith("--") else "overwrite=True"
        if results.is_file():
            doc = read_results(results)
            if doc is None and not overwrite and not extend:
                # not "another configuration": --overwrite would also replace the kept models
                raise ConfigError(
                    f"{results} is not a results document (unreadable, or not a JSON object): "
                    f"move it away, or pass {again} to run again over {self.path}"
                )
            same = doc is not None and config_hash(_config_of(doc)) == config_hash(cfg.to_dict())
            if same and not overwrite:
                return Start(done=doc)
            if not same and not overwrite and not extend:
                there = _config_of(doc) if doc is not None else {}  # unreadable: no keys
                differ = config_differences(there, cfg.to_dict()) if there else ""
                raise ConfigError(
                    f"{self.path} holds a finished run of another configuration"
                    f"{f' ({differ})' if differ else ''}: choose another {self.flag}, or pass "
                    f"{again} to replace it"
                )
        ckpt = self.path / CHECKPOINT_FILE
        source = None
        if extend and not ckpt.exists():
            source = self.path / FINAL_FILE
            if not source.is_file():
                raise ConfigError(
                    f"--extend: {source} does not exist (run with --save-models first)"
                )
        if ckpt.exists() and not (resume or extend):
            raise CheckpointError(
                f"{ckpt} exists (an interrupted run): pass --resume to continue it, "
                "or delete it to start over"
            )
        keep = 0
        verify = source or ckpt
        if (resume or extend) and verify.exists():
            # Verified in full (digest, config, round, clients) before anything changes: a
            # refused resume or extension leaves every file as it was.
            checker = Checkpointer(
                verify, 0, cfg.to_dict(), lambda: [], lambda s: None, resume=True, extend=extend
            )
            keep = int(checker.verify()["round"])
        return Start(keep=keep, source=source)

    def run(
        self,
        cfg: ExperimentConfig,
        start: Start,
        opts: RunOptions = RunOptions(),
        trained: Trained | None = None,
    ) -> dict[str, Any]:
        """Train ``cfg`` here (the sinks as it goes, a checkpoint every
        ``opts.checkpoint_every`` rounds) and return the results document, not yet written
        (:meth:`finish`). A start that fails before its first round removes what it created; so
        does ``opts.on_round`` raising when no checkpoint is there to resume from (its exception
        propagates). ``trained`` is ``run_experiment``'s. A finished run in the folder (not
        ``opts.extend``) is set aside first, then deleted or put back whole (the module's
        "Replacing a finished run")."""
        on_round = opts.on_round
        ckpt = self.path / CHECKPOINT_FILE
        if not opts.extend and (self.path / RESULTS_FILE).is_file():
            # A finished run replaced (overwrite, a cell run again): set aside before anything
            # is written, so that its results.json never stands beside this run's files.
            self._set_aside(rows=not start.keep)
        replacing = self.replacing
        rows = self.path / PROGRESS_FILE
        try:
            before = self._entries()
            # The sinks rewrite rounds.csv at once: an earlier run's rows are put back when this
            # one is rolled back, so its results.json and rows still agree.
            prior_rows = rows.read_bytes() if rows.is_file() else None
            if replacing is not None:
                replacing.before, replacing.prior_rows = before, prior_rows
        except BaseException as exc:
            if replacing is not None:
                self._abandon()
            if isinstance(exc, OSError):
                raise fs_error(exc, self.path) from exc
            raise
        try:
            if start.source is not None:
                # Continue from a copy: the finished run's final state stays as it was until the
                # extended run completes (an interrupted extension resumes from its own copy).
                source = start.source
                replace_all([(write_temp(ckpt, lambda t: shutil.copyfile(source, t)), ckpt)])
            sinks = Sinks(self.path, keep_rounds=start.keep, config=cfg.to_dict())
        except BaseException as exc:
            if replacing is not None:
                self._abandon()
            else:
                self._remove_new(before)
            if isinstance(exc, OSError):
                raise fs_error(exc, self.path) from exc
            raise
        started = stopped = False

        def each_round(rec: dict[str, Any]) -> None:
            nonlocal started, stopped
            started = True
            if replacing is not None:
                replacing.started = True
            sinks(rec)
            if on_round is not None:
                try:
                    on_round(rec)
                except BaseException:
                    stopped = True
                    raise

        try:
            doc = run_experiment(
                cfg,
                progress=opts.progress,
                on_round=each_round,
                checkpoint=CheckpointPolicy(
                    self.path, opts.checkpoint_every, opts.resume, opts.keep_final, opts.extend
                ),
                trained=trained,
            )
        except BaseException:
            sinks.close()
            if replacing is not None:
                # the old run whole again, or this run's interrupted run (module docstring)
                self._abandon()
            elif (not started or (stopped and not ckpt.exists())) and not start.keep:
                # Failed before any round, or stopped by the caller with nothing saved to
                # resume from: leave the folder as it was (rounds.csv alone would claim a run
                # that is not there). Otherwise it is an interrupted run: its checkpoint and
                # rows up to it.
                self._remove_new(before)
                if prior_rows is not None:
                    with contextlib.suppress(OSError):  # the original error matters more
                        write_atomic(rows, prior_rows)
            raise
        sinks.close()
        if replacing is not None:
            replacing.started = True  # trained to the end: its checkpoint, if any, is this run's
        return doc

    def execute(
        self,
        cfg: ExperimentConfig,
        start: Start,
        opts: RunOptions = RunOptions(),
        trained: Trained | None = None,
    ) -> dict[str, Any]:
        """:meth:`run` then :meth:`finish`: a checked start (``start.done`` is None) trained and
        written; ``fedmosaic run`` and ``fedmosaic.api.run(out=...)`` both come here."""
        doc = self.run(cfg, start, opts, trained)
        self.finish(doc, keep_final=opts.keep_final)
        return doc

    def finish(self, doc: dict[str, Any], *, keep_final: bool = False) -> None:
        """Write the results (``results.json`` renamed last: a failed write keeps the previous
        files), then keep the checkpoint as ``final.safetensors`` or remove it. A finished run
        set aside by :meth:`run` is deleted once this run's ``results.json`` is in place, or put
        back whole when the write fails and this run has no checkpoint to resume from."""
        try:
            write_results(self.path, doc)
        except BaseException as exc:
            if self.replacing is not None:
                self._abandon()
            if isinstance(exc, OSError):
                raise fs_error(exc, self.path) from exc
            raise
        replaced, self.replacing = self.replacing, None
        if replaced is not None:  # this run's results.json is in place: the old files go
            self._drop(replaced)
        try:
            ckpt = self.path / CHECKPOINT_FILE
            if keep_final and ckpt.exists():  # kept: inspection, load_run, --extend
                os.replace(ckpt, self.path / FINAL_FILE)
            ckpt.unlink(missing_ok=True)  # complete: results.json is the product
        except OSError as exc:
            raise fs_error(exc, self.path) from exc

    def _set_aside(self, rows: bool) -> None:
        """Rename the finished run's files (``PRODUCT_FILES``, ``results.json`` first; its
        ``rounds.csv`` only when ``rows``) to temporaries of this writer; a failure puts back
        what was moved and is one line naming the path."""
        replacing = _Replacing()
        try:
            for name in PRODUCT_FILES:
                path = self.path / name
                if (name == PROGRESS_FILE and not rows) or path.is_symlink():
                    continue
                if path.is_file():
                    tmp = temp_path(path)
                    os.rename(path, tmp)
                    replacing.aside.append((tmp, path))
        except BaseException as exc:
            self._put_back(replacing)
            if isinstance(exc, OSError):
                raise fs_error(exc, self.path) from exc
            raise
        self.replacing = replacing

    def _abandon(self) -> None:
        """The replacing run will not finish: with a checkpoint of its own the folder is its
        interrupted run and the old files aside go; else what it wrote goes and the old run's
        files are put back (``results.json`` last). Best effort: the error that stopped the run
        is the one reported."""
        replacing, self.replacing = self.replacing, None
        if replacing is None:
            return
        if replacing.started and (self.path / CHECKPOINT_FILE).exists():
            self._drop(replacing)
            return
        with contextlib.suppress(OSError):
            if replacing.before is not None:
                self._remove_new(replacing.before)  # the files aside were there: kept
            if replacing.prior_rows is not None:
                write_atomic(self.path / PROGRESS_FILE, replacing.prior_rows)
        self._put_back(replacing)

    @staticmethod
    def _put_back(replacing: _Replacing) -> None:
        for tmp, path in reversed(replacing.aside):  # results.json last
            with contextlib.suppress(OSError):
                os.replace(tmp, path)
        replacing.aside = []

    @staticmethod
    def _drop(replacing: _Replacing) -> None:
        for tmp, _ in replacing.aside:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        replacing.aside = []

    def _entries(self) -> set[str]:
        """Every path under the folder, relative (links are listed, never followed)."""
        found: set[str] = set()
        for root, dirs, files in os.walk(self.path):
            rel = Path(root).relative_to(self.path)
            found.update((rel / name).as_posix() for name in dirs + files)
        return found

    def _remove_new(self, before: set[str]) -> None:
        """Delete what a failed start created in the folder, inside folders that were there
        too (TensorBoard adds an event file to an earlier run's ``tb/``); the lock's own file
        stays."""
        for rel in sorted(self._entries() - before - {LOCK_FILE}, key=len):
            p = self.path / rel
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)  # a new folder goes with all it holds
            elif p.is_symlink() or p.exists():
                p.unlink(missing_ok=True)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (``{"train": {"lr": 0.1}}`` -> ``{"train.lr": 0.1}``)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(there: dict[str, Any], here: dict[str, Any], shown: int = 3) -> str:
    """The first ``shown`` keys whose values differ between a folder's finished run (``there``)
    and this start's config (``here``), compared as their fingerprints (the keys that change
    results), each with both values: ``train.lr = 0.01 there, 0.2 here``."""
    a, b = _flat(config_fingerprint(there)), _flat(config_fingerprint(here))

    def show(flat: dict[str, Any], key: str) -> str:  # as config_hash sees it (1 is not 1.0)
        return json.dumps(flat[key], sort_keys=True) if key in flat else "(not set)"

    keys = [*b, *(k for k in a if k not in b)]
    parts = [
        f"{k} = {show(a, k)} there, {show(b, k)} here" for k in keys if show(a, k) != show(b, k)
    ]
    more = len(parts) - shown
    return "; ".join(parts[:shown]) + (f"; and {more} more key(s)" if more > 0 else "")


def _config_of(doc: dict[str, Any]) -> dict[str, Any]:
    config = doc.get("config")
    return config if isinstance(config, dict) else {}
