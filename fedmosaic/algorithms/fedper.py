"""FedPer (Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 2019).

Shared: the encoder (base layers), sample-weighted average of its parameters and buffers. Each
client's head (personalization layer) stays local. Encoder and head train jointly on plain
cross-entropy every round. Averaging encoders needs identical encoders: homogeneous federations only.

Differences from the reference code (PFLlib ``clientper``/``serverper``):

- The encoder's buffers (BatchNorm running statistics) are averaged with its parameters, as in our
  FedAvg; PFLlib averages ``model.base.parameters()`` only, leaving running statistics local:
  ``bn = "local_stats"`` does that (``bn = "local"``: whole BatchNorm layers local, FedBN).
- Every client's head starts from its own seeded initialization (our per-client init streams);
  in PFLlib all clients start from copies of one model. The encoder is the server's from round 1.
- No hyperparameters beyond ``[train]`` and ``bn``: PFLlib's FedPer has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedmosaic.algorithms._shared import SharedWeights
from fedmosaic.core.algorithm import Acceleration
from fedmosaic.core.registry import ALGORITHMS


@ALGORITHMS.register("fedper")
@dataclass(frozen=True)
class FedPer(SharedWeights):
    """Average the encoder; keep the head local; train both jointly."""

    supports_heterogeneous: ClassVar[bool] = False
    shared: ClassVar[str] = "encoder"
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)
    paper: ClassVar[str] = (
        "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv:1912.00818, 2019"
    )
