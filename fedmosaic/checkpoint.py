"""Checkpoint and resume of one run: safetensors + JSON, never pickle.

One file, ``checkpoint.safetensors``, holds every tensor of the run (server state, each client's
model and extras state dicts, torch's RNG state) and, in its JSON header, the structure that puts
them back together: the server state's tree (dataclasses, dicts, lists, scalars), the
history so far, the last evaluation, the Python/NumPy RNG states, the round number, the config
and a digest over all of it.

Server states are plain data (dataclasses of tensors, dicts and scalars: no modules, generators or
caches), saved by a small flattener (:func:`flatten_tree`) and restored *into a template*: the
freshly initialised state of the same algorithm on the same config (``algo.init_server(spec)``).
Classes are never imported by name from the file, so loading a checkpoint runs no code from it
(the plugins its config names are imported only with the caller's consent: ``api.load_run``); a
file whose structure does not match the template is rejected as foreign. Leaves: ``None``,
``bool``, ``int``, ``float`` (NaN/Inf included), ``str``, tensors; containers: ``dict``
(str/int/float/bool keys), ``list``, ``tuple``, dataclass instances. Anything else fails at save
time with the path of the offending value.

Writes go to a temporary file that is read back and verified before it replaces the previous
checkpoint (write-then-rename), so a crash or a full disk never destroys the last good one.
They stream: each client's tensors go to an anonymous spool file as the transport hands them
over (one client at a time), the header is computed from what was spooled, and the file is the
header followed by the spool's bytes; verifying and resuming read one tensor (one client) at a
time. The file is a standard safetensors file, the same format as before (files written by
earlier versions load unchanged).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor, nn

import fedmosaic
from fedmosaic.core.checks import PrivacyRule
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.rounds import ClientState, EvalResult, History, LazyClientStates, Transport
from fedmosaic.federation import Federation
from fedmosaic.report.results import replace_all, write_temp

log = logging.getLogger("fedmosaic")

FORMAT = "fedmosaic-checkpoint"
VERSION = 1
FILENAME = "checkpoint.safetensors"
FINAL_FILE = "final.safetensors"  # --save-models: the checkpoint after the last round, kept
# Test hook: after saving the checkpoint of this round the process SIGKILLs itself (resume tests).
KILL_ENV = "FEDMOSAIC_KILL_AFTER_CHECKPOINT"
# Config keys that do not change a run's numbers (a resumed run may differ in them).
NEUTRAL_KEYS = ("sim.progress", "sim.wandb", "sim.offload_clients")
# Keys added after configs were first recorded, with the value that reproduces the results of the
# configs recorded without them: at that value they are left out of the fingerprint, so stored
# checkpoints and compare cells (docs/results) keep their hashes. The peer guard at its default
# changes no number where it drops nothing (tests/test_peer_guard.py: bitwise the guard off).
LATER_KEYS: dict[str, Any] = {
    "server.peer_factor": 10.0,
    "train.shuffle": True,
    "model.init": "client",
    "data.split_seed": -1,
    "sim.numerics": "native",
    "train.cuda_graphs": "auto",
    "eval.membership": False,
    "train.stop_on_divergence": True,
}
# Tables added later, left out of the fingerprint when every key is at its default (the run
# without them): ``[privacy]`` off.
LATER_TABLES: dict[str, dict[str, Any]] = {"privacy": dataclasses.asdict(PrivacyRule())}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or does not belong to this run (with the reason)."""


