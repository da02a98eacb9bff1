"""The fedmosaic Flower app: ``server_app`` (our round loop over a Grid) and ``client_app``.

Components for ``pyproject.toml``::

    serverapp = "fedmosaic.flower.app:server_app"
    clientapp = "fedmosaic.flower.app:client_app"

Both halves read the experiment from the run config (``experiment`` JSON + ``overrides``). A
SuperNode serves one client: ``partition-id`` in its node config is the client id and
``num-partitions`` must equal ``data.num_clients``. The ClientApp rebuilds that client's data
split, model and extras deterministically from the config (the same functions the simulator
uses), restores its persistent state from ``context.state`` and runs ``core.client``'s fit /
evaluate / fine-tune. Flower's own SuperNode starts a fresh ClientApp process per message, so this
module imports only Flower's app API at import time; everything else is imported on first use.
A process that serves many messages (``fedmosaic.flower.node``, the in-memory Grid) builds each
client once per run and starts every message from a copy of that build (``_pristine``): the
model and extras a fresh process would build, with the torch RNG state that build leaves.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

log = logging.getLogger("fedmosaic.flower")

MODEL_STATE = "fedmosaic.model"  # context.state: the client's model state dict
EXTRAS_STATE = "fedmosaic.extras"  # context.state: the algorithm's client extras state dict
CLIENT_STATE = "fedmosaic.client"  # context.state: which client the state above belongs to
TEST_FAULT = "fedmosaic-test-fault"  # node config, tests only: nan | malformed | raise


def _secure_mod(msg: Message, context: Context, call_next: Callable[..., Message]) -> Message:
    """Flower's ``secaggplus_mod`` around the workflow's messages (``privacy.secure_aggregation``,
    ``flower/secagg.py``); every other message goes straight to its handler."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == "train" and RECORD_KEY_CONFIGS in msg.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


server_app = ServerApp()
client_app = ClientApp(mods=[_secure_mod])


# ---- client half ------------------------------------------------------------------------------
@dataclass
class _NodeSetup:
    """What a SuperNode rebuilds from the experiment config (cached per process)."""

    cfg: Any
    algo: Any
    clients: list[Any]
    spec: Any
    settings: Any
    splits: tuple[str, ...]


_SETUPS: dict[str, _NodeSetup] = {}


@dataclass
class _Built:
    """A client as ``make_client`` builds it, and the global torch RNG state after the build
    (``make_client`` seeds it; ``evaluate`` must find it as a fresh build leaves it)."""

    model: Any
    extras: Any
    rng: Any
    cuda_rng: list[Any] | None


_BUILT: dict[tuple[int, str, int], _Built] = {}  # (run id, experiment key, client id)
# A SuperNode serves one client; a Ray actor of the simulation runtime serves many: keep the most
# recent builds only, so an actor's memory does not grow with the population (a build evicted is
# built again, the same bits)
_BUILT_MAX = 32


def _setup_key(run_config: Any) -> str:
    return json.dumps([run_config.get("experiment"), run_config.get("overrides")])


def eval_splits(clients: list[Any]) -> tuple[str, ...]:
    return ("test", "val") if any(c.num("val") for c in clients) else ("test",)


def _node_setup(run_config: Any) -> _NodeSetup:
    key = _setup_key(run_config)
    if key not in _SETUPS:
        import torch

        from fedmosaic.algorithms import build_algorithm
        from fedmosaic.core.training import TrainSettings
        from fedmosaic.data import build_federated_data
        from fedmosaic.federation import client_data, make_spec
        from fedmosaic.flower.settings import experiment_from_run_config

        cfg = experiment_from_run_config(run_config)
        # "auto" = 1, as the simulator resolves it: the simulator's numbers on any machine
        threads = 1 if cfg.sim.threads == "auto" else int(cfg.sim.threads)
        if threads > 0:  # 0: torch's default, left alone
            torch.set_num_threads(threads)
        data = build_federated_data(cfg.data, cfg.seed)
        clients = client_data(data, cfg.train.device)
        spec = make_spec(cfg, data, clients)
        _SETUPS.clear()  # one experiment per process
        _BUILT.clear()
        algo = build_algorithm(cfg.algorithm)
        _SETUPS[key] = _NodeSetup(
            cfg,
            algo,
            clients,
            spec,
            TrainSettings.from_config(cfg.train, algo, cfg.privacy, cfg.eval.membership),
            eval_splits(clients),
        )
    return _SETUPS[key]


