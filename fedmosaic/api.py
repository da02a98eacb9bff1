"""The public API for writing your own method, model or dataset (stable across versions).

Everything a plugin needs is importable from here; modules starting with ``_`` and names not
listed below are internal. A plugin is a module or ``.py`` file named in the config's top-level
``plugins = [...]``; it is imported before names are looked up, in this process, in every
simulator worker and in the Flower apps::

    # my_method.py
    from dataclasses import dataclass
    from fedmosaic.api import ALGORITHMS, SharedWeights

    @ALGORITHMS.register("fedavg_plus")
    @dataclass(frozen=True)
    class FedAvgPlus(SharedWeights):
        ...

    # my.toml
    plugins = ["my_method.py"]
    [algorithm]
    name = "fedavg_plus"

Contracts: ``Algorithm`` (server half: ``init_server``, ``broadcast``, ``aggregate``,
``validate_upload``; client half: ``init_client``, ``receive``, ``phases``, ``loss``, ``upload``,
``predict``), payloads are frozen ``Payload`` dataclasses of tensors/state dicts/scalars, and
``SharedWeights`` is the average-a-part base of FedAvg/FedPer/FedRep/... (``shared`` = a part,
``aggregate`` overridable; see ``fedmosaic/algorithms/fedopt.py`` for server optimizers on it).
"""

from __future__ import annotations

from fedmosaic.algorithms._shared import (
    SharedState,
    SharedWeights,
    check_state_like,
    class_means,
    weighted_average,
)
from fedmosaic.config import ConfigError, ExperimentConfig, from_dict, load
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Phase, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Empty, Payload, PayloadError
from fedmosaic.core.registry import ALGORITHMS, DATASETS, ENCODERS, FAMILIES, PARTITIONERS
from fedmosaic.data import DatasetError, ImageDataset, PartitionError
from fedmosaic.experiment import run_experiment

__all__ = [
    "ALGORITHMS",
    "DATASETS",
    "ENCODERS",
    "FAMILIES",
    "PARTITIONERS",
    "Algorithm",
    "ClientData",
    "ClientModel",
    "ConfigError",
    "DatasetError",
    "Empty",
    "ExperimentConfig",
    "FederationSpec",
    "ImageDataset",
    "PartitionError",
    "Payload",
    "PayloadError",
    "Phase",
    "SharedState",
    "SharedWeights",
    "Weighted",
    "check_state_like",
    "class_means",
    "from_dict",
    "load",
    "run_experiment",
    "weighted_average",
]
