"""The pieces of ``python -m fedmosaic.flower.node`` and of the ClientApp's per-run client cache
that can be checked without processes (``test_flower_deploy.py`` runs the whole thing)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from helpers.experiments import tiny_raw

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402

from fedmosaic.flower import app  # noqa: E402


def _context(raw: dict, run_id: int = 7, cid: int = 1) -> Context:
    node = {"partition-id": cid, "num-partitions": raw["data"]["num_clients"]}
    return Context(run_id, 1001 + cid, node, RecordDict(), {"experiment": json.dumps(raw)})


def test_a_cached_client_is_a_fresh_build():
    """Every message after the first starts from a copy of the first build: equal to what
    ``make_client`` returns, untouched by what an earlier message did to its copy, and with the
    global torch RNG where ``make_client`` leaves it."""
    from fedmosaic.federation import make_client

    raw = tiny_raw(algorithm={"name": "fedproto"}, model={"family": "fedhenn5"})
    first = app._Client(_context(raw))
    with torch.no_grad():
        for p in first.model.parameters():
            p.add_(1.0)  # what training does to the first message's copy
    torch.manual_seed(12345)  # and to the global RNG
    again = app._Client(_context(raw))
    rng_again = torch.get_rng_state()
    setup = again.setup
    model, extras = make_client(setup.cfg, setup.algo, setup.spec, setup.clients[1])
    assert torch.equal(rng_again, torch.get_rng_state())
    assert again.model is not first.model
    for got, want in ((again.model, model), (again.extras, extras)):
        a, b = got.state_dict(), want.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # another run: built again, not served from the old run's cache
    other = app._Client(_context(raw, run_id=8))
    assert (8, app._setup_key(other.context.run_config), 1) in app._BUILT
    assert not any(k[0] == 7 for k in app._BUILT)


def test_the_client_cache_is_bounded(monkeypatch: pytest.MonkeyPatch):
    """A process serving many clients (a Ray actor) keeps only the latest builds: memory does not
    grow with the population, and an evicted client is built again."""
    monkeypatch.setattr(app, "_BUILT_MAX", 2)
    raw = tiny_raw(algorithm={"name": "fedproto"}, model={"family": "fedhenn5"})
    for cid in (0, 1, 2, 3):
        app._Client(_context(raw, run_id=9, cid=cid))
    assert sorted(k[2] for k in app._BUILT) == [2, 3]
    again = app._Client(_context(raw, run_id=9, cid=0))  # evicted: a fresh build
    assert (9, app._setup_key(again.context.run_config), 0) in app._BUILT and len(app._BUILT) == 2


def test_the_generated_app_names_the_component_the_node_serves(tmp_path):
    from flwr.cli.build import build_fab_from_disk

    from fedmosaic.config import from_dict
    from fedmosaic.flower.node import CLIENT_APP, clientapp_component
    from fedmosaic.flower.project import write_app

    out = write_app(from_dict(tiny_raw()), tmp_path / "app", insecure=True)
    fab = SimpleNamespace(hash_str="h", content=build_fab_from_disk(out))
    assert clientapp_component(fab, {}) == CLIENT_APP


def test_supernode_sleeps_are_capped_in_that_module_only():
    import flwr.supernode.start_client_internal as loop

    from fedmosaic.flower.node import cap_supernode_sleeps

    saved = loop.time, loop.pull_objects
    try:
        cap_supernode_sleeps(0.01)
        start = time.perf_counter()
        loop.time.sleep(3)  # Flower's idle wait
        assert time.perf_counter() - start < 1.0
        assert abs(loop.time.time() - time.time()) < 1.0  # the rest of `time` is the real one
        assert loop.pull_objects.keywords["initial_backoff"] == 0.01
        assert time.sleep is saved[0].sleep  # the process's own `time` is untouched
    finally:
        loop.time, loop.pull_objects = saved
