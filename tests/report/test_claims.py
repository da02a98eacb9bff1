"""The claims page: paired per-seed tests, Holm within each claim and over the page, sequential
looks, the labels, the complete fair-pair check, the plans, and that the committed page is what
the committed cells give under the committed plans."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from fedmosaic.checkpoint import config_hash
from fedmosaic.report import claims, claims_page, fairness, stats
from fedmosaic.report.claims import FAILS, HOLDS, INCONCLUSIVE, SMALLER, WITHIN, Comparison
from fedmosaic.report.plans import PlanError, load_plan, load_plans
from fedmosaic.suite_runner import load_suite

T975_2 = 4.302652729911275  # t_{0.975, 2}: three seeds
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _doc(final: float, rounds: list[tuple[int, float]] = (), **summary: float) -> dict:
    return {
        "summary": {"final": {"acc_weighted": final, "acc_mean": final - 0.01}, **summary},
        "rounds": [{"round": r, "acc_weighted": a, "acc_mean": a} for r, a in rounds],
    }


def _cells(method: list[float], baseline: list[float], setting: str = "s") -> dict:
    out = {}
    for seed, (a, b) in enumerate(zip(method, baseline, strict=True)):
        out[(setting, "m", seed)] = _doc(a)
        out[(setting, "b", seed)] = _doc(b)
    return out


def _one(c: Comparison, cells: dict, plan=None) -> dict:
    """One comparison judged as a claim of its own (Holm over one: the plain 5% test)."""
    j = claims.judge(c, cells, plan)
    claims.decide([j], plan)
    return j


def test_paired_gap_test_and_interval_by_hand() -> None:
    c = Comparison("x", "s", "m", "b")
    j = _one(c, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))
    # per-seed gaps 2, 3, 1 points: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.464 on 2 df
    assert j["diff"]["mean"] == pytest.approx(2.0)
    assert j["diff"]["ci95"] == pytest.approx(T975_2 / math.sqrt(3))
    assert j["test"].p == pytest.approx(0.07417990022744858)  # 2 * t.sf(3.4641, 2)
    assert j["level"] == pytest.approx(0.05)  # one comparison: Holm is the plain test
    lo, hi = j["interval"]
    assert lo == pytest.approx(2 - T975_2 / math.sqrt(3)) and hi > 4
    # no paper gap: the power column aims at 1 point: sd 1 needs 10 seeds; the spread's 95%
    # bounds (0.52 and 6.29) need 5 ((2.776 + 0.941)^2 * 0.271 = 3.75 <= 5) and 312
    assert j["verdict"] == (
        INCONCLUSIVE + ": needs 10 (5 to 312) seeds for the default 1-point gap (1.00)"
    )


def test_unweighted_metric_reads_acc_mean() -> None:
    c = Comparison("x", "s", "m", "b", accuracy="unweighted")
    j = _one(c, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))
    assert j["method"]["mean"] == pytest.approx(90.0)  # acc_mean = acc_weighted - 1 point


@pytest.mark.parametrize(
    ("method", "baseline", "paper", "expected"),
    [
        ([0.95, 0.96, 0.97], [0.90, 0.905, 0.91], None, HOLDS),  # gaps 5, 5.5, 6
        ([0.95, 0.96, 0.97], [0.90, 0.905, 0.91], (90.0, 70.0), SMALLER),  # < half of 20
        ([0.95, 0.96, 0.97], [0.90, 0.905, 0.91], (90.0, 80.0), HOLDS),  # >= half of 10
        ([0.90, 0.90, 0.90], [0.90, 0.90, 0.90], None, INCONCLUSIVE),  # no gap
        ([0.89, 0.90, 0.91], [0.90, 0.91, 0.92], None, FAILS),  # -1 each seed
        ([0.90, 0.92, 0.91], [0.88, 0.89, 0.90], None, INCONCLUSIVE),  # +2 [-0.48, +4.48]
        ([0.88, 0.89, 0.90], [0.90, 0.92, 0.91], None, INCONCLUSIVE),  # -2 [-4.48, +0.48]
    ],
)
def test_above_verdicts(method, baseline, paper, expected) -> None:
    c = Comparison("x", "s", "m", "b", paper=paper)
    assert _one(c, _cells(method, baseline))["verdict"].split(":")[0] == expected


def test_non_inferiority_states_its_direction() -> None:
    c = Comparison("x", "s", "m", "b", relation="at_or_above")  # margin 1 point
    # below by 0.5, 0.4, 0.6: mean -0.5, sd 0.1: the NI test (gap = -1) resolves; the interval
    # [-0.75, -0.25] is below 0: "below b by 0.50 [0.25, 0.75]"
    j = _one(c, _cells([0.895, 0.906, 0.894], [0.90, 0.91, 0.90]))
    half = T975_2 * 0.1 / math.sqrt(3)
    assert j["verdict"] == (
        f"{WITHIN} 1-point margin; below b by 0.50 [{0.5 - half:.2f}, {0.5 + half:.2f}]"
    )
    above = _one(c, _cells([0.92, 0.91, 0.915], [0.90, 0.90, 0.90]))
    assert above["verdict"].startswith(f"{WITHIN} 1-point margin; above b by 1.50 [")
    level = _one(c, _cells([0.90, 0.90, 0.901], [0.899, 0.901, 0.901]))  # +0.1, -0.1, 0
    assert level["verdict"].startswith(f"{WITHIN} 1-point margin; level with b: ")
    below = _one(c, _cells([0.85, 0.86, 0.85], [0.90, 0.90, 0.91]))
    assert below["verdict"] == FAILS  # [-6.7, -3.3]: below by more than the margin
    wide = Comparison("x", "s", "m", "b", relation="at_or_above", margin=10.0)
    assert _one(wide, _cells([0.85, 0.86, 0.85], [0.90, 0.90, 0.91]))["verdict"].startswith(
        f"{WITHIN} 10-point margin; below b by 5.00"
    )
    # the claim's label drops the details after ";"
    assert claims.claim_verdict([j["verdict"], HOLDS]) == f"{WITHIN} 1-point margin"


def test_lower_needs_the_interval_below_0_and_compares_the_papers_ratio() -> None:
    def cost(a: list[float], b: list[float], paper: tuple[float, float]) -> str:
        c = Comparison("x", "s", "m", "b", relation="lower", metric="paper_cost_g", paper=paper)
        cells = {}
        for seed, (x, y) in enumerate(zip(a, b, strict=True)):
            cells[("s", "m", seed)] = _doc(0.9, paper_cost_total=x * 1e9)
            cells[("s", "b", seed)] = _doc(0.9, paper_cost_total=y * 1e9)
        return _one(c, cells)["verdict"]

    paper = (36.0, 100.0)
    assert cost([30.0, 31, 29], [100.0, 101, 99], paper) == HOLDS
    assert cost([60.0, 61, 59], [100.0, 101, 99], paper) == SMALLER  # ratio 0.6 > 0.36 + 0.1
    assert cost([110.0, 111, 109], [100.0, 101, 99], paper) == FAILS
    assert cost([90.0, 110, 95], [100.0, 101, 99], paper) == INCONCLUSIVE  # -1.7 [-27, +24]
    assert cost([30.0], [100.0], paper) == INCONCLUSIVE + " (1 seed)"


def test_seeds_needed_by_hand() -> None:
    """80% power at 5% two-sided: the smallest n with n >= (t_.975,n-1 + t_.8,n-1)^2 (sd/delta)^2.
    sd = delta: n = 9 needs (2.306 + 0.889)^2 = 10.21 > 9; n = 10 needs (2.262 + 0.883)^2 =
    9.89 <= 10."""
    assert stats.seeds_needed(1.0, 1.0) == 10
    assert stats.seeds_needed(2.0, 2.0) == 10  # only the ratio matters
    assert stats.seeds_needed(0.0, 1.0) == 2
    assert stats.seeds_needed(None, 1.0) is None and stats.seeds_needed(1.0, 0.0) is None
    assert stats.seeds_needed(100.0, 0.01) is None  # past MAX_SEEDS


def test_power_carries_the_spreads_uncertainty() -> None:
    """The spread's 95% bounds from chi-square on n - 1 df: with 3 seeds sd * sqrt(2 / 7.3778)
    and sd * sqrt(2 / 0.050636)."""
    lo, hi = stats.sd_bounds(1.0, 3)
    assert lo == pytest.approx(math.sqrt(2 / 7.377758908227871))
    assert hi == pytest.approx(math.sqrt(2 / 0.0506356159685798))
    point, low, high = stats.seeds_range(1.0, 3, 1.0)
    assert point == 10
    assert low == stats.seeds_needed(lo, 1.0) and high == stats.seeds_needed(hi, 1.0)
    assert low < point < high


def test_power_targets_the_papers_gap_the_plans_smallest_gap_or_the_margin() -> None:
    assert claims.target_gap(Comparison("x", "s", "m", "b", paper=(91.0, 90.0)), None) == (
        1.0,
        "paper gap",
    )
    ni = Comparison("x", "s", "m", "b", relation="at_or_above", paper=(90.5, 90.0))
    assert claims.target_gap(ni, None)[0] == pytest.approx(1.5)  # margin 1 + the paper's +0.5
    henn = next(p for p in load_plans() if p.path.stem == "fedhenn_5cnn")
    assert claims.target_gap(Comparison("x", "s", "m", "b"), henn) == (
        0.5,
        "smallest gap that matters",
    )
    assert claims.target_gap(Comparison("x", "s", "m", "b"), None) == (
        1.0,
        "default 1-point gap",
    )
    cost = Comparison("x", "s", "m", "b", relation="lower", metric="paper_cost_g")
    assert claims.target_gap(cost, None) == (None, "")


def test_holm_and_bh_by_hand() -> None:
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4 * 0.005, 3 * 0.01, 2 * 0.03, 1 * 0.04, running max
    assert stats.holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # BH: m p / rank = 0.02, 0.02, 0.04, 0.04, running min from the top
    assert stats.benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])


def test_holm_within_a_claim_needs_more_than_5_percent() -> None:
    """FedClassAvg Table 2's old p-values (0.018, 0.019, 0.044 among six comparisons): each
    resolved alone at 5%, none under Holm (the smallest needs 0.05 / 6)."""
    family = [stats.Family(p) for p in (0.018, 0.019, 0.044, 0.3, 0.5, 0.7)]
    rejected, levels = stats.sequential_holm(family, 0.05, "pocock")
    assert rejected == [False] * 6 and levels[0] == pytest.approx(0.05 / 6)
    # step-down: once the first is rejected, the next is tested at 0.05 / 5
    rejected, levels = stats.sequential_holm(
        [stats.Family(0.001), stats.Family(0.009), stats.Family(0.02)], 0.05, "pocock"
    )
    # the first two pass 0.05 / 3 together, the third is then tested at 0.05
    assert rejected == [True, True, True] and levels == pytest.approx([0.05 / 3, 0.05 / 3, 0.05])
    # an untestable hypothesis keeps its share of alpha and is never rejected
    # (0.03 alone would pass 0.05; beside it, 0.025)
    rejected, _ = stats.sequential_holm([stats.Family(0.03), stats.Family(None)], 0.05, "pocock")
    assert rejected == [False, False]


def test_group_sequential_boundaries() -> None:
    """Lan-DeMets Pocock-type spending, five equally spaced looks: the published boundaries
    2.438, 2.427, 2.410, 2.397, 2.386; each spending function spends all of alpha at the end."""
    z = stats.z_boundaries([0.2, 0.4, 0.6, 0.8, 1.0], 0.05, "pocock")
    assert z == pytest.approx([2.438, 2.427, 2.410, 2.397, 2.386], abs=2e-3)
    assert stats.spent("obrien_fleming", 1.0, 0.05) == pytest.approx(0.05)
    assert stats.spent("pocock", 1.0, 0.05) == pytest.approx(0.05)
    assert stats.nominal_levels([6], 0.05, "pocock") == [0.05]
    # FedHeNN's five-class looks at 3, 5 and 6 seeds: p = 0.023 at the last look does not cross
    # Pocock's level; O'Brien-Fleming's (which spends little early) would have crossed
    pocock = stats.nominal_levels([3, 5, 6], 0.05, "pocock")
    obf = stats.nominal_levels([3, 5, 6], 0.05, "obrien_fleming")
    assert pocock[-1] < 0.023 < obf[-1]


def test_a_planned_look_reads_only_its_seeds(tmp_path: Path) -> None:
    plan = _tiny_plan(tmp_path, looks="looks = [3, 6]")
    c = plan.claims[0].comparisons[0]
    cells = _cells([0.95, 0.96, 0.97, 0.5], [0.90, 0.905, 0.91, 0.9])  # seed 3 would flip it
    for doc in cells.values():  # the plan's equal budget: 3 rounds, all run
        doc["config"] = {"train": {"rounds": 3}}
        doc["summary"]["rounds_run"] = 3
    j = _one(c, cells, plan)
    assert j["seeds"] == [0, 1, 2] and j["all_seeds"] == [0, 1, 2, 3]
    assert j["look"] == 0 and j["schedule"] == (3, 6)
    assert j["level"] == pytest.approx(stats.nominal_levels([3, 6], 0.05, "pocock")[0])
    two = {k: v for k, v in cells.items() if k[2] < 2}
    assert _one(c, two, plan)["verdict"] == (
        f"{claims.WAITING}: 2 of the 3 seeds of the first planned look"
    )


def test_a_look_not_in_the_record_is_refused() -> None:
    c = Comparison("x", "s", "m", "b", looks=(3, 5))
    j = _one(c, _cells([0.95, 0.96, 0.97, 0.95, 0.96, 0.97], [0.9] * 6))
    assert j["verdict"].startswith(claims.WAITING + ": 6 paired seeds, but the plan's record")


def _tiny_plan(
    tmp_path: Path,
    looks: str = "",
    extra: str = "",
    suite: str = "x",
    rounds: int = 3,
    numerics: str = "native",
    comparison: str = 'setting = "s"\nmethod = "m"\nbaseline = "b"',
):
    path = tmp_path / "x.toml"
    path.write_text(
        f"""
