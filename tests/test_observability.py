"""Logging, per-round lines without a terminal, Ctrl-C, divergence, compare's ETA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.experiments import SMALL, tiny_raw, write_toml

from fedmosaic.cli import main
from fedmosaic.core import rounds


def _toml(path: Path, **sections) -> Path:
    raw = tiny_raw(data=SMALL, **sections)
    return write_toml(path, raw)


def test_one_log_line_per_round_without_a_terminal(tmp_path: Path):
    cfg = _toml(tmp_path / "c.toml", train={"rounds": 3}, algorithm={"name": "local"})
    log = tmp_path / "logs" / "run.log"
    assert main(["run", str(cfg), "--out", str(tmp_path / "o"), "--log-file", str(log)]) == 0
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if " round " in ln]
    assert [ln.split(" round ")[1].split(":")[0] for ln in lines] == ["1/3", "2/3", "3/3"]
    assert all("acc " in ln and "loss " in ln and "kB/client" in ln for ln in lines)
    assert "\r" not in text  # no progress-bar returns in the log
    # --quiet, or --log-level warning: warnings only.
    for i, flag in enumerate((["--quiet"], ["--log-level", "warning"])):
        log.unlink()
        args = ["run", str(cfg), "--out", str(tmp_path / f"q{i}"), *flag, "--log-file", str(log)]
        assert main(args) == 0
        assert " round " not in log.read_text()
    # --log-level debug: at least the info lines.
    args = ["run", str(cfg), "--out", str(tmp_path / "d"), "--log-level", "debug"]
    assert main([*args, "--log-file", str(log)]) == 0
    assert "local round 3/3" in log.read_text()


def test_the_progress_bar_shows_accuracy_in_percent(monkeypatch):
    """The bar showed ``acc=0.8409`` where the tables and logs say 84.09%."""
    from fedmosaic import experiment
    from fedmosaic.config import from_dict

    postfixes: list[dict] = []
    real = experiment.tqdm

    class Bar(real):  # the real bar, its postfixes recorded
        def set_postfix(self, ordered_dict=None, refresh=True, **kwargs) -> None:
            postfixes.append(kwargs)
            super().set_postfix(ordered_dict, refresh, **kwargs)

    monkeypatch.setattr(experiment, "tqdm", Bar)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    cfg = from_dict(tiny_raw(data=SMALL, train={"rounds": 1}, sim={"threads": 1}))
    doc = experiment.run_experiment(cfg, progress=True)
    acc = doc["rounds"][0]["acc_weighted"]
    assert postfixes and postfixes[-1]["acc"] == f"{100 * acc:.2f}%"


def test_stop_request_checkpoints_and_resume_finishes_identically(tmp_path: Path, monkeypatch):
    cfg = _toml(tmp_path / "c.toml", train={"rounds": 3}, algorithm={"name": "fedtgp"})
    ref = tmp_path / "ref"
    assert main(["run", str(cfg), "--out", str(ref), "--quiet"]) == 0
    out = tmp_path / "out"
    from fedmosaic.report import sinks

    real_call = sinks.Sinks.__call__

    def press_ctrl_c_after_round_1(self, rec):
        real_call(self, rec)
        if rec["round"] == 1:
            rounds.stop_requested.set()  # what the first Ctrl-C does

    monkeypatch.setattr(sinks.Sinks, "__call__", press_ctrl_c_after_round_1)
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 130
    assert (out / "checkpoint.safetensors").exists() and not (out / "results.json").exists()
    assert not rounds.stop_requested.is_set()  # cleared for the next command
    monkeypatch.setattr(sinks.Sinks, "__call__", real_call)
    log = tmp_path / "resume.log"
    args = ["run", str(cfg), "--out", str(out), "--resume", "--log-file", str(log)]
    assert main([*args, "--log-level", "info"]) == 0
    text = log.read_text()  # the default level says where the run continued, then each round
    assert "resumed from" in text and "after round 1" in text
    assert [ln.split(" round ")[1][:3] for ln in text.splitlines() if "fedtgp round" in ln] == [
        "2/3",
        "3/3",
    ]
    a = json.loads((ref / "results.json").read_text())
    b = json.loads((out / "results.json").read_text())
    assert [r["acc_weighted"] for r in a["rounds"]] == [r["acc_weighted"] for r in b["rounds"]]
    assert a["per_client_final_acc"] == b["per_client_final_acc"]


def _workers_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"fedmosaic.sim.worker" in cmd:
                out.append(int(d.name))
    return out


def test_ctrl_c_on_a_process_backend_run_is_one_line_and_leaves_no_worker(tmp_path: Path):
    cfg = _toml(
        tmp_path / "c.toml",
        train={"rounds": 400},
        sim={"backend": "processes", "workers": 2, "progress": False},
        algorithm={"name": "local"},
    )
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedmosaic.cli", "run", str(cfg), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    progress = out / "rounds.csv"
    while time.monotonic() < deadline:
        if progress.exists() and len(progress.read_text().splitlines()) >= 3:
            break
        time.sleep(0.1)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "interrupted after round" in err and "--resume" in err
    assert (out / "checkpoint.safetensors").exists()
    time.sleep(0.5)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_divergence_warns_then_stops_with_one_line(tmp_path: Path, capsys, backend: str):
    """Non-finite uploads are dropped (the run goes on), then two such rounds stop it cleanly."""
    cfg = _toml(
        tmp_path / "c.toml",
        train={"rounds": 6, "lr": 1e6},  # the largest lr a config takes
        sim={"backend": backend, "workers": 2, "check_wire": backend == "serial"},
        algorithm={"name": "fedavg"},
    )
    assert main(["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "no client has a finite training loss" in err
    assert err.strip().splitlines()[-1].startswith("error: training diverged")


def test_a_run_told_not_to_stop_reports_its_diverged_rounds(tmp_path: Path):
    """train.stop_on_divergence = false: every round runs, the diverged ones are marked and
    counted, and the run ends as a result (a privacy grid's broken cell is a number)."""
    from fedmosaic import api
    from fedmosaic.config import from_dict

    raw = tiny_raw(
        train={"rounds": 4, "lr": 1e6, "stop_on_divergence": False},
        sim={"check_wire": False, "progress": False},
    )
    result = api.run(from_dict(raw))
    assert [r["round"] for r in result.rounds] == [1, 2, 3, 4]
    marked = [r["round"] for r in result.rounds if r.get("diverged")]
    assert len(marked) >= 2 and result.summary["diverged_rounds"] == len(marked)
    assert all(0.0 <= r["acc_weighted"] <= 1.0 for r in result.rounds)


def test_compare_prints_an_eta(tmp_path: Path, capsys):
    suite = tmp_path / "s.toml"
    suite.write_text(
        """
[suite]
name = "eta"
title = "ETA"
seeds = [0, 1]
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
    )
    assert main(["compare", str(suite), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "ETA" in out and "for 1 more cell(s)" in out
