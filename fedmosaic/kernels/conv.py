"""Single-input-channel convolutions (the first layer of the gray CNNs) with plain SGD fused in.

At batch 10 on ``[1, 28, 28]`` images, mkldnn's convolution of a 1-channel input runs at a few
GFLOP/s (``K = C * kh * kw = 25`` is too short for its blocking) and its NCHW output is then
copied to channels-last for pooling. Here the forward is one im2col GEMM,
``y[B*L, O] = cols[B*L, K] W[O, K]^T + b``, whose output is already channels-last, and the
backward applies ``W -= lr * dy^T cols`` and ``b -= lr * sum(dy)`` in place (no ``W.grad``), as
the fused Linear layers do (``fedmosaic.core.training.FusedSGDLinears``). Same convolution; the
sums run in another order, so results agree with mkldnn's to float tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def eligible(m: nn.Module) -> bool:
    """A plain Conv2d of one input channel (zero padding, no dilation or groups)."""
    return (
        type(m) is nn.Conv2d
        and m.in_channels == 1
        and m.groups == 1
        and m.dilation == (1, 1)
        and m.padding_mode == "zeros"
        and isinstance(m.padding, tuple)
    )


def im2col(x: Tensor, k: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int]) -> Tensor:
    """``[B, C, H, W] -> [B * Ho * Wo, C * kh * kw]`` (rows in NHWC order, columns as W's)."""
    if pad != (0, 0):
        x = torch.nn.functional.pad(x, (pad[1], pad[1], pad[0], pad[0]))
    p = x.unfold(2, k[0], stride[0]).unfold(3, k[1], stride[1])  # [B, C, Ho, Wo, kh, kw]
    return p.permute(0, 2, 3, 1, 4, 5).reshape(-1, x.shape[1] * k[0] * k[1])


class SGDConv2d(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, conv: nn.Conv2d
    ) -> Tensor:
        k, s, p = conv.kernel_size, conv.stride, conv.padding
        cols = im2col(x, k, s, p)  # [B*L, K]
        b, ho = x.shape[0], (x.shape[2] + 2 * p[0] - k[0]) // s[0] + 1
        wo = (x.shape[3] + 2 * p[1] - k[1]) // s[1] + 1
        w2 = weight.reshape(weight.shape[0], -1)  # [O, K]
        y = torch.addmm(bias, cols, w2.t()) if bias is not None else cols @ w2.t()  # [B*L, O]
        ctx.save_for_backward(x, weight, cols)
        ctx.bias, ctx.lr, ctx.stride, ctx.padding = bias, lr, s, p
        return y.view(b, ho, wo, -1).permute(0, 3, 1, 2)  # [B, O, Ho, Wo], channels-last

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        x, weight, cols = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:  # with the old W
            gx = torch.nn.grad.conv2d_input(x.shape, weight, grad, ctx.stride, ctx.padding)
        w2 = weight.view(weight.shape[0], -1)  # [O, K]
        b, o = grad.shape[:2]
        with torch.no_grad():
            if grad.is_contiguous():  # NCHW (as after a flatten): per image [O, L] @ [L, K]
                g3 = grad.reshape(b, o, -1)
                w2.sub_(torch.bmm(g3, cols.view(b, -1, cols.shape[1])).sum(0), alpha=ctx.lr)
                gb = g3.sum((0, 2))
            else:  # channels-last: one [O, B*L] @ [B*L, K]
                g2 = grad.permute(0, 2, 3, 1).reshape(-1, o)  # [B*L, O]
                w2.addmm_(g2.t(), cols, alpha=-ctx.lr)
                gb = g2.sum(0)
            if ctx.bias is not None:
                ctx.bias.add_(gb, alpha=-ctx.lr)
        ctx.bias = None
        return gx, None, None, None, None
