"""The robust aggregation layer against hand-computed numbers (``core/robust.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from fedmosaic.algorithms._shared import weighted_average
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import robust
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.robust import RobustRule, ServerView


def rows(*vals: list[float]) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float64)


ONES = torch.ones(5, dtype=torch.float64)
# Five clients, two coordinates; client 4 is the outlier.
X = rows([1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [100.0, -100.0])


def test_median_coordinatewise_odd_and_even():
    got = robust.aggregate_rows(X, ONES, RobustRule("median"))
    assert got.tolist() == [3.0, 20.0]  # sorted: 1 2 3 4 100 | -100 10 20 30 40
    got = robust.aggregate_rows(X[:4], ONES[:4], RobustRule("median"))
    assert got.tolist() == [2.5, 25.0]  # the two middle values averaged


def test_trimmed_mean_cuts_floor_trim_k_each_end():
    # trim 0.2 of 5 rows: one value cut at each end of each coordinate.
    got = robust.aggregate_rows(X, ONES, RobustRule("trimmed_mean", trim=0.2))
    assert got.tolist() == [3.0, 20.0]  # (2+3+4)/3, (10+20+30)/3
    # trim 0.1 of 5 rows: floor(0.5) = 0, nothing cut: the unweighted mean.
    got = robust.aggregate_rows(X, ONES, RobustRule("trimmed_mean", trim=0.1))
    assert got.tolist() == pytest.approx([22.0, 0.0])
    assert robust.trim_count(5, 0.49) == 2 and robust.trim_count(2, 0.49) == 0


def test_krum_scores_by_hand():
    # 1-D points 0, 1, 3, 10; f = 1 -> K - f - 2 = 1 nearest neighbour.
    x = rows([0.0], [1.0], [3.0], [10.0])
    assert robust.krum_scores(x, 1).tolist() == [1.0, 1.0, 4.0, 49.0]
    # f = 0 -> 2 nearest: 0: 1+9, 1: 1+4, 3: 4+9, 10: 49+81.
    assert robust.krum_scores(x, 0).tolist() == [10.0, 5.0, 13.0, 130.0]
    w = torch.tensor([1.0, 3.0, 1.0, 1.0])
    krum = robust.aggregate_rows(x, w, RobustRule("krum", f=0))
    assert krum.tolist() == [1.0]  # the single best score
    # multi-Krum keeps K - f = 3 best (1, 0, 3), their sample-weighted mean: (0 + 3 + 3) / 5.
    multi = robust.aggregate_rows(x, w, RobustRule("multi_krum", f=1))
    assert multi.tolist() == pytest.approx([6.0 / 5.0])


def test_krum_tie_goes_to_the_lower_index():
    scores = torch.tensor([1.0, 1.0, 4.0], dtype=torch.float64)
    assert robust.krum_select(scores, False, 1).tolist() == [0]


def test_mean_is_sample_weighted():
    w = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    assert robust.aggregate_rows(X, w, RobustRule("mean")).tolist() == [75.25, -72.5]


def test_clip_scales():
    # norms 5 and 1 against a bound of 2: scaled by 2/5, left alone.
    sq = torch.tensor([25.0, 1.0])
    assert robust.clip_scales(sq, 2.0).tolist() == pytest.approx([0.4, 1.0])
    assert robust.clip_scales(sq, 0.0).tolist() == [1.0, 1.0]


def states_of(*vals: list[float]) -> list[dict[str, torch.Tensor]]:
    # a float tensor of two values and an int buffer, per client
    return [
        {"w": torch.tensor(v, dtype=torch.float32), "n": torch.tensor(i, dtype=torch.long)}
        for i, v in enumerate(vals)
    ]


def test_state_average_clips_updates_against_the_reference():
    ref = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(0)}
    states = states_of([4.0, 5.0], [1.0, 2.0])  # updates (3, 4) norm 5, (0, 1) norm 1
    rule = RobustRule("mean", clip_update_norm=2.0)
    out = robust.average_states(states, [1.0, 1.0], rule, ref)
    # (3, 4) -> (1.2, 1.6); mean with (0, 1): (0.6, 1.3); plus the reference.
    assert out["w"].tolist() == pytest.approx([1.6, 2.3])
    assert out["w"].dtype == torch.float32
    assert out["n"].item() == 1  # integer buffers: the maximum, as the plain average


def test_state_krum_scores_a_client_on_all_its_tensors():
    # f = 0, K = 4: scores sum the 2 nearest squared distances. Tensor a alone (0, 1, 1.2,
    # 1.4) scores 2.44, 0.2, 0.08, 0.2 and would pick client 2; with b (0, 0, 5, 0) the scores
    # are 2.96, 1.16, 50.08, 2.12: client 1.
    states = [
        {"a": torch.tensor([a]), "b": torch.tensor([b])}
        for a, b in ((0.0, 0.0), (1.0, 0.0), (1.2, 5.0), (1.4, 0.0))
    ]
    a_only = [{"a": s["a"]} for s in states]
    assert robust.average_states(a_only, [1.0] * 4, RobustRule("krum", f=0))["a"].item() == (
        pytest.approx(1.2)
    )
    out = robust.average_states(states, [1.0] * 4, RobustRule("krum", f=0))
    assert out == {"a": torch.tensor([1.0]), "b": torch.tensor([0.0])}


def test_weighted_average_default_is_the_plain_code_path():
    states = states_of([1.0, 2.0], [3.0, 5.0])
    with robust.serving(ServerView(RobustRule("median"))):
        med = weighted_average(states, [1.0, 3.0])
    assert med["w"].tolist() == [2.0, 3.5]  # unweighted median of two: the midpoint
    plain = weighted_average(states, [1.0, 3.0])  # outside serving: the weighted mean
    assert plain["w"].tolist() == [2.5, 4.25]


def test_class_average_per_class_over_the_holders():
    # 3 clients, 2 classes, d = 1; class 1 is held by clients 0 and 2 only.
    vec = torch.tensor([[[1.0], [10.0]], [[2.0], [0.0]], [[9.0], [30.0]]])
    present = torch.tensor([[True, True], [True, False], [True, True]])
    w = present.double()
    out, known = robust.class_average(vec, present, w, RobustRule("median"))
    assert out.tolist() == [[2.0], [20.0]] and known.tolist() == [True, True]
    # Clipping deviations from the global row (class 0 known at 1.0; class 1 unknown).
    ref = torch.tensor([[1.0], [5.0]])
    out, _ = robust.class_average(
        vec, present, w, RobustRule("mean", clip_update_norm=1.0), ref, torch.tensor([1, 0]) > 0
    )
    # class 0: deviations 0, 1, 8 -> 0, 1, 1, mean 2/3, + 1; class 1: rows 10, 30 -> 1, 1.
    assert out[:, 0].tolist() == pytest.approx([1 + 2 / 3, 1.0])


def test_robust_points_replace_points_by_their_class_centre():
    pts = torch.tensor([[0.0], [1.0], [100.0], [5.0], [7.0]])
    labels = torch.tensor([0, 0, 0, 1, 1])
    out = robust.robust_points(pts, labels, RobustRule("median"))
    assert out.flatten().tolist() == [1.0, 1.0, 1.0, 6.0, 6.0]
    assert robust.robust_points(pts, labels, RobustRule()) is pts  # the mean: untouched


def test_magnitude_sanity_of_model_updates():
    ref = {"w": torch.tensor([3.0, 4.0])}  # norm 5
    ok = {"w": torch.tensor([3.0, 4.0 + 49.0])}  # update norm 49 <= 10 x 5
    bad = {"w": torch.tensor([3.0, 4.0 + 51.0])}
    with robust.serving(ServerView(RobustRule(max_norm_ratio=10.0))):
        robust.check_update(ok, ref, 0, "state")
        with pytest.raises(PayloadError, match=r"client 3 state: update norm 51 exceeds 10"):
            robust.check_update(bad, ref, 3, "state")
        nan = {"w": torch.tensor([math.nan, 0.0])}
        with pytest.raises(PayloadError):
            robust.check_update(nan, ref, 3, "state")
    with robust.serving(ServerView(RobustRule(max_norm_ratio=0.0))):
        robust.check_update(bad, ref, 3, "state")  # 0: off


def test_magnitude_sanity_of_rows_only_where_the_server_has_a_global_row():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])  # class 0 known (norm 5), class 1 not
    known = torch.tensor([True, False])
    with robust.serving(ServerView(RobustRule(max_norm_ratio=2.0))):
        robust.check_rows(torch.tensor([[1e30, 0.0]]), torch.tensor([1]), ref, known, 0, "p")
        robust.check_rows(torch.tensor([[3.0, 14.0]]), torch.tensor([0]), ref, known, 0, "p")
        with pytest.raises(PayloadError, match="deviates by 11"):
            robust.check_rows(torch.tensor([[3.0, 15.0]]), torch.tensor([0]), ref, known, 0, "p")


def test_claimed_classes_and_counts_against_the_partition():
    view = ServerView(num_train=(5, 3), class_counts=((5, 0), (1, 2)))
    with robust.serving(view):
        robust.check_claimed_classes(torch.tensor([True, False]), 0, "classes")
        with pytest.raises(PayloadError, match=r"claims classes \[1\]"):
            robust.check_claimed_classes(torch.tensor([True, True]), 0, "classes")
        robust.check_class_counts(torch.tensor([1, 2]), 1, "counts")
        with pytest.raises(PayloadError, match=r"counts of classes \[1\]"):
            robust.check_class_counts(torch.tensor([1, 3]), 1, "counts")
    with robust.serving(ServerView(num_train=(5, 3))):  # totals only
        with pytest.raises(PayloadError, match="sum to 4, the partition holds 3"):
            robust.check_class_counts(torch.tensor([4, 0]), 1, "counts")
    robust.check_class_counts(torch.tensor([10**8, 0]), 1, "counts")  # nothing known: no check


def test_all_finite_walks_server_states():
    assert robust.all_finite({"a": torch.ones(2), "n": torch.tensor(3)})
    assert not robust.all_finite({"a": torch.tensor([1.0, math.inf])})
    layer = torch.nn.Linear(2, 2)
    assert robust.all_finite([layer])
    with torch.no_grad():
        layer.weight[0, 0] = math.nan
    assert not robust.all_finite((1, layer))


@pytest.mark.parametrize(
    "table, message",
    [
        ({"aggregator": "mode"}, "server.aggregator = 'mode'"),
        ({"trim": 0.5}, r"server.trim = 0.5 must be in \[0, 0.5\)"),
        ({"trim": math.nan}, "server.trim = nan must be a finite number"),
        ({"f": -1}, "server.f = -1 must be >= 0"),
        ({"f": 1.5}, "server.f = 1.5 has type float"),
        ({"clip_update_norm": -1.0}, "server.clip_update_norm = -1.0 must be >= 0"),
        ({"clip_update_norm": math.inf}, "server.clip_update_norm = inf must be a finite"),
        ({"max_norm_ratio": "big"}, "server.max_norm_ratio = 'big' has type str"),
        ({"peer_factor": -1.0}, "server.peer_factor = -1.0 must be >= 0"),
        ({"peer_factor": math.nan}, "server.peer_factor = nan must be a finite number"),
        ({"peer_factor": math.inf}, "server.peer_factor = inf must be a finite number"),
        # a guard that drops every honest upload: refused, not a run that trains on nothing
        (
            {"peer_factor": 1e-9},
            "server.peer_factor = 1e-09: 0 turns the guard off, else it must be >= 2",
        ),
        ({"peer_factor": 1.5}, "server.peer_factor = 1.5: 0 turns the guard off"),
        (
            {"max_norm_ratio": 1e-9},
            "server.max_norm_ratio = 1e-09: 0 turns the check off, else it must be >= 1",
        ),
        ({"bogus": 1}, "unknown key 'server.bogus'"),
    ],
)
def test_server_table_errors_name_the_key(table, message):
    with pytest.raises(ConfigError, match=message) as info:
        from_dict({"server": table})
    assert "\n" not in str(info.value)


def test_server_table_reaches_the_rule():
    cfg = from_dict({"server": {"aggregator": "multi_krum", "f": 2, "clip_update_norm": 3}})
    assert cfg.server == RobustRule("multi_krum", f=2, clip_update_norm=3.0)
    assert from_dict({}).server.plain


# ---- a rule that does not fit the round: refused at config time, said at aggregation time ----


@pytest.mark.parametrize(
    ("server", "sizes", "message"),
    [
        ({"aggregator": "krum", "f": 1}, {}, 'server.f = 1 .* "krum" on 4 clients.* is 0'),
        ({"aggregator": "multi_krum", "f": 4}, {}, "server.f = 4 .*largest allowed is 0"),
        (
            {"aggregator": "multi_krum", "f": 4},
            {"num_clients": 20, "participation": 0.5},  # 10 a round
            "server.f = 4 .* 10 clients per round.*largest allowed is 3",
        ),
        ({"aggregator": "krum", "f": 0}, {"clients_per_round": 2}, "needs at least 3 clients"),
        (
            {"aggregator": "trimmed_mean", "trim": 0.4999999999},
            {"clients_per_round": 2},
            "server.trim = 0.4999999999 would cut every value .* below 0.5",
        ),
    ],
)
def test_a_rule_too_large_for_the_round_is_a_config_error(server, sizes, message):
    from helpers.experiments import tiny_raw

    data = {k: v for k, v in sizes.items() if k == "num_clients"}
    train = {k: v for k, v in sizes.items() if k != "num_clients"}
    with pytest.raises(ConfigError, match=message) as info:
        from_dict(tiny_raw(server=server, data=data, train=train))
    assert "\n" not in str(info.value)


def test_the_largest_allowed_values_are_accepted():
    from helpers.experiments import tiny_raw

    from_dict(tiny_raw(server={"aggregator": "multi_krum", "f": 0}))  # 4 clients: f <= 0
    from_dict(tiny_raw(server={"aggregator": "krum", "f": 1}, data={"num_clients": 5}))
    from_dict(tiny_raw(server={"aggregator": "trimmed_mean", "trim": 0.49}))


def test_fewer_contributions_than_the_rule_needs_are_said_once_per_round(caplog):
    r = RobustRule("multi_krum", f=1)
    clamped = robust.aggregate_rows(X[:4], ONES[:4], r)  # 4 <= 2f + 2: what it did before
    caplog.clear()  # outside a round that is said too (once a process): not what is tested here
    with caplog.at_level("WARNING", logger="fedmosaic"), robust.serving(ServerView(r, round_num=3)):
        got = robust.aggregate_rows(X[:4], ONES[:4], r)
        robust.aggregate_rows(X[:4], ONES[:4], r)
        robust.aggregate_rows(X, ONES, r)  # 5 > 4: fits, nothing said
    assert torch.equal(got, clamped)
    said = [rec.getMessage() for rec in caplog.records]
    assert said == [
        "round 3: multi_krum with server.f = 1 needs more than 4 contributions, got 4: scored "
        "each on its 1 nearest other(s) and kept 3"
    ]


def test_a_round_with_dropped_clients_keeps_going_and_says_what_it_did(caplog):
    from helpers.experiments import tiny_raw

    from fedmosaic.core.rounds import run_rounds
    from fedmosaic.federation import build_federation
    from fedmosaic.sim.simulator import SimTransport

    class Dropping(SimTransport):
        def fit(self, round_num, messages):
            out = super().fit(round_num, messages)
            out[0].error, out[0].upload = "gone", None  # client 0 never answers
            return out

    raw = tiny_raw(
        data={"num_clients": 5, "synthetic_shape": [1, 16, 16]},
        server={"aggregator": "multi_krum", "f": 1},
        sim={"check_wire": False},
    )
    fed = build_federation(from_dict(raw))
    transport = Dropping(
        fed.algo, fed.models, fed.extras, fed.clients, fed.settings, fed.cfg.seed,
        fed.cfg.train.local_epochs,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="fedmosaic"):
        history, _ = run_rounds(fed.algo, fed.spec, transport, fed.plan)
    assert [r["aggregated"] for r in history.rounds] == [True, True]
    for t in (1, 2):
        assert (
            f"round {t}: multi_krum with server.f = 1 needs more than 4 contributions, got 4"
            in (caplog.text)
        )
        assert caplog.text.count(f"round {t}: multi_krum with server.f = 1") == 1
