"""Broken dataset files raise DatasetError naming the file and the problem."""

from __future__ import annotations

import gzip
import pickle
import zlib
from pathlib import Path

import numpy as np
import pytest
from dataset_files import idx_bytes, isolate_search, write_cifar, write_idx, write_mnist, write_tiny
from helpers.experiments import run_capped

from fedmosaic.config import DataConfig
from fedmosaic.data import DatasetError, load_dataset, read_idx

IMAGES = np.zeros((5, 4, 4), dtype=np.uint8)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_search(monkeypatch, tmp_path)


def test_truncated_idx(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte"
    data = idx_bytes(IMAGES)
    path.write_bytes(data[:-7])
    with pytest.raises(DatasetError) as err:
        read_idx(path)
    msg = str(err.value)
    assert str(path) in msg and "truncated" in msg
    assert f"expected {len(data)} bytes" in msg and f"found {len(data) - 7}" in msg


def test_truncated_header(tmp_path: Path) -> None:
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(idx_bytes(IMAGES)[:9])
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(path)


def test_trailing_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(idx_bytes(IMAGES) + b"\0\0")
    with pytest.raises(DatasetError, match="trailing bytes"):
        read_idx(path)


@pytest.mark.parametrize(
    "magic, problem",
    [
        (b"\x08\x03\x00\x00", "not an IDX file"),
        (b"\x00\x00\x0d\x03", "data type 0x0d"),  # float32 IDX: not what image files hold
    ],
)
def test_wrong_magic(tmp_path: Path, magic: bytes, problem: str) -> None:
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(magic + idx_bytes(IMAGES)[4:])
    with pytest.raises(DatasetError, match=problem) as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_wrong_ndim(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "labels-idx1-ubyte", IMAGES)
    with pytest.raises(DatasetError, match="3 dimensions.*expected 1"):
        read_idx(path, ndim=1)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gzip(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    data = gzip.compress(idx_bytes(IMAGES))
    path.write_bytes(b"not gzip at all" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DatasetError, match="corrupt gzip") as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_count_mismatch_names_both_files(tmp_path: Path) -> None:
    write_mnist(tmp_path, n_train=30)
    labels = tmp_path / "train-labels-idx1-ubyte"
    write_idx(labels, np.zeros(29, dtype=np.uint8))
    with pytest.raises(DatasetError) as err:
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)), 0)
    msg = str(err.value)
    assert str(tmp_path / "train-images-idx3-ubyte") in msg and str(labels) in msg
    assert "30 images" in msg and "29 labels" in msg


def test_corrupt_file_inside_dataset(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=True)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:20])
    with pytest.raises(DatasetError, match="corrupt gzip") as err:
        load_dataset(DataConfig(dataset="fmnist", root=str(tmp_path)), 0)
    assert str(bad) in str(err.value)


def test_label_out_of_range(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.full(10, 11, dtype=np.uint8))
    with pytest.raises(DatasetError, match=r"labels span \[0, 11\]"):
        load_dataset(DataConfig(dataset="mnist", root=str(tmp_path)), 0)


def test_missing_dataset_lists_search(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found") as err:
        load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)), 0)
    assert str(tmp_path / "cifar-10-batches-py") in str(err.value)


def test_truncated_cifar_pickle(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder, "cifar10")
    bad = folder / "data_batch_3"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(DatasetError, match="corrupt or unsupported pickle") as err:
        load_dataset(DataConfig(dataset="cifar10", root=str(tmp_path)), 0)
    assert str(bad) in str(err.value)


def test_cifar_wrong_content(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    write_cifar(folder, "cifar100")
    bad = folder / "test"
    data = np.zeros((2, 100), dtype=np.uint8)
    bad.write_bytes(pickle.dumps({b"data": data, b"fine_labels": [0, 1]}))
    with pytest.raises(DatasetError, match=r"uint8 \[N, 3072\]") as err:
        load_dataset(DataConfig(dataset="cifar100", root=str(tmp_path)), 0)
    assert str(bad) in str(err.value)
    bad.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}))
    with pytest.raises(DatasetError, match="no 'fine_labels' entry"):
        load_dataset(DataConfig(dataset="cifar100", root=str(tmp_path)), 0)


