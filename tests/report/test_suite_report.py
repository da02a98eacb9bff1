"""`fedmosaic compare`: suite parsing, the grid, caching, the table, plots and the HTML report."""

from __future__ import annotations

import csv
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fedmosaic import suite_runner
from fedmosaic.cli import main
from fedmosaic.config import ConfigError
from fedmosaic.report.suite_report import (
    OPTIONAL_METRICS,
    aggregate,
    fmt,
    markdown_table,
    run_metrics,
    summarize_grid,
    write_csv,
)
from fedmosaic.suite_runner import build_cells, load_suite

SUITES = Path(__file__).resolve().parents[2] / "benchmarks" / "suites"

TINY_SUITE = """
[suite]
name = "tiny"
title = "Tiny grid"
seeds = [0, 1]
methods = ["local", "proto"]
settings = ["dir"]
target_accuracy = 0.3
prototype_plot = "pca"
checkpoint_every = 1

[base]
[base.data]
dataset = "synthetic"
synthetic_size = 160
synthetic_classes = 4
synthetic_shape = [1, 16, 16]
partition = "dirichlet"
alpha = 1.0
min_size = 20
num_clients = 3
val_fraction = 0.2
[base.model]
family = "cnn1"
feature_dim = 8
[base.train]
rounds = 2
batch_size = 10
lr = 0.05

[settings.dir]
"data.alpha" = 1.0

[methods.proto]
algorithm = { name = "fedproto", lam = 0.1 }

[quick]
"train.rounds" = 1

[reference.dir]
proto = "12.34 ± 0.56"
"""


def _suite(tmp_path: Path, text: str = TINY_SUITE) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(text)
    return p


def test_every_shipped_suite_builds_valid_cells():
    paths = sorted(SUITES.glob("*.toml"))
    assert len(paths) >= 5
    for path in paths:
        suite = load_suite(path)
        cells = build_cells(suite, quick=True, check=False)  # configs only: no dataset files
        assert cells and suite.budget and suite.quick_budget, path.name
        assert len({c.key for c in cells}) == len(cells)


def test_cells_layer_base_setting_method_seed_quick_and_set(tmp_path: Path):
    suite = load_suite(_suite(tmp_path))
    cells = build_cells(suite, ["train.lr=0.02"], quick=True)
    assert [c.key for c in cells] == [
        "dir/local/seed0",
        "dir/local/seed1",
        "dir/proto/seed0",
        "dir/proto/seed1",
    ]
    c = cells[2]
    assert c.cfg.algorithm == {"name": "fedproto", "lam": 0.1}
    assert (c.cfg.seed, c.cfg.train.rounds, c.cfg.train.lr) == (0, 1, 0.02)
    assert len({x.hash for x in cells}) == 4
    assert build_cells(suite, methods=["proto"], seeds=[5])[0].key == "dir/proto/seed5"
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        build_cells(suite, methods=["nope"])
    with pytest.raises(ConfigError, match=r"cell dir/local/seed0: .*train\.rounds"):
        build_cells(suite, ["train.rounds=0"])


def test_suite_errors_name_the_key(tmp_path: Path):
    with pytest.raises(ConfigError, match="unknown key suite.seed;"):
        load_suite(_suite(tmp_path, "[suite]\nseed = 1\n"))
    with pytest.raises(ConfigError, match=r"methods.x: unknown keys \['lam'\]"):
        load_suite(_suite(tmp_path, '[suite]\nmethods = ["x"]\n[methods.x]\nlam = 1\n'))


