"""``dataset = "hf"``: image classification data a user already has on disk in a Hugging Face
``datasets`` / flwr-datasets layout. Nothing is downloaded: ``data.root`` names the folder.

Three layouts are recognised, in this order:

1. ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` output: ``state.json`` (one split) or
   ``dataset_dict.json`` with one such folder per split; the data are Arrow stream files
   (``data-00000-of-00001.arrow``) named in ``state.json``. Needs ``pyarrow``.
2. Parquet files anywhere under the folder (the Hub's ``data/train-00000-of-00001.parquet``
   layout, or ``train/*.parquet``). Needs ``pyarrow``.
3. An image folder (HF's ``imagefolder`` builder, torchvision's ``ImageFolder``):
   ``[<split>/]<class name>/<image>.png|jpg|jpeg|bmp``; classes are the sorted folder names.
   Needs only Pillow.

Splits: a split whose name (folder or file-name prefix) starts with ``test``, ``valid`` or ``val``
is pooled *after* the others (``num_train`` = rows before it), as every other loader pools the
official train then test rows. Columns: ``data.hf_image_column`` (default: the first of
``image``, ``img``, ``pixel_values``) holds an HF ``Image`` value (``{"bytes", "path"}``), encoded
bytes, or a nested list / array ``[H, W]`` or ``[H, W, C]``; ``data.hf_label_column`` (default:
the first of ``label``, ``labels``, ``fine_label``, ``target``) holds integer class ids (or
strings, mapped to sorted ids). Grayscale images stay one channel; anything else becomes RGB.
Every image must have the same size. Mean/std are computed from the data.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmosaic.config import DataConfig
from fedmosaic.core.registry import DATASETS
from fedmosaic.data.datasets import DatasetError, ImageDataset, _channel_stats, _stamp

IMAGE_COLUMNS = ("image", "img", "pixel_values")
LABEL_COLUMNS = ("label", "labels", "fine_label", "target")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
_EVAL = re.compile(r"^(test|valid|val)", re.IGNORECASE)
_SPLIT = re.compile(r"^(train|test|validation|valid|val)(?![a-z])", re.IGNORECASE)


def _is_eval(split: str) -> bool:
    return bool(_EVAL.match(split))


def _pyarrow(path: Path) -> Any:
    try:
        # optional dependency (the hf extra), untyped; absent where the extra is not installed
        import pyarrow  # type: ignore[import-not-found, import-untyped, unused-ignore]
        import pyarrow.ipc  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: F401
        import pyarrow.parquet  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: F401
    except ImportError:
        raise DatasetError(
            f"{path}: reading Arrow/Parquet files needs pyarrow (pip install 'fedmosaic[hf]'); or "
            "export the data as an image folder (<split>/<class>/<image>.png)"
        ) from None
    return pyarrow


# ----------------------------------------------------------------------------- finding files


def _arrow_splits(root: Path) -> list[tuple[str, list[Path]]] | None:
    """``save_to_disk`` output: [(split, arrow files)], or None if ``root`` is not one."""

    def one(folder: Path) -> list[Path]:
        state_path = folder / "state.json"
        try:
            state = json.loads(state_path.read_text())
            files = [folder / f["filename"] for f in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"{state_path}: not a datasets state file ({exc})") from exc
        for f in files:
            if not f.is_file():
                raise DatasetError(f"{f}: listed in {state_path} but missing")
        return files

    if (root / "state.json").is_file():
        return [(root.name, one(root))]
    dd = root / "dataset_dict.json"
    if not dd.is_file():
        return None
    try:
        splits = json.loads(dd.read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{dd}: not a datasets dict file ({exc})") from exc
    return [(str(s), one(root / str(s))) for s in splits]


def _parquet_splits(root: Path) -> list[tuple[str, list[Path]]] | None:
    files = sorted(root.rglob("*.parquet"))
    if not files:
        return None
    by_split: dict[str, list[Path]] = {}
    for f in files:
        # the split: the file's prefix (data/train-00000-of-00001.parquet), else the nearest
        # folder named like a split (test/0000.parquet); anything else counts as train
        names = [f.stem, *reversed(f.relative_to(root).parts[:-1])]
        split = next((m.group(1).lower() for n in names if (m := _SPLIT.match(n))), "train")
        by_split.setdefault(split, []).append(f)
    return list(by_split.items())


def _folder_splits(root: Path) -> tuple[list[tuple[str, list[Path]]], list[str]] | None:
    """Image folder: [(split, image files)] and the sorted class names."""
    subdirs = sorted(d for d in root.iterdir() if d.is_dir())
    if not subdirs:
        return None

    def images(d: Path) -> list[Path]:
        return sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)

    # <split>/<class>/<image> when the subfolders hold folders, else <class>/<image>
    nested = all(any(c.is_dir() for c in d.iterdir()) for d in subdirs)
    split_dirs = [(d.name, sorted(c for c in d.iterdir() if c.is_dir())) for d in subdirs]
    if not nested:
        split_dirs = [(root.name, subdirs)]
    classes = sorted({c.name for _, cls in split_dirs for c in cls})
    out = []
    for split, cls in split_dirs:
        files = [p for c in cls for p in images(c)]
        if files:
            out.append((split, files))
    return (out, classes) if out else None


# ----------------------------------------------------------------------------- decoding


def _pick(
    names: Iterable[str], wanted: str, defaults: tuple[str, ...], key: str, where: Path
) -> str:
    names = list(names)
    if wanted:
        if wanted not in names:
            raise DatasetError(f"{where}: no column {key} = {wanted!r} (columns: {names})")
        return wanted
    for d in defaults:
        if d in names:
            return d
    raise DatasetError(
        f"{where}: none of the columns {names} looks like {'/'.join(defaults)}; set {key}"
    )


def _to_pil(value: Any, where: str, root: Path) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(value, dict):  # an HF Image value: {"bytes": ..., "path": ...}
            if value.get("bytes") is not None:
                return Image.open(io.BytesIO(value["bytes"]))
            if value.get("path"):
                return Image.open(_inside(root, Path(value["path"]), where))
            raise DatasetError(f"{where}: image value has neither bytes nor path")
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value))
        if isinstance(value, (str, Path)):
            return Image.open(_inside(root, Path(value), where))
        arr = np.asarray(value)
        if arr.ndim not in (2, 3) or not np.issubdtype(arr.dtype, np.number):
            raise DatasetError(f"{where}: image array of shape {arr.shape}, expected [H, W(, C)]")
        if arr.dtype != np.uint8:
            if arr.min() < 0 or arr.max() > 255:
                raise DatasetError(f"{where}: pixel values outside 0..255")
            arr = arr.astype(np.uint8)
        return Image.fromarray(arr)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"{where}: cannot decode image ({exc})") from exc


def _inside(root: Path, p: Path, where: str) -> Path:
    """``p`` (relative to ``root``) when it stays inside ``root``: a table naming
    ``../../etc/...`` or an absolute path elsewhere is refused, never read."""
    # Lexical (no symlink resolution): the table's strings are what may be hostile, not the
    # links the root's owner made.
    full = Path(os.path.normpath(p if p.is_absolute() else root.absolute() / p))
    if not full.is_relative_to(Path(os.path.normpath(root.absolute()))):
        raise DatasetError(f"{where}: image path {str(p)!r} points outside {root}")
    return full


def _stack(images: list[Any], wheres: list[str]) -> torch.Tensor:
    """PIL images -> uint8 [N, C, H, W]; one channel when every image is grayscale."""
    from PIL import Image

    gray = all(im.mode in ("L", "1", "I;16", "I", "F") for im in images)
    arrays = []
    size = None
    for im, where in zip(images, wheres):
        try:  # Image.open is lazy: a truncated file or a pixel bomb shows up here
            a = np.asarray(im.convert("L" if gray else "RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise DatasetError(f"{where}: cannot decode image ({exc})") from exc
        if size is None:
            size = a.shape
        elif a.shape != size:
            raise DatasetError(
                f"{where}: image is {a.shape[1]}x{a.shape[0]}, but the first one is "
                f"{size[1]}x{size[0]}; every image must have the same size"
            )
        arrays.append(a)
    x = np.stack(arrays)  # [N, H, W] or [N, H, W, 3]
    x = x[:, None] if gray else x.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.ascontiguousarray(x))


def _class_names(meta: Any, label_col: str) -> list[str] | None:
    """ClassLabel names from HF ``features`` metadata, if present."""
    try:
        feat = meta[label_col]
        names = feat.get("names") if isinstance(feat, dict) else None
    except (KeyError, TypeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) and names else None


def _read_table(path: Path) -> tuple[dict[str, list[Any]], Any]:
    """A parquet or Arrow stream file as columns, and the HF features metadata (or None)."""
    pa = _pyarrow(path)
    try:
        if path.suffix == ".parquet":
            table = pa.parquet.read_table(path)
        else:
            with pa.memory_map(str(path)) as src:
                try:
                    table = pa.ipc.open_stream(src).read_all()
                except pa.ArrowInvalid:  # an Arrow IPC *file* rather than a stream
                    table = pa.ipc.open_file(src).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"{path}: cannot read Arrow/Parquet data ({exc})") from exc
    features = None
    meta = table.schema.metadata or {}
    if b"huggingface" in meta:
        try:
            features = json.loads(meta[b"huggingface"])["info"]["features"]
        except (ValueError, KeyError, TypeError):
            features = None
    return table.to_pydict(), features


def _features_from_info(files: list[Path]) -> Any:
    info = files[0].parent / "dataset_info.json"
    try:
        return json.loads(info.read_text()).get("features") if info.is_file() else None
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=2)
def _load(
    root: str, stamp: tuple[tuple[str, int, int], ...], image_col: str, label_col: str
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Decode once per process: images [N, C, H, W], labels [N], num_train, num_classes."""
    base = Path(root)
    splits = _arrow_splits(base) or _parquet_splits(base)
    pil: list[Any] = []
    wheres: list[str] = []
    raw_labels: list[Any] = []
    names: list[str] | None = None
    if splits is not None:
        order = sorted(splits, key=lambda s: _is_eval(s[0]))  # train-like splits first
        num_train = 0
        for split, files in order:
            for f in files:
                cols, features = _read_table(f)
                features = features or _features_from_info([f])
                ic = _pick(cols, image_col, IMAGE_COLUMNS, "data.hf_image_column", f)
                lc = _pick(cols, label_col, LABEL_COLUMNS, "data.hf_label_column", f)
                names = names or _class_names(features, lc)
                for r, (v, y) in enumerate(zip(cols[ic], cols[lc])):
                    wheres.append(f"{f} row {r}")
                    pil.append(_to_pil(v, wheres[-1], f.parent))
                    raw_labels.append(y)
            if not _is_eval(split):
                num_train = len(pil)
    else:
        found = _folder_splits(base)
        if found is None:
            raise DatasetError(
                f"{base}: no Hugging Face data found (expected state.json or dataset_dict.json "
                "from save_to_disk, *.parquet files, or an image folder "
                "[<split>/]<class>/<image>.png)"
            )
        folder_splits, names = found
        order = sorted(folder_splits, key=lambda s: _is_eval(s[0]))
        num_train = 0
        for split, files in order:
            for p in files:
                wheres.append(str(p))
                pil.append(_to_pil(p, str(p), base))
                raw_labels.append(p.parent.name)
            if not _is_eval(split):
                num_train = len(pil)
    if not pil:
        raise DatasetError(f"{base}: the dataset has no rows")
    images = _stack(pil, wheres)
    labels, num_classes = _encode_labels(raw_labels, names, base)
    return images, labels, num_train, num_classes


