"""Single-input-channel convolutions (the first layer of the gray CNNs) with plain SGD fused in.

At batch 10 on ``[1, 28, 28]`` images, mkldnn's convolution of a 1-channel input runs at a few
GFLOP/s (``K = C * kh * kw = 25`` is too short for its blocking) and its NCHW output is then
copied to channels-last for pooling. Here the forward is one im2col GEMM,
``y[B*L, O] = cols[B*L, K] W[O, K]^T + b``, whose output is already channels-last, and the
backward applies ``W -= lr * dy^T cols`` and ``b -= lr * sum(dy)`` in place (no ``W.grad``), as
the fused Linear layers do (``fedmosaic.accel.fused.FusedSGDLinears``). Same convolution; the
sums run in another order, so results agree with mkldnn's to float tolerance.

Where such a convolution opens the gray CNNs' usual block, ``Conv2d -> ToChannelsLast ->
MaxPool2d(2) -> ReLU`` (``models._layers.conv_pool_relu``) with a multiple of 8 output channels,
the whole block is one native op instead (:class:`SGDConvPoolReLU`): the forward computes the
four convolution outputs of each pooling window in registers, keeps their maximum (torch's rule:
first maximum, NaN wins) and its position, and applies the ReLU, writing only the pooled
channels-last output; the backward routes each pooled gradient (where the ReLU passed it) to its
window position and applies the SGD step to the weight and bias. No im2col copy, no full-size
convolution output, no separate pooling and ReLU passes or their backward buffers (HtCNN8's
first block, batch 10, one thread: a training step in 0.12 ms with the AVX-512 code, 0.26 ms with
AVX2, instead of 0.75 ms through torch's layers).
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
import torch.nn.grad  # torch.nn does not import it itself
from torch import Tensor, nn

from fedmosaic import kernels


def _pair(v: str | tuple[int, ...]) -> tuple[int, int]:
    """A Conv2d's ``kernel_size``, ``stride`` or ``padding``, which are pairs: torch types them as
    ``tuple[int, ...]`` (shared with the 1-d and 3-d layers), ``padding`` also as a string
    (``"same"``), which :func:`eligible` rules out."""
    assert isinstance(v, tuple) and len(v) == 2, v
    return v


def eligible(m: nn.Module) -> TypeGuard[nn.Conv2d]:
    """A plain Conv2d of one input channel (zero padding, no dilation or groups)."""
    return (
        type(m) is nn.Conv2d
        and m.in_channels == 1
        and m.groups == 1
        and m.dilation == (1, 1)
        and m.padding_mode == "zeros"
        and isinstance(m.padding, tuple)
    )


def block_eligible(m: nn.Module) -> TypeGuard[nn.Sequential]:
    """``Conv2d(1 -> 8n, k x k, stride 1) -> ToChannelsLast -> MaxPool2d(2) -> ReLU``: the block
    :class:`SGDConvPoolReLU` computes (``ToChannelsLast`` only re-lays memory out)."""
    if not isinstance(m, nn.Sequential) or len(m) != 4:
        return False
    conv, layout, pool, act = m
    return (
        eligible(conv)
        and conv.stride == (1, 1)
        and conv.kernel_size[0] == conv.kernel_size[1]
        and conv.out_channels % 8 == 0
        and conv.weight.is_contiguous()
        and type(layout).__name__ == "ToChannelsLast"
        and type(pool) is nn.MaxPool2d
        and pool.kernel_size in (2, (2, 2))
        and pool.stride in (2, (2, 2))
        and pool.padding in (0, (0, 0))
        and pool.dilation in (1, (1, 1))
        and not pool.ceil_mode
        and not pool.return_indices
        and type(act) is nn.ReLU
    )


def block_conv(m: nn.Sequential) -> nn.Conv2d:
    """The convolution opening a block that :func:`block_eligible` accepted."""
    conv = m[0]
    assert isinstance(conv, nn.Conv2d)
    return conv


def block_fits(x: Tensor, conv: nn.Conv2d) -> bool:
    """A batch the block op takes: ``[B, 1, H, W]`` float32 on the CPU, no input gradient, and a
    convolution output of at least 2 x 2."""
    k, p = conv.kernel_size[0], _pair(conv.padding)
    return (
        x.dim() == 4
        and x.shape[1] == 1
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not x.requires_grad
        and min(x.shape[2] + 2 * p[0], x.shape[3] + 2 * p[1]) >= k + 1
    )


def block_ready(m: nn.Module, x: Tensor) -> bool:
    """Whether the native block op takes ``x`` through block ``m`` now (kernel built, shapes)."""
    return kernels.load() is not None and block_eligible(m) and block_fits(x, block_conv(m))


def _padded(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """``[B, 1, H, W]`` -> ``[B, H + 2 ph, W + 2 pw]`` contiguous (zero padding)."""
    ph, pw = _pair(conv.padding)
    xp = x if (ph, pw) == (0, 0) else torch.nn.functional.pad(x, (pw, pw, ph, ph))
    return xp.reshape(x.shape[0], xp.shape[2], xp.shape[3]).contiguous()


@torch.no_grad()
def conv_pool_relu_inference(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """The block's forward without autograd (the caller checked :func:`block_ready`)."""
    mod = kernels.load()
    assert mod is not None
    w, b = conv.weight, conv.bias
    out, _ = mod.conv_pool_relu_forward(
        _padded(x, conv), w.view(w.shape[0], -1), None if b is None else b, conv.kernel_size[0]
    )
    return out.permute(0, 3, 1, 2)  # [B, O, Ho, Wo] in channels-last memory


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
        k, s, p = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.padding)
        cols = im2col(x, k, s, p)  # [B*L, K]
        b, ho = x.shape[0], (x.shape[2] + 2 * p[0] - k[0]) // s[0] + 1
        wo = (x.shape[3] + 2 * p[1] - k[1]) // s[1] + 1
        w2 = weight.reshape(weight.shape[0], -1)  # [O, K]
        y = torch.addmm(bias, cols, w2.t()) if bias is not None else cols @ w2.t()  # [B*L, O]
        ctx.save_for_backward(x, weight, cols)
        ctx.bias, ctx.lr, ctx.stride, ctx.padding = bias, lr, s, p
        return y.view(b, ho, wo, -1).permute(0, 3, 1, 2)  # [B, O, Ho, Wo], channels-last

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        (grad,) = grads  # one output
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


