"""FedRoD (Chen & Chao, On Bridging Generic and Personalized Federated Learning for Image
Classification, ICLR 2022).

Shared: the generic model (encoder + generic head = the whole ClientModel), trained with the
balanced softmax loss ``CE(logits + log n_c, y)`` (``n_c``: the client's training examples of class
``c``) and averaged by sample count, so it needs a homogeneous federation. Local: a personal head
``Linear(d, C)`` in the client's extras, trained on detached features with
``CE(out_generic.detach() + out_personal, y)``. Prediction: ``out_generic + out_personal`` (``acc``);
the generic model alone is reported as ``acc_generic``.

Choices and differences from the reference code (PFLlib ``clientrod``):

- Classes a client has no training examples of get ``log 0 = -inf`` in the balanced softmax: they
  drop out of the softmax exactly (zero probability, zero gradient on their logits), which is the
  balanced softmax's ``n_c exp(z_c)`` form taken literally. The loss and its gradients stay finite
  because a client's own labels always have ``n_c >= 1`` (a test checks this).
- Class counts are exact (``ClientData.class_counts()`` of the training split, kept as a buffer in
  the extras); PFLlib counts one pass of its shuffled ``drop_last`` loader, which misses a random
  tail of examples.
- The personal head is a fresh ``Linear(d, C)`` from the client's seeded init stream; PFLlib
  deep-copies the initial generic head: ``personal_init = "generic"`` does the same (a copy of
  the client's own initial head; with ``model.init = "architecture"`` every client starts from one
  model, as in PFLlib, so every personal head starts from that model's head). Generic model and personal head are trained in one step on
  the sum of both losses: the detaches keep the two gradients disjoint, so one SGD/Adam step equals
  PFLlib's two optimizers stepping on the same forward pass.
- The linear personal head is the paper's FedRoD (linear); its hypernetwork variant is not built.
- BatchNorm (``bn``): running statistics are averaged with the parameters by default; ``bn =
  "local_stats"`` keeps them on each client (PFLlib/HtFLlib average parameters only), ``bn =
  "local"`` keeps whole BatchNorm layers local (FedBN).
- No hyperparameters beyond ``[train]`` but ``bn`` and ``personal_init``: PFLlib's FedRoD has
  none.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._shared import SharedState, SharedWeights
from fedmosaic.core.algorithm import Acceleration, FederationSpec
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ALGORITHMS

PersonalInit = Literal["fresh", "generic"]  # the personal head's start (module docstring)


def balanced_softmax_logits(logits: Tensor, class_counts: Tensor) -> Tensor:
    """``logits [B, C] + log(class_counts [C])``; a zero count gives ``-inf`` (class excluded)."""
    return logits + class_counts.to(logits.dtype).log().unsqueeze(0)  # [B, C]


def balanced_softmax_loss(logits: Tensor, y: Tensor, class_counts: Tensor) -> Tensor:
    """Balanced softmax cross-entropy (Ren et al., NeurIPS 2020), mean over the batch."""
    return F.cross_entropy(balanced_softmax_logits(logits, class_counts), y)


class PersonalHead(nn.Module):
    """A client's personal head and its training-label histogram."""

    class_counts: Tensor

    def __init__(
        self,
        feature_dim: int,
        num_classes: int,
        class_counts: Tensor,
        head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # head: a module to start from (PFLlib's copy of the initial generic head), else fresh
        self.head = nn.Linear(feature_dim, num_classes) if head is None else head
        self.register_buffer("class_counts", class_counts.to(torch.int64).clone())  # [C]

    def forward(self, features: Tensor) -> Tensor:
        return self.head(features)  # [B, C]


@ALGORITHMS.register("fedrod")
@dataclass(frozen=True)
class FedRoD(SharedWeights):
    """Generic model with balanced softmax (shared) + personal head on detached features (local)."""

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    supports_heterogeneous: ClassVar[bool] = False
    shared: ClassVar[str] = "all"
    # fresh: a seeded Linear(d, C); generic: a copy of the client's initial generic head (PFLlib)
    personal_init: PersonalInit = "fresh"
    paper: ClassVar[str] = (
        "Chen & Chao, On Bridging Generic and Personalized Federated Learning for Image "
        "Classification, ICLR 2022"
    )

    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        # The runtime seeds torch's global RNG per client right before this call.
        counts = data.class_counts("train")
        if self.personal_init == "generic":
            head = copy.deepcopy(model.head)  # its own parameters: trained apart from the generic
            return PersonalHead(model.feature_dim, model.num_classes, counts, head)
        return PersonalHead(model.feature_dim, model.num_classes, counts)

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: SharedState
    ) -> Tensor:
        assert isinstance(extras, PersonalHead)
        features = model.features(x)  # [B, d]
        out_generic = model.head(features)  # [B, C]
        generic = balanced_softmax_loss(out_generic, y, extras.class_counts)
        # The personal head sees detached features and detached generic logits: its loss
        # reaches neither the encoder nor the generic head.
        out_personal = extras(features.detach())  # [B, C]
        personal = F.cross_entropy(out_generic.detach() + out_personal, y)
        return generic + personal

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: SharedState
    ) -> dict[str, Tensor]:
        features = model.features(x)  # [B, d]
        out_generic = model.head(features)  # [B, C]
        return {"acc": out_generic + extras(features), "acc_generic": out_generic}
