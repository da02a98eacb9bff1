"""The public API for writing your own method, model or dataset (stable across versions).

Everything a plugin needs is importable from here; modules starting with ``_`` and names not
listed below are internal. A plugin is a module or ``.py`` file named in the config's top-level
``plugins = [...]``; it is imported before names are looked up, in this process, in every
simulator worker and in the Flower apps::

    # my_method.py
    from dataclasses import dataclass
    from fedmosaic.api import ALGORITHMS, SharedWeights

    @ALGORITHMS.register("fedavg_plus")
    @dataclass(frozen=True)
    class FedAvgPlus(SharedWeights):
        ...

    # my.toml
    plugins = ["my_method.py"]
    [algorithm]
    name = "fedavg_plus"

Contracts: ``Algorithm`` (server half: ``init_server``, ``broadcast``, ``aggregate``,
``upload_names`` for its Upload's declared schema and guard roles; client half: ``init_client``, ``receive``, ``phases``, ``loss``, ``upload``,
``predict``), payloads are frozen ``Payload`` dataclasses of tensors/state dicts/scalars, and
``SharedWeights`` is the average-a-part base of FedAvg/FedPer/FedRep/... (``shared`` = a part,
``aggregate`` overridable; see ``fedmosaic/algorithms/fedopt.py`` for server optimizers on it).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmosaic.algorithms._shared import (
    SharedState,
    SharedWeights,
    check_state_like,
    class_means,
    weighted_average,
)
from fedmosaic.checkpoint import (
    FINAL_FILE,
    CheckpointError,
    check_meta,
    for_models,
    verify_file,
)
from fedmosaic.config import (
    Config,
    ConfigError,
    ExperimentConfig,
    experiment_config,
    from_dict,
    load,
    resolve_plugin,
)
from fedmosaic.core import schema  # declared upload schemas: schema.check(upload, cid, ...)
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Phase, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Empty, Payload, PayloadError
from fedmosaic.core.registry import ALGORITHMS, DATASETS, ENCODERS, FAMILIES, PARTITIONERS
from fedmosaic.data import DatasetError, ImageDataset, PartitionError
from fedmosaic.experiment import Trained, run_experiment
from fedmosaic.federation import Federation, build_federation, make_client
from fedmosaic.runfolder import RunFolder, RunFolderError, RunOptions, read_results

log = logging.getLogger("fedmosaic")


@dataclass
class Result:
    """A finished run: its results document, final server state and trained client models.

    Reads like ``results.json`` too: ``result["rounds"]``, ``result["summary"]``, ...
    """

    document: dict[str, Any]  # what results.json holds
    config: ExperimentConfig
    server_state: Any  # the algorithm's server state after the last round
    # client i's trained model (eval mode) as the final evaluation saw it: after receiving the
    # last broadcast, or after the method's fine-tuning (``load_run``: the file is written
    # after the last round, before any fine-tuning)
    models: list[ClientModel]
    extras: list[nn.Module]  # client i's extras (the algorithm's per-client state)
    rounds_done: int = 0
    out: Path | None = None  # the run folder written (``run(..., out=...)``), else None

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return self.document["rounds"]

    @property
    def clients(self) -> list[dict[str, Any]]:
        return self.document["clients"]

    @property
    def summary(self) -> dict[str, Any]:
        return self.document["summary"]

    def __getitem__(self, key: str) -> Any:
        return self.document[key]


def _trained_clients(
    fed: Federation, states: list[tuple[dict, dict]], server_state: Any, done: int, receive: bool
) -> tuple[list, list]:
    """Fresh client models and extras of ``fed`` holding ``states`` (nothing shared with a run),
    as the final evaluation saw them: with ``receive``, after taking the broadcast that followed
    round ``done`` (the global parts: FedAvg's global model, LG-FedAvg's global head, ...)."""
    models, extras = [], []
    for c, (model_state, extras_state) in zip(fed.clients, states, strict=True):
        model, extra = make_client(fed.cfg, fed.algo, fed.spec, c)
        model.load_state_dict(model_state, strict=True)
        extra.load_state_dict(extras_state, strict=True)
        models.append(model)
        extras.append(extra)
    return _as_evaluated(fed, models, extras, server_state, done, receive)


def _as_evaluated(
    fed: Federation, models: list, extras: list, server_state: Any, done: int, receive: bool
) -> tuple[list, list]:
    """``models``/``extras`` in eval mode, after the broadcast that followed round ``done`` when
    ``receive`` (what the final evaluation saw)."""
    for c, model, extra in zip(fed.clients, models, extras, strict=True):
        if receive:
            fed.algo.receive(model, extra, fed.algo.broadcast(server_state, c.client_id, done + 1))
        model.eval()
        extra.eval()
    return models, extras


@dataclass(frozen=True)
class RoundRecord:
    """One finished round, as ``run(..., on_round=...)`` receives it. Accuracies are fractions
    (0..1) as in ``results.json``; ``None`` on a round that was not evaluated
    (``train.eval_every``; the last round always is)."""

    round: int
    rounds: int  # the rounds planned (train.rounds)
    evaluated: bool
    acc: float | None  # test accuracy over all clients' test examples (acc_weighted)
    acc_mean: float | None  # the mean of the clients' test accuracies
    train_loss: float  # the mean of the participants' training losses (NaN: none)
    seconds: float  # this round's wall time
    elapsed: float  # seconds since ``run`` was called
    # the round's entry of results.json["rounds"] (a copy): every accuracy mode and split
    # (acc_head, val_acc_weighted, ...), bytes, participants, ...
    metrics: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, rec: dict[str, Any], rounds: int, elapsed: float) -> RoundRecord:
        def acc(key: str) -> float | None:
            return float(rec[key]) if key in rec else None

        return cls(
            round=int(rec["round"]),
            rounds=rounds,
            evaluated="acc_weighted" in rec,
            acc=acc("acc_weighted"),
            acc_mean=acc("acc_mean"),
            train_loss=float(rec.get("train_loss", math.nan)),
            seconds=float(rec.get("seconds", math.nan)),
            elapsed=elapsed,
            metrics=copy.deepcopy(rec),
        )


OnRound = Callable[[RoundRecord], None]


def _round_hook(on_round: OnRound | None, rounds: int) -> Callable[[dict], None] | None:
    """The round loop's per-round hook that hands ``on_round`` a :class:`RoundRecord`."""
    if on_round is None:
        return None
    t0 = time.perf_counter()
    return lambda rec: on_round(RoundRecord.of(rec, rounds, time.perf_counter() - t0))