def _encode_labels(
    raw: list[Any], names: list[str] | None, where: Path
) -> tuple[torch.Tensor, int]:
    if all(isinstance(y, str) for y in raw):
        vocab = names if names is not None and set(raw) <= set(names) else sorted(set(raw))
        index = {n: i for i, n in enumerate(vocab)}
        return torch.tensor([index[y] for y in raw], dtype=torch.int64), len(vocab)
    if not all(isinstance(y, (int, np.integer)) and not isinstance(y, bool) for y in raw):
        bad = next(y for y in raw if not isinstance(y, (int, np.integer)) or isinstance(y, bool))
        raise DatasetError(f"{where}: label {bad!r} is not an integer class id")
    labels = torch.tensor([int(y) for y in raw], dtype=torch.int64)
    c = len(names) if names else int(labels.max()) + 1
    if int(labels.min()) < 0 or int(labels.max()) >= c:
        raise DatasetError(
            f"{where}: labels span [{int(labels.min())}, {int(labels.max())}], expected [0, {c - 1}]"
        )
    return labels, c


def _files(root: Path) -> list[Path]:
    """Every file the dataset is read from (for the decode cache's key and provenance)."""
    arrow = _arrow_splits(root)
    if arrow is not None:
        return [f for _, fs in arrow for f in fs]
    parquet = _parquet_splits(root)
    if parquet is not None:
        return [f for _, fs in parquet for f in fs]
    found = _folder_splits(root)
    return [f for _, fs in found[0] for f in fs] if found else []


