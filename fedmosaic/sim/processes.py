"""Worker-process backend: clients owned by persistent spawned workers, one torch thread each.

The dataset's uint8 images live in shared memory (passed to the workers once); each worker
rebuilds its own clients' models and extras from the config, exactly as the serial backend does
(per-client seeded streams), so results are bitwise identical for any worker count. Messages
travel as wire bytes, so bytes are measured on the real encoding and every payload is decoded
and validated on arrival.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Algorithm, Phase
from fedmosaic.core.payload import Payload, PayloadError, decode, encode
from fedmosaic.core.rounds import EvalResult, FitResult


def _tune_malloc() -> None:
    # Keep glibc from returning freed activations to the OS after every batch (measurable on CPU).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))


def _worker(conn: Any, cfg_dict: dict[str, Any], fed: Any, client_ids: list[int]) -> None:
    torch.set_num_threads(1)
    try:
        from fedmosaic.algorithms import build_algorithm
        from fedmosaic.config import from_dict
        from fedmosaic.core.training import TrainSettings
        from fedmosaic.experiment import client_data, make_client, make_spec

        cfg = from_dict(cfg_dict)
        algo = build_algorithm(cfg.algorithm)
        clients = client_data(fed, cfg.train.device)
        spec = make_spec(cfg, fed, clients)
        own = {cid: make_client(cfg, algo, spec, clients[cid]) for cid in client_ids}
        settings = TrainSettings.from_config(cfg.train)
        splits = ("test", "val") if any(c.num("val") for c in clients) else ("test",)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                return
            if cmd == "fit":
                round_num, msgs = args
                out = []
                for cid, blob in msgs.items():
                    model, extras = own[cid]
                    msg = decode(algo.Broadcast, blob)
                    res = client_ops.fit(
                        algo,
                        model,
                        extras,
                        msg,
                        clients[cid],
                        settings,
                        cfg.seed,
                        round_num,
                        cfg.train.local_epochs,
                    )
                    out.append((cid, encode(res.upload), res.num_examples, res.stats.mean_loss))
                conn.send(("ok", out))
            elif cmd == "eval":
                msgs, receive = args
                out = []
                for cid, blob in msgs.items():
                    model, extras = own[cid]
                    msg = decode(algo.Broadcast, blob)
                    counts = client_ops.evaluate(
                        algo,
                        model,
                        extras,
                        msg,
                        clients[cid],
                        splits,
                        settings.eval_batch_size,
                        receive=receive,
                    )
                    out.append((cid, counts))
                conn.send(("ok", out))
            elif cmd == "finetune":
                msgs, phases = args
                for cid, blob in msgs.items():
                    model, extras = own[cid]
                    client_ops.finetune(
                        algo,
                        model,
                        extras,
                        decode(algo.Broadcast, blob),
                        clients[cid],
                        settings,
                        cfg.seed,
                        phases,
                    )
                conn.send(("ok", None))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def balance(costs: Sequence[float], workers: int) -> list[list[int]]:
    """Largest-first greedy assignment of clients to the least-loaded worker."""
    loads = [0.0] * workers
    groups: list[list[int]] = [[] for _ in range(workers)]
    for cid in sorted(range(len(costs)), key=lambda c: (-costs[c], c)):
        w = min(range(workers), key=lambda i: (loads[i], i))
        groups[w].append(cid)
        loads[w] += costs[cid]
    return groups


class ProcessTransport:
    """Persistent worker processes, each owning a cost-balanced set of clients."""

    def __init__(
        self, algo: Algorithm, cfg: Any, fed: Any, costs: Sequence[float], workers: int
    ) -> None:
        _tune_malloc()
        self.algo = algo
        ctx = mp.get_context("spawn")
        self.groups = [g for g in balance(costs, workers) if g]
        self.owner = {cid: w for w, g in enumerate(self.groups) for cid in g}
        fed.dataset.images.share_memory_()
        self.conns = []
        self.procs = []
        for g in self.groups:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, cfg.to_dict(), fed, g), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            self._reply(c)

    @staticmethod
    def _reply(conn: Any) -> Any:
        status, value = conn.recv()
        if status == "error":
            raise RuntimeError(f"worker failed:\n{value}")
        return value

    def _scatter(self, cmd: str, msgs: dict[int, bytes], *extra: Any) -> list[Any]:
        per: list[dict[int, bytes]] = [{} for _ in self.conns]
        for cid, blob in msgs.items():
            per[self.owner[cid]][cid] = blob
        active = [w for w, m in enumerate(per) if m]
        for w in active:
            self.conns[w].send((cmd, (*extra, per[w]) if cmd == "fit" else (per[w], *extra)))
        return [self._reply(self.conns[w]) for w in active]

    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[FitResult]:
        blobs = {cid: encode(m) for cid, m in messages.items()}
        results: dict[int, FitResult] = {}
        for part in self._scatter("fit", blobs, round_num):
            for cid, blob, n, loss in part:
                res = FitResult(cid, None, n, len(blob), len(blobs[cid]), loss)
                try:
                    res.upload = decode(self.algo.Upload, blob)
                except PayloadError as exc:
                    res.error = str(exc)  # the round loop drops and logs it
                results[cid] = res
        return [results[c] for c in messages]

    def evaluate(
        self, round_num: int, messages: dict[int, Payload], receive: bool = True
    ) -> list[EvalResult]:
        blobs = {cid: encode(m) for cid, m in messages.items()}
        out = {
            cid: counts for part in self._scatter("eval", blobs, receive) for cid, counts in part
        }
        return [EvalResult(c, out[c]) for c in messages]

    def finetune(self, messages: dict[int, Payload], phases: Sequence[Phase]) -> None:
        blobs = {cid: encode(m) for cid, m in messages.items()}
        self._scatter("finetune", blobs, tuple(phases))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