def _pristine(context: Context, setup: _NodeSetup, data: Any) -> tuple[Any, Any]:
    """A fresh copy of the client's initial model and extras, as ``make_client`` returns them,
    with the global torch RNG where ``make_client`` leaves it; built once per run and client."""
    import torch

    from fedmosaic.federation import make_client

    key = (context.run_id, _setup_key(context.run_config), data.client_id)
    built = _BUILT.get(key)
    if built is None:
        if any(k[:2] != key[:2] for k in _BUILT):  # another run: its clients are not needed
            _BUILT.clear()
        model, extras = make_client(setup.cfg, setup.algo, setup.spec, data)
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        while len(_BUILT) >= _BUILT_MAX:
            del _BUILT[next(iter(_BUILT))]  # the oldest build
        # one deepcopy of the pair keeps references between them (extras holding model parts)
        _BUILT[key] = _Built(*copy.deepcopy((model, extras)), torch.get_rng_state(), cuda)
        return model, extras
    torch.set_rng_state(built.rng)
    if built.cuda_rng is not None:
        torch.cuda.set_rng_state_all(built.cuda_rng)
    return copy.deepcopy((built.model, built.extras))


def _partition(context: Context) -> tuple[int, int]:
    pid, total = context.node_config.get("partition-id"), context.node_config.get("num-partitions")
    if not isinstance(pid, int) or not isinstance(total, int) or isinstance(pid, bool):
        raise ValueError(
            "this SuperNode needs --node-config 'partition-id=<i> num-partitions=<N>' "
            f"(got {dict(context.node_config)})"
        )
    return pid, total


class _Client:
    """One client's model and extras, restored from and saved to ``context.state``."""

    def __init__(self, context: Context) -> None:
        from fedmosaic.flower.codec import record_to_tensors

        self.context = context
        self.setup = _node_setup(context.run_config)
        self.cid, total = _partition(context)
        n = self.setup.spec.num_clients
        if total != n or not 0 <= self.cid < n:
            raise ValueError(
                f"partition-id={self.cid} num-partitions={total}: the run has {n} clients"
            )
        self.data = self.setup.clients[self.cid]
        self.model, self.extras = _pristine(context, self.setup, self.data)
        state = context.state
        owner = state.config_records.get(CLIENT_STATE)
        if owner is not None and owner.get("client-id") == self.cid:
            self.model.load_state_dict(record_to_tensors(state.array_records[MODEL_STATE]))
            self.extras.load_state_dict(record_to_tensors(state.array_records[EXTRAS_STATE]))

    def save(self) -> None:
        from flwr.app import ConfigRecord

        from fedmosaic.flower.codec import tensors_to_record

        self.context.state[MODEL_STATE] = tensors_to_record(self.model.state_dict())
        self.context.state[EXTRAS_STATE] = tensors_to_record(self.extras.state_dict())
        self.context.state[CLIENT_STATE] = ConfigRecord({"client-id": self.cid})

    def broadcast(self, content: RecordDict) -> tuple[Any, dict[str, Any]]:
        from fedmosaic.core.payload import PayloadError
        from fedmosaic.flower import messages as m
        from fedmosaic.flower.codec import records_to_payload

        head = m.header(content)
        if m.int_field(head, "client-id") != self.cid:
            raise PayloadError(f"message for client {head.get('client-id')} sent to {self.cid}")
        m.check_payload_type(head, self.setup.algo.Broadcast)
        return records_to_payload(self.setup.algo.Broadcast, content), head


