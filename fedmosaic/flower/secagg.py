"""Secure aggregation over Flower: a round's fit run by Flower's own SecAgg+ workflow.

The server half drives ``flwr.server.workflow.SecAggPlusWorkflow`` on the run's Grid through a
one-round strategy (:class:`_OneRound`): its fit instructions carry each client's fedmosaic
message (the broadcast and header, serialized), and its ``aggregate_fit`` receives the unmasked
mean of the clients' vectors and their clear metrics. The client half is Flower's
``secaggplus_mod`` (installed on the ClientApp for the workflow's messages only, :func:`mod`)
around :func:`train`: local training as in a plain round, then the method's summands
(``core/secure.py``) as the legacy fit result the mod quantizes and masks. The protocol's
parameters: ``clipping_range`` = ``privacy.secagg_range``, ``quantization_range`` = the round's
levels, ``modulus_range`` = 2^32, weight factors all one (``max_weight = num_examples = 1``: the
weights are inside the summands), ``num_shares`` and ``reconstruction_threshold`` the fractions
``privacy.secagg_shares`` and ``privacy.secagg_threshold``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedmosaic.core import secure
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.rounds import FitResult
from fedmosaic.flower import messages as m
from fedmosaic.flower.codec import wire_size

if TYPE_CHECKING:
    from fedmosaic.flower.transport import GridTransport

log = logging.getLogger("fedmosaic.flower")

EMBEDDED = "fedmosaic"  # fitins.config: the serialized fedmosaic message
FORM = "secagg"  # header: the round's protocol (JSON of secure.SecureForm)
NAMES = "fedmosaic-names"  # fitres.metrics: the summands' names (JSON), in the vector's order
METRICS = "fedmosaic-metrics"  # fitres.metrics: the upload's metrics (JSON)


def _serialize(content: RecordDict) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return bytes(recorddict_to_proto(content).SerializeToString())


def _deserialize(blob: bytes) -> RecordDict:
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    return recorddict_from_proto(ProtoRecordDict.FromString(blob))


# ---- server half --------------------------------------------------------------------------------
class _Proxy:
    """What the workflow reads of a client proxy: its node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Nodes:
    """What the workflow reads of a client manager (a log line's count)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def num_available(self) -> int:
        return self.n


class _OneRound:
    """The strategy of one secure round: fit instructions per node, and the unmasked result."""

    def __init__(self, fitins: dict[int, Any]) -> None:
        self.fitins = fitins
        self.results: list[tuple[Any, Any]] | None = None

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list:
        return [(_Proxy(node), ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = list(results)  # the failures: the workflow's own (_workflow)
        return None, {}


def fit(
    transport: GridTransport,
    round_num: int,
    messages: dict[int, Payload],
    sf: secure.SecureForm,
) -> tuple[list[FitResult], secure.SecureSum | None]:
    """One round's fit by SecAgg+ on ``transport``'s Grid."""
    from flwr.common import FitIns, Parameters
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    transport.discover()
    results: dict[int, FitResult] = {}
    fitins: dict[int, Any] = {}
    client_of: dict[int, int] = {}
    down: dict[int, int] = {}
    form = json.dumps(dataclasses.asdict(sf))
    for cid, msg in messages.items():
        node = transport.node_of.get(cid)
        if node is None:
            results[cid] = FitResult(cid, None, 0, 0, 0, error="no SuperNode serves this partition")
            continue
        content = m.payload_message(msg, **{"client-id": cid, "round": round_num, FORM: form})
        down[cid] = wire_size(content)
        fitins[node] = FitIns(Parameters([], "numpy.ndarray"), {EMBEDDED: _serialize(content)})
        client_of[node] = cid
    strategy = _OneRound(fitins)
    context = LegacyContext(
        Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        strategy=strategy,  # type: ignore[arg-type]  # the two methods the workflow calls
        client_manager=_Nodes(len(fitins)),  # type: ignore[arg-type]
    )
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: round_num}
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = _workflow(
        num_shares=float(sf.shares),
        reconstruction_threshold=float(sf.threshold),
        max_weight=1.0,
        clipping_range=sf.bound,
        quantization_range=sf.levels,
        modulus_range=secure.MODULUS,
        timeout=transport.options.round_timeout,
    )
    kept = random.getstate()  # the workflow shuffles with Python's global generator
    try:
        if len(fitins) >= 2:
            workflow(transport.grid, context)
        else:
            log.warning(
                "round %d: secure aggregation needs 2 clients; %d reachable", round_num, len(fitins)
            )
    except Exception as exc:  # a malformed reply must not end the run: the round is lost
        log.warning("round %d: secure aggregation failed: %s", round_num, exc)
        strategy.results = None
    finally:
        random.setstate(kept)
    for why in dict.fromkeys(_why(f) for f in workflow.failures):  # listed once per stage loop
        log.warning("round %d: a secure-aggregation client failed: %s", round_num, why)
    total = _collect(transport, strategy.results or [], client_of, results, down)
    if total is not None:  # the round's order (the workflow's is the replies' arrival)
        total.clients = tuple(c for c in messages if c in total.clients)
    for cid in messages:
        if cid not in results:
            results[cid] = FitResult(
                cid,
                None,
                0,
                0,
                down.get(cid, 0),
                error="left out of the secure sum (its ClientApp failed or did not answer)",
            )
    return [results[cid] for cid in messages], total


def _why(failure: Any) -> str:
    """The last line of a failed client's error (its ClientApp's exception)."""
    err = failure.args[0] if isinstance(failure, Exception) and failure.args else failure
    lines = str(getattr(err, "reason", None) or err).strip().splitlines()
    return lines[-1][:300] if lines else "no reason"


def _workflow(**params: Any) -> Any:
    """Flower's ``SecAggPlusWorkflow`` that keeps its failures (the workflow drops them when it
    halts before aggregating, and they carry the clients' reasons)."""
    from flwr.server.workflow import SecAggPlusWorkflow

    class Kept(SecAggPlusWorkflow):
        failures: list[Any] = []

        def _kept(self, stage: Any, grid: Any, context: Any, state: Any) -> bool:
            try:
                return bool(stage(grid, context, state))
            finally:
                self.failures = list(state.failures)

        def setup_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return self._kept(super().setup_stage, grid, context, state)

        def share_keys_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return self._kept(super().share_keys_stage, grid, context, state)

        def collect_masked_vectors_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return self._kept(super().collect_masked_vectors_stage, grid, context, state)

        def unmask_stage(self, grid: Any, context: Any, state: Any) -> bool:
            return self._kept(super().unmask_stage, grid, context, state)

    return Kept(**params)


