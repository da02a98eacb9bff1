"""Compact off-process storage of client state: one raw file per client.

A client's persistent state is every parameter and buffer (persistent or not) of its model and
extras, in module order. :func:`state_tensors` lists them; :class:`StateStore` writes them as raw
bytes (no pickle, no headers beyond a layout digest) to ``<dir>/<client>.bin`` and reads them back
straight into the live tensors of a module of the same layout. Files go through the OS page cache:
they cost no process memory (RSS), the kernel keeps them in RAM while there is room, and any
worker process can read any client's file, so clients can move between workers freely.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

_DIGEST = 16  # bytes of layout digest at the start of every file


def state_tensors(model: nn.Module, extras: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors that make up a client's state: parameters and buffers, model then extras.

    Non-persistent buffers (``register_buffer(..., persistent=False)``) are scratch, as in torch's
    ``state_dict``: recomputed before use (FedHeNN-homo's per-round kernel, whose shape changes
    from ``[0, 0]`` to ``[L, L]``), so they are neither stored nor part of the layout.
    """
    out: list[tuple[str, Tensor]] = []
    for prefix, module in (("model.", model), ("extras.", extras)):
        out += [(prefix + n, p.data) for n, p in module.named_parameters()]
        for mod_name, mod in module.named_modules():
            scratch = mod._non_persistent_buffers_set
            for n, b in mod.named_buffers(recurse=False):
                if n not in scratch:
                    out.append((prefix + (f"{mod_name}.{n}" if mod_name else n), b))
    return out


def layout_digest(tensors: list[tuple[str, Tensor]]) -> bytes:
    """A digest of names, dtypes and shapes: a file only loads into a module of the same layout."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    for name, t in tensors:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    return h.digest()


def state_nbytes(model: nn.Module, extras: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for _, t in state_tensors(model, extras))


def _bytes_view(t: Tensor) -> memoryview:
    # An ndarray is a buffer; numpy's stubs only say so for Python >= 3.12.
    return memoryview(cast(Any, t.detach().reshape(-1).view(torch.uint8).numpy()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def remove_stale(folder: str | Path, prefix: str) -> list[Path]:
    """Remove ``folder/<prefix><pid>-*`` entries of this user whose process no longer exists
    (what a SIGKILLed run leaves behind: its client-state folder, its shared image file)."""
    removed = []
    for p in Path(folder).glob(f"{prefix}*"):
        pid = p.name[len(prefix) :].split("-", 1)[0]
        try:
            if not pid.isdigit() or p.stat().st_uid != os.getuid() or _alive(int(pid)):
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p)
        except OSError:  # raced with another cleaner, or not ours after all
            continue
    return removed


class StateStore:
    """Per-client state files in a private temporary folder (removed by :meth:`close`)."""

    def __init__(self, root: str | Path | None = None, create: bool = True) -> None:
        if root is None:
            remove_stale(tempfile.gettempdir(), "fedmosaic-states-")
            # The owner's pid in the name: a SIGKILLed run's folder is removed by the next one.
            root = tempfile.mkdtemp(prefix=f"fedmosaic-states-{os.getpid()}-")  # mode 0700
        self.root = Path(root)
        self.owner = create
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
            # Removed when the store is dropped or at exit even if nobody calls close() (a
            # serial federation run by hand); a SIGKILL is handled by the next start.
            self._remove = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def path(self, cid: int) -> Path:
        return self.root / f"{cid}.bin"

    def has(self, cid: int) -> bool:
        return self.path(cid).exists()

    def save(self, cid: int, model: nn.Module, extras: nn.Module) -> int:
        """Write the client's state (atomically: a reader never sees half a file); returns bytes."""
        tensors = state_tensors(model, extras)
        tmp = self.path(cid).with_suffix(f".tmp{os.getpid()}")
        n = _DIGEST
        with open(tmp, "wb", buffering=0) as f:
            f.write(layout_digest(tensors))
            for _, t in tensors:
                if t.device.type != "cpu" or not t.is_contiguous():
                    t = t.detach().to("cpu").contiguous()
                if t.numel():
                    n += f.write(_bytes_view(t))
        os.replace(tmp, self.path(cid))
        return n

    def load(self, cid: int, model: nn.Module, extras: nn.Module) -> bool:
        """Read the client's state into ``model``/``extras`` (same layout); False if no file.

        Raises ``ValueError`` when the file was written from a module of another layout.
        """
        try:
            f = open(self.path(cid), "rb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return False
        with f, torch.no_grad():
            tensors = state_tensors(model, extras)
            if f.read(_DIGEST) != layout_digest(tensors):
                raise ValueError(f"client {cid}: stored state has another layout")
            for name, t in tensors:
                direct = t.device.type == "cpu" and t.is_contiguous()
                dst = t if direct else torch.empty_like(t, device="cpu").contiguous()
                if dst.numel():
                    view = _bytes_view(dst)
                    if f.readinto(view) != len(view):
                        raise ValueError(f"client {cid}: stored state is truncated at {name}")
                if not direct:
                    t.copy_(dst)
        return True

    def drop(self, cid: int) -> None:
        self.path(cid).unlink(missing_ok=True)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("*.bin"))

    def close(self) -> None:
        if self.owner:
            self._remove()  # runs the removal once
