"""Hostile and broken data files through ``fedmosaic run`` (issue 12's data fuzz).

tests/data/test_corrupt_files.py checks each loader's error; here each file goes through the
whole CLI: exit 2, one line naming the file or the problem, no traceback, ``--out`` not created.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from dataset_files import isolate_search, write_cifar, write_mnist, write_tiny
from helpers.experiments import tiny_raw, write_toml

from fedmosaic.cli import main


def _mnist_root(tmp_path: Path) -> Path:
    root = tmp_path / "mnist"
    write_mnist(root, n_train=60, n_test=20)
    return root


def _truncated_idx(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    root = _mnist_root(tmp_path)
    f = root / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-100])
    return "mnist", root, "truncated"


def _idx_header_lies(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    root = _mnist_root(tmp_path)  # a header claiming 2**31 images in a 1 KB file
    f = root / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:4] + (2**31).to_bytes(4, "big") + f.read_bytes()[8:])
    return "mnist", root, "train-images-idx3-ubyte"


def _gzip_bomb(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    from fedmosaic.data import datasets

    root = _mnist_root(tmp_path)
    (root / "train-images-idx3-ubyte").unlink()
    # A header stating a real MNIST size (47 MB) in front of the bomb: the limit stops it.
    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (60000, 28, 28))
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(header + b"\0" * (4 << 20)))
    monkeypatch.setattr(datasets, "MAX_DECOMPRESSED", 1 << 20)  # the real limit, scaled down
    return "mnist", root, "decompresses to more than"


def _missing_idx(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    root = _mnist_root(tmp_path)
    (root / "t10k-labels-idx1-ubyte").unlink()
    return "mnist", root, "not found"


def _cifar(tmp_path: Path, payload: bytes) -> Path:
    root = tmp_path / "cifar"
    write_cifar(root, "cifar10")
    batch = next(p for p in root.rglob("data_batch_1"))
    batch.write_bytes(payload)
    return root


def _deep_pickle(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    payload = b"\x80\x02" + b"(" * 100_000 + b"l" * 100_000 + b"."  # segfaulted before
    return "cifar10", _cifar(tmp_path, payload), "data_batch_1"


def _pickle_alloc(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    # bytearray(2**31): 2 GB from 41 bytes (LONG1, so the size is positive; a signed 32-bit
    # J would be -2**31 and fail on its own)
    payload = b"\x80\x02c__builtin__\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R."
    return "cifar10", _cifar(tmp_path, payload), "refusing to load global __builtin__.bytearray"


def _pickle_code(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    payload = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."  # os.system(("true",))
    return "cifar10", _cifar(tmp_path, payload), "refusing to load global os.system"


def _tiny_traversal(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    root = tmp_path / "tiny-imagenet-200"
    write_tiny(root, ["n01", "n02"])
    ann = root / "val" / "val_annotations.txt"
    lines = ann.read_text().splitlines()
    first = lines[0].split("\t")
    (tmp_path / "secret.JPEG").write_bytes((root / "val" / "images" / first[0]).read_bytes())
    lines[0] = "\t".join(["../../../secret.JPEG", *first[1:]])
    ann.write_text("\n".join(lines) + "\n")
    return "tinyimagenet", root, "outside"


def _tiny_absolute(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    dataset, root, _ = _tiny_traversal(tmp_path, monkeypatch)
    ann = root / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text().replace("../../../secret.JPEG", str(tmp_path / "secret.JPEG")))
    return dataset, root, "outside"


def _tiny_corrupt_jpeg(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    root = tmp_path / "tiny-imagenet-200"
    write_tiny(root, ["n01", "n02"])
    img = next((root / "val" / "images").iterdir())
    img.write_bytes(img.read_bytes()[:40])
    return "tinyimagenet", root, img.name


def _tiny_pixel_bomb(tmp_path: Path, monkeypatch) -> tuple[str, Path, str]:
    from PIL import Image

    dataset, root, _ = _tiny_corrupt_jpeg(tmp_path, monkeypatch)
    img = next((root / "val" / "images").iterdir())
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL's bomb check, scaled down
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(img, format="JPEG")
    return dataset, root, "decompression bomb"


DATA_CASES = {
    "truncated-idx": _truncated_idx,
    "idx-header-lies": _idx_header_lies,
    "gzip-bomb": _gzip_bomb,
    "missing-idx-file": _missing_idx,
    "deep-pickle": _deep_pickle,
    "pickle-2GB-bytearray": _pickle_alloc,
    "pickle-os-system": _pickle_code,
    "tiny-traversal": _tiny_traversal,
    "tiny-absolute-path": _tiny_absolute,
    "tiny-corrupt-jpeg": _tiny_corrupt_jpeg,
    "tiny-pixel-bomb": _tiny_pixel_bomb,
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_cli_refuses_hostile_data_files(case, tmp_path, capsys, monkeypatch):
    isolate_search(monkeypatch, tmp_path)
    dataset, root, problem = DATA_CASES[case](tmp_path, monkeypatch)
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(algorithm={"name": "local"}))
    out = tmp_path / "out"
    sets = [f"data.dataset={dataset}", f'data.root="{root}"', "data.public_size=0"]
    args = ["run", str(cfg), "--out", str(out), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("error:") and problem in err[0], err
    assert not any("Traceback" in line for line in err), err
    if case != "missing-idx-file":  # that one adds how to point at the files
        assert len(err) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("path", ["../secret.png", "sub/../../secret.png", "ABS"])
def test_hf_image_paths_cannot_point_outside_the_root(tmp_path, path):
    from fedmosaic.data import DatasetError
    from fedmosaic.data.hf import _to_pil

    root = tmp_path / "ds"
    root.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"not read")
    value = {"bytes": None, "path": str(secret) if path == "ABS" else path}
    with pytest.raises(DatasetError, match="points outside"):
        _to_pil(value, "train[0]", root)
    inside = root / "a.png"
    from dataset_files import png_bytes

    inside.write_bytes(png_bytes(np.zeros((4, 4), np.uint8)))
    assert _to_pil({"bytes": None, "path": "a.png"}, "train[0]", root).size == (4, 4)