def test_run_metrics_target_and_bytes():
    doc = {
        "summary": {
            "final": {"acc_weighted": 0.8, "acc_std": 0.1},
            "best_on_test": {"acc_weighted": 0.85},
            "bytes_up_per_client_per_round": 2000,  # 1 KB = 1000 bytes, as the round log
            "bytes_down_per_client_per_round": 1000,
            "seconds_per_round": 1.5,
        },
        "rounds": [
            {"round": 1, "acc_weighted": 0.4, "bytes_up": 10**6, "bytes_down": 10**6},
            {"round": 2, "bytes_up": 10**6, "bytes_down": 0},  # not evaluated
            {"round": 3, "acc_weighted": 0.7, "bytes_up": 5 * 10**5, "bytes_down": 5 * 10**5},
            {"round": 4, "acc_weighted": 0.9, "bytes_up": 10**6, "bytes_down": 10**6},
        ],
    }
    m = run_metrics(doc, 0.7)
    assert m["rounds_to_target"] == 3 and m["mb_to_target"] == 4.0
    assert (m["kb_up"], m["kb_down"], m["best_on_val"]) == (2.0, 1.0, None)
    assert run_metrics(doc, 0.95)["rounds_to_target"] is None
    a = aggregate([3.0, None, 5.0])
    # sample std sqrt(2); 95% t-interval: t(0.975, 1) = 12.706 x sqrt(2) / sqrt(2)
    assert (a["mean"], a["n"], a["of"]) == (4.0, 2, 3)
    assert a["std"] == pytest.approx(2**0.5) and a["ci95"] == pytest.approx(12.7062047, rel=1e-6)
    three = aggregate([0.5, 0.6, 0.7])  # std 0.1, t(0.975, 2) = 4.3027: 0.1 x 4.3027 / sqrt(3)
    assert three["ci95"] == pytest.approx(0.1 * 4.30265273 / 3**0.5, rel=1e-6)
    one = aggregate([0.5])
    assert one["std"] is None and one["ci95"] is None
    assert fmt(one, "pct") == "50.00 ± n/a" and fmt(three, "pct") == "60.00 ± 24.84"


def test_no_interval_from_two_seeds_but_their_range():
    """Two seeds gave ``54.02 ± 230.50`` (t(0.975, 1) = 12.7): an interval needs 3 seeds."""
    two = aggregate([0.3, 0.78])
    assert two["ci95"] is not None  # still computed (table.csv, claims): only not shown
    assert fmt(two, "pct") == "54.00 ± n/a (range 30.00-78.00)"
    assert fmt(aggregate([4.0, 6.0]), "int") == "5 (range 4-6)"
    assert fmt(aggregate([0.5, 0.6, 0.7]), "pct") == "60.00 ± 24.84"


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if (tag, k) in (("img", "src"), ("a", "href")):
                self.refs.append(v)


