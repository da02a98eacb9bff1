"""The seed papers' headline claims, judged from finished comparison cells.

Each claim is a list of paired comparisons ``method`` vs ``baseline`` on one suite setting. Both
ran on the same seeds, and a seed fixes the split and the initial models. So the comparison is
made per seed: ``d_s = metric(method, s) - metric(baseline, s)``, in percentage points. It is
reported as the mean of ``d_s`` and the half-width of its 95% Student-t interval over the seeds
(:func:`fedmosaic.report.compare.aggregate`). The verdict follows the relation:

- ``above`` (the paper has ``method`` higher):
  - **holds** when the interval lies above 0 and the mean gap is at least half the paper's gap;
  - **holds in direction but smaller** when the mean gap is positive but the interval reaches 0,
    or the gap is under half the paper's;
  - **does not hold here** when the mean gap is 0 or negative.
- ``at_or_above`` (the paper has ``method`` level with or above):
  - **holds** when the mean gap is 0 or positive;
  - **holds (level: ...)** when it is negative but the interval contains 0: not distinguishable
    from level at these seeds, and said so;
  - **does not hold here** when the interval lies wholly below 0.
- ``lower`` (a cost the paper has lower: bytes, compute):
  - **holds** when ``method``'s mean is below ``baseline``'s and the ratio is at most the paper's
    ratio + 0.1;
  - **holds in direction but smaller** when it is below, but by less than that;
  - **does not hold here** otherwise.

From one seed there is no interval: the direction alone is reported, marked "1 seed". A claim's
verdict is its weakest comparison's.

The metric is the paper's:
- ``final``: test accuracy at the last round run (the plateau stop's round), in the suite's paper
  metric (weighted or unweighted over clients);
- ``after_finetune``: the same after local fine-tuning (FedBABU, layer expansion);
- ``common_round``: both runs' test accuracy at the last round both ran, for claims "at the same
  rounds";
- ``mean_over_rounds``: each run's test accuracy averaged over rounds 1..that round (the area
  under the learning curve, divided by the rounds): "at the same rounds" over the whole training;
- ``kb_per_round``: KB up + down per client per round;
- ``paper_cost_g``: layer expansion's Table 4 cost.

Never a best-over-rounds number: that selects the round on the test set.

    python -m fedmosaic.report.claims                   # docs/results/converged -> stdout
    python -m fedmosaic.report.claims --out docs/results/claims.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmosaic.report.compare import METRIC_KEYS, aggregate

HOLDS = "holds"
SMALLER = "holds in direction but smaller"
FAILS = "does not hold here"
LEVEL = HOLDS + " (level: below on average, 0 inside the interval)"
RANK = {FAILS: 0, SMALLER: 1, HOLDS: 2}

DEFAULT_CELLS = Path(__file__).resolve().parents[2] / "docs" / "results" / "converged"


@dataclass(frozen=True)
class Comparison:
    """``method`` against ``baseline`` on ``suite``/``setting``, as the paper has it."""

    suite: str
    setting: str
    method: str
    baseline: str
    relation: str = "above"  # above | at_or_above | lower
    # final | after_finetune | common_round | mean_over_rounds | kb_per_round | paper_cost_g
    metric: str = "final"
    accuracy: str = "weighted"  # the paper's: weighted | unweighted (accuracy metrics only)
    paper: tuple[float, float] | None = None  # the paper's (method, baseline) numbers
    paper_note: str = ""  # where the paper's numbers come from, when not this setting's


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    comparisons: tuple[Comparison, ...]


def _tgp(setting: str, base: str, paper: tuple[float, float]) -> Comparison:
    return Comparison("fedtgp_table10", setting, "fedtgp", base, paper=paper)


def _gh(baseline: str, paper: tuple[float, float], note: str = "CIFAR-10", **kw: Any) -> Comparison:
    return Comparison(
        "fedgh_table3",
        "pathological",
        "fedgh",
        baseline,
        accuracy="unweighted",
        paper=paper,
        paper_note=note,
        **kw,
    )


def _le(method: str, relation: str, metric: str, paper: tuple[float, float]) -> Comparison:
    note = "MNIST, 100 rounds" if metric == "after_finetune" else "Table 4, G"
    return Comparison(
        "layer_expansion",
        "dir01",
        method,
        "fedbabu",
        relation=relation,
        metric=metric,
        paper=paper,
        paper_note=note,
    )


_TGP_PAPER = {  # Table 10, FMNIST, best-over-rounds test accuracy after 1000 rounds
    "pathological": {
        "fedtgp": 99.56,
        "fedproto": 99.48,
        "lg_fedavg": 99.39,
        "feddistill": 99.47,
        "fml": 99.42,
        "fedkd": 99.37,
        "fedgen": 99.38,
    },
    "practical": {
        "fedtgp": 97.58,
        "fedproto": 97.46,
        "lg_fedavg": 97.23,
        "feddistill": 97.48,
        "fml": 97.36,
        "fedkd": 97.30,
        "fedgen": 97.35,
    },
}
_TGP_BASELINES = ("fedproto", "lg_fedavg", "feddistill", "fml", "fedkd", "fedgen")

CLAIMS: tuple[Claim, ...] = (
    Claim(
        "fedtgp",
        "FedTGP above FedProto, LG-FedAvg, FD, FML, FedKD and FedGen (Table 10, HtCNN8, 20 clients)",
        tuple(
            _tgp(s, b, (_TGP_PAPER[s]["fedtgp"], _TGP_PAPER[s][b]))
            for s in ("pathological", "practical")
            for b in _TGP_BASELINES
        ),
    ),
    Claim(
        "fedtgp_code",
        "The same, with FedTGP's client term as the authors' code has it (MSE over the batch, "
        "lambda = 10: fedtgp_mse) where the paper writes the Euclidean distance with lambda = 0.1",
        tuple(
            Comparison(
                "fedtgp_table10",
                s,
                "fedtgp_mse",
                b,
                paper=(_TGP_PAPER[s]["fedtgp"], _TGP_PAPER[s][b]),
            )
            for s in ("pathological", "practical")
            for b in _TGP_BASELINES
        ),
    ),
    Claim(
        "fedtgp_mechanism",
        "FedTGP's trained, margin-separated prototypes beat FedProto's averaged ones at the same "
        "round (nearest-prototype inference)",
        tuple(
            Comparison("fedtgp_table10", s, "fedtgp", "fedproto", metric=m)
            for s in ("pathological", "practical")
            for m in ("mean_over_rounds", "common_round")
        ),
    ),
    Claim(
        "fedclassavg",
        "FedClassAvg above Local, FedProto and KT-pFL (Table 2, FMNIST Dir(0.5), 20 clients)",
        tuple(
            Comparison(
                "fedclassavg_table2",
                "dir05",
                "fedclassavg",
                b,
                accuracy="unweighted",
                paper=(93.03, p),
                paper_note="ResNet-18/ShuffleNetV2/GoogLeNet/AlexNet",
            )
            for b, p in (("local", 88.40), ("fedproto", 60.42), ("ktpfl", 90.39))
        ),
    ),
    Claim(
        "fedclassavg_ablation",
        "FedClassAvg's ablation (Table 4): proximal regularization helps with and without the "
        "contrastive loss (CA < CA+PR, CA+CL < CA+PR+CL)",
        (
            Comparison(
                "fedclassavg_ablation",
                "dir05",
                "ca_pr",
                "ca",
                accuracy="unweighted",
                paper=(89.71, 85.78),
            ),
            Comparison(
                "fedclassavg_ablation",
                "dir05",
                "ca_pr_cl",
                "ca_cl",
                accuracy="unweighted",
                paper=(93.03, 92.40),
            ),
        ),
    ),
    Claim(
        "fedgh",
        "FedGH above LG-FedAvg and FedProto (Table 3 setting, 5 CNNs, 10 clients, pathological), "
        "and its communication below LG-FedAvg's",
        (
            _gh("lg_fedavg", (97.60, 96.37)),
            _gh("fedproto", (97.60, 96.47)),
            _gh(
                "lg_fedavg",
                (23.45, 39.14),
                relation="lower",
                metric="kb_per_round",
                note="CIFAR-10, KB/client/round",
            ),
        ),
    ),
    Claim(
        "fedhenn",
        "FedHeNN above Local with heterogeneous models (5 CNNs, 2 or 5 classes per client)",
        tuple(
            Comparison("fedhenn_5cnn", s, "fedhenn_linear", "local", accuracy="unweighted")
            for s in ("cls2", "cls5")
        ),
    ),
    Claim(
        "layer_expansion",
        "Vanilla and Anti scheduling at or above FedBABU after fine-tuning, at lower training "
        "compute (Table 2 / Table 4; shallow CNN, 100 clients, 10%, Dir(0.1))",
        (
            _le("fedseq_vanilla", "at_or_above", "after_finetune", (98.21, 98.19)),
            _le("fedseq_anti", "at_or_above", "after_finetune", (98.34, 98.19)),
            _le("fedseq_vanilla", "lower", "paper_cost_g", (314.912, 865.344)),
            _le("fedseq_anti", "lower", "paper_cost_g", (838.880, 865.344)),
        ),
    ),
)

ACCURACY_METRICS = ("final", "after_finetune", "common_round", "mean_over_rounds")


def load_cells(root: Path, suite: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """``(setting, method, seed) -> results document`` of a suite's finished cells under ``root``
    (``root/<suite>/cells/<setting>/<method>/seed<k>/results.json``)."""
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    base = root / suite / "cells"
    for path in sorted(base.glob("*/*/seed*/results.json")):
        seed_dir = path.parent
        try:
            seed = int(seed_dir.name.removeprefix("seed"))
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: not a cell's results.json ({exc})") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
            raise ValueError(f"{path}: not a cell's results.json (no summary table)")
        out[(seed_dir.parent.parent.name, seed_dir.parent.name, seed)] = doc
    return out


def _at_round(doc: dict[str, Any], round_num: int, key: str) -> float | None:
    for r in doc.get("rounds", []):
        if int(r["round"]) == round_num and r.get(key) is not None:
            return float(r[key])
    return None


def _last_evaluated(doc: dict[str, Any], key: str) -> int:
    rounds = [int(r["round"]) for r in doc.get("rounds", []) if r.get(key) is not None]
    return max(rounds) if rounds else 0


def pair_values(
    c: Comparison, a: dict[str, Any], b: dict[str, Any]
) -> tuple[float | None, float | None, int | None]:
    """The metric of ``method`` (doc ``a``) and ``baseline`` (doc ``b``) on one seed (accuracies in
    %), and the round it was read at where that matters (``common_round``)."""
    sa, sb = a.get("summary", {}), b.get("summary", {})
    if c.metric in ("final", "after_finetune"):
        key = METRIC_KEYS[c.accuracy]
        va, vb = sa.get(c.metric, {}).get(key), sb.get(c.metric, {}).get(key)
        return _pct(va), _pct(vb), None
    if c.metric == "common_round":
        key = METRIC_KEYS[c.accuracy]
        r = min(_last_evaluated(a, key), _last_evaluated(b, key))
        return _pct(_at_round(a, r, key)), _pct(_at_round(b, r, key)), r
    if c.metric == "mean_over_rounds":
        key = METRIC_KEYS[c.accuracy]
        r = min(_last_evaluated(a, key), _last_evaluated(b, key))
        both = [
            (x, y)
            for t in range(1, r + 1)
            if (x := _at_round(a, t, key)) is not None and (y := _at_round(b, t, key)) is not None
        ]
        if not both:
            return None, None, r
        return (
            _pct(sum(x for x, _ in both) / len(both)),
            _pct(sum(y for _, y in both) / len(both)),
            r,
        )
    if c.metric == "kb_per_round":

        def kb(s: dict[str, Any]) -> float | None:
            up, down = (
                s.get("bytes_up_per_client_per_round"),
                s.get("bytes_down_per_client_per_round"),
            )
            return None if up is None or down is None else (float(up) + float(down)) / 1024

        return kb(sa), kb(sb), None
    if c.metric == "paper_cost_g":
        ca, cb = sa.get("paper_cost_total"), sb.get("paper_cost_total")
        return (
            None if ca is None else float(ca) / 1e9,
            None if cb is None else float(cb) / 1e9,
            None,
        )
    raise ValueError(f"unknown comparison metric {c.metric!r}")


def _pct(v: Any) -> float | None:
    return None if v is None else 100.0 * float(v)


def verdict(c: Comparison, diff: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> str:
    """The verdict of one comparison from the aggregated per-seed differences (see the module
    docstring); ``a``/``b``: the method's and baseline's aggregates."""
    mean, ci, n = diff["mean"], diff["ci95"], diff["n"]
    if n == 0 or mean is None:
        return "not run"
    one = n == 1 or ci is None
    if c.relation == "above":
        if mean <= 0:
            return FAILS
        if one:
            return SMALLER + " (1 seed)" if _short(c, mean) else HOLDS + " in direction (1 seed)"
        return SMALLER if mean - ci <= 0 or _short(c, mean) else HOLDS
    if c.relation == "at_or_above":
        if one:
            return (HOLDS if mean >= 0 else FAILS) + " (1 seed, direction only)"
        if mean + ci < 0:
            return FAILS
        return HOLDS if mean >= 0 else LEVEL
    if c.relation == "lower":
        ma, mb = a["mean"], b["mean"]
        mark = " (1 seed)" if one else ""
        if ma is None or mb is None or ma >= mb:
            return FAILS + mark
        if c.paper is not None and mb > 0 and ma / mb > c.paper[0] / c.paper[1] + 0.1:
            return SMALLER + mark
        return HOLDS + mark
    raise ValueError(f"unknown relation {c.relation!r}")


def _short(c: Comparison, mean_gap: float) -> bool:
    """Whether the gap is under half the paper's (never, without a paper gap)."""
    if c.paper is None:
        return False
    paper_gap = c.paper[0] - c.paper[1]
    return paper_gap > 0 and mean_gap < 0.5 * paper_gap


