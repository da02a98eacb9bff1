"""Parts of the simulator backends: balancing, the state store, message dedup, the eval cache."""

from __future__ import annotations

import torch
from helpers.experiments import tiny_raw
from torch import nn

from fedmosaic.config import from_dict
from fedmosaic.core.rounds import run_rounds
from fedmosaic.experiment import build_federation, make_transport
from fedmosaic.sim.common import EvalCache, MessageTable
from fedmosaic.sim.processes import assign, balance
from fedmosaic.sim.store import StateStore


def test_assign_largest_first_balances_and_is_deterministic():
    cost = [5.0, 1.0, 4.0, 3.0, 3.0, 2.0]
    groups = balance(cost, 2)
    assert sorted(c for g in groups for c in g) == list(range(6))
    loads = sorted(sum(cost[c] for c in g) for g in groups)
    assert loads == [9.0, 9.0]
    assert groups == balance(cost, 2)
    # committed loads are respected: the free clients go to the idle worker first
    assert assign([0], cost, 2, loads=[10.0, 0.0]) == [[], [0]]


def test_store_round_trip_and_layout_check(tmp_path):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    extras = nn.Module()
    extras.register_buffer("known", torch.tensor([True, False]))
    store = StateStore(tmp_path / "s")
    store.save(7, a, extras)
    b = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    e2 = nn.Module()
    e2.register_buffer("known", torch.tensor([False, False]))
    assert store.load(7, b, e2)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert torch.equal(e2.known, extras.known)
    assert not store.load(8, b, e2)
    other = nn.Sequential(nn.Linear(3, 5))
    try:
        store.load(7, other, nn.Module())
    except ValueError as exc:
        assert "layout" in str(exc)
    else:
        raise AssertionError("a different layout must not load")
    store.close()
    assert not (tmp_path / "s").exists()


def test_store_skips_non_persistent_scratch_buffers(tmp_path):
    """A scratch buffer whose shape changes between rounds (FedHeNN-homo's kernel) is not state."""
    model = nn.Linear(2, 2)
    extras = nn.Module()
    extras.register_buffer("kernel", torch.ones(3, 3), persistent=False)
    store = StateStore(tmp_path / "s")
    store.save(0, model, extras)
    fresh = nn.Module()
    fresh.register_buffer("kernel", torch.zeros(0, 0), persistent=False)
    assert store.load(0, nn.Linear(2, 2), fresh)  # used to fail: "stored state has another layout"
    assert fresh.kernel.shape == (0, 0)
    store.close()


def test_message_table_encodes_shared_messages_once():
    from fedmosaic.algorithms._shared import SharedState

    state = {"w": torch.ones(3)}
    msgs = {0: SharedState(state), 1: SharedState(state), 2: SharedState({"w": torch.ones(3)})}
    table = MessageTable(msgs)
    assert len(table.blobs) == 1  # same object, and same bytes
    assert table.digest(0) == table.digest(2)
    blobs, clients = table.part([2, 0])
    assert list(blobs) == [0] and clients == [(2, 0), (0, 0)]


def test_eval_cache_reuses_only_unchanged_clients(monkeypatch):
    # Local never communicates: a client not sampled keeps its model and gets the same (empty)
    # message, so its evaluation is reused; the numbers equal those without the cache.
    raw = tiny_raw(algorithm={"name": "local"}, train={"participation": 0.5, "rounds": 3})
    fed = build_federation(from_dict(raw))
    transport = make_transport(fed)
    history, _ = run_rounds(fed.algo, fed.spec, transport, fed.plan)
    assert transport.cache.hits > 0

    monkeypatch.setattr(EvalCache, "get", lambda self, cid, key: None)
    fed2 = build_federation(from_dict(raw))
    history2, _ = run_rounds(fed2.algo, fed2.spec, make_transport(fed2), fed2.plan)
    strip = [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in history.rounds]
    strip2 = [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in history2.rounds]
    assert strip == strip2


def test_a_killed_runs_leftovers_are_removed_by_the_next_run(tmp_path):
    import os
    import subprocess
    import sys

    from fedmosaic.sim.store import remove_stale

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(dead.stdout)
    (tmp_path / f"fedmosaic-states-{dead_pid}-abc").mkdir()
    (tmp_path / f"fedmosaic-states-{dead_pid}-abc" / "0.bin").write_bytes(b"x")
    (tmp_path / f"fedmosaic-states-{os.getpid()}-live").mkdir()  # a running owner: kept
    (tmp_path / "fedmosaic-states-notapid").mkdir()  # not ours by name: kept
    removed = remove_stale(tmp_path, "fedmosaic-states-")
    assert [p.name for p in removed] == [f"fedmosaic-states-{dead_pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"fedmosaic-states-{os.getpid()}-live", "fedmosaic-states-notapid"]
    )
