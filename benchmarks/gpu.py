"""The GPU path against the plain research loop on the same card, in one invocation, as JSON.

    python benchmarks/gpu.py --out gpu.json             # the workloads below, a few minutes
    python benchmarks/gpu.py --device cpu --quick       # the script's logic on CPU (smoke)

Workloads (batch 10 unless named, lr 0.01, one local epoch, evaluation every round):

- ``fedtgp``, ``lg_fedavg``: 20 clients on the eight gray CNNs of ``htfe8-gray``, Fashion-MNIST
  at ``--subsample`` (25%), Dirichlet(0.1), every client every round;
- ``fedavg``: 100 clients (``fedavgcnn``), 10 per round;
- ``resnet18_b10``, ``resnet18_b64``: FedAvg with 10 clients of the ResNet-18 member on a
  CIFAR-shaped synthetic set (3x32x32, 10 classes), batch 10 and 64.

Each runs as

- ``plain``: ``speed.Reference``, a research library's loop (clients one after another,
  ``deepcopy``, ``DataLoader``, ``torch.optim.SGD``) on the GPU;
- ``one_at_a_time``: fedmosaic, clients one at a time (``batched_clients = false``);
- ``batched``: the round's clients of one layout as one ``vmap`` step, eager
  (``cuda_graphs = false``);
- ``graphs``: the same step captured once per (layout, clients, batch size) as a CUDA graph and
  replayed (``cuda_graphs = "auto"``, the default on CUDA).

Seconds per round are the mean of the rounds after the first (which warms up and captures); the
plain loop runs two rounds and times the second. FLOPs per round are counted per layer
(``fedmosaic.models.flops``) and the achieved rate is given beside the card's fp32 matmul rate
measured in the same invocation, with TF32 off (plain fp32) and on (TF32, torch's setting for
cuDNN convolutions). The profile rows count, over one timed round of each fedmosaic variant,
the steps run and the graphs replayed, so a round's launches can be read off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from speed import Reference, cuda_matmul_gflops, raw_config, round_flops  # noqa: E402

from fedmosaic.accel import batched, engaged  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.experiment import build_federation, run_experiment  # noqa: E402
from fedmosaic.models import flops_per_image, trainable_flops  # noqa: E402

VARIANTS = {
    "one_at_a_time": {"batched_clients": False, "cuda_graphs": False},
    "batched": {"batched_clients": True, "cuda_graphs": False},
    "graphs": {"batched_clients": True, "cuda_graphs": "auto"},
}


def workload_raw(name: str, subsample: float, rounds: int, device: str) -> dict[str, Any]:
    if name in ("fedtgp", "lg_fedavg", "fedavg"):
        raw = raw_config(name, subsample, rounds, 0, device)
        if name == "fedavg":
            raw["data"]["min_size"] = 2
    else:  # resnet18_b<batch>: CIFAR-shaped synthetic images, FedAvg on the ResNet-18 member
        batch = int(name.rsplit("_b", 1)[1])
        raw = raw_config("fedavg", 1.0, rounds, 0, device)
        raw["data"] = {
            "dataset": "synthetic",
            "synthetic_shape": [3, 32, 32],
            "synthetic_classes": 10,
            "synthetic_size": max(400, int(8000 * subsample / 0.25)),
            "partition": "dirichlet",
            "alpha": 0.5,
            "num_clients": 10,
            "split": "pool_75_25",
        }
        raw["model"] = {"family": "resnet18", "feature_dim": 512}
        raw["train"]["clients_per_round"] = 10
        raw["train"]["batch_size"] = batch
    # fedmosaic's default threads ("auto": one); the plain loop keeps torch's default (main)
    raw["sim"] = {"backend": "serial", "progress": False}
    return raw


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_variant(raw: dict[str, Any], flags: dict[str, Any], device: str) -> dict[str, Any]:
    raw = json.loads(json.dumps(raw))
    raw["train"].update(flags)
    batched.clear_graphs()
    counts: list[dict[str, int]] = []

    def on_round(_: dict[str, Any]) -> None:
        counts.append(dict(engaged))

    engaged.clear()
    _sync(device)
    t0 = time.perf_counter()
    doc = run_experiment(from_dict(raw), progress=False, on_round=on_round)
    wall = time.perf_counter() - t0
    timed = doc["rounds"][1:] or doc["rounds"]

    def mean(key: str) -> float:
        return sum(r[key] for r in timed) / len(timed)

    last, before = (counts[-1], counts[-2]) if len(counts) > 1 else (counts[-1], {})
    per_round = {k: last.get(k, 0) - before.get(k, 0) for k in ("batched_steps", "graph_replays")}
    return {
        "seconds": mean("seconds"),
        "train": mean("seconds_train"),
        "aggregate": mean("seconds_aggregate"),
        "eval": mean("seconds_eval"),
        "setup_and_first_round": wall - sum(r["seconds"] for r in timed),
        "acc": doc["rounds"][-1].get("acc_weighted", math.nan),
        "last_round_steps": per_round["batched_steps"],
        "last_round_graph_replays": per_round["graph_replays"],
        "graphs_captured": last.get("graph_captures", 0),
    }


def flops_of(raw: dict[str, Any], name: str) -> dict[str, float]:
    fed = build_federation(from_dict(raw))
    if name in ("fedtgp", "lg_fedavg", "fedavg"):
        fl = round_flops(fed, name, 2)
        return {"train": fl.train, "total": fl.total}
    shape = fed.spec.input_shape
    model = fed.models[0]
    fwd, train = flops_per_image(model, shape), trainable_flops(model, shape)
    bs = fed.settings.batch_size
    trained = sum(n if n < bs else (n // bs) * bs for n in (c.num_train for c in fed.clients))
    evaluated = sum(c.num("test") for c in fed.clients)
    return {"train": float(train * trained), "total": float(train * trained + fwd * evaluated)}


def matmul_rates(device: str) -> dict[str, float]:
    if not device.startswith("cuda"):
        return {}
    out = {}
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        for label, tf32 in (("fp32", False), ("tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            out[label] = cuda_matmul_gflops()  # speed.py's probe: 8192^3 products, best of 1.5 s
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu.json", help="the JSON written (default gpu.json)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    p.add_argument("--subsample", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=3, help="fedmosaic rounds (first untimed)")
    p.add_argument("--workloads", default="fedtgp,lg_fedavg,fedavg,resnet18_b10,resnet18_b64")
    p.add_argument("--variants", default="plain,one_at_a_time,batched,graphs")
    p.add_argument("--quick", action="store_true", help="tiny data, two rounds (smoke)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    subsample, rounds = (0.01, 2) if args.quick else (args.subsample, args.rounds)
    device = args.device
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cores": os.cpu_count(),
        "torch_default_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "subsample": subsample,
        "rounds": rounds,
        "matmul_gflops": matmul_rates(device),
        "workloads": {},
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "workloads"}), flush=True)
    variants = [v for v in args.variants.split(",") if v]
    default_threads = torch.get_num_threads()
    for name in [w for w in args.workloads.split(",") if w]:
        raw = workload_raw(name, subsample, rounds, device)
        row: dict[str, Any] = {"config": {"data": raw["data"], "model": raw["model"]}}
        fl = flops_of(raw, name)
        row["tflop_per_round"] = fl["total"] / 1e12
        row["train_tflop_per_round"] = fl["train"] / 1e12
        for variant in variants:
            if variant == "plain":
                fed = build_federation(from_dict(raw))
                torch.set_num_threads(default_threads)  # a research loop's (torch's default)
                _sync(device)
                r = Reference(fed, device).run(2)[-1]
                got = {k: r[k] for k in ("seconds", "train", "aggregate", "eval", "acc")}
                del fed
            else:
                got = run_variant(raw, VARIANTS[variant], device)
            got["gflops_round"] = fl["total"] / got["seconds"] / 1e9
            got["gflops_train"] = fl["train"] / max(got["train"], 1e-9) / 1e9
            row[variant] = got
            print(name, variant, json.dumps(got), flush=True)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if "plain" in row:
            row["speedup_vs_plain"] = {
                v: row["plain"]["seconds"] / row[v]["seconds"] for v in variants if v != "plain"
            }
        if doc["matmul_gflops"] and "graphs" in row:
            row["graphs_fraction_of_matmul"] = {
                k: row["graphs"]["gflops_train"] / v for k, v in doc["matmul_gflops"].items()
            }
        doc["workloads"][name] = row
        with open(args.out, "w") as f:  # rewritten after each workload: a cut run keeps rows
            json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
