"""Robust aggregation, norm bounding and magnitude sanity: a server layer every method shares.

The server's rule (``[server]`` in the config, :class:`RobustRule`) travels on the
``FederationSpec``. The round loop makes it current (:func:`serving`) while it validates the
round's uploads and aggregates them, so a method's ``aggregate(state, uploads, round)`` keeps its
signature and reaches the rule through the helpers here (``_shared.weighted_average``,
:func:`class_average`, :func:`robust_points`, :func:`check_update`). Outside ``serving`` (unit
tests calling ``aggregate`` directly) the rule is the default: the plain mean, bitwise the numbers
of a federation without this layer.

Aggregators over the ``K`` clients of a round (each client's contribution one vector):
- ``mean``: the sample-weighted mean (the default; bitwise the historical numbers);
- ``median``: coordinate-wise median (Yin et al., ICML 2018), unweighted;
- ``trimmed_mean``: per coordinate, the ``floor(trim K)`` largest and smallest values dropped,
  the rest averaged (Yin et al. 2018), unweighted;
- ``krum``: the one contribution whose summed squared distance to its ``K - f - 2`` nearest
  others is smallest (Blanchard et al., NeurIPS 2017);
- ``multi_krum``: the ``K - f`` best Krum scores, sample-weighted mean of those.

Norm bounding (``clip_update_norm``, Sun et al., "Can You Really Backdoor Federated Learning?",
2019): each client's update (its upload minus the broadcast it received; for per-class vectors the
deviation from the current global row, or the row itself where the server has none) is scaled
to norm at most the bound before aggregation.

Magnitude sanity (``max_norm_ratio``): an upload whose update norm exceeds the ratio times the
norm of what the server broadcast is rejected with a logged reason (``PayloadError``), before any
aggregation. Where the server has broadcast nothing to compare with (prototypes in round 1) the
check cannot apply; clipping, the peer guard and the robust aggregators still do.

Peer guard (``peer_factor = k``, on by default): after every upload passed its own checks, an
upload far outside the round's majority is dropped with a logged reason (:func:`peer_screen`):
a model update whose norm is more than ``k`` x the median of the round's update norms (at
least 1% of the broadcast's norm) and more than ``k`` x the median per training example, or a
per-class row (prototype, class mean, logits) farther than ``k`` x its class's spread from the
coordinate-wise median row of that class. Medians of at least 3 values: one client cannot move them outside the honest values, and
each client is tested on its own numbers only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedmosaic.core.checks import (  # noqa: F401  (re-exported: the rule loads without torch)
    AGGREGATORS,
    NORM_RATIO_MIN,
    PEER_FACTOR_MIN,
    RobustRule,
    largest_f,
    trim_limit,
)
from fedmosaic.core.payload import PayloadError

# Fewer values than this (uploads in a round, holders of a class) have no majority to be
# measured against: the peer guard does not apply to them.
PEER_MIN = 3
# A class's rows are compared only where at least this many clients hold it. Honest rows of a
# class three clients hold reach 10.8 (FedGH) and 21 (FedDistill) x their scale on the default
# experiment's data (100 clients, Dirichlet 0.1, 20 rounds), at most 8.5 with four or more
# (docs/robustness.md): the median of three noisy rows is no centre.
PEER_MIN_ROWS = 4
# A client whose previous reply was dropped is tested at this fraction of ``peer_factor``.
SUSPECT_FRACTION = 0.5
# The scale a model update is measured against is at least this fraction of the broadcast's
# norm: where most of a federation has stopped moving, the median update is no scale for a
# client still moving (an honest straggler of a full-data LG-FedAvg run sat at 11 x the median
# update and 3 % of its broadcast's norm; docs/robustness.md).
UPDATE_FLOOR = 0.01
log = logging.getLogger("fedmosaic")


@dataclass(frozen=True)
class ServerView:
    """What the server applies and knows while it screens and aggregates a round."""

    rule: RobustRule = RobustRule()
    num_train: tuple[int, ...] | None = None  # training examples per client (the partition)
    class_counts: tuple[tuple[int, ...], ...] | None = None  # per client, per class
    round_num: int = 0  # the round being screened and aggregated (0: outside the round loop)
    # The local privacy mechanism's announced noise (``[privacy]``): ``(clip, sd)``, or None.
    # Its uploads are the clipped value plus N(0, sd^2) per coordinate: the magnitude checks
    # allow for that much (:func:`noise_slack`), or every private upload would be dropped.
    private_noise: tuple[float, float] | None = None
    # Every client's features are >= 0 (``FederationSpec.nonnegative_features``): class means of
    # features (``Rows(features=True)``) with a negative entry are refused.
    nonnegative_features: bool = False
    # what was already said this round (a rule that does not fit is said once, not per class)
    said: set[str] = field(default_factory=set, init=False, compare=False, repr=False)
    # what each client's upload showed while it was validated, for the peer guard: its update
    # norm (squared, summed over the parts checked) and its per-class rows (class -> [d])
    peer_sq: dict[int, float] = field(default_factory=dict, init=False, compare=False, repr=False)
    peer_rows: dict[int, dict[Any, Tensor]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # the norm (squared, summed over the parts checked) of what each update is measured from
    peer_ref_sq: dict[int, float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def note(self, message: str) -> None:
        """Log ``message`` once for this view (a round: a fresh view per round)."""
        if message in self.said:
            return
        self.said.add(message)
        where = f"round {self.round_num}: " if self.round_num else ""
        log.warning("%s%s", where, message)

    def held(self, client_id: int) -> Tensor | None:
        """``[C]`` bool: the classes client ``client_id``'s partition holds (None: unknown)."""
        if self.class_counts is None or not 0 <= client_id < len(self.class_counts):
            return None
        return torch.tensor(self.class_counts[client_id]) > 0

    def counts(self, client_id: int) -> Tensor | None:
        """``[C]`` int64: client ``client_id``'s training examples per class (None: unknown)."""
        if self.class_counts is None or not 0 <= client_id < len(self.class_counts):
            return None
        return torch.tensor(self.class_counts[client_id], dtype=torch.int64)


