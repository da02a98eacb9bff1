"""The Transport seam and the one round loop (sampling, fit, aggregate, evaluate, history)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedmosaic.core import accountant, guard, membership, privacy, robust, secure, seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec, Phase, Weighted
from fedmosaic.core.checks import clients_per_round  # noqa: F401  (torch-free, for the config)
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.schema import MAX_EXAMPLES  # a reply claiming more is not a real client
from fedmosaic.metrics import aggregate_accuracy

log = logging.getLogger("fedmosaic")
DIVERGED_ROUNDS = 2  # consecutive rounds with no finite training loss: the run stops

# Set (e.g. by the CLI's Ctrl-C handler) to stop the round loop after the round in progress: the
# loop saves a checkpoint (when it has a checkpoint hook) and raises ``Interrupted``.
stop_requested = threading.Event()


class Interrupted(Exception):
    """The round loop stopped on request after ``round_num`` complete rounds."""

    def __init__(self, round_num: int, saved: bool) -> None:
        super().__init__(f"interrupted after round {round_num}")
        self.round_num = round_num
        self.saved = saved


class Diverged(RuntimeError):
    """Training produced no finite loss for ``DIVERGED_ROUNDS`` consecutive rounds."""


@dataclass
class FitResult:
    client_id: int
    upload: Payload | None  # None when the reply could not be decoded (see ``error``)
    num_examples: int
    bytes_up: int
    bytes_down: int
    loss: float = math.nan
    error: str | None = None
    # under secure aggregation: the upload's metrics (costs), sent in clear with the masked sum
    metrics: dict[str, float] | None = None
    # eval.membership: the attack on the model the server rebuilds from the upload (counts)
    attack: dict[str, dict[str, int]] | None = None


@dataclass
class EvalResult:
    client_id: int
    counts: dict[str, dict[str, int]]  # split -> {"n": examples, mode: correct}


ClientState = tuple[dict[str, Tensor], dict[str, Tensor]]  # a client's (model, extras) state dicts
ClientProgress = Callable[[int, int], None]  # (clients done, clients in the fit or fine-tune)


class LazyClientStates(Sequence[ClientState]):
    """Every client's state, fetched only when indexed (a checkpoint's file, a state store, the
    workers): the length, bounds and slices written once; a subclass says how to get one."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, cid: int) -> ClientState: ...

    @overload
    def __getitem__(self, cid: slice) -> list[ClientState]: ...

    def __getitem__(self, cid: int | slice) -> ClientState | list[ClientState]:
        if isinstance(cid, slice):
            return [self[i] for i in range(self.n)[cid]]
        if not 0 <= cid < self.n:
            raise IndexError(cid)
        return self.get(cid)

    def get(self, cid: int) -> ClientState:
        """Client ``cid``'s (model, extras) state dicts, ``0 <= cid < len(self)``."""
        raise NotImplementedError


class ClientStatesUnavailable(RuntimeError):
    """The transport's clients keep their state where this process cannot read or set it
    (Flower: on the SuperNodes)."""


class Transport(Protocol):
    """How messages reach clients: in-process simulator, worker processes, or Flower.

    Besides the round's messages, a transport exports and imports every client's persistent
    state (checkpoints, the trained models of ``api.run``), reports each client's progress
    through a fit, and releases what it holds on ``close``.
    """

    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[FitResult]: ...

    def fit_secure(
        self, round_num: int, messages: dict[int, Payload], form: secure.SecureForm
    ) -> tuple[list[FitResult], secure.SecureSum | None]:
        """``fit`` under secure aggregation: the replies without their uploads (errors, example
        counts, losses, clear metrics) and the sum of the clients' summands (None: no sum)."""
        ...

    def evaluate(
        self, round_num: int, messages: dict[int, Payload], receive: bool = True
    ) -> list[EvalResult]: ...

    def finetune(self, messages: dict[int, Payload], phases: Sequence[Phase]) -> None: ...

    def client_states(self) -> Sequence[ClientState]:
        """Every client's state, in client order (read before :meth:`close`), possibly lazy:
        read when indexed, so a reader going client by client (a checkpoint) never holds the
        population; raises :class:`ClientStatesUnavailable` where the state is out of reach."""
        ...

    def load_client_states(self, states: Sequence[ClientState]) -> None:
        """Set every client's state (a checkpoint's); ``ValueError`` naming a client whose state
        does not fit, :class:`ClientStatesUnavailable` as for :meth:`client_states`."""
        ...

    def set_progress(
        self, on_client: ClientProgress | None, on_finetune: ClientProgress | None = None
    ) -> None:
        """Call ``on_client(done, total)`` during each fit and ``on_finetune(done, total)``
        during the fine-tuning after the rounds: 0 at its start, then per client finished
        (None: stop reporting)."""
        ...

    def close(self) -> None:
        """Release workers, stores and files; the transport is not used afterwards."""
        ...


