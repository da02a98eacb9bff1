"""End to end on real processes: ``flower-superlink`` + SuperNodes on 127.0.0.1, ``flwr run``.

One deployment covers the production set-up and the failure cases at once (Flower processes
start slowly, and CI has a time budget): TLS with certificates generated here, SuperNode
authentication with ECDSA keys registered through ``flwr supernode register``, an unregistered
SuperNode that is refused, a heterogeneous prototype method (FedProto on five CNN
architectures) for two rounds, one SuperNode sending NaN uploads (test-only node config flag)
and one SuperNode killed after round 1. The run must finish and say who took part. The
SuperNodes are ``python -m fedmosaic.flower.node`` (one long-running ClientApp process each),
and every process runs with ``HOME`` and ``FLWR_HOME`` inside the test's folder: nothing may
land in ``~/.flwr``.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _flower_deploy import Deployment, flower_binaries_missing, make_node_key, make_tls
from helpers.experiments import tiny_raw

MISSING = flower_binaries_missing()
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # click/typer, imported by flwr
]

N = 3
NAN_NODE, KILLED_NODE = 1, 2


@pytest.fixture
def deployment(tmp_path):
    d = Deployment(tmp_path, tls=make_tls(tmp_path / "certs"))
    yield d
    left = d.close()
    assert left == [], f"processes still running after teardown: {left}"


def test_tls_auth_faults_and_a_killed_node(deployment, tmp_path):
    from fedmosaic.config import from_dict
    from fedmosaic.flower.app import TEST_FAULT
    from fedmosaic.flower.project import write_app

    d = deployment
    start = time.monotonic()
    d.start_superlink(supernode_auth=True)
    d.write_connection()
    keys = [make_node_key(tmp_path / "keys", f"node{i}") for i in range(N + 1)]
    with ThreadPoolExecutor(N) as pool:  # each `flwr` call starts a Python process: overlap them
        registered = list(
            pool.map(lambda k: d.flwr("supernode", "register", str(k[1]), "test"), keys[:N])
        )
    for r in registered:
        assert r.returncode == 0 and "registered successfully" in r.stdout, r.stdout + r.stderr

    for i in range(N):
        fault = f' {TEST_FAULT}="nan"' if i == NAN_NODE else ""
        d.start_supernode(f"node{i}", f"partition-id={i} num-partitions={N}{fault}", key=keys[i][0])
    # a SuperNode whose key was never registered: the SuperLink must refuse it
    d.start_supernode(
        "rogue",
        f"partition-id=0 num-partitions={N}",
        key=keys[N][0],
        extra=["--max-retries", "2", "--max-wait-time", "30"],
    )

    raw = tiny_raw(
        data={"num_clients": N},
        model={"family": "fedhenn5"},
        train={"rounds": 2, "eval_every": 2},  # evaluate once, after the last round
        algorithm={"name": "fedproto"},
    )
    app = write_app(
        from_dict(raw),
        tmp_path / "app",
        d.address,
        root_certificates=str(d.tls["ca"]),
        run_config={"round-timeout": 150.0, "eval-timeout": 150.0, "connect-timeout": 150.0},
    )
    run = d.flwr("run", str(app), "test")
    assert run.returncode == 0 and "Successfully started run" in run.stdout, run.stdout + run.stderr

    results = app / "results"
    killed = False
    deadline = time.monotonic() + 360
    while not (results / "results.json").exists():
        assert time.monotonic() < deadline, d.log("superlink")[-4000:]
        failed = results / "FAILED"
        assert not failed.exists(), failed.read_text()  # the ServerApp crashed: say why, now
        progress = results / "progress.jsonl"
        if not killed and progress.exists() and progress.read_text().strip():
            d.kill(f"node{KILLED_NODE}")  # gone after round 1, mid-run
            killed = True
        time.sleep(0.5)
    doc = json.loads((results / "results.json").read_text())
    elapsed = time.monotonic() - start

    assert killed
    r1, r2 = doc["rounds"]
    assert r1["participants"] == [0, KILLED_NODE] and r1["rejected"] == [NAN_NODE]
    assert r2["participants"] == [0] and r2["rejected"] == [NAN_NODE, KILLED_NODE]
    assert r1["aggregated"] and r2["aggregated"]
    assert 0.0 <= r2["acc_weighted"] <= 1.0 and r2["bytes_up"] > 0
    flower = {r["round"]: r for r in doc["flower"]["rounds"]}
    assert "NaN" in flower[1]["fit_invalid"][str(NAN_NODE)]
    assert str(KILLED_NODE) in flower[2]["fit_failures"]
    assert sorted(doc["per_client_final_acc"]) == ["0", "1"]  # client 2 was not there to evaluate
    assert doc["config"]["algorithm"]["name"] == "fedproto"
    log = (results / "server.log").read_text()
    assert f"dropped the reply of client {NAN_NODE}: SuperNode" in log

    # the unregistered SuperNode was refused and never became a client
    rogue = d.procs["rogue"]
    for _ in range(120):
        if rogue.poll() is not None:
            break
        time.sleep(0.5)
    assert rogue.returncode not in (None, 0), d.log("rogue")[-2000:]
    assert "Failed to activate SuperNode" in d.log("rogue")
    assert len(doc["flower"]["nodes"]) == N
    # the long-running ClientApp processes served every message of the run (no process per
    # message): one line per task in each SuperNode's log, the same process throughout
    tasks = re.findall(r"fedmosaic\.flower\.node\[(\d+)\]: (\w+) message completed", d.log("node0"))
    assert [t for _, t in tasks].count("train") == 2 and "evaluate" in [t for _, t in tasks]
    assert len({pid for pid, _ in tasks}) == 1, tasks
    # everything Flower wrote is under FLWR_HOME (the ServerApp installed the app bundle there);
    # nothing under the user's home
    assert any((d.flwr_home / "apps").iterdir())
    assert not (d.home / ".flwr").exists(), sorted(map(str, d.home.rglob("*")))
    print(
        f"deployment test: {elapsed:.0f}s, seconds per round {[r['seconds'] for r in doc['rounds']]}"
    )


def test_secure_aggregation_on_a_loopback_deployment_gives_the_simulators_numbers(tmp_path):
    """SecAgg+ between real processes (``flwr run``, a SuperLink, three SuperNodes) gives the
    simulator's numbers bit for bit: the masks cancel, the rounding is seeded."""
    from fedmosaic import api
    from fedmosaic.config import from_dict
    from fedmosaic.flower.project import write_app

    d = Deployment(tmp_path)
    try:
        d.start_superlink(database=False)
        d.write_connection()
        for i in range(N):
            d.start_supernode(f"node{i}", f"partition-id={i} num-partitions={N}")
        raw = tiny_raw(
            data={"num_clients": N},
            train={"rounds": 2},
            algorithm={"name": "fedproto"},
            privacy={"secure_aggregation": True},
            sim={"threads": 1, "progress": False},
        )
        app = write_app(
            from_dict(raw),
            tmp_path / "app",
            d.address,
            insecure=True,
            run_config={"round-timeout": 150.0, "eval-timeout": 150.0, "connect-timeout": 150.0},
        )
        run = d.flwr("run", str(app), "test")
        assert run.returncode == 0, run.stdout + run.stderr
        results = app / "results"
        deadline = time.monotonic() + 300
        while not (results / "results.json").exists():
            assert time.monotonic() < deadline, d.log("superlink")[-4000:]
            assert not (results / "FAILED").exists(), (results / "FAILED").read_text()
            time.sleep(0.5)
        doc = json.loads((results / "results.json").read_text())
    finally:
        left = d.close()
    assert left == []
    sim = api.run(from_dict(raw)).rounds
    for s, f in zip(sim, doc["rounds"], strict=True):
        assert f["participants"] == s["participants"] == list(range(N))
        assert (f["acc_weighted"], f["train_loss"], f["bytes_up"]) == (
            s["acc_weighted"],
            s["train_loss"],
            s["bytes_up"],
        )
    assert (
        "Secure aggregation completed" in d.log("superlink")
        or "secure" in (results / "server.log").read_text()
    )
