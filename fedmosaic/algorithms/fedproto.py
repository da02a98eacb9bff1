"""FedProto (Tan et al., Federated Prototype Learning across Heterogeneous Clients, AAAI 2022).

Shared: per-class mean features only. Each client uploads its local prototypes ``protos [C, d]``
(class means of ``f(x)`` over its training split) with ``counts [C]``; the server averages them per
class and broadcasts ``protos [C, d]`` + ``known [C]``. Encoders and heads stay local, so every
client may have its own architecture (only ``feature_dim`` is common). Client loss:
``CE(h(f(x)), y) + lam * MSE(f(x), P[y])``; inference by the nearest global prototype.

Why the defaults are the code's: FedProto's authors' code (as PFLlib's and HtFLlib's) takes the
plain server mean, the MSE term and ``lam = 1``; it is the likely source of FedProto's published
numbers, so those are the defaults. FedTGP's paper describes FedProto differently (a Euclidean
term, ``lam = 0.1``): ``distance="euclidean", lam=0.1`` is that form.

Paper vs reference code vs default, and other choices (the authors' code, PFLlib, HtFLlib):

- Server mean. Paper: its aggregation equation weights client k's prototype of class c by
  ``|D_k,c| / N_c`` (its example count of the class). Reference code (the authors', PFLlib,
  HtFLlib): the plain mean over the clients that have the class. Default: ``weighting =
  "uniform"``, the code's plain mean; ``weighting = "count"`` is the count-weighted mean
  ``sum_k n_kc p_kc / sum_k n_kc`` (the paper's weights normalized to sum to 1). Both recompute
  the prototypes from this round's uploads only (as paper and code do): with partial
  participation a class no sampled client holds becomes unknown for that round.
- Inference. Paper: the nearest global prototype (over every known class) -- the default,
  ``inference = "all"``. The authors' code compares a client's features with the global
  prototypes of the classes that client holds only: ``inference = "own"`` (classes with training
  examples on the client; a client none of whose classes has a prototype falls back to its head).
- Local prototypes are exact class means computed after local training with the final local model
  in eval mode. The reference code averages features collected during training (a moving model in
  train mode, so dropout/BatchNorm noise and stale early-epoch features leak in).
- Loss normalization: ``F.mse_loss`` mean over all ``B * d`` elements, rows whose class has no
  global prototype included with target = their own detached feature (zero value, zero gradient),
  exactly as ``nn.MSELoss`` in the reference code, so ``lam`` means the same as in their scripts.
  (An early PFLlib version used a zero target for such rows, pulling them to the origin; not copied.)
  The paper writes the regularizer on local prototypes; all reference code applies it per sample,
  and so do we.
- Client term. ``distance = "mse"`` (default): ``MSELoss`` as above. ``distance = "euclidean"``:
  the per-sample Euclidean distance ``mean_i ||f(x_i) - P[y_i]||_2`` (rows without a prototype add
  0), FedProto's regularizer as FedTGP's paper writes it (its Eq. 4, "the same as FedProto" for
  its own Eq. 11), so that FedTGP and FedProto can be compared with one client term.
- ``lam = 1.0``: the argparse default of PFLlib, HtFLlib and the authors' code (``--ld 1``).
  HtFLlib's example scripts use ``-lam 10`` for CIFAR ResNets; FedTGP's comparison tables use
  ``lam = 0.1`` ("the same as FedProto") -- set ``algorithm.lam = 0.1`` to reproduce those tables.
- ``acc`` is nearest-global-prototype accuracy; while no global prototype exists yet (e.g. every
  upload of the round was rejected) it falls back to the head's prediction, where the reference
  reports 0 accuracy. ``acc_head`` (the local head's accuracy) is always reported as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, cast, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._shared import Distance, alignment_loss, class_means
from fedmosaic.core.aggregate import class_average
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Counts, Rows
from fedmosaic.core.secure import WEIGHT

Weighting = Literal["uniform", "count"]
Inference = Literal["all", "own"]


@dataclass(frozen=True)
class ProtoUpload(Payload):
    """A client's local prototypes and how many training examples each one averages."""

    # zero rows for classes the client does not have; to the guard, the rows where counts > 0
    protos: Annotated[
        Tensor, "[C, d] float32", Rows(where="counts", ref="glob", known="known", features=True)
    ]
    counts: Annotated[Tensor, "[C] int64 >= 0 sum <= MAX_EXAMPLES", Counts()]