def run(
    config: Config,
    overrides: Sequence[str] = (),
    progress: bool = False,
    *,
    out: str | Path | None = None,
    on_round: OnRound | None = None,
    save_models: bool = False,
    overwrite: bool = False,
    resume: bool = False,
    extend: bool = False,
    checkpoint_every: int = 0,
) -> Result:
    """Run one experiment on the simulator (``sim.backend``) and return its :class:`Result`: the
    results document, the final server state and every client's trained model, whichever
    backend trained them.

    ``out``: also write the run folder ``fedmosaic run CONFIG --out OUT`` writes, through the
    same code (``results.json``, ``rounds.csv``, the curve; ``final.safetensors`` with
    ``save_models``; a checkpoint every ``checkpoint_every`` rounds), with its lifecycle: the
    folder is locked while the run goes (a second run into it raises RunFolderError), a
    finished run of this config there is returned as it is (nothing runs; its models only when
    it kept them, else ``models == []``) unless ``overwrite``, another config's needs
    ``overwrite``, an interrupted run's checkpoint needs ``resume``, and ``extend`` continues a
    ``save_models`` run to more rounds (``train.rounds``), as the CLI's flags of those names do.

    ``on_round(record)`` is called after every round with a :class:`RoundRecord`, on every
    backend. An exception it raises stops the run after that round and propagates unchanged;
    the folder is then left as it was before the call (nothing of this run in it), unless a
    checkpoint of an earlier round (``checkpoint_every``, or the run resumed) is there: then it is
    an interrupted run that ``resume=True`` continues. No ``results.json`` is written either way.
    """
    cfg = experiment_config(config, overrides)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise ConfigError(f"checkpoint_every = {checkpoint_every!r}: an int, rounds between saves")
    if checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every = {checkpoint_every} must be >= 0")
    if out is None and (save_models or resume or extend or overwrite or checkpoint_every):
        raise ConfigError(
            "save_models, resume, extend, overwrite and checkpoint_every need a run folder: "
            "pass out=..."
        )
    if out is not None and (not isinstance(out, str | Path) or not str(out).strip()):
        # Path("") is the current directory: a run folder written there by accident
        raise ConfigError(f"out = {out!r}: name a folder (None: no run folder)")
    hook = _round_hook(on_round, cfg.train.rounds)
    trained = Trained()
    if out is None:
        doc = run_experiment(cfg, progress=progress, on_round=hook, trained=trained)
    else:
        keep_final = save_models or extend  # an extended run keeps its final state, as the CLI's
        with RunFolder(out, flag="out") as folder:
            start = folder.check(cfg, overwrite=overwrite, resume=resume, extend=extend)
            if start.done is not None:
                # a warning, not info: a caller who expected training must not be left silent
                log.warning(
                    "%s holds this configuration's finished run: returned as it is, nothing "
                    "trained (overwrite=True runs it again)",
                    folder.path,
                )
                return _finished(start.done, cfg, folder.path)
            opts = RunOptions(
                progress=progress,
                checkpoint_every=checkpoint_every,
                resume=resume,
                extend=extend,
                keep_final=keep_final,
                on_round=hook,
            )
            doc = folder.execute(cfg, start, opts, trained)
    done = int(doc["rounds"][-1]["round"]) if doc["rounds"] else 0
    # After the method's fine-tuning (FedBABU, ...) the clients hold the fine-tuned models, which
    # were evaluated without receiving again; otherwise the evaluation received the broadcast.
    tuned = "after_finetune" in doc.get("summary", {})
    state, fed = trained.state, trained.fed
    assert fed is not None  # the round loop fills it when the run ends
    if trained.models is not None:  # the serial backend's own modules: nothing to copy
        models, extras = _as_evaluated(
            fed, trained.models, trained.extras or [], state, done, not tuned
        )
    else:  # the clients lived in worker processes or a state store: built here from their states
        models, extras = _trained_clients(fed, trained.clients or [], state, done, not tuned)
    return Result(doc, cfg, state, models, extras, done, None if out is None else Path(out))