def judge(c: Comparison, cells: dict[tuple[str, str, int], dict[str, Any]]) -> dict[str, Any]:
    """The per-seed values, their aggregates and the verdict of one comparison."""
    seeds = sorted(
        s
        for (st, m, s) in cells
        if st == c.setting and m == c.method and (c.setting, c.baseline, s) in cells
    )
    va, vb, vd, rounds = [], [], [], []
    for s in seeds:
        x, y, r = pair_values(c, cells[(c.setting, c.method, s)], cells[(c.setting, c.baseline, s)])
        if x is None or y is None:
            continue
        va.append(x)
        vb.append(y)
        vd.append(x - y)
        if r is not None:
            rounds.append(r)
    a, b, d = aggregate(va), aggregate(vb), aggregate(vd)
    return {
        "comparison": c,
        "seeds": seeds,
        "method": a,
        "baseline": b,
        "diff": d,
        "rounds": rounds,
        "verdict": verdict(c, d, a, b),
    }


def claim_verdict(verdicts: Sequence[str]) -> str:
    """The weakest of a claim's comparison verdicts ("not run" if any is)."""
    if not verdicts or any(v == "not run" for v in verdicts):
        return "not run (cells missing)"
    return min(verdicts, key=lambda v: RANK[next(k for k in RANK if v.startswith(k))])


