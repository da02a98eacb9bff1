"""The statistics behind the claims page: paired t-tests, Holm and Benjamini-Hochberg over a
family, group-sequential boundaries from alpha spending, and power with its uncertainty.

Everything works on the per-seed paired differences ``d_s`` (method minus baseline, points).

- :func:`paired_test`: the two-sided p-value of ``H0: mean gap = null`` (Student t, n - 1
  degrees of freedom) and the interval at any level. A non-inferiority question ("at or above,
  within a margin m") is the test of ``null = -m``: its two-sided p is below alpha exactly when
  the two-sided (1 - alpha) interval's lower bound is above -m.
- :func:`holm` (Holm 1979, step-down) and :func:`benjamini_hochberg` (BH 1995, the false discovery
  rate): adjusted p-values.
- :func:`sequential_holm`: Holm's step-down where each hypothesis may have been looked at
  several times (seeds added after a look): at each step every remaining hypothesis is tested at
  its group-sequential nominal level for the step's share ``alpha / m`` (Maurer & Bretz 2013:
  Holm's recycling stays valid when each hypothesis's boundary is recomputed at its new level).
  With one look the nominal level is the share itself: plain Holm.
- :func:`nominal_levels`: Lan-DeMets alpha spending (Pocock or O'Brien-Fleming type) at the
  looks' information fractions ``n_k / n_max``, turned into two-sided boundaries on the z scale
  by the exact recursion over the looks' joint normal law (``corr(Z_i, Z_j) = sqrt(t_i / t_j)``)
  and reported as nominal p-value levels, to which each look's t-test p-value is compared (the
  usual nominal-level approximation for a t statistic).
- :func:`seeds_needed` and :func:`seeds_range`: the seeds for 80% power at a target gap, and the
  same at the 95% confidence bounds of the spread (chi-square on n - 1 degrees of freedom).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

POWER = 0.8
MAX_SEEDS = 10_000
BOUNDARIES = ("pocock", "obrien_fleming")


@dataclass(frozen=True)
class Test:
    """A paired t-test over ``n`` per-seed differences."""

    n: int
    mean: float
    sd: float | None  # sample sd (ddof = 1); None for one value
    null: float
    p: float | None  # two-sided; None for one value

    def interval(self, alpha: float) -> tuple[float, float] | None:
        """The two-sided (1 - alpha) Student-t interval of the mean gap (None for one value)."""
        if self.sd is None:
            return None
        from scipy.stats import t  # type: ignore[import-untyped]  # scipy ships no type information

        half = float(t.ppf(1 - alpha / 2, self.n - 1)) * self.sd / math.sqrt(self.n)
        return (self.mean - half, self.mean + half)


def paired_test(diffs: Sequence[float], null: float = 0.0) -> Test:
    """Two-sided paired t-test of ``H0: mean = null``; a zero spread gives p = 0 (or 1 when the
    mean equals ``null``): deterministic quantities such as compute costs."""
    d = [float(x) for x in diffs]
    n = len(d)
    if n == 0:
        raise ValueError("no paired differences")
    mean = float(np.mean(d))
    if n == 1:
        return Test(1, mean, None, null, None)
    sd = float(np.std(d, ddof=1))
    if sd == 0.0:
        return Test(n, mean, 0.0, null, 1.0 if mean == null else 0.0)
    from scipy.stats import t

    stat = (mean - null) / (sd / math.sqrt(n))
    return Test(n, mean, sd, null, float(2 * t.sf(abs(stat), n - 1)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values, in the input's order: ``max_{j<=i} min(1, (m - j + 1) p_(j))``."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values), in the input's order:
    ``min_{j>=i} min(1, m p_(j) / j)``."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 1.0
    for rank in range(m - 1, -1, -1):
        i = order[rank]
        running = min(running, min(1.0, m * pvalues[i] / (rank + 1)))
        out[i] = running
    return out


def spent(kind: str, t: float, alpha: float) -> float:
    """Lan-DeMets spending: the alpha spent by information fraction ``t`` (two-sided)."""
    from scipy.stats import norm

    if not 0.0 < t <= 1.0:
        raise ValueError(f"information fraction {t} outside (0, 1]")
    if kind == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    if kind == "obrien_fleming":
        return float(2 - 2 * norm.cdf(norm.ppf(1 - alpha / 2) / math.sqrt(t)))
    raise ValueError(f"boundary {kind!r}: choose one of {', '.join(BOUNDARIES)}")


GRID = 801  # points per look of the recursive integration (Simpson: levels to ~1e-7)


def _grid(b: float) -> tuple[np.ndarray, np.ndarray]:
    """Points and Simpson weights on [-b, b]."""
    x = np.linspace(-b, b, GRID)
    w = np.full(GRID, 2.0)
    w[1::2] = 4.0
    w[0] = w[-1] = 1.0
    return x, w * (x[1] - x[0]) / 3


def z_boundaries(fractions: Sequence[float], alpha: float, kind: str) -> list[float]:
    """Two-sided z boundaries ``c_k``: the first crossing at look k has probability
    ``spent(t_k) - spent(t_{k-1})`` under H0. Exact recursion (Armitage, McPherson & Rowe
    1969) on the score scale ``S_k = Z_k sqrt(t_k)``, a Brownian motion in the information
    fraction: the sub-density of ``S`` on the continuation region is carried from look to look
    by the normal increment of variance ``t_k - t_{k-1}``."""
    # scipy ships no type information
    from scipy.optimize import brentq  # type: ignore[import-untyped]
    from scipy.special import ndtr, ndtri  # type: ignore[import-untyped]

    fr = [float(f) for f in fractions]
    if any(b <= a for a, b in zip(fr, fr[1:], strict=False)):
        raise ValueError(f"looks' information fractions {fr} must increase")
    bounds: list[float] = []
    before = 0.0  # alpha spent so far
    x = w = dens = np.zeros(
        0
    )  # the continuation region's grid and sub-density of S at the last look
    for k, t in enumerate(fr):
        target = spent(kind, t, alpha)
        increment = target - before
        if k == 0:
            c = float(-ndtri(increment / 2))
        else:
            sigma = math.sqrt(t - fr[k - 1])
            mass = w * dens

            def crossing(
                c: float,
                sigma: float = sigma,
                t: float = t,
                mass: np.ndarray = mass,
                x: np.ndarray = x,
                increment: float = increment,
            ) -> float:
                b = c * math.sqrt(t)
                out = ndtr((-b - x) / sigma) + ndtr((x - b) / sigma)
                return float(mass @ out) - increment

            c = float(brentq(crossing, 0.1, 15.0, xtol=1e-12))
        bounds.append(c)
        b = c * math.sqrt(t)
        nx, nw = _grid(b)
        if k == 0:
            dens = _pdf(nx / math.sqrt(t)) / math.sqrt(t)
        else:
            sigma = math.sqrt(t - fr[k - 1])
            dens = (_pdf((nx[:, None] - x[None, :]) / sigma) / sigma) @ (w * dens)
        x, w = nx, nw
        before = target
    return bounds


def _pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


@functools.lru_cache(maxsize=256)
def _levels(looks: tuple[int, ...], alpha: float, kind: str) -> tuple[float, ...]:
    from scipy.special import ndtr

    fractions = [n / looks[-1] for n in looks]
    return tuple(float(2 * ndtr(-c)) for c in z_boundaries(fractions, alpha, kind))


def nominal_levels(looks: Sequence[int], alpha: float, kind: str) -> list[float]:
    """The two-sided nominal p-value level of each look (seeds ``looks``, the last one the
    maximum) under ``kind`` spending of ``alpha``; one look: ``[alpha]``."""
    ns = tuple(int(n) for n in looks)
    if len(ns) == 1:
        return [alpha]
    return list(_levels(ns, float(alpha), kind))


@dataclass(frozen=True)
class Family:
    """One hypothesis of a family: its p-value at this look (None: not testable now, e.g. cells
    missing; it keeps its share of alpha and is never rejected), its looks' schedule (seeds at
    each look, the last one the maximum) and which look this is (an index into it)."""

    p: float | None
    looks: tuple[int, ...] = (1,)
    at: int = -1


def sequential_holm(
    family: Sequence[Family], alpha: float, kind: str
) -> tuple[list[bool], list[float]]:
    """Which hypotheses Holm's step-down rejects, each tested at its look's nominal level for
    the step's share ``alpha / m`` (m: the hypotheses not yet rejected, untestable ones
    included); and the level each was last tested at. One look: plain Holm."""
    rejected = [False] * len(family)
    level = [alpha / max(len(family), 1)] * len(family)
    open_ = list(range(len(family)))
    while open_:
        share = alpha / len(open_)
        now = []
        for i in open_:
            h = family[i]
            level[i] = nominal_levels(h.looks, share, kind)[h.at] if len(h.looks) > 1 else share
            if h.p is not None and h.p < level[i]:
                now.append(i)
        if not now:
            break
        for i in now:
            rejected[i] = True
        open_ = [i for i in open_ if i not in now]
    return rejected, level


def seeds_needed(sd: float | None, delta: float, alpha: float = 0.05) -> int | None:
    """The smallest n with ``n >= ((t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / delta)^2``: the
    seeds for 80% power at level ``alpha`` (two-sided) to resolve a true gap ``delta`` with a
    per-seed spread ``sd``; None without a spread or a gap, or past ``MAX_SEEDS``."""
    from scipy.stats import t

    if sd is None or delta <= 0:
        return None
    if sd == 0:
        return 2

    def enough(n: int) -> bool:
        q = (float(t.ppf(1 - alpha / 2, n - 1)) + float(t.ppf(POWER, n - 1))) * sd / delta
        return n >= q * q

    if not enough(MAX_SEEDS):
        return None
    lo, hi = 2, MAX_SEEDS
    while lo < hi:  # enough() is monotone in n
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid + 1, hi)
    return lo


def sd_bounds(sd: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` confidence interval of a normal spread from its sample sd over n values."""
    from scipy.stats import chi2

    a = 1 - level
    return (
        sd * math.sqrt((n - 1) / float(chi2.ppf(1 - a / 2, n - 1))),
        sd * math.sqrt((n - 1) / float(chi2.ppf(a / 2, n - 1))),
    )


def seeds_range(
    sd: float | None, n: int, delta: float, alpha: float = 0.05
) -> tuple[int | None, int | None, int | None]:
    """Seeds for 80% power at the observed spread and at its 95% bounds: (point, low, high);
    None where past ``MAX_SEEDS`` or undefined."""
    if sd is None or n < 2:
        return None, None, None
    point = seeds_needed(sd, delta, alpha)
    if sd == 0:
        return point, point, point
    lo_sd, hi_sd = sd_bounds(sd, n)
    return point, seeds_needed(lo_sd, delta, alpha), seeds_needed(hi_sd, delta, alpha)


def slope_per_10(values: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares slope of ``(round, value)`` pairs, in value units per 10 rounds."""
    if len(values) < 2:
        return None
    x = np.array([r for r, _ in values], dtype=float)
    y = np.array([v for _, v in values], dtype=float)
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0] * 10)


__all__ = [
    "BOUNDARIES",
    "Family",
    "Test",
    "benjamini_hochberg",
    "holm",
    "nominal_levels",
    "paired_test",
    "seeds_needed",
    "seeds_range",
    "sequential_holm",
    "slope_per_10",
    "spent",
    "z_boundaries",
]