@dataclass(frozen=True)
class ProtoBroadcast(Payload):
    """Global prototypes; ``known[c]`` is False where no client had class ``c``."""

    protos: Tensor  # [C, d] float32; zero rows where unknown
    known: Tensor  # [C] bool


@dataclass
class ProtoState:
    """Server state: the current global prototypes (on CPU)."""

    protos: Tensor  # [C, d] float32
    known: Tensor  # [C] bool


def aggregate_prototypes(
    protos: Tensor, counts: Tensor, weighting: Weighting = "uniform"
) -> tuple[Tensor, Tensor]:
    """Per-class mean of client prototypes over the clients that have the class.

    ``protos [K, C, d]`` and ``counts [K, C]`` from ``K`` clients. ``weighting="count"`` weights
    client ``k``'s prototype of class ``c`` by ``counts[k, c]``; ``"uniform"`` weights every client
    holding the class equally. Returns ``protos [C, d]`` (float32, zero rows where unknown) and
    ``known [C]`` (bool).
    """
    if weighting == "count":
        w = counts.to(torch.float64)  # [K, C]
    elif weighting == "uniform":
        w = (counts > 0).to(torch.float64)  # [K, C]
    else:
        raise ValueError(
            f"weighting = {weighting!r}; choose one of {', '.join(get_args(Weighting))}"
        )
    total = w.sum(0)  # [C]
    known = total > 0  # [C]
    summed = torch.einsum("kc,kcd->cd", w, protos.to(torch.float64))  # [C, d]
    # float64 accumulation: counts can be large and prototypes of similar magnitude.
    mean = summed / total.clamp(min=1.0).unsqueeze(1)  # [C, d]; unknown rows stay 0
    return mean.to(torch.float32), known


def prototype_loss(features: Tensor, y: Tensor, protos: Tensor, known: Tensor) -> Tensor:
    """``mean over B*d of (f(x) - P[y])^2``; rows whose class is unknown contribute exactly 0.

    Those rows target their own detached feature, so they add nothing to the sum and pass no
    gradient, but still count in the ``B * d`` denominator (as ``nn.MSELoss`` in the reference).
    """
    target = torch.where(known[y].unsqueeze(1), protos[y], features.detach())  # [B, d]
    return F.mse_loss(features, target)


def nearest_prototype_scores(features: Tensor, protos: Tensor, known: Tensor) -> Tensor:
    """Scores ``[B, C]``: minus the Euclidean distance to each global prototype; ``-inf`` if unknown."""
    dist = torch.cdist(features.float(), protos.float())  # [B, C]
    return (-dist).masked_fill(~known.unsqueeze(0), float("-inf"))


class OwnClasses(nn.Module):
    """Client extras: which classes the client holds (for ``inference = "own"``)."""

    own: Tensor  # a buffer (registered below), declared for the checker

    def __init__(self, own: Tensor) -> None:
        super().__init__()
        self.register_buffer("own", own)  # [C] bool: training examples of the class exist


