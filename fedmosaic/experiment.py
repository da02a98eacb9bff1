"""Build a federation from a config and run it on the in-process simulator."""

from __future__ import annotations

import logging
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fedmosaic
from fedmosaic import provenance
from fedmosaic.algorithms import build_algorithm
from fedmosaic.config import ConfigError, ExperimentConfig
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.rounds import (
    EvalResult,
    History,
    RoundPlan,
    clients_per_round,
    holdout_clients,
    per_client_acc,
    run_rounds,
)
from fedmosaic.core.training import TrainSettings
from fedmosaic.data import FederatedData, build_federated_data
from fedmosaic.models import build_client_model, family_members

log = logging.getLogger("fedmosaic")


@dataclass
class Federation:
    """Everything a runtime needs: data, per-client models/extras, spec, algorithm."""

    cfg: ExperimentConfig
    fed: FederatedData
    algo: Algorithm
    spec: FederationSpec
    clients: list[ClientData]
    models: list[ClientModel]
    extras: list[nn.Module]
    settings: TrainSettings
    plan: RoundPlan


def model_projection(cfg: ExperimentConfig) -> str:
    """The projection of every client model: the method's own (``Algorithm.model_projection``;
    FedHeNN keeps natural widths) or ``model.projection``."""
    name = cfg.algorithm.get("name")
    fixed = ALGORITHMS.get(name).model_projection if name in ALGORITHMS else None
    return fixed or cfg.model.projection


def model_builder(cfg: ExperimentConfig, fed: FederatedData) -> Callable[[int], ClientModel]:
    members = family_members(cfg.model.family)
    projection = model_projection(cfg)

    def build(client_id: int) -> ClientModel:
        # Each client's initial weights come from its own stream: same seed, same model.
        seeding.seed_torch(cfg.seed, 0, client_id, "init")
        return build_client_model(
            members[client_id % len(members)],
            fed.input_shape,
            fed.num_classes,
            cfg.model.feature_dim,
            projection=projection,
        ).to(cfg.train.device)

    return build


def client_data(fed: FederatedData, device: str) -> list[ClientData]:
    out = []
    for cid, split in enumerate(fed.clients):
        splits = {"train": split.train, "test": split.test}
        if split.val.numel() > 0:
            splits["val"] = split.val
        out.append(ClientData(cid, fed, fed.dataset.labels, splits, fed.num_classes, device))
    return out


def make_spec(
    cfg: ExperimentConfig, fed: FederatedData, clients: list[ClientData]
) -> FederationSpec:
    members = family_members(cfg.model.family)
    n = fed.num_clients
    public = None
    if fed.public.numel() > 0:
        public = fed.batch(fed.public, "cpu")  # [P, C, H, W] normalized, server-held
    return FederationSpec(
        num_clients=n,
        num_classes=fed.num_classes,
        feature_dim=cfg.model.feature_dim,
        input_shape=tuple(fed.input_shape),
        members=tuple(members[i % len(members)] for i in range(n)),
        num_train=tuple(c.num_train for c in clients),
        seed=cfg.seed,
        rounds=cfg.train.rounds,
        build_model=model_builder(cfg, fed),
        public=public,
        device=cfg.train.device,
        projection=model_projection(cfg),
    )


def make_client(
    cfg: ExperimentConfig, algo: Algorithm, spec: FederationSpec, data: ClientData
) -> tuple[ClientModel, nn.Module]:
    """A client's initial model and extras: a pure function of (config, seed, client id)."""
    model = spec.build_model(data.client_id)
    seeding.seed_torch(cfg.seed, 0, data.client_id, "init-extras")
    extras = algo.init_client(model, spec, data).to(cfg.train.device)
    return model, extras


def build_federation(cfg: ExperimentConfig, with_clients: bool = True) -> Federation:
    """Load data, build the algorithm and (unless a worker backend owns them) every client."""
    if cfg.train.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device = {cfg.train.device!r} but CUDA is not available")
    if cfg.sim.threads > 0:
        torch.set_num_threads(cfg.sim.threads)
    algo = build_algorithm(cfg.algorithm)
    fed = build_federated_data(cfg.data, cfg.seed)
    clients = client_data(fed, cfg.train.device)
    spec = make_spec(cfg, fed, clients)
    models: list[ClientModel] = []
    extras: list[nn.Module] = []
    if with_clients:
        for c in clients:
            m, e = make_client(cfg, algo, spec, c)
            models.append(m)
            extras.append(e)
    n = fed.num_clients
    holdout = holdout_clients(cfg.seed, n, cfg.eval.holdout_clients)
    trainers = n - len(holdout)
    k = min(cfg.train.clients_per_round, trainers) or clients_per_round(
        trainers, cfg.train.participation
    )
    plan = RoundPlan(
        n,
        cfg.train.rounds,
        k,
        cfg.train.eval_every,
        cfg.train.finetune_epochs,
        holdout=holdout,
        plateau_delta=cfg.train.plateau_delta,
        plateau_window=cfg.train.plateau_window,
        plateau_min_rounds=cfg.train.plateau_min_rounds,
    )
    return Federation(
        cfg, fed, algo, spec, clients, models, extras, TrainSettings.from_config(cfg.train), plan
    )


