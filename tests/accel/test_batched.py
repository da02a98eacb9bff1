"""Batched clients (accel/batched.py) give the numbers of one client at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
from helpers.experiments import round_numbers, tiny_raw

from fedmosaic.accel import batched, engaged
from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Acceleration
from fedmosaic.core.registry import FAMILIES
from fedmosaic.core.training import AccelSettings
from fedmosaic.experiment import build_federation, run_experiment

MIXED = "test-batched-cnn1-cnn2"  # two layouts, so a round forms two groups
if MIXED not in FAMILIES:
    FAMILIES.add(MIXED, ["cnn1", "cnn2"])


def _fed(family="cnn1", algo="fedavg", num_clients=4, **train):
    raw = tiny_raw(
        data={"num_clients": num_clients},
        model={"family": family, "feature_dim": 16},
        algorithm={"name": algo},
        train=train,
    )
    return build_federation(from_dict(raw))


def _fit_both(family, algo, num_clients=4, method=None, **train):
    """One local epoch from the same start: one client at a time, then as one group."""
    one, many = _fed(family, algo, num_clients, **train), _fed(family, algo, num_clients, **train)
    if method is not None:
        one.algo = many.algo = method
    state = one.algo.init_server(one.spec)
    msgs = [one.algo.broadcast(state, c, 1) for c in range(num_clients)]
    seq = [
        client_ops.fit(one.algo, m, e, msg, d, one.settings, 0, 1, 1)
        for m, e, msg, d in zip(one.models, one.extras, msgs, one.clients)
    ]
    grp = batched.fit_group(
        many.algo, many.models, many.extras, msgs, many.clients, many.settings, 0, 1, 1
    )
    return one, many, seq, grp


def _max_diff(one, many, exact_ints=True):
    worst = 0.0
    for a_mod, b_mod in zip(one.models + one.extras, many.models + many.extras):
        for (name, a), b in zip(a_mod.state_dict().items(), b_mod.state_dict().values()):
            if a.is_floating_point():
                worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
            elif exact_ints:
                assert torch.equal(a, b), name  # num_batches_tracked, own-class masks
    return worst


CASES = [
    ("cnn1", "fedavg", {}),
    ("cnn1", "fedavg", {"momentum": 0.9, "weight_decay": 1e-3}),
    ("cnn1", "fedavg", {"optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-3}),
    ("fedavgcnn", "lg_fedavg", {"drop_last": True}),
    ("resnet4", "fedavg", {}),  # BatchNorm: running statistics stacked, updated under vmap
    ("cnn1", "fedrep", {}),  # two phases, frozen parts
    ("cnn1", "fedper", {}),
    ("cnn1", "local", {"local_epochs": 2}),
]


@pytest.mark.parametrize(("family", "algo", "train"), CASES, ids=lambda v: str(v))
def test_one_local_epoch_equals_one_at_a_time(family, algo, train, caplog):
    # fused_sgd off: the one-client path's fused Linear update rounds differently (checked below)
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        one, many, seq, grp = _fit_both(family, algo, fused_sgd=False, **train)
    sizes = [c.num_train for c in one.clients]
    assert len(set(sizes)) == len(sizes)  # unequal data: clients finish at different steps
    assert "fell back" not in caplog.text
    assert [r.stats.steps for r in grp] == [r.stats.steps for r in seq]
    assert [r.stats.examples for r in grp] == [r.stats.examples for r in seq]
    for a, b in zip(seq, grp):
        assert b.stats.mean_loss == pytest.approx(a.stats.mean_loss, abs=1e-5)
    tol = 2e-5 if train.get("optimizer") == "adam" else 1e-5  # Adam divides by sqrt(v)
    assert _max_diff(one, many) < tol
    # the models did train (a no-op would also be "equal")
    fresh = _fed(family, algo, fused_sgd=False, **train)
    assert _max_diff(one, fresh, exact_ints=False) > 1e-3


def test_equal_to_the_fused_sgd_path():
    """Default settings: the one-client path fuses plain SGD into the Linear backward."""
    one, many, seq, grp = _fit_both("cnn1", "fedavg")
    assert _max_diff(one, many) < 1e-5


@pytest.mark.parametrize("algo", ["fedtgp", "fedproto"])
def test_prototype_methods_after_a_round(algo):
    """Round 2: the loss pulls features towards the broadcast prototypes (closed over)."""
    one, many = (_fed(algo=algo, fused_sgd=False) for _ in range(2))
    algo_ = one.algo
    state = algo_.init_server(one.spec)
    msgs = [algo_.broadcast(state, c, 1) for c in range(4)]
    ups = [
        client_ops.fit(algo_, m, e, msg, d, one.settings, 0, 1, 1)
        for m, e, msg, d in zip(one.models, one.extras, msgs, one.clients)
    ]
    for m1, m2 in zip(one.models, many.models):
        m2.load_state_dict(m1.state_dict())
    from fedmosaic.core.algorithm import Weighted

    state = algo_.aggregate(state, [Weighted(c, 1.0, u.upload) for c, u in enumerate(ups)], 1)
    msgs = [algo_.broadcast(state, c, 2) for c in range(4)]
    assert bool(msgs[0].known.any())
    seq = [
        client_ops.fit(algo_, m, e, msg, d, one.settings, 0, 2, 1)
        for m, e, msg, d in zip(one.models, one.extras, msgs, one.clients)
    ]
    grp = batched.fit_group(
        algo_, many.models, many.extras, msgs, many.clients, many.settings, 0, 2, 1
    )
    assert _max_diff(one, many) < 1e-5
    for a, b in zip(seq, grp):
        assert b.stats.mean_loss == pytest.approx(a.stats.mean_loss, abs=1e-5)
        for x, y in zip(a.upload.flatten()[0].values(), b.upload.flatten()[0].values()):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_per_client_messages_are_vmapped():
    """Different messages per client (a personalized broadcast) go in as a vmapped input."""
    one, many = (_fed(algo="fedproto", fused_sgd=False) for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    msgs = []
    for c in range(4):
        protos = torch.randn(4, 16, generator=gen)
        known = torch.tensor([True, c % 2 == 0, True, False])
        msgs.append(one.algo.Broadcast(protos=protos, known=known))
    for m, e, msg, d in zip(one.models, one.extras, msgs, one.clients):
        client_ops.fit(one.algo, m, e, msg, d, one.settings, 0, 1, 1)
    batched.fit_group(
        many.algo, many.models, many.extras, msgs, many.clients, many.settings, 0, 1, 1
    )
    assert _max_diff(one, many) < 1e-5


@dataclass(frozen=True)
class _Noisy(ALGORITHMS.get("local")):  # type: ignore[misc]  # not registered: no registry tests
    """Declares batching but draws random numbers in its loss: vmap refuses, and the group is
    redone one client at a time."""

    acceleration: ClassVar[Acceleration] = Acceleration(batched=True)

    def loss(self, model, extras, x, y, msg):
        return super().loss(model, extras, x + 0.01 * torch.randn_like(x), y, msg)


def test_unbatchable_step_falls_back_to_one_at_a_time(caplog):
    engaged.clear()
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        one, many, seq, grp = _fit_both("cnn1", "local", method=_Noisy())
    assert "fell back to one at a time" in caplog.text
    assert engaged["batched_groups"] == engaged["batched_steps"] == 0  # no vmapped step held
    assert _max_diff(one, many) == 0.0  # exactly the one-client path
    assert [r.stats.loss_sum for r in grp] == [r.stats.loss_sum for r in seq]


def test_eligibility_and_groups():
    fed = _fed(MIXED, "lg_fedavg", num_clients=5)
    keys = {c: batched.layout_key(fed.models[c], fed.extras[c]) for c in range(5)}
    groups, singles = batched.groups(list(keys), keys)
    assert groups == [[0, 2, 4], [1, 3]] and singles == []
    assert batched.groups([0, 1, 2], keys) == ([[0, 2]], [1])
    assert batched.eligible(fed.algo, fed.models[0], fed.extras[0])
    fedprox = ALGORITHMS.get("fedprox")()
    assert not batched.eligible(fedprox, fed.models[0], fed.extras[0])  # not declared
    fedavgm = ALGORITHMS.get("fedavgm")()  # inherits FedOpt's declaration and FedAvg's loss
    assert batched.eligible(fedavgm, fed.models[0], fed.extras[0])
    lg = type(fed.algo)

    @dataclass(frozen=True)
    class MyLG(lg):  # a user's variant with its own loss: not batched unless it says so
        def loss(self, model, extras, x, y, msg):
            return super().loss(model, extras, x, y, msg) * 2

    @dataclass(frozen=True)
    class MyLGDeclared(MyLG):
        acceleration: ClassVar[Acceleration] = Acceleration(batched=True)

    assert not batched.eligible(MyLG(), fed.models[0], fed.extras[0])
    assert batched.eligible(MyLGDeclared(), fed.models[0], fed.extras[0])
    drop = torch.nn.Sequential(torch.nn.Dropout(0.5))
    assert not batched.eligible(fed.algo, drop, torch.nn.Module())


@pytest.mark.parametrize(
    ("family", "algo"), [(MIXED, "fedtgp"), (MIXED, "lg_fedavg"), ("cnn1", "fedavg")]
)
def test_two_round_federation_history(family, algo):
    def run(flag):
        raw = tiny_raw(
            data={"num_clients": 6, "synthetic_shape": [1, 16, 16]},
            model={"family": family, "feature_dim": 16},
            algorithm={"name": algo},
            train={"batched_clients": flag, "fused_sgd": False},
            sim={"threads": 1},
        )
        return round_numbers(run_experiment(from_dict(raw), progress=False))

    calls = []
    real = batched.fit_group
    batched_fit = lambda *a, **k: calls.append(len(a[1])) or real(*a, **k)  # noqa: E731
    off = run(False)
    engaged.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batched, "fit_group", batched_fit)
        on = run(True)
    groups = {MIXED: [3, 3, 3, 3], "cnn1": [6, 6]}[family]  # group sizes, two rounds
    assert calls == groups
    assert engaged["batched_groups"] == len(groups)  # each trained vmapped, none fell back
    assert len(on) == len(off) == 2
    for a, b in zip(off, on):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-5), k
            else:
                assert b[k] == v, k
    assert off[-1]["acc_weighted"] > 0.3  # it learned something (4 classes)


BATCHABLE = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).acceleration.batched]


def test_the_declared_methods():
    expected = {"fedavg", "local", "lg_fedavg", "fedper", "fedrep", "fedtgp", "fedproto"}
    assert expected <= set(BATCHABLE)
    assert "fedprox" not in BATCHABLE and "ktpfl" not in BATCHABLE  # losses with more state


@pytest.mark.parametrize("algo", BATCHABLE)
def test_every_batchable_method_matches_one_at_a_time(algo, monkeypatch):
    """Registry-wide: a method that declares ``Acceleration(batched=True)`` gets this test without writing one.
    Partial participation, a check_wire round trip and a momentum optimizer on top."""
    calls = []
    real = batched.fit_group
    monkeypatch.setattr(batched, "fit_group", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(flag):
        raw = tiny_raw(
            data={"synthetic_shape": [1, 16, 16], "num_clients": 6},
            model={"family": "cnn1", "feature_dim": 16},
            algorithm={"name": algo},
            train={
                "rounds": 2,
                "participation": 0.5,
                "momentum": 0.5,
                "batched_clients": flag,
            },
            sim={"threads": 1},
        )
        return round_numbers(run_experiment(from_dict(raw), progress=False))

    off = run(False)
    assert not calls
    engaged.clear()
    on = run(True)
    assert len(calls) == 2  # one group (three clients) per round
    assert engaged["batched_groups"] == 2 and engaged["batched_steps"] > 0  # vmapped, no fallback
    for a, b in zip(off, on, strict=True):
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-5), k
            else:
                assert b[k] == v, k


def test_settings_switch():
    fed = _fed()
    s = fed.settings
    assert s.accel.batched_clients == "auto" and not s.batched_enabled  # CPU: off by default
    assert replace(s, device="cuda").batched_enabled
    assert replace(s, accel=AccelSettings(batched_clients=True)).batched_enabled
    assert not replace(
        s, device="cuda:1", accel=AccelSettings(batched_clients=False)
    ).batched_enabled


@pytest.mark.parametrize(
    ("train", "sim", "message"),
    [
        ({"batched_clients": "yes"}, {}, "train.batched_clients = 'yes'"),
        ({"precision": "fp16"}, {}, "train.precision = 'fp16'"),
        ({}, {"devices": ["gpu0"]}, "sim.devices[0] = 'gpu0'"),
        ({}, {"devices": ["cpu"], "backend": "serial"}, 'set sim.backend = "processes"'),
    ],
)
def test_bad_settings_name_the_key(train, sim, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_dict(tiny_raw(train=train, sim=sim))


def test_heavy_steps_train_one_at_a_time(monkeypatch):
    """A client step over ``STACK_MAX_FLOP`` is not stacked: the round is one client at a time,
    with its numbers bit for bit."""
    fed = _fed("cnn1", "fedavg")
    batched._FLOPS.clear()
    assert not batched._heavy(fed.algo, fed.models[0], fed.clients[0], fed.settings)
    (flop,) = batched._FLOPS.values()
    # cnn1 on 1x28x28 (tiny_raw): the convolutions' and Linear layers' multiply-adds, x3
    assert 1e5 < flop / 3 < 1e8

    def run(flag):
        raw = tiny_raw(
            data={"num_clients": 4},
            model={"family": "cnn1", "feature_dim": 16},
            train={"batched_clients": flag, "fused_sgd": False},
            sim={"threads": 1},
        )
        return round_numbers(run_experiment(from_dict(raw), progress=False))

    monkeypatch.setattr(batched, "STACK_MAX_FLOP", 0.0)
    engaged.clear()
    assert run(True) == run(False)
    assert engaged["batched_groups"] == 0
