"""The privacy suite's page: rows grouped by method and epsilon, paired gaps, the figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedmosaic.report import privacy_page as pp
from fedmosaic.report.claims import load_cells

ROOT = Path(__file__).resolve().parents[2]


def _doc(name: str, eps: float, acc: float, auc: float | None, diverged: int = 0) -> dict:
    privacy = {"mechanism": "none"}
    if math.isfinite(eps):
        privacy = {"mechanism": "local", "epsilon": eps, "noise_multiplier": 5.7, "clip": 1.5}
    summary: dict = {"final": {"acc_weighted": acc}}
    if auc is not None:
        summary["membership"] = {"mia_auc": auc, "mia_tpr": 0.02}
    if diverged:
        summary["diverged_rounds"] = diverged
    return {"config": {"algorithm": {"name": name}, "privacy": privacy}, "summary": summary}


def _cells() -> dict:
    cells = {}
    for seed in range(3):
        cells[("s", "fedproto", seed)] = _doc("fedproto", math.inf, 0.88 + 0.01 * seed, 0.57)
        cells[("s", "fedproto_eps8", seed)] = _doc(
            "fedproto", 8.0, 0.10, None if seed == 2 else 0.50, diverged=20 if seed else 0
        )
        cells[("s", "lg_fedavg", seed)] = _doc("lg_fedavg", math.inf, 0.89, 0.55 + 0.01 * seed)
        cells[("s", "lg_fedavg_eps8", seed)] = _doc("lg_fedavg", 8.0, 0.89, 0.56 - 0.01 * seed)
    return cells


def test_rows_group_by_method_and_epsilon_with_paired_gaps():
    table = pp.rows(_cells())
    assert [(r["method"], r["epsilon"]) for r in table] == [
        ("fedproto", math.inf),
        ("fedproto", 8.0),
        ("lg_fedavg", math.inf),
        ("lg_fedavg", 8.0),
    ]
    proto = table[1]
    assert proto["acc"]["mean"] == pytest.approx(10.0)
    # paired: (10 - 88) + (10 - 89) + (10 - 90) over 3 seeds
    assert proto["acc_vs_none"]["mean"] == pytest.approx(-79.0)
    assert proto["auc_vs_none"]["n"] == 2  # seed 2 has no attack (every model NaN)
    assert proto["diverged_seeds"] == 2 and proto["noise_multiplier"] == 5.7
    assert table[0]["acc_vs_none"] is None and table[0]["noise_multiplier"] is None
    # lg_fedavg: AUC 56, 55, 54 against 55, 56, 57: gaps +1, -1, -3, mean -1, sd 2, the
    # interval -1 +- 4.303 * 2 / sqrt(3) contains 0
    lg = table[3]
    assert lg["auc_vs_none"]["mean"] == pytest.approx(-1.0)
    assert lg["auc_vs_none"]["ci95"] == pytest.approx(4.302652729911275 * 2 / math.sqrt(3))
    text = pp.markdown(table)
    assert "| lg_fedavg | 8 | 5.7 | 1.5 | 3 | 0 |" in text
    assert "-1.00 [-5.97, +3.97] (inconclusive)" in text
    assert "| fedproto | inf | - | - | 3 | 0 |" in text


def test_the_page_and_its_figures_are_written(tmp_path):
    cells_root = tmp_path / "privacy"
    for (setting, method, seed), doc in _cells().items():
        d = cells_root / "suite" / "cells" / setting / method / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps(doc))
    assert pp.main(["--suite", "suite", "--root", str(cells_root)]) == 0
    text = (cells_root / "suite.md").read_text()
    assert "![accuracy and attack AUC against epsilon](suite_epsilon.png)" in text
    for ext in ("png", "svg", "pdf"):
        assert (cells_root / f"suite_epsilon.{ext}").stat().st_size > 1000
    assert pp.main(["--suite", "none", "--root", str(cells_root)]) == 1
    # a cut-off cell is named (exit 2) and the page is left as it was
    page = (cells_root / "suite.md").read_text()
    (cells_root / "suite" / "cells" / "s" / "fedproto" / "seed0" / "results.json").write_text("{")
    assert pp.main(["--suite", "suite", "--root", str(cells_root)]) == 2
    assert (cells_root / "suite.md").read_text() == page


def test_the_committed_page_carries_the_committed_cells():
    page = ROOT / "docs" / "results" / "privacy" / f"{pp.SUITE}.md"
    cells = load_cells(pp.ROOT, pp.SUITE)
    if not cells:
        assert not page.exists(), "a privacy page without its cells"
        pytest.skip("no privacy cells committed yet")
    assert page.read_text() == pp.page(pp.rows(cells), pp.SUITE, f"{pp.SUITE}_epsilon")
