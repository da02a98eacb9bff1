"""The layout chooser: how many workers train a round, measured between rounds under load.

The chooser is fed synthetic measurements (the rate of a fit, each worker's CPU share, the idle
cores); the transport test switches layouts every round and checks the numbers stay serial's.
"""

from __future__ import annotations

import pytest
from helpers.experiments import numbers, tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.experiment import run_experiment
from fedmosaic.sim import backend, layout, processes
from fedmosaic.sim.layout import LayoutChooser, candidates

QUIET = [0.98, 0.97]


def feed(ch: LayoutChooser, rate_of: dict[int, float], shares=QUIET, idle=0.0, n=1) -> list[int]:
    """``n`` fits at the chooser's layouts; each takes 1 s per rate unit. Returns the layouts."""
    ran = []
    for _ in range(n):
        k = ch.choose()
        ran.append(k)
        ch.record(rate_of[k], 1.0, list(shares)[:k], idle)
    return ran


def test_candidates_are_all_half_and_one_worker():
    assert candidates(1) == [1]
    assert candidates(2) == [2, 1]
    assert candidates(3) == [3, 1]
    assert candidates(8) == [8, 4, 1]
    assert candidates(5) == [5, 3, 1]


def test_a_quiet_machine_never_probes():
    ch = LayoutChooser(2)
    assert feed(ch, {2: 10.0, 1: 5.0}, n=60) == [2] * 60
    assert ch.log == []


def test_under_contention_two_rounds_on_one_worker_decide():
    ch = LayoutChooser(2, recheck=20)
    # fit 1 warms up, fit 2 sees a worker at 60% of its core, fit 3 moves the clients to one
    # worker (untimed), fits 4-5 time it
    ran = feed(ch, {2: 6.0, 1: 9.0}, shares=[0.6, 0.95], n=7)
    assert ran == [2, 2, 1, 1, 1, 1, 1]
    assert ch.active == 1
    assert ch.log == [
        {
            "fit": 6,
            "workers": 1,
            "why": "a worker had 60% of its core: fastest measured "
            "(rate against 2: 1 worker(s) 1.50, 2 worker(s) 1.00)",
        }
    ]


def test_the_decision_takes_means_not_one_noisy_round():
    def run(probe_rounds: int) -> int:
        ch = LayoutChooser(2, recheck=50, probe_rounds=probe_rounds)
        # fit 1 warms up; fit 2 on two workers (rate 10, a worker at 60%: probe); then one
        # worker: its untimed first round (1), a lucky round at 13, then 5
        for rate in (10.0, 10.0, 1.0, 13.0, 5.0)[: 3 + probe_rounds]:
            ch.record(rate, 1.0, [0.6] * ch.choose(), 0.0)
        return ch.active

    assert run(probe_rounds=1) == 1  # one round: fooled by the lucky one
    assert run(probe_rounds=2) == 2  # the mean of two (9) stays below two workers' 10


def test_when_all_workers_stay_faster_under_contention_they_are_kept_and_rechecked():
    ch = LayoutChooser(2, recheck=10, probe_rounds=1)
    ran = feed(ch, {2: 12.0, 1: 8.0}, shares=[0.7, 0.7], n=70)
    assert ran[:5] == [2, 2, 1, 1, 2]
    # probed again while the contention lasts, after 10 fits, then 20, then 40 (backing off)
    assert [i for i, k in enumerate(ran) if k == 1] == [2, 3, 22, 23, 62, 63]
    assert ch.active == 2


def test_a_core_going_idle_sends_one_worker_back_to_all():
    ch = LayoutChooser(2, recheck=50)
    feed(ch, {2: 6.0, 1: 9.0}, shares=[0.6, 0.6], n=5)
    assert ch.active == 1
    assert feed(ch, {2: 6.0, 1: 9.0}, shares=[1.0], idle=0.05, n=5) == [1] * 5
    # the other work is gone: a core sits idle while one worker trains
    ran = feed(ch, {2: 18.0, 1: 9.0}, shares=[1.0], idle=0.95, n=5)
    assert ran == [1, 2, 2, 2, 2] and ch.active == 2
    assert ch.log[-1]["workers"] == 2 and "more idle core" in str(ch.log[-1]["why"])


