"""Server-side evaluation (``data.server_eval_size``): the server's own labelled split, carved out
before partitioning, and the global model of the methods that hold one evaluated on it."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.experiments import tiny_raw

from fedmosaic import api
from fedmosaic.algorithms.fedavg import FedAvg
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.rounds import server_evaluate
from fedmosaic.data import DatasetError, build_federated_data
from fedmosaic.federation import build_federation

HOMO = {"family": "fedhenn_cnn1"}  # one architecture: FedAvg's global model exists
SERVER_KEYS = ("server_acc", "server_loss")


def by_hand(state: dict[str, torch.Tensor], raw: dict) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of a fresh model holding ``state`` on the server's rows,
    recomputed from the data config alone (not through the round loop or ``spec.server_eval``)."""
    cfg = from_dict(raw)
    fd = build_federated_data(cfg.data, cfg.seed)
    model = build_federation(cfg, with_clients=False).spec.build_model(0)
    model.load_state_dict(state, strict=True)
    model.eval()
    x = fd.batch(fd.server_eval)
    y = fd.labels[fd.server_eval]
    with torch.no_grad():
        logits = model(x)
    acc = (logits.argmax(1) == y).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, y).item()
    return acc, loss


def test_the_split_is_the_servers_alone():
    raw = tiny_raw(data={"server_eval_size": 30})
    cfg = from_dict(raw)
    fd = build_federated_data(cfg.data, cfg.seed)
    plain = build_federated_data(from_dict(tiny_raw()).data, 0)
    server = set(fd.server_eval.tolist())
    assert len(server) == fd.server_eval.numel() == 30
    assert not server & set(fd.public.tolist())  # never the public inputs FedHeNN/KT-pFL use
    for cs in fd.clients:
        assert not server & set(cs.get("all").tolist())
    # carved out after the public split: the public inputs are the ones of a run without it
    assert torch.equal(fd.public, plain.public)
    assert sum(len(cs) for cs in fd.clients) == sum(len(cs) for cs in plain.clients) - 30
    assert plain.server_eval.numel() == 0


@pytest.mark.parametrize("name", ["fedavg", "fedadam"])
@pytest.mark.integration
def test_server_acc_each_evaluated_round_matches_a_recomputation(name):
    raw = tiny_raw(
        algorithm={"name": name},
        model=HOMO,
        data={"server_eval_size": 40},
        train={"rounds": 3, "eval_every": 2},
    )
    result = api.run(raw)
    evaluated = [r["round"] for r in result.rounds if "acc_weighted" in r]
    assert evaluated == [2, 3]
    assert [r["round"] for r in result.rounds if "server_acc" in r] == evaluated
    assert all("server_loss" in r for r in result.rounds if "server_acc" in r)
    state = result.server_state if name == "fedavg" else result.server_state.model
    acc, loss = by_hand(state, raw)
    last = result.rounds[-1]
    assert last["server_acc"] == pytest.approx(acc, abs=1e-12)
    assert last["server_loss"] == pytest.approx(loss, rel=1e-5)
    assert last["server_acc"] > 0.5  # 4 classes: chance is 0.25
    assert result.summary["server_evaluated"]["server_acc"] == last["server_acc"]
    assert result.summary["server_evaluated"]["round"] == 3
    assert "server-evaluated" not in result.summary["final"]  # client numbers stay as they are


def test_a_method_without_a_global_model_logs_once_and_records_nothing(caplog):
    raw = tiny_raw(algorithm={"name": "lg_fedavg"}, data={"server_eval_size": 40})
    with caplog.at_level(logging.INFO, logger="fedmosaic"):
        result = api.run(raw)
    assert not any(k in r for r in result.rounds for k in SERVER_KEYS)
    assert "server_evaluated" not in result.summary
    lines = [r for r in caplog.records if "server evaluation" in r.getMessage()]
    assert len(lines) == 1 and "LGFedAvg holds no global model" in lines[0].getMessage()


def test_no_global_model_without_averaged_batchnorm_or_in_a_heterogeneous_federation():
    fed = build_federation(
        from_dict(tiny_raw(model=HOMO, data={"server_eval_size": 40})), with_clients=False
    )
    state = FedAvg().init_server(fed.spec)
    assert FedAvg().server_model(state, fed.spec) is not None
    # local BatchNorm statistics (FedBN, PFLlib's parameters-only mean): no global model
    for bn in ("local_stats", "local"):
        assert FedAvg(bn=bn).server_model(state, fed.spec) is None
    het = build_federation(
        from_dict(
            tiny_raw(
                algorithm={"name": "lg_fedavg"},
                model={"family": "fedhenn5"},
                data={"server_eval_size": 40},
            )
        ),
        with_clients=False,
    )
    assert not het.spec.homogeneous
    assert FedAvg().server_model(state, het.spec) is None


def test_evaluating_leaves_torch_rng_alone():
    # Building the server's model reseeds torch's RNG: the clients' streams must not move.
    fed = build_federation(
        from_dict(tiny_raw(model=HOMO, data={"server_eval_size": 40})), with_clients=False
    )
    algo = fed.algo
    state = algo.init_server(fed.spec)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    out = server_evaluate(algo, state, fed.spec)
    assert set(out) == set(SERVER_KEYS)
    assert torch.equal(torch.get_rng_state(), before)


def test_off_by_default_changes_nothing():
    result = api.run(tiny_raw(model=HOMO))
    assert all(not k.startswith("server_") for r in result.rounds for k in r)
    assert "server_evaluated" not in result.summary
    fed = build_federation(from_dict(tiny_raw(model=HOMO)), with_clients=False)
    assert fed.spec.server_eval is None
    assert server_evaluate(fed.algo, fed.algo.init_server(fed.spec), fed.spec) == {}


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"data\.server_eval_size = -1"):
        from_dict(tiny_raw(data={"server_eval_size": -1}))
    cfg = from_dict(tiny_raw(data={"server_eval_size": 200}))  # 240 - 40 public = 200 left
    with pytest.raises(DatasetError, match=r"data\.server_eval_size = 200 leaves no samples"):
        build_federated_data(cfg.data, cfg.seed)


@pytest.mark.integration
def test_flower_reports_the_simulators_server_acc(tmp_path):
    pytest.importorskip("flwr")
    raw = tiny_raw(model=HOMO, data={"server_eval_size": 40}, train={"rounds": 2})
    sim = api.run(raw)
    flower = api.run_flower_in_memory(raw, tmp_path / "flower")
    got = [(r["round"], r.get("server_acc"), r.get("server_loss")) for r in flower["rounds"]]
    want = [(r["round"], r.get("server_acc"), r.get("server_loss")) for r in sim.rounds]
    assert got == want and all(acc is not None for _, acc, _ in got)
    assert flower["summary"]["server_evaluated"] == sim.summary["server_evaluated"]