[plan]
suite = "{suite}"
written = "2026-01-01"
budget = "full"
rounds = {rounds}
numerics = "{numerics}"
primary = "final"
{looks}
{extra}

[[claims]]
key = "k"
title = "A claim"
[[claims.comparisons]]
{comparison}
"""
    )
    return load_plan(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("oops = 1", "unknown key(s) oops"),
        ("looks = [3, 2]", "must increase"),
        ("looks = [1, 3]", "seed counts >= 2"),
        ('boundary = "haybittle"', "boundary 'haybittle'"),
        ('error_rule = "bonferroni"', "only holm"),
        ("alpha = 0.7", "alpha must be in"),
    ],
)
def test_a_bad_plan_is_refused_by_name(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _tiny_plan(tmp_path, extra=text)


def test_equal_budgets_read_at_the_end(tmp_path: Path) -> None:
    """A plateau-stopped cell, another round count or other numerics than the plan's: not
    comparable (such cells belong in an exploratory group)."""
    plan = _tiny_plan(tmp_path)
    doc = _cfg_doc(0.9)
    doc["config"]["train"]["rounds"] = 3
    doc["summary"]["rounds_run"] = 3
    assert claims.budget_problems(plan, "m", doc) == []
    stopped = copy.deepcopy(doc)
    stopped["summary"]["rounds_run"] = 2
    assert claims.budget_problems(plan, "m", stopped) == [
        "m's cell stopped at round 2 of 3 (a plateau stop)"
    ]
    longer = copy.deepcopy(doc)
    longer["config"]["train"]["rounds"] = 5
    assert "m's cell has train.rounds = 5, the plan 3" in claims.budget_problems(plan, "m", longer)
    portable = copy.deepcopy(doc)
    portable["config"]["sim"] = {"numerics": "portable"}
    assert claims.budget_problems(plan, "m", portable) == [
        "m's cell has sim.numerics = 'portable', the plan 'native'"
    ]


def test_flatness_is_the_slope_over_the_last_rounds(tmp_path: Path) -> None:
    # accuracy 50 + 0.5 * round (points): 5 points per 10 rounds, over rounds 91..100 of 100
    doc = _doc(0.0, [(r, (50 + 0.5 * r) / 100) for r in range(1, 101)])
    assert claims.curve_slope(doc, "acc_weighted", 0.1) == pytest.approx(5.0)
    flat = _doc(0.0, [(r, 0.9) for r in range(1, 101)])
    assert claims.curve_slope(flat, "acc_weighted", 0.1) == pytest.approx(0.0)
    plan = _tiny_plan(tmp_path, extra="flat_window = 0.1\nflat_tolerance = 0.1")
    j = {"comparison": plan.claims[0].comparisons[0], "slopes": (5.0, 0.0)}
    assert claims.climbing(plan, [j]) == ["m (s)"]


def _cfg_doc(final: float, seed: int = 0, **over) -> dict:
    cfg = {
        "seed": seed,
        "data": {"dataset": "fmnist", "num_clients": 5, "subsample": 0.1},
        "model": {"family": "fedhenn5", "feature_dim": 128, "projection": "linear"},
        "train": {"rounds": 50, "plateau_delta": 0.0},
        "algorithm": {"name": "local"},
    }
    for dotted, value in over.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    doc = _doc(final)
    doc["config"] = cfg
    doc["clients"] = [{"num_test": 10, "train_label_counts": [1] * 10} for _ in range(5)]
    return doc


def test_pair_problems_name_every_unfair_difference() -> None:
    c = Comparison("x", "s", "m", "b")
    base = _cfg_doc(0.9)
    assert claims.pair_problems(c, base, _cfg_doc(0.8)) == []
    (seed,) = claims.pair_problems(c, base, _cfg_doc(0.8, seed=1))
    assert seed == "seeds 0 vs 1"
    (data,) = claims.pair_problems(c, base, _cfg_doc(0.8, data__subsample=0.05))
    assert data == "data config differs (subsample)"
    (rounds,) = claims.pair_problems(c, base, _cfg_doc(0.8, train__rounds=40))
    assert rounds == "train.rounds 50 vs 40"
    (lr,) = claims.pair_problems(c, base, _cfg_doc(0.8, train__lr=0.05))
    assert lr == "train.lr None vs 0.05"
    declared = Comparison("x", "s", "m", "b", declared=("train.lr",))
    assert claims.pair_problems(declared, base, _cfg_doc(0.8, train__lr=0.05)) == []
    # FedHeNN fixes its own projection: Local on its networks sets projection "none" to match
    henn = _cfg_doc(0.9, algorithm__name="fedhenn")
    problems = claims.pair_problems(c, henn, base)
    assert any(p.startswith("client models differ (client 0: ") for p in problems)
    assert claims.pair_problems(c, henn, _cfg_doc(0.8, model__projection="none")) == []
    term = Comparison("x", "s", "m", "b", same=("distance", "lam"))
    tgp = _cfg_doc(0.9, algorithm__name="fedtgp")  # defaults: euclidean, lam 0.1
    proto = _cfg_doc(0.9, algorithm__name="fedproto")  # defaults: mse, lam 1.0
    assert claims.pair_problems(term, tgp, proto) == [
        "algorithm.distance 'euclidean' vs 'mse'",
        "algorithm.lam 0.1 vs 1.0",
    ]


def _committed_pair() -> tuple[Comparison, dict, dict]:
    cells = claims.load_cells(RESULTS / "full", "layer_expansion")
    c = Comparison(
        "layer_expansion",
        "dir01",
        "fedseq_vanilla",
        "fedbabu",
        relation="at_or_above",
        metric="after_finetune",
    )
    return c, cells[("dir01", "fedseq_vanilla", 0)], cells[("dir01", "fedbabu", 0)]


def _edited(doc: dict, path: str, value) -> dict:
    """A copy of a cell with the dotted ``path`` set to ``value``."""
    edited = copy.deepcopy(doc)
    node = edited
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return edited


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        ("config.train.lr", 0.05, "train.lr"),
        ("config.train.local_epochs", 5, "train.local_epochs"),
        ("config.train.batch_size", 64, "train.batch_size"),
        ("config.train.momentum", 0.9, "train.momentum"),
        ("config.train.optimizer", "adam", "train.optimizer"),
        ("config.train.weight_decay", 1e-4, "train.weight_decay"),
        ("config.train.drop_last", True, "train.drop_last"),
        ("config.model.feature_dim", 256, "model.feature_dim"),
        ("config.sim.numerics", "portable", "sim.numerics"),
        ("provenance.code.source_hash", "0" * 64, "made by different code"),
    ],
)
@pytest.mark.golden
def test_a_mutated_committed_cell_breaks_its_pair(path: str, value, expect: str) -> None:
    """Edit one key of a committed cell (the layer-expansion Vanilla cell, seed 0): its pair with
    FedBABU becomes not comparable, naming the key (and the edit breaks the config hash)."""
    c, a, b = _committed_pair()
    assert claims.pair_problems(c, a, b) == []
    edited = _edited(a, path, value)
    problems = claims.pair_problems(c, edited, b)
    assert any(expect in p for p in problems), problems
    if path.startswith("config."):
        assert any("does not match its config hash" in p for p in problems), problems


def test_the_stored_config_hash_is_checked() -> None:
    _, a, _ = _committed_pair()
    assert config_hash(a["config"]) == a["cell"]["config_hash"]
    assert fairness.hash_problems("m", a) == []


def test_an_unfair_pair_is_not_judged() -> None:
    c = Comparison("x", "s", "m", "b")
    cells = {}
    for seed in range(3):
        cells[("s", "m", seed)] = _cfg_doc(0.95, seed, algorithm__name="fedhenn")
        cells[("s", "b", seed)] = _cfg_doc(0.90, seed)
    j = _one(c, cells)
    assert j["verdict"].startswith(claims.NOT_COMPARABLE + ": seed 0: ")
    assert claims.claim_verdict([j["verdict"], HOLDS]) == claims.NOT_COMPARABLE


def test_a_claim_is_a_conjunction() -> None:
    assert claims.claim_verdict([FAILS, "not run", HOLDS]) == FAILS
    assert claims.claim_verdict([HOLDS, "not run"]) == "not run (cells missing)"
    assert claims.claim_verdict([HOLDS, claims.WAITING + ": 2 of 3"]) == claims.WAITING + ": 2 of 3"
    assert (
        claims.claim_verdict([claims.WAITING + ": 2 of 3", "not run"]) == "not run (cells missing)"
    )
    assert claims.claim_verdict([claims.WAITING + ": 1 of 3", FAILS]) == FAILS
    assert claims.claim_verdict([]) == "not run (cells missing)"
    assert claims.claim_verdict([HOLDS, SMALLER]) == SMALLER
    assert claims.claim_verdict([HOLDS, INCONCLUSIVE + ": needs 5"]) == INCONCLUSIVE
    assert claims.claim_verdict([INCONCLUSIVE + " (1 seed)", SMALLER]) == INCONCLUSIVE


def test_an_inconclusive_row_says_when_the_interval_excludes_the_papers_gap() -> None:
    c = Comparison("x", "s", "m", "b", paper=(95.0, 90.0))  # the paper: +5
    j = _one(c, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))  # +2 [-0.48, +4.48]
    assert j["verdict"].endswith("; the paper's gap (+5.00) is above the interval")
    wide = Comparison("x", "s", "m", "b", paper=(94.0, 90.0))  # +4: inside the interval
    assert (
        "above the interval"
        not in _one(wide, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))["verdict"]
    )


def test_one_seed_is_inconclusive_whatever_the_sign() -> None:
    j = _one(Comparison("x", "s", "m", "b"), _cells([0.95], [0.90]))
    assert j["verdict"] == INCONCLUSIVE + " (1 seed)"


def test_mean_over_rounds_averages_both_curves_up_to_the_common_round() -> None:
    c = Comparison("x", "s", "m", "b", metric="mean_over_rounds")
    cells = {
        ("s", "m", 0): _doc(0.99, [(1, 0.5), (2, 0.6), (3, 0.7)]),
        ("s", "b", 0): _doc(0.40, [(1, 0.4), (2, 0.45)]),
    }
    j = claims.judge(c, cells)
    assert j["rounds"] == [2]
    assert j["method"]["mean"] == pytest.approx(55.0)
    assert j["baseline"]["mean"] == pytest.approx(42.5)


@pytest.mark.parametrize("plan", load_plans(), ids=lambda p: p.suite)
def test_plans_name_the_suites_methods_settings_and_metric(plan) -> None:
    """A renamed method or setting, or a metric other than the paper's, fails here."""
    suite = load_suite(plan.suite)
    comps = [c for cl in plan.claims for c in cl.comparisons]
    comps += [c for g in plan.exploratory for c in g.comparisons]
    assert comps
    for c in comps:
        assert c.setting in [s.label for s in suite.settings]
        assert {c.method, c.baseline} <= {m.label for m in suite.methods}
        if c.metric in claims.ACCURACY_METRICS:
            assert c.accuracy == suite.paper_metric
    assert plan.rounds > 0 and plan.numerics in ("native", "portable")


