"""A config that says nothing about the runtime runs on the fastest setup, with the same numbers.

``sim.backend = "auto"`` and ``sim.threads = "auto"`` (the defaults) resolve per run
(``sim/backend.py``): worker processes of one thread each when the machine has two cores or more
and the run is large enough to repay starting them (how many of them train a round is then
measured between rounds), else serial on one thread. Before, the
default was serial on torch's own thread count: on a busy 2-core machine 12x slower.
"""

from __future__ import annotations

import pytest
from helpers.experiments import SMALL, numbers, tiny_raw

from fedmosaic.checkpoint import config_hash
from fedmosaic.cli import main
from fedmosaic.config import ConfigError, SimConfig, from_dict
from fedmosaic.experiment import run_experiment
from fedmosaic.federation import build_federation
from fedmosaic.sim import backend


def _machine(monkeypatch, cores: int, spare: int | None = None) -> None:
    monkeypatch.setattr(backend, "default_workers", lambda: cores)
    monkeypatch.setattr(backend, "spare_cores", lambda: cores if spare is None else spare)


def _runtime(monkeypatch, cores: int, min_flops: float, spare: int | None = None, **sim):
    _machine(monkeypatch, cores, spare)
    monkeypatch.setattr(backend, "MIN_PROCESS_FLOPS", min_flops)
    fed = build_federation(from_dict(tiny_raw(data=SMALL, sim=sim)), with_clients=False)
    return backend.resolve_runtime(fed)


def test_the_default_is_auto_and_resolves_to_one_thread_workers_on_spare_cores(monkeypatch):
    assert (SimConfig().backend, SimConfig().threads) == ("auto", "auto")
    rt = _runtime(monkeypatch, cores=2, min_flops=0.0)
    assert (rt.backend, rt.workers, rt.threads) == ("processes", 2, 1)
    assert rt.adaptive  # how many workers train a round is measured as the run goes
    rt = _runtime(monkeypatch, cores=1, min_flops=0.0)
    assert (rt.backend, rt.workers, rt.threads, rt.adaptive) == ("serial", 1, 1, False)
    # a busy machine (other work on all but one core): two workers, and the layout measured
    # between rounds decides whether both train (sim/layout.py)
    rt = _runtime(monkeypatch, cores=2, spare=1, min_flops=0.0)
    assert (rt.backend, rt.workers, rt.threads, rt.adaptive) == ("processes", 2, 1, True)
    rt = _runtime(monkeypatch, cores=16, spare=3, min_flops=0.0)
    assert (rt.backend, rt.workers, rt.threads) == ("processes", 3, 1)
    rt = _runtime(monkeypatch, cores=16, spare=0, min_flops=0.0)
    assert (rt.backend, rt.workers, rt.adaptive) == ("processes", 2, True)
    # an explicit worker count or explicit processes: the layout is the one asked for
    assert not _runtime(monkeypatch, cores=2, min_flops=0.0, workers=2).adaptive
    assert not _runtime(monkeypatch, cores=2, min_flops=0.0, backend="processes").adaptive
    # too little work to repay starting interpreters (a unit-test federation): serial
    rt = _runtime(monkeypatch, cores=8, min_flops=1e15)
    assert (rt.backend, rt.threads) == ("serial", 1)
    assert "GFLOP" in rt.why


@pytest.mark.parametrize(
    ("sim", "want"),
    [
        ({"backend": "serial", "threads": 0}, ("serial", 1, 0)),  # 0: torch's default, untouched
        ({"backend": "serial", "threads": 3}, ("serial", 1, 3)),
        ({"backend": "serial"}, ("serial", 1, 1)),
        ({"backend": "processes", "workers": 3}, ("processes", 3, 1)),
        ({"backend": "processes", "threads": 2}, ("processes", 2, 2)),
        ({"threads": 2}, ("serial", 1, 2)),  # auto backend, 2 threads asked: one process
        ({"threads": 0}, ("processes", 2, 1)),  # auto backend: every client on one thread
    ],
)
def test_explicit_settings_are_honoured(monkeypatch, sim, want):
    rt = _runtime(monkeypatch, cores=2, min_flops=0.0, **sim)
    assert (rt.backend, rt.workers, rt.threads) == want