def test_compare_end_to_end_cached_and_report(tmp_path: Path, monkeypatch, capsys):
    suite = _suite(tmp_path)
    out = tmp_path / "out"
    assert main(["compare", str(suite), "--out", str(out), "--quiet"]) == 0
    for name in ("table.md", "table.csv", "summary.json", "curves.png", "clients.png"):
        assert (out / name).stat().st_size > 0, name
    md = (out / "table.md").read_text()
    assert "best-on-test acc (as the papers report it)" in md and "12.34 ± 0.56" in md
    # two seeds: no interval (it would be 12.7 standard errors wide), their range instead
    assert re.search(r"\| proto \| 2 \| \d+\.\d\d ± n/a \(range \d+\.\d\d-\d+\.\d\d\) \|", md)
    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [r["method"] for r in rows] == ["local", "proto"] and rows[0]["final_n"] == "2"
    assert rows[0]["best_on_val_mean"] != ""  # the suite has a validation split
    cell = out / "cells" / "dir" / "proto" / "seed0"
    assert (cell / "prototypes.png").stat().st_size > 0  # prototype method: t-SNE/PCA plot
    assert not (cell / "checkpoint.safetensors").exists()
    # The HTML report shows the plots and links the runs: every reference resolves to a file.
    page = (out / "index.html").read_text()
    parser = _Refs()
    parser.feed(page)
    imgs = [r for r in parser.refs if r.endswith(".png")]
    assert {"curves.png", "clients.png"} <= set(imgs) and any("prototypes" in r for r in imgs)
    assert all((out / r).is_file() for r in parser.refs), parser.refs
    # A second run reuses every cell (results cached by config hash) and rewrites the report.
    monkeypatch.setattr(
        suite_runner, "run_cell", lambda *a, **k: pytest.fail("re-ran a cached cell")
    )
    capsys.readouterr()
    assert main(["compare", str(suite), "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.count(": cached") == 4
    # A changed config is a different cell: it runs again.
    calls = []
    monkeypatch.setattr(
        suite_runner,
        "run_cell",
        lambda out, cell, *a, **k: (
            calls.append(cell.key)
            or json.loads((out / "cells" / "dir" / "local" / "seed0" / "results.json").read_text())
        ),
    )
    assert (
        main(
            [
                "compare",
                str(suite),
                "--out",
                str(out),
                "--quiet",
                "--set",
                "train.lr=0.01",
                "--methods",
                "local",
                "--seeds",
                "0",
            ]
        )
        == 0
    )
    assert calls == ["dir/local/seed0"]


class _Stop(Exception):
    pass


def _untimed(path: Path) -> dict:
    doc = json.loads(path.read_text())
    doc.pop("wall_seconds")
    doc.pop("provenance")  # start/finish times, the command
    doc["summary"].pop("seconds_per_round")
    for r in doc["rounds"]:
        for k in [k for k in r if k.startswith("seconds")]:
            del r[k]
    return doc


def test_resume_continues_an_interrupted_grid(tmp_path: Path, monkeypatch):
    from fedmosaic.checkpoint import Checkpointer, peek

    suite = _suite(tmp_path)
    args = ["compare", str(suite), "--quiet", "--methods", "proto", "--seeds", "0"]
    assert main([*args, "--out", str(tmp_path / "ref")]) == 0
    original = Checkpointer.after_round

    def stop_after_first(self, t, *rest):
        original(self, t, *rest)
        if t == 1:
            raise _Stop

    monkeypatch.setattr(Checkpointer, "after_round", stop_after_first)
    assert main([*args, "--out", str(tmp_path / "got")]) == 1  # a crash: one line, exit 1
    monkeypatch.setattr(Checkpointer, "after_round", original)
    cell = Path("cells/dir/proto/seed0")
    ckpt = tmp_path / "got" / cell / "checkpoint.safetensors"
    assert peek(ckpt)["round"] == 1
    # A corrupt checkpoint is refused before its round decides anything: the rounds table stays.
    good, rows = ckpt.read_bytes(), (tmp_path / "got" / cell / "rounds.csv").read_bytes()
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF  # a tensor byte: the metadata still reads, the digest does not match
    ckpt.write_bytes(bytes(flipped))
    assert main([*args, "--out", str(tmp_path / "got"), "--resume"]) == 2
    assert ckpt.read_bytes() == bytes(flipped)
    assert (tmp_path / "got" / cell / "rounds.csv").read_bytes() == rows
    ckpt.write_bytes(good)
    assert main([*args, "--out", str(tmp_path / "got"), "--resume"]) == 0
    ref = _untimed(tmp_path / "ref" / cell / "results.json")
    assert _untimed(tmp_path / "got" / cell / "results.json") == ref


CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None
)


# Appended to a copy of the report: after every image has loaded (or failed), write each <img>'s
# decoded size and its box on the page into the DOM, which ``--dump-dom`` prints.
_PROBE = """<script>
window.addEventListener('load', () => {
  const rows = [...document.images].map(i => {
    const b = i.getBoundingClientRect();
    return {src: i.getAttribute('src'), w: i.naturalWidth, h: i.naturalHeight,
            x: b.left + scrollX, y: b.top + scrollY, cw: b.width, ch: b.height};
  });
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify(rows);
  document.body.appendChild(pre);
});
</script>"""
FIGURES = ("curves.png", "curves_mb.png", "curves_seconds.png", "clients.png", "labels.png")


def _chromium(tmp_path: Path, url: str, *flags: str) -> bytes:
    import subprocess

    base = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",  # the same layout width with or without a scrollbar
        "--force-device-scale-factor=1",  # screenshot pixels = CSS pixels
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    done = subprocess.run(
        [CHROMIUM, *base, *flags, url], check=True, capture_output=True, timeout=120
    )
    return done.stdout


def _rendered(tmp_path: Path, out: Path) -> tuple[str, dict[str, dict]]:
    """The report as Chromium renders it: its DOM and, per image src, the probe's record."""
    import html as html_mod

    probe = out / "probe.html"  # beside index.html: the same relative image paths
    probe.write_text((out / "index.html").read_text().replace("</body>", _PROBE + "</body>"))
    dom = _chromium(tmp_path, probe.as_uri(), "--window-size=1200,900", "--dump-dom").decode()
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, "the probe script did not run"
    rows = json.loads(html_mod.unescape(found.group(1)))
    return dom, {r["src"]: r for r in rows}


def _final_acc(cell: Path) -> float:
    return json.loads((cell / "results.json").read_text())["summary"]["final"]["acc_weighted"]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt: chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path: Path):
    """The report opens in a real browser: two seeds' mean and range in the table (no interval
    from two seeds), and each figure decoded (not a broken or missing image) and drawn with a
    figure's worth of colours."""
    import numpy as np
    from matplotlib.image import imread

    out = tmp_path / "out"
    assert main(["compare", str(_suite(tmp_path)), "--out", str(out), "--quiet"]) == 0
    dom, imgs = _rendered(tmp_path, out)
    # Two seeds: the mean and the seeds' range, by hand from the runs (a t-interval from two
    # seeds, 12.7 standard errors wide, is not shown).
    widths = []
    for method in ("local", "proto"):
        a, b = (100 * _final_acc(out / f"cells/dir/{method}/seed{s}") for s in (0, 1))
        row = re.search(
            rf"<td>{method}</td><td>2</td>\s*<td>(\d+\.\d\d) ± n/a(?: \(range (\d+\.\d\d)-"
            rf"(\d+\.\d\d)\))?</td>",
            dom,
        )
        assert row, f"no 'm ± n/a (range lo-hi)' in the rendered {method} row"
        assert float(row.group(1)) == pytest.approx((a + b) / 2, abs=0.006)
        if row.group(2) is not None:
            assert float(row.group(2)) == pytest.approx(min(a, b), abs=0.006)
            assert float(row.group(3)) == pytest.approx(max(a, b), abs=0.006)
            widths.append(float(row.group(3)) - float(row.group(2)))
    assert widths and max(widths) > 0, "the seeds gave identical accuracies: no range exercised"
    # no interval anywhere from two seeds: the paper's number is the only "a ± b" on the page
    assert set(re.findall(r"\d+\.\d\d ± \d+\.\d\d", dom)) == {"12.34 ± 0.56"}
    # Each figure individually: decoded by the browser, laid out at a readable size ...
    for name in FIGURES:
        assert name in imgs, f"{name} is not on the page"
    protos = [s for s in imgs if s.endswith("prototypes.png")]
    assert protos, "no prototype figure on the page"
    for src, r in imgs.items():
        assert r["w"] > 300 and r["h"] > 200, f"{src} did not load in the browser ({r})"
        assert r["cw"] > 500, f"{src} is drawn {r['cw']} px wide"
    # ... and drawn: the screenshot's pixels inside each image's box hold many colours.
    height = int(max(r["y"] + r["ch"] for r in imgs.values())) + 50
    shot = tmp_path / "page.png"
    _chromium(
        tmp_path,
        (out / "probe.html").as_uri(),
        f"--window-size=1200,{height}",
        f"--screenshot={shot}",
    )
    img = imread(shot)  # [H, W, 3|4] floats in 0..1
    assert img.shape[0] >= height - 1 and img.shape[1] >= 1200
    for src, r in imgs.items():
        x0, y0 = int(r["x"]) + 2, int(r["y"]) + 2  # inside the 1 px border
        box = img[y0 : int(r["y"] + r["ch"]) - 2, x0 : int(r["x"] + r["cw"]) - 2, :3]
        rgb = (box.reshape(-1, 3) * 255).astype(np.uint8)
        assert len(np.unique(rgb, axis=0)) > 200, f"{src} renders blank on the page"
    # The probe can fail: a missing and a corrupt figure are each reported as not loaded.
    (out / "clients.png").unlink()
    (out / "labels.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    _, broken = _rendered(tmp_path, out)
    assert broken["clients.png"]["w"] == 0 and broken["labels.png"]["w"] == 0
    assert broken["curves_mb.png"]["w"] > 300 and broken["curves_seconds.png"]["w"] > 300


def test_run_metrics_report_the_papers_metric():
    """FedGH/FedClassAvg report the unweighted mean over clients; HtFLlib the weighted one."""
    doc = {
        "summary": {"final": {"acc_weighted": 0.8, "acc_mean": 0.6, "acc_std": 0.1}},
        "rounds": [
            {
                "round": 1,
                "acc_weighted": 0.5,
                "acc_mean": 0.7,
                "val_acc_weighted": 0.9,
                "val_acc_mean": 0.2,
                "bytes_up": 0,
                "bytes_down": 0,
            },
            {
                "round": 2,
                "acc_weighted": 0.8,
                "acc_mean": 0.6,
                "val_acc_weighted": 0.1,
                "val_acc_mean": 0.8,
                "bytes_up": 0,
                "bytes_down": 0,
            },
        ],
    }
    w = run_metrics(doc, 0.65, "weighted")
    u = run_metrics(doc, 0.65, "unweighted")
    assert (w["final"], w["final_other"], u["final"], u["final_other"]) == (0.8, 0.6, 0.6, 0.8)
    # best-on-test and best-on-val select their round by the reported metric
    assert (w["best_on_test"], u["best_on_test"]) == (0.8, 0.7)
    assert (w["best_on_val"], u["best_on_val"]) == (0.5, 0.6)
    assert (w["rounds_to_target"], u["rounds_to_target"]) == (2, 1)


def test_suite_paper_metric_is_checked_and_names_the_columns(tmp_path: Path):
    from fedmosaic.report.suite_report import _columns

    with pytest.raises(ConfigError, match="paper_metric must be weighted or unweighted"):
        load_suite(_suite(tmp_path, '[suite]\nmethods = ["local"]\npaper_metric = "micro"\n'))
    suite = load_suite(
        _suite(tmp_path, '[suite]\nmethods = ["local"]\npaper_metric = "unweighted"\n')
    )
    row = {k: aggregate([0.5]) for k in ("final", "final_other", "best_on_test")}
    labels = {
        k: label
        for k, label, _ in _columns(
            [
                row
                | {
                    "after_finetune": aggregate([None]),
                    "holdout_before": aggregate([None]),
                    "holdout_after": aggregate([None]),
                    "best_on_val": aggregate([None]),
                    "paper_cost_g": aggregate([None]),
                    "train_tmacs": aggregate([None]),
                }
            ],
            suite,
        )
    }
    # A suite without a paper has no "paper's metric" (all_methods said it had one).
    assert labels["final"] == "final acc (unweighted mean over clients)"
    assert "test-size-weighted" in labels["final_other"]
    with_paper = load_suite(
        _suite(
            tmp_path,
            '[suite]\nmethods = ["local"]\npaper_metric = "unweighted"\npaper = "X (2024)"\n',
        )
    )
    cols = {
        k: label
        for k, label, _ in _columns(
            [row | {k: aggregate([None]) for k in OPTIONAL_METRICS if k != "rounds_run"}],
            with_paper,
        )
    }
    assert "unweighted mean over clients, the paper's metric" in cols["final"]


def test_report_has_vector_figures_budget_marker_and_what_ran(tmp_path: Path):
    text = TINY_SUITE.replace('title = "Tiny grid"', 'title = "Tiny grid"\npaper_rounds = 1000')
    text = text.replace('methods = ["local", "proto"]', 'methods = ["local"]')
    text = text.replace('proto = "12.34 ± 0.56"', 'local = "12.34 ± 0.56"')
    suite = _suite(tmp_path, text)
    out = tmp_path / "out"
    args = ["compare", str(suite), "--out", str(out), "--quiet", "--seeds", "0"]
    assert main([*args, "--set", "data.num_clients=4", "--set", "eval.holdout_clients=1"]) == 0
    for stem in ("curves", "curves_mb", "curves_seconds", "clients", "labels"):
        for ext in ("png", "svg", "pdf"):
            assert (out / f"{stem}.{ext}").stat().st_size > 0, f"{stem}.{ext}"
    md = (out / "table.md").read_text()
    # what ran (after --set), not the suite's text
    assert "Ran: synthetic, 4 clients, dirichlet, family cnn1, 2 rounds" in md
    assert "paper (1000 rounds) †" in md and "Budget differs from the paper" in md
    assert "newcomers on arrival" in md and "newcomers after one local round" in md
    assert "50.00 ± n/a" in md or "± n/a" in md  # one seed: no interval
    page = (out / "index.html").read_text()
    assert "curves_mb.png" in page and "labels.png" in page and "Budget differs" in page
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY_SUITE.replace('title = "Tiny grid"', 'title = "T"\npaper_rounds = -3'))
    with pytest.raises(ConfigError, match="paper_rounds"):
        load_suite(bad)


