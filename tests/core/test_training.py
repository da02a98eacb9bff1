"""Per-epoch coverage (``train.drop_last``) and participation rounding."""

from __future__ import annotations

import pytest
import torch
from helpers.experiments import tiny_raw
from torch import nn

from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import training
from fedmosaic.core.algorithm import Acceleration
from fedmosaic.core.rounds import clients_per_round
from fedmosaic.core.training import AccelSettings, TrainSettings, batch_order
from fedmosaic.experiment import build_federation


def _sizes(batches: list[torch.Tensor]) -> list[int]:
    return [int(b.numel()) for b in batches]


def test_every_example_is_used_by_default():
    batches = batch_order(22, 8, torch.Generator().manual_seed(0))
    assert _sizes(batches) == [8, 8, 6]
    assert sorted(torch.cat(batches).tolist()) == list(range(22))


def test_drop_last_drops_the_ragged_tail_like_pfllib():
    batches = batch_order(22, 8, torch.Generator().manual_seed(0), drop_last=True)
    assert _sizes(batches) == [8, 8]


def test_both_modes_share_the_shuffle():
    keep = batch_order(22, 8, torch.Generator().manual_seed(3))
    drop = batch_order(22, 8, torch.Generator().manual_seed(3), drop_last=True)
    assert all(torch.equal(a, b) for a, b in zip(drop, keep[:2]))


def test_a_single_example_tail_is_dropped_and_small_clients_train_once():
    assert _sizes(batch_order(17, 8, torch.Generator().manual_seed(0))) == [8, 8]
    assert _sizes(batch_order(5, 8, torch.Generator().manual_seed(0), drop_last=True)) == [5]
    assert batch_order(1, 8, torch.Generator().manual_seed(0)) == []


def test_without_shuffle_every_epoch_takes_the_rows_in_order_and_draws_nothing():
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    batches = batch_order(22, 8, gen, drop_last=True, shuffle=False)
    assert [b.tolist() for b in batches] == [list(range(8)), list(range(8, 16))]
    assert torch.equal(gen.get_state(), before)  # the same tail (16..21) is left out every epoch
    assert batch_order(22, 8, gen, shuffle=False)[-1].tolist() == list(range(16, 22))
    assert torch.equal(gen.get_state(), before)


def test_shuffle_reaches_the_training_settings_and_is_checked():
    cfg = from_dict(tiny_raw(train={"shuffle": False}))
    assert TrainSettings.from_config(cfg.train).shuffle is False
    assert TrainSettings.from_config(from_dict(tiny_raw()).train).shuffle is True
    with pytest.raises(ConfigError, match="train.shuffle"):
        from_dict(tiny_raw(train={"shuffle": "no"}))


def test_drop_last_reaches_the_training_settings():
    cfg = from_dict(tiny_raw(train={"drop_last": True}))
    assert TrainSettings.from_config(cfg.train).drop_last is True
    assert TrainSettings.from_config(from_dict(tiny_raw()).train).drop_last is False


@pytest.mark.parametrize(
    ("n", "p", "k"),
    [(10, 0.35, 3), (10, 0.25, 2), (100, 0.1, 10), (100, 0.29, 29), (20, 0.01, 1), (7, 1.0, 7)],
)
def test_participation_is_floored_as_pfllib(n: int, p: float, k: int):
    assert clients_per_round(n, p) == k


def test_the_experiment_uses_the_participation_rule():
    cfg = from_dict(
        tiny_raw(data={"num_clients": 10, "min_size": 5}, train={"participation": 0.35})
    )
    assert build_federation(cfg, with_clients=False).plan.clients_per_round == 3


def test_fused_sgd_can_be_turned_off_for_losses_that_differentiate_twice():
    """A gradient penalty (torch.autograd.grad with create_graph=True) needs real ``.grad``s."""
    import torch.nn.functional as F
    from torch import nn

    from fedmosaic.algorithms._shared import SharedState
    from fedmosaic.algorithms.fedavg import FedAvg
    from fedmosaic.config import from_dict
    from fedmosaic.core import client as client_ops
    from fedmosaic.core.client import ClientData
    from fedmosaic.core.model import ClientModel
    from fedmosaic.core.training import TrainSettings

    assert training.accelerator() is not None  # fedmosaic.experiment installed accel

    class GradientPenalty(FedAvg):
        def loss(self, model, extras, x, y, msg):
            x = x.requires_grad_(True)
            ce = F.cross_entropy(model(x), y)
            (gx,) = torch.autograd.grad(ce, x, create_graph=True)
            return ce + 0.1 * gx.pow(2).sum()

    class Source:
        def batch(self, idx, device="cpu"):
            return torch.randn(len(idx), 1, 1, 4, generator=torch.Generator().manual_seed(0))

    data = ClientData(0, Source(), torch.tensor([0, 1, 2, 0]), {"train": torch.arange(4)}, 3)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), nn.Linear(3, 3), 3, 3)
    msg = SharedState({k: v.clone() for k, v in model.state_dict().items()})
    before = model.head.weight.detach().clone()
    settings = TrainSettings(batch_size=4, lr=0.1, accel=AccelSettings(fused_sgd=False))
    client_ops.fit(GradientPenalty(), model, nn.Module(), msg, data, settings, 0, 1, 1)
    assert not torch.equal(model.head.weight, before)  # it trained
    # The config key reaches the settings.
    cfg = from_dict({"train": {"fused_sgd": False}, "data": {"dataset": "synthetic"}})
    assert TrainSettings.from_config(cfg.train).accel.fused_sgd is False
    # "auto" (the default): this user class is not fused, with no flag, and trains; a built-in is.
    auto = from_dict({"data": {"dataset": "synthetic"}}).train
    assert auto.fused_sgd == "auto"
    settings = TrainSettings.from_config(auto, GradientPenalty())
    assert settings.accel.fused_sgd is False
    assert TrainSettings.from_config(auto, FedAvg()).accel.fused_sgd
    before = model.head.weight.detach().clone()
    client_ops.fit(GradientPenalty(), model, nn.Module(), msg, data, settings, 0, 1, 1)
    assert not torch.equal(model.head.weight, before)

    class Declared(GradientPenalty):
        acceleration = Acceleration(fused_sgd=True)  # the class vouches for its loss: fused

    assert TrainSettings.from_config(auto, Declared()).accel.fused_sgd
    # Forced on, the penalty cannot differentiate through the fused layers.
    forced = TrainSettings(batch_size=4, lr=0.1, accel=AccelSettings(fused_sgd=True))
    with pytest.raises(RuntimeError):
        client_ops.fit(GradientPenalty(), model, nn.Module(), msg, data, forced, 0, 1, 1)
    with pytest.raises(ConfigError, match="train.fused_sgd"):
        from_dict({"train": {"fused_sgd": "yes"}, "data": {"dataset": "synthetic"}})


