"""A BatchNorm client for the FedHeNN tests: a zoo member, in-memory data, a shifted RAD."""

from __future__ import annotations

import torch
from helpers.toyfed import TensorSource
from torch import Tensor, nn

from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.models import build_client_model, family_members

BN_SHAPE = (3, 16, 16)
BN_CLASSES = 3
# One BatchNorm member of each family the issue names (the cheapest at 3x16x16).
BN_MEMBERS = [
    ("htfe8", "mobilenetv2"),
    ("fedclassavg4", "shufflenetv2"),
]


def bn_model(family: str, member: str, seed: int = 0) -> ClientModel:
    """A fresh member whose running statistics are those of the client's data (``bn_data``).

    A fresh deep BN network's inference map is near-constant (running var 1 while activations
    shrink layer by layer: MobileNetV2's features vary by 1e-9 across inputs), as it is before
    any training; one cumulative pass over the data gives the statistics training converges to.
    """
    assert member in family_members(family)
    torch.manual_seed(seed)
    model = build_client_model(member, BN_SHAPE, BN_CLASSES, 16)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    data = bn_data()
    with torch.no_grad():
        for bn in bns:
            bn.momentum = None  # cumulative: running stats = this batch's
        model.train()(data.source.batch(torch.arange(len(data.labels))))
        for bn in bns:
            bn.momentum = 0.1
            bn.num_batches_tracked.zero_()
    return model.eval()


def bn_data(n: int = 8) -> ClientData:
    """``n`` training inputs (two batches of 4) around 0, labels cycling over the classes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n + 2, *BN_SHAPE, generator=g)
    y = torch.arange(n + 2) % BN_CLASSES
    rows = torch.arange(n + 2)
    return ClientData(0, TensorSource(x), y, {"train": rows[:n], "test": rows[n:]}, BN_CLASSES)


def shifted_rad(rows: int = 6) -> Tensor:
    """Alignment inputs from another distribution (mean +3): they must not move BN statistics."""
    return torch.randn(rows, *BN_SHAPE, generator=torch.Generator().manual_seed(9)) + 3.0


def bn_buffers(model: ClientModel) -> dict[str, Tensor]:
    """running_mean / running_var / num_batches_tracked of every BatchNorm layer."""
    return {k: v.clone() for k, v in model.named_buffers() if "running" in k or "batches" in k}