# ---- the generic tree flattener --------------------------------------------------------------
def flatten_tree(obj: Any, tensors: dict[str, Tensor], prefix: str) -> Any:
    """A JSON-able description of ``obj``; its tensors go into ``tensors`` under ``prefix/...``.

    Two references to the same tensor object are stored once and restored as one object.
    """
    seen: dict[int, str] = {}
    keep: list[Any] = []  # pins every visited tensor so no id() is reused during the walk

    def walk(x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x if np.isfinite(x) else {"t": "float", "v": repr(x)}
        if isinstance(x, Tensor):
            if id(x) in seen:
                return {"t": "tensor", "key": seen[id(x)]}
            if x.is_complex() or x.is_sparse or x.is_quantized:
                raise CheckpointError(f"{path}: unsupported tensor kind {x.dtype}/{x.layout}")
            key = f"{prefix}/{len(seen)}"
            seen[id(x)] = key
            keep.append(x)
            tensors[key] = x.detach().to("cpu").contiguous().clone()
            return {"t": "tensor", "key": key, "grad": bool(x.requires_grad)}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {
                "t": "dataclass",
                "cls": type(x).__qualname__,
                "fields": {
                    f.name: walk(getattr(x, f.name), f"{path}.{f.name}")
                    for f in dataclasses.fields(x)
                },
            }
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int, float, bool)) or k is None:
                    raise CheckpointError(
                        f"{path}: unsupported dict key {k!r} ({type(k).__name__})"
                    )
                items.append([k, walk(v, f"{path}[{k!r}]")])
            return {"t": "dict", "items": items}
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return {"t": kind, "items": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        raise CheckpointError(
            f"{path}: cannot checkpoint a value of type {type(x).__module__}.{type(x).__qualname__}"
            " (server states are plain data: tensors, numbers, strings, None, dicts, lists, "
            "tuples, dataclasses)"
        )

    return walk(obj, prefix)


def _template_kind(x: Any) -> tuple[str, tuple[str, ...]] | None:
    """What a template value requires of the checkpoint's node at its place: (its name, the
    node types that fit); None where anything may stand (None, numbers, strings)."""
    if isinstance(x, Tensor):
        return "a tensor", ("tensor",)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return f"a {type(x).__qualname__}", ("dataclass",)  # the class is checked below
    if isinstance(x, dict):
        return "a dict", ("dict",)
    if isinstance(x, (list, tuple)):
        return "a list", ("list", "tuple")
    return None


def _node_kind(n: Any) -> str:
    """A checkpoint node in words (for the error)."""
    if isinstance(n, dict) and isinstance(n.get("t"), str):
        return {"tensor": "a tensor", "dict": "a dict", "float": "a number"}.get(
            n["t"], f"a {n.get('cls', n['t'])!r}"
        )
    return f"the value {str(n)[:40]}"


def restore_tree(node: Any, tensors: dict[str, Tensor], template: Any, path: str = "state") -> Any:
    """Rebuild the object described by ``node``, reusing ``template``'s classes and modules.

    Dataclasses must exist in the template at the same place with the same class
    (nothing is imported from the file); where the template holds a tensor, a dict or a
    sequence, so must the file (a number where the run has a state is a forged file);
    containers and leaves may differ in content.
    """
    cache: dict[str, Tensor] = {}

    def tensor(ref: dict[str, Any], p: str) -> Tensor:
        key = ref.get("key")
        if key not in tensors:
            raise CheckpointError(f"{p}: tensor {key!r} is missing from the checkpoint")
        if key not in cache:
            t = tensors[key].clone()
            cache[key] = t.requires_grad_(True) if ref.get("grad") and t.is_floating_point() else t
        return cache[key]

    def walk(n: Any, tmpl: Any, p: str) -> Any:
        want = _template_kind(tmpl)
        if want is not None and not (isinstance(n, dict) and n.get("t") in want[1]):
            # e.g. server_state = 5 where the run has a dict: a forged or foreign file
            raise CheckpointError(
                f"{p}: the checkpoint has {_node_kind(n)} where this run has {want[0]}"
            )
        if n is None or isinstance(n, (bool, int, float, str)):
            return n
        if isinstance(n, list):
            raise CheckpointError(f"{p}: malformed node")
        if not isinstance(n, dict) or "t" not in n:
            raise CheckpointError(f"{p}: malformed node {str(n)[:60]!r}")
        t = n["t"]
        if t == "float":
            return float(n["v"])
        if t == "tensor":
            out = tensor(n, p)
            if isinstance(tmpl, Tensor) and tmpl.device.type != "cpu":
                out = out.to(tmpl.device)
            return out
        if t == "dataclass":
            if not (dataclasses.is_dataclass(tmpl) and type(tmpl).__qualname__ == n.get("cls")):
                raise CheckpointError(
                    f"{p}: the checkpoint has a {n.get('cls')!r} where this run has "
                    f"{type(tmpl).__qualname__!r} (a checkpoint of another algorithm?)"
                )
            names = [f.name for f in dataclasses.fields(tmpl)]
            fields = n.get("fields", {})
            if sorted(fields) != sorted(names):
                raise CheckpointError(
                    f"{p}: fields {sorted(fields)} do not match {type(tmpl).__qualname__}'s {names}"
                )
            obj = object.__new__(type(tmpl))
            if hasattr(tmpl, "__dict__"):
                obj.__dict__.update(tmpl.__dict__)  # non-field attributes (caches) as initialised
            for name in names:
                value = walk(fields[name], getattr(tmpl, name), f"{p}.{name}")
                object.__setattr__(obj, name, value)
            return obj
        if t == "dict":
            tdict = tmpl if isinstance(tmpl, dict) else {}
            return {k: walk(v, tdict.get(k), f"{p}[{k!r}]") for k, v in n["items"]}
        if t in ("list", "tuple"):
            tseq = tmpl if isinstance(tmpl, (list, tuple)) else ()
            items = [
                walk(v, tseq[i] if i < len(tseq) else None, f"{p}[{i}]")
                for i, v in enumerate(n["items"])
            ]
            return items if t == "list" else tuple(items)
        raise CheckpointError(f"{p}: unknown node type {t!r}")

    return walk(node, template, path)


# ---- RNG state ---------------------------------------------------------------------------------
def capture_rng(tensors: dict[str, Tensor]) -> dict[str, Any]:
    """Torch / NumPy / Python global RNG states (our streams are derived; these are belt and braces)."""
    tensors["rng/torch"] = torch.get_rng_state()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    version, internal, py_gauss = random.getstate()
    return {
        "numpy": [str(name), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(internal), py_gauss],
    }


def restore_rng(meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    name, pos, has_gauss, gauss = meta["numpy"]
    keys = tensors["rng/numpy"].numpy().astype(np.uint32)
    np.random.set_state((name, keys, pos, has_gauss, gauss))
    version, internal, py_gauss = meta["python"]
    random.setstate((version, tuple(internal), py_gauss))


# ---- history -------------------------------------------------------------------------------------
def _evals(results: Sequence[EvalResult]) -> list[dict[str, Any]]:
    return [{"client_id": r.client_id, "counts": r.counts} for r in results]


def _from_evals(items: Sequence[dict[str, Any]]) -> list[EvalResult]:
    return [EvalResult(int(d["client_id"]), d["counts"]) for d in items]


def history_to_json(history: History) -> dict[str, Any]:
    return {
        "rounds": history.rounds,
        "participants": history.participants,
        "final_eval": _evals(history.final_eval),
        "finetune_eval": _evals(history.finetune_eval),
    }


def history_from_json(d: dict[str, Any]) -> History:
    return History(
        rounds=list(d["rounds"]),
        final_eval=_from_evals(d["final_eval"]),
        finetune_eval=_from_evals(d["finetune_eval"]),
        participants=[list(p) for p in d["participants"]],
    )


# ---- the file -------------------------------------------------------------------------------------
def config_fingerprint(config: dict[str, Any]) -> dict[str, Any]:
    """The config without the keys that do not change results (for the resume check)."""
    cfg = json.loads(json.dumps(config))
    for dotted in NEUTRAL_KEYS:
        section, key = dotted.split(".")
        cfg.get(section, {}).pop(key, None)
    for dotted, value in LATER_KEYS.items():
        section, key = dotted.split(".")
        if key in cfg.get(section, {}) and cfg[section][key] == value:
            del cfg[section][key]
    for table, default in LATER_TABLES.items():
        if cfg.get(table) == default:
            del cfg[table]
    # "auto" (sim.backend, sim.threads) came later: fingerprinted as the recorded value with the
    # same numbers. Every choice of "auto" with threads "auto", 0 or 1 runs each client's math on
    # one thread (sim/backend.py), as "processes" with threads 0 (every committed cell) does;
    # with threads N > 1 it is serial on N threads; serial with "auto" threads is serial with 1.
    sim = cfg.get("sim", {})
    if isinstance(sim, dict):
        if sim.get("backend") == "auto":
            t = sim.get("threads")
            many = isinstance(t, int) and not isinstance(t, bool) and t > 1
            sim["backend"] = "serial" if many else "processes"
        if sim.get("threads") == "auto":
            sim["threads"] = 0 if sim.get("backend") == "processes" else 1
    return cfg


def config_hash(config: dict[str, Any]) -> str:
    blob = json.dumps(config_fingerprint(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _digest(meta_json: str, tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1).contiguous()
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


@dataclass
class Loaded:
    meta: dict[str, Any]
    tensors: dict[str, Tensor]


# safetensors' dtype names (the file format's), by torch dtype
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_CHUNK = 1 << 24  # bytes per read when hashing or copying the spool (bounds the write's memory)


@dataclass
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class Spool:
    """Tensors written to an anonymous temporary file as they come (one client at a time), with
    their dtypes, shapes and byte ranges: what a checkpoint's header is computed from. The file
    has no name (removed by the OS when closed or when the process dies)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.fh: IO[bytes] = tempfile.TemporaryFile(dir=folder)
        self.entries: dict[str, _Entry] = {}
        self.size = 0

    def add(self, key: str, t: Tensor) -> None:
        if key in self.entries:
            raise CheckpointError(f"tensor {key!r} written twice")
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"{key}: unsupported tensor dtype {t.dtype}")
        flat = t.reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        self.fh.write(data)
        self.entries[key] = _Entry(t.dtype, tuple(t.shape), self.size, self.size + len(data))
        self.size += len(data)

    def add_all(self, tensors: Mapping[str, Tensor]) -> None:
        for k, v in tensors.items():
            self.add(k, v)

    def _chunks(self, start: int, end: int) -> Iterator[bytes]:
        self.fh.seek(start)
        while start < end:
            data = self.fh.read(min(_CHUNK, end - start))
            if not data:
                raise CheckpointError("the checkpoint spool is shorter than written (disk full?)")
            start += len(data)
            yield data

    def digest(self, meta_json: str) -> str:
        """:func:`_digest` over the spooled tensors, read back one chunk at a time."""
        self.fh.flush()
        h = hashlib.sha256(meta_json.encode())
        for key in sorted(self.entries):
            e = self.entries[key]
            h.update(f"{key}|{e.dtype}|{e.shape}|".encode())
            for data in self._chunks(e.start, e.end):
                h.update(data)
        return h.hexdigest()

    def header(self, metadata: dict[str, str]) -> bytes:
        """The safetensors header (length prefix and JSON, padded to 8 bytes as safetensors
        pads it) for the spooled tensors in spool order."""
        table: dict[str, Any] = {"__metadata__": metadata}
        for key, e in self.entries.items():
            table[key] = {
                "dtype": _ST_DTYPES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [e.start, e.end],
            }
        blob = json.dumps(table, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        return struct.pack("<Q", len(blob)) + blob

    def write_file(self, out: IO[bytes], metadata: dict[str, str]) -> None:
        out.write(self.header(metadata))
        self.fh.flush()
        self.fh.seek(0)
        shutil.copyfileobj(self.fh, out, _CHUNK)

    def close(self) -> None:
        self.fh.close()


class TensorFile:
    """A checkpoint's tensors read one at a time with plain file reads (no memory map: pages of a
    mapped file count as the process's resident memory while it is open, so reading every client
    through one would hold the whole file). The header was validated by :func:`read_header`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = open(path, "rb")  # noqa: SIM115 - closed by close() / the with block
        try:
            (n,) = struct.unpack("<Q", self.fh.read(8))
            table = json.loads(self.fh.read(n))
        except Exception:
            self.fh.close()
            raise
        table.pop("__metadata__", None)
        self.base = 8 + n
        self.table: dict[str, dict[str, Any]] = table

    def keys(self) -> list[str]:
        return list(self.table)

    def get_tensor(self, key: str) -> Tensor:
        e = self.table[key]
        dtype = _TORCH_DTYPES[e["dtype"]]
        shape = [int(d) for d in e["shape"]]
        start, end = (int(x) for x in e["data_offsets"])
        if end == start:
            return torch.empty(shape, dtype=dtype)
        self.fh.seek(self.base + start)
        data = bytearray(end - start)
        if self.fh.readinto(data) != len(data):
            raise CheckpointError(f"{self.path}: truncated tensor {key!r}")
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def close(self) -> None:
        self.fh.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_checkpoint(
    path: Path, meta: dict[str, Any], tensors: Mapping[str, Tensor] | Spool
) -> None:
    """Write-then-rename: the previous checkpoint stays until the new one is verified on disk.
    The temporary is this write's own (``temp_path``): another process's write in progress is
    never touched, and one killed mid-write leaves its temporary to the run folder's lock
    (``runfolder``), which removes a dead writer's temporaries. ``tensors``: a dict, or a
    :class:`Spool` the caller filled (clients streamed; closed here)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(tensors, Spool):
        spool = tensors
    else:
        spool = Spool(path.parent)
        spool.add_all(tensors)
    try:
        meta_json = json.dumps(meta, allow_nan=True, separators=(",", ":"))
        header = {"format": FORMAT, "meta": meta_json, "digest": spool.digest(meta_json)}

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:
                spool.write_file(fh, header)
                fh.flush()
                os.fsync(fh.fileno())
            verify_file(tmp)  # verify before it replaces anything (one tensor at a time)

        replace_all([(write_temp(path, write), path)])
    finally:
        spool.close()
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:  # pragma: no cover - filesystems without directory fsync
        pass


def read_header(path: Path) -> dict[str, str]:
    """The safetensors metadata of ``path``, or a CheckpointError saying why it is not ours."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(
            f"{path}: not a readable checkpoint (corrupt or not a safetensors file: {exc})"
        ) from exc
    if header.get("format") != FORMAT or "meta" not in header:
        raise CheckpointError(f"{path}: a foreign safetensors file, not a fedmosaic checkpoint")
    return header


def check_meta(meta: Any, path: str | Path, full: bool = False) -> dict[str, Any]:
    """The metadata's shape: a dict with this format's version and an int round >= 0; ``full``
    (a run's checkpoint): also an int client count >= 0, a config table and a history whose
    rounds match the round. Else a CheckpointError saying what is wrong."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: corrupt checkpoint metadata (not a table)")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')!r}, this fedmosaic reads {VERSION}"
        )
    for key in ("round", "num_clients") if full else ("round",):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"{path}: corrupt checkpoint metadata ({key} = {v!r})")
    if not full:
        return meta
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{path}: corrupt checkpoint metadata (no config table)")
    hist = meta.get("history")
    if not isinstance(hist, dict) or not isinstance(hist.get("rounds"), list):
        raise CheckpointError(f"{path}: corrupt checkpoint metadata (no history)")
    if len(hist["rounds"]) != meta["round"]:
        raise CheckpointError(
            f"{path}: corrupt checkpoint (round {meta['round']} but a history of "
            f"{len(hist['rounds'])} rounds)"
        )
    return meta


def peek(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata (round, config, ...), shape-checked, without loading tensors."""
    header = read_header(Path(path))
    try:
        meta = json.loads(header["meta"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint metadata ({exc})") from exc
    return check_meta(meta, path)


def _meta_of(path: Path, header: dict[str, str]) -> dict[str, Any]:
    try:
        meta = json.loads(header["meta"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint metadata ({exc})") from exc
    return check_meta(meta, path)


def _check_finite(path: Path, key: str, t: Tensor) -> None:
    # A NaN in the server's state would resume silently into a NaN run (the round loop never
    # keeps a non-finite aggregate, so one there is forged or corrupt). A client's own model may
    # have diverged honestly (its training blew up; the server refuses its uploads and the
    # federation goes on): its state is the run's, saved and resumed as it is.
    if key.startswith("client/"):
        return
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{path}: tensor {key!r} has NaN or infinite values")


def read_checkpoint(path: str | Path) -> Loaded:
    """Load and verify (digest over metadata and every tensor byte): every tensor in memory
    (the resume path reads one client at a time instead: :func:`verify_file`, :class:`Reader`)."""
    path = Path(path)
    header = read_header(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint ({exc})") from exc
    if _digest(header["meta"], tensors) != header.get("digest"):
        raise CheckpointError(f"{path}: corrupt checkpoint (digest mismatch)")
    meta = _meta_of(path, header)
    for key, t in tensors.items():
        _check_finite(path, key, t)
    return Loaded(meta, tensors)


def scan_file(path: str | Path) -> tuple[dict[str, Any], CheckpointError | None]:
    """:func:`read_checkpoint`'s checks holding one tensor at a time: the shape-checked metadata,
    and :func:`check_magnitudes`' error if any (left to the caller: it comes after the config
    check). Errors come in read_checkpoint's order (digest, metadata, then NaN values)."""
    path = Path(path)
    header = read_header(path)
    h = hashlib.sha256(header["meta"].encode())
    nonfinite: CheckpointError | None = None
    too_big: CheckpointError | None = None
    try:
        with TensorFile(path) as fh:
            for key in sorted(fh.keys()):
                t = fh.get_tensor(key)
                h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
                flat = t.reshape(-1).contiguous()
                h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
                if nonfinite is None:
                    try:
                        _check_finite(path, key, t)
                    except CheckpointError as exc:
                        nonfinite = exc
                if too_big is None:
                    try:
                        check_magnitudes(path, {key: t})
                    except CheckpointError as exc:
                        too_big = exc
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint ({exc})") from exc
    if h.hexdigest() != header.get("digest"):
        raise CheckpointError(f"{path}: corrupt checkpoint (digest mismatch)")
    meta = _meta_of(path, header)
    if nonfinite is not None:
        raise nonfinite
    return meta, too_big


def verify_file(path: str | Path) -> dict[str, Any]:
    """:func:`read_checkpoint`'s checks, one tensor in memory at a time; the metadata."""
    return scan_file(path)[0]


class Reader(LazyClientStates):
    """An open checkpoint: its non-client tensors (``tensors``: server state, RNG) in memory and
    each client's ``(model, extras)`` state dicts read from the file when indexed."""

    def __init__(self, fh: TensorFile, num_clients: int) -> None:
        self.fh = fh
        self.n = num_clients
        self.tensors: dict[str, Tensor] = {}
        self.keys: list[list[str]] = [[] for _ in range(num_clients)]
        for k in fh.keys():
            if k.startswith("client/"):
                self.keys[int(k.split("/", 2)[1])].append(k)
            else:
                self.tensors[k] = fh.get_tensor(k)

    def get(self, cid: int) -> ClientState:
        model: dict[str, Tensor] = {}
        extras: dict[str, Tensor] = {}
        for k in self.keys[cid]:
            _, _, part, key = k.split("/", 3)
            (model if part == "model" else extras)[key] = self.fh.get_tensor(k)
        return model, extras


# No trained weight comes near this: a value whose square overflows float32 (1.8e19) turns
# the first loss or norm into inf. A checkpoint holding one is forged or corrupt (its digest
# recomputed): resuming it would append NaN rounds.
MAX_ABS_VALUE = 1e18


def check_magnitudes(path: str | Path, tensors: dict[str, Tensor]) -> None:
    """A CheckpointError naming the first floating tensor with a value beyond MAX_ABS_VALUE."""
    for key, t in tensors.items():
        if t.is_floating_point() and t.numel():
            top = float(t.detach().abs().max())
            if not top <= MAX_ABS_VALUE:
                raise CheckpointError(
                    f"{path}: tensor {key!r} holds {top:.3g}, beyond any trained value "
                    f"(|x| <= {MAX_ABS_VALUE:g}): a forged or corrupt checkpoint"
                )


# ---- the round-loop hook -----------------------------------------------------------------------------
ClientStates = Callable[[], Iterable[ClientState]]
LoadClientStates = Callable[[Sequence[ClientState]], None]


class Checkpointer:
    """Saves every ``every`` rounds (and after the last round); restores on ``resume``.

    ``get_clients`` returns each client's ``(model state_dict, extras state_dict)`` in client
    order (an iterable: the writer copies one client at a time, so a lazy one never holds the
    population); ``set_clients`` loads them back from a sequence read from the file as indexed. Implements ``core.rounds.RoundCheckpoint``.
    """

    def __init__(
        self,
        path: str | Path,
        every: int,
        config: dict[str, Any],
        get_clients: ClientStates,
        set_clients: LoadClientStates,
        resume: bool = False,
        last_round: int | None = None,
        keep_final: bool = False,
        extend: bool = False,
    ) -> None:
        self.path = Path(path)
        self.every = int(every)
        # keep_final: also save after the last round (the trained models are kept);
        # extend: the checkpoint may come from a run with fewer rounds (train.rounds may differ)
        self.keep_final = keep_final
        self.extend = extend
        self.config = config
        self.get_clients = get_clients
        self.set_clients = set_clients
        self.resume = resume
        self.last_round = last_round if last_round is not None else config["train"]["rounds"]
        self.restored_round = 0
        if self.every < 0:
            raise CheckpointError(f"checkpoint interval {every} must be >= 0")

    # -- restore --
    def restore(self, template: Any) -> tuple[int, Any, History, list[EvalResult]] | None:
        if not self.resume:
            return None
        if not self.path.exists():
            log.warning("no checkpoint at %s: starting from round 1", self.path)
            return None
        meta = self.verify()
        try:
            with TensorFile(self.path) as fh:
                reader = Reader(fh, meta["num_clients"])
                tensors = reader.tensors
                state = restore_tree(meta["server_state"], tensors, template)
                self.set_clients(reader)  # one client read at a time, as the transport indexes
            history = history_from_json(meta["history"])
            last_eval = _from_evals(meta["last_eval"])
            restore_rng(meta["rng"], tensors)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from exc
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"{self.path}: checkpoint does not fit this run: {exc}") from exc
        self.restored_round = int(meta["round"])
        log.info("resumed from %s after round %d", self.path, self.restored_round)
        return self.restored_round, state, history, last_eval

    def verify(self) -> dict[str, Any]:
        """Read and check the checkpoint against this run (digest, shape, config, round and
        client count) without changing anything: callers check before they touch ``--out``.
        One tensor in memory at a time; the checked metadata."""
        meta, too_big = scan_file(self.path)
        meta = check_meta(meta, self.path, full=True)
        self._check_config(meta)
        if too_big is not None:
            raise too_big
        if meta["round"] > self.last_round:
            raise CheckpointError(
                f"{self.path}: checkpoint after round {meta['round']}, but this run has "
                f"{self.last_round} rounds"
            )
        want = self.config.get("data", {}).get("num_clients")
        if want is not None and meta["num_clients"] != want:
            raise CheckpointError(
                f"{self.path}: checkpoint of {meta['num_clients']} clients, this run has {want}"
            )
        return meta

    def _check_config(self, meta: dict[str, Any]) -> None:
        mine = config_fingerprint(self.config)
        theirs = config_fingerprint(meta.get("config", {}))
        if self.extend:  # extending a finished run: only the number of rounds may differ
            for cfg in (mine, theirs):
                cfg.get("train", {}).pop("rounds", None)
        if mine == theirs:
            return
        diffs = []
        for section in sorted(set(mine) | set(theirs)):
            a, b = mine.get(section), theirs.get(section)
            if isinstance(a, dict) and isinstance(b, dict):
                for k in sorted(set(a) | set(b)):
                    if a.get(k) != b.get(k):
                        diffs.append(f"{section}.{k}: checkpoint {b.get(k)!r}, now {a.get(k)!r}")
            elif a != b:
                diffs.append(f"{section}: checkpoint {b!r}, now {a!r}")
        raise CheckpointError(
            f"{self.path} belongs to a different configuration ({'; '.join(diffs[:6])})"
        )

    # -- save --
    def due(self, round_num: int) -> bool:
        if round_num == self.last_round and self.keep_final:
            return True
        if self.every <= 0:
            return False
        return round_num % self.every == 0 or round_num == self.last_round

    def after_round(
        self, round_num: int, state: Any, history: History, last_eval: list[EvalResult]
    ) -> None:
        if not self.due(round_num):
            return
        self.save(round_num, state, history, last_eval)
        if os.environ.get(KILL_ENV) == str(round_num):
            os.kill(os.getpid(), signal.SIGKILL)

    def save(
        self, round_num: int, state: Any, history: History, last_eval: list[EvalResult]
    ) -> None:
        tensors: dict[str, Tensor] = {}
        tree = flatten_tree(state, tensors, "server")
        rng = capture_rng(tensors)
        spool = Spool(self.path.parent)
        try:
            spool.add_all(tensors)
            num_clients = 0
            for cid, (model, extras) in enumerate(self.get_clients()):
                # copied into the spool, then dropped: one client's tensors in memory at a time
                for k, v in model.items():
                    spool.add(f"client/{cid}/model/{k}", v)
                for k, v in extras.items():
                    spool.add(f"client/{cid}/extras/{k}", v)
                num_clients = cid + 1
        except BaseException:
            spool.close()
            raise
        meta = {
            "version": VERSION,
            "library": fedmosaic.__version__,
            "round": round_num,
            "config": self.config,
            "config_hash": config_hash(self.config),
            "num_clients": num_clients,
            "server_state": tree,
            "history": history_to_json(history),
            "last_eval": _evals(last_eval),
            "rng": rng,
        }
        write_checkpoint(self.path, meta, spool)


@dataclass(frozen=True)
class CheckpointPolicy:
    """A run's checkpointing, decided once by its caller (the run folder, a test): the folder
    that holds ``checkpoint.safetensors``; a save every ``every`` rounds and after the last (0:
    only when the run is interrupted); continuing from that file when it exists (``resume``)
    or past a finished run's last round, its config differing only in ``train.rounds``
    (``extend``, which resumes); keeping the state after the last round (``keep_final``)."""

    folder: Path
    every: int = 0
    resume: bool = False
    keep_final: bool = False
    extend: bool = False

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint every = {self.every} rounds must be >= 0")


def for_federation(fed: Federation, transport: Transport, policy: CheckpointPolicy) -> Checkpointer:
    """The round loop's checkpoint hook under ``policy``: the transport reads and loads the
    clients wherever it keeps them (a transport whose clients are out of reach raises
    ``ClientStatesUnavailable`` at the first save or restore)."""
    return Checkpointer(
        Path(policy.folder) / FILENAME,
        policy.every,
        fed.cfg.to_dict(),
        transport.client_states,
        transport.load_client_states,
        resume=policy.resume or policy.extend,
        last_round=fed.plan.rounds,
        keep_final=policy.keep_final,
        extend=policy.extend,
    )


def for_models(
    path: str | Path,
    config: dict[str, Any],
    models: Sequence[nn.Module],
    extras: Sequence[nn.Module],
) -> Checkpointer:
    """A reader of the checkpoint file ``path`` (checked against ``config``) into client modules
    built in this process (``api.load_run``: no transport, no run)."""

    def get_clients() -> Iterator[tuple[dict, dict]]:
        return ((m.state_dict(), e.state_dict()) for m, e in zip(models, extras))

    def set_clients(states: Sequence[tuple[dict, dict]]) -> None:
        if len(states) != len(models):
            raise ValueError(f"checkpoint has {len(states)} clients, this run {len(models)}")
        for cid, (m, e) in enumerate(zip(models, extras)):
            try:
                m.load_state_dict(states[cid][0], strict=True)
                e.load_state_dict(states[cid][1], strict=True)
            except RuntimeError as exc:
                raise ValueError(f"client {cid}: {exc}") from exc

    return Checkpointer(path, 0, config, get_clients, set_clients, resume=True)
