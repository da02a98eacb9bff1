"""The Flower path (real ServerApp/ClientApp code over an in-memory Grid) gives the simulator's
numbers: every registered algorithm, a few rounds, the tiny federation."""

from __future__ import annotations

import json

import pytest
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

from fedmosaic.algorithms import ALGORITHMS  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.experiment import run_experiment  # noqa: E402
from fedmosaic.flower.app import client_app, run_server  # noqa: E402
from fedmosaic.flower.local import LocalGrid  # noqa: E402

ACC_KEYS = ("acc", "val_acc")


def run_both(raw, tmp_path):
    sim = run_experiment(from_dict(raw), progress=False)
    n = raw["data"]["num_clients"]
    rc = {"experiment": json.dumps(raw), "results-dir": str(tmp_path / "results")}
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], rc)
    flower = run_server(grid, rc)
    assert json.loads((tmp_path / "results" / "results.json").read_text())["runtime"] == "flower"
    return sim, flower


def assert_same_numbers(sim, flower):
    assert len(sim["rounds"]) == len(flower["rounds"])
    for a, b in zip(sim["rounds"], flower["rounds"], strict=True):
        accs = {k: v for k, v in a.items() if k.startswith(ACC_KEYS)}
        assert accs, "no accuracies recorded"
        assert accs == {k: b[k] for k in accs}, f"round {a['round']}"
        assert a["participants"] == b["participants"] and b["rejected"] == []
        talks = ALGORITHMS.get(sim["config"]["algorithm"]["name"]).communicates
        assert (b["bytes_up"] > 0 and b["bytes_down"] > 0) == talks
    assert sim["per_client_final_acc"] == flower["per_client_final_acc"]
    assert sim["summary"].get("after_finetune") == flower["summary"].get("after_finetune")
    assert sim["clients"] == flower["clients"]


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_parity_with_the_simulator(name, tmp_path):
    het = ALGORITHMS.get(name).supports_heterogeneous
    raw = tiny_raw(
        algorithm={"name": name},
        model={"family": "fedhenn5" if het else "fedhenn_cnn1"},  # small CNNs: seconds
        train={"rounds": 2},
    )
    assert_same_numbers(*run_both(raw, tmp_path))


def test_parity_batchnorm_sampling_and_validation(tmp_path):
    """BatchNorm buffers in client state, 2 of 4 clients per round, a validation split."""
    raw = tiny_raw(
        algorithm={"name": "fedrod"},
        model={"family": "resnet4"},
        data={"val_fraction": 0.2, "synthetic_shape": [1, 16, 16]},
        train={"rounds": 3, "clients_per_round": 2},
    )
    sim, flower = run_both(raw, tmp_path)
    assert_same_numbers(sim, flower)
    assert [r["participants"] for r in flower["rounds"]] != [[0, 1, 2, 3]] * 3
    assert "val_acc_weighted" in flower["rounds"][-1]


@pytest.mark.parametrize("name", ["fedproto", "fedavg"])
def test_parity_of_the_membership_attack(name, tmp_path):
    """eval.membership: each client's attack counts travel back with its evaluation, and with
    its fit reply the attack on its upload where that is a whole model (FedAvg)."""
    raw = tiny_raw(algorithm={"name": name}, train={"rounds": 2}, eval={"membership": True})
    sim, flower = run_both(raw, tmp_path)
    assert_same_numbers(sim, flower)
    for a, b in zip(sim["rounds"], flower["rounds"], strict=True):
        attack = {k: v for k, v in a.items() if k.startswith("mia_")}
        assert attack["mia_clients"] == 4 and attack == {k: b[k] for k in attack}
        assert ("mia_upload_auc" in attack) == (name == "fedavg")
    assert sim["summary"]["membership"] == flower["summary"]["membership"]


def test_a_failed_run_leaves_failed_with_the_reason(tmp_path):
    # Missing dataset files: the ServerApp fails before round 1 and says why in FAILED.
    raw = tiny_raw(data={"dataset": "mnist", "root": str(tmp_path / "empty")})
    (tmp_path / "empty").mkdir()
    rc = {"experiment": json.dumps(raw), "results-dir": str(tmp_path / "results")}
    grid = LocalGrid(client_app, [{"partition-id": 0, "num-partitions": 4}], rc)
    with pytest.raises(Exception):  # noqa: B017 - whatever the loader raises
        run_server(grid, rc)
    failed = (tmp_path / "results" / "FAILED").read_text()
    assert "Traceback" in failed and "mnist" in failed.lower()
    assert not (tmp_path / "results" / "results.json").exists()


def test_flower_round_log_gives_accuracy_in_percent(tmp_path, caplog):
    """Flower's round line said ``acc 0.8409`` where every table and log says 84.09%."""
    import logging

    n = 2
    raw = tiny_raw(data={"num_clients": n}, train={"rounds": 1}, algorithm={"name": "local"})
    rc = {"experiment": json.dumps(raw), "results-dir": str(tmp_path / "results")}
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], rc)
    with caplog.at_level(logging.INFO):
        doc = run_server(grid, rc)
    acc = doc["rounds"][0]["acc_weighted"]
    assert f"round 1: acc {100 * acc:.2f}%," in caplog.text
