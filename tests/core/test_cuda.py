"""The CUDA path: batched clients, the device map, bf16 and a FedTGP round on a GPU.

Skipped where CUDA is absent (the CPU versions of these checks live in
``accel/test_batched.py``, ``core/test_precision.py`` and ``sim/test_devices.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers.experiments import round_numbers, tiny_raw

from fedmosaic.accel import batched
from fedmosaic.config import from_dict
from fedmosaic.core import client as client_ops
from fedmosaic.experiment import build_federation, run_experiment

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fed(family, algo, **train):
    raw = tiny_raw(
        model={"family": family, "feature_dim": 16},
        algorithm={"name": algo},
        train={"device": "cuda", **train},
    )
    return build_federation(from_dict(raw))


def _state_diff(a_fed, b_fed):
    worst = 0.0
    for a_mod, b_mod in zip(a_fed.models + a_fed.extras, b_fed.models + b_fed.extras):
        for a, b in zip(a_mod.state_dict().values(), b_mod.state_dict().values()):
            if a.is_floating_point() and a.numel():
                worst = max(worst, float((a - b).abs().max()))
            elif not a.is_floating_point():
                assert torch.equal(a, b)
    return worst


@pytest.mark.parametrize(
    ("family", "algo", "train"),
    [
        ("cnn1", "fedavg", {}),
        ("cnn1", "fedavg", {"momentum": 0.9, "weight_decay": 1e-3}),
        ("resnet4", "fedavg", {}),
        ("cnn1", "fedtgp", {}),
    ],
    ids=str,
)
def test_batched_equals_one_at_a_time_on_cuda(family, algo, train):
    one, many = _fed(family, algo, **train), _fed(family, algo, **train)
    assert next(one.models[0].parameters()).is_cuda
    state = one.algo.init_server(one.spec)
    msgs = [one.algo.broadcast(state, c, 1) for c in range(len(one.clients))]
    seq = [
        client_ops.fit(one.algo, m, e, msg, d, one.settings, 0, 1, 1)
        for m, e, msg, d in zip(one.models, one.extras, msgs, one.clients)
    ]
    grp = batched.fit_group(
        many.algo, many.models, many.extras, msgs, many.clients, many.settings, 0, 1, 1
    )
    # TF32 matmuls/convs (torch's CUDA default for convs) round more coarsely than CPU fp32
    assert _state_diff(one, many) < 1e-3
    for a, b in zip(seq, grp):
        assert b.stats.steps == a.stats.steps
        assert b.stats.mean_loss == pytest.approx(a.stats.mean_loss, abs=1e-3)


def _rounds(sim=None, family="htfe8-gray", algo="fedtgp", **train):
    raw = tiny_raw(
        data={"synthetic_shape": [1, 16, 16], "num_clients": 8},
        model={"family": family, "feature_dim": 16},
        algorithm={"name": algo},
        train={"device": "cuda", **train},
        sim=sim or {},
    )
    doc = run_experiment(from_dict(raw), progress=False)
    return round_numbers(doc)


def test_fedtgp_rounds_on_cuda_learn_and_match_cpu():
    gpu = _rounds()  # batched_clients = "auto": on for CUDA
    cpu = _rounds(device="cpu", sim={"threads": 1})
    assert gpu[-1]["acc_weighted"] > 0.25  # 4 classes (CPU, same config: 0.30)
    for a, b in zip(cpu, gpu):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=2e-2)
        assert b["acc_weighted"] == pytest.approx(a["acc_weighted"], abs=0.05)


def test_device_map_on_cuda():
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mapped = _rounds({"backend": "processes", "devices": devices}, "cnn1", "lg_fedavg")
    serial = _rounds({"backend": "serial"}, "cnn1", "lg_fedavg")
    for a, b in zip(serial, mapped):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-3)
        assert b["acc_weighted"] == pytest.approx(a["acc_weighted"], abs=0.02)


def test_bf16_on_cuda_learns():
    rounds = _rounds(None, "cnn1", "fedavg", precision="bf16", lr=0.1)
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]


# ---- step graphs (accel/graphs.py): captured on the card, replayed ------------------------------
def _graph_rounds(graphs, family="htfe8-gray", algo="fedtgp", rounds=3, **train):
    from fedmosaic.accel import batched as batched_mod

    batched_mod.clear_graphs()
    raw = tiny_raw(
        data={"synthetic_shape": [1, 16, 16], "num_clients": 8},
        model={"family": family, "feature_dim": 16},
        algorithm={"name": algo},
        train={"device": "cuda", "rounds": rounds, "cuda_graphs": graphs, **train},
    )
    return round_numbers(run_experiment(from_dict(raw), progress=False))


@pytest.mark.parametrize(
    ("family", "algo", "train"),
    [
        ("htfe8-gray", "fedtgp", {}),  # the broadcast changes every round
        ("cnn1", "fedavg", {"momentum": 0.9, "weight_decay": 1e-3}),
        ("resnet4", "fedavg", {"local_epochs": 2}),  # BatchNorm running statistics
        ("cnn1", "fedrep", {}),  # two phases
        ("htfe8-gray", "lg_fedavg", {"participation": 0.5}),  # groups change per round
    ],
    ids=str,
)
def test_cuda_graphs_equal_the_eager_batched_path(family, algo, train):
    from fedmosaic.accel import engaged

    eager = _graph_rounds(False, family, algo, **train)
    engaged.clear()
    graphed = _graph_rounds("auto", family, algo, **train)
    assert engaged["graph_captures"] > 0
    if "participation" not in train:  # the same groups every round: later rounds only replay
        assert engaged["graph_replays"] > engaged["graph_captures"]
    for a, b in zip(eager, graphed, strict=True):
        for k, v in a.items():
            if isinstance(v, float):
                # a replay runs the captured kernels: equal up to cuDNN's run-to-run choices
                assert b[k] == pytest.approx(v, abs=2e-3), k
            else:
                assert b[k] == v, k


def test_a_failed_capture_runs_eagerly(caplog):
    """A loss that synchronizes with the host cannot be captured: logged once, eager after."""
    import logging

    from fedmosaic.accel.graphs import StepGraphs

    graphs = StepGraphs("cuda")
    x = torch.ones(4, device="cuda")
    out = []
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        for _ in range(4):
            graphs.run("k", lambda: out.append(float(x.sum())))  # .item(): a host sync
    assert "capture failed" in caplog.text and graphs.failed and len(graphs) == 0
    assert out == [4.0, 4.0, 4.0, 4.0]  # every step ran (the failed capture's counted once)
