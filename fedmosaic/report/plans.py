"""Analysis plans: what each claim compares, on which cells, read at which round, under which
error rule, written as data (``fedmosaic/suites/plans/<suite>.toml``) before the cells that
decide it run, and read by the claims page (:mod:`fedmosaic.report.claims`).

A plan file holds one ``[plan]`` table (the budget whose cells decide, the round budget, the
numerics, the primary metric, alpha, the error rule, the looks and their boundary, the
flatness check, a margin or the smallest gap that matters with the reason for its size, the
model substitution a verdict must name), its ``[[claims]]`` with their ``[[claims.comparisons]]``
(the confirmatory family), and ``[[exploratory]]`` groups (other cells, shown apart; they decide
nothing). Unknown keys are refused by name, so a typo cannot silently drop a rule.

The page shows each plan beside its verdicts with the date it was committed (git, else its
``written`` field) and the dates of the cells it judges: a plan recorded after its cells says so.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedmosaic.report.stats import BOUNDARIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PLANS = Path(__file__).resolve().parents[1] / "suites" / "plans"
MARGIN = 1.0  # points: the default non-inferiority margin
RELATIONS = ("above", "at_or_above", "lower")
METRICS = (
    "final",
    "after_finetune",
    "common_round",
    "mean_over_rounds",
    "kb_per_round",
    "paper_cost_g",
    "mia_auc",  # eval.membership: the attack's AUC on the final models (x 100, mean over clients)
)
ACCURACY_METRICS = ("final", "after_finetune", "common_round", "mean_over_rounds")


class PlanError(ValueError):
    """A plan file that cannot be used (with the file and the key)."""


@dataclass(frozen=True)
class Comparison:
    """``method`` against ``baseline`` on ``suite``/``setting``, as the paper has it."""

    suite: str
    setting: str
    method: str
    baseline: str
    relation: str = "above"  # above | at_or_above | lower
    # final | after_finetune | common_round | mean_over_rounds | kb_per_round | paper_cost_g |
    # mia_auc
    metric: str = "final"
    accuracy: str = "weighted"  # the paper's: weighted | unweighted (accuracy metrics only)
    paper: tuple[float, float] | None = None  # the paper's (method, baseline) numbers
    paper_note: str = ""  # where the paper's numbers come from, when not this setting's
    margin: float = MARGIN  # at_or_above: the non-inferiority margin (points)
    # algorithm keys that must be equal in both cells (e.g. one client term for both methods)
    same: tuple[str, ...] = ()
    # the looks taken (paired seeds at each), recorded where seeds were added after a look; empty:
    # the plan's schedule
    looks: tuple[int, ...] = ()
    # dotted config keys the paper prescribes differently for the two methods (allowed to differ)
    declared: tuple[str, ...] = ()
    # (method, prediction): read that method's accuracy from another of its recorded predictions
    # (``acc_local`` -> ``acc_local_mean``); the others read the headline ``acc``
    predictions: tuple[tuple[str, str], ...] = ()

    def prediction(self, method: str) -> str:
        """The prediction whose accuracy is read for ``method`` (``acc``: the headline)."""
        return dict(self.predictions).get(method, "acc")

    @property
    def key(self) -> tuple[str, str, str, str, str, str]:
        return (self.suite, self.setting, self.method, self.baseline, self.metric, self.relation)


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    comparisons: tuple[Comparison, ...]


@dataclass(frozen=True)
class Exploratory:
    budget: str  # the cells folder (docs/results/<budget>)
    note: str
    comparisons: tuple[Comparison, ...]


@dataclass(frozen=True)
class Plan:
    suite: str
    path: Path
    written: str
    budget: str  # the cells folder whose cells decide (docs/results/<budget>)
    rounds: int
    numerics: str
    primary: str
    alpha: float = 0.05
    error_rule: str = "holm"
    looks: tuple[int, ...] = ()  # planned looks (seeds); empty: one look at whatever ran
    boundary: str = "pocock"
    flat_window: float = 0.0  # 0: no flatness check
    flat_tolerance: float = 0.1
    margin: float = MARGIN
    margin_reason: str = ""
    smallest_gap: float = 0.0
    smallest_gap_reason: str = ""
    substitution: str = ""
    command: str = ""
    reason: str = ""
    cross_host: str = ""  # the measured difference of these cells on a host of another level
    claims: tuple[Claim, ...] = ()
    exploratory: tuple[Exploratory, ...] = field(default=())

    def committed(self) -> str:
        """The date the plan was first committed (git), else its ``written`` field."""
        return _first_commit(self.path) or self.written


@functools.lru_cache(maxsize=64)
def _first_commit(path: Path) -> str | None:
    """The commit date (ISO 8601) that added ``path``, once per process (one git call a plan,
    not one per table that shows it); None outside a checkout."""
    try:
        out = subprocess.run(
            ["git", "log", "--diff-filter=A", "--format=%cI", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[-1] if out else None


_PLAN_KEYS = {
    "suite",
    "written",
    "budget",
    "rounds",
    "numerics",
    "primary",
    "alpha",
    "error_rule",
    "looks",
    "boundary",
    "flat_window",
    "flat_tolerance",
    "margin",
    "margin_reason",
    "smallest_gap",
    "smallest_gap_reason",
    "substitution",
    "command",
    "reason",
    "cross_host",
}
_COMPARISON_KEYS = {
    "setting",
    "method",
    "baseline",
    "relation",
    "metric",
    "accuracy",
    "paper",
    "paper_note",
    "margin",
    "same",
    "looks",
    "declared",
}


def _unknown(where: str, got: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(got) - known)
    if extra:
        raise PlanError(f"{where}: unknown key(s) {', '.join(extra)}")


def _looks(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in value
    ):
        raise PlanError(f"{where}: looks must be a list of seed counts >= 2, got {value!r}")
    if any(b <= a for a, b in zip(value, value[1:], strict=False)):
        raise PlanError(f"{where}: looks {value} must increase")
    return tuple(value)


def _comparison(where: str, suite: str, raw: dict[str, Any], margin: float) -> Comparison:
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: a comparison is a table, got {raw!r}")
    _unknown(where, raw, _COMPARISON_KEYS)
    for k in ("setting", "method", "baseline"):
        if not isinstance(raw.get(k), str) or not raw[k]:
            raise PlanError(f"{where}: {k} missing")
    relation = raw.get("relation", "above")
    metric = raw.get("metric", "final")
    if relation not in RELATIONS:
        raise PlanError(f"{where}: relation {relation!r}: choose one of {', '.join(RELATIONS)}")
    if metric not in METRICS:
        raise PlanError(f"{where}: metric {metric!r}: choose one of {', '.join(METRICS)}")
    paper = raw.get("paper")
    if paper is not None and (
        not isinstance(paper, list)
        or len(paper) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in paper)
    ):
        raise PlanError(f"{where}: paper must be [method, baseline] numbers, got {paper!r}")
    m = raw.get("margin", margin)
    if not isinstance(m, int | float) or isinstance(m, bool) or not m > 0:
        raise PlanError(f"{where}: margin must be a positive number, got {m!r}")
    return Comparison(
        suite=suite,
        setting=raw["setting"],
        method=raw["method"],
        baseline=raw["baseline"],
        relation=relation,
        metric=metric,
        accuracy=raw.get("accuracy", "weighted"),
        paper=None if paper is None else (float(paper[0]), float(paper[1])),
        paper_note=str(raw.get("paper_note", "")),
        margin=float(m),
        same=tuple(raw.get("same", ())),
        looks=_looks(where, raw["looks"]) if "looks" in raw else (),
        declared=tuple(raw.get("declared", ())),
    )


_PREDICTION = re.compile(r"acc(_[a-z0-9]+)*")


def _predictions(where: str, raw: Any) -> tuple[tuple[str, str], ...]:
    """``{method = "acc_local", ...}``: the recorded prediction each method is read from."""
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _PREDICTION.fullmatch(v)
        for k, v in raw.items()
    ):
        raise PlanError(
            f"{where}: predictions must map method names to recorded predictions such as "
            f'"acc_local", got {raw!r}'
        )
    return tuple(sorted(raw.items()))


def load_plan(path: Path) -> Plan:
    """Parse and check one plan file (:class:`PlanError` names the file and the key)."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PlanError(f"{path}: not a readable plan ({exc})") from exc
    _unknown(str(path), raw, {"plan", "claims", "exploratory"})
    head = raw.get("plan")
    if not isinstance(head, dict):
        raise PlanError(f"{path}: no [plan] table")
    _unknown(f"{path} [plan]", head, _PLAN_KEYS)
    for k in ("suite", "written", "budget", "rounds", "numerics", "primary"):
        if k not in head:
            raise PlanError(f"{path} [plan]: {k} missing")
    suite = str(head["suite"])
    if head.get("boundary", "pocock") not in BOUNDARIES:
        raise PlanError(f"{path} [plan]: boundary {head['boundary']!r}: choose {BOUNDARIES}")
    if head.get("error_rule", "holm") != "holm":
        raise PlanError(f"{path} [plan]: error_rule {head['error_rule']!r}: only holm")
    alpha = head.get("alpha", 0.05)
    if not isinstance(alpha, float) or not 0 < alpha < 0.5:
        raise PlanError(f"{path} [plan]: alpha must be in (0, 0.5), got {alpha!r}")
    margin = float(head.get("margin", MARGIN))
    claims = []
    for i, c in enumerate(raw.get("claims", [])):
        where = f"{path} claims[{i}]"
        _unknown(where, c, {"key", "title", "comparisons"})
        comps = tuple(
            _comparison(f"{where}.comparisons[{j}]", suite, x, margin)
            for j, x in enumerate(c.get("comparisons", []))
        )
        if not comps:
            raise PlanError(f"{where}: no comparisons")
        claims.append(Claim(str(c.get("key", "")), str(c.get("title", "")), comps))
    exploratory = []
    for i, e in enumerate(raw.get("exploratory", [])):
        where = f"{path} exploratory[{i}]"
        _unknown(where, e, {"budget", "note", "comparisons", "predictions"})
        comps_raw = e.get("comparisons", [])
        if comps_raw == "confirmatory":  # the plan's own comparisons, read from other cells
            comps = tuple(x for cl in claims for x in cl.comparisons)
        else:
            comps = tuple(
                _comparison(f"{where}.comparisons[{j}]", suite, x, margin)
                for j, x in enumerate(comps_raw)
            )
        preds = _predictions(where, e.get("predictions", {}))
        if preds:  # the same comparisons, some methods read from another prediction
            comps = tuple(replace(x, predictions=preds) for x in comps)
        exploratory.append(Exploratory(str(e.get("budget", "")), str(e.get("note", "")), comps))
    return Plan(
        suite=suite,
        path=path,
        written=str(head["written"]),
        budget=str(head["budget"]),
        rounds=int(head["rounds"]),
        numerics=str(head["numerics"]),
        primary=str(head["primary"]),
        alpha=float(alpha),
        error_rule="holm",
        looks=_looks(f"{path} [plan]", head["looks"]) if "looks" in head else (),
        boundary=str(head.get("boundary", "pocock")),
        flat_window=float(head.get("flat_window", 0.0)),
        flat_tolerance=float(head.get("flat_tolerance", 0.1)),
        margin=margin,
        margin_reason=str(head.get("margin_reason", "")).strip(),
        smallest_gap=float(head.get("smallest_gap", 0.0)),
        smallest_gap_reason=str(head.get("smallest_gap_reason", "")).strip(),
        substitution=str(head.get("substitution", "")),
        command=str(head.get("command", "")),
        reason=str(head.get("reason", "")).strip(),
        cross_host=str(head.get("cross_host", "")).strip(),
        claims=tuple(claims),
        exploratory=tuple(exploratory),
    )


# the page's order: the seed papers as the results page lists them
ORDER = (
    "fedtgp_table10",
    "fedclassavg_table2",
    "fedclassavg_ablation",
    "fedgh_table3",
    "fedhenn_5cnn",
    "layer_expansion",
)


def load_plans(folder: Path = PLANS) -> list[Plan]:
    """Every plan under ``folder``, in the page's order (others after, by name)."""
    plans = [load_plan(p) for p in sorted(folder.glob("*.toml"))]
    rank = {s: i for i, s in enumerate(ORDER)}
    return sorted(plans, key=lambda p: (rank.get(p.suite, len(ORDER)), p.suite))


__all__ = [
    "ACCURACY_METRICS",
    "Claim",
    "Comparison",
    "Exploratory",
    "MARGIN",
    "Plan",
    "PlanError",
    "load_plan",
    "load_plans",
]
