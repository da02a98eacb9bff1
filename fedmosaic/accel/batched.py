"""Many clients of one architecture trained as one batched computation (``torch.func``).

A group of clients whose models (and extras) have the same layout trains together: their
parameters, buffers and optimizer state are stacked along a leading client dimension, and each
step is one ``vmap`` over ``grad_and_value(functional_call(...))`` of the algorithm's own
``loss``. Everything that makes a client's numbers is unchanged:

- each client's batches come from its own ``(seed, round, client, "batches")`` stream, drawn in
  the same order as :func:`fedmosaic.core.training.train_epochs` draws them;
- ``receive``, ``before_fit`` and ``upload`` run per client exactly as in
  :func:`fedmosaic.core.client.fit` (the global RNG is seeded per client first and restored to
  that client's state before its upload, as the one-client path leaves it);
- the optimizer step is :class:`torch.optim.SGD`'s (momentum, weight decay) or
  :class:`torch.optim.Adam`'s single-tensor update written on the stacked tensors, a fresh state
  per phase as ``make_optimizer`` gives;
- clients with fewer steps simply stop: at step ``t`` only the clients that have a ``t``-th
  batch take part, split by batch size (a ragged last batch), each subset gathered from and
  scattered back to the stacked state. No padding, so BatchNorm statistics see exactly the
  client's own batch (running statistics are stacked buffers updated in place under ``vmap``).

The numbers equal the one-client path to float tolerance, not bitwise (batched kernels round
differently, and the one-client path fuses plain SGD into the Linear backward). Only methods
that declare ``Acceleration(batched=True)`` take this path; a group whose step cannot be vmapped (a
random op, data-dependent Python control flow on a per-client message) falls back to one client
at a time with a log line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from fedmosaic.accel._engaged import engaged
from fedmosaic.accel.graphs import StepGraphs
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm, FitContext, Phase, declared_acceleration, payload_to
from fedmosaic.core.client import ClientData, FitOutput
from fedmosaic.core.client import fit as fit_one
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.training import (
    TrainSettings,
    TrainStats,
    autocast,
    batch_order,
    select_trainable,
    unfreeze_all,
)

log = logging.getLogger("fedmosaic")


def layout_key(model: nn.Module, extras: nn.Module) -> tuple[Any, ...]:
    """Clients with equal keys can be stacked: same module types, names, shapes, dtypes."""
    out: list[Any] = [type(model).__qualname__, type(extras).__qualname__]
    for module in (model, extras):
        out += [(n, type(m).__qualname__) for n, m in module.named_modules()]
        out += [(n, tuple(t.shape), t.dtype) for n, t in module.named_parameters()]
        out += [(n, tuple(t.shape), t.dtype) for n, t in module.named_buffers()]
    return tuple(out)


def eligible(algo: Algorithm, model: nn.Module, extras: nn.Module) -> bool:
    """The method declares batching equivalent and the model has no random layers."""
    if not declared_acceleration(algo).batched:
        return False
    for module in (model, extras):
        for m in module.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
                return False
    return True


def groups(
    cids: Sequence[int], keys: dict[int, tuple[Any, ...]], min_size: int = 2
) -> tuple[list[list[int]], list[int]]:
    """Clients grouped by layout (in first-seen order); groups smaller than ``min_size`` are
    returned as singles."""
    by: dict[tuple[Any, ...], list[int]] = {}
    for c in cids:
        by.setdefault(keys[c], []).append(c)
    out, singles = [], []
    for g in by.values():
        if len(g) >= min_size:
            out.append(g)
        else:
            singles += g
    return out, singles


def plan_groups(
    algo: Algorithm,
    cids: Sequence[int],
    take: Callable[[int], tuple[ClientModel, nn.Module]],
    min_size: int = 2,
) -> tuple[list[list[int]], list[int]]:
    """The round's clients as groups that train together (eligible, one model layout,
    ``min_size`` or more) and the rest, in their given order, to train one at a time.
    ``take(cid)`` gives a client's model and extras (built or loaded on demand by the backend)."""
    if not declared_acceleration(
        algo
    ).batched:  # nothing to group: load no client ahead of its turn
        return [], list(cids)
    keys = {}
    for c in cids:
        model, extras = take(c)
        if eligible(algo, model, extras):
            keys[c] = layout_key(model, extras)
    grouped, _ = groups(list(keys), keys, min_size)
    in_group = {c for g in grouped for c in g}
    return grouped, [c for c in cids if c not in in_group]