@ALGORITHMS.register("fedproto")
@dataclass(frozen=True)
class FedProto(Algorithm[ProtoState, ProtoBroadcast, ProtoUpload]):
    """Share per-class mean features; pull local features towards the global prototypes."""

    per_example_loss: ClassVar[bool] = True  # cross-entropy + the prototype term per row

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    lam: float = 1.0  # weight of the prototype MSE term (PFLlib/HtFLlib default; FedTGP used 0.1)
    # server mean per class: uniform (reference code) | count (paper)
    weighting: Weighting = "uniform"
    inference: Inference = "all"  # nearest prototype over: all known (paper) | own (authors')
    # client term: mse (the reference code's MSELoss) | euclidean (FedTGP's Eq. 4 writes FedProto's
    # term as the Euclidean distance: FedTGP's comparison with one client term for both)
    distance: Distance = "mse"

    supports_heterogeneous: ClassVar[bool] = True
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)
    paper: ClassVar[str] = (
        "Tan et al., FedProto: Federated Prototype Learning across Heterogeneous Clients, AAAI 2022"
    )

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ValueError(f"lam = {self.lam} must be >= 0")

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> ProtoState:
        return ProtoState(
            protos=torch.zeros(spec.num_classes, spec.feature_dim),
            known=torch.zeros(spec.num_classes, dtype=torch.bool),
        )

    def broadcast(self, state: ProtoState, client_id: int, round_num: int) -> ProtoBroadcast:
        return ProtoBroadcast(protos=state.protos, known=state.known)

    def upload_names(self, state: ProtoState, upload: ProtoUpload) -> dict[str, Any]:
        c, d = state.protos.shape
        return {"C": c, "d": d, "glob": state.protos, "known": state.known}

    def aggregate(
        self, state: ProtoState, uploads: Sequence[Weighted[ProtoUpload]], round_num: int
    ) -> ProtoState:
        protos = torch.stack([u.payload.protos.cpu() for u in uploads])  # [K, C, d]
        counts = torch.stack([u.payload.counts.cpu() for u in uploads])  # [K, C]
        w = counts if self.weighting == "count" else (counts > 0)
        # under a robust rule: clipped deviations from the global prototypes, median / Krum ...
        mean, known = class_average(
            protos,
            counts > 0,
            w.double(),
            state.protos,
            state.known,
            plain=lambda: aggregate_prototypes(protos, counts, self.weighting),
        )
        return ProtoState(protos=mean, known=known)

    def summands(self, upload: ProtoUpload, weight: float) -> dict[str, Tensor]:
        counts = upload.counts.double()  # [C]
        holders = (counts > 0).double()  # [C]: exact in the sum (whole numbers)
        # count weighting: counts / n_i x weight (= counts / the public scale); uniform: 0 or 1
        w = counts / counts.sum().clamp(min=1) * weight if self.weighting == "count" else holders
        return {"holders": holders, WEIGHT: w, "protos": w[:, None] * upload.protos.double()}

    def from_sums(
        self, state: ProtoState, sums: Mapping[str, Tensor], round_num: int
    ) -> Weighted[ProtoUpload]:
        known = sums["holders"] > 0.5  # [C]
        w = sums[WEIGHT].clamp(min=1e-300)[:, None]  # [C, 1]
        protos = torch.where(known[:, None], sums["protos"] / w, 0.0).float()  # [C, d]
        # one upload holding each class someone held: its mean is the rows themselves
        return Weighted(-1, 1.0, ProtoUpload(protos, known.long()))

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        return OwnClasses(data.class_counts("train") > 0)

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: ProtoBroadcast
    ) -> Tensor:
        features = model.features(x)  # [B, d]
        ce = F.cross_entropy(model.head(features), y)
        if self.lam == 0:
            return ce
        if self.distance == "euclidean":  # FedTGP's phi: mean over rows of ||f(x) - P[y]||_2
            return ce + self.lam * alignment_loss(features, y, msg.protos, msg.known, "euclidean")
        return ce + self.lam * prototype_loss(features, y, msg.protos, msg.known)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: ProtoBroadcast
    ) -> ProtoUpload:
        protos, counts = class_means(model, data, model.num_classes)  # [C, d], [C]
        return ProtoUpload(protos=protos.float(), counts=counts.long())

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: ProtoBroadcast
    ) -> dict[str, Tensor]:
        features = model.features(x)  # [B, d]
        logits = model.head(features)  # [B, C]
        known = msg.known
        if self.inference == "own":
            own = cast(OwnClasses, extras).own  # init_client's extras
            known = known & own.to(known.device)  # [C]
        if not bool(known.any()):
            return {"acc": logits, "acc_head": logits}  # no prototype yet: the head decides
        return {
            "acc": nearest_prototype_scores(features, msg.protos, known),
            "acc_head": logits,
        }
