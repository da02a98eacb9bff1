"""FedBABU (Oh, Kim, Yun, ICLR 2022): body aggregation, fixed random head, body update.

Oh, Kim, Yun. FedBABU: Toward Enhanced Representation for Federated Image Classification. ICLR 2022.

Shared: the body (encoder: parameters and buffers), sample-weighted average, both directions. The
head stays at its random initialization during the federated rounds - the same on every client,
because every client starts from the server's initial model ``spec.build_model(0)`` (what the
reference code's ``copy.deepcopy(net_glob)`` does before round 1), so the head costs no bytes.
After the last round every client fine-tunes locally (``finetune_part``: the whole model, as the
paper, or the head only) for ``finetune_epochs``; the round loop reports accuracy before and after.

Where we differ from the reference code (jhoon-oh/FedBABU, PFLlib's clientbabu):
- the head is frozen with ``requires_grad=False`` (no gradient computed); the reference sets the
  head's learning rate to 0 (gradient computed, never applied): identical weights, less compute.
- aggregation is weighted by training examples (as PFLlib); the authors' script takes the
  plain mean over the round's clients (equal shards in its experiments).
- the body's BatchNorm statistics are averaged with its parameters (state-dict FedAvg, as the
  authors' code); ``bn = "local_stats"`` keeps them on each client (PFLlib/HtFLlib average
  parameters only), ``bn = "local"`` keeps whole BatchNorm layers local (FedBN).
- uploads also carry ``train_macs`` (this round's forward + backward MACs) and ``paper_cost``
  (trainable parameters x examples, the layer-expansion paper's Table 4 measure), see
  ``models/flops.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, cast

import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._shared import SharedState, SharedWeights
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, FitContext, Phase
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Update
from fedmosaic.models.flops import paper_cost, training_macs

FinetunePart = Literal["all", "head"]  # what fine-tuning trains
BODY = ("encoder",)  # what trains during the federated rounds: the body only


@dataclass(frozen=True)
class BodyUpload(Payload):
    """A client's body after local training, and what that training cost."""

    # encoder state dict (params and buffers), an update of the server's body
    state: Annotated[dict[str, Tensor], "like body", Update("body")]
    train_macs: Annotated[int, "int >= 0"]  # this round's forward + backward MACs (models.flops)
    # this round's Table 4 cost: trainable parameters x examples (models.flops.paper_cost)
    paper_cost: Annotated[int, "int >= 0"]


class RoundCounter(nn.Module):
    """Client extras: training examples processed this round and the input shape (for compute accounting)."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)  # [C, H, W]
        self.examples = 0  # reset in before_fit, counted in loss


def start_from_server_init(model: ClientModel, spec: FederationSpec) -> None:
    """Load the server's initial model (``spec.build_model(0)``, body and head) into ``model``.

    Every party can rebuild it from the seed, so the shared random head never travels.
    """
    init = spec.build_model(0)
    own = model.state_dict()
    theirs = init.state_dict()
    if own.keys() != theirs.keys() or any(own[k].shape != theirs[k].shape for k in own):
        raise ValueError(
            "FedBABU-style methods need every client to have the server's architecture "
            f"(client model {model.arch!r} differs from client 0's {init.arch!r})"
        )
    model.load_state_dict(theirs)


def finetune_phase(part: str, epochs: int) -> tuple[Phase, ...]:
    """Local fine-tuning after the last round: the whole model (``all``) or the head only."""
    if epochs <= 0:
        return ()
    return (Phase((part,), epochs, name="finetune"),)


def check_finetune(epochs: int) -> None:
    if epochs < 0:
        raise ValueError(f"finetune_epochs = {epochs} must be >= 0")


@ALGORITHMS.register("fedbabu")
@dataclass(frozen=True)
class FedBABU(SharedWeights, Algorithm[dict[str, Tensor], SharedState, BodyUpload]):
    """Train and average the body; keep the shared random head fixed; fine-tune at the end."""

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    supports_heterogeneous: ClassVar[bool] = False
    shared: ClassVar[str] = "encoder"
    paper: ClassVar[str] = (
        "Oh, Kim, Yun, FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022"
    )

    finetune_epochs: int = 5  # fine-tuning epochs after the last round; [train] can override
    # what fine-tuning trains: all (body + head, the paper) | head
    finetune_part: FinetunePart = "all"

    def __post_init__(self) -> None:
        check_finetune(self.finetune_epochs)

    # ---- server half: SharedWeights (init from spec.build_model(0), weighted body average) ------
    # The Upload is narrowed to BodyUpload (Algorithm[..., BodyUpload] among the bases, see
    # core/algorithm.py) where SharedWeights declares SharedState: the checker sees an override
    # that narrows an argument (or widens a return) and cannot follow the redeclaration.
    def upload_metrics(self, upload: BodyUpload) -> dict[str, float]:  # type: ignore[override]
        return {"train_macs": float(upload.train_macs), "paper_cost": float(upload.paper_cost)}

    def upload_names(  # type: ignore[override]  # Upload narrowed to BodyUpload (above)
        self, state: dict[str, Tensor], upload: BodyUpload
    ) -> dict[str, Any]:
        return {"body": state}

    # ---- client half -------------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        start_from_server_init(model, spec)
        return RoundCounter(spec.input_shape)

    def before_fit(self, ctx: FitContext[SharedState]) -> None:
        cast(RoundCounter, ctx.extras).examples = 0  # init_client's extras

    def phases(self, round_num: int, epochs: int) -> tuple[Phase, ...]:
        return (Phase(BODY, epochs, name="body"),)  # the head never trains during the rounds

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: SharedState
    ) -> Tensor:
        cast(RoundCounter, extras).examples += int(x.shape[0])  # init_client's extras
        return F.cross_entropy(model(x), y)

    def upload(  # type: ignore[override]  # Upload narrowed to BodyUpload (above)
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: SharedState
    ) -> BodyUpload:
        counter = cast(RoundCounter, extras)  # init_client's extras
        macs = training_macs(model, counter.input_shape, BODY, counter.examples)
        cost = paper_cost(model, BODY, counter.examples)
        return BodyUpload(self.shared_state(model), macs, cost)

    def finetune_phases(self, epochs: int | None) -> tuple[Phase, ...]:
        return finetune_phase(
            self.finetune_part, self.finetune_epochs if epochs is None else epochs
        )
