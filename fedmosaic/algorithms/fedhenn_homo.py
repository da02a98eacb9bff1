"""FedHeNN, homogeneous variant (Makhija et al., ICML 2022, Algorithm 1, Eq. 5).

Makhija, Han, Ho, Ghosh. Architecture Agnostic Federated Learning for Neural Networks. ICML 2022.

Shared: the whole model, averaged FedAvg-style (sample-weighted, Algorithm 1), plus each round a
fresh representation alignment dataset (RAD) from the server's public split. Nothing stays local
between rounds (identical architectures needed). The client loss is
``CE + eta(t) * (1 - CKA(K_i, K_global(t-1)))``: ``K_global`` is the kernel of the received global
model's features on the RAD, which the client computes itself (in eval mode, before training: it
holds the global weights, so no kernel is sent); ``K_i`` is its training model's kernel on the same
RAD, with gradient. ``eta0 = 0`` is FedAvg. Both kernels are the eval-mode map (BatchNorm running
statistics used and left alone, dropout off: see ``fedhenn``), and the model has no projection layer
(``model_projection = "none"``: the representation is the network's own penultimate layer).

BatchNorm: the server averages the whole state dict, so running statistics are averaged with the
weights (float buffers by the same sample weights, ``num_batches_tracked`` the maximum) and every
client loads them each round; there is no ``bn`` option as in the SharedWeights family.

Evaluated: ``acc`` is the global model on each client's test split (Table 1, "FedHeNN global");
``acc_local`` each client's own model as its last local training left it (Table 2's personalised
"FedHeNN Homo"; a client that never trained: its initial model).

Where we differ from the paper: the final model is the last round's average over that round's
participants (Algorithm 1 ends with one average over all N clients' models); the RAD is drawn as
in ``fedhenn`` (the same inputs every round when ``data.public_size`` is no larger than
``rad_size``).

Where we differ from the reference code (github.com/dishamakhija/FedHeNN,
``scripts/homogeneous_clients.py``): CKA on the encoder's features, CE on the head's logits (the
reference swaps them); RAD from the public split (the reference samples the training set);
``eta(t) = eta0 * f(t)`` with t = 1, 2, ... (the reference's loop starts at 0, so round 1 has no
alignment there); the server weights models by training examples as Algorithm 1 (the reference's
``lens`` are ones: a plain mean); no extra last round with every client at 10 local epochs (the
reference's ``epochs + 1``-th).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmosaic.algorithms._shared import SharedState, StoredState, weighted_average
from fedmosaic.algorithms.fedhenn import (
    Kernel,
    Schedule,
    check_hyperparameters,
    cka_distance,
    eta_at,
    need_public,
    rad_inputs,
    representation_kernel,
)
from fedmosaic.core import secure
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, FitContext, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS


@dataclass(frozen=True)
class HomoBroadcast(Payload):
    state: dict[str, Tensor]  # global model W(t-1): every parameter and buffer
    rad: Tensor  # [L, C, H, W] this round's RAD
    eta: float  # eta(t) = eta0 * f(t)
    round_num: int


@dataclass
class HomoState:
    weights: dict[str, Tensor]  # the global model's state dict
    public: Tensor  # [P, C, H, W] normalized float, server-held
    seed: int
    rad_size: int  # L (capped to P)


def k_global(extras: nn.Module) -> Tensor:
    """The client's ``k_global`` buffer (``init_client`` registers it, ``before_fit`` sets it)."""
    return cast(Tensor, extras.k_global)


