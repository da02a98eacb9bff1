"""Privacy accounting: ``epsilon`` at ``delta`` of client-level differential privacy.

What each client uploads in a round has its data-dependent part clipped to L2 norm ``C`` and
Gaussian noise of standard deviation ``z C`` added (``z`` is ``noise_multiplier``). Neighbouring
datasets are *replace one*: for ``local`` DP any two datasets of one client (its clipped upload
moves by at most ``2C``), for ``central`` DP the federation with one client replaced (the clipped
sum moves by at most ``2C``). Either way the Gaussian mechanism's noise over its L2 sensitivity is
``z / 2``.

- ``central``: the server adds the noise to the sum of the ``k`` of ``n`` clients it sampled
  uniformly without replacement; every client has the same epsilon, that of ``t`` rounds of
  ``SampledWithoutReplacementDpEvent(n, k, GaussianDpEvent(z / 2))`` (plain
  ``GaussianDpEvent(z / 2)`` when ``k == n``).
- ``local``: each client noises its own upload. The server sees who took part, so sampling
  amplifies nothing: client ``i``'s epsilon is that of its ``m_i`` uploads, ``m_i`` compositions
  of ``GaussianDpEvent(z / 2)``; the run's epsilon is the largest over clients.

Accountants (dp-accounting, an optional dependency): ``rdp`` (Renyi DP, its default orders) and
``pld`` (privacy loss distributions; tight, but it has no sampling without replacement).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

MECHANISMS = ("local", "central")
ACCOUNTANTS = ("rdp", "pld")

_MISSING = "privacy accounting needs dp-accounting: pip install 'fedmosaic[privacy]'"


def _dp() -> Any:
    """The ``dp_accounting`` package, imported on first use: it is an optional dependency."""
    try:
        import dp_accounting  # type: ignore[import-not-found, import-untyped, unused-ignore]
        import dp_accounting.pld  # type: ignore[import-not-found, import-untyped, unused-ignore]
        import dp_accounting.rdp  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    return dp_accounting


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Drop absl warnings for the duration: dp-accounting's RDP code logs ones it handles itself
    (an order whose series failed to converge is left out of the minimum, a negative divergence
    from rounding counts as zero), which tell a user nothing about the result."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(
    mechanism: str,
    accountant: str,
    noise_multiplier: float,
    delta: float,
    num_clients: int,
    per_round: int,
) -> None:
    """Raise ``ValueError`` (one line, naming the argument) for arguments no accounting fits."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism = {mechanism!r}; choose one of {', '.join(MECHANISMS)}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant = {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    if (
        not _is_number(noise_multiplier)
        or not math.isfinite(noise_multiplier)
        or noise_multiplier < 0
    ):
        raise ValueError(f"noise_multiplier = {noise_multiplier!r} must be a finite number >= 0")
    if not _is_number(delta) or not 0 < delta < 1:
        raise ValueError(f"delta = {delta!r} must be a number in (0, 1)")
    if not _is_int(num_clients) or num_clients < 1:
        raise ValueError(f"num_clients = {num_clients!r} must be an int >= 1")
    if not _is_int(per_round) or not 1 <= per_round <= num_clients:
        raise ValueError(
            f"per_round = {per_round!r} must be an int in [1, num_clients = {num_clients}]"
        )
    if mechanism == "central" and accountant == "pld" and per_round < num_clients:
        raise ValueError(
            f"accountant = 'pld' cannot account sampling {per_round} of {num_clients} clients "
            "without replacement; use accountant 'rdp'"
        )


def _event(dp: Any, sigma: float, num_clients: int, per_round: int) -> Any:
    """One step's ``DpEvent``: the Gaussian with noise/sensitivity ``sigma``, sampled when
    ``per_round < num_clients``."""
    gaussian = dp.GaussianDpEvent(sigma)
    if per_round < num_clients:
        return dp.SampledWithoutReplacementDpEvent(num_clients, per_round, gaussian)
    return gaussian


@functools.lru_cache(maxsize=64)
def _rdp_per_step(sigma: float, num_clients: int, per_round: int) -> tuple[Any, Any]:
    """The RDP orders and one step's RDP at each (read-only arrays).

    Composition adds RDP, so ``t`` steps are ``t`` times this vector: a round loop asking for the
    epsilon of every round pays the sampled computation (about 0.1 s) once, not per round.
    """
    dp = _dp()
    acc = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
    with _quiet_absl():
        acc.compose(_event(dp, sigma, num_clients, per_round))
    orders, rdp = acc.orders, acc.rdp
    orders.setflags(write=False)
    rdp.setflags(write=False)
    return orders, rdp


