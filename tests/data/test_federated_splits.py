"""build_federated_data: public split, per-client train/val/test, normalization, histograms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_files import isolate_search, write_mnist

from fedmosaic.config import DataConfig
from fedmosaic.data import (
    DatasetError,
    FederatedData,
    PartitionError,
    build_federated_data,
    format_histograms,
    plot_histograms,
)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_search(monkeypatch, tmp_path)


def cfg(**kw) -> DataConfig:
    base = dict(
        dataset="synthetic",
        synthetic_size=1200,
        synthetic_classes=6,
        synthetic_shape=[1, 8, 8],
        num_clients=6,
        partition="dirichlet",
        alpha=0.5,
        min_size=20,
    )
    return DataConfig(**{**base, **kw})


def all_rows(fd: FederatedData) -> list[np.ndarray]:
    return [cs.get("all").numpy() for cs in fd.clients]


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological", "skewed"])
def test_public_split_disjoint_from_clients(partition: str) -> None:
    fd = build_federated_data(cfg(partition=partition, public_size=100), 0)
    public = set(fd.public.tolist())
    assert len(public) == 100 and fd.public.dtype == torch.int64
    client_rows = np.concatenate(all_rows(fd))
    assert public.isdisjoint(client_rows.tolist())
    assert np.unique(client_rows).size == client_rows.size  # clients are disjoint too
    if partition != "skewed":  # every other partition hands out the whole remaining pool
        assert len(public) + client_rows.size == 1200


@pytest.mark.parametrize("split", ["pool_75_25", "8_1_1"])
def test_client_splits_disjoint_and_cover_share(split: str) -> None:
    fd = build_federated_data(cfg(split=split, val_fraction=0.2), 0)
    for cs in fd.clients:
        tr, va, te = (set(t.tolist()) for t in (cs.train, cs.val, cs.test))
        assert tr.isdisjoint(va) and tr.isdisjoint(te) and va.isdisjoint(te)
        assert len(tr | va | te) == len(cs)
        for t in (cs.train, cs.val, cs.test):
            assert t.dtype == torch.int64 and torch.all(t[1:] > t[:-1])


def test_pool_75_25_proportions() -> None:
    fd = build_federated_data(cfg(), 0)
    for cs in fd.clients:
        n = len(cs)
        assert cs.train.numel() == int(0.75 * n) and cs.val.numel() == 0
        assert cs.test.numel() == n - int(0.75 * n)


def test_pool_75_25_with_validation() -> None:
    fd = build_federated_data(cfg(val_fraction=0.2), 0)
    for cs in fd.clients:
        n = len(cs)
        n_fit = int(0.75 * n)  # the train part before validation is held out
        assert cs.val.numel() == round(0.2 * n_fit)
        assert cs.train.numel() + cs.val.numel() == n_fit


def test_8_1_1_proportions() -> None:
    fd = build_federated_data(cfg(split="8_1_1", partition="iid", num_clients=4), 0)
    for cs in fd.clients:
        assert (cs.train.numel(), cs.val.numel(), cs.test.numel()) == (240, 30, 30)


def test_deterministic_in_seed() -> None:
    c = cfg(public_size=50, val_fraction=0.1)
    a, b, other = (build_federated_data(c, s) for s in (0, 0, 1))
    assert torch.equal(a.public, b.public)
    for x, y in zip(a.clients, b.clients):
        assert all(torch.equal(x.get(s), y.get(s)) for s in ("train", "val", "test"))
    assert not all(torch.equal(x.train, y.train) for x, y in zip(a.clients, other.clients))


def test_normalization_half() -> None:
    fd = build_federated_data(cfg(), 0)
    assert fd.mean.tolist() == [0.5] and fd.std.tolist() == [0.5]
    idx = fd.clients[0].train[:7]
    x = fd.batch(idx)
    assert x.shape == (7, 1, 8, 8) and x.dtype == torch.float32
    expected = (fd.dataset.images[idx].float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(x, expected)
    assert x.min() >= -1.0 and x.max() <= 1.0


def test_normalization_dataset_stats() -> None:
    fd = build_federated_data(cfg(synthetic_shape=[3, 4, 4], normalize="dataset"), 0)
    ds = fd.dataset
    torch.testing.assert_close(fd.mean, torch.tensor(ds.mean, dtype=torch.float32))
    torch.testing.assert_close(fd.std, torch.tensor(ds.std, dtype=torch.float32))
    x = fd.batch(torch.arange(len(ds)))  # the whole dataset: ~zero mean, unit std per channel
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-3, rtol=0)


def test_properties_and_histograms() -> None:
    fd = build_federated_data(cfg(val_fraction=0.1), 0)
    assert fd.input_shape == (1, 8, 8) and fd.num_classes == 6 and fd.num_clients == 6
    for split in ("train", "val", "test", "all"):
        h = fd.label_histograms(split)
        assert h.shape == (6, 6)
        assert h.sum(1).tolist() == [cs.get(split).numel() for cs in fd.clients]
    np.testing.assert_array_equal(
        fd.label_histograms("all"),
        sum(fd.label_histograms(s) for s in ("train", "val", "test")),
    )
    text = format_histograms(fd)
    lines = text.splitlines()
    assert "synthetic" in lines[0] and lines[1].split() == ["client", *map(str, range(6)), "total"]
    assert len(lines) == 3 + 6 + 1  # title, header, rule, one row per client, totals


def test_wide_histogram_table() -> None:
    fd = build_federated_data(cfg(synthetic_classes=40, num_clients=3, alpha=1.0), 0)
    text = format_histograms(fd)
    assert "largest (class:count)" in text and len(text.splitlines()) == 3 + 3 + 1


def test_plot_histograms(tmp_path: Path) -> None:
    fd = build_federated_data(cfg(), 0)
    out = tmp_path / "hist.png"
    plot_histograms(fd, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_subsample_stratified() -> None:
    fd = build_federated_data(cfg(subsample=0.25, partition="iid"), 0)
    counts = fd.label_histograms("all").sum(0)
    assert counts.tolist() == [50] * 6  # 200 per class in the full synthetic set


def test_public_too_large() -> None:
    with pytest.raises(DatasetError, match="public_size"):
        build_federated_data(cfg(public_size=1200), 0)


def test_partition_error_propagates() -> None:
    with pytest.raises(PartitionError):
        build_federated_data(cfg(partition="pathological", classes_per_client=7), 0)


def test_real_format_end_to_end(tmp_path: Path) -> None:
    write_mnist(tmp_path, n_train=60, n_test=20, gz=True)
    fd = build_federated_data(
        DataConfig(dataset="mnist", root=str(tmp_path), num_clients=4, partition="iid"), 0
    )
    assert fd.input_shape == (1, 28, 28) and sum(len(c) for c in fd.clients) == 80


@pytest.mark.slow
def test_real_fashion_mnist(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedmosaic.data import datasets

    root = Path("/usr/share/datasets/fashion-mnist")
    if not (root / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    # Found through the system search path (no data.root), as a user without settings would.
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", {"fmnist": [root]})
    fd = build_federated_data(DataConfig(dataset="fmnist", num_clients=20), 0)
    ds = fd.dataset
    assert ds.images.shape == (70000, 1, 28, 28) and ds.num_train == 60000
    assert ds.num_classes == 10 and torch.bincount(ds.labels).tolist() == [7000] * 10
    assert abs(ds.images[:60000].float().mean().item() / 255 - ds.mean[0]) < 1e-3
    assert sum(len(c) for c in fd.clients) == 70000