_DEFAULT = ServerView()
_CURRENT: contextvars.ContextVar[ServerView | None] = contextvars.ContextVar(
    "fedmosaic_server_view", default=None
)


@contextlib.contextmanager
def serving(view: ServerView) -> Iterator[ServerView]:
    """Make ``view`` current for the block (the round loop: validation and aggregation)."""
    token = _CURRENT.set(view)
    try:
        yield view
    finally:
        _CURRENT.reset(token)


def current() -> ServerView:
    """The server view in force (the default rule outside :func:`serving`)."""
    return _CURRENT.get() or _DEFAULT


def rule() -> RobustRule:
    """The robust rule in force (the plain mean outside :func:`serving`)."""
    return current().rule


NOISE_SIGMAS = 6.0  # the noise norm of n coordinates stays below sd (sqrt(n) + 6): P < 1e-7


def noise_slack(n: Callable[[], int]) -> float:
    """How far beyond the honest bound a locally private value of ``n()`` floats may lie: its
    clip plus the Gaussian noise's norm, which concentrates within ``sd (sqrt(n) + 6)``; 0
    without the local mechanism (``n`` is then not counted: every upload of every run passes
    here)."""
    noise = current().private_noise
    if noise is None:
        return 0.0
    clip, sd = noise
    return clip + sd * (math.sqrt(n()) + NOISE_SIGMAS)


# ---- aggregators over rows ------------------------------------------------------------------
def krum_scores(x: Tensor, f: int) -> Tensor:
    """Krum score per row of ``x [K, D]``: summed squared distance to its nearest ``K - f - 2``
    other rows (at least 1, at most ``K - 1``; Blanchard et al. 2017). ``[K]`` float64."""
    k = x.shape[0]
    if k == 1:
        return torch.zeros(1, dtype=torch.float64)
    return _krum_from_distances(_sq_distances(x.to(torch.float64)), f)


def _sq_distances(x: Tensor) -> Tensor:
    diff = x.unsqueeze(0) - x.unsqueeze(1)  # [K, K, D]; K is a round's clients: small
    return diff.pow(2).flatten(2).sum(2)


def _krum_from_distances(d2: Tensor, f: int) -> Tensor:
    k = d2.shape[0]
    if k == 1:
        return torch.zeros(1, dtype=torch.float64)
    # Fewer contributions than Krum needs (k <= 2f + 2: clients dropped, a class few clients
    # hold): the scores use what there is, and the round says so (never silently).
    closest = krum_neighbours(k, f)
    others = d2 + torch.diag(torch.full((k,), math.inf, dtype=d2.dtype))  # not itself
    return others.sort(1).values[:, :closest].sum(1)


