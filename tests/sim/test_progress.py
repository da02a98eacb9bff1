"""Progress inside a round: on a terminal, clients done / total with ETAs for the round and the
run (a round of 100-s clients used to sit at ``0/4``); without one, one log line per round."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
from helpers.experiments import SMALL, tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.experiment import run_experiment
from fedmosaic.report.summary import round_line


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(monkeypatch, stream: io.StringIO, sim: dict) -> dict:
    monkeypatch.setattr(sys, "stderr", stream)
    raw = tiny_raw(data=SMALL, train={"rounds": 3}, sim={**sim, "progress": True})
    return run_experiment(from_dict(raw))


@pytest.mark.parametrize(
    "sim",
    [{"backend": "serial", "threads": 1}, {"backend": "processes", "workers": 2}],
    ids=["serial", "processes"],
)
def test_a_terminal_shows_the_clients_of_the_round_with_etas(monkeypatch, sim):
    tty = FakeTTY()
    _run(monkeypatch, tty, sim)
    frames = tty.getvalue().split("\r")
    for r in (1, 2, 3):
        for done in range(1, 5):  # every client of every round, as it finishes
            want = f"round {r}: clients {done}/4, round ETA "
            assert any(want in f and "run ETA " in f for f in frames), (want, frames[-5:])
    assert re.search(r"3/3 rounds .*acc=", frames[-1])


def test_without_a_terminal_one_line_per_round_as_before(monkeypatch, caplog):
    plain = io.StringIO()  # not a TTY: a log file, a CI job
    with caplog.at_level(logging.INFO, logger="fedmosaic"):
        doc = _run(monkeypatch, plain, {"backend": "serial", "threads": 1})
    lines = [r.getMessage() for r in caplog.records if " round " in r.getMessage()]
    assert lines == [round_line("fedavg", rec, 3) for rec in doc["rounds"]]
    # no bar, no per-client frames (a CLI test's log handler may still write here)
    assert "\r" not in plain.getvalue() and "clients" not in plain.getvalue()
