"""Client-level differential privacy of the uploads (``core/privacy.py``): the release of one
upload by hand, the class set fixed by the protocol, the projection onto the schema, the
config's refusals, and every registered method run under the local and central mechanisms (or
refused with its reason), with the same numbers on the simulator's backends and over Flower."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Annotated

import pytest
import torch
from helpers.experiments import SMALL, tiny_raw
from torch import Tensor

from fedmosaic import api
from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.checkpoint import CheckpointPolicy
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import privacy, schema, seeding
from fedmosaic.core.payload import Payload
from fedmosaic.core.schema import Claims, Counts, Rows, Unguarded, Update, Whole

torch.set_num_threads(1)


@dataclass(frozen=True)
class Both(Payload):
    state: Annotated[dict[str, Tensor], "like shared", Update("shared")]
    protos: Annotated[Tensor, "[C, 2] float32", Rows(where="counts")]
    counts: Annotated[Tensor, "[C] int64 >= 0", Counts()]


@dataclass(frozen=True)
class Listed(Payload):
    protos: Annotated[Tensor, "[k, 2] float32", Rows(classes="classes")]
    classes: Annotated[Tensor, "[k] int64 increasing in [0, C)", Claims()]


@dataclass(frozen=True)
class Soft(Payload):
    soft: Annotated[Tensor, "[P, 3] float32 in [0, 1] rows sum 1", Whole()]
    kernel: Annotated[Tensor, "[2, 2] float32 symmetric diag >= 0", Unguarded("scale")]
    cost: Annotated[int, "int >= 0"]


def both() -> Both:
    return Both(
        state={"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(7)},
        protos=torch.tensor([[9.0, 9.0], [0.0, 0.0], [0.0, 0.0]]),
        counts=torch.tensor([0, 5, 2]),
    )


REF = {"state": {"w": torch.zeros(2), "n": torch.tensor(1)}}


def test_release_without_noise_clips_the_private_floats_as_one_vector():
    # the class with no examples sends a zero row; the update [3, 4] and rows [0, 0], [0, 0]
    # make one vector of norm 5: clip 1 scales everything by 1/5
    out = privacy.release(both(), REF, clip=1.0, sd=0.0, generator=torch.Generator(), num_classes=3)
    assert torch.equal(out.state["w"], torch.tensor([0.6, 0.8]))
    assert torch.equal(out.state["n"], torch.tensor(1))  # the counter: the reference's
    assert torch.equal(out.protos, torch.zeros(3, 2))
    assert torch.equal(out.counts, torch.ones(3, dtype=torch.int64))  # the class set fixed
    # with real rows: [3, 4] and [0, 12] -> norm 13; clip 26 leaves them as they are
    up = Both({"w": torch.tensor([3.0, 4.0])}, torch.tensor([[0.0, 12.0]]), torch.tensor([1]))
    out = privacy.release(up, {"state": {"w": torch.zeros(2)}}, 26.0, 0.0, torch.Generator(), 1)
    assert torch.equal(out.protos, torch.tensor([[0.0, 12.0]]))
    out = privacy.release(up, {"state": {"w": torch.zeros(2)}}, 6.5, 0.0, torch.Generator(), 1)
    assert torch.allclose(out.protos, torch.tensor([[0.0, 6.0]]))
    assert torch.allclose(out.state["w"], torch.tensor([1.5, 2.0]))


def test_release_adds_the_seeded_gaussian_noise_in_field_order():
    sd = 0.25
    out = privacy.release(both(), REF, 1.0, sd, seeding.torch_generator(3, 2, 1, "dp-local"), 3)
    gen = seeding.torch_generator(3, 2, 1, "dp-local")
    noise_w = seeding.randn(2, generator=gen) * sd
    noise_rows = seeding.randn(6, generator=gen).view(3, 2) * sd
    assert torch.equal(out.state["w"], torch.tensor([0.6, 0.8]) + noise_w)
    assert torch.equal(out.protos, noise_rows)
    # the update is relative to the reference
    ref = {"state": {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(1)}}
    up = Both(
        {"w": torch.tensor([4.0, 5.0]), "n": torch.tensor(3)}, torch.zeros(3, 2), both().counts
    )
    out = privacy.release(up, ref, 1.0, 0.0, torch.Generator(), 3)
    assert torch.allclose(out.state["w"], torch.tensor([1.6, 1.8]))


def test_class_ids_are_densified_to_every_class():
    up = Listed(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1, 3]))
    out = privacy.release(up, {}, 10.0, 0.0, torch.Generator(), 4)
    assert torch.equal(out.classes, torch.arange(4))
    assert torch.equal(out.protos, torch.tensor([[0.0, 0], [1, 0], [0, 0], [0, 1]]))
    schema.check(out, 0, C=4)  # still a valid upload


def test_noisy_values_are_projected_onto_their_schema():
    gen = torch.Generator().manual_seed(0)
    up = Soft(torch.full((5, 3), 1 / 3), torch.eye(2), cost=12)
    out = privacy.release(up, {}, 1.0, 2.0, gen, 3)
    schema.check(out, 0)  # in [0, 1], rows sum to 1, symmetric, non-negative diagonal
    assert out.cost == 12
    assert not torch.allclose(out.soft, up.soft)  # the noise is there


def test_state_dicts_that_are_not_updates_and_compressed_updates_have_no_release():
    @dataclass(frozen=True)
    class Bare(Payload):
        state: Annotated[dict[str, Tensor], "like shared"]

    with pytest.raises(privacy.PrivacyError, match="not an Update"):
        privacy.release_plan(Bare)
    with pytest.raises(privacy.PrivacyError, match="ranks depend"):
        privacy.check_releasable(
            ALGORITHMS.get("fedkd").Upload, ALGORITHMS.get("fedkd").privacy_refusal
        )


# ---- the config ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mechanism", "locl", "did you mean 'local'"),
        ("clip", 0.0, "must be > 0"),
        ("clip", float("nan"), "finite"),
        ("noise_multiplier", -1.0, ">= 0"),
        ("delta", 1.0, "in \\(0, 1\\)"),
        ("accountant", "moments", "rdp, pld"),
        ("clip", "1", "expected float"),
    ],
)
def test_bad_privacy_values_are_refused_in_one_line(key, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(tiny_raw(privacy={"mechanism": "local", key: value}))


def test_the_config_refuses_what_the_mechanism_cannot_cover():
    with pytest.raises(ConfigError, match="only averages"):
        from_dict(tiny_raw(algorithm={"name": "fedtgp"}, privacy={"mechanism": "central"}))
    with pytest.raises(ConfigError, match="ranks depend"):
        from_dict(tiny_raw(algorithm={"name": "fedkd"}, privacy={"mechanism": "local"}))
    with pytest.raises(ConfigError, match="plain sum"):
        from_dict(tiny_raw(privacy={"mechanism": "central"}, server={"aggregator": "median"}))
    with pytest.raises(ConfigError, match='use privacy.accountant = "rdp"'):
        from_dict(
            tiny_raw(
                privacy={"mechanism": "central", "accountant": "pld"},
                train={"clients_per_round": 2},
            )
        )
    with pytest.raises(ConfigError, match="without noise"):
        from_dict(
            tiny_raw(privacy={"mechanism": "local", "noise_multiplier": 0.0, "target_epsilon": 4.0})
        )


# ---- every registered method ------------------------------------------------------------------
METHODS = ALGORITHMS.names()
TRAIN = {"fedclassavg": {"lr": 0.01}}


def private_run(
    name: str,
    mechanism: str,
    privacy: dict | None = None,
    train: dict | None = None,
    sim: dict | None = None,
) -> api.Result:
    raw = tiny_raw(
        algorithm={"name": name},
        data=SMALL,
        train={"rounds": 2, **TRAIN.get(name, {}), **(train or {})},
        privacy={"mechanism": mechanism, "clip": 1.0, "noise_multiplier": 0.5, **(privacy or {})},
        sim={
            "check_wire": False,
            "progress": False,
            "threads": 1,
            "backend": "serial",
            **(sim or {}),
        },
    )
    return api.run(from_dict(raw))


@pytest.mark.parametrize("mechanism", ["local", "central"])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_under_both_mechanisms_or_is_refused_with_its_reason(name, mechanism):
    algo = ALGORITHMS.get(name)
    if algo.privacy_refusal or (mechanism == "central" and not algo.server_sums):
        with pytest.raises(ConfigError, match=r"\[privacy\]|only averages"):
            private_run(name, mechanism)
        return
    # a little noise: enough to change every number, not enough to break a tiny CNN
    result = private_run(name, mechanism, privacy={"noise_multiplier": 0.05})
    eps = [r["epsilon"] for r in result.rounds]
    if not algo.communicates:  # Local: nothing leaves a client
        assert eps == [0.0, 0.0]
        return
    assert len(eps) == 2 and 0 < eps[0] < eps[1] < math.inf, eps
    assert math.isfinite(result.rounds[-1]["acc_weighted"])
    assert all(r["aggregated"] for r in result.rounds), name  # the released uploads are usable
    assert not any(r["rejected"] for r in result.rounds), name  # and pass the guard


@pytest.mark.parametrize("mechanism", ["local", "central"])
def test_the_noise_is_the_same_on_every_backend(mechanism):
    serial = private_run("fedproto", mechanism, sim={"backend": "serial"})
    procs = private_run("fedproto", mechanism, sim={"backend": "processes", "workers": 2})
    keys = ("acc_weighted", "train_loss", "epsilon")
    assert [[r[k] for k in keys] for r in serial.rounds] == [
        [r[k] for k in keys] for r in procs.rounds
    ]


def test_the_run_stops_before_the_round_that_would_pass_its_target_epsilon():
    one = private_run("fedavg", "central", train={"rounds": 5})
    eps = [r["epsilon"] for r in one.rounds]
    target = (eps[2] + eps[3]) / 2
    capped = private_run(
        "fedavg", "central", train={"rounds": 5}, privacy={"target_epsilon": target}
    )
    assert [r["epsilon"] for r in capped.rounds] == eps[:3]


def test_the_privacy_page_lists_every_method_with_what_it_supports():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    section = page.split("## Methods", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    listed: dict[str, tuple[bool, bool]] = {}
    for row in table[1:]:
        names, local, central = (c.strip() for c in row.strip("|").split("|"))
        for n in names.split(","):
            listed[n.strip()] = (local == "yes", central == "yes")
    built_in = [n for n, c in ALGORITHMS.items() if c.__module__.startswith("fedmosaic.")]
    want = {}
    for n in built_in:
        algo = ALGORITHMS.get(n)
        ok = not algo.privacy_refusal
        want[n] = (ok, ok and algo.server_sums)
    assert listed == want


@pytest.mark.parametrize("mechanism", ["local", "central"])
def test_a_resumed_private_run_has_the_numbers_and_epsilon_of_an_uninterrupted_one(
    mechanism, tmp_path, monkeypatch
):
    from helpers.experiments import round_numbers, run_until_round

    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(
        algorithm={"name": "fedproto"},
        train={"rounds": 3, "participation": 0.5},
        privacy={"mechanism": mechanism, "clip": 1.0, "noise_multiplier": 0.5},
        sim={"check_wire": False, "progress": False, "threads": 1, "backend": "serial"},
    )
    cfg = from_dict(raw)
    ref = run_experiment(cfg, progress=False)
    run_until_round(cfg, 2, tmp_path, monkeypatch)
    got = run_experiment(cfg, progress=False, checkpoint=CheckpointPolicy(tmp_path, resume=True))
    assert round_numbers(got) == round_numbers(ref)
    eps = [r["epsilon"] for r in ref["rounds"]]
    assert eps == sorted(eps) and got["summary"]["epsilon"] == eps[-1]


@pytest.mark.parametrize(("mechanism", "per_round"), [("central", 4), ("central", 2), ("local", 2)])
def test_privacy_epsilon_solves_the_noise_that_ends_the_planned_rounds_there(mechanism, per_round):
    from fedmosaic.core import accountant

    cfg = from_dict(
        tiny_raw(
            privacy={"mechanism": mechanism, "epsilon": 4.0},
            train={"rounds": 5, "clients_per_round": per_round},
        )
    )
    z = cfg.privacy.noise_multiplier
    spent = accountant.epsilon(mechanism, "rdp", z, 1e-5, 5, 4, per_round)
    assert 4.0 * (1 - 1e-3) < spent <= 4.0
    assert accountant.epsilon(mechanism, "rdp", z * 0.999, 1e-5, 5, 4, per_round) > 4.0
    with pytest.raises(ConfigError, match="needs privacy.mechanism"):
        from_dict(tiny_raw(privacy={"epsilon": 4.0}))


def test_under_the_central_mechanism_the_peer_guard_is_off_and_says_so(caplog, monkeypatch):
    # Its drops depend on the other clients' uploads, which the accounting does not cover: a
    # client whose upload would be dropped as 50 x its peers' is kept (the clip bounds it).
    from fedmosaic.core import robust

    seen: list[float] = []
    original = robust.peer_screen

    def spy(view, uploads, suspects=()):
        seen.append(view.rule.peer_factor)
        return original(view, uploads, suspects)

    monkeypatch.setattr(robust, "peer_screen", spy)
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        private_run("fedavg", "central", privacy={"noise_multiplier": 0.05})
    assert seen == [0.0, 0.0]
    assert "privacy.mechanism = central: the peer guard is off" in caplog.text
    seen.clear()
    private_run("fedavg", "local", privacy={"noise_multiplier": 0.05})
    assert seen == [10.0, 10.0]  # the local mechanism keeps it (each upload is already private)
