"""Name -> object registries (algorithms, encoders, families, partitioners, datasets)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named mapping with a decorator for registration and helpful lookup errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


# Populated by importing fedmosaic.algorithms / models / data (see their __init__ files).
ALGORITHMS: Registry[Any] = Registry("algorithm")
ENCODERS: Registry[Any] = Registry("encoder")
FAMILIES: Registry[Any] = Registry("model family")
PARTITIONERS: Registry[Any] = Registry("partitioner")
DATASETS: Registry[Any] = Registry("dataset")
