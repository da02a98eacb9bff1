"""A malformed reply is dropped with its client named; the federation goes on."""

import dataclasses
import logging

import torch
from helpers.experiments import tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.core.rounds import run_rounds
from fedmosaic.experiment import build_federation
from fedmosaic.sim.simulator import SimTransport


class CorruptingTransport(SimTransport):
    """Client 1 sends a head with the wrong shape every round."""

    def fit(self, round_num, messages):
        out = super().fit(round_num, messages)
        for r in out:
            if r.client_id == 1:
                bad = {
                    k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in r.upload.state.items()
                }
                r.upload = dataclasses.replace(r.upload, state=bad)
        return out


def test_bad_upload_dropped_and_logged(caplog):
    cfg = from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "lg_fedavg"}))
    fed = build_federation(cfg)
    t = CorruptingTransport(fed.algo, fed.models, fed.extras, fed.clients, fed.settings, 0, 1)
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        history, state = run_rounds(fed.algo, fed.spec, t, fed.plan)
    assert [r["rejected"] for r in history.rounds] == [[1], [1]]
    assert all(1 not in r["participants"] for r in history.rounds)
    assert "client 1" in caplog.text
    assert all(torch.isfinite(v).all() for v in state.values())
    assert state["weight"].shape == (4, 16)
