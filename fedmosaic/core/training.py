"""The one local training loop, shared by every algorithm and both runtimes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic import kernels
from fedmosaic.core.algorithm import Phase
from fedmosaic.core.model import PARTS, ClientModel
from fedmosaic.kernels import conv as fast_conv

if TYPE_CHECKING:
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
    fused_sgd: bool = True  # plain SGD: update Linear weights inside their backward (see below)
    # (``from_config`` resolves the config's "auto" against the algorithm: ``fused_sgd_safe``)
    drop_last: bool = False  # drop each epoch's ragged last batch (PFLlib/HtFLlib loaders)
    batched_clients: bool | str = "auto"  # see ``batched_enabled``
    precision: str = "fp32"  # fp32 | bf16 (autocast of the training forward)

    @classmethod
    def from_config(cls, t: Any, algo: Any = None) -> TrainSettings:
        """From the ``[train]`` table (``config.TrainConfig``; core does not import config).

        ``train.fused_sgd = "auto"`` fuses only for ``algo`` when ``fused_sgd_safe(algo)``.
        """
        fused = t.fused_sgd
        if not isinstance(fused, bool):  # "auto"
            fused = algo is not None and fused_sgd_safe(algo)
        return cls(
            batch_size=t.batch_size,
            lr=t.lr,
            optimizer=t.optimizer,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            betas=(float(t.betas[0]), float(t.betas[1])),
            eval_batch_size=t.eval_batch_size,
            device=t.device,
            fused_sgd=fused,
            drop_last=t.drop_last,
            batched_clients=t.batched_clients,
            precision=t.precision,
        )

    @property
    def batched_enabled(self) -> bool:
        """Whether clients of one architecture may train as one batched computation: forced by
        ``True``/``False``; ``"auto"`` turns it on for CUDA only (on CPU one client at a time
        measured faster: see README, Speed)."""
        if isinstance(self.batched_clients, bool):
            return self.batched_clients
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
    n: int, batch_size: int, gen: torch.Generator, drop_last: bool = False
) -> list[Tensor]:
    """Shuffled minibatches of positions ``0..n-1``: every example once per epoch.

    ``drop_last`` (PFLlib/HtFLlib's loaders, FedClassAvg's code) drops the ragged tail, except when
    the client has fewer than ``batch_size`` examples: then its data is one batch (dropping it
    would train nothing). Either way a final batch of a single example is dropped: BatchNorm cannot
    train on one example, and a one-example step is what the papers' loaders would not take either
    (one example of a client per epoch at most).
    """
    perm = torch.randperm(n, generator=gen)
    if n < batch_size:
        return [perm] if n >= 2 else []
    if drop_last:
        return list(perm[: (n // batch_size) * batch_size].split(batch_size))
    batches = list(perm.split(batch_size))
    if batches[-1].numel() == 1:
        batches.pop()
    return batches


LossFn = Callable[[Tensor, Tensor], Tensor]


# ---- plain SGD fused into the Linear layers' backward ------------------------------------------


def fused_sgd_safe(algo: Any) -> bool:
    """Whether the fused plain-SGD path provably equals autograd + SGD for ``algo``'s losses.

    It fills no ``.grad`` (the weights are updated inside the backward), so a loss that
    differentiates twice (``torch.autograd.grad(..., create_graph=True)``, a gradient penalty,
    hooks) breaks under it. The built-in methods' losses do not; a class says so for itself with
    ``fused_sgd_safe = True`` in its own body. A user's subclass of a built-in does not inherit
    it (its ``loss`` may be new), so ``train.fused_sgd = "auto"`` leaves user code unfused.
    """
    declared = type(algo).__dict__.get("fused_sgd_safe")
    if declared is not None:
        return bool(declared)
    return type(algo).__module__.startswith("fedmosaic.algorithms.")


# With plain SGD (no momentum, no weight decay) a Linear layer's update is
# ``W -= lr * g^T x``: it can be applied inside the layer's backward with one in-place ``addmm_``
# right after the input gradient ``g W`` is computed, so ``dW`` is never materialised, written,
# read back by the optimizer and freed. For the wide fully-connected layers of small CNNs at batch
# 10 the step is bound by weight traffic, not FLOPs, and this removes about a third of it.
# Mathematically it is the same SGD step (other gradient contributions to ``W``, e.g. a proximal
# term, still reach ``W.grad`` and the optimizer adds them); the rounding differs slightly from
# ``mm`` then ``add_``, so fused and unfused runs are not bitwise equal (every runtime uses the
# same path, so backends stay bitwise equal to each other).
# Safety: a layer called twice in one forward (its second backward would see the updated W) or a
# weight saved by another op for its backward (autograd's version check would raise) cannot be
# fused. The first is detected during the forward; the step is then redone unfused (RNG and
# buffers restored) and the rest of that training stays unfused.


class _FusedConflict(Exception):
    """A fused Linear was called twice in one forward."""


def sgd_linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b``: the native kernel for 1..``kernels.MAX_BATCH`` rows when it is built (it
    streams W once, no packing), else ``F.linear``."""
    if kernels.usable(x, weight, bias):
        return kernels.linear_forward(x, weight, bias)
    return F.linear(x, weight, bias)


