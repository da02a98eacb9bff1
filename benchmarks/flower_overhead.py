"""Per-round overhead of the Flower path vs the simulator on the same tiny federation.

    .venv/bin/python benchmarks/flower_overhead.py                 # simulator vs in-memory Grid
    .venv/bin/python benchmarks/flower_overhead.py --deploy        # + real SuperLink/SuperNodes
    .venv/bin/python benchmarks/flower_overhead.py --deploy --flower-supernode   # + Flower's own

Runs of one config (synthetic 1x28x28 images, 4 clients, FedProto on the five FedHeNN CNNs by
default): the serial simulator; the Flower ServerApp/ClientApp code over the in-memory Grid
(codec, wire serialization, client state save/restore in ``context.state``); and, with
``--deploy``, real processes on 127.0.0.1 (insecure loopback: a ``flower-superlink``, one
SuperNode per client, ``flwr run``), the SuperNodes started with ``python -m
fedmosaic.flower.node`` (one long-running ClientApp process each, polling capped at
``--poll-interval``); ``--flower-supernode`` also runs plain ``flower-supernode`` (a new
ClientApp process per message, Flower's 3 s idle polling): the before. The SuperLink keeps its
state in memory (``--superlink-db``: in an SQLite file, as a production SuperLink would, which
adds its writes to every request). Round 1 includes
warm-up, so the table reports the mean of rounds 2.. as well, and every run must end with the
simulator's accuracies (checked). ``cpu``: CPU seconds per round (rounds 2..) of all the
deployment's processes together (long-running SuperNodes only; Flower's per-message processes
exit before they can be counted).
"""

from __future__ import annotations

import argparse
import json
import os
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
        "accs": tuple(r.get("acc_weighted") for r in doc["rounds"]),
        "cpu": doc.get("cpu_per_round"),
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


def run_deployment(
    raw: dict, root: Path, long_running: bool, poll_interval: float, database: bool
) -> dict:
    from _flower_deploy import Deployment

    from fedmosaic.config import from_dict
    from fedmosaic.flower.project import write_app

    d = Deployment(root, long_running=long_running)
    try:
        d.start_superlink(database=database)
        d.write_connection()
        n = raw["data"]["num_clients"]
        poll = ["--poll-interval", str(poll_interval)] if long_running else []
        for i in range(n):
            d.start_supernode(f"node{i}", f"partition-id={i} num-partitions={n}", extra=poll)
        app = write_app(from_dict(raw), root / "app", d.address, insecure=True)
        run = d.flwr("run", str(app), "test")
        if run.returncode:
            raise RuntimeError(run.stdout + run.stderr)
        results = app / "results" / "results.json"
        progress = app / "results" / "progress.jsonl"
        rounds = raw["train"]["rounds"]
        cpu: dict[int, float] = {}  # rounds finished -> CPU seconds of the deployment so far
        deadline = time.monotonic() + 900
        while not results.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(d.log("superlink")[-3000:])
            done = len(progress.read_text().splitlines()) if progress.exists() else 0
            if done in (1, rounds) and done not in cpu:
                cpu[done] = deployment_cpu_seconds([p.pid for p in d.procs.values()])
            time.sleep(0.05)
        doc = json.loads(results.read_text())
        if long_running and {1, rounds} <= set(cpu) and rounds > 1:
            doc["cpu_per_round"] = (cpu[rounds] - cpu[1]) / (rounds - 1)
        return doc
    finally:
        d.close()


def deployment_cpu_seconds(roots: list[int]) -> float:
    """CPU seconds (user + system, with reaped children) of every process of the deployment.
    Exact for long-lived processes only: a process that exited unreaped (``flower-supernode``'s
    per-message ClientApps) is not counted, so the old mode gets no figure."""
    from _flower_deploy import descendants

    total = 0
    for pid in descendants(roots):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="fedproto")
    p.add_argument("--family", default="fedhenn5")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--deploy", action="store_true", help="also run real Flower processes")
    p.add_argument(
        "--flower-supernode",
        action="store_true",
        help="with --deploy: also run Flower's own flower-supernode (the old mode)",
    )
    p.add_argument("--poll-interval", type=float, default=0.1, help="fedmosaic.flower.node's")
    p.add_argument(
        "--superlink-db",
        action="store_true",
        help="the SuperLink keeps its state in an SQLite file (as in production), not in memory",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    raw = experiment(args)
    load = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["simulator"] = per_round(run_simulator(raw))
        rows["flower, in-memory Grid"] = per_round(run_local_grid(raw, Path(tmp) / "local"))
        if args.deploy:
            doc = run_deployment(
                raw, Path(tmp) / "deploy", True, args.poll_interval, args.superlink_db
            )
            rows["flower, fedmosaic node"] = per_round(doc)
        if args.deploy and args.flower_supernode:
            doc = run_deployment(
                raw, Path(tmp) / "old", False, args.poll_interval, args.superlink_db
            )
            rows["flower, flower-supernode"] = per_round(doc)
    accs = {name: r["accs"] for name, r in rows.items()}  # every round, bitwise
    if len(set(accs.values())) != 1:
        raise SystemExit(f"the runtimes disagree: {accs}")
    base = rows["simulator"]["later_rounds_s"]
    print(
        f"{args.algorithm} on {args.family}, {args.clients} clients, {args.rounds} rounds "
        "(seconds per round; bytes per round, all clients); load average before "
        f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    # cpu: CPU seconds per round (rounds 2+) of all the deployment's processes together, what
    # the round would need of an otherwise idle machine (long-running SuperNodes only)
    print(
        f"{'runtime':26s} {'round 1':>8s} {'rounds 2+':>10s} {'x sim':>7s} {'cpu':>6s} "
        f"{'up B':>9s} {'down B':>9s}  acc"
    )
    for name, r in rows.items():
        cpu = "-" if r["cpu"] is None else f"{r['cpu']:.2f}"
        print(
            f"{name:26s} {r['round1_s']:8.2f} {r['later_rounds_s']:10.2f} "
            f"{r['later_rounds_s'] / base:7.1f} {cpu:>6s} {r['bytes_up']:9.0f} "
            f"{r['bytes_down']:9.0f}  {r['acc']:.4f}"
        )


if __name__ == "__main__":
    main()
