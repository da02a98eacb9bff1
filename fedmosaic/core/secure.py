"""Secure aggregation: the server learns the sum of a round's uploads, never one upload.

A method whose server needs only sums declares them (``Algorithm.summands``: what one upload adds
to the round's sum; ``Algorithm.from_sums``: the one upload the server rebuilds from the sums,
which its ``aggregate`` turns into the state the uploads themselves give). A method whose server
uses each upload on its own (FedTGP trains on them, FedDistill keeps them per client) declares
nothing and is refused with its reason (:func:`refusal`).

The arithmetic is Flower's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow`` with
``flwr.client.mod.secaggplus_mod``; Bell et al., CCS 2020): each client's summands, each divided
by the round's public weight scale, are clipped to ``[-R, R]`` (``privacy.secagg_range``; a
client whose summands leave it is refused with the reason instead of clipped) and stochastically
rounded to integers in ``[0, T]``, then masked by pairwise masks that cancel in the sum modulo
``2^32`` and by a private mask the server removes once enough neighbours reveal its seed share.
The server sees the masked vectors and the unmasked sum only. ``T`` is the largest power of two
with ``K T < 2^32`` for ``K`` clients in the round (a step of ``2R / T``: ``1.2e-7`` for
``R = 8`` and 20 clients).

The stochastic rounding draws from the run's seeded streams (numpy's legacy generator seeded
per client and round, as Flower's mod draws from numpy's global one, which the ClientApp seeds
the same way), so :func:`emulate` (the simulator's backends: the same arithmetic without the
masks, which cancel exactly) and Flower give the same bits.

What the server still sees in clear: who took part, each client's example count, training loss
and upload metrics (costs): scalars that are not the data, as under ``[privacy]``. What it
cannot do any more: check one upload (the schema, the magnitude checks, the peer guard); the
rebuilt upload is checked against the schema instead (docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Algorithm
from fedmosaic.core.payload import Payload, PayloadError

P = TypeVar("P", bound=Payload)
MODULUS = 2**32  # Flower's default modulus_range: the masked vectors' ring
WEIGHT = "weight"  # the conventional name of a method's summed upload weights


class SecureError(PayloadError):
    """A client's summands the protocol cannot carry (non-finite, or outside the range)."""


@dataclass(frozen=True)
class SecureForm:
    """One round's public protocol parameters (the same on the server and every client)."""

    scale: float  # every upload weight is divided by it (the largest possible: weights <= 1)
    bound: float  # R: each summand entry must lie in [-R, R]
    levels: int  # T: quantization levels of [-R, R]
    seed: int  # the run's seed (the stochastic rounding's streams)
    uniform: bool = False  # every upload weighs 1 (under [privacy]); else its example count
    shares: float = 1.0  # fraction of the round's clients each client shares its keys with
    threshold: float = 0.5  # fraction of those shares that reconstructs a secret


@dataclass
class SecureSum:
    """What secure aggregation gives the server: the summands' sum over ``clients``."""

    clients: tuple[int, ...]
    sums: dict[str, Tensor] = field(default_factory=dict)  # name -> float64 sum


def levels(num_clients: int) -> int:
    """``T``: the largest power of two with ``num_clients * T < 2^32`` (every quantized entry is
    in ``[0, T]``, so their sum over the round and the clients' weight factors fit the ring)."""
    return 2 ** (32 - math.ceil(math.log2(num_clients + 1)))


def form(
    seed: int,
    bound: float,
    num_clients: int,
    scale: float,
    uniform: bool = False,
    shares: float = 1.0,
    threshold: float = 0.5,
) -> SecureForm:
    """The protocol of a round of ``num_clients`` clients."""
    return SecureForm(scale, bound, levels(max(num_clients, 1)), seed, uniform, shares, threshold)


def weight(sf: SecureForm, num_examples: int) -> float:
    """A client's upload weight (before the scale): its example count, or 1 under privacy."""
    return 1.0 if sf.uniform else float(num_examples)


