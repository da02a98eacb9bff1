"""Typed payloads and their neutral wire form.

A :class:`Payload` is a frozen dataclass whose fields are tensors, ``dict[str, Tensor]`` (state
dicts) or scalars (int/float/bool/str). ``flatten`` gives the runtime-neutral form (named arrays +
scalars) that any transport carries; ``encode``/``decode`` give real bytes (safetensors, no pickle),
which is what communication is measured on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, TypeVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

Scalar = int | float | bool | str
SEP = "/"  # field/key separator for dict fields; state-dict keys use "." so never collide
P = TypeVar("P", bound="Payload")  # unflatten returns the subclass it is called on


class PayloadError(ValueError):
    """A payload that does not match its declared structure (names, kinds, dtypes, values)."""


def _kind(tp: Any) -> str:
    if tp is Tensor:
        return "tensor"
    if typing.get_origin(tp) is dict:
        return "dict"
    if tp in (int, float, bool, str):
        return "scalar"
    raise TypeError(f"unsupported payload field type {tp!r}")


@dataclasses.dataclass(frozen=True)
class Payload:
    """Base class for every message between server and clients."""

    @classmethod
    def field_kinds(cls) -> dict[str, str]:
        # Cached per subclass: resolving type hints is slow and the hot path calls this often.
        cache = cls.__dict__.get("_kinds_cache")
        if cache is None:
            hints = typing.get_type_hints(cls)
            cache = {f.name: _kind(hints[f.name]) for f in dataclasses.fields(cls)}
            cls._kinds_cache = cache  # type: ignore[attr-defined]
        return cache

    def flatten(self) -> tuple[dict[str, Tensor], dict[str, Scalar]]:
        arrays: dict[str, Tensor] = {}
        scalars: dict[str, Scalar] = {}
        for name, kind in self.field_kinds().items():
            value = getattr(self, name)
            if kind == "tensor":
                arrays[name] = value
            elif kind == "dict":
                for k, v in value.items():
                    arrays[f"{name}{SEP}{k}"] = v
            else:
                scalars[name] = value
        return arrays, scalars

    @classmethod
    def unflatten(cls: type[P], arrays: dict[str, Tensor], scalars: dict[str, Scalar]) -> P:
        """Rebuild from the neutral form, rejecting unknown/missing names and non-finite values."""
        kinds = cls.field_kinds()
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        dicts: dict[str, dict[str, Tensor]] = {n: {} for n, k in kinds.items() if k == "dict"}
        for key, arr in arrays.items():
            if not isinstance(arr, Tensor):
                raise PayloadError(f"{cls.__qualname__}: array {key!r} is not a tensor")
            if arr.is_floating_point() and not bool(torch.isfinite(arr).all()):
                raise PayloadError(f"{cls.__qualname__}: array {key!r} has NaN or Inf values")
            field, _, sub = key.partition(SEP)
            kind = kinds.get(field)
            if kind == "tensor" and not sub:
                values[field] = arr
            elif kind == "dict" and sub:
                dicts[field][sub] = arr
            else:
                raise PayloadError(f"{cls.__qualname__}: unexpected array {key!r}")
        values.update(dicts)
        for key, val in scalars.items():
            if kinds.get(key) != "scalar":
                raise PayloadError(f"{cls.__qualname__}: unexpected scalar {key!r}")
            tp = hints[key]
            if tp is float and isinstance(val, int) and not isinstance(val, bool):
                val = float(val)
            if not isinstance(val, tp) or (tp is int and isinstance(val, bool)):
                raise PayloadError(
                    f"{cls.__qualname__}: scalar {key!r}={val!r} is not {tp.__name__}"
                )
            if isinstance(val, float) and not math.isfinite(val):
                raise PayloadError(f"{cls.__qualname__}: scalar {key!r} is not finite")
            values[key] = val
        missing = [n for n, k in kinds.items() if k != "dict" and n not in values]
        if missing:
            raise PayloadError(f"{cls.__qualname__}: missing fields {missing}")
        return cls(**values)


def encode(payload: Payload) -> bytes:
    """Wire bytes: safetensors with scalars as JSON metadata (no pickle)."""
    arrays, scalars = payload.flatten()
    # safetensors wants contiguous, CPU, non-shared tensors.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in arrays.items()}
    # One metadata key: safetensors writes its metadata map in hash order, so two keys could
    # come out in either order and the same payload would not always give the same bytes.
    meta = {"fedmosaic": json.dumps({"type": type(payload).__qualname__, "scalars": scalars})}
    return st_save(tensors, metadata=meta)


# len(encode(p)) by what decides it: the type, each tensor's name, dtype and shape, and the
# scalars (the header is JSON of these, then the data); bounded, dropped whole when full
_SIZES: dict[tuple[Any, ...], int] = {}
_SIZES_MAX = 4096


def encoded_size(payload: Payload) -> int:
    """``len(encode(payload))`` without copying the tensors each time: the wire size depends
    only on the names, dtypes and shapes of the tensors and on the scalars, so it is measured
    once per such signature (one encode) and looked up after."""
    arrays, scalars = payload.flatten()
    key = (
        type(payload).__qualname__,
        tuple((k, str(v.dtype), tuple(v.shape)) for k, v in arrays.items()),
        json.dumps(scalars, sort_keys=True),
    )
    size = _SIZES.get(key)
    if size is None:
        if len(_SIZES) >= _SIZES_MAX:
            _SIZES.clear()
        size = _SIZES[key] = len(encode(payload))
    return size


def decode(cls: type[Payload], data: bytes, max_bytes: int | None = None) -> Payload:
    """Parse wire bytes into ``cls``; malformed input raises :class:`PayloadError`."""
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadError(f"{cls.__qualname__}: {len(data)} bytes exceeds the cap of {max_bytes}")
    try:
        arrays = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header.get("__metadata__", {}).get("fedmosaic", "{}"))
        scalars = meta.get("scalars", {})
        if not isinstance(scalars, dict):
            raise TypeError("scalars metadata is not a mapping")
    except Exception as exc:  # safetensors raises its own error types
        raise PayloadError(f"{cls.__qualname__}: undecodable payload ({exc})") from exc
    return cls.unflatten(arrays, scalars)


def payload_equal(a: Payload, b: Payload) -> bool:
    """Exact equality of two payloads (names, dtypes, shapes, values)."""
    aa, sa = a.flatten()
    ab, sb = b.flatten()
    if sa != sb or aa.keys() != ab.keys():
        return False
    return all(
        x.dtype == ab[k].dtype and x.shape == ab[k].shape and torch.equal(x.cpu(), ab[k].cpu())
        for k, x in aa.items()
    )


def check_like(payload: Payload, template: Payload, where: str = "") -> None:
    """Raise if ``payload`` differs from ``template`` in array names, dtypes or shapes."""
    pa, _ = payload.flatten()
    ta, _ = template.flatten()
    label = where or type(payload).__qualname__
    if pa.keys() != ta.keys():
        extra = sorted(set(pa) - set(ta))[:5]
        missing = sorted(set(ta) - set(pa))[:5]
        raise PayloadError(f"{label}: unexpected arrays {extra}, missing {missing}")
    for k, t in ta.items():
        x = pa[k]
        if x.dtype != t.dtype or x.shape != t.shape:
            raise PayloadError(
                f"{label}: {k} is {x.dtype}{tuple(x.shape)}, expected {t.dtype}{tuple(t.shape)}"
            )


@dataclasses.dataclass(frozen=True)
class Empty(Payload):
    """No content (e.g. Local's messages)."""
