"""Worker-process backend: persistent workers, one torch thread each, clients balanced by cost.

- **Workers** are fresh interpreters (``python -m fedmosaic.sim.worker``), started once per run.
  Each pins one math thread and runs with glibc malloc told to keep freed memory (the activations
  of every training step are reallocated otherwise; see ``MALLOC_ENV``).
- **Data**: the uint8 images are written once to a shared-memory file that every worker maps;
  workers rebuild the per-client index views and the algorithm from the config. Nothing
  dataset-sized is ever pickled.
- **Clients** are rebuilt inside the workers from the config and their own seeded streams, exactly
  as the serial backend builds them. A worker holds the clients it trained as live modules; a
  client moves between workers through the state store (``store.py``: one raw file per client).
- **Balancing**: every ``fit`` spreads the round's sampled clients over the workers by cost,
  largest first onto the least-loaded worker: forward FLOPs x examples until a client has been
  trained once, then its measured seconds (``balance_costs``). Clients stay on the worker that
  holds them unless moving them shortens the round by more than 5%, so with full participation
  they settle after round 1. Evaluation runs each client where it is held, the rest (in the
  store) balanced the same way.
- **Layout under load** (``adaptive``, what ``sim.backend = "auto"`` starts): how many of the
  workers train a round is measured between rounds (``layout.py``): when other work holds a core,
  the other layouts (fewer workers, or all again) are timed for a few rounds each against the
  current one and the fastest kept.
- **Memory scales with participation**: with partial participation a worker keeps only the
  clients of its last ``fit`` live; everyone else lives in the store (disk files, page cache),
  and evaluation borrows a spare module per architecture.
- **Devices**: ``sim.devices`` places one worker per entry (``cuda:N`` or ``cpu``, round-robin
  when there are more workers); a worker's clients, their steps and its copy of the images live
  on its device. With ``train.batched_clients`` on, a worker trains its clients of one model
  layout together (``ClientHost.fit_many``, ``accel/batched.py``).
- **Messages** travel as wire bytes (``encode``), so bytes up/down are the real encoding and every
  upload is decoded and validated on arrival. A message shared by many clients (FedAvg's global
  model) is encoded and sent once per worker.
- **Evaluation cache**: a client whose state has not changed since its last evaluation and whose
  broadcast is byte-identical reuses that evaluation's counts (see ``EvalCache``).

Results are bitwise identical to the serial backend run with ``sim.threads = 1`` and to any other
worker count: every client's work is a pure function of its state, its message and its own
``(seed, round, client)`` streams, computed single-threaded. (This relies on what every algorithm's
``receive`` does: overwrite the shared parts from the message, so re-receiving is harmless and a
borrowed evaluation need not be written back.)
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

import fedmosaic
from fedmosaic.config import from_dict
from fedmosaic.core import secure
from fedmosaic.core.algorithm import Algorithm, Phase
from fedmosaic.core.payload import Payload, PayloadError, decode
from fedmosaic.core.rounds import (
    ClientProgress,
    ClientState,
    EvalResult,
    FitResult,
    LazyClientStates,
)
from fedmosaic.data.datasets import ImageDataset
from fedmosaic.data.federated import FederatedData
from fedmosaic.federation import build_federation, make_client
from fedmosaic.sim.common import EvalCache, MessageTable
from fedmosaic.sim.host import ClientHost
from fedmosaic.sim.layout import LayoutChooser, idle_cores
from fedmosaic.sim.store import StateStore, remove_stale

log = logging.getLogger("fedmosaic")

# glibc malloc: no mmap/munmap per large allocation (32 MiB is the largest threshold glibc accepts
# on 64-bit; larger values are silently ignored) and never give the heap top back to the OS.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_TOP_PAD_": str(64 * 1024 * 1024),
}


# ---- wire helpers (plain pickle: torch's multiprocessing reductions are not wanted here) ----
def send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# ---- balancing ---------------------------------------------------------------------------------
def assign(
    cids: Sequence[int], cost: Sequence[float], workers: int, loads: Sequence[float] | None = None
) -> list[list[int]]:
    """Largest-first greedy: each client (costliest first) onto the least-loaded worker.

    ``loads`` are the workers' loads already committed. Ties go to the lower client / worker id,
    so the assignment is a pure function of its inputs.
    """
    load = list(loads) if loads is not None else [0.0] * workers
    groups: list[list[int]] = [[] for _ in range(workers)]
    for cid in sorted(cids, key=lambda c: (-cost[c], c)):
        w = min(range(workers), key=lambda i: (load[i], i))
        groups[w].append(cid)
        load[w] += cost[cid]
    return groups


def balance(costs: Sequence[float], workers: int) -> list[list[int]]:
    """All clients over ``workers`` (see :func:`assign`)."""
    return assign(range(len(costs)), costs, workers)


def worker_devices(devices: Sequence[str], workers: int) -> list[str | None]:
    """The device of each worker (``sim.devices``, round-robin); None = ``train.device``."""
    if not devices:
        return [None] * workers
    return [devices[w % len(devices)] for w in range(workers)]


# ---- worker side -----------------------------------------------------------------------------------
def worker_setup(init: dict[str, Any]) -> Any:
    """Build a worker's :class:`ClientHost` from its init message (runs in the worker)."""
    cfg = from_dict(init["cfg"])
    if init.get("device"):  # sim.devices: this worker's clients, data and steps live there
        cfg.train.device = init["device"]
        if cfg.train.device.startswith("cuda:"):
            torch.cuda.set_device(cfg.train.device)  # one CUDA context, on this device only
    shape = init["images_shape"]
    numel = 1
    for s in shape:
        numel *= s
    images = torch.from_file(init["images_path"], shared=True, size=numel, dtype=torch.uint8)
    dataset = ImageDataset(images=images.view(*shape), **init["dataset"])
    # The same assembly as the main process's, on the shared images: same spec, same clients.
    federation = build_federation(
        cfg, with_clients=False, data=FederatedData(dataset=dataset, **init["federated"])
    )
    algo, spec, clients = federation.algo, federation.spec, federation.clients

    def build(cid: int) -> tuple[Any, Any]:
        return make_client(cfg, algo, spec, clients[cid])

    return ClientHost(
        algo,
        clients,
        spec.members,
        build,
        federation.settings,
        cfg.seed,
        cfg.train.local_epochs,
        tuple(init["eval_splits"]),
        StateStore(init["store_dir"], create=False),
    )