@dataclass
class RoundPlan:
    num_clients: int
    rounds: int
    clients_per_round: int
    eval_every: int = 1
    finetune_epochs: int = -1  # -1: the algorithm's default; 0: no fine-tuning
    min_replies: int = 1  # fewer valid replies: the round is skipped (state unchanged)
    holdout: tuple[int, ...] = ()  # clients that never train (served as newcomers at the end)
    # Stop before ``rounds`` once validation accuracy has plateaued (see ``plateaued``); 0 = off.
    plateau_delta: float = 0.0
    plateau_window: float = 0.2
    plateau_min_rounds: int = 20
    # what a client's local training is made of (DP-SGD's accounting counts its steps)
    local_epochs: int = 1
    batch_size: int = 10
    stop_on_divergence: bool = True  # False: diverged rounds are run and reported, not raised
    membership: bool = False  # eval.membership: the replies' attacks on their uploads are read

    @property
    def pool(self) -> list[int]:
        """The clients that train and are evaluated each round."""
        held = set(self.holdout)
        return [c for c in range(self.num_clients) if c not in held]


PLATEAU_KEY = "val_acc_weighted"


def plateaued(
    rounds: Sequence[dict[str, Any]], delta: float, window: float, min_rounds: int
) -> bool:
    """Whether validation accuracy improved by less than ``delta`` over the last ``window`` of rounds.

    After round ``t`` (the last record, ``t >= min_rounds``): the best validation accuracy of
    rounds ``1..t`` minus the best of rounds ``1..floor((1 - window) t)`` is below ``delta``
    (e.g. 0.001 = 0.1 point over the last 20%). Only validation accuracy decides, never test.
    """
    if delta <= 0 or not rounds:
        return False
    t = int(rounds[-1]["round"])
    if t < min_rounds or PLATEAU_KEY not in rounds[-1]:
        return False
    cut = math.floor((1.0 - window) * t + 1e-9)
    vals = [(int(r["round"]), float(r[PLATEAU_KEY])) for r in rounds if PLATEAU_KEY in r]
    early = [v for r, v in vals if r <= cut]
    if not early:
        return False
    return max(v for _, v in vals) - max(early) < delta


def holdout_clients(seed: int, num_clients: int, k: int) -> tuple[int, ...]:
    """``k`` clients that never train: a seeded subset, sorted (``()`` for ``k = 0``)."""
    if k <= 0:
        return ()
    rng = seeding.numpy_rng(seed, 0, seeding.SERVER, "holdout")
    return tuple(sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False)))


def sample_clients(seed: int, round_num: int, num_clients: int, k: int) -> list[int]:
    """The round's participants: ``k`` distinct clients, sorted, from the round's own stream."""
    if k >= num_clients:
        return list(range(num_clients))
    rng = seeding.numpy_rng(seed, round_num, seeding.SERVER, "sample")
    return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))


def summarize_eval(results: Sequence[EvalResult]) -> dict[str, Any]:
    """Round-level accuracy statistics per split and prediction mode."""
    rec: dict[str, Any] = {}
    by_id = sorted(results, key=lambda r: r.client_id)
    splits = sorted({s for r in by_id for s in r.counts} - set(membership.SPLITS))
    for split in splits:
        modes = sorted({m for r in by_id for m in r.counts.get(split, {}) if m != "n"})
        totals = [r.counts.get(split, {}).get("n", 0) for r in by_id]
        if sum(totals) == 0:
            continue
        for mode in modes:
            correct = [r.counts.get(split, {}).get(mode, 0) for r in by_id]
            stats = aggregate_accuracy(correct, totals)
            prefix = mode if split == "test" else f"{split}_{mode}"
            for k, v in stats.items():
                rec[f"{prefix}_{k}"] = v
    rec.update(membership.summarize([r.counts for r in by_id]))  # eval.membership
    return rec


