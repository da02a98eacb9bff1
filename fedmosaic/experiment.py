"""Run one experiment on the in-process simulator: orchestration only.

The federation is assembled by ``federation.py``, the backend chosen by ``sim/backend.py``, the
round loop is ``core.rounds.run_rounds``, checkpoints are ``checkpoint.py``'s and the
``results.json`` document is ``report/summary.py``'s; this module wires them together around the
run's threads, progress display and timing.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

from fedmosaic import kernels, numerics, provenance
from fedmosaic.checkpoint import Checkpointer, CheckpointPolicy, for_federation, peek
from fedmosaic.config import ConfigError, ExperimentConfig
from fedmosaic.core.rounds import Transport, run_rounds
from fedmosaic.federation import Federation, add_clients, build_federation
from fedmosaic.report.summary import FinetuneLines, results_document, round_line
from fedmosaic.sim.backend import Runtime, make_transport, resolve_runtime
from fedmosaic.sim.processes import ProcessTransport

log = logging.getLogger("fedmosaic")

# Names that user code and the tests import from here.
__all__ = ["Federation", "build_federation", "make_transport", "run_experiment"]


@dataclass
class Trained:
    """What a finished run leaves besides its results document (filled by the round loop when
    a caller passes one): the final server state and the federation, and either the trained
    client modules themselves (``models``, ``extras``: the serial backend trained them in this
    process) or each client's final state (``clients``: they lived in workers or a state
    store)."""

    state: Any = None
    fed: Federation | None = None
    models: list[Any] | None = None
    extras: list[Any] | None = None
    clients: list[Any] | None = None


def run_experiment(
    cfg: ExperimentConfig,
    progress: bool | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    checkpoint: CheckpointPolicy | None = None,
    trained: Trained | None = None,
) -> dict[str, Any]:
    """Run one experiment on the simulator and return the ``results.json`` document.

    ``trained`` (:class:`Trained`, filled in place) receives the final server state and the
    federation, and either the trained client modules themselves (the serial backend's, in
    memory) or every client's final (model, extras) state dicts (clients that lived in worker
    processes or a state store).

    ``checkpoint`` (:class:`~fedmosaic.checkpoint.CheckpointPolicy`): where and how often the
    run saves ``checkpoint.safetensors``, whether it continues from it (``resume``, ``extend``)
    and keeps the state after the last round (``keep_final``); None: no checkpoint.
    """
    start = time.perf_counter()
    started = provenance.now()
    try:  # before any arithmetic: a portable cell made natively would be mislabelled
        numerics.check(cfg.sim.numerics)
    except numerics.NumericsError as exc:
        raise ConfigError(str(exc)) from exc
    kernels.load()  # decided (and logged) here once: workers load the same extension
    threads = torch.get_num_threads()
    asked = cfg.sim.threads
    if asked == "auto" or (isinstance(asked, int) and asked > 0):  # before data and models
        torch.set_num_threads(asked if isinstance(asked, int) else 1)
    try:
        fed = build_federation(cfg, with_clients=False)
        runtime = resolve_runtime(fed)
        if runtime.threads > 0:
            torch.set_num_threads(runtime.threads)
        if runtime.backend == "serial":  # the clients train in this process: built here, once
            fed = add_clients(fed, offload=None)
        if cfg.sim.backend == "auto":
            log.info("sim.backend = auto: %s (%s)", _runtime_words(runtime), runtime.why)
        transport = make_transport(fed, runtime)
        # With a folder but no interval the hook only writes when the run is interrupted.
        ckpt = None if checkpoint is None else for_federation(fed, transport, checkpoint)
        history = _rounds(fed, transport, ckpt, progress, on_round, trained)
        doc = results_document(
            cfg,
            fed.data,
            fed.clients,
            fed.spec.members,
            history,
            time.perf_counter() - start,
            started,
            runtime.workers,
        )
        # The config keeps what was asked ("auto"): the resolution does not change the numbers,
        # so it is not part of the run's identity; it is recorded beside the worker count.
        doc["provenance"]["runtime"] = runtime.to_dict()
        if isinstance(transport, ProcessTransport) and transport.chooser is not None:
            # every layout decision the measurements made (fit number, workers, why)
            doc["provenance"]["runtime"]["layouts"] = list(transport.chooser.log)
        return doc
    finally:
        torch.set_num_threads(threads)


def _runtime_words(rt: Runtime) -> str:
    if rt.backend == "serial":
        return f"serial, {rt.threads or 'torch default'} thread(s)"
    measured = ", how many train a round measured between rounds" if rt.adaptive else ""
    return f"processes, {rt.workers} worker(s) of one thread each{measured}"


def _rounds(
    fed: Federation,
    transport: Transport,
    ckpt: Checkpointer | None,
    progress: bool | None,
    on_round: Callable[[dict[str, Any]], None] | None,
    trained: Trained | None = None,
) -> Any:
    """The round loop with a progress bar (on a terminal) or one log line per round."""
    cfg = fed.cfg
    name = cfg.algorithm["name"]
    show = cfg.sim.progress if progress is None else progress
    stream = sys.stderr
    bar = None
    if show and stream.isatty():  # a bar's carriage returns would fill a log file
        done = 0
        if ckpt is not None and ckpt.resume and ckpt.path.exists():
            done = int(peek(ckpt.path)["round"])
        bar = RoundBar(name, cfg.train.rounds, stream, done)
        transport.set_progress(bar.clients, bar.finetune)
    elif show:  # the fine-tuning after the rounds: a line per tenth of the clients
        transport.set_progress(None, FinetuneLines(name, log.info))

    def tick(rec: dict[str, Any]) -> None:
        if bar is not None:
            bar.round_done(rec)
        elif show:
            log.info("%s", round_line(name, rec, cfg.train.rounds))
        if on_round is not None:
            on_round(rec)

    try:
        history, state = run_rounds(fed.algo, fed.spec, transport, fed.plan, tick, checkpoint=ckpt)
        if trained is not None:
            trained.state, trained.fed = state, fed
            if fed.models:  # the serial backend trained these very modules: no copy needed
                trained.models, trained.extras = fed.models, fed.extras
            else:  # before the workers (which hold the clients) are closed
                trained.clients = list(transport.client_states())
    finally:
        if bar is not None:
            bar.close()
        transport.close()
    return history


class RoundBar:
    """The terminal's progress bar: rounds done, and inside a round the clients trained so far
    with an ETA for the round and for the run (a round with 100-s clients shows life)."""

    def __init__(self, name: str, rounds: int, stream: Any, done: int = 0) -> None:
        self.bar = tqdm(
            total=rounds,
            initial=done,
            desc=name,
            unit="round",
            file=stream,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} rounds [{elapsed}{postfix}]",
        )
        self.started = time.perf_counter()
        self.rounds: list[dict[str, Any]] = []  # this run's finished rounds (their timings)

    def clients(self, done: int, total: int) -> None:
        """``done`` of the round's ``total`` clients have trained (0: the round's fit starts)."""
        now = time.perf_counter()
        if done == 0:
            self.started = now
        n, total_rounds = self.bar.n, self.bar.total
        where = f"round {n + 1}" if n < total_rounds else "after the last round"
        text = f"{where}: clients {done}/{total}"
        if done > 0:
            per_client = (now - self.started) / done
            # after training: aggregation and evaluation, as long as in the rounds so far
            rest = _mean([r["seconds"] - r.get("seconds_train", r["seconds"]) for r in self.rounds])
            round_eta = per_client * (total - done) + rest
            per_round = _mean([r["seconds"] for r in self.rounds]) or per_client * total
            run_eta = round_eta + max(total_rounds - n - 1, 0) * per_round
            fmt = tqdm.format_interval
            text += f", round ETA {fmt(round_eta)}, run ETA {fmt(run_eta)}"
        self.bar.set_postfix_str(text)

    def finetune(self, done: int, total: int) -> None:
        """``done`` of the ``total`` clients have fine-tuned (0: the fine-tuning starts)."""
        now = time.perf_counter()
        if done == 0:
            self.started = now
        text = f"fine-tune: clients {done}/{total}"
        if done > 0:
            eta = (now - self.started) / done * (total - done)
            text += f", ETA {tqdm.format_interval(eta)}"
        self.bar.set_postfix_str(text)

    def round_done(self, rec: dict[str, Any]) -> None:
        self.rounds.append(rec)
        post = {"acc": f"{100 * rec['acc_weighted']:.2f}%"} if "acc_weighted" in rec else {}
        if "epsilon" in rec:  # [privacy]: the budget spent so far
            post["eps"] = f"{rec['epsilon']:.3g}"
        if "mia_auc" in rec:  # eval.membership: the attack's AUC on the evaluated models
            post["auc"] = f"{rec['mia_auc']:.3f}"
        self.bar.set_postfix(**post, s=f"{rec['seconds']:.1f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
