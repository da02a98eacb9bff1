"""Every registered algorithm runs two rounds with every payload round-tripped through the wire."""

import math

import pytest
from helpers.experiments import tiny_raw

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.config import from_dict
from fedmosaic.experiment import run_experiment


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_two_rounds_with_wire_check(name):
    cls = ALGORITHMS.get(name)
    # Heterogeneous encoders (two CNN widths) wherever the method supports them.
    family = "htfe8-gray" if cls.supports_heterogeneous else "cnn1"
    raw = tiny_raw(model={"family": family}, algorithm={"name": name})
    doc = run_experiment(from_dict(raw), progress=False)
    rounds = doc["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert 0.0 <= r["acc_weighted"] <= 1.0 and math.isfinite(r["train_loss"])
        if cls.communicates:
            assert r["bytes_up"] > 0 and r["bytes_down"] > 0
        else:  # nothing exchanged: nothing counted (not the framing of empty payloads)
            assert r["bytes_up"] == 0 and r["bytes_down"] == 0
        assert r["rejected"] == []
    assert len(doc["clients"]) == 4
    assert all(0.0 <= c["acc"] <= 1.0 for c in doc["clients"])
