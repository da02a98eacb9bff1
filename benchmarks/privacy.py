"""Accuracy and measured leak against epsilon, for each way of sharing, under ``[privacy]``.

    .venv/bin/python benchmarks/privacy.py --pilot             # honest upload norms: the clips
    .venv/bin/python benchmarks/privacy.py --pilot --suite privacy_fmnist   # on a suite's
    .venv/bin/python benchmarks/privacy.py --out docs/results/privacy/digits.json
    .venv/bin/python benchmarks/privacy.py --table docs/results/privacy/digits.json

A real-data federation (scikit-learn's 8x8 digits, 10 clients, Dirichlet 0.5, cnn1, ``--rounds``
rounds, every client every round, paired seeds). Per method and mechanism (``local`` for every
method, ``central`` where the server only averages), the noise multiplier that reaches each
target epsilon at delta 1e-5 after the last round (solved on the accountant, so every cell ends
at its epsilon), beside the run without privacy. Per cell: the final weighted accuracy and the
loss-threshold membership attack (``report/leak.py``) on every client's final model (its
training split against its test split; for FedAvg that model is the global one the server
broadcasts, for the others the client's personalized model, which never leaves it).

The clip of each method is fixed from a pilot run without privacy (``--pilot``: the median
honest upload norm of round 1, rounded); the table names it. Differences to the run without
privacy are paired by seed, with their 95% t-interval; one that contains 0 is inconclusive.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fedmosaic import api  # noqa: E402
from fedmosaic.algorithms import ALGORITHMS  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.core import accountant  # noqa: E402
from fedmosaic.core.rounds import Diverged  # noqa: E402
from fedmosaic.report.leak import loss_threshold_attack  # noqa: E402

METHODS = ("fedavg", "lg_fedavg", "fedproto", "fedtgp", "fedgh")
EPSILONS = (1.0, 4.0, 8.0)  # and infinity: the run without privacy
DELTA = 1e-5
CLIENTS = 10
# The clip of each method's upload (its private part as one vector), from --pilot (2026-11-28):
# the median honest norm of round 1 (update norms for weights; the rows' joint norm otherwise).
CLIPS = {"fedavg": 0.7, "lg_fedavg": 0.3, "fedproto": 8.0, "fedtgp": 8.0, "fedgh": 8.0}


def experiment(name: str, rounds: int, seed: int, privacy: dict[str, Any]) -> dict[str, Any]:
    return {
        "seed": seed,
        "data": {
            "dataset": "digits",
            "partition": "dirichlet",
            "alpha": 0.5,
            "min_size": 5,
            "num_clients": CLIENTS,
        },
        "model": {"family": "cnn1", "feature_dim": 16},
        "train": {"rounds": rounds, "batch_size": 10, "lr": 0.05, "eval_every": rounds},
        "sim": {"threads": 1, "check_wire": False, "progress": False},
        "privacy": privacy,
        "algorithm": {"name": name},
    }


def leak(result: api.Result) -> float:
    """The loss-threshold attack's AUC, mean over the clients' final models."""
    from fedmosaic.federation import build_federated_data, client_data

    cfg = result.config
    clients = client_data(build_federated_data(cfg.data, cfg.seed), "cpu")
    aucs = []
    for model, data in zip(result.models, clients, strict=True):
        if data.num("test") == 0:
            continue
        members = (data.source.batch(data.rows("train")), data.targets("train"))
        nonmembers = (data.source.batch(data.rows("test")), data.targets("test"))
        try:
            aucs.append(loss_threshold_attack(model, members, nonmembers).auc)
        except ValueError:  # a client whose model the noise broke (NaN losses): no attack
            continue
    return statistics.mean(aucs) if aucs else math.nan


def cell(name: str, mechanism: str, epsilon: float, rounds: int, seed: int) -> dict[str, Any]:
    privacy: dict[str, Any] = {}
    z = 0.0
    if math.isfinite(epsilon):
        # every client every round: n = k = CLIENTS
        z = accountant.noise_for(mechanism, "rdp", epsilon, DELTA, rounds, CLIENTS, CLIENTS)
        privacy = {"mechanism": mechanism, "clip": CLIPS[name], "noise_multiplier": z}
        privacy["delta"] = DELTA
    t0 = time.perf_counter()
    try:
        result = api.run(from_dict(experiment(name, rounds, seed, privacy)))
    except Diverged:  # the noise broke training: a result of its own, not a crash
        last, auc, diverged = {"acc_weighted": math.nan}, math.nan, True
    else:
        last, auc, diverged = result.rounds[-1], leak(result), False
    return {
        "method": name,
        "mechanism": mechanism if privacy else "none",
        "target_epsilon": epsilon if math.isfinite(epsilon) else None,
        "epsilon": last.get("epsilon") if not diverged else None,
        "noise_multiplier": z,
        "clip": CLIPS[name] if privacy else None,
        "seed": seed,
        "acc": last["acc_weighted"],
        "auc": auc,
        "diverged": diverged,
        "seconds": time.perf_counter() - t0,
    }


def suite_experiment(suite: str, name: str) -> Any:
    """Seed 0's config of method ``name`` in bundled suite ``suite``, one round, no privacy."""
    import dataclasses

    from fedmosaic.config import PrivacyRule
    from fedmosaic.suite_runner import build_cells, load_suite

    (cell,) = build_cells(load_suite(suite), methods=[name], seeds=[0], check=False)
    cfg = cell.cfg
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, rounds=1), privacy=PrivacyRule()
    )


