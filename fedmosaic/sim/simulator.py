"""The in-process (serial) simulator: client models, data held once, real wire accounting.

Clients run one after another in this process with its torch thread setting. Evaluation of a
client whose model has not changed since its last evaluation and whose broadcast is byte-identical
reuses the previous counts (``EvalCache``). The multi-process backend (``processes.py``) gives
bitwise-identical results to this one run with ``sim.threads = 1``.

**Where clients live.** A small federation keeps every client's model and extras in memory (the
``models``/``extras`` lists, which callers may read and change between rounds). A large one
(``sim.offload_clients``, see ``federation.offload_decision``) keeps them in the process backend's
state store instead (``store.py``: one raw file per client, in the page cache, not this
process's memory) and holds a client live only while it trains, evaluates or fine-tunes,
through the same :class:`~fedmosaic.sim.host.ClientHost` a worker process uses (spare modules
recycled per architecture). Memory then follows the round's clients, not the population, and the
numbers are the same bit for bit: a client's state is every parameter and persistent buffer
(what the process backend moves between workers), and every client's work is a pure function of
that state, its message and its own streams. We chose a threshold over offloading always
because a file write and read per client per round is pure overhead while the population fits,
and because tests and notebooks reach into ``models`` of small federations.

With ``train.batched_clients`` on, the round's clients of one model layout train together as one
``torch.func`` computation (``accel/batched.py``) where the method declares that equivalent
(``Acceleration.batched``): the same numbers to float tolerance, not bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torch import nn

from fedmosaic.core import client as client_ops
from fedmosaic.core import secure
from fedmosaic.core.algorithm import Algorithm, Phase, payload_to
from fedmosaic.core.client import ClientData, FitOutput
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import (
    Payload,
    PayloadError,
    decode,
    encode,
    encoded_size,
    payload_equal,
)
from fedmosaic.core.rounds import (
    ClientProgress,
    ClientState,
    EvalResult,
    FitResult,
    LazyClientStates,
)
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.common import EvalCache, MessageTable
from fedmosaic.sim.host import ClientHost
from fedmosaic.sim.store import StateStore

Modules = tuple[ClientModel, nn.Module]


def wire(payload: Payload, check: bool) -> tuple[Payload, int]:
    """``payload`` as it arrives and its size on the wire: decoded back from its bytes and
    compared exactly with ``check``, else as is (its size looked up, not re-encoded)."""
    if not check:
        return payload, encoded_size(payload)
    data = encode(payload)
    back = decode(type(payload), data)
    if not payload_equal(payload, back):
        # An algorithm's bug, not a bad client: fail the run (RuntimeError, never dropped).
        raise RuntimeError(f"{type(payload).__qualname__} does not survive the wire round trip")
    return back, len(data)


def detached(payload: Payload) -> Payload:
    """A copy of ``payload`` sharing no tensor with it (an upload may be a view of the client's
    weights, and an offloaded client's module is reused for the next client)."""
    arrays, scalars = payload.flatten()
    return type(payload).unflatten({k: v.detach().clone() for k, v in arrays.items()}, scalars)


class SimTransport(secure.EmulatedSecureFit):
    """Serial in-process transport; clients in memory (``models``/``extras``) or, given
    ``build``, in a state store with only the clients being worked on live (see the module)."""

    def __init__(
        self,
        algo: Algorithm,
        models: Sequence[ClientModel],
        extras: Sequence[nn.Module],
        data: Sequence[ClientData],
        settings: TrainSettings,
        seed: int,
        local_epochs: int,
        check_wire: bool = False,
        eval_splits: tuple[str, ...] = ("test",),
        build: Callable[[int], Modules] | None = None,
        members: Sequence[str] = (),
    ) -> None:
        """``build(cid)``: the client's initial modules (``federation.make_client``); given, the
        clients are offloaded (``models``/``extras`` must be empty) and ``members[cid]`` names
        each client's architecture (spare modules are reused per architecture)."""
        self.algo = algo
        self.models = list(models)
        self.extras = list(extras)
        self.data = list(data)
        self.settings = settings
        self.seed = seed
        self.local_epochs = local_epochs
        self.check_wire = check_wire
        self.eval_splits = eval_splits
        # bumped whenever a client's model is trained
        self.version = [0] * (len(self.data) if build is not None else len(self.models))
        self.cache = EvalCache()
        self._on_client: ClientProgress | None = None  # see set_progress
        self._on_finetune: ClientProgress | None = None
        self.host: ClientHost | None = None
        if build is not None:
            if self.models or self.extras:
                raise ValueError("offloaded clients are built on demand: pass no models")
            self.host = ClientHost(
                algo,
                self.data,
                members,
                build,
                settings,
                seed,
                local_epochs,
                eval_splits,
                StateStore(),
            )

    @property
    def offloaded(self) -> bool:
        """Whether clients live in the state store (else in ``models``/``extras``)."""
        return self.host is not None

    # ---- client residency ------------------------------------------------------------------
    def _take(self, cid: int) -> Modules:
        if self.host is None:
            return self.models[cid], self.extras[cid]
        return self.host.take(cid)

    def _release(self, cids: Sequence[int]) -> None:
        """Offloaded: write the clients back to the store (their modules become spares)."""
        if self.host is not None:
            self.host.flush(cids)

    # ---- Transport -------------------------------------------------------------------------
    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[FitResult]:
        received, downs = {}, {}
        for cid, msg in messages.items():
            received[cid], downs[cid] = wire(msg, self.check_wire)
        results: dict[int, FitResult] = {}
        if self._on_client is not None:
            self._on_client(0, len(messages))
        for cid, res in self._fit_all(round_num, received):
            if self._on_client is not None:
                self._on_client(len(results) + 1, len(messages))
            down = downs[cid]
            self.version[cid] += 1
            try:
                upload, up = wire(res.upload, self.check_wire)
                if self.host is not None:  # before the client's module is reused
                    upload = detached(upload)
            except PayloadError as exc:  # e.g. non-finite values after a diverged step
                loss = res.stats.mean_loss
                results[cid] = FitResult(cid, None, res.num_examples, 0, down, loss, error=str(exc))
                continue
            results[cid] = FitResult(
                cid, upload, res.num_examples, up, down, res.stats.mean_loss, attack=res.attack
            )
        return [results[c] for c in messages]

    def _fit_all(
        self, round_num: int, messages: dict[int, Payload]
    ) -> Iterator[tuple[int, FitOutput]]:
        """Every client's fit, each yielded before its modules are released: grouped by model
        layout and trained together where the method allows it and ``train.batched_clients`` is
        on (``accel.batched``), else one at a time. The order does not matter: each client's fit
        depends only on its own state and streams."""
        for group, outs in client_ops.fit_clients(
            self.algo,
            messages,
            self._take,
            self.data,
            self.settings,
            self.seed,
            round_num,
            self.local_epochs,
        ):
            yield from zip(group, outs)
            self._release(group)

    def evaluate(
        self, round_num: int, messages: dict[int, Payload], receive: bool = True
    ) -> list[EvalResult]:
        out: list[EvalResult] = []
        table = MessageTable(messages)
        # each distinct broadcast moved to the clients' device once, not once per client
        moved: dict[tuple[int, str], Payload] = {}
        for cid, msg in messages.items():
            key = (self.version[cid], table.digest(cid), receive)
            counts = self.cache.get(cid, key)
            if counts is not None:
                out.append(EvalResult(cid, counts))
                continue
            if self.host is not None:
                # Borrowed into a spare module and not written back: evaluation only
                # re-receives the broadcast, which the client's next operation does anyway.
                counts = self.host.evaluate(cid, msg, receive)
            else:
                where = (table.key[cid], str(self.data[cid].device))
                if where not in moved:
                    moved[where] = payload_to(msg, self.data[cid].device)
                counts = client_ops.evaluate(
                    self.algo,
                    self.models[cid],
                    self.extras[cid],
                    moved[where],
                    self.data[cid],
                    self.eval_splits,
                    self.settings.eval_batch_size,
                    receive=receive,
                    membership=self.settings.membership,
                )
            self.cache.put(cid, key, counts)
            out.append(EvalResult(cid, counts))
        return out

    def finetune(self, messages: dict[int, Payload], phases: Sequence[Phase]) -> None:
        if self._on_finetune is not None:
            self._on_finetune(0, len(messages))
        for done, (cid, msg) in enumerate(messages.items(), 1):
            model, extras = self._take(cid)
            client_ops.finetune(
                self.algo,
                model,
                extras,
                msg,
                self.data[cid],
                self.settings,
                self.seed,
                phases,
            )
            self._release([cid])
            self.version[cid] += 1
            if self._on_finetune is not None:
                self._on_finetune(done, len(messages))

    def set_progress(
        self, on_client: ClientProgress | None, on_finetune: ClientProgress | None = None
    ) -> None:
        """Report each fit's (and the fine-tuning's) clients as they finish (the progress
        bar's per-client line)."""
        self._on_client = on_client
        self._on_finetune = on_finetune

    def invalidate(self) -> None:
        """Forget cached evaluations (after client models were changed from outside)."""
        self.cache.clear()

    # ---- client state (checkpoints, the trained models) ----------------------------------
    def client_states(self) -> Sequence[ClientState]:
        """Every client's (model, extras) state dicts: in memory, the live modules' (their
        readers copy what they keep: the checkpoint writer, ``api.run``'s fresh models).
        Offloaded, a lazy sequence that reads each client from the store when indexed (a
        checkpoint writer copies one client at a time); valid until :meth:`close`."""
        if self.host is None:
            return [(m.state_dict(), e.state_dict()) for m, e in zip(self.models, self.extras)]
        return _StoredStates(self.host, len(self.version))

    def load_client_states(self, states: Sequence[ClientState]) -> None:
        """Load every client's (model, extras) state dicts (a checkpoint's); ``ValueError``
        naming the client when one does not fit its model."""
        if len(states) != len(self.version):
            raise ValueError(f"checkpoint has {len(states)} clients, this run {len(self.version)}")
        for cid, (model_state, extras_state) in enumerate(states):
            model, extras = self._take(cid)
            try:
                model.load_state_dict(model_state, strict=True)
                extras.load_state_dict(extras_state, strict=True)
            except RuntimeError as exc:
                if self.host is not None:  # half loaded: never written back
                    self.host.live.pop(cid, None)
                raise ValueError(f"client {cid}: {exc}") from exc
            self._release([cid])
            self.version[cid] += 1
        self.cache.clear()

    def close(self) -> None:
        """Delete the state store of offloaded clients (nothing to do otherwise)."""
        if self.host is not None:
            self.host.live.clear()
            self.host.spare.clear()
            self.host.store.close()


class _StoredStates(LazyClientStates):
    """Offloaded clients' state dicts, each read from the store (copied) when indexed."""

    def __init__(self, host: ClientHost, n: int) -> None:
        self.host, self.n = host, n

    def get(self, cid: int) -> ClientState:
        return self.host.state_dicts([cid])[cid]
