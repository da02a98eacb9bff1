"""Tables and figures of parity runs: ``python benchmarks/parity/report.py [results dir] [--fig DIR]``.

Prints a summary table over all runs (mean over the last five rounds, both metrics), then per run
one markdown table per metric (weighted, client mean) at rounds 5/10/20/40 and the last, with
every fedmosaic series beside the reference: fedmosaic's default (``acc``), the metric that
evaluates the model the reference evaluates (where it differs, e.g. FedGH's ``acc_global``) and
each variant (the fedmosaic options that reproduce the reference). Writes ``<fig>/<run>.png``: the
curves (weighted solid, client mean dashed), and ``<fig>/gaps.png``: every run's gap against its
setting, with the reference's own spread as a band. Round ``r`` is the accuracy after ``r`` rounds of
training on both sides; a method's evaluation after local fine-tuning (FedBABU) is its own row.
``--doc docs/parity.md`` refreshes that page's marked tables in place instead of printing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AT = (5, 10, 20, 40)
LAST = 5  # the summary averages the last LAST rounds (single rounds of some methods swing)


def by_round(rounds: list[dict[str, Any]], key: str) -> dict[int, float]:
    """``round -> value`` of the per-round records (the fine-tuned record left out)."""
    return {int(r["round"]): float(r[key]) for r in rounds if key in r and not r.get("finetuned")}


def finetuned(rounds: list[dict[str, Any]], key: str) -> float | None:
    """The value after the method's local fine-tuning, if it has one."""
    for r in rounds:
        if r.get("finetuned") and key in r:
            return float(r[key])
    return None


def series(doc: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], str]]:
    """fedmosaic's series of a run: ``(label, rounds, metric prefix)``."""
    fm = doc["fedmosaic"]["rounds"]
    mode = doc.get("ref_mode", "acc")
    out = [("fedmosaic", fm, "acc")]
    if mode != "acc":
        out.append((f"fedmosaic {mode}", fm, mode))
    for name, var in doc.get("variants", {}).items():
        out.append(
            (f"fedmosaic {name}" + (f" {mode}" if mode != "acc" else ""), var["rounds"], mode)
        )
    return out


# The page's split, harness.py's Setup defaults (20 clients holding 5% of FMNIST): a run of
# another size is labelled by it. report.py stays importable without the harness's imports.
CLIENTS, SUBSAMPLE = 20, 0.05


def split_label(doc: dict[str, Any]) -> str:
    """The run's split as the tables name it: the setting (``dir05``), with the client count and
    the fraction of FMNIST where they differ from the page's 20 clients and 5%. Runs of two
    sizes are other experiments: their gaps are never pooled over seeds or drawn as one setting."""
    data = doc.get("setup", {}).get("data", {})
    n, frac = data.get("num_clients", CLIENTS), data.get("subsample", SUBSAMPLE)
    out = str(doc["setting"])
    if n != CLIENTS:
        out += f", {n} clients"
    if frac != SUBSAMPLE:
        out += f", {100 * frac:g}%"
    return out


def own_run(doc: dict[str, Any]) -> bool:
    """A run of the reference against itself (other torch seeds, seeded generators, or again on
    identical inputs): its spread, not a parity gap."""
    return bool(doc.get("ref_seed_offset") or doc.get("ref_repeat")) or (
        doc.get("ref_seed_globals") is not None
    )


def _ref_name(doc: dict[str, Any]) -> str:
    """The reference's name, with its seed offset when the run shifted its torch seeds and its
    global seed when the run seeded numpy's and Python's generators."""
    name = str(doc["reference"].get("library", "reference"))
    offset = doc.get("ref_seed_offset", 0)
    seeded = doc.get("ref_seed_globals")
    again = doc.get("ref_repeat", 0)
    notes = [f"torch seeds +{offset}"] if offset else []
    notes += [] if seeded is None else [f"numpy and random seeded {seeded}"]
    notes += [f"again, run {again + 1}"] if again else []
    return f"{name} ({', '.join(notes)})" if notes else name


