"""Image datasets as one pooled uint8 tensor: readers for IDX, CIFAR pickles and Tiny-ImageNet.

Every loader returns an :class:`ImageDataset` whose rows are the official train split followed by
the official test split (federated benchmarks pool both and re-split per client). Loaders are
registered in :data:`fedmosaic.core.registry.DATASETS` as ``(cfg: DataConfig, seed) -> ImageDataset``.

Where files are looked for, in order: ``data.root`` (the folder itself, then the dataset's usual
subfolder names), ``$FEDMOSAIC_DATA`` (same), system locations (Debian's
``dataset-fashion-mnist`` package), then the download cache (``$FEDMOSAIC_CACHE`` or
``~/.cache/fedmosaic``), which is filled only when ``data.download = true``.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import struct
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from fedmosaic import memory
from fedmosaic.config import CHUNK_PIXELS, STATS_DIRECT_PIXELS, DataConfig
from fedmosaic.core.checks import did_you_mean
from fedmosaic.core.errors import DatasetError
from fedmosaic.core.registry import DATASETS
from fedmosaic.data import _download


@dataclass
class ImageDataset:
    """A whole dataset held once in memory; rows are addressed by int64 indices."""

    name: str
    images: torch.Tensor  # uint8 [N, C, H, W]: official train rows first, then test rows, pooled
    labels: torch.Tensor  # int64 [N], values in [0, num_classes)
    num_classes: int
    mean: tuple[float, ...]  # per-channel dataset mean, in [0, 1] units
    std: tuple[float, ...]  # per-channel dataset std, in [0, 1] units
    num_train: int  # how many leading rows came from the official train split
    sources: tuple[str, ...] = ()  # the files it was read from (provenance); () if in-memory

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise DatasetError(
                f"{self.name}: images must be uint8 [N, C, H, W], got {self.images.dtype} "
                f"{tuple(self.images.shape)}"
            )
        if self.labels.shape != (self.images.shape[0],):
            raise DatasetError(
                f"{self.name}: {self.images.shape[0]} images but labels of shape "
                f"{tuple(self.labels.shape)}"
            )
        if len(self.mean) != self.images.shape[1] or len(self.std) != self.images.shape[1]:
            raise DatasetError(f"{self.name}: mean/std need one value per channel")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)


# Published per-channel statistics (pixels scaled to [0, 1]), computed on the train splits.
STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "emnist-letters": ((0.1722,), (0.3309,)),
    "emnist-balanced": ((0.1751,), (0.3332,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)),
}

# Patched by tests so a machine's installed datasets do not leak into "missing file" checks.
SYSTEM_DIRS: dict[str, list[Path]] = {
    "fmnist": [Path("/usr/share/datasets/fashion-mnist")],
}

# Usual folder names under a data root (ours, the archives' own, torchvision's raw layout).
SUBDIRS: dict[str, list[str]] = {
    "fmnist": ["fashion-mnist", "fmnist", "FashionMNIST/raw"],
    "mnist": ["mnist", "MNIST/raw"],
    "emnist": ["emnist", "gzip", "EMNIST/raw"],
    "cifar10": ["cifar-10-batches-py"],
    "cifar100": ["cifar-100-python"],
    "tinyimagenet": ["tiny-imagenet-200"],
}

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


# ----------------------------------------------------------------------------- locating files


def cache_dir() -> Path:
    """Where opt-in downloads go: ``$FEDMOSAIC_CACHE`` or ``~/.cache/fedmosaic``."""
    env = os.environ.get("FEDMOSAIC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedmosaic"


def search_dirs(name: str, cfg: DataConfig) -> list[Path]:
    """Candidate folders for dataset ``name``, in search order.

    An explicit ``data.root`` is the only place searched: a root that lacks a file is an error,
    never a silent fall-back to another copy of the dataset.
    """
    bases: list[Path] = []
    if cfg.root:
        base = Path(cfg.root).expanduser()
        return list(dict.fromkeys([base, *(base / sub for sub in SUBDIRS.get(name, []))]))
    env = os.environ.get("FEDMOSAIC_DATA")
    if env:
        bases.append(Path(env).expanduser())
    dirs: list[Path] = []
    for base in bases:
        dirs.append(base)
        dirs.extend(base / sub for sub in SUBDIRS.get(name, []))
    dirs.extend(SYSTEM_DIRS.get(name, []))
    cache = cache_dir() / name
    dirs.append(cache)
    dirs.extend(cache / sub for sub in SUBDIRS.get(name, []))
    return list(dict.fromkeys(dirs))  # drop duplicates, keep order


def _idx_file(folder: Path, stem: str) -> Path | None:
    """``folder/stem`` or ``folder/stem.gz``, whichever exists (plain first)."""
    for p in (folder / stem, folder / f"{stem}.gz"):
        if p.is_file():
            return p
    return None


def _find(
    name: str, cfg: DataConfig, resolve: Callable[[Path], list[Path] | None]
) -> list[Path] | None:
    """The dataset's files in the first searched folder that has all of them, or None."""
    for d in search_dirs(name, cfg):
        if d.is_dir():
            found = resolve(d)
            if found is not None:
                return found
    return None


