"""Simulator speed vs a plain research-library-style loop, on the same workload, in one run.

    .venv/bin/python benchmarks/speed.py            # full workloads (several minutes)
    .venv/bin/python benchmarks/speed.py --quick    # small subsample, under a minute (smoke)
    .venv/bin/python benchmarks/speed.py --memory   # also: peak RSS, 100 vs 1,000 clients

Workloads (Fashion-MNIST, Dirichlet(0.1), batch 10, lr 0.01, 1 local epoch, evaluation every
round): FedTGP and LG-FedAvg with 20 clients on the eight CNNs of ``htfe8-gray``; FedAvg with 100
clients (``fedavgcnn``) at 10% participation.

For each workload it prints seconds per round of

- **ours**: ``run_experiment`` with ``sim.backend = "processes"`` (one worker per core, one
  thread each), the last of ``--rounds`` rounds (round 1 warms kernels up; worker start-up and
  data loading are reported apart, as ``setup``);
- **reference**: an in-repo plain loop written the way research libraries run a round: clients
  one after another, each ``copy.deepcopy``-ed, trained from a ``DataLoader`` (batch 10, shuffle,
  ``drop_last``) over per-client lists of pre-normalized float tensors, torch's default threads;
  a separate batch-10 pass over the training data for the uploaded prototypes (FedTGP); and
  evaluation of every client with batch-10 loaders under ``no_grad``. It uses the same model
  classes with channels-last pooling switched off (NCHW max-pool, as a plain library does), the
  same algorithm object for the loss, prediction and the server side (FedTGP's server step with
  autograd and ``torch.optim.SGD``, ``server_fused_sgd = false``, as the libraries run it), so the
  two differ in how the round is executed, not in what it computes;

the ratio, and the achieved GFLOP/s (training; whole round) against the fp32 peak measured in the
same run (``Peak``: the best of MKL, oneDNN and the native kernel over ``PEAK_SHAPES``, on all
cores or cores x one thread, before and again after the workloads; a workload above it is
flagged). FLOPs are counted per layer (``fedmosaic.models.flops``: forward,
plus weight- and input-gradients for training). The last line is, for the FedTGP workload,

    speedup=<reference s/round / ours s/round> peak_fraction=<round FLOPs / wall / peak>

With the native kernel built (``fedmosaic.kernels``), "ours" runs twice, with the kernel and on
the torch path (``FEDMOSAIC_KERNELS=0``), and a ``kernel`` line gives their ratio;
``--layers`` also times the fused plain-SGD step (forward + backward + update) of every Linear
shape of the workloads' families (the kernel's AVX2 and, where the CPU has it, AVX-512 code) and
of the gray CNNs' first block (conv -> pool -> ReLU) at batch 10 on one thread, torch path vs
kernel, in GFLOP/s (``--workloads "" --layers``: the table only).

``--device cpu|cuda`` times the batched path (``train.batched_clients``, ``accel/batched.py``):
each workload on the serial backend on that device (one thread on CPU), clients one at a time
vs the round's clients of one layout as one ``torch.func`` computation, and the ratio. With
``cuda`` "ours" and the reference loop also run on the GPU (serial backend, batched clients on),
and the FedTGP line projects Table 10 (16 cells x 1,000 rounds) at the measured round time.

``--isa avx2`` runs everything as on a CPU without AVX-512: the benchmark starts again with ATen's
capability, oneDNN's ISA and MKL's instructions pinned at AVX2 (the native kernel follows ATen's);
the first line after the header names the instruction sets that ran (the CPU's, ATen's, the native
kernel's).

``--competing N`` then runs every workload again beside N single-threaded processes that keep a
core busy each (one-thread matmuls): ours with the default runtime (``auto``, which measures how
many workers train a round, and names the layouts it chose), on worker processes and serially,
and the reference, so the ratio with and without competition comes from one invocation.

Timings on a shared machine are noisy: compare the ratios of one invocation.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fedmosaic import kernels  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.core import seeding  # noqa: E402
from fedmosaic.core.algorithm import Weighted, payload_to  # noqa: E402
from fedmosaic.core.rounds import sample_clients  # noqa: E402
from fedmosaic.experiment import Federation, build_federation, run_experiment  # noqa: E402
from fedmosaic.models import _layers, flops_per_image, trainable_flops  # noqa: E402
from fedmosaic.sim.processes import shutdown_workers  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    "fedtgp": {"algorithm": {"name": "fedtgp"}, "family": "htfe8-gray", "clients": 20, "k": 20},
    "lg_fedavg": {
        "algorithm": {"name": "lg_fedavg"},
        "family": "htfe8-gray",
        "clients": 20,
        "k": 20,
    },
    "fedavg": {"algorithm": {"name": "fedavg"}, "family": "fedavgcnn", "clients": 100, "k": 10},
    # one layout, every client every round: the batched path's best case (one group of 20)
    "fedavg20": {"algorithm": {"name": "fedavg"}, "family": "fedavgcnn", "clients": 20, "k": 20},
}
TABLE10_ROUNDS = 16 * 1000  # FedTGP Table 10: 16 cells x 1,000 rounds (one trial each)


def raw_config(
    name: str, subsample: float, rounds: int, workers: int, device: str = "cpu", **data: Any
) -> dict:
    w = WORKLOADS[name]
    gpu = device.startswith("cuda")
    return {
        "seed": 0,
        "data": {
            "dataset": "fmnist",
            "partition": "dirichlet",
            "alpha": 0.1,
            "num_clients": w["clients"],
            "split": "pool_75_25",
            "subsample": subsample,
            **data,
        },
        "model": {"family": w["family"], "feature_dim": 512},
        "train": {
            "rounds": rounds,
            "clients_per_round": w["k"],
            "local_epochs": 1,
            "batch_size": 10,
            "lr": 0.01,
            "optimizer": "sgd",
            "eval_every": 1,
            "device": device,
        },
        # one GPU: the serial backend (one process, one CUDA context), clients batched on it
        "sim": {"backend": "serial", "progress": False}
        if gpu
        else {"backend": "processes", "workers": workers, "progress": False},
        "algorithm": dict(w["algorithm"]),
    }


# ---- the machine's peak -------------------------------------------------------------------------
# GEMM shapes (rows, in, out) the peak is the best of: large squares (the libraries' best case)
# and the workloads' own Linear shapes at an evaluation batch (100) and a training batch (10, the
# native kernel's case), so no shape a workload runs is missing from the peak.
# --isa avx2 on an AVX-512 host: ATen's kernels (and the native kernels, which follow ATen),
# oneDNN's JIT code and MKL's GEMM at AVX2, as on a machine without AVX-512 (set before torch loads)
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def isa_env(isa: str, environ: dict[str, str]) -> dict[str, str] | None:
    """The environment to run this benchmark again in for ``--isa avx2`` (None: ``native``, or
    the AVX2 pins are already in place)."""
    if isa != "avx2" or all(environ.get(k) == v for k, v in AVX2_ENV.items()):
        return None
    return {**environ, **AVX2_ENV}


def isa_line(forced: bool) -> str:
    """Which instruction sets this process runs: the CPU's, ATen's, the native kernel's."""
    from fedmosaic import numerics

    kernel = kernels.isa() if kernels.load() is not None else "no kernel"
    how = "forced to AVX2 (--isa avx2)" if forced else "as the host has them"
    return (
        f"# instruction sets: CPU {numerics.host_level()}, ATen "
        f"{torch.backends.cpu.get_cpu_capability()}, native kernel {kernel}; {how}"
    )


