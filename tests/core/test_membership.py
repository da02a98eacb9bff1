"""The membership attack as integer counts (core/membership.py) and ``eval.membership`` in runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.experiments import tiny_raw
from scipy import stats

from fedmosaic import api
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import membership as mia
from fedmosaic.federation import build_federated_data, client_data
from fedmosaic.report.leak import loss_threshold_attack
from fedmosaic.report.results import rounds_csv
from fedmosaic.report.suite_report import run_metrics

torch.set_num_threads(1)


def test_pair_counts_and_true_positives_by_hand():
    members, nonmembers = torch.tensor([3.0, 1.0, 2.0]), torch.tensor([1.0, 0.0])
    # pairs: 3>1, 3>0, 1=1, 1>0, 2>1, 2>0: 5 won, 1 tied, of 6
    assert mia.pair_counts(members, nonmembers) == (2 * 5 + 1, 12)
    # fpr 0.5 of 2 nonmembers: one may be called a member, threshold = the second largest (0)
    assert mia.true_positives(members, nonmembers, 0.5) == 3
    # fpr 1%: none may, threshold = the largest nonmember (1): only 3 and 2 lie above it
    assert mia.true_positives(members, nonmembers, 0.01) == 2
    assert mia.counts(members, nonmembers) == {
        mia.PAIRS: {"n": 12, "auc": 11},
        mia.MEMBERS: {"n": 3, "tpr": 2},
    }


def test_pair_counts_are_twice_mann_whitney_u_with_ties():
    g = np.random.default_rng(0)
    a, b = g.integers(0, 20, 300).astype(float), g.integers(0, 20, 200).astype(float)
    won2, pairs2 = mia.pair_counts(a, b)
    u = stats.mannwhitneyu(a, b).statistic  # pairs a wins, ties half
    assert won2 == 2 * u and pairs2 == 2 * 300 * 200


def test_allowed_false_positives_survive_float_rounding():
    assert mia.allowed_false(100, 0.29) == 29  # 0.29 * 100 == 28.999999999999996
    assert mia.allowed_false(50, 0.01) == 0
    for bad in (0.0, 1.0, math.nan):
        with pytest.raises(ValueError, match="fpr"):
            mia.allowed_false(10, bad)


def test_nan_scores_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        mia.pair_counts(torch.tensor([math.nan, 1.0]), torch.tensor([0.0]))


def test_summarize_means_over_the_clients_that_attacked():
    a = {mia.PAIRS: {"n": 12, "auc": 11}, mia.MEMBERS: {"n": 3, "tpr": 2}, "test": {"n": 2}}
    b = {mia.PAIRS: {"n": 8, "auc": 4}, mia.MEMBERS: {"n": 2, "tpr": 0}}
    out = mia.summarize([a, b, {"test": {"n": 5, "acc": 3}}])
    assert out["mia_auc"] == pytest.approx((11 / 12 + 0.5) / 2)
    assert out["mia_auc_max"] == pytest.approx(11 / 12)
    assert out["mia_tpr"] == pytest.approx((2 / 3 + 0) / 2)
    assert out["mia_clients"] == 2
    assert mia.summarize([{"test": {"n": 5, "acc": 3}}]) == {}


@pytest.mark.parametrize(
    "counts, problem",
    [
        ({mia.PAIRS: {"n": 12, "auc": 13}, mia.MEMBERS: {"n": 3, "tpr": 2}}, "more wins"),
        ({mia.PAIRS: {"n": 12, "auc": 1}, mia.MEMBERS: {"n": 3, "tpr": 4}}, "more wins"),
        ({mia.PAIRS: {"n": 13, "auc": 1}, mia.MEMBERS: {"n": 3, "tpr": 0}}, "do not fit"),
        ({mia.PAIRS: {"n": 12, "auc": 1}}, "only one"),
        ({mia.PAIRS: {"n": 12, "auc": 1}, mia.MEMBERS: {"n": 3, "x": 0}}, "n and tpr"),
        (
            {mia.PAIRS: {"n": 2 * 3 * 10**6, "auc": 1}, mia.MEMBERS: {"n": 3, "tpr": 0}},
            "nonmembers",
        ),
    ],
)
def test_check_names_what_no_real_client_reports(counts, problem):
    assert problem in mia.check(counts, max_examples=1000)


def test_check_accepts_a_real_report():
    members, nonmembers = torch.randn(30, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    assert mia.check(mia.counts(members, nonmembers), max_examples=30) == ""
    assert mia.check({"test": {"n": 3, "acc": 1}}, max_examples=30) == ""


def _run(name: str, backend: str = "serial", **privacy: object) -> api.Result:
    raw = tiny_raw(
        algorithm={"name": name},
        train={"rounds": 2, "local_epochs": 5},
        eval={"membership": True},
        privacy=privacy,
        sim={"check_wire": False, "progress": False, "threads": 1, "backend": backend},
    )
    return api.run(from_dict(raw))


def test_a_run_reports_the_attack_of_each_clients_own_model():
    """``local``: each client's evaluated model is its trained model, so the attack in the run
    equals report.leak's attack on the returned models, client by client."""
    result = _run("local")
    for rec in result.rounds:
        assert 0.5 < rec["mia_auc"] <= rec["mia_auc_max"] <= 1.0  # 5 local epochs: memorized
        assert 0.0 <= rec["mia_tpr"] <= 1.0 and rec["mia_clients"] == 4
    cfg = result.config
    clients = client_data(build_federated_data(cfg.data, cfg.seed), "cpu")
    expected = []
    for model, data, rec in zip(result.models, clients, result.clients, strict=True):
        members = (data.source.batch(data.rows("train")), data.targets("train"))
        nonmembers = (data.source.batch(data.rows("test")), data.targets("test"))
        attack = loss_threshold_attack(model, members, nonmembers)
        assert rec["mia_auc"] == attack.auc and rec["mia_tpr"] == attack.tpr_at_fpr
        expected.append(attack.auc)
    final = result.summary["membership"]
    assert final["mia_auc"] == pytest.approx(sum(expected) / len(expected), abs=1e-15)
    assert final["round"] == 2
    header = rounds_csv(result.rounds).decode().splitlines()[0].split(",")
    assert header[-3:] == ["mia_auc", "mia_auc_max", "mia_tpr"]
    metrics = run_metrics(result.document, None)
    assert (metrics["mia_auc"], metrics["mia_tpr"]) == (final["mia_auc"], final["mia_tpr"])


