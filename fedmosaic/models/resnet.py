"""ResNets (He et al. 2016) for small images: ResNet4/6/8/10 (FedTGP's HtFE3/HtFE9, HtFLlib's
``resnet4..10``: one BasicBlock per stage, 1..4 stages), ResNet18/34 (BasicBlock) and
ResNet50/101/152 (Bottleneck, stride on the 3x3 as in torchvision "v1.5").

Small-image stem: one 3x3 conv, stride 1, + BN + ReLU, no max pool (HtFLlib uses torchvision's
ImageNet stem, 7x7/2 + max pool, which leaves 1x1 maps after 16x down-sampling of a 32x32 image).
Stages have widths 64/128/256/512 (x4 for Bottleneck); stage 1 keeps the resolution, later stages
halve it (32 -> 32, 16, 8, 4). Projection shortcuts are 1x1 conv + BN where shape changes.
natural_dim = last stage width x expansion: 64, 128, 256, 512 (resnet4..10), 512 (18/34),
2048 (50/101/152).

Blocks: ``stem``, ``layer1`` .. ``layerK``; the global average pool + flatten close the last
layer, so every block owns parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

from torch import Tensor, nn

from fedmosaic.core.registry import ENCODERS

from ._layers import GlobalAvgPool, conv_bn_act, init_conv_kaiming


class BasicBlock(nn.Module):
    """3x3 -> BN -> ReLU -> 3x3 -> BN, + shortcut, ReLU."""

    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(in_ch, width, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 (x4 channels), BN after each, + shortcut, ReLU."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.shortcut = _shortcut(in_ch, out_ch, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


def resnet(
    in_channels: int, depths: list[int], block: type[BasicBlock] | type[Bottleneck]
) -> tuple[nn.Module, int]:
    """A small-image ResNet with ``depths[i]`` blocks in stage ``i`` (widths 64, 128, 256, 512)."""
    blocks: dict[str, nn.Module] = {"stem": conv_bn_act(in_channels, 64, 3)}
    ch = 64
    for i, depth in enumerate(depths):
        width = 64 * 2**i
        stage: list[nn.Module] = []
        for j in range(depth):
            stage.append(block(ch, width, 2 if (i > 0 and j == 0) else 1))
            ch = width * block.expansion
        blocks[f"layer{i + 1}"] = nn.Sequential(*stage)
    cast(nn.Sequential, blocks[f"layer{len(depths)}"]).append(GlobalAvgPool())  # a stage
    encoder = nn.Sequential(OrderedDict(blocks))
    init_conv_kaiming(encoder)
    return encoder, ch


_RESNETS: dict[str, tuple[list[int], type[BasicBlock] | type[Bottleneck], str]] = {
    "resnet4": ([1], BasicBlock, "FedTGP HtFE9 ResNet4 (HtFLlib resnet4: 2 + 2x1 layers)"),
    "resnet6": ([1, 1], BasicBlock, "FedTGP HtFE9 ResNet6 (HtFLlib resnet6: 2 + 2x2 layers)"),
    "resnet8": ([1, 1, 1], BasicBlock, "FedTGP HtFE9 ResNet8 (HtFLlib resnet8: 2 + 2x3)"),
    "resnet10": ([1, 1, 1, 1], BasicBlock, "FedTGP HtFE3/HtFE9 ResNet10 (2 + 2x4 layers)"),
    "resnet18": ([2, 2, 2, 2], BasicBlock, "ResNet18 (FedTGP HtFE2-9, FedClassAvg)"),
    "resnet34": ([3, 4, 6, 3], BasicBlock, "ResNet34 (FedTGP HtFE3/8/9, Res34-HtC4)"),
    "resnet50": ([3, 4, 6, 3], Bottleneck, "ResNet50 (FedTGP HtFE8/9)"),
    "resnet101": ([3, 4, 23, 3], Bottleneck, "ResNet101 (FedTGP HtFE8/9)"),
    "resnet152": ([3, 8, 36, 3], Bottleneck, "ResNet152 (FedTGP HtFE8/9)"),
}


def _register(
    name: str, depths: list[int], block: type[BasicBlock] | type[Bottleneck], doc: str
) -> None:
    def build(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        del image_size  # global pooling: any size >= 2**(stages - 1)
        return resnet(in_channels, depths, block)

    build.__name__ = build.__qualname__ = name
    blocks = ", ".join(["stem"] + [f"layer{i + 1}" for i in range(len(depths))])
    build.__doc__ = (
        f"{doc}: {block.__name__} x {depths}, small-image stem. Blocks: {blocks} (+ global pool)."
    )
    ENCODERS.add(name, build)


for _name, (_depths, _block, _doc) in _RESNETS.items():
    _register(_name, _depths, _block, _doc)
