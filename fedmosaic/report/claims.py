"""The seed papers' headline claims, judged from finished cells under their analysis plans.

Each claim, its comparisons and the rules that judge it come from an analysis plan
(:mod:`fedmosaic.report.plans`, ``fedmosaic/suites/plans/<suite>.toml``), written before the
cells that decide it ran or marked as recorded after them. A comparison ``method`` vs
``baseline`` on one suite setting is made per seed (a seed fixes the split and the initial
models): ``d_s = metric(method, s) - metric(baseline, s)`` in percentage points.

Which cells: only the plan's budget folder (``<results>/<budget>``), equal budgets read at their
end: every cell ran the plan's ``rounds`` and is read at its last round; a cell stopped on a
plateau, or of another round count, makes its pair "not comparable". Cells stopped on a plateau
(the ``converged`` folder) appear only in the plan's exploratory groups, which decide nothing.

The test: a paired two-sided t-test, ``H0: mean gap = 0`` (``above``, ``lower``) or
``H0: mean gap = -m`` (``at_or_above``: non-inferiority within the margin ``m``).

Error control: within a claim, Holm's step-down over its comparisons decides which resolve; where
seeds were added after a look, each comparison is tested at its group-sequential nominal level
(Lan-DeMets spending of the step's share of alpha, the plan's boundary; :mod:`.stats`). The
intervals printed beside the verdicts are at the level each comparison was last tested at, so
they agree with the decisions. The page also applies Holm and Benjamini-Hochberg over every
confirmatory comparison of the page, so a reader sees which verdicts survive both.

Labels (a comparison):

- ``above``: **holds** when it resolves with the gap above 0 and the gap is at least half the
  paper's; **holds but smaller** when under half; **does not hold** when it resolves below 0;
  **inconclusive** otherwise.
- ``at_or_above``: **holds within the m-point margin** when the non-inferiority test resolves,
  with the direction spelled out ("below fedbabu by 0.44 [0.25, 0.64]", "level with",
  "above"); **does not hold** when the adjusted interval lies below ``-m``; else inconclusive.
- ``lower`` (bytes, compute): **holds** when it resolves below 0 and the ratio of the means is at
  most the paper's ratio + 0.1; **holds but smaller** above that; **does not hold** when it
  resolves above 0.
- One seed: **inconclusive (1 seed)**. Fewer seeds than the plan's first look: **waiting**.
- Cells that ran but hold no value of the metric on any paired seed (the membership attack of a
  model whose every loss is NaN): **not measurable**, with the reason; a claim counts it as
  inconclusive.

A claim holds when every comparison holds; it does not hold when one resolves against it (after
Holm); else it is inconclusive. A resolved accuracy verdict from less than the paper's budget
(a fraction of the data, fewer rounds) ends "at this budget"; a plan's model substitution is
named in the claim's label; a curve still climbing at the end (its slope over the plan's last
rounds above the plan's tolerance) is named too.

Power: the seeds for 80% power at the 5% level to resolve the paper's gap (``at_or_above``: the
margin plus the paper's gap; without a paper gap, the plan's smallest gap that matters, else the
margin), at the observed spread and at the spread's 95% bounds: "needs 16 (6-553)".

What makes two cells a fair pair is :mod:`.fairness`; the page's Markdown is :mod:`.claims_page`.

    python -m fedmosaic.report.claims                   # -> stdout
    python -m fedmosaic.report.claims --out docs/results/claims.md
    python -m fedmosaic.report.claims --results /elsewhere/docs/results
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedmosaic.report import stats
from fedmosaic.report.claims_page import ALPHA, budget_markdown, markdown, seeds_text
from fedmosaic.report.fairness import (
    _code as fairness_code,
)
from fedmosaic.report.fairness import (
    _rounds_run,
    _suite,
    budget_problems,
    hash_problems,
    pair_problems,
)
from fedmosaic.report.plans import (
    ACCURACY_METRICS,
    MARGIN,
    PLANS,
    Claim,
    Comparison,
    Plan,
    PlanError,
    load_plans,
)
from fedmosaic.report.reruns import compare, compare_summary
from fedmosaic.report.suite_report import METRIC_KEYS, aggregate

HOLDS = "holds"
SMALLER = "holds but smaller"
WITHIN = "holds within the"  # ... m-point margin
INCONCLUSIVE = "inconclusive"
FAILS = "does not hold"
NOT_COMPARABLE = "not comparable"
WAITING = "waiting"
NOT_RUN = "not run"
NOT_MEASURED = "not measurable"  # the cells ran, and hold no value of the metric
RANK = {
    FAILS: 0,
    NOT_COMPARABLE: 0,
    NOT_RUN: 0,
    WAITING: 0,
    INCONCLUSIVE: 1,
    NOT_MEASURED: 1,
    SMALLER: 2,
    WITHIN: 2,
    HOLDS: 3,
}
POWER = 0.8
MAX_SEEDS = stats.MAX_SEEDS
AT_THIS_BUDGET = " at this budget"

# Relative on purpose: the repository's results, resolved against the current directory when read
# (the package lives in site-packages once installed, where no docs/ sits beside it).
RESULTS = Path("docs") / "results"


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


def _val_key(key: str) -> str:
    return "val_" + key  # acc_weighted -> val_acc_weighted, acc_mean -> val_acc_mean


def side_keys(c: Comparison) -> tuple[str, str]:
    """The accuracy keys read for ``method`` and ``baseline``: the plan's weighted/unweighted
    key of each side's prediction (``acc_mean``, or ``acc_local_mean`` where the comparison reads
    that method's ``acc_local``)."""
    suffix = METRIC_KEYS.get(c.accuracy, "acc_weighted")[len("acc") :]  # _weighted | _mean
    return c.prediction(c.method) + suffix, c.prediction(c.baseline) + suffix


