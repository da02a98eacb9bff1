"""Every run and every suite cell is checked against its federation before the first one starts.

``Algorithm.check(spec)`` (public split, identical heads, ...) needs the data, so it used to run
only when each run was assembled: a bad ``--baseline`` failed after the main run had trained and
written ``--out``, a bad suite cell after the cells before it had run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic import runfolder
from fedmosaic.cli import main
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.federation import check_runs
from fedmosaic.suite_runner import build_cells, load_suite

# No public split: KT-pFL (distills on it) cannot run here, Local can.
NO_PUBLIC = {"synthetic_shape": [1, 16, 16], "public_size": 0}


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The runs that started (none may start when a later one is refused)."""
    started: list[str] = []
    real = runfolder.run_experiment  # every run (fedmosaic run, compare cells) starts there

    def spy(cfg, *args, **kwargs):
        started.append(cfg.algorithm["name"])
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(runfolder, "run_experiment", spy)
    return started


def test_check_runs_names_the_run_and_passes_good_ones():
    good = from_dict(tiny_raw(data=NO_PUBLIC, algorithm={"name": "local"}))
    bad = from_dict(tiny_raw(data=NO_PUBLIC, algorithm={"name": "ktpfl"}))
    check_runs([("a", good), ("b", good)])
    with pytest.raises(ConfigError, match=r"^second: .*ktpfl.*public_size"):
        check_runs([("first", good), ("second", bad)])
    heads = from_dict(
        tiny_raw(data=NO_PUBLIC, model={"family": "htc4"}, algorithm={"name": "lg_fedavg"})
    )
    with pytest.raises(ConfigError, match=r"^x: .*lg_fedavg.*different heads"):
        check_runs([("x", heads)])


def test_failing_baseline_leaves_out_untouched(tmp_path: Path, capsys, ran):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(data=NO_PUBLIC, algorithm={"name": "local"}))
    out = tmp_path / "out"
    rc = main(["run", str(cfg), "--out", str(out), "--quiet", "--baseline", "ktpfl"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: --baseline ktpfl:"), err
    assert "public_size" in err[0]
    assert ran == [] and not out.exists()


def test_failing_main_run_is_refused_before_its_baselines(tmp_path: Path, capsys, ran):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(data=NO_PUBLIC, algorithm={"name": "fedhenn"}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = main(["run", str(cfg), "--out", str(out), "--quiet", "--baseline", "local"])
    assert rc == 2 and "run fedhenn:" in capsys.readouterr().err
    assert ran == [] and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


SUITE = """
[suite]
name = "mixed"
seeds = [0]
methods = ["local", "kt"]
settings = ["dir"]

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
[base.model]
family = "cnn1"
feature_dim = 8
[base.train]
rounds = 1
batch_size = 10

[settings.dir]
"data.alpha" = 1.0

[methods.kt]
algorithm = { name = "ktpfl" }
"""


def test_suite_with_one_bad_cell_fails_before_any_cell_runs(tmp_path: Path, capsys, ran):
    path = tmp_path / "mixed.toml"
    path.write_text(SUITE)
    with pytest.raises(ConfigError, match=r"^cell dir/kt/seed0: .*public_size"):
        build_cells(load_suite(path))
    assert [c.key for c in build_cells(load_suite(path), check=False)] == [
        "dir/local/seed0",
        "dir/kt/seed0",
    ]
    out = tmp_path / "out"
    assert main(["compare", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cell dir/kt/seed0" in err[0], err
    assert ran == [] and not out.exists()
    # Listing the cells needs no check (and no data).
    assert main(["compare", str(path), "--out", str(out), "--list"]) == 0
    # With the bad cell fixed (a public split), the suite checks and runs.
    assert (
        main(["compare", str(path), "--out", str(out), "--quiet", "--set", "data.public_size=20"])
        == 0
    )
    assert sorted(ran) == ["ktpfl", "local"]
