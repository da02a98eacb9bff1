"""Sequential layer expansion (fedseq_vanilla / fedseq_anti): schedule, payloads, merge, FLOPs."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch
from helpers.toyfed import TensorSource, make_toy
from torch import nn

from fedmosaic.algorithms import ALGORITHMS, build_algorithm
from fedmosaic.algorithms.fedbabu import FedBABU
from fedmosaic.algorithms.fedseq import (
    ExpansionBroadcast,
    ExpansionUpload,
    FedSeqAnti,
    FedSeqVanilla,
    active_blocks,
    body_blocks,
    default_unfreeze_rounds,
    num_unfrozen,
    paper_cost,
    trainable_prefixes,
    training_macs,
)
from fedmosaic.config import ConfigError
from fedmosaic.core import client as client_ops
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import PayloadError, encode
from fedmosaic.core.rounds import RoundPlan, run_rounds
from fedmosaic.core.training import TrainSettings, select_trainable

# ---- a hand-countable 3-block model: [1, 5, 5] -> conv1 -> conv2 -> fc1 -> head -------------------
# conv1 Conv2d(1, 2, 3): out 2x3x3 = 18 values x 9 MACs = 162 MACs per image
# conv2 Conv2d(2, 2, 2): out 2x2x2 = 8 values x 8 MACs = 64
# fc1   Linear(8, 4): 32;  head Linear(4, 3): 12.   Forward: 270 MACs per image.
SHAPE = (1, 5, 5)
NAMES = ("conv1", "conv2", "fc1")


def block_model() -> ClientModel:
    encoder = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(1, 2, 3),
            act1=nn.ReLU(),
            conv2=nn.Conv2d(2, 2, 2),
            act2=nn.ReLU(),
            flat=nn.Flatten(),
            fc1=nn.Linear(8, 4),
        )
    )
    return ClientModel(encoder, nn.Linear(4, 3), feature_dim=4, num_classes=3, arch="blocks3")


def block_spec(rounds: int = 3, num_clients: int = 2, seed: int = 0) -> FederationSpec:
    def build(client_id: int) -> ClientModel:
        seeding.seed_torch(seed, 0, client_id, "init")
        return block_model()

    return FederationSpec(
        num_clients=num_clients,
        num_classes=3,
        feature_dim=4,
        input_shape=SHAPE,
        members=("blocks3",) * num_clients,
        num_train=(20,) * num_clients,
        seed=seed,
        rounds=rounds,
        build_model=build,
    )


def block_data(client_id: int = 0, n: int = 20) -> ClientData:
    g = torch.Generator().manual_seed(7 + client_id)
    images = torch.randn(n, *SHAPE, generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    rows = torch.arange(n)
    return ClientData(client_id, TensorSource(images), labels, {"train": rows, "test": rows}, 3)


def trainable_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def block_params(*blocks: str) -> set[str]:
    return {f"encoder.{b}.{w}" for b in blocks for w in ("weight", "bias")}


# ---- schedule ------------------------------------------------------------------------------
def test_default_schedule_is_evenly_spaced_and_rounds_are_one_based():
    assert default_unfreeze_rounds(3, 300) == (0, 100, 200)  # the paper's t_1, t_2, t_3
    assert default_unfreeze_rounds(3, 2) == (0, 0, 1)
    assert default_unfreeze_rounds(1, 10) == (0,)
    u = (0, 100, 200)
    got = {t: num_unfrozen(t, u, 300) for t in (1, 100, 101, 200, 201, 300, 301)}
    assert got == {1: 1, 100: 1, 101: 2, 200: 2, 201: 3, 300: 3, 301: 3}
    assert num_unfrozen(2, (0, 5, 9), 3) == 1
    assert num_unfrozen(4, (0, 5, 9), 3) == 3  # after the last round: every block (fine-tuning)
    assert active_blocks(3, 1, "vanilla") == [0] and active_blocks(3, 1, "anti") == [2]
    assert active_blocks(3, 2, "vanilla") == [0, 1] and active_blocks(3, 2, "anti") == [1, 2]
    assert trainable_prefixes(NAMES, 2, "anti") == ("encoder.conv2", "encoder.fc1")


def test_blocks_are_the_encoders_children_with_parameters():
    assert [n for n, _ in body_blocks(block_model())] == list(NAMES)
    bad = block_model()
    bad.encoder.register_parameter("scale", nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match="outside them"):
        body_blocks(bad)


def test_registry_keys_map_to_the_right_order_and_options_are_validated():
    assert ALGORITHMS.get("fedseq_vanilla") is FedSeqVanilla
    assert ALGORITHMS.get("fedseq_anti") is FedSeqAnti
    assert FedSeqVanilla().order == "vanilla" and FedSeqAnti().order == "anti"
    assert not FedSeqVanilla.supports_heterogeneous
    assert build_algorithm(
        {"name": "fedseq_anti", "unfreeze_rounds": [0, 5, 5]}
    ).unfreeze_rounds == (
        0,
        5,
        5,
    )
    for bad in ([1, 2, 3], [0, 5, 4]):
        with pytest.raises(ConfigError, match="unfreeze_rounds"):
            build_algorithm({"name": "fedseq_vanilla", "unfreeze_rounds": bad})
    with pytest.raises(ConfigError, match="finetune_part"):
        build_algorithm({"name": "fedseq_vanilla", "finetune_part": "body"})
    with pytest.raises(ValueError, match="3 blocks"):
        FedSeqVanilla(unfreeze_rounds=(0, 1)).init_server(block_spec())


@pytest.mark.parametrize(
    ("algo", "expected"),
    [
        (FedSeqVanilla(), {1: ("conv1",), 2: ("conv1", "conv2"), 3: NAMES}),
        (FedSeqAnti(), {1: ("fc1",), 2: ("conv2", "fc1"), 3: NAMES}),
    ],
)
def test_requires_grad_per_round_via_phases_and_select_trainable(algo, expected):
    spec = block_spec(rounds=3)  # default schedule (0, 1, 2): round t trains t blocks
    state = algo.init_server(spec)
    assert state.unfreeze_rounds == (0, 1, 2)
    model = spec.build_model(1)
    extras = algo.init_client(model, spec, block_data())
    x, y = torch.randn(4, *SHAPE), torch.tensor([0, 1, 2, 0])
    for t, blocks in expected.items():
        msg = algo.broadcast(state, 1, t)
        assert msg.num_active == len(blocks) and msg.order == algo.order
        (phase,) = algo.phases(t, 1)
        select_trainable(model, extras, phase)
        assert trainable_names(model) == {n for n in block_params(*NAMES)}  # the body
        loss = algo.loss(model, extras, x, y, msg)  # switches the frozen blocks off
        assert trainable_names(model) == block_params(*blocks)  # never the head
        loss.backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None) == (name in block_params(*blocks)), name
            p.grad = None


@pytest.mark.parametrize("algo", [FedSeqVanilla(), FedSeqAnti()])
def test_upload_carries_only_unfrozen_blocks_and_grows(algo):
    spec = block_spec(rounds=3)
    state = algo.init_server(spec)
    data = block_data()
    model = spec.build_model(0)
    extras = algo.init_client(model, spec, data)
    settings = TrainSettings(batch_size=5, lr=0.1)
    sizes = []
    for t in (1, 2, 3):
        msg = algo.broadcast(state, 0, t)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = client_ops.fit(algo, model, extras, msg, data, settings, 0, t, 1)
        blocks = [NAMES[i] for i in active_blocks(3, t, algo.order)]
        expected_keys = {f"{b}.{w}" for b in blocks for w in ("weight", "bias")}
        assert set(out.upload.state) == expected_keys and set(msg.state) == expected_keys
        assert out.upload.num_active == t
        after = model.state_dict()
        for k in before:
            changed = not torch.equal(before[k], after[k])
            trained = k.startswith("encoder.") and k.removeprefix("encoder.") in expected_keys
            assert changed == trained, (t, k)  # frozen blocks and the head do not move
        sizes.append(len(encode(out.upload)))
        # 20 examples, batch 5, one epoch: 20 examples at the FLOPs of this stage
        assert out.upload.train_macs == training_macs(
            model, SHAPE, trainable_prefixes(NAMES, t, algo.order), 20
        )
        # the paper's Table 4 measure: trainable parameters x examples
        assert out.upload.paper_cost == paper_cost(
            model, trainable_prefixes(NAMES, t, algo.order), 20
        )
        algo.validate_upload(state, out.upload, 0)
        state = algo.aggregate(state, [Weighted(0, 20.0, out.upload)], t)
    assert sizes[0] < sizes[1] < sizes[2]


def test_server_merge_averages_unfrozen_blocks_and_keeps_frozen_ones():
    algo = FedSeqVanilla()
    state = algo.init_server(block_spec(rounds=3))
    body0 = {k: v.clone() for k, v in state.body.items()}
    w_shape, b_shape = state.body["conv1.weight"].shape, state.body["conv1.bias"].shape

    def upload(w: float, b: float, num_active: int = 1) -> ExpansionUpload:
        s = {"conv1.weight": torch.full(w_shape, w), "conv1.bias": torch.full(b_shape, b)}
        return ExpansionUpload(s, num_active, 100, 50)

    a, b = upload(1.0, 2.0), upload(5.0, -2.0)
    for u in (a, b):
        algo.validate_upload(state, u, 0)
    stale = Weighted(2, 50.0, ExpansionUpload(dict(b.state), 2, 0, 0))  # another stage: ignored
    new = algo.aggregate(state, [Weighted(0, 1.0, a), Weighted(1, 3.0, b), stale], round_num=1)
    # (1 * 1 + 3 * 5) / 4 = 4 ; (1 * 2 + 3 * -2) / 4 = -1
    assert torch.equal(new.body["conv1.weight"], torch.full(w_shape, 4.0))
    assert torch.equal(new.body["conv1.bias"], torch.full(b_shape, -1.0))
    for k in ("conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias"):
        assert torch.equal(new.body[k], body0[k])
    assert torch.equal(state.body["conv1.weight"], body0["conv1.weight"])  # input not mutated
    # the next broadcast carries the merged block
    msg = algo.broadcast(new, 0, 1)
    assert torch.equal(msg.state["conv1.weight"], torch.full(w_shape, 4.0))


def test_validate_upload_rejects_wrong_blocks_shapes_and_counts():
    algo = FedSeqAnti()
    state = algo.init_server(block_spec(rounds=3))
    good = {k: state.body[k].clone() for k in ("fc1.weight", "fc1.bias")}
    algo.validate_upload(state, ExpansionUpload(good, 1, 0, 0), 3)
    with_frozen = dict(good, **{"conv1.bias": state.body["conv1.bias"]})
    bad_shape = dict(good, **{"fc1.bias": torch.zeros(5)})
    cases = [
        ExpansionUpload(with_frozen, 1, 0, 0),  # a frozen block in the upload
        ExpansionUpload(good, 2, 0, 0),  # claims two blocks, carries one
        ExpansionUpload(bad_shape, 1, 0, 0),
        ExpansionUpload(good, 0, 0, 0),
        ExpansionUpload(good, 4, 0, 0),
        ExpansionUpload(good, 1, -1, 0),
        ExpansionUpload(good, 1, 0, -1),
    ]
    for u in cases:
        with pytest.raises(PayloadError):
            algo.validate_upload(state, u, 3)


def test_receive_loads_only_the_unfrozen_blocks():
    algo = FedSeqVanilla()
    spec = block_spec(rounds=3)
    state = algo.init_server(spec)
    model = spec.build_model(1)
    extras = algo.init_client(model, spec, block_data())
    head0 = model.head.weight.clone()
    msg = ExpansionBroadcast(
        {k: torch.ones_like(state.body[k]) for k in NAME_KEYS[:2]}, 1, "vanilla"
    )
    algo.receive(model, extras, msg)
    assert torch.equal(model.encoder.conv1.weight, torch.ones_like(model.encoder.conv1.weight))
    assert torch.equal(model.encoder.conv2.weight, state.body["conv2.weight"])
    assert torch.equal(model.head.weight, head0)
    with pytest.raises(ValueError):
        algo.receive(model, extras, dataclasses.replace(msg, order="anti"))


NAME_KEYS = ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias")


# ---- FLOPs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("trainable", "per_image"),
    [
        # backward = weight grads of trained layers + input grads of layers above the lowest one
        (("all",), 270 + 162 + (64 + 64) + (32 + 32) + (12 + 12)),
        (("encoder",), 270 + 162 + (64 + 64) + (32 + 32) + 12),
        (("encoder.conv1",), 270 + 162 + 64 + 32 + 12),  # vanilla, stage 1
        (("encoder.fc1",), 270 + 32 + 12),  # anti, stage 1
        (("encoder.conv2", "encoder.fc1"), 270 + 64 + (32 + 32) + 12),  # anti, stage 2
        (("head",), 270 + 12),
        ((), 0),  # nothing trains: no step
    ],
)
def test_training_macs_hand_counted(trainable, per_image):
    model = block_model()
    model.train()
    model.encoder.conv2.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert training_macs(model, SHAPE, trainable, 7) == per_image * 7
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # restored
    assert model.training


def test_paper_table4_costs_reproduced():
    """Jang & Choi Table 3/4: shallow CNN, 500 examples x 10 clients per round, 300 rounds."""
    encoder = nn.Sequential(
        OrderedDict(
            conv1=nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2)),
            conv2=nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2)),
            flat=nn.Flatten(),
            fc1=nn.Sequential(nn.Linear(1024, 512), nn.ReLU()),
        )
    )
    model = ClientModel(encoder, nn.Linear(512, 10), 512, 10)
    assert sum(p.numel() for p in model.parameters()) == 582_026
    per_round = 500 * 10
    assert paper_cost(model, ("all",), per_round) * 300 == 873_039_000_000  # FedAvg
    assert paper_cost(model, ("encoder",), per_round) * 300 == 865_344_000_000  # FedBABU
    names = [n for n, _ in body_blocks(model)]
    schedule = default_unfreeze_rounds(len(names), 300)
    for order, total in (("vanilla", 314_912_000_000), ("anti", 838_880_000_000)):
        cost = sum(
            paper_cost(
                model, trainable_prefixes(names, num_unfrozen(t, schedule, 300), order), per_round
            )
            for t in range(1, 301)
        )
        assert cost == total, order
    # Our FLOPs for the same model and stage (1 MAC = 1 FLOP): conv1 24x24x32 outputs x 25 MACs,
    # conv2 8x8x64 x 800, fc1 1024 x 512, head 512 x 10.
    conv1, conv2, fc1, head = 460_800, 3_276_800, 524_288, 5_120
    forward = conv1 + conv2 + fc1 + head
    vanilla1 = forward + conv1 + conv2 + fc1 + head
    assert training_macs(model, (1, 28, 28), ("encoder.conv1",), 1) == vanilla1


# ---- federations -----------------------------------------------------------------------------
def run_toy_rounds(algo, rounds: int, finetune_epochs: int = 0):
    """The shared toy federation (2 body blocks: encoder.1, encoder.3), ``rounds`` rounds."""
    fed = make_toy(algo)
    spec = dataclasses.replace(fed.spec, rounds=rounds)
    plan = RoundPlan(spec.num_clients, rounds, spec.num_clients, 1, finetune_epochs)
    fed.history, fed.state = run_rounds(algo, spec, fed.transport, plan)
    return fed


def _numbers(fed):
    rounds = [(r["acc_weighted"], r["train_loss"]) for r in fed.history.rounds]
    tuned = [r.counts for r in fed.history.finetune_eval]
    return rounds, tuned


@pytest.mark.parametrize("cls", [FedSeqVanilla, FedSeqAnti])
@pytest.mark.golden
def test_full_schedule_trains_exactly_like_fedbabu(cls):
    """Every block unfrozen from round 1 == FedBABU (layer expansion's last stage)."""
    babu = run_toy_rounds(FedBABU(finetune_epochs=1), rounds=3, finetune_epochs=-1)
    seq = run_toy_rounds(
        cls(unfreeze_rounds=(0, 0), finetune_epochs=1), rounds=3, finetune_epochs=-1
    )
    assert _numbers(seq) == _numbers(babu)
    assert seq.history.finetune_eval  # fine-tuning ran and was evaluated
    for a, b in zip(seq.models, babu.models):
        for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), k
    for k, v in babu.state.items():
        assert torch.equal(seq.state.body[k], v)
    staged = run_toy_rounds(cls(finetune_epochs=1), rounds=3, finetune_epochs=-1)
    assert _numbers(staged) != _numbers(babu)