def _locate(
    name: str,
    cfg: DataConfig,
    resolve: Callable[[Path], list[Path] | None],
    download: Callable[[Path], None],
    expected: str,
    apt_hint: str = "",
) -> list[Path]:
    """Resolve a dataset's files in the first folder that has all of them.

    ``resolve(folder)`` returns the dataset's file paths in that folder, or None if incomplete.
    ``download(dest)`` fetches the dataset into ``dest`` (used only when ``cfg.download``).
    """
    found = _find(name, cfg, resolve)
    if found is not None:
        return found
    dirs = search_dirs(name, cfg)
    if cfg.download:
        dest = cache_dir() / name
        dest.mkdir(parents=True, exist_ok=True)
        download(dest)
        for d in [dest, *(dest / s for s in SUBDIRS.get(name, []))]:
            found = resolve(d) if d.is_dir() else None
            if found is not None:
                return found
        raise DatasetError(f"{name}: download to {dest} finished but the expected files are absent")
    # Flag folders that exist but miss files: usually a typo'd root or a partial copy.
    searched = "\n  ".join(
        f"{d}  (exists, without all the files)" if d.is_dir() else str(d) for d in dirs
    )
    fixes = [
        "set data.root (or --set data.root=PATH) to a folder holding the files",
        "set the environment variable FEDMOSAIC_DATA to such a folder",
        "set data.download = true to fetch it into the cache (needs internet)",
    ]
    if apt_hint:
        fixes.insert(0, apt_hint)
    raise DatasetError(
        f"{name}: dataset files not found (expected {expected}). Searched:\n  {searched}\n"
        "To fix, either:\n  - " + "\n  - ".join(fixes)
    )


def _sources(paths: Sequence[Path]) -> tuple[str, ...]:
    return tuple(str(p.resolve()) for p in paths)