@DATASETS.register("hf")
def load_hf(cfg: DataConfig, seed: int) -> ImageDataset:
    """A local Hugging Face / flwr-datasets style image dataset in ``data.root``."""
    if not cfg.root:
        raise DatasetError(
            'data.dataset = "hf" reads a local folder: set data.root to a save_to_disk folder, '
            "a folder of *.parquet files or an image folder"
        )
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"data.root = {str(root)!r} is not a folder")
    files = _files(root)
    if not files:
        raise DatasetError(
            f"{root}: no Hugging Face data found (expected state.json or dataset_dict.json from "
            "save_to_disk, *.parquet files, or an image folder [<split>/]<class>/<image>.png)"
        )
    images, labels, num_train, num_classes = _load(
        str(root.resolve()), _stamp(files), cfg.hf_image_column, cfg.hf_label_column
    )
    mean, std = _channel_stats(images)
    # an image folder is named as a whole (like Tiny-ImageNet), table files one by one
    tables = files[0].suffix in (".arrow", ".parquet")
    sources = tuple(str(f.resolve()) for f in files) if tables else (str(root.resolve()),)
    name = "hf-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", root.resolve().name) or "data")
    return ImageDataset(name, images, labels, num_classes, mean, std, num_train, sources)


def clear_cache() -> None:
    _load.cache_clear()