def pair_values(
    c: Comparison, a: dict[str, Any], b: dict[str, Any]
) -> tuple[float | None, float | None, int | None]:
    """The metric of ``method`` (doc ``a``) and ``baseline`` (doc ``b``) on one seed (accuracies in
    %), and the round both were read at where that matters (``final``: the last round when both
    ran the same number of rounds, else the last round both evaluated; ``common_round``)."""
    sa, sb = a.get("summary", {}), b.get("summary", {})
    key_a, key_b = side_keys(c)
    if c.metric == "final":
        ra, rb = _rounds_run(a), _rounds_run(b)
        if ra == rb:  # the same length (or no record of it): the final rows
            return _pct(sa.get("final", {}).get(key_a)), _pct(sb.get("final", {}).get(key_b)), ra
        r = min(_last_evaluated(a, key_a), _last_evaluated(b, key_b))
        return _pct(_at_round(a, r, key_a)), _pct(_at_round(b, r, key_b)), r
    if c.metric == "after_finetune":
        va, vb = sa.get(c.metric, {}).get(key_a), sb.get(c.metric, {}).get(key_b)
        return _pct(va), _pct(vb), _rounds_run(a)
    if c.metric == "common_round":
        r = min(_last_evaluated(a, key_a), _last_evaluated(b, key_b))
        return _pct(_at_round(a, r, key_a)), _pct(_at_round(b, r, key_b)), r
    if c.metric == "mean_over_rounds":
        r = min(_last_evaluated(a, key_a), _last_evaluated(b, key_b))
        both = [
            (x, y)
            for t in range(1, r + 1)
            if (x := _at_round(a, t, key_a)) is not None
            and (y := _at_round(b, t, key_b)) is not None
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
            return None if up is None or down is None else (float(up) + float(down)) / 1000

        return kb(sa), kb(sb), None
    if c.metric == "mia_auc":  # eval.membership at the last evaluation, in AUC points (x 100)
        ma, mb = sa.get("membership", {}), sb.get("membership", {})
        return _pct(ma.get("mia_auc")), _pct(mb.get("mia_auc")), _rounds_run(a)
    if c.metric == "paper_cost_g":
        ca, cb = sa.get("paper_cost_total"), sb.get("paper_cost_total")
        return (
            None if ca is None else float(ca) / 1e9,
            None if cb is None else float(cb) / 1e9,
            None,
        )
    raise ValueError(f"unknown comparison metric {c.metric!r}")


def best_up_to(doc: dict[str, Any], key: str, r: int) -> tuple[float | None, float | None]:
    """Test accuracy (%) over rounds 1..r: at the best validation round (the first maximum; None
    without validation data) and the best on test (optimistic: selects the round on the test
    set, as the papers report it)."""
    rows = [x for x in doc.get("rounds", []) if int(x["round"]) <= r and x.get(key) is not None]
    if not rows:
        return None, None
    on_test = max(float(x[key]) for x in rows)
    with_val = [x for x in rows if x.get(_val_key(key)) is not None]
    if not with_val:
        return None, _pct(on_test)
    best = max(with_val, key=lambda x: (float(x[_val_key(key)]), -int(x["round"])))
    return _pct(best[key]), _pct(on_test)


def _pct(v: Any) -> float | None:
    return None if v is None else 100.0 * float(v)


# ---- fair pairs ------------------------------------------------------------------------------


def curve_slope(doc: dict[str, Any], key: str, fraction: float) -> float | None:
    """A cell's accuracy slope (points per 10 rounds) over its last ``fraction`` of rounds."""
    rows = [
        (int(r["round"]), 100 * float(r[key]))
        for r in doc.get("rounds", [])
        if r.get(key) is not None
    ]
    if len(rows) < 2:
        return None
    last = max(r for r, _ in rows)
    start = last - max(2, math.ceil(fraction * last)) + 1
    return stats.slope_per_10([(r, v) for r, v in rows if r >= start])


# ---- one comparison's evidence ---------------------------------------------------------------
def look_schedule(c: Comparison, plan: Plan | None, n: int) -> tuple[tuple[int, ...], int, str]:
    """``(schedule, k, problem)``: the looks' seed counts (the last one the maximum), the index of
    the look this reading is, and why it cannot be read ("" when it can). Recorded looks must end
    at ``n``; a planned schedule reads its largest look at or under ``n``."""
    if c.looks:
        if n != c.looks[-1]:
            return (
                c.looks,
                len(c.looks) - 1,
                (
                    f"{n} paired seeds, but the plan's record of looks ends at {c.looks[-1]}: "
                    "record the new look in the plan"
                ),
            )
        return c.looks, len(c.looks) - 1, ""
    if plan is not None and plan.looks:
        taken = [i for i, m in enumerate(plan.looks) if m <= n]
        if not taken:
            return plan.looks, -1, f"{n} of the {plan.looks[0]} seeds of the first planned look"
        return plan.looks, taken[-1], ""
    return (n,), 0, ""


def target_gap(c: Comparison, plan: Plan | None) -> tuple[float | None, str]:
    """The gap the power column aims at, and its name."""
    if c.relation == "lower" or c.metric not in ACCURACY_METRICS:
        return None, ""
    paper_gap = None if c.paper is None else c.paper[0] - c.paper[1]
    if c.relation == "at_or_above":
        return c.margin + max(paper_gap or 0.0, 0.0), "margin + paper gap"
    if paper_gap is not None and paper_gap > 0:
        return paper_gap, "paper gap"
    if plan is not None and plan.smallest_gap > 0:
        return plan.smallest_gap, "smallest gap that matters"
    return MARGIN, "default 1-point gap"


def judge(
    c: Comparison,
    cells: dict[tuple[str, str, int], dict[str, Any]],
    plan: Plan | None = None,
    confirmatory: bool = True,
) -> dict[str, Any]:
    """The evidence of one comparison: the paired seeds of this look, the per-seed values, the
    test, the fair-pair and budget checks, the looks, the power and the side read-outs. The
    label is decided per claim (:func:`decide`), under the plan's error rule."""
    all_seeds = paired_seeds(c, cells)
    schedule, k, wait = look_schedule(c, plan, len(all_seeds)) if all_seeds else ((0,), 0, "")
    seeds = all_seeds[: schedule[k]] if (c.looks or (plan and plan.looks)) and k >= 0 else all_seeds
    if k < 0:
        seeds = []
    va, vb, vd, rounds, problems = [], [], [], [], []
    val_d, test_d, slopes_a, slopes_b = [], [], [], []
    lost: list[tuple[str, int, int, int]] = []  # (method, seed, clients refused, clients)
    key_a, key_b = side_keys(c)
    for s in all_seeds:
        a, b = cells[(c.setting, c.method, s)], cells[(c.setting, c.baseline, s)]
        problems += [f"seed {s}: {p}" for p in pair_problems(c, a, b)]
        if confirmatory and plan is not None:
            for label, doc in ((c.method, a), (c.baseline, b)):
                problems += [f"seed {s}: {p}" for p in budget_problems(plan, label, doc)]
    for s in seeds:
        a, b = cells[(c.setting, c.method, s)], cells[(c.setting, c.baseline, s)]
        x, y, r = pair_values(c, a, b)
        if x is None or y is None:
            continue
        va.append(x)
        vb.append(y)
        vd.append(x - y)
        for name, doc in ((c.method, a), (c.baseline, b)):
            if n := len(refused_clients(doc)):
                total = doc.get("config", {}).get("data", {}).get("num_clients", 0)
                lost.append((name, s, n, int(total)))
        if r is not None:
            rounds.append(r)
        if c.metric == "final" and r is not None:
            (av, at), (bv, bt) = best_up_to(a, key_a, r), best_up_to(b, key_b, r)
            val_d.append(None if av is None or bv is None else av - bv)
            test_d.append(None if at is None or bt is None else at - bt)
        if plan is not None and plan.flat_window > 0 and c.metric in ACCURACY_METRICS:
            slopes_a.append(curve_slope(a, key_a, plan.flat_window))
            slopes_b.append(curve_slope(b, key_b, plan.flat_window))
    null = -c.margin if c.relation == "at_or_above" else 0.0
    test = stats.paired_test(vd, null) if vd else None
    direction = stats.paired_test(vd, 0.0) if vd else None
    res = {"test_images": 0, "per_image": None, "sampling_sd": None}
    b_ = aggregate(vb)
    if seeds and c.metric in ACCURACY_METRICS:
        res = resolution(cells[(c.setting, c.baseline, seeds[0])], b_["mean"])
    delta, basis = target_gap(c, plan)
    sd = None if test is None else test.sd
    point, low, high = stats.seeds_range(sd, len(vd), delta) if delta else (None, None, None)
    looks_read = []
    if len(schedule) > 1 and k >= 0:  # every look up to this one, each on its first seeds
        for m in schedule[: k + 1]:
            if m <= len(all_seeds):
                d = [v for s in all_seeds[:m] for v in [_diff(c, cells, s)] if v is not None]
                looks_read.append((m, stats.paired_test(d, null) if len(d) == m else None))
    return {
        "comparison": c,
        "seeds": seeds,
        "all_seeds": all_seeds,
        "method": aggregate(va),
        "baseline": b_,
        "diff": aggregate(vd),
        "diffs": vd,
        "test": test,
        "direction": direction,
        "rounds": rounds,
        "problems": problems,
        "wait": wait if all_seeds else "",
        "schedule": schedule,
        "look": k,
        "looks_read": looks_read,
        "power": {
            "delta": delta,
            "basis": basis,
            "seeds": point,
            "low": low,
            "high": high,
            "spread": sd is not None,
        },
        "resolution": res,
        "best_on_val": aggregate(val_d),
        "best_on_test": aggregate(test_d),
        "slopes": (_mean_or_none(slopes_a), _mean_or_none(slopes_b)),
        "refused": lost,
    }


def refused_clients(doc: dict[str, Any]) -> list[int]:
    """The clients whose uploads the server refused in some round of ``doc`` (a diverged
    client's non-finite prototypes or weights, an upload the guard or the robust rule
    dropped): the federation went on without them, so the cell's accuracy carries them."""
    out: set[int] = set()
    for r in doc.get("rounds", []):
        out.update(int(c) for c in r.get("rejected") or [])
    return sorted(out)


def refused(judged: Sequence[dict[str, Any]]) -> tuple[list[str], int, int]:
    """The cells read whose federation lost clients' uploads, per method and setting ("fedtgp_mse
    (pathological): 5 of 20 clients at seed 1"), with how many of the cells read they are."""
    lost: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}
    cells: set[tuple[str, str, int]] = set()
    for j in judged:
        c = j["comparison"]
        for s in j["seeds"]:
            cells.update({(c.method, c.setting, s), (c.baseline, c.setting, s)})
        for name, seed, n, total in j.get("refused", []):
            lost.setdefault((name, c.setting), {})[seed] = (n, total)
    out = []
    for (name, setting), by_seed in lost.items():
        seeds = sorted(by_seed)
        counts = ", ".join(str(by_seed[s][0]) for s in seeds)
        totals = {by_seed[s][1] for s in seeds}
        of = f" of {totals.pop()}" if len(totals) == 1 and 0 not in totals else ""
        word = "seed" if len(seeds) == 1 else "seeds"
        out.append(
            f"{name} ({setting}): {counts}{of} clients at {word} {', '.join(map(str, seeds))}"
        )
    return out, sum(len(v) for v in lost.values()), len(cells)


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _diff(c: Comparison, cells: dict[tuple[str, str, int], dict[str, Any]], s: int) -> float | None:
    x, y, _ = pair_values(c, cells[(c.setting, c.method, s)], cells[(c.setting, c.baseline, s)])
    return None if x is None or y is None else x - y