def _collect(
    transport: GridTransport,
    replies: Sequence[tuple[Any, Any]],
    client_of: dict[int, int],
    results: dict[int, FitResult],
    down: dict[int, int],
) -> secure.SecureSum | None:
    """The clients' FitResults (clear metrics checked) and the sum, from the workflow's result.
    One invalid reply refuses the whole sum (its vector is in it): every client in the sum gets
    an error naming that reply."""
    from flwr.common import parameters_to_ndarrays

    names: list[str] | None = None
    inside: list[int] = []
    mean: list[np.ndarray] | None = None
    for proxy, res in replies:
        cid = client_of.get(int(proxy.node_id))
        if cid is None:
            continue
        try:
            met = dict(res.metrics)
            if m.int_field(met, "client-id") != cid:
                raise PayloadError(f"reply claims to come from client {met.get('client-id')}")
            n = m.int_field(met, "num-examples")
            if n != transport.clients[cid].num_train:
                raise PayloadError(
                    f"claims {n} training examples; its partition has "
                    f"{transport.clients[cid].num_train}"
                )
            loss = m.finite_or_nan(m.float_field(met, "loss"))
            ns = json.loads(str(met[NAMES]))
            extra = {str(k): float(v) for k, v in json.loads(str(met[METRICS])).items()}
            if names is not None and ns != names:
                raise PayloadError(f"summands {ns} differ from the round's {names}")
        except (PayloadError, KeyError, ValueError, TypeError) as exc:
            why = f"the round's secure sum is refused: client {cid}'s reply is invalid: {exc}"
            for proxy_, _ in replies:
                other = client_of.get(int(proxy_.node_id))
                if other is not None:
                    results[other] = FitResult(other, None, 0, 0, down[other], error=why)
            return None
        names = ns
        if mean is None:
            mean = parameters_to_ndarrays(res.parameters)
        results[cid] = FitResult(cid, None, n, 0, down[cid], loss, metrics=extra)
        inside.append(cid)
    if names is None or mean is None or len(mean) != len(names):
        return None
    k = len(inside)
    sums = [np.asarray(v, dtype=np.float64) * k for v in mean]  # the workflow's mean, times K
    up = secure.masked_bytes(sums)
    for cid in inside:
        results[cid].bytes_up = up
    return secure.SecureSum(tuple(inside), secure.to_sums(names, sums))


# ---- client half --------------------------------------------------------------------------------
def embedded(msg: Message) -> RecordDict | None:
    """The fedmosaic message inside the workflow's fit instructions (None: a plain message)."""
    rec = msg.content.config_records.get("fitins.config")
    if rec is None or EMBEDDED not in rec:
        return None
    return _deserialize(bytes(rec[EMBEDDED]))  # type: ignore[arg-type]


def reply(
    algo: Any,
    cid: int,
    upload: Payload,
    num_examples: int,
    loss: float,
    head: dict[str, Any],
) -> RecordDict:
    """The legacy fit result the mod masks: the summands, and the clear fields in its metrics."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    sf = secure.SecureForm(**json.loads(str(head[FORM])))
    round_num = m.int_field(head, "round")
    try:
        names, arrays = secure.client_vector(algo, upload, secure.weight(sf, num_examples), sf)
    except PayloadError as exc:
        raise secure.SecureError(f"client {cid}: secure aggregation: {exc}") from None
    # Flower's mod rounds with numpy's global generator: seeded as the simulator's emulation
    np.random.seed(secure.rounding_seed(sf.seed, round_num, cid))
    metrics: dict[str, bool | bytes | float | int | str] = {
        "client-id": cid,
        "num-examples": num_examples,
        "loss": loss if math.isfinite(loss) else float("nan"),
        NAMES: json.dumps(names),
        METRICS: json.dumps(algo.upload_metrics(upload)),
    }
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics)
    return compat.fitres_to_recorddict(res, keep_input=False)
