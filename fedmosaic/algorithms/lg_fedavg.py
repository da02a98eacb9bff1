"""LG-FedAvg (Liang et al., 2020): local representations, global head.

Shared: the head ``Linear(feature_dim, C)`` only (sample-weighted average); each client's encoder
stays local, so encoders may differ across clients. Heads must be identical (no heterogeneous
heads such as ``htc4``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedmosaic.algorithms._shared import SharedWeights
from fedmosaic.core.algorithm import Acceleration, FederationSpec
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.models.build import split_member


def check_same_heads(spec: FederationSpec, name: str) -> None:
    """Shared heads need the same head on every client (member strings' ``/head`` suffix)."""
    heads = {split_member(m)[1] for m in spec.members}
    if len(heads) > 1:
        raise ConfigError(
            f"algorithm.name = {name!r} shares the head, but the clients' models "
            f"(model.family) have different heads ({sorted(heads)})"
        )


@ALGORITHMS.register("lg_fedavg")
@dataclass(frozen=True)
class LGFedAvg(SharedWeights):
    """Average only the classifier head; keep the encoder local."""

    shared: ClassVar[str] = "head"
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)
    paper: ClassVar[str] = (
        "Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations, 2020"
    )

    def check(self, spec: FederationSpec) -> None:
        check_same_heads(spec, "lg_fedavg")