def table(doc: dict[str, Any], metric: str = "weighted") -> str:
    """Markdown rows: round, the reference, every fedmosaic series and its gap (points)."""
    suffix = "_weighted" if metric == "weighted" else "_mean"
    ref = by_round(doc["reference"]["rounds"], "acc" + suffix)
    cols = [(label, by_round(rounds, mode + suffix)) for label, rounds, mode in series(doc)]
    last = max(set(ref).intersection(*(set(c) for _, c in cols)))
    head = f"| round | {_ref_name(doc)} {metric} |" + "".join(
        f" {label} | gap |" for label, _ in cols
    )
    lines = [head, "|---|---|" + "---|---|" * len(cols)]
    for r in [a for a in AT if a < last] + [last]:
        if r not in ref or any(r not in c for _, c in cols):
            continue
        row = f"| {r}{' (final)' if r == last else ''} | {100 * ref[r]:.2f} |"
        row += "".join(f" {100 * c[r]:.2f} | {100 * (c[r] - ref[r]):+.2f} |" for _, c in cols)
        lines.append(row)
    ref_ft = finetuned(doc["reference"]["rounds"], "acc" + suffix)
    if ref_ft is not None:
        vals = [finetuned(rounds, mode + suffix) for _, rounds, mode in series(doc)]
        row = f"| after fine-tuning | {100 * ref_ft:.2f} |"
        row += "".join(
            f" {100 * v:.2f} | {100 * (v - ref_ft):+.2f} |" if v is not None else " - | - |"
            for v in vals
        )
        lines.append(row)
    return "\n".join(lines)


def last_mean(values: dict[int, float], last: int, n: int = LAST) -> float:
    """Mean over rounds ``last - n + 1 .. last`` (those present)."""
    keep = [values[r] for r in range(last - n + 1, last + 1) if r in values]
    return sum(keep) / len(keep)