def fit_clients(
    algo: Algorithm,
    messages: dict[int, Payload],
    take: Callable[[int], tuple[ClientModel, nn.Module]],
    data: Sequence[ClientData],
    settings: TrainSettings,
    seed: int,
    round_num: int,
    local_epochs: int,
) -> Iterator[tuple[list[int], list[FitOutput]]]:
    """A round's fits for one backend (the serial transport, a worker): each group that trains
    together (``plan_groups``, when ``settings.batched_enabled``), then every other client one
    at a time, yielded as ``(client ids, their outputs)`` as each is done, so the backend can
    time it and release the modules before the next. ``data[cid]`` is client ``cid``'s data."""
    grouped, singles = (
        # with step graphs a lone client of its layout is a group of one: replayed, not eager
        plan_groups(algo, list(messages), take, 1 if settings.graphs_enabled else 2)
        if settings.batched_enabled
        else ([], list(messages))
    )
    if grouped:
        heavy = [g for g in grouped if _heavy(algo, take(g[0])[0], data[g[0]], settings)]
        grouped = [g for g in grouped if g not in heavy]
        alone = {c for g in heavy for c in g} | set(singles)
        singles = [c for c in messages if c in alone]
    for g in grouped:
        mods = [take(c) for c in g]
        models, extras = [m for m, _ in mods], [e for _, e in mods]
        msgs, datas = [messages[c] for c in g], [data[c] for c in g]
        yield (
            g,
            fit_group(algo, models, extras, msgs, datas, settings, seed, round_num, local_epochs),
        )
    for cid in singles:
        model, extra = take(cid)
        out = fit_one(
            algo, model, extra, messages[cid], data[cid], settings, seed, round_num, local_epochs
        )
        yield [cid], [out]


# A client's training step above this many FLOPs keeps the card busy on its own: stacking such
# clients under ``vmap`` measured slower than one at a time (ResNet-18 on 3x32x32 at batch 64 on
# an H200: 4.1 s against 2.3 s of training a round; at batch 10, 17 GFLOP a step, stacking won).
STACK_MAX_FLOP = 5e10
_FLOPS: dict[tuple[Any, ...], float] = {}


