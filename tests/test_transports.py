"""Every runtime's transport is a whole ``core.rounds.Transport``: fit with progress, client states
out and in (a round trip), close; Flower's, whose clients keep their state on the SuperNodes,
says so with ``ClientStatesUnavailable``. And nothing probes a transport for what it may lack."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.experiments import tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.core.rounds import ClientStatesUnavailable, Transport
from fedmosaic.federation import Federation, build_federation
from fedmosaic.sim.backend import Runtime, make_transport

RUNTIMES = ["serial", "serial-offloaded", "processes", "flower"]
PROTOCOL = [
    "fit",
    "evaluate",
    "finetune",
    "client_states",
    "load_client_states",
    "set_progress",
    "close",
]


def _flower(fed: Federation, tmp_path: Path) -> Transport:
    pytest.importorskip("flwr")
    from fedmosaic.flower.app import client_app, eval_splits
    from fedmosaic.flower.local import LocalGrid
    from fedmosaic.flower.settings import FlowerOptions
    from fedmosaic.flower.transport import GridTransport

    n = fed.plan.num_clients
    rc = {
        "experiment": json.dumps(fed.cfg.to_dict()),
        "results-dir": str(tmp_path),
        "connect-timeout": 5.0,
    }
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], rc)
    options = FlowerOptions.from_run_config(rc)
    transport = GridTransport(grid, fed.algo, fed.clients, eval_splits(fed.clients), options)
    transport.connect()
    return transport


@pytest.fixture(params=RUNTIMES)
def runtime(request: Any, tmp_path: Path) -> Iterator[tuple[str, Federation, Transport]]:
    kind = request.param
    cfg = from_dict(tiny_raw())
    if kind == "serial":
        fed = build_federation(cfg)
        transport = make_transport(fed, Runtime("serial", 1, 0, "test"))
    elif kind == "serial-offloaded":
        fed = build_federation(cfg, offload=True)
        transport = make_transport(fed, Runtime("serial", 1, 0, "test"))
    elif kind == "processes":
        fed = build_federation(cfg, with_clients=False)
        transport = make_transport(fed, Runtime("processes", 2, 1, "test"))
    else:
        fed = build_federation(cfg, with_clients=False)
        transport = _flower(fed, tmp_path)
    try:
        yield kind, fed, transport
    finally:
        transport.close()


def _shifted(states: Any) -> list[tuple[dict, dict]]:
    """Copies of ``states`` with every floating tensor moved by 0.5 (a state no run has)."""

    def shift(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v + 0.5 if v.is_floating_point() else v.clone() for k, v in d.items()}

    return [(shift(m), shift(e)) for m, e in states]


def test_every_transport_implements_the_whole_protocol(runtime):
    kind, fed, transport = runtime
    for name in PROTOCOL:
        assert callable(getattr(transport, name)), f"{kind}: no {name}"
    calls: list[tuple[int, int]] = []
    transport.set_progress(lambda done, total: calls.append((done, total)))
    state = fed.algo.init_server(fed.spec)
    messages = {c: fed.algo.broadcast(state, c, 1) for c in range(fed.plan.num_clients)}
    results = transport.fit(1, messages)
    n = len(messages)
    assert [r.client_id for r in results] == list(messages)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert calls[0] == (0, n) and calls[-1] == (n, n), calls
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    transport.set_progress(None)  # reporting stops
    transport.fit(2, messages)
    assert calls[-1] == (n, n) and len([c for c in calls if c == (0, n)]) == 1

    if kind == "flower":
        with pytest.raises(ClientStatesUnavailable, match="SuperNodes"):
            transport.client_states()
        with pytest.raises(ClientStatesUnavailable, match="SuperNodes"):
            transport.load_client_states([])
        return
    trained = list(transport.client_states())
    assert len(trained) == n and len(transport.client_states()[1:]) == n - 1
    wanted = _shifted(trained)
    transport.load_client_states(wanted)
    back = list(transport.client_states())
    for cid, ((m, e), (bm, be)) in enumerate(zip(wanted, back, strict=True)):
        for mine, theirs in ((m, bm), (e, be)):
            assert sorted(mine) == sorted(theirs), cid
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), cid
    with pytest.raises(ValueError, match="clients"):
        transport.load_client_states(wanted[:-1])
    # The loaded states are what the clients train from: the round trip reached the clients.
    again = transport.fit(3, messages)
    assert all(r.error is None for r in again)


# ---- the guard: transports are used through the protocol, never probed ---------------------------
ROOT = Path(__file__).resolve().parents[1] / "fedmosaic"


def probes(source: str) -> list[int]:
    """Lines where ``hasattr``/``getattr`` is applied to something named like a transport."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and node.args
            and "transport" in ast.unparse(node.args[0]).lower()
        ):
            lines.append(node.lineno)
    return lines


def test_the_probe_finder_finds_probes():
    assert probes("if hasattr(transport, 'close'):\n    pass\n") == [1]
    assert probes("x = 1\nf = getattr(self.transport, 'on_client', None)\n") == [2]
    assert probes("getattr(model, 'head')\n") == []


def test_no_module_probes_a_transport():
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(ROOT.rglob("*.py"))
        if (lines := probes(path.read_text()))
    }
    assert found == {}, f"use the Transport protocol's methods instead: {found}"
