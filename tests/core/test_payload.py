import dataclasses

import pytest
import torch
from torch import Tensor, nn

from fedmosaic.core.payload import (
    Empty,
    Payload,
    PayloadError,
    check_like,
    decode,
    encode,
    encoded_size,
    payload_equal,
)


@dataclasses.dataclass(frozen=True)
class Protos(Payload):
    protos: Tensor
    known: Tensor
    counts: Tensor
    state: dict[str, Tensor]
    round_num: int
    eta: float
    order: str
    flag: bool


def make() -> Protos:
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)).state_dict()
    return Protos(
        protos=torch.randn(3, 4),
        known=torch.tensor([True, False, True]),
        counts=torch.tensor([5, 0, 7]),
        state=bn,
        round_num=3,
        eta=0.5,
        order="anti",
        flag=True,
    )


def test_round_trip_keeps_names_dtypes_values():
    p = make()
    back = decode(Protos, encode(p))
    assert payload_equal(p, back)
    assert back.known.dtype == torch.bool and back.counts.dtype == torch.int64
    assert back.state["1.num_batches_tracked"].dtype == torch.int64
    assert (back.round_num, back.eta, back.order, back.flag) == (3, 0.5, "anti", True)


def test_bytes_grow_with_content():
    small = Protos(**{**dataclasses.asdict(make()), "protos": torch.zeros(1, 4)})
    assert len(encode(make())) > len(encode(small))
    assert len(encode(Empty())) < 100


def test_encoded_size_is_the_encoded_length():
    """The simulator's per-client byte counts come from ``encoded_size``: equal to the encoded
    length for new values (looked up), other shapes, dtypes and scalars (measured again)."""
    base = make()
    cases = [
        base,
        dataclasses.replace(base, protos=torch.randn(3, 4)),  # new values: the same size
        dataclasses.replace(base, protos=torch.randn(30, 4)),  # a longer offset
        dataclasses.replace(base, counts=torch.tensor([5, 0, 7], dtype=torch.int32)),
        dataclasses.replace(base, round_num=123456789, eta=1e-7, order="vanilla"),
        dataclasses.replace(base, state={}),
        Empty(),
    ]
    for p in cases:
        assert encoded_size(p) == len(encode(p))
    assert encoded_size(cases[0]) == encoded_size(cases[1])
    assert encoded_size(cases[2]) != encoded_size(cases[0])


def test_nan_rejected_with_name():
    p = dataclasses.replace(make(), protos=torch.tensor([[float("nan")] * 4] * 3))
    with pytest.raises(PayloadError, match="protos"):
        decode(Protos, encode(p))


def test_unknown_and_missing_fields_rejected():
    arrays, scalars = make().flatten()
    with pytest.raises(PayloadError, match="unexpected array 'bogus'"):
        Protos.unflatten({**arrays, "bogus": torch.zeros(1)}, scalars)
    del scalars["eta"]
    with pytest.raises(PayloadError, match="missing fields"):
        Protos.unflatten(arrays, scalars)


def test_wrong_scalar_type_rejected():
    arrays, scalars = make().flatten()
    with pytest.raises(PayloadError, match="round_num"):
        Protos.unflatten(arrays, {**scalars, "round_num": "three"})


def test_garbage_and_oversize_rejected():
    with pytest.raises(PayloadError, match="undecodable"):
        decode(Protos, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(PayloadError, match="exceeds the cap"):
        decode(Protos, encode(make()), max_bytes=10)


def test_check_like_names_shape_mismatch():
    p = make()
    q = dataclasses.replace(p, protos=torch.zeros(3, 5))
    with pytest.raises(PayloadError, match=r"protos is torch.float32\(3, 5\)"):
        check_like(q, p)
    check_like(p, p)
