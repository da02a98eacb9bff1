"""Flower's simulation runtime on a real Ray cluster: a head and a worker node (two ``ray start``
processes on 127.0.0.1, one CPU each, as two hosts would be), joined through ``ray-address``.

A heterogeneous prototype method (FedTGP, four FedHeNN CNNs) and a weight-sharing one (FedAvg)
give the embedded simulator's numbers, and their ClientApps ran on both Ray nodes (each reply
says which node computed it): a run that stayed in this process, or on a Ray instance of its
own, fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

pytest.importorskip("flwr")
pytest.importorskip(
    "ray", reason="ray is not installed (pip install 'fedmosaic[flower-simulation]')"
)

from test_flower_parity import assert_same_numbers  # noqa: E402

from fedmosaic.cli import main  # noqa: E402
from fedmosaic.config import ConfigError, from_dict  # noqa: E402
from fedmosaic.experiment import run_experiment  # noqa: E402
from fedmosaic.flower.simulation import (  # noqa: E402
    SimulationOptions,
    run_simulation,
    simulation_run_config,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # click/typer, imported by flwr
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # ray's accelerator env var notice
]

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_ports() -> list[str]:
    """Ports every Ray node opens beside the head's: free ones, so two nodes on one host (and
    other Ray users of this machine) never collide on Ray's fixed defaults."""
    return [
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}",
    ]


@dataclass
class RayCluster:
    """``ray start --block`` processes, each in its own process group (stopped by group: never
    ``ray stop``, which would stop every Ray node of this machine, other users' too)."""

    temp: Path
    port: int = field(default_factory=_free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, args: list[str]) -> None:
        cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1"]
        cmd += ["--num-gpus=0", "--disable-usage-stats", *_node_ports(), *args]
        log = open(self.temp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        self.procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()

    def node_ids(self) -> set[str]:
        """Active nodes as ``ray status`` reports them (a separate process: this one must not
        connect before the runtime does, or it would reuse this connection)."""
        r = subprocess.run(
            [RAY, "status", f"--address={self.address}"], capture_output=True, text=True
        )
        active = r.stdout.split("Pending:")[0] if r.returncode == 0 else ""
        return set(re.findall(r"node_([0-9a-f]{16,})", active))

    def start(self, nodes: int = 2) -> None:
        self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--temp-dir={self.temp}",
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}",
            ],
        )
        for i in range(1, nodes):
            self._wait(1)
            self._start(f"worker{i}", [f"--address={self.address}"])
        self._wait(nodes)

    def _wait(self, nodes: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while len(self.node_ids()) < nodes:
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = {f.name: f.read_text()[-2000:] for f in self.temp.glob("*.log")}
                raise RuntimeError(f"Ray cluster did not come up ({nodes} nodes): {dead} {logs}")
            time.sleep(1.0)

    def stop(self) -> list[int]:
        """Stop every process of the cluster; returns the pids still alive afterwards."""
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self._left() and time.monotonic() < deadline:
                time.sleep(0.5)
            if not self._left():
                break
        for p in self.procs:
            p.wait(timeout=10)
        return self._left()

    def _left(self) -> list[int]:
        """Processes of this cluster: in its process groups, or naming its temp dir."""
        groups = {p.pid for p in self.procs}
        left = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            zombie, pgid = fields[0] == "Z", int(fields[2])
            if not zombie and (pgid in groups or str(self.temp).encode() in cmd):
                left.append(int(d.name))
        return left


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    # Short: Ray's Unix sockets live under the temp dir (107-byte path limit).
    temp = Path(tempfile.mkdtemp(prefix="fm-ray-", dir="/tmp"))
    cluster = RayCluster(temp)
    try:
        cluster.start(nodes=2)
        yield cluster
    finally:
        left = cluster.stop()
        shutil.rmtree(temp, ignore_errors=True)
        assert left == [], f"Ray processes still running after teardown: {left}"


def _run_on_cluster(cluster: RayCluster, raw: dict, out: Path, via_cli: bool) -> dict:
    if not via_cli:
        extra = {"ray-address": cluster.address, "client-num-cpus": 1}
        return run_simulation(simulation_run_config(from_dict(raw), out, extra))
    toml = write_toml(out.parent / "experiment.toml", raw)
    argv = ["flower", "simulate", str(toml), "--out", str(out)]
    argv += ["--run-config", f"ray-address={cluster.address}", "--run-config", "client-num-cpus=1"]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, family, via_cli",
    [("fedtgp", "fedhenn5", False), ("fedavg", "fedhenn_cnn1", True)],
    ids=["fedtgp-heterogeneous", "fedavg-cli"],
)
def test_ray_cluster_gives_the_simulators_numbers(
    ray_cluster, tmp_path, algorithm, family, via_cli
):
    raw = tiny_raw(algorithm={"name": algorithm}, model={"family": family}, train={"rounds": 2})
    nodes = ray_cluster.node_ids()
    assert len(nodes) == 2
    flower = _run_on_cluster(ray_cluster, raw, tmp_path / "results", via_cli)
    sim = run_experiment(from_dict(raw), progress=False)
    if via_cli:  # compared with what the CLI wrote: JSON's string keys
        sim = json.loads(json.dumps(sim))
    assert_same_numbers(sim, flower)

    ran = flower["flower"]["simulation"]
    assert set(ran["ray_nodes"]) == nodes, "the run did not join this cluster"
    assert set(ran["messages_per_ray_node"]) == nodes, ran["messages_per_ray_node"]
    # every message answered on the cluster: 4 handshakes, 2 rounds x 4 fits and 4 evaluations
    assert sum(ran["messages_per_ray_node"].values()) == 4 + 2 * (4 + 4)


