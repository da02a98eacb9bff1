"""One hostile client on the simulator (tests/test_adversarial.py, tests/test_peer_guard.py).

Client ``ATTACKER`` trains honestly; its upload is then rewritten by the test's ``poison``
before the server sees it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fedmosaic.config import from_dict
from fedmosaic.core.payload import Payload
from fedmosaic.core.rounds import Diverged, run_rounds
from fedmosaic.federation import build_federation
from fedmosaic.sim.simulator import SimTransport

ATTACKER = 0
# (round, the attacker's trained upload, the broadcast it received) -> the upload it sends
Poison = Callable[[int, Payload, Payload], Payload]


class Attacker(SimTransport):
    """The simulator's transport, with client ``ATTACKER``'s uploads rewritten by ``poison``."""

    poison: Poison | None = None
    attackers: frozenset[int] = frozenset({ATTACKER})

    def fit(self, round_num, messages):
        out = super().fit(round_num, messages)
        for r in out:
            if self.poison is not None and r.client_id in self.attackers and r.upload is not None:
                r.upload = self.poison(round_num, r.upload, messages[r.client_id])
        return out


def attacked_run(
    raw: dict[str, Any], poison: Poison | None, attackers: tuple[int, ...] = (ATTACKER,)
) -> dict[str, Any]:
    """Run the experiment ``raw`` with the attacker (``poison`` None: honest): the final
    accuracy (NaN and ``diverged`` if the round loop gave up), the rejections and aggregation
    flags per round and the final server state."""
    fed = build_federation(from_dict(raw))
    t = Attacker(
        fed.algo, fed.models, fed.extras, fed.clients, fed.settings, fed.cfg.seed,
        fed.cfg.train.local_epochs,
    )  # fmt: skip
    t.poison = poison
    t.attackers = frozenset(attackers)
    try:
        history, state = run_rounds(fed.algo, fed.spec, t, fed.plan)
    except Diverged:
        return {"acc": math.nan, "diverged": True}
    return {
        "acc": history.rounds[-1]["acc_weighted"],
        "rejected": [r["rejected"] for r in history.rounds],
        "aggregated": [r["aggregated"] for r in history.rounds],
        "state": state,
        "diverged": False,
    }
