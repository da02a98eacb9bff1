"""The two cost measures of ``models.flops``: FLOPs (a multiply-add is 2) and MACs (it is 1)."""

from __future__ import annotations

import torch
from torch import nn

from fedmosaic.models.flops import layer_flops, layer_macs


def test_a_bias_free_conv_or_linear_costs_two_flops_per_mac() -> None:
    for layer, x in (
        (nn.Conv2d(3, 5, 3, padding=1, bias=False), torch.zeros(1, 3, 6, 6)),
        (nn.Conv2d(4, 8, 3, groups=2, bias=False), torch.zeros(1, 4, 5, 5)),
        (nn.Linear(7, 3, bias=False), torch.zeros(1, 7)),
    ):
        out = layer(x)
        assert layer_flops(layer, x, out) == 2 * layer_macs(layer, out) > 0


def test_a_bias_adds_one_flop_per_output_and_no_mac() -> None:
    layer, x = nn.Linear(7, 3), torch.zeros(1, 7)
    out = layer(x)
    assert layer_flops(layer, x, out) == 2 * layer_macs(layer, out) + 3
