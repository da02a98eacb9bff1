"""Opt-in downloads (``data.download = true``) into the cache folder.

Only reached when a dataset is missing everywhere else and the user asked for a download; tests
never reach the network (they replace ``urlopen``). Every file comes over https and is checked
against the MD5 its publisher lists (``CHECKSUMS``; the values torchvision pins too) before it
takes its final name: a file that does not match is deleted and the download refused, and an
interrupted download never leaves a half file that looks complete. MD5 here guards integrity
against a corrupted or substituted mirror; the transport's authenticity comes from https.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

from fedmosaic.core.errors import DatasetError

MNIST_URLS = {
    # The S3 REST endpoint of the bucket behind the site's http-only website endpoint.
    "fmnist": "https://fashion-mnist.s3.eu-central-1.amazonaws.com/",
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
}
EMNIST_URL = "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"
CIFAR_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}
TINY_URL = "https://cs231n.stanford.edu/tiny-imagenet-200.zip"

# MD5 of every file we download, by URL (the publishers' listed values).
CHECKSUMS: dict[str, str] = {
    MNIST_URLS["fmnist"] + "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    MNIST_URLS["fmnist"] + "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    MNIST_URLS["fmnist"] + "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    MNIST_URLS["fmnist"] + "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    MNIST_URLS["mnist"] + "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    MNIST_URLS["mnist"] + "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    MNIST_URLS["mnist"] + "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    MNIST_URLS["mnist"] + "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    EMNIST_URL: "58c8d27c78d21e728a6bc7b3cc06412e",
    CIFAR_URLS["cifar10"]: "c58f30108f718f92721af3b95e74349a",
    CIFAR_URLS["cifar100"]: "eb9058c3a382ffc7106e4002c42a8d85",
    TINY_URL: "90528d7ca1a48142e341f4ef8d21d0de",
}


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, dest: Path) -> Path:
    """Download ``url`` to ``dest`` over https and check its pinned MD5 (skipped when present).

    A file already at ``dest`` is checked too: a corrupt or substituted cache is refused, naming
    the file, rather than read.
    """
    want = CHECKSUMS.get(url)
    if want is None:
        raise DatasetError(f"download of {url} refused: no pinned checksum for it")
    if not url.startswith("https://"):
        raise DatasetError(f"download of {url} refused: only https is used")
    if dest.is_file():
        if _md5(dest) != want:
            raise DatasetError(
                f"{dest}: checksum differs from {url}'s; delete it to download again"
            )
        return dest
    tmp = dest.with_name(dest.name + ".part")
    print(f"downloading {url} -> {dest}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out, length=1 << 20)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DatasetError(f"download of {url} failed: {exc}") from exc
    got = _md5(tmp)
    if got != want:
        tmp.unlink(missing_ok=True)
        raise DatasetError(f"download of {url} refused: MD5 {got} is not the pinned {want}")
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
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")  # "data" filter refuses links and absolute paths
        else:  # Python 3.10 before 3.10.12 has no filters: refuse the same members by hand
            root = dest.resolve()
            for m in tf.getmembers():
                if not (m.isfile() or m.isdir()) or not (root / m.name).resolve().is_relative_to(
                    root
                ):
                    raise DatasetError(f"{archive}: unsafe member {m.name!r}")
            tf.extractall(dest)


def fetch_tinyimagenet(dest: Path) -> None:
    archive = fetch(TINY_URL, dest / "tiny-imagenet-200.zip")
    _extract_zip(archive, dest)
