"""FedAvg (McMahan et al., AISTATS 2017): average the whole model, weighted by sample counts.

Shared: every parameter and buffer of the (identical) client models. Nothing stays local, so
it needs a homogeneous federation.

BatchNorm (``bn``): running statistics are averaged with the parameters by default; ``bn =
"local_stats"`` keeps them on each client (PFLlib/HtFLlib average parameters only), ``bn = "local"``
keeps whole BatchNorm layers local (FedBN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedmosaic.algorithms._shared import SharedWeights
from fedmosaic.core.algorithm import Acceleration
from fedmosaic.core.registry import ALGORITHMS


@ALGORITHMS.register("fedavg")
@dataclass(frozen=True)
class FedAvg(SharedWeights):
    """Federated averaging of the whole model."""

    supports_heterogeneous: ClassVar[bool] = False
    shared: ClassVar[str] = "all"
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)
    paper: ClassVar[str] = (
        "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    )