def _stamp(paths: Sequence[Path]) -> tuple[tuple[str, int, int], ...]:
    """Cache key: resolved path, size and mtime (a rewritten file is read again)."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(out)


# ----------------------------------------------------------------------------- IDX


def _read_bytes(
    path: Path, stated: Callable[[bytes], int | None] | None = None
) -> bytes | bytearray:
    """File contents, gunzipped if the name ends in .gz or the data starts with the gzip magic
    (``stated``: the size the first decompressed bytes declare, see :func:`_gunzip_bounded`).
    A file larger than ``MAX_DECOMPRESSED`` is refused unread: no dataset file is that large."""
    try:
        size = path.stat().st_size
        if size > MAX_DECOMPRESSED:
            raise DatasetError(
                f"{path}: {size} bytes, more than the {MAX_DECOMPRESSED} bytes any dataset file "
                "decompresses to; not a dataset file"
            )
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read file: {exc}") from exc
    if path.suffix == ".gz" or raw[:2] == b"\x1f\x8b":
        return _gunzip_bounded(path, raw, stated=stated)
    return raw


# No dataset file here decompresses to 1 GiB (the largest, EMNIST letters' training images, is
# 98 MB; EMNIST byclass, not offered, would be 0.55 GB); read at call time (tests lower it).
MAX_DECOMPRESSED = 2**30
_GZ_IN = 1 << 20  # compressed bytes fed at a time: zlib copies the unconsumed input per call
_GZ_OUT = 1 << 24  # decompressed bytes asked for at a time
_GZ_HEAD = 4096  # decompressed bytes asked for until the header has stated its size
# Deflate's largest expansion: 258 bytes from a 2-bit code, ~1032:1; a gzip member adds 18
# bytes of framing. A header stating more than the compressed file can expand to is a lie.
_DEFLATE_RATIO = 1032


def _check_stated(path: Path, size: int, compressed: int, limit: int) -> None:
    """The size an output's header states, refused before it is decompressed: above ``limit``,
    above what ``compressed`` bytes of deflate can expand to, or above the available memory."""
    if size > limit:
        raise DatasetError(
            f"{path}: its header states {size} bytes; no dataset file decompresses to more than "
            f"{limit} bytes; not a dataset file"
        )
    if size > _DEFLATE_RATIO * compressed + _GZ_HEAD:
        raise DatasetError(
            f"{path}: its header states {size} bytes, more than {compressed} bytes of gzip can "
            "hold; the file is truncated or not a dataset file"
        )
    free = memory.available_bytes() if memory.check_enabled() else None
    if free is not None and size > free:
        raise DatasetError(
            f"{path}: its header states {size} bytes ({memory.size_text(size)}) and "
            f"{memory.size_text(free)} of memory is available; not read"
        )


def _gunzip_bounded(
    path: Path,
    raw: bytes,
    limit: int | None = None,
    stated: Callable[[bytes], int | None] | None = None,
) -> bytearray:
    """gunzip in chunks, never holding more than ``limit`` + 1 output bytes (default
    ``MAX_DECOMPRESSED``, read at call time): a gzip bomb stops there, before it is in memory.

    ``stated(head)``: the total size the output's first bytes declare (an IDX header), or None
    while they are too few. The first few kB are decompressed alone, so the header is read
    before anything large: a stated size above ``limit``, above what the compressed bytes can
    expand to, or above the available memory is refused there (:func:`_check_stated`), and
    output beyond the stated size is refused as soon as it appears."""
    limit = MAX_DECOMPRESSED if limit is None else limit
    cap, declared = limit, stated is None
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = bytearray()
    pos, pending = 0, b""
    try:
        while True:
            if not pending and pos < len(raw):
                pending, pos = raw[pos : pos + _GZ_IN], pos + _GZ_IN
            # cap + 1: one byte past the cap tells a file that is too long from one that fits
            ask = _GZ_OUT if declared else _GZ_HEAD
            chunk = d.decompress(pending, min(ask, cap + 1 - len(out)))
            pending = d.unconsumed_tail
            out += chunk
            if stated is not None and not declared:
                size = stated(bytes(out[:_GZ_HEAD]))
                if size is not None:
                    _check_stated(path, size, len(raw), limit)
                    cap, declared = size, True
                elif len(out) >= _GZ_HEAD:
                    declared = True  # no header in the first kB: the limit alone bounds it
            if len(out) > cap:
                if cap < limit:
                    raise DatasetError(
                        f"{path}: decompresses to more than the {cap} bytes its header states; "
                        "not a dataset file"
                    )
                raise DatasetError(
                    f"{path}: decompresses to more than {limit} bytes; not a dataset file"
                )
            if d.eof:
                rest = d.unused_data + pending
                if not rest and pos >= len(raw):
                    break
                # a multi-member gzip: the next member (trailing junk fails as corrupt)
                d, pending = zlib.decompressobj(16 + zlib.MAX_WBITS), rest
            elif not chunk and not pending and pos >= len(raw):
                raise zlib.error("incomplete gzip stream")
    except (zlib.error, EOFError) as exc:
        raise DatasetError(f"{path}: corrupt gzip file ({exc}); delete it and re-fetch") from exc
    return out  # a bytearray: numpy reads it in place, writable (no copy of a large file)


def _idx_header(path: Path, raw: bytes, ndim: int | None) -> tuple[int, tuple[int, ...]] | None:
    """An IDX file's header length and dimensions from its first bytes; None while they are too
    few to hold it; a DatasetError naming ``path`` for a header that is not IDX."""
    if len(raw) < 4:
        return None
    magic = raw[:4].hex()
    if raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path}: not an IDX file (magic number 0x{magic}, expected 0x0000....)")
    if raw[2] != 0x08:
        raise DatasetError(
            f"{path}: IDX data type 0x{raw[2]:02x} is not supported (magic 0x{magic}); "
            "expected 0x08 (unsigned byte)"
        )
    nd = raw[3]
    if nd == 0 or (ndim is not None and nd != ndim):
        want = ndim if ndim is not None else ">= 1"
        raise DatasetError(
            f"{path}: IDX file has {nd} dimensions (magic 0x{magic}), expected {want}"
        )
    header = 4 + 4 * nd
    if len(raw) < header:
        return None
    return header, struct.unpack(f">{nd}I", raw[4:header])


def read_idx(path: str | Path, ndim: int | None = None) -> np.ndarray:
    """Read an IDX file (``*-idx3-ubyte``, ``*-idx1-ubyte``, optionally gzipped) as uint8.

    Header: magic ``00 00 <dtype> <ndim>`` then ``ndim`` big-endian uint32 sizes, then the data.
    Only dtype 0x08 (unsigned byte) is accepted; ``ndim`` (if given) must match.
    """
    path = Path(path)

    def stated(head: bytes) -> int | None:
        found = _idx_header(path, head, ndim)
        return None if found is None else found[0] + math.prod(found[1])

    raw = _read_bytes(path, stated)
    if len(raw) < 4:
        raise DatasetError(f"{path}: truncated IDX file: {len(raw)} bytes, no 4-byte magic number")
    found = _idx_header(path, raw, ndim)
    if found is None:
        header = 4 + 4 * raw[3]
        raise DatasetError(
            f"{path}: truncated IDX file: expected at least {header} header bytes, found {len(raw)}"
        )
    header, dims = found
    expected = header + math.prod(dims)
    if len(raw) != expected:
        what = "truncated IDX file" if len(raw) < expected else "IDX file has trailing bytes"
        raise DatasetError(
            f"{path}: {what}: expected {expected} bytes for shape {tuple(dims)}, found {len(raw)}"
        )
    array = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
    # Over bytes it is read-only and torch wants writable memory: a copy. A decompressed file
    # is a bytearray, writable: used in place.
    return array if isinstance(raw, bytearray) else array.copy()


def _read_idx_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, H, W]`` and labels ``[N]`` from matching IDX files."""
    images = read_idx(images_path, ndim=3)
    labels = read_idx(labels_path, ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds "
            f"{labels.shape[0]} labels; the files do not belong together"
        )
    return images, labels