def epsilon(
    mechanism: str,
    accountant: str,
    noise_multiplier: float,
    delta: float,
    steps: int,
    num_clients: int = 1,
    per_round: int = 1,
) -> float:
    """(epsilon at delta) after `steps` compositions: for central, steps = rounds run; for local,
    steps = the client's participations.

    ``num_clients`` and ``per_round`` (``n`` and ``k``) matter for ``central`` only, where
    ``k < n`` is amplification by sampling (``rdp`` only). ``inf`` without noise, 0 before any
    step.
    """
    _check(mechanism, accountant, noise_multiplier, delta, num_clients, per_round)
    trivial = _no_steps_or_noise(steps, noise_multiplier)
    if trivial is not None:
        return trivial
    dp = _dp()
    # The noise is z C against a replace-one sensitivity of 2C (module docstring).
    sigma = float(noise_multiplier) / 2
    if mechanism == "local" or per_round == num_clients:
        num_clients = per_round = 1  # no sampling: one cache entry for local and full central
    if accountant == "rdp":
        orders, rdp = _rdp_per_step(sigma, num_clients, per_round)
        with _quiet_absl():
            eps = dp.rdp.compute_epsilon(orders, steps * rdp, delta)[0]
        return float(eps)
    # PLD, un-sampled only (_check). Under REPLACE_ONE dp-accounting's PLD reads a Gaussian's
    # multiplier as noise over one record's norm bound and doubles the shift itself, which would
    # count our factor 2 twice; under ADD_OR_REMOVE_ONE the shift is the sensitivity, so
    # GaussianDpEvent(z / 2) is exactly our mechanism (dp-accounting's RDP reads the multiplier
    # over the sensitivity, un-sampled under any relation, sampled under REPLACE_ONE, the
    # relation sampling without replacement needs there). dp-accounting builds t compositions
    # as one Gaussian of noise sigma / sqrt(t); with the default discretization (1e-4) its cost
    # grows with the privacy loss's range, about mu^2 for mu = sqrt(t) / sigma: a few seconds at
    # mu = 10 (sigma = 1, 100 steps), minutes at mu = 100.
    acc = dp.pld.PLDAccountant()
    with _quiet_absl():
        acc.compose(dp.SelfComposedDpEvent(dp.GaussianDpEvent(sigma), steps))
        eps = acc.get_epsilon(delta)
    return float(eps)


def _no_steps_or_noise(steps: int, noise_multiplier: float) -> float | None:
    """Epsilon where no accounting is needed (0 before any step, inf without noise), else None;
    ``steps`` checked (an int >= 0)."""
    if not _is_int(steps) or steps < 0:
        raise ValueError(f"steps = {steps!r} must be an int >= 0")
    if steps == 0:
        return 0.0
    return math.inf if noise_multiplier == 0 else None


