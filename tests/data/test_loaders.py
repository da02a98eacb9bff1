"""Dataset loaders on tiny files written in each real format."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_files import (
    isolate_search,
    write_cifar,
    write_emnist,
    write_idx,
    write_mnist,
    write_tiny,
)
from helpers.experiments import run_capped

from fedmosaic.config import DataConfig
from fedmosaic.core.registry import DATASETS
from fedmosaic.data import STATS, DatasetError, ImageDataset, load_dataset, read_idx

ALL_DATASETS = [
    "cifar10",
    "cifar100",
    "digits",
    "emnist",
    "fmnist",
    "hf",
    "mnist",
    "synthetic",
    "tinyimagenet",
]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_search(monkeypatch, tmp_path)


def test_every_dataset_registered() -> None:
    assert sorted(DATASETS.names()) == ALL_DATASETS


def test_unknown_dataset_names_known_ones() -> None:
    with pytest.raises(DatasetError, match="known: cifar10"):
        load_dataset(DataConfig(dataset="imagenet"), 0)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / "x-idx3-ubyte", arr, gz)
    out = read_idx(path, ndim=3)
    assert out.dtype == np.uint8 and out.flags.writeable
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("name", ["fmnist", "mnist"])
@pytest.mark.parametrize("gz", [False, True])
def test_mnist_like_from_root(tmp_path: Path, name: str, gz: bool) -> None:
    w = write_mnist(tmp_path, gz=gz)
    ds = load_dataset(DataConfig(dataset=name, root=str(tmp_path)), 0)
    assert isinstance(ds, ImageDataset) and ds.name == name
    assert ds.images.shape == (40, 1, 28, 28) and ds.images.dtype == torch.uint8
    assert ds.labels.dtype == torch.int64 and ds.num_classes == 10 and ds.num_train == 30
    # Train rows first, then test rows.
    np.testing.assert_array_equal(ds.images[:30, 0].numpy(), w["xtr"])
    np.testing.assert_array_equal(ds.images[30:, 0].numpy(), w["xte"])
    np.testing.assert_array_equal(ds.labels.numpy(), np.concatenate([w["ytr"], w["yte"]]))
    assert (ds.mean, ds.std) == STATS[name]


def test_fmnist_subfolder_and_env_var(tmp_path: Path, monkeypatch) -> None:
    write_mnist(tmp_path / "root" / "fashion-mnist", n_train=20)
    ds = load_dataset(DataConfig(dataset="fmnist", root=str(tmp_path / "root")), 0)
    assert ds.num_train == 20
    write_mnist(tmp_path / "env" / "fashion-mnist", n_train=12)
    monkeypatch.setenv("FEDMOSAIC_DATA", str(tmp_path / "env"))
    assert load_dataset(DataConfig(dataset="fmnist"), 0).num_train == 12
    # An explicit root wins over the environment variable.
    assert (
        load_dataset(DataConfig(dataset="fmnist", root=str(tmp_path / "root")), 0).num_train == 20
    )


def test_fmnist_system_folder(tmp_path: Path, monkeypatch) -> None:
    from fedmosaic.data import datasets

    write_mnist(tmp_path / "sys", n_train=14, gz=True)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", {"fmnist": [tmp_path / "sys"]})
    assert load_dataset(DataConfig(dataset="fmnist"), 0).num_train == 14
    with pytest.raises(DatasetError):  # the Debian folder is Fashion-MNIST only
        load_dataset(DataConfig(dataset="mnist"), 0)


def test_missing_files_explain_the_fix(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetError) as err:
        load_dataset(DataConfig(dataset="fmnist", root=str(tmp_path)), 0)
    msg = str(err.value)
    assert str(tmp_path) in msg and str(tmp_path / "fashion-mnist") in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "FEDMOSAIC_DATA" in msg and "download" in msg


def test_emnist_letters_shifted_and_upright(tmp_path: Path) -> None:
    w = write_emnist(tmp_path / "emnist", "letters")
    ds = load_dataset(DataConfig(dataset="emnist", emnist_split="letters", root=str(tmp_path)), 0)
    assert ds.name == "emnist-letters" and ds.num_classes == 26 and ds.num_train == 26
    assert ds.labels.min() == 0 and ds.labels.max() == 25
    np.testing.assert_array_equal(ds.labels[:26].numpy(), w["train"][1] - 1)
    np.testing.assert_array_equal(ds.images[:26, 0].numpy(), w["train"][0])  # transposed back
    np.testing.assert_array_equal(ds.images[26:, 0].numpy(), w["test"][0])


def test_emnist_balanced(tmp_path: Path) -> None:
    write_emnist(tmp_path, "balanced", n_train=47, n_test=5)
    ds = load_dataset(DataConfig(dataset="emnist", emnist_split="balanced", root=str(tmp_path)), 0)
    assert ds.num_classes == 47 and len(ds) == 52 and int(ds.labels.max()) == 46


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar10(tmp_path: Path, protocol: int) -> None:
    w = write_cifar(tmp_path / "cifar-10-batches-py", "cifar10", protocol=protocol)
    ds = load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)), 0)
    assert ds.images.shape == (24, 3, 32, 32) and ds.num_train == 20 and ds.num_classes == 10
    data, labels = w["data_batch_2"]
    # Row layout: 1024 red, 1024 green, 1024 blue, each a row-major 32x32 plane.
    np.testing.assert_array_equal(ds.images[4:8].numpy(), data.reshape(4, 3, 32, 32))
    assert ds.labels[4:8].tolist() == labels
    assert ds.labels[20:].tolist() == w["test_batch"][1]
    assert (ds.mean, ds.std) == STATS["cifar10"]


def test_cifar100_fine_labels(tmp_path: Path) -> None:
    w = write_cifar(tmp_path / "cifar-100-python", "cifar100", per_file=6, protocol=5)
    ds = load_dataset(DataConfig(dataset="cifar100", root=str(tmp_path)), 0)
    assert ds.num_classes == 100 and ds.num_train == 6 and len(ds) == 12
    assert ds.labels.tolist() == w["train"][1] + w["test"][1]


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    write_cifar(folder, "cifar100")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    (folder / "train").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(DatasetError, match="refusing to load global") as err:
        load_dataset(DataConfig(dataset="cifar100", root=str(tmp_path)), 0)
    assert str(folder / "train") in str(err.value)
    assert not marker.exists()


def test_tinyimagenet(tmp_path: Path) -> None:
    wnids = ["n02", "n01", "n03"]  # wnids.txt order is not sorted; class ids follow sorted order
    colour = write_tiny(tmp_path / "tiny-imagenet-200", wnids)
    ds = load_dataset(DataConfig(dataset="tinyimagenet", root=str(tmp_path)), 0)
    assert ds.images.shape == (9, 3, 64, 64) and ds.num_train == 6 and ds.num_classes == 3
    assert ds.labels[:6].tolist() == [0, 0, 1, 1, 2, 2]
    assert ds.labels[6:].tolist() == [1, 0, 2]  # val_0 -> n02, val_1 -> n01, val_2 -> n03
    for row, w in ((0, "n01"), (2, "n02"), (4, "n03")):
        mean_rgb = ds.images[row].float().mean(dim=(1, 2))
        assert torch.allclose(mean_rgb, torch.tensor(colour[w], dtype=torch.float32), atol=3)
    gray = ds.images[6].float()  # the grayscale val file, now 3 equal channels
    assert torch.allclose(gray[0], gray[1]) and abs(gray.mean().item() - 128) < 3


@pytest.mark.integration
def test_digits() -> None:
    ds = load_dataset(DataConfig(dataset="digits"), 0)
    assert ds.images.shape == (1797, 1, 8, 8) and ds.num_classes == 10
    assert ds.num_train == 1797 and int(ds.images.max()) == 255
    assert 0.0 < ds.mean[0] < 1.0 and 0.0 < ds.std[0] < 1.0


def test_synthetic_deterministic_and_learnable() -> None:
    cfg = DataConfig(dataset="synthetic", synthetic_size=600, synthetic_classes=6)
    a, b = load_dataset(cfg, 0), load_dataset(cfg, 0)
    assert a.images.shape == (600, 1, 28, 28) and a.images.dtype == torch.uint8
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, load_dataset(cfg, 1).images)
    assert torch.bincount(a.labels).tolist() == [100] * 6
    # Nearest class mean, fit on half, scores far above chance (1/6) on the other half.
    x, y = a.images.float().flatten(1), a.labels
    means = torch.stack([x[:300][y[:300] == c].mean(0) for c in range(6)])
    pred = torch.cdist(x[300:], means).argmin(1)
    assert (pred == y[300:]).float().mean() > 0.9


def _old_synthetic(seed: int, size: int, classes: int, shape: tuple[int, int, int]) -> np.ndarray:
    """The generator as it was before it worked in chunks: one float64 draw for every pixel."""
    rng = np.random.default_rng([seed % 2**64, 0x5EED])
    c, h, w = shape
    gh, gw = min(h, 4), min(w, 4)
    coarse = rng.uniform(0.15, 0.85, size=(classes, c, gh, gw))
    protos = coarse.repeat(-(-h // gh), axis=2).repeat(-(-w // gw), axis=3)[:, :, :h, :w]
    labels = rng.permutation(np.arange(size) % classes)
    noise = rng.normal(0.0, 0.2, size=(size, c, h, w))
    return np.rint(np.clip(protos[labels] + noise, 0.0, 1.0) * 255).astype(np.uint8)


@pytest.mark.parametrize(
    "args", [(0, 240, 4, (1, 28, 28)), (7, 12_000, 10, (3, 5, 7)), (2, 9000, 100, (3, 32, 32))]
)
@pytest.mark.golden
def test_synthetic_images_are_bitwise_the_same_in_chunks(args) -> None:
    from fedmosaic.data import datasets

    datasets.clear_cache()
    images, _ = datasets._synthetic(*args)
    assert np.array_equal(images.numpy(), _old_synthetic(*args))  # several chunks, same bits


def test_channel_stats_of_a_large_dataset_in_bounded_memory() -> None:
    from fedmosaic.data import datasets

    images = datasets._synthetic(1, 6000, 10, (3, 16, 16))[0]
    direct = datasets._channel_stats(images)  # small enough: the float64 computation
    bounded = datasets._channel_stats_bounded(images)  # exact sums: equal to ~1e-12
    for a, b in zip([*direct[0], *direct[1]], [*bounded[0], *bounded[1]], strict=True):
        assert b == pytest.approx(a, rel=1e-12) and np.float32(a) == np.float32(b)


@pytest.mark.integration
def test_synthetic_generation_stays_within_a_memory_ceiling() -> None:
    """120,000 images of 28x28 are 94 MB; generating them used to take ~2 GB of float64."""
    result = run_capped(
        """
        from fedmosaic.config import DataConfig
        from fedmosaic.data import load_dataset
        ds = load_dataset(DataConfig(dataset="synthetic", synthetic_size=120_000), 0)
        print("loaded", tuple(ds.images.shape), ds.mean, ds.std)
        """,
        headroom=768 << 20,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("loaded (120000, 1, 28, 28)"), result.stdout


def test_synthetic_shape_rgb() -> None:
    cfg = DataConfig(dataset="synthetic", synthetic_size=50, synthetic_shape=[3, 16, 12])
    ds = load_dataset(cfg, 3)
    assert ds.images.shape == (50, 3, 16, 12) and len(ds.mean) == 3
    with pytest.raises(DatasetError, match="synthetic_shape"):
        load_dataset(DataConfig(dataset="synthetic", synthetic_shape=[28, 28]), 0)
