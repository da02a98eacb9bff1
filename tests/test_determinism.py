import pytest
import torch
from helpers.experiments import round_numbers, tiny_raw

from fedmosaic.config import ConfigError, from_dict
from fedmosaic.experiment import run_experiment


def strip(doc):
    return round_numbers(doc), doc["clients"]


def test_same_seed_same_numbers_different_seed_differs():
    raw = tiny_raw(
        model={"family": "htfe8-gray"},
        algorithm={"name": "lg_fedavg"},
        train={"participation": 0.5, "rounds": 3},
    )
    a = run_experiment(from_dict(raw), progress=False)
    b = run_experiment(from_dict(raw), progress=False)
    assert strip(a) == strip(b)
    raw["seed"] = 1
    c = run_experiment(from_dict(raw), progress=False)
    assert strip(c) != strip(a)


def test_partial_participation_records_participants():
    raw = tiny_raw(train={"participation": 0.5, "rounds": 2}, algorithm={"name": "fedavg"})
    doc = run_experiment(from_dict(raw), progress=False)
    for r in doc["rounds"]:
        assert len(r["participants"]) == 2 and r["num_sampled"] == 2


def test_architecture_init_starts_clients_of_one_member_identical():
    """``model.init = "architecture"`` (HtFLlib's seed 0 before every client's model): clients
    holding the same family member start from the same weights, other members differ; the
    default gives every client its own initial weights."""
    from fedmosaic.data.federated import build_federated_data
    from fedmosaic.federation import model_builder

    def states(init: str) -> list[dict]:
        raw = tiny_raw(model={"family": "htfe2", "init": init}, algorithm={"name": "local"})
        cfg = from_dict(raw)
        build = model_builder(cfg, build_federated_data(cfg.data, cfg.seed))
        return [build(cid).state_dict() for cid in range(4)]

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    shared = states("architecture")
    assert same(shared[0], shared[2]) and same(shared[1], shared[3])  # members i mod 2
    own = states("client")
    assert same(own[0], shared[0]) and same(own[1], shared[1])  # clients 0, 1: their own stream
    assert not same(own[0], own[2]) and not same(own[1], own[3])


def test_split_seed_fixes_the_split_while_the_experiment_seed_moves_the_rest():
    """``data.split_seed``: the same clients' rows under two experiment seeds, other initial
    weights; -1 (the default) is the experiment seed."""
    from fedmosaic.data.federated import build_federated_data
    from fedmosaic.federation import model_builder

    def rows_and_model(seed: int, split_seed: int) -> tuple[list, dict]:
        raw = tiny_raw(data={"split_seed": split_seed})
        raw["seed"] = seed
        cfg = from_dict(raw)
        data = build_federated_data(cfg.data, cfg.seed)
        rows = [c.get("train").tolist() + c.get("test").tolist() for c in data.clients]
        return rows, model_builder(cfg, data)(0).state_dict()

    rows0, model0 = rows_and_model(0, -1)
    rows1, model1 = rows_and_model(1, 0)  # experiment seed 1 on seed 0's split
    assert rows1 == rows0
    assert any(not torch.equal(model0[k], model1[k]) for k in model0)
    assert rows_and_model(1, -1)[0] != rows0  # without it, the split follows the seed
    with pytest.raises(ConfigError, match="data.split_seed"):
        from_dict(tiny_raw(data={"split_seed": -2}))
