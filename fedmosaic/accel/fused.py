"""Plain SGD fused into the Linear layers' backward: the fast steps of ``core.training``'s loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic import kernels
from fedmosaic.accel._engaged import engaged
from fedmosaic.core.training import LossFn, TrainSettings
from fedmosaic.kernels import conv as fast_conv

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


@overload
def sgd_linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, need_dx: Literal[True]
) -> Tensor: ...
@overload
def sgd_linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, need_dx: bool
) -> Tensor | None: ...
def sgd_linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, need_dx: bool
) -> Tensor | None:
    """The backward of :func:`sgd_linear_forward` with plain SGD applied in place: returns
    ``dx = grad W`` with the old W (when ``need_dx``), then ``W -= lr * grad^T x`` and
    ``b -= lr * sum(grad)``; no ``.grad`` is written. One pass over W with the native kernel."""
    engaged["sgd_linear_backward"] += 1
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
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None]:
        (grad,) = grads  # one output
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
        if not (
            s.accel.fused_sgd and s.optimizer == "sgd" and s.momentum == 0 and s.weight_decay == 0
        ):
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
        # a conv -> pool -> ReLU block (eligible() took it): its convolution holds the weight
        block = fast_conv.block_conv(layer) if isinstance(layer, nn.Sequential) else None
        owner = layer if block is None else block  # the module holding the weight

        def forward(x: Tensor) -> Tensor:
            w, b = owner.weight, owner.bias
            if (
                not (torch.is_grad_enabled() and w.requires_grad and (b is None or b.requires_grad))
                or (is_conv and x.dim() != 4)
                or (block is not None and not fast_conv.block_fits(x, block))
            ):  # frozen right now (some losses freeze blocks per step), unbatched, or an input
                return type(layer).forward(layer, x)  # the block op does not take: plain layers
            if id(layer) in self.calls:
                raise _FusedConflict
            self.calls.add(id(layer))
            if block is not None:
                return fast_conv.SGDConvPoolReLU.apply(x, w, b, self.lr, block)
            if is_conv:
                return fast_conv.SGDConv2d.apply(x, w, b, self.lr, layer)
            return _SGDLinear.apply(x, w, b, self.lr)

        return forward

    def start(self) -> None:
        for layer in self.layers:
            layer.forward = self._forward(layer)
        self.active = True

    def stop(self) -> None:
        for layer in self.layers:
            if "forward" in layer.__dict__:
                del layer.forward
        self.active = False

    def new_step(self) -> None:
        self.calls.clear()


class FusedSteps:
    """``core.training.FastSteps`` for a phase: ``layers`` take their SGD update in their backward.

    A conflict (a layer used twice in one forward) shows on the first step (same loss code every
    step): only then are buffers (BatchNorm statistics) snapshotted; the RNG always is. The step
    is then redone unfused, and the rest of the phase stays unfused.
    """

    def __init__(self, layers: Sequence[nn.Module], lr: float, modules: Sequence[nn.Module]):
        self.fused = FusedSGDLinears(layers, lr)
        self.lr = lr
        self.buffers = [b for m in modules for b in m.buffers(recurse=False)]

    def __enter__(self) -> FusedSteps:
        self.fused.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.fused.stop()

    def loss(self, loss_fn: LossFn, x: Tensor, y: Tensor, first: bool) -> Tensor:
        if not self.fused.active:  # stopped by a conflict (fp32 only: no autocast to apply)
            return loss_fn(x, y)
        rng = torch.get_rng_state()
        saved = [b.clone() for b in self.buffers] if first else []
        self.fused.new_step()
        try:
            loss = loss_fn(x, y)
        except _FusedConflict:  # a layer used twice: redo this step unfused
            self.fused.stop()
            torch.set_rng_state(rng)
            with torch.no_grad():
                for b, v in zip(self.buffers, saved):
                    b.copy_(v)
            return loss_fn(x, y)
        engaged["fused_steps"] += 1
        return loss

    def update(self, params: Sequence[nn.Parameter]) -> None:
        # Plain SGD (fusing requires it): ``p -= lr * grad`` as torch.optim.SGD computes it
        # (``param.add_(grad, alpha=-lr)``), bit for bit, without its ~0.05 ms a step; the
        # layers updated in their backward have no .grad.
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)
                    p.grad = None


def fused_steps(
    modules: Sequence[nn.Module], params: Sequence[nn.Parameter], s: TrainSettings, lr: float
) -> FusedSteps | None:
    """Fused steps for the eligible layers of ``modules``; None when no layer is."""
    layers = FusedSGDLinears.eligible(modules, params, s)
    return FusedSteps(layers, lr, modules) if layers else None