def summarize(history: History, fed: Federation) -> dict[str, Any]:
    """Final, best-on-validation and best-on-test (as the papers report it) accuracies."""
    rounds = [r for r in history.rounds if "acc_weighted" in r]
    summary: dict[str, Any] = {}
    if not rounds:
        return summary
    last = rounds[-1]
    summary["final"] = {k: last[k] for k in last if k.startswith("acc") or k.endswith("_weighted")}
    summary["final"]["round"] = last["round"]
    summary["rounds_run"] = int(history.rounds[-1]["round"])
    if history.rounds[-1].get("plateau"):
        # train.plateau_delta: the run stopped before its cap (train.rounds) on a plateau
        summary["stopped_on_plateau"] = summary["rounds_run"]
    best_test = max(rounds, key=lambda r: r["acc_weighted"])
    summary["best_on_test"] = {
        "note": "max over evaluated rounds of test accuracy, as the papers report it",
        "round": best_test["round"],
        "acc_weighted": best_test["acc_weighted"],
        "acc_mean": best_test["acc_mean"],
    }
    if "val_acc_weighted" in last:
        best_val = max(rounds, key=lambda r: r["val_acc_weighted"])
        summary["best_on_val"] = {
            "note": "test accuracy at the round with the best validation accuracy",
            "round": best_val["round"],
            "val_acc_weighted": best_val["val_acc_weighted"],
            "acc_weighted": best_val["acc_weighted"],
            "acc_mean": best_val["acc_mean"],
        }
    secs = [r["seconds"] for r in history.rounds]
    summary["seconds_per_round"] = sum(secs) / len(secs)
    summary["bytes_up_per_client_per_round"] = sum(
        r["bytes_up_per_client"] for r in history.rounds
    ) / len(history.rounds)
    summary["bytes_down_per_client_per_round"] = sum(
        r["bytes_down_per_client"] for r in history.rounds
    ) / len(history.rounds)
    for key in ("paper_cost", "train_macs"):
        if any(key in r for r in history.rounds):
            # Training compute summed over clients and rounds: ``paper_cost`` is the layer-expansion
            # paper's Table 4 measure (trainable parameters x examples, which it calls FLOPs),
            # ``train_macs`` the forward + backward multiply-accumulates (``algorithms/_flops.py``).
            summary[f"{key}_total"] = sum(r.get(key, 0) for r in history.rounds)
    if history.finetune_eval:
        from fedmosaic.core.rounds import summarize_eval

        summary["after_finetune"] = summarize_eval(history.finetune_eval)
    if history.holdout_before:
        from fedmosaic.core.rounds import summarize_eval

        summary["holdout"] = {
            "note": "clients that never trained: on the final broadcast (before) and after one "
            "local round of the method's own client procedure (after)",
            "clients": sorted(r.client_id for r in history.holdout_before),
            "before": summarize_eval(history.holdout_before),
            "after": summarize_eval(history.holdout_after),
        }
    return summary


def client_records(fed: Federation, history: History) -> list[dict[str, Any]]:
    final = {r.client_id: r for r in history.final_eval}
    tuned = {r.client_id: r for r in history.finetune_eval}
    held_before = {r.client_id: r for r in history.holdout_before}
    held_after = {r.client_id: r for r in history.holdout_after}
    recs = []
    for c in fed.clients:
        rec: dict[str, Any] = {
            "client_id": c.client_id,
            "arch": fed.spec.members[c.client_id],
            "num_train": c.num_train,
            "num_val": c.num("val"),
            "num_test": c.num("test"),
            "train_label_counts": c.class_counts("train").tolist(),
            "test_label_counts": c.class_counts("test").tolist(),
        }
        if fed.fed.shifts:  # feature shift: this client's transform (data.shift_*)
            rec["feature_shift"] = fed.fed.shifts[c.client_id]
        if c.client_id in final:
            rec.update(_client_accs(final[c.client_id], ""))
        if c.client_id in tuned:
            rec.update(_client_accs(tuned[c.client_id], "finetuned_"))
        if c.client_id in held_before:
            rec["holdout"] = True
            rec.update(_client_accs(held_before[c.client_id], "newcomer_before_"))
            rec.update(_client_accs(held_after[c.client_id], "newcomer_after_"))
        recs.append(rec)
    return recs