@client_app.query()
def hello(msg: Message, context: Context) -> Message:
    """Handshake: which client (partition) this SuperNode serves."""
    from fedmosaic.flower import messages as m

    pid, total = _partition(context)
    return Message(
        m.with_header(RecordDict(), **{"partition-id": pid, "num-partitions": total}),
        reply_to=msg,
    )


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training on this client's split; replies with the upload."""
    from fedmosaic.core import client as client_ops
    from fedmosaic.flower import messages as m

    fault = context.node_config.get(TEST_FAULT, "")
    if fault == "raise":
        raise RuntimeError(f"{TEST_FAULT}=raise")
    inner = None  # under secure aggregation: the message inside the workflow's fit instructions
    if "fitins.config" in msg.content.config_records:
        from fedmosaic.flower import secagg

        inner = secagg.embedded(msg)
    client = _Client(context)
    payload, head = client.broadcast(msg.content if inner is None else inner)
    setup = client.setup
    out = client_ops.fit(
        setup.algo,
        client.model,
        client.extras,
        payload,
        client.data,
        setup.settings,
        setup.cfg.seed,
        m.int_field(head, "round"),
        setup.cfg.train.local_epochs,
    )
    client.save()
    if inner is not None:
        reply = secagg.reply(
            setup.algo, client.cid, out.upload, out.num_examples, float(out.stats.mean_loss), head
        )
        return Message(reply, reply_to=msg)
    content = m.payload_message(
        out.upload,
        **{
            "client-id": client.cid,
            "num-examples": out.num_examples,
            "loss": float(out.stats.mean_loss),
        },
    )
    if out.attack is not None:  # eval.membership: the attack on what this reply uploads
        content[m.ATTACK] = m.counts_record(out.attack)
    if fault:
        _inject_fault(content, str(fault))
    return Message(content, reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Correct counts per split and prediction mode with the model this client would use."""
    from fedmosaic.core import client as client_ops
    from fedmosaic.flower import messages as m

    client = _Client(context)
    payload, head = client.broadcast(msg.content)
    receive = bool(head.get("receive", True))
    counts = client_ops.evaluate(
        client.setup.algo,
        client.model,
        client.extras,
        payload,
        client.data,
        client.setup.splits,
        client.setup.settings.eval_batch_size,
        receive=receive,
        membership=client.setup.settings.membership,
    )
    if receive:  # receiving changed the model, exactly as it does in the simulator
        client.save()
    content = m.with_header(RecordDict(), **{"client-id": client.cid})
    content[m.COUNTS] = m.counts_record(counts)
    return Message(content, reply_to=msg)


@client_app.train("finetune")
def finetune(msg: Message, context: Context) -> Message:
    """Local fine-tuning after the last round (FedBABU, layer expansion)."""
    from fedmosaic.core import client as client_ops
    from fedmosaic.flower import messages as m

    client = _Client(context)
    payload, head = client.broadcast(msg.content)
    phases = m.phases_from_json(str(head.get("phases", "[]")))
    client_ops.finetune(
        client.setup.algo,
        client.model,
        client.extras,
        payload,
        client.data,
        client.setup.settings,
        client.setup.cfg.seed,
        phases,
    )
    client.save()
    return Message(m.with_header(RecordDict(), **{"client-id": client.cid}), reply_to=msg)


def _inject_fault(content: RecordDict, fault: str) -> None:
    """Tests only: corrupt a reply the way a broken or hostile client would."""
    import numpy as np
    from flwr.app import Array

    from fedmosaic.flower.codec import ARRAYS

    arrays = content.array_records[ARRAYS]
    if fault == "nan":
        for name, arr in arrays.items():
            if arr.dtype.startswith("float"):
                arrays[name] = Array(np.full(arr.shape, np.nan, dtype=arr.dtype))
                return
    if fault in ("nan", "malformed"):
        arrays["not-a-field"] = Array(np.zeros(3, dtype=np.float32))
        return
    raise ValueError(f"unknown {TEST_FAULT} {fault!r}")


# ---- server half ------------------------------------------------------------------------------
@server_app.main()
def main(grid: Grid, context: Context) -> None:
    _quick_reply_pulls()
    run_server(grid, context.run_config)


REPLY_PULL_BACKOFF = 0.1  # seconds; Flower 1.41's: 1 s, then doubling
FLWR_PATCHED = "1.41.0"  # the Flower whose internals this package's speed patches target


def _quick_reply_pulls() -> None:
    """Look again after ``REPLY_PULL_BACKOFF``, not 1 s, for reply objects a SuperNode is still
    uploading: Flower's SuperLink lists a reply as soon as its message arrives, before its
    objects, and the Grid (``flwr.superlink.grid.http_grid``) waits before pulling them again.
    This process runs only the ServerApp, so the patch reaches nothing else."""
    import functools

    from flwr.supercore.version import package_version
    from flwr.superlink.grid import http_grid

    if package_version != FLWR_PATCHED:
        log.warning(
            "flwr %s: the reply-pull wait patched here is %s's", package_version, FLWR_PATCHED
        )

    pull = getattr(http_grid.pull_objects, "func", http_grid.pull_objects)
    http_grid.pull_objects = functools.partial(
        pull,
        max_tries_per_object=None,  # bounded by Flower's max_time (2 h) instead
        initial_backoff=REPLY_PULL_BACKOFF,
        backoff_cap=REPLY_PULL_BACKOFF,
    )


def run_server(
    grid: Any, run_config: Any, on_round: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Our round loop over ``grid``; writes and returns the ``results.json`` document.
    ``on_round`` also gets each round's record (``fedmosaic.api.run_flower_in_memory``'s).

    A run that fails leaves ``FAILED`` (the traceback) next to ``server.log`` in the results
    folder, so whoever waits for ``results.json`` can stop waiting.

    The results folder (``results-dir``) is locked for the whole run with ``fedmosaic.runfolder``'s
    lock, the one ``fedmosaic run --out`` takes: a second ServerApp (or a ``fedmosaic run``) into
    it is refused in one line naming the folder (RunFolderError) before anything there changes.
    A caller with the folder open as a RunFolder in this thread (``run_flower_in_memory``) is
    not locked twice.
    """
    from fedmosaic.flower.settings import FlowerOptions, experiment_from_run_config

    start = time.perf_counter()
    from fedmosaic.provenance import now

    started = now()
    options = FlowerOptions.from_run_config(run_config)
    cfg = experiment_from_run_config(run_config)
    out = Path(
        options.results_dir
        or f"runs/flower-{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algorithm['name']}"
    )
    from fedmosaic.runfolder import hold

    with hold(out, flag="results-dir"):  # refused here: nothing of the holder's run touched
        return _serve(grid, out, cfg, options, on_round, start, started)


def _serve(
    grid: Any,
    out: Path,
    cfg: Any,
    options: Any,
    on_round: Callable[[dict[str, Any]], None] | None,
    start: float,
    started: str,
) -> dict[str, Any]:
    """:func:`run_server`'s run, its results folder locked."""
    out.mkdir(parents=True, exist_ok=True)
    run_log = _RunLog(out / "server.log")
    (out / "FAILED").unlink(missing_ok=True)
    try:
        from fedmosaic.core.rounds import run_rounds
        from fedmosaic.federation import build_federation
        from fedmosaic.flower.transport import GridTransport
        from fedmosaic.report.results import write_results
        from fedmosaic.report.summary import FinetuneLines, results_document

        threads = 1 if cfg.sim.threads == "auto" else int(cfg.sim.threads)  # as the simulator
        if threads > 0:  # the server's own steps
            import torch

            torch.set_num_threads(threads)
        fed = build_federation(cfg, with_clients=False)
        plan = replace(fed.plan, min_replies=options.min_replies)
        transport = GridTransport(grid, fed.algo, fed.clients, eval_splits(fed.clients), options)
        log.info(
            "fedmosaic on Flower: %s, %d clients, %d rounds; waiting for SuperNodes",
            cfg.algorithm["name"],
            plan.num_clients,
            plan.rounds,
        )
        transport.connect()
        transport.set_progress(None, FinetuneLines(cfg.algorithm["name"], log.info))
        progress = out / "progress.jsonl"
        progress.unlink(missing_ok=True)

        def each_round(rec: dict[str, Any]) -> None:
            line = {**rec, "flower": transport.rounds.get(rec["round"], {})}
            with open(progress, "a") as fh:
                fh.write(json.dumps(line, default=str) + "\n")
            log.info(
                "round %d: acc %s, participants %s, rejected %s%s",
                rec["round"],
                f"{100 * rec['acc_weighted']:.2f}%" if "acc_weighted" in rec else "-",
                rec["participants"],
                rec["rejected"],
                "" if rec.get("aggregated", True) else " (skipped)",
            )
            if on_round is not None:
                on_round(rec)

        history, _ = run_rounds(fed.algo, fed.spec, transport, plan, each_round)
        nodes = len(set(transport.node_of.values())) or None  # workers: the SuperNodes
        wall = time.perf_counter() - start
        doc = results_document(
            cfg, fed.data, fed.clients, fed.spec.members, history, wall, started, nodes
        )
        doc["runtime"] = "flower"
        # Every accuracy here is what the SuperNodes counted on their own data: the server sees
        # counts it can bound (never above the split's size) but cannot recompute. The one
        # exception is server_acc/server_loss (data.server_eval_size): the server's own split.
        doc["evaluation_source"] = "client-reported"
        doc["flower"] = {
            "options": dict(vars(options)),
            "nodes": {str(c): n for c, n in sorted(transport.node_of.items())},
            "refused_nodes": {str(n): r for n, r in sorted(transport.refused.items())},
            "rounds": [transport.rounds[t] for t in sorted(transport.rounds)],
        }
        write_results(out, doc)
        log.info("results written to %s", out)
        return doc
    except BaseException:
        log.exception("the run failed")
        (out / "FAILED").write_text(traceback.format_exc())
        raise
    finally:
        run_log.close()


class _RunLog:
    """INFO and above of every ``fedmosaic`` logger to ``path`` (and stderr, which Flower
    collects as the run's log, when nothing else prints them) for the duration of a run."""

    def __init__(self, path: Path) -> None:
        self.logger = logging.getLogger("fedmosaic")
        self.level = self.logger.level
        self.handlers: list[logging.Handler] = [logging.FileHandler(path)]
        if not self.logger.hasHandlers():
            self.handlers.append(logging.StreamHandler())
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        for h in self.handlers:
            h.setFormatter(fmt)
            self.logger.addHandler(h)
        self.logger.setLevel(logging.INFO)

    def close(self) -> None:
        for h in self.handlers:
            self.logger.removeHandler(h)
            h.close()
        self.logger.setLevel(self.level)