def test_suites_ship_with_the_package_and_load_by_name():
    from fedmosaic.config import tomllib  # tomli on Python 3.10
    from fedmosaic.report.suite import BUNDLED, bundled_suites

    assert BUNDLED.parent.name == "fedmosaic"  # inside the package: installed with it
    assert {"fedtgp_table10", "fedgh_table3", "layer_expansion"} <= set(bundled_suites())
    assert load_suite("fedtgp_table10").name == "fedtgp_table10"
    pyproject = tomllib.loads((SUITES.parents[1] / "pyproject.toml").read_text())
    assert "suites/*.toml" in pyproject["tool"]["setuptools"]["package-data"]["fedmosaic"]
    with pytest.raises(ConfigError, match="does not exist"):
        load_suite("no_such_suite")


def test_converged_budget_caps_rounds_and_the_report_shows_where_each_cell_stopped(
    tmp_path: Path,
):
    text = TINY_SUITE.replace('title = "Tiny grid"', 'title = "Tiny grid"\npaper_rounds = 1000')
    text = text.replace('methods = ["local", "proto"]', 'methods = ["local"]')
    text = text.replace('proto = "12.34 ± 0.56"', 'local = "12.34 ± 0.56"')
    text += (
        '\n[converged]\n"train.rounds" = 30\n"train.plateau_delta" = 0.9\n'
        '"train.plateau_min_rounds" = 2\n'
    )
    suite_path = _suite(tmp_path, text)
    suite = load_suite(suite_path)
    cells = build_cells(suite, converged=True, seeds=[0])
    assert (cells[0].cfg.train.rounds, cells[0].cfg.train.plateau_delta) == (30, 0.9)
    assert build_cells(suite, seeds=[0])[0].cfg.train.plateau_delta == 0.0  # base: off
    with pytest.raises(ConfigError, match="pick one"):
        build_cells(suite, quick=True, converged=True)
    with pytest.raises(ConfigError, match="no \\[converged\\] budget"):
        plain = tmp_path / "plain"
        plain.mkdir()
        build_cells(load_suite(_suite(plain, TINY_SUITE)), converged=True)
    out = tmp_path / "out"
    assert main(["compare", str(suite_path), "--out", str(out), "--quiet", "--seeds", "0",
                 "--converged"]) == 0  # fmt: skip
    doc = json.loads((out / "cells/dir/local/seed0/results.json").read_text())
    assert doc["summary"]["stopped_on_plateau"] == 2 == len(doc["rounds"])
    md = (out / "table.md").read_text()
    assert "rounds run (plateau stop)" in md and "up to 30 (stopped once validation" in md
    assert "at most 30 (plateau stop) rounds here against 1000" in md


