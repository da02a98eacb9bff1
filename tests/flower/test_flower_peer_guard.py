"""The peer guard over Flower: issue 23's single attacker through the real ServerApp/ClientApp.

The in-memory Grid (:class:`LocalGrid`) with the default ``[server]``; the SuperNode serving
partition 0 trains honestly, then rewrites its train reply before it goes on the wire: FedAvg's
update x 50 (``reply = sent + 50 (reply - sent)``), or FedProto's prototypes 1e30 in round 1 only
(when the server has no global row to bound them against; before the guard, the poisoned global
made the honest clients' next replies non-finite, and the server dropped them and kept the
attacker). The synthetic federation of tests/test_peer_guard.py: 10 IID clients, cnn1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

from _hostile import ATTACKER, grid_run  # noqa: E402
from flwr.app import Array  # noqa: E402

N = 10
ROUNDS = 5
TOLERANCE = 0.02


def rewrite(attack: str):
    """``scale50``: the update x 50; ``huge_round1``: 1e30 in round 1 only."""

    def arrays(name: str, arr: Array, sent: Array, round_num: int) -> Array | None:
        x = arr.numpy()
        if attack == "scale50":
            s = sent.numpy()
            return Array((s + 50 * (x - s)).astype(x.dtype))
        if attack == "huge_round1" and round_num == 1:
            return Array(x * 0 + 1e30)
        if attack == "neg5" and x.dtype.kind == "f":  # every round, -5 x its prototypes
            return Array((x * -5).astype(x.dtype))
        return None

    return None if attack == "none" else arrays


_RUNS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """``outcome(name, attack, **server)``: rounds, final accuracy and warnings, once each."""

    def run(name: str, attack: str, model: dict | None = None, **server: Any) -> dict[str, Any]:
        key = json.dumps([name, attack, model, server], sort_keys=True)
        if key not in _RUNS:
            experiment = tiny_raw(
                data={
                    "num_clients": N,
                    "partition": "iid",
                    "synthetic_size": 1000,
                    "synthetic_classes": 10,
                    "synthetic_shape": [1, 16, 16],
                },
                algorithm={"name": name},
                sim={"threads": 1, "check_wire": False, "progress": False},
                train={"rounds": ROUNDS},
                server=server,
            )
            experiment["model"].update(model or {})
            results = tmp_path_factory.mktemp("guard") / "results"
            out = grid_run(experiment, rewrite(attack), results, N)
            rounds = out["rounds"]
            _RUNS[key] = {
                "acc": rounds[-1]["acc_weighted"],
                "rejected": [r["rejected"] for r in rounds],
                "aggregated": [r["aggregated"] for r in rounds],
                "log": out["log"],
            }
        return _RUNS[key]

    return run


def test_fedavg_update_x50_is_dropped_over_flower(outcome):
    honest = outcome("fedavg", "none")
    assert honest["rejected"] == [[]] * ROUNDS
    out = outcome("fedavg", "scale50")
    assert out["rejected"] == [[ATTACKER]] * ROUNDS
    assert f"dropped the reply of client {ATTACKER}: update norm" in out["log"]
    assert "(server.peer_factor)" in out["log"]
    assert abs(out["acc"] - honest["acc"]) <= TOLERANCE, (out["acc"], honest["acc"])


def test_fedproto_round_one_1e30_is_dropped_and_no_honest_client_is(outcome):
    honest = outcome("fedproto", "none")
    assert honest["rejected"] == [[]] * ROUNDS
    out = outcome("fedproto", "huge_round1")
    assert out["rejected"] == [[ATTACKER]] + [[]] * (ROUNDS - 1)
    assert all(out["aggregated"])
    assert f"round 1: dropped the reply of client {ATTACKER}: its class" in out["log"]
    assert abs(out["acc"] - honest["acc"]) <= TOLERANCE, (out["acc"], honest["acc"])
    # Before the guard: the poisoned global drives every honest reply of round 2 non-finite.
    before = outcome("fedproto", "huge_round1", peer_factor=0.0)
    assert set(range(1, N)) <= set(before["rejected"][1])


def test_negated_prototypes_stay_out_over_flower_where_features_are_nonnegative(outcome):
    # The pool projection keeps every feature >= 0 (each encoder ends in a ReLU): a -5 x
    # prototype attacker, inside the peer guard's band on this IID federation, is refused in
    # every round by the sign of its rows, as on the simulator (tests/test_peer_guard.py).
    pool = {"projection": "pool"}
    honest = outcome("fedproto", "none", model=pool)
    assert honest["rejected"] == [[]] * ROUNDS
    out = outcome("fedproto", "neg5", model=pool)
    assert out["rejected"] == [[ATTACKER]] * ROUNDS, out["rejected"]
    assert "has a negative entry" in out["log"]
    assert abs(out["acc"] - honest["acc"]) <= TOLERANCE, (out["acc"], honest["acc"])