@pytest.mark.parametrize(
    ("key", "value"),
    [("backend", "fast"), ("threads", "many"), ("threads", -1), ("threads", True)],
)
def test_bad_runtime_values_are_one_line_errors(tmp_path, capsys, key, value):
    with pytest.raises(ConfigError, match=rf"sim\.{key}"):
        from_dict(tiny_raw(data=SMALL, sim={key: value}))
    text = value if isinstance(value, str) else str(value).lower()
    assert main(["run", "--set", f"sim.{key}={text}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"sim.{key}" in err[0], err


def test_auto_gives_the_numbers_of_serial_on_one_thread(monkeypatch):
    """Whichever backend auto picks, the numbers are serial's with ``sim.threads = 1``, bit for
    bit; the choice is recorded in provenance, the config keeps "auto"."""
    args = {"data": SMALL, "algorithm": {"name": "lg_fedavg"}, "train": {"participation": 0.5}}
    raw = tiny_raw(**args)
    serial = run_experiment(from_dict(tiny_raw(**args, sim={"backend": "serial", "threads": 1})))
    _machine(monkeypatch, 2)
    seen = []
    for min_flops in (1e15, 0.0):  # auto -> serial, auto -> processes
        monkeypatch.setattr(backend, "MIN_PROCESS_FLOPS", min_flops)
        doc = run_experiment(from_dict(raw), progress=False)
        assert doc["config"]["sim"]["backend"] == "auto"
        seen.append(doc["provenance"]["runtime"]["backend"])
        assert numbers(doc) == numbers(serial)
    assert seen == ["serial", "processes"]
    assert numbers(serial)[0][-1]["acc_weighted"] > 0


@pytest.mark.golden
def test_auto_keeps_the_identity_of_the_runs_recorded_before_it():
    """The committed cells were recorded as processes with threads 0; "auto" gives their numbers,
    so it hashes as them (compare reuses them) and serial with auto threads as serial with 1."""
    recorded = from_dict(tiny_raw(sim={"backend": "processes", "threads": 0})).to_dict()
    assert config_hash(from_dict(tiny_raw()).to_dict()) == config_hash(recorded)
    now = from_dict(tiny_raw(sim={"backend": "processes"})).to_dict()
    assert config_hash(now) == config_hash(recorded)
    one = from_dict(tiny_raw(sim={"backend": "serial", "threads": 1})).to_dict()
    auto = from_dict(tiny_raw(sim={"backend": "serial"})).to_dict()
    assert config_hash(auto) == config_hash(one)
    torch_default = from_dict(tiny_raw(sim={"backend": "serial", "threads": 0})).to_dict()
    assert config_hash(torch_default) != config_hash(one)
    zero = from_dict(tiny_raw(sim={"threads": 0})).to_dict()  # auto backend: one thread a client
    assert config_hash(zero) == config_hash(recorded)
    two = from_dict(tiny_raw(sim={"threads": 2})).to_dict()  # auto backend: serial on 2 threads
    assert config_hash(two) == config_hash(
        from_dict(tiny_raw(sim={"backend": "serial", "threads": 2})).to_dict()
    )


@pytest.mark.parametrize("asked", ["auto", "serial"])
def test_a_run_assembles_its_federation_once(monkeypatch, asked):
    # "auto" choosing serial used to assemble the data, algorithm and spec a second time to
    # build the clients; now they are added to the federation already built.
    import fedmosaic.experiment as experiment
    import fedmosaic.federation as federation

    _machine(monkeypatch, cores=1)  # one core: auto chooses serial
    calls: list[str] = []
    assemble = federation._assemble

    def counted(*args, **kwargs):
        calls.append("assemble")
        return assemble(*args, **kwargs)

    monkeypatch.setattr(federation, "_assemble", counted)
    doc = experiment.run_experiment(
        from_dict(tiny_raw(data=SMALL, sim={"backend": asked}, train={"rounds": 1})),
        progress=False,
    )
    assert calls == ["assemble"]
    assert doc["provenance"]["runtime"]["backend"] == "serial"
