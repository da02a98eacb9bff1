"""Training-cost accounting for the layer-wise methods (FedBABU, sequential layer expansion).

Two conventions, both per client and per round:

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedmosaic.core.model import PARTS

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
    return any(name.startswith(p) for p in prefixes)


@dataclass(frozen=True)
class LayerCost:
    """One Conv/Linear call in forward order."""

    name: str  # qualified module name, e.g. "encoder.conv1"
    macs: int  # multiply-accumulates per image in the forward pass
    weight_grad: bool  # its weight trains: backward computes the weight gradient
    input_grad: bool  # its input requires grad: backward computes the activation gradient


def _macs(module: nn.Module, output: Tensor) -> int:
    per_image = output.numel() // max(output.shape[0], 1)
    if isinstance(module, nn.Linear):
        return per_image * module.in_features
    kernel = 1
    for k in module.kernel_size:  # type: ignore[union-attr]
        kernel *= int(k)
    return per_image * (module.in_channels // module.groups) * kernel  # type: ignore[operator]


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
                _macs(module, output),
                bool(module.weight.requires_grad),  # type: ignore[union-attr]
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
