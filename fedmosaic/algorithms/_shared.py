"""Helpers shared by several algorithms: weighted averaging, class means, shared-weight base."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.core import secure
from fedmosaic.core.aggregate import weighted_average  # noqa: F401  (the methods import it here)
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.schema import Update


def check_state_like(state: dict[str, Tensor], template: dict[str, Tensor], what: str) -> None:
    """Raise :class:`PayloadError` if ``state`` differs from ``template`` in names/dtypes/shapes."""
    if state.keys() != template.keys():
        extra = sorted(set(state) - set(template))[:5]
        missing = sorted(set(template) - set(state))[:5]
        raise PayloadError(f"{what}: unexpected tensors {extra}, missing {missing}")
    for k, t in template.items():
        x = state[k]
        if x.dtype != t.dtype or x.shape != t.shape:
            raise PayloadError(
                f"{what}: {k} is {x.dtype}{tuple(x.shape)}, expected {t.dtype}{tuple(t.shape)}"
            )


# Rows per forward pass when collecting class means (eval mode: batches only change float
# rounding). 100, not 1000: at 1000 a gray CNN's first activation (32 x 24 x 24 floats, 74 KB per
# image) is 74 MB, far past the 32 MB L3, and the pass runs at half speed (HtCNN8's eight models,
# 1,000 images each, one thread: 0.83 s at 100 vs 1.72 s at 1000; 50 and 20 are no faster).
PROTO_BATCH = 100


class StoredState(nn.Module):
    """A state dict kept as buffers, e.g. a client's head or whole model as its last local training
    left it (evaluated beside the received global one). Buffers: never trained, checkpointed with
    the client's extras."""

    def __init__(self, state: dict[str, Tensor]) -> None:
        super().__init__()
        self.names = list(state)
        for k, v in state.items():
            self.register_buffer(k.replace(".", "__"), v.detach().clone())

    def state(self) -> dict[str, Tensor]:
        return {k: getattr(self, k.replace(".", "__")) for k in self.names}

    @torch.no_grad()
    def store(self, state: dict[str, Tensor]) -> None:
        for k, v in state.items():
            getattr(self, k.replace(".", "__")).copy_(v)


class FeatureModel(Protocol):
    """What ``class_means`` reads of a model: a ClientModel, or a view of one whose "features"
    are something else (FedDistill's logits)."""

    training: bool
    feature_dim: int

    def eval(self) -> object: ...

    def train(self, mode: bool = True) -> object: ...

    def features(self, x: Tensor) -> Tensor: ...


