"""FedGH (Yi et al., ACM MM 2023): a global prediction header trained on the server.

Yi, Wang, Liu, Shi, Yu. FedGH: Heterogeneous Federated Learning with Generalized Global Header.
ACM Multimedia 2023 (arXiv:2303.13137).

Shared: the head ``Linear(feature_dim, C)``, which lives on the server and is broadcast to every
client; clients upload their exact per-class mean representations (LARs, Eq. 3) of the classes they
hold, with those classes' labels, computed in eval mode after local training. Local: each client's
encoder (any architecture) and its own trained head. The server trains the head with CE on the
uploaded (LAR, label) pairs (Eq. 4); a client replaces its head with the received one (Eq. 5) and
trains the whole model with CE (Eq. 6).

Evaluation (the paper: "the accuracy of each client's local model"): ``acc`` is the client's local
model after its last local training, i.e. its encoder + the head it trained locally from the
received global header (Algorithm 1). ``acc_global`` is the client's encoder + the server's latest
global header (what this library reported as ``acc`` before). A client that has not trained yet
holds the received global header (Eq. 5), so both modes agree for it.

Server step (``server_step``, with ``server_batch_size = 0``): ``"pair"`` (default, Eq. 4 and the
authors' code) takes one SGD step per uploaded (client, class) pair: the participating clients in a
random order drawn from the round's seeded server stream, each client's pairs in increasing class
order. ``"client"`` takes one step per client on the mean CE over its LARs (this library's earlier
default: |C_k| times smaller steps), clients in the same seeded order.

Where we differ from the reference code (HtFLlib ``servergh.py``/``clientgh.py``):
- the authors' code is known to never step the header (its optimizer is built but the header is
  not updated); we train it every round, as the paper says (the HtFLlib port also steps it).
- HtFLlib pools every (LAR, label) pair and shuffles them into minibatches of the client batch size
  (10): ``server_batch_size = 10`` (then ``server_step`` is not used).
- the upload is ``protos [k, d]`` + ``classes [k]`` (k = |C_k|, sorted int64 class ids) instead of
  a dict keyed by class; no class counts leave the client.
- LARs are exact means over the whole training split; HtFLlib iterates its training loader
  (``shuffle=False, drop_last=True``), so the same ragged tail is left out every round (a class
  held only there is not uploaded): ``lar_batch = 10`` does the same (the split in stored order
  less its last ``n mod 10`` examples).
- the global header starts from client 0's initial head (as HtFLlib); clients' own initial heads
  are replaced by it when they first receive it.

The authors' own code (github.com/LipingYi/FedGH) differs further from the paper and from us
(optimizer, augmentation, LARs, header, data split): see ``docs/algorithms/fedgh.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmosaic.algorithms._shared import SharedState, class_means
from fedmosaic.core import seeding
from fedmosaic.core.aggregate import server_points
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, FitContext, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Claims, Rows

ServerStep = Literal["pair", "client"]


@dataclass(frozen=True)
class ClassMeans(Payload):
    """A client's local averaged representations (LARs) of the classes it holds, with labels."""

    # k = |C_k|; row i: the LAR of class classes[i] (no global rows: the peer guard bounds them)
    protos: Annotated[Tensor, "[k, d] float32", Rows(classes="classes", features=True)]
    classes: Annotated[Tensor, "[k] int64 increasing in [0, C)", Claims()]


@dataclass
class FedGHState:
    """The server's persistent global head (on CPU) and the seed of its shuffling streams."""

    head: dict[str, Tensor]  # the global header Linear(d, C): weight [C, d], bias [C]
    seed: int


def check_linear_head(head: nn.Module, feature_dim: int, num_classes: int, where: str) -> None:
    """FedGH replaces every client's head with one ``Linear(feature_dim, C)``."""
    if not (
        isinstance(head, nn.Linear)
        and head.in_features == feature_dim
        and head.out_features == num_classes
        and head.bias is not None
    ):
        raise ValueError(
            f"fedgh needs a Linear({feature_dim}, {num_classes}) head with bias; {where} has {head}"
        )


class FedGHClient(nn.Module):
    """Client extras: whether the client has trained (its head is then its own trained one)."""

    trained: Tensor  # a buffer (registered below), declared for the checker

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("trained", torch.zeros((), dtype=torch.bool))


def server_step_batches(
    sizes: Sequence[int], batch_size: int, gen: torch.Generator, step: str = "pair"
) -> list[Tensor]:
    """Index batches into the pooled pairs for one server epoch.

    ``sizes[k]`` = number of pairs of upload ``k`` (pooled in upload order, each upload's pairs in
    increasing class order). ``batch_size = 0``: uploads in a random order drawn from ``gen``;
    ``step = "pair"``: one single-pair batch per pair (Eq. 4), an upload's pairs in order;
    ``step = "client"``: one batch per upload. ``batch_size > 0``: all pairs shuffled into
    minibatches of ``batch_size``, the last one possibly smaller (HtFLlib).
    """
    total = int(sum(sizes))
    if batch_size > 0:
        return list(torch.randperm(total, generator=gen).split(batch_size))
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    order = torch.randperm(len(sizes), generator=gen).tolist()
    rows = [torch.arange(starts[k], starts[k + 1]) for k in order if sizes[k] > 0]
    if step == "client":
        return rows
    return [p for r in rows for p in r.split(1)]


