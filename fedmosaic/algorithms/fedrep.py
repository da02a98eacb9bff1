"""FedRep (Collins et al., Exploiting Shared Representations for Personalized FL, ICML 2021).

Shared: the encoder (representation), sample-weighted average of its parameters and buffers. The
head stays local. Each round a client first trains its head for ``head_epochs`` with the encoder
frozen, then the encoder for ``[train] local_epochs`` with the head frozen (two Phases), and
uploads the encoder. Averaging encoders needs identical encoders: homogeneous federations only.

Choices and differences from the reference code (PFLlib ``clientrep``/``serverrep``):

- ``head_epochs = 1``: PFLlib's default (``-pls/--plocal_epochs 1``). The authors' code
  (lgcollins/FedRep) spends most of a round on the head (``head_eps = local_ep - local_rep_ep``,
  e.g. 10 - 1); set ``algorithm.head_epochs`` accordingly to follow the paper's schedule.
- The encoder's buffers (BatchNorm running statistics) are averaged with its parameters, as in our
  FedAvg; PFLlib averages ``model.base.parameters()`` only (``bn = "local_stats"``; ``bn = "local"``:
  whole BatchNorm layers local, FedBN). Note that the head phase runs the
  encoder in train mode (as PFLlib does), so running statistics also move during the head phase.
- One fresh optimizer per phase (PFLlib keeps two persistent SGD optimizers; identical for plain
  SGD, which is stateless; with momentum/Adam our state restarts every phase and round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fedmosaic.algorithms._shared import SharedWeights
from fedmosaic.core.algorithm import Acceleration, Phase
from fedmosaic.core.registry import ALGORITHMS


@ALGORITHMS.register("fedrep")
@dataclass(frozen=True)
class FedRep(SharedWeights):
    """Head epochs with the encoder frozen, then encoder epochs with the head frozen; share encoder."""

    head_epochs: int = 1  # head epochs (encoder frozen) before the encoder epochs; PFLlib -pls

    supports_heterogeneous: ClassVar[bool] = False
    shared: ClassVar[str] = "encoder"
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)
    paper: ClassVar[str] = (
        "Collins et al., Exploiting Shared Representations for Personalized Federated Learning, ICML 2021"
    )

    def __post_init__(self) -> None:
        if self.head_epochs < 0:
            raise ValueError(f"head_epochs = {self.head_epochs} must be >= 0")

    def phases(self, round_num: int, epochs: int) -> Sequence[Phase]:
        return (
            Phase(("head",), self.head_epochs, train_extras=False, name="head"),
            Phase(("encoder",), epochs, train_extras=False, name="encoder"),
        )
