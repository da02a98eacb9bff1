"""What a client does in a round (fit / evaluate / fine-tune): used by every runtime."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from fedmosaic.core import membership as mia
from fedmosaic.core import privacy, seeding
from fedmosaic.core.algorithm import Algorithm, FitContext, Phase, payload_to
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.training import (
    TrainSettings,
    TrainStats,
    accelerated_inference,
    accelerator,
    run_phases,
)


class ImageSource(Protocol):
    """Where client data lives: uint8 images held once, normalized per batch."""

    def batch(self, idx: Tensor, device: torch.device | str = "cpu") -> Tensor: ...


@dataclass
class ClientData:
    """One client's splits as row indices into a shared image source."""

    client_id: int
    source: ImageSource
    labels: Tensor  # int64 [N] for the whole dataset
    splits: dict[str, Tensor]  # "train" | "val" | "test" -> int64 row indices
    num_classes: int
    device: str = "cpu"
    _y: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def rows(self, split: str) -> Tensor:
        return self.splits.get(split, torch.empty(0, dtype=torch.long))

    def num(self, split: str) -> int:
        return int(self.rows(split).numel())

    @property
    def num_train(self) -> int:
        return self.num("train")

    def targets(self, split: str) -> Tensor:
        if split not in self._y:
            self._y[split] = self.labels[self.rows(split)].to(self.device)
        return self._y[split]

    def train_batch(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Normalized inputs and labels for positions within the training split."""
        rows = self.rows("train")[pos]
        return self.source.batch(rows, self.device), self.targets("train")[pos.to(self.device)]

    def iter_batches(self, split: str, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        """In-order batches (evaluation, prototype collection)."""
        rows, y = self.rows(split), self.targets(split)
        for start in range(0, rows.numel(), batch_size):
            yield (
                self.source.batch(rows[start : start + batch_size], self.device),
                y[start : start + batch_size],
            )

    def class_counts(self, split: str = "train") -> Tensor:
        return torch.bincount(self.targets(split).cpu(), minlength=self.num_classes)  # [C]


@dataclass
class FitOutput:
    upload: Payload
    num_examples: int
    stats: TrainStats
    # eval.membership: the attack on the model the server rebuilds from the upload (counts of
    # core/membership.py), None where the upload is not a whole model
    attack: dict[str, dict[str, int]] | None = None


def fit_clients(
    algo: Algorithm,
    messages: dict[int, Payload],
    take: Callable[[int], tuple[ClientModel, nn.Module]],
    data: Sequence[ClientData],
    settings: TrainSettings,
    seed: int,
    round_num: int,
    local_epochs: int,
) -> Iterator[tuple[list[int], list[FitOutput]]]:
    """A round's fits for one backend (the serial transport, a process worker), yielded as
    ``(client ids, their outputs)`` as each is done, so the backend can time it and release the
    modules before the next; ``take(cid)`` gives a client's modules, ``data[cid]`` its data.
    One client at a time (:func:`fit`); through the installed accelerator
    (``Accelerator.fit_clients``: ``fedmosaic.accel`` trains clients of one model layout together
    where the method and ``train.batched_clients`` allow it, the numbers of one at a time)."""
    acc = accelerator()
    if acc is not None:
        yield from acc.fit_clients(
            algo, messages, take, data, settings, seed, round_num, local_epochs
        )
        return
    for cid in messages:
        model, extras = take(cid)
        out = fit(
            algo, model, extras, messages[cid], data[cid], settings, seed, round_num, local_epochs
        )
        yield [cid], [out]


def fit(
    algo: Algorithm,
    model: ClientModel,
    extras: nn.Module,
    msg: Payload,
    data: ClientData,
    settings: TrainSettings,
    seed: int,
    round_num: int,
    epochs: int,
) -> FitOutput:
    """Receive the broadcast, train the algorithm's phases, and build the upload."""
    cid = data.client_id
    seeding.seed_torch(seed, round_num, cid, "fit")  # dropout / augmentation / in-loss sampling
    gen = seeding.torch_generator(seed, round_num, cid, "batches")
    msg = payload_to(msg, settings.device)
    algo.receive(model, extras, msg)
    local_dp = settings.privacy.mechanism == "local"
    refs = received_state(algo, model, extras, data, msg) if local_dp else {}
    algo.before_fit(FitContext(model, extras, data, msg, settings, gen, round_num))
    stats = run_phases(
        algo, model, extras, msg, data, algo.phases(round_num, epochs), settings, gen
    )
    model.eval()
    extras.eval()
    with torch.no_grad(), accelerated_inference(model, extras):
        upload = payload_to(algo.upload(model, extras, data, msg), "cpu")
    if local_dp:  # the client's own noise, before anything leaves it
        rule = settings.privacy
        upload = privacy.release(
            upload,
            refs,
            rule.clip,
            rule.noise_multiplier * rule.clip,
            privacy.local_generator(seed, round_num, cid),
            data.num_classes,
        )
    attack = None
    if settings.membership:  # what the server sees: the released upload
        attack = upload_attack(algo, model, upload, data, settings.eval_batch_size)
    return FitOutput(upload, data.num_train, stats, attack)


def upload_attack(
    algo: Algorithm, model: ClientModel, upload: Payload, data: ClientData, batch_size: int
) -> dict[str, dict[str, int]] | None:
    """``eval.membership`` at the fit: the loss-threshold attack on the model the server
    rebuilds from this upload (``Algorithm.upload_model``), the client's training split against
    its test split, as counts; None where the upload is not a whole model, a split is empty or a
    loss is NaN (a model the noise broke: nothing to rank)."""
    if data.num("train") == 0 or data.num("test") == 0:
        return None
    view = algo.upload_model(model, upload)
    if view is None:
        return None
    view.eval()
    with torch.inference_mode():
        sides = [
            torch.cat([mia.scores(view(x), y).cpu() for x, y in data.iter_batches(s, batch_size)])
            for s in ("train", "test")
        ]
    if any(bool(s.isnan().any()) for s in sides):
        return None
    return mia.counts(sides[0], sides[1])


def received_state(
    algo: Algorithm, model: ClientModel, extras: nn.Module, data: ClientData, msg: Payload
) -> dict[str, object]:
    """The Update fields of the upload a client would send right after ``receive``: what it was
    given, the reference its private update is taken from (none without Update fields)."""
    cls = algo.Upload
    if not privacy.needs_reference(cls):
        return {}
    model.eval()
    extras.eval()
    with torch.no_grad():
        before = payload_to(algo.upload(model, extras, data, msg), "cpu")
    model.train()
    extras.train()
    plan = privacy.release_plan(cls)
    # copies: an upload may hold the model's own tensors, which training then changes
    out: dict[str, object] = {}
    for name in plan.updates:
        value = getattr(before, name)
        if isinstance(value, Tensor):
            out[name] = value.detach().clone()
        else:
            out[name] = {k: v.detach().clone() for k, v in value.items()}
    return out


def evaluate(
    algo: Algorithm,
    model: ClientModel,
    extras: nn.Module,
    msg: Payload,
    data: ClientData,
    splits: tuple[str, ...],
    batch_size: int,
    receive: bool = True,
    membership: bool = False,
) -> dict[str, dict[str, int]]:
    """Correct counts per split and prediction mode, plus ``n`` (examples) per split.

    ``receive=False`` evaluates the client's model as it is (after fine-tuning); ``msg`` is still
    passed to ``predict`` (prototype methods classify against the broadcast prototypes).
    ``membership=True`` (``eval.membership``) adds the loss-threshold membership attack on the
    headline prediction (``acc``): the training split against the test split, as the counts of
    ``core/membership.py`` (left out when the model gives a NaN loss: nothing to rank).
    """
    msg = payload_to(msg, data.device)
    if receive:
        algo.receive(model, extras, msg)
    model.eval()
    extras.eval()
    attack = membership and data.num("train") > 0 and data.num("test") > 0
    sides: dict[str, list[Tensor]] = {"train": [], "test": []}
    out: dict[str, dict[str, int]] = {}
    with torch.inference_mode(), accelerated_inference(model, extras):
        for split in splits:
            counts: dict[str, int] = {"n": data.num(split)}
            for x, y in data.iter_batches(split, batch_size):
                for mode, scores in algo.predict(model, extras, x, msg).items():
                    counts[mode] = counts.get(mode, 0) + int((scores.argmax(1) == y).sum())
                    if attack and split == "test" and mode == "acc":
                        sides["test"].append(mia.scores(scores, y).cpu())
            out[split] = counts
        if attack:
            for split in [s for s in sides if not sides[s]]:  # train, and test if not scored
                for x, y in data.iter_batches(split, batch_size):
                    sides[split].append(
                        mia.scores(algo.predict(model, extras, x, msg)["acc"], y).cpu()
                    )
    if attack:
        members, nonmembers = torch.cat(sides["train"]), torch.cat(sides["test"])
        if not (members.isnan().any() or nonmembers.isnan().any()):
            out.update(mia.counts(members, nonmembers))
    return out


def finetune(
    algo: Algorithm,
    model: ClientModel,
    extras: nn.Module,
    msg: Payload,
    data: ClientData,
    settings: TrainSettings,
    seed: int,
    phases: Sequence[Phase],
) -> TrainStats:
    """Local fine-tuning after the last round (FedBABU-style), on the training split."""
    cid = data.client_id
    seeding.seed_torch(seed, 0, cid, "finetune")
    gen = seeding.torch_generator(seed, 0, cid, "finetune-batches")
    msg = payload_to(msg, settings.device)
    algo.receive(model, extras, msg)
    return run_phases(algo, model, extras, msg, data, phases, settings, gen)
