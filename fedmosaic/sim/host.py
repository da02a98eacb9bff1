"""A worker's clients: live models for the clients it holds, the rest in the state store.

A :class:`ClientHost` runs the per-client operations of ``core.client`` (fit / evaluate /
fine-tune) on wire bytes. The main process decides which host holds which client (see
``processes``); a host keeps the clients it holds as live modules and can hand one back to the
store (:meth:`flush`) so another host can take it. Evaluating a client the host does not hold
loads it into a spare module and leaves no trace (evaluation only re-receives the broadcast, which
overwrites the shared parts: the client's next operation re-receives anyway).

Spare modules are recycled per architecture, so moving clients costs a file read, not a model
construction (ResNet initialisation is slower than reading its weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Algorithm, Phase
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload, PayloadError, decode, encode
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.store import StateStore

Modules = tuple[ClientModel, nn.Module]  # (ClientModel, extras)
MAX_SPARES = 2  # spare module sets kept per architecture


class ClientHost:
    def __init__(
        self,
        algo: Algorithm,
        clients: Sequence[ClientData],
        members: Sequence[str],
        build: Callable[[int], Modules],
        settings: TrainSettings,
        seed: int,
        local_epochs: int,
        eval_splits: tuple[str, ...],
        store: StateStore,
    ) -> None:
        self.algo = algo
        self.clients = clients
        self.members = members
        self.build = build
        self.settings = settings
        self.seed = seed
        self.local_epochs = local_epochs
        self.eval_splits = eval_splits
        self.store = store
        self.live: dict[int, Modules] = {}
        self.spare: dict[str, list[Modules]] = {}

    # ---- client residency ----------------------------------------------------------------
    def _materialize(self, cid: int) -> Modules:
        """The client's modules with its latest state: from the store, or its initial state."""
        spares = self.spare.get(self.members[cid], [])
        if spares and self.store.has(cid):
            mods = spares.pop()
            try:
                if self.store.load(cid, *mods):
                    return mods
            except ValueError:  # another layout under the same member (data-dependent extras)
                pass
        mods = self.build(cid)  # deterministic initial state of this client
        self.store.load(cid, *mods)  # its saved state, if it has one
        return mods

    def take(self, cid: int) -> Modules:
        """Hold ``cid`` live (loading it if this host does not hold it yet)."""
        if cid not in self.live:
            self.live[cid] = self._materialize(cid)
        return self.live[cid]

    def flush(self, cids: Sequence[int]) -> None:
        """Write the clients to the store and stop holding them (their modules become spares)."""
        for cid in cids:
            mods = self.live.pop(cid, None)
            if mods is not None:
                self.store.save(cid, *mods)
                self._spare(cid, mods)

    def keep_only(self, cids: Sequence[int]) -> list[int]:
        """Flush every held client not in ``cids``; returns the flushed ids."""
        keep = set(cids)
        out = [c for c in self.live if c not in keep]
        self.flush(out)
        return out

    def _borrow(self, cid: int) -> tuple[Modules, bool]:
        if cid in self.live:
            return self.live[cid], False
        if not self.store.has(cid):
            # Never trained: save its initial state once, so the next visit is a file read.
            mods = self.build(cid)
            self.store.save(cid, *mods)
            return mods, True
        return self._materialize(cid), True

    def _spare(self, cid: int, mods: Modules) -> None:
        spares = self.spare.setdefault(self.members[cid], [])
        if len(spares) < MAX_SPARES:
            spares.append(mods)

    def _give_back(self, cid: int, mods: Modules, borrowed: bool) -> None:
        if borrowed:
            self._spare(cid, mods)

    # ---- operations ----------------------------------------------------------------------
    def fit_many(
        self, round_num: int, todo: Sequence[tuple[int, Payload]]
    ) -> Iterator[tuple[int, bytes | str, int, float, float, dict[str, dict[str, int]] | None]]:
        """``(cid, upload, examples, loss, seconds, attack)`` per client, as each is ready (the
        attack: ``eval.membership``'s on the upload, see ``client.upload_attack``): clients of
        one model layout train together (``accel.batched``) when ``train.batched_clients`` is on
        and the method allows it (a group's seconds are split evenly over its clients)."""
        fits = client_ops.fit_clients(
            self.algo,
            dict(todo),
            self.take,
            self.clients,
            self.settings,
            self.seed,
            round_num,
            self.local_epochs,
        )
        while True:
            t0 = time.perf_counter()
            try:
                group, outs = next(fits)
            except StopIteration:
                return
            seconds = (time.perf_counter() - t0) / len(group)
            for cid, res in zip(group, outs):
                upload = self._encode(res.upload)
                yield (cid, upload, res.num_examples, res.stats.mean_loss, seconds, res.attack)

    @staticmethod
    def _encode(upload: Payload) -> bytes | str:
        try:
            return encode(upload)
        except PayloadError as exc:
            return str(exc)

    def evaluate(self, cid: int, msg: Payload, receive: bool) -> dict[str, dict[str, int]]:
        mods, borrowed = self._borrow(cid)
        try:
            return client_ops.evaluate(
                self.algo,
                mods[0],
                mods[1],
                msg,
                self.clients[cid],
                self.eval_splits,
                self.settings.eval_batch_size,
                receive=receive,
                membership=self.settings.membership,
            )
        finally:
            self._give_back(cid, mods, borrowed)

    def finetune(self, cid: int, msg: Payload, phases: Sequence[Phase]) -> None:
        model, extras = self.take(cid)
        client_ops.finetune(
            self.algo,
            model,
            extras,
            msg,
            self.clients[cid],
            self.settings,
            self.seed,
            phases,
        )

    def decode_all(self, blobs: dict[int, bytes]) -> dict[int, Payload]:
        """Decode each distinct message once (every client of a round often gets the same one)."""
        return {k: decode(self.algo.Broadcast, b) for k, b in blobs.items()}

    def state_dicts(self, cids: Sequence[int]) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
        out = {}
        for cid in cids:
            mods, borrowed = self._borrow(cid)
            out[cid] = (
                {k: v.clone() for k, v in mods[0].state_dict().items()},
                {k: v.clone() for k, v in mods[1].state_dict().items()},
            )
            self._give_back(cid, mods, borrowed)
        return out