def paired_seeds(c: Comparison, cells: dict[tuple[str, str, int], dict[str, Any]]) -> list[int]:
    return sorted(
        s
        for (st, m, s) in cells
        if st == c.setting and m == c.method and (c.setting, c.baseline, s) in cells
    )


def resolution(doc: dict[str, Any], accuracy_pct: float | None) -> dict[str, Any]:
    """A cell's test-set resolution: its test images, points per image, and the binomial
    sampling spread (points) of one accuracy near ``accuracy_pct`` on that many images."""
    n = sum(int(cl.get("num_test", 0)) for cl in doc.get("clients", []))
    if n == 0 or accuracy_pct is None:
        return {"test_images": n, "per_image": None, "sampling_sd": None}
    p = min(max(accuracy_pct / 100.0, 0.0), 1.0)
    return {
        "test_images": n,
        "per_image": 100.0 / n,
        "sampling_sd": 100.0 * math.sqrt(p * (1 - p) / n),
    }


# ---- verdicts ----------------------------------------------------------------------------------
def _ready(j: dict[str, Any]) -> bool:
    return j["test"] is not None and j["test"].p is not None and not j["problems"] and not j["wait"]


def decide(judged: Sequence[dict[str, Any]], plan: Plan | None) -> None:
    """Label a claim's comparisons in place: Holm's step-down over the claim (each comparison at
    its look's group-sequential level), the interval at the level each was last tested at, and
    the label from it (module docstring)."""
    alpha = plan.alpha if plan is not None else ALPHA
    kind = plan.boundary if plan is not None else "pocock"
    family = [
        stats.Family(j["test"].p if _ready(j) else None, tuple(j["schedule"]), max(j["look"], 0))
        for j in judged
    ]
    rejected, levels = stats.sequential_holm(family, alpha, kind)
    for j, rej, level in zip(judged, rejected, levels, strict=True):
        j["rejected"], j["level"] = rej, level
        j["interval"] = j["test"].interval(level) if j["test"] is not None else None
        j["verdict"] = label(j)