@functools.lru_cache(maxsize=4)
def _load_idx_dataset(
    stamp: tuple[tuple[str, int, int], ...], transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Decode train+test IDX files once per process; returns images [N,1,H,W], labels, num_train."""
    paths = [Path(s[0]) for s in stamp]
    xtr, ytr = _read_idx_pair(paths[0], paths[1])
    xte, yte = _read_idx_pair(paths[2], paths[3])
    if xtr.shape[1:] != xte.shape[1:]:
        raise DatasetError(
            f"{paths[0]} has images of size {xtr.shape[1:]} but {paths[2]} has {xte.shape[1:]}"
        )
    x = np.concatenate([xtr, xte])
    if transpose:  # EMNIST stores each image transposed (column-major); make it upright.
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
    y = np.concatenate([ytr, yte]).astype(np.int64)
    return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y), len(ytr)


def _check_labels(name: str, labels: torch.Tensor, num_classes: int, where: object) -> None:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise DatasetError(
            f"{where}: {name} labels span [{int(labels.min())}, {int(labels.max())}], "
            f"expected [0, {num_classes - 1}]"
        )


def _idx_files(d: Path, stems: Sequence[str]) -> list[Path] | None:
    """Every ``stem`` (plain or .gz) in ``d``, or None when one is missing."""
    found = [_idx_file(d, stem) for stem in stems]
    return None if any(p is None for p in found) else [p for p in found if p is not None]


def _mnist_like(name: str, cfg: DataConfig, apt_hint: str = "") -> ImageDataset:
    def resolve(d: Path) -> list[Path] | None:
        return _idx_files(d, MNIST_FILES)

    def download(dest: Path) -> None:
        _download.fetch_mnist_like(name, dest, MNIST_FILES)

    paths = _locate(name, cfg, resolve, download, "{" + ", ".join(MNIST_FILES) + "}[.gz]", apt_hint)
    images, labels, num_train = _load_idx_dataset(_stamp(paths), False)
    _check_labels(name, labels, 10, f"{paths[1]} / {paths[3]}")
    mean, std = STATS[name]
    return ImageDataset(name, images, labels, 10, mean, std, num_train, _sources(paths))


@DATASETS.register("fmnist")
def load_fmnist(cfg: DataConfig, seed: int) -> ImageDataset:
    """Fashion-MNIST: 60000 + 10000 grayscale 28x28 images, 10 classes."""
    hint = "install the Debian package: sudo apt-get install dataset-fashion-mnist"
    return _mnist_like("fmnist", cfg, hint)


@DATASETS.register("mnist")
def load_mnist(cfg: DataConfig, seed: int) -> ImageDataset:
    """MNIST: 60000 + 10000 grayscale 28x28 digits, 10 classes."""
    return _mnist_like("mnist", cfg)


EMNIST_CLASSES = {"letters": 26, "balanced": 47}


def _emnist_stems(split: str) -> list[str]:
    return [
        f"emnist-{split}-{part}-{kind}-ubyte"
        for part in ("train", "test")
        for kind in ("images-idx3", "labels-idx1")
    ]


@DATASETS.register("emnist")
def load_emnist(cfg: DataConfig, seed: int) -> ImageDataset:
    """EMNIST ``letters`` (26 classes, labels 1..26 shifted to 0..25) or ``balanced`` (47)."""
    split = cfg.emnist_split
    if split not in EMNIST_CLASSES:
        raise DatasetError(f"data.emnist_split = {split!r}; choose one of letters, balanced")
    stems = _emnist_stems(split)

    def resolve(d: Path) -> list[Path] | None:
        return _idx_files(d, stems)

    def download(dest: Path) -> None:
        _download.fetch_emnist(dest, [f"{s}.gz" for s in stems])

    paths = _locate("emnist", cfg, resolve, download, f"emnist-{split}-*-ubyte[.gz]")
    images, labels, num_train = _load_idx_dataset(_stamp(paths), True)
    if split == "letters":
        labels = labels - 1  # letters are labelled 1..26 in the files
    num_classes = EMNIST_CLASSES[split]
    _check_labels(f"emnist-{split}", labels, num_classes, f"{paths[1]} / {paths[3]}")
    mean, std = STATS[f"emnist-{split}"]
    return ImageDataset(
        f"emnist-{split}", images, labels, num_classes, mean, std, num_train, _sources(paths)
    )


# ----------------------------------------------------------------------------- CIFAR pickles


def _latin1_encode(obj: str, encoding: str = "utf-8") -> bytes:
    # Python 3 protocol-2 pickles store bytes as _codecs.encode(str, "latin1"); allow only that.
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return obj.encode("latin1")


def _safe_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR pickle may reference: numpy array reconstruction, plain types."""
    try:  # numpy >= 2 moved numpy.core to numpy._core; pickles may name either
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy 1.26
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]

    allowed: dict[tuple[str, str], Any] = {}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = multiarray._reconstruct
        allowed[(mod, "scalar")] = multiarray.scalar
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        # private numpy function (what array pickles name), absent from numpy's stubs
        allowed[(mod, "_frombuffer")] = numeric._frombuffer  # type: ignore[attr-defined]
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    allowed[("_codecs", "encode")] = _latin1_encode
    # Not bytes/bytearray: ``bytearray(2**31)`` from a 39-byte file allocates 2 GB (the CIFAR
    # pickles carry their bytes as opcodes, never through these constructors).
    for t in (list, dict, tuple, set, frozenset, str, int, float, bool):
        allowed[("builtins", t.__name__)] = t
        allowed[("__builtin__", t.__name__)] = t  # Python 2 pickles (the CIFAR originals)
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Refuses every global outside :func:`_safe_globals` (no code runs while loading)."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _RestrictedUnpickler._allowed is None:
            _RestrictedUnpickler._allowed = _safe_globals()
        try:
            return _RestrictedUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}") from None


MAX_PICKLE_DEPTH = 32  # CIFAR batches: a dict of arrays and flat lists (depth 2-3)
MAX_PICKLE_OPS = 5_000_000  # CIFAR-100's train file: ~0.3 M opcodes


