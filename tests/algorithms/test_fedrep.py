"""FedRep: head epochs with the encoder frozen, then encoder epochs with the head frozen."""

import copy
import math

import pytest
import torch
from helpers.toyfed import make_toy, run_toy, settings

from fedmosaic.algorithms import build_algorithm
from fedmosaic.algorithms.fedrep import FedRep
from fedmosaic.config import ConfigError
from fedmosaic.core import client as client_ops
from fedmosaic.core import seeding
from fedmosaic.core.training import run_phases


def _state(module: torch.nn.Module) -> dict:
    return copy.deepcopy(module.state_dict())


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _all_changed(a: dict, b: dict) -> bool:
    return all(not torch.equal(a[k], b[k]) for k in a)


def test_phases_head_then_encoder():
    head, enc = FedRep(head_epochs=3).phases(1, 2)
    assert (head.trainable, head.epochs) == (("head",), 3)
    assert (enc.trainable, enc.epochs) == (("encoder",), 2)
    assert FedRep().head_epochs == 1  # PFLlib's -pls default


def test_head_phase_freezes_encoder_and_encoder_phase_freezes_head():
    algo = FedRep()
    fed = make_toy(algo)
    model, extras, data = fed.models[0], fed.extras[0], fed.clients[0]
    msg = algo.broadcast(algo.init_server(fed.spec), 0, 1)
    head_phase, enc_phase = algo.phases(1, 1)
    gen = torch.Generator().manual_seed(0)

    enc0, head0 = _state(model.encoder), _state(model.head)
    run_phases(algo, model, extras, msg, data, [head_phase], settings(), gen)
    enc1, head1 = _state(model.encoder), _state(model.head)
    assert _same(enc0, enc1)  # encoder frozen in the head phase
    assert _all_changed(head0, head1)

    run_phases(algo, model, extras, msg, data, [enc_phase], settings(), gen)
    enc2, head2 = _state(model.encoder), _state(model.head)
    assert _same(head1, head2)  # head frozen in the encoder phase
    assert _all_changed(enc1, enc2)
    assert all(p.requires_grad for p in model.parameters())  # unfrozen afterwards


def test_fit_runs_head_phase_first_and_uploads_only_the_encoder():
    algo = FedRep(head_epochs=2)
    msg = algo.broadcast(algo.init_server(make_toy(algo).spec), 0, 1)

    fed = make_toy(algo)
    out = client_ops.fit(
        algo, fed.models[0], fed.extras[0], msg, fed.clients[0], settings(), 0, 1, 1
    )
    assert set(out.upload.state) == set(fed.models[0].encoder.state_dict())

    # The same client trained by hand: head phase, then encoder phase, same streams.
    ref = make_toy(algo)
    model = ref.models[0]
    algo.receive(model, ref.extras[0], msg)
    seeding.seed_torch(0, 1, 0, "fit")
    gen = seeding.torch_generator(0, 1, 0, "batches")
    head_phase, enc_phase = algo.phases(1, 1)
    run_phases(algo, model, ref.extras[0], msg, ref.clients[0], [head_phase], settings(), gen)
    run_phases(algo, model, ref.extras[0], msg, ref.clients[0], [enc_phase], settings(), gen)
    assert _same(model.state_dict(), fed.models[0].state_dict())


def test_head_epochs_zero_keeps_the_initial_head():
    algo = FedRep(head_epochs=0)
    fed = make_toy(algo)
    msg = algo.broadcast(algo.init_server(fed.spec), 0, 1)
    head0 = _state(fed.models[0].head)
    client_ops.fit(algo, fed.models[0], fed.extras[0], msg, fed.clients[0], settings(), 0, 1, 1)
    assert _same(head0, _state(fed.models[0].head))
    with pytest.raises(ConfigError, match="head_epochs"):
        build_algorithm({"name": "fedrep", "head_epochs": -1})


def test_two_rounds_toy_with_wire_check():
    fed = run_toy(FedRep(), rounds=2, check_wire=True)
    for r in fed.history.rounds:
        assert r["rejected"] == [] and 0.0 <= r["acc_weighted"] <= 1.0
    assert set(fed.state) == set(fed.models[0].encoder.state_dict())


def test_rejects_heterogeneous_family():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict

    assert FedRep.supports_heterogeneous is False
    with pytest.raises(ConfigError, match="needs identical client models"):
        from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedrep"}))


@pytest.mark.integration
def test_two_rounds_end_to_end_single_arch():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(model={"family": "cnn1"}, algorithm={"name": "fedrep", "head_epochs": 2})
    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
