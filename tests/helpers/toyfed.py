"""The zoo-free toy federation of the algorithm tests: hand-built ClientModels on in-memory data.

:func:`make_toy` builds three clients with label skew (client 0 lacks class 2, client 2 lacks
class 0) and :func:`run_toy` runs the real round loop (``core.rounds.run_rounds``) on the real
simulator transport, so the wire round trip (``check_wire``), ``validate_upload`` and evaluation
are exercised without the model zoo or the dataset loaders. What differs between the methods'
tests is a :class:`ToySetup`; three are named:

- :data:`BASE`: labels from a random linear teacher, no public split (FedPer, FedRep, FedRoD,
  FedProto, FedBABU, layer expansion);
- :data:`WITH_PUBLIC`: the same kind of data with a server-held public split of unused rows
  (FedGen, KT-pFL);
- :data:`CLASS_MEANS`: inputs scattered around a per-class mean, a public split of fresh draws
  (FedTGP, FedHeNN).

The distillation methods' tests (FedDistill, FML, FedKD) drive rounds by hand instead
(:func:`run_round`: the real client code, every payload through the wire codec) on
:func:`member_model` clients, with :func:`fake_zoo` standing in for the shared small model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fedmosaic.algorithms import _distill
from fedmosaic.core import client as client_ops
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.rounds import History, RoundPlan, run_rounds
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.simulator import SimTransport, wire

NUM_CLASSES = 3
FEATURE_DIM = 4
IN_FEATURES = 12  # every input shape below holds 12 values
SHAPE = (1, 3, 4)
# Per client: which classes it holds (client 0 lacks class 2, client 2 lacks class 0).
CLIENT_CLASSES = ((0, 1), (0, 1, 2), (1, 2))


class TensorSource:
    """An image source over a float tensor held in memory."""

    def __init__(self, images: Tensor) -> None:
        self.images = images

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor:
        return self.images[idx].to(device)


def toy_model(hidden: int = 8) -> ClientModel:
    """encoder: Flatten -> Linear(12, hidden) -> ReLU -> Linear(hidden, 4); head: Linear(4, 3)."""
    encoder = nn.Sequential(
        nn.Flatten(), nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, FEATURE_DIM)
    )
    return ClientModel(encoder, nn.Linear(FEATURE_DIM, NUM_CLASSES), FEATURE_DIM, NUM_CLASSES)


@dataclass(frozen=True)
class ToySetup:
    """What varies between the toy federations (``BASE``'s values are the defaults)."""

    # teacher: rows of a random pool labelled by a random linear map, each client taking the
    # first unused rows of its classes; means: inputs around a per-class mean, labels cycling
    data: str = "teacher"
    data_seed: int = 1234
    shape: tuple[int, ...] = SHAPE
    pool: int | None = None  # teacher: rows drawn (None: 4 x the clients' total)
    per_client: int = 30
    # teacher: the first rows no client took; means: fresh draws after the clients' data
    public_size: int = 0
    heterogeneous: bool = False  # client 1 gets a narrower encoder
    narrow: int = 6  # its hidden width (the others have 8)
    member: str = "toy"  # member names: member + width
    spec_rounds: int = 1  # FederationSpec.rounds (what schedules read)
    batch_size: int = 8
    lr: float = 0.1
    check_wire: bool = True
    seed: int = 0


BASE = ToySetup()
WITH_PUBLIC = ToySetup(
    data_seed=99,
    pool=600,
    per_client=24,
    public_size=16,
    heterogeneous=True,
    narrow=5,
    spec_rounds=2,
    batch_size=6,
)
CLASS_MEANS = ToySetup(
    data="means",
    data_seed=7,
    shape=(1, 2, 6),
    per_client=32,
    public_size=24,
    heterogeneous=True,
    narrow=5,
    member="tiny",
    spec_rounds=2,
    lr=0.05,
)


@dataclass
class ToyFed:
    spec: FederationSpec
    clients: list[ClientData]
    models: list[ClientModel]
    extras: list[nn.Module]
    transport: SimTransport
    history: History | None = None
    state: Any = None


def _teacher_data(s: ToySetup) -> tuple[Tensor, Tensor, list[Tensor], Tensor | None]:
    """(images, labels, each client's rows, public inputs) of a ``teacher`` setup."""
    g = torch.Generator().manual_seed(s.data_seed)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=g)
    pool = s.pool if s.pool is not None else 4 * s.per_client * len(CLIENT_CLASSES)
    images = torch.randn(pool, *s.shape, generator=g)
    labels = (images.flatten(1) @ teacher).argmax(1)  # learnable labels
    rows: list[Tensor] = []
    taken: set[int] = set()
    for classes in CLIENT_CLASSES:
        mine = [i for i in range(len(labels)) if int(labels[i]) in classes and i not in taken]
        mine = mine[: s.per_client]
        taken.update(mine)
        rows.append(torch.tensor(mine, dtype=torch.long))
    free = [i for i in range(len(labels)) if i not in taken][: s.public_size]
    public = images[torch.tensor(free, dtype=torch.long)] if free else None
    return images, labels, rows, public


