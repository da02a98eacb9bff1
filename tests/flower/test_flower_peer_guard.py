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
import logging
from typing import Any

import pytest
from conftest import tiny_raw

pytest.importorskip("flwr")

from flwr.app import Array  # noqa: E402

from fedmosaic.flower import messages as m  # noqa: E402
from fedmosaic.flower.app import client_app, run_server  # noqa: E402
from fedmosaic.flower.codec import ARRAYS  # noqa: E402
from fedmosaic.flower.local import FIRST_NODE_ID, LocalGrid  # noqa: E402

N = 10
ROUNDS = 5
ATTACKER = 0
HOSTILE_NODE = FIRST_NODE_ID + ATTACKER  # node configs are listed in partition order
TOLERANCE = 0.02


def hostile(attack: str):
    """The real ClientApp, except that the hostile node's train replies are rewritten."""

    def app(msg, context):
        reply = client_app(msg, context)
        if (
            context.node_id != HOSTILE_NODE
            or msg.metadata.message_type != m.FIT
            or reply.has_error()
        ):
            return reply
        sent = msg.content.array_records[ARRAYS]
        arrays = reply.content.array_records[ARRAYS]
        first = m.header(msg.content)["round"] == 1
        for name, arr in list(arrays.items()):
            if not arr.dtype.startswith("float"):
                continue
            x = arr.numpy()
            if attack == "scale50":
                s = sent[name].numpy()
                arrays[name] = Array((s + 50 * (x - s)).astype(x.dtype))
            elif attack == "huge_round1" and first:
                arrays[name] = Array(x * 0 + 1e30)
        return reply

    return app


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_RUNS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """``outcome(name, attack, **server)``: rounds, final accuracy and warnings, once each."""

    def run(name: str, attack: str, **server: Any) -> dict[str, Any]:
        key = json.dumps([name, attack, server], sort_keys=True)
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
            rc = {
                "experiment": json.dumps(experiment),
                "results-dir": str(tmp_path_factory.mktemp("guard") / "results"),
            }
            nodes = [{"partition-id": i, "num-partitions": N} for i in range(N)]
            grid = LocalGrid(hostile(attack), nodes, rc)
            logs = _Collect()
            logger = logging.getLogger("fedmosaic")
            logger.addHandler(logs)
            try:
                doc = run_server(grid, rc)
            finally:
                logger.removeHandler(logs)
            rounds = doc["rounds"]
            _RUNS[key] = {
                "acc": rounds[-1]["acc_weighted"],
                "rejected": [r["rejected"] for r in rounds],
                "aggregated": [r["aggregated"] for r in rounds],
                "log": "\n".join(logs.lines),
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
