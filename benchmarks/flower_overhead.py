"""Per-round overhead of the Flower path vs the simulator on the same tiny federation.

    .venv/bin/python benchmarks/flower_overhead.py                 # simulator vs in-memory Grid
    .venv/bin/python benchmarks/flower_overhead.py --deploy        # + real SuperLink/SuperNodes

Three runs of one config (synthetic 1x28x28 images, 4 clients, FedProto on the five FedHeNN CNNs
by default): the serial simulator; the Flower ServerApp/ClientApp code over the in-memory Grid
(codec, wire serialization, client state save/restore in ``context.state``, one model rebuild
per message); and, with ``--deploy``, real processes on 127.0.0.1 (insecure loopback: a
``flower-superlink``, one ``flower-supernode`` per client, ``flwr run``). Round 1 includes
warm-up, so the table reports the mean of rounds 2.. as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "flower"))


def experiment(args: argparse.Namespace) -> dict:
    from helpers.experiments import tiny_raw

    return tiny_raw(
        algorithm={"name": args.algorithm},
        model={"family": args.family},
        data={"num_clients": args.clients},
        train={"rounds": args.rounds},
        sim={"check_wire": False},
    )


def per_round(doc: dict) -> dict:
    secs = [r["seconds"] for r in doc["rounds"]]
    return {
        "round1_s": secs[0],
        "later_rounds_s": statistics.mean(secs[1:]) if len(secs) > 1 else secs[0],
        "bytes_up": statistics.mean(r["bytes_up"] for r in doc["rounds"]),
        "bytes_down": statistics.mean(r["bytes_down"] for r in doc["rounds"]),
        "acc": doc["rounds"][-1].get("acc_weighted"),
    }


def run_simulator(raw: dict) -> dict:
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    return run_experiment(from_dict(raw), progress=False)


def run_local_grid(raw: dict, out: Path) -> dict:
    from fedmosaic.flower.app import client_app, run_server
    from fedmosaic.flower.local import LocalGrid

    n = raw["data"]["num_clients"]
    rc = {"experiment": json.dumps(raw), "results-dir": str(out)}
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": n} for i in range(n)], rc)
    return run_server(grid, rc)


def run_deployment(raw: dict, root: Path) -> dict:
    from _flower_deploy import Deployment

    from fedmosaic.config import from_dict
    from fedmosaic.flower.project import write_app

    d = Deployment(root)
    try:
        d.start_superlink()
        d.write_connection()
        n = raw["data"]["num_clients"]
        for i in range(n):
            d.start_supernode(f"node{i}", f"partition-id={i} num-partitions={n}")
        app = write_app(from_dict(raw), root / "app", d.address, insecure=True)
        run = d.flwr("run", str(app), "test")
        if run.returncode:
            raise RuntimeError(run.stdout + run.stderr)
        results = app / "results" / "results.json"
        deadline = time.monotonic() + 900
        while not results.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(d.log("superlink")[-3000:])
            time.sleep(1)
        return json.loads(results.read_text())
    finally:
        d.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="fedproto")
    p.add_argument("--family", default="fedhenn5")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--deploy", action="store_true", help="also run real Flower processes")
    args = p.parse_args()
    torch.set_num_threads(1)
    raw = experiment(args)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["simulator"] = per_round(run_simulator(raw))
        rows["flower, in-memory Grid"] = per_round(run_local_grid(raw, Path(tmp) / "local"))
        if args.deploy:
            rows["flower, real processes"] = per_round(run_deployment(raw, Path(tmp) / "deploy"))
    base = rows["simulator"]["later_rounds_s"]
    print(
        f"{args.algorithm} on {args.family}, {args.clients} clients, {args.rounds} rounds "
        "(seconds per round; bytes per round, all clients)"
    )
    print(
        f"{'runtime':26s} {'round 1':>8s} {'rounds 2+':>10s} {'x sim':>7s} {'up B':>9s} {'down B':>9s}  acc"
    )
    for name, r in rows.items():
        print(
            f"{name:26s} {r['round1_s']:8.2f} {r['later_rounds_s']:10.2f} "
            f"{r['later_rounds_s'] / base:7.1f} {r['bytes_up']:9.0f} {r['bytes_down']:9.0f}  "
            f"{r['acc']:.4f}"
        )


if __name__ == "__main__":
    main()
