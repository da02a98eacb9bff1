import pytest
import torch
from conftest import tiny_raw
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
