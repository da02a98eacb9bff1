"""Opt-in downloads (``data.download = true``) into the cache folder.

Only reached when a dataset is missing everywhere else and the user asked for a download; tests
never call it. Files are written to a temporary name and renamed, so an interrupted download
never leaves a half file that looks complete.
"""

from __future__ import annotations

import shutil
import tarfile
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

from fedmosaic.core.errors import DatasetError

MNIST_URLS = {
    "fmnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
}
EMNIST_URL = "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"
CIFAR_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}
TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"


def fetch(url: str, dest: Path) -> Path:
    """Download ``url`` to ``dest`` (skipped when it already exists)."""
    if dest.is_file():
        return dest
    tmp = dest.with_name(dest.name + ".part")
    print(f"downloading {url} -> {dest}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out, length=1 << 20)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DatasetError(f"download of {url} failed: {exc}") from exc
    tmp.rename(dest)
    return dest


def _extract_zip(archive: Path, dest: Path, members: Sequence[str] | None = None) -> None:
    root = dest.resolve()
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            if members is not None and info.filename not in members:
                continue
            target = (dest / info.filename).resolve()
            if not target.is_relative_to(root):  # refuse path traversal
                raise DatasetError(f"{archive}: unsafe member path {info.filename!r}")
            zf.extract(info, dest)


def fetch_mnist_like(name: str, dest: Path, stems: Sequence[str]) -> None:
    for stem in stems:
        fetch(MNIST_URLS[name] + f"{stem}.gz", dest / f"{stem}.gz")


def fetch_emnist(dest: Path, files: Sequence[str]) -> None:
    archive = fetch(EMNIST_URL, dest / "gzip.zip")
    # The archive holds gzip/<file>; extract just the split we need into dest/gzip/.
    _extract_zip(archive, dest, [f"gzip/{f}" for f in files])


def fetch_cifar(name: str, dest: Path) -> None:
    archive = fetch(CIFAR_URLS[name], dest / Path(CIFAR_URLS[name]).name)
    with tarfile.open(archive, "r:gz") as tf:
        tf.extractall(dest, filter="data")  # "data" filter refuses links and absolute paths


def fetch_tinyimagenet(dest: Path) -> None:
    archive = fetch(TINY_URL, dest / "tiny-imagenet-200.zip")
    _extract_zip(archive, dest)
