"""Any experiment on Flower's simulation runtime (Ray): ``fedmosaic flower simulate``.

The same ServerApp round loop (``app.run_server``) and ClientApp (``app.client_app``) as a
deployment, run by ``flwr.simulation.run_simulation``: one virtual SuperNode per client
(``partition-id`` = client id), each message executed by a ClientApp actor of a Ray cluster,
either a local Ray instance started for the run or an existing cluster joined at
``ray-address`` (every host needs fedmosaic installed). Per-client resources (``client-num-cpus``,
``client-num-gpus``) come from the run config, next to the app's own keys (``settings.RUN_CONFIG``).

Each reply carries the Ray node that computed it (a config record added here and removed again
before the round loop sees the reply), so ``results.json`` says which Ray nodes ran the clients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation as flwr_run_simulation

from fedmosaic.config import ConfigError, ExperimentConfig
from fedmosaic.flower.app import client_app, run_server
from fedmosaic.flower.settings import RUN_CONFIG, FlowerOptions, experiment_from_run_config
from fedmosaic.report.results import write_results

RAY_NODE = "fedmosaic.ray-node"  # reply record: the Ray node whose actor ran the ClientApp

# key -> (default, meaning): the simulation runtime's run-config keys (besides RUN_CONFIG's).
SIMULATION_CONFIG: dict[str, tuple[Any, str]] = {
    "client-num-cpus": (1.0, "CPUs Ray reserves for each ClientApp actor (one client at a time)"),
    "client-num-gpus": (
        0.0,
        "GPUs (fractions allowed) Ray reserves for each ClientApp actor; > 0 when train.device "
        "is cuda",
    ),
    "ray-address": (
        "",
        'Ray cluster to join ("auto" or HEAD_IP:PORT of `ray start --head`); empty = start a '
        "local Ray instance for the run",
    ),
    "ray-num-cpus": (0, "local Ray instance only: CPUs it may use (0 = all of this machine's)"),
}


@dataclass(frozen=True)
class SimulationOptions:
    """Resources of the simulation runtime (``SIMULATION_CONFIG``)."""

    client_num_cpus: float = 1.0
    client_num_gpus: float = 0.0
    ray_address: str = ""
    ray_num_cpus: int = 0

    @classmethod
    def from_run_config(cls, rc: Mapping[str, Any]) -> SimulationOptions:
        def num(key: str, low: float, top: float) -> float:
            value = rc.get(key, SIMULATION_CONFIG[key][0])
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not low <= value <= top:
                raise ConfigError(
                    f"run config {key} = {value!r} must be a number in [{low}, {top}]"
                )
            return float(value)

        cpus = num("client-num-cpus", 0.0, 1024.0)
        if cpus <= 0:  # Ray sizes the actor pool as CPUs / client-num-cpus
            raise ConfigError("run config client-num-cpus must be > 0")
        address = rc.get("ray-address", "")
        if not isinstance(address, str):
            raise ConfigError(f"run config ray-address = {address!r} must be a string")
        local_cpus = num("ray-num-cpus", 0, 1 << 16)
        if local_cpus != int(local_cpus):
            raise ConfigError(f"run config ray-num-cpus = {local_cpus!r} must be an integer")
        if address and local_cpus:  # ray.init refuses resources when joining a cluster
            raise ConfigError(
                "run config ray-num-cpus applies to a local Ray instance only; a joined cluster "
                "has the resources its `ray start` gave it"
            )
        return cls(cpus, num("client-num-gpus", 0.0, 1024.0), address.strip(), int(local_cpus))

    def check(self, cfg: ExperimentConfig) -> None:
        """Refuse a device the actors will not have: Ray hides every GPU from an actor that
        reserved none, and shows the ones it reserved as ``cuda:0``."""
        device = cfg.train.device
        if device.startswith("cuda") and self.client_num_gpus <= 0:
            raise ConfigError(
                f"train.device = {device!r} needs run config client-num-gpus > 0 (Ray hides GPUs "
                "from actors that reserve none)"
            )
        if device.startswith("cuda:") and device != "cuda:0":
            raise ConfigError(
                f"train.device = {device!r}: on Ray use 'cuda' (each actor sees the GPU Ray "
                "gave it as cuda:0)"
            )

    def backend_config(self) -> dict[str, Any]:
        """Flower's ``backend_config``: ``init_args`` go to ``ray.init`` as they are."""
        init: dict[str, Any] = {}
        if self.ray_address:
            init["address"] = self.ray_address
        elif self.ray_num_cpus:
            init["num_cpus"] = self.ray_num_cpus
        resources = {"num_cpus": self.client_num_cpus, "num_gpus": self.client_num_gpus}
        return {"init_args": init, "client_resources": resources}


