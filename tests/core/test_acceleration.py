"""``Algorithm.acceleration``: which built-in methods may batch clients and fuse SGD (pinned, so a
change shows), the re-declare rule for subclasses, and the retired flags refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.config import from_dict
from fedmosaic.core.algorithm import Acceleration, declared_acceleration
from fedmosaic.core.training import TrainSettings

BATCHED = {
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fedper",
    "fedproto",
    "fedrep",
    "fedtgp",
    "fedyogi",
    "lg_fedavg",
    "local",
}
NOT_BATCHED = {
    "fedbabu",
    "fedclassavg",
    "feddistill",
    "fedgen",
    "fedgh",
    "fedhenn",
    "fedhenn_homo",
    "fedkd",
    "fedprox",
    "fedrod",
    "fedseq_anti",
    "fedseq_vanilla",
    "fml",
    "ktpfl",
}


def test_the_table_of_built_in_methods():
    # the package's own methods: plugins other tests loaded in this process stay out
    built_in = {n for n, cls in ALGORITHMS.items() if cls.__module__.startswith("fedmosaic.")}
    assert built_in == BATCHED | NOT_BATCHED  # a new method joins the table
    got = {n: declared_acceleration(ALGORITHMS.get(n)()) for n in built_in}
    assert {n for n, a in got.items() if a.batched} == BATCHED
    assert all(a.fused_sgd for a in got.values())  # every built-in loss differentiates once


def test_a_subclass_overriding_the_training_must_declare_again():
    fedavg = ALGORITHMS.get("fedavg")

    @dataclass(frozen=True)
    class Renamed(fedavg):  # type: ignore[misc,valid-type]  # same training: inherits
        pass

    @dataclass(frozen=True)
    class OwnLoss(fedavg):  # type: ignore[misc,valid-type]
        def loss(self, model, extras, x, y, msg):
            return super().loss(model, extras, x, y, msg) * 2

    @dataclass(frozen=True)
    class OwnPhases(fedavg):  # type: ignore[misc,valid-type]
        def phases(self, round_num, epochs):
            return super().phases(round_num, epochs)

    @dataclass(frozen=True)
    class Declared(OwnLoss):
        acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    assert declared_acceleration(Renamed()) == Acceleration(batched=True, fused_sgd=True)
    assert declared_acceleration(OwnLoss()) == Acceleration()
    assert declared_acceleration(OwnPhases()) == Acceleration()
    assert declared_acceleration(Declared()) == Acceleration(fused_sgd=True)
    auto = from_dict({"data": {"dataset": "synthetic"}}).train  # train.fused_sgd = "auto"
    for algo, fused in ((Renamed(), True), (OwnLoss(), False), (Declared(), True)):
        assert TrainSettings.from_config(auto, algo).accel.fused_sgd is fused


@pytest.mark.parametrize("old", ["batchable", "fused_sgd_safe"])
def test_the_retired_flags_are_refused_not_ignored(old):
    with pytest.raises(TypeError, match="Acceleration"):
        type("Old", (ALGORITHMS.get("fedavg"),), {old: True})