def _check_pickle_shape(path: Path, raw: bytes) -> None:
    """Refuse deeply nested or huge opcode streams before unpickling (a 200 KB file of nested
    containers can exhaust the C stack when it is built or freed)."""
    import pickletools

    # Opcodes that wrap the top of the stack into a new container without a MARK.
    wrap = {"TUPLE1", "TUPLE2", "TUPLE3"}
    closes = {"LIST", "TUPLE", "DICT", "FROZENSET", "OBJ", "INST", "POP_MARK"}
    depth = nest = ops = 0
    try:
        for op, _, _ in pickletools.genops(raw):
            ops += 1
            if op.name == "MARK":
                depth += 1
            elif op.name in closes or op.name in ("APPENDS", "SETITEMS", "ADDITEMS"):
                depth = max(depth - 1, 0)
            nest = nest + 1 if op.name in wrap else 0
            if depth > MAX_PICKLE_DEPTH or nest > MAX_PICKLE_DEPTH or ops > MAX_PICKLE_OPS:
                raise DatasetError(
                    f"{path}: pickle nested deeper than {MAX_PICKLE_DEPTH} levels or longer than "
                    f"{MAX_PICKLE_OPS} opcodes; not a dataset file"
                )
    except (ValueError, IndexError) as exc:
        raise DatasetError(f"{path}: corrupt or unsupported pickle ({exc}); re-fetch it") from exc


# What a CIFAR file can hold: at most 50,000 images (CIFAR-100's train file), each 3072 bytes of
# one uint8 array and, in lists, a label, a coarse label and a file name. A pickle reaching more
# (shared references counted as often as they are reached, as np.asarray would materialize them)
# is refused: 20 references of a list to one list, 10 levels deep, is 235 bytes and 10^10 leaves.
CIFAR_MAX_IMAGES = 50_000
MAX_PICKLE_OBJECTS = 20 * 3 * CIFAR_MAX_IMAGES  # Python objects reached through containers
MAX_PICKLE_ELEMENTS = 2 * CIFAR_MAX_IMAGES * 3 * 32 * 32  # array elements reached


_PICKLE_LEAVES = frozenset({int, float, bool, str, bytes, type(None)})


def _pickle_children(x: Any) -> list[Any] | None:
    """What ``x`` holds, if it is a container (an object array is one); None for a leaf."""
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    if isinstance(x, np.ndarray) and x.dtype.hasobject:
        return list(x.ravel())
    return None


def _pickle_weight(x: Any) -> tuple[int, int]:
    """(objects, array elements) of ``x`` itself, without what it holds."""
    if isinstance(x, np.ndarray) and not x.dtype.hasobject:
        return 1, int(x.size)
    return 1, 0


def _check_pickle_size(path: Path, obj: Any) -> None:
    """Refuse an unpickled object that reaches more than ``MAX_PICKLE_OBJECTS`` objects or
    ``MAX_PICKLE_ELEMENTS`` array elements, counting every reference to a shared container
    (memoized by id, so each distinct object is walked once: the file's size bounds the walk),
    or that contains itself. Iterative: memo references can nest deeper than the C stack."""
    kids = _pickle_children(obj)
    if kids is None:
        return
    done: dict[int, tuple[int, int]] = {}  # id -> (objects, array elements) it reaches
    active = {id(obj)}  # on the walk's path: reached again = a cycle
    keep = [obj]  # pins walked objects so no id() is reused while the walk runs
    # frames: [container, its children, next child, objects, elements]
    stack: list[list[Any]] = [[obj, kids, 0, *_pickle_weight(obj)]]
    while stack:
        frame = stack[-1]
        x, kids, i = frame[0], cast("list[Any]", frame[1]), frame[2]  # frames hold containers
        child = None
        while i < len(kids):
            kid, i = kids[i], i + 1
            if type(kid) in _PICKLE_LEAVES:
                frame[3] += 1
                continue
            if id(kid) in done:
                o, e = done[id(kid)]
            elif (sub := _pickle_children(kid)) is None:
                o, e = _pickle_weight(kid)
            elif id(kid) in active:
                raise DatasetError(f"{path}: pickle contains itself; not a dataset file")
            else:
                child = [kid, sub, 0, *_pickle_weight(kid)]
                break
            frame[3], frame[4] = frame[3] + o, frame[4] + e
        frame[2] = i
        if child is not None:
            active.add(id(child[0]))
            keep.append(child[0])
            stack.append(child)
            continue
        objects, elements = frame[3], frame[4]
        if objects > MAX_PICKLE_OBJECTS or elements > MAX_PICKLE_ELEMENTS:
            raise DatasetError(
                f"{path}: pickle reaches more than {MAX_PICKLE_OBJECTS} objects or "
                f"{MAX_PICKLE_ELEMENTS} array elements (shared references counted); not a "
                "dataset file"
            )
        done[id(x)] = (objects, elements)
        active.discard(id(x))
        stack.pop()
        if stack:
            stack[-1][3] += objects
            stack[-1][4] += elements