@pytest.mark.parametrize("cls", [FedSeqVanilla, FedSeqAnti])
@pytest.mark.integration
def test_toy_federation_end_to_end_with_wire_check(cls):
    fed = run_toy_rounds(cls(), rounds=3, finetune_epochs=1)  # schedule (0, 1): 1, 2, 2 blocks
    recs = fed.history.rounds
    assert all(r["rejected"] == [] for r in recs)
    assert recs[0]["bytes_up"] < recs[1]["bytes_up"] == recs[2]["bytes_up"]
    assert recs[0]["bytes_down"] < recs[1]["bytes_down"]
    init_head = fed.spec.build_model(0).head.weight
    assert len(fed.history.finetune_eval) == 3
    for m in fed.models:  # fine-tuning (whole model) moved every head away from the shared init
        assert not torch.equal(m.head.weight, init_head)


# ---- with the model zoo (runs once fedmosaic.models exists) ----------------------------------
def zoo_or_skip() -> None:
    models = pytest.importorskip("fedmosaic.models")
    if not hasattr(models, "family_members"):
        pytest.skip("the model zoo (fedmosaic.models) is not there yet")


@pytest.mark.parametrize("name", ["fedseq_vanilla", "fedseq_anti"])
@pytest.mark.integration
def test_three_rounds_on_the_zoo_with_wire_check(name):
    zoo_or_skip()
    from helpers.experiments import tiny_raw

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(
        model={"family": "shallowcnn"},
        train={"rounds": 3, "finetune_epochs": 1},
        algorithm={"name": name},
    )
    doc = run_experiment(from_dict(raw), progress=False)
    rounds = doc["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["rejected"] == [] for r in rounds)
    # shallowcnn: 3 blocks (conv1, conv2, fc1), 3 rounds -> 1, 2, 3 blocks travel
    ups = [r["bytes_up"] for r in rounds]
    assert ups[0] < ups[1] < ups[2]
    assert "after_finetune" in doc["summary"]
    # The paper's compute accounting reaches the round records and the summary: training FLOPs
    # summed over clients; Vanilla's growing stack costs more every round, Anti's first round
    # (only fc1 trains, no backward through the convs) is the cheapest of all.
    flops = [r["train_macs"] for r in rounds]
    assert all(f > 0 for f in flops) and flops[0] < flops[1] < flops[2]
    assert doc["summary"]["train_macs_total"] == sum(flops)
    babu = run_experiment(from_dict({**raw, "algorithm": {"name": "fedbabu"}}), progress=False)
    full = [r["train_macs"] for r in babu["rounds"]]
    assert full[0] == full[1] == full[2] == flops[2]
    # The paper's measure (trainable parameters x examples) sums the same way, under its own name.
    cost = [r["paper_cost"] for r in rounds]
    assert doc["summary"]["paper_cost_total"] == sum(cost)
    assert [r["paper_cost"] for r in babu["rounds"]][0] == cost[2]


@pytest.mark.unit
def test_fine_tuning_after_an_early_stop_unfreezes_every_block():
    """A plateau stop at round 2 of 6: the broadcast after the rounds is past the last round, so
    the clients fine-tune (and newcomers train) with every block unfrozen, as after round 6."""
    from fedmosaic.core import rounds as rounds_mod

    algo = FedSeqVanilla(finetune_epochs=1)
    state = algo.init_server(block_spec(rounds=6))
    plan = RoundPlan(2, 6, 2, holdout=(1,))
    seen: list[dict[int, ExpansionBroadcast]] = []

    class Capture:
        def finetune(self, msgs, phases):
            seen.append(msgs)

        def evaluate(self, round_num, msgs, receive=True):
            seen.append(msgs)
            return []

        def fit(self, round_num, msgs):
            return []

    history = rounds_mod.History()
    rounds_mod.finetune(algo, state, Capture(), plan, history, 3)  # stopped after round 2
    rounds_mod.serve_newcomers(algo, state, Capture(), plan, history, 3)
    assert seen and all(m.num_active == 3 for msgs in seen for m in msgs.values())
    assert algo.broadcast(state, 0, 3).num_active == 2  # round 3 itself: 2 of 3 (schedule 0, 2, 4)
