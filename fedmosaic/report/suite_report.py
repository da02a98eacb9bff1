"""The report of a comparison grid: one table (Markdown + CSV + HTML), curves, client spread.

Accuracies are shown in % as mean ± the half-width of the 95% Student-t confidence interval of the
mean over seeds, from 3 seeds or more (``MIN_SEEDS_FOR_CI``); from two, "± n/a" and the seeds'
range (a t-interval from two seeds is 12.7 standard errors wide: noise, not a statement); from
one, "± n/a". ``table.csv`` holds fractions with the sample std (ddof=1), ci95 and n as computed.
1 kB = 1000 bytes, 1 MB = 10^6 bytes. Each is a statistic of one run:

Accuracy is the metric named by ``suite.paper_metric`` (the paper's metric when the suite has a
paper; the headers say "the paper's metric" only then): ``weighted`` =
test-size-weighted over all clients (HtFLlib/PFLlib, FedTGP), ``unweighted`` = the plain mean of
per-client accuracies (FedGH, FedClassAvg); the other metric's final accuracy stands beside it.

- final: test accuracy at the last round;
- final (other metric): the same in the metric the paper does not report;
- after fine-tune: the same after the method's local fine-tuning (FedBABU, layer expansion);
- final acc, <mode>: every other accuracy a method reports beside its headline (FedProto's
  ``head`` classifier beside its nearest-prototype headline, FML's ``meme`` model, ...);
- best on val: test accuracy at the round with the best validation accuracy (needs a validation
  split; ``-`` without one);
- best on test: the maximum test accuracy over rounds, *as the papers report it* (optimistic:
  it selects the round on the test set);
- client std: the spread of per-client final accuracies (std over clients);
- rounds to target: first round whose test accuracy (paper metric) reaches the suite's target, mean over the
  seeds that reached it (``k/n`` of the seeds did);
- kB up / down per client per round; MB to target: all clients' traffic (up + down) until then;
- s/round: wall-clock seconds per round on this machine.
"""

from __future__ import annotations

import csv
import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedmosaic import provenance
from fedmosaic.report.results import STAR_SHIFT, accuracy_modes, save_figure
from fedmosaic.report.suite import Cell, Suite

if TYPE_CHECKING:
    from fedmosaic.config import ExperimentConfig

METRICS: tuple[tuple[str, str, str], ...] = (
    # key, column label, unit (pct | int | kb | mb | s)
    ("final", "final acc", "pct"),
    ("final_other", "final acc", "pct"),  # the other metric; labels name both (``_columns``)
    ("after_finetune", "after fine-tune", "pct"),
    ("holdout_before", "newcomers on arrival", "pct"),  # eval.holdout_clients (README)
    ("holdout_after", "newcomers after one local round", "pct"),
    ("best_on_val", "best-on-val acc", "pct"),
    ("best_on_test", "best-on-test acc (as the papers report it)", "pct"),
    ("client_std", "per-client std", "pct"),
    ("rounds_run", "rounds run (plateau stop)", "int"),  # train.plateau_delta > 0 only
    ("rounds_to_target", "rounds to target", "int"),
    ("kb_up", "kB up /client/round", "kb"),
    ("kb_down", "kB down /client/round", "kb"),
    ("mb_to_target", "MB to target (all clients)", "mb"),
    ("seconds_per_round", "s/round", "s"),
    # Training compute over all clients and rounds, where the method reports it (layer expansion,
    # FedBABU): the paper's Table 4 measure (trainable parameters x examples, in G, the paper's
    # "FLOPs"), and forward + backward multiply-accumulates in T.
    ("paper_cost_g", "Table 4 cost: trainable params x examples (G)", "g"),
    ("train_tmacs", "train TMACs fwd+bwd", "tflop"),
    ("epsilon", "epsilon spent ([privacy], at its delta)", "eps"),
    # eval.membership: the loss-threshold attack on the clients' final models
    ("mia_auc", "membership attack AUC (0.5 = chance)", "auc"),
    ("mia_tpr", "attack TPR at 1% FPR", "auc"),
)

METRIC_KEYS = {"weighted": "acc_weighted", "unweighted": "acc_mean"}
METRIC_SUFFIX = {"weighted": "_weighted", "unweighted": "_mean"}
MIN_SEEDS_FOR_CI = 3  # a 95% t-interval from 2 seeds is +-12.7 standard errors: shown as n/a
METRIC_NAMES = {"weighted": "test-size-weighted", "unweighted": "unweighted mean over clients"}


