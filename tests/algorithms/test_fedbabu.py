"""FedBABU: fixed shared head, body-only averaging and payloads, fine-tuning after the last round."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.toyfed import make_toy

from fedmosaic.algorithms import ALGORITHMS, build_algorithm
from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedbabu import BodyUpload, FedBABU
from fedmosaic.config import ConfigError
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Phase, Weighted
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.rounds import RoundPlan, run_rounds
from fedmosaic.models.flops import training_macs


def run_toy_rounds(algo: FedBABU, rounds: int = 3, finetune_epochs: int = 0):
    fed = make_toy(algo)
    spec = dataclasses.replace(fed.spec, rounds=rounds)
    plan = RoundPlan(spec.num_clients, rounds, spec.num_clients, 1, finetune_epochs)
    fed.history, fed.state = run_rounds(algo, spec, fed.transport, plan)
    return fed


def test_defaults_and_finetune_phases():
    assert ALGORITHMS.get("fedbabu") is FedBABU
    algo = FedBABU()
    assert (algo.finetune_epochs, algo.finetune_part) == (5, "all")
    assert not FedBABU.supports_heterogeneous
    assert algo.phases(1, 2) == (Phase(("encoder",), 2, name="body"),)
    assert algo.finetune_phases(None) == (Phase(("all",), 5, name="finetune"),)
    assert algo.finetune_phases(2) == (Phase(("all",), 2, name="finetune"),)
    assert algo.finetune_phases(0) == ()
    assert FedBABU(finetune_part="head").finetune_phases(None)[0].trainable == ("head",)
    with pytest.raises(ConfigError, match="finetune_part"):
        build_algorithm({"name": "fedbabu", "finetune_part": "encoder"})
    with pytest.raises(ConfigError, match="finetune_epochs"):
        build_algorithm({"name": "fedbabu", "finetune_epochs": -1})


def test_head_is_the_servers_init_on_every_client_and_never_trains():
    fed = make_toy(FedBABU())
    # the clients' own initializations differ, so identical heads come from the server's init
    assert not torch.equal(fed.spec.build_model(1).head.weight, fed.spec.build_model(0).head.weight)
    init = fed.spec.build_model(0)
    algo = FedBABU()
    plan = RoundPlan(3, 3, 3, 1, 0)
    history, state = run_rounds(algo, fed.spec, fed.transport, plan)
    assert all(r["rejected"] == [] for r in history.rounds)
    for m in fed.models:
        for k, v in init.head.state_dict().items():
            assert torch.equal(m.head.state_dict()[k], v)
        # the body is the server's average (received for the final evaluation)
        for k, v in m.encoder.state_dict().items():
            assert torch.equal(v, state[k])
    assert not torch.equal(state["1.weight"], init.encoder.state_dict()["1.weight"])  # it learned
    assert set(state) == set(init.encoder.state_dict())  # the server holds the body only


def test_payloads_carry_the_body_only_with_hand_counted_flops():
    fed = run_toy_rounds(FedBABU(), rounds=1)
    algo, model, data = FedBABU(), fed.models[0], fed.clients[0]
    msg = algo.broadcast(fed.state, 0, 2)
    assert isinstance(msg, SharedState) and set(msg.state) == {
        "1.weight",
        "1.bias",
        "3.weight",
        "3.bias",
    }
    out = client_ops.fit(algo, model, fed.extras[0], msg, data, fed.transport.settings, 0, 2, 1)
    up = out.upload
    assert isinstance(up, BodyUpload) and set(up.state) == set(msg.state)
    # 22 training examples, batch 8, every example (train.drop_last = false): 22 in one epoch
    assert data.num_train == 22
    assert up.train_macs == training_macs(model, (1, 3, 4), ("encoder",), 22)
    # per image: forward 12*8 + 8*4 + 4*3 = 140; backward 96 + (32 + 32) + 12 = 172
    assert up.train_macs == (140 + 172) * 22
    algo.validate_upload(fed.state, up, 0)
    with pytest.raises(PayloadError):
        algo.validate_upload(fed.state, dataclasses.replace(up, train_macs=-1), 0)
    with pytest.raises(PayloadError):
        algo.validate_upload(fed.state, dataclasses.replace(up, paper_cost=-1), 0)
    bad = dict(up.state, **{"1.bias": torch.zeros(3)})
    with pytest.raises(PayloadError):
        algo.validate_upload(fed.state, BodyUpload(bad, 0, 0), 0)


def test_aggregation_is_sample_weighted_over_the_body():
    algo = FedBABU()
    state = {"w": torch.zeros(2)}
    a = BodyUpload({"w": torch.tensor([1.0, 2.0])}, 0, 0)
    b = BodyUpload({"w": torch.tensor([3.0, 6.0])}, 0, 0)
    new = algo.aggregate(state, [Weighted(0, 1.0, a), Weighted(1, 3.0, b)], 1)
    assert torch.equal(new["w"], torch.tensor([2.5, 5.0]))  # (1*1 + 3*3)/4, (1*2 + 3*6)/4


@pytest.mark.parametrize("part", ["all", "head"])
def test_finetuning_moves_the_head(part):
    fed = run_toy_rounds(FedBABU(finetune_epochs=2, finetune_part=part), finetune_epochs=-1)
    init_head = fed.spec.build_model(0).head.weight
    assert len(fed.history.finetune_eval) == 3 and len(fed.history.final_eval) == 3
    for m in fed.models:
        assert not torch.equal(m.head.weight, init_head)
        body_kept = all(torch.equal(v, fed.state[k]) for k, v in m.encoder.state_dict().items())
        assert body_kept == (part == "head")  # head-only fine-tuning leaves the shared body


@pytest.mark.integration
def test_two_rounds_on_the_zoo_with_wire_check_and_finetuning():
    models = pytest.importorskip("fedmosaic.models")
    if not hasattr(models, "family_members"):
        pytest.skip("the model zoo (fedmosaic.models) is not there yet")
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(
        model={"family": "shallowcnn"},
        train={"finetune_epochs": 1},
        algorithm={"name": "fedbabu"},
    )
    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(r["rejected"] == [] for r in doc["rounds"])
    summary = doc["summary"]
    assert "after_finetune" in summary and 0.0 <= summary["after_finetune"]["acc_weighted"] <= 1.0
    assert all("finetuned_acc" in c for c in doc["clients"])