def sgd_linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, need_dx: bool
) -> Tensor | None:
    """The backward of :func:`sgd_linear_forward` with plain SGD applied in place: returns
    ``dx = grad W`` with the old W (when ``need_dx``), then ``W -= lr * grad^T x`` and
    ``b -= lr * sum(grad)``; no ``.grad`` is written. One pass over W with the native kernel."""
    if kernels.usable(x, weight, bias):
        return kernels.linear_backward_sgd(grad, x, weight, bias, lr, need_dx)
    g2 = grad.reshape(-1, grad.shape[-1])  # [N, out]
    gx = grad.matmul(weight) if need_dx else None  # [.., in], old W
    with torch.no_grad():
        weight.addmm_(g2.t(), x.reshape(-1, x.shape[-1]), alpha=-lr)  # W -= lr g^T x
        if bias is not None:
            bias.add_(g2.sum(0), alpha=-lr)
    return gx


class _SGDLinear(torch.autograd.Function):
    # The two functions above as one autograd op: the update happens in the backward.
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias = bias
        ctx.lr = lr
        return sgd_linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        gx = sgd_linear_backward(grad, x, weight, ctx.bias, ctx.lr, ctx.needs_input_grad[0])
        ctx.bias = None
        return gx, None, None, None


class FusedSGDLinears:
    """Route the given Linear layers through :class:`_SGDLinear` while active (and, with the
    native kernels built, single-input-channel Conv2d layers through ``kernels.conv``)."""

    def __init__(self, layers: Sequence[nn.Module], lr: float) -> None:
        self.layers = list(layers)
        self.lr = lr
        self.calls: set[int] = set()
        self.active = False

    @staticmethod
    def eligible(
        modules: Iterable[nn.Module], params: Sequence[nn.Parameter], s: TrainSettings
    ) -> list[nn.Module]:
        """Linear layers whose weight (and bias) all train, when the optimizer is plain SGD."""
        if not (s.fused_sgd and s.optimizer == "sgd" and s.momentum == 0 and s.weight_decay == 0):
            return []
        if s.precision != "fp32":  # the fused layers compute in float32 only
            return []
        train = {id(p) for p in params}

        def trains(m: nn.Module) -> bool:
            return (
                id(m.weight) in train
                and m.weight.device.type == "cpu"
                and (m.bias is None or id(m.bias) in train)
            )

        native = kernels.load() is not None
        modules = list(modules)
        # whole conv -> pool -> ReLU blocks first: their convolution then runs inside the block
        blocks = [m for m in modules if native and fast_conv.block_eligible(m) and trains(m[0])]
        inside = {id(b[0]) for b in blocks}
        out: list[nn.Module] = list(blocks)
        for m in modules:
            fused = type(m) is nn.Linear or (native and fast_conv.eligible(m))
            if fused and id(m) not in inside and trains(m):
                out.append(m)
        return out

    def _forward(self, layer: nn.Module) -> Callable[[Tensor], Tensor]:
        is_conv = type(layer) is nn.Conv2d
        is_block = isinstance(layer, nn.Sequential)  # a conv -> pool -> ReLU block
        owner = layer[0] if is_block else layer  # the module holding the weight

        def forward(x: Tensor) -> Tensor:
            w, b = owner.weight, owner.bias
            if (
                not (torch.is_grad_enabled() and w.requires_grad and (b is None or b.requires_grad))
                or (is_conv and x.dim() != 4)
                or (is_block and not fast_conv.block_fits(x, owner))
            ):  # frozen right now (some losses freeze blocks per step), unbatched, or an input
                return type(layer).forward(layer, x)  # the block op does not take: plain layers
            if id(layer) in self.calls:
                raise _FusedConflict
            self.calls.add(id(layer))
            if is_block:
                return fast_conv.SGDConvPoolReLU.apply(x, w, b, self.lr, owner)
            if is_conv:
                return fast_conv.SGDConv2d.apply(x, w, b, self.lr, layer)
            return _SGDLinear.apply(x, w, b, self.lr)

        return forward

    def start(self) -> None:
        for layer in self.layers:
            layer.forward = self._forward(layer)  # type: ignore[method-assign]
        self.active = True

    def stop(self) -> None:
        for layer in self.layers:
            if "forward" in layer.__dict__:
                del layer.forward
        self.active = False

    def new_step(self) -> None:
        self.calls.clear()


