"""Fast evaluation: Linear layers through the fastest CPU path while autograd is off.

oneDNN's dense linear op is probed once at import (``_ONEDNN``): present in this torch build and
equal to ``F.linear`` on a small case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic import kernels
from fedmosaic.accel._engaged import engaged
from fedmosaic.accel.fused import sgd_linear_forward


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_inference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` without autograd: the native kernel for skinny batches, oneDNN's matmul
    for larger ones (measured here at batch 100: 2.1x MKL's sgemm with AVX-512, 1.15x with
    oneDNN held to AVX2), else ``F.linear``. Same function; sums in another order. Portable
    numerics turn oneDNN off (``torch.backends.mkldnn``: it sizes its blocking from the host's
    caches), and this path with it."""
    if (
        _ONEDNN
        and torch.backends.mkldnn.enabled
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


class _LinearForward(Protocol):
    """``nn.Linear.forward``'s signature, for a replacement set on a layer."""

    def __call__(self, input: Tensor) -> Tensor: ...


@contextlib.contextmanager
def fast_inference(*modules: nn.Module) -> Iterator[None]:
    """While active, the ``nn.Linear`` layers of ``modules`` compute through
    :func:`linear_inference` when autograd is off (evaluation, prototype passes); with autograd
    on, or for a layer already patched (training's fused layers), nothing changes."""
    layers = [
        m
        for mod in modules
        for m in mod.modules()
        if type(m) is nn.Linear and "forward" not in m.__dict__
    ]

    def patched(layer: nn.Linear) -> _LinearForward:
        def forward(input: Tensor) -> Tensor:  # nn.Linear.forward's name: linear(input=x) works
            if torch.is_grad_enabled():
                return F.linear(input, layer.weight, layer.bias)
            engaged["inference_linear"] += 1
            return linear_inference(input, layer.weight, layer.bias)

        return forward

    for layer in layers:
        # an instance attribute over the method while active (mypy flags any method assigned to)
        layer.forward = patched(layer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            if "forward" in layer.__dict__:
                del layer.forward