class _RayClientApp(ClientApp):
    """``app.client_app`` with the run config attached (the Python simulation API gives virtual
    SuperNodes an empty one) and each reply tagged with the Ray node that ran it."""

    def __init__(self, run_config: Mapping[str, Any]) -> None:
        super().__init__()
        self.run_config = dict(run_config)

    def __call__(self, message: Message, context: Context) -> Message:
        import ray

        # Same state object: what the client saves lands in the node's own context.
        ctx = Context(
            context.run_id, context.node_id, context.node_config, context.state, self.run_config
        )
        reply = client_app(message, ctx)
        if reply.has_content():
            node = ray.get_runtime_context().get_node_id()
            reply.content.config_records[RAY_NODE] = ConfigRecord({"node-id": node})
        return reply


class _RayTally:
    """The runtime's Grid as the round loop sees it: every reply's Ray-node record counted and
    removed (the transport accepts only the records it expects)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.messages: Counter[str] = Counter()
        self.nodes: dict[str, str] = {}  # alive Ray node id -> its IP, when the first reply came

    def __getattr__(self, name: str) -> Any:  # the rest of the Grid API, unchanged
        return getattr(self.grid, name)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._count(self.grid.pull_messages(message_ids))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self._count(self.grid.send_and_receive(messages, timeout=timeout))

    def _count(self, received: Iterable[Message]) -> list[Message]:
        replies = list(received)
        for reply in replies:
            if reply.has_content() and RAY_NODE in reply.content.config_records:
                record = reply.content.config_records.pop(RAY_NODE)
                self.messages[str(record.get("node-id"))] += 1
                if not self.nodes:
                    self.nodes = _alive_nodes()
        return replies


def _alive_nodes() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def run_simulation(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Run the experiment of ``run_config`` (``experiment`` JSON and the app's keys, plus
    ``SIMULATION_CONFIG``'s) on Flower's Ray runtime; returns the ``results.json`` document,
    also written to ``results-dir`` with ``flower.simulation`` saying where the clients ran."""
    if importlib.util.find_spec("ray") is None:  # Flower would exit the process instead
        raise ConfigError(
            "Flower's simulation runtime needs ray: pip install 'fedmosaic[flower-simulation]'"
        )
    unknown = sorted(set(run_config) - set(RUN_CONFIG) - set(SIMULATION_CONFIG))
    if unknown:
        raise ConfigError(f"unknown run config keys {unknown}")
    options = SimulationOptions.from_run_config(run_config)
    cfg = experiment_from_run_config(run_config)
    options.check(cfg)
    # Flower's telemetry would try the network from a machine that may have none.
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    app_config = {k: v for k, v in run_config.items() if k in RUN_CONFIG}
    if not app_config.get("results-dir"):  # as run_server would name it, known here
        stamp = time.strftime("%Y%m%d-%H%M%S")
        app_config["results-dir"] = f"runs/flower-sim-{stamp}-{cfg.algorithm['name']}"
    # What the ServerApp would refuse is refused before Ray starts (seconds, and its warnings).
    FlowerOptions.from_run_config(app_config)
    results = Path(app_config["results-dir"])
    if results.exists() and not results.is_dir():
        raise ConfigError(f"results-dir {results} is a file, not a folder")
    done: dict[str, Any] = {}
    tally: list[_RayTally] = []
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        tally.append(_RayTally(grid))
        done["doc"] = run_server(tally[0], app_config)

    flwr_run_simulation(
        server_app=server,
        client_app=_RayClientApp(app_config),
        num_supernodes=cfg.data.num_clients,
        backend_config=options.backend_config(),
    )
    if "doc" not in done:  # run_simulation re-raises the ServerApp's exception; belt and braces
        raise RuntimeError("Flower's simulation runtime ended without a result")
    doc = done["doc"]
    doc["flower"]["simulation"] = {
        "backend": "ray",
        "options": dict(vars(options)),
        "ray_nodes": tally[0].nodes,
        "messages_per_ray_node": dict(sorted(tally[0].messages.items())),
    }
    write_results(Path(app_config["results-dir"]), doc)
    return doc


def simulation_run_config(
    cfg: ExperimentConfig, results_dir: str | Path, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The run config of ``cfg`` for ``run_simulation`` (``extra``: any app or simulation key)."""
    rc: dict[str, Any] = {"experiment": json.dumps(cfg.to_dict()), "results-dir": str(results_dir)}
    rc.update(extra or {})
    return rc
