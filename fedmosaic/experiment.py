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
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fedmosaic import kernels, provenance
from fedmosaic.checkpoint import Checkpointer, for_federation, peek
from fedmosaic.config import ExperimentConfig
from fedmosaic.core.rounds import Transport, run_rounds
from fedmosaic.federation import Federation, build_federation
from fedmosaic.report.summary import results_document, round_line
from fedmosaic.sim.backend import make_transport, workers

log = logging.getLogger("fedmosaic")

# Names that user code and the tests import from here.
__all__ = ["Federation", "build_federation", "make_transport", "run_experiment"]


def run_experiment(
    cfg: ExperimentConfig,
    progress: bool | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    keep_final: bool = False,
    extend: bool = False,
    trained: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one experiment on the simulator and return the ``results.json`` document.

    ``trained`` (a dict, filled in place) receives the final server state (``"state"``), every
    client's final model and extras state dicts (``"clients"``) and the federation (``"fed"``).

    ``checkpoint_every=K`` writes ``checkpoint_dir/checkpoint.safetensors`` every K rounds and
    after the last one; ``resume`` continues from that file when it exists (see
    ``fedmosaic.checkpoint``). ``keep_final`` also writes it after the last round (the trained
    server state and client models); ``extend`` lets ``resume`` continue a finished run whose
    config differs only in ``train.rounds`` (more rounds now).
    """
    start = time.perf_counter()
    started = provenance.now()
    kernels.load()  # decided (and logged) here once: workers load the same extension
    threads = torch.get_num_threads()
    if cfg.sim.threads > 0:
        torch.set_num_threads(cfg.sim.threads)
    try:
        fed = build_federation(cfg, with_clients=cfg.sim.backend == "serial", offload=None)
        if cfg.sim.backend == "processes" and cfg.sim.threads == 0:
            # The workers own the cores. The server's own steps (FedTGP's prototype training,
            # FedGen's generator, KT-pFL's coefficients) are small ops: on one thread they give
            # exactly the numbers of the serial backend run with sim.threads = 1, at about the
            # same speed (FedTGP's 100 server epochs: 2.15 s vs 1.89 s on two threads).
            torch.set_num_threads(1)
        transport = make_transport(fed)
        ckpt = None
        if checkpoint_every > 0 or resume or checkpoint_dir is not None:
            # With a folder but no interval the hook only writes when the run is interrupted.
            ckpt = for_federation(
                fed, transport, checkpoint_dir, checkpoint_every, resume, keep_final, extend
            )
        history = _rounds(fed, transport, ckpt, progress, on_round, trained)
        return results_document(fed, history, time.perf_counter() - start, started, workers(fed))
    finally:
        torch.set_num_threads(threads)


def _rounds(
    fed: Federation,
    transport: Transport,
    ckpt: Checkpointer | None,
    progress: bool | None,
    on_round: Callable[[dict[str, Any]], None] | None,
    trained: dict[str, Any] | None = None,
) -> Any:
    """The round loop with a progress bar (on a terminal) or one log line per round."""
    cfg = fed.cfg
    name = cfg.algorithm["name"]
    show = cfg.sim.progress if progress is None else progress
    bar = None
    if show and sys.stderr.isatty():  # a bar's carriage returns would fill a log file
        bar = tqdm(total=cfg.train.rounds, desc=name, unit="round")

    def tick(rec: dict[str, Any]) -> None:
        if bar is not None:
            bar.update(1)
            if "acc_weighted" in rec:
                bar.set_postfix(acc=f"{100 * rec['acc_weighted']:.2f}%", s=f"{rec['seconds']:.1f}")
        elif show:
            log.info("%s", round_line(name, rec, cfg.train.rounds))
        if on_round is not None:
            on_round(rec)

    try:
        if ckpt is not None and bar is not None and ckpt.resume and ckpt.path.exists():
            bar.update(int(peek(ckpt.path)["round"]))
        history, state = run_rounds(fed.algo, fed.spec, transport, fed.plan, tick, checkpoint=ckpt)
        if trained is not None:  # before the workers (which hold the clients) are closed
            trained.update(state=state, clients=_client_states(fed, transport), fed=fed)
    finally:
        if bar is not None:
            bar.close()
        close = getattr(transport, "close", None)
        if close is not None:
            close()
    return history


def _client_states(fed: Federation, transport: Transport) -> list[tuple[dict, dict]]:
    """Every client's (model, extras) state dicts, wherever the backend keeps them (read out
    before the transport closes)."""
    return list(transport.client_states())  # type: ignore[attr-defined]