def krum_select(scores: Tensor, multi: bool, f: int) -> Tensor:
    """Indices kept: the best score (``krum``) or the ``K - f`` best (``multi_krum``), sorted.
    Ties go to the lower index (a stable sort), so the choice is deterministic."""
    k = scores.numel()
    m = max(1, k - f) if multi else 1
    return torch.sort(torch.sort(scores, stable=True).indices[:m]).values


def trim_count(k: int, trim: float) -> int:
    """Values cut at each end of a coordinate for ``k`` rows: ``floor(trim k)``, leaving >= 1."""
    return min(math.floor(trim * k + 1e-9), (k - 1) // 2)


def krum_neighbours(k: int, f: int) -> int:
    """The nearest others each of ``k`` contributions is scored on: ``k - f - 2``, at least 1
    and at most ``k - 1`` (fewer contributions than Krum needs still give a score)."""
    return min(max(1, k - f - 2), k - 1)


def _say_if_unfit(k: int, r: RobustRule) -> None:
    """A rule that does not fit the ``k`` contributions in hand (fewer than planned) is applied
    as well as it can be and said once per round; the federation keeps going."""
    if r.aggregator in ("krum", "multi_krum") and r.f > largest_f(k):
        closest = krum_neighbours(k, r.f)
        kept = max(1, k - r.f) if r.aggregator == "multi_krum" else 1
        done = (
            f"scored each on its {closest} nearest other(s) and kept {kept}"
            if k > 1
            else "kept the only one"
        )
        current().note(
            f"{r.aggregator} with server.f = {r.f} needs more than {2 * r.f + 2} contributions, "
            f"got {k}: {done}"
        )
    elif r.aggregator == "trimmed_mean" and math.floor(r.trim * k + 1e-9) > (k - 1) // 2:
        current().note(
            f"trimmed_mean with server.trim = {r.trim} would cut every value of {k} "
            f"contributions: cut {trim_count(k, r.trim)} at each end instead"
        )


def aggregate_rows(x: Tensor, w: Tensor, r: RobustRule, selected: Tensor | None = None) -> Tensor:
    """Aggregate ``x [K, ...]`` over its first dimension with weights ``w [K]`` under rule ``r``.

    Computed in float64. ``selected`` are Krum's chosen rows when the caller scored the rows over
    more than ``x`` (a state dict's tensors are scored together, aggregated one by one).
    """
    x = x.to(torch.float64)
    w = w.to(torch.float64)
    k = x.shape[0]
    if selected is None:
        _say_if_unfit(k, r)
    if r.aggregator == "median":
        s = x.sort(0).values
        return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2
    if r.aggregator == "trimmed_mean":
        c = trim_count(k, r.trim)
        return x.sort(0).values[c : k - c].mean(0)
    if r.aggregator in ("krum", "multi_krum"):
        if selected is None:
            scores = krum_scores(x.flatten(1), r.f)
            selected = krum_select(scores, r.aggregator == "multi_krum", r.f)
        x, w = x[selected], w[selected]
    shape = (-1,) + (1,) * (x.dim() - 1)
    return (x * w.view(shape)).sum(0) / w.sum().clamp(min=1e-300)


def clip_scales(sq_norms: Tensor, bound: float) -> Tensor:
    """Per-row factor ``min(1, bound / ||u||)`` from squared norms (1 where the bound is 0)."""
    if bound <= 0:
        return torch.ones_like(sq_norms, dtype=torch.float64)
    norms = sq_norms.to(torch.float64).sqrt()
    return torch.where(norms > bound, bound / norms.clamp(min=1e-300), torch.ones_like(norms))


# ---- model states ---------------------------------------------------------------------------
def average_states(
    states: Sequence[dict[str, Tensor]],
    weights: Sequence[float],
    r: RobustRule,
    reference: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Robust counterpart of a weighted state-dict average.

    Floating tensors are aggregated as updates ``state - reference`` (the state itself without a
    reference), clipped to ``r.clip_update_norm`` over all of a client's tensors together, then
    aggregated per ``r`` and added back to the reference. Krum scores a client on all its
    tensors. Integer buffers keep the maximum, as in the plain average.
    """
    keys = [k for k, t in states[0].items() if t.is_floating_point()]
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)

    def updates(key: str) -> Tensor:  # [K, ...] float64
        x = torch.stack([s[key].detach().cpu().to(torch.float64) for s in states])
        if reference is not None:
            x = x - reference[key].detach().cpu().to(torch.float64)
        return x

    k = len(states)
    scales = torch.ones(k, dtype=torch.float64)
    if r.clip_update_norm > 0:
        sq = torch.zeros(k, dtype=torch.float64)
        for key in keys:
            sq += updates(key).flatten(1).pow(2).sum(1)
        scales = clip_scales(sq, r.clip_update_norm)
    selected = None
    _say_if_unfit(k, r)
    if r.aggregator in ("krum", "multi_krum"):
        d2 = torch.zeros(k, k, dtype=torch.float64)
        for key in keys:
            u = updates(key).flatten(1) * scales.unsqueeze(1)
            d2 += _sq_distances(u)
        selected = krum_select(_krum_from_distances(d2, r.f), r.aggregator == "multi_krum", r.f)
    out: dict[str, Tensor] = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            out[key] = torch.stack([s[key] for s in states]).amax(0)
            continue
        u = updates(key)
        u = u * scales.view((-1,) + (1,) * (u.dim() - 1))
        agg = aggregate_rows(u, w, r, selected)
        if reference is not None:
            agg = agg + reference[key].detach().cpu().to(torch.float64)
        out[key] = agg.to(first.dtype).to(first.device)
    return out


def update_norm(
    state: dict[str, Tensor],
    reference: dict[str, Tensor],
    scale: dict[str, Tensor] | None = None,
) -> tuple[float, float]:
    """``(||state - reference||, ||scale||)`` over ``state``'s floating tensors, in float64.

    An entry of ``state`` the reference lacks (or holds in another shape) counts whole; the scale
    (``reference`` by default) is measured over the entries ``state`` has, so an upload of some
    blocks (layer expansion) is compared with those blocks."""
    scale = reference if scale is None else scale
    du, dr = 0.0, 0.0
    for key, x in state.items():
        if not x.is_floating_point():
            continue
        # Norms accumulated in float64 without float64 copies of the tensors (every upload of
        # every SharedWeights-family round passes here: it is a hot path of the server).
        # The upload arrives on the CPU while the first round's state may sit on the training
        # device (``init_server`` builds a model there): compare on the reference's device.
        ref = reference.get(key)
        if ref is not None and ref.shape == x.shape and ref.is_floating_point():
            ref = ref.detach()
            diff = x.detach().to(ref.device) - ref
        else:
            diff = x.detach()
        du += float(torch.linalg.vector_norm(diff, dtype=torch.float64)) ** 2
        s = scale.get(key)
        if s is not None and s.is_floating_point():
            dr += float(torch.linalg.vector_norm(s.detach(), dtype=torch.float64)) ** 2
    return math.sqrt(du), math.sqrt(dr)


def _peer_view() -> ServerView | None:
    """The round's view where the peer guard is on (None outside the round loop: nothing kept)."""
    view = _CURRENT.get()
    return view if view is not None and view.rule.peer_factor > 0 else None


def check_update(
    state: dict[str, Tensor],
    reference: dict[str, Tensor],
    client_id: int,
    what: str,
    scale: dict[str, Tensor] | None = None,
) -> None:
    """Magnitude sanity of a model upload: ``||state - reference|| <= ratio * ||scale||``
    (``scale``: the reference by default).

    The update norm is also kept for the round's peer guard (:func:`peer_screen`)."""
    ratio = rule().max_norm_ratio
    peers = _peer_view()
    if ratio <= 0 and peers is None:
        return
    du, dr = update_norm(state, reference, scale)
    slack = noise_slack(
        lambda: sum(t.numel() for k, t in state.items() if t.is_floating_point() and k in reference)
    )
    # ``not <=``: a NaN norm is rejected too
    if ratio > 0 and dr > 0 and not du <= ratio * dr + slack:
        allowed = f" + {slack:.3g} for the privacy noise" if slack else ""
        raise PayloadError(
            f"client {client_id} {what}: update norm {du:.3g} exceeds {ratio:g} x the "
            f"broadcast's norm {dr:.3g}{allowed} (server.max_norm_ratio)"
        )
    if peers is not None:  # parts checked one by one add up to the upload's update norm
        peers.peer_sq[client_id] = peers.peer_sq.get(client_id, 0.0) + du * du
        peers.peer_ref_sq[client_id] = peers.peer_ref_sq.get(client_id, 0.0) + dr * dr


def _factor_name(client_id: int, suspects: Collection[int]) -> str:
    if client_id in suspects:
        return f"{SUSPECT_FRACTION:g} x server.peer_factor: its previous reply was dropped"
    return "server.peer_factor"


def forget(client_id: int) -> None:
    """Drop what the round's peer guard kept of a client whose upload was refused."""
    peers = _peer_view()
    if peers is not None:
        peers.peer_sq.pop(client_id, None)
        peers.peer_ref_sq.pop(client_id, None)
        peers.peer_rows.pop(client_id, None)


RowKey = int | tuple[str, int]  # a class, or (field, class); class -1: the field as one vector


def note_rows(rows: Tensor, classes: Tensor | None, client_id: int, field: str = "") -> None:
    """Keep a client's per-class vectors ``rows [k, d]`` of ``classes [k]`` (None: ``rows [1, d]``
    is the field's value as one vector) for the round's peer guard (:func:`peer_screen`); a no-op
    outside the round loop or with the guard off."""
    peers = _peer_view()
    if peers is None:
        return
    kept = peers.peer_rows.setdefault(client_id, {})
    ids = [-1] if classes is None else classes.tolist()
    for j, row in zip(ids, rows.detach().cpu().to(torch.float64), strict=True):
        kept[(field, int(j)) if field else int(j)] = row


def _row_order(key: RowKey) -> tuple[str, int]:
    return ("", key) if isinstance(key, int) else key


def _row_name(key: RowKey) -> str:
    if isinstance(key, int):
        return f"class {key} row"
    field, j = key
    return field if j < 0 else f"class {j} {field} row"


def _median(values: Sequence[float]) -> float:
    """The median (even count: the mean of the two middle values); NaN sorts last."""
    s = sorted(values, key=lambda v: (math.isnan(v), v))
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def peer_screen(
    view: ServerView, uploads: Sequence[tuple[int, float]], suspects: Collection[int] = ()
) -> dict[int, str]:
    """The uploads the peer guard rejects, with the reason: ``{client id: reason}``; empty when
    none or the guard is off. ``uploads``: ``(client id, weight)`` of the round's uploads that
    passed their own checks (the weight: the training examples the client reported, which the
    round loop bounds by its partition). ``suspects``: clients whose previous reply was dropped;
    they are tested at ``SUSPECT_FRACTION`` of the factor (at least ``PEER_FACTOR_MIN``), so an
    attacker caught once stays out while it keeps sending what it sent, and comes back when its
    upload is within half the factor of its peers' again.

    Model updates: rejected where the update norm ``||w_i - w_broadcast||`` is more than ``k x``
    the round's scale (the median of the round's update norms, at least ``UPDATE_FLOOR`` x the
    median norm of what the updates are measured from) *and* the norm per training example is
    more than ``k x`` the median per example. Clients of very different sizes take very
    different numbers of local steps: a client with 100 x the median's data moves 100 steps'
    worth (an outlier by norm, ordinary per example), a client with 3 examples moves one step
    (an outlier per example, small by norm); an attacker scaling its update is an outlier by
    both. The floor keeps an honest straggler in a federation that has stopped moving.

    Per-class rows: for each class, rejected where the row's distance to the coordinate-wise
    median row of the holders exceeds ``k x`` the class's scale, the larger of the median
    distance and the median row norm (so honest rows that differ among themselves, e.g. models
    of different architectures, are measured against their own spread).

    Fewer than ``PEER_MIN`` uploads (``PEER_MIN_ROWS`` holders of a class) have no majority,
    and a median
    of 0 (most clients did not move) no scale: the test is skipped for them. One client cannot
    move a median of 3 or more values outside the honest ones, so an honest upload is not
    dropped for another client's poison; each client is tested on its own numbers.
    """
    k = view.rule.peer_factor
    if k <= 0 or len(uploads) < PEER_MIN:
        return {}
    strict = max(PEER_FACTOR_MIN, SUSPECT_FRACTION * k)
    factor = {c: strict if c in suspects else k for c, _ in uploads}
    out: dict[int, str] = {}
    sizes = {c: max(float(w), 1.0) for c, w in uploads}  # a 0 weight counts as one example
    ids = list(sizes)
    norms = {c: math.sqrt(view.peer_sq[c]) for c in ids if c in view.peer_sq}
    med = _median(list(norms.values())) if len(norms) >= PEER_MIN else 0.0
    if med > 0:  # 0: most clients did not move, there is no scale to measure a peer against
        refs = [math.sqrt(view.peer_ref_sq[c]) for c in norms if c in view.peer_ref_sq]
        floor = UPDATE_FLOOR * _median(refs) if refs else 0.0
        scale = max(med, floor)
        per = {c: n / sizes[c] for c, n in norms.items()}
        med_per = _median(list(per.values()))
        for c, n in norms.items():
            kc = factor[c]
            if not (n <= kc * scale or per[c] <= kc * med_per):  # ``not <=``: NaN rejected too
                of = (
                    f"the median {med:.3g} of the round's {len(norms)} update norms"
                    if med >= floor
                    else f"{UPDATE_FLOOR:g} x the broadcast's norm {floor / UPDATE_FLOOR:.3g} "
                    f"(the median of the round's {len(norms)} update norms is {med:.3g})"
                )
                out[c] = (
                    f"update norm {n:.3g} is more than {kc:g} x {of}, and {per[c]:.3g} per "
                    f"training example more than {kc:g} x the median {med_per:.3g} per example "
                    f"({_factor_name(c, suspects)})"
                )
    rows = {c: view.peer_rows[c] for c in ids if c in view.peer_rows}
    for j in sorted({j for r in rows.values() for j in r}, key=_row_order):
        holders = [c for c in rows if j in rows[c]]
        if len(holders) < PEER_MIN_ROWS:
            continue
        x = torch.stack([rows[c][j] for c in holders])  # [h, d] float64
        centre = aggregate_rows(x, torch.ones(len(holders)), RobustRule("median"))
        dist = (x - centre).norm(dim=1).tolist()
        scale = max(_median(dist), _median(x.norm(dim=1).tolist()))
        if not scale > 0:  # most rows are zero: no scale to measure the others against
            continue
        for c, dc in zip(holders, dist, strict=True):
            kc = factor[c]
            if c not in out and not dc <= kc * scale:
                out[c] = (
                    f"its {_row_name(j)} is {dc:.3g} from the median of the {len(holders)} "
                    f"clients' rows, more than {kc:g} x their scale {scale:.3g} "
                    f"({_factor_name(c, suspects)})"
                )
    return out


# ---- per-class vectors (prototypes, class means, logits) -------------------------------------
def _known_rows(reference: Tensor, ref_known: Tensor | None) -> Tensor:
    """``reference [C, d]`` in float64 with the rows the server has nothing for set to zero."""
    ref = reference.detach().cpu().to(torch.float64)
    if ref_known is None:
        return ref
    return torch.where(ref_known.cpu().unsqueeze(1), ref, torch.zeros_like(ref))


def check_rows(
    rows: Tensor,
    classes: Tensor,
    reference: Tensor,
    ref_known: Tensor,
    client_id: int,
    what: str,
    field: str = "",
) -> None:
    """Magnitude sanity of per-class vectors ``rows [k, d]`` of ``classes [k]``.

    A row of a class the server has a global vector for must stay within ``ratio x`` the largest
    global row norm of that global (``reference [C, d]``, ``ref_known [C]``). Rows of classes
    the server has nothing for are not bounded here (nothing to derive a bound from); every row
    is kept for the round's peer guard, which bounds them against the other clients' rows.
    """
    note_rows(rows, classes, client_id, field)  # for the peer guard, with or without a global row
    ratio = rule().max_norm_ratio
    if ratio <= 0 or not bool(ref_known.any()) or classes.numel() == 0:
        return
    ref = reference.to(torch.float64)
    scale = float(ref[ref_known].norm(dim=1).max())
    if scale <= 0:
        return
    known = ref_known[classes]  # [k]
    dev = (rows.to(torch.float64) - ref[classes]).norm(dim=1)[known]  # [k'] deviations
    slack = noise_slack(lambda: rows.shape[-1]) if rows.dim() else 0.0
    if dev.numel() and not bool((dev <= ratio * scale + slack).all()):
        worst = float(dev.nan_to_num(math.inf).max())
        allowed = f" (+ {slack:.3g} for the privacy noise)" if slack else ""
        raise PayloadError(
            f"client {client_id} {what}: a row deviates by {worst:.3g} from the global one, more "
            f"than {ratio:g} x the largest global norm {scale:.3g}{allowed} "
            "(server.max_norm_ratio)"
        )


def check_claimed_classes(present: Tensor, client_id: int, what: str) -> None:
    """Reject an upload claiming classes (``present [C]`` bool) its client's partition lacks."""
    held = current().held(client_id)
    if held is None or held.numel() != present.numel():
        return
    extra = (present.cpu() & ~held).nonzero().flatten().tolist()
    if extra:
        raise PayloadError(
            f"client {client_id} {what}: claims classes {extra[:10]} its partition does not hold"
        )


def check_class_counts(counts: Tensor, client_id: int, what: str) -> None:
    """Reject per-class counts above what the client's partition holds (per class where the
    server knows it, else in total)."""
    view = current()
    held = view.counts(client_id)
    if held is not None and held.numel() == counts.numel():
        over = (counts.cpu() > held).nonzero().flatten().tolist()
        if over:
            raise PayloadError(
                f"client {client_id} {what}: counts of classes {over[:10]} exceed the "
                f"partition's ({counts[over[0]]} > {int(held[over[0]])})"
            )
    elif view.num_train is not None and 0 <= client_id < len(view.num_train):
        total = int(counts.sum())
        if total > view.num_train[client_id]:
            raise PayloadError(
                f"client {client_id} {what}: counts sum to {total}, the partition holds "
                f"{view.num_train[client_id]}"
            )


def class_average(
    vectors: Tensor,
    present: Tensor,
    weights: Tensor,
    r: RobustRule,
    reference: Tensor | None = None,
    ref_known: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per class, the robust aggregate of the rows of the clients that hold it.

    ``vectors [K, C, d]``, ``present [K, C]`` bool, ``weights [K, C]`` (the mean's and
    multi-Krum's weights). Each row is first taken as its deviation from the known reference row
    (``reference [C, d]``, ``ref_known [C]``) and clipped to ``r.clip_update_norm``. Returns
    ``[C, d]`` float32 (zero rows where no client holds the class) and ``known [C]``.
    """
    k, c, d = vectors.shape
    base = torch.zeros(c, d, dtype=torch.float64)
    if reference is not None:
        base = _known_rows(reference, ref_known)  # [C, d]
    dev = vectors.to(torch.float64) - base  # [K, C, d]
    if r.clip_update_norm > 0:
        dev = dev * clip_scales(dev.pow(2).sum(2), r.clip_update_norm).unsqueeze(2)
    out = torch.zeros(c, d, dtype=torch.float64)
    known = present.any(0)
    for j in known.nonzero().flatten().tolist():
        rows = present[:, j]
        out[j] = aggregate_rows(dev[rows, j], weights[rows, j], r)
    out = torch.where(known.unsqueeze(1), out + base, out)
    return out.to(torch.float32), known


def robust_points(
    points: Tensor,
    labels: Tensor,
    r: RobustRule,
    reference: Tensor | None = None,
    ref_known: Tensor | None = None,
) -> Tensor:
    """For servers that learn from the uploaded per-class points (FedTGP, FedGH).

    ``points [N, d]`` with class ``labels [N]`` (one point per client and class). Every point is
    clipped like :func:`class_average`'s rows; under an aggregator other than the mean each point
    is then replaced by its class's robust aggregate (uniform weights), so the server trains on
    the robust centre with the class's multiplicity unchanged. Returns ``[N, d]`` float32.
    """
    if r.plain:
        return points
    base = torch.zeros(points.shape, dtype=torch.float64)
    if reference is not None:
        base = _known_rows(reference, ref_known)[labels]  # [N, d]
    dev = points.detach().cpu().to(torch.float64) - base
    if r.clip_update_norm > 0:
        dev = dev * clip_scales(dev.pow(2).sum(1), r.clip_update_norm).unsqueeze(1)
    if r.aggregator != "mean":
        centre = dev.clone()
        for j in labels.unique().tolist():
            rows = labels == j
            centre[rows] = aggregate_rows(dev[rows], torch.ones(int(rows.sum())), r)
        dev = centre
    return (dev + base).to(torch.float32)


# ---- the server's own state ------------------------------------------------------------------
def all_finite(obj: Any) -> bool:
    """Whether every floating tensor of a server state is finite (tensors, modules, containers,
    dataclasses). Python floats are diagnostics (a loss may be NaN by design) and not checked."""
    if isinstance(obj, Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, nn.Module):
        return all(all_finite(t) for t in obj.state_dict().values())
    if isinstance(obj, dict):
        return all(all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(all_finite(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return all(all_finite(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return True