def test_missing_cells_make_every_claim_not_run(tmp_path: Path) -> None:
    result = claims.evaluate(tmp_path)
    assert {r["verdict"] for r in result["claims"]} == {"not run (cells missing)"}
    assert "not run" in claims.markdown(result)


def test_exploratory_cells_never_decide(tmp_path: Path) -> None:
    """Plateau-stopped cells in the converged folder: shown, but a claim with no cells in its
    plan's budget folder is not run, whatever they say."""
    src = RESULTS / "converged" / "fedclassavg_ablation"
    dst = tmp_path / "converged" / "fedclassavg_ablation"
    for p in src.glob("cells/*/*/seed*/results.json"):
        (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        (dst / p.relative_to(src)).write_text(p.read_text())
    plans = [p for p in load_plans() if p.suite == "fedclassavg_ablation"]
    result = claims.evaluate(tmp_path, plans)
    (res,) = result["claims"]
    assert res["verdict"] == "not run (cells missing)"
    (group,) = [g for g in result["exploratory"] if g["group"].budget == "converged"]
    assert all(len(j["seeds"]) >= 3 for j in group["comparisons"])


def test_a_side_can_be_read_from_another_of_its_predictions() -> None:
    """``predictions``: the method's accuracy from its ``acc_local`` record, the baseline's from
    its headline."""
    cells = _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90])
    for seed, local in enumerate([0.80, 0.81, 0.83]):
        cells[("s", "m", seed)]["summary"]["final"]["acc_local_mean"] = local
    plain = Comparison("x", "s", "m", "b", accuracy="unweighted")
    read = Comparison("x", "s", "m", "b", accuracy="unweighted", predictions=(("m", "acc_local"),))
    assert _one(plain, cells)["method"]["mean"] == pytest.approx(90.0)
    j = _one(read, cells)
    assert j["method"]["mean"] == pytest.approx(81.333333333)
    assert j["baseline"]["mean"] == pytest.approx(88.0)  # acc_mean = acc_weighted - 1 point
    assert "m: acc_local" in claims_page._metric_label(read)


