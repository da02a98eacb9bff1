"""Memory a run needs, estimated from its config before anything is built, and what is free.

A run that cannot fit is refused in one line naming the keys that drive it, before any data is
generated, decompressed or partitioned (a ten-million-client federation used to partition for
minutes and end in a ``MemoryError`` traceback). The estimate is deliberately low (the fixed
costs measured on CPython 3.11 are rounded down, model state counts parameters and buffers
only), so only a run that clearly cannot fit is refused.

Torch-free: :mod:`fedmosaic.federation` adds the models' bytes (it builds them on the meta
device), and the data readers ask :func:`available_bytes` before they decompress.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from fedmosaic.config import DataConfig, synthetic_memory
from fedmosaic.core.errors import ConfigError

# Set to "0" to skip the check (an estimate is an estimate: a machine whose swap you trust).
ENV_SKIP = "FEDMOSAIC_MEMORY_CHECK"

# The built-in datasets' pools (official train + test): images and [C, H, W].
DATASET_SHAPES: dict[str, tuple[int, tuple[int, int, int]]] = {
    "fmnist": (70_000, (1, 28, 28)),
    "mnist": (70_000, (1, 28, 28)),
    "emnist-letters": (145_600, (1, 28, 28)),
    "emnist-balanced": (131_600, (1, 28, 28)),
    "cifar10": (60_000, (3, 32, 32)),
    "cifar100": (60_000, (3, 32, 32)),
    "tinyimagenet": (110_000, (3, 64, 64)),
    "digits": (1_797, (1, 8, 8)),
}
DATASET_CLASSES = {
    "fmnist": 10,
    "mnist": 10,
    "emnist-letters": 26,
    "emnist-balanced": 47,
    "cifar10": 10,
    "cifar100": 100,
    "tinyimagenet": 200,
    "digits": 10,
}

# Measured (20,000 synthetic clients, tests of this module): ~3.5 kB a client of index tensors,
# split records and per-client bookkeeping, plus 8 bytes a class for its class counts (24 here:
# the Dirichlet proportions are float64 too); ~40 bytes an image of labels and row indices.
PER_CLIENT_BYTES = 3_000
PER_CLIENT_CLASS_BYTES = 24
PER_IMAGE_BYTES = 40


@dataclass(frozen=True)
class Part:
    """One term of the estimate: what it is (naming its keys), its bytes and the keys to lower."""

    what: str
    nbytes: int
    keys: tuple[str, ...]


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping); None where
    there is none to read (then nothing is refused)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_enabled() -> bool:
    return os.environ.get(ENV_SKIP, "1").strip() not in ("0", "off", "false", "no")


def size_text(n: float) -> str:
    """Bytes in the docs' units (kB = 1000 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def dataset_key(d: DataConfig) -> str:
    return f"emnist-{d.emnist_split}" if d.dataset == "emnist" else d.dataset


def dataset_shape(d: DataConfig) -> tuple[int, tuple[int, int, int], int] | None:
    """(images, [C, H, W], classes) of ``d``'s pool, known without reading it; None for a
    dataset whose size only its files tell (hf, a plugin's)."""
    if d.dataset == "synthetic":
        c, h, w = (int(v) for v in d.synthetic_shape)
        return d.synthetic_size, (c, h, w), d.synthetic_classes
    key = dataset_key(d)
    if key not in DATASET_SHAPES:
        return None
    n, shape = DATASET_SHAPES[key]
    return n, shape, DATASET_CLASSES[key]


def data_parts(d: DataConfig) -> list[Part]:
    """The pooled images (uint8, all of them: ``subsample`` picks rows of the loaded pool) at
    their loading peak, and the clients' splits and records."""
    known = dataset_shape(d)
    parts: list[Part] = []
    classes = 0
    if known is not None:
        n, (c, h, w), classes = known
        pixels = c * h * w
        if d.dataset == "synthetic":
            images = synthetic_memory(d.synthetic_size, d.synthetic_classes, d.synthetic_shape)
            keys: tuple[str, ...] = ("data.synthetic_size", "data.synthetic_shape")
            what = f"data.synthetic_size = {n} images of {list(d.synthetic_shape)}"
        else:  # decoded and pooled (train + test concatenated): two copies at the peak
            images = 2 * n * pixels
            keys = ("data.dataset",)
            what = f'data.dataset = "{d.dataset}": {n} images of {[c, h, w]}'
        images += n * PER_IMAGE_BYTES
        if d.shift_rotation or d.shift_contrast != 1.0 or d.shift_brightness:
            images += n * pixels  # the shifted copy
        parts.append(Part(f"{what} = {size_text(images)}", images, keys))
    per_client = PER_CLIENT_BYTES + PER_CLIENT_CLASS_BYTES * classes
    parts.append(
        Part(
            f"data.num_clients = {d.num_clients} clients x {size_text(per_client)} of splits and "
            f"records = {size_text(d.num_clients * per_client)}",
            d.num_clients * per_client,
            ("data.num_clients",),
        )
    )
    return parts


def check_fits(parts: Sequence[Part], available: int | None = None) -> None:
    """A ConfigError (one line) when the parts add up to more than the available memory."""
    if not check_enabled():
        return
    free = available_bytes() if available is None else available
    if free is None:
        return
    need = sum(p.nbytes for p in parts)
    if need <= free:
        return
    shown = sorted((p for p in parts if p.nbytes >= 0.01 * need), key=lambda p: -p.nbytes)
    keys: list[str] = []
    for p in shown:
        keys += [k for k in p.keys if k not in keys]
    raise ConfigError(
        f"the run needs about {size_text(need)} ({'; '.join(p.what for p in shown)}); "
        f"{size_text(free)} is available: lower {' or '.join(keys)} "
        f"({ENV_SKIP}=0 skips this check)"
    )
