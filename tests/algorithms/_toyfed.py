"""A zoo-free toy federation for algorithm tests: hand-built ClientModels on in-memory data.

Runs the real round loop (``core.rounds.run_rounds``) on the real simulator transport, so the wire
round trip (``check_wire``), ``validate_upload`` and evaluation are exercised without the model zoo
or the dataset loaders.
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

NUM_CLASSES = 3
FEATURE_DIM = 4
IN_FEATURES = 12  # inputs are [N, 1, 3, 4]


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


@dataclass
class ToyFed:
    spec: FederationSpec
    clients: list[ClientData]
    models: list[ClientModel]
    extras: list[nn.Module]
    transport: SimTransport
    history: History | None = None
    state: Any = None


# Per client: which classes it holds (client 0 lacks class 2, client 2 lacks class 0).
CLIENT_CLASSES = ((0, 1), (0, 1, 2), (1, 2))


def make_toy(
    algo: Algorithm,
    heterogeneous: bool = False,
    seed: int = 0,
    per_client: int = 30,
    check_wire: bool = True,
    lr: float = 0.1,
    batch_size: int = 8,
) -> ToyFed:
    """Three clients with label skew (missing classes); two encoder widths if heterogeneous."""
    g = torch.Generator().manual_seed(1234)
    n_total = per_client * len(CLIENT_CLASSES)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=g)
    images = torch.randn(4 * n_total, 1, 3, 4, generator=g)
    labels_all = (images.flatten(1) @ teacher).argmax(1)  # learnable labels
    rows: list[list[int]] = []
    taken: set[int] = set()
    for classes in CLIENT_CLASSES:
        mine = [
            i for i in range(len(labels_all)) if int(labels_all[i]) in classes and i not in taken
        ][:per_client]
        taken.update(mine)
        rows.append(mine)
    source = TensorSource(images)
    clients = []
    for cid, mine in enumerate(rows):
        idx = torch.tensor(mine, dtype=torch.long)
        cut = (len(mine) * 3) // 4
        clients.append(
            ClientData(
                cid, source, labels_all, {"train": idx[:cut], "test": idx[cut:]}, NUM_CLASSES
            )
        )
    widths = (8, 6, 8) if heterogeneous else (8, 8, 8)
    members = tuple(f"toy{w}" for w in widths)

    def build(client_id: int) -> ClientModel:
        seeding.seed_torch(seed, 0, client_id, "init")
        return toy_model(widths[client_id])

    spec = FederationSpec(
        num_clients=len(clients),
        num_classes=NUM_CLASSES,
        feature_dim=FEATURE_DIM,
        input_shape=(1, 3, 4),
        members=members,
        num_train=tuple(c.num_train for c in clients),
        seed=seed,
        rounds=1,
        build_model=build,
    )
    models, extras = [], []
    for c in clients:
        models.append(build(c.client_id))
        seeding.seed_torch(seed, 0, c.client_id, "init-extras")
        extras.append(algo.init_client(models[-1], spec, c))
    train = TrainSettings(batch_size=batch_size, lr=lr)
    transport = SimTransport(algo, models, extras, clients, train, seed, 1, check_wire=check_wire)
    return ToyFed(spec, clients, models, extras, transport)


def run_toy(algo: Algorithm, rounds: int = 2, **kwargs: Any) -> ToyFed:
    """Build the toy federation and run ``rounds`` rounds with every client every round."""
    fed = make_toy(algo, **kwargs)
    plan = RoundPlan(fed.spec.num_clients, rounds, fed.spec.num_clients, 1, 0)
    fed.history, fed.state = run_rounds(algo, fed.spec, fed.transport, plan)
    return fed


def settings() -> TrainSettings:
    """The toy federation's training settings, for calling ``client.fit`` by hand."""
    return TrainSettings(batch_size=8, lr=0.1)