@pytest.mark.parametrize("bad", ['{ m = "loss" }', "{ m = 3 }", '"acc_local"'])
def test_predictions_that_are_not_recorded_accuracies_are_refused(tmp_path: Path, bad) -> None:
    plan = _tiny_plan(tmp_path).path.read_text()
    path = tmp_path / "y.toml"
    path.write_text(
        plan + f'\n[[exploratory]]\nbudget = "full"\ncomparisons = "confirmatory"\n'
        f"predictions = {bad}\n"
    )
    with pytest.raises(PlanError, match="predictions must map method names"):
        load_plan(path)


def test_fedclassavg_is_also_read_on_its_own_classifier_from_the_committed_cells() -> None:
    """The paper's model (each client's classifier after local training) beside the planned
    reading of the same cells (the global head they recorded as ``acc``)."""
    (plan,) = [p for p in load_plans() if p.suite == "fedclassavg_table2"]
    result = claims.evaluate(RESULTS, [plan])
    (group,) = [g for g in result["exploratory"] if g["group"].budget == "equal"]
    cells = claims.load_cells(RESULTS / "equal", "fedclassavg_table2")
    for j in group["comparisons"]:
        c = j["comparison"]
        assert c.prediction("fedclassavg") == "acc_local" and c.prediction(c.baseline) == "acc"
        want = [
            100 * cells[(c.setting, "fedclassavg", s)]["summary"]["final"]["acc_local_mean"]
            for s in j["seeds"]
        ]
        assert len(want) == 6 and j["method"]["mean"] == pytest.approx(sum(want) / len(want))


