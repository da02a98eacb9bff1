"""The measured leak that ``[privacy]`` must close: a curious server's membership inference
from the uploads.

FedAvg clients upload their whole trained model. The server loads client ``i``'s last upload
into client ``i``'s architecture and runs the loss-threshold attack (``report/leak.py``) on the
client's training examples (members) against its test examples (non-members). Without privacy
the clients memorize their few examples and the attack sees it; with the local mechanism at a
small epsilon the uploads are noise to it. A mechanism that forgot its noise fails here.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from helpers.experiments import tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.core.rounds import run_rounds
from fedmosaic.federation import build_federation
from fedmosaic.report.leak import loss_threshold_attack
from fedmosaic.sim.simulator import SimTransport

torch.set_num_threads(1)


class Recording(SimTransport):
    """The simulator's transport, keeping every client's last upload (what the server saw)."""

    uploads: dict[int, object]

    def fit(self, round_num, messages):
        out = super().fit(round_num, messages)
        for r in out:
            self.uploads[r.client_id] = r.upload
        return out


def server_attack_auc(privacy: dict) -> tuple[float, float, float]:
    """The attack's mean AUC over the clients' last uploads, the run's epsilon (0: none), and
    the same attack as the run measured it (eval.membership's mia_upload_auc)."""
    cfg = from_dict(
        tiny_raw(
            data={"synthetic_size": 160, "num_clients": 4, "alpha": 100.0},
            train={"rounds": 1, "local_epochs": 10, "lr": 0.05},
            privacy=privacy,
            eval={"membership": True},
            sim={"check_wire": False, "progress": False, "threads": 1},
        )
    )
    fed = build_federation(cfg)
    t = Recording(
        fed.algo, fed.models, fed.extras, fed.clients, fed.settings, cfg.seed,
        cfg.train.local_epochs,
    )  # fmt: skip
    t.uploads = {}
    history, _ = run_rounds(fed.algo, fed.spec, t, fed.plan)
    aucs = []
    for cid, upload in t.uploads.items():
        model = fed.spec.build_model(cid)
        model.load_state_dict(upload.state)  # FedAvg uploads the whole state
        data = fed.clients[cid]
        members = (data.source.batch(data.rows("train")), data.targets("train"))
        nonmembers = (data.source.batch(data.rows("test")), data.targets("test"))
        aucs.append(loss_threshold_attack(model, members, nonmembers).auc)
    last = history.rounds[-1]
    return statistics.mean(aucs), last.get("epsilon", 0.0), last["mia_upload_auc"]


def test_the_server_sees_membership_without_privacy_and_not_at_a_small_epsilon():
    plain, _, plain_in_run = server_attack_auc({})
    private, epsilon, private_in_run = server_attack_auc(
        {"mechanism": "local", "clip": 1.0, "noise_multiplier": 50.0}
    )
    # eval.membership measures the same attack inside the run, from the clients' side
    assert plain_in_run == pytest.approx(plain, abs=1e-12)
    assert private_in_run == pytest.approx(private, abs=1e-12)
    assert plain > 0.8, plain  # measured 0.866 (2026-11-28)
    assert epsilon < 1.0, epsilon
    assert abs(private - 0.5) < 0.1, private  # measured 0.557: 40 examples a client
