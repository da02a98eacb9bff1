"""Per-client accuracy and its aggregates over clients."""

from __future__ import annotations

import math
from collections.abc import Sequence


def aggregate_accuracy(correct: Sequence[int], totals: Sequence[int]) -> dict[str, float]:
    """Weighted (micro) and unweighted (macro) accuracy over clients, with spread.

    Clients with no examples in the split are left out of the unweighted statistics.
    """
    accs = [c / n for c, n in zip(correct, totals, strict=True) if n > 0]
    n_total = sum(totals)
    if not accs:
        return {
            "weighted": math.nan,
            "mean": math.nan,
            "std": math.nan,
            "min": math.nan,
            "max": math.nan,
        }
    mean = sum(accs) / len(accs)
    std = math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs))  # population std over clients
    return {
        "weighted": sum(correct) / n_total,
        "mean": mean,
        "std": std,
        "min": min(accs),
        "max": max(accs),
    }
