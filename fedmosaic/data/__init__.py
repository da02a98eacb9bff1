"""Datasets, partitioners and per-client splits. Importing this package registers every dataset
loader in ``DATASETS`` and every partitioner in ``PARTITIONERS``."""

from fedmosaic.data import datasets as _datasets
from fedmosaic.data import hf  # noqa: F401  (registers dataset "hf")
from fedmosaic.data.datasets import (
    STATS,
    DatasetError,
    ImageDataset,
    load_dataset,
    load_pickle,
    read_idx,
    search_dirs,
)
from fedmosaic.data.federated import (
    ClientSplit,
    FederatedData,
    build_federated_data,
    format_histograms,
    plot_histograms,
)
from fedmosaic.data.partition import (
    PartitionError,
    dirichlet,
    iid,
    partition,
    pathological,
    skewed,
)


def clear_cache() -> None:
    """Forget every decoded dataset held by this process (the built-in loaders' and the local
    Hugging Face adapter's)."""
    _datasets.clear_cache()
    hf.clear_cache()


__all__ = [
    "STATS",
    "ClientSplit",
    "DatasetError",
    "FederatedData",
    "ImageDataset",
    "PartitionError",
    "build_federated_data",
    "clear_cache",
    "dirichlet",
    "format_histograms",
    "iid",
    "load_dataset",
    "load_pickle",
    "partition",
    "pathological",
    "plot_histograms",
    "read_idx",
    "search_dirs",
    "skewed",
]
