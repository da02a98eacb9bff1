"""dataset = "hf": local Hugging Face layouts written by the tests (image folder always; parquet
and save_to_disk Arrow when pyarrow is installed). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_files import (
    image_set,
    isolate_search,
    write_hf_imagefolder,
    write_hf_parquet,
    write_hf_save_to_disk,
)

from fedmosaic.config import DataConfig
from fedmosaic.data import DatasetError, build_federated_data, clear_cache, load_dataset


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_search(monkeypatch, tmp_path)
    clear_cache()


def splits(hw: int = 8) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    # first pixel encodes the label (image_set), so row order is checkable
    return {"train": image_set(20, 10, 0, hw), "test": image_set(10, 10, 1, hw)}


def load(root: Path, **kw) -> object:
    return load_dataset(DataConfig(dataset="hf", root=str(root), **kw), 0)


def check_rows(ds, data: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    xtr, ytr = data["train"]
    xte, yte = data["test"]
    assert ds.num_train == 20 and len(ds) == 30 and ds.num_classes == 10
    assert ds.images.dtype == torch.uint8 and ds.images.shape == (30, 1, 8, 8)
    np.testing.assert_array_equal(ds.images[:, 0].numpy(), np.concatenate([xtr, xte]))
    np.testing.assert_array_equal(ds.labels.numpy(), np.concatenate([ytr, yte]))


def test_image_folder_train_then_test(tmp_path: Path) -> None:
    data = splits()
    # write test first: the pool still starts with train
    write_hf_imagefolder(tmp_path / "ds", {"test": data["test"], "train": data["train"]})
    ds = load(tmp_path / "ds")
    # files are read in sorted order per class folder; sort the expectation the same way
    order = {s: np.lexsort((np.arange(len(y)), y)) for s, (x, y) in data.items()}
    want = {s: (x[order[s]], y[order[s]]) for s, (x, y) in data.items()}
    check_rows(ds, want)
    assert ds.name == "hf-ds" and ds.sources == (str((tmp_path / "ds").resolve()),)
    assert ds.mean[0] == pytest.approx(ds.images.double().mean().item() / 255)


def test_image_folder_rgb_and_flat_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(6, 5, 7, 3), dtype=np.uint8)  # [N, H, W, 3]
    y = np.array([0, 1, 2, 0, 1, 2])
    # no split folders: <class>/<image>
    write_hf_imagefolder(tmp_path / "flat", {"all": (x, y)})
    (tmp_path / "flat" / "all").rename(tmp_path / "flat2")
    ds = load(tmp_path / "flat2")
    assert ds.images.shape == (6, 3, 5, 7) and ds.num_classes == 3 and ds.num_train == 6
    np.testing.assert_array_equal(ds.images[0].numpy(), x[0].transpose(2, 0, 1))


def test_federated_build_on_hf_data(tmp_path: Path) -> None:
    write_hf_imagefolder(tmp_path / "ds", splits())
    cfg = DataConfig(dataset="hf", root=str(tmp_path / "ds"), num_clients=3, partition="iid")
    fd = build_federated_data(cfg, 0)
    assert sum(len(c) for c in fd.clients) == 30 and fd.input_shape == (1, 8, 8)


@pytest.mark.parametrize(
    "setup, match",
    [
        ("no_root", "set data.root"),
        ("empty", "no Hugging Face data found"),
        ("mixed_sizes", "every image must have the same size"),
        ("not_image", "cannot decode image"),
    ],
)
def test_errors_name_the_problem(tmp_path: Path, setup: str, match: str) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    if setup == "mixed_sizes":
        write_hf_imagefolder(root, {"train": image_set(4, 2, 0, 8)})
        write_hf_imagefolder(root, {"test": image_set(2, 2, 1, 6)})
    if setup == "not_image":
        write_hf_imagefolder(root, {"train": image_set(4, 2, 0, 8)})
        (root / "train" / "class_0" / "zz.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=match) as exc:
        load_dataset(DataConfig(dataset="hf", root="" if setup == "no_root" else str(root)), 0)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("writer", [write_hf_parquet, write_hf_save_to_disk])
def test_arrow_and_parquet_layouts(tmp_path: Path, writer) -> None:
    pytest.importorskip("pyarrow")
    data = splits()
    writer(tmp_path / "ds", {"test": data["test"], "train": data["train"]})
    ds = load(tmp_path / "ds")
    check_rows(ds, data)
    assert all(s.endswith((".parquet", ".arrow")) for s in ds.sources) and len(ds.sources) == 2
    # explicit column names; a wrong one is named in the error
    assert load(tmp_path / "ds", hf_image_column="image", hf_label_column="label").num_train == 20
    with pytest.raises(DatasetError, match="data.hf_label_column = 'fine'"):
        load(tmp_path / "ds", hf_label_column="fine")


def test_arrow_without_pyarrow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ds"
    (root / "data").mkdir(parents=True)
    (root / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name: str, *args, **kw):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DatasetError, match="needs pyarrow"):
        load(root)