def evaluate(root: Path = DEFAULT_CELLS) -> list[dict[str, Any]]:
    """Every claim's comparisons judged from the cells under ``root``."""
    cache: dict[str, dict[tuple[str, str, int], dict[str, Any]]] = {}
    out = []
    for claim in CLAIMS:
        judged = []
        for c in claim.comparisons:
            if c.suite not in cache:
                cache[c.suite] = load_cells(root, c.suite)
            judged.append(judge(c, cache[c.suite]))
        out.append(
            {
                "claim": claim,
                "comparisons": judged,
                "verdict": claim_verdict([j["verdict"] for j in judged]),
            }
        )
    return out


def budget_rows(root: Path = DEFAULT_CELLS) -> list[dict[str, Any]]:
    """Per suite folder under ``root``: its cells, seeds, data fractions, rounds run, the wall
    hours they took on this machine and the code versions (source hashes) that produced them."""
    rows = []
    for suite_dir in sorted(p for p in root.iterdir() if (p / "cells").is_dir()):
        docs = load_cells(root, suite_dir.name)
        if not docs:
            continue
        rounds = [int(d.get("summary", {}).get("rounds_run") or 0) for d in docs.values()]
        fractions = {
            d.get("config", {}).get("data", {}).get("subsample", 1.0) for d in docs.values()
        }
        codes = {
            (d.get("provenance", {}).get("code", {}).get("source_hash") or "?")[:12]
            for d in docs.values()
        }
        rows.append(
            {
                "suite": suite_dir.name,
                "cells": len(docs),
                "seeds": sorted({s for _, _, s in docs}),
                "fractions": sorted(fractions),
                "rounds": (min(rounds), max(rounds)),
                "hours": sum(float(d.get("wall_seconds") or 0.0) for d in docs.values()) / 3600,
                "codes": sorted(codes),
            }
        )
    return rows


