"""The main job's claim figure: after-fine-tune accuracy against training cost beside the curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fedmosaic.report import results


def _doc(
    name: str,
    accs: list[float],
    tuned: float | None = None,
    cost: float | None = None,
    subsample: float = 0.25,
    seed: int = 0,
    num_clients: int = 100,
) -> dict[str, Any]:
    summary: dict[str, Any] = {"final": {"acc_weighted": accs[-1]}}
    if tuned is not None:
        summary["after_finetune"] = {"acc_weighted": tuned}
    if cost is not None:
        summary["paper_cost_total"] = cost
    return {
        "seed": seed,
        "config": {
            "seed": seed,
            "algorithm": {"name": name},
            "data": {
                "dataset": "fmnist",
                "num_clients": num_clients,
                "partition": "dirichlet",
                "alpha": 0.1,
                "subsample": subsample,
            },
            "model": {"family": "shallowcnn"},
            "train": {"rounds": len(accs)},
        },
        "rounds": [{"round": i + 1, "acc_weighted": a} for i, a in enumerate(accs)],
        "summary": summary,
    }


def _runs() -> dict[str, dict[str, Any]]:
    return {
        "fedseq_vanilla": _doc("fedseq_vanilla", [0.1, 0.3, 0.5], tuned=0.895, cost=20e9),
        "fedbabu": _doc("fedbabu", [0.2, 0.5, 0.6], tuned=0.90, cost=60e9),
        "fedavg": _doc("fedavg", [0.3, 0.4, 0.55]),  # no fine-tuning, no cost: curves only
    }


# The committed cells, full data: (accuracy after fine-tuning, cost in G) per seed.
CELLS = {
    "fedbabu": [(0.94, 270.0), (0.95, 280.0), (0.945, 275.0)],
    "fedseq_vanilla": [(0.935, 100.0), (0.94, 104.0), (0.94, 98.0)],
    "fedseq_anti": [(0.93, 265.0), (0.94, 262.0), (0.935, 270.0)],  # not in the run
}


def _cells(root: Path) -> Path:
    for method, points in CELLS.items():
        for seed, (acc, cost) in enumerate(points):
            doc = _doc(method, [0.2, 0.4, 0.6 + seed / 100], acc, cost * 1e9, 1.0, seed)
            folder = root / "cells" / "dir01" / method / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "results.json").write_text(json.dumps(doc))
    # Another setting's cell (50 clients) must not stand beside a 100-client run.
    other = root / "cells" / "dir01" / "fedbabu" / "seed7"
    other.mkdir()
    other_doc = _doc("fedbabu", [0.2, 0.4, 0.6], 0.5, 1e9, 1.0, 7, num_clients=50)
    (other / "results.json").write_text(json.dumps(other_doc))
    (root / "cells" / "dir01" / "fedbabu" / "seed8").mkdir()
    (root / "cells" / "dir01" / "fedbabu" / "seed8" / "results.json").write_text("{not json")
    return root


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    figs: list[Any] = []
    monkeypatch.setattr(results, "save_figure", lambda fig, path: figs.append(fig))
    return figs


def _t_interval(values: list[float]) -> tuple[float, float]:
    from scipy.stats import t

    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)


def test_claim_figure_sets_accuracy_against_cost_beside_the_curves(tmp_path, figures):
    assert results.plot_claim(_runs(), tmp_path / "curves.png", _cells(tmp_path / "ref"))
    claim, curves, key = figures[0].axes
    assert "training cost" in claim.get_xlabel() and "Table 4" in claim.get_xlabel()
    assert "after local fine-tuning" in claim.get_ylabel() and "(%)" in claim.get_ylabel()
    assert curves.get_xlabel() == "round" and "before fine-tuning" in curves.get_ylabel()
    # this run: one filled circle per method that fine-tunes and counts its cost (not fedavg)
    circles = sorted(
        (ln.get_xdata()[0], ln.get_ydata()[0]) for ln in claim.lines if ln.get_marker() == "o"
    )
    assert [c for xy in circles for c in xy] == pytest.approx([20.0, 89.5, 60.0, 90.0])
    # the committed cells: the run's methods only, of its setting (not the 50-client cell, not
    # the unreadable one), at their mean with a 95% t-interval on both axes
    squares = [ln for ln in claim.lines if ln.get_marker() == "s"]
    assert len(squares) == 2
    babu = next(ln for ln in squares if ln.get_xdata()[0] > 200)
    acc_mean, acc_half = _t_interval([100 * a for a, _ in CELLS["fedbabu"]])
    cost_mean, _ = _t_interval([c for _, c in CELLS["fedbabu"]])
    assert (babu.get_xdata()[0], babu.get_ydata()[0]) == pytest.approx((cost_mean, acc_mean))
    whiskers = [c for c in claim.collections if len(c.get_segments()) == 1]
    spans = sorted(
        abs(seg[1][1] - seg[0][1]) for c in whiskers for seg in c.get_segments() if seg[0][0] > 200
    )
    assert spans[-1] == pytest.approx(2 * acc_half)
    # the claim's numbers on the arrow from the baseline to the cheaper method
    texts = [t.get_text() for t in claim.texts]
    assert any("0.33× fedbabu's cost" in t and "−0.50 pt" in t for t in texts)  # this run
    assert any("paired 95% CI" in t for t in texts)  # the cells' seeds pair up
    # the learning curves: every run, in %, before fine-tuning
    assert len(curves.lines) == 3
    assert sorted(list(ln.get_ydata())[-1] for ln in curves.lines) == pytest.approx([50, 55, 60])
    # the key below both panels, outside the data, naming both sources and their data fractions
    assert not key.axison
    labels = [t.get_text() for t in key.get_legend().get_texts()]
    assert "this run (25% of the data)" in labels
    assert any(lab.startswith("committed full-data cells, 3 seeds") for lab in labels)
    assert any("different data fractions" in t.get_text() for t in key.texts)


def test_claim_figure_is_written_with_its_vector_siblings(tmp_path):
    out = tmp_path / "curves.png"
    assert results.plot_claim(_runs(), out, _cells(tmp_path / "ref"))
    assert all(out.with_suffix(s).stat().st_size > 0 for s in (".png", ".svg", ".pdf"))
    # the committed figure: the cells alone, PNG only
    alone = tmp_path / "committed.png"
    assert results.plot_claim({}, alone, tmp_path / "ref", vector=False)
    assert alone.is_file() and not alone.with_suffix(".svg").exists()


def test_claim_figure_degrades_to_curves_without_after_fine_tune_numbers(tmp_path, figures):
    runs = {m: _doc(m, [0.1, 0.4]) for m in ("fedavg", "fedper")}
    assert not results.plot_claim(runs, tmp_path / "curves.png", _cells(tmp_path / "ref"))
    (ax,) = figures[0].axes  # plot_curves: the learning curves only
    assert ax.get_xlabel() == "round" and len(ax.lines) == 2
    # its legend sits beside the axes, not on the curves
    anchor = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
    assert anchor.x0 > 1.0


def test_claim_figure_without_the_committed_cells_shows_this_run_alone(tmp_path, figures):
    """Installed from a wheel, no docs/ beside the run: this run's points, no reference."""
    assert results.plot_claim(_runs(), tmp_path / "curves.png", tmp_path / "absent")
    claim, _, key = figures[0].axes
    assert len([ln for ln in claim.lines if ln.get_marker() == "o"]) == 2
    assert not [ln for ln in claim.lines if ln.get_marker() == "s"]
    labels = [t.get_text() for t in key.get_legend().get_texts()]
    assert not any("committed" in lab for lab in labels) and not key.texts
    # no run and no cell: nothing to draw, nothing written
    assert not results.plot_claim({}, tmp_path / "none.png", tmp_path / "absent")
    assert not (tmp_path / "none.png").exists() and len(figures) == 1


def test_reference_cells_are_read_relative_to_the_current_directory():
    """As the claims' RESULTS: an installed package has no docs/ beside its files."""
    assert not results.REFERENCE_CELLS.is_absolute()
    assert results.REFERENCE_CELLS.parts[:3] == ("docs", "results", "full")
