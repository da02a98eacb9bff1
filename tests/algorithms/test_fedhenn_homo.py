"""Homogeneous FedHeNN: eta0 = 0 is FedAvg, the CKA proximal term, payloads, end to end."""

import math

import pytest
import torch
import torch.nn.functional as F
from _bnclient import BN_MEMBERS, bn_buffers, bn_data, bn_model, shifted_rad
from helpers.experiments import tiny_raw
from helpers.toyfed import CLASS_MEANS, means_client, run_toy, toy_model
from helpers.toyfed import NUM_CLASSES as C

from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedavg import FedAvg
from fedmosaic.algorithms.fedhenn import cka, cka_distance, kernel_matrix
from fedmosaic.algorithms.fedhenn_homo import FedHeNNHomo, HomoBroadcast
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import FederationSpec, FitContext
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.training import TrainSettings


def _spec(public) -> FederationSpec:
    def build(i: int):
        torch.manual_seed(0)
        return toy_model()

    return FederationSpec(3, C, 4, CLASS_MEANS.shape, ("a",) * 3, (8, 8, 8), 0, 2, build, public)


def _numbers(fed):
    return [(r["acc_weighted"], r["train_loss"]) for r in fed.history.rounds]


def test_eta0_zero_is_fedavg_exactly():
    avg = run_toy(FedAvg(), CLASS_MEANS, rounds=3, heterogeneous=False)
    henn0 = run_toy(FedHeNNHomo(eta0=0.0, rad_size=8), CLASS_MEANS, rounds=3, heterogeneous=False)
    assert _numbers(avg) == _numbers(henn0)
    assert all(torch.equal(henn0.state.weights[k], v) for k, v in avg.state.items())
    henn = run_toy(FedHeNNHomo(eta0=1.0, rad_size=8), CLASS_MEANS, rounds=3, heterogeneous=False)
    assert _numbers(henn) != _numbers(avg)
    for r in henn.history.rounds:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])


def test_global_kernel_is_the_received_models_and_starts_aligned():
    public = torch.randn(20, *CLASS_MEANS.shape)
    algo = FedHeNNHomo(eta0=0.5, rad_size=10)
    spec = _spec(public)
    state = algo.init_server(spec)
    msg = algo.broadcast(state, 0, 4)
    assert msg.eta == pytest.approx(1.0)  # 0.5 * sqrt(4)
    torch.manual_seed(3)
    model = toy_model()  # different weights from the global model until it receives them
    data = means_client()
    extras = algo.init_client(model, spec, data)
    algo.receive(model, extras, msg)
    algo.before_fit(FitContext(model, extras, data, msg, TrainSettings(), torch.Generator(), 1))
    with torch.no_grad():
        global_model = spec.build_model(0).eval()
        want = kernel_matrix(global_model.features(msg.rad))
    assert torch.allclose(extras.k_global, want)
    # At the start of local training the model is the global model: the CKA term is 0.
    x, y = torch.randn(6, *CLASS_MEANS.shape), torch.tensor([0, 1, 2, 0, 1, 2])
    model.train()
    ce = F.cross_entropy(model(x), y)
    assert torch.allclose(algo.loss(model, extras, x, y, msg), ce, atol=1e-5)
    # After the model moves, the term is eta * (1 - CKA(K_i, K_global)).
    with torch.no_grad():
        model.encoder[1].weight.mul_(-1.5).add_(0.3)
    ce = F.cross_entropy(model(x), y)
    k_i = kernel_matrix(model.features(msg.rad))
    want = ce + 1.0 * (1 - cka(k_i, extras.k_global))
    assert torch.allclose(algo.loss(model, extras, x, y, msg), want, atol=1e-5)
    assert float((want - ce).detach()) > 0


