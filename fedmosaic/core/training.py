"""The one local training loop, shared by every algorithm and both runtimes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from fedmosaic.core.algorithm import Phase
from fedmosaic.core.model import PARTS, ClientModel

if TYPE_CHECKING:
    from fedmosaic.config import TrainConfig
    from fedmosaic.core.client import ClientData


@dataclass(frozen=True)
class TrainSettings:
    """Optimizer and batching settings of one experiment (from ``[train]``)."""

    batch_size: int = 10
    lr: float = 0.01
    optimizer: str = "sgd"  # sgd | adam
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eval_batch_size: int = 1000
    device: str = "cpu"

    @classmethod
    def from_config(cls, t: TrainConfig) -> TrainSettings:
        return cls(
            batch_size=t.batch_size,
            lr=t.lr,
            optimizer=t.optimizer,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            betas=(float(t.betas[0]), float(t.betas[1])),
            eval_batch_size=t.eval_batch_size,
            device=t.device,
        )


@dataclass
class TrainStats:
    steps: int = 0
    examples: int = 0
    loss_sum: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)


def make_optimizer(
    params: Iterable[nn.Parameter], s: TrainSettings, lr: float | None = None
) -> torch.optim.Optimizer:
    params = list(params)
    lr = s.lr if lr is None else lr
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=s.momentum, weight_decay=s.weight_decay)
    if s.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=s.betas, weight_decay=s.weight_decay)
    raise ValueError(f"train.optimizer = {s.optimizer!r}; choose sgd or adam")


def select_trainable(model: ClientModel, extras: nn.Module, phase: Phase) -> list[nn.Parameter]:
    """Set ``requires_grad`` per the phase and return the trainable parameters.

    Frozen parameters get ``requires_grad=False`` so autograd skips their backward entirely.
    """
    prefixes: list[str] = []
    for entry in phase.trainable:
        if entry == "all":
            prefixes.append("")
        elif entry in PARTS:
            prefixes.append(entry + ".")
        else:
            prefixes.append(entry if entry.endswith(".") else entry + ".")
    params: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        on = any(name.startswith(pre) for pre in prefixes)
        p.requires_grad_(on)
        if on:
            params.append(p)
    for p in extras.parameters():
        p.requires_grad_(phase.train_extras)
        if phase.train_extras:
            params.append(p)
    return params


def unfreeze_all(model: nn.Module, extras: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(True)
    for p in extras.parameters():
        p.requires_grad_(True)


def batch_order(n: int, batch_size: int, gen: torch.Generator) -> list[Tensor]:
    """Shuffled minibatches of positions ``0..n-1``.

    Like PFLlib's ``drop_last=True`` the ragged tail is dropped, except when the client has fewer
    than ``batch_size`` examples: then its data is one batch (dropping it would train nothing).
    A final batch of one example is always dropped (BatchNorm cannot train on it).
    """
    perm = torch.randperm(n, generator=gen)
    if n < batch_size:
        return [perm] if n >= 2 else []
    return list(perm[: (n // batch_size) * batch_size].split(batch_size))


LossFn = Callable[[Tensor, Tensor], Tensor]


def train_epochs(
    params: Sequence[nn.Parameter],
    loss_fn: LossFn,
    sample: Callable[[Tensor], tuple[Tensor, Tensor]],
    n: int,
    epochs: int,
    s: TrainSettings,
    gen: torch.Generator,
    lr: float | None = None,
) -> TrainStats:
    """Minibatch training of ``params`` on ``loss_fn(x, y)``; ``sample(positions) -> (x, y)``."""
    stats = TrainStats()
    if not params or epochs <= 0:
        return stats
    opt = make_optimizer(params, s, lr)
    for _ in range(epochs):
        for pos in batch_order(n, s.batch_size, gen):
            x, y = sample(pos)
            loss = loss_fn(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats.steps += 1
            stats.examples += int(pos.numel())
            stats.loss_sum += float(loss.detach())
    return stats


def run_phases(
    algo: object,
    model: ClientModel,
    extras: nn.Module,
    msg: object,
    data: ClientData,
    phases: Sequence[Phase],
    s: TrainSettings,
    gen: torch.Generator,
) -> TrainStats:
    """Train through ``phases`` with ``algo.loss`` on the client's training split."""
    total = TrainStats()
    model.train()
    extras.train()
    try:
        for phase in phases:
            params = select_trainable(model, extras, phase)

            def loss_fn(x: Tensor, y: Tensor) -> Tensor:
                return algo.loss(model, extras, x, y, msg)  # type: ignore[attr-defined]

            st = train_epochs(
                params, loss_fn, data.train_batch, data.num_train, phase.epochs, s, gen
            )
            total.steps += st.steps
            total.examples += st.examples
            total.loss_sum += st.loss_sum
    finally:
        unfreeze_all(model, extras)
        model.eval()
        extras.eval()
    return total
