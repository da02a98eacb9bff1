"""A dataset split across clients: per-client train/val/test index tensors over one image tensor.

Images stay in one uint8 tensor; clients hold int64 row indices; :meth:`FederatedData.batch`
normalizes only the rows asked for. Random streams (all derived from ``seed``):

- subsample: ``default_rng([seed, 1])`` — stratified: ``round(subsample * n_c)`` rows per class
  (at least one for every class present), so class balance is kept;
- public split: ``default_rng([seed, 2])`` — a simple random ``public_size`` rows of the pool;
- server evaluation split: ``default_rng([seed, 5])`` — ``server_eval_size`` rows of what the
  public split left (so the two never overlap); off (0), the streams above are untouched;
- partition: ``default_rng(seed)`` — as the partitioner's ``rng``, over the remaining rows;
- per-client train/val/test: ``default_rng([seed, 3])``;
- feature shift (``data.shift_*``): ``default_rng([seed, 4])``, see :mod:`fedmosaic.data.shift`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from fedmosaic.config import DataConfig
from fedmosaic.data.datasets import DatasetError, ImageDataset, load_dataset
from fedmosaic.data.partition import partition
from fedmosaic.data.shift import apply_shift, draw_domains, shift_enabled

if TYPE_CHECKING:
    from matplotlib.colors import Colormap

SPLITS = ("train", "val", "test")


@dataclass
class ClientSplit:
    """One client's rows, as sorted int64 indices into the dataset."""

    train: Tensor
    val: Tensor  # empty unless validation is requested (val_fraction > 0 or split = 8_1_1)
    test: Tensor

    def get(self, split: str) -> Tensor:
        if split == "all":
            return torch.cat([self.train, self.val, self.test])
        if split not in SPLITS:
            raise ValueError(f"split {split!r}; choose one of train, val, test, all")
        return getattr(self, split)

    def __len__(self) -> int:
        return int(self.train.numel() + self.val.numel() + self.test.numel())