@pytest.mark.parametrize(("family", "member"), BN_MEMBERS)
@pytest.mark.integration
def test_batchnorm_statistics_untouched_and_one_mode_for_both_kernels(family, member):
    algo = FedHeNNHomo(rad_size=6)
    received = bn_model(family, member, seed=3).part_state("all")  # W(t-1), its statistics too

    def fit(eta: float, lr: float):
        model = bn_model(family, member)
        extras = algo.init_client(model, None, bn_data())  # type: ignore[arg-type]
        msg = HomoBroadcast(received, shifted_rad(), eta, 2)
        settings = TrainSettings(batch_size=4, lr=lr)  # 8 examples: two steps
        client_ops.fit(algo, model, extras, msg, bn_data(), settings, 0, 2, 1)
        return model

    # lr = 0: weights fixed, the RAD pass (inputs shifted by +3) is the only difference.
    got, want = bn_buffers(fit(1.0, 0.0)), bn_buffers(fit(0.0, 0.0))
    assert len(want) > 20 and got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    counts = [int(v) for k, v in bn_buffers(fit(1.0, 0.05)).items() if "num_batches" in k]
    assert counts and set(counts) == {2}  # one per training batch
    # At the received weights K_i (the loss's, with gradient) is K_global (eval, before training).
    model = bn_model(family, member)
    extras = algo.init_client(model, None, bn_data())  # type: ignore[arg-type]
    msg = HomoBroadcast(received, shifted_rad(), 1.0, 2)
    algo.receive(model, extras, msg)
    algo.before_fit(
        FitContext(model, extras, bn_data(), msg, TrainSettings(), torch.Generator(), 1)
    )
    model.train()
    dist = cka_distance(model, msg.rad, extras.k_global, "linear", 1.0)
    assert float(dist.detach()) == pytest.approx(0.0, abs=1e-5)
    assert all(m.training for m in model.modules())


def test_payloads_validation_and_config():
    public = torch.randn(20, *CLASS_MEANS.shape)
    algo = FedHeNNHomo(rad_size=50)
    state = algo.init_server(_spec(public))
    assert state.rad_size == 20 and algo.broadcast(state, 0, 1).rad.shape == (
        20,
        *CLASS_MEANS.shape,
    )
    assert not FedHeNNHomo.supports_heterogeneous and FedHeNNHomo.Upload is SharedState
    good = SharedState({k: v.clone() for k, v in state.weights.items()})
    algo.validate_upload(state, good, 0)
    bad = dict(good.state)
    bad["head.weight"] = torch.zeros(C + 1, 4)
    with pytest.raises(PayloadError):
        algo.validate_upload(state, SharedState(bad), 1)
    with pytest.raises(ConfigError, match="public_size"):
        algo.check(_spec(None))
    with pytest.raises(ConfigError):
        algo.init_server(_spec(None))


@pytest.mark.integration
def test_two_rounds_with_config_and_wire_check():
    raw = tiny_raw(
        model={"family": "fedavgcnn"}, algorithm={"name": "fedhenn_homo", "rad_size": 20}
    )
    from fedmosaic.experiment import run_experiment

    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(r["rejected"] == [] for r in doc["rounds"])


def test_acc_is_the_global_model_and_acc_local_the_clients_own():
    """Table 1 scores the received global model (``acc``), Table 2 each client's own model as its
    local training left it (``acc_local``, stored at upload)."""
    public = torch.randn(20, *CLASS_MEANS.shape)
    algo = FedHeNNHomo(eta0=0.5, rad_size=10)
    spec = _spec(public)
    torch.manual_seed(3)
    model, data = toy_model(), means_client()
    extras = algo.init_client(model, spec, data)
    x = torch.randn(6, *CLASS_MEANS.shape)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # "after local training"
        own = model(x)
    msg = algo.broadcast(algo.init_server(spec), 0, 1)
    algo.upload(model, extras, data, msg)
    algo.receive(model, extras, msg)  # the next round's global model
    model.eval()
    with torch.no_grad():
        out = algo.predict(model, extras, x, msg)
        glob = model(x)
    assert torch.equal(out["acc"], glob) and torch.equal(out["acc_local"], own)
    assert not torch.equal(out["acc"], out["acc_local"])
    # the stored model travels with the extras (checkpoints, offloaded clients)
    assert any(k.startswith("local.") for k in extras.state_dict())
