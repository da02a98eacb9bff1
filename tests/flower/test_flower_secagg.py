"""Secure aggregation over Flower: Flower's own SecAgg+ workflow and ClientApp mod carry the
methods' summands, and give the simulator's numbers (its emulation of the same arithmetic)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

from _hostile import grid_run  # noqa: E402

from fedmosaic import api  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.core import secure  # noqa: E402

torch.set_num_threads(1)
N = 4


def experiment(name: str, **privacy: Any) -> dict[str, Any]:
    return tiny_raw(
        data={"num_clients": N},
        algorithm={"name": name},
        privacy={"secure_aggregation": True, **privacy},
        sim={"threads": 1, "check_wire": False, "progress": False},
    )


def test_the_emulated_rounding_is_flowers():
    from flwr.common.secure_aggregation.quantization import quantize

    sf = secure.SecureForm(scale=1.0, bound=8.0, levels=2**27, seed=0)
    arrays = [np.linspace(-9, 9, 101), np.array([0.123456789, -3.3])]
    np.random.seed(1234)
    flower = quantize(arrays, sf.bound, sf.levels)
    ours = secure.quantize(arrays, sf, 1234)
    assert all(np.array_equal(a, b) for a, b in zip(flower, ours, strict=True))


@pytest.mark.parametrize(
    ("name", "privacy"),
    [
        ("fedproto", {}),
        ("lg_fedavg", {}),
        # the released head itself is summed: a little noise keeps it inside the range
        ("lg_fedavg", {"mechanism": "local", "clip": 1.0, "noise_multiplier": 0.01}),
    ],
)
def test_secagg_plus_gives_the_simulators_numbers(name, privacy, tmp_path):
    sim = api.run(from_dict(experiment(name, **privacy))).rounds
    out = grid_run(experiment(name, **privacy), None, tmp_path / "results", N)
    flower = out["rounds"]
    for s, f in zip(sim, flower, strict=True):
        assert f["participants"] == s["participants"] == list(range(N))
        assert f["acc_weighted"] == s["acc_weighted"]
        assert f["train_loss"] == s["train_loss"]
        assert f["bytes_up"] == s["bytes_up"]


def test_a_client_outside_the_range_is_left_out_over_flower_as_on_the_simulator(tmp_path):
    out = grid_run(experiment("fedavg", secagg_range=1e-3), None, tmp_path / "results", N)
    assert all(not r["aggregated"] for r in out["rounds"])
    assert "secagg_range" in out["log"]


def test_a_client_that_fails_mid_protocol_is_left_out_and_the_others_are_summed(tmp_path, caplog):
    """A ClientApp that raises in the masking stage (after the key exchange): the workflow
    recovers its masks from the others' shares, and the round sums the other three."""
    import json
    import math

    from fedmosaic.flower.app import TEST_FAULT, client_app, run_server
    from fedmosaic.flower.local import LocalGrid

    raw = experiment("lg_fedavg")
    rc = {"experiment": json.dumps(raw), "results-dir": str(tmp_path / "results")}
    nodes = [{"partition-id": i, "num-partitions": N} for i in range(N)]
    nodes[2][TEST_FAULT] = "raise"
    rounds = run_server(LocalGrid(client_app, nodes, rc), rc)["rounds"]
    for r in rounds:
        assert r["participants"] == [0, 1, 3] and r["rejected"] == [2], r
        assert r["aggregated"] and math.isfinite(r["acc_weighted"])
    assert f"{TEST_FAULT}=raise" in caplog.text