def load_pickle(path: Path) -> Any:
    """Unpickle a dataset file with the restricted unpickler; any failure names the file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read file: {exc}") from exc
    _check_pickle_shape(path, raw)
    try:
        # encoding="bytes": the original CIFAR files are Python 2 pickles with byte-string keys.
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means a corrupt or foreign file
        raise DatasetError(
            f"{path}: corrupt or unsupported pickle ({type(exc).__name__}: {exc}); re-fetch it"
        ) from exc
    # The objects unpickled are bounded by the file's size; what they reach through shared
    # references is not, and np.asarray would build all of it.
    _check_pickle_size(path, obj)
    return obj


def _cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch file: images [N, 3, 32, 32] uint8 and labels [N] int64."""
    d = load_pickle(path)
    if not isinstance(d, dict):
        raise DatasetError(f"{path}: expected a pickled dict, found {type(d).__name__}")

    def get(key: str) -> Any:
        for k in (key.encode(), key):
            if k in d:
                return d[k]
        raise DatasetError(f"{path}: no {key!r} entry (keys: {sorted(map(str, d))})")

    try:
        data, labels = np.asarray(get("data")), np.asarray(get(label_key), dtype=np.int64)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged, nested or non-numeric
        raise DatasetError(f"{path}: 'data'/{label_key!r} are not arrays ({exc})") from exc
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DatasetError(
            f"{path}: 'data' must be uint8 [N, 3072], found {data.dtype} {list(data.shape)}"
        )
    if labels.shape != (data.shape[0],):
        raise DatasetError(f"{path}: {data.shape[0]} images but {labels.size} labels")
    # Each row is 1024 red, then green, then blue values, each a row-major 32x32 plane.
    return data.reshape(-1, 3, 32, 32), labels


@functools.lru_cache(maxsize=2)
def _load_cifar(
    stamp: tuple[tuple[str, int, int], ...], label_key: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Decode CIFAR batches once per process; the last file is the test batch."""
    parts = [_cifar_batch(Path(s[0]), label_key) for s in stamp]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    num_train = len(y) - len(parts[-1][1])
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y), num_train


def _cifar_stems(name: str) -> list[str]:
    if name == "cifar10":
        return [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
    return ["train", "test"]


def _cifar_resolve(d: Path, stems: Sequence[str]) -> list[Path] | None:
    found = [d / s for s in stems]
    return found if all(p.is_file() for p in found) else None


def _cifar(name: str, cfg: DataConfig) -> ImageDataset:
    stems = _cifar_stems(name)
    label_key, num_classes = ("labels", 10) if name == "cifar10" else ("fine_labels", 100)

    def resolve(d: Path) -> list[Path] | None:
        return _cifar_resolve(d, stems)

    def download(dest: Path) -> None:
        _download.fetch_cifar(name, dest)

    paths = _locate(name, cfg, resolve, download, ", ".join(stems))
    images, labels, num_train = _load_cifar(_stamp(paths), label_key)
    _check_labels(name, labels, num_classes, paths[0].parent)
    mean, std = STATS[name]
    return ImageDataset(name, images, labels, num_classes, mean, std, num_train, _sources(paths))


@DATASETS.register("cifar10")
def load_cifar10(cfg: DataConfig, seed: int) -> ImageDataset:
    """CIFAR-10 (python pickles): 50000 + 10000 RGB 32x32 images, 10 classes."""
    return _cifar("cifar10", cfg)


@DATASETS.register("cifar100")
def load_cifar100(cfg: DataConfig, seed: int) -> ImageDataset:
    """CIFAR-100 (python pickles): 50000 + 10000 RGB 32x32 images, 100 fine classes."""
    return _cifar("cifar100", cfg)


# ----------------------------------------------------------------------------- Tiny-ImageNet

TINY_SIZE = 64


def _decode_jpeg(path: Path) -> np.ndarray:
    """One Tiny-ImageNet JPEG as uint8 [3, 64, 64] (grayscale files are converted to RGB)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))  # [H, W, 3]
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"{path}: cannot decode image ({exc})") from exc
    if arr.shape != (TINY_SIZE, TINY_SIZE, 3):
        raise DatasetError(f"{path}: image is {arr.shape[1]}x{arr.shape[0]}, expected 64x64")
    return arr.transpose(2, 0, 1)


def _is_jpeg(p: Path) -> bool:
    return p.suffix.lower() in (".jpeg", ".jpg")


def _tiny_listing(root: Path) -> tuple[list[str], list[Path], list[int], int]:
    """Class ids (sorted wnids), image paths (train then val), labels, and num_train."""
    wnids_path = root / "wnids.txt"
    try:
        wnids = sorted({w.strip() for w in wnids_path.read_text().split() if w.strip()})
    except OSError as exc:
        raise DatasetError(f"{wnids_path}: cannot read file: {exc}") from exc
    if not wnids:
        raise DatasetError(f"{wnids_path}: lists no class ids")
    cls = {w: i for i, w in enumerate(wnids)}
    paths: list[Path] = []
    labels: list[int] = []
    for w in wnids:
        folder = root / "train" / w / "images"
        files = sorted(p for p in folder.glob("*") if _is_jpeg(p)) if folder.is_dir() else []
        if not files:
            raise DatasetError(f"{folder}: no JPEG images for class {w} (listed in {wnids_path})")
        paths += files
        labels += [cls[w]] * len(files)
    num_train = len(paths)
    ann = root / "val" / "val_annotations.txt"
    try:
        lines = ann.read_text().splitlines()
    except OSError as exc:
        raise DatasetError(f"{ann}: cannot read file: {exc}") from exc
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in cls:
            raise DatasetError(f"{ann}:{lineno}: expected '<file>\\t<wnid>...', got {line!r}")
        rows.append((fields[0], cls[fields[1]]))
    images_dir = (root / "val" / "images").resolve()
    for fname, label in sorted(rows):
        p = root / "val" / "images" / fname
        if not p.resolve().is_relative_to(images_dir):  # "../../etc/passwd" and the like
            raise DatasetError(f"{ann}: {fname!r} points outside {images_dir}")
        if not p.is_file():
            raise DatasetError(f"{p}: listed in {ann} but missing")
        paths.append(p)
        labels.append(label)
    return wnids, paths, labels, num_train


