"""Diagnostic variants for the parity runs (a fedmosaic plugin: ``plugins = ["<this file>"]``).

``fedproto_train_protos``: fedmosaic's FedProto with the local prototypes the reference code
uploads (HtFLlib/PFLlib ``clientproto.py``: the mean of the features ``model.base(x)`` computed
*during* local training, batch by batch, by the model as it was before each step, over the full
batches only), where fedmosaic's FedProto uploads the exact class means of the trained model in
eval mode. Everything else (loss, server mean, inference) is FedProto's. Used to test whether
that documented deviation explains the accuracy gap between the two codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedmosaic.algorithms.fedproto import FedProto, OwnClasses, ProtoBroadcast, ProtoUpload
from fedmosaic.api import ALGORITHMS, ClientData, ClientModel, FederationSpec


class RunningProtos(OwnClasses):
    """``OwnClasses`` plus this round's per-class feature sums and counts from training."""

    def __init__(self, own: Tensor, num_classes: int, feature_dim: int) -> None:
        super().__init__(own)
        self.register_buffer("sums", torch.zeros(num_classes, feature_dim, dtype=torch.float64))
        self.register_buffer("counts", torch.zeros(num_classes, dtype=torch.int64))


@ALGORITHMS.register("fedproto_train_protos")
@dataclass(frozen=True)
class FedProtoTrainProtos(FedProto):
    """FedProto uploading training-time prototypes, as the reference code does."""

    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        own = data.class_counts("train") > 0
        return RunningProtos(own, spec.num_classes, spec.feature_dim)

    def receive(self, model: ClientModel, extras: nn.Module, msg: ProtoBroadcast) -> None:
        extras.sums.zero_()  # a new round: the reference starts an empty defaultdict(list)
        extras.counts.zero_()

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: ProtoBroadcast
    ) -> Tensor:
        # the features of this step's model, before its update: what the reference appends
        features = model.features(x)  # [B, d]
        extras.sums.index_add_(0, y, features.detach().double())
        extras.counts.index_add_(0, y, torch.ones_like(y))
        return super().loss(model, extras, x, y, msg)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: ProtoBroadcast
    ) -> ProtoUpload:
        counts = extras.counts.clone()
        protos = extras.sums / counts.clamp(min=1).unsqueeze(1).double()  # zero rows: no class
        return ProtoUpload(protos=protos.float(), counts=counts.long())
