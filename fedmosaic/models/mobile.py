"""Small-image MobileNetV2, ShuffleNetV2 (1.0x) and GoogLeNet.

All three keep the papers' layer tables and widths but replace the ImageNet stem (stride-2 conv
and/or max pool, 4x down-sampling) with a stride-1 3x3 stem, as the ResNets here do, so a 32x32
image is not reduced to 1x1 maps halfway through the network.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from fedmosaic.core.registry import ENCODERS

from ._layers import GlobalAvgPool, ToChannelsLast, conv_bn_act, init_conv_kaiming

# ----------------------------------------------------------------------------------------------
# MobileNetV2 (Sandler et al. 2018, Table 2)


class InvertedResidual(nn.Module):
    """[1x1 expand -> BN -> ReLU6] -> 3x3 depthwise -> BN -> ReLU6 -> 1x1 project -> BN (+ x)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = in_ch * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(conv_bn_act(in_ch, hidden, 1, act=nn.ReLU6))
        layers += [
            conv_bn_act(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
            conv_bn_act(hidden, out_ch, 1, act=None),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        return x + out if self.residual else out


# (expansion t, channels c, repeats n, stride s); stage 2's stride is 1 here (ImageNet: 2).
_MBV2_TABLE = [
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


@ENCODERS.register("mobilenetv2")
def mobilenetv2(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """MobileNetV2 1.0x (Sandler et al. 2018, Table 2; FedTGP HtFE4/HtFE8) for small images: stem
    3x3 conv 32 with stride 1 and the 24-channel stage at stride 1 (ImageNet: both 2), so 32x32
    maps go 32 -> 32 -> 16 -> 8 -> 4. Final 1x1 conv 1280 + global pool: natural_dim 1280.
    Blocks: stem (channels-last re-layout + 3x3 conv), stage1..stage7 (the table's rows),
    conv_last (1x1 conv + pool).
    """
    del image_size
    # Channels-last activations: oneDNN's depthwise convs are faster in it (~1.2x per training
    # step at 3x32x32, batch 10, 1 thread; ResNets gain nothing, so they stay NCHW).
    stem = nn.Sequential(ToChannelsLast(), *conv_bn_act(in_channels, 32, 3, act=nn.ReLU6))
    blocks: dict[str, nn.Module] = {"stem": stem}
    ch = 32
    for i, (t, c, n, s) in enumerate(_MBV2_TABLE, start=1):
        stage = []
        for j in range(n):
            stage.append(InvertedResidual(ch, c, s if j == 0 else 1, t))
            ch = c
        blocks[f"stage{i}"] = nn.Sequential(*stage)
    blocks["conv_last"] = nn.Sequential(*conv_bn_act(ch, 1280, 1, act=nn.ReLU6), GlobalAvgPool())
    encoder = nn.Sequential(OrderedDict(blocks))
    init_conv_kaiming(encoder)
    return encoder, 1280


# ----------------------------------------------------------------------------------------------
# ShuffleNetV2 (Ma et al. 2018, Table 5, 1.0x)


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    b, c, h, w = x.shape
    return x.reshape(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit: stride 1 splits channels in half and transforms one half; stride 2
    transforms two copies (one through a depthwise down-sampling branch). Concat + shuffle."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = out_ch // 2
        branch_in = in_ch if stride > 1 else in_ch // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                conv_bn_act(in_ch, in_ch, 3, stride, groups=in_ch, act=None),
                conv_bn_act(in_ch, half, 1),
            )
        self.branch2 = nn.Sequential(
            conv_bn_act(branch_in, half, 1),
            conv_bn_act(half, half, 3, stride, groups=half, act=None),
            conv_bn_act(half, half, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            keep, x2 = x.chunk(2, dim=1)
            out = torch.cat((keep, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


@ENCODERS.register("shufflenetv2")
def shufflenetv2(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """ShuffleNetV2 1.0x (Ma et al. 2018, Table 5; FedClassAvg) for small images: stem 3x3 conv 24
    with stride 1 and no max pool (ImageNet: stride 2 + max pool); stages of 116/232/464 channels
    (4/8/4 units, first of each with stride 2: 32 -> 16 -> 8 -> 4); conv5 1x1 1024 + global pool:
    natural_dim 1024. Blocks: stem, stage2, stage3, stage4, conv5 (1x1 conv + pool).
    """
    del image_size
    blocks: dict[str, nn.Module] = {"stem": conv_bn_act(in_channels, 24, 3)}
    ch = 24
    for name, out_ch, repeats in (("stage2", 116, 4), ("stage3", 232, 8), ("stage4", 464, 4)):
        units = []
        for j in range(repeats):
            units.append(ShuffleUnit(ch, out_ch, 2 if j == 0 else 1))
            ch = out_ch
        blocks[name] = nn.Sequential(*units)
    blocks["conv5"] = nn.Sequential(*conv_bn_act(ch, 1024, 1), GlobalAvgPool())
    encoder = nn.Sequential(OrderedDict(blocks))
    init_conv_kaiming(encoder)
    return encoder, 1024


# ----------------------------------------------------------------------------------------------
# GoogLeNet (Szegedy et al. 2015, Table 1), with BatchNorm as torchvision's


def _bconv(in_ch: int, out_ch: int, kernel: int) -> nn.Sequential:
    return conv_bn_act(in_ch, out_ch, kernel, eps=1e-3)


class Inception(nn.Module):
    """Four branches concatenated: 1x1 | 1x1 -> 3x3 | 1x1 -> 3x3 | 3x3 max pool -> 1x1.

    The third branch uses a 3x3 conv where the paper has 5x5, as torchvision's GoogLeNet (the one
    FedTGP/HtFLlib and FedClassAvg ran) does.
    """

    def __init__(
        self, in_ch: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool_proj: int
    ) -> None:
        super().__init__()
        self.branch1 = _bconv(in_ch, c1, 1)
        self.branch2 = nn.Sequential(_bconv(in_ch, c3r, 1), _bconv(c3r, c3, 3))
        self.branch3 = nn.Sequential(_bconv(in_ch, c5r, 1), _bconv(c5r, c5, 3))
        self.branch4 = nn.Sequential(
            ToChannelsLast(), nn.MaxPool2d(3, 1, 1), _bconv(in_ch, pool_proj, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat(
            (self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)), dim=1
        )


def _down() -> nn.Module:
    return nn.Sequential(ToChannelsLast(), nn.MaxPool2d(3, 2, 1))


@ENCODERS.register("googlenet")
def googlenet(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """GoogLeNet (Szegedy et al. 2015, Table 1 widths; FedTGP HtFE4/8, FedClassAvg), small variant:
    the 7x7/2 conv + 2 max pools of the ImageNet stem become a 3x3 stride-1 conv and one max pool,
    so inception 3/4/5 run at 16/8/4 pixels for a 32x32 input (ImageNet: 28/14/7; torchvision on
    32x32: 4/2/1). BatchNorm after every conv (torchvision), no auxiliary classifiers or dropout.
    natural_dim 1024. Blocks: stem (3x3 64, pool, 1x1 64, 3x3 192), inception3 (3a, 3b, pool),
    inception4 (4a-4e, pool), inception5 (5a, 5b, global pool).
    """
    del image_size
    encoder = nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(
                _bconv(in_channels, 64, 3), _down(), _bconv(64, 64, 1), _bconv(64, 192, 3)
            ),
            inception3=nn.Sequential(
                Inception(192, 64, 96, 128, 16, 32, 32),
                Inception(256, 128, 128, 192, 32, 96, 64),
                _down(),
            ),
            inception4=nn.Sequential(
                Inception(480, 192, 96, 208, 16, 48, 64),
                Inception(512, 160, 112, 224, 24, 64, 64),
                Inception(512, 128, 128, 256, 24, 64, 64),
                Inception(512, 112, 144, 288, 32, 64, 64),
                Inception(528, 256, 160, 320, 32, 128, 128),
                _down(),
            ),
            inception5=nn.Sequential(
                Inception(832, 256, 160, 320, 32, 128, 128),
                Inception(832, 384, 192, 384, 48, 128, 128),
                GlobalAvgPool(),
            ),
        )
    )
    init_conv_kaiming(encoder)
    return encoder, 1024
