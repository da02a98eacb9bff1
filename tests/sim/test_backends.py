"""Serial and worker-process backends give bitwise-identical results, for any worker count."""

from __future__ import annotations

import pytest
from helpers.experiments import numbers, tiny_raw

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.config import from_dict
from fedmosaic.experiment import run_experiment


def run(algo, backend, workers=0, family="htfe8-gray", **train):
    sim = {"backend": backend, "workers": workers}
    if backend == "serial":
        sim["threads"] = 1  # intra-op reductions depend on the thread count; workers use one
    # 16x16 images keep every model small (the registry-wide case runs 21 methods twice).
    raw = tiny_raw(
        data={"synthetic_shape": [1, 16, 16]},
        model={"family": family},
        algorithm={"name": algo},
        sim=sim,
        train=train,
    )
    return numbers(run_experiment(from_dict(raw), progress=False))


@pytest.mark.parametrize(
    ("algo", "train"),
    [
        ("fedtgp", {}),
        ("lg_fedavg", {}),
        # partial participation: clients move between workers and through the state store
        ("fedtgp", {"participation": 0.5, "rounds": 3}),
    ],
    ids=["fedtgp", "lg_fedavg", "fedtgp-partial"],
)
def test_serial_and_processes_identical(algo, train):
    two = run(algo, "processes", 2, **train)  # first: starts both pooled workers at once
    one = run(algo, "processes", 1, **train)
    serial = run(algo, "serial", **train)
    assert two == serial
    assert one == serial
    assert serial[0][-1]["acc_weighted"] > 0


@pytest.mark.parametrize("algo", ALGORITHMS.names())
def test_every_method_is_identical_on_both_backends_with_partial_participation(algo):
    """Half the clients per round: clients with local state move between workers and rounds."""
    family = "htfe8-gray" if ALGORITHMS.get(algo).supports_heterogeneous else "cnn1"
    raw_args = {"participation": 0.5, "rounds": 3}
    procs = run(algo, "processes", 2, family=family, **raw_args)
    serial = run(algo, "serial", family=family, **raw_args)
    assert procs == serial
