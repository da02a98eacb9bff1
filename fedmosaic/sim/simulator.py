"""The in-process (serial) simulator: persistent client models, data held once, real wire accounting.

Clients run one after another in this process with its torch thread setting. Evaluation of a
client whose model has not changed since its last evaluation and whose broadcast is byte-identical
reuses the previous counts (``EvalCache``). The multi-process backend (``processes.py``) gives
bitwise-identical results to this one run with ``sim.threads = 1``.

With ``train.batched_clients`` on, the round's clients of one model layout train together as one
``torch.func`` computation (``core/batched.py``) where the method declares that equivalent
(``Algorithm.batchable``): the same numbers to float tolerance, not bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fedmosaic.core import batched
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Algorithm, Phase
from fedmosaic.core.client import ClientData, FitOutput
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload, PayloadError, decode, encode, payload_equal
from fedmosaic.core.rounds import EvalResult, FitResult
from fedmosaic.core.training import TrainSettings
from fedmosaic.sim.common import EvalCache, MessageTable


def wire(payload: Payload, check: bool) -> tuple[Payload, int]:
    """Encode ``payload`` as it would travel; optionally decode it back and compare exactly."""
    data = encode(payload)
    if not check:
        return payload, len(data)
    back = decode(type(payload), data)
    if not payload_equal(payload, back):
        # An algorithm's bug, not a bad client: fail the run (RuntimeError, never dropped).
        raise RuntimeError(f"{type(payload).__qualname__} does not survive the wire round trip")
    return back, len(data)


class SimTransport:
    """Serial in-process transport: every client's model and extras stay in memory."""

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
    ) -> None:
        self.algo = algo
        self.models = list(models)
        self.extras = list(extras)
        self.data = list(data)
        self.settings = settings
        self.seed = seed
        self.local_epochs = local_epochs
        self.check_wire = check_wire
        self.eval_splits = eval_splits
        self.version = [0] * len(self.models)  # bumped whenever a client's model is trained
        self.cache = EvalCache()

    def fit(self, round_num: int, messages: dict[int, Payload]) -> list[FitResult]:
        out: list[FitResult] = []
        received, downs = {}, {}
        for cid, msg in messages.items():
            received[cid], downs[cid] = wire(msg, self.check_wire)
        fitted = self._fit_all(round_num, received)
        for cid in messages:
            res, down = fitted[cid], downs[cid]
            self.version[cid] += 1
            try:
                upload, up = wire(res.upload, self.check_wire)
            except PayloadError as exc:  # e.g. non-finite values after a diverged step
                loss = res.stats.mean_loss
                out.append(FitResult(cid, None, res.num_examples, 0, down, loss, error=str(exc)))
                continue
            out.append(FitResult(cid, upload, res.num_examples, up, down, res.stats.mean_loss))
        return out

    def _fit_all(self, round_num: int, messages: dict[int, Payload]) -> dict[int, FitOutput]:
        """Every client's fit: grouped by model layout and trained together where the method
        allows it and ``train.batched_clients`` is on (``core.batched``), else one at a time.
        The order does not matter: each client's fit depends only on its own state and streams."""
        out: dict[int, FitOutput] = {}
        singles = list(messages)
        if self.settings.batched_enabled:
            keys = {
                c: batched.layout_key(self.models[c], self.extras[c])
                for c in messages
                if batched.eligible(self.algo, self.models[c], self.extras[c])
            }
            grouped, _ = batched.groups(list(keys), keys)
            in_group = {c for g in grouped for c in g}
            singles = [c for c in messages if c not in in_group]
            for g in grouped:
                res = batched.fit_group(
                    self.algo,
                    [self.models[c] for c in g],
                    [self.extras[c] for c in g],
                    [messages[c] for c in g],
                    [self.data[c] for c in g],
                    self.settings,
                    self.seed,
                    round_num,
                    self.local_epochs,
                )
                out.update(zip(g, res))
        for cid in singles:
            out[cid] = client_ops.fit(
                self.algo,
                self.models[cid],
                self.extras[cid],
                messages[cid],
                self.data[cid],
                self.settings,
                self.seed,
                round_num,
                self.local_epochs,
            )
        return out

    def evaluate(
        self, round_num: int, messages: dict[int, Payload], receive: bool = True
    ) -> list[EvalResult]:
        out: list[EvalResult] = []
        table = MessageTable(messages)
        for cid, msg in messages.items():
            key = (self.version[cid], table.digest(cid), receive)
            counts = self.cache.get(cid, key)
            if counts is not None:
                out.append(EvalResult(cid, counts))
                continue
            counts = client_ops.evaluate(
                self.algo,
                self.models[cid],
                self.extras[cid],
                msg,
                self.data[cid],
                self.eval_splits,
                self.settings.eval_batch_size,
                receive=receive,
            )
            self.cache.put(cid, key, counts)
            out.append(EvalResult(cid, counts))
        return out

    def finetune(self, messages: dict[int, Payload], phases: Sequence[Phase]) -> None:
        for cid, msg in messages.items():
            client_ops.finetune(
                self.algo,
                self.models[cid],
                self.extras[cid],
                msg,
                self.data[cid],
                self.settings,
                self.seed,
                phases,
            )
            self.version[cid] += 1

    def invalidate(self) -> None:
        """Forget cached evaluations (after client models were changed from outside)."""
        self.cache.clear()
