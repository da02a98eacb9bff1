"""A hostile SuperNode on Flower's in-memory Grid (tests/flower/test_flower_poisoning.py,
tests/flower/test_flower_peer_guard.py).

The real ServerApp/ClientApp code (:class:`LocalGrid`); the node serving partition ``ATTACKER``
trains honestly, then the test's ``rewrite`` changes its train reply's arrays before it goes on
the wire.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Array

from fedmosaic.core.rounds import Diverged
from fedmosaic.flower import messages as m
from fedmosaic.flower.app import client_app, run_server
from fedmosaic.flower.codec import ARRAYS
from fedmosaic.flower.local import FIRST_NODE_ID, LocalGrid

ATTACKER = 0  # the partition the hostile node serves
HOSTILE_NODE = FIRST_NODE_ID + ATTACKER  # node configs are listed in partition order
# (array name, the reply's array, the broadcast's array, round) -> the array sent, or None: as is
Rewrite = Callable[[str, Array, Array, int], Array | None]


def hostile(rewrite: Rewrite) -> Callable[..., Any]:
    """The real ClientApp, except that the hostile node's floating train-reply arrays go
    through ``rewrite``."""

    def app(msg, context):
        reply = client_app(msg, context)
        if (
            context.node_id != HOSTILE_NODE
            or msg.metadata.message_type != m.FIT
            or reply.has_error()
        ):
            return reply
        sent = msg.content.array_records[ARRAYS]
        arrays = reply.content.array_records[ARRAYS]
        round_num = m.header(msg.content)["round"]
        for name, arr in list(arrays.items()):
            if arr.dtype.startswith("float"):
                new = rewrite(name, arr, sent.get(name), round_num)
                if new is not None:
                    arrays[name] = new
        return reply

    return app


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def grid_run(
    experiment: dict[str, Any], rewrite: Rewrite | None, results_dir: Path, n: int
) -> dict[str, Any]:
    """``experiment`` over the Grid with ``n`` nodes (``rewrite`` None: every node honest): the
    rounds, the final accuracy, the warnings logged, ``diverged`` if the round loop gave up."""
    rc = {"experiment": json.dumps(experiment), "results-dir": str(results_dir)}
    nodes = [{"partition-id": i, "num-partitions": n} for i in range(n)]
    grid = LocalGrid(client_app if rewrite is None else hostile(rewrite), nodes, rc)
    logs = _Collect()
    logger = logging.getLogger("fedmosaic")
    logger.addHandler(logs)
    try:
        rounds = run_server(grid, rc)["rounds"]
        out = {"diverged": False, "acc": rounds[-1]["acc_weighted"], "rounds": rounds}
    except Diverged:
        out = {"diverged": True}
    finally:
        logger.removeHandler(logs)
    out["log"] = "\n".join(logs.lines)
    return out
