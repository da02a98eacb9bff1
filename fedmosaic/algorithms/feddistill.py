"""FedDistill / FD (Jeong et al., Communication-Efficient On-Device Machine Learning: Federated
Distillation and Augmentation under Non-IID Private Data, NeurIPS-W 2018).

Shared: per-class mean logits only. Each client uploads ``logits [C, C]`` (row ``c`` = the mean
logit vector of its class-``c`` training examples) + ``known [C]`` (which classes it has); the
server averages each row over the clients that have the class and sends each client its global
logits ``G``. Models never leave the clients, so every client may have its own architecture (its
head must output ``C`` logits). Client loss: ``CE(z, y) + lam * MSE(z, G[y])``.

Paper vs reference code vs default, and other choices (reference: PFLlib/HtFLlib
``clientdistill``/``serverdistill``, from the FedLogit code; ``clientfd``/``serverfd``, HtFLlib's
FD):

- Which mean a client receives. Paper (Jeong et al., Algorithm 1, global ensembling): client ``i``
  gets the average of the *other* clients' logits, ``(F_c - F_ic) / (M - 1)`` with ``F_c`` the sum
  over all ``M`` clients -- the default, ``average = "others"``. Per class ``c`` it is the plain
  mean over the clients other than ``i`` that uploaded class ``c`` this round; a class only ``i``
  holds is unknown to ``i``; a client that did not upload this round gets the mean over every
  uploader. Reference code (HtFLlib): one plain mean over every client that has the class, the
  client's own logits included: ``average = "all"``. Either way an unweighted mean over clients
  (the paper's per-label averaging; clients send no class counts), recomputed from this round's
  uploads only (as paper and code do, and as our FedProto does): with partial participation a class
  no sampled client holds becomes unknown for that round.
- Local logits are exact class means computed after local training with the final local model in
  eval mode. The reference averages the outputs produced during training (a moving model in train
  mode, over every local epoch).
- Loss normalization: ``F.mse_loss`` mean over all ``B * C`` elements; rows whose class has no
  global logit target their own detached logits (zero value, zero gradient) but still count in the
  denominator, exactly as ``nn.MSELoss`` in PFLlib's ``clientdistill``, so ``lam`` means the same
  as there.
- ``distill = "kl"`` (option): ``lam * T^2 * KL(softmax(G[y]/T) || softmax(z/T))`` averaged over the
  batch, rows without a global logit contributing 0. This is the soft-target cross-entropy
  ``CE(z, softmax(G[y]))`` of HtFLlib's current ``clientdistill`` and of its ``clientfd`` up to
  late 2025, minus the targets' entropy (a constant): the same gradients at ``T = 1``. Since late
  2025 HtFLlib's ``clientfd`` passes the raw global logits ``G[y]`` themselves as the soft targets of
  ``nn.CrossEntropyLoss`` (unnormalized, possibly negative "probabilities": the loss is then
  ``-sum_j G[y]_j log softmax(z)_j``, not a divergence). That form is not offered: our targets are
  always softmax probabilities of the global logits.
- ``lam = 1.0``: HtFLlib's default (``-lam 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._distill import kl_rows
from fedmosaic.algorithms._shared import class_means
from fedmosaic.core.aggregate import class_average, robust_rule_in_force
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Claims, Rows

Distill = Literal["mse", "kl"]
Average = Literal["others", "all"]


@dataclass(frozen=True)
class ClassLogits(Payload):
    """Per-class mean logits; ``known[c]`` is False where the class has no examples (row is 0)."""

    # row c = mean logit vector of class-c examples; to the guard, the rows where known
    logits: Annotated[Tensor, "[C, C] float32", Rows(where="known", ref="glob", known="held")]
    known: Annotated[Tensor, "[C] bool", Claims()]


@dataclass
class FDState:
    """Server state (CPU): this round's global mean and every client's upload of this round."""

    logits: Tensor  # [C, C] float32: the mean over every uploader (average = "all")
    known: Tensor  # [C] bool
    client_logits: Tensor  # [N, C, C] float32: this round's uploads (zeros: no upload)
    client_known: Tensor  # [N, C] bool: False for every class of a client that did not upload


class _LogitsAsFeatures(nn.Module):
    """A view of a model whose "features" are its logits, so ``class_means`` averages logits."""

    def __init__(self, model: ClientModel) -> None:
        super().__init__()
        self.model = model
        self.feature_dim = model.num_classes
        self.train(model.training)  # class_means restores this mode afterwards

    def features(self, x: Tensor) -> Tensor:
        return self.model(x)  # [B, C]


def aggregate_logits(logits: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
    """Per-class mean of ``logits [K, C, C]`` over the clients with ``known [K, C]`` True.

    Returns ``logits [C, C]`` (zero rows where no client has the class) and ``known [C]``.
    """
    mask = known.to(torch.float64)  # [K, C]
    num = mask.sum(0)  # [C] clients holding each class
    summed = torch.einsum("kc,kcj->cj", mask, logits.to(torch.float64))  # [C, C]
    mean = summed / num.clamp(min=1.0).unsqueeze(1)  # [C, C]
    return mean.to(torch.float32), num > 0


def leave_one_out(client_logits: Tensor, client_known: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """Per class, the mean of the other clients' logits: ``(F_c - F_ic) / (M_c - 1)``.

    ``client_logits [N, C, C]``, ``client_known [N, C]``; ``M_c`` clients hold class ``c`` and
    ``F_c`` is the sum of their rows. Client ``i``'s row is left out where it holds the class.
    Returns ``logits [C, C]`` (zero rows where no other client has the class) and ``known [C]``.
    """
    others = client_known.to(torch.float64)  # [N, C]
    others[i] = 0.0  # summing the others directly: exactly F_c - F_ic, without the cancellation
    summed = torch.einsum("kc,kcj->cj", others, client_logits.to(torch.float64))  # [C, C]
    count = others.sum(0)  # [C]: M_c - 1 where client i holds the class, else M_c
    mean = summed / count.clamp(min=1.0).unsqueeze(1)
    known = count > 0
    return torch.where(known.unsqueeze(1), mean, 0.0).to(torch.float32), known


def distill_loss(
    logits: Tensor,
    y: Tensor,
    global_logits: Tensor,
    known: Tensor,
    kind: str = "mse",
    T: float = 1.0,
) -> Tensor:
    """The distillation term for a batch: rows whose class is not ``known`` contribute exactly 0.

    ``mse``: mean over ``B * C`` of ``(z - G[y])^2``. ``kl``: ``T^2 * sum_rows KL(softmax(G[y]/T) ||
    softmax(z/T)) / B``.
    """
    has = known[y]  # [B]
    if kind == "mse":
        target = torch.where(has.unsqueeze(1), global_logits[y], logits.detach())  # [B, C]
        return F.mse_loss(logits, target)
    if kind == "kl":
        rows = kl_rows(logits, global_logits[y], T)  # [B]
        return (T * T) * torch.where(has, rows, torch.zeros_like(rows)).sum() / y.numel()
    raise ValueError(f"distill = {kind!r}; choose one of {', '.join(get_args(Distill))}")


@ALGORITHMS.register("feddistill")
@dataclass(frozen=True)
class FedDistill(Algorithm[FDState, ClassLogits, ClassLogits]):
    """Share per-class mean logits; pull each example's logits towards its class's global mean."""

    secure_refusal: ClassVar[str] = (
        "its server keeps each client's class-mean logits to send each client the others' mean"
    )

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    lam: float = 1.0  # weight of the distillation term (HtFLlib default)
    distill: Distill = "mse"  # mse (paper, PFLlib) | kl (soft targets softmax(G[y]/T), HtFLlib)
    T: float = 1.0  # softmax temperature of the kl variant (unused by mse)
    average: Average = "others"  # mean a client gets: others (paper, leave-one-out) | all (HtFLlib)

    supports_heterogeneous: ClassVar[bool] = True
    paper: ClassVar[str] = (
        "Jeong et al., Communication-Efficient On-Device Machine Learning: Federated Distillation "
        "and Augmentation under Non-IID Private Data, NeurIPS Workshop 2018"
    )

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ValueError(f"lam = {self.lam} must be >= 0")
        if self.T <= 0:
            raise ValueError(f"T = {self.T} must be > 0")

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> FDState:
        n, c = spec.num_clients, spec.num_classes
        return FDState(
            logits=torch.zeros(c, c),
            known=torch.zeros(c, dtype=torch.bool),
            client_logits=torch.zeros(n, c, c),
            client_known=torch.zeros(n, c, dtype=torch.bool),
        )

    def broadcast(self, state: FDState, client_id: int, round_num: int) -> ClassLogits:
        if self.average == "all" or not bool(state.client_known[client_id].any()):
            return ClassLogits(state.logits, state.known)  # nothing of this client's to leave out
        return ClassLogits(*leave_one_out(state.client_logits, state.client_known, client_id))

    def aggregate(
        self, state: FDState, uploads: Sequence[Weighted[ClassLogits]], round_num: int
    ) -> FDState:
        logits = torch.stack([u.payload.logits.cpu() for u in uploads])  # [K, C, C]
        known = torch.stack([u.payload.known.cpu() for u in uploads])  # [K, C]
        client_logits = torch.zeros_like(state.client_logits)  # this round's uploads only
        client_known = torch.zeros_like(state.client_known)
        if robust_rule_in_force():
            # Leave-one-out means of the raw uploads would let a poisoned row through: every
            # client gets the robust all-client aggregate (no per-client rows are kept).
            robust_mean = class_average(logits, known, known.double(), state.logits, state.known)
            return FDState(*robust_mean, client_logits, client_known)
        for u, lg, kn in zip(uploads, logits, known, strict=True):
            client_logits[u.client_id] = torch.where(kn.unsqueeze(1), lg, 0.0)
            client_known[u.client_id] = kn
        return FDState(*aggregate_logits(logits, known), client_logits, client_known)

    def upload_names(self, state: FDState, upload: ClassLogits) -> dict[str, Any]:
        return {"C": state.known.numel(), "glob": state.logits, "held": state.known}

    # ---- client half ---------------------------------------------------------------------
    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: ClassLogits
    ) -> Tensor:
        z = model(x)  # [B, C]
        ce = F.cross_entropy(z, y)
        if self.lam == 0:
            return ce
        return ce + self.lam * distill_loss(z, y, msg.logits, msg.known, self.distill, self.T)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: ClassLogits
    ) -> ClassLogits:
        logits, counts = class_means(_LogitsAsFeatures(model), data, model.num_classes)
        return ClassLogits(logits, counts > 0)
