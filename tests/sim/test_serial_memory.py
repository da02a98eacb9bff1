"""The serial backend with offloaded clients (``sim.offload_clients``): the numbers of every client
in memory and of the process backend, O(participants) live models, checkpoints, cleanup."""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from pathlib import Path

import pytest
import torch
from helpers.experiments import SMALL, numbers, run_until_round, tiny_raw, write_toml

from fedmosaic import federation
from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.api import load_run
from fedmosaic.api import run as api_run
from fedmosaic.checkpoint import FILENAME, CheckpointPolicy
from fedmosaic.cli import main
from fedmosaic.config import from_dict
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.model import ClientModel
from fedmosaic.experiment import run_experiment
from fedmosaic.federation import build_federation
from fedmosaic.sim.host import MAX_SPARES


def big_raw(offload: str, backend: str = "serial", clients: int = 300) -> dict:
    """``clients`` clients of eight architectures at 10% participation, with personal state
    (LG-FedAvg's local encoders), so an offloaded client must come back as it left."""
    raw = tiny_raw(
        data={
            **SMALL,
            "partition": "iid",
            "num_clients": clients,
            "synthetic_size": 8 * clients,
            "public_size": 0,
        },
        model={"family": "htfe8-gray"},
        train={"rounds": 3, "participation": 0.1},
        sim={"offload_clients": offload, "backend": backend, "threads": 1, "workers": 2},
        algorithm={"name": "lg_fedavg"},
    )
    raw["sim"]["check_wire"] = False
    return raw


@pytest.fixture
def live_models(monkeypatch):
    """Counts ClientModel instances alive at once: ``peak[0]`` is the most there ever were."""
    alive: weakref.WeakSet[ClientModel] = weakref.WeakSet()
    peak = [0]
    original = ClientModel.__init__

    def counting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        alive.add(self)
        peak[0] = max(peak[0], len(alive))

    monkeypatch.setattr(ClientModel, "__init__", counting)
    return peak


def test_offloaded_population_gives_the_same_numbers_with_participants_live(live_models):
    offloaded = numbers(run_experiment(from_dict(big_raw("on")), progress=False))
    bound = MAX_SPARES * 8 + 2  # spares per architecture, the client at work, one borrowed
    assert live_models[0] <= bound < 30  # 30 = one round's clients
    live_models[0] = 0
    in_memory = numbers(run_experiment(from_dict(big_raw("off")), progress=False))
    assert live_models[0] >= 300  # the test can fail: in memory, every client is alive
    assert offloaded == in_memory
    assert offloaded[0][-1]["acc_weighted"] > 0
    processes = numbers(run_experiment(from_dict(big_raw("on", "processes")), progress=False))
    assert processes == offloaded


def _offloaded_and_not(raw: dict) -> dict[str, list]:
    """The same run's numbers with the serial backend's offloading off and on."""
    got = {}
    for offload in ("off", "on"):
        raw["sim"].update(offload_clients=offload, threads=1)
        got[offload] = numbers(run_experiment(from_dict(raw), progress=False))
    return got


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_is_identical_offloaded(name: str):
    """Half the clients per round on one architecture: spare modules carry other clients' state
    between uses, so anything a client keeps outside its parameters and buffers would show."""
    raw = tiny_raw(
        data={**SMALL, "num_clients": 6, "synthetic_size": 360},
        train={"rounds": 3, "participation": 0.5},
        algorithm={"name": name},
    )
    got = _offloaded_and_not(raw)
    assert got["on"] == got["off"]


@pytest.mark.parametrize("name", ["fedavg", "lg_fedavg"])
def test_batched_clients_are_identical_offloaded(name: str):
    raw = tiny_raw(
        data={**SMALL, "num_clients": 6, "synthetic_size": 360},
        train={"rounds": 2, "participation": 0.5, "batched_clients": True},
        algorithm={"name": name},
    )
    got = _offloaded_and_not(raw)
    assert got["on"] == got["off"]


