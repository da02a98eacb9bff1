"""Sequential layer expansion (Jang & Choi, 2024) on FedBABU: Vanilla and Anti scheduling.

Jang, Choi. Personalized Federated Learning via Sequential Layer Expansion in Representation
Learning. 2024.

As FedBABU (``fedbabu.py``): the head stays at the shared random initialization during the rounds
and every client fine-tunes after the last round. The body is split into ``B`` ordered blocks - the
encoder's top-level children that have parameters, in forward order (the paper's shallow CNN:
conv1, conv2, fc1) - which become trainable one after another: ``fedseq_vanilla`` from the input
side (block 0 first), ``fedseq_anti`` from the head side (block B-1 first). Shared: only the
unfrozen blocks (parameters and buffers), both directions, sample-weighted average; the server
keeps the full body and merges the averaged blocks into it. Frozen blocks never travel: they stay
at the shared initialization on every client and on the server until they unfreeze.
BatchNorm running statistics of the unfrozen blocks are thus averaged with the weights (float
buffers by sample weight, ``num_batches_tracked`` the maximum); there is no ``bn`` option.

Schedule (``unfreeze_rounds``, one entry per block in unfreezing order): the k-th block to unfreeze
trains in round t (1-based) iff ``t > unfreeze_rounds[k]``, i.e. the entry is the number of rounds
completed before the block first trains (Algorithm 1's "current round > t_k"). The paper's points
are absolute rounds, 0, 100 and 200 whatever R (also in its 1000-round runs): at R = 100 they
would train only the first block during the rounds. Our default, our choice, spaces them evenly,
``floor(k R / B)`` (0, 33, 66 at R = 100): each phase keeps its share of the rounds, and so Table
4's cost ratio, at any R, and it equals the paper's at R = 300. ``unfreeze_rounds = [0, 100,
200]`` gives the paper's. After the rounds (final evaluation, fine-tuning, newcomers) every block is
unfrozen, also when a plateau stopped the run before round R.
The broadcast carries ``num_active`` (and ``order``) so clients know which blocks train and upload.

Compute: uploads carry ``paper_cost``, this round's cost in the paper's Table 4 measure (trainable
parameters x examples processed, which the paper calls FLOPs), and ``train_macs``, the forward +
backward multiply-accumulates of Conv/Linear layers (``models/flops.py``); the report shows both under
their own names, the paper's as the compute column. There is no public reference
code. Choices of ours:
- freezing: phases train the encoder; the loss sets ``requires_grad=False`` on the frozen blocks
  before each forward (``phases()`` sees neither the model nor the broadcast, so ``Phase.trainable``
  cannot name them). Their gradients are never computed and the optimizer skips them (no update,
  no weight decay, no momentum), as the paper's "freezing gradients ... preventing computation".
- frozen blocks' BatchNorm layers stay in eval mode (running statistics frozen too), so a frozen
  block equals its initialization exactly; the paper's shallow CNN has no BatchNorm.
- the head is frozen with ``requires_grad=False``, as the paper (FedBABU's code uses lr 0).
- the paper gives batch 10 and lr 0.005 only: ``finetune_epochs = 5`` (it leaves the fine-tuning
  rounds unspecified) is ours, as are the suites' 1 local epoch and momentum 0.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._shared import weighted_average
from fedmosaic.algorithms.fedbabu import (
    BODY,
    FinetunePart,
    RoundCounter,
    check_finetune,
    finetune_phase,
    start_from_server_init,
)
from fedmosaic.core import schema, secure
from fedmosaic.core.algorithm import (
    Acceleration,
    Algorithm,
    FederationSpec,
    FitContext,
    Phase,
    Weighted,
)
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Update
from fedmosaic.models.flops import paper_cost, training_macs

__all__ = [
    "FedSeqAnti",
    "FedSeqVanilla",
    "SequentialLayerExpansion",
    "active_blocks",
    "body_blocks",
    "default_unfreeze_rounds",
    "num_unfrozen",
    "paper_cost",
    "trainable_prefixes",
    "training_macs",
]

log = logging.getLogger("fedmosaic")
ORDERS = ("vanilla", "anti")


@dataclass(frozen=True)
class ExpansionBroadcast(Payload):
    state: dict[str, Tensor]  # server body state of the unfrozen blocks (keys relative to encoder)
    num_active: int  # unfrozen blocks this round, 1..B, counted in unfreezing order
    order: str  # vanilla | anti: which end of the body unfreezes first


@dataclass(frozen=True)
class ExpansionUpload(Payload):
    # the unfrozen blocks' body state only; an update of those blocks of the server's body
    state: Annotated[dict[str, Tensor], "like blocks", Update("body")]
    num_active: Annotated[int, "int in [1, B]"]  # the broadcast's num_active: which blocks
    train_macs: Annotated[int, "int >= 0"]  # this round's forward + backward MACs (models.flops)
    # this round's Table 4 cost: trainable parameters x examples (models.flops.paper_cost)
    paper_cost: Annotated[int, "int >= 0"]


@dataclass
class ExpansionState:
    body: dict[str, Tensor]  # full encoder state; frozen blocks stay at the initialization
    block_keys: tuple[tuple[str, ...], ...]  # per block (forward order): its keys in ``body``
    unfreeze_rounds: tuple[int, ...]  # resolved schedule, one entry per block, unfreezing order
    rounds: int  # R: after it every block counts as unfrozen (final evaluation, fine-tuning)


# ---- the block split and the schedule: pure functions -------------------------------------------
def _param_children(model: ClientModel) -> list[tuple[str, nn.Module]]:
    return [
        (n, m) for n, m in model.encoder.named_children() if next(m.parameters(), None) is not None
    ]


def body_blocks(model: ClientModel) -> list[tuple[str, nn.Module]]:
    """The body's blocks in forward order: the encoder's top-level children with parameters.

    Raises ``ValueError`` if some encoder parameter belongs to no block (a parameter held by the
    encoder itself rather than by a child) or if there is no block at all.
    """
    blocks = _param_children(model)
    covered = {f"{n}.{k}" for n, m in blocks for k, _ in m.named_parameters()}
    loose = [k for k, _ in model.encoder.named_parameters() if k not in covered]
    if loose or not blocks:
        raise ValueError(
            f"layer expansion needs an encoder made of top-level blocks; model {model.arch!r} "
            f"has blocks {[n for n, _ in blocks]} and parameters outside them: {loose[:5]}"
        )
    return blocks


def default_unfreeze_rounds(num_blocks: int, rounds: int) -> tuple[int, ...]:
    """Evenly spaced: ``floor(k R / B)`` rounds completed before the k-th block trains."""
    return tuple(k * rounds // num_blocks for k in range(num_blocks))


def num_unfrozen(round_num: int, unfreeze_rounds: Sequence[int], rounds: int) -> int:
    """Blocks trainable in 1-based round ``round_num``; every block after the last round."""
    if round_num > rounds:
        return len(unfreeze_rounds)
    return sum(1 for u in unfreeze_rounds if u < round_num)


def active_blocks(num_blocks: int, num_active: int, order: str) -> list[int]:
    """Forward-order indices of the unfrozen blocks."""
    if order == "vanilla":
        return list(range(num_active))
    if order == "anti":
        return list(range(num_blocks - num_active, num_blocks))
    raise ValueError(f"order = {order!r}; choose one of {', '.join(ORDERS)}")


def trainable_prefixes(block_names: Sequence[str], num_active: int, order: str) -> tuple[str, ...]:
    """``Phase.trainable`` entries of the unfrozen blocks, e.g. ``("encoder.conv1",)``."""
    return tuple(
        f"encoder.{block_names[i]}" for i in active_blocks(len(block_names), num_active, order)
    )


def _block_keys(model: ClientModel, names: Sequence[str]) -> list[tuple[str, ...]]:
    keys = list(model.encoder.state_dict())
    return [tuple(k for k in keys if k.startswith(n + ".")) for n in names]


def _active_keys(block_keys: Sequence[Sequence[str]], num_active: int, order: str) -> list[str]:
    return [k for i in active_blocks(len(block_keys), num_active, order) for k in block_keys[i]]


def freeze_inactive(model: ClientModel, num_active: int, order: str) -> None:
    """``requires_grad=False`` and eval-mode normalization layers for every frozen block."""
    blocks = _param_children(model)
    on = set(active_blocks(len(blocks), num_active, order))
    for i, (_, block) in enumerate(blocks):
        if i in on:
            continue
        for p in block.parameters():
            p.requires_grad_(False)
        for m in block.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase):
                m.eval()  # no running-statistics updates in a frozen block


# ---- the algorithm --------------------------------------------------------------------------
@dataclass(frozen=True)
class SequentialLayerExpansion(Algorithm[ExpansionState, ExpansionBroadcast, ExpansionUpload]):
    """FedBABU whose body blocks unfreeze one after another (``order`` set by the subclass)."""

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    supports_heterogeneous: ClassVar[bool] = False
    paper: ClassVar[str] = (
        "Jang & Choi, Personalized Federated Learning via Sequential Layer Expansion in Representation Learning, 2024"
    )
    order: ClassVar[str] = "vanilla"  # vanilla: input side first | anti: head side first

    # Per block, in unfreezing order: rounds completed before it trains; () = floor(k R / B).
    unfreeze_rounds: tuple[int, ...] = ()  # e.g. (0, 100, 200): the paper's, absolute rounds
    finetune_epochs: int = 5  # fine-tuning epochs after the last round; [train] can override
    # what fine-tuning trains: all (body + head, the paper) | head
    finetune_part: FinetunePart = "all"

    def __post_init__(self) -> None:
        check_finetune(self.finetune_epochs)
        u = self.unfreeze_rounds
        if u and (u[0] != 0 or any(b < a for a, b in zip(u, u[1:]))):
            raise ValueError(
                f"unfreeze_rounds = {list(u)} must start at 0 and be non-decreasing "
                "(rounds completed before each block trains)"
            )

    # ---- server half -------------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> ExpansionState:
        model = spec.build_model(0)
        names = [n for n, _ in body_blocks(model)]
        schedule = self.unfreeze_rounds or default_unfreeze_rounds(len(names), spec.rounds)
        if len(schedule) != len(names):
            raise ValueError(
                f"unfreeze_rounds = {list(schedule)} has {len(schedule)} entries, but the body of "
                f"{model.arch or 'the model'!r} has {len(names)} blocks {names}"
            )
        return ExpansionState(
            model.part_state("encoder"),
            tuple(_block_keys(model, names)),
            tuple(schedule),
            spec.rounds,
        )

    def broadcast(
        self, state: ExpansionState, client_id: int, round_num: int
    ) -> ExpansionBroadcast:
        n = num_unfrozen(round_num, state.unfreeze_rounds, state.rounds)
        keys = _active_keys(state.block_keys, n, self.order)
        return ExpansionBroadcast({k: state.body[k] for k in keys}, n, self.order)

    def upload_metrics(self, upload: ExpansionUpload) -> dict[str, float]:
        return {"train_macs": float(upload.train_macs), "paper_cost": float(upload.paper_cost)}

    def upload_names(self, state: ExpansionState, upload: ExpansionUpload) -> dict[str, Any]:
        def blocks(x: dict[str, Tensor], where: str) -> None:  # num_active (a scalar) is checked
            keys = _active_keys(state.block_keys, upload.num_active, self.order)
            schema.check_like(x, {k: state.body[k] for k in keys}, where)

        # The guard measures the update over the uploaded blocks only (the keys the upload has).
        return {"B": len(state.block_keys), "blocks": blocks, "body": state.body}

    def aggregate(
        self, state: ExpansionState, uploads: Sequence[Weighted[ExpansionUpload]], round_num: int
    ) -> ExpansionState:
        n = num_unfrozen(round_num, state.unfreeze_rounds, state.rounds)
        fresh = [u for u in uploads if u.payload.num_active == n]
        if len(fresh) < len(uploads):
            stale = [u.client_id for u in uploads if u.payload.num_active != n]
            log.warning(
                "round %d: ignored uploads for another schedule stage from %s", round_num, stale
            )
        if not fresh:
            return state
        states = [u.payload.state for u in fresh]
        reference = {k: state.body[k] for k in states[0]}
        avg = weighted_average(states, [u.weight for u in fresh], reference=reference)
        body = dict(state.body)
        body.update(avg)  # frozen blocks keep their (initial) values
        return dataclasses.replace(state, body=body)

    def summands(self, upload: ExpansionUpload, weight: float) -> dict[str, Tensor]:
        # Every client of a round trains the blocks its broadcast named (num_active = the
        # schedule's n): the sum is over the same keys.
        return secure.state_terms(upload.state, weight)

    def from_sums(
        self, state: ExpansionState, sums: Mapping[str, Tensor], round_num: int
    ) -> Weighted[ExpansionUpload]:
        n = num_unfrozen(round_num, state.unfreeze_rounds, state.rounds)
        keys = _active_keys(state.block_keys, n, self.order)
        mean, total = secure.state_from_terms(sums, {k: state.body[k] for k in keys})
        return Weighted(-1, total, ExpansionUpload(mean, n, 0, 0))

    # ---- client half -------------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        body_blocks(model)  # fail early on an encoder without a block split
        start_from_server_init(model, spec)  # frozen blocks and head = the shared initialization
        return RoundCounter(spec.input_shape)

    def receive(self, model: ClientModel, extras: nn.Module, msg: ExpansionBroadcast) -> None:
        if msg.order != self.order:
            raise ValueError(f"broadcast for order {msg.order!r}, client runs {self.order!r}")
        names = [n for n, _ in _param_children(model)]
        expected = _active_keys(_block_keys(model, names), msg.num_active, self.order)
        if sorted(msg.state) != sorted(expected):
            raise ValueError(f"broadcast blocks {sorted(msg.state)[:5]} != expected {expected[:5]}")
        own = model.encoder.state_dict()
        with torch.no_grad():
            for k, v in msg.state.items():
                if own[k].shape != v.shape:
                    raise ValueError(
                        f"broadcast {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}"
                    )
                own[k].copy_(v)

    def before_fit(self, ctx: FitContext[ExpansionBroadcast]) -> None:
        cast(RoundCounter, ctx.extras).examples = 0  # init_client's extras

    def phases(self, round_num: int, epochs: int) -> tuple[Phase, ...]:
        # The body; frozen blocks are switched off in ``loss`` (the broadcast says which).
        return (Phase(BODY, epochs, name="body"),)

    def loss(
        self,
        model: ClientModel,
        extras: nn.Module,
        x: Tensor,
        y: Tensor,
        msg: ExpansionBroadcast,
    ) -> Tensor:
        freeze_inactive(model, msg.num_active, self.order)  # before the forward: no graph for them
        cast(RoundCounter, extras).examples += int(x.shape[0])  # init_client's extras
        return F.cross_entropy(model(x), y)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: ExpansionBroadcast
    ) -> ExpansionUpload:
        names = [n for n, _ in _param_children(model)]
        keys = _active_keys(_block_keys(model, names), msg.num_active, self.order)
        own = model.encoder.state_dict()
        trainable = trainable_prefixes(names, msg.num_active, self.order)
        counter = cast(RoundCounter, extras)  # init_client's extras
        macs = training_macs(model, counter.input_shape, trainable, counter.examples)
        cost = paper_cost(model, trainable, counter.examples)
        return ExpansionUpload(
            {k: own[k].detach().clone() for k in keys}, msg.num_active, macs, cost
        )

    def finetune_phases(self, epochs: int | None) -> tuple[Phase, ...]:
        return finetune_phase(
            self.finetune_part, self.finetune_epochs if epochs is None else epochs
        )


@ALGORITHMS.register("fedseq_vanilla")
@dataclass(frozen=True)
class FedSeqVanilla(SequentialLayerExpansion):
    """Vanilla scheduling: blocks unfreeze from the input side (block 0 first)."""

    order: ClassVar[str] = "vanilla"


@ALGORITHMS.register("fedseq_anti")
@dataclass(frozen=True)
class FedSeqAnti(SequentialLayerExpansion):
    """Anti scheduling: blocks unfreeze from the head side (the last block first)."""

    order: ClassVar[str] = "anti"
