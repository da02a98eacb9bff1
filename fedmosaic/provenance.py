"""Where a result came from: the code, the machine, the command and the data of a run.

Every ``results.json`` carries a ``provenance`` block (:func:`provenance`):

- ``code``: library version, git commit (and whether the tree had uncommitted changes) when the
  package runs from a checkout, and ``source_hash``: a SHA-256 over the package's source files
  that decide the numbers (every ``.py``/``.cpp``/``.h`` under ``fedmosaic/`` except the
  presentation-only ``report/``). ``compare`` keys its cell cache on it, so a code change reruns
  cells instead of showing stale numbers; it does not depend on git (works from a wheel).
- ``command``, ``started`` (UTC, ISO 8601), ``host``: hostname, OS, CPU model (vendor, family,
  model, stepping, as /proc/cpuinfo gives them) and count, GPU.
- ``numerics`` (:func:`fedmosaic.numerics.record`): native or portable arithmetic, the CPU's
  instruction-set level, the level torch and the native kernels run at, MKL's and oneDNN's
  versions, and the level variables as found: which hosts should reproduce the cell bit for bit.
- ``versions``: python, torch, numpy, scikit-learn, flwr (when installed).
- ``data``: the dataset's files (path, bytes, SHA-256) and a SHA-256 of the loaded images and
  labels, so two runs on "the same" dataset can be told apart when the files differ.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import fedmosaic
from fedmosaic import numerics

PACKAGE = Path(fedmosaic.__file__).resolve().parent
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
PRESENTATION = ("report",)  # subpackages that never change a number


def source_files(root: Path = PACKAGE) -> list[Path]:
    """The package's number-deciding source files, in a stable order."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and rel.parts[0] not in PRESENTATION:
            if "__pycache__" not in rel.parts:
                out.append(p)
    return out


def source_hash(root: Path = PACKAGE) -> str:
    """SHA-256 over the relative path and contents of every :func:`source_files` entry."""
    h = hashlib.sha256()
    for p in source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=PACKAGE, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.cache
def code() -> dict[str, Any]:
    """The library version, git commit and dirty flag (None outside a checkout), source hash."""
    commit = _git("rev-parse", "HEAD")
    dirty = None
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", str(PACKAGE))
        dirty = bool(status) if status is not None else None
    return {
        "version": fedmosaic.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "source_hash": source_hash(),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def _cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def _cpu_id() -> dict[str, str | None]:
    info = _cpuinfo()
    return {k: info.get(k) for k in ("vendor_id", "cpu family", "model", "stepping", "microcode")}


@functools.cache
def host() -> dict[str, Any]:
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_id": _cpu_id(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
    }


@functools.cache
def versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "scikit-learn": _version("scikit-learn"),
        "flwr": _version("flwr"),
    }


@functools.cache
def file_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file (cached by path, size and mtime: a rewritten file is hashed again)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_files(paths: tuple[str, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in paths:
        try:
            st = os.stat(p)
            if os.path.isdir(p):  # a folder of many files (Tiny-ImageNet): named, not hashed
                out.append({"path": p, "bytes": None, "sha256": None})
                continue
            digest = file_digest(p, st.st_size, st.st_mtime_ns)
        except OSError:  # moved or unreadable since it was read: say so rather than fail
            out.append({"path": p, "bytes": None, "sha256": None})
            continue
        out.append({"path": p, "bytes": st.st_size, "sha256": digest})
    return out


def tensor_digest(*tensors: torch.Tensor) -> str:
    """SHA-256 over the tensors' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else []


def provenance(
    dataset_files: tuple[str, ...],
    images: torch.Tensor,
    labels: torch.Tensor,
    started: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """The ``provenance`` block of ``results.json`` (see the module docstring)."""
    return {
        "code": code(),
        "command": command(),
        "started": started,
        "finished": now(),
        "workers": workers,
        "host": host(),
        "versions": versions(),
        "numerics": numerics.record(),
        "data": {"files": data_files(dataset_files), "sha256": tensor_digest(images, labels)},
    }
