"""A zoo-free tiny federation for the distillation methods' tests (FedDistill, FML, FedKD).

Hand-built ``ClientModel``s on 1x3x4 inputs, in-memory client data, a fake zoo for the shared
small model, and a round driver that runs the real client code (``core.client.fit``) with every
payload round-tripped through the wire codec.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from fedmosaic.algorithms import _distill
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.simulator import wire

SHAPE = (1, 3, 4)
CLASSES = 3
DIM = 4


class TensorSource:
    """Images held as a float tensor; ``batch`` slices rows."""

    def __init__(self, x: Tensor) -> None:
        self.x = x

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor:
        return self.x[idx].to(device)


def tiny_model(member: str = "narrow", num_classes: int = CLASSES, dim: int = DIM) -> ClientModel:
    """``narrow``: one linear layer; ``wide``: a hidden layer of 64 (more parameters)."""
    if member == "narrow":
        enc = nn.Sequential(nn.Flatten(), nn.Linear(12, dim))
    elif member == "wide":
        enc = nn.Sequential(nn.Flatten(), nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, dim))
    else:
        raise KeyError(f"unknown tiny member {member!r}")
    return ClientModel(enc, nn.Linear(dim, num_classes), dim, num_classes, arch=member)


def tiny_data(cid: int, n: int = 24, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed + cid)
    x = torch.randn(n, *SHAPE, generator=g)
    y = torch.arange(n) % CLASSES  # every class present
    train, test = torch.arange(0, n * 3 // 4), torch.arange(n * 3 // 4, n)
    return ClientData(cid, TensorSource(x), y, {"train": train, "test": test}, CLASSES)


def tiny_spec(members: tuple[str, ...] = ("wide", "narrow"), rounds: int = 2) -> FederationSpec:
    def build(i: int) -> ClientModel:
        torch.manual_seed(100 + i)
        return tiny_model(members[i % len(members)])

    return FederationSpec(
        num_clients=len(members),
        num_classes=CLASSES,
        feature_dim=DIM,
        input_shape=SHAPE,
        members=members,
        num_train=tuple(18 for _ in members),
        seed=0,
        rounds=rounds,
        build_model=build,
    )


@pytest.fixture
def fake_zoo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the shared-model builder to ``tiny_model`` (no dependency on the model zoo)."""

    def zoo(
        member: str,
        input_shape: tuple,
        num_classes: int,
        feature_dim: int,
        projection: str = "linear",
    ) -> ClientModel:
        assert tuple(input_shape) == SHAPE
        return tiny_model(member, num_classes, feature_dim)

    monkeypatch.setattr(_distill, "_zoo_model", zoo)
    _distill._smallest.cache_clear()
    yield
    _distill._smallest.cache_clear()


def make_clients(
    algo: Algorithm, spec: FederationSpec
) -> tuple[list[ClientModel], list[nn.Module], list[ClientData]]:
    models = [spec.build_model(i) for i in range(spec.num_clients)]
    data = [tiny_data(i) for i in range(spec.num_clients)]
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
    settings = TrainSettings(batch_size=6, lr=lr)
    uploads, sizes = [], []
    for cid in range(len(models)):
        msg, _ = wire(algo.broadcast(state, cid, round_num), check=True)
        out = client_ops.fit(
            algo, models[cid], extras[cid], msg, data[cid], settings, 0, round_num, 1
        )
        up, nbytes = wire(out.upload, check=True)
        algo.validate_upload(state, up, cid)
        uploads.append(Weighted(cid, float(out.num_examples), up))
        sizes.append(nbytes)
    return algo.aggregate(state, uploads, round_num), uploads, sizes
