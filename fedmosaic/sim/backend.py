"""The simulator backend chosen by ``[sim] backend``, built from an assembled federation.

``sim.backend = "auto"`` (the default) and ``sim.threads = "auto"`` are resolved here, per run
(:func:`resolve_runtime`), into a backend, a worker count and this process's torch threads; with
worker processes, how many of them train each round is then measured as the run goes
(``sim/layout.py``). Every choice ``auto`` can make runs each client's math on one thread, so the
numbers are those of ``serial`` with ``sim.threads = 1`` bit for bit, on any machine (the process
backend's promise); only the speed depends on the machine.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from fedmosaic.core.rounds import Transport
from fedmosaic.federation import Federation, make_client
from fedmosaic.models.flops import member_flops
from fedmosaic.sim.processes import ProcessTransport
from fedmosaic.sim.simulator import SimTransport


def default_workers() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def spare_cores() -> int:
    """Cores this run may use without taking them from other work: this process's cores less the
    system's one-minute load other than this process (a busy 2-core machine has none spare)."""
    cores = default_workers()
    try:
        others = max(os.getloadavg()[0] - 1.0, 0.0)  # this process is one runnable task
    except OSError:  # no load average on this platform
        others = 0.0
    return max(1, min(cores, int(cores - others + 0.5)))


# Starting the worker processes (fresh interpreters importing torch, then each building the
# federation's view of the shared images) costs seconds once per process (they are pooled
# afterwards): 10-20 s on a loaded 2-core machine, where one thread trains these small models at
# 15-25 GFLOP/s. A run estimated below this much work (training: 3x forward FLOPs; evaluation:
# forward) finishes sooner serially: a unit-test federation is ~1-6 GFLOP, a 10-client FMNIST 10%
# round ~165 GFLOP, a round of 10 of 100 cnn1 clients on FMNIST 20% ~38 GFLOP.
MIN_PROCESS_FLOPS = 200e9


@dataclass(frozen=True)
class Runtime:
    """What one run's ``sim.backend`` / ``sim.workers`` / ``sim.threads`` resolved to."""

    backend: str  # serial | processes
    workers: int  # processes that train clients (1 serially)
    threads: int  # torch threads of this process; 0 = torch's default, left alone
    why: str  # how it was chosen (a short phrase, for provenance and the log)
    adaptive: bool = False  # processes: how many workers train a round is measured per round

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_flops(fed: Federation) -> float:
    """Estimated FLOPs of the whole run: each round, the sampled share of every client's local
    epochs (forward + backward ~ 3x forward) and, every ``eval_every`` rounds, a forward pass over
    every client's evaluation splits."""
    cfg, plan = fed.cfg, fed.plan
    flops = member_flops(fed.spec.members, fed.spec.build_model, fed.spec.input_shape)
    train = sum(f * c.num_train for f, c in zip(flops, fed.clients))
    evals = sum(f * sum(c.num(s) for s in fed.eval_splits) for f, c in zip(flops, fed.clients))
    share = plan.clients_per_round / max(plan.num_clients, 1)
    per_round = 3 * cfg.train.local_epochs * share * train + evals / max(plan.eval_every, 1)
    return plan.rounds * per_round


def resolve_runtime(fed: Federation) -> Runtime:
    """The backend, workers and threads this run uses (``"auto"`` decided here)."""
    sim = fed.cfg.sim
    backend, why, cores = sim.backend, "sim.backend", default_workers()
    adaptive = False
    if backend == "auto":
        backend, why, cores = _auto_backend(fed)
        adaptive = backend == "processes" and not sim.devices and not sim.workers
    if sim.threads == "auto" or (
        sim.threads == 0 and (backend == "processes" or sim.backend == "auto")
    ):
        # The workers own the cores. The server's own steps (FedTGP's prototype training,
        # FedGen's generator, KT-pFL's coefficients) are small ops: on one thread they give
        # exactly the numbers of the serial backend run with sim.threads = 1, at about the
        # same speed (FedTGP's 100 server epochs: 2.15 s vs 1.89 s on two threads).
        threads = 1
    else:
        threads = int(sim.threads)
    if backend != "processes":
        return Runtime("serial", 1, threads, why)
    n = sim.workers or len(sim.devices) or cores
    return Runtime("processes", max(1, min(n, fed.plan.num_clients)), threads, why, adaptive)


def _auto_backend(fed: Federation) -> tuple[str, str, int]:
    """``sim.backend = "auto"``: processes (on the spare cores) where they finish first, else
    serial; returns the backend, why, and the cores to use."""
    cfg = fed.cfg
    if cfg.sim.devices:
        return "processes", "auto: sim.devices places worker processes", len(cfg.sim.devices)
    n = cfg.sim.threads
    if isinstance(n, int) and n > 1:  # the clients' math on n threads: one process (and hash)
        return "serial", f"auto: sim.threads = {n} asks for {n} threads in one process", 1
    if cfg.train.device != "cpu":
        return "serial", f"auto: train.device = {cfg.train.device!r} (one process drives it)", 1
    if fed.plan.num_clients < 2:
        return "serial", "auto: one client", 1
    cores, spare = default_workers(), spare_cores()
    if cores < 2:
        return "serial", "auto: one core", 1
    work = run_flops(fed)
    if work < MIN_PROCESS_FLOPS:
        return "serial", f"auto: ~{work / 1e9:.1f} GFLOP, too little to repay starting workers", 1
    # One worker per spare core, at least two: under load the layout is measured between rounds
    # (sim/layout.py), since whether fewer workers finish first depends on the other work (one
    # competing process on 2 cores: 2 workers 11.2 s a round, one thread serially 15.0 s).
    n = min(cores, max(2, spare))
    return "processes", f"auto: {spare} spare of {cores} cores, ~{work / 1e9:.0f} GFLOP", n


def make_transport(fed: Federation, runtime: Runtime | None = None) -> Transport:
    """``serial``: every client in this process, in memory (``fed.models``) or, with
    ``fed.offload``, in an on-disk state store and built on demand. ``processes``:
    ``sim.workers`` worker processes, clients balanced by estimated cost (forward FLOPs per image
    x examples); with partial participation (or ``sim.offload_clients = "on"``), clients not
    training this round wait in an on-disk state store. Offloaded, memory scales with the round's
    clients, not the population."""
    cfg = fed.cfg
    runtime = runtime or resolve_runtime(fed)
    if runtime.backend == "processes":
        partial = fed.plan.clients_per_round < fed.plan.num_clients
        offload = {"on": True, "off": False}.get(cfg.sim.offload_clients, partial)
        flops = member_flops(fed.spec.members, fed.spec.build_model, fed.spec.input_shape)
        clients = fed.clients
        return ProcessTransport(
            fed.algo,
            cfg,
            fed.data,
            [f * max(c.num_train, 1) for f, c in zip(flops, clients)],
            runtime.workers,
            eval_costs=[f * max(c.num("test") + c.num("val"), 1) for f, c in zip(flops, clients)],
            eval_splits=fed.eval_splits,
            offload=offload,
            adaptive=runtime.adaptive,
        )
    # Offloaded (sim.offload_clients): no client is built up front; ``build`` makes one on demand.
    off = fed.offload
    return SimTransport(
        fed.algo,
        [] if off else fed.models,
        [] if off else fed.extras,
        fed.clients,
        fed.settings,
        cfg.seed,
        cfg.train.local_epochs,
        check_wire=cfg.sim.check_wire,
        eval_splits=fed.eval_splits,
        build=(lambda cid: make_client(cfg, fed.algo, fed.spec, fed.clients[cid])) if off else None,
        members=fed.spec.members if off else (),
    )
