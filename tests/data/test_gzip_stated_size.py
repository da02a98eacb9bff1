"""A gzip IDX file is checked against the size its header states while it streams (issue 37).

A header promising 1.5 GB used to be decompressed in full (45 s, 3.2 GB) before it was refused.
Now the header is read from the first kB of the stream and a stated size above the cap, above
what the compressed bytes can expand to, or above the available memory is refused there.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import pytest
from dataset_files import idx_bytes, isolate_search, write_mnist
from helpers.experiments import run_capped, tiny_raw, write_toml

from fedmosaic import memory
from fedmosaic.cli import main
from fedmosaic.data import DatasetError, datasets, read_idx


def _header(*dims: int) -> bytes:
    return bytes([0, 0, 8, len(dims)]) + b"".join(n.to_bytes(4, "big") for n in dims)


def _zeros_gz(nbytes: int) -> bytes:
    """``nbytes`` zeros as one gzip member (~1 kB a MB), compressed a chunk at a time."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    return b"".join([*(c.compress(chunk) for _ in range(nbytes >> 20)), c.flush()])


def _refused_capped(path: Path, headroom: int) -> tuple[float, str]:
    """read_idx(path) in a child capped at ``headroom`` bytes: (seconds, message) of its
    refusal (the old reader decompressed the body: MemoryError there)."""
    result = run_capped(
        f"""
        import time
        from fedmosaic.data import DatasetError, read_idx
        start = time.perf_counter()
        try:
            read_idx({str(path)!r})
        except DatasetError as exc:
            print("refused", time.perf_counter() - start, exc)
        """,
        headroom=headroom,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    verdict, seconds, message = result.stdout.strip().split(" ", 2)
    assert verdict == "refused", result.stdout
    return float(seconds), message


def test_a_header_promising_a_huge_count_is_refused_before_decompressing(tmp_path: Path) -> None:
    """2**31 images of 28x28 promised; 256 MiB of zeros behind the header (256 kB on disk)."""
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(_header(2**31, 28, 28)) + _zeros_gz(256 << 20))
    seconds, message = _refused_capped(f, headroom=64 << 20)
    assert str(f) in message and "header states" in message, message
    assert "no dataset file decompresses to more than" in message, message
    assert seconds < 1.0, message


def test_a_header_promising_one_and_a_half_gigabytes_is_refused_by_the_cap(tmp_path: Path):
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(_header(2_000_000, 28, 28) + bytes(64 << 20)))  # 1.57 GB stated
    seconds, message = _refused_capped(f, headroom=32 << 20)
    assert f"header states {2_000_000 * 784 + 16} bytes" in message, message
    assert seconds < 1.0, message


def test_a_header_promising_more_than_the_file_can_hold_is_refused(tmp_path: Path) -> None:
    """200 MB stated (under the cap) in a 16 kB file: deflate cannot expand it that far."""
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(_header(255_000, 28, 28) + bytes(16 << 20)))
    seconds, message = _refused_capped(f, headroom=8 << 20)
    assert "can hold" in message and "truncated or not a dataset file" in message, message
    assert seconds < 1.0, message


def test_a_header_promising_more_than_the_available_memory_is_refused(
    tmp_path: Path, monkeypatch
) -> None:
    f = tmp_path / "train-images-idx3-ubyte.gz"
    body = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    f.write_bytes(gzip.compress(_header(1000, 100, 100) + body))  # 10 MB stated, 1 MB on disk
    monkeypatch.setattr(memory, "available_bytes", lambda: 5_000_000)
    seen: list[int] = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, *args):
            self._d = real(*args)

        def decompress(self, data, max_length=0):
            out = self._d.decompress(data, max_length)
            seen.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self._d, name)

    monkeypatch.setattr(datasets.zlib, "decompressobj", Counting)
    with pytest.raises(DatasetError, match=r"header states 10000016 bytes .* is available"):
        read_idx(f)
    assert sum(seen) <= 4096, seen  # the header's kB, nothing more
    monkeypatch.setenv(memory.ENV_SKIP, "0")  # the opt-out reads it (and finds it truncated)
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(f)


def test_output_past_the_stated_size_stops_the_stream(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(_header(10, 4, 4) + bytes(8 << 20)))  # 176 bytes stated
    with pytest.raises(DatasetError, match="more than the 176 bytes its header states"):
        read_idx(f)


def test_an_honest_gzip_file_is_read_writable(tmp_path: Path) -> None:
    arr = np.arange(5 * 4 * 4, dtype=np.uint8).reshape(5, 4, 4)
    f = tmp_path / "x-idx3-ubyte.gz"
    f.write_bytes(gzip.compress(idx_bytes(arr)))
    got = read_idx(f, ndim=3)
    assert np.array_equal(got, arr) and got.flags.writeable
    plain = tmp_path / "y-idx3-ubyte"
    plain.write_bytes(idx_bytes(arr))
    got = read_idx(plain, ndim=3)
    assert np.array_equal(got, arr) and got.flags.writeable


def test_a_file_larger_than_the_cap_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "x-idx3-ubyte"
    f.write_bytes(idx_bytes(np.zeros((64, 4, 4), dtype=np.uint8)))
    monkeypatch.setattr(datasets, "MAX_DECOMPRESSED", 512)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read"))
    with pytest.raises(DatasetError, match=r"1040 bytes, more than the 512 bytes"):
        read_idx(f)


def test_the_cli_refuses_a_lying_gzip_header_in_one_line(tmp_path: Path, capsys, monkeypatch):
    isolate_search(monkeypatch, tmp_path)
    root = tmp_path / "mnist"
    write_mnist(root, n_train=60, n_test=20)
    (root / "train-images-idx3-ubyte").unlink()
    bomb = root / "train-images-idx3-ubyte.gz"
    bomb.write_bytes(gzip.compress(_header(2**31, 28, 28)) + _zeros_gz(16 << 20))
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(algorithm={"name": "local"}))
    out = tmp_path / "out"
    args = ["run", str(cfg), "--out", str(out), "--quiet"]
    for s in ["data.dataset=mnist", f'data.root="{root}"', "data.public_size=0"]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bomb) in err[0] and "header states" in err[0], err
    assert not out.exists()