def _finished(doc: dict[str, Any], cfg: ExperimentConfig, folder: Path) -> Result:
    """A finished run found in ``folder``: with its kept models when it has them."""
    if (folder / FINAL_FILE).is_file():
        kept = load_run(folder, plugins=cfg.plugins)  # the plugins this very config names
        return replace(kept, document=doc, config=cfg, out=folder)
    done = int(doc["rounds"][-1]["round"]) if doc.get("rounds") else 0
    return Result(doc, cfg, None, [], [], done, folder)


def load_run(
    path: str | Path, *, trust_plugins: bool = False, plugins: Sequence[str] | None = None
) -> Result:
    """The kept models of a finished run: ``path`` is a ``fedmosaic run --save-models --out``
    folder (its ``final.safetensors`` and ``results.json``) or a checkpoint file. Rebuilds the
    federation from the config stored in the file (the data are read again to size the models)
    and loads the server state and every client's model into it.

    Loading runs no code from the file: its digest is verified first, and a stored config that
    names plugins (code, imported like a Python script) is refused unless the caller consents
    with ``trust_plugins=True`` or a ``plugins`` list naming every one of them."""
    p = Path(path)
    file = p / FINAL_FILE if p.is_dir() else p
    if p.is_dir() and not file.exists() and (p / "results.json").is_file():
        # A finished run without --save-models: its results are there, its models never were.
        raise CheckpointError(
            f"{p}: this run kept no models ({FINAL_FILE} is absent): re-run it with "
            f"`fedmosaic run ... --out {p} --save-models --overwrite`"
        )
    # Digest first: a missing, truncated or forged file is a CheckpointError naming it, before
    # anything of its config is used.
    meta = check_meta(verify_file(file), file, full=True)
    stored = meta["config"].get("plugins", [])
    if not isinstance(stored, list) or not all(isinstance(s, str) for s in stored):
        raise CheckpointError(f"{file}: corrupt checkpoint metadata (plugins = {stored!r})")
    if stored and not trust_plugins:
        allowed = {*(plugins or ()), *(resolve_plugin(n, Path.cwd()) for n in plugins or ())}
        missing = [s for s in stored if s not in allowed]
        if missing:
            raise CheckpointError(
                f"{file}: the run's config names plugins {missing}, code that loading would "
                "import and run; pass load_run(..., trust_plugins=True) or plugins=[...] "
                "naming them if you trust it"
            )
    cfg = from_dict(meta["config"])
    fed = build_federation(replace(cfg, sim=replace(cfg.sim, backend="serial")))
    # This file, checked against its own config (loaded on the serial backend whatever ran it).
    ckpt = for_models(file, meta["config"], fed.models, fed.extras)
    with torch.random.fork_rng(devices=[]):  # the file's RNG state is the run's, not ours
        restored = ckpt.restore(fed.algo.init_server(fed.spec))
    assert restored is not None  # the file exists: restore either loads it or raises
    done, state, _, _ = restored
    doc_file = file.parent / "results.json"
    doc: dict[str, Any] = {}
    if doc_file.is_file():
        read = read_results(doc_file)
        if read is None:
            raise CheckpointError(
                f"{doc_file}: not a results document (unreadable, or not a JSON object)"
            )
        doc = read
    # fed's clients were built for this call alone and now hold the file's states: no copies
    models, extras = _as_evaluated(fed, fed.models, fed.extras, state, done, receive=True)
    return Result(doc, cfg, state, models, extras, done)


