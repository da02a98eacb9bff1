"""What a method's server combines uploads with; each primitive applies the server's rule in force.

The round loop makes the ``[server]`` rule current while it aggregates (``robust.serving``), and
these are the only aggregation entry points the methods use: a state-dict mean, a per-class mean
and the points a learning server trains on. Under the default rule (the plain mean, no clipping)
each is bitwise the plain computation; under a robust rule (median, trimmed mean, Krum, clipping;
``core/robust.py``) the same call gives the robust aggregate. A method never reads the rule to
be protected; :func:`robust_rule_in_force` is for a server that must also change *what* it keeps
under a robust rule (FedDistill's leave-one-out means).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fedmosaic.core import robust


def robust_rule_in_force() -> bool:
    """Whether the rule in force is other than the plain mean without clipping."""
    return not robust.rule().plain


def weighted_average(
    states: Sequence[dict[str, Tensor]],
    weights: Sequence[float],
    reference: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Sample-weighted mean of state dicts, under the server's rule.

    With the default rule (plain mean, no clipping): floating tensors ``sum_k (w_k / sum w) *
    x_k`` in float32. Otherwise ``robust.average_states``: updates against ``reference`` (what
    the server broadcast; the states themselves without it) clipped and aggregated by the
    configured median / trimmed mean / Krum. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are not averaged; the maximum is kept.
    """
    if not states:
        raise ValueError("weighted_average of no states")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_average: weights sum to zero")
    rule = robust.rule()
    if not rule.plain:
        return robust.average_states(states, weights, rule, reference)
    out: dict[str, Tensor] = {}
    for k, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros_like(first)
            for s, w in zip(states, weights, strict=True):
                acc.add_(s[k], alpha=float(w) / total)
            out[k] = acc
        else:
            out[k] = torch.stack([s[k] for s in states]).amax(0)
    return out


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Mean of same-shaped tensors with weights ``w_k / sum w`` (each client's value taken as one
    vector), under the server's rule: plain, in the tensors' dtype, accumulated in client order;
    else the robust aggregate of the values (no reference: each value is its own update)."""
    if not tensors:
        raise ValueError("weighted_mean of no tensors")
    total = float(sum(weights))
    rule = robust.rule()
    if not rule.plain:
        stacked = torch.stack([t.detach().cpu() for t in tensors])  # [K, ...]
        if rule.clip_update_norm > 0:
            sq = stacked.double().flatten(1).pow(2).sum(1)
            scale = robust.clip_scales(sq, rule.clip_update_norm)
            stacked = stacked.double() * scale.view((-1,) + (1,) * (stacked.dim() - 1))
        w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
        return robust.aggregate_rows(stacked, w, rule).to(tensors[0].dtype)
    out = torch.zeros_like(tensors[0])
    for t, wk in zip(tensors, weights, strict=True):
        out.add_(t, alpha=float(wk) / total if total > 0 else 1.0 / len(tensors))
    return out


def class_average(
    vectors: Tensor,
    present: Tensor,
    weights: Tensor,
    reference: Tensor | None,
    known: Tensor | None,
    plain: Callable[[], tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor]:
    """Per class, the aggregate of the rows of the clients that hold it: ``plain()`` under the
    default rule where given (the method's own mean, bitwise), else ``robust.class_average`` of
    ``vectors [K, C, d]`` with ``present [K, C]`` and ``weights [K, C]``, as deviations from the
    global rows ``reference [C, d]`` where ``known [C]`` (under the default rule: the weighted
    mean in float64). Returns ``([C, d] float32, known [C])``."""
    rule = robust.rule()
    if rule.plain and plain is not None:
        return plain()
    return robust.class_average(vectors, present, weights, rule, reference, known)


def server_points(
    points: Tensor,
    labels: Tensor,
    reference: Tensor | None = None,
    known: Tensor | None = None,
) -> Tensor:
    """The per-class points ``[N, d]`` (labels ``[N]``) a learning server trains on (FedTGP's
    prototypes, FedGH's class means): unchanged under the default rule, else clipped against the
    global rows (``reference [C, d]`` where ``known [C]``) and replaced by their class's robust
    centre (``robust.robust_points``)."""
    rule = robust.rule()
    if rule.plain:
        return points
    return robust.robust_points(points, labels, rule, reference, known)
