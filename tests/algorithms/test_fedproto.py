"""FedProto: aggregation, loss and nearest-prototype prediction against hand-computed numbers."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.toyfed import make_toy, run_toy
from torch import nn

from fedmosaic.algorithms import build_algorithm
from fedmosaic.algorithms.fedproto import (
    FedProto,
    ProtoBroadcast,
    ProtoUpload,
    aggregate_prototypes,
    nearest_prototype_scores,
)
from fedmosaic.algorithms.local import Local
from fedmosaic.config import ConfigError
from fedmosaic.core.algorithm import FederationSpec, Weighted
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import PayloadError

# Three clients, two classes, d = 2; client A lacks class 1, client C lacks class 0.
PROTOS = torch.tensor(
    [
        [[1.0, 2.0], [0.0, 0.0]],  # A: class 0 from 2 examples, no class 1
        [[3.0, 6.0], [0.0, 4.0]],  # B: class 0 from 1 example, class 1 from 3
        [[0.0, 0.0], [2.0, 0.0]],  # C: no class 0, class 1 from 1 example
    ]
)
COUNTS = torch.tensor([[2, 0], [1, 3], [0, 1]])


def _spec(num_classes=2, feature_dim=2):
    return FederationSpec(
        num_clients=3,
        num_classes=num_classes,
        feature_dim=feature_dim,
        input_shape=(1, 1, feature_dim),
        members=("a", "b", "c"),
        num_train=(2, 4, 1),
        seed=0,
        rounds=1,
        build_model=lambda i: None,  # type: ignore[arg-type, return-value]
    )


def _uploads():
    # Weights (example counts) deliberately unrelated to the per-class counts.
    return [
        Weighted(k, 100.0 * (k + 1), ProtoUpload(PROTOS[k].clone(), COUNTS[k].clone()))
        for k in range(3)
    ]


def test_aggregate_count_weighted_hand_computed():
    algo = FedProto(weighting="count")
    state = algo.aggregate(algo.init_server(_spec()), _uploads(), 1)
    # class 0: (2*[1,2] + 1*[3,6]) / 3 = [5/3, 10/3]; class 1: (3*[0,4] + 1*[2,0]) / 4 = [0.5, 3]
    expected = torch.tensor([[5 / 3, 10 / 3], [0.5, 3.0]])
    assert torch.allclose(state.protos, expected)
    assert state.known.tolist() == [True, True]
    assert state.protos.dtype == torch.float32


def test_aggregate_uniform_hand_computed():
    algo = FedProto(weighting="uniform")
    state = algo.aggregate(algo.init_server(_spec()), _uploads(), 1)
    # class 0: ([1,2] + [3,6]) / 2 = [2, 4]; class 1: ([0,4] + [2,0]) / 2 = [1, 2]
    assert torch.allclose(state.protos, torch.tensor([[2.0, 4.0], [1.0, 2.0]]))


def test_aggregate_class_nobody_has_is_unknown():
    protos = torch.cat([PROTOS, torch.full((3, 1, 2), 7.0)], dim=1)  # junk row for class 2
    counts = torch.cat([COUNTS, torch.zeros(3, 1, dtype=torch.long)], dim=1)
    for weighting in ("count", "uniform"):
        mean, known = aggregate_prototypes(protos, counts, weighting)
        assert known.tolist() == [True, True, False]
        assert mean[2].tolist() == [0.0, 0.0]  # junk of absent classes never leaks in


def test_validate_upload_rejects_bad_shapes_dtypes_counts():
    algo = FedProto()
    state = algo.init_server(_spec())
    good = ProtoUpload(PROTOS[1].clone(), COUNTS[1].clone())
    algo.validate_upload(state, good, 1)
    bad = [
        ProtoUpload(torch.zeros(3, 2), COUNTS[1].clone()),  # wrong C
        ProtoUpload(torch.zeros(2, 5), COUNTS[1].clone()),  # wrong d
        ProtoUpload(torch.zeros(2, 2, dtype=torch.float64), COUNTS[1].clone()),
        ProtoUpload(PROTOS[1].clone(), COUNTS[1].float()),
        ProtoUpload(PROTOS[1].clone(), torch.tensor([1, -1])),
        ProtoUpload(PROTOS[1].clone(), torch.tensor([1, 2, 3])),
    ]
    for upload in bad:
        with pytest.raises(PayloadError, match="client 1"):
            algo.validate_upload(state, upload, 1)


def test_weighting_is_validated_by_config():
    with pytest.raises(ConfigError, match="weighting"):
        build_algorithm({"name": "fedproto", "weighting": "median"})
    assert build_algorithm({"name": "fedproto", "lam": 0.1}) == FedProto(lam=0.1)


def _identity_model() -> ClientModel:
    """features = the input itself (d = 2); head = identity logits (C = 2)."""
    head = nn.Linear(2, 2)
    with torch.no_grad():
        head.weight.copy_(torch.eye(2))
        head.bias.zero_()
    return ClientModel(nn.Flatten(), head, feature_dim=2, num_classes=2)


def _logsumexp_ce(rows, labels):
    return sum(math.log(sum(math.exp(v) for v in r)) - r[c] for r, c in zip(rows, labels)) / len(
        rows
    )


def test_loss_hand_computed_with_a_missing_class():
    rows = [[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]
    y = torch.tensor([0, 1, 1])
    x = torch.tensor(rows).view(3, 1, 1, 2)
    msg = ProtoBroadcast(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([True, False]))
    loss = FedProto(lam=2.0).loss(_identity_model(), nn.Module(), x, y, msg)
    # Only row 0 has a prototype: ((1-1)^2 + (2-1)^2) / (B*d = 6); rows of class 1 add 0.
    expected = _logsumexp_ce(rows, [0, 1, 1]) + 2.0 * (1.0 / 6.0)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)


def test_euclidean_client_term_hand_computed():
    """``distance = "euclidean"`` (FedTGP's form of FedProto's term): mean over the B rows of
    ``||f(x) - P[y]||_2``, rows without a prototype adding 0."""
    rows = [[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]
    y = torch.tensor([0, 0, 1])
    x = torch.tensor(rows).view(3, 1, 1, 2)
    msg = ProtoBroadcast(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([True, False]))
    loss = FedProto(lam=0.5, distance="euclidean").loss(_identity_model(), nn.Module(), x, y, msg)
    # row 0: ||(0, 1)|| = 1; row 1: ||(2, 3)|| = sqrt(13); row 2: no prototype, 0; mean over 3
    expected = _logsumexp_ce(rows, [0, 0, 1]) + 0.5 * (1.0 + math.sqrt(13.0)) / 3.0
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    mse = FedProto(lam=0.5).loss(_identity_model(), nn.Module(), x, y, msg)
    assert float(mse.detach()) != pytest.approx(expected, rel=1e-3)  # the default stays MSE
    with pytest.raises(ValueError, match="distance"):
        FedProto(distance="cosine")


def test_rows_without_prototype_get_only_the_ce_gradient():
    model = _identity_model()
    y = torch.tensor([0, 1, 1])
    msg = ProtoBroadcast(torch.tensor([[1.0, 1.0], [5.0, 5.0]]), torch.tensor([True, False]))
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]).view(3, 1, 1, 2).requires_grad_()
    FedProto(lam=3.0).loss(model, nn.Module(), x, y, msg).backward()
    x_ce = x.detach().clone().requires_grad_()
    F.cross_entropy(model(x_ce), y).backward()
    # Class-1 rows: exactly the CE gradient (the junk prototype [5, 5] is ignored).
    assert torch.equal(x.grad[1:], x_ce.grad[1:])
    # Class-0 row: CE gradient + lam * 2 (f - P) / (B*d) = + 3 * 2 * [0, 1] / 6.
    assert torch.allclose(x.grad[0] - x_ce.grad[0], torch.tensor([[[0.0, 1.0]]]))
    # No prototype at all: the loss is CE exactly.
    none = ProtoBroadcast(torch.zeros(2, 2), torch.tensor([False, False]))
    xx = x.detach()
    assert torch.equal(
        FedProto(lam=3.0).loss(model, nn.Module(), xx, y, none), F.cross_entropy(model(xx), y)
    )


def test_nearest_prototype_prediction_on_hand_placed_prototypes():
    protos = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    known = torch.tensor([True, True, False])
    feats = torch.tensor([[1.0, 1.0], [9.0, 1.0], [0.0, 9.0], [6.0, 0.0]])
    scores = nearest_prototype_scores(feats, protos, known)
    # [0, 9] is nearest to the unknown class 2, so the nearest *known* one (class 0, distance 9).
    assert scores.argmax(1).tolist() == [0, 1, 0, 1]
    assert torch.allclose(scores[0, :2], torch.tensor([-math.sqrt(2.0), -math.sqrt(82.0)]))
    assert scores[:, 2].eq(float("-inf")).all()


def test_predict_reports_head_accuracy_and_falls_back_before_prototypes():
    model = _identity_model()
    x = torch.tensor([[4.0, 0.0], [0.0, 1.0]]).view(2, 1, 1, 2)
    # Prototypes that disagree with the (identity) head on both rows.
    msg = ProtoBroadcast(torch.tensor([[0.0, 1.0], [4.0, 0.0]]), torch.tensor([True, True]))
    out = FedProto().predict(model, nn.Module(), x, msg)
    assert out["acc"].argmax(1).tolist() == [1, 0]
    assert out["acc_head"].argmax(1).tolist() == [0, 1]
    empty = ProtoBroadcast(torch.zeros(2, 2), torch.tensor([False, False]))
    out = FedProto().predict(model, nn.Module(), x, empty)
    assert torch.equal(out["acc"], out["acc_head"])


def test_upload_is_exact_class_means_in_eval_mode():
    fed = make_toy(FedProto())
    model, data = fed.models[0], fed.clients[0]
    model.train()
    msg = FedProto().broadcast(FedProto().init_server(fed.spec), 0, 1)
    with torch.no_grad():
        up = FedProto().upload(model, nn.Module(), data, msg)
    assert model.training  # restored
    feats = model.eval().features(data.source.batch(data.rows("train")))
    y = data.targets("train")
    for c in range(3):
        n = int((y == c).sum())
        assert int(up.counts[c]) == n
        if n:
            assert torch.allclose(up.protos[c], feats[y == c].mean(0), atol=1e-6)
        else:
            assert up.protos[c].abs().sum() == 0  # client 0 lacks class 2
    assert up.counts.dtype == torch.int64 and up.protos.dtype == torch.float32


def test_lam0_trains_like_local():
    """Same seeds, lam = 0: identical training, so FedProto's head accuracy == Local's accuracy."""
    proto = run_toy(FedProto(lam=0.0), rounds=3, heterogeneous=True)
    local = run_toy(Local(), rounds=3, heterogeneous=True)
    for rp, rl in zip(proto.history.rounds, local.history.rounds, strict=True):
        assert rp["train_loss"] == rl["train_loss"]
        for stat in ("weighted", "mean", "std", "min", "max"):
            assert rp[f"acc_head_{stat}"] == rl[f"acc_{stat}"]
    for a, b in zip(proto.models, local.models, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # With lam > 0 the prototypes change training from round 2 on.
    pulled = run_toy(FedProto(lam=1.0), rounds=3, heterogeneous=True)
    assert pulled.history.rounds[0]["train_loss"] == local.history.rounds[0]["train_loss"]
    assert pulled.history.rounds[2]["train_loss"] != local.history.rounds[2]["train_loss"]


def test_two_rounds_heterogeneous_toy_with_wire_check():
    fed = run_toy(FedProto(), rounds=2, heterogeneous=True, check_wire=True)
    assert fed.spec.homogeneous is False
    # Every class is held by some client: all prototypes known after aggregation.
    assert fed.state.known.tolist() == [True, True, True]
    for r in fed.history.rounds:
        assert r["rejected"] == [] and r["bytes_up"] > 0 and r["bytes_down"] > 0
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_head_weighted"] <= 1.0


@pytest.mark.integration
def test_two_rounds_end_to_end_heterogeneous_family():
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedproto"})
    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_head_weighted"] <= 1.0
    assert all("acc_head" in c for c in doc["clients"])


def test_default_server_mean_is_the_reference_codes_plain_mean():
    # The authors' code, PFLlib and HtFLlib: plain mean over the holders of each class.
    algo = FedProto()
    assert algo.weighting == "uniform"
    state = algo.aggregate(algo.init_server(_spec()), _uploads(), 1)
    # class 0: ([1,2] + [3,6]) / 2 = [2, 4]; class 1: ([0,4] + [2,0]) / 2 = [1, 2]
    assert torch.allclose(state.protos, torch.tensor([[2.0, 4.0], [1.0, 2.0]]))
    mean, _ = aggregate_prototypes(PROTOS, COUNTS)
    assert torch.allclose(mean, state.protos)


def test_inference_own_classes_only():
    from fedmosaic.algorithms.fedproto import OwnClasses

    model = _identity_model()
    # Three classes; the client holds classes 1 and 2 only (no training example of class 0).
    protos = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    msg = ProtoBroadcast(protos, torch.tensor([True, True, True]))
    extras = OwnClasses(torch.tensor([False, True, True]))
    x = torch.tensor([[2.0, 1.0], [4.0, 1.0], [1.0, 6.0]]).view(3, 1, 1, 2)
    # Distances: row 0 -> [2.24, 8.06, 9.22]; row 1 -> [4.12, 6.08, 9.85]; row 2 -> [6.08, 10.8,
    # 4.12]: the nearest of all classes is 0, 0, 2; of the client's own classes 1, 1, 2.
    paper = FedProto().predict(model, extras, x, msg)["acc"]
    assert paper.argmax(1).tolist() == [0, 0, 2]
    own = FedProto(inference="own").predict(model, extras, x, msg)["acc"]
    assert own.argmax(1).tolist() == [1, 1, 2]  # class 0 is never predicted
    assert own[:, 0].eq(float("-inf")).all()
    assert own[1, 1].item() == pytest.approx(-math.sqrt(37.0))
    # No overlap between the client's classes and the known prototypes: the head decides.
    only0 = ProtoBroadcast(protos, torch.tensor([True, False, False]))
    out = FedProto(inference="own").predict(model, extras, x, only0)
    assert torch.equal(out["acc"], out["acc_head"])


def test_own_classes_come_from_the_training_split():
    fed = make_toy(FedProto(inference="own"))
    for model, data in zip(fed.models, fed.clients, strict=True):
        extras = FedProto(inference="own").init_client(model, fed.spec, data)
        assert extras.own.tolist() == (data.class_counts("train") > 0).tolist()


def test_inference_is_validated_by_config():
    with pytest.raises(ConfigError, match="inference"):
        build_algorithm({"name": "fedproto", "inference": "nearest"})
    assert build_algorithm({"name": "fedproto", "inference": "own"}) == FedProto(inference="own")
