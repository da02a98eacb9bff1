"""Server optimizers (FedAvgM, FedAdagrad, FedAdam, FedYogi): hand-computed server steps."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.experiments import tiny_raw

from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedopt import FedAdagrad, FedAdam, FedAvgM, FedOptState, FedYogi
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.algorithm import Weighted
from fedmosaic.experiment import run_experiment


def _state(tau: float) -> FedOptState:
    model = {
        "w": torch.tensor([1.0, 2.0]),
        "bn.running_mean": torch.tensor([0.0, 0.0]),
        "bn.num_batches_tracked": torch.tensor(3),
    }
    return FedOptState(model, {"w": torch.zeros(2)}, {"w": torch.full((2,), tau * tau)}, ("w",))


def _uploads() -> list[Weighted[SharedState]]:
    a = {"w": torch.tensor([2.0, 2.0]), "bn.running_mean": torch.tensor([1.0, 1.0])}
    b = {"w": torch.tensor([4.0, 6.0]), "bn.running_mean": torch.tensor([3.0, 3.0])}
    a["bn.num_batches_tracked"], b["bn.num_batches_tracked"] = torch.tensor(5), torch.tensor(7)
    return [Weighted(0, 1.0, SharedState(a)), Weighted(1, 3.0, SharedState(b))]


# mean of the uploads (weights 1, 3): w = [3.5, 5.0], running mean 2.5; Delta = [2.5, 3.0]
DELTA = (2.5, 3.0)


@pytest.mark.parametrize(
    ("algo", "v_of"),
    [
        (FedAdagrad(), lambda d, t: t * t + d * d),
        (FedAdam(), lambda d, t: 0.99 * t * t + 0.01 * d * d),
        (FedYogi(), lambda d, t: t * t + 0.01 * d * d),  # sign(tau^2 - d^2) = -1
    ],
    ids=["adagrad", "adam", "yogi"],
)
def test_adaptive_server_step_hand_computed(algo, v_of):
    new = algo.aggregate(_state(algo.tau), _uploads(), 1)
    for i, (x0, d) in enumerate(zip((1.0, 2.0), DELTA, strict=True)):
        m = 0.1 * d
        v = v_of(d, algo.tau)
        assert float(new.m["w"][i]) == pytest.approx(m, rel=1e-6)
        assert float(new.v["w"][i]) == pytest.approx(v, rel=1e-6)
        want = x0 + 0.1 * m / (math.sqrt(v) + algo.tau)
        assert float(new.model["w"][i]) == pytest.approx(want, rel=1e-6)
    # buffers: FedAvg's mean, integer buffers the maximum; never the optimizer's step
    assert new.model["bn.running_mean"].tolist() == [2.5, 2.5]
    assert int(new.model["bn.num_batches_tracked"]) == 7


def test_server_momentum_accumulates_across_rounds():
    algo = FedAvgM(server_lr=0.5, beta1=0.9)
    s1 = algo.aggregate(_state(0.0), _uploads(), 1)
    # round 1: m = Delta; x = x0 + 0.5 Delta
    assert s1.m["w"].tolist() == [2.5, 3.0]
    assert s1.model["w"].tolist() == [1.0 + 1.25, 2.0 + 1.5]
    s2 = algo.aggregate(s1, _uploads(), 2)
    # round 2: Delta' = mean - x1 = [3.5 - 2.25, 5 - 3.5]; m = 0.9 m + Delta'
    m2 = [0.9 * 2.5 + 1.25, 0.9 * 3.0 + 1.5]
    assert s2.m["w"].tolist() == pytest.approx(m2)
    assert s2.model["w"].tolist() == pytest.approx([2.25 + 0.5 * m2[0], 3.5 + 0.5 * m2[1]])


@pytest.mark.golden
def test_fedavgm_without_momentum_at_server_lr_1_is_fedavg():
    base = dict(train={"rounds": 3}, data={"num_clients": 4})
    avg = run_experiment(from_dict(tiny_raw(algorithm={"name": "fedavg"}, **base)), progress=False)
    algo = {"name": "fedavgm", "beta1": 0.0, "server_lr": 1.0}
    m = run_experiment(from_dict(tiny_raw(algorithm=algo, **base)), progress=False)
    for a, b in zip(avg["rounds"], m["rounds"], strict=True):
        assert a["acc_weighted"] == b["acc_weighted"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "fedadam", "server_lr": 0.0},
        {"name": "fedadam", "beta2": 1.0},
        {"name": "fedyogi", "tau": 0.0},
        {"name": "fedavgm", "beta1": 1.5},
    ],
)
def test_bad_server_optimizer_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        from_dict(tiny_raw(algorithm=bad))
