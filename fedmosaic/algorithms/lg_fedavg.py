"""LG-FedAvg (Liang et al., 2020): local representations, global head.

Shared: the head ``Linear(feature_dim, C)`` only (sample-weighted average); each client's encoder
stays local, so encoders may differ across clients. Heads must be identical (no heterogeneous
heads such as ``htc4``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from fedmosaic.algorithms._shared import SharedState, SharedWeights
from fedmosaic.core.registry import ALGORITHMS

if TYPE_CHECKING:
    from fedmosaic.config import ExperimentConfig

Broadcast = SharedState
Upload = SharedState
ServerState = dict[str, Tensor]


def check_same_heads(cfg: ExperimentConfig, name: str) -> None:
    """Shared heads need the same head on every client (member strings' ``/head`` suffix)."""
    from fedmosaic.config import ConfigError
    from fedmosaic.models import family_members
    from fedmosaic.models.build import split_member

    members = family_members(cfg.model.family)[: max(cfg.data.num_clients, 1)]  # those in use
    heads = {split_member(m)[1] for m in members}
    if len(heads) > 1:
        raise ConfigError(
            f"algorithm.name = {name!r} shares the head, but model.family = "
            f"{cfg.model.family!r} has different heads ({sorted(heads)})"
        )


@ALGORITHMS.register("lg_fedavg")
@dataclass(frozen=True)
class LGFedAvg(SharedWeights):
    """Average only the classifier head; keep the encoder local."""

    shared: ClassVar[str] = "head"
    paper: ClassVar[str] = (
        "Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations, 2020"
    )

    def check_config(self, cfg: ExperimentConfig) -> None:
        check_same_heads(cfg, "lg_fedavg")
