"""Model cost counts, in two named measures (forward hooks on one image):

- **FLOPs** (``*_flops``, ``flops_per_image``): every floating-point operation of the counted
  layers, a multiply-add being 2. The process backend's cost model (``member_flops``) and
  ``fedmosaic info`` use them.
- **MACs** (``training_macs``, ``layer_costs``): multiply-accumulates of the Conv/Linear layers
  only, a multiply-add being 1 (what fvcore/thop call a "FLOP"). The layer-wise methods report
  them as ``train_macs``.

For one Conv2d/Linear call without bias, FLOPs = 2 x MACs exactly; the FLOP count adds one per
output element for a bias, and counts normalization, activations and pooling, which MACs leave out.
A third measure, :func:`paper_cost`, is neither: the layer-expansion paper's Table 4 "FLOPs"
(trainable parameters x training examples).

FLOPs per layer (``layer_flops``):

- Conv2d: ``2 * out_elements * in_channels / groups * kh * kw`` (+ ``out_elements`` with bias)
- Linear: ``2 * in_features * out_features`` per row (+ ``out_features`` with bias)
- BatchNorm: 2 per element (scale + shift); ReLU / ReLU6: 1 per element
- MaxPool2d: ``kh * kw`` per output element; average pools (adaptive, global): 1 per input element

Ignored (all small next to the convs): residual additions, concatenation, channel shuffle,
flatten / reshape / memory-layout changes, Identity.

MACs for training, both per client and per round:

- :func:`training_macs` (what clients report as ``train_macs``): forward + backward
  multiply-accumulates of the Conv/Linear layers, counted from the autograd graph the trainable set
  actually produces (fvcore/thop call one MAC a "FLOP"; we name it MACs). Per image:
  ``forward = sum_l m_l`` over every Conv/Linear layer ``l`` (``m_l`` = its MACs), and
  ``backward = sum_l m_l * ([weight of l trains] + [input of l requires grad])``: the weight
  gradient of each trained layer, plus the activation gradient of every layer whose input depends
  on a trained parameter (the frozen head and frozen blocks above the lowest trained block).
  Autograd never computes the input gradient of the lowest trained layer, so this is exact where
  the common "backward = 2 x forward of trained layers" approximation overcounts by that layer's
  input gradient. Bias, activation, pooling, normalization and loss costs are not counted.
  Times the number of training examples processed (epochs x examples).
- :func:`paper_cost` (what clients report as ``paper_cost``): the layer-expansion paper's Table 4
  accounting, which the paper calls "FLOPs" (Jang & Choi, 2024, Sec. 5.2): number of trainable
  parameters x training examples processed (its FedAvg row is 582,026 parameters x 500 examples
  x 10 clients x 300 rounds = 873.039 billion). It ranks Vanilla (314.9 G) far below Anti
  (838.9 G); the MAC count does not (Anti's early rounds backpropagate through frozen blocks
  below the trained ones only as far as needed, Vanilla's forward runs the whole model), so the
  two are reported side by side under their own names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from fedmosaic.core.model import PARTS

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


# MACs: multiply-accumulates of Conv/Linear layers for training (the layer-wise methods)

COUNTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def prefixes_of(trainable: Sequence[str]) -> list[str]:
    """Name prefixes of ``Phase.trainable`` entries, with the semantics of ``select_trainable``."""
    out: list[str] = []
    for entry in trainable:
        if entry == "all":
            out.append("")
        elif entry in PARTS:
            out.append(entry + ".")
        else:
            out.append(entry if entry.endswith(".") else entry + ".")
    return out


def is_trainable(name: str, prefixes: Sequence[str]) -> bool:
    """Whether parameter ``name`` falls under one of ``prefixes`` (from ``prefixes_of``)."""
    return any(name.startswith(p) for p in prefixes)


@dataclass(frozen=True)
class LayerCost:
    """One Conv/Linear call in forward order."""

    name: str  # qualified module name, e.g. "encoder.conv1"
    macs: int  # multiply-accumulates per image in the forward pass
    weight_grad: bool  # its weight trains: backward computes the weight gradient
    input_grad: bool  # its input requires grad: backward computes the activation gradient


def layer_macs(module: nn.Module, output: Tensor) -> int:
    """Forward MACs per image of one Conv/Linear call (bias not counted)."""
    per_image = output.numel() // max(output.shape[0], 1)
    if isinstance(module, nn.Linear):
        return per_image * module.in_features
    conv = cast("nn.Conv1d | nn.Conv2d | nn.Conv3d", module)  # the other COUNTED layers
    kernel = 1
    for k in conv.kernel_size:
        kernel *= int(k)
    return per_image * (conv.in_channels // conv.groups) * kernel


def layer_costs(
    model: nn.Module, input_shape: Sequence[int], trainable: Sequence[str]
) -> list[LayerCost]:
    """Per-layer MACs and backward work for a one-image forward pass with ``trainable`` training.

    The model's ``requires_grad`` flags and train/eval mode are restored afterwards.
    """
    prefixes = prefixes_of(trainable)
    names = {m: n for n, m in model.named_modules()}
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    records: list[LayerCost] = []

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        records.append(
            LayerCost(
                names[module],
                layer_macs(module, output),
                bool(module.weight.requires_grad),
                bool(inputs[0].requires_grad),
            )
        )

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, COUNTED)]
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(is_trainable(n, prefixes))
        model.eval()  # no BatchNorm statistics updates, no dropout
        device = next(model.parameters()).device
        with torch.enable_grad():
            model(torch.zeros(1, *input_shape, device=device))
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
        model.train(was_training)
    return records


def training_macs(
    model: nn.Module,
    input_shape: Sequence[int],
    trainable_prefixes: Sequence[str],
    num_examples: int,
) -> int:
    """Forward + backward multiply-accumulates of training ``num_examples`` examples.

    ``trainable_prefixes`` are ``Phase.trainable`` entries (``all``, ``encoder``, ``head`` or
    qualified prefixes like ``encoder.conv1``). No trainable parameter means no training step: 0.
    """
    prefixes = prefixes_of(trainable_prefixes)
    if not any(is_trainable(n, prefixes) for n, _ in model.named_parameters()):
        return 0
    costs = layer_costs(model, input_shape, trainable_prefixes)
    forward = sum(c.macs for c in costs)
    backward = sum(c.macs * (int(c.weight_grad) + int(c.input_grad)) for c in costs)
    return (forward + backward) * int(num_examples)


def paper_cost(model: nn.Module, trainable_prefixes: Sequence[str], num_examples: int) -> int:
    """The paper's Table 4 cost: trainable parameters x training examples processed."""
    prefixes = prefixes_of(trainable_prefixes)
    params = sum(p.numel() for n, p in model.named_parameters() if is_trainable(n, prefixes))
    return params * int(num_examples)
