"""One run folder's lifecycle: ``fedmosaic run`` (``--resume``, ``--extend``, ``--overwrite``),
each ``fedmosaic compare`` cell and ``fedmosaic.api`` go through it.

1. **Lock** (:class:`FolderLock`): an exclusive ``fcntl.flock`` on ``.fedmosaic.lock`` in the
   folder, which holds the owner's pid. A second run into the folder is refused at once, naming
   the holder; the kernel drops the lock of a process that dies, so a killed run's lock is simply
   taken over (and its temporary files, whose names carry its pid, are removed). The lock file
   is removed on release, and a folder the lock created is removed again if nothing was written.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from fedmosaic.checkpoint import FILENAME as CHECKPOINT_FILE
from fedmosaic.checkpoint import (
    FINAL_FILE,
    Checkpointer,
    CheckpointError,
    config_fingerprint,
    config_hash,
)
from fedmosaic.config import ConfigError, ExperimentConfig
from fedmosaic.experiment import run_experiment
from fedmosaic.report.results import (
    TEMP_MARK,
    replace_all,
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


class RunFolder:
    """One run's output folder, locked while open (``with RunFolder(out) as folder``)."""

    def __init__(self, path: str | Path, flag: str = "--out") -> None:
        self.path = Path(path)
        self.flag = flag
        self.lock = FolderLock(self.path, flag)

    def __enter__(self) -> RunFolder:
        self.lock.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
        if results.is_file():
            doc = read_results(results)
            same = doc is not None and config_hash(_config_of(doc)) == config_hash(cfg.to_dict())
            if same and not overwrite:
                return Start(done=doc)
            if not same and not overwrite and not extend:
                there = _config_of(doc) if doc is not None else {}  # unreadable: no keys
                differ = config_differences(there, cfg.to_dict()) if there else ""
                raise ConfigError(
                    f"{self.path} holds a finished run of another configuration"
                    f"{f' ({differ})' if differ else ''}: choose another {self.flag}, or pass "
                    "--overwrite to replace it"
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
        *,
        progress: bool = False,
        checkpoint_every: int = 0,
        resume: bool = False,
        extend: bool = False,
        keep_final: bool = False,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        trained: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Train ``cfg`` here (the sinks as it goes, a checkpoint every ``checkpoint_every``
        rounds) and return the results document, not yet written (:meth:`finish`). A start that
        fails before its first round removes what it created; so does ``on_round`` raising when
        no checkpoint is there to resume from (its exception propagates). ``on_round`` gets each
        round's record after the sinks; ``trained`` is ``run_experiment``'s."""
        ckpt = self.path / CHECKPOINT_FILE
        before = self._entries()
        # The sinks rewrite rounds.csv at once: an earlier run's (an overwrite) is put back when
        # this one is rolled back, so its results.json and rows still agree.
        rows = self.path / PROGRESS_FILE
        prior_rows = rows.read_bytes() if rows.is_file() else None
        try:
            if start.source is not None:
                # Continue from a copy: the finished run's final state stays as it was until the
                # extended run completes (an interrupted extension resumes from its own copy).
                source = start.source
                replace_all([(write_temp(ckpt, lambda t: shutil.copyfile(source, t)), ckpt)])
            sinks = Sinks(self.path, keep_rounds=start.keep, config=cfg.to_dict())
        except OSError as exc:
            self._remove_new(before)
            raise fs_error(exc, self.path) from exc
        started = stopped = False

        def each_round(rec: dict[str, Any]) -> None:
            nonlocal started, stopped
            started = True
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
                progress=progress,
                on_round=each_round,
                checkpoint_dir=self.path,
                checkpoint_every=checkpoint_every,
                resume=resume or extend,
                keep_final=keep_final,
                extend=extend,
                trained=trained,
            )
        except BaseException:
            sinks.close()
            # Failed before any round, or stopped by the caller with nothing saved to resume
            # from: leave the folder as it was (rounds.csv alone would claim a run that is not
            # there). Otherwise it is an interrupted run: its checkpoint and rows up to it.
            if (not started or (stopped and not ckpt.exists())) and not start.keep:
                self._remove_new(before)
                if prior_rows is not None:
                    with contextlib.suppress(OSError):  # the original error matters more
                        write_atomic(rows, prior_rows)
            raise
        sinks.close()
        return doc

    def execute(
        self, cfg: ExperimentConfig, start: Start, *, keep_final: bool = False, **options: Any
    ) -> dict[str, Any]:
        """:meth:`run` (``options``: its keywords) then :meth:`finish`: a checked start
        (``start.done`` is None) trained and written; ``fedmosaic run`` and
        ``fedmosaic.api.run(out=...)`` both come here."""
        doc = self.run(cfg, start, keep_final=keep_final, **options)
        self.finish(doc, keep_final=keep_final)
        return doc

    def finish(self, doc: dict[str, Any], *, keep_final: bool = False) -> None:
        """Write the results (``results.json`` renamed last: a failed write keeps the previous
        files), then keep the checkpoint as ``final.safetensors`` or remove it."""
        try:
            write_results(self.path, doc)
            ckpt = self.path / CHECKPOINT_FILE
            if keep_final and ckpt.exists():  # kept: inspection, load_run, --extend
                os.replace(ckpt, self.path / FINAL_FILE)
            ckpt.unlink(missing_ok=True)  # complete: results.json is the product
        except OSError as exc:
            raise fs_error(exc, self.path) from exc

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