def label(j: dict[str, Any]) -> str:
    """One comparison's label from its Holm decision and adjusted interval."""
    c: Comparison = j["comparison"]
    if not j["all_seeds"]:
        return NOT_RUN
    if j["problems"]:
        more = f" (and {len(j['problems']) - 1} more)" if len(j["problems"]) > 1 else ""
        return f"{NOT_COMPARABLE}: {j['problems'][0]}{more}"
    if j["wait"]:
        return f"{WAITING}: {j['wait']}"
    if j["test"] is None:
        if j["seeds"] and not j["diffs"]:
            why = " (the attack's models gave no finite loss)" if c.metric == "mia_auc" else ""
            n = len(j["seeds"])
            return f"{NOT_MEASURED}: the cells of {n} paired seeds hold no {c.metric}{why}"
        return NOT_RUN
    t: stats.Test = j["test"]
    if t.n == 1 or t.p is None:
        return INCONCLUSIVE + " (1 seed)"
    lo, hi = j["interval"]
    mean = t.mean
    if c.relation == "above":
        if j["rejected"]:
            if mean > 0:
                return SMALLER if _short(c, mean) else HOLDS
            return FAILS
        return INCONCLUSIVE + needs(j)
    if c.relation == "at_or_above":  # the test is of a gap at -m: which side resolved matters
        if j["rejected"] and mean < -c.margin:
            return FAILS
        if j["rejected"]:
            if lo > 0:
                side = f"above {c.baseline} by {mean:.2f} [{lo:.2f}, {hi:.2f}]"
            elif hi < 0:
                side = f"below {c.baseline} by {-mean:.2f} [{-hi:.2f}, {-lo:.2f}]"
            else:
                side = f"level with {c.baseline}: {mean:+.2f} [{lo:+.2f}, {hi:+.2f}]"
            return f"{WITHIN} {c.margin:g}-point margin; {side}"
        return INCONCLUSIVE + needs(j)
    if c.relation == "lower":
        ma, mb = j["method"]["mean"], j["baseline"]["mean"]
        if j["rejected"] and mean < 0:
            if c.paper is not None and mb and ma / mb > c.paper[0] / c.paper[1] + 0.1:
                return SMALLER
            return HOLDS
        if j["rejected"]:
            return FAILS
        return INCONCLUSIVE
    raise ValueError(f"unknown relation {c.relation!r}")