def _means_data(s: ToySetup) -> tuple[Tensor, Tensor, list[Tensor], Tensor | None]:
    """(images, labels, each client's rows, public inputs) of a ``means`` setup."""
    g = torch.Generator().manual_seed(s.data_seed)
    labels, images = [], []
    for classes in CLIENT_CLASSES:
        y = torch.tensor([classes[i % len(classes)] for i in range(s.per_client)])
        labels.append(y)
        x = torch.randn(s.per_client, *s.shape, generator=g) * 0.5 + y.view(-1, 1, 1, 1) - 1
        images.append(x)
    rows = [
        torch.arange(cid * s.per_client, (cid + 1) * s.per_client)
        for cid in range(len(CLIENT_CLASSES))
    ]
    public = torch.randn(s.public_size, *s.shape, generator=g) if s.public_size > 0 else None
    return torch.cat(images), torch.cat(labels), rows, public


def make_toy(algo: Algorithm, setup: ToySetup = BASE, **changes: Any) -> ToyFed:
    """The toy federation of ``setup`` with ``changes`` (``ToySetup`` fields), ready to run."""
    s = dataclasses.replace(setup, **changes)
    images, labels, rows, public = (_teacher_data if s.data == "teacher" else _means_data)(s)
    source = TensorSource(images)
    clients = []
    for cid, idx in enumerate(rows):
        cut = (len(idx) * 3) // 4
        split = {"train": idx[:cut], "test": idx[cut:]}
        clients.append(ClientData(cid, source, labels, split, NUM_CLASSES))
    widths = (8, s.narrow, 8) if s.heterogeneous else (8, 8, 8)

    def build(client_id: int) -> ClientModel:
        seeding.seed_torch(s.seed, 0, client_id, "init")
        return toy_model(widths[client_id])

    spec = FederationSpec(
        num_clients=len(clients),
        num_classes=NUM_CLASSES,
        feature_dim=FEATURE_DIM,
        input_shape=s.shape,
        members=tuple(f"{s.member}{w}" for w in widths),
        num_train=tuple(c.num_train for c in clients),
        seed=s.seed,
        rounds=s.spec_rounds,
        build_model=build,
        public=public,
    )
    models, extras = [], []
    for c in clients:
        models.append(build(c.client_id))
        seeding.seed_torch(s.seed, 0, c.client_id, "init-extras")
        extras.append(algo.init_client(models[-1], spec, c))
    train = TrainSettings(batch_size=s.batch_size, lr=s.lr)
    transport = SimTransport(
        algo, models, extras, clients, train, s.seed, 1, check_wire=s.check_wire
    )
    return ToyFed(spec, clients, models, extras, transport)


def run_toy(
    algo: Algorithm,
    setup: ToySetup = BASE,
    rounds: int = 2,
    clients_per_round: int | None = None,
    **changes: Any,
) -> ToyFed:
    """Build the toy federation and run ``rounds`` rounds (every client every round unless
    ``clients_per_round`` says fewer)."""
    fed = make_toy(algo, setup, **changes)
    n = fed.spec.num_clients
    plan = RoundPlan(n, rounds, n if clients_per_round is None else clients_per_round, 1, 0)
    fed.history, fed.state = run_rounds(algo, fed.spec, fed.transport, plan)
    return fed


def settings() -> TrainSettings:
    """``BASE``'s training settings, for calling ``client.fit`` by hand."""
    return TrainSettings(batch_size=BASE.batch_size, lr=BASE.lr)


def accuracy_and_loss(history: History) -> list[tuple[float, float]]:
    """Each round's weighted test accuracy and training loss."""
    return [(r["acc_weighted"], r["train_loss"]) for r in history.rounds]


