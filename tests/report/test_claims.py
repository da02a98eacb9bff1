"""The claims page: paired per-seed gaps, their intervals, the verdict rules, and that the
committed page is what the committed cells give."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedmosaic.compare import load_suite
from fedmosaic.report import claims
from fedmosaic.report.claims import FAILS, HOLDS, SMALLER, Comparison

T975_2 = 4.302652729911275  # t_{0.975, 2}: three seeds
ROOT = Path(__file__).resolve().parents[2]


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


def test_paired_gap_and_interval_by_hand() -> None:
    c = Comparison("x", "s", "m", "b")
    j = claims.judge(c, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))
    # per-seed gaps 2, 3, 1 points: mean 2, sd 1, half-width t * 1 / sqrt(3)
    assert j["diff"]["n"] == 3
    assert j["diff"]["mean"] == pytest.approx(2.0)
    assert j["diff"]["ci95"] == pytest.approx(T975_2 / math.sqrt(3))
    assert j["method"]["mean"] == pytest.approx(91.0)
    assert j["verdict"] == SMALLER  # 2 - 2.48 < 0: the interval reaches 0


def test_unweighted_metric_reads_acc_mean() -> None:
    c = Comparison("x", "s", "m", "b", accuracy="unweighted")
    j = claims.judge(c, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))
    assert j["method"]["mean"] == pytest.approx(90.0)  # acc_mean = acc_weighted - 1 point


@pytest.mark.parametrize(
    ("method", "baseline", "paper", "expected"),
    [
        ([0.95, 0.96, 0.97], [0.90, 0.905, 0.91], None, HOLDS),  # gaps 5, 5.5, 6: well above 0
        ([0.95, 0.96, 0.97], [0.90, 0.905, 0.91], (90.0, 70.0), SMALLER),  # < half of 20
        ([0.95, 0.96, 0.97], [0.90, 0.905, 0.91], (90.0, 80.0), HOLDS),  # >= half of 10
        ([0.90, 0.90, 0.90], [0.90, 0.90, 0.90], None, FAILS),  # no gap
        ([0.89, 0.90, 0.91], [0.90, 0.91, 0.92], None, FAILS),  # below
    ],
)
def test_above_verdicts(method, baseline, paper, expected) -> None:
    c = Comparison("x", "s", "m", "b", paper=paper)
    assert claims.judge(c, _cells(method, baseline))["verdict"] == expected


def test_at_or_above_fails_only_when_clearly_below() -> None:
    c = Comparison("x", "s", "m", "b", relation="at_or_above")
    level = claims.judge(c, _cells([0.90, 0.91, 0.89], [0.905, 0.90, 0.90]))
    assert level["diff"]["mean"] < 0 and level["verdict"] == claims.LEVEL  # interval spans 0
    above = claims.judge(c, _cells([0.91, 0.90, 0.90], [0.90, 0.90, 0.90]))
    assert above["verdict"] == HOLDS
    below = claims.judge(c, _cells([0.85, 0.86, 0.85], [0.90, 0.90, 0.91]))
    assert below["verdict"] == FAILS


def test_lower_compares_means_against_the_papers_ratio() -> None:
    def cost(a: float, b: float, paper: tuple[float, float]) -> str:
        c = Comparison("x", "s", "m", "b", relation="lower", metric="paper_cost_g", paper=paper)
        cells = {
            ("s", "m", 0): _doc(0.9, paper_cost_total=a * 1e9),
            ("s", "b", 0): _doc(0.9, paper_cost_total=b * 1e9),
        }
        return claims.judge(c, cells)["verdict"]

    assert cost(30.0, 100.0, (36.0, 100.0)) == HOLDS + " (1 seed)"
    assert cost(60.0, 100.0, (36.0, 100.0)) == SMALLER + " (1 seed)"  # ratio 0.6 > 0.36 + 0.1
    assert cost(110.0, 100.0, (36.0, 100.0)) == FAILS + " (1 seed)"


def test_one_seed_reports_direction_only() -> None:
    c = Comparison("x", "s", "m", "b")
    j = claims.judge(c, _cells([0.95], [0.90]))
    assert j["diff"]["ci95"] is None and j["verdict"] == HOLDS + " in direction (1 seed)"
    assert claims.claim_verdict([j["verdict"], SMALLER]) == SMALLER


def test_common_round_reads_both_runs_at_the_last_round_both_ran() -> None:
    c = Comparison("x", "s", "m", "b", metric="common_round")
    cells = {
        ("s", "m", 0): _doc(0.99, [(1, 0.5), (2, 0.6), (3, 0.7)]),
        ("s", "b", 0): _doc(0.40, [(1, 0.4), (2, 0.45)]),  # stopped on its plateau at round 2
    }
    j = claims.judge(c, cells)
    assert j["rounds"] == [2]
    assert j["method"]["mean"] == pytest.approx(60.0) and j["baseline"]["mean"] == pytest.approx(
        45.0
    )


def test_mean_over_rounds_averages_both_curves_up_to_the_common_round() -> None:
    c = Comparison("x", "s", "m", "b", metric="mean_over_rounds")
    cells = {
        ("s", "m", 0): _doc(0.99, [(1, 0.5), (2, 0.6), (3, 0.7)]),
        ("s", "b", 0): _doc(0.40, [(1, 0.4), (2, 0.45)]),
    }
    j = claims.judge(c, cells)
    assert j["rounds"] == [2]
    assert j["method"]["mean"] == pytest.approx(55.0) and j["baseline"]["mean"] == pytest.approx(
        42.5
    )


def test_only_seeds_both_methods_ran_are_paired() -> None:
    c = Comparison("x", "s", "m", "b")
    cells = _cells([0.9, 0.9], [0.8, 0.8])
    cells[("s", "m", 7)] = _doc(0.1)  # no baseline on seed 7
    assert claims.judge(c, cells)["seeds"] == [0, 1]


def test_missing_cells_make_the_claim_not_run(tmp_path: Path) -> None:
    results = claims.evaluate(tmp_path)
    assert {r["verdict"] for r in results} == {"not run (cells missing)"}
    assert "not run" in claims.markdown(results)


def test_load_cells_reads_the_compare_layout(tmp_path: Path) -> None:
    d = tmp_path / "suite" / "cells" / "dir" / "fedtgp" / "seed2"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps(_doc(0.5)))
    assert list(claims.load_cells(tmp_path, "suite")) == [("dir", "fedtgp", 2)]


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=lambda c: c.key)
def test_claims_name_the_suites_methods_settings_and_metric(claim) -> None:
    """A renamed method or setting, or a metric other than the paper's, fails here."""
    for c in claim.comparisons:
        suite = load_suite(c.suite)
        assert c.setting in [s.label for s in suite.settings]
        assert {c.method, c.baseline} <= {m.label for m in suite.methods}
        if c.metric in claims.ACCURACY_METRICS:
            assert c.accuracy == suite.paper_metric


