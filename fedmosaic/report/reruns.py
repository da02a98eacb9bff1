"""Two records of one run compared number by number: every per-round value but wall times, then
the summary, with where they first differ and by how much. ``fedmosaic verify`` compares a re-run
made on this host with the stored run; the claims page compares the committed re-runs of its cells
made on other hosts (:func:`fedmosaic.report.claims.reruns`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

# per-round keys that measure time, not arithmetic
TIMING_PREFIX = "seconds"
# the headline numbers reported for the last round compared (when the cell has them)
HEADLINE = ("acc_weighted", "acc_mean", "acc_head_weighted", "val_acc_weighted", "train_loss")
# the summary's numbers reported beside the rounds when they differ
SUMMARY_KEYS = (
    "final.acc_weighted",
    "final.acc_mean",
    "best_on_val.acc_weighted",
    "after_finetune.acc_weighted",
    "after_finetune.acc_mean",
)


@dataclass
class Difference:
    """One metric's differences over the rounds compared."""

    first_round: int
    max_abs: float = 0.0
    rounds: int = 0  # rounds where it differs
    last: tuple[float, float] | None = None  # (stored, here) at the last round compared


@dataclass
class Comparison:
    """Every number of the re-run against the stored run's."""

    rounds: int  # rounds compared
    values: int = 0  # numbers compared
    differing: int = 0
    first: tuple[int, str, Any, Any] | None = None  # (round, key, stored, here)
    by_key: dict[str, Difference] = field(default_factory=dict)
    summary: dict[str, tuple[float, float]] = field(default_factory=dict)  # key: (stored, here)

    @property
    def identical(self) -> bool:
        return self.differing == 0


def is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def compare(stored: list[dict[str, Any]], here: list[dict[str, Any]]) -> Comparison:
    """Round by round, every key both records hold (wall times left out): equal or not."""
    out = Comparison(rounds=min(len(stored), len(here)))
    for a, b in zip(stored, here, strict=False):
        r = int(a.get("round", 0))
        for key in sorted(set(a) | set(b)):
            if key.startswith(TIMING_PREFIX):
                continue
            x, y = a.get(key), b.get(key)
            out.values += 1
            same = x == y or (is_number(x) and is_number(y) and math.isnan(x) and math.isnan(y))
            if same:
                continue
            out.differing += 1
            if out.first is None:
                out.first = (r, key, x, y)
            d = out.by_key.setdefault(key, Difference(first_round=r))
            d.rounds += 1
            if is_number(x) and is_number(y):
                d.max_abs = max(d.max_abs, abs(float(x) - float(y)))
    last_a, last_b = stored[out.rounds - 1], here[out.rounds - 1]
    for key, d in out.by_key.items():
        x, y = last_a.get(key), last_b.get(key)
        if is_number(x) and is_number(y):
            d.last = (float(x), float(y))
    return out


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def compare_summary(out: Comparison, stored: dict[str, Any], here: dict[str, Any]) -> None:
    """A complete re-run: the summary's numbers too (final, best-on-test and best-on-validation
    accuracies, after fine-tuning where the method fine-tunes; wall times left out)."""
    a, b = _flat(stored), _flat(here)
    for key in sorted(set(a) | set(b)):
        if "seconds" in key:
            continue
        x, y = a.get(key), b.get(key)
        out.values += 1
        if x == y:
            continue
        out.differing += 1
        if out.first is None:
            out.first = (out.rounds, f"summary.{key}", x, y)
        if is_number(x) and is_number(y) and key in SUMMARY_KEYS:
            out.summary[key] = (float(x), float(y))
