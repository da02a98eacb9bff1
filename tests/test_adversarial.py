"""Finite poisoning end to end: 1 of 10 clients attacks FedAvg and FedTGP on the simulator.

The attacker (client 0) trains honestly, then replaces its upload: ``huge`` sends 1e30 in every
value; ``flip`` sends ``broadcast - 10 x update`` (prototypes: ``-10 x`` its own). The plain mean
does not survive either attack; the robust aggregators and clipping (``[server]``,
``core/robust.py``) keep accuracy near the honest run; magnitude sanity rejects the 1e30 model
upload, and a server whose aggregate would be non-finite keeps its previous state. The peer guard
(``server.peer_factor``, on by default) is switched off here wherever a case shows what a rule
does alone; its own cases are in tests/test_peer_guard.py.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import cache
from typing import Any

import pytest
import torch
from _attack import ATTACKER, Poison, attacked_run
from helpers.experiments import tiny_raw

from fedmosaic.algorithms._shared import SharedState
from fedmosaic.core import robust

ROUNDS = 8


def poisoner(attack: str) -> Poison | None:
    """``huge``: 1e30 everywhere; ``flip``: ``broadcast - 10 x update`` (prototypes: ``-10 x``)."""
    if attack == "none":
        return None

    def poison(round_num: int, up: Any, sent: Any) -> Any:
        if isinstance(up, SharedState):
            return dataclasses.replace(up, state=poison_state(up.state, sent.state, attack))
        p = torch.full_like(up.protos, 1e30) if attack == "huge" else -10 * up.protos
        return dataclasses.replace(up, protos=p)

    return poison


def poison_state(state: dict, sent: dict, attack: str) -> dict:
    out = {}
    for k, v in state.items():
        if not v.is_floating_point():
            out[k] = v
        elif attack == "huge":
            out[k] = torch.full_like(v, 1e30)
        else:  # sign-flipped update, x10
            out[k] = sent[k] - 10 * (v - sent[k])
    return out


def raw(name: str, server: dict[str, Any]) -> dict[str, Any]:
    """10 clients, IID digits, cnn1, ROUNDS rounds, serial."""
    algorithm = {"name": name, **({"server_epochs": 20} if name == "fedtgp" else {})}
    r = tiny_raw(
        data={"dataset": "digits", "num_clients": 10, "partition": "iid"},
        model={"family": "cnn1"},
        algorithm=algorithm,
        sim={"backend": "serial", "threads": 1, "check_wire": False, "progress": False},
        train={"rounds": ROUNDS},
        server=server,
    )
    for key in ("synthetic_size", "synthetic_classes", "synthetic_shape"):
        del r["data"][key]
    return r


@cache
def outcome(name: str, attack: str, **server: Any) -> dict[str, Any]:
    """Final accuracy (NaN if the run diverged), rejections, refusals and the final state."""
    return attacked_run(raw(name, server), poisoner(attack))


def honest(name: str) -> float:
    return outcome(name, "none")["acc"]


# ---- FedAvg -------------------------------------------------------------------------------------


def test_fedavg_learns_honestly():
    assert honest("fedavg") >= 0.65


def test_fedavg_plain_mean_is_destroyed_by_one_huge_upload():
    # Magnitude sanity and the peer guard off: the 1e30 enters the mean, every client's next
    # loss is non-finite.
    assert outcome("fedavg", "huge", max_norm_ratio=0.0, peer_factor=0.0)["diverged"]


def test_fedavg_magnitude_sanity_rejects_the_huge_upload(caplog):
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        out = outcome.__wrapped__("fedavg", "huge")
    assert out["rejected"] == [[ATTACKER]] * ROUNDS
    assert "server.max_norm_ratio" in caplog.text and f"client {ATTACKER}" in caplog.text
    assert out["acc"] >= honest("fedavg") - 0.03


@pytest.mark.parametrize(
    "server",
    [
        {"aggregator": "median"},
        {"aggregator": "trimmed_mean"},
        {"aggregator": "multi_krum"},
        {"aggregator": "krum"},
        {"clip_update_norm": 1.0},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_fedavg_robust_rules_survive_the_huge_upload(server):
    out = outcome("fedavg", "huge", max_norm_ratio=0.0, peer_factor=0.0, **server)
    assert out["rejected"] == [[]] * ROUNDS  # nothing rejected: the rule alone defends
    # Krum keeps one client's update per round: it learns slower even without an attack.
    slack = 0.1 if server.get("aggregator") == "krum" else 0.03
    assert out["acc"] >= honest("fedavg") - slack, out["acc"]


def test_fedavg_sign_flip_x10_plain_mean_vs_robust():
    # passes magnitude sanity: 10x is a plausible norm (the peer guard off: the rules alone)
    mean = outcome("fedavg", "flip", peer_factor=0.0)["acc"]
    assert mean <= 0.2
    for aggregator in ("median", "trimmed_mean", "multi_krum"):
        acc = outcome("fedavg", "flip", aggregator=aggregator, peer_factor=0.0)["acc"]
        assert acc >= honest("fedavg") - 0.05, (aggregator, acc)
    # Clipping alone bounds the damage but does not remove the wrong direction.
    assert outcome("fedavg", "flip", clip_update_norm=1.0, peer_factor=0.0)["acc"] >= mean + 0.3


# ---- FedTGP prototypes --------------------------------------------------------------------------


def test_fedtgp_plain_mean_never_broadcasts_nan():
    # The 1e30 prototypes would make the server's prototypes non-finite: every aggregation is
    # refused and the previous (initial) state kept, so no client ever receives NaN.
    out = outcome("fedtgp", "huge", max_norm_ratio=0.0, peer_factor=0.0)
    assert out["aggregated"] == [False] * ROUNDS
    assert robust.all_finite(out["state"])
    assert not bool(out["state"].known.any())  # the federation learned nothing from its server


@pytest.mark.parametrize(
    "server",
    [{"aggregator": "median"}, {"aggregator": "trimmed_mean"}, {"clip_update_norm": 5.0}],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_fedtgp_robust_rules_survive_huge_prototypes(server):
    out = outcome("fedtgp", "huge", max_norm_ratio=0.0, peer_factor=0.0, **server)
    assert out["aggregated"] == [True] * ROUNDS
    assert robust.all_finite(out["state"]) and bool(out["state"].known.all())
    assert out["acc"] >= honest("fedtgp") - 0.1, (out["acc"], honest("fedtgp"))
