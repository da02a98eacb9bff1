"""Every algorithm module in this package registers itself in ``ALGORITHMS`` on import."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from fedmosaic.core.algorithm import Algorithm
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.typed import build_dataclass

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")


def build_algorithm(table: dict[str, Any]) -> Algorithm:
    """Construct an algorithm from its ``[algorithm]`` table: ``name`` plus hyperparameters."""
    params = dict(table)
    name = params.pop("name", None)
    if not isinstance(name, str):
        raise ConfigError("algorithm.name must be a string")
    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm.name = {name!r} is unknown; known: {', '.join(ALGORITHMS.names())}"
        )
    algo = build_dataclass(ALGORITHMS.get(name), params, "algorithm")
    # Numeric hyperparameters are weights, rates, counts and sizes: never negative. NaN/inf and
    # values outside a Literal's choices are refused by build_dataclass; method-specific ranges
    # by each method's __post_init__.
    for key, value in ((f.name, getattr(algo, f.name)) for f in dataclasses.fields(algo)):
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and value < 0:
            raise ConfigError(f"algorithm.{key} = {value} must be >= 0 ({name})")
    return algo


__all__ = ["ALGORITHMS", "build_algorithm"]
