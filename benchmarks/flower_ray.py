"""Seconds per round: the embedded simulator vs Flower's simulation runtime (Ray), same config.

    .venv/bin/python benchmarks/flower_ray.py                       # 20 and 200 clients
    .venv/bin/python benchmarks/flower_ray.py --clients 20 --rounds 4
    .venv/bin/python benchmarks/flower_ray.py --ray-address HEAD_IP:6379   # an existing cluster

FedAvg on one small CNN (``cnn1``, 64-wide features) over a 10% subsample of Fashion-MNIST
(6,000 training images, Dirichlet 0.3 over the clients), every client every round, evaluated
every round. The simulator runs as ``sim.backend = auto`` decides (printed); Flower's runtime
with one Ray actor per ``client-num-cpus`` of the local instance (``--ray-cpus``, default all
cores) or of the cluster joined. Round 1 includes Ray's start and each actor building the
federation, so the table gives round 1 and the mean of the later rounds; the accuracies of both
runtimes are compared (they must be equal).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def experiment(clients: int, rounds: int) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {
            "dataset": "fmnist",
            "subsample": 0.1,
            "num_clients": clients,
            "partition": "dirichlet",
            "alpha": 0.3,
            "min_size": 10,
        },
        "model": {"family": "cnn1", "feature_dim": 64},
        "train": {"rounds": rounds, "batch_size": 10, "lr": 0.05, "eval_every": 1},
        "sim": {"progress": False},
        "algorithm": {"name": "fedavg"},
    }


def timings(doc: dict[str, Any]) -> dict[str, float]:
    secs = [r["seconds"] for r in doc["rounds"]]
    return {"round1": secs[0], "later": statistics.mean(secs[1:]) if len(secs) > 1 else secs[0]}


def accuracies(doc: dict[str, Any]) -> list[float | None]:
    return [r.get("acc_weighted") for r in doc["rounds"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[20, 200])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ray-cpus", type=int, default=0, help="local Ray instance: CPUs (0 = all)")
    p.add_argument("--client-cpus", type=float, default=1.0, help="client-num-cpus per actor")
    p.add_argument("--ray-address", default="", help="join this Ray cluster instead")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment
    from fedmosaic.flower.simulation import run_simulation, simulation_run_config

    logging.getLogger("flwr").propagate = False
    rows = []
    for n in args.clients:
        raw = experiment(n, args.rounds)
        cfg = from_dict(raw)
        t0 = time.perf_counter()
        sim = run_experiment(cfg, progress=False)
        sim_wall = time.perf_counter() - t0
        extra: dict[str, Any] = {"client-num-cpus": args.client_cpus}
        if args.ray_address:
            extra["ray-address"] = args.ray_address
        elif args.ray_cpus:
            extra["ray-num-cpus"] = args.ray_cpus
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            ray = run_simulation(simulation_run_config(cfg, tmp, extra))
            ray_wall = time.perf_counter() - t0
        same = accuracies(sim) == accuracies(ray)
        rows.append(
            {
                "clients": n,
                "simulator_backend": (sim.get("provenance") or {}).get("runtime", {}),
                "simulator": timings(sim) | {"wall": sim_wall},
                "ray": timings(ray) | {"wall": ray_wall},
                "ray_nodes": len(ray["flower"]["simulation"]["ray_nodes"]),
                "same_accuracies": same,
                "final_acc": accuracies(sim)[-1],
            }
        )
    load = os.getloadavg()
    print(f"\nFedAvg, cnn1, FMNIST 10%, {args.rounds} rounds; load {load[0]:.2f} {load[1]:.2f}")
    print(
        "| clients | simulator s/round (r1 / later) | Flower+Ray s/round (r1 / later) "
        "| later-round ratio | whole run (sim / Ray) | same accuracies |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        s, y = r["simulator"], r["ray"]
        print(
            f"| {r['clients']} | {s['round1']:.2f} / {s['later']:.2f} "
            f"| {y['round1']:.2f} / {y['later']:.2f} | {y['later'] / s['later']:.1f}x "
            f"| {s['wall']:.1f} s / {y['wall']:.1f} s | {'yes' if r['same_accuracies'] else 'NO'} |"
        )
    for r in rows:
        print(f"simulator backend ({r['clients']} clients): {r['simulator_backend']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["same_accuracies"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