def summary(docs: list[dict[str, Any]]) -> str:
    """One row per run and fedmosaic series: last-5 means, their gaps, the largest round gap."""
    lines = [
        f"| method | setting | seed | reference | rounds | series | reference, last {LAST} | "
        f"fedmosaic, last {LAST} | gap, last {LAST} (weighted / client mean) | "
        "largest gap in a round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for doc in docs:
        rw = by_round(doc["reference"]["rounds"], "acc_weighted")
        rm = by_round(doc["reference"]["rounds"], "acc_mean")
        for label, rounds, mode in series(doc):
            fw, fmn = by_round(rounds, mode + "_weighted"), by_round(rounds, mode + "_mean")
            common = sorted(set(rw) & set(fw) - {0})
            if not common:
                continue
            last = common[-1]
            gw = last_mean(fw, last) - last_mean(rw, last)
            gm = last_mean(fmn, last) - last_mean(rm, last)
            worst = max(common, key=lambda r: abs(fw[r] - rw[r]))
            lines.append(
                f"| {doc['method']} | {split_label(doc)} | {doc['setup']['seed']} | {_ref_name(doc)} | "
                f"{last} | {label} | "
                f"{100 * last_mean(rw, last):.2f} | {100 * last_mean(fw, last):.2f} | "
                f"{100 * gw:+.2f} / {100 * gm:+.2f} | "
                f"{100 * abs(fw[worst] - rw[worst]):.2f} (round {worst}) |"
            )
    return "\n".join(lines)


def seeds_table(docs: list[dict[str, Any]]) -> str:
    """Runs of one method, setting and reference over several seeds (splits): each seed's gap over
    the last five rounds, weighted and client mean, and their means with 95% t-intervals (the
    suites' own ``aggregate``); for a method that fine-tunes, a second row with the gaps after
    fine-tuning. Runs of the reference under other seeds (its own spread on one split) are left out."""
    from fedmosaic.report.suite_report import aggregate

    # one group per method, split (its size included), read round, reference and series
    groups: dict[tuple[str, str, int, str, str], dict[int, tuple[float, float]]] = {}
    for doc in docs:
        if own_run(doc):
            continue
        ref = doc["reference"]["rounds"]
        rw, rm = by_round(ref, "acc_weighted"), by_round(ref, "acc_mean")
        for label, rounds, mode in series(doc):
            fw, fmn = by_round(rounds, mode + "_weighted"), by_round(rounds, mode + "_mean")
            common = sorted(set(rw) & set(fw) - {0})
            if not common:
                continue
            last = common[-1]
            key = (doc["method"], split_label(doc), last, _ref_name(doc), label)
            seed = int(doc["setup"]["seed"])
            groups.setdefault(key, {})[seed] = (
                last_mean(fw, last) - last_mean(rw, last),
                last_mean(fmn, last) - last_mean(rm, last),
            )
            ft = [finetuned(rounds, mode + "_weighted"), finetuned(ref, "acc_weighted")]
            ftm = [finetuned(rounds, mode + "_mean"), finetuned(ref, "acc_mean")]
            if None not in ft and None not in ftm:
                fkey = (*key[:4], f"{label}, after fine-tuning")
                groups.setdefault(fkey, {})[seed] = (ft[0] - ft[1], ftm[0] - ftm[1])
    lines = [
        f"| method | setting | rounds | reference | series | seeds | gap per seed, last {LAST} "
        "(weighted) | mean gap [95% interval] | gap per seed (client mean) | mean gap [95% interval] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (method, setting, rounds, ref, label), gaps in sorted(groups.items()):
        if len(gaps) < 2:
            continue
        cells = []
        for i in (0, 1):
            vals = [gaps[k][i] for k in sorted(gaps)]
            agg = aggregate(vals)
            mean, half = agg["mean"], agg["ci95"]
            cells.append(
                f"{', '.join(f'{100 * v:+.2f}' for v in vals)} | {100 * mean:+.2f} "
                f"[{100 * (mean - half):+.2f}, {100 * (mean + half):+.2f}]"
            )
        lines.append(
            f"| {method} | {setting} | {rounds} | {ref} | {label} | "
            f"{', '.join(map(str, sorted(gaps)))} | "
            f"{cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


SETTING_ORDER = ("dir01", "dir05", "dir1", "pat2")  # the others after these, by name


def _setting_key(setting: str) -> tuple[int, str]:
    known = SETTING_ORDER.index(setting) if setting in SETTING_ORDER else len(SETTING_ORDER)
    return known, setting


def gap_points(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary figure's data. ``gaps``: ``(library method, setting) -> [gap per seed]``, the
    last-5 weighted gap (points) of fedmosaic's default options, read on the model the reference
    evaluates, on each seed's split (runs of the reference under other seeds left out). ``spread``: ``(library method, setting) -> range``
    (points) of the reference's own last-5 weighted accuracy over its runs on one split (the
    plain run, its ``--ref-seed-offset`` runs, its seeded runs; the largest range over seeds),
    where it ran more than once: how far the reference moves from itself."""
    gaps: dict[tuple[str, str], list[float]] = {}
    refs: dict[tuple[str, str, int], list[float]] = {}
    for doc in docs:
        name = f"{doc['reference'].get('library', '?')} {doc['method']}"
        setting, seed = split_label(doc), int(doc["setup"]["seed"])
        rw = by_round(doc["reference"]["rounds"], "acc_weighted")
        # the metric of the model the reference evaluates (FedGH's acc_global): like with like
        fw = by_round(doc["fedmosaic"]["rounds"], doc.get("ref_mode", "acc") + "_weighted")
        common = sorted(set(rw) & set(fw) - {0})
        if not common:
            continue
        last = common[-1]
        refs.setdefault((name, setting, seed), []).append(100 * last_mean(rw, last))
        if own_run(doc):
            continue
        gap = 100 * (last_mean(fw, last) - last_mean(rw, last))
        gaps.setdefault((name, setting), []).append(gap)
    spread: dict[tuple[str, str], float] = {}
    for (name, setting, _), vals in refs.items():
        if len(vals) > 1:
            key = (name, setting)
            spread[key] = max(spread.get(key, 0.0), max(vals) - min(vals))
    return {"gaps": gaps, "spread": spread}


def gap_figure(docs: list[dict[str, Any]], path: Path) -> None:
    """fedmosaic minus the reference (last-5 weighted mean, points) against the setting, one
    marker per seed and method; a grey band of +-half the reference's own range where it was
    measured (its run-to-run spread on one split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = gap_points(docs)
    settings = sorted({s for _, s in pts["gaps"]}, key=_setting_key)
    methods = sorted({m for m, _ in pts["gaps"]})
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(settings) + 3), 4.2))
    cmap = plt.get_cmap("tab20")
    for i, method in enumerate(methods):
        for j, setting in enumerate(settings):
            x = j - 0.4 + width * (i + 0.5)
            half = pts["spread"].get((method, setting))
            if half is not None:
                ax.fill_between([x - width / 2, x + width / 2], -half / 2, half / 2, color="0.85")
            ys = pts["gaps"].get((method, setting), [])
            # labelled at the first setting even without points there: one legend entry each
            ax.plot(
                [x] * len(ys), ys, "o", ms=4, color=cmap(i % 20), label=method if j == 0 else None
            )
    ax.axhline(0.0, color="black", lw=0.8)
    for y in (-1.0, 1.0):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_xticks(range(len(settings)))
    ax.set_xticklabels(settings)
    ax.set_xlabel("setting")
    ax.set_ylabel("fedmosaic - reference, last 5 rounds (points)")
    ax.set_title("Parity gap per seed; grey: the reference's own range on one split")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    curves = [(_ref_name(doc), doc["reference"]["rounds"], "acc")] + series(doc)
    colors = ["tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown"]
    for (label, rounds, mode), color in zip(curves, colors):
        for suffix, style in (("_weighted", "-"), ("_mean", "--")):
            pts = [(r, a) for r, a in sorted(by_round(rounds, mode + suffix).items()) if r >= 1]
            ax.plot(
                [r for r, _ in pts],
                [100 * a for _, a in pts],
                style,
                color=color,
                label=f"{label} ({'weighted' if suffix == '_weighted' else 'client mean'})",
            )
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{doc['method']} ({split_label(doc)}, seed {doc['setup']['seed']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spread_table(runs: dict[str, dict[str, Any]]) -> str:
    """The reference run more than once on identical inputs (the same split, model, seeds and
    arguments: ``--ref-repeat K`` is run K + 1), every two of its runs side by side, round by
    round (weighted accuracy)."""
    head = (
        "| method | setting | seed | runs | equal through round | largest difference in a round "
        "(points) | mean of the last 5 rounds |\n|---|---|---|---|---|---|---|"
    )
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for stem, doc in runs.items():
        k = doc.get("ref_repeat") or 0
        if k:
            groups.setdefault(stem.removesuffix(f"_u{k}"), {})[k + 1] = doc
    rows = []
    for base_stem, again in sorted(groups.items()):
        base = runs.get(base_stem)
        if base is None or own_run(base):
            continue
        every = {1: base, **again}
        for a, b in itertools.combinations(sorted(every), 2):
            ra = by_round(every[a]["reference"]["rounds"], "acc_weighted")
            rb = by_round(every[b]["reference"]["rounds"], "acc_weighted")
            common = sorted(set(ra) & set(rb))
            if not common:
                continue
            differ = [r for r in common if ra[r] != rb[r]]
            through = f"{differ[0] - 1}" if differ else f"{common[-1]} (every round)"
            largest = 100 * max(abs(ra[r] - rb[r]) for r in common)
            last = common[-1]
            rows.append(
                f"| {base['reference'].get('library', '?')} {base['method']} | "
                f"{split_label(base)} | {base['setup'].get('seed', '?')} | {a} / {b} | "
                f"{through} | {largest:.2f} | "
                f"{100 * last_mean(ra, last):.2f} / {100 * last_mean(rb, last):.2f} |"
            )
    return "\n".join([head, *rows]) if rows else "(no repeated reference runs)"


def complete(doc: dict[str, Any]) -> bool:
    """Both sides finished (a run writes its result after each side)."""
    return "rounds" in doc.get("reference", {}) and "fedmosaic" in doc


def run_block(doc: dict[str, Any]) -> str:
    """Both tables of one run and its wall times."""
    walls = f"wall time {_ref_name(doc)} {doc['reference'].get('seconds', '?')} s, fedmosaic "
    walls += f"{doc['fedmosaic'].get('seconds', '?')} s"
    return f"{table(doc, 'weighted')}\n\n{table(doc, 'client mean')}\n\n{walls}."


_MARK = re.compile(r"<!-- parity:(summary|seeds|spread|run (\S+)) -->\n.*?<!-- /parity -->", re.S)


def fill(
    page: str, runs: dict[str, dict[str, Any]], refs: dict[str, dict[str, Any]] | None = None
) -> str:
    """``page`` with every ``<!-- parity:summary -->`` / ``<!-- parity:run STEM -->`` block
    (closed by ``<!-- /parity -->``) replaced by the current table; a missing run fails."""

    def body(m: re.Match[str]) -> str:
        if m.group(1) == "summary":
            text = summary(list(runs.values()))
        elif m.group(1) == "seeds":
            text = seeds_table(list(runs.values()))
        elif m.group(1) == "spread":  # the reference's side is enough there
            text = spread_table(runs if refs is None else refs)
        elif m.group(2) in runs:
            text = run_block(runs[m.group(2)])
        else:
            raise SystemExit(f"the page names run {m.group(2)!r}, which has no complete result")
        return f"<!-- parity:{m.group(1)} -->\n{text}\n<!-- /parity -->"

    return _MARK.sub(body, page)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path, nargs="?", default=HERE / "results")
    p.add_argument("--fig", type=Path, help="write one PNG per run here")
    p.add_argument("--doc", type=Path, help="refresh the marked tables of this page in place")
    a = p.parse_args(argv)
    loaded = [(path, json.loads(path.read_text())) for path in sorted(a.results.glob("*.json"))]
    runs = {path.stem: doc for path, doc in loaded if complete(doc)}
    refs = {path.stem: doc for path, doc in loaded if "rounds" in doc.get("reference", {})}
    if a.doc:
        a.doc.write_text(fill(a.doc.read_text(), runs, refs))
    else:
        print(f"## Summary\n\n{summary(list(runs.values()))}\n")
        print(f"## Over seeds\n\n{seeds_table(list(runs.values()))}\n")
        for stem, doc in runs.items():
            print(f"### {doc['method']} ({doc['setting']}, {stem})\n\n{run_block(doc)}\n")
    if a.fig:
        for stem, doc in runs.items():
            figure(doc, a.fig / f"{stem}.png")
        gap_figure(list(runs.values()), a.fig / "gaps.png")


if __name__ == "__main__":
    main()