def train_global_head(
    head: dict[str, Tensor],
    protos: Tensor,
    labels: Tensor,
    batches_per_epoch: Sequence[Sequence[Tensor]],
    eta_g: float,
) -> None:
    """SGD on ``CE(linear(protos[b]), labels[b])`` over the given batches, on the head's
    ``weight [C, d]`` and ``bias [C]`` in place (leaf tensors; the caller passes copies).

    ``protos [N, d]`` are the pooled class means, ``labels [N]`` their classes; one list of index
    batches per server epoch.
    """
    w, bias = head["weight"].requires_grad_(True), head["bias"].requires_grad_(True)
    opt = torch.optim.SGD([w, bias], lr=eta_g)
    with torch.enable_grad():
        for batches in batches_per_epoch:
            for b in batches:
                loss = F.cross_entropy(F.linear(protos[b], w, bias), labels[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    for p in (w, bias):
        p.requires_grad_(False)
        p.grad = None


@ALGORITHMS.register("fedgh")
@dataclass(frozen=True)
class FedGH(Algorithm[FedGHState, SharedState, ClassMeans]):
    """A server-trained global head on clients' class-mean representations."""

    secure_refusal: ClassVar[str] = "its server trains the shared head on each client's class means"

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    eta_g: float = 0.01  # server learning rate of the global head (paper: 0.01)
    server_epochs: int = 1  # passes over the round's (class mean, label) pairs (reference: 1)
    # pair: one step per (client, class) (Eq. 4) | client: per client
    server_step: ServerStep = "pair"
    server_batch_size: int = (
        0  # 0: steps per server_step; N: pooled shuffled batches of N (HtFLlib)
    )
    # 0: LARs over the whole training split (Eq. 3); N: less its last n mod N examples in stored
    # order, as HtFLlib's unshuffled drop_last loader of batch N leaves them out
    lar_batch: int = 0

    paper: ClassVar[str] = (
        "Yi et al., FedGH: Heterogeneous Federated Learning with Generalized Global Header, "
        "ACM MM 2023"
    )

    def __post_init__(self) -> None:
        # ValueError: the config loader reports it as a ConfigError naming [algorithm].
        if self.eta_g <= 0 or self.server_epochs < 0 or self.server_batch_size < 0:
            raise ValueError("eta_g must be > 0, server_epochs >= 0 and server_batch_size >= 0")
        if self.lar_batch < 0:
            raise ValueError("lar_batch must be >= 0 (0: LARs over the whole training split)")

    def check(self, spec: FederationSpec) -> None:
        heads = {m.partition("/")[2] for m in spec.members}
        other = sorted(heads - {"", "linear"})
        if other:
            raise ConfigError(
                "algorithm.name = 'fedgh' replaces every head with one Linear(feature_dim, C), "
                f"but the clients' models (model.family) have other heads ({other})"
            )

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> FedGHState:
        start = spec.build_model(0).head
        check_linear_head(start, spec.feature_dim, spec.num_classes, "client 0")
        head = {k: v.detach().cpu().clone() for k, v in start.state_dict().items()}
        return FedGHState(head, spec.seed)

    def broadcast(self, state: FedGHState, client_id: int, round_num: int) -> SharedState:
        return SharedState({k: v.clone() for k, v in state.head.items()})

    def upload_names(self, state: FedGHState, upload: ClassMeans) -> dict[str, Any]:
        c, d = state.head["weight"].shape
        return {"C": c, "d": d}

    def aggregate(
        self, state: FedGHState, uploads: Sequence[Weighted[ClassMeans]], round_num: int
    ) -> FedGHState:
        # Pool the (LAR, label) pairs, in upload order; each upload's classes are sorted.
        protos = [u.payload.protos.float() for u in uploads]  # [k, d] each
        labels = [u.payload.classes for u in uploads]  # [k] each
        sizes = [int(cls.numel()) for cls in labels]
        head = {k: v.clone() for k, v in state.head.items()}  # the previous state stays as is
        if sum(sizes) > 0 and self.server_epochs > 0:
            gen = seeding.torch_generator(state.seed, round_num, seeding.SERVER, "fedgh")
            epochs = [
                server_step_batches(sizes, self.server_batch_size, gen, self.server_step)
                for _ in range(self.server_epochs)
            ]
            # The server has no class means of its own: clipping bounds the LARs themselves.
            points = server_points(torch.cat(protos), torch.cat(labels))
            train_global_head(head, points, torch.cat(labels), epochs, self.eta_g)
        return FedGHState(head, state.seed)

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        check_linear_head(
            model.head, spec.feature_dim, spec.num_classes, f"client {data.client_id}"
        )
        return FedGHClient()

    def receive(self, model: ClientModel, extras: nn.Module, msg: SharedState) -> None:
        # A trained client keeps its locally trained head (its local model, evaluated as ``acc``);
        # one that has not trained yet holds the received global header (Eq. 5).
        if not _trained(extras):
            model.load_part_state("head", msg.state)

    def before_fit(self, ctx: FitContext[SharedState]) -> None:
        # Eq. 5: the global header replaces the local one
        ctx.model.load_part_state("head", ctx.msg.state)
        if isinstance(ctx.extras, FedGHClient):
            ctx.extras.trained.fill_(True)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: SharedState
    ) -> ClassMeans:
        # Exact LARs over the whole training split (or its full batches), in eval mode, after
        # local training.
        keep = None
        if self.lar_batch:
            n = data.num("train")
            keep = n - n % self.lar_batch
        protos, counts = class_means(model, data, model.num_classes, keep=keep)  # [C, d], [C]
        has = counts > 0  # the counts stay on the client
        classes = has.nonzero().flatten()  # [k] int64, increasing
        return ClassMeans(protos[has].float().contiguous(), classes)

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: SharedState
    ) -> dict[str, Tensor]:
        f = model.features(x)  # [B, d]
        # acc: the local model (encoder + locally trained head); acc_global: the global header.
        return {"acc": model.head(f), "acc_global": functional_call(model.head, msg.state, (f,))}


def _trained(extras: nn.Module) -> bool:
    return isinstance(extras, FedGHClient) and bool(extras.trained)