def test_cli_refuses_a_missing_folder(tmp_path: Path, capsys) -> None:
    assert claims.main(["--results", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_cli_names_a_corrupt_cell_and_writes_nothing(tmp_path: Path, capsys) -> None:
    d = tmp_path / "full" / "fedgh_table3" / "cells" / "pathological" / "fedgh" / "seed0"
    d.mkdir(parents=True)
    (d / "results.json").write_text("{not json")
    out = tmp_path / "claims.md"
    assert claims.main(["--results", str(tmp_path), "--out", str(out)]) == 2
    assert "results.json: not a cell's results.json" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.golden
def test_committed_claims_page_is_what_the_committed_cells_give() -> None:
    """docs/results/claims.md is generated from the committed cells under the committed plans;
    a stale page fails."""
    page = RESULTS / "claims.md"
    out = ROOT / "build" / "claims-test.md"
    out.parent.mkdir(exist_ok=True)
    assert claims.main(["--results", str(RESULTS), "--out", str(out)]) == 0
    assert page.read_text() == out.read_text()


@pytest.mark.golden
def test_results_page_carries_the_current_verdicts() -> None:
    """docs/results.md quotes the verdict table of the committed cells verbatim."""
    table = claims_page.summary_markdown(claims.evaluate(RESULTS)["claims"])
    assert table in (ROOT / "docs" / "results.md").read_text()


@pytest.mark.parametrize("plan", load_plans(), ids=lambda p: p.suite)
@pytest.mark.golden
def test_every_published_pair_is_fair(plan) -> None:
    """The committed cells behind each claim: same seed, every training, data and model key,
    numerics, per-client parameter counts, code, config hash, the plan's equal budget, and the
    suite's current definition of both methods."""
    result = claims.evaluate(RESULTS, [plan])
    for res in result["claims"]:
        for j in res["comparisons"]:
            assert j["problems"] == [], (j["comparison"], j["problems"][:3])


@pytest.mark.golden
def test_every_accuracy_row_with_seeds_has_a_power_column() -> None:
    for res in claims.evaluate(RESULTS)["claims"]:
        for j in res["comparisons"]:
            c = j["comparison"]
            if c.metric in claims.ACCURACY_METRICS and len(j["seeds"]) >= 2:
                assert j["power"]["delta"] is not None and j["resolution"]["test_images"] > 0


def test_a_verdict_from_less_than_the_papers_budget_says_so() -> None:
    c = Comparison("layer_expansion", "dir01", "fedseq_vanilla", "fedbabu")  # paper: 100 rounds
    assert claims.reduced_budget(c, {"fraction": [0.25], "rounds": [100]})
    assert claims.reduced_budget(c, {"fraction": [1.0], "rounds": [60]})
    assert not claims.reduced_budget(c, {"fraction": [1.0], "rounds": [100]})
    cost = Comparison("layer_expansion", "dir01", "m", "b", relation="lower", metric="paper_cost_g")
    assert not claims.reduced_budget(cost, {"fraction": [0.25], "rounds": []})


def test_a_cell_whose_peer_guard_dropped_an_honest_reply_is_not_comparable() -> None:
    """The guard dropped an honest straggler (seen on FedGH's full-data LG-FedAvg, round 57):
    that cell is no longer the paper's method, so its pair is not judged."""
    c = Comparison("x", "s", "m", "b")
    base, other = _cfg_doc(0.9), _cfg_doc(0.8)
    base["rounds"] = [{"round": 1, "rejected": []}, {"round": 2, "rejected": []}]
    other["rounds"] = [{"round": t, "rejected": [0] if t in (3, 57) else []} for t in range(1, 60)]
    assert claims.pair_problems(c, base, _cfg_doc(0.8)) == []
    (msg,) = claims.pair_problems(c, base, other)
    assert msg == (
        "b's run dropped replies in round(s) 3, 57 (server.peer_factor): re-run it with "
        "server.peer_factor = 0"
    )
    other["config"]["server"] = {"peer_factor": 0.0}  # guard off: an invalid reply, not the guard
    assert claims.pair_problems(c, base, other) == []


def test_a_cell_of_an_older_method_definition_is_flagged() -> None:
    """fedtgp_mse now trains on stale prototypes (the authors' code): a cell without them is not
    that method."""
    algo = {"name": "fedtgp", "distance": "mse", "lam": 10.0, "tau": 100.0, "server_epochs": 100}
    old = {"config": {"algorithm": algo}}
    (msg,) = fairness.definition_problems("fedtgp_table10", "fedtgp_mse", old)
    assert msg == "fedtgp_mse's cell has algorithm.stale_prototypes = None, the suite True"
    assert fairness.definition_problems("fedtgp_table10", "fedtgp_mse_fresh", old) == []


def test_final_reads_runs_of_different_lengths_at_their_common_round() -> None:
    c = Comparison("x", "s", "m", "b")
    a = _doc(0.99, [(1, 0.5), (2, 0.6), (3, 0.7)], rounds_run=3)
    b = _doc(0.40, [(1, 0.4), (2, 0.45)], rounds_run=2)
    assert claims.pair_values(c, a, b) == (pytest.approx(60.0), pytest.approx(45.0), 2)
    b3 = _doc(0.80, [(1, 0.4), (2, 0.45), (3, 0.8)], rounds_run=3)
    assert claims.pair_values(c, a, b3) == (pytest.approx(99.0), pytest.approx(80.0), 3)


def test_the_attack_auc_is_read_from_the_membership_summary_and_judged_lower() -> None:
    """metric mia_auc (eval.membership): AUC x 100 at the last evaluation; DP lowering it by
    about 5 AUC points on every seed holds, a seed with no attack (every model NaN) is left out."""
    c = Comparison("x", "s", "m", "b", relation="lower", metric="mia_auc")
    cells = {}
    for seed, (a, b) in enumerate([(0.50, 0.55), (0.51, 0.555), (0.505, 0.56)]):
        cells[("s", "m", seed)] = _doc(0.8, membership={"mia_auc": a}, rounds_run=20)
        cells[("s", "b", seed)] = _doc(0.8, membership={"mia_auc": b}, rounds_run=20)
    assert claims.pair_values(c, cells[("s", "m", 0)], cells[("s", "b", 0)]) == (
        pytest.approx(50.0),
        pytest.approx(55.0),
        20,
    )
    j = _one(c, cells)
    assert j["verdict"] == claims.HOLDS and j["diff"]["mean"] == pytest.approx(-5.0)
    cells[("s", "m", 3)] = _doc(0.1, rounds_run=20)  # diverged everywhere: no attack to read
    cells[("s", "b", 3)] = _doc(0.8, membership={"mia_auc": 0.55}, rounds_run=20)
    assert len(_one(c, cells)["diffs"]) == 3
    # no seed with an attack on both sides: the cells ran, the metric is not measurable
    broken = {k: v for k, v in cells.items() if k[2] == 3}
    j = _one(c, broken)
    assert j["verdict"].startswith(claims.NOT_MEASURED) and "no finite loss" in j["verdict"]
    assert claims.claim_verdict([j["verdict"], claims.HOLDS]) == claims.INCONCLUSIVE
    assert claims.claim_verdict([j["verdict"], claims.FAILS]) == claims.FAILS


def test_best_on_val_picks_the_validation_round_and_best_on_test_is_the_max() -> None:
    doc = {
        "rounds": [
            {"round": 1, "acc_weighted": 0.5, "val_acc_weighted": 0.6},
            {"round": 2, "acc_weighted": 0.7, "val_acc_weighted": 0.9},
            {"round": 3, "acc_weighted": 0.9, "val_acc_weighted": 0.8},
            {"round": 4, "acc_weighted": 0.95, "val_acc_weighted": 0.99},
        ]
    }
    assert claims.best_up_to(doc, "acc_weighted", 3) == (pytest.approx(70.0), pytest.approx(90.0))


def test_a_cell_whose_model_cannot_be_rebuilt_is_one_line_not_a_traceback() -> None:
    doc = {
        "config": {"data": {"dataset": "fmnist"}, "model": {"family": "nope", "feature_dim": 8}},
        "clients": [{"train_label_counts": [1] * 10}],
    }
    with pytest.raises(ValueError, match="stored model config .* cannot be rebuilt"):
        fairness.param_counts(doc)


@pytest.mark.integration
def test_claims_alone_sees_every_method_default():
    """In a fresh process that imports only the fair-pair module, a cell without a hyperparameter
    compares at the method's default: the registry is filled by claims' own imports (a cell's
    ``distance`` read as None made FedTGP vs FedProto "not comparable")."""
    import subprocess
    import sys

    code = (
        "from fedmosaic.report import fairness; "
        "print(fairness._algo_value({'algorithm': {'name': 'fedtgp'}}, 'distance'), "
        "fairness._algo_value({'algorithm': {'name': 'fedproto'}}, 'lam'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["euclidean", "1.0"]


def test_resolution_counts_all_test_images() -> None:
    doc = {"clients": [{"num_test": 300}, {"num_test": 700}]}
    r = claims.resolution(doc, 90.0)
    assert r["test_images"] == 1000 and r["per_image"] == pytest.approx(0.1)
    assert r["sampling_sd"] == pytest.approx(100 * math.sqrt(0.09 / 1000))


def test_load_cells_reads_the_compare_layout(tmp_path: Path) -> None:
    d = tmp_path / "suite" / "cells" / "dir" / "fedtgp" / "seed2"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps(_doc(0.5)))
    assert list(claims.load_cells(tmp_path, "suite")) == [("dir", "fedtgp", 2)]


def test_budget_rows_sum_the_cells_wall_time(tmp_path: Path) -> None:
    for seed, (wall, rounds) in enumerate(((1800.0, 40), (3600.0, 55))):
        d = tmp_path / "s" / "cells" / "set" / "m" / f"seed{seed}"
        d.mkdir(parents=True)
        doc = {
            "config": {"data": {"subsample": 0.05}},
            "summary": {"rounds_run": rounds},
            "wall_seconds": wall,
            "provenance": {"code": {"source_hash": "abcdef0123456789"}},
        }
        (d / "results.json").write_text(json.dumps(doc))
    (row,) = claims.budget_rows(tmp_path)
    assert row["cells"] == 2 and row["seeds"] == [0, 1] and row["fractions"] == [0.05]
    assert row["rounds"] == (40, 55) and row["hours"] == pytest.approx(1.5)
    assert row["codes"] == ["abcdef012345"]
    assert "| all | | 2 | | | | 1.50 | |" in claims_page.budget_markdown([row])


def test_only_seeds_both_methods_ran_are_paired() -> None:
    c = Comparison("x", "s", "m", "b")
    cells = _cells([0.9, 0.9], [0.8, 0.8])
    cells[("s", "m", 7)] = _doc(0.1)  # no baseline on seed 7
    assert claims.judge(c, cells)["seeds"] == [0, 1]


def _host_doc(mode: str, vendor: str, branch: str | None, asked: str | None = None) -> dict:
    numerics: dict = {"mode": mode, "env": {"MKL_CBWR": asked} if asked else {}}
    if branch is not None:
        numerics["mkl_branch"] = {"branch": branch, "strict": True, "auto": "AVX2"}
    return {
        "provenance": {
            "host": {"cpu": "X", "cpu_id": {"vendor_id": vendor, "cpu family": "6", "model": "1"}},
            "numerics": numerics,
        }
    }


def test_hosts_say_where_cells_re_run_bit_for_bit():
    intel = claims.host_key(_host_doc("portable", "GenuineIntel", "AVX2"))
    amd = claims.host_key(_host_doc("portable", "AuthenticAMD", None, asked="AVX2,STRICT"))
    native = claims.host_key({"provenance": {"host": {"cpu": "AMD EPYC"}}})
    assert intel == ("portable", "GenuineIntel", "X (GenuineIntel, family 6 model 1)", "AVX2")
    assert amd[3] == "AVX2 asked, not read back"  # older cells: only what the pins asked
    assert native == ("native", "?", "AMD EPYC", "unpinned")
    assert "any Intel host with AVX2" in claims_page.rerun_words(intel)
    assert "Intel processors only" in claims_page.rerun_words(amd)
    assert "same instruction-set level" in claims_page.rerun_words(native)
    # one line per claim, each group counted
    text = claims_page.hosts_markdown([(intel, 2), (amd, 6)])[0]
    assert text.startswith("Hosts: 2 cells on X (GenuineIntel") and "; 6 cells on X" in text


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        ("provenance.host.cpu_id.vendor_id", "GenuineIntel", "made on a GenuineIntel and a"),
        ("provenance.numerics.mkl_branch", {"branch": "AVX2"}, None),  # one side read back: ok
        ("provenance.numerics.host_level", "avx2", "AuthenticAMD hosts of two instruction-set"),
    ],
)
@pytest.mark.golden
def test_portable_cells_of_other_arithmetic_are_not_a_pair(path: str, value, expect) -> None:
    """A committed portable pair (FedTGP Table 10, practical, seed 0, both made on one AMD host):
    moving one cell to another vendor's processor makes it not comparable (MKL keeps its AVX2
    branch on Intel only); two read-back MKL branches that differ do too, and so does an AMD
    host of another instruction-set level (off Intel MKL runs the processor's own branch)."""
    cells = claims.load_cells(RESULTS / "full", "fedtgp_table10")
    c = Comparison("fedtgp_table10", "practical", "fedtgp", "fedproto_l2", same=("distance", "lam"))
    a, b = cells[("practical", "fedtgp", 0)], cells[("practical", "fedproto_l2", 0)]
    assert claims.pair_problems(c, a, b) == []
    edited = _edited(a, path, value)
    problems = claims.pair_problems(c, edited, b)
    if expect is None:
        assert problems == []
        other = copy.deepcopy(b)
        other["provenance"]["numerics"]["mkl_branch"] = {"branch": "AUTO"}
        problems = claims.pair_problems(c, edited, other)
        expect = "MKL ran its AVX2 branch for one cell and its AUTO branch"
    assert any(expect in p for p in problems), problems


