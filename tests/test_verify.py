"""``fedmosaic verify``: a finished run re-run on this host and compared number by number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic import cli, numerics, provenance
from fedmosaic.checkpoint import config_hash
from fedmosaic.verify import VerifyError, compare, load, verify


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-round FedProto run's folder (serial, synthetic data)."""
    root = tmp_path_factory.mktemp("verify")
    raw = tiny_raw(train={"rounds": 3}, algorithm={"name": "fedproto"}, sim={"backend": "serial"})
    cfg = write_toml(root / "run.toml", raw)
    out = root / "run"
    assert cli.main(["run", str(cfg), "--quiet", "--out", str(out)]) == 0
    return out


def _copy(src: Path, dst: Path, edit=None) -> Path:
    doc = json.loads((src / "results.json").read_text())
    if edit is not None:
        edit(doc)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "results.json").write_text(json.dumps(doc))
    return dst


def test_a_run_re_run_here_is_identical(finished: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["verify", str(finished)]) == 0
    captured = capsys.readouterr()
    assert "identical: every one of" in captured.out and "rounds 1-3" in captured.out
    assert "round 3/3: " in captured.err and "numbers equal" in captured.err
    # the hosts are named (this host twice: its vendor and MKL's branch as read back)
    assert "made on" in captured.out and "re-run on" in captured.out


