"""The in-process (serial) simulator: persistent client models, data held once, real wire accounting.

Clients run one after another in this process with its torch thread setting. Evaluation of a
client whose model has not changed since its last evaluation and whose broadcast is byte-identical
reuses the previous counts (``EvalCache``). The multi-process backend (``processes.py``) gives
bitwise-identical results to this one run with ``sim.threads = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import Algorithm, Phase
from fedmosaic.core.client import ClientData
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
        for cid, msg in messages.items():
            msg, down = wire(msg, self.check_wire)
            res = client_ops.fit(
                self.algo,
                self.models[cid],
                self.extras[cid],
                msg,
                self.data[cid],
                self.settings,
                self.seed,
                round_num,
                self.local_epochs,
            )
            self.version[cid] += 1
            try:
                upload, up = wire(res.upload, self.check_wire)
            except PayloadError as exc:  # e.g. non-finite values after a diverged step
                loss = res.stats.mean_loss
                out.append(FitResult(cid, None, res.num_examples, 0, down, loss, error=str(exc)))
                continue
            out.append(FitResult(cid, upload, res.num_examples, up, down, res.stats.mean_loss))
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
