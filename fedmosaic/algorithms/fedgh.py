"""FedGH (Yi et al., ACM MM 2023): a global prediction header trained on the server.

Yi, Wang, Liu, Shi, Yu. FedGH: Heterogeneous Federated Learning with Generalized Global Header.
ACM Multimedia 2023 (arXiv:2303.13137).

Shared: the head ``Linear(feature_dim, C)``, which lives on the server and is broadcast to every
client; clients upload their exact per-class mean representations (LARs, Eq. 3) over their
training data, computed in eval mode after local training. Local: each client's encoder (any
architecture). The server trains the head with CE on the uploaded (class mean, label) pairs
(Eq. 4), clients replace their head with it and train the whole model with CE (Eq. 5-6).

Where we differ from the reference code (HtFLlib ``servergh.py``/``clientgh.py``):
- the authors' code is known to never step the header (its optimizer is built but the header is
  not updated); we train it every round, as the paper says (the HtFLlib port also steps it).
- server minibatches: the paper's Algorithm 1 takes one gradient step per participating client on
  that client's LARs (``server_batch_size = 0``, the default; clients visited in a seeded random
  order each server epoch). HtFLlib pools every (LAR, label) pair and shuffles them into minibatches
  of the client batch size (10): ``server_batch_size = 10``.
- the payload is dense: ``protos [C, d]`` and ``counts [C]`` (int64; 0 marks an absent class, whose
  row is zero and is not trained on) instead of a dict of the client's classes.
- LARs are exact means over the whole training split; HtFLlib iterates its shuffled training
  loader with ``drop_last=True`` and so leaves the ragged tail out.
- the global header starts from client 0's initial head (as HtFLlib); clients' own initial heads
  are replaced by it when they first receive it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._shared import SharedState, class_means
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.registry import ALGORITHMS

if TYPE_CHECKING:
    from fedmosaic.config import ExperimentConfig


@dataclass(frozen=True)
class ClassMeans(Payload):
    """A client's local averaged representations (LARs) per class, dense over all classes."""

    protos: Tensor  # [C, d] float32; zero rows for absent classes
    counts: Tensor  # [C] int64; training examples per class (0 = absent)


@dataclass
class FedGHState:
    """The server's persistent global head (on CPU) and the seed of its shuffling streams."""

    head: nn.Linear
    seed: int


Broadcast = SharedState
Upload = ClassMeans
ServerState = FedGHState


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


def server_step_batches(
    sizes: Sequence[int], batch_size: int, gen: torch.Generator
) -> list[Tensor]:
    """Index batches into the pooled pairs for one server epoch.

    ``sizes[k]`` = number of pairs of upload ``k`` (pooled in upload order). ``batch_size = 0``:
    one batch per upload, uploads in a random order (paper's Algorithm 1). Otherwise all pairs
    shuffled into minibatches of ``batch_size``, the last one possibly smaller (HtFLlib).
    """
    total = int(sum(sizes))
    if batch_size <= 0:
        starts = torch.tensor([0, *sizes]).cumsum(0)
        order = torch.randperm(len(sizes), generator=gen).tolist()
        return [torch.arange(int(starts[k]), int(starts[k + 1])) for k in order if sizes[k] > 0]
    return list(torch.randperm(total, generator=gen).split(batch_size))