def test_tiny_missing_val_image(tmp_path: Path) -> None:
    root = tmp_path / "tiny-imagenet-200"
    write_tiny(root, ["n01", "n02"])
    (root / "val" / "images" / "val_1.JPEG").unlink()
    with pytest.raises(DatasetError, match="listed in .* but missing") as err:
        load_dataset(DataConfig(dataset="tinyimagenet", root=str(tmp_path)), 0)
    assert "val_1.JPEG" in str(err.value)


def test_tiny_corrupt_jpeg(tmp_path: Path) -> None:
    root = tmp_path / "tiny-imagenet-200"
    write_tiny(root, ["n01", "n02"])
    bad = root / "train" / "n02" / "images" / "n02_1.JPEG"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DatasetError, match="cannot decode image") as err:
        load_dataset(DataConfig(dataset="tinyimagenet", root=str(tmp_path)), 0)
    assert str(bad) in str(err.value)


# ---- hostile files (issue 12): bounded, refused by name, nothing read outside the root ----------


def test_gzip_bomb_stops_at_the_limit(tmp_path: Path, monkeypatch) -> None:
    from fedmosaic.data import datasets

    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    bomb.write_bytes(gzip.compress(b"\0" * (8 << 20)))  # 8 MiB of zeros, ~8 KB compressed
    monkeypatch.setattr(datasets, "MAX_DECOMPRESSED", 1 << 20)
    with pytest.raises(DatasetError, match="decompresses to more than"):
        datasets._gunzip_bounded(bomb, bomb.read_bytes(), datasets.MAX_DECOMPRESSED)
    ok = tmp_path / "ok.gz"
    ok.write_bytes(gzip.compress(b"abc") + gzip.compress(b"def"))  # two members
    assert datasets._read_bytes(ok) == b"abcdef"


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02" + b"(" * 1000 + b"l" * 1000 + b".",  # nested lists (MARK ... LIST)
        b"\x80\x02K\x01" + b"\x85" * 1000 + b".",  # nested 1-tuples
        b"\x80\x02c__builtin__\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R.",  # bytearray(2**31)
    ],
    ids=["nested-lists", "nested-tuples", "bytearray-2GB"],
)
def test_hostile_pickles_are_refused_before_they_cost_anything(tmp_path: Path, payload) -> None:
    from fedmosaic.data.datasets import load_pickle

    f = tmp_path / "data_batch_1"
    f.write_bytes(payload)
    with pytest.raises(DatasetError, match=str(f)):
        load_pickle(f)


def test_an_explicit_root_missing_a_file_never_falls_back(tmp_path: Path, monkeypatch) -> None:
    good = tmp_path / "system"
    write_mnist(good)
    monkeypatch.setenv("FEDMOSAIC_DATA", str(good))  # a complete copy elsewhere
    partial = tmp_path / "mine"
    write_mnist(partial)
    next(partial.iterdir()).unlink()
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(DataConfig(dataset="mnist", root=str(partial)), 0)


def test_tiny_imagenet_annotations_cannot_point_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "tiny-imagenet-200"
    write_tiny(root, ["n01", "n02"])
    ann = root / "val" / "val_annotations.txt"
    lines = ann.read_text().splitlines()
    first = lines[0].split("\t")
    secret = tmp_path / "secret.JPEG"
    secret.write_bytes((root / "val" / "images" / first[0]).read_bytes())
    lines[0] = "\t".join(["../../../secret.JPEG", *first[1:]])
    ann.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match="outside"):
        load_dataset(DataConfig(dataset="tinyimagenet", root=str(root)), 0)