@pytest.mark.parametrize("name", ["lg_fedavg", "fedrod", "fedtgp"])
def test_interrupted_and_resumed_offloaded_run_is_identical(
    tmp_path: Path, monkeypatch, caplog, name
):
    raw = tiny_raw(
        data={**SMALL, "num_clients": 6, "synthetic_size": 360},
        model={"family": "htfe8-gray" if ALGORITHMS.get(name).supports_heterogeneous else "cnn1"},
        train={"rounds": 3, "participation": 0.5},
        sim={"offload_clients": "off", "threads": 1},
        algorithm={"name": name},
    )
    ref = numbers(run_experiment(from_dict(raw), progress=False))
    raw["sim"]["offload_clients"] = "on"
    cfg = from_dict(raw)
    run_until_round(cfg, 2, tmp_path, monkeypatch)
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(tmp_path / FILENAME, copy / FILENAME)
    with caplog.at_level(logging.INFO, logger="fedmosaic"):
        got = run_experiment(
            cfg, progress=False, checkpoint=CheckpointPolicy(tmp_path, resume=True)
        )
        # The offloaded run's checkpoint, resumed with every client in memory: the same again.
        raw["sim"]["offload_clients"] = "off"
        back = run_experiment(
            from_dict(raw), progress=False, checkpoint=CheckpointPolicy(copy, resume=True)
        )
    assert caplog.text.count("after round 2") == 2  # both resumed
    assert numbers(got) == ref
    assert numbers(back) == ref


def test_api_run_returns_the_same_models_offloaded():
    raw = tiny_raw(
        data={**SMALL, "num_clients": 6, "synthetic_size": 360},
        train={"rounds": 2, "participation": 0.5},
        algorithm={"name": "fedrod"},
    )
    results = [api_run(raw, [f"sim.offload_clients={o}", "sim.threads=1"]) for o in ("off", "on")]
    assert (
        results[0].document["rounds"][-1]["acc_weighted"]
        == (results[1].document["rounds"][-1]["acc_weighted"])
    )
    for a, b in zip(results[0].models + results[0].extras, results[1].models + results[1].extras):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_kept_models_of_an_offloaded_run_load_as_in_memory(tmp_path: Path):
    """``fedmosaic run`` keeps the final models (through ``client_states``); ``load_run``."""
    toml = write_toml(
        tmp_path / "tiny.toml",
        tiny_raw(
            data={**SMALL, "num_clients": 6, "synthetic_size": 360}, algorithm={"name": "fedrod"}
        ),
    )
    loaded = []
    for offload in ("off", "on"):
        out = tmp_path / offload
        args = [
            "run",
            str(toml),
            "--out",
            str(out),
            "--quiet",
            "--save-models",
            "--set",
            "sim.threads=1",
        ]
        assert main([*args, "--set", f"sim.offload_clients={offload}"]) == 0
        loaded.append(load_run(out))
    for a, b in zip(loaded[0].models + loaded[0].extras, loaded[1].models + loaded[1].extras):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_auto_offloads_above_the_budget_only(monkeypatch):
    raw = tiny_raw(data={**SMALL, "num_clients": 6, "synthetic_size": 360})
    cfg = from_dict(raw)
    one = build_federation(cfg)  # default: every client in memory, whatever the setting
    state = federation.module_nbytes(one.models[0], one.extras[0])
    assert not one.offload and len(one.models) == 6
    monkeypatch.setattr(federation, "OFFLOAD_BUDGET", 6 * state)  # exactly fits: in memory
    fed = build_federation(cfg, offload=None)
    assert not fed.offload and len(fed.models) == 6
    monkeypatch.setattr(federation, "OFFLOAD_BUDGET", 6 * state - 1)
    fed = build_federation(cfg, offload=None)
    assert fed.offload and fed.models == [] and fed.extras == []
    cfg.sim.offload_clients = "off"
    assert not build_federation(cfg, offload=None).offload
    cfg.sim.offload_clients = "on"
    monkeypatch.setattr(federation, "OFFLOAD_BUDGET", 2**60)
    assert build_federation(cfg, offload=None).offload
    assert not build_federation(cfg).offload  # callers that read fed.models get them


def test_the_state_store_is_removed_after_the_run(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def during(_record):
        seen.append(sorted(p.name for p in tmp_path.glob("fedmosaic-states-*")))

    raw = tiny_raw(sim={"offload_clients": "on"}, train={"participation": 0.5})
    run_experiment(from_dict(raw), progress=False, on_round=during)
    assert seen and all(len(names) == 1 for names in seen)  # one store, used while it ran
    assert not list(tmp_path.glob("fedmosaic-states-*"))


def test_a_bad_setting_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="sim.offload_clients"):
        from_dict(tiny_raw(sim={"offload_clients": "sometimes"}))


def test_the_budget_on_a_card_is_half_its_free_memory(monkeypatch):
    """Client states on a CUDA device wait there while half the card's free memory holds them
    (the store would copy each off, through a file and back every round); the host's budget
    stays the floor."""
    assert federation.offload_budget("cpu") == federation.OFFLOAD_BUDGET
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (100 * 2**30, 141 * 2**30))
    assert federation.offload_budget("cuda") == 50 * 2**30
    assert federation.offload_budget("cuda:0") == 50 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2**20, 141 * 2**30))
    assert federation.offload_budget("cuda") == federation.OFFLOAD_BUDGET
