"""FedPer: the encoder is shared and averaged, the head stays local, both train jointly."""

import copy
import math

import pytest
import torch
from helpers.toyfed import make_toy, run_toy, settings

from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedper import FedPer
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Weighted


def _changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_receive_loads_the_encoder_and_keeps_the_head():
    fed = make_toy(FedPer())
    model, other = fed.models[1], fed.models[2]
    head = copy.deepcopy(model.head.state_dict())
    FedPer().receive(model, fed.extras[1], SharedState(other.part_state("encoder")))
    enc, oenc = model.encoder.state_dict(), other.encoder.state_dict()
    assert all(torch.equal(enc[k], oenc[k]) for k in oenc)
    assert not _changed(head, model.head.state_dict())


def test_fit_trains_encoder_and_head_jointly_and_uploads_only_the_encoder():
    algo = FedPer()
    fed = make_toy(algo)
    msg = algo.broadcast(algo.init_server(fed.spec), 0, 1)
    model = fed.models[0]
    head_before = copy.deepcopy(model.head.state_dict())
    out = client_ops.fit(algo, model, fed.extras[0], msg, fed.clients[0], settings(), 0, 1, 1)
    assert set(out.upload.state) == set(model.encoder.state_dict())  # no head entries
    # Joint training: the received encoder and the local head both moved.
    assert _changed(msg.state, out.upload.state) == set(msg.state)
    assert _changed(head_before, model.head.state_dict()) == set(head_before)
    assert out.num_examples == fed.clients[0].num_train


def test_joint_phase_trains_everything():
    assert [p.trainable for p in FedPer().phases(1, 3)] == [("all",)]
    assert [p.epochs for p in FedPer().phases(1, 3)] == [3]


def test_aggregate_is_the_sample_weighted_mean_of_encoders():
    algo = FedPer()
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([4.0, 8.0])}
    out = algo.aggregate(a, [Weighted(0, 2.0, SharedState(a)), Weighted(1, 1.0, SharedState(b))], 1)
    assert torch.allclose(out["w"], torch.tensor([2.0, 4.0]))  # (2*[1,2] + [4,8]) / 3


def test_two_rounds_toy_with_wire_check():
    fed = run_toy(FedPer(), rounds=2, check_wire=True)
    for r in fed.history.rounds:
        assert r["rejected"] == [] and 0.0 <= r["acc_weighted"] <= 1.0
    assert set(fed.state) == set(fed.models[0].encoder.state_dict())
    # Heads stay personal: after the round they differ across clients.
    h0, h1 = fed.models[0].head.weight, fed.models[1].head.weight
    assert not torch.equal(h0, h1)


def test_homogeneous_only():
    assert FedPer.supports_heterogeneous is False


def test_rejects_heterogeneous_family():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="needs identical client models"):
        from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedper"}))


@pytest.mark.integration
def test_two_rounds_end_to_end_single_arch():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    doc = run_experiment(
        from_dict(tiny_raw(model={"family": "cnn1"}, algorithm={"name": "fedper"})),
        progress=False,
    )
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