PEAK_SHAPES = ((1024, 1024, 1024), (512, 1024, 512), (100, 4608, 1024), (10, 4608, 1024))


def _best_rate(op: Any, flop: float, seconds: float) -> float:
    """The best GFLOP/s of ``op`` over repeated short timings (the least disturbed window)."""
    for _ in range(2):
        op()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        reps = 4
        t = time.perf_counter()
        for _ in range(reps):
            op()
        best = max(best, reps * flop / (time.perf_counter() - t) / 1e9)
    return best


def linear_ops(x: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    """``x W^T`` by library, each a no-argument callable: ``mkl`` (``torch.mm`` against the
    transposed weight, its best layout), ``onednn`` (oneDNN's matmul, where this torch has it) and
    ``native`` (the project's skinny-batch kernel, where it takes the shape)."""
    from fedmosaic.accel import inference

    wt, c = w.t().contiguous(), torch.empty(x.shape[0], w.shape[0])
    ops: dict[str, Any] = {"mkl": lambda: torch.mm(x, wt, out=c)}
    if inference._ONEDNN:
        ops["onednn"] = lambda: inference._onednn_linear(x, w, None)
    if kernels.load() is not None and kernels.usable(x, w, None):
        ops["native"] = lambda: kernels.linear_forward(x, w, None)
    return ops


def matmul_gflops(threads: int, seconds: float = 0.4) -> dict[str, float]:
    """Sustained fp32 GFLOP/s on ``threads`` threads by library, each the best over
    :data:`PEAK_SHAPES`: ``mkl`` (``torch.mm``, MKL's sgemm), ``onednn`` (oneDNN's matmul, where
    this torch has it; on AMD CPUs with AVX-512 about twice MKL, whose code there is AVX2) and
    ``native`` (the project's skinny-batch Linear kernel, up to its batch limit)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    try:
        for m, k, n in PEAK_SHAPES:
            ops = linear_ops(torch.randn(m, k), torch.randn(n, k))
            for lib, op in ops.items():
                out[lib] = max(out.get(lib, 0.0), _best_rate(op, 2.0 * m * k * n, seconds))
        return out
    finally:
        torch.set_num_threads(before)


@dataclass
class Peak:
    """The machine's fp32 peak as measured in this invocation: the best rate of any library and
    shape on all cores, or the best one-thread rate times the cores, whichever is higher (one
    thread per worker is how the simulator runs; a loaded machine can hold an all-core
    measurement below what its workers reach one thread each), over every measurement taken
    (:meth:`remeasure` adds one after the workloads)."""

    cores: int
    single: dict[str, float] = field(default_factory=dict)
    multi: dict[str, float] = field(default_factory=dict)

    def measure(self) -> None:
        for into, threads in ((self.single, 1), (self.multi, self.cores)):
            for lib, v in matmul_gflops(threads).items():
                into[lib] = max(into.get(lib, 0.0), v)

    @property
    def value(self) -> float:
        return max(max(self.multi.values()), self.cores * max(self.single.values()))

    @property
    def mkl(self) -> float:
        return max(self.multi["mkl"], self.cores * self.single["mkl"])


def _peaks(p: dict[str, float]) -> str:
    return " / ".join(f"{v:.1f} ({k})" for k, v in p.items())


def cuda_matmul_gflops(n: int = 8192, seconds: float = 1.5) -> float:
    """Sustained fp32 GFLOP/s of square matmuls on the current GPU (TF32 as torch's default)."""
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    c = torch.empty(n, n, device="cuda")
    torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    best = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


# ---- FLOPs of a round -----------------------------------------------------------------------------
@dataclass
class RoundFlops:
    train: float = 0.0  # forward + backward of the local steps
    upload: float = 0.0  # FedTGP: forward over the training split for the prototypes
    eval: float = 0.0  # forward over every client's test split
    server: float = 0.0  # FedTGP: the server's prototype training (its MLP, forward + backward)

    @property
    def total(self) -> float:
        return self.train + self.upload + self.server + self.eval


def round_flops(fed: Federation, name: str, round_num: int) -> RoundFlops:
    per_member: dict[str, tuple[float, float]] = {}
    shape = fed.spec.input_shape
    for cid, member in enumerate(fed.spec.members):
        if member not in per_member:
            with torch.random.fork_rng(devices=[]):
                model = fed.spec.build_model(cid)
            per_member[member] = (
                float(flops_per_image(model, shape)),
                float(trainable_flops(model, shape)),
            )
    out = RoundFlops()
    bs = fed.settings.batch_size
    sampled = sample_clients(
        fed.cfg.seed, round_num, fed.plan.num_clients, fed.plan.clients_per_round
    )
    points = 0  # FedTGP: uploaded (prototype, class) pairs
    for c in fed.clients:
        fwd, train = per_member[fed.spec.members[c.client_id]]
        if c.client_id in sampled:
            n = c.num_train
            trained = n if n < bs else (n // bs) * bs
            out.train += train * trained
            if name == "fedtgp":
                out.upload += fwd * n
                points += int((c.class_counts("train") > 0).sum())
        out.eval += fwd * c.num("test")
    algo = fed.algo
    if name == "fedtgp" and getattr(algo, "mlp", False):
        # per step: the MLP's two d x d layers on the C prototypes, forward (2 C d^2 each) and
        # backward (input and weight gradients: twice that)
        c, d = fed.spec.num_classes, fed.spec.feature_dim
        steps = algo.server_epochs * math.ceil(points / algo.server_batch_size)
        out.server = steps * 3 * 2 * (2 * c * d * d)
    return out


# ---- ours -----------------------------------------------------------------------------------------
def set_kernel(on: bool) -> None:
    """Native kernel on/off for this process and freshly started workers."""
    os.environ[kernels.ENV] = "1" if on else "0"
    shutdown_workers()  # pooled workers keep the choice they started with
    kernels.reset()


def run_ours(raw: dict) -> dict[str, Any]:
    t0 = time.perf_counter()
    doc = run_experiment(from_dict(raw), progress=False)
    wall = time.perf_counter() - t0
    last = doc["rounds"][-1]
    rounds_total = sum(r["seconds"] for r in doc["rounds"])
    return {
        "seconds": last["seconds"],
        "train": last["seconds_train"],
        "aggregate": last["seconds_aggregate"],
        "eval": last["seconds_eval"],
        "setup": wall - rounds_total,
        "acc": last.get("acc_weighted", math.nan),
        "runtime": doc["provenance"]["runtime"],
    }


# ---- the reference loop ---------------------------------------------------------------------------
@dataclass
class Reference:
    """Research-library-style execution of the same rounds (see module doc)."""

    fed: Federation
    device: str = "cpu"
    train_sets: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    test_sets: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        fd = self.fed.data
        for c in self.fed.clients:  # per-client copies of normalized floats, as from .npz files
            for split, out in (("train", self.train_sets), ("test", self.test_sets)):
                x = fd.batch(c.rows(split), self.device).contiguous()
                out.append(list(zip(x, c.targets(split).to(self.device))))

    def run(self, rounds: int) -> list[dict[str, float]]:
        fed, algo = self.fed, self.fed.algo
        if hasattr(algo, "server_fused_sgd"):  # FedTGP's server step as the libraries run it
            algo = dataclasses.replace(algo, server_fused_sgd=False)
        state = algo.init_server(fed.spec)
        models, extras = fed.models, fed.extras
        lr = fed.settings.lr
        times = []
        was = _layers.CHANNELS_LAST_POOL, _layers.NATIVE_INFERENCE
        _layers.CHANNELS_LAST_POOL = False  # a plain library pools in NCHW
        _layers.NATIVE_INFERENCE = False  # and runs torch's layers one by one
        try:
            for t in range(1, rounds + 1):
                t0 = time.perf_counter()
                sampled = sample_clients(
                    fed.cfg.seed, t, fed.plan.num_clients, fed.plan.clients_per_round
                )
                uploads = []
                for cid in sampled:
                    msg = payload_to(algo.broadcast(state, cid, t), self.device)
                    model = copy.deepcopy(models[cid])  # the client's model, loaded afresh
                    ext = copy.deepcopy(extras[cid])
                    algo.receive(model, ext, msg)
                    seeding.seed_torch(fed.cfg.seed, t, cid, "reference")
                    loader = DataLoader(
                        self.train_sets[cid],
                        batch_size=fed.settings.batch_size,
                        shuffle=True,
                        drop_last=True,
                    )
                    opt = torch.optim.SGD(model.parameters(), lr=lr)
                    model.train()
                    for x, y in loader:
                        loss = algo.loss(model, ext, x, y, msg)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                    model.eval()
                    uploads.append(
                        Weighted(
                            cid,
                            float(len(self.train_sets[cid])),
                            self._upload(model, ext, cid, msg),
                        )
                    )
                    models[cid], extras[cid] = model, ext
                t1 = time.perf_counter()
                state = algo.aggregate(state, uploads, t)
                t2 = time.perf_counter()
                correct = total = 0
                for cid in range(fed.plan.num_clients):
                    msg = payload_to(algo.broadcast(state, cid, t + 1), self.device)
                    model, ext = models[cid], extras[cid]
                    algo.receive(model, ext, msg)
                    model.eval()
                    with torch.no_grad():
                        for x, y in DataLoader(self.test_sets[cid], batch_size=10):
                            scores = algo.predict(model, ext, x, msg)["acc"]
                            correct += int((scores.argmax(1) == y).sum())
                            total += len(y)
                t3 = time.perf_counter()
                times.append(
                    {
                        "seconds": t3 - t0,
                        "train": t1 - t0,
                        "aggregate": t2 - t1,
                        "eval": t3 - t2,
                        "acc": correct / max(total, 1),
                    }
                )
        finally:
            _layers.CHANNELS_LAST_POOL, _layers.NATIVE_INFERENCE = was
        return times

    def _upload(self, model: Any, ext: Any, cid: int, msg: Any) -> Any:
        if type(self.fed.algo).__name__ != "FedTGP":
            up = self.fed.algo.upload(model, ext, self.fed.clients[cid], msg)  # weights only
            return payload_to(up, "cpu")  # the server aggregates on the CPU
        from fedmosaic.algorithms.fedtgp import ClientPrototypes

        c, d = self.fed.spec.num_classes, self.fed.spec.feature_dim
        sums = torch.zeros(c, d, device=self.device)
        counts = torch.zeros(c, device=self.device)
        with torch.no_grad():  # a separate pass over the training data, batch 10
            for x, y in DataLoader(self.train_sets[cid], batch_size=10):
                sums.index_add_(0, y, model.features(x))
                counts.index_add_(0, y, torch.ones(len(y), device=self.device))
        has = counts > 0
        return ClientPrototypes(
            (sums[has] / counts[has].unsqueeze(1)).cpu().contiguous(), has.nonzero().flatten().cpu()
        )


# ---- batched clients -----------------------------------------------------------------------------
def batched_comparison(names: list[str], subsample: float, rounds: int, device: str) -> None:
    """Serial backend on ``device`` (one thread on CPU): one client at a time vs batched."""
    print(f"\n== batched clients on {device} (serial backend, last of {rounds} rounds timed)")
    threads = torch.get_num_threads()
    for name in names:
        data = {"min_size": 2} if WORKLOADS[name]["clients"] > 20 else {}
        raw = raw_config(name, subsample, rounds, 0, device, **data)
        raw["sim"] = {
            "backend": "serial",
            "threads": 1 if device == "cpu" else 0,
            "progress": False,
        }
        got = {}
        for flag in (False, True):
            raw["train"]["batched_clients"] = flag
            got[flag] = run_ours(raw)
        torch.set_num_threads(threads)
        w = WORKLOADS[name]
        print(f"{name} ({w['clients']} clients, {w['k']} per round, {w['family']}):")
        for flag, o in got.items():
            print(
                f"  {'batched' if flag else 'one at a time':13} {o['seconds']:7.2f} s/round "
                f"(train {o['train']:.2f}, eval {o['eval']:.2f})  acc {o['acc']:.4f}"
            )
        print(
            f"  batched   {got[False]['seconds'] / got[True]['seconds']:7.2f}x  (one-at-a-time "
            f"s/round / batched s/round; training {got[False]['train'] / got[True]['train']:.2f}x)"
        )


# ---- memory -----------------------------------------------------------------------------------------
def memory_child(num_clients: int, rounds: int, subsample: float) -> None:
    """One FedAvg run at 10% participation; prints peak RSS of this process and the workers."""
    from fedmosaic.core.rounds import run_rounds
    from fedmosaic.experiment import make_transport

    raw = raw_config("fedavg", subsample, rounds, 0, partition="iid")
    raw["data"]["num_clients"] = num_clients
    raw["train"]["clients_per_round"] = num_clients // 10
    fed = build_federation(from_dict(raw), with_clients=False)
    transport = make_transport(fed)
    try:
        run_rounds(fed.algo, fed.spec, transport, fed.plan)
        workers = transport.peak_rss()
        store = transport.store.disk_bytes()
    finally:
        transport.close()
    with open("/proc/self/status") as f:
        main = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"main": main, "workers": workers, "store": store}))


