"""Plain SGD fused into the Linear layers' backward (accel.fused): the same step as the
optimizer's, and the fused path is the one that ran (``accel.engaged``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedmosaic.accel import ACCEL, engaged
from fedmosaic.core import training
from fedmosaic.core.training import AccelSettings, TrainSettings, train_epochs


def _train(fused: bool, twice: bool = False, frozen: bool = False, momentum: float = 0.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    if frozen:
        model[0].requires_grad_(False)
    x = torch.randn(40, 6)
    y = torch.randint(0, 3, (40,))
    anchor = [p.detach().clone() for p in model.parameters()]

    def loss_fn(xb, yb):
        loss = F.cross_entropy(model(xb), yb)
        loss = loss + 0.1 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
        if twice:  # the last layer used a second time in the same forward
            loss = loss + model[2](torch.relu(model[0](xb))).pow(2).mean()
        return loss

    params = [p for p in model.parameters() if p.requires_grad]
    s = TrainSettings(batch_size=5, lr=0.1, momentum=momentum, accel=AccelSettings(fused_sgd=fused))
    gen = torch.Generator().manual_seed(1)
    engaged.clear()
    stats = train_epochs(params, loss_fn, lambda p: (x[p], y[p]), 40, 2, s, gen, modules=(model,))
    assert "forward" not in model[0].__dict__ and "forward" not in model[2].__dict__
    return stats, [p.detach().clone() for p in model.parameters()]


def _close(a, b, tol=1e-6):
    return all(torch.allclose(u, v, atol=tol, rtol=0) for u, v in zip(a, b))


def test_fused_matches_optimizer_step():
    (s0, p0) = _train(False)
    assert engaged["fused_steps"] == engaged["sgd_linear_backward"] == 0
    (s1, p1) = _train(True)
    assert engaged["fused_steps"] == 16  # every step fused
    assert engaged["sgd_linear_backward"] == 2 * 16  # both Linear layers, every step
    assert s0.steps == s1.steps == 16
    assert _close(p0, p1)  # same SGD step up to rounding (proximal term included)
    assert not all(torch.equal(u, v) for u, v in zip(p0, p1))  # another rounding: it ran


def test_fused_claimed_but_switched_off_engages_nothing():
    """Without the accelerator core trains plain, whatever ``fused_sgd`` says: the counts above
    are what tells a fused run from an unfused one."""
    assert training.use_accelerator(None) is ACCEL
    try:
        (_, p_off) = _train(True)
        assert engaged["fused_steps"] == engaged["sgd_linear_backward"] == 0
    finally:
        training.use_accelerator(ACCEL)
    (_, p_plain) = _train(False)
    assert all(torch.equal(u, v) for u, v in zip(p_off, p_plain))  # bitwise the plain loop


def test_layer_used_twice_falls_back_to_the_plain_step():
    (_, p0), (_, p1) = _train(False, twice=True), _train(True, twice=True)
    assert engaged["fused_steps"] == 0  # the conflict showed on step 1: nothing stayed fused
    assert all(torch.equal(u, v) for u, v in zip(p0, p1))  # redone unfused from step 1


def test_frozen_layers_and_momentum_untouched():
    (_, p0), (_, p1) = _train(False, frozen=True), _train(True, frozen=True)
    assert _close(p0, p1)
    assert engaged["fused_steps"] == 16  # the trainable layer fused, the frozen one untouched
    assert engaged["sgd_linear_backward"] == 16
    (_, m0), (_, m1) = _train(False, momentum=0.9), _train(True, momentum=0.9)
    assert engaged["fused_steps"] == 0  # momentum: never fused
    assert all(torch.equal(u, v) for u, v in zip(m0, m1))
