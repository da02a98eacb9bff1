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

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmosaic.algorithms._shared import (
    SharedState,
    SharedWeights,
    check_state_like,
    class_means,
    weighted_average,
)
from fedmosaic.config import ConfigError, ExperimentConfig, apply_overrides, from_dict, load
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Phase, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Empty, Payload, PayloadError
from fedmosaic.core.registry import ALGORITHMS, DATASETS, ENCODERS, FAMILIES, PARTITIONERS
from fedmosaic.data import DatasetError, ImageDataset, PartitionError
from fedmosaic.experiment import run_experiment

Config = str | Path | dict[str, Any] | ExperimentConfig


def experiment_config(config: Config, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """A validated config from a TOML path, a dict of its tables, or an ``ExperimentConfig``;
    ``overrides`` are ``--set``-style ``"section.key=value"`` strings. Plugins named in it are
    imported here."""
    if isinstance(config, ExperimentConfig):
        config = config.to_dict()
    if isinstance(config, dict):
        return from_dict(apply_overrides(copy.deepcopy(config), list(overrides)))
    return load(config, list(overrides))


def run(config: Config, overrides: Sequence[str] = (), progress: bool = False) -> dict[str, Any]:
    """Run one experiment on the simulator (``sim.backend``: serial or processes) and return its
    results document (what ``results.json`` holds: ``rounds``, ``clients``, ``summary``, ...)."""
    return run_experiment(experiment_config(config, overrides), progress=progress)


def run_flower_in_memory(
    config: Config, results_dir: str | Path, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """The same experiment through Flower's real ServerApp and ClientApp code over an in-process
    grid (one node per client, messages serialized as a SuperLink would); needs the ``flower``
    extra. Writes ``results.json`` under ``results_dir`` and returns it."""
    from fedmosaic.flower.app import client_app, run_server  # the optional flower extra
    from fedmosaic.flower.local import LocalGrid

    cfg = experiment_config(config, overrides)
    n = cfg.data.num_clients
    rc = {"experiment": json.dumps(cfg.to_dict()), "results-dir": str(results_dir)}
    nodes = [{"partition-id": i, "num-partitions": n} for i in range(n)]
    return run_server(LocalGrid(client_app, nodes, rc), rc)


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
    "experiment_config",
    "run",
    "run_experiment",
    "run_flower_in_memory",
    "weighted_average",
]
