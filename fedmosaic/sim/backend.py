"""The simulator backend chosen by ``[sim] backend``, built from an assembled federation."""

from __future__ import annotations

import os

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


def workers(fed: Federation) -> int:
    """Processes that train clients: 1 serially, ``sim.workers`` otherwise (0 = one per entry of
    ``sim.devices``, else one per core)."""
    if fed.cfg.sim.backend != "processes":
        return 1
    return fed.cfg.sim.workers or len(fed.cfg.sim.devices) or default_workers()


def make_transport(fed: Federation) -> Transport:
    """``serial``: every client in this process, in memory (``fed.models``) or, with
    ``fed.offload``, in an on-disk state store and built on demand. ``processes``:
    ``sim.workers`` worker processes, clients balanced by estimated cost (forward FLOPs per image
    x examples); with partial participation (or ``sim.offload_clients = "on"``), clients not
    training this round wait in an on-disk state store. Offloaded, memory scales with the round's
    clients, not the population."""
    cfg = fed.cfg
    if cfg.sim.backend == "processes":
        partial = fed.plan.clients_per_round < fed.plan.num_clients
        offload = {"on": True, "off": False}.get(cfg.sim.offload_clients, partial)
        flops = member_flops(fed.spec.members, fed.spec.build_model, fed.spec.input_shape)
        clients = fed.clients
        return ProcessTransport(
            fed.algo,
            cfg,
            fed.fed,
            [f * max(c.num_train, 1) for f, c in zip(flops, clients)],
            workers(fed),
            eval_costs=[f * max(c.num("test") + c.num("val"), 1) for f, c in zip(flops, clients)],
            eval_splits=fed.eval_splits,
            offload=offload,
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
