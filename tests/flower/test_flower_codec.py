"""Payload <-> Flower RecordDict: exact round trips for every algorithm, strict decoding."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers.experiments import tiny_raw
from torch import Tensor, nn

pytest.importorskip("flwr")

from flwr.app import Array, ConfigRecord, RecordDict  # noqa: E402

from fedmosaic.algorithms import ALGORITHMS  # noqa: E402
from fedmosaic.config import from_dict  # noqa: E402
from fedmosaic.core import client as client_ops  # noqa: E402
from fedmosaic.core.algorithm import Phase  # noqa: E402
from fedmosaic.core.payload import Payload, PayloadError, payload_equal  # noqa: E402
from fedmosaic.experiment import build_federation  # noqa: E402
from fedmosaic.flower import messages as m  # noqa: E402
from fedmosaic.flower.codec import (  # noqa: E402
    ARRAYS,
    SCALARS,
    payload_to_records,
    record_to_tensors,
    records_to_payload,
    tensors_to_record,
    wire_size,
)
from fedmosaic.flower.local import through_wire  # noqa: E402


def roundtrip(payload: Payload) -> Payload:
    back = records_to_payload(type(payload), through_wire(payload_to_records(payload)))
    assert payload_equal(payload, back), type(payload).__qualname__
    return back


def small_family(name: str) -> str:
    return "fedhenn5" if ALGORITHMS.get(name).supports_heterogeneous else "fedhenn_cnn1"


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_payload_and_client_state_round_trip(name):
    raw = tiny_raw(algorithm={"name": name}, model={"family": small_family(name)})
    fed = build_federation(from_dict(raw))
    algo, spec = fed.algo, fed.spec
    state = algo.init_server(spec)
    for cid in (0, 1):  # two architectures in the heterogeneous family
        msg = roundtrip(algo.broadcast(state, cid, 1))
        out = client_ops.fit(
            algo, fed.models[cid], fed.extras[cid], msg, fed.clients[cid], fed.settings, 0, 1, 1
        )
        roundtrip(out.upload)
        for module in (fed.models[cid], fed.extras[cid]):  # what context.state keeps
            sd = module.state_dict()
            back = record_to_tensors(through_wire(RecordDict({"s": tensors_to_record(sd)}))["s"])
            assert back.keys() == sd.keys()
            assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in sd.items())


@dataclass(frozen=True)
class Everything(Payload):
    protos: Tensor  # float32 [C, d]
    known: Tensor  # bool [C]
    counts: Tensor  # int64 [C]
    half: Tensor  # float16 [2]
    pixels: Tensor  # uint8 [2, 2]
    state: dict[str, Tensor]  # conv + BatchNorm state dict (buffers included)
    steps: int
    lr: float
    flag: bool
    note: str


def everything() -> Everything:
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    net.train()
    net(torch.randn(4, 1, 5, 5))  # running stats and num_batches_tracked move
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    assert state["1.num_batches_tracked"].dtype == torch.int64
    return Everything(
        protos=torch.randn(3, 4),
        known=torch.tensor([True, False, True]),
        counts=torch.tensor([5, 0, 7], dtype=torch.int64),
        half=torch.tensor([0.5, -1.0], dtype=torch.float16),
        pixels=torch.tensor([[0, 255], [7, 9]], dtype=torch.uint8),
        state=state,
        steps=3,
        lr=0.125,
        flag=True,
        note="héllo",
    )


def test_dtypes_scalars_and_batchnorm_buffers_round_trip():
    p = everything()
    back = roundtrip(p)
    assert back.known.dtype == torch.bool and back.counts.dtype == torch.int64
    assert back.state["1.running_var"].shape == (2,)
    assert (back.steps, back.lr, back.flag, back.note) == (3, 0.125, True, "héllo")
    assert wire_size(payload_to_records(p)) > sum(t.numel() for t in p.flatten()[0].values())


def npy(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def tampered(change) -> RecordDict:
    content = payload_to_records(everything())
    change(content)
    return content


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda c: c[ARRAYS].__setitem__("protos", Array(np.full((3, 4), np.nan, np.float32))),
            "NaN",
        ),
        (lambda c: c[ARRAYS].__setitem__("half", Array(np.array([np.inf, 1], np.float16))), "NaN"),
        (lambda c: c[ARRAYS].__setitem__("bogus", Array(np.zeros(2, np.float32))), "unexpected"),
        (lambda c: c[ARRAYS].__delitem__("counts"), "missing"),
        (lambda c: c[SCALARS].__setitem__("steps", "3"), "is not int"),
        (lambda c: c[SCALARS].__setitem__("lr", float("nan")), "not finite"),
        (lambda c: c[SCALARS].__setitem__("extra", 1), "unexpected scalar"),
        (
            lambda c: c[ARRAYS].__setitem__(
                "counts", Array("float32", (3,), "numpy.ndarray", npy(np.arange(3)))
            ),
            "declares",
        ),
        (
            lambda c: c[ARRAYS].__setitem__(
                "counts", Array("int64", (3,), "torch.raw", b"\0" * 24)
            ),
            "serialization type",
        ),
        (
            lambda c: c[ARRAYS].__setitem__("protos", Array(np.zeros((3, 4), np.complex64))),
            "dtype",
        ),
        (  # a pickled object array is refused: numpy.load runs with allow_pickle=False
            lambda c: c[ARRAYS].__setitem__(
                "protos",
                Array("float32", (1,), "numpy.ndarray", npy(np.array([{}], object), True)),
            ),
            "not a valid array",
        ),
        (lambda c: c.__delitem__(SCALARS), "missing the"),
        (lambda c: c.__setitem__(ARRAYS, ConfigRecord({"x": 1})), "missing the"),
    ],
)
def test_malformed_records_are_rejected(change, match):
    with pytest.raises(PayloadError, match=match):
        records_to_payload(Everything, tampered(change))


def test_byte_cap_is_checked_before_parsing():
    p = everything()
    content = payload_to_records(p)
    with pytest.raises(PayloadError, match="exceeds the cap"):
        records_to_payload(Everything, content, max_bytes=100)
    assert payload_equal(records_to_payload(Everything, content, 1 << 20), p)


def test_unsupported_dtype_refused_on_encode():
    with pytest.raises(PayloadError, match="bfloat16"):
        tensors_to_record({"x": torch.zeros(2, dtype=torch.bfloat16)})


def test_eval_counts_and_phases():
    counts = {"test": {"n": 10, "acc": 7}, "val": {"n": 3, "acc": 3}}
    assert m.parse_counts(m.counts_record(counts), ("test", "val"), 100) == counts
    for bad in ({"test": {"n": 2, "acc": 3}}, {"train": {"n": 2}}, {"test": {"acc": 1}}):
        with pytest.raises(PayloadError):
            m.parse_counts(m.counts_record(bad), ("test", "val"), 100)
    # eval.membership's attack counts travel with them, checked as a real client's could be
    attack = {**counts, "mia_pairs": {"n": 60, "auc": 41}, "mia_members": {"n": 10, "tpr": 2}}
    assert m.parse_counts(m.counts_record(attack), ("test", "val"), 100) == attack
    forged = {**attack, "mia_pairs": {"n": 60, "auc": 61}}
    with pytest.raises(PayloadError, match="membership attack: more wins"):
        m.parse_counts(m.counts_record(forged), ("test", "val"), 100)
    # a fit reply's attack on its upload: only the two groups, at the client's split sizes
    upload = {"mia_pairs": {"n": 60, "auc": 41}, "mia_members": {"n": 10, "tpr": 2}}
    assert m.parse_attack(m.counts_record(upload), 10, 3) == upload
    with pytest.raises(PayloadError, match="mia_pairs claims 60; it has 72"):
        m.parse_attack(m.counts_record(upload), 12, 3)
    with pytest.raises(PayloadError, match="unexpected count 'test/n'"):
        m.parse_attack(m.counts_record({**upload, "test": {"n": 3, "acc": 1}}), 10, 3)
    with pytest.raises(PayloadError, match="only one of"):
        m.parse_attack(m.counts_record({"mia_pairs": upload["mia_pairs"]}), 10, 3)
    phases = (Phase(("encoder.conv1", "head"), 2, False, "finetune"), Phase())
    assert m.phases_from_json(m.phases_to_json(phases)) == phases
    with pytest.raises(PayloadError):
        m.phases_from_json('[{"epochs": 1}]')