def test_cli_refuses_a_missing_folder(tmp_path: Path, capsys) -> None:
    assert claims.main(["--cells", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_committed_claims_page_is_what_the_committed_cells_give() -> None:
    """docs/results/claims.md is generated from docs/results/converged; a stale page fails."""
    page = ROOT / "docs" / "results" / "claims.md"
    assert page.is_file()
    out = ROOT / "build" / "claims-test.md"
    out.parent.mkdir(exist_ok=True)
    assert claims.main(["--out", str(out)]) == 0
    assert page.read_text() == out.read_text()


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
    assert "| all | 2 | | | | 1.50 | |" in claims.budget_markdown([row])


def test_results_page_carries_the_current_verdicts() -> None:
    """docs/results.md quotes the verdict table of the committed cells verbatim."""
    table = claims.summary_markdown(claims.evaluate(claims.DEFAULT_CELLS))
    assert table in (ROOT / "docs" / "results.md").read_text()


def test_summary_counts_each_comparisons_verdict() -> None:
    c = Comparison("x", "s", "m", "b")
    j1 = claims.judge(c, _cells([0.95, 0.96, 0.97], [0.90, 0.905, 0.91]))
    j2 = claims.judge(c, _cells([0.89, 0.90, 0.91], [0.90, 0.91, 0.92]))
    res = {
        "claim": claims.Claim("k", "A claim", (c, c)),
        "comparisons": [j1, j2],
        "verdict": claims.claim_verdict([j1["verdict"], j2["verdict"]]),
    }
    row = claims.summary_markdown([res]).splitlines()[2]
    assert row == f"| A claim | **{FAILS}** | 3 | 1 {FAILS}, 1 {HOLDS} |"


def test_cli_names_a_corrupt_cell_and_writes_nothing(tmp_path: Path, capsys) -> None:
    d = tmp_path / "fedgh_table3" / "cells" / "pathological" / "fedgh" / "seed0"
    d.mkdir(parents=True)
    (d / "results.json").write_text("{not json")
    out = tmp_path / "claims.md"
    assert claims.main(["--cells", str(tmp_path), "--out", str(out)]) == 2
    assert "results.json: not a cell's results.json" in capsys.readouterr().err
    assert not out.exists()