def _short(c: Comparison, mean_gap: float) -> bool:
    """Whether the gap is under half the paper's (never, without a paper gap)."""
    if c.paper is None:
        return False
    paper_gap = c.paper[0] - c.paper[1]
    return paper_gap > 0 and mean_gap < 0.5 * paper_gap


def needs(j: dict[str, Any]) -> str:
    """The suffix of an inconclusive label: what would resolve it, and where the paper's gap sits."""
    p, c = j["power"], j["comparison"]
    if p["delta"] is None:
        return ""
    if p["seeds"] is not None and p["seeds"] <= j["test"].n:
        lo, hi = j["interval"]
        out = (
            f": {j['test'].n} seeds already give 80% power for the {p['basis']} "
            f"({p['delta']:.2f}); the interval [{lo:+.2f}, {hi:+.2f}] bounds any real gap"
        )
    else:
        out = f": needs {seeds_text(p)} seeds for the {p['basis']} ({p['delta']:.2f})"
    gap = None if c.paper is None else c.paper[0] - c.paper[1]
    lo, hi = j["interval"]
    if c.relation == "above" and gap is not None and gap > 0 and hi < gap:
        out += f"; the paper's gap (+{gap:.2f}) is above the interval"
    return out


def claim_verdict(verdicts: Sequence[str]) -> str:
    """A claim is a conjunction: one comparison that does not hold settles it (after Holm) even
    with others not run yet; otherwise a missing, waiting or unfair one leaves it at that; all
    holding: the weakest hold; else inconclusive."""
    failed = [v for v in verdicts if v.startswith(FAILS)]
    if failed:
        return FAILS
    if not verdicts or any(v.startswith(NOT_RUN) for v in verdicts):
        return "not run (cells missing)"
    waiting = [v for v in verdicts if v.startswith(WAITING)]
    if waiting:  # cells of the planned look are in for some seeds, not yet for all
        return waiting[0]
    if any(v.startswith(NOT_COMPARABLE) for v in verdicts):
        return NOT_COMPARABLE
    if any(v.startswith((INCONCLUSIVE, NOT_MEASURED)) for v in verdicts):
        return INCONCLUSIVE
    worst = min(verdicts, key=lambda v: RANK[next(k for k in RANK if v.startswith(k))])
    return worst.split(";")[0]


