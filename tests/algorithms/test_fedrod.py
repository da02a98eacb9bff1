"""FedRoD: balanced softmax on hand-computed numbers; the personal head never trains the encoder."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.toyfed import make_toy, run_toy, settings
from torch import nn

from fedmosaic.algorithms.fedrod import (
    FedRoD,
    PersonalHead,
    balanced_softmax_logits,
    balanced_softmax_loss,
)
from fedmosaic.config import ConfigError
from fedmosaic.core import client as client_ops
from fedmosaic.core.model import ClientModel


def test_balanced_softmax_logits_hand_computed():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    counts = torch.tensor([1, 4, 2])
    out = balanced_softmax_logits(logits, counts)
    expected = torch.tensor(
        [[1.0, 2.0 + math.log(4), 0.5 + math.log(2)], [0.0, -1.0 + math.log(4), 3.0 + math.log(2)]]
    )
    assert torch.allclose(out, expected)
    # Row 0, label 0: -log(e^1 / (e^1 + 4 e^2 + 2 e^0.5)); row 1, label 2: likewise.
    l0 = -math.log(math.e / (math.e + 4 * math.e**2 + 2 * math.e**0.5))
    l1 = -math.log(2 * math.e**3 / (1 + 4 * math.e**-1 + 2 * math.e**3))
    loss = balanced_softmax_loss(logits, torch.tensor([0, 2]), counts)
    assert float(loss) == pytest.approx((l0 + l1) / 2, rel=1e-6)


def test_zero_count_class_drops_out_exactly_and_stays_finite():
    logits = torch.tensor([[1.0, 2.0, 5.0]], requires_grad=True)
    counts = torch.tensor([1, 4, 0])  # class 2 absent from this client's training data
    out = balanced_softmax_logits(logits, counts)
    assert out[0, 2] == float("-inf")
    loss = balanced_softmax_loss(logits, torch.tensor([1]), counts)
    # Softmax over the present classes only: -log(4 e^2 / (e^1 + 4 e^2)).
    assert float(loss.detach()) == pytest.approx(
        -math.log(4 * math.e**2 / (math.e + 4 * math.e**2)), rel=1e-6
    )
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2] == 0.0  # the absent class gets no push at all


def _model() -> ClientModel:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.ReLU())
    return ClientModel(enc, nn.Linear(4, 3), feature_dim=4, num_classes=3)


def test_personal_head_gradient_does_not_reach_the_generic_model():
    model = _model()
    torch.manual_seed(1)
    extras = PersonalHead(4, 3, torch.tensor([5, 2, 1]))
    x = torch.randn(6, 1, 3, 4)
    y = torch.tensor([0, 1, 2, 0, 0, 1])
    FedRoD().loss(model, extras, x, y, None).backward()  # type: ignore[arg-type]
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    personal_grads = {k: p.grad.clone() for k, p in extras.named_parameters()}

    # Generic part alone: balanced softmax of the generic model.
    ref_model = copy.deepcopy(model)
    ref_model.zero_grad()
    balanced_softmax_loss(ref_model(x), y, extras.class_counts).backward()
    for k, p in ref_model.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-7), k  # encoder and generic head

    # Personal part alone: CE(out_generic.detach() + out_personal) on detached features.
    ref_extras = copy.deepcopy(extras)
    ref_extras.zero_grad()
    with torch.no_grad():
        feats = model.features(x)
        out_g = model.head(feats)
    F.cross_entropy(out_g + ref_extras(feats), y).backward()
    for k, p in ref_extras.named_parameters():
        assert torch.allclose(personal_grads[k], p.grad, atol=1e-7), k
        assert p.grad.abs().sum() > 0


def test_predict_sums_generic_and_personal_logits():
    model = _model()
    extras = PersonalHead(4, 3, torch.tensor([1, 1, 1]))
    x = torch.randn(5, 1, 3, 4)
    out = FedRoD().predict(model, extras, x, None)  # type: ignore[arg-type]
    assert torch.allclose(out["acc_generic"], model(x))
    assert torch.allclose(out["acc"], model(x) + extras.head(model.features(x)))


def test_init_client_counts_labels_and_is_seeded():
    algo = FedRoD()
    a, b = make_toy(algo), make_toy(algo)
    for cid in range(3):
        ea = a.extras[cid]
        assert isinstance(ea, PersonalHead)
        assert ea.head.weight.shape == (3, 4)  # Linear(d, C), like the generic head
        assert torch.equal(ea.class_counts, a.clients[cid].class_counts("train"))
        assert torch.equal(ea.head.weight, b.extras[cid].head.weight)  # same seed, same init
    assert int(a.extras[0].class_counts[2]) == 0  # client 0 has no class 2
    assert not torch.equal(a.extras[0].head.weight, a.extras[1].head.weight)


def test_generic_personal_init_starts_from_a_copy_of_the_initial_generic_head():
    fed = make_toy(FedRoD(personal_init="generic"))
    for cid in range(3):
        head, personal = fed.models[cid].head, fed.extras[cid].head
        assert isinstance(personal, nn.Linear)
        assert torch.equal(personal.weight, head.weight) and torch.equal(personal.bias, head.bias)
        assert personal.weight.data_ptr() != head.weight.data_ptr()  # a copy, not shared
    fresh = make_toy(FedRoD())
    assert not torch.equal(fresh.extras[0].head.weight, fresh.models[0].head.weight)
    # the copy trains apart from the generic head it came from
    algo = FedRoD(personal_init="generic")
    msg = algo.broadcast(algo.init_server(fed.spec), 0, 1)
    start = fed.extras[0].head.weight.detach().clone()
    client_ops.fit(algo, fed.models[0], fed.extras[0], msg, fed.clients[0], settings(), 0, 1, 1)
    assert not torch.equal(fed.extras[0].head.weight, start)  # trained
    assert not torch.equal(fed.extras[0].head.weight, fed.models[0].head.weight)


def test_personal_init_rejects_an_unknown_start():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict

    raw = tiny_raw(model={"family": "cnn1"}, algorithm={"name": "fedrod", "personal_init": "zero"})
    with pytest.raises(ConfigError, match="personal_init"):
        from_dict(raw)


def test_fit_uploads_the_whole_generic_model_not_the_personal_head():
    algo = FedRoD()
    fed = make_toy(algo)
    msg = algo.broadcast(algo.init_server(fed.spec), 0, 1)
    model, extras = fed.models[0], fed.extras[0]
    personal0 = copy.deepcopy(extras.state_dict())
    out = client_ops.fit(algo, model, extras, msg, fed.clients[0], settings(), 0, 1, 1)
    assert set(out.upload.state) == set(model.state_dict())
    assert not torch.equal(personal0["head.weight"], extras.head.weight)  # personal head trained
    assert torch.equal(personal0["class_counts"], extras.class_counts)  # buffer untouched


def test_two_rounds_toy_with_wire_check():
    fed = run_toy(FedRoD(), rounds=2, check_wire=True)
    for r in fed.history.rounds:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_generic_weighted"] <= 1.0


def test_rejects_heterogeneous_family():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict

    assert FedRoD.supports_heterogeneous is False
    with pytest.raises(ConfigError, match="needs identical client models"):
        from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedrod"}))


@pytest.mark.integration
def test_two_rounds_end_to_end_single_arch():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    doc = run_experiment(
        from_dict(tiny_raw(model={"family": "cnn1"}, algorithm={"name": "fedrod"})),
        progress=False,
    )
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_generic_weighted"] <= 1.0
    assert all("acc_generic" in c for c in doc["clients"])