def _best(rounds: Sequence[dict[str, Any]], select: str, key: str) -> float | None:
    """``key`` at the first round that maximizes ``select`` (None if no round has both)."""
    have = [r for r in rounds if r.get(select) is not None and r.get(key) is not None]
    return max(have, key=lambda r: r[select])[key] if have else None


def run_metrics(
    doc: dict[str, Any], target: float | None, metric: str = "weighted"
) -> dict[str, float | None]:
    """The per-run statistics of one results document (None where not defined).

    ``metric``: the accuracy the paper reports (``weighted`` | ``unweighted``); best-on-test and
    best-on-val select their round by that metric too.
    """
    s = doc.get("summary", {})
    key = METRIC_KEYS[metric]
    other = METRIC_KEYS["unweighted" if metric == "weighted" else "weighted"]
    evaluated = [r for r in doc.get("rounds", []) if r.get(key) is not None]
    out: dict[str, float | None] = {
        "final": s.get("final", {}).get(key),
        "final_other": s.get("final", {}).get(other),
        "after_finetune": s.get("after_finetune", {}).get(key),
        "holdout_before": s.get("holdout", {}).get("before", {}).get(key),
        "holdout_after": s.get("holdout", {}).get("after", {}).get(key),
        "best_on_val": _best(evaluated, f"val_{key}", key),
        "best_on_test": _best(evaluated, key, key),
        "client_std": s.get("final", {}).get("acc_std"),
        "kb_up": _div(s.get("bytes_up_per_client_per_round"), 1000),
        "kb_down": _div(s.get("bytes_down_per_client_per_round"), 1000),
        "seconds_per_round": s.get("seconds_per_round"),
        "paper_cost_g": _div(s.get("paper_cost_total"), 1e9),
        "train_tmacs": _div(s.get("train_macs_total"), 1e12),
        "epsilon": s.get("epsilon"),
        "mia_auc": s.get("membership", {}).get("mia_auc"),
        "mia_tpr": s.get("membership", {}).get("mia_tpr"),
        "rounds_to_target": None,
        "mb_to_target": None,
        "rounds_run": None,
    }
    for mode in accuracy_modes(s.get("final", {})):  # acc_head, acc_meme, ...: beside the headline
        out[f"final_{mode}"] = s["final"].get(mode + METRIC_SUFFIX[metric])
    if (doc.get("config", {}).get("train", {}).get("plateau_delta") or 0) > 0:
        out["rounds_run"] = s.get("rounds_run")
    if target is not None:
        total = 0.0
        for r in doc.get("rounds", []):
            total += (r.get("bytes_up") or 0) + (r.get("bytes_down") or 0)
            acc = r.get(key)
            if acc is not None and acc >= target:
                out["rounds_to_target"] = float(r["round"])
                out["mb_to_target"] = total / 1e6
                break
    return out


def _div(v: Any, d: float) -> float | None:
    return None if v is None else float(v) / d