@functools.lru_cache(maxsize=4096)
def sample_epsilon(
    accountant: str, noise_multiplier: float, delta: float, q: float, steps: int
) -> float:
    """DP-SGD's (epsilon at delta) per training example after ``steps`` steps of Poisson
    sampling at rate ``q`` (``1``: every example every step) with Gaussian noise
    ``noise_multiplier`` x the per-example clip: add-or-remove one example, whose clipped
    gradient moves the sum by at most the clip (core/dpsgd.py). ``inf`` without noise."""
    if not 0 < q <= 1:
        raise ValueError(f"q = {q!r} must be in (0, 1]")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant = {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    trivial = _no_steps_or_noise(steps, noise_multiplier)
    if trivial is not None:
        return trivial
    dp = _dp()
    event = dp.GaussianDpEvent(float(noise_multiplier))
    if q < 1:
        event = dp.PoissonSampledDpEvent(float(q), event)
    acc = dp.rdp.RdpAccountant() if accountant == "rdp" else dp.pld.PLDAccountant()
    with _quiet_absl():
        acc.compose(event, steps)
        return float(acc.get_epsilon(delta))


def noise_for(
    mechanism: str,
    accountant: str,
    target: float,
    delta: float,
    steps: int,
    num_clients: int = 1,
    per_round: int = 1,
) -> float:
    """The smallest noise multiplier (to 1e-4 relative) whose :func:`epsilon` after ``steps``
    is at most ``target``: bisection on a log scale, epsilon falling as the noise grows."""
    if not _is_number(target) or not math.isfinite(target) or target <= 0:
        raise ValueError(f"target = {target!r} must be a finite number > 0")

    def eps(z: float) -> float:
        return epsilon(mechanism, accountant, z, delta, steps, num_clients, per_round)

    lo, hi = 1e-3, 1e6
    if eps(hi) > target:
        raise ValueError(f"epsilon {target:g} at delta {delta:g} needs more noise than {hi:g}")
    if eps(lo) <= target:
        return lo
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    return hi


@dataclass
class Ledger:
    """Per-run bookkeeping the round loop keeps: participations per client, epsilon per round.

    ``participations`` left empty starts at zeros for every client. Epsilons are cached by step
    count (rounds for central, participations for local), so asking every round is cheap.
    """

    mechanism: str
    accountant: str
    noise_multiplier: float
    delta: float
    num_clients: int
    per_round: int
    participations: list[int] = field(default_factory=list)
    rounds: int = 0
    _cache: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(
            self.mechanism,
            self.accountant,
            self.noise_multiplier,
            self.delta,
            self.num_clients,
            self.per_round,
        )
        if not self.participations:
            self.participations = [0] * self.num_clients
        if len(self.participations) != self.num_clients or not all(
            _is_int(m) and m >= 0 for m in self.participations
        ):
            raise ValueError(
                f"participations must be {self.num_clients} ints >= 0 (one per client), "
                f"got {self.participations!r}"
            )
        if not _is_int(self.rounds) or self.rounds < 0:
            raise ValueError(f"rounds = {self.rounds!r} must be an int >= 0")

    def _eps(self, steps: int) -> float:
        if steps not in self._cache:
            self._cache[steps] = epsilon(
                self.mechanism,
                self.accountant,
                self.noise_multiplier,
                self.delta,
                steps,
                self.num_clients,
                self.per_round,
            )
        return self._cache[steps]

    def _clients(self, clients: Sequence[int]) -> list[int]:
        """The round's client indices, checked: in range, each once, at most ``per_round``."""
        out = [operator.index(c) for c in clients]
        if len(out) > self.per_round:
            raise ValueError(
                f"clients: {len(out)} uploaded in one round, more than per_round = {self.per_round}"
            )
        seen: set[int] = set()
        for c in out:
            if not 0 <= c < self.num_clients:
                raise ValueError(f"clients: index {c} outside [0, {self.num_clients})")
            if c in seen:
                raise ValueError(f"clients: client {c} listed twice in one round")
            seen.add(c)
        return out

    def _worst(self, participations: Sequence[int]) -> float:
        return max(self._eps(m) for m in set(participations))

    def record(self, clients: Sequence[int]) -> None:
        """One round ran; these clients uploaded."""
        checked = self._clients(clients)
        self.rounds += 1
        for c in checked:
            self.participations[c] += 1

    def current(self) -> float:
        """The run's epsilon now: central, that of the rounds run; local, the largest client's."""
        if self.mechanism == "central":
            return self._eps(self.rounds)
        return self._worst(self.participations)

    def per_client(self) -> list[float]:
        """Each client's epsilon now (central: all the same)."""
        if self.mechanism == "central":
            return [self._eps(self.rounds)] * self.num_clients
        return [self._eps(m) for m in self.participations]

    def after_next(self, clients: Sequence[int]) -> float:
        """The run's epsilon if these clients uploaded in one more round (to stop before a target
        epsilon is exceeded); the ledger is left as it was."""
        checked = self._clients(clients)
        if self.mechanism == "central":
            return self._eps(self.rounds + 1)
        bumped = list(self.participations)
        for c in checked:
            bumped[c] += 1
        return self._worst(bumped)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields, for checkpoints (:meth:`from_dict` reads them back)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        out["participations"] = list(self.participations)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Ledger:
        """The ledger :meth:`to_dict` wrote."""
        names = {f.name for f in fields(cls) if f.init}
        optional = {"participations", "rounds"}
        missing = sorted(names - optional - set(data))
        unknown = sorted(set(data) - names)
        problems = [f"missing keys {missing}"] if missing else []
        problems += [f"unknown keys {unknown}"] if unknown else []
        if problems:
            raise ValueError(f"Ledger.from_dict: {', '.join(problems)}")
        kwargs = dict(data)
        if "participations" in kwargs:
            kwargs["participations"] = list(kwargs["participations"])
        return cls(**kwargs)
