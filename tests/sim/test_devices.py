"""``sim.devices``: one worker process per device; tested with ``cpu`` devices."""

from __future__ import annotations

import pytest
from helpers.experiments import round_numbers, tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.experiment import run_experiment
from fedmosaic.sim.processes import worker_devices


def test_worker_devices_round_robin():
    assert worker_devices([], 3) == [None, None, None]
    assert worker_devices(["cuda:0", "cuda:1"], 2) == ["cuda:0", "cuda:1"]
    assert worker_devices(["cuda:0", "cuda:1"], 3) == ["cuda:0", "cuda:1", "cuda:0"]


def _rounds(sim, family="htfe8-gray", **train):
    raw = tiny_raw(
        data={"synthetic_shape": [1, 16, 16], "num_clients": 6},
        model={"family": family, "feature_dim": 16},
        algorithm={"name": "fedtgp"},
        sim=sim,
        train=train,
    )
    doc = run_experiment(from_dict(raw), progress=False)
    return round_numbers(doc), doc


def test_cpu_devices_equal_the_serial_backend():
    """Three ``cpu`` devices: three workers (sim.workers unset), bitwise the serial numbers."""
    on_devices, doc = _rounds({"backend": "processes", "devices": ["cpu", "cpu", "cpu"]})
    serial, _ = _rounds({"backend": "serial", "threads": 1})
    assert on_devices == serial
    assert doc["provenance"]["workers"] == 3  # one per device, not one per core
    assert serial[-1]["acc_weighted"] > 0


@pytest.mark.parametrize("participation", [1.0, 0.5])
def test_cpu_devices_with_batched_clients(participation):
    """Workers group their clients of one layout (``ClientHost.fit_many``): the numbers of one
    client at a time to float tolerance; with partial participation clients also move through
    the state store (offload) between rounds."""
    train = {"fused_sgd": False, "participation": participation, "rounds": 3}
    grouped, _ = _rounds(
        {"backend": "processes", "devices": ["cpu", "cpu"]},
        "cnn1",  # clients of one layout on each worker
        batched_clients=True,
        **train,
    )
    plain, _ = _rounds({"backend": "serial", "threads": 1}, "cnn1", **train)
    for a, b in zip(plain, grouped, strict=True):
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-5), k
            else:
                assert b[k] == v, k