def _heavy(algo: Algorithm, model: ClientModel, data: ClientData, s: TrainSettings) -> bool:
    """Whether one client's step (forward and backward, ~3x the forward's multiply-adds of its
    convolutions and Linear layers, at ``s.batch_size``) is over ``STACK_MAX_FLOP``."""
    if data.num_train == 0:
        return False
    x = data.source.batch(data.rows("train")[:1], data.device)
    key = (layout_key(model, nn.Module()), tuple(x.shape))
    if key not in _FLOPS:
        total = [0.0]

        def count(m: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
            if isinstance(m, nn.Conv2d):
                fan_in = m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
                total[0] += 2.0 * out.numel() * fan_in
            elif isinstance(m, nn.Linear):
                total[0] += 2.0 * out.numel() * m.in_features

        hooks = [m.register_forward_hook(count) for m in model.modules()]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                was = model.training
                model.eval()
                model(x)
                model.train(was)
        finally:
            for h in hooks:
                h.remove()
        _FLOPS[key] = 3.0 * total[0]
    return _FLOPS[key] * s.batch_size > STACK_MAX_FLOP


class _LossModule(nn.Module):
    """``algo.loss`` as a module forward, so ``functional_call`` can swap in one client's tensors."""

    algo: Algorithm  # declared for the type checker: set below, past nn.Module's __setattr__

    def __init__(self, algo: Algorithm, model: ClientModel, extras: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.extras = extras
        object.__setattr__(self, "algo", algo)  # not a submodule: a frozen dataclass

    def forward(self, x: Tensor, y: Tensor, msg: Payload) -> Tensor:
        return self.algo.loss(self.model, self.extras, x, y, msg)


# ---- messages: shared (closed over) or per client (vmapped) ------------------------------------
def _leaves(msg: Payload) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, Tensor):
            out[f.name] = v
        elif isinstance(v, dict):
            out.update({f"{f.name}\0{k}": t for k, t in v.items()})
    return out


def _with_leaves(msg: Payload, leaves: dict[str, Tensor]) -> Payload:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = leaves[f.name]
        elif isinstance(v, dict):
            changes[f.name] = {k: leaves[f"{f.name}\0{k}"] for k in v}
    return dataclasses.replace(msg, **changes)


def _same_message(msgs: Sequence[Payload]) -> bool:
    first = msgs[0]
    a = _leaves(first)
    scalars = [(f.name, getattr(first, f.name)) for f in dataclasses.fields(first)]
    for m in msgs[1:]:
        if type(m) is not type(first):
            return False
        b = _leaves(m)
        if a.keys() != b.keys() or any(
            x is not b[k] and (x.shape != b[k].shape or not torch.equal(x, b[k]))
            for k, x in a.items()
        ):
            return False
        for name, v in scalars:
            if not isinstance(v, (Tensor, dict)) and getattr(m, name) != v:
                return False
    return True


# ---- the optimizer on stacked tensors -------------------------------------------------------------
class _StackedOptimizer:
    """``torch.optim.SGD`` / ``Adam`` (single-tensor updates) on ``[K, ...]`` parameter stacks."""

    def __init__(self, s: TrainSettings, params: dict[str, Tensor]) -> None:
        if s.optimizer not in ("sgd", "adam"):
            raise ValueError(f"train.optimizer = {s.optimizer!r}; choose sgd or adam")
        self.s = s
        self.buf: dict[str, Tensor] = {}
        self.exp_avg: dict[str, Tensor] = {}
        self.exp_avg_sq: dict[str, Tensor] = {}
        if s.optimizer == "sgd" and s.momentum != 0:
            self.buf = {k: torch.zeros_like(p) for k, p in params.items()}
        if s.optimizer == "adam":
            self.exp_avg = {k: torch.zeros_like(p) for k, p in params.items()}
            self.exp_avg_sq = {k: torch.zeros_like(p) for k, p in params.items()}

    def state(self) -> list[dict[str, Tensor]]:
        return [d for d in (self.buf, self.exp_avg, self.exp_avg_sq) if d]

    @torch.no_grad()
    def reset(self) -> None:
        """A fresh phase's state, in place (its tensors keep their addresses)."""
        for d in self.state():
            for v in d.values():
                v.zero_()

    @torch.no_grad()
    def step(
        self,
        params: dict[str, Tensor],
        grads: dict[str, Tensor],
        state: list[dict[str, Tensor]],
        t: int,
    ) -> None:
        """Update ``params`` in place; ``state`` the (possibly gathered) optimizer tensors; every
        client in the stack takes its step number ``t`` (0-based) of this phase."""
        s = self.s
        if s.optimizer == "sgd" and (s.momentum == 0 or t > 0):
            # one multi-tensor kernel per operation instead of one per parameter (fewer launches)
            keys = list(params)
            ps, gs = [params[k] for k in keys], [grads[k] for k in keys]
            if s.weight_decay != 0:
                gs = list(torch._foreach_add(gs, ps, alpha=s.weight_decay))
            if s.momentum != 0:
                bufs = [state[0][k] for k in keys]
                torch._foreach_mul_(bufs, s.momentum)
                torch._foreach_add_(bufs, gs)  # dampening 0
                gs = bufs
            torch._foreach_add_(ps, gs, alpha=-s.lr)
            return
        for k, p in params.items():
            g = grads[k]
            if s.weight_decay != 0:
                g = g.add(p, alpha=s.weight_decay)
            if s.optimizer == "sgd":
                if s.momentum != 0:
                    buf = state[0][k]
                    if t == 0:
                        buf.copy_(g)  # SGD: the first step's buffer is the gradient itself
                    else:
                        buf.mul_(s.momentum).add_(g)  # dampening 0
                    g = buf
                p.add_(g, alpha=-s.lr)
            else:
                b1, b2 = s.betas
                exp_avg, exp_avg_sq = state[0][k], state[1][k]
                exp_avg.lerp_(g, 1 - b1)
                exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
                step = float(t + 1)
                bias_correction1 = 1 - b1**step
                bias_correction2 = 1 - b2**step
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(1e-8)
                p.addcdiv_(exp_avg, denom, value=-(s.lr / bias_correction1))


# ---- one group ----------------------------------------------------------------------------------
@dataclass
class _Client:
    model: ClientModel
    extras: nn.Module
    data: ClientData
    msg: Payload
    gen: torch.Generator
    rng: Tensor  # global RNG state after receive/before_fit: restored before upload


def fit_group(
    algo: Algorithm,
    models: Sequence[ClientModel],
    extras: Sequence[nn.Module],
    msgs: Sequence[Payload],
    datas: Sequence[ClientData],
    settings: TrainSettings,
    seed: int,
    round_num: int,
    epochs: int,
) -> list[FitOutput]:
    """:func:`fedmosaic.core.client.fit` for clients of one layout, trained as one computation.

    Falls back to one client at a time (same results) when the step cannot be batched.
    """
    clients: list[_Client] = []
    for model, ext, msg, data in zip(models, extras, msgs, datas, strict=True):
        cid = data.client_id
        seeding.seed_torch(seed, round_num, cid, "fit")
        gen = seeding.torch_generator(seed, round_num, cid, "batches")
        msg = payload_to(msg, settings.device)
        algo.receive(model, ext, msg)
        algo.before_fit(FitContext(model, ext, data, msg, settings, gen, round_num))
        clients.append(_Client(model, ext, data, msg, gen, torch.get_rng_state()))
    # most steps first: the clients still training at any step are then a prefix of the stack
    # (views, no gather), the same prefixes every round (the same graphs)
    order = sorted(range(len(clients)), key=lambda k: -clients[k].data.num_train)
    try:
        by_rank = _train(
            algo, [clients[k] for k in order], algo.phases(round_num, epochs), settings
        )
        stats = [TrainStats()] * len(clients)
        for rank, k in enumerate(order):
            stats[k] = by_rank[rank]
        engaged["batched_groups"] += 1
    except _Unbatchable as exc:
        log.warning(
            "batched training of %s clients fell back to one at a time: %s",
            type(algo).__name__,
            exc,
        )
        return [
            fit_one(algo, m, e, msg, d, settings, seed, round_num, epochs)
            for m, e, msg, d in zip(models, extras, msgs, datas, strict=True)
        ]
    out = []
    for c, st in zip(clients, stats):
        torch.set_rng_state(c.rng)
        c.model.eval()
        c.extras.eval()
        with torch.no_grad():
            upload = algo.upload(c.model, c.extras, c.data, c.msg)
        out.append(FitOutput(payload_to(upload, "cpu"), c.data.num_train, st))
    return out


class _Unbatchable(Exception):
    """A step could not be vmapped; nothing was written back to the clients' modules yet."""


# ---- a group's tensors at fixed addresses ---------------------------------------------------------
@dataclass
class _Static:
    """A group's tensors at fixed addresses: parameters and buffers stacked ``[K, ...]``, the
    message's tensors (shared: as broadcast; per client: stacked), the optimizer's state per
    phase, the loss sums, and per step key its row buffer and step function. With step graphs
    on it is kept across rounds (``_STATIC``), so a graph captured in one round replays in the
    next: every round only copies new values into it."""

    stacked: dict[str, Tensor]
    msg: dict[str, Tensor]
    loss_sums: Tensor  # [K] float64
    labels: Tensor | None  # the dataset's labels on the device (clients sharing one source)
    graphs: StepGraphs | None
    pins: tuple[object, ...]  # what the key names by id(): kept alive while the entry is
    opts: dict[Hashable, _StackedOptimizer] = dataclasses.field(default_factory=dict)
    steps: dict[Hashable, tuple[Tensor, Callable[[], None]]] = dataclasses.field(
        default_factory=dict
    )


_STATIC: OrderedDict[Hashable, _Static] = OrderedDict()
STATIC_ENTRIES = 32  # groups kept (least recently used dropped): layouts x group sizes


def clear_graphs() -> None:
    """Drop every kept group and its graphs (their device memory is freed with them)."""
    _STATIC.clear()


def _scalars(msg: Payload) -> tuple[Any, ...]:
    """What a captured step bakes in of a message besides its tensors' values."""
    out: list[Any] = [type(msg).__qualname__]
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if not isinstance(v, (Tensor, dict)):
            out.append((f.name, repr(v)))
    out += sorted((k, tuple(t.shape), str(t.dtype)) for k, t in _leaves(msg).items())
    return tuple(out)


def _graphable(s: TrainSettings) -> bool:
    """Step graphs: on by the settings, for SGD in fp32 (a graph bakes in Python scalars, and
    Adam's bias corrections change every step; autocast's weight cache must not be captured)."""
    return s.graphs_enabled and s.optimizer == "sgd" and s.precision == "fp32"


def _static_for(
    algo: Algorithm,
    clients: list[_Client],
    s: TrainSettings,
    own: list[dict[str, Tensor]],
    names: list[str],
    shared_msg: bool,
    device: torch.device,
    graphed: bool,
    shared_src: bool,
) -> _Static:
    """The group's static tensors, holding this round's values (kept ones reused)."""
    first = clients[0]
    per_client = [_leaves(c.msg) for c in clients]
    key = (
        id(algo),
        layout_key(first.model, first.extras),
        len(clients),
        str(device),
        shared_msg,
        _scalars(first.msg),
        id(first.data.source),
        id(first.data.labels),
        s,
    )
    st = _STATIC.get(key) if graphed else None
    if graphed and st is None:  # another run's groups (its algorithm object) are done with
        for old in [k for k, v in _STATIC.items() if v.pins[0] is not algo]:
            del _STATIC[old]
    with torch.no_grad():
        if st is None:
            stacked = {n: torch.stack([o[n].detach() for o in own]) for n in names}
            if shared_msg:
                msg = {k: v.clone() if graphed else v for k, v in per_client[0].items()}
            else:
                msg = {k: torch.stack([p[k] for p in per_client]) for k in per_client[0]}
            labels = first.data.labels.to(device) if shared_src else None
            st = _Static(
                stacked,
                msg,
                torch.zeros(len(clients), dtype=torch.float64, device=device),
                labels,
                StepGraphs(device) if graphed else None,
                (algo, first.data.source, first.data.labels),
            )
            if graphed:
                _STATIC[key] = st
                while len(_STATIC) > STATIC_ENTRIES:
                    _STATIC.popitem(last=False)
            return st
        _STATIC.move_to_end(key)
        for n in names:
            torch.stack([o[n].detach() for o in own], out=st.stacked[n])
        for k, v in st.msg.items():
            if shared_msg:
                v.copy_(per_client[0][k])
            else:
                torch.stack([p[k] for p in per_client], out=v)
        st.loss_sums.zero_()
    return st


@dataclass(frozen=True)
class _Phase:
    """What a phase's step functions read, bound when they are made (a step kept across rounds
    must not see a later phase's or round's loop variables)."""

    st: _Static
    opt: _StackedOptimizer
    step_fn: Callable[..., tuple[dict[str, Tensor], Tensor]]
    trainable: tuple[str, ...]
    rest: tuple[str, ...]
    per_msg: dict[str, Tensor]
    clock: list[int]  # the optimizer's step number (a graph bakes it: SGD, never the first)
    held: list[tuple[Tensor, Tensor]]  # the batch, for clients without a shared source
    source: Any
    k_all: int
    device: torch.device


def _make_step(ph: _Phase, ks: tuple[int, ...], size: int) -> tuple[Tensor, Callable[[], None]]:
    """The step of clients ``ks`` at batch ``size``: it reads the row buffer it returns (or
    ``ph.held``) and writes the group's static state; no Python value of it changes per call
    but ``ph.clock`` and ``ph.held``."""
    k, st = len(ks), ph.st
    rows_buf = torch.empty(k * size, dtype=torch.long, device=ph.device)
    idx = torch.tensor(ks, device=ph.device)
    whole = ks == tuple(range(k))  # a prefix of the stack (all of it, or the clients left)

    def step() -> None:
        if st.labels is not None:
            x = ph.source.batch(rows_buf, ph.device)
            x = x.view(k, size, *x.shape[1:])
            y = st.labels[rows_buf].view(k, size)
        else:
            x, y = ph.held[0]
        stacked = st.stacked

        def of(v: Tensor) -> Tensor:  # a view of the prefix, written through; else a gather
            return (v if k == ph.k_all else v[:k]) if whole else v.index_select(0, idx)

        sub = {n: of(v) for n, v in stacked.items()}
        state = [{n: of(v) for n, v in d.items()} for d in ph.opt.state()]
        m = {n: of(v) for n, v in ph.per_msg.items()}
        tr = {n: sub[n] for n in ph.trainable}
        other = {n: sub[n] for n in ph.rest}
        grads, loss = ph.step_fn(tr, other, x, y, m)
        ph.opt.step(tr, grads, state, ph.clock[0])
        if not whole:
            with torch.no_grad():
                for n, v in stacked.items():
                    v.index_copy_(0, idx, sub[n])
                for full, part in zip(ph.opt.state(), state):
                    for n, v in full.items():
                        v.index_copy_(0, idx, part[n])
        if whole:
            st.loss_sums[:k].add_(loss.detach().double())
        else:
            st.loss_sums.index_add_(0, idx, loss.detach().double())

    return rows_buf, step


def _train(
    algo: Algorithm, clients: list[_Client], phases: Sequence[Phase], s: TrainSettings
) -> list[TrainStats]:
    k_all = len(clients)
    template = _LossModule(algo, clients[0].model, clients[0].extras)
    wrappers = [_LossModule(algo, c.model, c.extras) for c in clients]
    names_p = [n for n, _ in template.named_parameters()]
    names_b = [n for n, _ in template.named_buffers()]
    own = [dict(w.named_parameters()) | dict(w.named_buffers()) for w in wrappers]
    device = own[0][names_p[0]].device if names_p else torch.device(s.device)
    shared_msg = _same_message([c.msg for c in clients])
    lead = clients[0].data
    shared_src = all(c.data.source is lead.source and c.data.labels is lead.labels for c in clients)
    graphed = shared_src and _graphable(s)
    st = _static_for(
        algo, clients, s, own, names_p + names_b, shared_msg, device, graphed, shared_src
    )
    stacked = st.stacked
    # a shared message enters the loss closed over: from the static copy when graphs replay
    msg0 = _with_leaves(clients[0].msg, st.msg) if graphed else clients[0].msg
    per_msg = {} if shared_msg else st.msg
    stats = [TrainStats() for _ in clients]
    precision = autocast(s)
    src = clients[0].data.source
    template.train()
    for w in wrappers:
        w.train()
    try:
        for pi, phase in enumerate(phases):
            params = select_trainable(template.model, template.extras, phase)
            for c in clients[1:]:
                select_trainable(c.model, c.extras, phase)  # requires_grad as the loss may look
            if not params or phase.epochs <= 0:
                continue  # train_epochs draws no batches then
            ids = {id(p) for p in params}
            trainable = [n for n, p in template.named_parameters() if id(p) in ids]
            train_set = set(trainable)
            rest = [n for n in names_p + names_b if n not in train_set]  # frozen + buffers
            plans = []
            for c in clients:
                steps: list[Tensor] = []
                for _ in range(phase.epochs):
                    steps += batch_order(
                        c.data.num_train, s.batch_size, c.gen, s.drop_last, s.shuffle
                    )
                plans.append(steps)
            # each client's rows for the whole phase on the device, and where step t starts
            empty = torch.empty(0, dtype=torch.long, device=device)
            rows = [
                c.data.rows("train")[torch.cat(p)].to(device) if p else empty
                for c, p in zip(clients, plans)
            ]
            starts = [[0] for _ in plans]
            for k, plan in enumerate(plans):
                for p in plan:
                    starts[k].append(starts[k][-1] + int(p.numel()))
            okey = (pi, tuple(trainable))
            opt = st.opts.get(okey)
            if opt is None:
                opt = st.opts[okey] = _StackedOptimizer(s, {n: stacked[n] for n in trainable})
            else:
                opt.reset()

            def loss_of(
                tr: dict[str, Tensor], other: dict[str, Tensor], x: Tensor, y: Tensor, m: Any
            ) -> Tensor:
                msg = msg0 if shared_msg else _with_leaves(msg0, m)
                with precision:
                    return functional_call(template, {**tr, **other}, (x, y, msg))

            step_fn = vmap(grad_and_value(loss_of), in_dims=(0, 0, 0, 0, 0 if per_msg else None))

            ph = _Phase(
                st,
                opt,
                step_fn,
                tuple(trainable),
                tuple(rest),
                per_msg,
                [0],
                [],
                src,
                k_all,
                device,
            )
            for t in range(max((len(p) for p in plans), default=0)):
                ph.clock[0] = t
                by_size: dict[int, list[int]] = {}
                for k, plan in enumerate(plans):
                    if t < len(plan):
                        by_size.setdefault(int(plan[t].numel()), []).append(k)
                for size, ks in by_size.items():
                    first = t == 0 and s.momentum != 0  # SGD's first step: its own update
                    key = (okey, tuple(ks), size, first)
                    made = st.steps.get(key) if st.graphs is not None else None
                    if made is None:
                        made = _make_step(ph, tuple(ks), size)
                        if st.graphs is not None:
                            st.steps[key] = made
                    rows_buf, step = made
                    if st.labels is not None:
                        torch.cat(
                            [rows[k][starts[k][t] : starts[k][t + 1]] for k in ks], out=rows_buf
                        )
                    else:
                        ph.held[:] = [
                            _batch([clients[k].data for k in ks], [plans[k][t] for k in ks])
                        ]
                    try:
                        if st.graphs is not None and not first:
                            st.graphs.run(key, step)
                        else:
                            step()
                    except Exception as exc:  # the caller redoes the group one at a time
                        raise _Unbatchable(f"{type(exc).__name__}: {exc}") from exc
                    engaged["batched_steps"] += 1
                    for k in ks:
                        stats[k].steps += 1
                        stats[k].examples += size
        with torch.no_grad():
            for k, o in enumerate(own):
                for n, v in o.items():
                    v.copy_(stacked[n][k])
    finally:
        for c in clients:
            unfreeze_all(c.model, c.extras)
            c.model.eval()
            c.extras.eval()
    for st_, total in zip(stats, st.loss_sums.tolist()):
        st_.loss_sum = total
    return stats


def _batch(datas: Sequence[ClientData], positions: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``x [k, B, ...]``, ``y [k, B]``: one gather when the clients share one image source."""
    src = datas[0].source
    if all(d.source is src and d.device == datas[0].device for d in datas):
        rows = torch.cat([d.rows("train")[p] for d, p in zip(datas, positions)])
        x = src.batch(rows, datas[0].device)
        y = torch.cat([d.targets("train")[p.to(d.device)] for d, p in zip(datas, positions)])
        k = len(datas)
        return x.view(k, -1, *x.shape[1:]), y.view(k, -1)
    xs, ys = zip(*(d.train_batch(p) for d, p in zip(datas, positions)))
    return torch.stack(xs), torch.stack(ys)
