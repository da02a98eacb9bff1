"""``fedmosaic compare SUITE.toml``: a grid of methods x settings x seeds, cached and resumable.

A suite file is an experiment TOML (``[base]``) plus the grid around it::

    [suite]
    name = "fedtgp-table10"
    title = "FedTGP Table 10: FMNIST, HtCNN8, 20 clients"
    seeds = [0, 1, 2]
    methods = ["local", "fedproto", "fedtgp"]   # labels; a label without a [methods.X] table
    settings = ["pathological", "practical"]    #   is the algorithm of that name, defaults
    target_accuracy = 0.9                       # for rounds / bytes to target
    checkpoint_every = 10
    paper_metric = "weighted"                   # or "unweighted": the accuracy the paper reports
    paper_rounds = 1000                         # the budget behind [reference]: a run of another
    paper_budget = "full FMNIST, 3 trials"      #   number of rounds is marked in the report

    [base]                 # the shared experiment config (the schema of `fedmosaic run`)
    [base.data] ...

    [settings.pathological]                     # dotted overrides on [base]
    "data.partition" = "pathological"

    [methods.fedhenn_rbf]                       # an algorithm table and optional overrides
    algorithm = { name = "fedhenn", kernel = "rbf" }
    set = { "data.public_size" = 1000 }

    [quick]                                     # the reduced budget of `--quick`
    "train.rounds" = 5

    [converged]                                 # the converged budget of `--converged`:
    "train.rounds" = 300                        #   a cap, and a plateau stop on validation
    "train.plateau_delta" = 0.001               #   accuracy (train.plateau_*)

    [full]                                      # the claims budget of `--full` (issue 22):
    "data.subsample" = 1.0                      #   full data, one fixed round count for every
    "train.rounds" = 100                        #   method of a setting (no plateau stop)

    [reference.pathological]                    # the paper's numbers (accuracy, %), optional
    fedtgp = "99.56 ± 0.03"

Each cell's config is ``base <- setting <- method <- seed <- [quick], [converged] or [full] <- --set``. Cells are stored in
``OUT/cells/<setting>/<method>/seed<k>/``; a cell whose ``results.json`` was produced by the same
config (hash) *and* the same code (``provenance.code()["source_hash"]``) is skipped; a cell of
another code version is run again (``--reuse-other-code`` keeps it; the report then lists the code
versions its cells come from), ``--force`` reruns every cell; ``--resume`` continues interrupted
cells from their checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedmosaic import provenance
from fedmosaic.algorithms._shared import class_means
from fedmosaic.checkpoint import FILENAME as CHECKPOINT_FILE
from fedmosaic.checkpoint import (
    CheckpointError,
    config_hash,
    peek,
    read_checkpoint,
    restore_tree,
    verify_file,
)
from fedmosaic.config import ConfigError, apply_overrides, from_dict
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.federation import Federation, build_federation, check_runs
from fedmosaic.report.prototypes import plot_prototypes
from fedmosaic.report.results import write_atomic
from fedmosaic.report.suite import Cell, Method, Setting, Suite, load_suite
from fedmosaic.report.suite_report import write_report
from fedmosaic.runfolder import FolderLock, RunFolder, RunOptions, Start

__all__ = ["Cell", "Method", "Setting", "Suite", "build_cells", "load_suite", "run_suite"]

log = logging.getLogger("fedmosaic")


def _apply(raw: dict[str, Any], overrides: dict[str, Any], where: str) -> None:
    for key, value in overrides.items():
        parts = key.split(".")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {key!r}: {p!r} is not a table")
        node[parts[-1]] = copy.deepcopy(value)


def build_cells(
    suite: Suite,
    overrides: list[str] | None = None,
    quick: bool = False,
    methods: list[str] | None = None,
    settings: list[str] | None = None,
    seeds: list[int] | None = None,
    converged: bool = False,
    check: bool = True,
    full: bool = False,
) -> list[Cell]:
    """Every cell's validated config, before anything runs (errors name the cell). With
    ``check``, each cell's method is also checked against its federation (``Algorithm.check``:
    data loaded, no model built), so one bad cell fails the suite before the first cell runs."""
    if quick + converged + full > 1:
        raise ConfigError("--quick, --converged and --full are three budgets: pick one")
    if converged and not suite.converged:
        raise ConfigError(f"suite {suite.name} has no [converged] budget")
    if full and not suite.full:
        raise ConfigError(f"suite {suite.name} has no [full] budget")
    pick_m = [m for m in suite.methods if not methods or m.label in methods]
    pick_s = [s for s in suite.settings if not settings or s.label in settings]
    for name, wanted, have in (
        ("method", methods, [m.label for m in suite.methods]),
        ("setting", settings, [s.label for s in suite.settings]),
    ):
        for w in wanted or []:
            if w not in have:
                raise ConfigError(f"unknown {name} {w!r} in suite {suite.name}; have {have}")
    cells = []
    for setting in pick_s:
        for method in pick_m:
            for seed in seeds if seeds else suite.seeds:
                raw = copy.deepcopy(suite.base)
                where = f"cell {setting.label}/{method.label}/seed{seed}"
                _apply(raw, setting.overrides, where)
                _apply(raw, method.overrides, where)
                raw["algorithm"] = copy.deepcopy(method.algorithm)
                raw["seed"] = seed
                if quick:
                    _apply(raw, suite.quick, where)
                if converged:
                    _apply(raw, suite.converged, where)
                if full:
                    _apply(raw, suite.full, where)
                raw.setdefault("sim", {})["progress"] = False
                try:
                    cfg = from_dict(apply_overrides(raw, list(overrides or [])))
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from exc
                cells.append(Cell(method, setting, seed, cfg, config_hash(cfg.to_dict())))
    if check:
        check_runs([(f"cell {c.key}", c.cfg) for c in cells])
    return cells


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.setting.label / cell.method.label / f"seed{cell.seed}"


def doc_code(doc: dict[str, Any]) -> str | None:
    """The source hash of the code that produced a results document (None: before provenance)."""
    code = doc.get("provenance", {}).get("code", {})
    return code.get("source_hash") if isinstance(code, dict) else None


def cell_status(out: Path, cell: Cell) -> tuple[str, dict[str, Any] | None]:
    """``("done" | "other code" | "to run", results)``: results of this config, by which code."""
    path = cell_dir(out, cell) / "results.json"
    if not path.is_file():
        return "to run", None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        log.warning("%s is not a results document: the cell runs again", path)
        return "to run", None
    if config_hash(doc.get("config", {})) != cell.hash:
        return "to run", None
    if doc_code(doc) != provenance.code()["source_hash"]:
        return "other code", doc
    return "done", doc


def cached(out: Path, cell: Cell, reuse_other_code: bool = False) -> dict[str, Any] | None:
    """The cell's results when this config produced them, with this code (or any code)."""
    status, doc = cell_status(out, cell)
    if status == "done" or (status == "other code" and reuse_other_code):
        return doc
    return None


