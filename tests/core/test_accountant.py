"""Privacy accounting (``core/accountant.py``) against a closed form and dp-accounting itself."""

from __future__ import annotations

import json
import logging
import math
import sys

import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from fedmosaic.core import accountant
from fedmosaic.core.accountant import Ledger, epsilon

dp_accounting = pytest.importorskip("dp_accounting")

DELTA = 1e-5


def gdp_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at delta of mu-GDP: the analytic Gaussian mechanism (Balle & Wang 2018,
    Theorem 8), delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), solved for eps."""

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(gap, 0.0, 200.0, xtol=1e-12, rtol=1e-14)


# z = 2 against a replace-one sensitivity of 2C: the Gaussian's multiplier is s = 1, and T = 10
# compositions are exactly mu-GDP with mu = sqrt(T) / s (Dong, Roth & Su 2019).
Z, T = 2.0, 10
EXACT = gdp_epsilon(math.sqrt(T) / (Z / 2), DELTA)


def test_closed_form_is_what_the_test_expects():
    assert EXACT == pytest.approx(17.8566, abs=1e-4)


@pytest.mark.parametrize(
    "mechanism, n, k", [("local", 1, 1), ("central", 5, 5)], ids=["local", "central_all"]
)
def test_pld_matches_the_exact_gaussian_and_rdp_bounds_it(mechanism: str, n: int, k: int):
    pld = epsilon(mechanism, "pld", Z, DELTA, T, n, k)
    assert pld == pytest.approx(EXACT, rel=1e-3)
    rdp = epsilon(mechanism, "rdp", Z, DELTA, T, n, k)
    assert EXACT <= rdp <= 1.15 * EXACT


def test_rdp_is_within_the_classic_conversion():
    # The un-sampled Gaussian's RDP of order a is a / (2 s^2); the classic conversion
    # (Mironov 2017) eps = T a / (2 s^2) + log(1/delta) / (a - 1), minimised over the
    # accountant's orders, bounds the tighter conversion the library uses from above.
    s = Z / 2
    orders = dp_accounting.rdp.RdpAccountant().orders
    classic = min(T * a / (2 * s**2) + math.log(1 / DELTA) / (a - 1) for a in orders if a > 1)
    got = epsilon("local", "rdp", Z, DELTA, T)
    assert got <= classic
    assert got == pytest.approx(classic, rel=0.1)  # the same order of magnitude


def test_sampled_central_is_dp_accountings_own_number():
    n, k, rounds = 100, 10, 50
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        n, k, dp_accounting.GaussianDpEvent(Z / 2)
    )
    acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    want = acc.get_epsilon(DELTA)
    got = epsilon("central", "rdp", Z, DELTA, rounds, n, k)
    assert got == pytest.approx(want, rel=1e-12)
    assert 0 < got < epsilon("central", "rdp", Z, DELTA, rounds, n, n)


def test_monotone_in_rounds_noise_and_sampling():
    def central(z: float, rounds: int, k: int = 10) -> float:
        return epsilon("central", "rdp", z, DELTA, rounds, 100, k)

    assert central(Z, 10) < central(Z, 20) < central(Z, 50)
    assert central(4.0, 50) < central(Z, 50) < central(1.0, 50)
    assert central(Z, 50) < central(Z, 50, k=100)
    local = [epsilon("local", "pld", Z, DELTA, m) for m in (1, 2, 5)]
    assert local == sorted(local) and len(set(local)) == 3


def test_local_ledger_counts_each_client():
    led = Ledger("local", "rdp", Z, DELTA, num_clients=4, per_round=2)
    assert led.participations == [0, 0, 0, 0] and led.current() == 0.0
    led.record([0, 1])
    led.record([0, 2])
    assert led.rounds == 2 and led.participations == [2, 1, 1, 0]
    one, two = (epsilon("local", "rdp", Z, DELTA, m) for m in (1, 2))
    assert led.per_client() == [two, one, one, 0.0]
    assert led.current() == two == max(led.per_client())

    # after_next: what the round would cost, the ledger unchanged.
    assert led.after_next([1, 2]) == two  # everyone at most 2
    assert led.after_next([0, 3]) == epsilon("local", "rdp", Z, DELTA, 3)
    assert led.rounds == 2 and led.participations == [2, 1, 1, 0]

    back = Ledger.from_dict(json.loads(json.dumps(led.to_dict())))
    assert back == led and back.per_client() == led.per_client()
    assert back.participations is not led.participations


def test_central_ledger_is_the_same_for_everyone():
    led = Ledger("central", "rdp", Z, DELTA, num_clients=100, per_round=10)
    for r in range(3):
        led.record(range(10 * r, 10 * r + 10))
    want = epsilon("central", "rdp", Z, DELTA, 3, 100, 10)
    assert led.current() == want and led.per_client() == [want] * 100
    assert led.after_next(range(10)) == epsilon("central", "rdp", Z, DELTA, 4, 100, 10)
    assert led.rounds == 3 and sum(led.participations) == 30


def test_ledger_rejects_bad_rounds_and_bad_checkpoints():
    led = Ledger("local", "rdp", Z, DELTA, num_clients=3, per_round=2)
    with pytest.raises(ValueError, match="outside"):
        led.record([3])
    with pytest.raises(ValueError, match="twice"):
        led.after_next([1, 1])
    with pytest.raises(ValueError, match="per_round"):
        led.record([0, 1, 2])
    assert led.rounds == 0 and led.participations == [0, 0, 0]
    with pytest.raises(ValueError, match="missing keys"):
        Ledger.from_dict({"mechanism": "local"})
    with pytest.raises(ValueError, match="unknown keys"):
        Ledger.from_dict({**led.to_dict(), "epsilon": 1.0})
    with pytest.raises(ValueError, match="participations"):
        Ledger("local", "rdp", Z, DELTA, num_clients=3, per_round=2, participations=[1, 2])


@pytest.mark.parametrize("acct", ["rdp", "pld"])
def test_no_noise_is_infinite_and_no_step_is_zero(acct: str):
    assert epsilon("local", acct, 0.0, DELTA, 1) == math.inf
    assert epsilon("central", acct, 0.0, DELTA, 5, 4, 4) == math.inf
    assert epsilon("local", acct, 0.0, DELTA, 0) == 0.0
    assert epsilon("central", acct, Z, DELTA, 0, 4, 4) == 0.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"mechanism": "global"}, "mechanism"),
        ({"accountant": "moments"}, "accountant"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"num_clients": 0, "per_round": 0}, "num_clients"),
        ({"per_round": 0}, "per_round"),
        ({"per_round": 11}, "per_round"),
        ({"steps": -1}, "steps"),
        ({"steps": 1.5}, "steps"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict, name: str):
    args = dict(
        mechanism="central",
        accountant="rdp",
        noise_multiplier=Z,
        delta=DELTA,
        steps=3,
        num_clients=10,
        per_round=5,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=name) as err:
        epsilon(**args)
    assert "\n" not in str(err.value)


def test_pld_cannot_account_sampling_without_replacement():
    with pytest.raises(ValueError, match="use accountant 'rdp'"):
        epsilon("central", "pld", Z, DELTA, 3, 10, 5)
    with pytest.raises(ValueError, match="'rdp'"):
        Ledger("central", "pld", Z, DELTA, num_clients=10, per_round=5)
    # Local DP has no amplification by sampling, so pld accounts it whatever k is.
    assert Ledger("local", "pld", Z, DELTA, num_clients=10, per_round=5).current() == 0.0


def test_missing_dp_accounting_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting now fails
    accountant._rdp_per_step.cache_clear()
    with pytest.raises(ImportError, match=r"pip install 'fedmosaic\[privacy\]'"):
        epsilon("local", "rdp", Z, DELTA, 1)


def test_absl_warnings_are_silenced_only_inside(caplog: pytest.LogCaptureFixture):
    from absl import logging as absl_logging

    with caplog.at_level(logging.WARNING, logger="absl"):
        with accountant._quiet_absl():
            absl_logging.warning("failed to converge")
        assert not caplog.records
        absl_logging.warning("after")
    assert [r.getMessage() for r in caplog.records] == ["after"]