def reduced_budget(c: Comparison, j: dict[str, Any]) -> bool:
    """Whether a comparison's cells ran less than the paper: a fraction of the data, or fewer
    rounds than the suite's ``paper_rounds`` at the round compared."""
    if c.metric not in ACCURACY_METRICS:
        return False  # costs (bytes, Table 4 compute) do not depend on the budget's length
    if any(f < 1.0 for f in j.get("fraction", [])):
        return True
    definition = _suite(c.suite)
    paper_rounds = None if definition is None else definition.paper_rounds
    return bool(paper_rounds and j["rounds"] and min(j["rounds"]) < paper_rounds)


def climbing(plan: Plan | None, judged: Sequence[dict[str, Any]]) -> list[str]:
    """The methods whose mean slope over the plan's last rounds is above its tolerance."""
    if plan is None or plan.flat_window <= 0:
        return []
    out: list[str] = []
    for j in judged:
        c = j["comparison"]
        for name, slope in zip((c.method, c.baseline), j["slopes"], strict=True):
            tag = f"{name} ({c.setting})"
            if slope is not None and slope > plan.flat_tolerance and tag not in out:
                out.append(tag)
    return out


def budget_rows(root: Path = RESULTS / "full") -> list[dict[str, Any]]:
    """Per suite folder under ``root``: its cells, seeds, data fractions, rounds run, the wall
    hours they took on this machine and the code versions (source hashes) that produced them."""
    rows: list[dict[str, Any]] = []
    if not root.is_dir():
        return rows
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
                "folder": root.name,
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


# ---- the page ----------------------------------------------------------------------------------
def _fractions(
    cells: dict[tuple[str, str, int], dict[str, Any]], c: Comparison, seeds: Sequence[int]
) -> list[float]:
    return sorted(
        {
            cells[(c.setting, m, s)].get("config", {}).get("data", {}).get("subsample", 1.0)
            for s in seeds
            for m in (c.method, c.baseline)
        }
    )


def _dates(
    cells: dict[tuple[str, str, int], dict[str, Any]], judged: Sequence[dict[str, Any]]
) -> tuple[str, str] | None:
    stamps = sorted(
        str(cells[(j["comparison"].setting, m, s)].get("provenance", {}).get("started") or "")
        for j in judged
        for s in j["all_seeds"]
        for m in (j["comparison"].method, j["comparison"].baseline)
    )
    stamps = [s for s in stamps if s]
    return (stamps[0], stamps[-1]) if stamps else None


def host_key(doc: dict[str, Any]) -> tuple[str, str, str, str]:
    """What decides whether another host re-runs a cell bit for bit: the numerics mode, the
    CPU's vendor and model line, and the branch MKL ran (as MKL read it back; cells made before
    it was recorded: what the environment asked for, marked so)."""
    prov = doc.get("provenance", {})
    host = prov.get("host", {}) if isinstance(prov, dict) else {}
    cpu_id = host.get("cpu_id", {}) if isinstance(host, dict) else {}
    num = prov.get("numerics", {}) if isinstance(prov, dict) else {}
    mode = str(num.get("mode", "native")) if isinstance(num, dict) else "native"
    vendor = str(cpu_id.get("vendor_id", "?")) if isinstance(cpu_id, dict) else "?"
    cpu = str(host.get("cpu", "?")) if isinstance(host, dict) else "?"
    if isinstance(cpu_id, dict) and cpu_id.get("vendor_id"):
        cpu += (
            f" ({vendor}, family {cpu_id.get('cpu family', '?')} model {cpu_id.get('model', '?')})"
        )
    mkl = num.get("mkl_branch") if isinstance(num, dict) else None
    if isinstance(mkl, dict):
        branch = str(mkl.get("branch"))
    else:
        asked = num.get("env", {}).get("MKL_CBWR") if isinstance(num, dict) else None
        branch = f"{str(asked).split(',')[0]} asked, not read back" if asked else "unpinned"
    return mode, vendor, cpu, branch


