"""FedTGP: adaptive margin, ACL server step, client loss, payloads, stale option, end to end."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.experiments import tiny_raw
from helpers.toyfed import CLASS_MEANS, means_client, run_toy, toy_model
from helpers.toyfed import FEATURE_DIM as D
from helpers.toyfed import NUM_CLASSES as C

from fedmosaic.algorithms.fedtgp import (
    ClientPrototypes,
    FedTGP,
    Prototypes,
    TGPState,
    acl_loss,
    adaptive_margin,
    alignment_loss,
    euclidean_distances,
    global_prototypes,
    nearest_prototype_scores,
    train_prototypes,
)
from fedmosaic.config import from_dict
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import FederationSpec, Weighted
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.training import TrainSettings


def _spec(c: int = C, d: int = D, seed: int = 0) -> FederationSpec:
    return FederationSpec(c, c, d, (1, 2, 6), ("a",) * c, (1,) * c, seed, 2, lambda i: None)


# ---- adaptive margin --------------------------------------------------------------------------
def test_adaptive_margin_three_hand_placed_prototypes():
    # Class centers Q0 = (0, 0), Q1 = (3, 0), Q2 = (0, 4): pairwise distances 3, 4, 5.
    # Per class, the distance to the nearest other class: 3, 3, 4 -> the maximum margin is 4
    # (not 5, the largest pairwise distance).
    # Class 0 is uploaded by two clients at (-1, 0) and (1, 0): unweighted mean (0, 0).
    points = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    labels = torch.tensor([0, 0, 1, 2])
    assert adaptive_margin(points, labels, 4, tau=100.0) == pytest.approx(4.0)
    assert adaptive_margin(points, labels, 4, tau=3.5) == pytest.approx(3.5)  # capped by tau
    # Only the classes present count; one class alone has no margin.
    assert adaptive_margin(points[:3], labels[:3], 4, tau=100.0) == pytest.approx(3.0)
    assert adaptive_margin(points[:2], labels[:2], 4, tau=100.0) == 0.0


def test_margin_modes():
    points = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    labels = torch.tensor([0, 1])
    assert FedTGP().margin_for(points, labels, 2) == pytest.approx(3.0)
    assert FedTGP(margin="fixed", fixed_margin=0.7).margin_for(points, labels, 2) == 0.7
    assert FedTGP(margin="none").margin_for(points, labels, 2) == 0.0
    with pytest.raises(ValueError):
        FedTGP(margin="huge")
    with pytest.raises(ValueError):
        FedTGP(distance="cosine")


# ---- the server's ACL step --------------------------------------------------------------------
def _numpy_acl_step(p, x, y, delta, lr):
    """One SGD step of mean_i CE(-(D_i + delta e_{y_i}), y_i) w.r.t. prototypes P, by hand.

    dL/dP_c = 1/N sum_i (1[c = y_i] - softmax_ic) (P_c - x_i) / D_ic.
    """
    n, c = len(x), len(p)
    dist = np.sqrt(((x[:, None, :] - p[None, :, :]) ** 2).sum(-1))  # [N, C]
    onehot = np.eye(c)[y]
    z = -(dist + delta * onehot)
    sm = np.exp(z - z.max(1, keepdims=True))
    sm /= sm.sum(1, keepdims=True)
    loss = -np.log(sm[np.arange(n), y]).mean()
    grad = np.zeros_like(p)
    for i in range(n):
        for k in range(c):
            grad[k] += (onehot[i, k] - sm[i, k]) * (p[k] - x[i]) / dist[i, k] / n
    return loss, p - lr * grad


def test_one_acl_step_matches_hand_computation():
    p0 = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    x = np.array([[1.0, 0.5], [0.5, 1.5], [2.5, -0.5]])
    y = np.array([0, 2, 1])
    delta, lr = 0.5, 0.1
    want_loss, want_p = _numpy_acl_step(p0, x, y, delta, lr)

    params = {"embedding.weight": torch.tensor(p0, dtype=torch.float32)}  # mlp=False
    points = torch.tensor(x, dtype=torch.float32)
    labels = torch.tensor(y)
    assert float(acl_loss(points, labels, global_prototypes(params), delta)) == pytest.approx(
        want_loss, rel=1e-5
    )
    gen = torch.Generator().manual_seed(0)
    last = train_prototypes(params, points, labels, delta, 1, 10, lr, gen)  # one full batch
    assert last == pytest.approx(want_loss, rel=1e-5)
    assert torch.allclose(global_prototypes(params).double(), torch.tensor(want_p), atol=1e-6)
    assert not params["embedding.weight"].requires_grad  # plain data again after training


@pytest.mark.parametrize("num_classes", [10, 30])  # native kernel (<= 24 rows), torch fallback
@pytest.mark.parametrize("mlp", [True, False])
def test_fused_server_step_equals_autograd_sgd(num_classes, mlp):
    """The server step by hand (default) is autograd + SGD to float rounding, and the fused
    Linear backwards are the ones that ran (two per step with the MLP)."""
    from fedmosaic.accel import engaged
    from fedmosaic.algorithms.fedtgp import TrainablePrototypes

    torch.manual_seed(0)
    d = 64
    module = TrainablePrototypes(num_classes, d, mlp)
    base = {k: v.detach() for k, v in module.named_parameters()}
    points, labels = torch.randn(45, d), torch.arange(45) % num_classes
    points[3] = global_prototypes(base)[labels[3]]  # a point on its prototype: zero distance
    engaged.clear()
    out = {}
    for fused in (True, False):
        params = {k: v.clone() for k, v in base.items()}
        gen = torch.Generator().manual_seed(1)
        loss = train_prototypes(params, points, labels, 0.5, 3, 10, 0.05, gen, fused=fused)
        out[fused] = (loss, params)
        assert not any(p.requires_grad or p.grad is not None for p in params.values())
    assert engaged["fedtgp.server"] == 3 * 5  # the fused run's steps: 3 epochs x 5 minibatches
    assert engaged["sgd_linear_backward"] == (2 * 3 * 5 if mlp else 0)  # 2 layers a step
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    for k, v in out[False][1].items():
        assert not torch.equal(v, base[k]), k  # every parameter trained
        assert torch.allclose(out[True][1][k], v, atol=1e-5), k


def test_acl_gradient_by_hand_equals_autograd():
    from fedmosaic.accel.prototypes import acl_loss_and_grad

    torch.manual_seed(0)
    protos = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    points = torch.randn(6, 7, dtype=torch.float64)
    points[2] = protos[4].detach()  # distance 0: finite, zero gradient from that pair
    labels = torch.tensor([0, 1, 4, 4, 2, 0])
    want = acl_loss(points, labels, protos, 0.7)
    want.backward()
    loss, grad = acl_loss_and_grad(points, labels, protos.detach(), 0.7)
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-12)
    assert torch.allclose(grad, protos.grad, rtol=1e-10, atol=1e-12)


def test_server_distance_is_finite_when_a_prototype_equals_a_point():
    protos = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    points = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    d = euclidean_distances(points, protos)
    assert torch.allclose(d, torch.tensor([[0.0, math.sqrt(5)], [math.sqrt(8), 5.0]]), atol=1e-5)
    loss = acl_loss(points, torch.tensor([0, 1]), protos, delta=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(protos.grad).all()


def test_trainable_prototypes_structure_and_seeded_init():
    algo = FedTGP()
    s1, s2 = algo.init_server(_spec(seed=5)), algo.init_server(_spec(seed=5))
    # Plain data: Embedding(C, d) -> Linear(d, d) -> ReLU -> Linear(d, d), as parameters.
    m = s1.params
    shapes = {k: tuple(v.shape) for k, v in m.items()}
    assert shapes == {
        "embedding.weight": (C, D),
        "mlp.0.weight": (D, D),
        "mlp.0.bias": (D,),
        "mlp.2.weight": (D, D),
        "mlp.2.bias": (D,),
    }
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in m.values())
    assert all(torch.equal(m[k], s2.params[k]) for k in m)
    other = algo.init_server(_spec(seed=6)).params
    assert not torch.equal(m["embedding.weight"], other["embedding.weight"])
    w0, b0, w2, b2 = (m[k] for k in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"))
    by_hand = torch.relu(m["embedding.weight"] @ w0.T + b0) @ w2.T + b2
    assert torch.allclose(global_prototypes(m), by_hand, atol=1e-6)
    bare = FedTGP(mlp=False).init_server(_spec()).params
    assert list(bare) == ["embedding.weight"]
    assert torch.equal(global_prototypes(bare), bare["embedding.weight"])


def test_aggregate_trains_persistent_prototypes_deterministically():
    algo = FedTGP(server_epochs=3)
    state = algo.init_server(_spec())
    before = copy.deepcopy(state.params)
    up = ClientPrototypes(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]), torch.tensor([0, 1]))
    up2 = ClientPrototypes(
        torch.tensor([[0.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 3.0, 0]]), torch.tensor([0, 1, 2])
    )
    uploads = [Weighted(0, 10.0, up), Weighted(1, 99.0, up2)]
    new = algo.aggregate(state, uploads, 1)
    again = algo.aggregate(state, uploads, 1)
    # The input state is untouched; the output is a pure function of (state, uploads, round).
    assert all(torch.equal(before[k], v) for k, v in state.params.items())
    assert all(torch.equal(new.params[k], again.params[k]) for k in new.params)
    assert not torch.equal(new.params["embedding.weight"], state.params["embedding.weight"])
    assert new.known.tolist() == [True, True, True] and new.num_points == 5
    # Q0 = (0.5, 0, 0, 0), Q1 = (0, 1.5, 0, 0), Q2 = (0, 0, 3, 0): nearest-other-class distances
    # |Q0 Q1| = 1.58, |Q1 Q0| = 1.58, |Q2 Q0| = sqrt(0.25 + 9) = 3.04 -> the margin is 3.04.
    assert new.margin == pytest.approx(math.sqrt(0.5**2 + 3**2), rel=1e-6)
    # Broadcast, class 2 never uploaded: before any training there is no prototype at all; after
    # it all C trained prototypes (the paper's), or with unseen="zero" class 2 as a zero row.
    assert not algo.broadcast(state, 0, 1).known.any()
    only0 = algo.aggregate(state, [Weighted(0, 1.0, up)], 1)
    assert only0.known.tolist() == [True, True, False]  # the server's record is unchanged
    with torch.no_grad():
        trained = global_prototypes(only0.params)  # [C, D]
    msg = algo.broadcast(only0, 0, 2)
    assert msg.known.tolist() == [True, True, True]
    assert torch.equal(msg.protos, trained) and msg.protos[2].abs().sum() > 0
    zero = dataclasses.replace(algo, unseen="zero")
    assert not zero.broadcast(state, 0, 1).known.any()
    msg = zero.broadcast(only0, 0, 2)
    assert msg.known.tolist() == [True, True, False]
    assert torch.equal(msg.protos[2], torch.zeros(D))
    assert torch.equal(msg.protos[:2], trained[:2])
    # A second round keeps training the same module (persistent across rounds).
    third = algo.aggregate(new, uploads, 2)
    assert not torch.equal(third.params["embedding.weight"], new.params["embedding.weight"])


# ---- client side ------------------------------------------------------------------------------
def test_alignment_loss_euclidean_and_mse_hand_computed():
    f = torch.tensor([[3.0, 4.0], [7.0, 7.0], [1.0, 1.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.0, 0.0], [9.0, 9.0], [1.0, 1.0]])
    known = torch.tensor([True, False, True])  # class 1 has no global prototype
    # Euclidean: rows 5, 0 (no prototype), 0 (on its prototype) -> mean over the batch of 3.
    eu = alignment_loss(f, y, protos, known, "euclidean")
    assert float(eu.detach()) == pytest.approx(5.0 / 3.0)
    eu.backward()
    assert torch.isfinite(f.grad).all()  # finite at distance 0
    assert torch.equal(f.grad[1], torch.zeros(2))  # the row without a prototype gets no pull
    assert torch.allclose(f.grad[0], torch.tensor([3.0, 4.0]) / 5.0 / 3.0)
    # MSE (reference): squared error summed over rows with a prototype / (B * d) = 25 / 6.
    mse = alignment_loss(f, y, protos, known, "mse")
    assert float(mse.detach()) == pytest.approx(25.0 / 6.0)


def test_client_loss_is_ce_plus_lam_times_alignment():
    torch.manual_seed(0)
    model = toy_model()
    x = torch.randn(5, 1, 2, 6)
    y = torch.tensor([0, 1, 2, 1, 0])
    protos = torch.randn(C, D)
    ce = F.cross_entropy(model(x), y)
    none = Prototypes(protos, torch.zeros(C, dtype=torch.bool))
    assert torch.allclose(FedTGP().loss(model, None, x, y, none), ce)  # no prototype yet: CE
    only2 = Prototypes(protos, torch.tensor([False, False, True]))
    # Only the row of class 2 contributes, divided by the batch size.
    feats = model.features(x)
    want = ce + 0.1 * (feats[2] - protos[2]).norm() / 5
    assert torch.allclose(FedTGP(lam=0.1).loss(model, None, x, y, only2), want, atol=1e-6)
    want_mse = ce + 10.0 * (feats[2] - protos[2]).pow(2).sum() / (5 * D)
    got = FedTGP(lam=10.0, distance="mse").loss(model, None, x, y, only2)
    assert torch.allclose(got, want_mse, atol=1e-5)


def _hand_class_means(model, data):
    with torch.no_grad():
        x = data.source.batch(data.rows("train"))
        f = model.eval().features(x)
    y = data.targets("train")
    out = torch.zeros(C, D)
    for c in range(C):
        if (y == c).any():
            out[c] = f[y == c].mean(0)
    return out


def test_upload_is_exact_class_means_without_counts():
    assert {f.name for f in dataclasses.fields(FedTGP.Upload)} == {"protos", "classes"}
    torch.manual_seed(0)
    model = toy_model()
    data = means_client(classes=(0, 2))  # class 1 absent
    up = FedTGP().upload(model, torch.nn.Module(), data, None)
    assert up.classes.dtype == torch.int64 and up.classes.tolist() == [0, 2]
    # Only the |C_i| = 2 classes held are sent (the paper's K x |C_i| floats), no counts.
    assert up.protos.shape == (2, D)
    assert torch.allclose(up.protos, _hand_class_means(model, data)[[0, 2]], atol=1e-6)
    arrays, scalars = up.flatten()
    assert set(arrays) == {"protos", "classes"} and scalars == {}
    assert sum(a.numel() * a.element_size() for a in arrays.values()) == 2 * D * 4 + 2 * 8


def _fit(algo, model, data, msg):
    extras = algo.init_client(model, _spec(), data)
    return client_ops.fit(
        algo, model, extras, msg, data, TrainSettings(batch_size=8, lr=0.5), 0, 1, 2
    ).upload


def test_stale_prototypes_upload_the_model_before_training():
    data = means_client()
    msg = Prototypes(torch.zeros(C, D), torch.zeros(C, dtype=torch.bool))
    torch.manual_seed(1)
    m_stale = toy_model()
    m_fresh = copy.deepcopy(m_stale)
    before = _hand_class_means(m_stale, data)
    stale = _fit(FedTGP(stale_prototypes=True), m_stale, data, msg)
    fresh = _fit(FedTGP(), m_fresh, data, msg)
    assert torch.allclose(stale.protos, before, atol=1e-6)
    assert torch.allclose(fresh.protos, _hand_class_means(m_fresh, data), atol=1e-6)
    assert not torch.allclose(fresh.protos, before, atol=1e-3)  # training moved the features
    assert stale.classes.tolist() == fresh.classes.tolist() == [0, 1, 2]


def test_predict_nearest_prototype_and_head_fallback():
    torch.manual_seed(0)
    model = toy_model().eval()
    x = torch.randn(6, 1, 2, 6)
    feats = model.features(x)
    protos = torch.stack([feats[0], feats[1] + 10, feats[2]])  # class 1 is far from everything
    msg = Prototypes(protos.detach(), torch.tensor([True, True, False]))
    out = FedTGP().predict(model, None, x, msg)
    assert torch.equal(out["acc_head"], model(x))
    assert out["acc"][0].argmax() == 0  # feats[0] sits on prototype 0
    assert torch.isinf(out["acc"][:, 2]).all()  # no global prototype for class 2: never chosen
    want = -torch.cdist(feats, protos[:2]).argmin(1)
    assert torch.equal(out["acc"].argmax(1), -want)
    # Before any global prototype exists, the head decides.
    empty = Prototypes(torch.zeros(C, D), torch.zeros(C, dtype=torch.bool))
    out = FedTGP().predict(model, None, x, empty)
    assert torch.equal(out["acc"], out["acc_head"])
    assert torch.equal(
        nearest_prototype_scores(feats, protos, torch.ones(3, dtype=torch.bool)),
        -euclidean_distances(feats, protos),
    )


def test_validate_upload_rejects_wrong_shapes_and_dtypes():
    algo = FedTGP()
    state: TGPState = algo.init_server(_spec())
    ok = ClientPrototypes(torch.zeros(2, D), torch.tensor([0, 2]))
    algo.validate_upload(state, ok, 0)
    algo.validate_upload(state, ClientPrototypes(torch.zeros(0, D), torch.zeros(0).long()), 0)
    bad = [
        ClientPrototypes(torch.zeros(2, D + 1), ok.classes),
        ClientPrototypes(torch.zeros(C + 1, D), torch.arange(C + 1)),
        ClientPrototypes(torch.zeros(2, D, dtype=torch.float64), ok.classes),
        ClientPrototypes(ok.protos, torch.tensor([0, 2], dtype=torch.int32)),
        ClientPrototypes(ok.protos, torch.tensor([0, 1, 2])),
        ClientPrototypes(ok.protos, torch.tensor([2, 0])),  # not increasing
        ClientPrototypes(ok.protos, torch.tensor([1, 1])),  # repeated
        ClientPrototypes(ok.protos, torch.tensor([0, C])),  # out of range
        ClientPrototypes(ok.protos, torch.tensor([-1, 0])),
    ]
    for up in bad:
        with pytest.raises(PayloadError):
            algo.validate_upload(state, up, 3)


# ---- end to end -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"stale_prototypes": True, "distance": "mse", "lam": 10.0},
        {"mlp": False, "margin": "none"},
    ],
)
def test_two_rounds_heterogeneous_toy_federation(kwargs):
    fed = run_toy(FedTGP(server_epochs=5, **kwargs), CLASS_MEANS)
    rounds = fed.history.rounds
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_head_weighted"] <= 1.0
    assert fed.state.known.all() and math.isfinite(fed.state.loss)
    # Upload per client: C x d float32 + C bool (+ framing); the paper counts d x |C_i| floats.
    assert rounds[0]["bytes_up_per_client"] >= C * D * 4 + C


@pytest.mark.integration
def test_two_rounds_with_config_and_wire_check():
    raw = tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedtgp", "server_epochs": 5})
    from fedmosaic.experiment import run_experiment

    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(r["rejected"] == [] and "acc_head_weighted" in r for r in doc["rounds"])
