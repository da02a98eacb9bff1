"""Step graphs (accel/graphs.py, train.cuda_graphs): captured once, replayed, the same numbers.

On CPU ``cuda_graphs = true`` runs the graph path's bookkeeping with the captured function called
in place of a CUDA graph: group tensors kept at fixed addresses across rounds, refreshed every
round (parameters, the broadcast, the optimizer state), one step function per (phase, clients,
batch size) made once and replayed. A replay that read a stale buffer or a later phase's
variables changes the numbers, so these histories must equal the eager batched path bit for bit.
The capture itself is tested on a card (``tests/core/test_cuda.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.experiments import round_numbers, tiny_raw

from fedmosaic.accel import batched, engaged
from fedmosaic.accel.graphs import StepGraphs
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.registry import FAMILIES
from fedmosaic.core.training import AccelSettings
from fedmosaic.experiment import build_federation, run_experiment

MIXED = "test-graphs-cnn1-cnn2"  # two layouts: two groups of three
if MIXED not in FAMILIES:
    FAMILIES.add(MIXED, ["cnn1", "cnn2"])


def _history(algo, family, graphs, rounds=3, **train):
    raw = tiny_raw(
        data={"num_clients": 6, "synthetic_shape": [1, 16, 16]},
        model={"family": family, "feature_dim": 16},
        algorithm={"name": algo},
        train={
            "rounds": rounds,
            "batched_clients": True,
            "cuda_graphs": graphs,
            "fused_sgd": False,
            **train,
        },
        sim={"threads": 1},
    )
    batched.clear_graphs()
    return round_numbers(run_experiment(from_dict(raw), progress=False))


@pytest.mark.parametrize(
    ("algo", "family", "train"),
    [
        ("fedtgp", MIXED, {}),  # the broadcast changes every round: read from the static copy
        ("lg_fedavg", MIXED, {"momentum": 0.9, "weight_decay": 1e-3}),
        ("fedrep", "cnn1", {}),  # two phases: each step keeps its own phase's optimizer
        ("fedavg", "resnet4", {"local_epochs": 2}),  # BatchNorm buffers, two epochs
        ("fedproto", "cnn1", {"participation": 0.5}),  # groups of three out of six
    ],
    ids=lambda v: str(v),
)
def test_graph_path_equals_the_eager_batched_path_bitwise(algo, family, train):
    eager = _history(algo, family, False, **train)
    engaged.clear()
    graphed = _history(algo, family, True, **train)
    assert engaged["graph_captures"] > 0
    # from round 2 on, every full-size step of a kept group replays
    assert engaged["graph_replays"] > engaged["graph_captures"]
    assert eager == graphed
    assert eager[-1]["train_loss"] < eager[0]["train_loss"]  # it trained


def test_a_stale_buffer_would_be_caught(monkeypatch):
    """The test above can fail: a kept group that skips refreshing its broadcast copy replays
    the previous round's prototypes, and the history moves."""
    eager = _history("fedtgp", MIXED, False)
    real = batched._static_for

    first_seen: dict[int, dict] = {}

    def stale(*args):
        st = real(*args)
        kept = first_seen.setdefault(id(st), {k: v.clone() for k, v in st.msg.items()})
        for k, v in st.msg.items():  # undo the refresh: the first round's broadcast stays
            v.copy_(kept[k])
        return st

    monkeypatch.setattr(batched, "_static_for", stale)
    assert _history("fedtgp", MIXED, True) != eager


def test_lone_clients_join_as_groups_of_one():
    """With graphs on, a client alone with its layout trains through the replayed path."""
    keys = {0: "a", 1: "b", 2: "a"}
    assert batched.groups([0, 1, 2], keys, min_size=1) == ([[0, 2], [1]], [])
    fed = build_federation(
        from_dict(
            tiny_raw(
                data={"num_clients": 3},
                model={"family": MIXED, "feature_dim": 16},
                algorithm={"name": "lg_fedavg"},
                train={"batched_clients": True, "cuda_graphs": True},
            )
        )
    )

    def take(c):
        return fed.models[c], fed.extras[c]

    assert fed.settings.graphs_enabled
    assert batched.plan_groups(fed.algo, [0, 1, 2], take, 1) == ([[0, 2], [1]], [])
    assert batched.plan_groups(fed.algo, [0, 1, 2], take, 2) == ([[0, 2]], [1])


def test_kept_groups_are_bounded_and_clearable():
    batched.clear_graphs()
    _history("lg_fedavg", MIXED, True, rounds=1)
    assert 0 < len(batched._STATIC) <= batched.STATIC_ENTRIES
    batched.clear_graphs()
    assert not batched._STATIC
    _history("lg_fedavg", MIXED, False, rounds=1)
    assert not batched._STATIC  # nothing kept without graphs


def test_step_graphs_warm_then_capture_then_replay():
    engaged.clear()
    graphs = StepGraphs("cpu")
    calls = []
    for i in range(4):
        graphs.run("k", lambda i=i: calls.append(i))
    # eager once (warm-up), captured at the second sight (which runs it), then replayed: the
    # closure captured on the second call is what runs from then on, as a graph's kernels are
    assert calls == [0, 1, 1, 1]
    assert len(graphs) == 1 and engaged["graph_captures"] == 1 and engaged["graph_replays"] == 3


def test_settings_switch_and_validation():
    s = build_federation(from_dict(tiny_raw())).settings
    assert s.accel.cuda_graphs == "auto" and not s.graphs_enabled  # CPU: off
    assert replace(s, device="cuda").graphs_enabled  # auto: on with CUDA (batched auto-on)
    off = AccelSettings(batched_clients=False, cuda_graphs=True)
    assert not replace(s, device="cuda", accel=off).graphs_enabled  # only with batched clients
    on_cpu = AccelSettings(batched_clients=True, cuda_graphs=True)
    assert replace(s, accel=on_cpu).graphs_enabled
    with pytest.raises(ConfigError, match="train.cuda_graphs = 'yes'"):
        from_dict(tiny_raw(train={"cuda_graphs": "yes"}))


def test_adam_and_bf16_are_never_captured():
    """A graph bakes in the Python it ran: Adam's per-step bias corrections and autocast's
    weight cache cannot be replayed, so those groups run the eager batched step."""
    s = build_federation(from_dict(tiny_raw())).settings
    on = AccelSettings(batched_clients=True, cuda_graphs=True)
    assert batched._graphable(replace(s, accel=on))
    assert not batched._graphable(replace(s, accel=on, optimizer="adam"))
    assert not batched._graphable(replace(s, accel=on, precision="bf16"))
    engaged.clear()
    _history("fedavg", "cnn1", True, rounds=2, optimizer="adam", lr=1e-3)
    assert engaged["graph_captures"] == engaged["graph_replays"] == 0
    assert engaged["batched_steps"] > 0


def test_cuda_graphs_key_keeps_old_hashes():
    from fedmosaic.checkpoint import config_hash

    raw = tiny_raw()
    train = raw.get("train", {})
    assert config_hash(raw) == config_hash({**raw, "train": {**train, "cuda_graphs": "auto"}})
    assert config_hash(raw) != config_hash({**raw, "train": {**train, "cuda_graphs": True}})
