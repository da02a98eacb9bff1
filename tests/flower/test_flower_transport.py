"""Replies are validated before aggregation; failures never stop the federation.

Real ServerApp/ClientApp code over the in-memory Grid; misbehaving clients come from the
test-only node config flag or from wrapping the real ClientApp."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.core.rounds import run_rounds  # noqa: E402
from fedmosaic.experiment import build_federation  # noqa: E402
from fedmosaic.flower import app  # noqa: E402
from fedmosaic.flower import messages as m  # noqa: E402
from fedmosaic.flower.app import client_app, eval_splits, run_server  # noqa: E402
from fedmosaic.flower.local import FIRST_NODE_ID, LocalGrid  # noqa: E402
from fedmosaic.flower.settings import FlowerOptions  # noqa: E402
from fedmosaic.flower.transport import GridTransport  # noqa: E402

N = 4


def raw(name="fedproto", rounds=2, **sections):
    family = "fedhenn5" if name != "fedavg" else "fedhenn_cnn1"
    return tiny_raw(
        algorithm={"name": name}, model={"family": family}, train={"rounds": rounds}, **sections
    )


def run_config(experiment, tmp_path, **extra):
    rc = {
        "experiment": json.dumps(experiment),
        "results-dir": str(tmp_path / "results"),
        "round-timeout": 0.5,
        "eval-timeout": 0.5,
        "connect-timeout": 2.0,
        "min-nodes": 1,
    }
    rc.update(extra)
    return rc


def nodes(extra=None):
    extra = extra or {}
    return [{"partition-id": i, "num-partitions": N, **extra.get(i, {})} for i in range(N)]


def test_bad_failing_and_missing_clients_do_not_stop_the_run(tmp_path, caplog):
    rc = run_config(raw(), tmp_path)
    grid = LocalGrid(
        client_app,
        nodes({1: {app.TEST_FAULT: "nan"}, 2: {app.TEST_FAULT: "raise"}, 3: {}}),
        rc,
    )
    grid.gone.add(FIRST_NODE_ID + 3)  # listed by the SuperLink, never answers
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        doc = run_server(grid, rc)
    for r in doc["rounds"]:
        assert r["participants"] == [0] and r["rejected"] == [1, 2, 3] and r["aggregated"]
        assert 0.0 <= r["acc_weighted"] <= 1.0
    # client 3 never answered the handshake: it has no node, so it was never sent anything
    assert doc["flower"]["nodes"] == {
        "0": FIRST_NODE_ID,
        "1": FIRST_NODE_ID + 1,
        "2": FIRST_NODE_ID + 2,
    }
    fit = doc["flower"]["rounds"][0]
    assert (
        "NaN" in fit["fit_invalid"][1] and f"SuperNode {FIRST_NODE_ID + 1}" in fit["fit_invalid"][1]
    )
    assert "RuntimeError" in fit["fit_failures"][2]
    assert "no SuperNode" in fit["fit_failures"][3]
    assert {c["client_id"] for c in doc["clients"] if "acc" in c} == {0, 1, 2}
    log = (tmp_path / "results" / "server.log").read_text()
    assert f"dropped the reply of client 1: SuperNode {FIRST_NODE_ID + 1}: invalid reply" in log
    assert (
        json.loads((tmp_path / "results" / "results.json").read_text())["rounds"][1]["round"] == 2
    )


class VanishingGrid(LocalGrid):
    """Node 2 answers the handshake, then stops answering (a crashed machine)."""

    def push_messages(self, messages):
        messages = list(messages)
        if any(msg.metadata.message_type != m.HELLO for msg in messages):
            self.gone.add(FIRST_NODE_ID + 2)
        return super().push_messages(messages)


def test_a_node_that_stops_answering_times_out(tmp_path):
    rc = run_config(raw(), tmp_path)
    doc = run_server(VanishingGrid(client_app, nodes(), rc), rc)
    assert [r["participants"] for r in doc["rounds"]] == [[0, 1, 3], [0, 1, 3]]
    first = doc["flower"]["rounds"][0]
    assert first["fit_failures"][2] == f"SuperNode {FIRST_NODE_ID + 2}: no reply within 0.5s"
    assert 2 in first["eval_failures"]
    assert sorted(doc["per_client_final_acc"]) == [0, 1, 3]


def test_too_few_valid_replies_skip_the_round_and_keep_the_state(tmp_path, caplog):
    experiment = raw("fedavg")
    rc = run_config(experiment, tmp_path, **{"min-replies": 2})
    grid = LocalGrid(client_app, nodes({i: {app.TEST_FAULT: "nan"} for i in (1, 2, 3)}), rc)
    fed = build_federation(from_dict(experiment), with_clients=False)
    options = FlowerOptions.from_run_config(rc)
    transport = GridTransport(grid, fed.algo, fed.clients, eval_splits(fed.clients), options)
    transport.connect()
    plan = dataclasses.replace(fed.plan, min_replies=2)
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        history, state = run_rounds(fed.algo, fed.spec, transport, plan)
    initial = fed.algo.init_server(fed.spec)
    assert all(torch.equal(state[k], initial[k]) for k in initial)  # never half-aggregated
    assert [r["aggregated"] for r in history.rounds] == [False, False]
    assert [r["participants"] for r in history.rounds] == [[0], [0]]
    assert "round 1: skipped: 1 valid replies, fewer than the minimum of 2" in caplog.text


def lying_app(change_fit=None, change_eval=None) -> ClientApp:
    """The real ClientApp whose replies are edited after the fact."""
    liar = ClientApp()

    @liar.query()
    def hello(msg: Message, context: Context) -> Message:
        return app.hello(msg, context)

    @liar.train()
    def train(msg: Message, context: Context) -> Message:
        reply = app.train(msg, context)
        if change_fit and context.node_config["partition-id"] == 1:
            change_fit(reply.content)
        return reply

    @liar.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        reply = app.evaluate(msg, context)
        if change_eval and context.node_config["partition-id"] == 1:
            change_eval(reply.content)
        return reply

    return liar


def set_header(**fields):
    def change(content: RecordDict) -> None:
        head = dict(content[m.HEADER])
        head.update(fields)
        content[m.HEADER] = ConfigRecord(head)

    return change


@pytest.mark.parametrize(
    "change, reason",
    [
        (set_header(**{"num-examples": 10**6}), "training examples"),
        (set_header(**{"client-id": 2}), "claims to come from client 2"),
        (set_header(payload="SharedState"), "payload type"),
        (lambda c: c.__delitem__(m.HEADER), "no 'fedmosaic' header"),
    ],
)
def test_replies_that_lie_are_rejected(change, reason, tmp_path):
    rc = run_config(raw(rounds=1), tmp_path)
    doc = run_server(LocalGrid(lying_app(change_fit=change), nodes(), rc), rc)
    assert doc["rounds"][0]["rejected"] == [1]
    assert reason in doc["flower"]["rounds"][0]["fit_invalid"][1]


def test_oversized_replies_are_rejected(tmp_path):
    rc = run_config(raw(rounds=1), tmp_path, **{"max-reply-mb": 1e-4, "min-replies": 1})
    doc = run_server(LocalGrid(client_app, nodes(), rc), rc)
    assert doc["rounds"][0]["rejected"] == [0, 1, 2, 3] and not doc["rounds"][0]["aggregated"]
    assert "exceeds the cap" in doc["flower"]["rounds"][0]["fit_invalid"][0]


def test_impossible_evaluation_counts_are_dropped(tmp_path):
    def inflate(content: RecordDict) -> None:
        counts = dict(content[m.COUNTS])
        counts["test/acc"] = counts["test/n"] + 1
        content[m.COUNTS] = ConfigRecord(counts)

    rc = run_config(raw(rounds=1), tmp_path)
    doc = run_server(LocalGrid(lying_app(change_eval=inflate), nodes(), rc), rc)
    assert "1" not in {str(c) for c in doc["per_client_final_acc"]}
    assert "more correct predictions" in doc["flower"]["rounds"][0]["eval_failures"][1]


def test_handshake_ignores_nodes_that_do_not_fit(tmp_path, caplog):
    rc = run_config(raw(rounds=1), tmp_path)
    configs = nodes() + [
        {"partition-id": 0, "num-partitions": N},  # a second node for partition 0
        {"partition-id": 1, "num-partitions": 7},  # another federation's node
        {},  # no partition at all: its ClientApp raises
    ]
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        doc = run_server(LocalGrid(client_app, configs, rc), rc)
    assert doc["flower"]["nodes"] == {str(i): FIRST_NODE_ID + i for i in range(N)}
    assert doc["rounds"][0]["participants"] == [0, 1, 2, 3]
    assert "partition 0 is already served" in caplog.text
    assert "num-partitions=7" in caplog.text
    assert "partition-id=<i>" in caplog.text


def test_no_node_at_all_is_a_clear_error(tmp_path):
    rc = run_config(raw(rounds=1), tmp_path, **{"connect-timeout": 0.5})
    with pytest.raises(RuntimeError, match="no SuperNode"):
        run_server(LocalGrid(client_app, [], rc), rc)


def _big_metrics(content: RecordDict) -> None:
    from flwr.app import MetricRecord

    content["metrics"] = MetricRecord({"padding": [0.0] * (256 << 10)})  # 2 MiB of floats


def test_every_record_counts_towards_the_reply_cap(tmp_path):
    rc = run_config(raw(rounds=1), tmp_path, **{"max-reply-mb": 1})
    doc = run_server(LocalGrid(lying_app(change_fit=_big_metrics), nodes(), rc), rc)
    assert doc["rounds"][0]["rejected"] == [1] and doc["rounds"][0]["aggregated"]
    assert "exceeds the cap of 1048576" in doc["flower"]["rounds"][0]["fit_invalid"][1]


def _extra_arrays(content: RecordDict) -> None:
    import numpy as np
    from flwr.app import Array, ArrayRecord

    content["more"] = ArrayRecord({"x": Array(np.zeros(3, dtype=np.float32))})


def _extra_config(content: RecordDict) -> None:
    content["notes"] = ConfigRecord({"hello": "world"})


@pytest.mark.parametrize(
    ("change", "found"),
    [(_extra_arrays, "arrays record(s) ['more']"), (_extra_config, "configs record(s) ['notes']")],
)
def test_a_reply_with_a_record_the_protocol_does_not_expect_is_refused(
    change, found, tmp_path, caplog
):
    rc = run_config(raw(rounds=1), tmp_path)
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        doc = run_server(
            LocalGrid(lying_app(change_fit=change, change_eval=change), nodes(), rc), rc
        )
    flower = doc["flower"]["rounds"][0]
    assert doc["rounds"][0]["rejected"] == [1]
    assert found in flower["fit_invalid"][1] and found in flower["eval_failures"][1]
    assert "dropped the reply of client 1" in caplog.text and found in caplog.text


@pytest.mark.parametrize("value", [0, 0.0, 1e-9, -1, float("nan")])
def test_a_reply_cap_that_rejects_everything_is_a_config_error(value):
    from fedmosaic.config import ConfigError

    with pytest.raises(ConfigError, match="max-reply-mb"):
        FlowerOptions.from_run_config({"max-reply-mb": value})