def test_fast_inference_routes_linear_layers_and_restores_them(monkeypatch):
    from fedmosaic import kernels
    from fedmosaic.accel import engaged, inference

    model = nn.Sequential(nn.Linear(300, 40), nn.ReLU(), nn.Linear(40, 7))
    other = nn.Linear(300, 5)
    other.forward = lambda x: x  # already patched (as training's fused layers are): left alone
    calls: list[int] = []
    real = inference._onednn_linear
    monkeypatch.setattr(inference, "_onednn_linear", lambda *a: calls.append(1) or real(*a))
    skinny: list[int] = []
    real_k = kernels.linear_forward
    monkeypatch.setattr(kernels, "linear_forward", lambda *a: skinny.append(1) or real_k(*a))
    x_big, x_small = torch.randn(100, 300), torch.randn(10, 300)
    engaged.clear()
    with torch.no_grad():
        want_big, want_small = model(x_big), model(x_small)
        with inference.fast_inference(model, other):
            got_big, got_small = model(x_big), model(x_small)
            assert other(x_small) is x_small
        with inference.fast_inference(model), torch.enable_grad():
            assert model(x_big).requires_grad  # autograd on: plain layers
    torch.testing.assert_close(got_big, want_big, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_small, want_small, rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if inference._ONEDNN else 0)  # batch 100: oneDNN
    assert len(skinny) == (2 if kernels.load() is not None else 0)  # batch 10: the kernel
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored
    assert engaged["inference_linear"] == 4  # two layers, two batches; none with autograd on


def test_client_evaluation_and_upload_take_the_installed_fast_inference():
    """core.client asks the seam; with the accelerator removed it evaluates plain."""
    from fedmosaic.accel import ACCEL, engaged
    from fedmosaic.algorithms.fedavg import FedAvg
    from fedmosaic.core import client as client_ops
    from fedmosaic.core.client import ClientData
    from fedmosaic.core.model import ClientModel

    class Source:
        def batch(self, idx, device="cpu"):
            return torch.randn(len(idx), 1, 1, 4, generator=torch.Generator().manual_seed(0))

    data = ClientData(0, Source(), torch.tensor([0, 1, 2, 0]), {"test": torch.arange(4)}, 3)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), nn.Linear(3, 3), 3, 3)
    msg = FedAvg().broadcast(dict(model.state_dict()), 0, 1)
    engaged.clear()
    fast = client_ops.evaluate(FedAvg(), model, nn.Module(), msg, data, ("test",), 4)
    assert engaged["inference_linear"] == 2  # encoder's and head's Linear, one batch
    assert training.use_accelerator(None) is ACCEL
    try:
        plain = client_ops.evaluate(FedAvg(), model, nn.Module(), msg, data, ("test",), 4)
    finally:
        training.use_accelerator(ACCEL)
    assert engaged["inference_linear"] == 2  # nothing more without the accelerator
    assert fast == plain


def test_the_plain_loop_steps_with_torchs_optimizer_and_the_fused_path_with_its_own(monkeypatch):
    """Without the accelerator every step is ``optimizer.step()``, ``.grad`` as torch leaves it;
    with it, the fused path's own update, the same bits."""
    from fedmosaic.accel import ACCEL, fused

    calls = {"opt": 0, "fused": 0}
    sgd_step, fused_update = torch.optim.SGD.step, fused.FusedSteps.update

    def counted_step(self, *a, **k):
        calls["opt"] += 1
        return sgd_step(self, *a, **k)

    def counted_update(self, params):
        calls["fused"] += 1
        return fused_update(self, params)

    monkeypatch.setattr(torch.optim.SGD, "step", counted_step)
    monkeypatch.setattr(fused.FusedSteps, "update", counted_update)

    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
        params = list(model.parameters())
        s = TrainSettings(batch_size=5, lr=0.1)
        training.train_epochs(
            params,
            lambda a, b: nn.functional.cross_entropy(model(a), b),
            lambda pos: (x[pos], y[pos]),
            20,
            1,
            s,
            torch.Generator().manual_seed(1),
            modules=[model],
        )
        return [p.detach().clone() for p in params]

    fast = train()
    assert calls == {"opt": 0, "fused": 4}
    assert training.use_accelerator(None) is ACCEL
    try:
        plain = train()
    finally:
        training.use_accelerator(ACCEL)
    assert calls == {"opt": 4, "fused": 4}
    for a, b in zip(fast, plain, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
