"""Steps captured once and replayed: CUDA graphs for the batched clients' training step.

At batch 10 with the papers' small CNNs, a GPU step is a few hundred tiny kernel launches and
the Python that issues them; the card waits on the host. :class:`StepGraphs` runs a step given
as a zero-argument function ``fn`` that reads and writes only tensors at fixed addresses (the
caller's static buffers): the first ``WARMUP`` times a key is seen it runs ``fn`` eagerly (real
steps, on a side stream on CUDA as graph capture requires), then it captures ``fn`` once as a
``torch.cuda.CUDAGraph`` and every later step with that key is one ``replay()``. All graphs of
one instance share one memory pool.

On CPU the same logic runs with the graph replaced by a call of the captured function itself:
what a graph bakes in (the Python it ran at capture) is what the stored closure keeps, so the
static-buffer bookkeeping (buffers refreshed every round, keys that change when the captured
Python would) is exercised by the CPU suite; only the capture itself needs a card
(``tests/core/test_cuda.py``).

A capture that fails (the step synchronizes with the host, e.g. ``bool(tensor)`` in a loss, or
allocates pageable memory) is logged once and that instance runs eagerly from then on; nothing
was written by the failed capture, since captured kernels do not execute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from fedmosaic.accel._engaged import engaged

log = logging.getLogger("fedmosaic")

WARMUP = 1  # eager runs of a key before it is captured (cuDNN/cuBLAS pick their kernels there)


class StepGraphs:
    """Capture-once, replay-always for the steps of one group of static buffers."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.seen: dict[Hashable, int] = {}
        self.replays: dict[Hashable, Callable[[], object]] = {}
        self.failed: str | None = None
        self._pool: Any = None  # the first graph's memory pool, shared by the later ones
        self._side: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self.replays)

    def run(self, key: Hashable, fn: Callable[[], object]) -> None:
        """One step: replay ``key``'s graph, or run ``fn`` (and capture it once warmed up)."""
        replay = self.replays.get(key)
        if replay is not None:
            replay()
            engaged["graph_replays"] += 1
            return
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        if self.failed is not None or n <= WARMUP:
            self._eager(fn, warm=self.failed is None)
            return
        replay = self._capture(key, fn)
        if replay is None:
            fn()
            return
        self.replays[key] = replay
        replay()
        engaged["graph_replays"] += 1

    def _eager(self, fn: Callable[[], object], warm: bool) -> None:
        if not (self.cuda and warm):
            fn()
            return
        # warm-up before a capture runs on a side stream (torch.cuda.graph's requirement)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            fn()
        main.wait_stream(self._side)

    def _capture(self, key: Hashable, fn: Callable[[], object]) -> Callable[[], object] | None:
        if not self.cuda:
            engaged["graph_captures"] += 1
            return fn  # the stand-in: the closure is what a graph would have baked in
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph, pool=self._pool):
                fn()
        except Exception as exc:  # a host sync or other uncapturable op: eager from now on
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("CUDA graph capture failed, steps run eagerly: %s", self.failed)
            torch.cuda.synchronize(self.device)
            return None
        if self._pool is None:
            self._pool = graph.pool()
        engaged["graph_captures"] += 1
        return graph.replay