def test_full_budget_gives_every_method_one_round_count(tmp_path: Path) -> None:
    """``[full]`` (issue 22's claims budget): applied by ``--full``, exclusive with the other
    budgets, refused when the suite has none."""
    text = TINY_SUITE + '\n[full]\n"train.rounds" = 7\n"data.subsample" = 1.0\n'
    suite = load_suite(_suite(tmp_path, text))
    cells = build_cells(suite, full=True, seeds=[0], check=False)
    assert {(c.cfg.train.rounds, c.cfg.data.subsample) for c in cells} == {(7, 1.0)}
    assert len({c.method.label for c in cells}) > 1  # every method, the same rounds
    with pytest.raises(ConfigError, match="pick one"):
        build_cells(suite, converged=True, full=True, check=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ConfigError, match="no \\[full\\] budget"):
        build_cells(load_suite(_suite(plain, TINY_SUITE)), full=True, check=False)


@pytest.mark.parametrize("name", ["fedtgp_table10", "fedgh_table3", "fedhenn_5cnn",
                                  "fedclassavg_table2", "fedclassavg_ablation", "layer_expansion"])  # fmt: skip
def test_bundled_claims_suites_have_a_full_budget_without_plateau_stops(name: str) -> None:
    """Every method of a setting runs the same rounds under --full (layer expansion's plateau
    keys only record whether round 100 had plateaued: min_rounds = rounds)."""
    cells = build_cells(load_suite(name), full=True, seeds=[0], check=False)
    for c in cells:
        t = c.cfg.train
        assert t.plateau_delta == 0 or t.plateau_min_rounds >= t.rounds, c.key
    assert len({(c.setting.label, c.cfg.train.rounds) for c in cells}) == len(
        {c.setting.label for c in cells}
    )