def _rerun_tree(tmp_path: Path, edit_round: int | None) -> tuple[Path, dict]:
    """A results tree holding FedTGP Table 10's committed practical fedproto_l2 cells and a
    re-run of seed 0 "on another host": the cell itself, one number edited at ``edit_round``."""
    src = RESULTS / "full" / "fedtgp_table10"
    dst = tmp_path / "full" / "fedtgp_table10"
    for p in src.glob("cells/practical/fedproto_l2/seed*/results.json"):
        (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        (dst / p.relative_to(src)).write_text(p.read_text())
    doc = json.loads((src / "cells/practical/fedproto_l2/seed0/results.json").read_text())
    doc["provenance"]["host"]["cpu"] = "Other CPU"
    doc["provenance"]["host"]["cpu_id"]["vendor_id"] = "GenuineIntel"
    if edit_round is not None:
        for r in doc["rounds"]:
            if r["round"] >= edit_round:
                r["acc_weighted"] += 0.001  # +0.1 points from that round on
    rerun = dst / "reruns/practical/fedproto_l2/seed0/other-host/results.json"
    rerun.parent.mkdir(parents=True)
    rerun.write_text(json.dumps(doc))
    return rerun, doc


def test_a_committed_rerun_is_compared_number_by_number_with_its_cell(tmp_path: Path) -> None:
    _rerun_tree(tmp_path, edit_round=50)
    plans = [p for p in load_plans() if p.suite == "fedtgp_table10"]
    (r,) = claims.reruns(tmp_path, plans)
    assert r["cell"] == ("practical", "fedproto_l2", 0) and r["same_code"]
    assert r["made"][2].startswith("AMD EPYC") and r["rerun"][2].startswith("Other CPU")
    cmp = r["comparison"]
    assert cmp.first[:2] == (50, "acc_weighted") and cmp.by_key["acc_weighted"].rounds == 51
    assert r["rerun_value"] - r["cell_value"] == pytest.approx(0.1)
    seeds = sorted(RESULTS.glob("full/fedtgp_table10/cells/practical/fedproto_l2/seed*"))
    assert r["seeds"] == len(seeds) >= 2 and r["seed_sd"] > 0
    text = "\n".join(claims_page.reruns_markdown([r]))
    assert (
        "| round 50 (`acc_weighted`) |" in text
        and "(+0.100 points, round 100; largest over the rounds 0.100)" in text
    )


def test_an_identical_rerun_reads_bit_for_bit_and_an_edited_one_is_refused(tmp_path) -> None:
    rerun, doc = _rerun_tree(tmp_path, edit_round=None)
    plans = [p for p in load_plans() if p.suite == "fedtgp_table10"]
    (r,) = claims.reruns(tmp_path, plans)
    assert r["comparison"].identical and r["complete"]
    assert "none: bit for bit" in "\n".join(claims_page.reruns_markdown([r]))
    doc["config"]["train"]["lr"] = 0.05  # another config than the cell's
    rerun.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="does not match its config hash"):
        claims.reruns(tmp_path, plans)
    doc["config"]["train"]["lr"] = json.loads(
        (RESULTS / "full/fedtgp_table10/cells/practical/fedproto_l2/seed0/results.json").read_text()
    )["config"]["train"]["lr"]
    doc["cell"]["seed"] = 0
    moved = rerun.parents[2] / "seed7" / "other-host" / "results.json"
    moved.parent.mkdir(parents=True)
    rerun.rename(moved)
    with pytest.raises(ValueError, match="not a committed cell"):
        claims.reruns(tmp_path, plans)


