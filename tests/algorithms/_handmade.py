"""A hand-built heterogeneous federation for algorithm tests that must not depend on the zoo.

Three clients with two encoder widths, 3 classes of 8x8 single-channel images with a class-dependent
pattern, run through the real round loop and simulator with ``check_wire=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.rounds import History, RoundPlan, run_rounds
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.simulator import SimTransport


class _Source:
    def __init__(self, x: Tensor) -> None:
        self.x = x

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor:
        return self.x[idx].to(device)


def _encoder(width: int, d: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(width * 4, d),
    )


def run_handmade(
    algo: Algorithm, rounds: int = 2, seed: int = 0, num_clients: int = 3
) -> tuple[History, object]:
    """``rounds`` rounds on 3 clients with two encoder widths, 3 classes, 8x8 images."""
    c, d = 3, 8
    g = torch.Generator().manual_seed(1)
    n = 40 * num_clients
    labels = torch.randint(0, c, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.5
    x[:, 0, :, :4] += (labels.float() - 1).view(-1, 1, 1)  # a class-dependent left half
    src = _Source(x)
    clients = []
    for cid in range(num_clients):
        rows = torch.arange(cid * 40, (cid + 1) * 40)
        clients.append(ClientData(cid, src, labels, {"train": rows[:30], "test": rows[30:]}, c))

    def build(cid: int) -> ClientModel:
        seeding.seed_torch(seed, 0, cid, "init")
        return ClientModel(_encoder(4 if cid % 2 else 6, d), nn.Linear(d, c), d, c)

    spec = FederationSpec(
        num_clients=num_clients,
        num_classes=c,
        feature_dim=d,
        input_shape=(1, 8, 8),
        members=tuple(f"w{4 if i % 2 else 6}" for i in range(num_clients)),
        num_train=tuple(cd.num_train for cd in clients),
        seed=seed,
        rounds=rounds,
        build_model=build,
    )
    models = [build(i) for i in range(num_clients)]
    extras = [algo.init_client(m, spec, cd) for m, cd in zip(models, clients)]
    settings = TrainSettings(batch_size=10, lr=0.05)
    transport = SimTransport(algo, models, extras, clients, settings, seed, 1, check_wire=True)
    return run_rounds(algo, spec, transport, RoundPlan(num_clients, rounds, num_clients))
