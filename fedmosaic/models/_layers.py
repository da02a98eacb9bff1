"""Small building blocks shared by the zoo's architectures.

Speed note (CPU): PyTorch's NCHW ``max_pool2d`` kernel is ~8x slower than its channels-last one
(1.04 ms vs 0.13 ms per call in FedAvgCNN at batch 10). The plain CNNs therefore run
``conv -> ToChannelsLast -> MaxPool2d -> ReLU``: ReLU after the pool is the same function as before
it (both monotone: ``relu(max(x)) == max(relu(x))``, same gradients) on 4x fewer elements, and
converting before the ReLU keeps its backward in one memory layout (converting between ReLU and
pool, with the ReLU's backward then mixing layouts, was no faster than plain NCHW). Measured
training-step gains (1 thread, batch 10, CPU time): FedAvgCNN 1.14-1.17x, CNN1 1.04-1.10x,
AlexNet 1.22-1.39x, GoogLeNet 1.27-1.31x. Layouts never change values (conv algorithms may differ
in the last float bits); ``flatten`` reads logical NCHW order, and ``ToChannelsLast`` is a no-op
inside ``torch.func`` transforms, which cannot handle channels-last layouts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from fedmosaic.core.training import accelerator

# Switch for benchmarks / debugging: False makes ToChannelsLast a no-op everywhere.
CHANNELS_LAST_POOL = True


def _functorch_wrapped(x: Tensor) -> bool:
    """True inside torch.func transforms (vmap cannot query channels-last contiguity)."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(x)) if check is not None else False


class ToChannelsLast(nn.Module):
    """Re-lay a 4-D activation out as channels-last (values unchanged); no-op under torch.func."""

    def forward(self, x: Tensor) -> Tensor:
        if not CHANNELS_LAST_POOL or x.dim() != 4 or _functorch_wrapped(x):
            return x
        return x.contiguous(memory_format=torch.channels_last)


class GlobalAvgPool(nn.Module):
    """``[B, C, H, W] -> [B, C]``: adaptive average pool to 1x1, then flatten."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)


def conv_bn_act(
    in_ch: int,
    out_ch: int,
    kernel: int,
    stride: int = 1,
    groups: int = 1,
    act: type[nn.Module] | None = nn.ReLU,
    eps: float = 1e-5,
) -> nn.Sequential:
    """``Conv2d (no bias, 'same' padding for odd kernel sizes) -> BatchNorm2d [-> activation]``."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_ch, eps=eps),
    ]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


# Switch for benchmarks (a plain library's execution): False keeps inference on torch's layers.
NATIVE_INFERENCE = True


class ConvPoolReLU(nn.Sequential):
    """``Conv2d -> ToChannelsLast -> MaxPool2d(2) -> ReLU`` (the plain-CNN conv block).

    Without autograd (evaluation, prototype passes), a single-input-channel block runs as one
    native op where the installed accelerator has one (``Accelerator.block_inference``, given
    by ``fedmosaic.accel``: a fused conv, pool and ReLU forward; HtCNN8's first
    block at batch 100, one thread: 0.44 ms with AVX-512 instead of 6-10 ms through torch's
    layers); same function, sums in another order. Training takes it through
    ``accel.fused.FusedSGDLinears``. With a hook on a child (FLOP counting, user probes) the
    children run one by one, as they would anyway.
    """

    def forward(self, x: Tensor) -> Tensor:
        acc = accelerator()
        if acc is not None and NATIVE_INFERENCE and not torch.is_grad_enabled():
            if not _functorch_wrapped(x) and not _hooked(self):
                y = acc.block_inference(self, x)
                if y is not None:
                    return y
        return super().forward(x)


def _hooked(block: nn.Module) -> bool:
    glob = nn.modules.module
    if glob._global_forward_hooks or glob._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())


def conv_pool_relu(in_ch: int, out_ch: int, kernel: int, padding: int) -> nn.Sequential:
    """The plain-CNN conv block: ``Conv2d -> 2x2 max pool -> ReLU`` (see module note)."""
    return ConvPoolReLU(
        nn.Conv2d(in_ch, out_ch, kernel, padding=padding),
        ToChannelsLast(),
        nn.MaxPool2d(2),
        nn.ReLU(),
    )


def fc_relu(in_dim: int, out_dim: int, flatten: bool = False) -> nn.Sequential:
    """``[Flatten ->] Linear -> ReLU``."""
    layers: list[nn.Module] = [nn.Flatten()] if flatten else []
    layers += [nn.Linear(in_dim, out_dim), nn.ReLU()]
    return nn.Sequential(*layers)


def plain_cnn(
    in_channels: int,
    image_size: int,
    convs: Sequence[tuple[int, int, int]],
    fcs: Sequence[int],
) -> tuple[nn.Sequential, int]:
    """Blocks ``conv1..convK`` (conv -> 2x2 max pool -> ReLU) then ``fc1..fcM`` (Linear -> ReLU).

    ``convs`` holds ``(out_channels, kernel, padding)`` per conv. The papers' convs are unpadded;
    when the unpadded stack would shrink the image below 1x1 (e.g. 8x8 digits), every conv uses
    'same' padding (``kernel // 2``) instead. ``fc1`` starts with the flatten; with no fcs the
    flatten ends the last conv block. Returns ``(encoder, natural_dim)``.
    """

    def spatial(pads: Sequence[int]) -> int:
        size = image_size
        for (_, k, _), p in zip(convs, pads):
            size = (size + 2 * p - k + 1) // 2
        return size

    pads = [p for _, _, p in convs]
    if spatial(pads) < 1:
        pads = [k // 2 for _, k, _ in convs]
    size = spatial(pads)
    if size < 1:
        raise ValueError(f"image size {image_size} is too small for this CNN")

    blocks: dict[str, nn.Module] = {}
    ch = in_channels
    for i, ((out_ch, k, _), p) in enumerate(zip(convs, pads), start=1):
        blocks[f"conv{i}"] = conv_pool_relu(ch, out_ch, k, p)
        ch = out_ch
    dim = ch * size * size
    if not fcs:
        cast(nn.Sequential, blocks[f"conv{len(convs)}"]).append(nn.Flatten())  # conv_pool_relu
    for i, width in enumerate(fcs, start=1):
        blocks[f"fc{i}"] = fc_relu(dim, width, flatten=i == 1)
        dim = width
    return nn.Sequential(OrderedDict(blocks)), dim


def init_conv_kaiming(module: nn.Module) -> None:
    """He (fan_out) init for convs, unit/zero BatchNorm: the torchvision ResNet recipe."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