def train_global_head(
    head: nn.Linear,
    protos: Tensor,
    labels: Tensor,
    batches_per_epoch: Sequence[Sequence[Tensor]],
    eta_g: float,
) -> None:
    """SGD on ``CE(head(protos[b]), labels[b])`` over the given batches (in place).

    ``protos [N, d]`` are the pooled class means, ``labels [N]`` their classes; one list of index
    batches per server epoch.
    """
    opt = torch.optim.SGD(head.parameters(), lr=eta_g)
    head.train()
    with torch.enable_grad():
        for batches in batches_per_epoch:
            for b in batches:
                loss = F.cross_entropy(head(protos[b]), labels[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()


@ALGORITHMS.register("fedgh")
@dataclass(frozen=True)
class FedGH(Algorithm[FedGHState, SharedState, ClassMeans]):
    """A server-trained global head on clients' class-mean representations."""

    eta_g: float = 0.01  # server learning rate of the global head (paper: 0.01)
    server_epochs: int = 1  # passes over the round's (class mean, label) pairs (reference: 1)
    server_batch_size: int = 0  # 0: one step per client's LARs (paper); N: pooled batches of N

    Broadcast: ClassVar[type[Payload]] = SharedState
    Upload: ClassVar[type[Payload]] = ClassMeans
    paper: ClassVar[str] = (
        "Yi et al., FedGH: Heterogeneous Federated Learning with Generalized Global Header, "
        "ACM MM 2023"
    )

    def __post_init__(self) -> None:
        # ValueError: the config loader reports it as a ConfigError naming [algorithm].
        if self.eta_g <= 0 or self.server_epochs < 0 or self.server_batch_size < 0:
            raise ValueError("eta_g must be > 0, server_epochs >= 0 and server_batch_size >= 0")

    def check_config(self, cfg: ExperimentConfig) -> None:
        from fedmosaic.config import ConfigError
        from fedmosaic.models import family_members

        heads = {m.partition("/")[2] for m in family_members(cfg.model.family)}
        other = sorted(heads - {"", "linear"})
        if other:
            raise ConfigError(
                f"algorithm.name = 'fedgh' replaces every head with one Linear(feature_dim, C), "
                f"but model.family = {cfg.model.family!r} has other heads ({other})"
            )

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> FedGHState:
        start = spec.build_model(0).head
        check_linear_head(start, spec.feature_dim, spec.num_classes, "client 0")
        head = nn.Linear(spec.feature_dim, spec.num_classes)
        head.load_state_dict({k: v.detach().cpu() for k, v in start.state_dict().items()})
        return FedGHState(head, spec.seed)

    def broadcast(self, state: FedGHState, client_id: int, round_num: int) -> SharedState:
        return SharedState({k: v.detach().clone() for k, v in state.head.state_dict().items()})

    def validate_upload(self, state: FedGHState, upload: ClassMeans, client_id: int) -> None:
        c, d = state.head.out_features, state.head.in_features
        p, n = upload.protos, upload.counts
        if p.dtype != torch.float32 or tuple(p.shape) != (c, d):
            raise PayloadError(
                f"client {client_id}: protos is {p.dtype}{tuple(p.shape)}, expected "
                f"torch.float32{(c, d)}"
            )
        if n.dtype != torch.int64 or tuple(n.shape) != (c,):
            raise PayloadError(
                f"client {client_id}: counts is {n.dtype}{tuple(n.shape)}, expected "
                f"torch.int64{(c,)}"
            )
        if bool((n < 0).any()):
            raise PayloadError(f"client {client_id}: counts has negative entries")
        if not bool(torch.isfinite(p).all()):
            raise PayloadError(f"client {client_id}: protos has NaN or Inf values")

    def aggregate(
        self, state: FedGHState, uploads: Sequence[Weighted[ClassMeans]], round_num: int
    ) -> FedGHState:
        # Pool the (class mean, label) pairs of present classes, in upload order.
        protos, labels, sizes = [], [], []
        for u in uploads:
            present = torch.nonzero(u.payload.counts > 0).flatten()  # [k] classes it holds
            protos.append(u.payload.protos[present].float())  # [k, d]
            labels.append(present)
            sizes.append(int(present.numel()))
        head = copy.deepcopy(state.head)  # the previous state stays untouched
        if sum(sizes) > 0 and self.server_epochs > 0:
            gen = seeding.torch_generator(state.seed, round_num, seeding.SERVER, "fedgh")
            epochs = [
                server_step_batches(sizes, self.server_batch_size, gen)
                for _ in range(self.server_epochs)
            ]
            train_global_head(head, torch.cat(protos), torch.cat(labels), epochs, self.eta_g)
        head.eval()
        return FedGHState(head, state.seed)

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        check_linear_head(
            model.head, spec.feature_dim, spec.num_classes, f"client {data.client_id}"
        )
        return nn.Module()

    def receive(self, model: ClientModel, extras: nn.Module, msg: SharedState) -> None:
        model.load_part_state("head", msg.state)  # the global head replaces the local one

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: SharedState
    ) -> ClassMeans:
        # Exact LARs over the whole training split, in eval mode, after local training.
        protos, counts = class_means(model, data, model.num_classes)  # [C, d], [C]
        return ClassMeans(protos.float(), counts.long())
