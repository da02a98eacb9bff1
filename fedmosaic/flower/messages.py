"""The fedmosaic protocol on Flower messages, shared by the ServerApp and the ClientApp.

Every message carries a ``fedmosaic`` ``ConfigRecord`` (its header: client id, round, example
count, ...) next to the payload records of :mod:`fedmosaic.flower.codec`. Message types:

========================  ================================  ====================================
type                      server -> client                  client -> server
========================  ================================  ====================================
``query``                 hello                             ``partition-id``, ``num-partitions``
``train``                 the round's broadcast             the upload + ``num-examples``, ``loss``
``evaluate``              the broadcast to evaluate with    ``counts`` (split/mode -> correct, n)
``train.finetune``        the broadcast + the phases (JSON) nothing
========================  ================================  ====================================
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ConfigRecord, RecordDict

from fedmosaic.core import membership
from fedmosaic.core.algorithm import Phase
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.flower.codec import ARRAYS, SCALARS, payload_to_records

HEADER = "fedmosaic"
COUNTS = "counts"
ATTACK = "attack"  # eval.membership: a fit reply's attack on its own upload (counts)

HELLO = "query"
FIT = "train"
EVALUATE = "evaluate"
FINETUNE = "train.finetune"

PROTOCOL = 1


def with_header(content: RecordDict, **fields: Any) -> RecordDict:
    content[HEADER] = ConfigRecord({"protocol": PROTOCOL, **fields})
    return content


def payload_message(payload: Payload, **fields: Any) -> RecordDict:
    """A payload's records plus a header (``payload`` names its type for the receiver)."""
    return with_header(payload_to_records(payload), payload=type(payload).__qualname__, **fields)


def header(content: RecordDict) -> dict[str, Any]:
    configs = content.config_records
    if HEADER not in configs:
        raise PayloadError(f"message has no {HEADER!r} header")
    head = dict(configs[HEADER])
    if head.get("protocol") != PROTOCOL:
        raise PayloadError(f"unsupported fedmosaic protocol {head.get('protocol')!r}")
    return head


# The records each reply carries, by message type and record kind (arrays, configs, metrics);
# anything else in a reply is refused: nothing a client sends is ignored unseen.
REPLY_RECORDS: dict[str, dict[str, frozenset[str]]] = {
    HELLO: {"configs": frozenset({HEADER})},
    FIT: {"arrays": frozenset({ARRAYS}), "configs": frozenset({HEADER, SCALARS, ATTACK})},
    EVALUATE: {"configs": frozenset({HEADER, COUNTS})},
    FINETUNE: {"configs": frozenset({HEADER})},
}


def check_reply_records(content: RecordDict, kind: str) -> None:
    """Refuse a ``kind`` reply carrying a record the protocol does not expect there."""
    expected = REPLY_RECORDS[kind]
    groups: dict[str, Mapping[str, Any]] = {
        "arrays": content.array_records,
        "configs": content.config_records,
        "metrics": content.metric_records,
    }
    for group, records in groups.items():
        extra = sorted(set(records) - expected.get(group, frozenset()))
        if extra:
            raise PayloadError(
                f"unexpected {group} record(s) {extra} in a {kind!r} reply (expected: "
                f"{sorted(expected.get(group, ())) or 'none'})"
            )


def int_field(head: Mapping[str, Any], key: str) -> int:
    value = head.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PayloadError(f"header field {key!r} = {value!r} is not an int")
    return value


def float_field(head: Mapping[str, Any], key: str) -> float:
    value = head.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise PayloadError(f"header field {key!r} = {value!r} is not a number")
    return float(value)


def check_payload_type(head: Mapping[str, Any], cls: type[Payload]) -> None:
    if head.get("payload") != cls.__qualname__:
        raise PayloadError(f"payload type {head.get('payload')!r}, expected {cls.__qualname__!r}")


# ---- evaluation counts ------------------------------------------------------------------------
def counts_record(counts: Mapping[str, Mapping[str, int]]) -> ConfigRecord:
    return ConfigRecord(
        {f"{split}/{mode}": int(v) for split, c in counts.items() for mode, v in c.items()}
    )


def parse_counts(
    record: ConfigRecord, splits: Sequence[str], max_examples: int
) -> dict[str, dict[str, int]]:
    """``split/mode -> int`` back to nested counts; rejects unknown splits and impossible counts."""
    out: dict[str, dict[str, int]] = {}
    for key, value in record.items():
        split, sep, mode = key.partition("/")
        if not sep or split not in (*splits, *membership.SPLITS) or not mode:
            raise PayloadError(f"unexpected count {key!r}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PayloadError(f"count {key!r} = {value!r} is not a non-negative int")
        out.setdefault(split, {})[mode] = value
    problem = membership.check(out, max_examples)  # eval.membership's attack counts
    if problem:
        raise PayloadError(f"membership attack: {problem}")
    for split, c in out.items():
        if split in membership.SPLITS:
            continue
        n = c.get("n")
        if n is None or n > max_examples:
            raise PayloadError(f"split {split!r}: example count {n!r} missing or implausible")
        if any(v > n for m, v in c.items() if m != "n"):
            raise PayloadError(f"split {split!r}: more correct predictions than examples")
    return out


def parse_attack(record: ConfigRecord, n_train: int, n_test: int) -> dict[str, dict[str, int]]:
    """A fit reply's attack counts (``eval.membership``), checked against the client's split
    sizes the server knows; PayloadError naming what no real client reports."""
    out = parse_counts(record, (), max(n_train, n_test))
    if set(out) != set(membership.SPLITS):
        raise PayloadError(f"membership attack: needs {list(membership.SPLITS)}, got {sorted(out)}")
    sizes = membership.sizes(n_train, n_test)
    for split, c in out.items():
        if c["n"] != sizes[split]:
            raise PayloadError(f"membership attack: {split} claims {c['n']}; it has {sizes[split]}")
    return out


# ---- fine-tuning phases -----------------------------------------------------------------------
def phases_to_json(phases: Sequence[Phase]) -> str:
    return json.dumps([dataclasses.asdict(p) for p in phases])


def phases_from_json(text: str) -> tuple[Phase, ...]:
    try:
        items = json.loads(text)
        return tuple(
            Phase(
                trainable=tuple(str(t) for t in p["trainable"]),
                epochs=int(p["epochs"]),
                train_extras=bool(p["train_extras"]),
                name=str(p["name"]),
            )
            for p in items
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PayloadError(f"malformed fine-tuning phases: {exc}") from exc


def finite_or_nan(value: float) -> float:
    return value if math.isfinite(value) else math.nan