def refusal(algo: Algorithm | type[Algorithm]) -> str:
    """Why ``algo`` cannot run under secure aggregation ("" when it can): it must declare its
    summands in the class that defines its aggregation (or a subclass of it), so a method that
    aggregates its own way does not inherit sums that no longer describe its server."""
    cls = algo if isinstance(algo, type) else type(algo)
    if not cls.communicates:
        return "it sends nothing to aggregate"
    summing = next(c for c in cls.__mro__ if "summands" in c.__dict__)
    if summing is Algorithm:
        return cls.secure_refusal
    aggregating = next(c for c in cls.__mro__ if "aggregate" in c.__dict__)
    if not issubclass(summing, aggregating):
        return (
            f"{aggregating.__name__} aggregates in its own way and declares no summands of its "
            "own (Algorithm.summands / from_sums)"
        )
    return ""


# ---- the summands of common uploads -------------------------------------------------------------
def state_terms(
    state: Mapping[str, Tensor], weight: float, prefix: str = "state."
) -> dict[str, Tensor]:
    """A state dict's share of a weighted mean: ``weight`` and ``weight * x`` per float entry
    (float64). Integer buffers (BatchNorm's batch counter) are not summed: see
    :func:`state_from_terms`."""
    out = {WEIGHT: torch.tensor([weight], dtype=torch.float64)}
    for k, v in state.items():
        if v.is_floating_point():
            out[prefix + k] = v.detach().cpu().double() * weight
    return out


def state_from_terms(
    sums: Mapping[str, Tensor], like: Mapping[str, Tensor], prefix: str = "state."
) -> tuple[dict[str, Tensor], float]:
    """``(the weighted mean state, the total weight)`` from summed :func:`state_terms`, with the
    keys and dtypes of ``like`` (what the server holds of it). Integer buffers keep ``like``'s
    value: a sum cannot give the clients' largest counter (their plain mean takes it), and the
    counter is read only by a BatchNorm without momentum."""
    total = float(sums[WEIGHT][0])
    if not total > 0:
        raise PayloadError(f"the summed weight is {total:g}: no upload in the sum")
    state = {}
    for k, v in like.items():
        if v.is_floating_point():
            state[k] = (sums[prefix + k] / total).to(v.dtype).view(v.shape)
        else:
            state[k] = v.clone()
    return state, total


def rebuilt(cls: type[P], **fields: object) -> P:
    """An upload of ``cls`` with ``fields`` and every other (integer metadata: costs) at 0; the
    round record takes the costs from the clients' clear metrics instead."""
    given = dict(fields)
    for f in dataclasses.fields(cls):
        given.setdefault(f.name, 0)
    return cls(**given)


# ---- one client's vector ------------------------------------------------------------------------
def client_vector(
    algo: Algorithm, upload: Payload, weight: float, sf: SecureForm
) -> tuple[list[str], list[np.ndarray]]:
    """The names and float64 arrays a client adds to the round's sum (``SecureError`` when they
    cannot be carried: the client is then left out of the round, named in the log)."""
    terms = algo.summands(upload, weight / sf.scale)
    if terms is None:
        raise SecureError(f"{type(algo).__name__} declares no summands")
    names, arrays = [], []
    for name in sorted(terms):  # one order on every client (a state dict's is the sender's)
        t = terms[name]
        a = np.atleast_1d(t.detach().cpu().double().numpy())
        if not np.isfinite(a).all():
            raise SecureError(f"summand {name!r} has non-finite values")
        peak = float(np.abs(a).max()) if a.size else 0.0
        if peak > sf.bound:
            raise SecureError(
                f"summand {name!r} reaches {peak:.4g}, outside privacy.secagg_range = "
                f"{sf.bound:g} (raise it)"
            )
        names.append(name)
        arrays.append(a)
    return names, arrays


def rounding_seed(seed: int, round_num: int, client_id: int) -> int:
    """The 32-bit seed of a client's stochastic rounding in a round."""
    return seeding.derive(seed, round_num, client_id, "secagg-rounding") & 0xFFFFFFFF


