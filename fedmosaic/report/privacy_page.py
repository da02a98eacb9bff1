"""The privacy suite's page: accuracy and the measured leak against epsilon, per method, from
the committed cells, with the two figures (accuracy against epsilon, attack AUC against
epsilon).

    .venv/bin/python -m fedmosaic.report.privacy_page      # docs/results/privacy/<suite>.md

Each row groups one method's cells at one epsilon (read from each cell's config: the method's
name, ``privacy.mechanism`` and ``privacy.epsilon``; no privacy is epsilon infinity). Per row:
the final test-size-weighted accuracy and the membership attack's AUC and TPR at 1% FPR
(``eval.membership``, means over clients), each the mean over seeds with its 95% t-interval,
the seeds whose training diverged, and the paired differences to the same method without
privacy (95% t-interval; one that contains 0 is inconclusive). These are descriptions of the
cells; the verdicts the suite's analysis plan fixed (error rates controlled) are on the claims
page.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmosaic.report.claims import RESULTS, load_cells
from fedmosaic.report.results import save_figure, write_atomic
from fedmosaic.report.suite_report import aggregate

SUITE = "privacy_fmnist"
ROOT = RESULTS / "privacy"  # the plan's budget folder
INF = math.inf


def epsilon_of(doc: dict[str, Any]) -> float:
    """The epsilon a cell was run at: ``privacy.epsilon`` (or its target) under a mechanism,
    infinity without one."""
    priv = doc.get("config", {}).get("privacy", {})
    if priv.get("mechanism", "none") == "none":
        return INF
    return float(priv.get("epsilon") or priv.get("target_epsilon") or INF)


def _pct(v: Any) -> float | None:
    return None if v is None else 100.0 * float(v)


def values(doc: dict[str, Any]) -> dict[str, float | None]:
    """One cell's numbers: final accuracy (%), attack AUC and TPR (x 100), diverged rounds."""
    s = doc.get("summary", {})
    m = s.get("membership", {})
    return {
        "acc": _pct(s.get("final", {}).get("acc_weighted")),
        "auc": _pct(m.get("mia_auc")),
        "tpr": _pct(m.get("mia_tpr")),
        "diverged": float(s.get("diverged_rounds", 0)),
    }


def rows(cells: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, epsilon), methods in their first-seen order, epsilon from infinity
    down; paired differences to the method's cells without privacy on the same seed."""
    groups: dict[tuple[str, float], dict[int, dict[str, Any]]] = {}
    for (_, _, seed), doc in sorted(cells.items()):
        name = str(doc.get("config", {}).get("algorithm", {}).get("name", "?"))
        groups.setdefault((name, epsilon_of(doc)), {})[seed] = doc
    order = list(dict.fromkeys(name for name, _ in groups))
    out = []
    for name in order:
        base = groups.get((name, INF), {})
        for eps in sorted((e for n, e in groups if n == name), reverse=True):
            docs = groups[(name, eps)]
            vals = {seed: values(doc) for seed, doc in docs.items()}
            row: dict[str, Any] = {"method": name, "epsilon": eps, "seeds": sorted(docs)}
            for key in ("acc", "auc", "tpr"):
                row[key] = aggregate([v[key] for v in vals.values()])
            row["diverged_seeds"] = sum(1 for v in vals.values() if v["diverged"])
            first = next(iter(docs.values()))
            priv = first.get("config", {}).get("privacy", {})
            row["noise_multiplier"] = priv.get("noise_multiplier") if eps < INF else None
            row["clip"] = priv.get("clip") if eps < INF else None
            for key in ("acc", "auc"):
                diffs = []
                for seed, v in vals.items():
                    x = v[key]
                    y = values(base[seed])[key] if seed in base else None
                    if eps < INF and x is not None and y is not None:
                        diffs.append(x - y)
                row[f"{key}_vs_none"] = aggregate(diffs) if eps < INF else None
            out.append(row)
    return out


def _mean(agg: dict[str, Any], digits: int) -> str:
    if agg["mean"] is None:
        return "-"
    ci = "n/a" if agg["ci95"] is None else f"{agg['ci95']:.{digits}f}"
    return f"{agg['mean']:.{digits}f} ± {ci}"