@pytest.fixture(scope="module")
def gigabyte_of_zeros() -> bytes:
    """1 GiB of zeros as one gzip member (~4.7 MB), compressed a chunk at a time."""
    c = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 24)
    return b"".join([*(c.compress(zeros) for _ in range(64)), c.flush()])


@pytest.mark.parametrize("header", ["idx-header", "no-header"])
@pytest.mark.integration
def test_a_gzip_bomb_is_refused_by_name_within_two_seconds(
    tmp_path: Path, gigabyte_of_zeros: bytes, header: str
) -> None:
    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    # A valid header (10 images of 28x28) as its own gzip member in front of the zeros.
    dims = b"".join(n.to_bytes(4, "big") for n in (10, 28, 28))
    head = gzip.compress(bytes([0, 0, 8, 3]) + dims) if header == "idx-header" else b""
    bomb.write_bytes(head + gigabyte_of_zeros)
    result = run_capped(
        f"""
        import time
        from fedmosaic.data import DatasetError, read_idx
        start = time.perf_counter()
        try:
            read_idx({str(bomb)!r})
        except DatasetError as exc:
            print("refused", time.perf_counter() - start, exc)
        """,
        headroom=512 << 20,  # the old reader held the whole GiB
    )
    assert result.returncode == 0, result.stderr[-2000:]
    verdict, seconds, message = result.stdout.strip().split(" ", 2)
    assert verdict == "refused" and str(bomb) in message, result.stdout
    assert float(seconds) < 2.0, result.stdout


def _shared_reference_pickle(levels: int = 10, fanout: int = 10) -> bytes:
    """A CIFAR batch dict whose labels are ``levels`` nested lists, each of ``fanout`` references
    to the list below (memo ops: BINPUT/BINGET): fanout**levels leaves in a few hundred bytes."""
    ops = b"](" + b"K\x01" * fanout + b"eq\xc8"  # level 0: [1] * fanout, memo 200
    for level in range(1, levels):  # pop the level below (it stays in the memo), refer to it
        below, here = bytes([199 + level]), bytes([200 + level])
        ops += b"0](" + b"h" + below + (b"h" + below) * (fanout - 1) + b"eq" + here
    data = np.zeros((1, 3072), dtype=np.uint8)
    body = pickle.dumps({b"batch_label": b"x", b"data": data, b"labels": None}, protocol=2)
    assert body.startswith(b"\x80\x02") and body.endswith(b"Nu.")  # labels: None, last
    top = bytes([200 + levels - 1])
    return b"\x80\x02" + ops + b"0" + body[2:-3] + b"h" + top + b"u."


def test_the_pickle_walk_counts_shared_references() -> None:
    small = pickle.loads(_shared_reference_pickle(levels=3, fanout=4))
    assert np.asarray(small[b"labels"]).shape == (4, 4, 4)  # the builder builds what it says
    from fedmosaic.data import datasets

    datasets._check_pickle_size(Path("x"), small)  # 64 leaves: fine
    looped: list = [1]
    looped.append(looped)
    with pytest.raises(DatasetError, match="contains itself"):
        datasets._check_pickle_size(Path("x"), looped)


@pytest.mark.integration
def test_a_pickle_of_shared_references_is_refused_by_name_in_milliseconds(tmp_path: Path) -> None:
    root = tmp_path / "cifar"
    write_cifar(root, "cifar10")
    bomb = root / "data_batch_1"
    bomb.write_bytes(_shared_reference_pickle())  # 10^10 labels once materialized
    result = run_capped(
        f"""
        import time
        from fedmosaic.config import DataConfig
        from fedmosaic.data import DatasetError, load_dataset
        start = time.perf_counter()
        try:
            load_dataset(DataConfig(dataset="cifar10", root={str(root)!r}), 0)
        except DatasetError as exc:
            print("refused", time.perf_counter() - start, exc)
        """,
        headroom=2 << 30,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    verdict, seconds, message = result.stdout.strip().split(" ", 2)
    assert verdict == "refused" and str(bomb) in message and "shared references" in message
    assert float(seconds) < 0.5, result.stdout