def _client_accs(r: EvalResult, prefix: str) -> dict[str, float]:
    out = {}
    for split, counts in r.counts.items():
        n = counts.get("n", 0)
        for mode, correct in counts.items():
            if mode == "n":
                continue
            key = mode if split == "test" else f"{split}_{mode}"
            out[prefix + key] = correct / n if n else math.nan
    return out


def member_flops(fed: Federation) -> list[float]:
    """Forward FLOPs per image of each client's model (one model built per family member)."""
    from fedmosaic.models import flops_per_image

    per_member: dict[str, float] = {}
    out = []
    for c in fed.clients:
        member = fed.spec.members[c.client_id]
        if member not in per_member:
            with torch.random.fork_rng(devices=[]):
                model = fed.spec.build_model(c.client_id)
            per_member[member] = float(flops_per_image(model, fed.spec.input_shape))
        out.append(per_member[member])
    return out


def client_costs(fed: Federation, flops: list[float] | None = None) -> list[float]:
    """Estimated training cost per client: forward FLOPs per image x training examples."""
    flops = member_flops(fed) if flops is None else flops
    return [f * max(c.num_train, 1) for f, c in zip(flops, fed.clients)]


def eval_costs(fed: Federation, flops: list[float] | None = None) -> list[float]:
    """Estimated evaluation cost per client: forward FLOPs per image x test (+ val) examples."""
    flops = member_flops(fed) if flops is None else flops
    return [f * max(c.num("test") + c.num("val"), 1) for f, c in zip(flops, fed.clients)]