def _hosts(
    cells: dict[tuple[str, str, int], dict[str, Any]], judged: Sequence[dict[str, Any]]
) -> list[tuple[tuple[str, str, str, str], int]]:
    """The judged cells counted by :func:`host_key`."""
    counts: dict[tuple[str, str, str, str], int] = {}
    seen = set()
    for j in judged:
        for s in j["all_seeds"]:
            for m in (j["comparison"].method, j["comparison"].baseline):
                key = (j["comparison"].setting, m, s)
                if key in cells and key not in seen:
                    seen.add(key)
                    hk = host_key(cells[key])
                    counts[hk] = counts.get(hk, 0) + 1
    return sorted(counts.items())


def reruns(
    results: Path,
    plans: Sequence[Plan],
    cells_of: Callable[[str, str], dict[tuple[str, str, int], dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """The committed re-runs of plans' cells on other hosts, each compared number by number with
    the cell it re-ran (``<budget>/<suite>/reruns/<setting>/<method>/seed<k>/<host>/results.json``:
    the same config, run again on another machine). Per re-run: both hosts (:func:`host_key`),
    whether the code was the cell's own, the rounds and numbers that differ, and the weighted
    test accuracy at the plan's read round on both hosts beside the seed-to-seed spread of that
    method's cells in that setting (what a host's difference is measured against).
    ``cells_of(budget, suite)``: the cells already loaded (default: read them here)."""
    out: list[dict[str, Any]] = []
    for budget, suite, read_round in sorted({(p.budget, p.suite, p.rounds) for p in plans}):
        base = results / budget / suite / "reruns"
        if not base.is_dir():
            continue
        cells = cells_of(budget, suite) if cells_of else load_cells(results / budget, suite)
        for path in sorted(base.glob("*/*/seed*/*/results.json")):
            seed_dir = path.parent.parent
            setting, method = seed_dir.parent.parent.name, seed_dir.parent.name
            try:
                seed = int(seed_dir.name.removeprefix("seed"))
                doc = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                raise ValueError(f"{path}: not a re-run's results.json ({exc})") from exc
            cell = cells.get((setting, method, seed))
            if cell is None:
                raise ValueError(
                    f"{path}: re-runs {setting}/{method}/seed{seed}, not a committed cell"
                )
            rounds = doc.get("rounds") if isinstance(doc, dict) else None
            if (
                not rounds
                or not isinstance(rounds, list)
                or not all(isinstance(r, dict) for r in rounds)
            ):
                raise ValueError(f"{path}: not a re-run's results.json (no per-round records)")
            if not isinstance(doc.get("cell"), dict):
                raise ValueError(f"{path}: not a re-run's results.json (no cell record)")
            problems = hash_problems("the re-run", doc)
            if problems:
                raise ValueError(f"{path}: {problems[0]}")
            if doc["cell"].get("config_hash") != cell.get("cell", {}).get("config_hash"):
                raise ValueError(
                    f"{path}: another config than the cell {setting}/{method}/seed{seed}"
                )
            cmp = compare(cell["rounds"], doc["rounds"])
            complete = len(doc["rounds"]) == len(cell["rounds"])
            if complete and isinstance(doc.get("summary"), dict):
                compare_summary(cmp, cell.get("summary", {}), doc["summary"])
            spread = [
                v
                for (st, m, _), d in sorted(cells.items())
                if st == setting and m == method
                for v in [_pct(_at_round(d, read_round, "acc_weighted"))]
                if v is not None
            ]
            code_a, code_b = fairness_code(cell), fairness_code(doc)
            out.append(
                {
                    "suite": suite,
                    "budget": budget,
                    "cell": (setting, method, seed),
                    "made": host_key(cell),
                    "rerun": host_key(doc),
                    "same_code": code_a is not None and code_a == code_b,
                    "comparison": cmp,
                    "complete": complete,
                    "read_round": read_round,
                    "cell_value": _pct(_at_round(cell, read_round, "acc_weighted")),
                    "rerun_value": _pct(_at_round(doc, read_round, "acc_weighted")),
                    "seed_sd": statistics.stdev(spread) if len(spread) >= 2 else None,
                    "seeds": len(spread),
                }
            )
    return out


def evaluate(results: Path = RESULTS, plans: Sequence[Plan] | None = None) -> dict[str, Any]:
    """Every plan's claims judged from its budget's cells under ``results``, the page-wide error
    control over all confirmatory comparisons, and the exploratory groups."""
    plans = load_plans() if plans is None else list(plans)
    cache: dict[tuple[Path, str], dict[tuple[str, str, int], dict[str, Any]]] = {}

    def cells_of(budget: str, suite: str) -> dict[tuple[str, str, int], dict[str, Any]]:
        root = results / budget
        if (root, suite) not in cache:
            cache[(root, suite)] = load_cells(root, suite) if root.is_dir() else {}
        return cache[(root, suite)]

    claims_out, explore_out = [], []
    for plan in plans:
        cells = cells_of(plan.budget, plan.suite)
        for claim in plan.claims:
            judged = [judge(c, cells, plan) for c in claim.comparisons]
            for j in judged:
                j["source"] = plan.budget if j["all_seeds"] else "-"
                j["fraction"] = _fractions(cells, j["comparison"], j["seeds"])
            decide(judged, plan)
            verdict = claim_verdict([j["verdict"] for j in judged])
            if verdict.startswith((HOLDS, FAILS, WITHIN, SMALLER)):
                if any(reduced_budget(j["comparison"], j) for j in judged):
                    verdict += AT_THIS_BUDGET
                if plan.substitution:
                    verdict += f" ({plan.substitution})"
            up = climbing(plan, judged)
            if up and not verdict.startswith((NOT_RUN, WAITING)):
                verdict += f"; still climbing at round {plan.rounds}: {', '.join(up)}"
            lost, n_lost, n_read = refused(judged)
            if n_lost and not verdict.startswith((NOT_RUN, WAITING)):
                verdict += f"; clients' uploads refused in {n_lost} of the {n_read} cells read"
            claims_out.append(
                {
                    "claim": claim,
                    "plan": plan,
                    "comparisons": judged,
                    "verdict": verdict,
                    "dates": _dates(cells, judged),
                    "hosts": _hosts(cells, judged),
                    "refused": lost,
                }
            )
        for group in plan.exploratory:
            cells_e = cells_of(group.budget, plan.suite)
            rows = []
            for c in group.comparisons:
                j = judge(c, cells_e, None, confirmatory=False)
                j["source"] = group.budget
                j["fraction"] = _fractions(cells_e, c, j["seeds"])
                rows.append(j)
            explore_out.append({"plan": plan, "group": group, "comparisons": rows})
    page = page_family(claims_out)
    return {
        "claims": claims_out,
        "page": page,
        "exploratory": explore_out,
        "reruns": reruns(results, plans, cells_of),
    }


def page_family(claims_out: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Holm (with each comparison's looks) and Benjamini-Hochberg over every distinct
    confirmatory comparison of the page that has a p-value."""
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for res in claims_out:
        for j in res["comparisons"]:
            if _ready(j) and j["comparison"].key not in rows:
                rows[j["comparison"].key] = {"claim": res["claim"].key, "j": j}
    items = list(rows.values())
    family = [
        stats.Family(r["j"]["test"].p, tuple(r["j"]["schedule"]), max(r["j"]["look"], 0))
        for r in items
    ]
    rejected, _ = stats.sequential_holm(family, ALPHA, "pocock")
    qs = stats.benjamini_hochberg([r["j"]["test"].p for r in items]) if items else []
    for r, rej, q in zip(items, rejected, qs, strict=True):
        r["holm"], r["bh_q"] = rej, q
    return items


def page(results: Path = RESULTS) -> str:
    """The whole claims page: the verdicts, the tables and the cells behind them."""
    text = markdown(evaluate(results))
    text += "\n#### The cells behind these verdicts\n\n"
    rows = [r for name in ("full", "equal", "converged") for r in budget_rows(results / name)]
    return text + budget_markdown(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedmosaic.report.claims", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        metavar="RESULTS",
        help="the results folder whose budget folders (full/, equal/, converged/) the plans read "
        f"(default: {RESULTS}, relative to the current directory: run from the repository root)",
    )
    p.add_argument("--out", type=Path, help="write the Markdown here (default: stdout)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(
            f"error: --results {args.results} is not a folder (run from the repository root, or "
            "pass --results DIR)",
            file=sys.stderr,
        )
        return 2
    try:
        text = page(args.results)
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


__all__ = [
    "Claim",
    "Comparison",
    "PLANS",
    "PlanError",
    "decide",
    "evaluate",
    "judge",
    "label",
    "markdown",
    "pair_problems",
]
