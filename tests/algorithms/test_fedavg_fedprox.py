import pytest
import torch
from conftest import tiny_raw
from torch import nn

from fedmosaic.algorithms._shared import weighted_average
from fedmosaic.algorithms.fedprox import proximal_term
from fedmosaic.config import from_dict
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