def test_the_attack_is_off_by_default_and_validated():
    result = api.run(from_dict(tiny_raw(sim={"check_wire": False, "progress": False})))
    assert "mia_auc" not in result.rounds[-1] and "membership" not in result.summary
    assert "mia_auc" not in rounds_csv(result.rounds).decode()
    with pytest.raises(ConfigError, match="eval.membership"):
        from_dict(tiny_raw(eval={"membership": "yes"}))


def test_the_uploads_are_attacked_where_they_are_whole_models():
    """FedAvg uploads its whole model: every round attacks it (mia_upload_*); LG-FedAvg uploads
    a head, the server has no model to attack; under secure aggregation it sees no upload."""
    fedavg = _run("fedavg")
    for rec in fedavg.rounds:
        assert 0.0 <= rec["mia_upload_auc"] <= rec["mia_upload_auc_max"] <= 1.0
        assert rec["mia_upload_clients"] == 4
    assert fedavg.summary["membership"]["mia_upload_auc"] == fedavg.rounds[-1]["mia_upload_auc"]
    assert "mia_upload_auc" not in _run("lg_fedavg").rounds[-1]
    hidden = _run("fedavg", secure_aggregation=True)
    assert "mia_upload_auc" not in hidden.rounds[-1] and "mia_auc" in hidden.rounds[-1]


def test_attack_counts_of_a_run_that_did_not_ask_are_not_read():
    """Replies carrying upload attacks (here: clients told to attack, a server not) add nothing
    to the round record: only eval.membership's plan reads them."""
    import dataclasses

    from fedmosaic.core.rounds import run_rounds
    from fedmosaic.federation import build_federation
    from fedmosaic.sim.simulator import SimTransport

    raw = tiny_raw(
        algorithm={"name": "fedavg"},
        train={"rounds": 1},
        eval={"membership": True},
        sim={"check_wire": False, "progress": False, "threads": 1},
    )
    fed = build_federation(from_dict(raw))
    t = SimTransport(fed.algo, fed.models, fed.extras, fed.clients, fed.settings, 0, 1)
    quiet = dataclasses.replace(fed.plan, membership=False)
    history, _ = run_rounds(fed.algo, fed.spec, t, quiet)
    assert "mia_upload_auc" not in history.rounds[-1]


@pytest.mark.integration  # worker processes
@pytest.mark.parametrize("name", ["fedproto", "fedavg"])
def test_worker_processes_give_the_same_attack(name):
    """FedProto classifies by distance to the prototypes: the attack scores those scores;
    FedAvg's uploads are attacked too."""
    serial, procs = _run(name), _run(name, backend="processes")
    keys = [k for k in serial.rounds[-1] if k.startswith("mia_")]
    assert len(keys) == (8 if name == "fedavg" else 4)
    assert [{k: r[k] for k in keys} for r in serial.rounds] == [
        {k: r[k] for k in keys} for r in procs.rounds
    ]
