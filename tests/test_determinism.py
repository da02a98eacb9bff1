from helpers.experiments import round_numbers, tiny_raw

from fedmosaic.config import from_dict
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