def quantize(arrays: Sequence[np.ndarray], sf: SecureForm, rng_seed: int) -> list[np.ndarray]:
    """Flower's ``quantize`` (flwr 1.41, ``common/secure_aggregation/quantization.py``) with its
    draws from ``RandomState(rng_seed)``: the same bits as the ClientApp's after it seeds numpy's
    global generator with ``rng_seed`` (a Flower test holds the two equal)."""
    rng = np.random.RandomState(rng_seed)
    quantizer = sf.levels / (2 * sf.bound)
    out = []
    for arr in arrays:
        pre = (np.clip(arr, -sf.bound, sf.bound) + sf.bound) * quantizer
        q = np.ceil(pre).astype(np.int32)
        draw = rng.rand(*q.shape)
        q[draw < q - pre] -= 1
        out.append(q)
    return out


def unquantize(summed: Sequence[np.ndarray], k: int, sf: SecureForm) -> list[np.ndarray]:
    """The sum of ``k`` clients' values from the sum of their quantized arrays, by the float
    operations of Flower's ``SecAggPlusWorkflow.unmask_stage`` (its weighted mean, every weight
    factor one), times ``k``."""
    step, inv = (2 * sf.bound) / sf.levels, sf.levels / np.int64(k * sf.levels)
    out = []
    for s in summed:
        v = s.astype(float) * step + (-sf.bound)
        v += -(k - 1) * sf.bound
        v *= inv
        out.append(v * k)
    return out


def masked_bytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes of a client's masked vector: one int64 per entry, plus its weight factor."""
    return 8 * (1 + sum(int(a.size) for a in arrays))


def to_sums(names: Sequence[str], arrays: Sequence[np.ndarray]) -> dict[str, Tensor]:
    return {
        n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in zip(names, arrays, strict=True)
    }


class EmulatedSecureFit:
    """``Transport.fit_secure`` for a transport whose clients' uploads reach this process (the
    simulator's backends): its own ``fit``, then :func:`emulate`, the sum Flower's SecAgg+
    gives, bit for bit."""

    algo: Algorithm

    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[Any]:
        raise NotImplementedError  # the transport's own

    def fit_secure(
        self, round_num: int, messages: dict[int, Payload], form: SecureForm
    ) -> tuple[list[Any], SecureSum | None]:
        results = self.fit(round_num, messages)
        return results, emulate(self.algo, results, form, round_num)


def emulate(
    algo: Algorithm, results: Sequence[Any], sf: SecureForm, round_num: int
) -> SecureSum | None:
    """The secure sum of in-process ``results`` (``FitResult``s with their uploads): Flower's
    arithmetic without the masks, which cancel exactly. A client whose vector cannot be carried
    gets its ``error`` set (it is left out, as its ClientApp's failure leaves it out over
    Flower). None when no client is left."""
    names: list[str] | None = None
    total: list[np.ndarray] | None = None
    clients: list[int] = []
    for r in results:
        if r.error is not None or r.upload is None:
            continue
        try:
            ns, arrays = client_vector(algo, r.upload, weight(sf, r.num_examples), sf)
            if names is not None and ns != names:
                raise SecureError(f"summands {ns} differ from the round's {names}")
        except PayloadError as exc:
            r.error = f"secure aggregation: {exc}"
            continue
        r.bytes_up = masked_bytes(arrays)
        r.metrics = algo.upload_metrics(r.upload)
        r.upload = None  # the server sees the sum only
        q = quantize(arrays, sf, rounding_seed(sf.seed, round_num, r.client_id))
        if names is None:
            names, total = ns, [x.astype(np.int64) for x in q]
        else:
            assert total is not None
            total = [t + x for t, x in zip(total, q, strict=True)]
        clients.append(r.client_id)
    if names is None or total is None:
        return None
    values = unquantize([t % MODULUS for t in total], len(clients), sf)
    return SecureSum(tuple(clients), to_sums(names, values))
