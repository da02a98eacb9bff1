import math

import pytest
import torch
from helpers.experiments import tiny_raw
from torch import nn

from fedmosaic.algorithms._shared import SharedState, weighted_average
from fedmosaic.algorithms.fedavg import FedAvg
from fedmosaic.algorithms.fedprox import proximal_term
from fedmosaic.config import from_dict
from fedmosaic.core.algorithm import Weighted
from fedmosaic.core.model import ClientModel
from fedmosaic.experiment import run_experiment


def _numbers(doc):
    return [(r["acc_weighted"], r["train_loss"]) for r in doc["rounds"]], doc[
        "per_client_final_acc"
    ]


@pytest.mark.golden
def test_fedprox_mu0_equals_fedavg_exactly():
    base = dict(train={"rounds": 3}, data={"num_clients": 4})
    avg = run_experiment(from_dict(tiny_raw(algorithm={"name": "fedavg"}, **base)), progress=False)
    prox = run_experiment(
        from_dict(tiny_raw(algorithm={"name": "fedprox", "mu": 0.0}, **base)), progress=False
    )
    assert _numbers(avg) == _numbers(prox)
    other = run_experiment(
        from_dict(tiny_raw(algorithm={"name": "fedprox", "mu": 1.0}, **base)), progress=False
    )
    assert _numbers(other) != _numbers(avg)


def test_weighted_average_exact():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    out = weighted_average([a, b], [1.0, 3.0])
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert int(out["n"]) == 5  # integer buffers keep the max
    with pytest.raises(ValueError):
        weighted_average([], [])


def test_proximal_term_hand_computed():
    m = nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0]]))
        m.bias.fill_(0.5)
    g = {"weight": torch.tensor([[0.0, 0.0]]), "bias": torch.tensor([1.5])}
    # (1^2 + 2^2) + (0.5 - 1.5)^2 = 6
    assert float(proximal_term(m, g).detach()) == pytest.approx(6.0)


@pytest.mark.integration
def test_proximal_term_skips_what_the_broadcast_does_not_hold():
    """FedBN + FedProx (``bn = "local"``): local BatchNorm weights have no global anchor."""
    m = nn.Sequential(nn.Linear(2, 1), nn.BatchNorm1d(1))
    with torch.no_grad():
        m[0].weight.copy_(torch.tensor([[1.0, 2.0]]))
        m[0].bias.fill_(0.5)
    g = {"0.weight": torch.tensor([[0.0, 0.0]]), "0.bias": torch.tensor([1.5])}
    assert float(proximal_term(m, g).detach()) == pytest.approx(6.0)  # BatchNorm left out
    cfg = from_dict(
        tiny_raw(model={"family": "resnet4"}, algorithm={"name": "fedprox", "bn": "local"})
    )
    doc = run_experiment(cfg, progress=False)
    assert all(math.isfinite(r["train_loss"]) for r in doc["rounds"])


# ---- BatchNorm layers in the shared state (``bn``) --------------------------------------------


def _bn_model(seed: int) -> ClientModel:
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.BatchNorm1d(6), nn.ReLU())
    return ClientModel(encoder, nn.Linear(6, 3), 6, 3)


@pytest.mark.parametrize(
    ("bn", "kept"),
    [
        ("average", set()),
        (
            "local_stats",
            {"encoder.2.running_mean", "encoder.2.running_var", "encoder.2.num_batches_tracked"},
        ),
        (
            "local",
            {
                "encoder.2.running_mean",
                "encoder.2.running_var",
                "encoder.2.num_batches_tracked",
                "encoder.2.weight",
                "encoder.2.bias",
            },
        ),
    ],
)
def test_batchnorm_modes_keep_the_named_tensors_on_the_client(bn: str, kept: set[str]):
    algo = FedAvg(bn=bn)
    a, b = _bn_model(0), _bn_model(1)
    with torch.no_grad():
        for m, v in ((a, 1.0), (b, 3.0)):
            m.encoder[2].running_mean.fill_(v)
            m.encoder[2].weight.fill_(v)
            m.encoder[2].num_batches_tracked.fill_(int(v))
    ua = algo.upload(a, nn.Module(), None, None)  # type: ignore[arg-type]
    ub = algo.upload(b, nn.Module(), None, None)  # type: ignore[arg-type]
    full = set(a.state_dict())
    assert set(ua.state) == full - kept
    state = algo.aggregate(ua.state, [Weighted(0, 1.0, ua), Weighted(1, 3.0, ub)], 1)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    algo.receive(a, nn.Module(), SharedState(state))
    after = a.state_dict()
    for k in full:
        if k in kept:  # untouched by the server
            assert torch.equal(after[k], before[k]), k
        else:  # the weighted mean (integer buffers: the max)
            assert torch.equal(after[k], state[k]), k
    if "encoder.2.running_mean" not in kept:
        assert torch.allclose(after["encoder.2.running_mean"], torch.full((6,), 2.5))


def test_unknown_bn_mode_is_refused():
    with pytest.raises(ValueError, match="bn = 'x'"):
        FedAvg(bn="x")


# ---- FedProx at the step level: anchor = the round's starting global model, factor mu/2 -------


def test_fedprox_steps_match_hand_made_sgd_with_the_rounds_global_anchor():
    """Two full-batch SGD steps by ``core.client.fit`` against the same steps written by hand.

    Step 1 starts at the global model (proximal gradient 0); step 2's proximal gradient is
    ``mu * (w1 - g)``: anchored to the round's global model ``g``, not to the previous step's
    weights (that would give 0 again), with the factor mu/2 in the loss (mu in the gradient).
    """
    from fedmosaic.algorithms.fedprox import FedProx
    from fedmosaic.core import client as client_ops
    from fedmosaic.core.client import ClientData
    from fedmosaic.core.training import TrainSettings

    class Source:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

        def batch(self, idx: torch.Tensor, device: str = "cpu") -> torch.Tensor:
            return self.x[idx].to(device)

    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 1, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    data = ClientData(0, Source(x), y, {"train": torch.arange(6)}, 3)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), nn.Linear(3, 3), 3, 3)
    g = {k: torch.randn_like(v) for k, v in model.state_dict().items()}  # the round's global
    mu, lr = 0.5, 0.1
    algo = FedProx(mu=mu)
    s = TrainSettings(batch_size=6, lr=lr)  # one full batch per epoch: order plays no role
    client_ops.fit(algo, model, nn.Module(), SharedState(g), data, s, 0, 1, 2)

    ref = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), nn.Linear(3, 3), 3, 3)
    ref.load_state_dict(g)
    for _ in range(2):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p -= lr * (p.grad + mu * (p - g[name]))  # d/dp of mu/2 ||p - g||^2
    for name, p in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[name], p, atol=1e-6), name
    # the proximal gradient acted: without it the weights differ
    plain = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), nn.Linear(3, 3), 3, 3)
    client_ops.fit(FedProx(mu=0.0), plain, nn.Module(), SharedState(g), data, s, 0, 1, 2)
    assert not torch.allclose(plain.head.weight, model.head.weight, atol=1e-4)