def test_cores_idle_all_along_do_not_keep_probing():
    # 8 workers on a bigger machine (cores idle whatever the layout) where 4 are fastest: the
    # idle level when 4 were chosen is the baseline, so the probes stop until it rises
    ch = LayoutChooser(8, recheck=20, probe_rounds=1)
    ran = feed(ch, {8: 10.0, 4: 14.0, 1: 3.0}, shares=[0.5] * 8, idle=0.8, n=24)
    assert ran[:8] == [8, 8, 4, 4, 1, 1, 4, 4]
    assert ran[6:22] == [4] * 16  # until the recheck is due
    ran = feed(ch, {8: 10.0, 4: 14.0, 1: 3.0}, shares=[0.5] * 8, idle=0.8, n=4)
    assert ch.active == 4


def test_an_idle_rise_is_probed_once_not_every_round_it_lasts():
    ch = LayoutChooser(2, recheck=100)
    feed(ch, {2: 6.0, 1: 9.0}, shares=[0.6, 0.6], n=5)
    feed(ch, {2: 6.0, 1: 9.0}, shares=[1.0], idle=0.0, n=2)
    # a core goes idle, but one worker stays faster: probed once, then no more at that level
    ran = feed(ch, {2: 6.0, 1: 9.0}, shares=[1.0], idle=0.7, n=12)
    assert ran.count(2) == 3 and ch.active == 1


def test_rechecks_back_off_to_eight_times_and_reset_after_a_change():
    ch = LayoutChooser(2, recheck=2, probe_rounds=1, min_gap=1)
    ran = feed(ch, {2: 12.0, 1: 8.0}, shares=[0.7, 0.7], n=80)
    starts = [i for i in range(1, 80) if ran[i] == 1 and ran[i - 1] == 2]
    # the first probe is at once; each that keeps the layout doubles the wait: 4, 8, then 16
    assert [b - a for a, b in zip(starts, starts[1:])][:5] == [4, 8, 16, 16, 16]
    # one worker becomes the faster: after the change the recheck is 2 rounds again, and on
    # fewer workers it stays on schedule with no contention in sight (shares 1.0)
    ch2 = LayoutChooser(2, recheck=2, probe_rounds=1, min_gap=1)
    ran = feed(ch2, {2: 6.0, 1: 9.0}, shares=[0.7, 0.7], n=4)  # probe at fit 2, change at 4
    assert ran == [2, 2, 1, 1] and ch2.active == 1
    ran = feed(ch2, {2: 6.0, 1: 9.0}, shares=[1.0], n=6)
    assert ran[:3] == [1, 2, 2]  # 2 rounds after the last probe began: probed again


def test_the_current_layout_is_judged_on_its_last_rounds_under_contention():
    def run(keep: int, quiet_first: bool) -> int:
        ch = LayoutChooser(2, recheck=4, probe_rounds=1, keep=keep, min_gap=1)
        if quiet_first:  # 10 quiet rounds at a high rate: not the conditions of the probe
            feed(ch, {2: 10.0, 1: 5.0}, shares=[1.0, 1.0], n=10)
        else:
            feed(ch, {2: 10.0, 1: 7.0}, shares=[0.6, 0.6], n=4)  # probed once: two kept
            assert ch.active == 2
            feed(ch, {2: 10.0, 1: 7.0}, shares=[0.6, 0.6], n=5)
        # now a round at 4 (noise, or the other work growing), then the probe
        feed(ch, {2: 4.0, 1: 7.0}, shares=[0.6, 0.6], n=1)
        feed(ch, {2: 4.0, 1: 7.0}, shares=[0.6, 0.6], n=3)
        return ch.active

    assert run(keep=3, quiet_first=False) == 2  # mean of 10, 10, 4 = 8 beats 7
    assert run(keep=1, quiet_first=False) == 1  # the last round alone: 4 loses to 7
    assert run(keep=3, quiet_first=True) == 1  # the quiet 10s are not in the mean


