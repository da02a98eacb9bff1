"""A zoo-free toy federation for the FedGen and KT-pFL tests.

Three clients with label skew on in-memory ``[1, 3, 4]`` inputs, hand-built ClientModels (two
encoder widths when heterogeneous, identical ``Linear(4, 3)`` heads) and a server-held public
split. Runs the real round loop on the real simulator transport (wire round trip included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.rounds import History, RoundPlan, run_rounds
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.simulator import SimTransport

C = 3  # classes
D = 4  # feature_dim
SHAPE = (1, 3, 4)
CLIENT_CLASSES = ((0, 1), (0, 1, 2), (1, 2))


class Source:
    def __init__(self, images: Tensor) -> None:
        self.images = images

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor:
        return self.images[idx].to(device)


def toy_model(hidden: int = 8) -> ClientModel:
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, D))
    return ClientModel(encoder, nn.Linear(D, C), D, C)


@dataclass
class Toy:
    spec: FederationSpec
    clients: list[ClientData]
    models: list[ClientModel]
    extras: list[nn.Module]
    transport: SimTransport
    history: History | None = None
    state: Any = None


def make_toy(
    algo: Algorithm,
    heterogeneous: bool = True,
    seed: int = 0,
    per_client: int = 24,
    public_size: int = 16,
    lr: float = 0.1,
) -> Toy:
    g = torch.Generator().manual_seed(99)
    w_true = torch.randn(12, C, generator=g)
    images = torch.randn(600, *SHAPE, generator=g)
    labels = (images.flatten(1) @ w_true).argmax(1)
    taken: set[int] = set()
    rows = []
    for classes in CLIENT_CLASSES:
        mine = [i for i in range(len(labels)) if int(labels[i]) in classes and i not in taken]
        mine = mine[:per_client]
        taken.update(mine)
        rows.append(mine)
    free = [i for i in range(len(labels)) if i not in taken][:public_size]
    public = images[torch.tensor(free, dtype=torch.long)] if free else None
    source = Source(images)
    clients = []
    for cid, mine in enumerate(rows):
        idx = torch.tensor(mine, dtype=torch.long)
        cut = (3 * len(mine)) // 4
        clients.append(ClientData(cid, source, labels, {"train": idx[:cut], "test": idx[cut:]}, C))
    widths = (8, 5, 8) if heterogeneous else (8, 8, 8)

    def build(cid: int) -> ClientModel:
        seeding.seed_torch(seed, 0, cid, "init")
        return toy_model(widths[cid])

    spec = FederationSpec(
        num_clients=3,
        num_classes=C,
        feature_dim=D,
        input_shape=SHAPE,
        members=tuple(f"toy{w}" for w in widths),
        num_train=tuple(c.num_train for c in clients),
        seed=seed,
        rounds=2,
        build_model=build,
        public=public,
    )
    models, extras = [], []
    for c in clients:
        models.append(build(c.client_id))
        seeding.seed_torch(seed, 0, c.client_id, "init-extras")
        extras.append(algo.init_client(models[-1], spec, c))
    settings = TrainSettings(batch_size=6, lr=lr)
    transport = SimTransport(algo, models, extras, clients, settings, seed, 1, check_wire=True)
    return Toy(spec, clients, models, extras, transport)


def run_toy(algo: Algorithm, rounds: int = 2, clients_per_round: int = 3, **kw: Any) -> Toy:
    toy = make_toy(algo, **kw)
    plan = RoundPlan(3, rounds, clients_per_round, 1, 0)
    toy.history, toy.state = run_rounds(algo, toy.spec, toy.transport, plan)
    return toy


def numbers(h: History) -> list[tuple[float, float]]:
    return [(r["acc_weighted"], r["train_loss"]) for r in h.rounds]
