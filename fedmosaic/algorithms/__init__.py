"""Every algorithm module in this package registers itself in ``ALGORITHMS`` on import."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from fedmosaic.core.algorithm import Algorithm
from fedmosaic.core.registry import ALGORITHMS

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")


def build_algorithm(table: dict[str, Any]) -> Algorithm:
    """Construct an algorithm from its ``[algorithm]`` table: ``name`` plus hyperparameters."""
    from fedmosaic.config import ConfigError, build_dataclass

    params = dict(table)
    name = params.pop("name", None)
    if not isinstance(name, str):
        raise ConfigError("algorithm.name must be a string")
    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm.name = {name!r} is unknown; known: {', '.join(ALGORITHMS.names())}"
        )
    return build_dataclass(ALGORITHMS.get(name), params, "algorithm")


__all__ = ["ALGORITHMS", "build_algorithm"]