def budget_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| suite | cells | seeds | FMNIST fraction | rounds run | wall hours (2 cores) | code |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['suite']} | {r['cells']} | {', '.join(map(str, r['seeds']))} | "
            f"{', '.join(f'{f:g}' for f in r['fractions'])} | {r['rounds'][0]}-{r['rounds'][1]} | "
            f"{r['hours']:.2f} | {', '.join(r['codes'])} |"
        )
    total = sum(r["hours"] for r in rows)
    lines.append(f"| all | {sum(r['cells'] for r in rows)} | | | | {total:.2f} | |")
    return "\n".join(lines) + "\n"


def _num(agg: dict[str, Any], digits: int = 2) -> str:
    if agg["mean"] is None:
        return "-"
    if agg["ci95"] is None:
        return f"{agg['mean']:.{digits}f}"
    return f"{agg['mean']:.{digits}f} ± {agg['ci95']:.{digits}f}"


def _metric_label(c: Comparison) -> str:
    if c.metric == "kb_per_round":
        return "KB/client/round (up + down)"
    if c.metric == "paper_cost_g":
        return "Table 4 cost (G)"
    acc = "weighted" if c.accuracy == "weighted" else "unweighted"
    where = {
        "final": "final",
        "after_finetune": "after fine-tune",
        "common_round": "same round",
        "mean_over_rounds": "mean over rounds 1..r",
    }
    return f"{where[c.metric]} acc, {acc} (%)"


