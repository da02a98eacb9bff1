"""Parameter and FLOP counts (forward hooks on one image).

What is counted per layer (FLOPs; a multiply-add is 2):

- Conv2d: ``2 * out_elements * in_channels / groups * kh * kw`` (+ ``out_elements`` with bias)
- Linear: ``2 * in_features * out_features`` per row (+ ``out_features`` with bias)
- BatchNorm: 2 per element (scale + shift); ReLU / ReLU6: 1 per element
- MaxPool2d: ``kh * kw`` per output element; average pools (adaptive, global): 1 per input element

Ignored (all small next to the convs): residual additions, concatenation, channel shuffle,
flatten / reshape / memory-layout changes, Identity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ._layers import GlobalAvgPool


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (optionally only those with ``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def layer_flops(module: nn.Module, inp: Tensor, out: Tensor) -> int:
    """Forward FLOPs of one leaf module call (0 for the ignored kinds)."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        per_out = 2 * (module.in_channels // module.groups) * kh * kw
        return out.numel() * (per_out + (module.bias is not None))
    if isinstance(module, nn.Linear):
        return out.numel() * (2 * module.in_features + (module.bias is not None))
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return 2 * out.numel()
    if isinstance(module, (nn.ReLU, nn.ReLU6)):
        return out.numel()
    if isinstance(module, nn.MaxPool2d):
        kh, kw = _pair(module.kernel_size)
        return out.numel() * kh * kw
    if isinstance(
        module,
        (nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, GlobalAvgPool),
    ):
        return inp.numel()
    return 0


@contextmanager
def _traced(
    model: nn.Module, input_shape: tuple[int, ...]
) -> Iterator[list[tuple[nn.Module, int]]]:
    """Run one image through ``model`` in eval mode; yield ``[(leaf module, flops)]`` in call order."""
    calls: list[tuple[nn.Module, int]] = []

    def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        calls.append((module, layer_flops(module, args[0], out)))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    was_training = model.training
    model.eval()
    try:
        param = next(model.parameters(), None)
        x = torch.zeros(1, *input_shape, device=param.device if param is not None else None)
        with torch.no_grad():
            model(x)
        yield calls
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()


def flops_per_image(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Forward FLOPs of ``model`` for one image of shape ``(C, H, W)`` (see module doc)."""
    with _traced(model, input_shape) as calls:
        return sum(f for _, f in calls)


def trainable_flops(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Estimated forward + backward FLOPs for one training image when only the parameters with
    ``requires_grad`` train (layer expansion, FedBABU, FedRep phases).

    Forward: every layer. Backward, per layer in call order: the weight gradient (about its forward
    FLOPs) if it has trainable parameters, and the input gradient (again about its forward FLOPs)
    if any trainable parameter was used before it, i.e. if the gradient must flow through it.
    Call order approximates "before" for branching nets (ResNets, Inception).
    """
    with _traced(model, input_shape) as calls:
        total = 0
        seen_trainable = False
        for module, flops in calls:
            trains = any(p.requires_grad for p in module.parameters(recurse=False))
            total += flops  # forward
            total += flops if trains else 0  # weight gradient
            total += flops if seen_trainable else 0  # input gradient
            seen_trainable = seen_trainable or trains
        return total


def member_flops(
    members: Sequence[str], build: Callable[[int], nn.Module], input_shape: Sequence[int]
) -> list[float]:
    """Forward FLOPs per image of each client's model, building one model per distinct member
    (``members[i]`` is client i's architecture, ``build(i)`` its model). The caller's RNG state is
    left as it was."""
    per_member: dict[str, float] = {}
    out = []
    for cid, member in enumerate(members):
        if member not in per_member:
            with torch.random.fork_rng(devices=[]):
                model = build(cid)
            per_member[member] = float(flops_per_image(model, tuple(input_shape)))
        out.append(per_member[member])
    return out