def per_client_acc(
    results: Sequence[EvalResult], split: str = "test", mode: str = "acc"
) -> dict[int, float]:
    out = {}
    for r in results:
        c = r.counts.get(split, {})
        if c.get("n", 0) > 0:
            out[r.client_id] = c.get(mode, 0) / c["n"]
    return out


SERVER_EVAL_BATCH = 500


@torch.no_grad()
def evaluate_model(
    model: ClientModel, x: Tensor, y: Tensor, batch_size: int = SERVER_EVAL_BATCH
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` (eval mode, float32) on inputs ``x`` and
    labels ``y`` (on the CPU; moved to the model's device a batch at a time)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        xb, yb = xb.to(device), yb.to(device)
        logits = model(xb).float()  # [B, C]
        correct += int((logits.argmax(1) == yb).sum())
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    model.train(was_training)
    n = max(int(y.numel()), 1)
    return correct / n, loss / n


def _rng_kept(device: str) -> Any:
    """A context that restores torch's RNG state on exit: building a model reseeds it
    (``FederationSpec.build_model``), and the server's evaluation must not move any stream."""
    cuda = torch.device(device).type == "cuda"
    return torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else [])


def server_evaluate(algo: Algorithm, state: Any, spec: FederationSpec) -> dict[str, float]:
    """``server_acc`` and ``server_loss`` of the method's global model (``server_model``) on the
    server's own split (``spec.server_eval``); ``{}`` when either is missing."""
    if spec.server_eval is None:
        return {}
    with _rng_kept(spec.device):
        model = algo.server_model(state, spec)
        if model is None:
            return {}
        acc, loss = evaluate_model(model, *spec.server_eval)
    return {"server_acc": acc, "server_loss": loss}


@dataclass
class History:
    rounds: list[dict[str, Any]] = field(default_factory=list)
    final_eval: list[EvalResult] = field(default_factory=list)
    finetune_eval: list[EvalResult] = field(default_factory=list)
    participants: list[list[int]] = field(default_factory=list)
    # held-out clients: on the final broadcast as they arrive, then after one local round
    holdout_before: list[EvalResult] = field(default_factory=list)
    holdout_after: list[EvalResult] = field(default_factory=list)


class RoundCheckpoint(Protocol):
    """Checkpoint/resume hook of the round loop (``fedmosaic.checkpoint.Checkpointer``)."""

    def restore(self, template: Any) -> tuple[int, Any, History, list[EvalResult]] | None:
        """``(rounds done, server state, history, last evaluation)`` to continue from, or None.

        ``template`` is the freshly initialised server state; the hook also restores the
        clients' persistent state and the RNG states.
        """
        ...

    def after_round(
        self, round_num: int, state: Any, history: History, last_eval: list[EvalResult]
    ) -> None: ...

    def save(
        self, round_num: int, state: Any, history: History, last_eval: list[EvalResult]
    ) -> None: ...

    def due(self, round_num: int) -> bool: ...


def run_rounds(
    algo: Algorithm,
    spec: FederationSpec,
    transport: Transport,
    plan: RoundPlan,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    checkpoint: RoundCheckpoint | None = None,
) -> tuple[History, Any]:
    """Run the federation; returns the history and the final server state.

    Each round ``t``: sample the participants, broadcast to them, fit (local training on the
    transport), screen the replies (validation and the peer guard), aggregate, evaluate every
    client (every ``eval_every`` rounds and the last), then check the plateau. After the rounds:
    fine-tune, then serve the held-out newcomers.

    With ``checkpoint``, the loop first asks it for a saved point to continue from, and hands it
    the state after every round (it decides when to write).

    After each round: when ``stop_requested`` is set, the state is saved (if there is a
    checkpoint hook) and ``Interrupted`` is raised; when no participant produced a finite
    training loss for ``DIVERGED_ROUNDS`` rounds in a row, ``Diverged`` is raised (a warning
    names the first such round). With ``plan.plateau_delta > 0`` the loop ends early at the first
    evaluated round where ``plateaued`` holds; that round's record has ``"plateau": True``.
    """
    state, history, last_eval, done = resume(algo, spec, checkpoint)
    # The server's robust rule and what it knows of the partition, in force while uploads are
    # screened and aggregated (``core/robust.py``).
    p = spec.privacy
    noise = (p.clip, p.noise_multiplier * p.clip) if p.mechanism == "local" else None
    rule = spec.robust
    if p.mechanism == "central" and rule.peer_factor > 0:
        # Whether the peer guard drops one client depends on the other clients' uploads, so a
        # neighbouring dataset could change more than one term of the sum the accountant
        # bounds; every other check (schema, claims, magnitude) looks at one upload alone.
        log.warning(
            "privacy.mechanism = central: the peer guard is off (server.peer_factor = %g not "
            "applied): its drops depend on other clients' uploads, which the accounting does "
            "not cover; the clip bounds each upload",
            rule.peer_factor,
        )
        rule = dataclasses.replace(rule, peer_factor=0.0)
    if p.secure_aggregation:
        log.warning(
            "privacy.secure_aggregation: the server sees only the round's sum, so it cannot "
            "check one upload (the peer guard, server.peer_factor = %g, and the per-upload "
            "checks are off); the rebuilt upload is checked against its schema",
            rule.peer_factor,
        )
        rule = dataclasses.replace(rule, peer_factor=0.0)
    view = robust.ServerView(
        rule,
        spec.num_train,
        spec.class_counts,
        private_noise=noise,
        nonnegative_features=spec.nonnegative_features,
    )
    server_eval = server_evaluates(algo, state, spec)
    last = done
    # a restored run that had already stopped on its plateau runs no more rounds
    stopped = bool(history.rounds) and bool(history.rounds[-1].get("plateau"))
    diverged = 0
    ledger = privacy_ledger(spec, plan, history.rounds) if algo.communicates else None
    sample_steps: dict[int, int] | None = None  # DP-SGD steps per client so far
    if spec.privacy.dpsgd:
        sample_steps = {}
        for done_rec in history.rounds:
            count_sample_steps(algo, spec, plan, done_rec, sample_steps)
    for t in range(plan.rounds + 1 if stopped else done + 1, plan.rounds + 1):
        rec: dict[str, Any] = {"round": t}
        round_view = dataclasses.replace(view, round_num=t)  # what it says names the round
        sampled = sample_round(spec, plan, t)
        if over_budget(spec, ledger, sampled, t):
            break
        last = t
        t0 = time.perf_counter()
        messages = broadcast(algo, state, sampled, t)
        if p.secure_aggregation:
            results, uploads, rec["rejected"], participants, totals = secure_fit(
                algo, state, spec, transport, round_view, messages, t
            )
            t1 = time.perf_counter()
            rec.update(totals)
        else:
            results = transport.fit(t, messages)
            t1 = time.perf_counter()
            watched = suspects(history.rounds, sampled)
            uploads, rec["rejected"] = screen_replies(
                algo, state, spec, round_view, results, t, watched
            )
            participants = [u.client_id for u in uploads]
            rec.update(upload_totals(algo, uploads))
        if spec.privacy.mechanism == "central":
            uploads = central_release(algo, state, spec, uploads, t)
        state, rec["aggregated"] = aggregate_round(
            algo, state, uploads, plan, round_view, t, len(participants)
        )
        t2 = time.perf_counter()
        rec.update(reply_stats(algo, sampled, results, participants))
        if ledger is not None:
            ledger.record(released(rec))
            rec["epsilon"] = ledger.current()
        elif spec.privacy.on:  # a method that sends nothing releases nothing
            rec["epsilon"] = 0.0
        if sample_steps is not None:
            rec["epsilon_sample"] = count_sample_steps(algo, spec, plan, rec, sample_steps)
        if plan.membership and not p.secure_aggregation:  # what the server learns from uploads
            attacks = [r.attack for r in results if r.attack is not None]
            rec.update(membership.summarize(attacks, "mia_upload"))
        if no_finite_loss(results, t):
            diverged += 1
            rec["diverged"] = True  # what train.stop_on_divergence = false runs through
        else:
            diverged = 0
        evaluated = t % plan.eval_every == 0 or t == plan.rounds
        if evaluated:
            last_eval, scores = evaluate_round(algo, state, spec, transport, plan, t, server_eval)
            rec.update(scores)
        t3 = time.perf_counter()
        rec.update(
            seconds_train=t1 - t0, seconds_aggregate=t2 - t1, seconds_eval=t3 - t2, seconds=t3 - t0
        )
        history.rounds.append(rec)
        history.participants.append(rec["participants"])
        stop = evaluated and stop_on_plateau(history.rounds, plan)
        if on_round is not None:
            on_round(rec)
        if checkpoint is not None:
            checkpoint.after_round(t, state, history, last_eval)
        if diverged >= DIVERGED_ROUNDS and plan.stop_on_divergence:
            raise Diverged(
                f"training diverged: no finite loss for {diverged} rounds in a row "
                f"(rounds {t - diverged + 1}-{t}); lower train.lr or check the data"
            )
        if stop:
            save_unless_due(checkpoint, t, state, history, last_eval)  # the last round run
            break
        if stop_requested.is_set() and t < plan.rounds:
            save_unless_due(checkpoint, t, state, history, last_eval)
            raise Interrupted(t, checkpoint is not None)
    history.final_eval = last_eval
    finetune(algo, state, transport, plan, history, last + 1)
    serve_newcomers(algo, state, transport, plan, history, last + 1)
    return history, state


def privacy_ledger(
    spec: FederationSpec, plan: RoundPlan, rounds: Sequence[dict[str, Any]]
) -> accountant.Ledger | None:
    """The run's privacy bookkeeping under ``[privacy]`` (None without), with the rounds already
    run (a resumed run) counted from their records."""
    rule = spec.privacy
    if not rule.on:
        return None
    ledger = accountant.Ledger(
        rule.mechanism,
        rule.accountant,
        rule.noise_multiplier,
        rule.delta,
        spec.num_clients,
        min(plan.clients_per_round, len(plan.pool)),
    )
    for rec in rounds:
        ledger.record(released(rec))
    return ledger


def count_sample_steps(
    algo: Algorithm,
    spec: FederationSpec,
    plan: RoundPlan,
    rec: dict[str, Any],
    steps: dict[int, int],
) -> float:
    """Add round ``rec``'s DP-SGD steps to ``steps`` (client -> steps so far) and return the
    largest per-example epsilon over the clients (``accountant.sample_epsilon``): each trained
    client took ``ceil(n / batch_size)`` Poisson steps an epoch, for its phases' epochs."""
    epochs = sum(p.epochs for p in algo.phases(rec["round"], plan.local_epochs))
    rule = spec.privacy
    for cid in released(rec):
        n = spec.num_train[cid]
        steps[cid] = steps.get(cid, 0) + epochs * math.ceil(n / plan.batch_size)
    worst = 0.0
    for cid, k in steps.items():
        q = min(1.0, plan.batch_size / max(spec.num_train[cid], 1))
        eps = accountant.sample_epsilon(
            rule.accountant, rule.sample_noise_multiplier, rule.delta, q, k
        )
        worst = max(worst, eps)
    return worst


def released(rec: dict[str, Any]) -> list[int]:
    """The clients whose upload a round released: those aggregated and those the server
    dropped (counted too: their noisy upload left them all the same)."""
    return sorted({*rec.get("participants", ()), *rec.get("rejected", ())})


def over_budget(
    spec: FederationSpec, ledger: accountant.Ledger | None, sampled: Sequence[int], t: int
) -> bool:
    """Whether round ``t`` would take the run past ``privacy.target_epsilon`` (then it is not
    run, and a line says so)."""
    target = spec.privacy.target_epsilon
    if ledger is None or target <= 0:
        return False
    eps = ledger.after_next(sampled)
    if eps <= target:
        return False
    log.warning(
        "privacy: stopped before round %d: it would bring epsilon to %.4g, past "
        "privacy.target_epsilon = %g (delta %g)",
        t,
        eps,
        target,
        spec.privacy.delta,
    )
    return True


def central_release(
    algo: Algorithm, state: Any, spec: FederationSpec, uploads: list[Weighted], round_num: int
) -> list[Weighted]:
    """The central mechanism (a trusted server): each of the round's ``K`` uploads clipped and
    given a ``1/sqrt(K)`` share of the sum's noise, so the uniform mean the method computes is
    the clipped sum plus ``N(0, (z C)^2)``, over ``K`` (``core/privacy.py``)."""
    if not uploads:
        return uploads
    rule = spec.privacy
    share = rule.noise_multiplier * rule.clip / math.sqrt(len(uploads))
    out = []
    for u in uploads:
        payload = privacy.release(
            u.payload,
            privacy.server_refs(u.payload, algo.upload_names(state, u.payload)),
            rule.clip,
            share,
            privacy.central_generator(spec.seed, round_num, u.client_id),
            spec.num_classes,
        )
        out.append(Weighted(u.client_id, u.weight, payload))
    return out


def resume(
    algo: Algorithm, spec: FederationSpec, checkpoint: RoundCheckpoint | None
) -> tuple[Any, History, list[EvalResult], int]:
    """``(server state, history, last evaluation, rounds done)``: a fresh start, or where the
    checkpoint left off."""
    state = algo.init_server(spec)
    if checkpoint is not None:
        restored = checkpoint.restore(state)
        if restored is not None:
            done, state, history, last_eval = restored
            return state, history, last_eval, done
    return state, History(), [], 0


def server_evaluates(algo: Algorithm, state: Any, spec: FederationSpec) -> bool:
    """Whether the rounds add the server's own accuracy: a server split and a global model."""
    if spec.server_eval is None:
        return False
    with _rng_kept(spec.device):
        has_model = algo.server_model(state, spec) is not None
    if not has_model:  # said at the default level: its rows were still taken from clients
        log.warning(
            "server evaluation (data.server_eval_size) skipped: %s holds no global model",
            type(algo).__name__,
        )
    return has_model


def sample_round(spec: FederationSpec, plan: RoundPlan, round_num: int) -> list[int]:
    """Round ``round_num``'s participants, drawn from the pool (the clients not held out)."""
    # Without held-out clients the pool is range(num_clients): the same draws as always.
    pool = plan.pool
    picks = sample_clients(spec.seed, round_num, len(pool), plan.clients_per_round)
    return [pool[i] for i in picks]


def broadcast(
    algo: Algorithm, state: Any, clients: Sequence[int], round_num: int
) -> dict[int, Payload]:
    """The server's message to each of ``clients`` for round ``round_num``."""
    return {c: algo.broadcast(state, c, round_num) for c in clients}


def screen_replies(
    algo: Algorithm,
    state: Any,
    spec: FederationSpec,
    view: robust.ServerView,
    results: Sequence[FitResult],
    round_num: int,
    watched: Collection[int] = (),
) -> tuple[list[Weighted], list[int]]:
    """The uploads that pass validation and the peer guard, and the clients whose reply was
    dropped (each drop logged with its reason). ``watched``: clients whose previous reply was
    dropped (:func:`suspects`), held to the peer guard's stricter factor."""
    uploads, rejected = [], []
    for r in results:
        try:
            check_reply(algo, state, spec, view, r)
        except PayloadError as exc:
            log.warning("round %d: dropped the reply of client %d: %s", round_num, r.client_id, exc)
            rejected.append(r.client_id)
            continue
        assert r.upload is not None  # check_reply refuses a missing one
        # Under [privacy] the example count is not used: a client's weight would reveal its size
        # and scale its share of the sum past the clip (uniform weights, as DP-FedAvg's).
        weight = 1.0 if spec.privacy.on else float(r.num_examples)
        uploads.append(Weighted(r.client_id, weight, r.upload))
    # The peer guard: an upload far outside the round's majority (``server.peer_factor``)
    # is dropped like an invalid one, and recorded in ``rejected``. The measured honest runs
    # drop nothing (so their numbers are those without the guard; a late straggler is measured
    # against at least 1% of the broadcast, docs/robustness.md); claims treat a cell that
    # dropped a reply as unfair.
    far = robust.peer_screen(view, [(u.client_id, u.weight) for u in uploads], watched)
    for u in uploads:
        if u.client_id in far:
            log.warning(
                "round %d: dropped the reply of client %d: %s",
                round_num,
                u.client_id,
                far[u.client_id],
            )
            rejected.append(u.client_id)
    return [u for u in uploads if u.client_id not in far], rejected


def suspects(rounds: Sequence[dict[str, Any]], clients: Iterable[int]) -> frozenset[int]:
    """The ``clients`` whose last reply (the last round each took part in) the server dropped.

    Read from the round records, so a resumed run (the records are in its checkpoint) and every
    runtime watch the same clients."""
    pending, out = set(clients), set()
    for rec in reversed(rounds):
        if not pending:
            break
        dropped = pending.intersection(rec.get("rejected", ()))
        kept = pending.intersection(rec.get("participants", ()))
        out |= dropped
        pending -= dropped | kept
    return frozenset(out)


def check_reply(
    algo: Algorithm, state: Any, spec: FederationSpec, view: robust.ServerView, r: FitResult
) -> None:
    """Raise ``PayloadError`` for a reply the server cannot use: undecodable, an implausible
    example count, or an upload its declarations refuse (``guard.check_upload``: the schema,
    the claims, magnitude sanity; it also keeps what the round's peer guard needs)."""
    if r.error is not None or r.upload is None:
        raise PayloadError(r.error or "no upload")
    if r.num_examples < 0 or r.num_examples > MAX_EXAMPLES:
        raise PayloadError(f"implausible example count {r.num_examples}")
    held = spec.num_train[r.client_id] if r.client_id < len(spec.num_train) else None
    if held is not None and r.num_examples > held:
        raise PayloadError(f"claims {r.num_examples} training examples; its partition has {held}")
    with robust.serving(view):
        guard.check_upload(r.upload, r.client_id, algo.upload_names(state, r.upload))


def secure_fit(
    algo: Algorithm,
    state: Any,
    spec: FederationSpec,
    transport: Transport,
    view: robust.ServerView,
    messages: dict[int, Payload],
    round_num: int,
) -> tuple[list[FitResult], list[Weighted], list[int], list[int], dict[str, Any]]:
    """A round's fit under secure aggregation: ``(replies, [the upload rebuilt from the sum],
    rejected clients, the clients in the sum, their clear metrics summed)``. The weight scale is
    public: 1 under ``[privacy]`` (every upload weighs 1), else the largest training split."""
    p = spec.privacy
    scale = 1.0 if p.on else float(max(spec.num_train, default=1) or 1)
    sf = secure.form(
        spec.seed,
        p.secagg_range,
        len(messages),
        scale,
        uniform=p.on,
        shares=p.secagg_shares,
        threshold=p.secagg_threshold,
    )
    results, total = transport.fit_secure(round_num, messages, sf)
    rejected = []
    for r in results:
        if r.error is not None:
            log.warning(
                "round %d: dropped the reply of client %d: %s", round_num, r.client_id, r.error
            )
            rejected.append(r.client_id)
    if total is None or not total.clients:
        return results, [], rejected, [], {}
    try:
        rebuilt = algo.from_sums(state, total.sums, round_num)
        with robust.serving(view):
            guard.check_upload(rebuilt.payload, -1, algo.upload_names(state, rebuilt.payload))
    except (PayloadError, KeyError, ValueError, RuntimeError) as exc:  # RuntimeError: a shape
        log.warning(
            "round %d: refused the secure sum of clients %s: %s",
            round_num,
            list(total.clients),
            exc,
        )
        return results, [], sorted({*rejected, *total.clients}), [], {}
    totals: dict[str, Any] = {}
    inside = set(total.clients)
    for r in results:
        if r.client_id in inside:
            for k, v in (r.metrics or {}).items():
                totals[k] = totals.get(k, 0) + v
    return results, [rebuilt], rejected, list(total.clients), totals


def upload_totals(algo: Algorithm, uploads: Sequence[Weighted]) -> dict[str, Any]:
    """The method's per-upload metrics (``upload_metrics``), summed over the round's uploads."""
    totals: dict[str, Any] = {}
    for u in uploads:
        for k, v in algo.upload_metrics(u.payload).items():
            totals[k] = totals.get(k, 0) + v
    return totals


def aggregate_round(
    algo: Algorithm,
    state: Any,
    uploads: list[Weighted],
    plan: RoundPlan,
    view: robust.ServerView,
    round_num: int,
    replies: int | None = None,
) -> tuple[Any, bool]:
    """``(server state, aggregated)``: the aggregate of ``uploads``, or the state unchanged when
    there are fewer than ``plan.min_replies`` valid replies (``replies``; default: the uploads;
    under secure aggregation one upload stands for the clients in the sum) or the aggregate is
    not finite."""
    minimum = max(plan.min_replies, 1)
    valid = len(uploads) if replies is None else replies
    if valid < minimum or not uploads:
        log.warning(
            "round %d: skipped: %d valid replies, fewer than the minimum of %d; "
            "the server state is unchanged",
            round_num,
            valid if uploads else 0,
            minimum,
        )
        return state, False
    with robust.serving(view):
        new_state = algo.aggregate(state, uploads, round_num)
    if robust.all_finite(new_state):
        return new_state, True
    # never broadcast NaN: this round's aggregation is refused
    log.warning(
        "round %d: refused the aggregate of clients %s: the new server state has "
        "NaN or Inf values; the previous state is kept",
        round_num,
        [u.client_id for u in uploads],
    )
    return state, False


def reply_stats(
    algo: Algorithm,
    sampled: Sequence[int],
    results: Sequence[FitResult],
    participants: Sequence[int],
) -> dict[str, Any]:
    """The round record's participants (the clients whose uploads were aggregated), traffic and
    mean training loss."""
    talks = algo.communicates
    up = sum(r.bytes_up for r in results) if talks else 0
    down = sum(r.bytes_down for r in results) if talks else 0
    losses = [r.loss for r in results if not math.isnan(r.loss)]
    return {
        "participants": list(participants),
        "num_sampled": len(sampled),
        "bytes_up": up,
        "bytes_down": down,
        "bytes_up_per_client": up / max(len(results), 1),
        "bytes_down_per_client": down / max(len(results), 1),
        "train_loss": float(np.mean(losses)) if losses else math.nan,
    }


def no_finite_loss(results: Sequence[FitResult], round_num: int) -> bool:
    """Whether some client trained and none has a finite training loss (a warning says so)."""
    # Clients that trained (a lost reply reports no examples): none with a finite loss.
    trained = [r for r in results if r.num_examples > 0]
    if trained and not any(math.isfinite(r.loss) for r in trained):
        log.warning(
            "round %d: no client has a finite training loss (diverged; lower train.lr?)",
            round_num,
        )
        return True
    return False


def evaluate_round(
    algo: Algorithm,
    state: Any,
    spec: FederationSpec,
    transport: Transport,
    plan: RoundPlan,
    round_num: int,
    server_eval: bool,
) -> tuple[list[EvalResult], dict[str, Any]]:
    """Every pool client evaluated on the next round's broadcast: the results and the round's
    accuracy statistics (with the server's own numbers when ``server_eval``)."""
    results = transport.evaluate(round_num, broadcast(algo, state, plan.pool, round_num + 1))
    scores = summarize_eval(results)
    if server_eval:  # the server's own numbers, next to the clients' reports
        scores.update(server_evaluate(algo, state, spec))
    return results, scores


def stop_on_plateau(rounds: list[dict[str, Any]], plan: RoundPlan) -> bool:
    """Whether validation accuracy has plateaued after the last round; if so its record gets
    ``"plateau": True`` and the stop is logged."""
    if not plateaued(rounds, plan.plateau_delta, plan.plateau_window, plan.plateau_min_rounds):
        return False
    rec = rounds[-1]
    rec["plateau"] = True
    log.info(
        "round %d: validation accuracy improved by less than %.2f points over the last "
        "%d%% of rounds: stopping (cap %d)",
        rec["round"],
        100 * plan.plateau_delta,
        round(100 * plan.plateau_window),
        plan.rounds,
    )
    return True


def save_unless_due(
    checkpoint: RoundCheckpoint | None,
    round_num: int,
    state: Any,
    history: History,
    last_eval: list[EvalResult],
) -> None:
    """Save the last round run when the checkpoint's schedule did not (kept models)."""
    if checkpoint is not None and not checkpoint.due(round_num):
        checkpoint.save(round_num, state, history, last_eval)


def after_rounds(plan: RoundPlan, round_num: int) -> int:
    """The round number the broadcast after the rounds carries: past the plan's last round even
    when a plateau stopped the run early, so a schedule over the rounds (layer expansion's
    unfreezing) reads it as finished."""
    return max(round_num, plan.rounds + 1)


def finetune(
    algo: Algorithm,
    state: Any,
    transport: Transport,
    plan: RoundPlan,
    history: History,
    round_num: int,
) -> None:
    """The method's local fine-tuning after the rounds, evaluated into ``history.finetune_eval``
    (nothing when the method has none or ``plan.finetune_epochs`` is 0)."""
    phases = algo.finetune_phases(None if plan.finetune_epochs < 0 else plan.finetune_epochs)
    if plan.finetune_epochs == 0 or not phases:
        return
    msgs = broadcast(algo, state, plan.pool, after_rounds(plan, round_num))
    transport.finetune(msgs, phases)
    history.finetune_eval = transport.evaluate(round_num, msgs, receive=False)


def serve_newcomers(
    algo: Algorithm,
    state: Any,
    transport: Transport,
    plan: RoundPlan,
    history: History,
    round_num: int,
) -> None:
    """The held-out clients, served as newcomers after the rounds."""
    if not plan.holdout:
        return
    # Newcomers: their initial models receive the final broadcast (evaluated as they
    # arrive), then run one round of the method's own client procedure (receive, its
    # phases and loss; the upload is discarded) and are evaluated again.
    msgs = broadcast(algo, state, plan.holdout, after_rounds(plan, round_num))
    history.holdout_before = transport.evaluate(round_num, msgs)
    transport.fit(round_num, msgs)
    history.holdout_after = transport.evaluate(round_num, msgs, receive=False)
