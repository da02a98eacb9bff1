"""Local: every client trains only on its own data; nothing is exchanged.

The lower bound every personalized-FL paper reports. It does not communicate
(``communicates = False``): its rounds report 0 bytes up and down, not a wire format's framing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Empty
from fedmosaic.core.registry import ALGORITHMS


@ALGORITHMS.register("local")
@dataclass(frozen=True)
class Local(Algorithm[None, Empty, Empty]):
    """Local training only (no federation)."""

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    paper: ClassVar[str] = "baseline: local training only"
    communicates: ClassVar[bool] = False
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)

    def init_server(self, spec: FederationSpec) -> None:
        return None

    def broadcast(self, state: None, client_id: int, round_num: int) -> Empty:
        return Empty()

    def aggregate(self, state: None, uploads: Sequence[Weighted[Empty]], round_num: int) -> None:
        return None

    def upload(self, model: ClientModel, extras: nn.Module, data: ClientData, msg: Empty) -> Empty:
        return Empty()
