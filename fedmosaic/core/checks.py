"""The torch-free checks the config and the command line need.

The server's aggregation rule (:class:`RobustRule`, the ``[server]`` config table) with its
validation and the bounds it is checked against, the round plan's client count
(:func:`clients_per_round`) and the "did you mean" suffix of a refusal (:func:`did_you_mean`).
They need no tensors, so ``fedmosaic.config`` and the command line load them without importing
torch (``fedmosaic --version`` or a config typo costs no torch import); ``core/robust.py`` (the
aggregators' maths) and ``core/rounds.py`` (the round loop) re-export them under their old
names.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def did_you_mean(name: str, known: Iterable[str], template: str = "{}") -> str:
    """``"; did you mean 'x'?"`` for the known names closest to a mistyped ``name``
    (``difflib``'s ratio of at least 0.6, at most two), or ``""`` when none is close.
    ``template`` formats each suggestion (``"train.{}"``: a key shown with its section)."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=2, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(template.format(c)) for c in close) + "?"


AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "multi_krum")


PEER_FACTOR_MIN = 2.0  # the smallest peer guard that keeps uploads within 2x the median
NORM_RATIO_MIN = 1.0  # the smallest magnitude check that keeps updates as large as the model


@dataclass(frozen=True)
class RobustRule:
    """The server's aggregation rule: the ``[server]`` config table."""

    # how the server combines the uploads: mean | median | trimmed_mean | krum | multi_krum
    aggregator: str = "mean"
    trim: float = 0.1  # trimmed_mean: fraction cut at each end of every coordinate, in [0, 0.5)
    f: int = 1  # krum / multi_krum: number of Byzantine clients tolerated
    clip_update_norm: float = 0.0  # > 0: every client update scaled to at most this L2 norm
    # reject an upload whose update norm exceeds this many times the broadcast's norm; 0 = off,
    # else at least 1
    max_norm_ratio: float = 100.0
    # peer guard: reject an upload more than this many times the round's median (update norm,
    # per-class row distance) away; 0 = off, else at least 2. See docs/robustness.md for why 10.
    peer_factor: float = 10.0

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATORS:
            raise ValueError(
                f"server.aggregator = {self.aggregator!r}; choose one of {', '.join(AGGREGATORS)}"
            )
        _number("trim", self.trim, float)
        _number("f", self.f, int)
        _number("clip_update_norm", self.clip_update_norm, float)
        _number("max_norm_ratio", self.max_norm_ratio, float)
        _number("peer_factor", self.peer_factor, float)
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"server.trim = {self.trim} must be in [0, 0.5)")
        if self.f < 0:
            raise ValueError(f"server.f = {self.f} must be >= 0")
        if self.clip_update_norm < 0:
            raise ValueError(f"server.clip_update_norm = {self.clip_update_norm} must be >= 0")
        if self.max_norm_ratio < 0:
            raise ValueError(f"server.max_norm_ratio = {self.max_norm_ratio} must be >= 0")
        if self.peer_factor < 0:
            raise ValueError(f"server.peer_factor = {self.peer_factor} must be >= 0")
        # Guards that would drop honest uploads in every round: a run that silently trains on
        # nothing (every reply rejected) instead of failing in one line.
        if 0 < self.peer_factor < PEER_FACTOR_MIN:
            raise ValueError(
                f"server.peer_factor = {self.peer_factor:g}: 0 turns the guard off, else it must "
                f"be >= {PEER_FACTOR_MIN:g} (below that it drops honest uploads near the round's "
                "median)"
            )
        if 0 < self.max_norm_ratio < NORM_RATIO_MIN:
            raise ValueError(
                f"server.max_norm_ratio = {self.max_norm_ratio:g}: 0 turns the check off, else "
                f"it must be >= {NORM_RATIO_MIN:g} (below that it rejects honest updates smaller "
                "than the model they update)"
            )

    @property
    def plain(self) -> bool:
        """The plain mean without clipping: every helper takes the historical code path."""
        return self.aggregator == "mean" and self.clip_update_norm == 0


