"""Run-config keys of the fedmosaic Flower app (``[tool.flwr.app.config]``, ``flwr run -c``)."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedmosaic.config import ConfigError, ExperimentConfig, experiment_config

# key -> (default, meaning); written into the generated app's pyproject.toml with these comments.
RUN_CONFIG: dict[str, tuple[Any, str]] = {
    "experiment": ("", "the experiment config as JSON (what `fedmosaic flower app` wrote)"),
    "overrides": ("", 'space-separated section.key=value overrides, e.g. "train.rounds=5"'),
    "results-dir": ("", "where the ServerApp writes results.json (on the SuperLink host)"),
    "round-timeout": (600.0, "seconds to wait for the round's training replies (the deadline)"),
    "eval-timeout": (600.0, "seconds to wait for evaluation / fine-tuning replies"),
    "min-replies": (1, "fewer valid training replies than this: the round is skipped"),
    "min-nodes": (0, "SuperNodes to wait for before round 1 (0 = one per client)"),
    "connect-timeout": (600.0, "seconds to wait for min-nodes SuperNodes"),
    "max-reply-mb": (256.0, "replies with more data than this (all records) are rejected"),
    "node-partitions": (
        "",
        'allow-list "NODE=PARTITION ..." (SuperNode ids as the SuperLink assigns them to '
        "authenticated nodes): only these nodes may serve these partitions; empty = trust what "
        "each node declares",
    ),
}


@dataclass(frozen=True)
class FlowerOptions:
    round_timeout: float = 600.0
    eval_timeout: float = 600.0
    min_replies: int = 1
    min_nodes: int = 0
    connect_timeout: float = 600.0
    max_reply_bytes: int = 256 << 20
    results_dir: str = ""
    poll_interval: float = 0.1  # seconds between looks for replies (SuperLink requests)
    # SuperNode id -> the one partition it may serve; empty: each node's declared partition-id
    node_partitions: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def from_run_config(cls, rc: Mapping[str, Any]) -> FlowerOptions:
        def num(key: str, top: float = 1e9) -> float:
            # Finite and bounded: a NaN timeout never expires, 1e300 replies never arrive.
            value = rc.get(key, RUN_CONFIG[key][0])
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not 0 <= value <= top:
                raise ConfigError(f"run config {key} = {value!r} must be a number in [0, {top:g}]")
            return float(value)

        def count(key: str, low: int = 0) -> int:
            value = num(key, 1e6)
            if value != int(value) or value < low:
                raise ConfigError(f"run config {key} = {value!r} must be an integer >= {low}")
            return int(value)

        max_reply = int(num("max-reply-mb", 1e6) * (1 << 20))
        if max_reply < 1:  # a cap of no bytes rejects every reply: every round skipped
            raise ConfigError(
                f"run config max-reply-mb = {rc.get('max-reply-mb')!r} must be > 0 (at least "
                "one byte)"
            )
        return cls(
            round_timeout=num("round-timeout"),
            eval_timeout=num("eval-timeout"),
            min_replies=count("min-replies", 1),
            min_nodes=count("min-nodes"),
            connect_timeout=num("connect-timeout"),
            max_reply_bytes=max_reply,
            results_dir=str(rc.get("results-dir", "")),
            node_partitions=parse_node_partitions(rc.get("node-partitions", "")),
        )


def parse_node_partitions(text: Any) -> dict[int, int]:
    """``"1001=0 1002=1"`` -> ``{1001: 0, 1002: 1}``; a node or a partition listed twice is an
    error (two nodes for one partition is exactly the ambiguity the list exists to remove)."""
    key = "run config node-partitions"
    if not isinstance(text, str):
        raise ConfigError(f"{key} = {text!r} must be a string of NODE=PARTITION pairs")
    out: dict[int, int] = {}
    for item in text.replace(",", " ").split():
        node, sep, part = item.partition("=")
        if not (sep and node.strip().isdigit() and part.strip().isdigit()):
            raise ConfigError(f"{key}: {item!r} is not NODE=PARTITION (two non-negative integers)")
        n, p = int(node), int(part)
        if n in out:
            raise ConfigError(f"{key}: node {n} is listed twice")
        if p in out.values():
            raise ConfigError(f"{key}: partition {p} is given to two nodes")
        out[n] = p
    return out


def experiment_from_run_config(rc: Mapping[str, Any]) -> ExperimentConfig:
    """The experiment both halves run: the run config's ``experiment`` JSON with its
    ``overrides`` (space-separated ``section.key=value``) applied by ``experiment_config``."""
    text = rc.get("experiment", "")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            "run config key 'experiment' is empty: generate the app with "
            "`fedmosaic flower app CONFIG.toml --out DIR`"
        )
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"run config 'experiment' is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("run config 'experiment' must be a JSON object")
    overrides = rc.get("overrides", "")
    if not isinstance(overrides, str):
        raise ConfigError("run config 'overrides' must be a string")
    try:
        items = shlex.split(overrides)
    except ValueError as exc:  # an unbalanced quote
        raise ConfigError(f"run config 'overrides' = {overrides!r}: {exc}") from exc
    return experiment_config(raw, items)