def default_workers() -> int:
    """The CPU cores this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def make_transport(fed: Federation) -> Any:
    """The simulator backend chosen by ``[sim] backend``.

    ``processes``: ``sim.workers`` worker processes (0 = one per core), clients balanced by cost;
    with partial participation, clients not training this round are kept in an on-disk state store
    (memory scales with the round's clients, not the population).
    """
    cfg = fed.cfg
    splits = ("test", "val") if any(c.num("val") for c in fed.clients) else ("test",)
    if cfg.sim.backend == "processes":
        from fedmosaic.sim.processes import ProcessTransport

        flops = member_flops(fed)
        return ProcessTransport(
            fed.algo,
            cfg,
            fed.fed,
            client_costs(fed, flops),
            cfg.sim.workers or default_workers(),
            eval_costs=eval_costs(fed, flops),
            eval_splits=splits,
            offload=fed.plan.clients_per_round < fed.plan.num_clients,
        )
    from fedmosaic.sim.simulator import SimTransport

    return SimTransport(
        fed.algo,
        fed.models,
        fed.extras,
        fed.clients,
        fed.settings,
        cfg.seed,
        cfg.train.local_epochs,
        check_wire=cfg.sim.check_wire,
        eval_splits=splits,
    )


def make_checkpointer(
    fed: Federation,
    transport: Any,
    checkpoint_dir: str | Path | None,
    every: int,
    resume: bool,
    keep_final: bool = False,
    extend: bool = False,
) -> Any:
    """The round loop's checkpoint hook, with access to every client's persistent state."""
    from fedmosaic.checkpoint import FILENAME, Checkpointer

    if checkpoint_dir is None:
        raise ConfigError("checkpointing needs an output folder (checkpoint_dir)")
    if fed.models:  # serial backend: the clients live in this process
        models, extras = fed.models, fed.extras

        def get_clients() -> list[tuple[dict, dict]]:
            return [(m.state_dict(), e.state_dict()) for m, e in zip(models, extras)]

        def set_clients(states: list[tuple[dict, dict]]) -> None:
            if len(states) != len(models):
                raise ValueError(f"checkpoint has {len(states)} clients, this run {len(models)}")
            for cid, (m, e) in enumerate(zip(models, extras)):
                try:
                    m.load_state_dict(states[cid][0], strict=True)
                    e.load_state_dict(states[cid][1], strict=True)
                except RuntimeError as exc:
                    raise ValueError(f"client {cid}: {exc}") from exc

    elif hasattr(transport, "client_states") and hasattr(transport, "load_client_states"):
        get_clients, set_clients = transport.client_states, transport.load_client_states
    else:
        raise ConfigError(
            f"sim.backend = {fed.cfg.sim.backend!r} cannot checkpoint client state yet; "
            'use sim.backend = "serial" with --checkpoint-every/--resume'
        )
    return Checkpointer(
        Path(checkpoint_dir) / FILENAME,
        every,
        fed.cfg.to_dict(),
        get_clients,
        set_clients,
        resume=resume,
        last_round=fed.plan.rounds,
        keep_final=keep_final,
        extend=extend,
    )


def run_experiment(
    cfg: ExperimentConfig,
    progress: bool | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    keep_final: bool = False,
    extend: bool = False,
) -> dict[str, Any]:
    """Run one experiment on the simulator and return the ``results.json`` document.

    ``checkpoint_every=K`` writes ``checkpoint_dir/checkpoint.safetensors`` every K rounds and
    after the last one; ``resume`` continues from that file when it exists (see
    ``fedmosaic.checkpoint``). ``keep_final`` also writes it after the last round (the trained
    server state and client models); ``extend`` lets ``resume`` continue a finished run whose
    config differs only in ``train.rounds`` (more rounds now).
    """

    start = time.perf_counter()
    started = provenance.now()
    from fedmosaic import kernels

    kernels.load()  # decided (and logged) here once: workers load the same extension
    fed = build_federation(cfg, with_clients=cfg.sim.backend == "serial")
    threads = torch.get_num_threads()
    if cfg.sim.backend == "processes" and cfg.sim.threads == 0:
        # The workers own the cores. The server's own steps (FedTGP's prototype training, FedGen's
        # generator, KT-pFL's coefficients) are small ops: on one thread they give exactly the
        # numbers of the serial backend run with sim.threads = 1, at about the same speed
        # (FedTGP's 100 server epochs: 2.15 s vs 1.89 s on two threads).
        torch.set_num_threads(1)
    try:
        return _run(
            fed,
            cfg,
            start,
            started,
            progress,
            on_round,
            checkpoint_dir,
            checkpoint_every,
            resume,
            keep_final,
            extend,
        )
    finally:
        torch.set_num_threads(threads)


def _run(
    fed: Federation,
    cfg: ExperimentConfig,
    start: float,
    started: str,
    progress: bool | None,
    on_round: Callable[[dict[str, Any]], None] | None,
    checkpoint_dir: str | Path | None,
    checkpoint_every: int,
    resume: bool,
    keep_final: bool = False,
    extend: bool = False,
) -> dict[str, Any]:
    transport = make_transport(fed)
    ckpt = None
    if checkpoint_every > 0 or resume or checkpoint_dir is not None:
        # With a folder but no interval the hook only writes when the run is interrupted.
        ckpt = make_checkpointer(
            fed, transport, checkpoint_dir, checkpoint_every, resume, keep_final, extend
        )
    show = cfg.sim.progress if progress is None else progress
    bar = None
    if show and sys.stderr.isatty():  # a bar's carriage returns would fill a log file
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.rounds, desc=cfg.algorithm["name"], unit="round")

    def tick(rec: dict[str, Any]) -> None:
        if bar is not None:
            bar.update(1)
            if "acc_weighted" in rec:
                bar.set_postfix(acc=f"{rec['acc_weighted']:.4f}", s=f"{rec['seconds']:.1f}")
        elif show:
            log.info("%s", round_line(cfg.algorithm["name"], rec, cfg.train.rounds))
        if on_round is not None:
            on_round(rec)

    try:
        if ckpt is not None and bar is not None and resume:
            from fedmosaic.checkpoint import peek

            if ckpt.path.exists():
                bar.update(int(peek(ckpt.path)["round"]))
        history, _ = run_rounds(fed.algo, fed.spec, transport, fed.plan, tick, checkpoint=ckpt)
    finally:
        if bar is not None:
            bar.close()
        if hasattr(transport, "close"):
            transport.close()
    workers = 1
    if cfg.sim.backend == "processes":
        workers = cfg.sim.workers or default_workers()
    return results_document(fed, history, time.perf_counter() - start, started, workers)


def round_line(name: str, rec: dict[str, Any], rounds: int) -> str:
    """One log line per round (when no progress bar is shown): accuracy, loss, time, bytes."""
    acc = f"acc {100 * rec['acc_weighted']:.2f}%" if "acc_weighted" in rec else "acc -"
    loss = rec.get("train_loss", math.nan)
    return (
        f"{name} round {rec['round']}/{rounds}: {acc}, loss {loss:.4f}, {rec['seconds']:.1f} s, "
        f"up {rec['bytes_up_per_client'] / 1e3:.1f} KB/client, "
        f"down {rec['bytes_down_per_client'] / 1e3:.1f} KB/client"
        + (f", rejected {rec['rejected']}" if rec.get("rejected") else "")
    )


def results_document(
    fed: Federation,
    history: History,
    wall_seconds: float,
    started: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document of a finished run (any runtime)."""
    cfg = fed.cfg
    ds = fed.fed.dataset
    return {
        "library": {"name": "fedmosaic", "version": fedmosaic.__version__},
        "environment": {"python": platform.python_version(), "torch": torch.__version__},
        "seed": cfg.seed,
        "config": cfg.to_dict(),
        "rounds": history.rounds,
        "clients": client_records(fed, history),
        "per_client_final_acc": per_client_acc(history.final_eval),
        "summary": summarize(history, fed),
        "wall_seconds": wall_seconds,
        "provenance": provenance.provenance(ds.sources, ds.images, ds.labels, started, workers),
    }