@dataclass
class FederatedData:
    """The federation's data: one image tensor, per-client splits, a server-held public split."""

    dataset: ImageDataset
    clients: list[ClientSplit]
    public: Tensor  # int64 indices of the server-held split (may be empty)
    mean: Tensor  # float32 [C]: the normalization actually used
    std: Tensor  # float32 [C]
    # per-client feature-shift transform (domain, rotation, contrast, brightness); [] when off
    shifts: list[dict[str, float]] = field(default_factory=list)
    # int64 indices of the server's labelled evaluation split (``data.server_eval_size``): never
    # a client's, disjoint from ``public``; empty when off
    server_eval: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    _per_device: dict[str, tuple[Tensor, Tensor, Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Images, mean and std on ``device``; a GPU gets one uint8 copy of all images, so
        batches are gathered there instead of being copied over per step."""
        key = str(device)
        if key not in self._per_device:
            images = self.dataset.images.to(device)
            c = self.mean.numel()
            self._per_device[key] = (
                images,
                self.mean.to(device).view(1, c, 1, 1),
                self.std.to(device).view(1, c, 1, 1),
            )
        return self._per_device[key]

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor:
        """Float32 normalized images ``[B, C, H, W]`` for dataset rows ``idx`` (int64 [B])."""
        dev = torch.device(device)
        images, mean, std = self._on(dev)
        x = images[idx.to(images.device)].to(torch.float32)  # [B, C, H, W] in 0..255
        return x.div_(255.0).sub_(mean).div_(std)

    @property
    def labels(self) -> Tensor:
        return self.dataset.labels

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.dataset.input_shape

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def label_histograms(self, split: str = "train") -> np.ndarray:
        """Per-client class counts ``[num_clients, num_classes]`` of ``split``
        (train | val | test | all)."""
        labels = self.dataset.labels
        out = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        for i, cs in enumerate(self.clients):
            rows = cs.get(split)
            out[i] = torch.bincount(labels[rows], minlength=self.num_classes).numpy()
        return out


def _stratified_subsample(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> np.ndarray:
    keep = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        n = max(1, round(fraction * idx.size))
        keep.append(rng.choice(idx, size=n, replace=False))
    return np.sort(np.concatenate(keep))


def _client_split(rows: np.ndarray, cfg: DataConfig, rng: np.random.Generator) -> ClientSplit:
    """Shuffle one client's rows and cut them into train / val / test."""
    rows = rng.permutation(rows)
    n = rows.size
    if cfg.split == "pool_75_25":
        # PFLlib: sklearn train_test_split(train_size=0.75) -> floor(0.75 n) train, rest test.
        n_train = int(0.75 * n)
        n_val = int(round(cfg.val_fraction * n_train))
        n_train -= n_val
    elif cfg.split == "8_1_1":
        n_train, n_val = int(0.8 * n), int(0.1 * n)
    else:
        raise DatasetError(f"data.split = {cfg.split!r}; choose pool_75_25 or 8_1_1")
    parts = np.split(rows, [n_train, n_train + n_val])  # train | val | test (the rest)
    return ClientSplit(*(torch.from_numpy(np.sort(p).astype(np.int64)) for p in parts))


def _carve_out(
    rows: np.ndarray, size: int, rng: np.random.Generator, too_big: str
) -> tuple[np.ndarray, np.ndarray]:
    """``size`` rows drawn with ``rng`` (sorted) and the rest, which never reach them; a ``size``
    that would leave no row is a DatasetError saying ``too_big``."""
    if size <= 0:
        return np.empty(0, dtype=np.int64), rows
    if size >= rows.size:
        raise DatasetError(too_big)
    pick = rng.choice(rows.size, size=size, replace=False)
    return np.sort(rows[pick]), np.delete(rows, pick)


def build_federated_data(cfg: DataConfig, seed: int) -> FederatedData:
    """Load ``cfg.dataset``, carve out the public split, partition the rest over clients and
    split each client's share. Same ``cfg`` and ``seed`` give identical indices; ``cfg.split_seed
    >= 0`` replaces ``seed`` here (one split under several experiment seeds)."""
    if cfg.split_seed >= 0:
        seed = cfg.split_seed
    ds = load_dataset(cfg, seed)
    seed %= 2**64  # numpy seeds must be >= 0; non-negative seeds are unchanged
    labels = ds.labels.numpy()
    rows = np.arange(len(ds), dtype=np.int64)
    if cfg.subsample < 1.0:
        rows = _stratified_subsample(labels, cfg.subsample, np.random.default_rng([seed, 1]))
    public, rows = _carve_out(
        rows,
        cfg.public_size,
        np.random.default_rng([seed, 2]),
        f"data.public_size = {cfg.public_size} leaves no samples for the clients: {ds.name} has "
        f"{rows.size} samples (after subsample = {cfg.subsample})",
    )
    # After the public rows: disjoint from them (the public split does not depend on it)
    server_eval, rows = _carve_out(
        rows,
        cfg.server_eval_size,
        np.random.default_rng([seed, 5]),
        f"data.server_eval_size = {cfg.server_eval_size} leaves no samples for the clients: "
        f"{rows.size} remain after subsample and the public split",
    )
    shares = partition(
        cfg.partition,
        labels[rows],
        cfg.num_clients,
        np.random.default_rng(seed),
        num_classes=ds.num_classes,
        alpha=cfg.alpha,
        classes_per_client=cfg.classes_per_client,
        min_size=cfg.min_size,
        max_tries=cfg.max_tries,
        quantity_alpha=cfg.quantity_alpha,
        power_law_exponent=cfg.power_law_exponent,
        quantity_labels=cfg.quantity_labels,
    )
    split_rng = np.random.default_rng([seed, 3])
    clients = [_client_split(rows[share], cfg, split_rng) for share in shares]
    empty = [i for i, cs in enumerate(clients) if cs.train.numel() == 0]
    if empty:  # such a client can neither train nor count in a weighted mean: a wrong setup
        shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
        raise DatasetError(
            f"{len(empty)} of {len(clients)} clients hold no training examples (clients "
            f"{shown}); lower data.num_clients or raise data.min_size ({rows.size} samples "
            f"to share)"
        )
    shifts: list[dict[str, float]] = []
    if shift_enabled(cfg):
        shifts = draw_domains(cfg, seed, len(clients))
        shifted = apply_shift(ds.images, [cs.get("all") for cs in clients], shifts)
        ds = dataclasses.replace(ds, images=shifted)
    if cfg.normalize == "half":
        mean, std = (0.5,) * ds.input_shape[0], (0.5,) * ds.input_shape[0]
    elif cfg.normalize == "dataset":
        mean, std = ds.mean, ds.std
    else:
        raise DatasetError(f"data.normalize = {cfg.normalize!r}; choose half or dataset")
    return FederatedData(
        dataset=ds,
        clients=clients,
        public=torch.from_numpy(public),
        mean=torch.tensor(mean, dtype=torch.float32),
        std=torch.tensor(std, dtype=torch.float32),
        shifts=shifts,
        server_eval=torch.from_numpy(server_eval),
    )


def format_histograms(fd: FederatedData, split: str = "train", max_columns: int = 30) -> str:
    """A text table of per-client class counts: one row per client, a column per class and a
    total. With more than ``max_columns`` classes, rows list the client's largest classes."""
    hist = fd.label_histograms(split)
    c = fd.num_classes
    title = f"{fd.dataset.name}: {fd.num_clients} clients, {c} classes, split = {split}"
    if fd.public.numel():
        title += f", public (server) = {fd.public.numel()}"
    if fd.server_eval.numel():
        title += f", server evaluation = {fd.server_eval.numel()}"
    if c <= max_columns:
        header = ["client", *(str(j) for j in range(c)), "total"]
        rows = [[str(i), *(str(v) for v in h), str(h.sum())] for i, h in enumerate(hist)]
        totals = hist.sum(axis=0)
        rows.append(["all", *(str(v) for v in totals), str(totals.sum())])
    else:
        header = ["client", "total", "classes", "largest (class:count)"]
        rows = []
        for i, h in enumerate(hist):
            top = np.argsort(-h, kind="stable")[:8]
            largest = " ".join(f"{j}:{h[j]}" for j in top if h[j] > 0)
            rows.append([str(i), str(h.sum()), str(int((h > 0).sum())), largest])
        rows.append(["all", str(hist.sum()), str(int((hist.sum(0) > 0).sum())), ""])
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]
    lines = [title, " ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append(" ".join("-" * w for w in widths))
    lines += [" ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def plot_histograms(fd: FederatedData, path: str | Path, split: str = "train") -> None:
    """Write a PNG of per-client class counts: stacked bars (<= 20 classes) or a heatmap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hist = fd.label_histograms(split)
    n, c = hist.shape
    fig = Figure(figsize=(max(6.0, 0.35 * n + 2), 4.5))
    FigureCanvasAgg(fig)  # Agg canvas without touching pyplot's global backend
    ax = fig.add_subplot()
    clients = np.arange(n)
    if c <= 20:
        cmap = _colormap(c)
        bottom = np.zeros(n)
        for j in range(c):
            ax.bar(clients, hist[:, j], bottom=bottom, color=cmap(j), label=str(j), width=0.8)
            bottom += hist[:, j]
        ax.legend(title="class", fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_ylabel("samples")
    else:
        im = ax.imshow(hist.T, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(im, ax=ax, label="samples")
        ax.set_ylabel("class")
    ax.set_xlabel("client")
    ax.set_title(f"{fd.dataset.name}: {split} labels per client")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)


def _colormap(c: int) -> Colormap:
    from matplotlib import colormaps

    return colormaps["tab10" if c <= 10 else "tab20"]