@pytest.mark.parametrize("bad", [{"rounds": []}, {"cell": ["not", "a", "record"]}])
def test_a_malformed_rerun_is_named_not_a_traceback(tmp_path: Path, bad: dict) -> None:
    rerun, doc = _rerun_tree(tmp_path, edit_round=None)
    rerun.write_text(json.dumps({**doc, **bad}))
    plans = [p for p in load_plans() if p.suite == "fedtgp_table10"]
    with pytest.raises(ValueError, match="not a re-run's results.json"):
        claims.reruns(tmp_path, plans)


def test_every_plan_of_a_suite_shows_its_own_rules(tmp_path: Path) -> None:
    """A suite judged by two plans (its first split and the paper's): each plan's rules head its
    own claims, not only the first plan's."""
    page = claims.markdown(claims.evaluate(tmp_path))
    first = page.index("### fedgh_table3\n")
    second = page.index("### fedgh_table3 (fedgh_table3_pfedhn)\n")
    assert "(`fedgh_table3.toml`" in page[first:second]
    assert "(`fedgh_table3_pfedhn.toml`" in page[second:] and "portable numerics" in page[second:]
    assert page.index("#### FedGH above LG-FedAvg and FedProto on the paper's split") > second


def test_refused_clients_are_read_from_the_rounds() -> None:
    doc = _doc(0.5)
    doc["rounds"] = [{"round": 1, "rejected": []}, {"round": 2, "rejected": [4]}, {"round": 3}]
    doc["rounds"].append({"round": 4, "rejected": [4, 1]})
    assert claims.refused_clients(doc) == [1, 4]
    assert claims.refused_clients(_doc(0.5, [(1, 0.4)])) == []