def test_idle_bouncing_around_its_baseline_does_not_probe_endlessly():
    ch = LayoutChooser(2, recheck=1000, probe_rounds=1, min_gap=1)
    feed(ch, {2: 6.0, 1: 9.0}, shares=[0.6, 0.6], n=4)
    assert ch.active == 1
    ran = []
    for i in range(100):  # idle 0.2, 0.8, 0.2, ...: the other work comes and goes
        ran += feed(ch, {2: 6.0, 1: 9.0}, shares=[1.0], idle=0.2 + 0.6 * (i % 2), n=1)
    assert ran.count(2) == 2 and ch.active == 1  # one probe (one untimed, one timed round)
    # a steady rise is probed once
    ch2 = LayoutChooser(2, recheck=1000, probe_rounds=1, min_gap=1)
    feed(ch2, {2: 6.0, 1: 9.0}, shares=[0.6, 0.6], n=4)
    steady = feed(ch2, {2: 6.0, 1: 9.0}, shares=[1.0], idle=0.0, n=2)
    steady += feed(ch2, {2: 6.0, 1: 9.0}, shares=[1.0], idle=0.8, n=60)
    assert steady.count(2) == 2 and ch2.active == 1


def test_many_workers_probe_half_and_one():
    ch = LayoutChooser(8, probe_rounds=1)
    ran = feed(ch, {8: 10.0, 4: 14.0, 1: 3.0}, shares=[0.5] * 8, n=8)
    assert ran == [8, 8, 4, 4, 1, 1, 4, 4]
    assert ch.active == 4


def test_a_single_worker_has_nothing_to_choose():
    ch = LayoutChooser(1)
    assert feed(ch, {1: 1.0}, shares=[0.3], n=30) == [1] * 30
    with pytest.raises(ValueError, match="workers"):
        LayoutChooser(0)
    with pytest.raises(ValueError, match="probe_rounds"):
        LayoutChooser(2, probe_rounds=0)


def test_idle_cores_reads_this_machine():
    got = layout.idle_cores()
    if got is None:
        pytest.skip("no /proc/stat here")
    assert got >= 0


class _Alternating(LayoutChooser):
    """Two, one, two, one workers: a client moves through the store at every fit."""

    def choose(self) -> int:
        return 2 - self._fits % 2

    def record(self, flops, seconds, shares, idle) -> None:
        # what the transport measured: one CPU share per worker that trained
        assert flops > 0 and seconds > 0 and len(shares) == self.choose()
        assert all(0.0 <= s <= 1.5 for s in shares) and idle >= 0.0
        self._fits += 1
        self.log.append({"fit": self._fits + 1, "workers": self.choose(), "why": "test"})


@pytest.mark.parametrize(("participation", "offload"), [(1.0, "auto"), (0.5, "auto"), (0.5, "off")])
def test_switching_layouts_every_round_keeps_serial_numbers(monkeypatch, participation, offload):
    # offload "off" with partial participation: clients not sampled stay live on a worker that
    # the next round's layout leaves out, and must be evaluated (and saved) from there
    args = {
        "data": {"synthetic_shape": [1, 16, 16]},
        "algorithm": {"name": "fedproto"},
        "train": {"rounds": 4, "participation": participation},
    }
    serial = run_experiment(from_dict(tiny_raw(**args, sim={"backend": "serial", "threads": 1})))
    args["sim"] = {"offload_clients": offload}
    monkeypatch.setattr(backend, "default_workers", lambda: 2)
    monkeypatch.setattr(backend, "spare_cores", lambda: 1)  # another process holds a core
    monkeypatch.setattr(backend, "MIN_PROCESS_FLOPS", 0.0)
    monkeypatch.setattr(processes, "LayoutChooser", _Alternating)
    doc = run_experiment(from_dict(tiny_raw(**args)), progress=False)
    runtime = doc["provenance"]["runtime"]
    assert (runtime["backend"], runtime["workers"], runtime["adaptive"]) == ("processes", 2, True)
    assert [e["workers"] for e in runtime["layouts"]] == [1, 2, 1, 2]
    assert numbers(doc) == numbers(serial)


def test_explicit_processes_keep_their_layout(monkeypatch):
    monkeypatch.setattr(backend, "default_workers", lambda: 2)
    raw = tiny_raw(sim={"backend": "processes", "workers": 2}, train={"rounds": 2})
    doc = run_experiment(from_dict(raw), progress=False)
    assert doc["provenance"]["runtime"]["adaptive"] is False
    assert "layouts" not in doc["provenance"]["runtime"]