# ---- figures: one resolution and format for every figure, a colour key on the label histogram ----


def _dpi(path: Path) -> float:
    from PIL import Image

    with Image.open(path) as im:
        return float(im.info["dpi"][0])


def test_run_and_prototype_figures_match_the_compare_reports_dpi_and_formats(tmp_path: Path):
    """``curve.png`` (every run) and ``prototypes.png`` at the compare report's 150 dpi (was
    110), each with SVG and PDF beside it, as the report's own figures."""
    import torch

    from fedmosaic.report.prototypes import plot_prototypes
    from fedmosaic.report.results import FIGURE_DPI, plot_curves

    assert FIGURE_DPI == 150
    doc = {
        "config": {
            "algorithm": {"name": "fedavg"},
            "data": {"dataset": "synthetic", "num_clients": 3, "partition": "iid"},
            "model": {"family": "cnn1"},
        },
        "rounds": [{"round": t, "acc_weighted": 0.2 * t} for t in (1, 2, 3)],
    }
    plot_curves({"fedavg": doc}, tmp_path / "curve.png")
    g = torch.eye(3)
    clients = [(0, c, g[c] + 0.1) for c in range(3)] + [(1, c, g[c] - 0.1) for c in range(3)]
    plot_prototypes(clients, g, torch.ones(3, dtype=torch.bool), tmp_path / "p.png", method="pca")
    for stem in ("curve", "p"):
        assert _dpi(tmp_path / f"{stem}.png") == pytest.approx(150, abs=0.1)
        for ext in ("svg", "pdf"):
            assert (tmp_path / f"{stem}.{ext}").stat().st_size > 0, f"{stem}.{ext}"


