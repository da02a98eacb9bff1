"""A zoo-free toy federation with a server-held public split (FedTGP / FedHeNN tests).

Three clients with label skew, hand-built ClientModels (two encoder widths when heterogeneous),
in-memory data, run through the real round loop and simulator with ``check_wire=True``.
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

C, D = 3, 4  # classes, feature dim
SHAPE = (1, 2, 6)  # input [C, H, W]: 12 values


class Source:
    """An image source over a float tensor held in memory."""

    def __init__(self, x: Tensor) -> None:
        self.x = x

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor:
        return self.x[idx].to(device)


def tiny_model(hidden: int = 8) -> ClientModel:
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, D))
    return ClientModel(encoder, nn.Linear(D, C), D, C)


def tiny_data(n: int = 60, classes: tuple[int, ...] = (0, 1, 2), seed: int = 3) -> ClientData:
    """One client: ``n`` inputs with class-dependent means, labels cycling over ``classes``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor([classes[i % len(classes)] for i in range(n)])
    x = torch.randn(n, *SHAPE, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() - 1
    rows = torch.arange(n)
    cut = (3 * n) // 4
    return ClientData(0, Source(x), y, {"train": rows[:cut], "test": rows[cut:]}, C)


@dataclass
class Fed:
    spec: FederationSpec
    clients: list[ClientData]
    models: list[ClientModel]
    extras: list[nn.Module]
    transport: SimTransport
    history: History | None = None
    state: Any = None


CLIENT_CLASSES = ((0, 1), (0, 1, 2), (1, 2))  # client 0 lacks class 2, client 2 lacks class 0


def make_fed(
    algo: Algorithm,
    heterogeneous: bool = True,
    public_size: int = 24,
    seed: int = 0,
    per_client: int = 32,
    lr: float = 0.05,
) -> Fed:
    g = torch.Generator().manual_seed(7)
    labels, images = [], []
    for classes in CLIENT_CLASSES:
        y = torch.tensor([classes[i % len(classes)] for i in range(per_client)])
        labels.append(y)
        images.append(torch.randn(per_client, *SHAPE, generator=g) * 0.5 + y.view(-1, 1, 1, 1) - 1)
    y_all, x_all = torch.cat(labels), torch.cat(images)
    source = Source(x_all)
    clients = []
    for cid in range(len(CLIENT_CLASSES)):
        rows = torch.arange(cid * per_client, (cid + 1) * per_client)
        cut = (3 * per_client) // 4
        clients.append(ClientData(cid, source, y_all, {"train": rows[:cut], "test": rows[cut:]}, C))
    widths = (8, 5, 8) if heterogeneous else (8, 8, 8)

    def build(cid: int) -> ClientModel:
        seeding.seed_torch(seed, 0, cid, "init")
        return tiny_model(widths[cid])

    public = torch.randn(public_size, *SHAPE, generator=g) if public_size > 0 else None
    spec = FederationSpec(
        num_clients=len(clients),
        num_classes=C,
        feature_dim=D,
        input_shape=SHAPE,
        members=tuple(f"tiny{w}" for w in widths),
        num_train=tuple(c.num_train for c in clients),
        seed=seed,
        rounds=2,
        build_model=build,
        public=public,
    )
    models = [build(c.client_id) for c in clients]
    extras = [algo.init_client(m, spec, c) for m, c in zip(models, clients)]
    settings = TrainSettings(batch_size=8, lr=lr)
    transport = SimTransport(algo, models, extras, clients, settings, seed, 1, check_wire=True)
    return Fed(spec, clients, models, extras, transport)


def run_fed(algo: Algorithm, rounds: int = 2, **kwargs: Any) -> Fed:
    fed = make_fed(algo, **kwargs)
    plan = RoundPlan(fed.spec.num_clients, rounds, fed.spec.num_clients, 1, 0)
    fed.history, fed.state = run_rounds(algo, fed.spec, fed.transport, plan)
    return fed
