"""Every registered method under one hostile client, on the simulator and over Flower: the same
drops round by round and the same final numbers.

The guard is declared by each upload's fields (``core/schema.py`` roles) and applied by the round
loop (``core/guard.py``), so a method cannot run unprotected and no runtime differs. Client 0
trains honestly, then multiplies every floating tensor of its upload by ``FACTOR`` (on the
simulator, the payload's tensors; over Flower's in-memory Grid, the reply's floating arrays on
the wire: the same numbers). A tiny IID federation (6 clients, 4 classes: every class has more
than 3 holders, so the per-class row test applies), 2 rounds (round 1: prototypes have no global
row yet), the default ``[server]``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _attack import ATTACKER, attacked_run
from helpers.experiments import SMALL, tiny_raw

pytest.importorskip("flwr")

from _hostile import grid_run  # noqa: E402
from flwr.app import Array  # noqa: E402

from fedmosaic.algorithms import ALGORITHMS  # noqa: E402
from fedmosaic.core.payload import Payload  # noqa: E402

N = 6
ROUNDS = 2
FACTOR = -50.0
# Local sends nothing: there is nothing to poison.
METHODS = [n for n in ALGORITHMS.names() if n != "local"]
# FedClassAvg's contrastive term diverges at the tiny federation's lr 0.05 (tests/test_peer_guard.py)
TRAIN = {"fedclassavg": {"lr": 0.01}}


def experiment(name: str) -> dict[str, Any]:
    return tiny_raw(
        # small images: FedKD factorizes cnn1's first linear layer every round
        data={"num_clients": N, "partition": "iid", "min_size": 1, **SMALL},
        algorithm={"name": name},
        train={"rounds": ROUNDS, **TRAIN.get(name, {})},
        sim={"threads": 1, "check_wire": False, "progress": False},
    )


def scaled(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x * FACTOR
    if isinstance(x, dict):
        return {k: scaled(v) for k, v in x.items()}
    return x


def poison(round_num: int, upload: Payload, sent: Payload) -> Payload:
    """The simulator's attacker: every floating tensor of the upload x FACTOR."""
    fields = {f: scaled(getattr(upload, f)) for f in upload.__dataclass_fields__}
    return type(upload)(**fields)


def rewrite(name: str, arr: Array, sent: Array | None, round_num: int) -> Array:
    """Flower's attacker: every floating array of the reply x FACTOR (the same numbers)."""
    x = arr.numpy()
    return Array((x * FACTOR).astype(x.dtype))


@pytest.mark.parametrize("name", METHODS)
def test_one_hostile_client_is_dropped_alike_on_the_simulator_and_over_flower(name, tmp_path):
    sim = attacked_run(experiment(name), poison)
    assert not sim["diverged"], name
    # the attacker is dropped in every round, and nobody else
    assert sim["rejected"] == [[ATTACKER]] * ROUNDS, sim["rejected"]
    flower = grid_run(experiment(name), rewrite, tmp_path / "results", N)
    assert not flower["diverged"], name
    assert [r["rejected"] for r in flower["rounds"]] == sim["rejected"]
    assert math.isclose(flower["acc"], sim["acc"], abs_tol=1e-6), (flower["acc"], sim["acc"])