def is_prototype_method(name: str) -> bool:
    """A method whose broadcast carries global prototypes (``protos [C, d]`` + ``known [C]``)."""
    cls = ALGORITHMS.get(name)
    names = {f.name for f in dataclasses.fields(cls.Broadcast)}
    return {"protos", "known"} <= names


def run_cell(
    out: Path,
    cell: Cell,
    resume: bool,
    checkpoint_every: int,
    progress: bool = False,
    prototype_plot: str = "tsne",
) -> dict[str, Any]:
    """Run one cell in its folder, through the run-folder lifecycle (``runfolder``: locked,
    files checked before training, results written atomically). Unlike ``fedmosaic run``, a
    cell's checkpoint without ``resume`` (or of another config) is discarded: the suite's
    config decides what the cell is."""
    d = cell_dir(out, cell)
    with RunFolder(d, flag=f"cell {cell.key}") as folder:
        folder.check_files()
        ckpt = d / CHECKPOINT_FILE
        keep = 0
        if ckpt.exists() and not resume:
            log.warning("%s: discarding the checkpoint of an earlier interrupted run", cell.key)
            ckpt.unlink()
        elif ckpt.exists():
            try:  # another config's is discarded; this cell's is verified whole (digest)
                meta = peek(ckpt)  # before its round trims the rounds table
                if meta.get("config_hash") == cell.hash:
                    meta = verify_file(ckpt)
            except CheckpointError as exc:
                raise CheckpointError(
                    f"{cell.key}: {exc} (delete it to restart this cell)"
                ) from exc
            if meta.get("config_hash") == cell.hash:
                keep = int(meta["round"])
            else:  # the suite (or --set) changed since: that checkpoint is another cell's
                log.warning(
                    "%s: the checkpoint is of another configuration; starting over", cell.key
                )
                ckpt.unlink()
        every = checkpoint_every if checkpoint_every > 0 else cell.cfg.train.rounds
        opts = RunOptions(progress=progress, checkpoint_every=every, resume=resume)
        doc = folder.run(cell.cfg, Start(keep=keep), opts)
        doc["cell"] = {
            "suite_setting": cell.setting.label,
            "method": cell.method.label,
            "seed": cell.seed,
            "config_hash": cell.hash,
        }
        if prototype_plot != "none" and is_prototype_method(cell.cfg.algorithm["name"]):
            try:
                plot_prototypes_of(cell.cfg, ckpt, d / "prototypes.png", prototype_plot)
            except Exception as exc:  # a report plot must not lose a finished run
                log.warning("%s: prototype plot failed: %s", cell.key, exc)
        folder.finish(doc)
    return doc


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def run_suite(
    suite: Suite,
    out: str | Path,
    cells: list[Cell],
    resume: bool = False,
    checkpoint_every: int | None = None,
    progress: bool = True,
    command: str = "",
    force: bool = False,
    reuse_other_code: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Run (or reuse) every cell, then write the report. Returns the docs per cell key.

    ``force``: run every cell again. ``reuse_other_code``: keep cells that the same config
    produced with other code (by default they are run again: their numbers may be stale).
    """
    out = Path(out)
    # One suite run per folder at a time (each cell's folder is locked as well, against a
    # `fedmosaic run --out` into it).
    with FolderLock(out):
        return _run_suite(
            suite, out, cells, resume, checkpoint_every, progress, command, force, reuse_other_code
        )


def _run_suite(
    suite: Suite,
    out: Path,
    cells: list[Cell],
    resume: bool,
    checkpoint_every: int | None,
    progress: bool,
    command: str,
    force: bool,
    reuse_other_code: bool,
) -> dict[str, list[dict[str, Any]]]:
    every = suite.checkpoint_every if checkpoint_every is None else checkpoint_every
    docs: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    spent: list[float] = []  # seconds of each cell run so far: the ETA's mean
    # Each cell's status read once: running one cell changes no other's (and a cell whose results
    # file is unreadable is reported once, not again at every ETA).
    before = {c.key: ("to run", None) if force else cell_status(out, c) for c in cells}
    for i, cell in enumerate(cells, 1):
        status, doc = before[cell.key]
        if status == "done" or (status == "other code" and reuse_other_code):
            note = "" if status == "done" else " (from other code: --reuse-other-code)"
            print(f"[{i}/{len(cells)}] {cell.key}: cached{note}")
        else:
            if status == "other code":
                print(f"[{i}/{len(cells)}] {cell.key}: cached by other code; running it again")
            c = cell.cfg
            print(
                f"[{i}/{len(cells)}] {cell.key}: {c.data.dataset}, {c.data.num_clients} clients, "
                f"{c.data.partition}, {c.model.family}, {c.train.rounds} rounds",
                flush=True,
            )
            t0 = time.perf_counter()
            doc = run_cell(out, cell, resume, every, progress, suite.prototype_plot)
            acc = doc.get("summary", {}).get("final", {}).get("acc_weighted")
            spent.append(time.perf_counter() - t0)
            left = sum(1 for c in cells[i:] if before[c.key][0] != "done")
            eta = sum(spent) / len(spent) * left
            acc_s = "-" if acc is None else f"{100 * acc:.2f}%"
            print(
                f"    final acc {acc_s}, {spent[-1]:.0f} s"
                + (f"; ETA {_duration(eta)} for {left} more cell(s)" if left else ""),
                flush=True,
            )
        assert doc is not None  # cached statuses carry their results; run_cell returns one
        docs[cell.key] = doc
    manifest = {
        "suite": suite.name,
        "suite_file": suite.path,
        "command": command,
        "cells": [
            {"key": c.key, "config_hash": c.hash, "dir": str(cell_dir(out, c).relative_to(out))}
            for c in cells
        ],
        "seconds": time.perf_counter() - t_start,
    }
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    write_report(suite, out, cells, docs, command=command)
    return {k: [v] for k, v in docs.items()}


def prototypes_of_run(
    fed: Federation, state: Any
) -> tuple[list[tuple[int, int, Tensor]], Tensor, Tensor]:
    """Client and global prototypes of a federation in ``state``."""
    msg = fed.algo.broadcast(state, 0, fed.plan.rounds + 1)
    if not hasattr(msg, "protos") or not hasattr(msg, "known"):
        raise ValueError(f"{fed.cfg.algorithm['name']} broadcasts no prototypes")
    clients: list[tuple[int, int, Tensor]] = []
    with torch.no_grad():
        for data, model in zip(fed.clients, fed.models, strict=True):
            protos, counts = class_means(model, data, fed.spec.num_classes)
            clients += [(data.client_id, c, protos[c]) for c in range(len(counts)) if counts[c] > 0]
    return clients, msg.protos, msg.known


def plot_prototypes_of(
    cfg: Any, checkpoint: str | Path, path: str | Path, method: str = "tsne"
) -> None:
    """Rebuild the federation of ``cfg``, load its checkpoint, and plot its prototypes."""
    fed = build_federation(cfg)
    loaded = read_checkpoint(checkpoint)
    tensors = loaded.tensors
    for cid, model in enumerate(fed.models):
        prefix = f"client/{cid}/model/"
        model.load_state_dict(
            {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        )
    state = restore_tree(loaded.meta["server_state"], tensors, fed.algo.init_server(fed.spec))
    clients, protos, known = prototypes_of_run(fed, state)
    d = cfg.data
    title = (
        f"{cfg.algorithm['name']}: {d.dataset}, {d.partition}, round {loaded.meta['round']} "
        f"({method.upper()}); colour = class, * = global"
    )
    plot_prototypes(clients, protos, known, path, title, method)