def summary_markdown(results: Sequence[dict[str, Any]]) -> str:
    """One row per claim: its verdict, the seeds behind it and its comparisons' verdicts."""
    lines = ["| claim | verdict | seeds | comparisons |", "|---|---|---|---|"]
    for res in results:
        ns = sorted({j["diff"]["n"] for j in res["comparisons"]})
        counts: dict[str, int] = {}
        for j in res["comparisons"]:
            counts[j["verdict"]] = counts.get(j["verdict"], 0) + 1
        parts = ", ".join(f"{k} {v}" for v, k in sorted(counts.items(), key=lambda kv: kv[0]))
        seeds = "-".join(str(n) for n in (ns[0], ns[-1])) if ns[0] != ns[-1] else str(ns[0])
        lines.append(f"| {res['claim'].title} | **{res['verdict']}** | {seeds} | {parts} |")
    return "\n".join(lines) + "\n"


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """One table per claim: per comparison the two methods, the paired gap, the paper's, the
    verdict."""
    lines = [summary_markdown(results)]
    for res in results:
        claim = res["claim"]
        lines += [f"#### {claim.title}", "", f"**Verdict: {res['verdict']}.**", ""]
        lines.append(
            "| setting | method vs baseline | metric | seeds | method | baseline | gap (paired) | "
            "paper | verdict |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for j in res["comparisons"]:
            c: Comparison = j["comparison"]
            paper = "-"
            if c.paper is not None:
                paper = f"{c.paper[0]:g} vs {c.paper[1]:g}"
                if c.relation != "lower":
                    paper += f" ({c.paper[0] - c.paper[1]:+.2f})"
                if c.paper_note:
                    paper += f" ({c.paper_note})"
            metric = _metric_label(c)
            if j["rounds"]:
                metric += f" (rounds {min(j['rounds'])}-{max(j['rounds'])})"
            lines.append(
                f"| {c.setting} | {c.method} vs {c.baseline} | {metric} | {j['diff']['n']} | "
                f"{_num(j['method'])} | {_num(j['baseline'])} | {_signed(j['diff'])} | {paper} | "
                f"{j['verdict']} |"
            )
        lines.append("")
    lines.append(
        "Values: mean ± half-width of the 95% t-interval over seeds; the gap is the mean of the "
        "per-seed differences (same seed = same split and initial models) with its interval."
    )
    return "\n".join(lines) + "\n"


def _signed(agg: dict[str, Any]) -> str:
    if agg["mean"] is None:
        return "-"
    s = f"{agg['mean']:+.2f}"
    return s if agg["ci95"] is None else f"{s} ± {agg['ci95']:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedmosaic.report.claims", description=__doc__.split("\n")[0]
    )
    p.add_argument("--cells", type=Path, default=DEFAULT_CELLS, help="folder of <suite>/cells/...")
    p.add_argument("--out", type=Path, help="write the Markdown here (default: stdout)")
    args = p.parse_args(argv)
    if not args.cells.is_dir():
        print(f"error: --cells {args.cells} is not a folder", file=sys.stderr)
        return 2
    try:
        text = markdown(evaluate(args.cells))
        text += "\n#### The cells behind these verdicts\n\n"
        text += budget_markdown(budget_rows(args.cells))
        if args.out is None:
            sys.stdout.write(text)
        else:  # written whole or not at all
            tmp = args.out.with_suffix(args.out.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(args.out)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CLAIMS", "Claim", "Comparison", "evaluate", "judge", "markdown", "verdict"]
