"""Any algorithm's :class:`Payload` <-> Flower ``RecordDict``; no pickle anywhere.

A payload travels as two records: ``arrays`` (an ``ArrayRecord``: every tensor and every state-dict
entry, keyed by the payload's flat names, serialized by Flower with ``numpy.save(allow_pickle=
False)``) and ``scalars`` (a ``ConfigRecord`` of its int/float/bool/str fields). Decoding checks
the array kinds, declared dtypes and shapes, a byte cap and then the payload's own structure
(:meth:`Payload.unflatten`: names, scalar types, finite values) before any tensor reaches an
algorithm.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from fedmosaic.core.payload import Payload, PayloadError

ARRAYS = "arrays"
SCALARS = "scalars"
NUMPY_STYPE = "numpy.ndarray"  # Flower's serialization type for numpy.save'd arrays

# Tensor dtypes that may cross the wire (numpy name -> torch dtype).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_TORCH_TO_NAME = {v: k for k, v in DTYPES.items()}


def tensors_to_record(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """Named tensors (a state dict, a flattened payload) as an ``ArrayRecord``."""
    record = ArrayRecord()
    for name, t in tensors.items():
        if t.dtype not in _TORCH_TO_NAME:
            raise PayloadError(f"array {name!r}: dtype {t.dtype} cannot travel over Flower")
        record[name] = Array(t.detach().to("cpu").contiguous().numpy())
    return record


def record_bytes(record: ArrayRecord) -> int:
    return sum(len(a.data) for a in record.values())


def _load_array(name: str, arr: Array, where: str) -> Tensor:
    if not isinstance(arr, Array):
        raise PayloadError(f"{where}: {name!r} is not an Array")
    if arr.stype != NUMPY_STYPE:
        raise PayloadError(f"{where}: {name!r} has serialization type {arr.stype!r}")
    if arr.dtype not in DTYPES:
        raise PayloadError(
            f"{where}: {name!r} has dtype {arr.dtype!r}, not one of {sorted(DTYPES)}"
        )
    try:
        nd = np.load(io.BytesIO(arr.data), allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError/OSError/EOFError on bad headers
        raise PayloadError(f"{where}: {name!r} is not a valid array ({exc})") from exc
    if str(nd.dtype) != arr.dtype or tuple(nd.shape) != tuple(arr.shape):
        raise PayloadError(
            f"{where}: {name!r} declares {arr.dtype}{tuple(arr.shape)} but holds "
            f"{nd.dtype}{tuple(nd.shape)}"
        )
    if not nd.flags.writeable:
        nd = nd.copy()
    return torch.from_numpy(nd)


def record_to_tensors(
    record: ArrayRecord, max_bytes: int | None = None, where: str = "arrays"
) -> dict[str, Tensor]:
    """Decode an ``ArrayRecord``; the byte cap is checked before anything is parsed."""
    if not isinstance(record, ArrayRecord):
        raise PayloadError(f"{where}: expected an ArrayRecord, got {type(record).__name__}")
    size = record_bytes(record)
    if max_bytes is not None and size > max_bytes:
        raise PayloadError(f"{where}: {size} bytes exceeds the cap of {max_bytes}")
    return {name: _load_array(name, arr, where) for name, arr in record.items()}


def payload_to_records(payload: Payload) -> RecordDict:
    """The payload as ``{"arrays": ArrayRecord, "scalars": ConfigRecord}``."""
    arrays, scalars = payload.flatten()
    return RecordDict({ARRAYS: tensors_to_record(arrays), SCALARS: ConfigRecord(dict(scalars))})


def records_to_payload(
    cls: type[Payload], content: RecordDict, max_bytes: int | None = None
) -> Payload:
    """Rebuild a ``cls`` payload from a message's records, validating everything on the way.

    Raises :class:`PayloadError` for missing records, non-numpy or disallowed arrays, arrays
    whose bytes disagree with their declared dtype/shape, more than ``max_bytes`` of array data,
    and anything :meth:`Payload.unflatten` rejects (unknown or missing names, wrong scalar types,
    NaN/Inf).
    """
    label = cls.__qualname__
    try:
        records = content.array_records
        configs = content.config_records
    except AttributeError as exc:
        raise PayloadError(f"{label}: not a RecordDict") from exc
    if ARRAYS not in records or SCALARS not in configs:
        raise PayloadError(f"{label}: missing the {ARRAYS!r}/{SCALARS!r} records")
    arrays = record_to_tensors(records[ARRAYS], max_bytes, label)
    # any config value may arrive; unflatten refuses the wrong scalar types
    return cls.unflatten(arrays, dict(configs[SCALARS]))  # type: ignore[arg-type]


def wire_size(content: RecordDict) -> int:
    """Bytes of the serialized record objects Flower transfers for this content."""
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        no_object_id_recompute,
    )

    with no_object_id_recompute():  # hash each object once, as Flower's grids do when pushing
        return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())
