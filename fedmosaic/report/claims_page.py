"""The claims page in Markdown: the verdict table, each claim's plan and comparisons, the
looks, the page-wide error control and the exploratory groups (``report/claims.py`` computes
them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmosaic.report import stats
from fedmosaic.report.plans import Comparison, Plan

MAX_SEEDS = stats.MAX_SEEDS
ALPHA = 0.05  # the level of every test on the page (a plan may set its own)


def seeds_text(p: dict[str, Any]) -> str:
    """``16 (6-553)``: seeds for 80% power at the observed spread (and at its 95% bounds)."""

    def one(n: int | None) -> str:
        return f"> {MAX_SEEDS:,}" if n is None else f"{n:,}"

    if p["delta"] is None or not p.get("spread"):
        return "-"
    return f"{one(p['seeds'])} ({one(p['low'])} to {one(p['high'])})"


def budget_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| cells folder | suite | cells | seeds | FMNIST fraction | rounds run | "
        "wall hours (2 cores) | code |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('folder', '')} | {r['suite']} | {r['cells']} | "
            f"{', '.join(map(str, r['seeds']))} | "
            f"{', '.join(f'{f:g}' for f in r['fractions'])} | {r['rounds'][0]}-{r['rounds'][1]} | "
            f"{r['hours']:.2f} | {', '.join(r['codes'])} |"
        )
    total = sum(r["hours"] for r in rows)
    lines.append(f"| all | | {sum(r['cells'] for r in rows)} | | | | {total:.2f} | |")
    return "\n".join(lines) + "\n"


def _num(agg: dict[str, Any], digits: int = 2) -> str:
    if agg["mean"] is None:
        return "-"
    if agg["ci95"] is None:
        return f"{agg['mean']:.{digits}f}"
    return f"{agg['mean']:.{digits}f} ± {agg['ci95']:.{digits}f}"


def _interval(agg: dict[str, Any]) -> str:
    if agg["mean"] is None:
        return "-"
    s = f"{agg['mean']:+.2f}"
    if agg["ci95"] is None:
        return s
    return f"{s} [{agg['mean'] - agg['ci95']:+.2f}, {agg['mean'] + agg['ci95']:+.2f}]"


def _adjusted(j: dict[str, Any]) -> str:
    if j.get("interval") is None:
        return "-"
    lo, hi = j["interval"]
    return f"[{lo:+.2f}, {hi:+.2f}] at {100 * (1 - j['level']):.2f}%"


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.0e}"


def _metric_label(c: Comparison) -> str:
    if c.metric == "kb_per_round":
        return "kB/client/round (up + down)"
    if c.metric == "paper_cost_g":
        return "Table 4 cost (G)"
    if c.metric == "mia_auc":
        return "membership attack AUC x 100 (50 = chance)"
    acc = "weighted" if c.accuracy == "weighted" else "unweighted"
    where = {
        "final": "final",
        "after_finetune": "after fine-tune",
        "common_round": "same round",
        "mean_over_rounds": "mean over rounds 1..r",
    }
    # e.g. "; fedclassavg: acc_local", for the sides of this comparison read from another prediction
    read = "".join(f"; {m}: {p}" for m, p in c.predictions if m in (c.method, c.baseline))
    return f"{where[c.metric]} acc, {acc} (%){read}"


def _resolution_text(r: dict[str, Any]) -> str:
    if r["per_image"] is None:
        return "-"
    return f"{r['test_images']:,} img: {r['per_image']:.3f} pt each, sd {r['sampling_sd']:.2f}"


def _slopes_text(j: dict[str, Any]) -> str:
    a, b = j["slopes"]
    if a is None and b is None:
        return "-"
    f = lambda v: "-" if v is None else f"{v:+.2f}"  # noqa: E731
    return f"{f(a)} / {f(b)}"


def _paper_text(c: Comparison) -> str:
    if c.paper is None:
        return "-"
    out = f"{c.paper[0]:g} vs {c.paper[1]:g}"
    if c.relation != "lower":
        out += f" ({c.paper[0] - c.paper[1]:+.2f})"
    if c.paper_note:
        out += f" ({c.paper_note})"
    return out


def _day(stamp: str) -> str:
    return stamp[:10]


def summary_markdown(claims_out: Sequence[dict[str, Any]]) -> str:
    """One row per claim: its verdict, its plan's date and its cells' dates, the seeds and the
    comparisons' verdicts."""
    lines = [
        "| claim | verdict | plan committed | cells ran | seeds | evidence | comparisons |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in claims_out:
        js = res["comparisons"]
        ns = sorted({len(j["seeds"]) for j in js})
        seeds = (
            "-"
            if ns == [0]
            else ("-".join(str(n) for n in (ns[0], ns[-1])) if ns[0] != ns[-1] else str(ns[0]))
        )
        evidence = sorted(
            {
                f"{j['source']} {', '.join(f'{100 * f:g}%' for f in j['fraction'])}"
                for j in js
                if j.get("fraction")
            }
        )
        rounds = [r for j in js for r in j["rounds"]]
        if rounds:
            lo, hi = min(rounds), max(rounds)
            evidence.append(f"round {lo}" if lo == hi else f"rounds {lo}-{hi}")
        counts: dict[str, int] = {}
        for j in js:
            v = j["verdict"].split(":")[0].split(";")[0]
            counts[v] = counts.get(v, 0) + 1
        parts = ", ".join(f"{k} {v}" for v, k in sorted(counts.items(), key=lambda kv: kv[0]))
        plan_day = _day(res["plan"].committed())
        ran = "-"
        if res["dates"]:
            first, last = (_day(d) for d in res["dates"])
            ran = first if first == last else f"{first} to {last}"
            if plan_day > first:
                ran += " (before the plan)"
        lines.append(
            f"| {res['claim'].title} | **{res['verdict']}** | {plan_day} | {ran} | {seeds} | "
            f"{'; '.join(evidence) or '-'} | {parts} |"
        )
    return "\n".join(lines) + "\n"


def plan_markdown(plan: Plan) -> list[str]:
    """The plan's rules, as the page shows them beside its verdicts."""
    looks = (
        f"planned at {', '.join(map(str, plan.looks))} seeds, {plan.boundary} spending"
        if plan.looks
        else f"as recorded per comparison, {plan.boundary} spending"
    )
    lines = [
        f"*Plan* (`{plan.path.name}`, committed {_day(plan.committed())}): cells "
        f"`{plan.budget}/`, {plan.rounds} rounds for every method read at the last, "
        f"{plan.numerics} numerics, primary metric `{plan.primary}`, two-sided alpha "
        f"{plan.alpha:g} with Holm over each claim's comparisons; looks {looks}"
        + (
            f"; a curve whose slope over its last {100 * plan.flat_window:g}% of rounds is above "
            f"{plan.flat_tolerance:g} point per 10 rounds is named as still climbing"
            if plan.flat_window > 0
            else ""
        )
        + ".",
        "",
    ]
    if plan.command:
        lines += [f"Cells: `{plan.command}`.", ""]
    for head, text in (
        (f"Margin ({plan.margin:g} point)", plan.margin_reason),
        (f"Smallest gap that matters ({plan.smallest_gap:g} point)", plan.smallest_gap_reason),
        ("Substitution", plan.substitution),
        ("Why this design", plan.reason),
        ("Other hosts", plan.cross_host),
    ):
        if text:
            lines += [f"{head}: {' '.join(text.split())}", ""]
    return lines


def rerun_words(key: tuple[str, str, str, str]) -> str:
    """Where cells of one :func:`~fedmosaic.report.claims.host_key` re-run bit for bit."""
    mode, vendor, _, branch = key
    if mode != "portable":
        return "bit for bit on a host of the same instruction-set level and library versions"
    if vendor == "GenuineIntel":
        return "bit for bit on any Intel host with AVX2 (MKL's AVX2 branch, kept on Intel only)"
    return (
        "bit for bit on hosts whose MKL runs the branch it ran here (MKL keeps its AVX2 branch on "
        "Intel processors only); re-run on an Intel host, a FedTGP-grid cell of this kind "
        "differed from round 2 on (Cells re-run on another host, below)"
    )


def _host_text(key: tuple[str, str, str, str]) -> str:
    mode, _, cpu, branch = key
    return f"{cpu}, {mode} numerics, MKL branch {branch}"


def hosts_markdown(hosts: Sequence[tuple[tuple[str, str, str, str], int]]) -> list[str]:
    """Which hosts made a claim's cells, and where each group re-runs bit for bit."""
    if not hosts:
        return []
    parts = [
        f"{n} cell{'s' if n != 1 else ''} on {_host_text(key)}: {rerun_words(key)}"
        for key, n in hosts
    ]
    return ["Hosts: " + "; ".join(parts) + ".", ""]


def claim_markdown(res: dict[str, Any]) -> list[str]:
    claim = res["claim"]
    lines = [f"#### {claim.title}", "", f"**Verdict: {res['verdict']}.**", ""]
    lines.append(
        "| setting | method vs baseline | metric | cells | seeds | method | baseline | "
        "gap [95%] | p | Holm level | adjusted interval | paper | verdict | seeds for 80% power "
        "(spread's 95% bounds) | test-set resolution | slope, last rounds (pt/10 rounds) | "
        "gap best-on-val / best-on-test |"
    )
    lines.append("|" + "---|" * 17)
    for j in res["comparisons"]:
        c: Comparison = j["comparison"]
        metric = _metric_label(c)
        if j["rounds"]:
            lo, hi = min(j["rounds"]), max(j["rounds"])
            metric += f" (round {lo})" if lo == hi else f" (rounds {lo}-{hi})"
        fraction = ", ".join(f"{f:g}" for f in j.get("fraction", [])) or "-"
        n = len(j["seeds"])
        seeds = str(n)
        if len(j["schedule"]) > 1 and j["look"] >= 0:
            seeds += f" (look {j['look'] + 1} of {len(j['schedule'])})"
        elif len(j["schedule"]) > 1:
            seeds = f"{len(j['all_seeds'])} of {j['schedule'][0]} (first look)"
        t = j["test"]
        lines.append(
            f"| {c.setting} | {c.method} vs {c.baseline} | {metric} | "
            f"{j.get('source', '-')} ({fraction}) | {seeds} | {_num(j['method'])} | "
            f"{_num(j['baseline'])} | {_interval(j['diff'])} | {_p(None if t is None else t.p)} | "
            f"{_p(j.get('level') if t is not None else None)} | {_adjusted(j)} | {_paper_text(c)} | {j['verdict']} | "
            f"{seeds_text(j['power'])} | {_resolution_text(j['resolution'])} | "
            f"{_slopes_text(j)} | {_interval(j['best_on_val'])} / {_interval(j['best_on_test'])} |"
        )
    lines.append("")
    lost = res.get("refused", [])
    if lost:
        lines += [
            "Uploads refused (a client's non-finite prototypes or weights, or an upload the "
            "guard or the robust rule dropped; the federation went on without it, and the "
            "cell's accuracy counts that client): " + "; ".join(lost) + ".",
            "",
        ]
    return lines + hosts_markdown(res.get("hosts", []))


def looks_markdown(claims_out: Sequence[dict[str, Any]]) -> list[str]:
    """Every comparison looked at more than once: each look's seeds and result, with its
    boundary (the plan's) and, for reference, O'Brien-Fleming's at the full alpha."""
    rows = []
    for res in claims_out:
        plan: Plan = res["plan"]
        for j in res["comparisons"]:
            if len(j["looks_read"]) < 2 and len(j["schedule"]) < 2:
                continue
            c = j["comparison"]
            sched = tuple(j["schedule"])
            own = stats.nominal_levels(sched, plan.alpha, plan.boundary)
            obf = stats.nominal_levels(sched, plan.alpha, "obrien_fleming")
            for i, (m, t) in enumerate(j["looks_read"]):
                p = None if t is None else t.p
                crossed = "yes" if p is not None and p < own[i] else "no"
                rows.append(
                    f"| {c.suite} | {c.setting}: {c.method} vs {c.baseline} | {i + 1} of "
                    f"{len(sched)} | {m} | {'-' if t is None else f'{t.mean:+.2f}'} | {_p(p)} | "
                    f"{own[i]:.4f} ({plan.boundary}) | {crossed} | {obf[i]:.4f} |"
                )
    if not rows:
        return []
    return [
        "#### Every look",
        "",
        "Each look reads the first n paired seeds. Levels: the two-sided nominal p-value level of "
        "that look for the claim's full alpha (0.05), from Lan-DeMets spending over the looks' "
        "seed fractions; within a claim Holm then divides alpha, so the level a comparison is "
        "tested at (its row above) is smaller. O'Brien-Fleming's level is shown for reference "
        "and decides nothing.",
        "",
        "| suite | comparison | look | seeds | gap | p | level (plan's boundary) | crossed | "
        "level (O'Brien-Fleming) |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def page_markdown_table(page: Sequence[dict[str, Any]]) -> list[str]:
    if not page:
        return []
    lines = [
        "#### Error control over the whole page",
        "",
        f"All {len(page)} distinct confirmatory comparisons with a p-value: Holm over all of them "
        "(with each comparison's looks, Pocock spending), and Benjamini-Hochberg's false "
        "discovery rate (q, over the nominal p-values). A verdict that resolves within its claim "
        "and survives both is marked.",
        "",
        "| claim | comparison | metric | p | within its claim | page-wide Holm | BH q | survives both |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in page:
        j = r["j"]
        c = j["comparison"]
        lines.append(
            f"| {r['claim']} | {c.setting}: {c.method} vs {c.baseline} | {_metric_label(c)} | "
            f"{_p(j['test'].p)} | {'resolves' if j['rejected'] else 'no'} | "
            f"{'resolves' if r['holm'] else 'no'} | {_p(r['bh_q'])} | "
            f"{'yes' if j['rejected'] and r['holm'] and r['bh_q'] < ALPHA else 'no'} |"
        )
    lines.append("")
    return lines


def exploratory_markdown(groups: Sequence[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for g in groups:
        rows = [j for j in g["comparisons"] if j["seeds"]]
        if not rows:
            continue
        lines += [
            f"#### Exploratory: {g['plan'].suite} ({g['group'].budget}/: {g['group'].note})",
            "",
            "Unadjusted 95% intervals; these cells decide no verdict.",
            "",
            "| setting | method vs baseline | metric | seeds | method | baseline | gap [95%] | paper | reads |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for j in rows:
            c = j["comparison"]
            d = j["diff"]
            reads = "interval contains 0"
            if d["ci95"] is not None and d["mean"] - d["ci95"] > 0:
                reads = "above 0"
            elif d["ci95"] is not None and d["mean"] + d["ci95"] < 0:
                reads = "below 0"
            elif d["ci95"] is None:
                reads = "1 seed"
            metric = _metric_label(c)
            if j["rounds"]:
                lo, hi = min(j["rounds"]), max(j["rounds"])
                metric += f" (round {lo})" if lo == hi else f" (rounds {lo}-{hi})"
            lines.append(
                f"| {c.setting} | {c.method} vs {c.baseline} | {metric} | {len(j['seeds'])} | "
                f"{_num(j['method'])} | {_num(j['baseline'])} | {_interval(d)} | "
                f"{_paper_text(c)} | {reads} |"
            )
        lines.append("")
    return lines


def reruns_markdown(reruns: Sequence[dict[str, Any]]) -> list[str]:
    """The committed re-runs of judged cells on other hosts, each against its cell."""
    if not reruns:
        return []
    lines = [
        "### Cells re-run on another host",
        "",
        "A judged cell run again from its stored config on another machine, compared number by "
        "number with the committed cell (every per-round value but wall times, then the summary; "
        "`fedmosaic verify --keep` makes such a re-run). The difference in weighted test accuracy "
        "at the plan's read round is read beside the seed-to-seed spread (standard deviation) "
        "of the same method's cells in that setting.",
        "",
        "| cell | made on | re-run on | code | first difference | numbers that differ | "
        "weighted test accuracy at the read round: cell / re-run (difference) | seed-to-seed sd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reruns:
        setting, method, seed = r["cell"]
        cmp = r["comparison"]
        if cmp.identical:
            first = "none: bit for bit" + ("" if r["complete"] else f" over {cmp.rounds} rounds")
        else:
            rnd, key, _, _ = cmp.first
            first = f"round {rnd} (`{key}`)"
        a, b = r["cell_value"], r["rerun_value"]
        if a is None or b is None:
            values = f"- (the re-run stopped after round {cmp.rounds})"
        else:
            values = f"{a:.2f} / {b:.2f} ({b - a:+.3f} points, round {r['read_round']}"
            d = cmp.by_key.get("acc_weighted")
            values += "" if d is None else f"; largest over the rounds {100 * d.max_abs:.3f}"
            values += ")"
        code = "the cell's own" if r["same_code"] else "other code"
        sd = "-" if r["seed_sd"] is None else f"{r['seed_sd']:.2f} points ({r['seeds']} seeds)"
        lines.append(
            f"| {r['suite']} {setting}/{method}/seed{seed} | {_host_text(r['made'])} | "
            f"{_host_text(r['rerun'])} | {code} | "
            f"{first} | {cmp.differing} of {cmp.values} | {values} | {sd} |"
        )
    return lines + [""]


def markdown(result: dict[str, Any]) -> str:
    """The verdict table, then per plan its rules and its claims' tables, every look, the
    page-wide error control and the exploratory groups."""
    lines = [summary_markdown(result["claims"])]
    seen: set[Path] = set()
    for res in result["claims"]:
        plan: Plan = res["plan"]
        if plan.path not in seen:  # a suite may have several plans (e.g. one per split)
            seen.add(plan.path)
            title = (
                plan.suite if plan.path.stem == plan.suite else f"{plan.suite} ({plan.path.stem})"
            )
            lines += [f"### {title}", ""] + plan_markdown(plan)
        lines += claim_markdown(res)
    lines += looks_markdown(result["claims"])
    lines += page_markdown_table(result["page"])
    lines += exploratory_markdown(result["exploratory"])
    lines += reruns_markdown(result.get("reruns", []))
    lines.append(
        "Values: mean ± half-width of the 95% t-interval over seeds; the gap is the mean of the "
        "per-seed differences (same seed = same split and initial models) with its unadjusted "
        "95% interval. p: the paired two-sided t-test (`at_or_above`: of a gap at the margin's "
        "edge). Holm level: the level the comparison was last tested at within its claim "
        "(Holm's share of alpha at its look); the adjusted interval is at that level and agrees "
        "with the verdict. Seeds for 80% power: at the observed spread of the paired gap (and at "
        "the spread's 95% confidence bounds), the seeds a two-sided t-test at 5% needs to "
        "resolve the named gap. Slope: each method's test-accuracy slope over the plan's last "
        "rounds, mean over seeds (method / baseline). Best-on-val and best-on-test gaps use "
        "rounds up to the compared round; best-on-test selects the round on the test set "
        "(optimistic) and never decides a verdict."
    )
    return "\n".join(lines) + "\n"