class SGDConvPoolReLU(torch.autograd.Function):
    """``relu(max_pool2d(conv2d(x, W, b), 2))`` for one input channel, with plain SGD applied to
    ``W`` and ``b`` in the backward (native kernel; the caller checked :func:`block_eligible`,
    :func:`block_fits` and that the kernel is loaded). No input gradient: a first layer."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, conv: nn.Conv2d
    ) -> Tensor:
        mod = kernels.load()
        assert mod is not None
        xp = _padded(x, conv)  # [B, H, W]
        k, o = conv.kernel_size[0], weight.shape[0]
        b = None if bias is None else bias.detach()
        out, arg = mod.conv_pool_relu_forward(xp, weight.detach().view(o, -1), b, k)
        ctx.save_for_backward(xp, out, arg)
        ctx.weight, ctx.bias, ctx.lr, ctx.k = weight, bias, lr, k
        return out.permute(0, 3, 1, 2)  # [B, O, Ho, Wo] in channels-last memory

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, None, None, None, None]:
        (grad,) = grads  # one output
        mod = kernels.load()
        assert mod is not None
        xp, out, arg = ctx.saved_tensors
        w, bias = ctx.weight, ctx.bias
        g = grad.permute(0, 2, 3, 1).contiguous()  # [B, Ho, Wo, O]
        b = None if bias is None else bias.detach()
        mod.conv_pool_relu_backward_sgd(
            g, out, arg, xp, w.detach().view(w.shape[0], -1), b, ctx.k, ctx.lr
        )
        # written through raw pointers: bump the versions as an in-place op would
        torch.autograd.graph.increment_version(w)
        if bias is not None:
            torch.autograd.graph.increment_version(bias)
        ctx.weight = ctx.bias = None
        return None, None, None, None, None
