"""FedGH: the server's head steps (per pair and per client) against hand-computed numbers, the
upload (held classes, no counts) and its validation, exact class means, which model is evaluated
(the local model; the global header as ``acc_global``), and short runs through the wire."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _handmade import run_handmade
from helpers.experiments import tiny_raw
from torch import nn

from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedgh import (
    ClassMeans,
    FedGH,
    FedGHClient,
    FedGHState,
    check_linear_head,
    server_step_batches,
)
from fedmosaic.core import client as client_ops
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.training import TrainSettings


def _state(c: int, d: int = 2) -> FedGHState:
    return FedGHState({"weight": torch.zeros(c, d), "bias": torch.zeros(c)}, seed=0)


def _up(cid: int, protos: list[list[float]], classes: list[int]) -> Weighted[ClassMeans]:
    return Weighted(cid, 10.0, ClassMeans(torch.tensor(protos), torch.tensor(classes)))


@pytest.mark.parametrize(("step", "batch_size"), [("client", 0), ("pair", 10), ("client", 10)])
def test_server_step_per_client_hand_computed(step, batch_size):
    # Zero head: both logits 0, softmax (1/2, 1/2). Mean CE over the two LARs x0 = e1 (class 0),
    # x1 = e2 (class 1): dL/dlogits = (p - onehot) / 2 -> g0 = (-1/4, 1/4), g1 = (1/4, -1/4).
    # dW[c, :] = g0[c] x0 + g1[c] x1 = [[-1/4, 1/4], [1/4, -1/4]]; db = g0 + g1 = 0.
    # One SGD step at eta_g = 0.5: W = [[1/8, -1/8], [-1/8, 1/8]], b = 0. (Pooled batches of 10
    # hold both pairs too, whatever server_step says.)
    state = _state(2)
    algo = FedGH(eta_g=0.5, server_epochs=1, server_step=step, server_batch_size=batch_size)
    new = algo.aggregate(state, [_up(0, [[1.0, 0.0], [0.0, 1.0]], [0, 1])], round_num=1)
    assert torch.allclose(new.head["weight"], torch.tensor([[0.125, -0.125], [-0.125, 0.125]]))
    assert torch.allclose(new.head["bias"], torch.zeros(2))
    assert bool((state.head["weight"] == 0).all())  # the previous state is left untouched


def test_server_step_per_pair_hand_computed():
    # The default: one SGD step per (client, class) pair (Eq. 4), a client's classes in order.
    # Step 1 on (e1, class 0) from the zero head: p = (1/2, 1/2), g = (-1/2, 1/2);
    #   dW = g x e1^T = [[-1/2, 0], [1/2, 0]], db = g; eta_g = 1/2 -> W = [[1/4, 0], [-1/4, 0]],
    #   b = (1/4, -1/4).
    # Step 2 on (e2, class 1): logits = W e2 + b = (1/4, -1/4), p0 = sigmoid(1/2), p1 = 1 - p0;
    #   g = (p0, -p0); dW = [[0, p0], [0, -p0]], db = g ->
    #   W = [[1/4, -p0/2], [-1/4, p0/2]], b = (1/4 - p0/2, -1/4 + p0/2).
    algo = FedGH(eta_g=0.5)
    assert algo.server_step == "pair" and algo.server_batch_size == 0
    new = algo.aggregate(_state(2), [_up(0, [[1.0, 0.0], [0.0, 1.0]], [0, 1])], round_num=1)
    h = 0.5 / (1.0 + math.exp(-0.5))  # p0 / 2 = 0.31122966...
    assert torch.allclose(new.head["weight"], torch.tensor([[0.25, -h], [-0.25, h]]), atol=1e-6)
    assert torch.allclose(new.head["bias"], torch.tensor([0.25 - h, -0.25 + h]), atol=1e-6)


def test_classes_not_held_are_not_trained_on():
    # Three classes, the client holds 0 and 1 only (class 2 is never uploaded).
    # Zero head: softmax (1/3, 1/3, 1/3); g0 = (-2/3, 1/3, 1/3) / 2, g1 = (1/3, -2/3, 1/3) / 2.
    # dW = [[-1/3, 1/6], [1/6, -1/3], [1/6, 1/6]], db = (-1/6, -1/6, 1/3); eta_g = 0.6:
    # W = [[0.2, -0.1], [-0.1, 0.2], [-0.1, -0.1]], b = (0.1, 0.1, -0.2).
    algo = FedGH(eta_g=0.6, server_step="client")
    up = _up(0, [[1.0, 0.0], [0.0, 1.0]], [0, 1])
    new = algo.aggregate(_state(3), [up], round_num=1)
    want_w = torch.tensor([[0.2, -0.1], [-0.1, 0.2], [-0.1, -0.1]])
    assert torch.allclose(new.head["weight"], want_w, atol=1e-6)
    assert torch.allclose(new.head["bias"], torch.tensor([0.1, 0.1, -0.2]), atol=1e-6)


@pytest.mark.parametrize("step", ["pair", "client"])
def test_clients_in_the_seeded_order(step):
    # Two clients, one SGD step each on its own LARs (server_batch_size = 0), in the order drawn
    # from the round's server stream. Client 0 holds class 0 with LAR e1, client 1 class 1 with
    # LAR e2. Written out by hand for both orders (eta_g = 1/2):
    # first step (class a, LAR e_a) from the zero head: p = (1/2, 1/2), g = p - onehot(a);
    #   W[:, a] = -g / 2, b = -g / 2.
    # second step (class c, LAR e_c): logits = W e_c + b = b, p = softmax(b), g' = p - onehot(c);
    #   W[:, c] = -g' / 2, b = b - g' / 2.
    # One class per client: one pair per client, so both server_step modes take the same steps.
    ups = [_up(0, [[1.0, 0.0]], [0]), _up(1, [[0.0, 1.0]], [1])]
    new = FedGH(eta_g=0.5, server_step=step).aggregate(_state(2), ups, round_num=3)
    order = torch.randperm(2, generator=seeding.torch_generator(0, 3, seeding.SERVER, "fedgh"))
    a, c = (0, 1) if order.tolist() == [0, 1] else (1, 0)
    g = [0.5 - (k == a) for k in range(2)]
    w = [[0.0, 0.0], [0.0, 0.0]]
    b = [-g[k] / 2 for k in range(2)]
    for k in range(2):
        w[k][a] = -g[k] / 2
    e = [math.exp(v) for v in b]
    g2 = [e[k] / sum(e) - (k == c) for k in range(2)]
    for k in range(2):
        w[k][c] = -g2[k] / 2
        b[k] -= g2[k] / 2
    assert torch.allclose(new.head["weight"], torch.tensor(w), atol=1e-6)
    assert torch.allclose(new.head["bias"], torch.tensor(b), atol=1e-6)
    # The other order gives a different head: the order really is the seeded one.
    assert abs(b[c] - b[a]) > 0.1


def test_server_batches_cover_every_pair_and_are_seeded():
    g = torch.Generator().manual_seed(5)
    per_client = server_step_batches([2, 0, 3], 0, g, "client")
    assert sorted(tuple(b.tolist()) for b in per_client) == [(0, 1), (2, 3, 4)]
    # Per pair: the same client order (same draw from the stream), one pair per step, each
    # client's pairs (its sorted classes) in order.
    per_pair = server_step_batches([2, 0, 3], 0, torch.Generator().manual_seed(5), "pair")
    assert all(b.numel() == 1 for b in per_pair)
    assert [int(b) for b in per_pair] == torch.cat(per_client).tolist()
    assert server_step_batches([2, 0, 3], 0, torch.Generator().manual_seed(5)) == per_pair
    order = torch.randperm(3, generator=torch.Generator().manual_seed(5)).tolist()
    want = {0: [0, 1], 1: [], 2: [2, 3, 4]}
    assert [int(b) for b in per_pair] == [i for k in order for i in want[k]]
    pooled = server_step_batches([2, 0, 3], 2, torch.Generator().manual_seed(5))
    assert [len(b) for b in pooled] == [2, 2, 1]
    assert sorted(torch.cat(pooled).tolist()) == [0, 1, 2, 3, 4]
    again = server_step_batches([2, 0, 3], 2, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(pooled, again))


def test_aggregate_is_deterministic_per_round():
    ups = [
        _up(0, [[1.0, 0.5], [0.2, -1.0]], [0, 1]),
        _up(1, [[0.3, 0.4], [-0.7, 0.1]], [0, 1]),
    ]
    for algo in (FedGH(eta_g=0.1, server_epochs=3, server_batch_size=1), FedGH(server_epochs=3)):
        a = algo.aggregate(_state(2), ups, 1)
        b = algo.aggregate(_state(2), ups, 1)
        assert torch.equal(a.head["weight"], b.head["weight"])
        assert torch.equal(a.head["bias"], b.head["bias"])


def test_validate_upload_rejects_wrong_shapes_and_dtypes():
    algo, state = FedGH(), _state(3, d=4)
    algo.validate_upload(state, ClassMeans(torch.zeros(2, 4), torch.tensor([0, 2])), 0)
    algo.validate_upload(state, ClassMeans(torch.zeros(3, 4), torch.tensor([0, 1, 2])), 0)
    algo.validate_upload(state, ClassMeans(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), 0)
    bad = [
        ClassMeans(torch.zeros(2, 5), torch.tensor([0, 2])),  # wrong d
        ClassMeans(torch.zeros(4, 4), torch.tensor([0, 1, 2, 3])),  # more rows than classes
        ClassMeans(torch.zeros(4), torch.tensor([0, 1, 2, 3])),  # not 2-D
        ClassMeans(torch.zeros(2, 4, dtype=torch.float64), torch.tensor([0, 2])),
        ClassMeans(torch.zeros(2, 4), torch.tensor([0.0, 2.0])),  # float classes
        ClassMeans(torch.zeros(2, 4), torch.tensor([0, 1, 2])),  # classes do not match rows
        ClassMeans(torch.zeros(3, 4), torch.tensor([0, 2])),  # rows do not match classes
        ClassMeans(torch.zeros(2, 4), torch.tensor([2, 0])),  # not increasing
        ClassMeans(torch.zeros(2, 4), torch.tensor([1, 1])),  # repeated class
        ClassMeans(torch.zeros(2, 4), torch.tensor([1, 3])),  # class id >= C
        ClassMeans(torch.zeros(2, 4), torch.tensor([-1, 1])),  # negative class id
        ClassMeans(torch.full((2, 4), math.nan), torch.tensor([0, 2])),
    ]
    for up in bad:
        with pytest.raises(PayloadError, match="client 7"):
            algo.validate_upload(state, up, 7)


def test_upload_carries_classes_not_counts():
    # The label histogram stays on the client: the payload has the held classes only.
    assert [f.name for f in dataclasses.fields(ClassMeans)] == ["protos", "classes"]


def test_hyperparameters_are_validated():
    with pytest.raises(ValueError):
        FedGH(eta_g=0.0)
    with pytest.raises(ValueError):
        FedGH(server_batch_size=-1)
    with pytest.raises(ValueError, match="server_step = 'pairs'; choose one of"):
        FedGH(server_step="pairs")
    with pytest.raises(ValueError, match="lar_batch"):
        FedGH(lar_batch=-1)


class _Rows:
    def __init__(self, x):
        self.x = x

    def batch(self, idx, device="cpu"):
        return self.x[idx].to(device)


def test_client_receives_head_and_uploads_exact_class_means():
    torch.manual_seed(0)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)), nn.Linear(4, 3), 4, 3)
    x = torch.randn(7, 1, 3, 4)
    labels = torch.tensor([0, 2, 0, 2, 2, 0, 0])  # class 1 absent
    data = ClientData(0, _Rows(x), labels, {"train": torch.arange(7)}, 3)
    spec = FederationSpec(3, 3, 4, (1, 3, 4), ("m",), (7,), 0, 1, lambda i: model)
    algo = FedGH()
    extras = algo.init_client(model, spec, data)
    head = {"weight": torch.ones(3, 4), "bias": torch.arange(3.0)}
    algo.receive(model, extras, SharedState(head))  # not trained yet: holds the global header
    assert torch.equal(model.head.weight, head["weight"])
    assert torch.equal(model.head.bias, head["bias"])
    model.eval()
    with torch.no_grad():
        up = algo.upload(model, extras, data, SharedState(head))
        feats = model.encoder(x)  # [7, 4]
    assert up.classes.dtype == torch.int64 and up.classes.tolist() == [0, 2]
    assert tuple(up.protos.shape) == (2, 4)
    for row, c in enumerate((0, 2)):
        rows = [i for i in range(7) if int(labels[i]) == c]
        want = sum(feats[i] for i in rows) / len(rows)
        assert torch.allclose(up.protos[row], want, atol=1e-6)
    algo.validate_upload(FedGHState(nn.Linear(4, 3).state_dict(), 0), up, 0)


def test_lar_batch_leaves_out_the_ragged_tail_as_an_unshuffled_drop_last_loader():
    # 8 examples, lar_batch = 3: the loader's two full batches hold rows 0-5; rows 6-7 (the only
    # class-1 example and one of class 2) are left out, so class 1 is not uploaded at all.
    torch.manual_seed(0)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)), nn.Linear(4, 3), 4, 3)
    x = torch.randn(8, 1, 3, 4)
    labels = torch.tensor([0, 2, 0, 2, 0, 0, 1, 2])
    data = ClientData(0, _Rows(x), labels, {"train": torch.arange(8)}, 3)
    spec = FederationSpec(3, 3, 4, (1, 3, 4), ("m",), (8,), 0, 1, lambda i: model)
    head = SharedState({"weight": torch.ones(3, 4), "bias": torch.arange(3.0)})
    model.eval()
    with torch.no_grad():
        feats = model.encoder(x)  # [8, 4]
        ups = {}
        for lar_batch in (0, 3, 8):
            algo = FedGH(lar_batch=lar_batch)
            ups[lar_batch] = algo.upload(model, algo.init_client(model, spec, data), data, head)
    assert ups[0].classes.tolist() == [0, 1, 2]
    assert ups[3].classes.tolist() == [0, 2]
    assert torch.allclose(ups[3].protos[1], (feats[1] + feats[3]) / 2, atol=1e-6)
    assert torch.allclose(ups[0].protos[2], (feats[1] + feats[3] + feats[7]) / 3, atol=1e-6)
    assert torch.allclose(ups[3].protos[0], ups[0].protos[0], atol=1e-6)
    # a batch that divides the split leaves nothing out
    assert torch.equal(ups[8].classes, ups[0].classes)
    assert torch.equal(ups[8].protos, ups[0].protos)


def _two_class_client() -> tuple[ClientModel, ClientData]:
    # Features = the 2 input pixels; class 0 at (1, 0) + noise, class 1 at (0, 1) + noise.
    g = torch.Generator().manual_seed(3)
    labels = torch.tensor([0, 1] * 10)
    x = torch.stack([1.0 - labels.float(), labels.float()], 1) + 0.1 * torch.randn(
        20, 2, generator=g
    )
    model = ClientModel(nn.Flatten(), nn.Linear(2, 2), 2, 2)
    splits = {"train": torch.arange(12), "test": torch.arange(12, 20)}
    return model, ClientData(0, _Rows(x.view(20, 1, 1, 2)), labels, splits, 2)


def test_headline_is_the_locally_trained_model_and_acc_global_the_global_header():
    # Train from a correct global header (identity), then evaluate with a new global header that
    # swaps the classes (always wrong here). The paper's local model (encoder + the locally
    # trained head) is the headline ``acc``; the new header is ``acc_global``.
    model, data = _two_class_client()
    spec = FederationSpec(1, 2, 2, (1, 1, 2), ("m",), (12,), 0, 1, lambda i: model)
    algo = FedGH()
    extras = algo.init_client(model, spec, data)
    assert isinstance(extras, FedGHClient) and not bool(extras.trained)
    train_msg = SharedState({"weight": torch.eye(2), "bias": torch.zeros(2)})
    settings = TrainSettings(batch_size=4, lr=0.1)
    client_ops.fit(algo, model, extras, train_msg, data, settings, 0, 1, 1)
    assert bool(extras.trained)
    local = {k: v.clone() for k, v in model.head.state_dict().items()}
    assert not torch.equal(local["weight"], torch.eye(2))  # trained from the received header
    swap = SharedState({"weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "bias": torch.zeros(2)})
    counts = client_ops.evaluate(algo, model, extras, swap, data, ("test",), 100)["test"]
    with torch.no_grad():
        xs = data.source.batch(data.rows("test"))
        y = data.targets("test")
        want_local = int(
            (torch.func.functional_call(model.head, local, (xs.flatten(1),)).argmax(1) == y).sum()
        )
    assert counts == {"n": 8, "acc": want_local, "acc_global": 0}
    assert want_local == 8  # the two modes really differ here
    assert torch.equal(model.head.weight, local["weight"])  # evaluation kept the local head


def test_untrained_client_is_evaluated_with_the_received_header():
    model, data = _two_class_client()
    spec = FederationSpec(1, 2, 2, (1, 1, 2), ("m",), (12,), 0, 1, lambda i: model)
    algo = FedGH()
    extras = algo.init_client(model, spec, data)
    swap = SharedState({"weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "bias": torch.zeros(2)})
    counts = client_ops.evaluate(algo, model, extras, swap, data, ("test",), 100)["test"]
    assert counts == {"n": 8, "acc": 0, "acc_global": 0}


def test_rejects_non_linear_heads():
    with pytest.raises(ValueError, match="Linear"):
        check_linear_head(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)), 4, 3, "x")
    with pytest.raises(ValueError, match="Linear"):
        check_linear_head(nn.Linear(5, 3), 4, 3, "x")
    check_linear_head(nn.Linear(4, 3), 4, 3, "x")


def test_handmade_two_rounds_with_wire_check_and_bytes():
    h, state = run_handmade(FedGH())
    assert [r["round"] for r in h.rounds] == [1, 2]
    d, c = 8, 3
    for r in h.rounds:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
        # up: k x d float32 means + k int64 classes (k <= C held classes; every client of
        # this federation holds all 3); down: (d + 1) x C float32; plus framing.
        assert c * d * 4 + c * 8 < r["bytes_up_per_client"] < c * d * 4 + c * 8 + 400
        assert 0.0 <= r["acc_global_weighted"] <= 1.0
        assert (d + 1) * c * 4 < r["bytes_down_per_client"] < (d + 1) * c * 4 + 400
    assert isinstance(state, FedGHState) and state.head["weight"].shape == (c, d)


@pytest.mark.integration
def test_two_rounds_on_zoo_family_with_wire_check():
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(model={"family": "htfe8-gray", "feature_dim": 32}, algorithm={"name": "fedgh"})
    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
        assert r["bytes_up_per_client"] > 4 * 32 * 4  # C x d floats