def run_flower_in_memory(
    config: Config,
    results_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    overwrite: bool = False,
    on_round: OnRound | None = None,
) -> dict[str, Any]:
    """The same experiment through Flower's real ServerApp and ClientApp code over an in-process
    grid (one node per client, messages serialized as a SuperLink would); needs the ``flower``
    extra. Writes ``results.json`` under ``results_dir`` and returns it.

    ``results_dir`` goes through the run-folder lifecycle (``fedmosaic.runfolder``) as
    ``fedmosaic run --out`` does: locked for the run (a second run into it raises
    RunFolderError), checked before anything is written; a finished run of this config there is
    returned as it is unless ``overwrite``, and another config's needs ``overwrite``.
    ``on_round`` is :func:`run`'s; an exception it raises stops the run and propagates, and
    the Flower server leaves its ``FAILED`` file (the traceback) there, no ``results.json``."""
    try:  # the optional flower extra
        from fedmosaic.flower.app import client_app, run_server
        from fedmosaic.flower.local import FIRST_NODE_ID, LocalGrid
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "flwr":
            raise
        raise ModuleNotFoundError(
            "run_flower_in_memory needs Flower: pip install 'fedmosaic[flower]'", name="flwr"
        ) from None

    cfg = experiment_config(config, overrides)
    with RunFolder(results_dir, flag="results_dir") as folder:
        start = folder.check(cfg, overwrite=overwrite)
        if start.done is not None:
            return start.done
        n = cfg.data.num_clients
        nodes = [{"partition-id": i, "num-partitions": n} for i in range(n)]
        rc = {
            "experiment": json.dumps(cfg.to_dict()),
            "results-dir": str(results_dir),
            # the in-process grid knows which node serves which partition: the allow-list a
            # deployment sets by hand (no "partitions bound to whoever declares them" warning)
            "node-partitions": " ".join(f"{FIRST_NODE_ID + i}={i}" for i in range(n)),
        }
        hook = _round_hook(on_round, cfg.train.rounds)
        return run_server(LocalGrid(client_app, nodes, rc), rc, on_round=hook)


__all__ = [
    "ALGORITHMS",
    "DATASETS",
    "ENCODERS",
    "FAMILIES",
    "PARTITIONERS",
    "Acceleration",
    "Algorithm",
    "CheckpointError",
    "ClientData",
    "ClientModel",
    "ConfigError",
    "DatasetError",
    "Empty",
    "ExperimentConfig",
    "FederationSpec",
    "ImageDataset",
    "PartitionError",
    "Payload",
    "PayloadError",
    "Phase",
    "Result",
    "RoundRecord",
    "RunFolderError",
    "SharedState",
    "SharedWeights",
    "Weighted",
    "check_state_like",
    "class_means",
    "from_dict",
    "load",
    "load_run",
    "experiment_config",
    "run",
    "run_experiment",
    "run_flower_in_memory",
    "schema",
    "weighted_average",
]
