"""``[privacy]`` over Flower: the clients' noise (local) and the server's (central) are drawn from
the run's seeded streams, so the in-memory Grid gives the simulator's numbers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

from _hostile import grid_run  # noqa: E402

from fedmosaic import api  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402

torch.set_num_threads(1)
N = 4


def experiment(name: str, mechanism: str) -> dict[str, Any]:
    return tiny_raw(
        data={"num_clients": N},
        algorithm={"name": name},
        privacy={"mechanism": mechanism, "clip": 1.0, "noise_multiplier": 0.5},
        sim={"threads": 1, "check_wire": False, "progress": False},
    )


@pytest.mark.parametrize(("name", "mechanism"), [("fedproto", "local"), ("lg_fedavg", "central")])
def test_private_runs_give_the_simulators_numbers_over_flower(name, mechanism, tmp_path):
    sim = api.run(from_dict(experiment(name, mechanism))).rounds
    flower = grid_run(experiment(name, mechanism), None, tmp_path / "results", N)["rounds"]
    for s, f in zip(sim, flower, strict=True):
        assert math.isclose(f["acc_weighted"], s["acc_weighted"], abs_tol=1e-9), (f, s)
        assert f["epsilon"] == s["epsilon"]
