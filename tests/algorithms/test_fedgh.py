"""FedGH: the server's head step against hand-computed numbers, masking of absent classes, upload
validation, exact class means, and short runs with every payload round-tripped through the wire."""

from __future__ import annotations

import math

import pytest
import torch
from _handmade import run_handmade
from conftest import tiny_raw
from torch import nn

from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedgh import (
    ClassMeans,
    FedGH,
    FedGHState,
    check_linear_head,
    server_step_batches,
)
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import PayloadError


def _state(c: int, d: int = 2) -> FedGHState:
    head = nn.Linear(d, c)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    return FedGHState(head, seed=0)


def _up(cid: int, protos: list[list[float]], counts: list[int]) -> Weighted[ClassMeans]:
    return Weighted(cid, 10.0, ClassMeans(torch.tensor(protos), torch.tensor(counts)))


@pytest.mark.parametrize("batch_size", [0, 10])
def test_server_step_two_classes_hand_computed(batch_size):
    # Zero head: both logits 0, softmax (1/2, 1/2). Mean CE over the two LARs x0 = e1 (class 0),
    # x1 = e2 (class 1): dL/dlogits = (p - onehot) / 2 -> g0 = (-1/4, 1/4), g1 = (1/4, -1/4).
    # dW[c, :] = g0[c] x0 + g1[c] x1 = [[-1/4, 1/4], [1/4, -1/4]]; db = g0 + g1 = 0.
    # One SGD step at eta_g = 0.5: W = [[1/8, -1/8], [-1/8, 1/8]], b = 0.
    state = _state(2)
    algo = FedGH(eta_g=0.5, server_epochs=1, server_batch_size=batch_size)
    new = algo.aggregate(state, [_up(0, [[1.0, 0.0], [0.0, 1.0]], [3, 5])], round_num=1)
    assert torch.allclose(new.head.weight, torch.tensor([[0.125, -0.125], [-0.125, 0.125]]))
    assert torch.allclose(new.head.bias, torch.zeros(2))
    assert bool((state.head.weight == 0).all())  # the previous state is left untouched


def test_absent_classes_are_masked():
    # Three classes, class 2 absent (count 0) with a garbage row that must not be trained on.
    # Zero head: softmax (1/3, 1/3, 1/3); g0 = (-2/3, 1/3, 1/3) / 2, g1 = (1/3, -2/3, 1/3) / 2.
    # dW = [[-1/3, 1/6], [1/6, -1/3], [1/6, 1/6]], db = (-1/6, -1/6, 1/3); eta_g = 0.6:
    # W = [[0.2, -0.1], [-0.1, 0.2], [-0.1, -0.1]], b = (0.1, 0.1, -0.2).
    algo = FedGH(eta_g=0.6)
    up = _up(0, [[1.0, 0.0], [0.0, 1.0], [100.0, -50.0]], [4, 1, 0])
    new = algo.aggregate(_state(3), [up], round_num=1)
    want_w = torch.tensor([[0.2, -0.1], [-0.1, 0.2], [-0.1, -0.1]])
    assert torch.allclose(new.head.weight, want_w, atol=1e-6)
    assert torch.allclose(new.head.bias, torch.tensor([0.1, 0.1, -0.2]), atol=1e-6)


def test_per_client_steps_follow_algorithm_1():
    # Two clients, one SGD step each on its own LARs (server_batch_size = 0), in the order drawn
    # from the round's server stream. Client 0 holds class 0 with LAR e1, client 1 class 1 with
    # LAR e2. Written out by hand for both orders (eta_g = 1/2):
    # first step (class a, LAR e_a) from the zero head: p = (1/2, 1/2), g = p - onehot(a);
    #   W[:, a] = -g / 2, b = -g / 2.
    # second step (class c, LAR e_c): logits = W e_c + b = b, p = softmax(b), g' = p - onehot(c);
    #   W[:, c] = -g' / 2, b = b - g' / 2.
    ups = [_up(0, [[1.0, 0.0], [0.0, 0.0]], [2, 0]), _up(1, [[0.0, 0.0], [0.0, 1.0]], [0, 7])]
    new = FedGH(eta_g=0.5).aggregate(_state(2), ups, round_num=3)
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
    assert torch.allclose(new.head.weight, torch.tensor(w), atol=1e-6)
    assert torch.allclose(new.head.bias, torch.tensor(b), atol=1e-6)
    # The other order gives a different head: the order really is the seeded one.
    assert abs(b[c] - b[a]) > 0.1