def measure_memory(rounds: int, subsample: float) -> None:
    got = {}
    for n in (100, 1000):
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--memory-child",
                str(n),
                "--rounds",
                str(rounds),
                "--subsample",
                str(subsample),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        got[n] = json.loads(out.stdout.strip().splitlines()[-1])
        rss = got[n]["main"] + sum(got[n]["workers"])
        print(
            f"memory fedavg {n:>4} clients @10%: peak RSS {rss / 2**20:7.0f} MiB "
            f"(main {got[n]['main'] / 2**20:.0f}, workers "
            f"{', '.join(f'{w / 2**20:.0f}' for w in got[n]['workers'])}); "
            f"client states on disk {got[n]['store'] / 2**20:.0f} MiB"
        )
    total = {n: g["main"] + sum(g["workers"]) for n, g in got.items()}
    print(f"memory ratio 1000/100 clients: {total[1000] / total[100]:.2f} (target <= 2)")


# ---- per-layer rates ------------------------------------------------------------------------------
def linear_shapes(family: str) -> list[tuple[int, int]]:
    """(in, out) of the Linear layers of a family's members (FMNIST input, feature_dim 512)."""
    from torch import nn

    from fedmosaic.models import build_client_model, family_members

    shapes: set[tuple[int, int]] = set()
    for member in family_members(family):
        with torch.device("meta"):
            model = build_client_model(member, (1, 28, 28), 10, 512)
        shapes |= {(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear}
    return sorted(shapes, key=lambda s: -s[0] * s[1])


def fused_step_seconds(batch: int, i: int, o: int, native: bool, reps: int = 15) -> float:
    """Best time of one fused plain-SGD Linear step (forward, backward, in-place update)."""
    from fedmosaic.accel.fused import _SGDLinear

    before = kernels.MAX_BATCH
    kernels.MAX_BATCH = before if native else 0
    try:
        w = torch.nn.Parameter(torch.randn(o, i) * 0.01)
        b = torch.nn.Parameter(torch.zeros(o))
        x = torch.randn(batch, i, requires_grad=True)
        g = torch.randn(batch, o) * 1e-3
        best = math.inf
        for _ in range(reps + 2):
            t = time.perf_counter()
            _SGDLinear.apply(x, w, b, 1e-6).backward(g)
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        kernels.MAX_BATCH = before


def block_step_seconds(batch: int, native: bool, reps: int = 15) -> float:
    """Best time of one training step of the gray CNNs' first block (conv 1->32, 5x5, 28x28 ->
    2x2 max pool -> ReLU): torch's layers (mkldnn, channels-last pool) + SGD update, or the
    native block op (kernels.conv.SGDConvPoolReLU)."""
    from fedmosaic.kernels.conv import SGDConvPoolReLU
    from fedmosaic.models._layers import conv_pool_relu

    block = conv_pool_relu(1, 32, 5, 0)
    conv = block[0]
    x = torch.randn(batch, 1, 28, 28)
    best = math.inf
    for _ in range(reps + 2):
        t = time.perf_counter()
        y = SGDConvPoolReLU.apply(x, conv.weight, conv.bias, 1e-6, conv) if native else block(x)
        y.backward(torch.ones_like(y) * 1e-3)
        if not native:
            with torch.no_grad():
                for p in conv.parameters():
                    p.add_(p.grad, alpha=-1e-6)
                    p.grad = None
        best = min(best, time.perf_counter() - t)
    return best


def layer_table(families: list[str], batch: int = 10) -> None:
    """GFLOP/s of the fused step per Linear shape and of the first conv block, torch path vs
    the kernel (AVX2 and, where the CPU has it, AVX-512), one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    native = kernels.load() is not None
    isas = ["avx2"] + (["avx512"] if native and kernels.set_isa("avx512") == "avx512" else [])
    try:
        print(f"\n== Fused plain-SGD step per layer at batch {batch}, 1 thread (GFLOP/s)")
        print(f"{'in x out':>12} {'torch':>7} " + " ".join(f"{i:>7}" for i in isas) + "  ratio")
        for i, o in sorted(
            {s for f in families for s in linear_shapes(f)}, key=lambda s: -s[0] * s[1]
        ):
            flop = 3 * 2 * batch * i * o  # forward, input gradient, weight gradient
            t = fused_step_seconds(batch, i, o, False)
            ks = []
            for isa in isas if native else []:
                kernels.set_isa(isa)
                ks.append(fused_step_seconds(batch, i, o, True))
            rates = " ".join(f"{flop / k / 1e9:7.1f}" for k in ks)
            ratio = t / min(ks) if ks else math.nan
            print(f"{f'{i}x{o}':>12} {flop / t / 1e9:7.1f} {rates} {ratio:6.2f}")
        # forward and weight gradient of the convolution (pooling and ReLU not counted)
        flop = 2 * 2 * batch * 24 * 24 * 32 * 25
        t = block_step_seconds(batch, False)
        k = block_step_seconds(batch, True) if native else math.nan
        print(
            f"{'conv block':>12} {flop / t / 1e9:7.1f} {flop / k / 1e9:7.1f}"
            f"{'':>{8 * (len(isas) - 1)}} {t / k:6.2f}   (conv 1->32 5x5 + pool + ReLU; "
            f"{kernels.isa() if native else 'no kernel'})"
        )
    finally:
        if native:
            kernels.set_isa("avx512")
        torch.set_num_threads(before)


# A single-threaded process that keeps one core busy with float work (matmuls through MKL on one
# thread, as another user's training would), for --competing.
COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(384, 384)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)


def under_load(
    names: list[str], subsample: float, rounds: int, workers: int, competing: int, quick: bool
) -> None:
    """Each workload again while ``competing`` single-threaded processes hold cores: ours with
    the default runtime (``sim.backend = "auto"``, which measures its layout between rounds: at
    least 6 rounds, the last timed, so the measured layout is the one timed), on worker processes
    (one per core) and serially (one process, one thread), and the reference loop; seconds per
    round and the ratios, beside the unloaded run printed above (the same invocation)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", COMPETITOR], stdout=subprocess.DEVNULL)
        for _ in range(competing)
    ]
    try:
        time.sleep(1.0)  # the competitors are running before the first timed round
        print(f"\n== under load: {competing} competing single-threaded process(es)")
        for name in names:
            data = {"min_size": 2} if (quick and WORKLOADS[name]["clients"] > 20) else {}
            raw = raw_config(name, subsample, rounds, workers, **data)
            set_kernel(kernels.load() is not None)
            auto = run_ours(
                {
                    **raw,
                    "train": {**raw["train"], "rounds": max(rounds, 6)},
                    "sim": {"progress": False},
                }
            )
            spread = run_ours(raw)
            serial = run_ours(
                {**raw, "sim": {"backend": "serial", "threads": 1, "progress": False}}
            )
            ref = Reference(build_federation(from_dict(raw)), "cpu").run(rounds)[-1]
            rt = auto["runtime"]
            chose = "; ".join(
                f"from fit {e['fit']} {e['workers']} worker(s)" for e in rt.get("layouts", [])
            )
            print(
                f"{name}: ours {auto['seconds']:.2f} s/round as auto runs it ({rt['backend']}, "
                f"{rt['workers']} worker(s){'; ' + chose if chose else ''}), "
                f"{spread['seconds']:.2f} on worker processes, {serial['seconds']:.2f} serially; "
                f"reference {ref['seconds']:.2f}; speedup {ref['seconds'] / auto['seconds']:.2f}x "
                f"(auto), {ref['seconds'] / spread['seconds']:.2f}x (processes), "
                f"{ref['seconds'] / serial['seconds']:.2f}x (serial); acc {spread['acc']:.4f} "
                f"{serial['acc']:.4f} {ref['acc']:.4f}"
            )
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def forward_table(families: list[str], batch: int = 10, seconds: float = 0.25) -> None:
    """GFLOP/s of the Linear forward per shape of the families at ``batch``, one thread: MKL
    (``torch.mm`` against the transposed weight, its best layout), oneDNN (where this torch has
    it) and the native kernel on each instruction set the CPU has; the native/MKL ratio. Each is
    the best of three interleaved windows (a noisy neighbour moves all three alike)."""
    from fedmosaic.accel import inference

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    native = kernels.load() is not None
    isas = (
        (["avx2"] + (["avx512"] if kernels.set_isa("avx512") == "avx512" else [])) if native else []
    )
    libs = ["mkl"] + (["onednn"] if inference._ONEDNN else []) + isas
    try:
        print(f"\n== Linear forward per layer at batch {batch}, 1 thread (GFLOP/s)")
        print(f"{'in x out':>12} " + " ".join(f"{k:>7}" for k in libs) + "  native/mkl")
        for i, o in sorted(
            {s for f in families for s in linear_shapes(f)}, key=lambda s: -s[0] * s[1]
        ):
            ops = linear_ops(torch.randn(batch, i), torch.randn(o, i))
            kernel = ops.pop("native", None)
            for isa in isas if kernel is not None else []:  # the set is chosen per window below
                ops[isa] = kernel
            rate = dict.fromkeys(ops, 0.0)
            for _ in range(3):
                for k, op in ops.items():
                    if k in isas:
                        kernels.set_isa(k)
                    rate[k] = max(rate[k], _best_rate(op, 2.0 * batch * i * o, seconds))
            mine = rate[kernels.isa()] if native else math.nan
            print(
                f"{f'{i}x{o}':>12} "
                + " ".join(f"{rate[k]:7.1f}" for k in libs)
                + f"  {mine / rate['mkl']:10.2f}"
            )
    finally:
        if native:
            kernels.set_isa("avx512")
        torch.set_num_threads(before)