def pilot(rounds: int, suite: str = "") -> None:
    """Median honest upload norm of round 1 per method (the update for weight-like uploads), on
    the digits federation or, with ``suite``, on that suite's federation (its methods without
    privacy)."""
    from fedmosaic.core import privacy
    from fedmosaic.federation import build_federation

    for name in METHODS:
        cfg = suite_experiment(suite, name) if suite else from_dict(experiment(name, 1, 0, {}))
        fed = build_federation(cfg)
        state = fed.algo.init_server(fed.spec)
        n = fed.spec.num_clients
        msgs = {c: fed.algo.broadcast(state, c, 1) for c in range(n)}
        from fedmosaic.sim.simulator import SimTransport

        t = SimTransport(
            fed.algo, fed.models, fed.extras, fed.clients, fed.settings, 0, 1
        )  # fmt: skip
        norms = []
        for r in t.fit(1, msgs):
            plan = privacy.release_plan(type(r.upload))
            names = fed.algo.upload_names(state, r.upload)
            refs = privacy.server_refs(r.upload, names)
            out = privacy.release(r.upload, refs, 1e30, 0.0, torch.Generator(), n)
            sq = 0.0
            for f in plan.updates:
                sq += sum(
                    float((v.float() - refs[f][k].float()).pow(2).sum())
                    for k, v in getattr(out, f).items()
                    if v.is_floating_point()
                )
            for f in plan.values:
                sq += float(getattr(out, f).pow(2).sum())
            norms.append(math.sqrt(sq))
        print(f"{name}: median honest norm {statistics.median(norms):.3g}")


def table(rows: list[dict[str, Any]]) -> str:
    base = {(r["method"], r["seed"]): r for r in rows if r["mechanism"] == "none"}
    lines = [
        "| method | mechanism | epsilon | noise multiplier | clip | accuracy (%) | vs none (points) "
        "| attack AUC | vs none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["mechanism"], r["target_epsilon"]), []).append(r)
    for (name, mech, eps), rs in groups.items():
        acc = [100 * r["acc"] for r in rs]
        auc = [r["auc"] for r in rs]
        broke = sum(bool(r.get("diverged")) for r in rs)
        if broke:
            lines.append(
                f"| {name} | {mech} | {eps} | {rs[0]['noise_multiplier']:.3g} | {rs[0]['clip']:g} "
                f"| diverged ({broke} of {len(rs)} seeds) | - | - | - |"
            )
            continue
        if mech == "none":
            gap_acc = gap_auc = "-"
        else:
            gap_acc = interval([100 * (r["acc"] - base[(name, r["seed"])]["acc"]) for r in rs])
            gap_auc = interval([r["auc"] - base[(name, r["seed"])]["auc"] for r in rs], 3)
        z = f"{rs[0]['noise_multiplier']:.3g}" if mech != "none" else "-"
        clip = f"{rs[0]['clip']:g}" if mech != "none" else "-"
        lines.append(
            f"| {name} | {mech} | {eps if eps is not None else 'inf'} | {z} | {clip} | "
            f"{statistics.mean(acc):.1f} | {gap_acc} | {statistics.mean(auc):.3f} | {gap_auc} |"
        )
    return "\n".join(lines)


def interval(diffs: list[float], digits: int = 1) -> str:
    """Mean paired difference with its 95% t-interval; "inconclusive" when it contains 0."""
    m = statistics.mean(diffs)
    if len(diffs) < 2:
        return f"{m:+.{digits}f}"
    h = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    word = " (inconclusive)" if m - h <= 0 <= m + h else ""
    return f"{m:+.{digits}f} [{m - h:+.{digits}f}, {m + h:+.{digits}f}]{word}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="print the table of a written JSON")
    ap.add_argument("--pilot", action="store_true")
    ap.add_argument("--suite", default="", help="--pilot on this bundled suite's federation")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.table:
        print(table(json.loads(args.table.read_text())["rows"]))
        return
    if args.pilot:
        pilot(args.rounds, args.suite)
        return
    rows: list[dict[str, Any]] = []
    done = set()
    if args.out and args.out.exists():  # continue a partial file
        rows = json.loads(args.out.read_text())["rows"]
        done = {(r["method"], r["mechanism"], r["target_epsilon"], r["seed"]) for r in rows}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.methods.split(","):
            mechanisms = ["local"] + (["central"] if ALGORITHMS.get(name).server_sums else [])
            plan = [("none", math.inf)] + [(m, e) for m in mechanisms for e in EPSILONS]
            for mech, eps in plan:
                key = (name, mech, eps if math.isfinite(eps) else None, seed)
                if key in done:
                    continue
                r = cell(name, mech, eps, args.rounds, seed)
                rows.append(r)
                print(json.dumps(r), flush=True)
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    doc = {"rounds": args.rounds, "delta": DELTA, "rows": rows}
                    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