def test_server_batches_cover_every_pair_and_are_seeded():
    g = torch.Generator().manual_seed(5)
    per_client = server_step_batches([2, 0, 3], 0, g)
    assert sorted(tuple(b.tolist()) for b in per_client) == [(0, 1), (2, 3, 4)]
    pooled = server_step_batches([2, 0, 3], 2, torch.Generator().manual_seed(5))
    assert [len(b) for b in pooled] == [2, 2, 1]
    assert sorted(torch.cat(pooled).tolist()) == [0, 1, 2, 3, 4]
    again = server_step_batches([2, 0, 3], 2, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(pooled, again))


def test_aggregate_is_deterministic_per_round():
    ups = [
        _up(0, [[1.0, 0.5], [0.2, -1.0]], [3, 2]),
        _up(1, [[0.3, 0.4], [-0.7, 0.1]], [1, 9]),
    ]
    algo = FedGH(eta_g=0.1, server_epochs=3, server_batch_size=1)
    a = algo.aggregate(_state(2), ups, 1)
    b = algo.aggregate(_state(2), ups, 1)
    assert torch.equal(a.head.weight, b.head.weight) and torch.equal(a.head.bias, b.head.bias)


def test_validate_upload_rejects_wrong_shapes_and_dtypes():
    algo, state = FedGH(), _state(3, d=4)
    algo.validate_upload(state, ClassMeans(torch.zeros(3, 4), torch.tensor([1, 0, 2])), 0)
    bad = [
        ClassMeans(torch.zeros(3, 5), torch.tensor([1, 0, 2])),  # wrong d
        ClassMeans(torch.zeros(2, 4), torch.tensor([1, 0, 2])),  # wrong C
        ClassMeans(torch.zeros(3, 4, dtype=torch.float64), torch.tensor([1, 0, 2])),
        ClassMeans(torch.zeros(3, 4), torch.tensor([1.0, 0.0, 2.0])),  # float counts
        ClassMeans(torch.zeros(3, 4), torch.tensor([1, 0])),  # short counts
        ClassMeans(torch.zeros(3, 4), torch.tensor([1, -1, 2])),  # negative count
        ClassMeans(torch.full((3, 4), math.nan), torch.tensor([1, 0, 2])),
    ]
    for up in bad:
        with pytest.raises(PayloadError, match="client 7"):
            algo.validate_upload(state, up, 7)


def test_hyperparameters_are_validated():
    with pytest.raises(ValueError):
        FedGH(eta_g=0.0)
    with pytest.raises(ValueError):
        FedGH(server_batch_size=-1)


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
    algo.receive(model, extras, SharedState(head))
    assert torch.equal(model.head.weight, head["weight"])
    assert torch.equal(model.head.bias, head["bias"])
    model.eval()
    with torch.no_grad():
        up = algo.upload(model, extras, data, SharedState(head))
        feats = model.encoder(x)  # [7, 4]
    assert up.counts.dtype == torch.int64 and up.counts.tolist() == [4, 0, 3]
    for c in (0, 2):
        rows = [i for i in range(7) if int(labels[i]) == c]
        want = sum(feats[i] for i in rows) / len(rows)
        assert torch.allclose(up.protos[c], want, atol=1e-6)
    assert bool((up.protos[1] == 0).all())


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
        # up: C x d float32 means + C int64 counts; down: (d + 1) x C float32; plus framing.
        assert c * d * 4 + c * 8 < r["bytes_up_per_client"] < c * d * 4 + c * 8 + 400
        assert (d + 1) * c * 4 < r["bytes_down_per_client"] < (d + 1) * c * 4 + 400
    assert isinstance(state, FedGHState) and state.head.weight.shape == (c, d)


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