def means_client(n: int = 60, classes: tuple[int, ...] = (0, 1, 2), seed: int = 3) -> ClientData:
    """One client of ``CLASS_MEANS``-like data: ``n`` inputs around their class's mean, labels
    cycling over ``classes``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor([classes[i % len(classes)] for i in range(n)])
    x = torch.randn(n, *CLASS_MEANS.shape, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() - 1
    rows = torch.arange(n)
    cut = (3 * n) // 4
    return ClientData(0, TensorSource(x), y, {"train": rows[:cut], "test": rows[cut:]}, NUM_CLASSES)


# Rounds driven by hand (the distillation methods): named members, every class on every client.


def member_model(
    member: str = "narrow", num_classes: int = NUM_CLASSES, dim: int = FEATURE_DIM
) -> ClientModel:
    """``narrow``: one linear layer; ``wide``: a hidden layer of 64 (more parameters)."""
    if member == "narrow":
        enc = nn.Sequential(nn.Flatten(), nn.Linear(IN_FEATURES, dim))
    elif member == "wide":
        enc = nn.Sequential(nn.Flatten(), nn.Linear(IN_FEATURES, 64), nn.ReLU(), nn.Linear(64, dim))
    else:
        raise KeyError(f"unknown tiny member {member!r}")
    return ClientModel(enc, nn.Linear(dim, num_classes), dim, num_classes, arch=member)


def member_data(cid: int, n: int = 24, seed: int = 0) -> ClientData:
    """Client ``cid``: ``n`` random inputs, every class present."""
    g = torch.Generator().manual_seed(seed + cid)
    x = torch.randn(n, *SHAPE, generator=g)
    y = torch.arange(n) % NUM_CLASSES
    train, test = torch.arange(0, n * 3 // 4), torch.arange(n * 3 // 4, n)
    return ClientData(cid, TensorSource(x), y, {"train": train, "test": test}, NUM_CLASSES)


def member_spec(members: tuple[str, ...] = ("wide", "narrow"), rounds: int = 2) -> FederationSpec:
    """A federation of ``member_model`` clients, ``members[i]`` being client i's."""

    def build(i: int) -> ClientModel:
        torch.manual_seed(100 + i)
        return member_model(members[i % len(members)])

    return FederationSpec(
        num_clients=len(members),
        num_classes=NUM_CLASSES,
        feature_dim=FEATURE_DIM,
        input_shape=SHAPE,
        members=members,
        num_train=tuple(18 for _ in members),
        seed=0,
        rounds=rounds,
        build_model=build,
    )


@pytest.fixture
def fake_zoo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Route the shared-model builder to ``member_model`` (no dependency on the model zoo)."""

    def zoo(
        member: str,
        input_shape: tuple,
        num_classes: int,
        feature_dim: int,
        projection: str = "linear",
    ) -> ClientModel:
        assert tuple(input_shape) == SHAPE
        return member_model(member, num_classes, feature_dim)

    monkeypatch.setattr(_distill, "_zoo_model", zoo)
    _distill._smallest.cache_clear()
    yield
    _distill._smallest.cache_clear()


def make_clients(
    algo: Algorithm, spec: FederationSpec
) -> tuple[list[ClientModel], list[nn.Module], list[ClientData]]:
    """Each client's model, its method state (``init_client``) and its data."""
    models = [spec.build_model(i) for i in range(spec.num_clients)]
    data = [member_data(i) for i in range(spec.num_clients)]
    extras = [algo.init_client(models[i], spec, data[i]) for i in range(spec.num_clients)]
    return models, extras, data


def run_round(
    algo: Algorithm,
    state: object,
    models: list[ClientModel],
    extras: list[nn.Module],
    data: list[ClientData],
    round_num: int,
    lr: float = 0.05,
) -> tuple[object, list[Weighted], list[int]]:
    """One round over every client with wire checks: the new state, the uploads, their bytes."""
    train = TrainSettings(batch_size=6, lr=lr)
    uploads, sizes = [], []
    for cid in range(len(models)):
        msg, _ = wire(algo.broadcast(state, cid, round_num), check=True)
        out = client_ops.fit(algo, models[cid], extras[cid], msg, data[cid], train, 0, round_num, 1)
        up, nbytes = wire(out.upload, check=True)
        algo.validate_upload(state, up, cid)
        uploads.append(Weighted(cid, float(out.num_examples), up))
        sizes.append(nbytes)
    return algo.aggregate(state, uploads, round_num), uploads, sizes
