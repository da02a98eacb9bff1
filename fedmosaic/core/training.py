"""The one local training loop, shared by every algorithm and both runtimes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor, nn

from fedmosaic.core import dpsgd
from fedmosaic.core.algorithm import Algorithm, Phase, declared_acceleration
from fedmosaic.core.checks import PrivacyRule
from fedmosaic.core.model import PARTS, ClientModel
from fedmosaic.core.payload import Payload

if TYPE_CHECKING:
    from fedmosaic.core.client import ClientData, FitOutput


@dataclass(frozen=True)
class AccelSettings:
    """Which fast paths of ``fedmosaic.accel`` a run may take (the maths unchanged): resolved
    from ``train.fused_sgd`` and ``train.batched_clients`` against the method's declared
    ``Acceleration``. The plain loop reads none of it; the installed accelerator does."""

    fused_sgd: bool = True  # plain SGD: update Linear weights inside their backward (accel.fused)
    batched_clients: bool | str = "auto"  # clients of one layout as one batch (accel.batched)
    cuda_graphs: bool | str = "auto"  # the batched step captured once and replayed (accel.graphs)


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
    drop_last: bool = False  # drop each epoch's ragged last batch (PFLlib/HtFLlib loaders)
    shuffle: bool = True  # false: the same order every epoch (HtFLlib's train loader)
    precision: str = "fp32"  # fp32 | bf16 (autocast of the training forward)
    # the fast paths allowed (``from_config`` resolves the config's "auto" against the
    # algorithm's ``acceleration``); see ``batched_enabled``
    accel: AccelSettings = AccelSettings()
    # ``[privacy]``: with the local mechanism each client releases its upload (core/privacy.py)
    privacy: PrivacyRule = PrivacyRule()
    # ``eval.membership``: every evaluation runs the membership attack (core/membership.py)
    membership: bool = False

    @classmethod
    def from_config(
        cls,
        t: Any,
        algo: Any = None,
        privacy: PrivacyRule | None = None,
        membership: bool = False,
    ) -> TrainSettings:
        """From the ``[train]`` table (``config.TrainConfig``; core does not import config).

        ``train.fused_sgd = "auto"`` fuses only where ``algo`` declares ``Acceleration.fused_sgd``.
        """
        fused = t.fused_sgd
        if not isinstance(fused, bool):  # "auto"
            fused = algo is not None and declared_acceleration(algo).fused_sgd
        return cls(
            batch_size=t.batch_size,
            lr=t.lr,
            optimizer=t.optimizer,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            betas=(float(t.betas[0]), float(t.betas[1])),
            eval_batch_size=t.eval_batch_size,
            device=t.device,
            drop_last=t.drop_last,
            shuffle=t.shuffle,
            precision=t.precision,
            accel=AccelSettings(
                fused_sgd=fused, batched_clients=t.batched_clients, cuda_graphs=t.cuda_graphs
            ),
            privacy=privacy or PrivacyRule(),
            membership=membership,
        )

    @property
    def batched_enabled(self) -> bool:
        """Whether clients of one architecture may train as one batched computation: forced by
        ``True``/``False``; ``"auto"`` turns it on for CUDA only (on CPU one client at a time
        measured faster: see README, Speed)."""
        if self.privacy.mechanism == "local" or self.privacy.dpsgd:  # one client at a time
            return False
        if self.membership:  # the attack on each upload runs in the one-client fit
            return False
        if isinstance(self.accel.batched_clients, bool):
            return self.accel.batched_clients
        return torch.device(self.device).type == "cuda"

    @property
    def graphs_enabled(self) -> bool:
        """Whether batched steps are captured once and replayed (``accel.graphs``): forced by
        ``True``/``False`` (on CPU ``True`` runs the same bookkeeping with the captured function
        called instead of a graph: the tests' view of the path); ``"auto"`` = on for CUDA.
        Only where clients train batched (``batched_enabled``)."""
        if not self.batched_enabled:
            return False
        if isinstance(self.accel.cuda_graphs, bool):
            return self.accel.cuda_graphs
        return torch.device(self.device).type == "cuda"


def autocast(s: TrainSettings) -> contextlib.AbstractContextManager[Any]:
    """The training forward's precision context: nothing for fp32 (the code path is the plain
    one, bitwise), bf16 autocast otherwise (matmuls and convs in bfloat16, losses and
    reductions in float32; parameters and optimizer state stay float32)."""
    if s.precision == "fp32":
        return contextlib.nullcontext()
    if s.precision == "bf16":
        return torch.autocast(torch.device(s.device).type, dtype=torch.bfloat16)
    raise ValueError(f"train.precision = {s.precision!r}; choose fp32 or bf16")


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


def batch_order(
    n: int, batch_size: int, gen: torch.Generator, drop_last: bool = False, shuffle: bool = True
) -> list[Tensor]:
    """Shuffled minibatches of positions ``0..n-1``: every example once per epoch.

    ``shuffle = False`` keeps positions in order every epoch and draws nothing from ``gen``
    (HtFLlib's ``DataLoader(shuffle=False)``; with ``drop_last`` the same tail is left out every
    epoch).

    ``drop_last`` (PFLlib/HtFLlib's loaders, FedClassAvg's code) drops the ragged tail, except when
    the client has fewer than ``batch_size`` examples: then its data is one batch (dropping it
    would train nothing). Either way a final batch of a single example is dropped: BatchNorm cannot
    train on one example, and a one-example step is what the papers' loaders would not take either
    (one example of a client per epoch at most).
    """
    perm = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
    if n < batch_size:
        return [perm] if n >= 2 else []
    if drop_last:
        return list(perm[: (n // batch_size) * batch_size].split(batch_size))
    batches = list(perm.split(batch_size))
    if batches[-1].numel() == 1:
        batches.pop()
    return batches


LossFn = Callable[[Tensor, Tensor], Tensor]


# ---- the seam: faster ways to compute the same steps (filled by ``fedmosaic.accel``) ----------


class FastSteps(Protocol):
    """A phase's SGD steps with some layers' updates computed inside their backward (the same
    step; see ``accel.fused``). Active between ``__enter__`` and ``__exit__``."""

    def __enter__(self) -> FastSteps: ...

    def __exit__(self, *exc: object) -> None: ...

    def loss(self, loss_fn: LossFn, x: Tensor, y: Tensor, first: bool) -> Tensor:
        """``loss_fn(x, y)`` whose backward also updates the layers it routes (``first``: the
        phase's first step, where a layer it cannot route shows)."""
        ...

    def update(self, params: Sequence[nn.Parameter]) -> None:
        """After the backward: the SGD update of the ``params`` it did not update (those with a
        ``.grad``), their gradients cleared; the optimizer's step, bit for bit."""
        ...


StepT = TypeVar("StepT")


@dataclass(frozen=True)
class FastStep(Generic[StepT]):
    """The key of a method's own fast step, typed by the step's signature ``StepT``: the method
    asks ``accelerator().step(key)`` and gets a ``StepT`` (or None: its plain step then runs);
    ``fedmosaic.accel`` registers its implementation under the same key. ``name`` is what its
    engagement counter says."""

    name: str


class PrototypeServerStep(Protocol):
    """One SGD step of FedTGP's server on a minibatch of (prototype, class) pairs, in place on
    ``params`` (float32, autograd off); returns the minibatch's loss. Equal to the method's
    autograd step to float rounding (``tests/algorithms/test_fedtgp.py``)."""

    def __call__(
        self,
        params: dict[str, Tensor],
        points: Tensor,
        labels: Tensor,
        delta: float,
        lr: float,
        eps: float = ...,
    ) -> float: ...


FEDTGP_SERVER_STEP: FastStep[PrototypeServerStep] = FastStep("fedtgp.server")


class Accelerator(Protocol):
    """How to run this training and inference faster, the maths unchanged: what core asks,
    ``fedmosaic.accel`` answers. Core alone runs the plain loop below."""

    def steps(
        self,
        modules: Sequence[nn.Module],
        params: Sequence[nn.Parameter],
        s: TrainSettings,
        lr: float,
    ) -> FastSteps | None:
        """Faster steps for training ``params`` (of ``modules``) under ``s``, or None."""
        ...

    def inference(self, *modules: nn.Module) -> contextlib.AbstractContextManager[object]:
        """A context in which ``modules`` evaluate faster (autograd off)."""
        ...

    def block_inference(self, block: nn.Module, x: Tensor) -> Tensor | None:
        """``block(x)`` without autograd by a faster route (the zoo's conv -> pool -> ReLU
        block as one native op), or None where there is none for this block and input."""
        ...

    def step(self, key: FastStep[StepT]) -> StepT | None:
        """A method's own fast step (``FEDTGP_SERVER_STEP``), equal to its plain one to float
        rounding; None when there is none."""
        ...

    def fit_clients(
        self,
        algo: Algorithm,
        messages: dict[int, Payload],
        take: Callable[[int], tuple[ClientModel, nn.Module]],
        data: Sequence[ClientData],
        settings: TrainSettings,
        seed: int,
        round_num: int,
        local_epochs: int,
    ) -> Iterator[tuple[list[int], list[FitOutput]]]:
        """A round's fits in this process (``core.client.fit_clients``'s contract), clients of
        one model layout trained together where the method and ``settings`` allow it."""
        ...


_accelerator: Accelerator | None = None


def use_accelerator(acc: Accelerator | None) -> Accelerator | None:
    """Install ``acc`` (None: the plain paths); returns the one it replaces."""
    global _accelerator
    previous, _accelerator = _accelerator, acc
    return previous


def accelerator() -> Accelerator | None:
    """The installed accelerator; None: core's plain paths."""
    return _accelerator


def accelerated_inference(*modules: nn.Module) -> contextlib.AbstractContextManager[object]:
    """The installed accelerator's inference context for ``modules``; nothing without one."""
    acc = _accelerator
    return contextlib.nullcontext() if acc is None else acc.inference(*modules)


def train_epochs(
    params: Sequence[nn.Parameter],
    loss_fn: LossFn,
    sample: Callable[[Tensor], tuple[Tensor, Tensor]],
    n: int,
    epochs: int,
    s: TrainSettings,
    gen: torch.Generator,
    lr: float | None = None,
    modules: Sequence[nn.Module] = (),
    private: bool = False,
) -> TrainStats:
    """Minibatch training of ``params`` on ``loss_fn(x, y)``; ``sample(positions) -> (x, y)``.

    ``modules``: the modules ``params`` belong to, for the installed accelerator's fast steps.
    ``private``: a client's own training, DP-SGD when ``s.privacy.dpsgd`` (core/dpsgd.py).
    """
    stats = TrainStats()
    if not params or epochs <= 0:
        return stats
    opt = make_optimizer(params, s, lr)
    if private and s.privacy.dpsgd:
        steps, examples, loss_sum = dpsgd.private_epochs(
            params,
            loss_fn,
            sample,
            n,
            epochs,
            s.batch_size,
            s.privacy.sample_clip,
            s.privacy.sample_noise_multiplier,
            opt,
            gen,
            modules,
        )
        return TrainStats(steps, examples, loss_sum)
    step_lr = s.lr if lr is None else lr
    unique = list({id(m): m for mod in modules for m in mod.modules()}.values())
    fast = _accelerator.steps(unique, params, s, step_lr) if _accelerator is not None else None
    precision = autocast(s)
    opt.zero_grad(set_to_none=True)  # then after every step: each backward starts from none
    # off the CPU the losses add up on the device: ``float(loss)`` every step would make the
    # host wait for the device each step (the same float64 sum, one sync at the end)
    on_device: Tensor | None = None
    with fast if fast is not None else contextlib.nullcontext():
        for _ in range(epochs):
            for pos in batch_order(n, s.batch_size, gen, s.drop_last, s.shuffle):
                x, y = sample(pos)
                if fast is not None:
                    loss = fast.loss(loss_fn, x, y, first=stats.steps == 0)
                else:
                    with precision:
                        loss = loss_fn(x, y)
                loss.backward()
                if fast is not None:  # the layers its backward updated have no .grad
                    fast.update(params)
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                stats.steps += 1
                stats.examples += int(pos.numel())
                if loss.device.type == "cpu":
                    stats.loss_sum += float(loss.detach())
                elif on_device is None:
                    on_device = loss.detach().double()
                else:
                    on_device += loss.detach().double()
    if on_device is not None:
        stats.loss_sum = float(on_device)
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
                params,
                loss_fn,
                data.train_batch,
                data.num_train,
                phase.epochs,
                s,
                gen,
                modules=(model, extras),
                private=True,
            )
            total.steps += st.steps
            total.examples += st.examples
            total.loss_sum += st.loss_sum
    finally:
        unfreeze_all(model, extras)
        model.eval()
        extras.eval()
    return total
