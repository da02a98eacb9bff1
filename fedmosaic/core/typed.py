"""Typed construction of a dataclass from a plain dict (a TOML table, a ``--set`` override).

Shared by the config sections and by every algorithm's hyperparameters, so it lives below both.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from fedmosaic.core.errors import ConfigError


def type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is typing.Literal:
        return _is_choice(value, typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            return False
        return not args or all(type_ok(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _is_choice(value: Any, choices: tuple[Any, ...]) -> bool:
    """Equal to one of ``choices`` and of its type (``True`` is not ``1``)."""
    return any(value == c and type(value) is type(c) for c in choices)


def literal_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The choices of each ``Literal[...]`` field of the dataclass ``cls`` (cached per class:
    resolving type hints is slow)."""
    cache = cls.__dict__.get("_literal_choices")
    if cache is None:
        hints = typing.get_type_hints(cls)
        cache = {
            f.name: typing.get_args(hints[f.name])
            for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is typing.Literal
        }
        cls._literal_choices = cache  # type: ignore[attr-defined]
    return cache


def choice_error(name: str, value: Any, choices: tuple[Any, ...]) -> str:
    """The one-line message for a value outside a ``Literal``'s choices."""
    return f"{name} = {value!r}; choose one of {', '.join(str(c) for c in choices)}"


def check_choices(obj: Any) -> None:
    """Raise ValueError for a ``Literal[...]`` field of the dataclass ``obj`` holding another value."""
    for key, choices in literal_choices(type(obj)).items():
        value = getattr(obj, key)
        if not _is_choice(value, choices):
            raise ValueError(choice_error(key, value, choices))


def _coerce(value: Any, tp: Any) -> Any:
    if tp is float and isinstance(value, int):
        return float(value)
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def build_dataclass(cls: type, values: dict[str, Any], where: str) -> Any:
    """Construct ``cls`` from ``values``, rejecting unknown keys, wrong types and values outside
    a ``Literal[...]`` field's choices by name."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {name!r}; valid keys: {known}")
        tp = hints[key]
        if typing.get_origin(tp) is typing.Literal and not type_ok(value, tp):
            raise ConfigError(choice_error(name, value, typing.get_args(tp)))
        if not type_ok(value, tp):
            raise ConfigError(
                f"{name} = {value!r} has type {type(value).__name__}, expected {_type_name(tp)}"
            )
        _check_finite(name, value)
        kwargs[key] = _coerce(value, tp)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{where}]: {exc}") from exc


def _check_finite(name: str, value: Any) -> None:
    """NaN and infinity are never a setting (an ``lr = nan`` would train to NaN silently)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} = {value} must be a finite number")
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(f"{name}[{i}]", v)


def _type_name(tp: Any) -> str:
    # list[int] names itself "list": its arguments say what was wrong with ["a"]
    return str(tp) if typing.get_args(tp) else getattr(tp, "__name__", str(tp))