def test_a_changed_number_is_found_with_its_round_and_key(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    def edit(doc: dict) -> None:
        doc["rounds"][1]["acc_weighted"] += 1e-12  # one ulp-scale change, round 2

    edited = _copy(finished, tmp_path / "edited", edit)
    assert cli.main(["verify", str(edited), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "different: 1 of" in out and "first in round 2, acc_weighted" in out
    # the first round alone still matches, and the re-run stops there
    comparison, text = verify(edited, rounds=1)
    assert comparison.identical and comparison.rounds == 1, text


def test_first_difference_stops_the_re_run(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    def edit(doc: dict) -> None:
        doc["rounds"][0]["train_loss"] = 0.5

    edited = _copy(finished, tmp_path / "edited", edit)
    assert cli.main(["verify", str(edited), "--first-difference"]) == 1
    captured = capsys.readouterr()
    assert "round 1/3: 1 of" in captured.err and "round 2/3" not in captured.err
    assert "rounds 1-1" in captured.out and "round 1, train_loss" in captured.out


def test_a_complete_re_run_compares_the_summary_too(finished: Path, tmp_path: Path) -> None:
    def edit(doc: dict) -> None:
        doc["summary"]["final"]["acc_mean"] += 0.25

    edited = _copy(finished, tmp_path / "edited", edit)
    comparison, text = verify(edited)
    assert not comparison.identical
    assert comparison.first is not None and comparison.first[1] == "summary.final.acc_mean"
    assert "summary final.acc_mean" in text


def test_keep_writes_the_complete_re_run_with_its_cell_record(finished: Path, tmp_path: Path):
    def edit(doc: dict) -> None:
        doc["cell"] = {"suite_setting": "s", "method": "fedproto", "seed": 0}
        doc["cell"]["config_hash"] = config_hash(doc["config"])

    cell = _copy(finished, tmp_path / "cell", edit)
    keep = tmp_path / "reruns" / "s" / "fedproto" / "seed0" / "here" / "results.json"
    assert cli.main(["verify", str(cell), "--quiet", "--keep", str(keep)]) == 0
    kept, stored = json.loads(keep.read_text()), json.loads((cell / "results.json").read_text())
    assert kept["cell"] == stored["cell"] and kept["config"] == stored["config"]
    assert compare(stored["rounds"], kept["rounds"]).identical
    assert not [p for p in keep.parent.iterdir() if p.name != "results.json"]  # no temporary
    # never over an existing file, and only a complete re-run: refused before anything runs
    before = keep.read_bytes()
    assert cli.main(["verify", str(cell), "--keep", str(keep)]) == 2
    assert keep.read_bytes() == before
    other = tmp_path / "other.json"
    assert cli.main(["verify", str(cell), "--rounds", "1", "--keep", str(other)]) == 2
    assert cli.main(["verify", str(cell), "--first-difference", "--keep", str(other)]) == 2
    assert not other.exists()


@pytest.mark.parametrize(
    "case",
    ["missing", "corrupt", "no_rounds", "edited_config", "plugin", "rounds_0", "rounds_past"],
)
def test_what_cannot_be_verified_is_one_line_exit_2(
    finished: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    doc = json.loads((finished / "results.json").read_text())
    target = tmp_path / "cell"
    target.mkdir()
    args: list[str] = []
    if case == "missing":
        target = tmp_path / "nothing"
    elif case == "corrupt":
        (target / "results.json").write_text('{"config": {')
    elif case == "no_rounds":
        doc["rounds"] = []
        (target / "results.json").write_text(json.dumps(doc))
    elif case == "edited_config":  # a suite cell stores its config's hash: an edit is caught
        doc["cell"] = {"config_hash": config_hash(doc["config"])}
        doc["config"]["train"]["lr"] = 0.5
        (target / "results.json").write_text(json.dumps(doc))
    elif case == "plugin":
        doc["config"]["plugins"] = ["/tmp/evil.py"]
        (target / "results.json").write_text(json.dumps(doc))
    else:
        (target / "results.json").write_text(json.dumps(doc))
        args = ["--rounds", "0" if case == "rounds_0" else "4"]
    assert cli.main(["verify", str(target), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    if case != "missing":
        with pytest.raises((VerifyError, ValueError)):
            if case.startswith("rounds"):
                verify(target, rounds=0 if case == "rounds_0" else 4)
            else:
                load(target)


@pytest.mark.unit
def test_compare_by_hand() -> None:
    stored = [{"round": 1, "a": 1.0, "b": 2.0, "seconds": 3.0}, {"round": 2, "a": 1.5, "b": 2.0}]
    here = [{"round": 1, "a": 1.0, "b": 2.0, "seconds": 9.0}, {"round": 2, "a": 1.25, "b": 2.0}]
    c = compare(stored, here)
    assert c.rounds == 2 and c.values == 6 and c.differing == 1  # round, a, b twice; no seconds
    assert c.first == (2, "a", 1.5, 1.25)
    assert c.by_key["a"].max_abs == 0.25 and c.by_key["a"].last == (1.5, 1.25)
    nan = float("nan")
    assert compare([{"round": 1, "x": nan}], [{"round": 1, "x": nan}]).identical


@pytest.mark.skipif(numerics.mkl_branch() is None, reason="torch without MKL")
@pytest.mark.parametrize(
    ("env", "branch", "strict"),
    [(None, "off", False), ("COMPATIBLE", "COMPATIBLE", False), ("AUTO,STRICT", "AUTO", True)],
)
def test_mkl_branch_is_read_back_from_mkl(env: str | None, branch: str, strict: bool) -> None:
    """COMPATIBLE and AUTO are the branches MKL keeps on every vendor's processor."""
    environ = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if env is not None:
        environ["MKL_CBWR"] = env
    code = "from fedmosaic import numerics; import json; print(json.dumps(numerics.mkl_branch()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120
    )
    got = json.loads(proc.stdout)
    assert got["branch"] == branch and got["strict"] is strict
    assert got["auto"] != "off"
    # on Intel AUTO resolves to a named branch; elsewhere MKL reads back AUTO itself
    if provenance.host()["cpu_id"]["vendor_id"] == "GenuineIntel":
        assert got["auto"] != "AUTO"


@pytest.mark.slow
@pytest.mark.skipif(numerics.can_be_portable() is not None, reason="needs x86-64 with AVX2")
def test_a_portable_run_is_verified_in_portable_numerics(tmp_path: Path) -> None:
    """verify re-runs a portable run with the pins (the command re-executes itself), so the
    re-run is bitwise; the report names the numerics and MKL's branch as read back."""
    raw = tiny_raw(
        algorithm={"name": "fedproto"}, sim={"backend": "serial", "numerics": "portable"}
    )
    cfg = write_toml(tmp_path / "run.toml", raw)
    env = {k: v for k, v in os.environ.items() if k not in numerics.LEVEL_VARS}
    run = [sys.executable, "-m", "fedmosaic"]
    made = subprocess.run(
        [*run, "run", str(cfg), "--quiet", "--out", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    if numerics.mkl_branch() is not None:  # torch built with MKL: the pin read back
        assert doc["provenance"]["numerics"]["mkl_branch"]["strict"] is True
    checked = subprocess.run(
        [*run, "verify", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr[-2000:]
    assert "portable numerics" in checked.stdout and "identical" in checked.stdout
    assert "sim.numerics = portable: running this command again" in checked.stderr
