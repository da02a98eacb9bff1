"""FedProx (Li et al., MLSys 2020): FedAvg plus a proximal term to the round's global model.

Shared: the whole model (homogeneous federation). Client loss:
``CE + mu/2 * sum_p ||w_p - w_p^global||^2`` over parameters (not buffers); ``mu = 0`` is FedAvg.

BatchNorm (``bn``): running statistics are averaged with the parameters by default; ``bn =
"local_stats"`` keeps them on each client (PFLlib/HtFLlib average parameters only), ``bn = "local"``
keeps whole BatchNorm layers local (FedBN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._shared import SharedState, SharedWeights
from fedmosaic.core.algorithm import Acceleration
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ALGORITHMS


def proximal_term(model: nn.Module, global_state: dict[str, Tensor]) -> Tensor:
    """``sum_p ||w_p - g_p||^2`` over the trainable parameters the global model holds.

    With ``bn = "local"`` (FedBN) the BatchNorm affine weights are not in the broadcast: they
    are the client's own, and nothing anchors them (FedBN + FedProx regularizes the shared part).
    """
    total: Tensor | None = None
    for name, p in model.named_parameters():
        if p.requires_grad and name in global_state:
            d = (p - global_state[name]).pow(2).sum()
            total = d if total is None else total + d
    assert total is not None, "proximal term over no trainable parameters"
    return total


@ALGORITHMS.register("fedprox")
@dataclass(frozen=True)
class FedProx(SharedWeights):
    """FedAvg with a proximal term ``mu/2 ||w - w_global||^2`` in the client loss."""

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    # mu: proximal strength; the FedProx paper sweeps {0.001, 0.01, 0.1, 1}; 0 = FedAvg
    mu: float = 0.01
    supports_heterogeneous: ClassVar[bool] = False
    shared: ClassVar[str] = "all"
    paper: ClassVar[str] = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: SharedState
    ) -> Tensor:
        ce = F.cross_entropy(model(x), y)
        if self.mu == 0:
            return ce
        return ce + 0.5 * self.mu * proximal_term(model, msg.state)