# ---- driver -----------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5%% of Fashion-MNIST; under a minute")
    p.add_argument("--rounds", type=int, default=2, help="rounds per run; the last is timed")
    p.add_argument("--workers", type=int, default=0, help="simulator workers (0: one per core)")
    p.add_argument("--subsample", type=float, default=None, help="fraction of Fashion-MNIST")
    p.add_argument("--workloads", default="lg_fedavg,fedavg,fedtgp")
    p.add_argument(
        "--memory", action="store_true", help="also measure peak RSS, 100 vs 1000 clients"
    )
    p.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--kernel",
        choices=("both", "on", "off"),
        default="both",
        help="ours with the native kernel, on the torch path, or both (default; ratio line)",
    )
    p.add_argument("--layers", action="store_true", help="also the per-layer Linear table")
    p.add_argument(
        "--competing",
        type=int,
        default=0,
        help="then run the workloads again beside this many single-threaded processes that keep "
        "a core busy each (ours on worker processes and serially, and the reference)",
    )
    p.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: run as on a CPU without AVX-512 (ATen, oneDNN, MKL and the native kernel "
        "pinned at AVX2); native: what the host has",
    )
    p.add_argument(
        "--batched-only",
        action="store_true",
        help="with --device: only the batched vs one-at-a-time comparison",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="also time batched vs one-at-a-time clients on this device; cuda: everything on "
        "the GPU",
    )
    args = p.parse_args()
    if args.competing < 0:
        p.error(f"--competing: {args.competing} processes; give 0 or more")
    if args.competing and args.device == "cuda":
        p.error("--competing measures the CPU path: leave out --device cuda")
    env = isa_env(args.isa, dict(os.environ))
    if env is not None:  # ATen reads its capability when torch loads: start again with the pins
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    subsample = args.subsample if args.subsample is not None else (0.05 if args.quick else 1.0)
    if args.memory_child:
        memory_child(args.memory_child, args.rounds, subsample)
        return

    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"# torch {torch.__version__}, {cores} cores, default threads {threads}, "
        f"subsample {subsample}, rounds {args.rounds} (last timed), load {os.getloadavg()[0]:.1f}"
    )
    print(isa_line(args.isa == "avx2"))
    machine = Peak(cores or 1)
    machine.measure()
    peak, mkl_peak = machine.value, machine.mkl
    print(
        f"peak fp32 GFLOP/s (best of {len(PEAK_SHAPES)} GEMM shapes): {_peaks(machine.single)} "
        f"on 1 thread, {_peaks(machine.multi)} on {cores}; peak = max(best on {cores}, "
        f"{cores} x best on 1) = {peak:.1f}; fractions below are of it"
    )
    print(f"fused SGD layers: {kernels.status()}")
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.kernel]
    if kernels.load() is None:
        modes = [False]
    gpu = args.device == "cuda"
    device = "cuda" if gpu else "cpu"
    if gpu:
        modes = [False]  # the native kernel is CPU-only
        peak = mkl_peak = cuda_matmul_gflops()
        print(f"GPU: {torch.cuda.get_device_name(0)}, fp32 matmul {peak:.0f} GFLOP/s (peak below)")

    names = [n for n in args.workloads.split(",") if n]
    if "fedtgp" in names:  # its summary line must come last
        names = [n for n in names if n != "fedtgp"] + ["fedtgp"]
    last = ""
    rates: dict[str, tuple[float, float]] = {}  # workload -> (speedup, whole-round GFLOP/s)
    for name in [] if (args.batched_only and args.device) else names:
        data = {"min_size": 2} if (args.quick and WORKLOADS[name]["clients"] > 20) else {}
        raw = raw_config(name, subsample, args.rounds, args.workers, device, **data)
        by_mode = {}
        for on in modes:
            set_kernel(on)
            by_mode[on] = run_ours(raw)
        ours = by_mode[modes[0]]  # the kernel when it is built
        fed = build_federation(from_dict(raw))
        ref = Reference(fed, device).run(args.rounds)[-1]
        fl = round_flops(fed, name, args.rounds)
        speedup = ref["seconds"] / ours["seconds"]
        train_rate = fl.train / ours["train"] / 1e9
        round_rate = fl.total / ours["seconds"] / 1e9
        k, n = WORKLOADS[name]["k"], WORKLOADS[name]["clients"]
        print(f"\n== {name}: {n} clients, {k} per round, {WORKLOADS[name]['family']}")
        for on, o in by_mode.items():
            print(
                f"ours      {o['seconds']:7.2f} s/round  (train {o['train']:.2f}, aggregate "
                f"{o['aggregate']:.2f}, eval {o['eval']:.2f}; setup {o['setup']:.1f} s once)"
                f"  acc {o['acc']:.4f}  [{'kernel' if on else 'torch path'}]"
            )
        print(
            f"reference {ref['seconds']:7.2f} s/round  (train {ref['train']:.2f}, aggregate "
            f"{ref['aggregate']:.2f}, eval {ref['eval']:.2f})  acc {ref['acc']:.4f}"
        )
        for on, o in by_mode.items():
            print(
                f"speedup   {ref['seconds'] / o['seconds']:7.2f}x  "
                f"[{'kernel' if on else 'torch path'}]"
            )
        if len(by_mode) == 2:
            print(
                f"kernel    {by_mode[False]['seconds'] / by_mode[True]['seconds']:7.2f}x  "
                f"(torch path s/round / kernel s/round; training "
                f"{by_mode[False]['train'] / by_mode[True]['train']:.2f}x)"
            )
        print(
            f"FLOPs     train {fl.train / 1e12:.3f} T + prototypes {fl.upload / 1e12:.3f} T + "
            f"server {fl.server / 1e12:.3f} T + eval {fl.eval / 1e12:.3f} T = "
            f"{fl.total / 1e12:.3f} TFLOP per round"
        )
        print(
            f"rate      training {train_rate:.1f} GFLOP/s ({train_rate / peak:.2f} of peak), "
            f"whole round {round_rate:.1f} GFLOP/s ({round_rate / peak:.2f} of peak, "
            f"{round_rate / mkl_peak:.2f} of MKL's)"
        )
        rates[name] = (speedup, round_rate)
        if name == "fedtgp":
            print(
                f"Table 10  {ours['seconds'] * TABLE10_ROUNDS / 3600:7.1f} h projected "
                f"(16 cells x 1,000 rounds at {ours['seconds']:.2f} s/round, {device})"
            )
    set_kernel(modes[0])
    if rates and not gpu:
        # Measured again after the workloads (the load of a shared machine changes): the peak
        # is the best of both, and no workload's rate may exceed it.
        machine.measure()
        peak = machine.value
        print(
            f"\npeak re-measured after the workloads: {_peaks(machine.single)} on 1 thread, "
            f"{_peaks(machine.multi)} on {cores}; peak {peak:.1f} GFLOP/s; whole round of peak: "
            + ", ".join(f"{n} {r / peak:.2f}" for n, (_, r) in rates.items())
        )
        over = [n for n, (_, r) in rates.items() if r > peak]
        if over:
            print(f"WARNING: {', '.join(over)} ran above the measured peak: it is mis-measured")
    if "fedtgp" in rates:
        speedup, round_rate = rates["fedtgp"]
        last = f"speedup={speedup:.2f} peak_fraction={round_rate / peak:.2f}"
    if args.competing > 0 and not gpu:
        under_load(names, subsample, args.rounds, args.workers, args.competing, args.quick)
    if args.device is not None:
        batched_comparison(names, subsample, args.rounds, device)
    if args.layers:
        families = sorted({WORKLOADS[n]["family"] for n in names or ["fedtgp", "fedavg"]})
        forward_table(families)
        layer_table(families)
    if args.memory:
        print()
        measure_memory(args.rounds, 1.0 if not args.quick else 0.2)
    if last:
        print(last)


if __name__ == "__main__":
    main()