PRIVACY_MECHANISMS = ("none", "local", "central")
PRIVACY_ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True)
class PrivacyRule:
    """Client-level differential privacy of every upload: the ``[privacy]`` config table.

    Each upload's data-dependent floats are clipped to L2 norm ``clip`` as one vector and get
    Gaussian noise of standard deviation ``noise_multiplier x clip`` per coordinate: by the client
    before it sends (``local``), or by the server on the round's clipped sum (``central``, a
    trusted server). ``core/privacy.py`` says what is clipped for each kind of field, and
    ``core/accountant.py`` how ``epsilon`` at ``delta`` is counted (docs/privacy.md)."""

    mechanism: str = "none"  # none | local | central
    clip: float = 1.0  # L2 bound of one upload's data-dependent part (its update, its rows)
    noise_multiplier: float = 1.0  # noise sd / clip; 0 = clipping only (epsilon is infinite)
    delta: float = 1e-5  # the delta epsilon is reported at
    target_epsilon: float = 0.0  # > 0: stop before the round that would exceed it; 0 = none
    # > 0: noise_multiplier is solved so that train.rounds rounds end at this epsilon (the
    # resolved config records the multiplier); 0 = noise_multiplier as given
    epsilon: float = 0.0
    # > 0: DP-SGD in local training (core/dpsgd.py): every example's gradient clipped to this
    # L2 norm, Gaussian noise of sd sample_noise_multiplier x sample_clip on their sum
    sample_clip: float = 0.0
    sample_noise_multiplier: float = 1.0  # DP-SGD's noise sd / sample_clip
    accountant: str = "rdp"  # rdp | pld (dp-accounting's Renyi or privacy-loss-distribution)
    # Secure aggregation (core/secure.py): the server learns only the sum of a round's uploads,
    # by Flower's SecAgg+ over Flower and by the same arithmetic on the simulator
    secure_aggregation: bool = False
    secagg_range: float = 8.0  # every summed entry (weights <= 1 times values) within [-R, R]
    secagg_shares: float = 1.0  # fraction of the round's clients each shares its keys with
    secagg_threshold: float = 0.5  # fraction of those shares that reconstructs a secret

    def __post_init__(self) -> None:
        if self.mechanism not in PRIVACY_MECHANISMS:
            raise ValueError(
                f"privacy.mechanism = {self.mechanism!r}; choose one of "
                f"{', '.join(PRIVACY_MECHANISMS)}{did_you_mean(str(self.mechanism), PRIVACY_MECHANISMS)}"
            )
        if self.accountant not in PRIVACY_ACCOUNTANTS:
            raise ValueError(
                f"privacy.accountant = {self.accountant!r}; choose one of "
                f"{', '.join(PRIVACY_ACCOUNTANTS)}"
            )
        for key in (
            "clip",
            "noise_multiplier",
            "delta",
            "target_epsilon",
            "epsilon",
            "sample_clip",
            "sample_noise_multiplier",
            "secagg_range",
            "secagg_shares",
            "secagg_threshold",
        ):
            _number(key, getattr(self, key), float, "privacy")
        if not isinstance(self.secure_aggregation, bool):
            raise ValueError(
                f"privacy.secure_aggregation = {self.secure_aggregation!r} must be true or false"
            )
        if self.secagg_range <= 0:
            raise ValueError(f"privacy.secagg_range = {self.secagg_range} must be > 0")
        for key in ("secagg_shares", "secagg_threshold"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"privacy.{key} = {getattr(self, key)} must be in (0, 1]")
        if self.secure_aggregation and self.mechanism == "central":
            raise ValueError(
                'privacy.secure_aggregation hides each upload from the server, which the "central" '
                'mechanism clips and noises one by one: use privacy.mechanism = "local" with it'
            )
        if self.clip <= 0:
            raise ValueError(f"privacy.clip = {self.clip} must be > 0")
        if self.noise_multiplier < 0:
            raise ValueError(f"privacy.noise_multiplier = {self.noise_multiplier} must be >= 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta = {self.delta} must be in (0, 1)")
        if self.target_epsilon < 0:
            raise ValueError(f"privacy.target_epsilon = {self.target_epsilon} must be >= 0")
        if self.sample_clip < 0:
            raise ValueError(f"privacy.sample_clip = {self.sample_clip} must be >= 0 (0: off)")
        if self.sample_noise_multiplier < 0:
            raise ValueError(
                f"privacy.sample_noise_multiplier = {self.sample_noise_multiplier} must be >= 0"
            )
        if self.epsilon < 0:
            raise ValueError(f"privacy.epsilon = {self.epsilon} must be >= 0")
        if self.epsilon > 0 and self.mechanism == "none":
            raise ValueError(
                f'privacy.epsilon = {self.epsilon:g} needs privacy.mechanism = "local" or "central"'
            )
        if self.target_epsilon > 0 and self.noise_multiplier == 0:
            raise ValueError(
                f"privacy.target_epsilon = {self.target_epsilon:g} cannot be met without noise "
                "(privacy.noise_multiplier = 0 gives an infinite epsilon)"
            )

    @property
    def on(self) -> bool:
        """Whether the uploads are released (the local or central mechanism)."""
        return self.mechanism != "none"

    @property
    def dpsgd(self) -> bool:
        """Whether local training is DP-SGD."""
        return self.sample_clip > 0


def _number(key: str, value: Any, tp: type, table: str = "server") -> None:
    ok = isinstance(value, (int, float)) if tp is float else isinstance(value, int)
    if isinstance(value, bool) or not ok:
        raise ValueError(
            f"{table}.{key} = {value!r} must be {'an int' if tp is int else 'a number'}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{table}.{key} = {value} must be a finite number")


def largest_f(k: int) -> int:
    """The largest ``f`` Krum and multi-Krum accept for ``k`` contributions (``k > 2f + 2``;
    negative: none, fewer than 3 contributions)."""
    return (k - 3) // 2


def trim_limit(k: int) -> float:
    """``trim`` must stay below this for ``k`` rows: ``floor(trim k)`` leaves at least one."""
    return ((k - 1) // 2 + 1 - 1e-9) / k


def clients_per_round(num_clients: int, participation: float) -> int:
    """Clients sampled per round for a participation fraction: ``floor(participation x N)``, at least 1.

    The floor is PFLlib's ``int(num_clients * join_ratio)`` (10 x 0.35 -> 3, where Python's
    banker's ``round`` would give 4). A product within 1e-9 of an integer counts as that integer,
    so float noise cannot lose a client (0.29 x 100 = 28.999999999999996 -> 29).
    """
    return max(1, math.floor(participation * num_clients + 1e-9))