@functools.lru_cache(maxsize=1)
def _load_tiny(
    root: str, stamp: tuple[tuple[str, int, int], ...]
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Decode every Tiny-ImageNet JPEG once per process: images, labels, num_train, classes."""
    try:
        import PIL  # noqa: F401  (Pillow decodes the JPEGs)
    except ImportError:
        raise DatasetError(
            "tinyimagenet needs Pillow to decode JPEGs: pip install pillow"
        ) from None
    wnids, paths, labels, num_train = _tiny_listing(Path(root))
    # Pillow releases the GIL while decoding, so threads give a real speed-up on 110k files.
    workers = min(16, os.cpu_count() or 1) if len(paths) > 256 else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        arrays = list(pool.map(_decode_jpeg, paths))
    x = np.stack(arrays)  # [N, 3, 64, 64]
    return torch.from_numpy(x), torch.tensor(labels, dtype=torch.int64), num_train, len(wnids)


def _tiny_resolve(d: Path) -> list[Path] | None:
    need = [d / "wnids.txt", d / "val" / "val_annotations.txt"]
    return need if all(p.is_file() for p in need) and (d / "train").is_dir() else None


@DATASETS.register("tinyimagenet")
def load_tinyimagenet(cfg: DataConfig, seed: int) -> ImageDataset:
    """Tiny-ImageNet-200: train (100000) then val (10000) RGB 64x64 images; the unlabelled test
    folder is ignored. Class index = position of the wnid in sorted order."""

    def download(dest: Path) -> None:
        _download.fetch_tinyimagenet(dest)

    resolve = _tiny_resolve

    expected = "wnids.txt, train/<wnid>/images/*.JPEG, val/val_annotations.txt, val/images/"
    paths = _locate("tinyimagenet", cfg, resolve, download, expected)
    root = paths[0].parent
    images, labels, num_train, num_classes = _load_tiny(str(root.resolve()), _stamp(paths))
    mean, std = STATS["tinyimagenet"]
    # Tiny-ImageNet is ~120k JPEGs: its provenance names the folder, not every file.
    return ImageDataset(
        "tinyimagenet", images, labels, num_classes, mean, std, num_train, (str(root.resolve()),)
    )


# ----------------------------------------------------------------------------- in-memory datasets


# Up to STATS_DIRECT_PIXELS the statistics are computed as they always were (their float64
# rounding kept, peak ~16 bytes a pixel); above it from exact per-channel byte histograms, a
# chunk of images at a time, so a large dataset costs no float64 copy of itself. A chunk is
# CHUNK_PIXELS pixels (~32 MiB of float64); config.synthetic_memory counts both.


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std of uint8 images [N, C, H, W], in [0, 1] units."""
    if images.numel() > STATS_DIRECT_PIXELS:
        return _channel_stats_bounded(images)
    x = images.to(torch.float64).div(255).transpose(0, 1).reshape(images.shape[1], -1)
    std = x.std(dim=1).clamp_min(1e-6)
    return tuple(x.mean(dim=1).tolist()), tuple(std.tolist())


def _channel_stats_bounded(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """:func:`_channel_stats` from byte counts: exact sums, one rounding, bounded memory."""
    n, c = int(images.shape[0]), int(images.shape[1])
    per_image = max(1, math.prod(images.shape[1:]))
    rows = max(1, CHUNK_PIXELS // per_image)
    counts = np.zeros((c, 256), dtype=np.int64)
    for start in range(0, n, rows):
        chunk = images[start : start + rows].numpy()
        for ch in range(c):
            counts[ch] += np.bincount(chunk[:, ch].ravel(), minlength=256)
    means, stds = [], []
    for ch in range(c):
        cnt = [int(k) for k in counts[ch]]  # Python ints: the sums below are exact
        m = sum(cnt)
        total = sum(v * k for v, k in enumerate(cnt))
        squares = sum(v * v * k for v, k in enumerate(cnt))
        means.append(total / (255 * m))  # int / int: correctly rounded
        if m < 2:  # as torch's unbiased std of one value
            stds.append(math.nan)
            continue
        var = Fraction(m * squares - total * total, m * (m - 1) * 255 * 255)
        stds.append(max(math.sqrt(var), 1e-6))
    return tuple(means), tuple(stds)


@DATASETS.register("digits")
def load_digits(cfg: DataConfig, seed: int) -> ImageDataset:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes, no download).

    There is no official train/test split, so the whole set is one pool: ``num_train = N``.
    Pixel values 0..16 are scaled to 0..255; mean/std are computed from the data.
    """
    # scikit-learn ships no type information
    from sklearn.datasets import load_digits as sk_load_digits  # type: ignore[import-untyped]

    bunch = sk_load_digits()
    x = np.rint(np.asarray(bunch.images, dtype=np.float64) * (255.0 / 16.0)).astype(np.uint8)
    images = torch.from_numpy(x).unsqueeze(1)  # [1797, 1, 8, 8]
    labels = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    mean, std = _channel_stats(images)
    return ImageDataset("digits", images, labels, 10, mean, std, len(labels))


@functools.lru_cache(maxsize=4)
def _synthetic(
    seed: int, size: int, num_classes: int, shape: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng([seed % 2**64, 0x5EED])  # SeedSequence wants seed >= 0
    c, h, w = shape
    # Each class has a mean image: a coarse random grid (at most 4x4 cells per channel) in
    # [0.15, 0.85], blown up to H x W. Samples add pixel noise, so classes overlap a little
    # per pixel but are easy to tell apart from the whole image: any model can learn them.
    gh, gw = min(h, 4), min(w, 4)
    coarse = rng.uniform(0.15, 0.85, size=(num_classes, c, gh, gw))
    labels = rng.permutation(np.arange(size) % num_classes)  # balanced classes, shuffled
    # A chunk of images at a time: the float64 noise (the numbers as one draw would give them:
    # the generator's stream does not depend on how it is split) is never held for all images.
    images = np.empty((size, c, h, w), dtype=np.uint8)  # [N, C, H, W]
    rows = max(1, CHUNK_PIXELS // (c * h * w))
    for start in range(0, size, rows):
        lab = labels[start : start + rows]
        protos = coarse[lab].repeat(-(-h // gh), axis=2).repeat(-(-w // gw), axis=3)[:, :, :h, :w]
        noise = rng.normal(0.0, 0.2, size=(len(lab), c, h, w))
        x = np.clip(protos + noise, 0.0, 1.0)
        images[start : start + len(lab)] = np.rint(x * 255).astype(np.uint8)
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


@DATASETS.register("synthetic")
def load_synthetic(cfg: DataConfig, seed: int) -> ImageDataset:
    """A learnable synthetic dataset (class mean image + Gaussian noise), deterministic in
    ``seed``, ``synthetic_size``, ``synthetic_classes`` and ``synthetic_shape``; one pool."""
    if len(cfg.synthetic_shape) != 3 or min(cfg.synthetic_shape) < 1:
        raise DatasetError(f"data.synthetic_shape = {cfg.synthetic_shape}; expected [C, H, W] >= 1")
    c, h, w = (int(v) for v in cfg.synthetic_shape)
    if cfg.synthetic_classes < 1 or cfg.synthetic_size < cfg.synthetic_classes:
        raise DatasetError(
            f"data.synthetic_size = {cfg.synthetic_size} must be >= data.synthetic_classes = "
            f"{cfg.synthetic_classes} >= 1"
        )
    images, labels = _synthetic(seed, cfg.synthetic_size, cfg.synthetic_classes, (c, h, w))
    mean, std = _channel_stats(images)
    return ImageDataset("synthetic", images, labels, cfg.synthetic_classes, mean, std, len(labels))


# ----------------------------------------------------------------------------- dispatch


def where_on_disk(name: str, cfg: DataConfig) -> dict[str, Path | None] | None:
    """Where the loaders would find built-in dataset ``name``'s files (the same search and file
    checks, nothing read): the folder per variant (EMNIST's splits; else one, keyed by the
    name), None where absent; None for a dataset that reads no files of its own (digits,
    synthetic, hf, plugins)."""
    checks: dict[str, tuple[str, Callable[[Path], list[Path] | None]]]
    if name in ("fmnist", "mnist"):
        checks = {name: (name, lambda d: _idx_files(d, MNIST_FILES))}
    elif name == "emnist":
        checks = {
            f"emnist-{split}": (
                "emnist",
                # the default argument binds the loop's split; mypy cannot infer such a lambda
                cast(
                    "Callable[[Path], list[Path] | None]",
                    lambda d, s=split: _idx_files(d, _emnist_stems(s)),
                ),
            )
            for split in EMNIST_CLASSES
        }
    elif name in ("cifar10", "cifar100"):
        checks = {name: (name, lambda d: _cifar_resolve(d, _cifar_stems(name)))}
    elif name == "tinyimagenet":
        checks = {name: (name, _tiny_resolve)}
    else:
        return None
    out: dict[str, Path | None] = {}
    for variant, (folder_name, resolve) in checks.items():
        found = _find(folder_name, cfg, resolve)
        out[variant] = found[0].parent if found else None
    return out


def load_dataset(cfg: DataConfig, seed: int) -> ImageDataset:
    """Load ``cfg.dataset`` through the registry. Returned tensors may be shared with the
    per-process decode cache: treat them as read-only."""
    if cfg.dataset not in DATASETS:
        raise DatasetError(
            f"data.dataset = {cfg.dataset!r} is unknown; known: {', '.join(DATASETS.names())}"
            + did_you_mean(cfg.dataset, DATASETS.names())
        )
    return DATASETS.get(cfg.dataset)(cfg, seed)


def clear_cache() -> None:
    """Forget every decoded dataset held by this process."""
    for fn in (_load_idx_dataset, _load_cifar, _load_tiny, _synthetic):
        fn.cache_clear()