@pytest.mark.parametrize(("num_classes", "key"), [(4, "legend"), (15, "legend"), (30, "colorbar")])
def test_label_histogram_has_a_class_colour_key(num_classes: int, key: str):
    """Up to 20 classes a legend naming every class (distinct colours); beyond, a colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from fedmosaic.report.suite_report import _stacked_label_bars

    fig, ax = plt.subplots()
    counts = np.arange(3 * num_classes, dtype=float).reshape(3, num_classes)
    _stacked_label_bars(plt, fig, ax, counts)
    legend = ax.get_legend()
    if key == "legend":
        assert legend is not None and legend.get_title().get_text() == "class"
        assert [t.get_text() for t in legend.get_texts()] == [str(k) for k in range(num_classes)]
        colours = {tuple(h.get_facecolor()) for h in legend.legend_handles}
        assert len(colours) == num_classes  # no two classes share a colour
        assert len(fig.axes) == 1
    else:
        assert legend is None and len(fig.axes) == 2  # the colour bar's axes
        assert fig.axes[1].get_ylabel() == "class"
    plt.close(fig)


def test_compare_goes_through_the_run_folder_lifecycle(tmp_path: Path, monkeypatch, capsys):
    """A suite folder in use by another run is refused at once (one line, nothing written); a
    cell whose results.json is a directory fails before that cell trains, naming the path."""
    from fedmosaic import experiment
    from fedmosaic.runfolder import FolderLock

    suite = _suite(tmp_path)
    out = tmp_path / "out"
    args = ["compare", str(suite), "--out", str(out), "--quiet", "--quick", "--seeds", "0"]
    with FolderLock(out):
        before = sorted(p.name for p in out.iterdir())
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(out) in err[0] and "in use" in err[0], err
        assert sorted(p.name for p in out.iterdir()) == before
    cell = out / "cells" / "dir" / "local" / "seed0"
    (cell / "results.json").mkdir(parents=True)
    monkeypatch.setattr(experiment, "build_federation", lambda *a, **k: pytest.fail("trained"))
    capsys.readouterr()
    assert main([*args, "--methods", "local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(cell / "results.json") in err[0], err
    assert sorted(p.name for p in cell.iterdir()) == ["results.json"]


def _mode_doc(acc: float, head: float | None, tuned: float | None = None) -> dict[str, Any]:
    final = {"acc_weighted": acc, "acc_mean": acc, "acc_std": 0.1}
    if head is not None:
        final |= {"acc_head_weighted": head, "acc_head_mean": head - 0.01}
    summary: dict[str, Any] = {"final": final}
    if tuned is not None:
        summary["after_finetune"] = {"acc_weighted": tuned, "acc_mean": tuned}
    rounds = [{"round": 1, "acc_weighted": acc / 2}, {"round": 2, "acc_weighted": acc}]
    return {"summary": summary, "rounds": rounds}


def test_every_accuracy_a_method_reports_has_a_column(tmp_path: Path):
    """FedProto's table showed only its nearest-prototype accuracy (75.3%), not its heads'."""
    from fedmosaic.report.suite_report import _columns

    suite = load_suite(_suite(tmp_path, '[suite]\nmethods = ["local", "fedproto"]\n'))
    cells = [
        SimpleNamespace(
            setting=SimpleNamespace(label="s"), method=SimpleNamespace(label=m), seed=0, key=m
        )
        for m in ("local", "fedproto")
    ]
    docs = {"local": _mode_doc(0.6, None), "fedproto": _mode_doc(0.753, 0.892)}
    rows = summarize_grid(suite, cells, docs)  # type: ignore[arg-type]
    cols = _columns(rows, suite)
    assert ("final_acc_head", "final acc, head", "pct") in cols
    md = markdown_table(suite, rows)
    proto = next(line for line in md.splitlines() if line.startswith("| fedproto"))
    local = next(line for line in md.splitlines() if line.startswith("| local"))
    assert "75.30 ± n/a" in proto and "89.20 ± n/a" in proto
    assert local.split(" | ")[3] == "-"  # local has no head: "-" in that column
    write_csv(tmp_path / "t.csv", rows)
    assert "final_acc_head_mean" in (tmp_path / "t.csv").read_text().splitlines()[0]


def test_grid_curves_show_the_after_fine_tune_point(monkeypatch):
    """FedBABU's headline (after fine-tuning) was missing from curves.png (7-26% curves only)."""
    from fedmosaic.report import suite_report as rc

    figs: list[Any] = []
    monkeypatch.setattr(rc, "save_figure", lambda fig, path: figs.append(fig))
    cells = [
        SimpleNamespace(
            setting=SimpleNamespace(label="s"),
            method=SimpleNamespace(label="fedbabu"),
            seed=s,
            key=f"b{s}",
        )
        for s in (0, 1)
    ]
    docs = {"b0": _mode_doc(0.2, None, tuned=0.88), "b1": _mode_doc(0.26, None, tuned=0.92)}
    rc.plot_grid_curves(cells, docs, Path("unused.png"), None)  # type: ignore[arg-type]
    ax = figs[0].axes[0]
    stars = [ln for ln in ax.lines if ln.get_marker() == "*"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(stars) == 1 and "fedbabu after fine-tune" in legend
    assert list(stars[0].get_xdata()) == [2.0] and list(stars[0].get_ydata()) == pytest.approx(
        [90.0]
    )
    assert "(%)" in ax.get_ylabel()


def test_a_private_grid_reports_the_epsilon_spent_and_a_plain_one_has_no_such_column(
    tmp_path: Path,
):
    text = TINY_SUITE.replace(
        '"data.alpha" = 1.0',
        '"data.alpha" = 1.0\n"privacy.mechanism" = "central"\n"privacy.epsilon" = 8.0',
    )
    out = tmp_path / "out"
    assert main(["compare", str(_suite(tmp_path, text)), "--out", str(out), "--quiet"]) == 0
    md = (out / "table.md").read_text()
    assert "epsilon spent" in md
    rows = list(csv.DictReader(open(out / "table.csv")))
    eps = {r["method"]: r["epsilon_mean"] for r in rows}
    assert eps["local"] == "0.0" and 7.99 < float(eps["proto"]) <= 8.0, eps
    assert run_metrics({"summary": {}}, None)["epsilon"] is None
    plain = (tmp_path / "plain").mkdir() or tmp_path / "plain"
    assert main(["compare", str(_suite(plain)), "--out", str(plain / "out"), "--quiet"]) == 0
    assert "epsilon" not in (plain / "out" / "table.md").read_text()