@ALGORITHMS.register("fedhenn_homo")
@dataclass(frozen=True)
class FedHeNNHomo(Algorithm[HomoState, HomoBroadcast, SharedState]):
    """FedAvg plus a CKA proximal term to the global model's representation kernel on the RAD."""

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    eta0: float = 0.001  # eta_0: base weight of the CKA term (paper: 0.001 on CIFAR)
    # f(t) in eta(t) = eta0 * f(t): sqrt (reference) | constant | linear
    schedule: Schedule = "sqrt"
    kernel: Kernel = "linear"  # kernel on representations: linear | rbf
    sigma: float = 1.0  # rbf bandwidth, in units of the median pairwise distance
    rad_size: int = 1000  # L: RAD inputs per round (paper 5000), capped to data.public_size
    rad_batch: int = 0  # >0: align on this many random RAD rows per step (0: whole RAD, paper)

    supports_heterogeneous: ClassVar[bool] = False
    model_projection: ClassVar[str | None] = "none"  # the paper's model, no added layer
    paper: ClassVar[str] = (
        "Makhija et al., Architecture Agnostic Federated Learning for Neural Networks, ICML 2022 "
        "(homogeneous variant)"
    )

    def __post_init__(self) -> None:
        check_hyperparameters(self.sigma, self.eta0, self.rad_size)
        if self.rad_batch < 0 or self.rad_batch == 1:
            raise ValueError(f"rad_batch = {self.rad_batch} must be 0 (whole RAD) or >= 2")

    def check(self, spec: FederationSpec) -> None:
        need_public(spec, "fedhenn_homo")

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> HomoState:
        public = need_public(spec, "fedhenn_homo")
        weights = spec.build_model(0).part_state("all")
        weights = {k: v.cpu() for k, v in weights.items()}
        return HomoState(weights, public, spec.seed, min(self.rad_size, public.shape[0]))

    def broadcast(self, state: HomoState, client_id: int, round_num: int) -> HomoBroadcast:
        rad = rad_inputs(state.public, state.rad_size, state.seed, round_num)
        return HomoBroadcast(
            state.weights, rad, eta_at(self.eta0, self.schedule, round_num), round_num
        )

    def upload_names(self, state: HomoState, upload: SharedState) -> dict[str, Any]:
        return {"shared": state.weights}

    def aggregate(
        self, state: HomoState, uploads: Sequence[Weighted[SharedState]], round_num: int
    ) -> HomoState:
        states = [u.payload.state for u in uploads]
        weights = weighted_average(states, [u.weight for u in uploads], reference=state.weights)
        return HomoState(weights, state.public, state.seed, state.rad_size)

    def summands(self, upload: SharedState, weight: float) -> dict[str, Tensor]:
        return secure.state_terms(upload.state, weight)

    def from_sums(
        self, state: HomoState, sums: Mapping[str, Tensor], round_num: int
    ) -> Weighted[SharedState]:
        mean, total = secure.state_from_terms(sums, state.weights)
        return Weighted(-1, total, SharedState(mean))

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        extras = nn.Module()
        # K_global(t-1) of the current round: recomputed every round, never trained or saved.
        extras.register_buffer("k_global", torch.zeros(0, 0), persistent=False)
        # the client's own model as its last local training left it (Table 2's local model)
        extras.local = StoredState(model.part_state("all"))
        return extras

    def receive(self, model: ClientModel, extras: nn.Module, msg: HomoBroadcast) -> None:
        model.load_part_state("all", msg.state)

    def before_fit(self, ctx: FitContext[HomoBroadcast]) -> None:
        # The model holds W(t-1) right after receive: its kernel on the RAD is K_global(t-1).
        extras, msg = ctx.extras, ctx.msg
        if msg.eta > 0:
            extras.k_global = representation_kernel(ctx.model, msg.rad, self.kernel, self.sigma)
        else:
            extras.k_global = torch.zeros(0, 0, device=k_global(extras).device)

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: HomoBroadcast
    ) -> Tensor:
        ce = F.cross_entropy(model(x), y)
        if msg.eta == 0 or k_global(extras).numel() == 0:
            return ce
        return ce + msg.eta * cka_distance(
            model, msg.rad, k_global(extras), self.kernel, self.sigma, self.rad_batch
        )

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: HomoBroadcast
    ) -> SharedState:
        state = model.part_state("all")
        local = getattr(extras, "local", None)
        if isinstance(local, StoredState):
            local.store(state)
        return SharedState(state)

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: HomoBroadcast
    ) -> dict[str, Tensor]:
        out = {"acc": model(x)}  # the global model, received before evaluation (Table 1)
        local = getattr(extras, "local", None)
        if isinstance(local, StoredState):  # each client's own model (Table 2, "FedHeNN Homo")
            out["acc_local"] = functional_call(model, local.state(), (x,))
        return out