@pytest.mark.parametrize(
    "run_config, device, error",
    [
        ({"client-num-cpus": 0}, "cpu", "client-num-cpus must be > 0"),
        ({"client-num-gpus": -1}, "cpu", "client-num-gpus"),
        ({"ray-address": "auto", "ray-num-cpus": 2}, "cpu", "local Ray instance only"),
        ({}, "cuda", "client-num-gpus > 0"),
        ({"client-num-gpus": 0.5}, "cuda:1", "use 'cuda'"),
    ],
)
def test_simulation_options_refuse_what_ray_would_not_run(run_config, device, error):
    raw = tiny_raw(train={"device": device})
    rc = simulation_run_config(from_dict(raw), "unused", run_config)
    with pytest.raises(ConfigError, match=re.escape(error)):
        SimulationOptions.from_run_config(rc).check(from_dict(raw))


@pytest.mark.parametrize(
    "extra, error",
    [({"round-timeout": float("nan")}, "round-timeout"), ({}, "is a file, not a folder")],
)
def test_what_the_server_app_would_refuse_is_refused_before_ray_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict, error: str
):
    import fedmosaic.flower.simulation as simulation

    monkeypatch.setattr(simulation, "flwr_run_simulation", lambda **kw: pytest.fail("Ray ran"))
    results = tmp_path / "results"
    results.write_text("a file where the results folder goes")
    rc = simulation_run_config(from_dict(tiny_raw()), results, extra)
    with pytest.raises(ValueError, match=re.escape(error)):
        simulation.run_simulation(rc)
    assert results.read_text() == "a file where the results folder goes"


def test_backend_config_joins_a_cluster_or_sizes_a_local_instance():
    joined = SimulationOptions(client_num_cpus=2, client_num_gpus=0.25, ray_address="10.0.0.1:6379")
    assert joined.backend_config() == {
        "init_args": {"address": "10.0.0.1:6379"},
        "client_resources": {"num_cpus": 2, "num_gpus": 0.25},
    }
    assert SimulationOptions(ray_num_cpus=3).backend_config()["init_args"] == {"num_cpus": 3}
