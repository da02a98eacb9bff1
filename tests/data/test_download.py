"""Opt-in downloads: https only, every file checked against its pinned MD5, nothing half-written.

The network is never reached: ``urlopen`` is replaced by a fake that serves chosen bytes.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from fedmosaic.data import _download
from fedmosaic.data._download import CHECKSUMS, fetch
from fedmosaic.data.datasets import MNIST_FILES, DatasetError

URL = "https://example.org/data.bin"
GOOD = b"the real bytes" * 100


@pytest.fixture
def served(monkeypatch):
    """``urlopen`` serving ``body['bytes']``; URL pinned to GOOD's MD5; calls counted."""
    body = {"bytes": GOOD, "calls": 0}

    def urlopen(url, timeout):
        body["calls"] += 1
        return io.BytesIO(body["bytes"])

    monkeypatch.setattr(_download.urllib.request, "urlopen", urlopen)
    monkeypatch.setitem(CHECKSUMS, URL, hashlib.md5(GOOD).hexdigest())
    return body


def test_a_matching_download_lands_under_its_name(tmp_path: Path, served):
    dest = tmp_path / "data.bin"
    assert fetch(URL, dest) == dest and dest.read_bytes() == GOOD
    assert fetch(URL, dest) == dest and served["calls"] == 1  # cached, checked, not fetched again


def test_a_substituted_file_is_refused_and_nothing_is_left(tmp_path: Path, served):
    served["bytes"] = b"a mirror's other bytes"
    dest = tmp_path / "data.bin"
    with pytest.raises(DatasetError, match="MD5 .* is not the pinned"):
        fetch(URL, dest)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its .part


def test_a_corrupt_cached_file_is_refused_naming_it(tmp_path: Path, served):
    dest = tmp_path / "data.bin"
    dest.write_bytes(GOOD[:-1])
    with pytest.raises(DatasetError, match="data.bin: checksum differs"):
        fetch(URL, dest)
    assert served["calls"] == 0


def test_plain_http_and_unpinned_urls_are_refused(tmp_path: Path, served, monkeypatch):
    http = "http://example.org/data.bin"
    monkeypatch.setitem(CHECKSUMS, http, hashlib.md5(GOOD).hexdigest())
    with pytest.raises(DatasetError, match="only https"):
        fetch(http, tmp_path / "a")
    with pytest.raises(DatasetError, match="no pinned checksum"):
        fetch("https://example.org/other.bin", tmp_path / "b")
    assert served["calls"] == 0


def test_every_download_url_is_https_and_pinned():
    urls = [
        *(_download.MNIST_URLS[n] + f"{s}.gz" for n in _download.MNIST_URLS for s in MNIST_FILES),
        _download.EMNIST_URL,
        *_download.CIFAR_URLS.values(),
        _download.TINY_URL,
    ]
    for url in urls:
        assert url.startswith("https://"), url
        assert len(CHECKSUMS[url]) == 32, url
