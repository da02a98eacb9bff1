"""Writers for tiny dataset files in each real on-disk format, and an isolated search path.

A plain helper module imported by name (``from dataset_files import write_mnist``), not a
conftest.py: fixtures live in conftest.py, what tests import lives in helper modules.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from fedmosaic.data import datasets

MNIST_STEMS = datasets.MNIST_FILES  # train images, train labels, test images, test labels


def isolate_search(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No env var, no system folder, an empty cache: only what a test writes is found."""
    monkeypatch.delenv("FEDMOSAIC_DATA", raising=False)
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", {})


def idx_bytes(arr: np.ndarray, dtype_code: int = 0x08) -> bytes:
    """IDX encoding: magic 00 00 <dtype> <ndim>, big-endian uint32 sizes, raw data."""
    header = bytes([0, 0, dtype_code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


def write_idx(path: Path, arr: np.ndarray, gz: bool = False) -> Path:
    data = idx_bytes(arr)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def image_set(n: int, num_classes: int, seed: int, hw: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """Images [n, hw, hw] whose first pixel encodes the label (to check row order)."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) % num_classes).astype(np.uint8)
    images = rng.integers(0, 256, size=(n, hw, hw), dtype=np.uint8)
    images[:, 0, 0] = labels
    return images, labels


def write_mnist(folder: Path, n_train: int = 30, n_test: int = 10, gz: bool = False) -> dict:
    """The four MNIST-layout IDX files; returns the arrays written."""
    xtr, ytr = image_set(n_train, 10, 0)
    xte, yte = image_set(n_test, 10, 1)
    for stem, arr in zip(MNIST_STEMS, (xtr, ytr, xte, yte)):
        write_idx(folder / stem, arr, gz)
    return {"xtr": xtr, "ytr": ytr, "xte": xte, "yte": yte}


def write_emnist(folder: Path, split: str, n_train: int = 26, n_test: int = 13) -> dict:
    """EMNIST files store each upright image transposed; letters labels are 1..26."""
    classes = 26 if split == "letters" else 47
    out = {}
    for part, n, seed in (("train", n_train, 2), ("test", n_test, 3)):
        upright, labels = image_set(n, classes, seed)
        if split == "letters":
            labels = labels + 1
        write_idx(
            folder / f"emnist-{split}-{part}-images-idx3-ubyte",
            upright.transpose(0, 2, 1),
            gz=True,
        )
        write_idx(folder / f"emnist-{split}-{part}-labels-idx1-ubyte", labels, gz=True)
        out[part] = (upright, labels)
    return out


def write_cifar(folder: Path, name: str, per_file: int = 4, protocol: int = 2) -> dict:
    """CIFAR python-format batches: pickled dicts, b"data" uint8 [N, 3072], labels lists."""
    folder.mkdir(parents=True, exist_ok=True)
    if name == "cifar10":
        files, key, classes = (
            [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"],
            b"labels",
            10,
        )
    else:
        files, key, classes = ["train", "test"], b"fine_labels", 100
    rng = np.random.default_rng(4)
    written = {}
    for i, fname in enumerate(files):
        data = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, classes, size=per_file)]
        labels[0] = i % classes
        with open(folder / fname, "wb") as f:
            pickle.dump({b"batch_label": b"x", b"data": data, key: labels}, f, protocol=protocol)
        written[fname] = (data, labels)
    return written


def write_tiny(root: Path, wnids: list[str], per_class: int = 2, val: int = 3) -> dict:
    """Tiny-ImageNet layout with solid-colour 64x64 JPEGs (colour encodes the class)."""
    from PIL import Image

    (root / "wnids.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    colour = {w: (40 + 80 * i, 200 - 60 * i, 30 * i) for i, w in enumerate(sorted(wnids))}
    for w in wnids:
        folder = root / "train" / w / "images"
        folder.mkdir(parents=True)
        for j in range(per_class):
            Image.new("RGB", (64, 64), colour[w]).save(folder / f"{w}_{j}.JPEG")
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for j in range(val):
        w = wnids[j % len(wnids)]
        if j == 0:  # a grayscale file: must come out as RGB
            Image.new("L", (64, 64), 128).save(root / "val" / "images" / f"val_{j}.JPEG")
        else:
            Image.new("RGB", (64, 64), colour[w]).save(root / "val" / "images" / f"val_{j}.JPEG")
        lines.append(f"val_{j}.JPEG\t{w}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return colour


# ----------------------------------------------------------------------------- Hugging Face layouts


def png_bytes(image: np.ndarray) -> bytes:
    """A lossless PNG of a uint8 [H, W] (grayscale) or [H, W, 3] (RGB) image."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def write_hf_imagefolder(folder: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """HF ``imagefolder`` / torchvision ``ImageFolder``: <split>/<class name>/<i>.png, where
    class k is named ``class_<k>`` (sorted names give back k for k < 10)."""
    for split, (images, labels) in splits.items():
        for i, (x, y) in enumerate(zip(images, labels)):
            d = folder / split / f"class_{int(y)}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:05d}.png").write_bytes(png_bytes(x))


def hf_table(images: np.ndarray, labels: np.ndarray, names: list[str]):  # -> pyarrow.Table
    """A table as ``datasets`` writes it: an Image struct column ``{bytes, path}`` and an int64
    ClassLabel column, with the ``huggingface`` features metadata on the schema."""
    import json

    import pyarrow as pa

    image = pa.array(
        [{"bytes": png_bytes(x), "path": None} for x in images],
        type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    features = {
        "image": {"_type": "Image"},
        "label": {"names": names, "_type": "ClassLabel"},
    }
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    table = pa.table({"image": image, "label": pa.array(labels.astype(np.int64))})
    return table.replace_schema_metadata(meta)


def write_hf_parquet(folder: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """The Hub's layout: data/<split>-00000-of-00001.parquet."""
    import pyarrow.parquet as pq

    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, (x, y) in splits.items():
        pq.write_table(
            hf_table(x, y, [f"c{k}" for k in range(10)]),
            folder / "data" / f"{split}-00000-of-00001.parquet",
        )


def write_hf_save_to_disk(folder: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """``DatasetDict.save_to_disk``: dataset_dict.json, and per split an Arrow *stream* file
    named in state.json beside dataset_info.json."""
    import json

    import pyarrow as pa

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, (x, y) in splits.items():
        d = folder / split
        d.mkdir()
        table = hf_table(x, y, [f"c{k}" for k in range(10)])
        with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": split}
        (d / "state.json").write_text(json.dumps(state))
        info = {
            "features": {
                "image": {"_type": "Image"},
                "label": {"names": [f"c{k}" for k in range(10)], "_type": "ClassLabel"},
            }
        }
        (d / "dataset_info.json").write_text(json.dumps(info))
