"""Hostile SuperNodes: partition hijacks and replies from the wrong node.

Real ServerApp/ClientApp code over the in-memory Grid (:class:`LocalGrid`); an impostor is a
node whose node config declares someone else's partition, a forged reply is one whose source
node is not the node its message went to."""

from __future__ import annotations

import json
import logging

import pytest
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

from fedmosaic.config import ConfigError  # noqa: E402
from fedmosaic.flower import messages as m  # noqa: E402
from fedmosaic.flower.app import client_app, run_server  # noqa: E402
from fedmosaic.flower.local import FIRST_NODE_ID, LocalGrid  # noqa: E402
from fedmosaic.flower.settings import FlowerOptions, parse_node_partitions  # noqa: E402

N = 4
IMPOSTOR = FIRST_NODE_ID  # listed first by the SuperLink, so it answers the handshake first
REAL = {i: FIRST_NODE_ID + 1 + i for i in range(N)}  # partition -> the node that owns it


def run_config(tmp_path, **extra):
    experiment = tiny_raw(
        algorithm={"name": "fedproto"}, model={"family": "fedhenn5"}, train={"rounds": 1}
    )
    rc = {
        "experiment": json.dumps(experiment),
        "results-dir": str(tmp_path / "results"),
        "round-timeout": 0.5,
        "eval-timeout": 0.5,
        "connect-timeout": 2.0,
    }
    rc.update(extra)
    return rc


def with_impostor(claims: int = 0) -> list[dict]:
    """Node 1001 claims partition ``claims``; nodes 1002..1005 serve partitions 0..3."""
    return [{"partition-id": claims, "num-partitions": N}] + [
        {"partition-id": i, "num-partitions": N} for i in range(N)
    ]


ALLOW = " ".join(f"{node}={pid}" for pid, node in REAL.items())


