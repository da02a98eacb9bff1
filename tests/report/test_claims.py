"""The claims page: paired per-seed gaps, their intervals, the verdict rules, and that the
committed page is what the committed cells give."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedmosaic.report import claims
from fedmosaic.report.claims import FAILS, HOLDS, INCONCLUSIVE, SMALLER, Comparison
from fedmosaic.suite_runner import load_suite

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
    # 2 - 2.48 < 0: the interval contains 0. Without a paper gap the count is for the observed
    # one (sd 1, gap 2): n = 4 needs (3.182 + 0.978)^2 / 4 = 4.33 > 4; n = 5 needs
    # (2.776 + 0.941)^2 / 4 = 3.45 <= 5
    assert j["verdict"] == INCONCLUSIVE + ": needs 5 seeds"


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
        ([0.90, 0.90, 0.90], [0.90, 0.90, 0.90], None, INCONCLUSIVE),  # no gap: [0, 0]
        ([0.89, 0.90, 0.91], [0.90, 0.91, 0.92], None, FAILS),  # -1 each seed: [-1, -1]
        # the labels that used to flatter or condemn on the sign of the mean alone:
        ([0.90, 0.92, 0.91], [0.88, 0.89, 0.90], None, INCONCLUSIVE),  # +2 [-0.48, +4.48]
        ([0.88, 0.89, 0.90], [0.90, 0.92, 0.91], None, INCONCLUSIVE),  # -2 [-4.48, +0.48]
    ],
)
def test_above_verdicts(method, baseline, paper, expected) -> None:
    c = Comparison("x", "s", "m", "b", paper=paper)
    assert claims.judge(c, _cells(method, baseline))["verdict"].split(":")[0] == expected


def test_at_or_above_is_non_inferiority_with_a_margin() -> None:
    c = Comparison("x", "s", "m", "b", relation="at_or_above")  # margin 1 point
    # gaps -0.5, +1, -1.5: mean -1/3, half-width 4.30 * 1.258 / sqrt(3) = 3.12: inconclusive
    level = claims.judge(c, _cells([0.90, 0.91, 0.89], [0.905, 0.90, 0.905]))
    assert level["diff"]["mean"] < 0 and level["verdict"].startswith(INCONCLUSIVE + ": needs ")
    # layer expansion's old cells: -0.76 [-1.99, +0.46] used to be published as "holds"
    le = claims.verdict(c, {"mean": -0.76, "ci95": 1.22, "n": 3}, {"mean": 89.8}, {"mean": 90.6})
    assert le == INCONCLUSIVE
    above = claims.judge(c, _cells([0.92, 0.91, 0.915], [0.90, 0.90, 0.90]))
    assert above["verdict"] == HOLDS  # [+1.00, +2.00]... lower bound above 0
    # below by 0.5 each seed: [-0.5, -0.5], inside the 1-point margin
    within = claims.judge(c, _cells([0.895, 0.905, 0.895], [0.90, 0.91, 0.90]))
    assert within["verdict"] == f"{HOLDS} within the 1-point margin"
    below = claims.judge(c, _cells([0.85, 0.86, 0.85], [0.90, 0.90, 0.91]))
    assert below["verdict"] == FAILS  # [-6.7, -3.3]: below by more than the margin
    wide = Comparison("x", "s", "m", "b", relation="at_or_above", margin=10.0)
    assert claims.judge(wide, _cells([0.85, 0.86, 0.85], [0.90, 0.90, 0.91]))["verdict"] == (
        f"{HOLDS} within the 10-point margin"
    )


def test_lower_needs_the_interval_below_0_and_compares_the_papers_ratio() -> None:
    def cost(a: list[float], b: list[float], paper: tuple[float, float]) -> str:
        c = Comparison("x", "s", "m", "b", relation="lower", metric="paper_cost_g", paper=paper)
        cells = {}
        for seed, (x, y) in enumerate(zip(a, b, strict=True)):
            cells[("s", "m", seed)] = _doc(0.9, paper_cost_total=x * 1e9)
            cells[("s", "b", seed)] = _doc(0.9, paper_cost_total=y * 1e9)
        return claims.judge(c, cells)["verdict"]

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
    assert claims.seeds_needed(1.0, 1.0) == 10
    assert claims.seeds_needed(2.0, 2.0) == 10  # only the ratio matters
    assert claims.seeds_needed(0.0, 1.0) == 2
    assert claims.seeds_needed(None, 1.0) is None and claims.seeds_needed(1.0, 0.0) is None
    assert claims.seeds_needed(100.0, 0.01) is None  # past MAX_SEEDS


def test_power_targets_the_papers_gap_or_the_margin() -> None:
    diff = {"mean": 0.3, "std": 1.0, "ci95": 2.0, "n": 3}
    above = claims.power(Comparison("x", "s", "m", "b", paper=(91.0, 90.0)), diff)
    assert above["delta"] == pytest.approx(1.0) and above["seeds"] == 10
    nopaper = claims.power(Comparison("x", "s", "m", "b"), diff)
    assert nopaper["basis"] == "observed gap" and nopaper["delta"] == pytest.approx(0.3)
    ni = claims.power(
        Comparison("x", "s", "m", "b", relation="at_or_above", paper=(90.5, 90.0)), diff
    )
    assert ni["delta"] == pytest.approx(1.5)  # margin 1 + the paper's +0.5


def test_resolution_counts_all_test_images() -> None:
    doc = {"clients": [{"num_test": 300}, {"num_test": 700}]}
    r = claims.resolution(doc, 90.0)
    assert r["test_images"] == 1000 and r["per_image"] == pytest.approx(0.1)
    assert r["sampling_sd"] == pytest.approx(100 * math.sqrt(0.09 / 1000))


def test_one_seed_is_inconclusive_whatever_the_sign() -> None:
    c = Comparison("x", "s", "m", "b")
    j = claims.judge(c, _cells([0.95], [0.90]))
    assert j["diff"]["ci95"] is None and j["verdict"] == INCONCLUSIVE + " (1 seed)"
    assert claims.claim_verdict([j["verdict"], SMALLER]) == INCONCLUSIVE + " (1 seed)"
    assert claims.claim_verdict([INCONCLUSIVE, FAILS, HOLDS]) == FAILS


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
    """docs/results/claims.md is generated from docs/results/{full,converged}; a stale page
    fails."""
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
    assert "| all | | 2 | | | | 1.50 | |" in claims.budget_markdown([row])


def test_results_page_carries_the_current_verdicts() -> None:
    """docs/results.md quotes the verdict table of the committed cells verbatim."""
    table = claims.summary_markdown(claims.evaluate())
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
    j1["source"] = j2["source"] = "full"
    j1["fraction"] = j2["fraction"] = [1.0]
    row = claims.summary_markdown([res]).splitlines()[2]
    assert row == f"| A claim | **{FAILS}** | 3 | full 100% | 1 {FAILS}, 1 {HOLDS} |"


def test_cli_names_a_corrupt_cell_and_writes_nothing(tmp_path: Path, capsys) -> None:
    d = tmp_path / "fedgh_table3" / "cells" / "pathological" / "fedgh" / "seed0"
    d.mkdir(parents=True)
    (d / "results.json").write_text("{not json")
    out = tmp_path / "claims.md"
    assert claims.main(["--cells", str(tmp_path), "--out", str(out)]) == 2
    assert "results.json: not a cell's results.json" in capsys.readouterr().err
    assert not out.exists()


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
    # FedHeNN's networks with and without the projection to feature_dim (the old Local cells)
    henn = _cfg_doc(0.9, algorithm__name="fedhenn")
    (model,) = claims.pair_problems(c, henn, base)
    assert model.startswith("client models differ (client 0: ")
    assert claims.pair_problems(c, henn, _cfg_doc(0.8, model__projection="none")) == []
    term = Comparison("x", "s", "m", "b", same=("distance", "lam"))
    tgp = _cfg_doc(0.9, algorithm__name="fedtgp")  # defaults: euclidean, lam 0.1
    proto = _cfg_doc(0.9, algorithm__name="fedproto")  # defaults: mse, lam 1.0
    assert claims.pair_problems(term, tgp, proto) == [
        "algorithm.distance 'euclidean' vs 'mse'",
        "algorithm.lam 0.1 vs 1.0",
    ]


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


def test_an_unfair_pair_is_not_judged() -> None:
    c = Comparison("x", "s", "m", "b")
    cells = {}
    for seed in range(3):
        cells[("s", "m", seed)] = _cfg_doc(0.95, seed, algorithm__name="fedhenn")
        cells[("s", "b", seed)] = _cfg_doc(0.90, seed)
    j = claims.judge(c, cells)
    assert j["verdict"].startswith(claims.NOT_COMPARABLE + ": seed 0: client models differ")
    assert claims.claim_verdict([j["verdict"], HOLDS]) == claims.NOT_COMPARABLE


def test_a_cell_of_an_older_method_definition_is_flagged() -> None:
    """fedtgp_mse now trains on stale prototypes (the authors' code): a cell without them is not
    that method."""
    algo = {"name": "fedtgp", "distance": "mse", "lam": 10.0, "tau": 100.0, "server_epochs": 100}
    old = {"config": {"algorithm": algo}}
    (msg,) = claims.definition_problems("fedtgp_table10", "fedtgp_mse", old)
    assert msg == "fedtgp_mse's cell has algorithm.stale_prototypes = None, the suite True"
    assert claims.definition_problems("fedtgp_table10", "fedtgp_mse_fresh", old) == []


def test_final_reads_runs_of_different_lengths_at_their_common_round() -> None:
    c = Comparison("x", "s", "m", "b")
    a = _doc(0.99, [(1, 0.5), (2, 0.6), (3, 0.7)], rounds_run=3)
    b = _doc(0.40, [(1, 0.4), (2, 0.45)], rounds_run=2)
    assert claims.pair_values(c, a, b) == (pytest.approx(60.0), pytest.approx(45.0), 2)
    b3 = _doc(0.80, [(1, 0.4), (2, 0.45), (3, 0.8)], rounds_run=3)
    assert claims.pair_values(c, a, b3) == (pytest.approx(99.0), pytest.approx(80.0), 3)


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


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=lambda c: c.key)
def test_every_published_pair_is_fair(claim) -> None:
    """The committed cells behind each claim: same seed, data, per-client parameter counts, round
    budget, the same client term where the claim says so, and the suite's current definition of
    both methods (rebuilt from each cell's stored config)."""
    (res,) = [r for r in claims.evaluate() if r["claim"] is claim]
    for j in res["comparisons"]:
        assert j["problems"] == [], (j["comparison"], j["problems"][:3])


def test_every_accuracy_row_has_a_power_column() -> None:
    for res in claims.evaluate():
        for j in res["comparisons"]:
            c = j["comparison"]
            if c.metric in claims.ACCURACY_METRICS and j["diff"]["n"] >= 2:
                assert j["power"]["delta"] is not None and j["resolution"]["test_images"] > 0


def test_a_verdict_from_less_than_the_papers_budget_says_so() -> None:
    """Reduced data or fewer rounds than the suite's paper_rounds: "... at this budget"; the full
    data at the paper's rounds, and costs, are verdicts without it."""
    c = Comparison("layer_expansion", "dir01", "fedseq_vanilla", "fedbabu")  # paper: 100 rounds
    assert claims.reduced_budget(c, {"fraction": [0.25], "rounds": [100]})
    assert claims.reduced_budget(c, {"fraction": [1.0], "rounds": [60]})
    assert not claims.reduced_budget(c, {"fraction": [1.0], "rounds": [100]})
    cost = Comparison("layer_expansion", "dir01", "m", "b", relation="lower", metric="paper_cost_g")
    assert not claims.reduced_budget(cost, {"fraction": [0.25], "rounds": []})
    (tgp,) = [r for r in claims.evaluate() if r["claim"].key == "fedtgp"]
    for j in tgp["comparisons"]:  # 5% of the data: nothing on this page refutes the paper itself
        assert not j["verdict"].startswith(FAILS) or j["verdict"].endswith(claims.AT_THIS_BUDGET)


def test_a_claim_is_a_conjunction() -> None:
    """One comparison that does not hold settles the claim, cells missing elsewhere or not; a
    missing one otherwise leaves it not run."""
    budget = FAILS + claims.AT_THIS_BUDGET
    assert claims.claim_verdict([budget, "not run", HOLDS]) == budget
    assert claims.claim_verdict([budget, FAILS]) == FAILS
    assert claims.claim_verdict([HOLDS, "not run"]) == "not run (cells missing)"
    assert claims.claim_verdict([]) == "not run (cells missing)"


def test_an_inconclusive_row_says_when_the_interval_excludes_the_papers_gap() -> None:
    c = Comparison("x", "s", "m", "b", paper=(95.0, 90.0))  # the paper: +5
    j = claims.judge(c, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))  # +2 [-0.48, +4.48]
    assert j["verdict"].endswith("; the paper's gap (+5.00) is above the interval")
    wide = Comparison("x", "s", "m", "b", paper=(94.0, 90.0))  # +4: inside the interval
    assert (
        "above the interval"
        not in claims.judge(wide, _cells([0.90, 0.92, 0.91], [0.88, 0.89, 0.90]))["verdict"]
    )


def test_a_cell_whose_model_cannot_be_rebuilt_is_one_line_not_a_traceback() -> None:
    doc = {
        "config": {"data": {"dataset": "fmnist"}, "model": {"family": "nope", "feature_dim": 8}},
        "clients": [{"train_label_counts": [1] * 10}],
    }
    with pytest.raises(ValueError, match="stored model config .* cannot be rebuilt"):
        claims.param_counts(doc)


def test_claims_alone_sees_every_method_default():
    """In a fresh process that imports only the claims module, a cell without a hyperparameter
    compares at the method's default: the registry is filled by claims' own imports (a cell's
    ``distance`` read as None made FedTGP vs FedProto "not comparable")."""
    import subprocess
    import sys

    code = (
        "from fedmosaic.report import claims; "
        "print(claims._algo_value({'algorithm': {'name': 'fedtgp'}}, 'distance'), "
        "claims._algo_value({'algorithm': {'name': 'fedproto'}}, 'lam'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["euclidean", "1.0"]
