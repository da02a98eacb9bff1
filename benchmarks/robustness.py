"""One persistent hostile client against every method family, under each server rule.

    .venv/bin/python benchmarks/robustness.py --out docs/results/robustness/digits.json
    .venv/bin/python benchmarks/robustness.py --table docs/results/robustness/digits.json
    .venv/bin/python benchmarks/robustness.py --row-spread   # honest rows' spread, by holders
    .venv/bin/python benchmarks/robustness.py --update-spread docs/results/full/fedgh_table3/cells/pathological/lg_fedavg/seed0/results.json
    .venv/bin/python benchmarks/robustness.py --methods fedproto --attacks x-8 --rules default

A real-data federation (scikit-learn's 8x8 digits, 10 clients, Dirichlet 0.5, cnn1, ``--rounds``
rounds, every client every round). Client 0 trains honestly, then, in *every* round, either sends
NaN (``absent``: refused by the schema, the federation without it: the best any rule that drops
it can do) or multiplies every floating tensor of its upload by the attack's factor (``x-50``, ``x-8``, ``x-5``: a
prototype, kernel or state sent as -50, -8 or -5 times itself), or, for ``flip-9``, sends
``sent - 9 (x - sent)`` for each tensor the broadcast holds in the same shape (a sign-flipped
update x 9) and ``-9 x`` for the rest. Per (method, attack, rule): the rounds the attacker was
dropped, honest clients dropped (client-rounds), the final weighted accuracy beside the honest
run's under the same rule. Written as JSON (``--out``) and printed as the markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _attack import ATTACKER, attacked_run  # noqa: E402

from fedmosaic.core.payload import Payload  # noqa: E402

# One method per way of sharing: weights (FedAvg, FedBABU's body, layer expansion's blocks, LG's
# head, FML's meme), SVD factors (FedKD), a head plus counts (FedGen), prototypes (FedProto),
# points a server learns from (FedTGP, FedGH), class logits (FedDistill), kernels (FedHeNN),
# soft labels (KT-pFL).
METHODS = (
    "fedavg", "fedbabu", "fedseq_vanilla", "lg_fedavg", "fml", "fedkd", "fedgen",
    "fedproto", "fedtgp", "fedgh", "feddistill", "fedhenn", "ktpfl",
)  # fmt: skip
ROW_METHODS = ("fedtgp", "fedgh", "feddistill", "fedproto")  # uploads of per-class rows
ATTACKS = ("absent", "x-50", "x-8", "x-5", "flip-9")
RULES: dict[str, dict[str, Any]] = {
    "default": {},
    "median": {"aggregator": "median"},
    "trimmed_mean": {"aggregator": "trimmed_mean", "trim": 0.2},
    "multi_krum": {"aggregator": "multi_krum", "f": 2},
}
TRAIN = {"fedclassavg": {"lr": 0.01}}


def experiment(name: str, rule: str, rounds: int, seed: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "data": {
            "dataset": "digits",
            "partition": "dirichlet",
            "alpha": 0.5,
            "min_size": 5,
            "num_clients": 10,
            "public_size": 100,
        },
        "model": {"family": "cnn1", "feature_dim": 16},
        "train": {"rounds": rounds, "batch_size": 10, "lr": 0.05, "eval_every": rounds}
        | TRAIN.get(name, {}),
        "sim": {"threads": 1, "check_wire": False, "progress": False},
        "server": RULES[rule],
        "algorithm": {"name": name},
    }


def _tensor(x: torch.Tensor, s: Any, attack: str) -> torch.Tensor:
    if attack == "absent":  # NaN: refused by the schema every round, as if it never replied
        return torch.full_like(x, float("nan"))
    factor = float(attack[1:]) if attack.startswith("x") else -float(attack.split("-", 1)[1])
    if attack.startswith("flip") and isinstance(s, torch.Tensor) and s.shape == x.shape:
        return s + factor * (x - s)
    return x * factor


def poisoner(attack: str):
    def poison(round_num: int, upload: Payload, sent: Payload) -> Payload:
        out = {}
        for f in upload.__dataclass_fields__:
            v, s = getattr(upload, f), getattr(sent, f, None)
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v = _tensor(v, s, attack)
            elif isinstance(v, dict):
                ref = s if isinstance(s, dict) else {}
                v = {
                    k: _tensor(t, ref.get(k), attack) if t.is_floating_point() else t
                    for k, t in v.items()
                }
            out[f] = v
        return type(upload)(**out)

    return poison


def run(
    name: str, attack: str, rule: str, rounds: int, seed: int, attackers: int = 1
) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = tuple(range(ATTACKER, ATTACKER + attackers))
    poison = None if attack == "none" else poisoner(attack)
    out = attacked_run(experiment(name, rule, rounds, seed), poison, ids)
    rejected = out.get("rejected", [])
    return {
        "method": name,
        "attack": attack,
        "rule": rule,
        "attackers": attackers,
        "acc": out["acc"],
        "diverged": out["diverged"],
        # attacker-rounds dropped (one attacker: rounds), honest client-rounds dropped
        "attacker_dropped": sum(len([c for c in r if c in ids]) for r in rejected),
        "honest_dropped": sum(len([c for c in r if c not in ids]) for r in rejected),
        "rejected": rejected,
        "seconds": time.perf_counter() - t0,
    }


def compact(doc: dict[str, Any]) -> str:
    """The docs' table: per method, the honest run, the run without client 0 (its reply dropped
    every round: the best any rule that drops the attacker can do) and each attack; per rule the
    final accuracy and, for an attack, the rounds the attacker was dropped (and honest drops)."""
    rows, n = doc["rows"], doc["rounds"]
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    lines = ["| method | client 0 | " + " | ".join(rules) + " |", "|---|---|" + "---|" * len(rules)]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        acc = "diverged" if r["diverged"] else f"{100 * r['acc']:.1f}"
        if r["attack"] in ("none", "absent"):
            cell = acc
        else:
            extra = f", {r['honest_dropped']} honest" if r["honest_dropped"] else ""
            cell = f"{acc} ({r['attacker_dropped']}/{n}{extra})"
        cells.setdefault((r["method"], r["attack"]), {})[r["rule"]] = cell
    label = {"none": "honest", "absent": "absent"}
    for (method, attack), by_rule in cells.items():
        lines.append(
            f"| {method} | {label.get(attack, attack)} | "
            + " | ".join(by_rule.get(x, "") for x in rules)
            + " |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], rounds: int) -> str:
    honest = {(r["method"], r["rule"]): r["acc"] for r in rows if r["attack"] == "none"}
    lines = [
        "| method | attack | rule | attacker dropped | honest drops | accuracy | honest run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["attack"] == "none":
            continue
        acc = "diverged" if r["diverged"] else f"{100 * r['acc']:.1f}%"
        h = honest.get((r["method"], r["rule"]))
        lines.append(
            f"| {r['method']} | {r['attack']} | {r['rule']} | {r['attacker_dropped']}/{rounds} "
            f"| {r['honest_dropped']} | {acc} | {'' if h is None else f'{100 * h:.1f}%'} |"
        )
    return "\n".join(lines)


def leave_one_out(robust: Any, x: torch.Tensor, i: int) -> tuple[float, float]:
    """Row ``i`` of ``x [h, d]`` against the other rows: its distance to their coordinate-wise
    median, and their scale (the larger of their median distance to it and their median norm):
    the guard's row test with the row left out of its own centre and scale, a candidate
    statistic this benchmark measures (the guard does not use it: honest clients reach 9 x)."""
    others = torch.cat([x[:i], x[i + 1 :]])  # [h - 1, d]
    centre = robust.aggregate_rows(others, torch.ones(len(others)), robust.RobustRule("median"))
    spread = robust._median((others - centre).norm(dim=1).tolist())
    scale = max(spread, robust._median(others.norm(dim=1).tolist()))
    return float((x[i] - centre).norm()), scale


def row_spread(names: list[str], rounds: int) -> None:
    """Honest per-class rows on ``configs/default.toml``'s data (``rounds`` rounds, serial): the
    largest distance / scale a row reached (the peer guard's row test) over rows of classes held
    by at least 3, 4, 5 and 6 of the round's clients; the largest per-client median of its rows'
    leave-one-out ratios (:func:`leave_one_out`), and the replies the guard dropped."""
    import tomllib

    from fedmosaic.config import from_dict
    from fedmosaic.core import robust
    from fedmosaic.experiment import run_experiment

    stats: list[tuple[int, float]] = []  # (holders, distance / scale)
    typical: list[float] = []  # per client and round: the median of its rows' leave-one-out ratios
    mine: dict[int, list[float]] = {}  # this round's, per client
    original = robust.peer_screen

    def spy(view: Any, uploads: Any, suspects: Any = ()) -> dict[int, str]:
        rows = {c: view.peer_rows[c] for c, _ in uploads if c in view.peer_rows}
        for j in {j for r in rows.values() for j in r}:
            holders = [c for c in rows if j in rows[c]]
            if len(holders) < 3:
                continue
            x = torch.stack([rows[c][j] for c in holders])  # [h, d]
            centre = robust.aggregate_rows(x, torch.ones(len(holders)), robust.RobustRule("median"))
            dist = (x - centre).norm(dim=1).tolist()
            scale = max(robust._median(dist), robust._median(x.norm(dim=1).tolist()))
            stats.extend((len(holders), d / scale) for d in dist if scale > 0)
            if len(holders) >= robust.PEER_MIN_ROWS:
                for i, c in enumerate(holders):
                    away, others = leave_one_out(robust, x, i)
                    if others > 0:
                        mine.setdefault(c, []).append(away / others)
        typical.extend(robust._median(v) for v in mine.values())
        mine.clear()
        return original(view, uploads, suspects)

    robust.peer_screen = spy
    base = tomllib.loads((ROOT / "fedmosaic" / "configs" / "default.toml").read_text())
    for name in names:
        raw = json.loads(json.dumps(base))
        raw["algorithm"] = {"name": name}
        raw["train"] = {k: v for k, v in raw["train"].items() if not k.startswith("plateau")}
        raw["train"]["rounds"] = rounds
        raw["sim"] = {"backend": "serial", "threads": 1, "progress": False}
        stats.clear()
        typical.clear()
        result = run_experiment(from_dict(raw), progress=False)
        worst = {h: max([r for n, r in stats if n >= h], default=0.0) for h in (3, 4, 5, 6)}
        top = sorted(typical, reverse=True)[:5]
        dropped = sum(len(r.get("rejected", [])) for r in result["rounds"])
        print(
            name,
            "largest distance / scale by holders >=",
            {h: round(r, 2) for h, r in worst.items()},
            f"| largest median of a client's rows against the others {[round(v, 2) for v in top]}"
            f" of {len(typical)} | honest replies dropped {dropped}",
            flush=True,
        )


def update_spread(source: Path, rounds: int | None) -> None:
    """Honest model updates of one run (``source``: a TOML config, or a ``results.json`` whose
    config is rerun), every round screened and nothing dropped (``peer_factor`` raised out of
    reach): per round, the largest decisive ratio of the update test (the smaller of norm /
    scale and per-example norm / median per example), with the scale the median update norm
    alone and floored at ``rho`` x the broadcast's norm, for several ``rho``."""
    import tomllib

    from fedmosaic.config import from_dict
    from fedmosaic.core import robust
    from fedmosaic.experiment import run_experiment

    text = source.read_text()
    raw = json.loads(text)["config"] if source.suffix == ".json" else tomllib.loads(text)
    raw.setdefault("server", {})["peer_factor"] = 1e6
    raw.setdefault("sim", {}).update({"backend": "serial", "threads": 1, "progress": False})
    if rounds is not None:
        raw.setdefault("train", {})["rounds"] = rounds
    rhos = (0.0, 0.003, robust.UPDATE_FLOOR, 0.03)
    worst: dict[float, tuple[float, int, int]] = {rho: (0.0, 0, 0) for rho in rhos}
    original = robust.peer_screen

    def spy(view: Any, uploads: Any, suspects: Any = ()) -> dict[int, str]:
        sizes = {c: max(float(w), 1.0) for c, w in uploads}
        norms = {c: view.peer_sq[c] ** 0.5 for c in sizes if c in view.peer_sq}
        med = robust._median(list(norms.values())) if len(norms) >= robust.PEER_MIN else 0.0
        if med > 0:  # the guard's own condition: a scale to measure against
            ref = robust._median([view.peer_ref_sq[c] ** 0.5 for c in norms])
            med_per = robust._median([n / sizes[c] for c, n in norms.items()])  # > 0 with med
            for rho in rhos:
                scale = max(med, rho * ref)
                for c, n in norms.items():
                    r = min(n / scale, n / sizes[c] / med_per)
                    if r > worst[rho][0]:
                        worst[rho] = (r, view.round_num, c)
            line = {rho: round(max(min(n / max(med, rho * ref), n / sizes[c] / med_per)
                                   for c, n in norms.items()), 2) for rho in rhos}  # fmt: skip
            print(f"round {view.round_num}: median update {med:.3g}, broadcast {ref:.3g}, "
                  f"largest ratio by rho {line}", flush=True)  # fmt: skip
        return original(view, uploads, suspects)

    robust.peer_screen = spy
    run_experiment(from_dict(raw), progress=False)
    for rho, (r, rnd, c) in worst.items():
        print(f"rho {rho:g}: largest honest ratio {r:.2f} (round {rnd}, client {c})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods", default=None, help="default: every family (--row-spread: the row-sharing ones)"
    )
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--rounds", type=int, default=None, help="default: 8 (--row-spread: 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attackers", type=int, default=1, help="clients 0..N-1 attack together")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table", type=Path, default=None, help="print the docs' table of this JSON")
    p.add_argument(
        "--row-spread",
        action="store_true",
        help="honest rows' largest distance / scale on the default experiment's data, by holders",
    )
    p.add_argument(
        "--update-spread",
        type=Path,
        default=None,
        metavar="CONFIG",
        help="honest update norms of one run (a TOML config or a results.json), by floor",
    )
    a = p.parse_args(argv)
    if a.update_spread is not None:
        torch.set_num_threads(1)
        update_spread(a.update_spread, a.rounds)
        return 0
    if a.row_spread:
        torch.set_num_threads(1)
        row_spread((a.methods or ",".join(ROW_METHODS)).split(","), a.rounds or 20)
        return 0
    if a.table is not None:
        print(compact(json.loads(a.table.read_text())))
        return 0
    torch.set_num_threads(1)
    a.rounds = a.rounds or 8
    rows: list[dict[str, Any]] = []
    for name in (a.methods or ",".join(METHODS)).split(","):
        for rule in a.rules.split(","):
            for attack in ("none", *a.attacks.split(",")):
                rows.append(run(name, attack, rule, a.rounds, a.seed, a.attackers))
                r = rows[-1]
                print(
                    f"{name} {rule} {attack}: acc {r['acc']:.4f} attacker dropped "
                    f"{r['attacker_dropped']}/{a.rounds * a.attackers} honest drops {r['honest_dropped']} "
                    f"({r['seconds']:.1f} s)",
                    flush=True,
                )
                if a.out is not None:
                    a.out.parent.mkdir(parents=True, exist_ok=True)
                    doc = {"rounds": a.rounds, "seed": a.seed, "rows": rows}
                    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows, a.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