class _Worker:
    """One worker process and our end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env.update(MALLOC_ENV)
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        env["FEDMOSAIC_PARENT_PID"] = str(os.getpid())
        root = str(Path(fedmosaic.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        fd = theirs.fileno()
        # A process group of its own: a terminal's Ctrl-C reaches only the parent, which stops
        # after the round (the workers die with it: PR_SET_PDEATHSIG in the worker).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedmosaic.sim.worker", str(fd)],
            pass_fds=(fd,),
            env=env,
            process_group=0,
        )
        theirs.close()
        self.conn = Connection(ours.detach())

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.conn.closed

    def stop(self) -> None:
        try:
            send(self.conn, ("stop", {}))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


# Idle, warm workers (torch imported, kernels initialised), reused by the next ProcessTransport of
# this process: starting an interpreter and importing torch takes seconds. They hold no client
# state between runs (``reset`` drops it and returns freed memory to the OS).
_POOL: list[_Worker] = []


def shutdown_workers() -> None:
    """Stop the idle pooled workers (also done automatically at interpreter exit)."""
    while _POOL:
        _POOL.pop().stop()


atexit.register(shutdown_workers)


def _acquire(n: int) -> list[_Worker]:
    out: list[_Worker] = []
    while _POOL and len(out) < n:
        w = _POOL.pop()
        if w.alive():
            out.append(w)
        else:
            w.stop()
    while len(out) < n:
        out.append(_Worker())
    return out


def _shm_dir() -> str:
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else (tempfile.gettempdir())
    )


# ---- main side ---------------------------------------------------------------------------------------
class ProcessTransport(secure.EmulatedSecureFit):
    """Persistent worker processes owning the clients; the round loop's Transport."""

    def __init__(
        self,
        algo: Algorithm,
        cfg: Any,
        data: FederatedData,
        fit_costs: Sequence[float],
        workers: int,
        eval_costs: Sequence[float] | None = None,
        eval_splits: tuple[str, ...] = ("test",),
        offload: bool = False,
        state_dir: str | None = None,
        reuse: bool = True,
        adaptive: bool = False,
    ) -> None:
        self.algo = algo
        self.num_clients = len(fit_costs)
        devices = list(getattr(cfg.sim, "devices", None) or [])
        if devices and not cfg.sim.workers:
            workers = len(devices)  # sim.devices: one worker process per device
        self.fit_costs = list(fit_costs)
        self.eval_costs = list(eval_costs) if eval_costs is not None else list(fit_costs)
        self.workers = max(1, min(int(workers), self.num_clients))
        # adaptive (sim.backend = "auto"): how many workers train each round is measured
        self.chooser = LayoutChooser(self.workers) if adaptive and self.workers > 1 else None
        self.active = self.workers  # the workers the last fit used (clients are placed on them)
        self.offload = offload
        self.holder: dict[int, int] = {}  # client -> worker holding it live (else: in the store)
        self.measured: dict[int, float] = {}  # client -> seconds of its last fit (cost model)
        self.version = [0] * self.num_clients  # bumped whenever a client's state changes
        self.cache = EvalCache()
        self._on_client: ClientProgress | None = None  # see set_progress
        self._on_finetune: ClientProgress | None = None
        self.store = StateStore(state_dir)
        self.procs: list[_Worker] = []
        self.conns: list[Connection] = []
        self.reuse = reuse
        self._clean = True
        images = data.dataset.images.contiguous()
        remove_stale(_shm_dir(), "fedmosaic-")  # image files of SIGKILLed runs
        self._images_path = os.path.join(_shm_dir(), f"fedmosaic-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            # Readable by this user only (the dataset may be private): 0600, created exclusively.
            fd = os.open(self._images_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                images.numpy().tofile(fh)
            init = {
                "cfg": cfg.to_dict(),
                "images_path": self._images_path,
                "images_shape": tuple(images.shape),
                "dataset": {
                    f.name: getattr(data.dataset, f.name)
                    for f in dataclasses.fields(data.dataset)
                    if f.name != "images"
                },
                "federated": {
                    f.name: getattr(data, f.name)
                    for f in dataclasses.fields(data)
                    if f.init and f.name != "dataset"
                },
                "store_dir": str(self.store.root),
                "eval_splits": list(eval_splits),
            }
            self.procs = _acquire(self.workers)
            self.conns = [w.conn for w in self.procs]
            on = worker_devices(devices, self.workers)
            self.pids = list(
                self._call(
                    {w: ("init", dict(init, device=on[w])) for w in range(self.workers)}
                ).values()
            )
        except BaseException:
            self.close()
            raise
        finally:
            # Every worker has mapped the images (or failed): the name is no longer needed.
            Path(self._images_path).unlink(missing_ok=True)

    # ---- process plumbing ------------------------------------------------------------------
    def _reply(self, w: int) -> tuple[str, Any]:
        try:
            return recv(self.conns[w])
        except (EOFError, OSError) as exc:
            code = self.procs[w].proc.poll()
            raise RuntimeError(f"simulator worker {w} died (exit code {code})") from exc

    def _call(
        self,
        per_worker: dict[int, tuple[str, dict[str, Any]]],
        on_part: Callable[[int, Any], None] | None = None,
    ) -> dict[int, Any]:
        """Send each worker its command, collect every reply, then raise the first failure.

        Partial results a worker streams before its reply go to ``on_part(worker, part)``.
        """
        self._clean = False
        for w, msg in per_worker.items():
            send(self.conns[w], msg)
        out: dict[int, Any] = {}
        errors: list[str] = []
        pending = {self.conns[w]: w for w in per_worker}
        while pending:
            for conn in wait(list(pending)):
                w = pending[conn]  # type: ignore[index]
                status, value = self._reply(w)
                if status == "part":
                    if on_part is not None and not errors:
                        try:
                            on_part(w, value)
                        except Exception as exc:  # keep reading: the protocol stays in step
                            errors.append(f"handling a result of worker {w}: {exc!r}")
                    continue
                del pending[conn]  # type: ignore[arg-type]
                if status == "error":
                    errors.append(f"simulator worker {w} failed:\n{value}")
                out[w] = value
        self._clean = True
        if errors:
            raise RuntimeError(errors[0])
        return out

    def _release(self, moves: dict[int, int]) -> None:
        """Have the holders of clients that change workers write them to the store first."""
        flush: dict[int, list[int]] = {}
        for cid, w in moves.items():
            h = self.holder.get(cid)
            if h is not None and h != w:
                flush.setdefault(h, []).append(cid)
        if flush:
            self._call({h: ("flush", {"cids": cids}) for h, cids in flush.items()})
            for cids in flush.values():
                for cid in cids:
                    del self.holder[cid]

    def _place(
        self, cids: Sequence[int], cost: Sequence[float], active: int | None = None
    ) -> list[list[int]]:
        """Held clients stay where they are, the others balance around them by cost on the
        active workers. With ``active`` given (``fit``, which then moves them through the store),
        clients held by a worker beyond the first ``active`` count as not held."""
        keep = self.workers if active is None else active
        active = self.active if active is None else active
        groups: list[list[int]] = [[] for _ in range(self.workers)]
        loads = [0.0] * self.workers
        free = []
        for cid in cids:
            h = self.holder.get(cid)
            if h is None or h >= keep:
                free.append(cid)
            else:
                groups[h].append(cid)
                loads[h] += cost[cid]
        for w, extra in enumerate(assign(free, cost, active, loads[:active])):
            groups[w] += extra
        return groups

    def balance_costs(self) -> list[float]:
        """Fit costs for balancing, in seconds where measured.

        The FLOPs x examples estimate misjudges memory-bound models (wide fully-connected layers at
        batch 10 run at a fraction of the FLOP rate of convolutions), so once a client has been
        trained its measured seconds replace the estimate; clients not yet measured get the
        estimate scaled by the median seconds-per-estimated-FLOP of those measured. Only the
        placement depends on it: results are the same on any worker.
        """
        if not self.measured:
            return list(self.fit_costs)
        rates = sorted(s / max(self.fit_costs[c], 1e-9) for c, s in self.measured.items())
        rate = rates[len(rates) // 2]
        return [self.measured.get(c, self.fit_costs[c] * rate) for c in range(self.num_clients)]

    @staticmethod
    def _per_worker(
        groups: list[list[int]], table: MessageTable, cmd: str, **args: Any
    ) -> dict[int, tuple[str, dict[str, Any]]]:
        """One ``cmd`` per worker with clients: the blobs they need and (client, blob) pairs."""
        calls = {}
        for w, g in enumerate(groups):
            if g:
                blobs, clients = table.part(g)
                calls[w] = (cmd, {"blobs": blobs, "clients": clients, **args})
        return calls

    # ---- Transport -------------------------------------------------------------------------
    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[FitResult]:
        # the layout chooser's measurements (adaptive only): wall time and idle cores over the fit
        start, idle = (
            (time.perf_counter(), idle_cores()) if self.chooser is not None else (0.0, None)
        )
        table = MessageTable(messages)
        costs = self.balance_costs()
        cids = list(messages)
        active = self.chooser.choose() if self.chooser is not None else self.workers
        stay = self._place(cids, costs, active)  # held clients where they are: nothing moves
        fresh = assign(cids, costs, active) + [[] for _ in range(self.workers - active)]

        def span(groups: list[list[int]]) -> float:
            return max(sum(costs[c] for c in g) for g in groups)

        # Moving a client costs a store round trip: rebalance only for a clear gain.
        groups = fresh if span(fresh) < 0.95 * span(stay) else stay
        self.active = active
        self._release({cid: w for w, g in enumerate(groups) for cid in g})
        calls = self._per_worker(groups, table, "fit", round=round_num, offload=self.offload)
        results: dict[int, FitResult] = {}

        def arrived(
            w: int,
            part: tuple[int, bytes | str, int, float, float, dict[str, dict[str, int]] | None],
        ) -> None:
            cid, blob, n, loss, seconds, attack = part  # decoded as it arrives: one at a time
            self.measured[cid] = seconds
            self.holder[cid] = w
            self.version[cid] += 1
            if isinstance(blob, str):  # the client's upload could not be encoded
                results[cid] = FitResult(cid, None, n, 0, table.sizes[cid], loss, error=blob)
                if self._on_client is not None:
                    self._on_client(len(results), len(messages))
                return
            res = FitResult(cid, None, n, len(blob), table.sizes[cid], loss, attack=attack)
            try:
                res.upload = decode(self.algo.Upload, blob)
            except PayloadError as exc:
                res.error = str(exc)  # the round loop drops and logs it
            results[cid] = res
            if self._on_client is not None:
                self._on_client(len(results), len(messages))

        if self._on_client is not None:
            self._on_client(0, len(messages))
        shares = []
        for flushed, share in self._call(calls, arrived).values():
            shares.append(share)
            for cid in flushed:
                self.holder.pop(cid, None)
        if self.chooser is not None:
            seconds, after = time.perf_counter() - start, idle_cores()
            spare = (after - idle) / seconds if idle is not None and after is not None else 0.0
            changes = len(self.chooser.log)
            self.chooser.record(sum(self.fit_costs[c] for c in cids), seconds, shares, spare)
            if len(self.chooser.log) > changes:
                log.info(
                    "layout: %(workers)s worker(s) from fit %(fit)s (%(why)s)", self.chooser.log[-1]
                )
        return [results[c] for c in messages]

    def evaluate(
        self, round_num: int, messages: dict[int, Payload], receive: bool = True
    ) -> list[EvalResult]:
        table = MessageTable(messages)
        out: dict[int, dict[str, dict[str, int]]] = {}
        todo = []
        for cid in messages:
            hit = self.cache.get(cid, (self.version[cid], table.digest(cid), receive))
            if hit is None:
                todo.append(cid)
            else:
                out[cid] = hit
        groups = self._place(todo, self.eval_costs)
        calls = self._per_worker(groups, table, "eval", receive=receive)
        for part in self._call(calls).values():
            for cid, counts in part:
                out[cid] = counts
                self.cache.put(cid, (self.version[cid], table.digest(cid), receive), counts)
        return [EvalResult(c, out[c]) for c in messages]

    def finetune(self, messages: dict[int, Payload], phases: Sequence[Phase]) -> None:
        table = MessageTable(messages)
        groups = self._place(list(messages), self.fit_costs)
        calls = self._per_worker(
            groups, table, "finetune", phases=tuple(phases), offload=self.offload
        )
        done = 0

        def tuned(w: int, cid: int) -> None:  # a worker streams each client as it finishes
            nonlocal done
            done += 1
            if self._on_finetune is not None:
                self._on_finetune(done, len(messages))

        if self._on_finetune is not None:
            self._on_finetune(0, len(messages))
        # with offload, each client goes back to the store right after
        self._call(calls, tuned)
        for w, g in enumerate(groups):
            for cid in g:
                if self.offload:
                    self.holder.pop(cid, None)
                else:
                    self.holder[cid] = w
                self.version[cid] += 1

    # ---- client state (checkpoints, the trained models) ----------------------------------
    def set_progress(
        self, on_client: ClientProgress | None, on_finetune: ClientProgress | None = None
    ) -> None:
        """Report each fit's clients as their uploads arrive (the progress bar's per-client
        line), and the fine-tuning's as the workers finish them."""
        self._on_client = on_client
        self._on_finetune = on_finetune

    def client_states(self) -> Sequence[ClientState]:
        """Every client's (model, extras) state dicts, fetched from the workers
        ``STATE_BATCH`` clients at a time as the sequence is read (a checkpoint writer holds one
        batch, not the population); valid until :meth:`close`."""
        return _WorkerStates(self)

    def _fetch_states(self, cids: Sequence[int]) -> dict[int, ClientState]:
        groups = self._place(cids, self.eval_costs)
        got: dict[int, ClientState] = {}
        for part in self._call(
            {w: ("states", {"cids": g}) for w, g in enumerate(groups) if g}
        ).values():
            got.update(part)
        return got

    def load_client_states(self, states: Sequence[ClientState]) -> None:
        if len(states) != self.num_clients:
            raise ValueError(f"checkpoint has {len(states)} clients, this run {self.num_clients}")
        groups = self._place(range(self.num_clients), self.fit_costs)
        worker_of = {c: w for w, g in enumerate(groups) for c in g}
        # the same placement as one call, sent STATE_BATCH clients at a time (a lazy ``states``,
        # a checkpoint being read, is then never in memory whole)
        for lo in range(0, self.num_clients, STATE_BATCH):
            batch: dict[int, dict[int, ClientState]] = {}
            for c in range(lo, min(lo + STATE_BATCH, self.num_clients)):
                batch.setdefault(worker_of[c], {})[c] = states[c]
            self._call(
                {
                    w: ("set_states", {"states": part, "offload": self.offload})
                    for w, part in batch.items()
                }
            )
        for w, g in enumerate(groups):
            for cid in g:
                if self.offload:
                    self.holder.pop(cid, None)
                else:
                    self.holder[cid] = w
                self.version[cid] += 1
        self.cache.clear()

    # ---- measurements / shutdown -------------------------------------------------------------
    def peak_rss(self) -> list[int]:
        """Peak resident memory (VmHWM, bytes) of each worker."""
        got = self._call({w: ("rss", {}) for w in range(self.workers)})
        return [got[w] for w in range(self.workers)]

    def close(self) -> None:
        """Release the workers (back to the idle pool when ``reuse``) and delete the store."""
        for w in self.procs:
            pooled = False
            if self.reuse and self._clean and w.alive():
                try:
                    send(w.conn, ("reset", {}))
                    status, _ = recv(w.conn)
                    pooled = status == "ok"
                except (EOFError, OSError):
                    pooled = False
            if pooled:
                _POOL.append(w)
            else:
                w.stop()
        self.procs, self.conns = [], []
        self.store.close()
        Path(self._images_path).unlink(missing_ok=True)


STATE_BATCH = 32  # clients per fetch or load of client states (bounds a checkpoint's memory)


class _WorkerStates(LazyClientStates):
    """The workers' clients' state dicts, fetched a batch at a time when indexed (in order: one
    fetch per ``STATE_BATCH`` clients; only the current batch is kept)."""

    def __init__(self, transport: ProcessTransport) -> None:
        self.transport = transport
        self.n = transport.num_clients
        self.batch: dict[int, ClientState] = {}

    def get(self, cid: int) -> ClientState:
        if cid not in self.batch:
            lo = cid - cid % STATE_BATCH
            self.batch = {}  # the previous batch is dropped before the next arrives
            self.batch = self.transport._fetch_states(range(lo, min(lo + STATE_BATCH, self.n)))
        return self.batch[cid]
