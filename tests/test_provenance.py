"""Provenance in results.json, the source hash, and the compare cache keyed by code."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw

from fedmosaic import provenance, suite_runner
from fedmosaic.cli import main
from fedmosaic.config import from_dict
from fedmosaic.experiment import run_experiment

sys.path.insert(0, str(Path(__file__).parent / "data"))
from dataset_files import isolate_search, write_mnist  # noqa: E402


def test_results_carry_code_host_versions_command_and_data(tmp_path: Path, monkeypatch):
    isolate_search(monkeypatch, tmp_path)
    write_mnist(tmp_path / "fmnist", n_train=60, n_test=20)
    raw = tiny_raw(data={"dataset": "fmnist", "root": str(tmp_path / "fmnist"), "min_size": 5})
    for key in ("synthetic_size", "synthetic_classes", "synthetic_shape"):
        del raw["data"][key]
    raw["algorithm"] = {"name": "local"}
    raw["train"]["rounds"] = 1
    monkeypatch.setattr(sys, "argv", ["fedmosaic", "run", "x.toml"])
    doc = run_experiment(from_dict(raw), progress=False)
    p = doc["provenance"]
    assert len(p["code"]["source_hash"]) == 64 and p["code"]["version"]
    assert p["code"]["source_hash"] == provenance.source_hash()
    assert p["command"] == ["fedmosaic", "run", "x.toml"]
    started = dt.datetime.fromisoformat(p["started"])
    assert started <= dt.datetime.fromisoformat(p["finished"])
    assert p["workers"] == 1
    assert p["host"]["cpu_count"] >= 1 and isinstance(p["host"]["gpus"], list)
    assert {"python", "torch", "numpy", "scikit-learn"} <= set(p["versions"])
    files = p["data"]["files"]
    assert [Path(f["path"]).name for f in files] == list(
        __import__("fedmosaic.data.datasets", fromlist=["MNIST_FILES"]).MNIST_FILES
    )
    for f in files:
        raw_bytes = Path(f["path"]).read_bytes()
        assert f["bytes"] == len(raw_bytes)
        assert f["sha256"] == hashlib.sha256(raw_bytes).hexdigest()
    assert len(p["data"]["sha256"]) == 64
    for c in doc["clients"]:
        assert sum(c["train_label_counts"]) == c["num_train"]
        assert sum(c["test_label_counts"]) == c["num_test"]
        assert len(c["train_label_counts"]) == 10
    json.dumps(doc)  # all of it is JSON


def test_data_digest_tells_different_data_apart():
    a = run_experiment(from_dict(tiny_raw(algorithm={"name": "local"})), progress=False)
    b = run_experiment(
        from_dict(tiny_raw(algorithm={"name": "local"}, data={"synthetic_size": 200})),
        progress=False,
    )
    assert a["provenance"]["data"]["files"] == []  # in-memory data: no files
    assert a["provenance"]["data"]["sha256"] != b["provenance"]["data"]["sha256"]


def test_source_hash_follows_number_deciding_code_only(tmp_path: Path):
    root = tmp_path / "pkg"
    shutil.copytree(provenance.PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    before = provenance.source_hash(root)
    assert before == provenance.source_hash()  # same files, same hash
    report = root / "report" / "suite_report.py"
    report.write_text(report.read_text() + "\n# presentation only\n")
    assert provenance.source_hash(root) == before
    algo = root / "algorithms" / "fedavg.py"
    algo.write_text(algo.read_text() + "\n# a change\n")
    assert provenance.source_hash(root) != before


SUITE = """
[suite]
name = "tiny"
title = "Tiny"
seeds = [0]
methods = ["local"]
settings = ["dir"]

[base.data]
dataset = "synthetic"
synthetic_size = 120
synthetic_classes = 3
synthetic_shape = [1, 16, 16]
num_clients = 3
min_size = 10
[base.model]
family = "cnn1"
feature_dim = 8
[base.train]
rounds = 1

[settings.dir]
"data.alpha" = 1.0
"""


def test_compare_reruns_cells_of_other_code_unless_told(tmp_path: Path, monkeypatch, capsys):
    suite = tmp_path / "s.toml"
    suite.write_text(SUITE)
    out = tmp_path / "out"
    args = ["compare", str(suite), "--out", str(out), "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0
    assert ": cached" in capsys.readouterr().out
    assert "other code" not in (out / "table.md").read_text()
    # The code changes: the cell is stale and runs again.
    current = provenance.code()
    monkeypatch.setattr(provenance, "code", lambda: {**current, "source_hash": "f" * 64})
    ran = []
    real = suite_runner.run_cell
    monkeypatch.setattr(
        suite_runner, "run_cell", lambda o, cell, *a, **k: ran.append(1) or real(o, cell, *a, **k)
    )
    capsys.readouterr()
    assert main([*args, "--reuse-other-code"]) == 0  # kept, and the report says so
    assert ran == [] and "from other code" in capsys.readouterr().out
    assert "Cells come from other code" in (out / "table.md").read_text()
    assert "Cells come from other code" in (out / "index.html").read_text()
    assert main(args) == 0
    assert ran == [1] and "running it again" in capsys.readouterr().out
    assert main(args) == 0  # produced by this code now: cached
    assert ran == [1]
    assert main([*args, "--force"]) == 0
    assert ran == [1, 1]


@pytest.mark.parametrize("dirty", [True, False])
def test_code_reports_git_state(dirty: bool, monkeypatch):
    provenance.code.cache_clear()
    answers = {"rev-parse": "abc123", "status": " M fedmosaic/x.py" if dirty else ""}
    monkeypatch.setattr(provenance, "_git", lambda *a: answers[a[0]])
    try:
        info = provenance.code()
        assert info["git_commit"] == "abc123" and info["git_dirty"] is dirty
    finally:
        provenance.code.cache_clear()


def test_each_clients_feature_shift_is_recorded():
    raw = tiny_raw(
        data={"shift_rotation": 90, "shift_domains": 2},
        algorithm={"name": "local"},
        train={"rounds": 1},
    )
    doc = run_experiment(from_dict(raw), progress=False)
    shifts = [c["feature_shift"] for c in doc["clients"]]
    assert len(shifts) == 4 and shifts[0] == shifts[2] and shifts[1] == shifts[3]
    plain = run_experiment(from_dict(tiny_raw(algorithm={"name": "local"})), progress=False)
    assert "feature_shift" not in plain["clients"][0]
