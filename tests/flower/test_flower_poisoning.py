"""Finite poisoning over Flower: a hostile ClientApp on the in-memory Grid.

The real ServerApp/ClientApp code (:class:`LocalGrid`); the SuperNode serving partition 0 trains
honestly, then replaces every floating array of its train reply by 1e30 before it goes on the
wire. 10 IID digits clients, cnn1, 8 rounds (the simulator's cases in tests/test_adversarial.py).
FedAvg: magnitude sanity (the default) rejects the reply with a logged reason; with it off the
plain mean diverges, the median and the trimmed mean survive. FedTGP prototypes: the plain mean's
aggregate would be non-finite, so every aggregation is refused (logged) and no NaN is broadcast;
the median survives. The peer guard (on by default) is switched off wherever a case shows what a
rule does alone; its own Flower cases are in test_flower_peer_guard.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

import numpy as np  # noqa: E402
from _hostile import ATTACKER, grid_run  # noqa: E402
from flwr.app import Array  # noqa: E402

N = 10
ROUNDS = 8


def huge(name: str, arr: Array, sent: Array, round_num: int) -> Array:
    """Every floating array of the hostile node's train reply: 1e30."""
    return Array(np.full(arr.shape, 1e30, dtype=arr.dtype))


def experiment(name: str, server: dict[str, Any]) -> dict[str, Any]:
    algorithm = {"name": name, **({"server_epochs": 20} if name == "fedtgp" else {})}
    raw = tiny_raw(
        data={"dataset": "digits", "num_clients": N, "partition": "iid"},
        model={"family": "cnn1"},
        algorithm=algorithm,
        sim={"threads": 1, "check_wire": False, "progress": False},
        train={"rounds": ROUNDS},
        server=server,
    )
    for key in ("synthetic_size", "synthetic_classes", "synthetic_shape"):
        del raw["data"][key]
    return raw


_RUNS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """``outcome(name, attacked, **server)``: the run's rounds, final accuracy and warnings
    (``diverged`` if the round loop gave up); each distinct run once per module."""

    def run(name: str, attacked: bool, **server: Any) -> dict[str, Any]:
        key = json.dumps([name, attacked, server], sort_keys=True)
        if key not in _RUNS:
            results = tmp_path_factory.mktemp("poison") / "results"
            _RUNS[key] = grid_run(experiment(name, server), huge if attacked else None, results, N)
        return _RUNS[key]

    return run


# ---- FedAvg: one model upload of 1e30 -------------------------------------------------------------
def test_fedavg_learns_honestly_over_flower(outcome):
    honest = outcome("fedavg", False)
    assert honest["acc"] >= 0.65
    assert [r["rejected"] for r in honest["rounds"]] == [[]] * ROUNDS


def test_fedavg_magnitude_sanity_rejects_the_hostile_reply_with_a_logged_reason(outcome):
    out = outcome("fedavg", True)  # the default [server]: plain mean, max_norm_ratio = 100
    assert [r["rejected"] for r in out["rounds"]] == [[ATTACKER]] * ROUNDS
    assert all(ATTACKER not in r["participants"] for r in out["rounds"])
    assert f"dropped the reply of client {ATTACKER}" in out["log"]
    assert "server.max_norm_ratio" in out["log"]
    assert out["acc"] >= outcome("fedavg", False)["acc"] - 0.03


def test_fedavg_plain_mean_without_sanity_diverges(outcome):
    assert outcome("fedavg", True, max_norm_ratio=0.0, peer_factor=0.0)["diverged"]


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_fedavg_robust_aggregators_survive_without_sanity(outcome, aggregator):
    out = outcome("fedavg", True, max_norm_ratio=0.0, peer_factor=0.0, aggregator=aggregator)
    assert [r["rejected"] for r in out["rounds"]] == [[]] * ROUNDS  # the rule alone defends
    assert all(r["aggregated"] for r in out["rounds"])
    assert out["acc"] >= outcome("fedavg", False)["acc"] - 0.03, out["acc"]


# ---- FedTGP: prototypes of 1e30 ---------------------------------------------------------------
def test_fedtgp_plain_mean_refuses_every_non_finite_aggregate(outcome):
    out = outcome("fedtgp", True, max_norm_ratio=0.0, peer_factor=0.0)
    assert [r["aggregated"] for r in out["rounds"]] == [False] * ROUNDS
    assert out["log"].count("the new server state has NaN or Inf values") == ROUNDS


def test_fedtgp_median_survives_huge_prototypes(outcome):
    out = outcome("fedtgp", True, max_norm_ratio=0.0, peer_factor=0.0, aggregator="median")
    assert [r["aggregated"] for r in out["rounds"]] == [True] * ROUNDS
    assert out["acc"] >= outcome("fedtgp", False)["acc"] - 0.1