def test_without_an_allow_list_the_first_claimant_wins_and_the_hijack_is_logged(tmp_path, caplog):
    """What a declared partition-id alone can do (the limitation the allow-list removes): the
    impostor answering first serves partition 0, and the real node is refused with a log line
    and a results.json entry, never silently."""
    rc = run_config(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        doc = run_server(LocalGrid(client_app, with_impostor(), rc), rc)
    assert doc["flower"]["nodes"]["0"] == IMPOSTOR
    assert doc["flower"]["refused_nodes"] == {
        str(REAL[0]): f"partition 0 is already served by node {IMPOSTOR}"
    }
    assert "no node-partitions allow-list" in caplog.text
    assert f"ignoring SuperNode {REAL[0]}: partition 0 is already served" in caplog.text


def test_the_allow_list_refuses_an_impostor_claiming_partition_0(tmp_path, caplog):
    rc = run_config(tmp_path, **{"node-partitions": ALLOW})
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        doc = run_server(LocalGrid(client_app, with_impostor(), rc), rc)
    assert doc["flower"]["nodes"] == {str(pid): node for pid, node in REAL.items()}
    assert doc["flower"]["refused_nodes"] == {
        str(IMPOSTOR): "claims partition 0, but node-partitions omits it"
    }
    assert f"ignoring SuperNode {IMPOSTOR}: claims partition 0" in caplog.text
    assert doc["rounds"][0]["participants"] == [0, 1, 2, 3]
    assert "no node-partitions allow-list" not in caplog.text


def test_a_listed_node_cannot_claim_another_partition(tmp_path):
    """The impostor is a legitimate member (listed for partition 1) grabbing partition 0 too."""
    allow = f"{IMPOSTOR}=1 " + " ".join(f"{REAL[p]}={p}" for p in (0, 2, 3))
    rc = run_config(tmp_path, **{"node-partitions": allow})
    doc = run_server(LocalGrid(client_app, with_impostor(claims=0), rc), rc)
    assert doc["flower"]["nodes"] == {"0": REAL[0], "2": REAL[2], "3": REAL[3]}
    assert doc["flower"]["refused_nodes"] == {
        str(IMPOSTOR): "claims partition 0, but node-partitions binds it to partition 1",
        str(REAL[1]): "claims partition 1, but node-partitions omits it",
    }
    assert doc["rounds"][0]["participants"] == [0, 2, 3]


class ForgingGrid(LocalGrid):
    """Replies to messages for ``victim`` arrive with ``forger`` as their source node (another
    node answering in its place); ``kinds`` picks which message types are forged."""

    def __init__(self, *args, victim: int, forger: int, kinds: tuple[str, ...], **kw) -> None:
        super().__init__(*args, **kw)
        self.victim, self.forger, self.kinds = victim, forger, kinds

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        for reply in replies:
            md = reply.metadata
            if md.src_node_id == self.victim and md.message_type in self.kinds:
                md.__dict__["_src_node_id"] = self.forger
        return replies


def test_a_reply_from_another_node_is_dropped(tmp_path, caplog):
    rc = run_config(tmp_path, **{"min-nodes": N})
    victim, forger = FIRST_NODE_ID + 1, FIRST_NODE_ID + 2
    nodes = [{"partition-id": i, "num-partitions": N} for i in range(N)]
    grid = ForgingGrid(
        client_app, nodes, rc, victim=victim, forger=forger, kinds=(m.FIT, m.EVALUATE)
    )
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        doc = run_server(grid, rc)
    r = doc["rounds"][0]
    assert r["participants"] == [0, 2, 3] and r["rejected"] == [1]
    flower = doc["flower"]["rounds"][0]
    why = f"SuperNode {victim}: reply came from SuperNode {forger}, not {victim}: dropped"
    assert flower["fit_failures"] == {1: why}
    assert flower["eval_failures"] == {1: why}
    assert 1 not in doc["per_client_final_acc"] and "1" not in doc["per_client_final_acc"]
    assert f"dropped a reply from SuperNode {forger} to a message sent to SuperNode {victim}" in (
        caplog.text
    )


def test_a_handshake_answered_by_another_node_registers_nothing(tmp_path):
    rc = run_config(tmp_path, **{"min-nodes": N - 1})
    victim, forger = FIRST_NODE_ID + 3, FIRST_NODE_ID
    nodes = [{"partition-id": i, "num-partitions": N} for i in range(N)]
    grid = ForgingGrid(client_app, nodes, rc, victim=victim, forger=forger, kinds=(m.HELLO,))
    doc = run_server(grid, rc)
    assert doc["flower"]["nodes"] == {str(i): FIRST_NODE_ID + i for i in range(N - 1)}


def test_results_say_the_evaluation_is_client_reported(tmp_path):
    rc = run_config(tmp_path)
    nodes = [{"partition-id": i, "num-partitions": N} for i in range(N)]
    run_server(LocalGrid(client_app, nodes, rc), rc)
    doc = json.loads((tmp_path / "results" / "results.json").read_text())
    assert doc["evaluation_source"] == "client-reported"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("1001=0 1002=0", "partition 0 is given to two nodes"),
        ("1001=0 1001=1", "node 1001 is listed twice"),
        ("1001:0", "not NODE=PARTITION"),
        ("1001=-1", "not NODE=PARTITION"),
        (7, "must be a string"),
    ],
)
def test_a_malformed_allow_list_is_a_config_error(text, problem):
    with pytest.raises(ConfigError, match=problem):
        FlowerOptions.from_run_config({"node-partitions": text})


def test_allow_list_parses_and_names_partitions_outside_the_federation(tmp_path):
    assert parse_node_partitions("1001=0, 1002=3") == {1001: 0, 1002: 3}
    rc = run_config(tmp_path, **{"node-partitions": "1001=0 1002=9"})
    nodes = [{"partition-id": i, "num-partitions": N} for i in range(N)]
    with pytest.raises(ConfigError, match=r"names partitions \[9\]"):
        run_server(LocalGrid(client_app, nodes, rc), rc)
