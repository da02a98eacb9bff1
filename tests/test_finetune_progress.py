"""The fine-tuning after the last round (FedBABU, layer expansion) reports its progress as the
rounds do: log lines per tenth of the clients without a terminal, the bar's postfix on one; the
numbers are those of a run that reports nothing."""

from __future__ import annotations

import io
import logging
import re
from types import SimpleNamespace

import pytest
from helpers.experiments import tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.experiment import RoundBar, run_experiment
from fedmosaic.report import summary
from fedmosaic.report.summary import FinetuneLines

BABU = {"name": "fedbabu", "finetune_epochs": 1}


def _finetune_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fine-tune" in r.getMessage()]


@pytest.mark.parametrize("backend", ["serial", "processes"])
def test_finetune_logs_progress_lines(backend, caplog):
    sim = {"backend": backend, "progress": True}
    if backend == "processes":
        sim.update(workers=2, threads=1)
    cfg = from_dict(tiny_raw(algorithm=BABU, train={"rounds": 1}, sim=sim))
    with caplog.at_level(logging.INFO, logger="fedmosaic"):
        doc = run_experiment(cfg, progress=True)
    lines = _finetune_lines(caplog)
    n = cfg.data.num_clients
    assert lines[0] == f"fedbabu fine-tune: {n} clients, each fine-tunes its model locally"
    # a fine-tuning of a few seconds: the start and the end (the workers' clients all counted)
    assert len(lines) == 2 and re.fullmatch(
        rf"fedbabu fine-tune: clients {n}/{n}, [\d.]+ s", lines[1]
    )
    assert "after_finetune" in doc["summary"]


def test_progress_does_not_change_the_numbers(caplog):
    raw = tiny_raw(algorithm=BABU, train={"rounds": 1})
    with caplog.at_level(logging.INFO, logger="fedmosaic"):
        shown = run_experiment(from_dict(raw), progress=True)
    assert _finetune_lines(caplog)
    caplog.clear()
    quiet = run_experiment(from_dict(raw), progress=False)
    assert not _finetune_lines(caplog)  # progress off: nothing
    assert shown["summary"]["after_finetune"] == quiet["summary"]["after_finetune"]
    assert shown["clients"] == quiet["clients"]


def test_a_method_without_finetuning_prints_no_finetune_line(caplog):
    cfg = from_dict(tiny_raw(train={"rounds": 1}))  # fedavg
    with caplog.at_level(logging.INFO, logger="fedmosaic"):
        run_experiment(cfg, progress=True)
    assert not _finetune_lines(caplog)


def test_lines_every_tenth_of_the_clients():
    out: list[str] = []
    lines = FinetuneLines("lg", out.append, min_seconds=0)
    for done in range(101):
        lines(done, 100)
    assert len(out) == 1 + 10  # the start, then clients 10, 20, ..., 100
    assert out[1].startswith("lg fine-tune: clients 10/100, ") and "ETA" in out[1]
    assert out[-1].startswith("lg fine-tune: clients 100/100, ")
    few: list[str] = []
    lines = FinetuneLines("lg", few.append, min_seconds=0)
    for done in range(4):
        lines(done, 3)
    assert [s.split(",")[0] for s in few[1:]] == [f"lg fine-tune: clients {i}/3" for i in (1, 2, 3)]


def test_a_quick_finetuning_prints_its_start_and_end_only(monkeypatch):
    clock = iter([0.0, 0.0] + [0.01 * i for i in range(1, 101)])  # 100 clients in a second
    monkeypatch.setattr(summary, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    out: list[str] = []
    lines = FinetuneLines("lg", out.append)
    for done in range(101):
        lines(done, 100)
    assert [s.split(",")[0] for s in out] == [
        "lg fine-tune: 100 clients",
        "lg fine-tune: clients 100/100",
    ]
    clock = iter([0.0, 0.0] + [3.0 * i for i in range(1, 101)])  # 3 s a client: every tenth
    out.clear()
    lines = FinetuneLines("lg", out.append)
    for done in range(101):
        lines(done, 100)
    assert len(out) == 11 and out[5].startswith("lg fine-tune: clients 50/100, 150.0 s, ETA 150 s")


def test_the_terminal_bar_shows_the_finetuning():
    stream = io.StringIO()
    bar = RoundBar("fedbabu", 2, stream, done=2)
    bar.finetune(0, 100)
    assert "fine-tune: clients 0/100" in bar.bar.postfix
    bar.finetune(40, 100)
    assert "fine-tune: clients 40/100, ETA " in bar.bar.postfix
    bar.close()
