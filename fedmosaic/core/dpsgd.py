"""Sample-level differential privacy of local training: DP-SGD (Abadi et al. 2016).

Each local step draws its batch by Poisson sampling (every training example independently with
probability ``q = batch_size / n``; ``ceil(n / batch_size)`` steps an epoch), computes every
example's gradient of the method's loss on that example alone, clips each to L2 norm
``privacy.sample_clip`` (all trainable tensors as one vector), sums them, adds Gaussian noise of
standard deviation ``sample_noise_multiplier x sample_clip`` per coordinate and divides by the
*expected* batch size (the fixed denominator the accountant assumes); the method's optimizer then
steps on that gradient. Batches and noise come from the client's seeded batch stream (the same
numbers on every runtime).

Per-example gradients are computed with ``torch.func`` (``vmap`` of ``grad`` through
``functional_call``): exact for any loss that is a mean of per-example terms, whatever layers and
terms the method's loss uses, which is what a method declares with
``Algorithm.per_example_loss`` (on the class that defines its ``loss``). BatchNorm mixes the
examples of a batch, so a model trained with DP-SGD has its BatchNorm layers replaced by
GroupNorm when it is built (:func:`replace_batchnorm`, reported once per architecture), as Opacus
requires of the models it trains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from fedmosaic.core import seeding

MAX_GROUPS = 32  # GroupNorm's groups: the largest divisor of the channels up to this


def declares_per_example_loss(algo: object) -> bool:
    """Whether the class that defines ``algo``'s ``loss`` (``algo``: a method or its class) declares it a mean of per-example
    terms (``per_example_loss = True`` in that class's own body: a subclass that overrides the
    loss must declare again)."""
    for cls in (algo if isinstance(algo, type) else type(algo)).__mro__:
        if "loss" in cls.__dict__:
            return bool(cls.__dict__.get("per_example_loss", False))
    return False


def _groups(channels: int) -> int:
    return max(g for g in range(1, min(MAX_GROUPS, channels) + 1) if channels % g == 0)


def replace_batchnorm(module: nn.Module) -> int:
    """Replace every BatchNorm layer of ``module`` by GroupNorm of the same channels (affine as
    it was, weight 1 and bias 0: BatchNorm's own initialization); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            c = child.num_features
            gn = nn.GroupNorm(_groups(c), c, eps=child.eps, affine=child.affine)
            setattr(module, name, gn.to(next(child.buffers(), torch.empty(0)).device))
            count += 1
        else:
            count += replace_batchnorm(child)
    return count


class _Loss(nn.Module):
    """The method's loss as a module, so ``functional_call`` can swap in tensors of its
    modules (they are registered here, and the loss closes over the same objects)."""

    def __init__(self, modules: Sequence[nn.Module], fn: Callable[[Tensor, Tensor], Tensor]):
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.fn = fn

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.fn(x, y)


def private_epochs(
    params: Sequence[nn.Parameter],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    sample: Callable[[Tensor], tuple[Tensor, Tensor]],
    n: int,
    epochs: int,
    batch_size: int,
    clip: float,
    noise_multiplier: float,
    optimizer: torch.optim.Optimizer,
    gen: torch.Generator,
    modules: Sequence[nn.Module],
) -> tuple[int, int, float]:
    """``epochs`` of DP-SGD on ``params`` (module docstring); ``(steps, examples, loss sum)``."""
    holder = _Loss(modules, loss_fn)
    names = {id(p): name for name, p in holder.named_parameters(remove_duplicate=False)}
    keys = [names[id(p)] for p in params]

    def one(train: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return functional_call(holder, train, (xi.unsqueeze(0), yi.unsqueeze(0)), strict=False)

    per_example = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different")
    q = min(1.0, batch_size / n)
    per_epoch = math.ceil(n / batch_size)
    sd = noise_multiplier * clip
    steps = examples = 0
    loss_sum = 0.0
    for _ in range(epochs):
        for _ in range(per_epoch):
            pos = (torch.rand(n, generator=gen) < q).nonzero().flatten()  # Poisson sampling
            train = {k: p.detach() for k, p in zip(keys, params, strict=True)}
            summed: dict[str, Tensor] = {}
            if pos.numel():
                x, y = sample(pos)
                grads, losses = per_example(train, x, y)  # name -> [b, *shape], [b]
                norms = torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads.values()))
                factor = (clip / norms.clamp_min(1e-12)).clamp(max=1.0).float()  # [b]
                summed = {k: torch.einsum("b,b...->...", factor, g) for k, g in grads.items()}
                loss_sum += float(losses.mean())
                examples += int(pos.numel())
            for k, p in zip(keys, params, strict=True):
                noise = seeding.randn(p.numel(), generator=gen).view(p.shape).to(p.device) * sd
                total = summed[k] + noise if k in summed else noise
                p.grad = total / batch_size  # the expected batch size: a fixed denominator
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    return steps, examples, loss_sum