def _gap(agg: dict[str, Any] | None, digits: int) -> str:
    if agg is None or agg["mean"] is None:
        return "-"
    m, h = agg["mean"], agg["ci95"]
    if h is None:
        return f"{m:+.{digits}f} (1 seed)"
    word = " (inconclusive)" if m - h <= 0 <= m + h else ""
    return f"{m:+.{digits}f} [{m - h:+.{digits}f}, {m + h:+.{digits}f}]{word}"


def _eps(e: float) -> str:
    return "inf" if e == INF else f"{e:g}"


def markdown(table: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| method | epsilon | noise multiplier | clip | seeds | diverged | accuracy (%) "
        "| vs no privacy (points) | attack AUC x 100 | vs no privacy | TPR at 1% FPR (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        z = "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.3g}"
        clip = "-" if r["clip"] is None else f"{r['clip']:g}"
        lines.append(
            f"| {r['method']} | {_eps(r['epsilon'])} | {z} | {clip} | {len(r['seeds'])} "
            f"| {r['diverged_seeds']} | {_mean(r['acc'], 2)} | {_gap(r['acc_vs_none'], 2)} "
            f"| {_mean(r['auc'], 2)} | {_gap(r['auc_vs_none'], 2)} | {_mean(r['tpr'], 2)} |"
        )
    return "\n".join(lines)


def figure(table: Sequence[dict[str, Any]], path: Path) -> list[Path]:
    """Accuracy and attack AUC against epsilon, one line per method (mean over seeds, 95%
    t-interval bars); epsilon on a log axis, no privacy drawn at the right as "inf"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({r["epsilon"] for r in table if r["epsilon"] < INF})
    inf_x = (finite[-1] * 2.5) if finite else 1.0  # where "no privacy" sits on the log axis
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = (("acc", "final test accuracy (%)"), ("auc", "membership attack AUC x 100"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name in dict.fromkeys(r["method"] for r in table):
            pts = [
                (inf_x if r["epsilon"] == INF else r["epsilon"], r[key])
                for r in table
                if r["method"] == name and r[key]["mean"] is not None
            ]
            if not pts:
                continue
            pts.sort()
            xs = [x for x, _ in pts]
            ys = [a["mean"] for _, a in pts]
            err = [a["ci95"] or 0.0 for _, a in pts]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xscale("log")
        ticks = [*finite, inf_x]
        ax.set_xticks(ticks)
        ax.set_xticklabels([*(f"{e:g}" for e in finite), "inf"])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (delta 1e-5, after the last round)")
        ax.set_ylabel(label)
        if key == "auc":
            ax.axhline(50.0, color="grey", lw=0.8, ls="--")  # chance
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def page(table: Sequence[dict[str, Any]], suite: str, figure_name: str) -> str:
    return (
        f"# Privacy against utility: {suite}\n\n"
        "<!-- generated by `python -m fedmosaic.report.privacy_page` from the committed cells -->\n\n"
        "Each row groups one method's cells at one epsilon: the final test-size-weighted "
        "accuracy and the loss-threshold membership attack on each client's evaluated model "
        "(AUC and TPR at 1% FPR, means over clients; 50 = chance), the mean over seeds with its "
        "95% t-interval, the seeds whose training diverged (rounds with no finite training "
        "loss; the run went on to its last round), and the paired differences to the same "
        "method without privacy. An interval that contains 0 is inconclusive. These describe the "
        "cells; the verdicts of the suite's analysis plan are on the claims page "
        "(`docs/results/claims.md`).\n\n"
        f"{markdown(table)}\n\n"
        f"![accuracy and attack AUC against epsilon]({figure_name}.png)\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default=SUITE)
    ap.add_argument("--root", type=Path, default=ROOT, help="the budget folder of the cells")
    args = ap.parse_args(argv)
    try:
        table = rows(load_cells(args.root, args.suite))
    except ValueError as exc:  # a cell's results.json that cannot be read, named
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not table:
        print(f"no cells under {args.root / args.suite / 'cells'}")
        return 1
    name = f"{args.suite}_epsilon"
    figure(table, args.root / f"{name}.png")
    write_atomic(args.root / f"{args.suite}.md", page(table, args.suite, name).encode())
    print(f"wrote {args.root / (args.suite + '.md')} and {name}.png/.svg/.pdf")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
