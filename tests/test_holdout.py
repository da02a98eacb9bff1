"""Held-out clients (``eval.holdout_clients``) and fine-tuning for every method."""

from __future__ import annotations

import pytest
from helpers.experiments import tiny_raw

from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.rounds import holdout_clients
from fedmosaic.experiment import run_experiment

SMALL = {"synthetic_shape": [1, 16, 16], "num_clients": 5}


def test_holdout_subset_is_seeded_sorted_and_empty_for_zero():
    a = holdout_clients(3, 10, 3)
    assert a == holdout_clients(3, 10, 3) and list(a) == sorted(a) and len(set(a)) == 3
    assert holdout_clients(4, 10, 3) != a or holdout_clients(5, 10, 3) != a
    assert holdout_clients(3, 10, 0) == ()


@pytest.mark.parametrize("name", ["fedavg", "fedper", "fedtgp", "local"])
def test_held_out_clients_never_train_and_are_served_at_the_end(name: str):
    raw = tiny_raw(
        data=SMALL,
        train={"rounds": 3, "participation": 0.5},
        eval={"holdout_clients": 2},
        algorithm={"name": name},
    )
    raw["model"]["family"] = "cnn1"
    doc = run_experiment(from_dict(raw), progress=False)
    held = doc["summary"]["holdout"]["clients"]
    assert held == list(holdout_clients(0, 5, 2))
    for r in doc["rounds"]:
        assert not set(r["participants"]) & set(held)  # never trained
        assert r["num_sampled"] == 1  # floor(0.5 x 3 trainers)
    assert set(map(int, doc["per_client_final_acc"])) == set(range(5)) - set(held)
    recs = {c["client_id"]: c for c in doc["clients"]}
    for cid in held:
        assert recs[cid]["holdout"] is True
        assert 0.0 <= recs[cid]["newcomer_before_acc"] <= 1.0
        assert 0.0 <= recs[cid]["newcomer_after_acc"] <= 1.0
    h = doc["summary"]["holdout"]
    assert {"acc_weighted", "acc_mean"} <= set(h["before"]) and {"acc_weighted"} <= set(h["after"])


def test_without_holdout_the_numbers_do_not_move():
    raw = tiny_raw(data=SMALL, train={"rounds": 2, "participation": 0.6})
    a = run_experiment(from_dict(raw), progress=False)
    raw["eval"] = {"holdout_clients": 0}
    b = run_experiment(from_dict(raw), progress=False)
    assert [r["acc_weighted"] for r in a["rounds"]] == [r["acc_weighted"] for r in b["rounds"]]
    assert "holdout" not in a["summary"]


@pytest.mark.parametrize("bad", [-1, 5, 7])
def test_holdout_must_leave_a_trainer(bad: int):
    with pytest.raises(ConfigError, match="eval.holdout_clients"):
        from_dict(tiny_raw(data=SMALL, eval={"holdout_clients": bad}))


def test_any_method_can_report_before_and_after_fine_tuning():
    raw = tiny_raw(data=SMALL, train={"rounds": 2, "finetune_epochs": 1})
    raw["algorithm"] = {"name": "fedavg"}
    doc = run_experiment(from_dict(raw), progress=False)
    after = doc["summary"]["after_finetune"]["acc_weighted"]
    before = doc["summary"]["final"]["acc_weighted"]
    assert after != before  # the personal fine-tuning moved the global model
    assert all("finetuned_acc" in c for c in doc["clients"])
    none = run_experiment(from_dict(tiny_raw(data=SMALL, train={"rounds": 2})), progress=False)
    assert "after_finetune" not in none["summary"]  # -1: FedAvg's own default is none
