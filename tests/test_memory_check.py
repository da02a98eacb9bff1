"""A run that cannot fit in memory is refused from its config, before anything is built (issue 37).

``--set data.num_clients=10000000 --set data.min_size=0`` on the synthetic set used to partition
for 220 s up to 5.5 GB and end in a ``MemoryError`` traceback; ``synthetic_size = 1e6`` with
``synthetic_classes = 1e6`` was accepted. The available memory is monkeypatched here: nothing in
these tests allocates more than a few MB.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic import api, federation, memory
from fedmosaic.cli import default_config_path, main
from fedmosaic.config import ConfigError, from_dict, load
from fedmosaic.federation import check_runs, memory_parts, model_state_bytes, module_nbytes

# Many clients over many one-pixel images: cheap to describe, far too many to hold in 50 MB.
CROWD = {
    "dataset": "synthetic",
    "synthetic_size": 400_000,
    "synthetic_shape": [1, 1, 1],
    "num_clients": 100_000,
    "min_size": 0,
    "partition": "iid",
    "public_size": 0,
}


@pytest.fixture
def little_memory(monkeypatch) -> int:
    """50 MB available; building any data is a test failure (the check comes first)."""
    monkeypatch.delenv(memory.ENV_SKIP, raising=False)
    monkeypatch.setattr(memory, "available_bytes", lambda: 50_000_000)

    def built(*args, **kwargs):
        raise AssertionError("data built before the memory check")

    monkeypatch.setattr(federation, "build_federated_data", built)
    return 50_000_000


def _cli(tmp_path: Path, raw: dict, *args: str) -> tuple[int, float]:
    """``fedmosaic run`` of ``raw`` with ``args`` (``--set`` for each ``key=value``): exit
    status and seconds."""
    cfg = write_toml(tmp_path / "c.toml", raw)
    argv = ["run", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]
    for a in args:
        argv += ["--set", a] if "=" in a else [a]
    start = time.perf_counter()
    rc = main(argv)
    return rc, time.perf_counter() - start


def test_ten_million_clients_are_refused_in_one_line_at_once(tmp_path: Path, capsys):
    raw = tiny_raw(algorithm={"name": "local"})
    sets = ["data.dataset=synthetic", "data.num_clients=10000000", "data.min_size=0"]
    rc, seconds = _cli(tmp_path, raw, *sets)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "data.num_clients = 10000000" in err[0] and "data.synthetic_size" in err[0], err
    assert seconds < 1.0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"synthetic_size": 1_000_000, "synthetic_classes": 1_000_000}, "must be <= 100000"),
        ({"synthetic_size": 1000, "synthetic_classes": 1000}, "fewer than 2 a class"),
        ({"synthetic_size": 240, "synthetic_classes": 121}, "fewer than 2 a class"),
    ],
)
def test_absurd_synthetic_classes_are_refused_by_name(data, message):
    with pytest.raises(ConfigError, match=r"^data\.synthetic_classes = \d+ .*" + message):
        from_dict(tiny_raw(data=data))
    from_dict(tiny_raw(data={"synthetic_size": 240, "synthetic_classes": 120}))  # two a class


def test_the_synthetic_classes_probe_exits_2_at_once(tmp_path: Path, capsys):
    sets = ["data.synthetic_size=1000000", "data.synthetic_classes=1000000"]
    rc, seconds = _cli(tmp_path, tiny_raw(algorithm={"name": "local"}), *sets)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "data.synthetic_classes" in err[0], err
    assert seconds < 1.0


def test_more_clients_than_images_is_refused_but_as_many_pass():
    with pytest.raises(ConfigError, match=r"^data\.num_clients = 241 is more than the 240 images"):
        from_dict(tiny_raw(data={"num_clients": 241, "min_size": 0}))
    from_dict(tiny_raw(data={"num_clients": 240, "min_size": 0}))  # refused later if one is empty


def test_a_run_past_the_available_memory_is_refused_before_data(little_memory):
    cfg = from_dict(tiny_raw(data=CROWD, algorithm={"name": "local"}))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        check_runs([("run local", cfg)])
    assert time.perf_counter() - start < 1.0
    msg = str(err.value)
    assert msg.startswith("run local: the run needs about "), msg
    assert "data.num_clients = 100000 clients x" in msg and "50.0 MB is available" in msg, msg
    assert "lower data.num_clients" in msg and "\n" not in msg, msg
    # The Python API passes the same check before it builds anything.
    with pytest.raises(ConfigError, match="the run needs about"):
        api.run(cfg)


def test_the_cli_with_baselines_is_refused_before_any_run(tmp_path: Path, capsys, little_memory):
    raw = tiny_raw(data=CROWD, algorithm={"name": "local"})
    rc, seconds = _cli(tmp_path, raw, "--baseline", "fedavg")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: run local: the run needs"), err
    assert seconds < 1.0 and not (tmp_path / "out").exists()


def test_model_copies_count_when_clients_stay_in_memory(monkeypatch):
    data = {**CROWD, "num_clients": 20_000, "synthetic_shape": [1, 28, 28]}
    cfg = from_dict(tiny_raw(data=data, model={"family": "cnn1"}, sim={"offload_clients": "off"}))
    each = model_state_bytes(cfg, (1, 28, 28), 4)
    real = federation.build_client_model("cnn1", (1, 28, 28), 4, 16, projection="linear")
    assert each == module_nbytes(real)
    parts = memory_parts(cfg)
    assert parts[-1].nbytes == 20_000 * each and "client model state" in parts[-1].what
    # Offloaded ("on"), the clients wait on disk: their models are not counted.
    on = from_dict(tiny_raw(data=data, sim={"offload_clients": "on"}))
    assert all("client model state" not in p.what for p in memory_parts(on))
    # "auto" keeps at most OFFLOAD_BUDGET in memory on the serial backend.
    auto = from_dict(tiny_raw(data=data, sim={"offload_clients": "auto", "backend": "serial"}))
    assert memory_parts(auto)[-1].nbytes == federation.OFFLOAD_BUDGET
    need = sum(p.nbytes for p in parts)
    with pytest.raises(ConfigError, match=r"client model state .*sim\.offload_clients"):
        memory.check_fits(parts, available=need - 1)
    memory.check_fits(parts, available=need)


def test_unknown_memory_or_the_opt_out_refuses_nothing(monkeypatch):
    parts = [memory.Part("x", 10**15, ("data.num_clients",))]
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    memory.check_fits(parts)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1)
    monkeypatch.setenv(memory.ENV_SKIP, "0")
    memory.check_fits(parts)
    monkeypatch.delenv(memory.ENV_SKIP)
    with pytest.raises(ConfigError, match="1.0 PB|1000.0 TB"):
        memory.check_fits(parts)


def test_meminfo_is_read():
    free = memory.available_bytes()
    assert free is None or free > 0


def test_honest_runs_fit_in_twenty_gigabytes():
    """The default main job (100 clients, 25% FMNIST), the 10k-client config and every committed
    suite cell stay far below a 20 GB machine."""
    from fedmosaic.suite_runner import build_cells, load_suite

    configs = [load(default_config_path())]
    configs += [load(p) for p in sorted(Path(default_config_path()).parent.glob("*.toml"))]
    suites = sorted((Path(federation.__file__).parent / "suites").glob("*.toml"))
    configs += [c.cfg for s in suites for c in build_cells(load_suite(s), check=False)]
    assert len(configs) > 100
    for cfg in configs:
        parts = memory_parts(cfg)
        memory.check_fits(parts, available=20 * 10**9)
        assert sum(p.nbytes for p in parts) < 2 * 10**9