def aggregate(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std (ddof=1), and the half-width of the 95% Student-t confidence interval of
    the mean over the defined values (``ci95 = t_{0.975, n-1} * std / sqrt(n)``; None for one
    value: no interval from one seed), and how many values were defined."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return {"mean": None, "std": None, "ci95": None, "n": 0, "of": len(values)}
    n = len(vals)
    std = ci = None
    if n > 1:
        from scipy.stats import t  # type: ignore[import-untyped]  # scipy ships no type information

        std = float(np.std(vals, ddof=1))
        ci = float(t.ppf(0.975, n - 1)) * std / math.sqrt(n)
    return {
        "mean": float(np.mean(vals)),
        "std": std,
        "ci95": ci,
        "n": n,
        "of": len(values),
        "min": min(vals),
        "max": max(vals),
    }


def summarize_grid(
    suite: Suite, cells: Sequence[Cell], docs: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per (setting, method): aggregated metrics over its seeds."""
    rows = []
    order: list[tuple[str, str]] = []
    for c in cells:
        if (c.setting.label, c.method.label) not in order:
            order.append((c.setting.label, c.method.label))
    for setting, method in order:
        mine = [c for c in cells if c.setting.label == setting and c.method.label == method]
        per_run = [
            run_metrics(docs[c.key], suite.target_accuracy, suite.paper_metric)
            for c in mine
            if c.key in docs
        ]
        row: dict[str, Any] = {
            "setting": setting,
            "method": method,
            "seeds": [c.seed for c in mine if c.key in docs],
            "reference": suite.reference.get(setting, {}).get(method, ""),
        }
        for key, _, _ in METRICS:
            row[key] = aggregate([m[key] for m in per_run])
        for key in dict.fromkeys(k for m in per_run for k in m if k.startswith("final_acc_")):
            row[key] = aggregate([m.get(key) for m in per_run])
        rows.append(row)
    for key in _mode_keys(rows):  # a method without that mode: "-" in its column
        for row in rows:
            row.setdefault(key, aggregate([]))
    return rows


def _mode_keys(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``final_acc_<mode>`` of every mode some row reports, first seen first."""
    return list(dict.fromkeys(k for r in rows for k in r if k.startswith("final_acc_")))


def fmt(agg: dict[str, Any], unit: str, with_count: bool = False) -> str:
    """``mean ± ci95`` for accuracies from ``MIN_SEEDS_FOR_CI`` seeds (``± n/a`` below, with the
    seeds' range from two), the mean for costs."""
    if agg["mean"] is None:
        return "-"
    m = agg["mean"]
    ci = agg.get("ci95") if agg.get("n", 0) >= MIN_SEEDS_FOR_CI else None
    spread = agg.get("n", 0) > 1 and ci is None and agg.get("min") != agg.get("max")
    if unit == "pct":
        text = f"{100 * m:.2f} ± " + ("n/a" if ci is None else f"{100 * ci:.2f}")
        if spread:
            text += f" (range {100 * agg['min']:.2f}-{100 * agg['max']:.2f})"
    elif unit == "int":
        text = f"{m:.1f} ± {ci:.1f}" if ci is not None else f"{m:.0f}"
        if spread:
            text += f" (range {agg['min']:.0f}-{agg['max']:.0f})"
    elif unit == "kb":
        text = f"{m:.1f}"
    elif unit == "mb":
        text = f"{m:.2f}"
    elif unit == "tflop":
        text = f"{m:.3f}"
    elif unit == "g":
        text = f"{m:.1f}"
    elif unit == "eps":
        text = f"{m:.3g}"
    elif unit == "auc":
        text = f"{m:.3f}" + ("" if ci is None else f" ± {ci:.3f}")
    else:
        text = f"{m:.2f}"
    if with_count and agg["n"] < agg["of"]:
        text += f" ({agg['n']}/{agg['of']})"
    return text


# Columns shown only where some method reports them.
OPTIONAL_METRICS = (
    "after_finetune",
    "holdout_before",
    "holdout_after",
    "best_on_val",
    "paper_cost_g",
    "train_tmacs",
    "rounds_run",
    "epsilon",
    "mia_auc",
    "mia_tpr",
)


def _columns(rows: Sequence[dict[str, Any]], suite: Suite) -> list[tuple[str, str, str]]:
    cols = []
    other = "unweighted" if suite.paper_metric == "weighted" else "weighted"
    for key, label, unit in METRICS:
        if key in ("rounds_to_target", "mb_to_target") and suite.target_accuracy is None:
            continue
        if key in OPTIONAL_METRICS and all(r.get(key, {}).get("mean") is None for r in rows):
            continue
        if key == "final":
            paper = ", the paper's metric" if suite.paper else ""
            label = f"final acc ({METRIC_NAMES[suite.paper_metric]}{paper})"
        elif key == "final_other":
            label = f"final acc ({METRIC_NAMES[other]})"
        cols.append((key, label, unit))
        if key == "final":  # every other accuracy the methods report, beside the headline
            cols += [(k, f"final acc, {k[len('final_acc_') :]}", "pct") for k in _mode_keys(rows)]
    return cols


def run_description(cells: Sequence[Cell]) -> str:
    """What the cells actually ran (after settings, --quick and --set), not the suite's title."""
    if not cells:
        return ""

    def values(get: Any) -> str:
        seen = list(dict.fromkeys(str(get(c.cfg)) for c in cells))
        return seen[0] if len(seen) == 1 else "/".join(seen)

    def rounds(cfg: ExperimentConfig) -> str:
        t = cfg.train
        if t.plateau_delta <= 0:
            return str(t.rounds)
        return (
            f"up to {t.rounds} (stopped once validation accuracy gained < "
            f"{100 * t.plateau_delta:g} points over the last {100 * t.plateau_window:g}% of rounds, "
            f"from round {t.plateau_min_rounds})"
        )

    return (
        f"{values(lambda c: c.data.dataset)}, {values(lambda c: c.data.num_clients)} clients, "
        f"{values(lambda c: c.data.partition)}, family {values(lambda c: c.model.family)}, "
        f"{values(rounds)} rounds, participation "
        f"{values(lambda c: c.train.participation)}, subsample {values(lambda c: c.data.subsample)}"
        f"; seeds {sorted({c.seed for c in cells})}"
    )


def _paper_budget(suite: Suite, cell: Cell) -> bool:
    """Whether the cell ran the paper's number of rounds (a plateau stop may end it earlier)."""
    t = cell.cfg.train
    return t.rounds == suite.paper_rounds and t.plateau_delta <= 0


def budget_note(suite: Suite, cells: Sequence[Cell]) -> str:
    """The paper's budget beside its numbers, and a marker when the cells ran another one."""
    if not suite.reference:
        return ""
    rounds = sorted({c.cfg.train.rounds for c in cells})
    parts = []
    if suite.paper_rounds is not None:
        parts.append(f"{suite.paper_rounds} rounds")
    if suite.paper_budget:
        parts.append(suite.paper_budget)
    text = "Paper numbers: " + (", ".join(parts) if parts else "budget not stated in the suite")
    if suite.paper_rounds is not None and any(not _paper_budget(suite, c) for c in cells):
        here = "/".join(map(str, rounds))
        if any(c.cfg.train.plateau_delta > 0 for c in cells):
            here = f"at most {here} (plateau stop)"
        text += (
            f". **Budget differs from the paper** ({here} rounds here against "
            f"{suite.paper_rounds}): compare directions, not the numbers"
        )
    return text + "."


def markdown_table(suite: Suite, rows: Sequence[dict[str, Any]], cells: Sequence[Cell] = ()) -> str:
    cols = _columns(rows, suite)
    has_ref = any(r["reference"] for r in rows)
    differs = suite.paper_rounds is not None and any(not _paper_budget(suite, c) for c in cells)
    paper_col = "paper" + (f" ({suite.paper_rounds} rounds) †" if differs else "")
    lines = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == setting]
        lines.append(f"### {setting}\n")
        header = ["method", "seeds", *[c[1] for c in cols]] + ([paper_col] if has_ref else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        for r in mine:
            line = [r["method"], str(len(r["seeds"]))]
            for key, _, unit in cols:
                line.append(fmt(r[key], unit, with_count=key == "rounds_to_target"))
            if has_ref:
                line.append(r["reference"] or "-")
            lines.append("| " + " | ".join(line) + " |")
        lines.append("")
    note = budget_note(suite, cells)
    if note and has_ref:
        lines.append(("† " if differs else "") + note + "\n")
    if suite.target_accuracy is not None:
        lines.append(
            f"Target accuracy: {100 * suite.target_accuracy:.1f}% "
            f"({METRIC_NAMES[suite.paper_metric]} test accuracy); "
            "`(k/n)`: k of n seeds reached it."
        )
    lines.append(
        f"Accuracies in %, mean ± half-width of the 95% t-interval over seeds (from "
        f"{MIN_SEEDS_FOR_CI} seeds; n/a below, with the seeds' range from two), "
        f"{METRIC_NAMES[suite.paper_metric]} accuracy "
        + ("(the metric the suite's paper reports) " if suite.paper else "")
        + "unless a column names the other; best-on-test "
        "selects the round on the test set, as the papers report it. 1 kB = 1000 bytes, "
        "1 MB = 10^6 bytes."
    )
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        header = ["setting", "method", "seeds"]
        keys = [key for key, _, _ in METRICS] + _mode_keys(rows)
        for key in keys:
            header += [f"{key}_mean", f"{key}_std", f"{key}_ci95", f"{key}_n"]
        header.append("paper")
        w.writerow(header)
        for r in rows:
            line: list[Any] = [r["setting"], r["method"], " ".join(map(str, r["seeds"]))]
            for key in keys:
                a = r[key]
                line += [
                    "" if a["mean"] is None else a["mean"],
                    "" if a["std"] is None else a["std"],
                    "" if a["ci95"] is None else a["ci95"],
                    a["n"],
                ]
            line.append(r["reference"])
            w.writerow(line)


# ---- plots ------------------------------------------------------------------------------------
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _setting_axes(cells: Sequence[Cell]) -> tuple[Any, list[str], Any, Any]:
    """pyplot, the settings in suite order, and a figure with one axes per setting."""
    plt = _plt()
    settings = list(dict.fromkeys(c.setting.label for c in cells))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
    return plt, settings, fig, axes


# x axes of the accuracy curves: per round, against the cumulative communication (all clients,
# up + down, MB) and against the cumulative wall-clock seconds of the run.
X_AXES = {
    "round": "round",
    "mb": "communicated MB (all clients, up + down, cumulative)",
    "seconds": "wall-clock seconds (cumulative)",
}


def _xs(doc: dict[str, Any], x: str) -> dict[int, float]:
    """Round -> x coordinate of that round's end."""
    out, total = {}, 0.0
    for r in doc.get("rounds", []):
        if x == "round":
            total = float(r["round"])
        elif x == "mb":
            total += ((r.get("bytes_up") or 0) + (r.get("bytes_down") or 0)) / 1e6
        else:
            total += r.get("seconds") or 0.0
        out[int(r["round"])] = total
    return out


def plot_grid_curves(
    cells: Sequence[Cell],
    docs: dict[str, dict[str, Any]],
    path: Path,
    target: float | None,
    metric: str = "weighted",
    x: str = "round",
) -> None:
    """Test accuracy (``metric``) of every method against ``x`` (``X_AXES``), mean over seeds
    (band: min-max over seeds; against MB or seconds, at each seed's mean x of that round)."""
    from matplotlib.ticker import MaxNLocator

    key = METRIC_KEYS[metric]
    plt, settings, fig, axes = _setting_axes(cells)
    for ax, setting in zip(axes[0], settings, strict=True):
        methods = list(dict.fromkeys(c.method.label for c in cells if c.setting.label == setting))
        # Past ten methods the default colour cycle repeats: 20 colours, then dashed lines.
        colors = plt.get_cmap("tab20" if len(methods) > 10 else "tab10").colors
        for i, method in enumerate(methods):
            runs = [
                docs[c.key]
                for c in cells
                if c.setting.label == setting and c.method.label == method and c.key in docs
            ]
            curves: dict[int, list[float]] = {}
            where: dict[int, list[float]] = {}
            for doc in runs:
                coords = _xs(doc, x)
                for r in doc.get("rounds", []):
                    if r.get(key) is not None:
                        curves.setdefault(int(r["round"]), []).append(100 * r[key])
                        where.setdefault(int(r["round"]), []).append(coords[int(r["round"])])
            if not curves:
                continue
            rs = sorted(curves)
            xs = [float(np.mean(where[t])) for t in rs]
            mean = [float(np.mean(curves[t])) for t in rs]
            (line,) = ax.plot(
                xs,
                mean,
                label=method,
                marker="." if len(xs) < 30 else None,
                color=colors[i % len(colors)],
                ls="-" if i < len(colors) else "--",
            )
            if len(runs) > 1:
                lo = [min(curves[t]) for t in rs]
                hi = [max(curves[t]) for t in rs]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
            _finetune_point(ax, runs, key, x, line.get_color(), method, i)
        if target is not None:
            ax.axhline(100 * target, color="gray", ls="--", lw=0.8, label="target")
        ax.set_title(setting, fontsize=10)
        ax.set_xlabel(X_AXES[x])
        if x == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no fractional rounds
        ax.set_ylabel(f"test accuracy, {METRIC_NAMES[metric]} (%)")
        ax.grid(alpha=0.3)
        if len(methods) > 8:  # a long legend would hide the curves: put it beside the axes
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _finetune_point(
    ax: Any, runs: Sequence[dict[str, Any]], key: str, x: str, color: Any, label: str, i: int
) -> None:
    """The accuracy after the method's local fine-tuning (the table's headline for FedBABU and
    layer expansion), mean over seeds, as a star at the last round's x (whiskers: min-max),
    the ``i``-th method's shifted right by ``STAR_SHIFT * i`` of it."""
    tuned = [
        (100 * doc["summary"]["after_finetune"][key], _xs(doc, x)[int(doc["rounds"][-1]["round"])])
        for doc in runs
        if doc.get("rounds")
        and doc.get("summary", {}).get("after_finetune", {}).get(key) is not None
    ]
    if not tuned:
        return
    ys = [y for y, _ in tuned]
    mean = float(np.mean(ys))
    yerr = [[mean - min(ys)], [max(ys) - mean]] if len(ys) > 1 else None
    ax.errorbar(
        [float(np.mean([w for _, w in tuned])) * (1 + STAR_SHIFT * i)],
        [mean],
        yerr=yerr,
        marker="*",
        ms=11,
        color=color,
        ls="none",
        capsize=3,
        label=f"{label} after fine-tune",
    )


def _stacked_label_bars(plt: Any, fig: Any, ax: Any, counts: np.ndarray) -> None:
    """Bars of ``counts [clients, C]`` stacked by class, with a colour key: a legend up to 20
    classes (distinct qualitative colours), beyond that a colour bar of the class index."""
    ids = np.arange(counts.shape[0])
    num_classes = counts.shape[1]
    if num_classes <= 20:
        cmap = plt.get_cmap("tab10" if num_classes <= 10 else "tab20")
        colours = [cmap(k) for k in range(num_classes)]
    else:  # qualitative maps would repeat colours: a continuous map with a colour bar
        cmap = plt.get_cmap("viridis")
        colours = [cmap(k / (num_classes - 1)) for k in range(num_classes)]
    bottom = np.zeros(counts.shape[0])
    for k in range(num_classes):
        ax.bar(ids, counts[:, k], bottom=bottom, color=colours[k], width=0.85, label=str(k))
        bottom += counts[:, k]
    if num_classes <= 20:
        ax.legend(
            title="class",
            fontsize=7,
            title_fontsize=7,
            ncol=1 + (num_classes - 1) // 10,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
        )
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        bar = fig.colorbar(ScalarMappable(Normalize(0, num_classes - 1), cmap), ax=ax, pad=0.01)
        bar.set_label("class", fontsize=8)


def plot_labels_and_accuracy(
    cells: Sequence[Cell], docs: dict[str, dict[str, Any]], path: Path
) -> None:
    """Per setting: each client's training label histogram (stacked bars, seed of the first
    cell) beside each method's per-client final accuracy (points, same client order)."""
    plt = _plt()
    settings = list(dict.fromkeys(c.setting.label for c in cells))
    fig, axes = plt.subplots(
        len(settings), 2, figsize=(12, 3.6 * len(settings)), squeeze=False, sharex="row"
    )
    for row, setting in enumerate(settings):
        mine = [c for c in cells if c.setting.label == setting and c.key in docs]
        if not mine:
            continue
        seed = min(c.seed for c in mine)
        first = next(c for c in mine if c.seed == seed)
        clients = docs[first.key].get("clients", [])
        counts = np.array([c.get("train_label_counts", []) for c in clients], dtype=float)
        ax_h, ax_a = axes[row]
        if counts.ndim == 2 and counts.size:
            _stacked_label_bars(plt, fig, ax_h, counts)
        ax_h.set_title(f"{setting}: training labels per client (seed {seed})", fontsize=10)
        ax_h.set_xlabel("client")
        ax_h.set_ylabel("examples (stacked by class)")
        for method in dict.fromkeys(c.method.label for c in mine):
            cell = next((c for c in mine if c.method.label == method and c.seed == seed), None)
            if cell is None:
                continue
            accs = docs[cell.key].get("per_client_final_acc", {})
            pts = sorted((int(k), 100 * float(v)) for k, v in accs.items())
            if pts:
                ax_a.plot(*zip(*pts, strict=True), marker="o", ms=3, lw=0.6, label=method)
        ax_a.set_title(f"{setting}: final test accuracy per client (seed {seed})", fontsize=10)
        ax_a.set_xlabel("client")
        ax_a.set_ylabel("accuracy (%)")
        ax_a.grid(alpha=0.3)
        ax_a.legend(fontsize=7, ncol=2)
        from matplotlib.ticker import MaxNLocator

        for ax in (ax_h, ax_a):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_client_spread(cells: Sequence[Cell], docs: dict[str, dict[str, Any]], path: Path) -> None:
    """Per-client final test accuracies of every method (pooled over seeds), box + points."""
    plt, settings, fig, axes = _setting_axes(cells)
    for ax, setting in zip(axes[0], settings, strict=True):
        methods = list(dict.fromkeys(c.method.label for c in cells if c.setting.label == setting))
        data = []
        for method in methods:
            accs = []
            for c in cells:
                if c.setting.label == setting and c.method.label == method and c.key in docs:
                    accs += [
                        100 * float(v) for v in docs[c.key].get("per_client_final_acc", {}).values()
                    ]
            data.append(accs)
        pos = [i for i, d in enumerate(data, 1) if d]
        if pos:
            ax.boxplot([d for d in data if d], positions=pos, widths=0.6, showfliers=False)
            rng = np.random.default_rng(0)
            for i, d in zip(pos, [d for d in data if d], strict=True):
                ax.scatter(i + rng.uniform(-0.15, 0.15, len(d)), d, s=6, alpha=0.5)
        ax.set_xticks(range(1, len(methods) + 1))
        ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("per-client final test accuracy (%)")
        ax.set_title(setting, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# ---- HTML -------------------------------------------------------------------------------------
def html_report(
    suite: Suite,
    rows: Sequence[dict[str, Any]],
    cells: Sequence[Cell],
    images: Sequence[tuple[str, str]],
    command: str,
    out: Path,
) -> str:
    esc = html.escape
    cols = _columns(rows, suite)
    has_ref = any(r["reference"] for r in rows)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{esc(suite.title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}"
        "img{max-width:100%;border:1px solid #eee;margin:0.5em 0}"
        "code{background:#f4f4f4;padding:1px 4px}</style></head><body>",
        f"<h1>{esc(suite.title)}</h1>",
    ]
    if suite.paper:
        parts.append(f"<p>Paper setting: {esc(suite.paper)}</p>")
    if suite.description:
        parts.append(f"<p>{esc(suite.description)}</p>")
    if command:
        parts.append(f"<p>Command: <code>{esc(command)}</code></p>")
    c0 = cells[0].cfg if cells else None
    if c0 is not None:
        parts.append(
            f"<p>Ran: {esc(run_description(cells))}; batch {c0.train.batch_size}, lr "
            f"{c0.train.lr}, {c0.train.local_epochs} local epoch(s).</p>"
        )
    differs = suite.paper_rounds is not None and any(not _paper_budget(suite, c) for c in cells)
    paper_col = "paper" + (f" ({suite.paper_rounds} rounds) †" if differs else "")
    for setting in dict.fromkeys(r["setting"] for r in rows):
        parts.append(f"<h2>{esc(setting)}</h2><table><tr><th>method</th><th>seeds</th>")
        parts += [f"<th>{esc(label)}</th>" for _, label, _ in cols]
        parts.append(f"<th>{esc(paper_col)}</th></tr>" if has_ref else "</tr>")
        for r in rows:
            if r["setting"] != setting:
                continue
            parts.append(f"<tr><td>{esc(r['method'])}</td><td>{len(r['seeds'])}</td>")
            parts += [
                f"<td>{esc(fmt(r[k], u, with_count=k == 'rounds_to_target'))}</td>"
                for k, _, u in cols
            ]
            parts.append(f"<td>{esc(r['reference'] or '-')}</td></tr>" if has_ref else "</tr>")
        parts.append("</table>")
    note = budget_note(suite, cells)
    if note and has_ref:
        note_html = esc(("† " if differs else "") + note).replace("**", "")
        parts.append(f"<p class='budget'><strong>{note_html}</strong></p>")
    parts.append(
        "<p>Accuracies in %, mean ± half-width of the 95% Student-t interval over seeds (from "
        f"{MIN_SEEDS_FOR_CI} seeds; n/a below, with the seeds' range from two); 1 kB = 1000 "
        "bytes, 1 MB = 10^6 bytes. <em>best-on-test</em> picks the round on the "
        "test set, as the papers report it; <em>best-on-val</em> picks it on a validation split.</p>"
    )
    for title, rel in images:
        parts.append(f"<h2>{esc(title)}</h2><img src='{esc(rel)}' alt='{esc(title)}'>")
    parts.append("<h2>Runs</h2><ul>")
    for c in cells:
        d = f"cells/{c.setting.label}/{c.method.label}/seed{c.seed}"
        if (out / d / "results.json").exists():
            parts.append(
                f"<li>{esc(c.key)}: <a href='{esc(d)}/results.json'>results.json</a>, "
                f"<a href='{esc(d)}/rounds.csv'>rounds.csv</a></li>"
            )
    parts.append("</ul></body></html>")
    return "\n".join(parts)


def code_versions(cells: Sequence[Cell], docs: dict[str, dict[str, Any]]) -> str:
    """A line naming the code versions the cells come from when there is more than one, or when
    they differ from the running code ("" otherwise)."""
    groups: dict[str, list[str]] = {}
    commits: dict[str, str] = {}
    for c in cells:
        doc = docs.get(c.key)
        if doc is None:
            continue
        info = doc.get("provenance", {}).get("code", {})
        h = str(info.get("source_hash") or "unknown (no provenance)")
        groups.setdefault(h, []).append(c.key)
        commit = info.get("git_commit")
        if commit:
            commits[h] = f", commit {commit[:10]}{'+changes' if info.get('git_dirty') else ''}"
    current = provenance.code()["source_hash"]
    if not groups or set(groups) == {current}:
        return ""
    parts = [
        f"{h[:12]}{commits.get(h, '')}{' (this code)' if h == current else ''}: {len(keys)} cell(s)"
        for h, keys in groups.items()
    ]
    return "Cells come from other code than this report's, or from several versions: " + "; ".join(
        parts
    )


def write_report(
    suite: Suite,
    out: Path,
    cells: Sequence[Cell],
    docs: dict[str, dict[str, Any]],
    command: str = "",
) -> dict[str, Path]:
    """``table.md``, ``table.csv``, ``summary.json``, ``curves.png``, ``clients.png``,
    ``index.html`` in ``out`` (plus the per-cell prototype plots the runs made)."""
    out = Path(out)
    rows = summarize_grid(suite, cells, docs)
    md = f"# {suite.title}\n\n"
    if command:
        md += f"Command: `{command}`\n\n"
    md += f"Ran: {run_description(cells)}.\n\n"
    md += markdown_table(suite, rows, cells)
    versions = code_versions(cells, docs)
    if versions:
        md += f"\n{versions}.\n"
    (out / "table.md").write_text(md)
    write_csv(out / "table.csv", rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    plot_grid_curves(cells, docs, out / "curves.png", suite.target_accuracy, suite.paper_metric)
    metric = suite.paper_metric
    target = suite.target_accuracy
    plot_grid_curves(cells, docs, out / "curves_mb.png", target, metric, x="mb")
    plot_grid_curves(cells, docs, out / "curves_seconds.png", target, metric, x="seconds")
    plot_client_spread(cells, docs, out / "clients.png")
    plot_labels_and_accuracy(cells, docs, out / "labels.png")
    images = [
        ("Learning curves (mean over seeds; band: min-max over seeds)", "curves.png"),
        ("Accuracy against communicated MB (mean over seeds; band: min-max)", "curves_mb.png"),
        (
            "Accuracy against wall-clock seconds (mean over seeds; band: min-max)",
            "curves_seconds.png",
        ),
        ("Per-client final accuracy", "clients.png"),
        ("Per-client label distribution beside per-client accuracy", "labels.png"),
    ]
    for c in cells:
        rel = f"cells/{c.setting.label}/{c.method.label}/seed{c.seed}/prototypes.png"
        if c.seed == min(x.seed for x in cells) and (out / rel).exists():
            images.append((f"Prototypes: {c.method.label}, {c.setting.label}, seed {c.seed}", rel))
    page = html_report(suite, rows, cells, images, command, out)
    if versions:
        page = page.replace("</body>", f"<p><strong>{html.escape(versions)}.</strong></p></body>")
    (out / "index.html").write_text(page)
    return {
        "table_md": out / "table.md",
        "table_csv": out / "table.csv",
        "html": out / "index.html",
        "curves": out / "curves.png",
        "clients": out / "clients.png",
        "curves_mb": out / "curves_mb.png",
        "curves_seconds": out / "curves_seconds.png",
        "labels": out / "labels.png",
    }