@pytest.mark.golden
def test_a_diverged_committed_cell_is_named_where_its_pair_is_read() -> None:
    """The code form's pathological seed 1 FedTGP cell (committed): five clients' uploads are
    refused as their training diverges; judged as a comparison of its own, the pair is read and
    the verdict line names the cell, its seed and how many clients the federation lost."""
    cells = claims.load_cells(RESULTS / "full", "fedtgp_table10")
    a = cells[("pathological", "fedtgp_mse", 1)]
    assert claims.refused_clients(a) == [3, 6, 7, 11, 15]
    assert claims.refused_clients(cells[("pathological", "fedproto_mse", 1)]) == []
    c = Comparison("fedtgp_table10", "pathological", "fedtgp_mse", "fedproto_mse")
    j = _one(c, {k: v for k, v in cells.items() if k[2] == 1})
    assert j["refused"] == [("fedtgp_mse", 1, 5, 20)]
    assert claims.refused([j]) == (["fedtgp_mse (pathological): 5 of 20 clients at seed 1"], 1, 2)


@pytest.mark.golden
def test_a_verdict_names_the_cells_that_lost_clients(tmp_path: Path) -> None:
    """A plan reading the code form's pathological pair on the committed seed 1 (guard off, so
    the refusals are invalid replies and the pair stays comparable): its verdict says which
    cell lost how many clients; without the refusals it says nothing of the kind."""
    plan = _tiny_plan(
        tmp_path,
        suite="fedtgp_table10",
        rounds=100,
        numerics="portable",
        comparison='setting = "pathological"\nmethod = "fedtgp_mse"\nbaseline = "fedproto_mse"\n'
        'same = ["distance", "lam"]',
    )
    # the committed seed 1 pair alone (other seeds' cells land over time)
    root = tmp_path / "results"
    for m in ("fedtgp_mse", "fedproto_mse"):
        cell = Path("full/fedtgp_table10/cells/pathological") / m / "seed1" / "results.json"
        (root / cell).parent.mkdir(parents=True)
        (root / cell).write_bytes((RESULTS / cell).read_bytes())
    (res,) = claims.evaluate(root, [plan])["claims"]
    (j,) = res["comparisons"]
    assert j["seeds"] == [1] and j["problems"] == []
    lost = "clients' uploads refused in "
    assert res["verdict"].endswith(f"; {lost}1 of the 2 cells read")
    page = "\n".join(claims_page.claim_markdown(res))
    assert "the federation went on without it" in page
    assert "fedtgp_mse (pathological): 5 of 20 clients at seed 1." in page
    src = RESULTS / "full" / "fedtgp_table10" / "cells" / "pathological"
    for m in ("fedtgp_mse", "fedproto_mse"):
        doc = json.loads((src / m / "seed1" / "results.json").read_text())
        for r in doc["rounds"]:
            r["rejected"] = []
        out = tmp_path / "full" / "fedtgp_table10" / "cells" / "pathological" / m / "seed1"
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps(doc))
    (clean,) = claims.evaluate(tmp_path, [plan])["claims"]
    assert lost not in clean["verdict"] and clean["comparisons"][0]["seeds"] == [1]
    assert "went on without it" not in "\n".join(claims_page.claim_markdown(clean))