# ---- inference: Linear layers through the fastest CPU path -------------------------------------


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_inference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` without autograd: the native kernel for skinny batches, oneDNN's matmul
    for larger ones (measured here at batch 100: 2.1x MKL's sgemm with AVX-512, 1.15x with
    oneDNN held to AVX2), else ``F.linear``. Same function; sums in another order."""
    if (
        _ONEDNN
        and not kernels.usable(x, weight, bias)  # skinny batches: the kernel, below
        and x.numel() > 0
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
    ):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        return _onednn_linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return sgd_linear_forward(x, weight, bias)


def _onednn_works() -> bool:
    """oneDNN's dense linear op exists in this torch build and agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.ones(3, 5), torch.full((2, 5), 0.5), torch.tensor([1.0, -1.0])
        return torch.equal(_onednn_linear(x, w, b), F.linear(x, w, b))
    except (RuntimeError, AttributeError):  # an op missing from this build: F.linear
        return False


_ONEDNN = _onednn_works()


@contextlib.contextmanager
def fast_inference(*modules: nn.Module) -> Any:
    """While active, the ``nn.Linear`` layers of ``modules`` compute through
    :func:`linear_inference` when autograd is off (evaluation, prototype passes); with autograd
    on, or for a layer already patched (training's fused layers), nothing changes."""
    layers = [
        m
        for mod in modules
        for m in mod.modules()
        if type(m) is nn.Linear and "forward" not in m.__dict__
    ]

    def patched(layer: nn.Linear) -> Callable[[Tensor], Tensor]:
        def forward(x: Tensor) -> Tensor:
            if torch.is_grad_enabled():
                return F.linear(x, layer.weight, layer.bias)
            return linear_inference(x, layer.weight, layer.bias)

        return forward

    for layer in layers:
        layer.forward = patched(layer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            if "forward" in layer.__dict__:
                del layer.forward


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
) -> TrainStats:
    """Minibatch training of ``params`` on ``loss_fn(x, y)``; ``sample(positions) -> (x, y)``.

    ``modules``: the modules ``params`` belong to; with plain SGD their Linear layers take the
    fused update (see ``FusedSGDLinears``).
    """
    stats = TrainStats()
    if not params or epochs <= 0:
        return stats
    opt = make_optimizer(params, s, lr)
    unique = list({id(m): m for mod in modules for m in mod.modules()}.values())
    layers = FusedSGDLinears.eligible(unique, params, s)
    step_lr = s.lr if lr is None else lr
    fused = FusedSGDLinears(layers, step_lr) if layers else None
    buffers = [b for m in unique for b in m.buffers(recurse=False)]
    precision = autocast(s)
    opt.zero_grad(set_to_none=True)  # then after every step: each backward starts from none
    # plain SGD (no momentum, weight decay or other options): ``p -= lr * grad``, as the optimizer
    # computes it (``param.add_(grad, alpha=-lr)``), bit for bit
    plain_sgd = isinstance(opt, torch.optim.SGD) and s.momentum == 0 and s.weight_decay == 0
    try:
        if fused is not None:
            fused.start()
        for _ in range(epochs):
            for pos in batch_order(n, s.batch_size, gen, s.drop_last):
                x, y = sample(pos)
                if fused is not None and fused.active:
                    # A conflict shows on the first step (same loss code every step): only then
                    # are buffers (BatchNorm statistics) snapshotted; the RNG always is.
                    rng = torch.get_rng_state()
                    saved = [b.clone() for b in buffers] if stats.steps == 0 else []
                    fused.new_step()
                    try:
                        loss = loss_fn(x, y)  # fp32 only (see ``eligible``): no autocast
                    except _FusedConflict:  # a layer used twice: redo this step unfused
                        fused.stop()
                        torch.set_rng_state(rng)
                        with torch.no_grad():
                            for b, v in zip(buffers, saved):
                                b.copy_(v)
                        loss = loss_fn(x, y)
                else:
                    with precision:
                        loss = loss_fn(x, y)
                loss.backward()
                if plain_sgd:  # torch.optim.SGD's own update, without its ~0.05 ms a step
                    with torch.no_grad():
                        for p in params:
                            if p.grad is not None:  # none for the fused layers
                                p.add_(p.grad, alpha=-step_lr)
                                p.grad = None
                elif any(p.grad is not None for p in params):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                stats.steps += 1
                stats.examples += int(pos.numel())
                stats.loss_sum += float(loss.detach())
    finally:
        if fused is not None:
            fused.stop()
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
            )
            total.steps += st.steps
            total.examples += st.examples
            total.loss_sum += st.loss_sum
    finally:
        unfreeze_all(model, extras)
        model.eval()
        extras.eval()
    return total
