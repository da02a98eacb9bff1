"""How many of the worker processes train a round, chosen by measurement between rounds.

With ``sim.backend = "auto"`` the process backend starts one worker per core. When other work
holds cores, the workers share them with it, and a round waits for its slowest worker. Whether
all workers, fewer, or one (the serial layout, in a worker) then finish a round first depends on
the other work, so :class:`LayoutChooser` measures it:

- After every ``fit`` it records the round's rate (the clients' estimated cost, forward FLOPs x
  examples, over the fit's wall time, client moves included), each worker's share of its core
  during the fit (1 - the time it was runnable but waiting for a CPU, from the kernel's
  scheduler statistics: under 1 when another task ran on its core, while waiting on messages
  does not count; its CPU time over its wall time where those are missing) and the idle cores
  of the machine over the fit.
- It **probes** (each other candidate for one untimed round, which moves the clients, then
  ``probe_rounds`` timed rounds; then it keeps the layout with the highest mean rate, the current
  one's over its last ``keep`` rounds) when a worker's share fell below ``contended`` (another
  task holds a core) or, while fewer than all workers run, when the idle cores rose by half a
  core or more over the least idle seen since that layout was chosen (the other work has gone).
  Under contention on all workers, and on fewer workers in any case, it probes again ``recheck``
  rounds after the last probe began, twice as long after each probe that keeps the layout (at
  most 8x), back to ``recheck`` after a change; an idle rise triggers one probe, and if the
  layout holds the next idle probe waits for the scheduled one. On a quiet machine the workers have their cores and it does not probe; rounds
  measured then are not part of the current layout's mean.
- The rate counts estimated FLOPs, not measured seconds, because those depend on the layout:
  with partial participation and mixed architectures the estimate misjudges a round's mix
  (memory-bound layers), which adds noise to the comparison.
- The first fit (workers warming up, clients being built) is not measured.

Which worker trains a client changes only where it runs: every client's work is a pure function
of its state, its message and its own streams on one thread, so the numbers are the same on any
layout (tested).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def candidates(workers: int) -> list[int]:
    """Active-worker counts worth measuring, largest first: all, half (from 4 workers), one."""
    half = {(workers + 1) // 2} if workers >= 4 else set()
    return sorted({workers, 1} | half, reverse=True)


@dataclass
class LayoutChooser:
    """The active-worker count for each ``fit`` (:meth:`choose`), from what the previous fits
    measured (:meth:`record`)."""

    workers: int
    recheck: int = 20  # rounds under contention before the other layouts are measured again
    contended: float = 0.85  # a worker's CPU share below this: another task shares its core
    min_gap: int = 3  # fits between two probes at least
    probe_rounds: int = 2  # rounds each other layout is timed for (one round is noisy under load)
    keep: int = 3  # the current layout's rate: the mean of its last this many rounds
    active: int = field(init=False)
    log: list[dict[str, object]] = field(init=False, default_factory=list)
    _rates: dict[int, list[float]] = field(init=False, default_factory=dict)  # recent, per layout
    # layouts left to probe, and whether the round is timed: a layout's first round moves clients
    # to the workers it adds or drops, a one-off cost a change pays once, not every round
    _queue: list[tuple[int, bool]] = field(init=False, default_factory=list)
    _interval: int = field(init=False, default=0)  # rounds until the next recheck (backs off)
    _fits: int = field(init=False, default=0)
    _probed_at: int = field(init=False, default=-(10**9))
    _idle_base: float | None = field(init=False, default=None)  # least idle since chosen
    _idle_spent: bool = field(init=False, default=False)  # an idle rise probed, layout kept
    _why: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.workers < 1 or self.probe_rounds < 1 or self.keep < 1:
            raise ValueError(
                f"workers, probe_rounds and keep must be at least 1, got {self.workers}, "
                f"{self.probe_rounds}, {self.keep}"
            )
        self.active = self.workers
        self._interval = self.recheck

    def choose(self) -> int:
        """How many workers train the next fit."""
        return self._queue[0][0] if self._queue else self.active

    def record(self, flops: float, seconds: float, shares: list[float], idle: float) -> None:
        """What the fit just done measured: its clients' FLOPs, its wall seconds, each active
        worker's share of its core (:func:`run_delay`), the machine's idle cores over it."""
        self._fits += 1
        if self._fits == 1 or seconds <= 0 or flops <= 0:
            return  # the warm-up fit says nothing about the layout
        ran, timed = self._queue[0] if self._queue else (self.active, True)
        if timed:
            self._rates[ran] = (self._rates.get(ran, []) + [flops / seconds])[-self.keep :]
        if not self._queue and ran == self.workers and min(shares, default=1.0) >= self.contended:
            self._rates[ran] = []  # a quiet round: not the conditions a probe compares under
        if self._queue:
            self._queue.pop(0)
            if not self._queue:  # every candidate measured under the same conditions: pick
                mean = {k: sum(r) / len(r) for k, r in self._rates.items() if r}
                best = max(mean, key=lambda k: mean[k])
                words = ", ".join(
                    f"{k} worker(s) {mean[k] / mean[self.active]:.2f}" for k in sorted(mean)
                )
                # the same layout again: the conditions hold, so recheck less often
                again = min(2 * self._interval, 8 * self.recheck)
                self._interval = self.recheck if best != self.active else again
                self._set(best, f"fastest measured (rate against {self.active}: {words})")
            return
        if self.workers == 1:
            return
        why = self._trigger(shares, idle)
        if why:
            others = [k for k in candidates(self.workers) if k != self.active]
            self._queue = [(k, i > 0) for k in others for i in range(self.probe_rounds + 1)]
            self._rates = {self.active: self._rates[self.active]}  # the others measured afresh
            self._probed_at = self._fits
            self._why = why

    def _trigger(self, shares: list[float], idle: float) -> str:
        """Why the other layouts should be measured now ("" if they should not)."""
        since = self._fits - self._probed_at
        ready = since >= self.min_gap
        due = since >= self._interval
        share = min(shares, default=1.0)
        if self.active == self.workers:
            if ready and due and share < self.contended:
                return f"a worker had {share:.0%} of its core"
            return ""
        if self._idle_base is None or idle < self._idle_base:
            self._idle_base = idle
        rise = idle - self._idle_base
        # An idle rise is probed once; if the layout holds, the next one waits for the scheduled
        # recheck (idle that comes and goes would otherwise probe every few rounds).
        if ready and rise >= 0.5 and not self._idle_spent:
            self._idle_spent = True
            return f"{rise:.1f} more idle core(s) on {self.active} worker(s)"
        if ready and due:
            self._idle_spent = False
            return f"{since} rounds on {self.active} worker(s)"
        return ""

    def _set(self, active: int, why: str) -> None:
        if active != self.active:  # a new layout: its own idle baseline
            self._idle_base, self._idle_spent = None, False
        self.active = active
        self._rates = {active: self._rates[active]}
        self.log.append({"fit": self._fits + 1, "workers": active, "why": f"{self._why}: {why}"})


def idle_cores() -> float | None:
    """Idle time of this process's cores so far, in seconds summed over them; ``None`` where
    ``/proc/stat`` cannot be read. The difference of two readings over the wall time between them
    is the number of cores that sat idle."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        ticks = os.sysconf("SC_CLK_TCK")
        idle = 0
        with open("/proc/stat") as fh:
            for line in fh:
                parts = line.split()
                if parts and parts[0] in mine:
                    idle += int(parts[4]) + int(parts[5])  # idle + iowait
        return idle / ticks
    except (OSError, ValueError, AttributeError, IndexError):
        return None


def run_delay() -> float | None:
    """Seconds this process's main thread has spent runnable but waiting for a CPU
    (``/proc/self/schedstat``, Linux with scheduler statistics); ``None`` elsewhere. Over a fit,
    one minus its growth over the wall time is a worker's share of its core."""
    try:
        with open("/proc/self/schedstat") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