@torch.no_grad()
def class_means(
    model: FeatureModel,
    data: ClientData,
    num_classes: int,
    batch_size: int = PROTO_BATCH,
    keep: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact per-class mean representation over the training split, in eval mode.

    ``keep``: only the split's first ``keep`` examples in stored order (None: all of them).
    Returns ``protos [C, d]`` (zero rows for absent classes) and ``counts [C]`` (int64).
    """
    was_training = model.training
    model.eval()
    d = model.feature_dim
    sums = torch.zeros(num_classes, d, device=data.device)
    counts = torch.zeros(num_classes, dtype=torch.long, device=data.device)
    seen = 0
    for x, y in data.iter_batches("train", batch_size):
        if keep is not None:
            if seen >= keep:
                break
            x, y = x[: keep - seen], y[: keep - seen]
            seen += int(y.numel())
        f = model.features(x)  # [B, d]
        sums.index_add_(0, y, f.float())
        counts.index_add_(0, y, torch.ones_like(y))
    model.train(was_training)
    protos = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
    return protos.cpu(), counts.cpu()


@dataclass(frozen=True)
class SharedState(Payload):
    """A state dict of the shared part (parameters and buffers)."""

    # shared: what the server holds of it; an update of it to the guard
    state: Annotated[dict[str, Tensor], "like shared", Update("shared")]


BNMode = Literal["average", "local_stats", "local"]
_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


def batchnorm_keys(module: nn.Module, with_affine: bool) -> frozenset[str]:
    """State-dict names of ``module``'s BatchNorm statistics (and affine weights if asked)."""
    keys: set[str] = set()
    names = set(module.state_dict())
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            pre = f"{name}." if name else ""
            for k in _BN_STATS + (("weight", "bias") if with_affine else ()):
                if pre + k in names:
                    keys.add(pre + k)
    return frozenset(keys)


@dataclass(frozen=True)
class SharedWeights(Algorithm[dict[str, Tensor], SharedState, SharedState]):
    """Base for the average-a-part family: FedAvg, FedProx, FedPer, FedRep, LG-FedAvg, FedBABU.

    Subclasses set ``shared`` (a model part) and may override the client's loss or phases.

    ``bn`` says what happens to the shared part's BatchNorm layers:
    - ``average`` (default): parameters *and* running statistics are averaged like every other
      tensor of the state dict (FedAvg on a state dict, as FedBABU's and FedClassAvg's code do);
    - ``local_stats``: running statistics never leave the client; only parameters are averaged
      (PFLlib/HtFLlib average ``model.parameters()`` only);
    - ``local``: whole BatchNorm layers stay local, affine weights too (FedBN, Li et al., ICLR 2021).
    """

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    shared: ClassVar[str] = "all"

    # average | local_stats (PFLlib) | local (FedBN); see the class docstring
    bn: BNMode = "average"

    def local_keys(self, module: nn.Module) -> frozenset[str]:
        """Names in the shared part's state dict that stay on the client (per ``bn``)."""
        if self.bn == "average":
            return frozenset()
        return batchnorm_keys(module, with_affine=self.bn == "local")

    def shared_state(self, model: ClientModel) -> dict[str, Tensor]:
        """Detached copy of what this method shares of ``model`` (the part minus local keys)."""
        state = model.part_state(self.shared)
        local = self.local_keys(model.part(self.shared))
        return {k: v for k, v in state.items() if k not in local}

    def load_shared(self, model: ClientModel, state: dict[str, Tensor]) -> None:
        """Load a shared state into ``model``'s part, leaving its local keys untouched."""
        if self.bn == "average":
            model.load_part_state(self.shared, state)
            return
        module = model.part(self.shared)
        own = {k: v for k, v in module.state_dict().items() if k not in self.local_keys(module)}
        check_state_like(state, own, f"state for part {self.shared!r}")
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(state[k])

    def init_server(self, spec: FederationSpec) -> dict[str, Tensor]:
        return self.shared_state(spec.build_model(0))

    def broadcast(self, state: dict[str, Tensor], client_id: int, round_num: int) -> SharedState:
        return SharedState(state)

    def aggregate(
        self, state: dict[str, Tensor], uploads: Sequence[Weighted[SharedState]], round_num: int
    ) -> dict[str, Tensor]:
        states = [u.payload.state for u in uploads]
        return weighted_average(states, [u.weight for u in uploads], reference=state)

    def summands(self, upload: SharedState, weight: float) -> dict[str, Tensor]:
        return secure.state_terms(upload.state, weight)  # the weighted mean's numerator, weight

    def from_sums(
        self, state: dict[str, Tensor], sums: Mapping[str, Tensor], round_num: int
    ) -> Weighted[SharedState]:
        mean, total = secure.state_from_terms(sums, state)
        # a subclass's Upload (FedBABU's BodyUpload) has the same ``state`` and its costs
        return Weighted(-1, total, cast(SharedState, secure.rebuilt(self.Upload, state=mean)))

    def server_model(self, state: dict[str, Tensor], spec: FederationSpec) -> ClientModel | None:
        """The global model, where the server holds a whole one: ``shared = "all"`` with
        BatchNorm statistics averaged (``bn = "average"``) in a homogeneous federation. Under
        ``local_stats``/``local`` each client keeps its own statistics: there is no global model."""
        if self.shared != "all" or self.bn != "average" or not spec.homogeneous:
            return None
        model = spec.build_model(0)
        self.load_shared(model, state)
        return model

    def upload_model(self, model: ClientModel, upload: SharedState) -> ClientModel | None:
        """The whole model when the whole model is shared with its BatchNorm statistics (as
        :meth:`server_model`); a part (or local statistics) leaves the server without one."""
        if self.shared != "all" or self.bn != "average":
            return None
        view = copy.deepcopy(model)
        self.load_shared(view, upload.state)
        return view

    def upload_names(self, state: dict[str, Tensor], upload: SharedState) -> dict[str, Any]:
        return {"shared": state}

    def receive(self, model: ClientModel, extras: nn.Module, msg: SharedState) -> None:
        self.load_shared(model, msg.state)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: SharedState
    ) -> SharedState:
        return SharedState(self.shared_state(model))


Distance = Literal["euclidean", "mse"]  # a prototype method's client term phi (FedProto, FedTGP)


def alignment_loss(
    features: Tensor, y: Tensor, protos: Tensor, known: Tensor, distance: Distance = "euclidean"
) -> Tensor:
    """``phi(f(x), P_hat[y])`` over a batch; rows whose class has no global prototype add 0.

    ``euclidean`` (paper): ``mean_i ||f_i - P[y_i]||_2`` over all ``B`` rows. ``mse`` (reference
    code): ``MSELoss(f, target)`` where rows without a prototype target themselves, i.e.
    ``sum_i ||f_i - P[y_i]||^2 / (B * d)`` over the rows with one.
    """
    has = known[y]  # [B] bool; the floor 1e-12 before sqrt keeps the gradient finite at 0
    target = torch.where(has.unsqueeze(1), protos[y], features.detach())  # [B, d]
    if distance == "mse":
        return F.mse_loss(features, target)
    sq = (features - target).pow(2).sum(1)  # [B]
    return torch.where(has, sq.clamp_min(1e-12).sqrt(), torch.zeros_like(sq)).mean()
