"""Declared payload schemas (core/schema.py): the grammar, the one validator, and every registered
method's upload: a real one from a tiny run passes; one field of the wrong shape, the wrong dtype,
a NaN or missing is rejected with that field named."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any

import pytest
import torch
from helpers.experiments import tiny_raw
from torch import Tensor

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.config import from_dict
from fedmosaic.core import client as client_ops
from fedmosaic.core import robust, schema
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.rounds import MAX_EXAMPLES, run_rounds
from fedmosaic.federation import build_federation
from fedmosaic.sim.backend import make_transport


# ---- the grammar ---------------------------------------------------------------------------------
def test_parse_the_three_forms():
    t = schema.parse("[k, d, 3] float32 increasing in [0, C) >= 1 sum <= MAX_EXAMPLES rows sum 1")
    assert (t.kind, t.dims, t.dtype) == ("tensor", ("k", "d", 3), torch.float32)
    assert t.constraints == (
        ("increasing", 0),
        ("[", 0),
        (")", "C"),
        (">=", 1),
        ("sum<=", "MAX_EXAMPLES"),
        ("rows", 1),
    )
    assert t.names() == {"k", "d", "C", "MAX_EXAMPLES"}
    assert schema.parse("like shared") == schema.FieldSchema("like shared", "like", ref="shared")
    s = schema.parse("int in [1, B]")
    assert (s.kind, s.scalar, s.constraints) == ("scalar", int, (("[", 1), ("]", "B")))
    assert schema.parse("[] bool").dims == ()
    assert schema.parse("float <= 1e9").constraints == (("<=", 1e9),)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[C, d] float33", "not a torch dtype"),
        ("[C, 2x] float32", "bad dimension"),
        ("[C] int64 >= ", "cannot parse"),
        ("[C] int64 positive", "cannot parse"),
        ("like", "expected"),
        ("tensor of floats", "expected"),
    ],
)
def test_a_malformed_declaration_is_a_schema_error(text, problem):
    with pytest.raises(schema.SchemaError, match=problem):
        schema.parse(text)


@dataclass(frozen=True)
class Demo(Payload):
    rows: Annotated[Tensor, "[k, d] float32"]
    ids: Annotated[Tensor, "[k] int64 increasing in [0, C)"]
    counts: Annotated[Tensor, "[C] int64 >= 0 sum <= MAX_EXAMPLES"]
    probs: Annotated[Tensor, "[2, C] float32 in [0, 1] rows sum 1"]
    state: Annotated[dict[str, Tensor], "like ref"]
    steps: Annotated[int, "int in [1, B]"]
    rate: Annotated[float, "float > 0"]


REF = {"w": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.int64)}


def demo(**changes: Any) -> Demo:
    good = Demo(
        rows=torch.zeros(2, 4),
        ids=torch.tensor([0, 2]),
        counts=torch.tensor([1, 0, 5]),
        probs=torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]),
        state={k: v.clone() for k, v in REF.items()},
        steps=2,
        rate=0.5,
    )
    return dataclasses.replace(good, **changes)


def check(p: Demo) -> None:
    schema.check(p, 7, C=3, d=4, B=3, ref=REF)


def test_a_good_payload_passes_and_free_dims_take_their_first_value():
    check(demo())
    check(demo(rows=torch.zeros(0, 4), ids=torch.zeros(0, dtype=torch.int64)))  # k = 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rows": torch.zeros(2, 5)}, r"client 7 Demo\.rows is float32\[2, 5\], expected "
         r"float32\[k=2, d=4\]"),
        ({"rows": torch.zeros(2, 4, dtype=torch.float64)}, r"Demo\.rows is float64\[2, 4\]"),
        ({"rows": torch.zeros(8)}, r"Demo\.rows is float32\[8\], expected float32\[k, d=4\]"),
        ({"rows": torch.tensor([[0.0] * 4, [math.nan] * 4])}, r"Demo\.rows has NaN or Inf"),
        ({"rows": torch.full((2, 4), math.inf)}, r"Demo\.rows has NaN or Inf"),
        ({"rows": [[0.0] * 4] * 2}, r"Demo\.rows is list, expected a tensor"),
        ({"ids": torch.tensor([0, 1, 2])}, r"Demo\.ids is int64\[3\], expected int64\[k=2\]"),
        ({"ids": torch.tensor([2, 0])}, r"Demo\.ids is not strictly increasing"),
        ({"ids": torch.tensor([1, 1])}, r"Demo\.ids is not strictly increasing"),
        ({"ids": torch.tensor([0, 3])}, r"Demo\.ids has values outside \[0, 3\)"),
        ({"ids": torch.tensor([-1, 0])}, r"Demo\.ids has values outside \[0, 3\)"),
        ({"counts": torch.tensor([1, -1, 5])}, r"Demo\.counts has values not >= 0"),
        ({"counts": torch.tensor([2**62, 2**62, 2**62])}, r"Demo\.counts sums to .* more than"),
        ({"counts": torch.tensor([1.0, 0.0, 5.0])}, r"Demo\.counts is float32\[3\]"),
        ({"probs": torch.tensor([[0.5, 0.6, -0.1], [0.0, 0.0, 1.0]])}, r"outside \[0, 1\]"),
        ({"probs": torch.tensor([[0.5, 0.4, 0.0], [0.0, 0.0, 1.0]])}, r"rows do not sum to 1"),
        ({"state": {"w": torch.zeros(2, 3)}}, r"Demo\.state: unexpected tensors \[\], "
         r"missing \['n'\]"),
        ({"state": dict(REF, x=torch.zeros(1))}, r"Demo\.state: unexpected tensors \['x'\]"),
        ({"state": dict(REF, w=torch.zeros(3, 2))}, r"Demo\.state w is float32\[3, 2\], "
         r"expected float32\[2, 3\]"),
        ({"state": dict(REF, n=torch.zeros(()))}, r"Demo\.state n is float32\[\]"),
        ({"state": dict(REF, w=torch.full((2, 3), math.nan))}, r"Demo\.state w has NaN"),
        ({"state": torch.zeros(2, 3)}, r"Demo\.state is Tensor, expected a state dict"),
        ({"steps": 0}, r"Demo\.steps has values outside \[1, 3\]"),
        ({"steps": 4}, r"Demo\.steps has values outside \[1, 3\]"),
        ({"steps": 2.0}, r"Demo\.steps = 2\.0 is not int"),
        ({"steps": True}, r"Demo\.steps = True is not int"),
        ({"rate": math.nan}, r"Demo\.rate = nan is not finite"),
        ({"rate": 0.0}, r"Demo\.rate has values not > 0"),
        ({"rate": "fast"}, r"Demo\.rate = 'fast' is not float"),
    ],
)  # fmt: skip
def test_each_violation_is_named(changes, message):
    with pytest.raises(PayloadError, match=message):
        check(demo(**changes))


def test_a_callable_reference_checks_a_relation_and_finiteness_still_holds():
    seen = []

    def relation(value, where):
        seen.append(where)
        if "w" not in value:
            raise PayloadError(f"{where}: no w")

    up = demo(state={"w": torch.zeros(5), "extra": torch.zeros(1)})
    schema.check(up, 1, C=3, d=4, B=3, ref=relation)
    assert seen == ["client 1 Demo.state"]
    with pytest.raises(PayloadError, match="client 1 Demo.state: no w"):
        schema.check(demo(state={}), 1, C=3, d=4, B=3, ref=relation)
    with pytest.raises(PayloadError, match=r"Demo\.state w has NaN"):
        schema.check(demo(state={"w": torch.tensor([math.nan])}), 1, C=3, d=4, B=3, ref=relation)


def test_scalars_are_checked_first_and_unbound_names_are_programming_errors():
    order = []

    def relation(value, where):
        order.append("state")

    with pytest.raises(PayloadError, match="steps"):
        schema.check(demo(steps=9), 1, C=3, d=4, B=3, ref=relation)
    assert order == []  # the relation never saw an upload whose scalars were wrong
    with pytest.raises(schema.SchemaError, match="'C'"):
        schema.check(demo(), 1, d=4, B=3, ref=REF)  # C used in a constraint, never bound
    with pytest.raises(schema.SchemaError, match="'ref'"):
        schema.check(demo(), 1, C=3, d=4, B=3)


def test_builtin_bound_is_the_round_loops():
    assert schema.BUILTINS["MAX_EXAMPLES"] == MAX_EXAMPLES == 10**9


def test_a_field_without_a_declaration_is_refused():
    @dataclass(frozen=True)
    class Bare(Payload):
        x: Tensor

    with pytest.raises(schema.SchemaError, match=r"Bare\.x: declare its schema"):
        schema.schema_of(Bare)


# ---- every registered method ---------------------------------------------------------------------
def test_every_registered_upload_declares_a_schema_for_every_field():
    for name in ALGORITHMS.names():
        upload = ALGORITHMS.get(name).Upload
        fields = schema.schema_of(upload)  # raises for an undeclared or malformed field
        assert list(fields) == [f.name for f in dataclasses.fields(upload)], name


@cache
def real_upload(name: str) -> tuple[Any, Any, Payload, int, robust.ServerView]:
    """(algorithm, server state after round 1, client 0's upload of round 2, its id, the
    server's partition view) from a tiny run."""
    cls = ALGORITHMS.get(name)
    family = "htfe8-gray" if cls.supports_heterogeneous else "cnn1"
    raw = tiny_raw(
        model={"family": family},
        algorithm={"name": name},
        train={"rounds": 1, "local_epochs": 1},
        sim={"backend": "serial", "check_wire": True, "progress": False},
    )
    fed = build_federation(from_dict(raw))
    _, state = run_rounds(fed.algo, fed.spec, make_transport(fed), fed.plan)
    cid = 0
    msg = fed.algo.broadcast(state, cid, 2)
    out = client_ops.fit(
        fed.algo, fed.models[cid], fed.extras[cid], msg, fed.clients[cid], fed.settings, 0, 2, 1
    )
    view = robust.ServerView(fed.spec.robust, fed.spec.num_train, fed.spec.class_counts)
    return fed.algo, state, out.upload, cid, view


def _reshaped(x: Tensor) -> Tensor:
    """``x`` with its last dimension one longer (a 0-d tensor becomes 1-d)."""
    if x.dim() == 0:
        return x.reshape(1)
    return torch.cat([x, torch.zeros(*x.shape[:-1], 1, dtype=x.dtype)], -1)


def _retyped(x: Tensor) -> Tensor:
    if x.is_floating_point():
        return x.double()
    return x.to(torch.uint8) if x.dtype == torch.bool else x.to(torch.int32)


def _with_nan(x: Tensor) -> Tensor:
    y = x.flatten().clone()
    y[0] = math.nan
    return y.reshape(x.shape)


def _first(d: dict[str, Tensor], floating: bool = False) -> str:
    return next(k for k, v in d.items() if v.numel() and (v.is_floating_point() or not floating))


def _mutants(up: Payload, field: str) -> dict[str, Any]:
    """Per kind of damage, the field's damaged value (kinds that do not apply left out)."""
    value = getattr(up, field)
    out: dict[str, Any] = {}
    if isinstance(value, Tensor):
        out["shape"] = _reshaped(value)
        out["dtype"] = _retyped(value)
        if value.is_floating_point() and value.numel():
            out["nan"] = _with_nan(value)
    elif isinstance(value, dict):
        k = _first(value)
        out["shape"] = dict(value, **{k: _reshaped(value[k])})
        out["dtype"] = dict(value, **{k: _retyped(value[k])})
        kf = _first(value, floating=True)
        out["nan"] = dict(value, **{kf: _with_nan(value[kf])})
    elif isinstance(value, bool):
        out["dtype"] = int(value)
    elif isinstance(value, int):
        out["dtype"] = float(value) + 0.5
        out["nan"] = math.nan
    elif isinstance(value, float):
        out["dtype"] = str(value)
        out["nan"] = math.nan
    else:
        out["dtype"] = 1
    return out


def _named(field: str) -> re.Pattern[str]:
    # The validator says "Type.field"; the wire decoder's missing-field error "'field'".
    return re.compile(rf"\.{field}\b|'{field}'")


@pytest.mark.parametrize("name", ALGORITHMS.names())
@pytest.mark.integration
def test_a_real_upload_passes_its_schema_and_each_damaged_field_is_named(name):
    algo, state, up, cid, view = real_upload(name)
    fields = schema.schema_of(type(up))
    with robust.serving(view):  # the round loop's partition view: the real upload passes it too
        algo.validate_upload(state, up, cid)
    if not fields:
        pytest.skip(f"{name} uploads nothing ({type(up).__name__} has no fields)")
    checked = 0
    for field in fields:
        damaged = {k: dataclasses.replace(up, **{field: v}) for k, v in _mutants(up, field).items()}
        # Missing: the field's arrays/scalar absent from the neutral form a transport carries.
        arrays, scalars = up.flatten()
        arrays = {k: v for k, v in arrays.items() if k != field and not k.startswith(field + "/")}
        scalars = {k: v for k, v in scalars.items() if k != field}
        damaged["missing"] = lambda a=arrays, s=scalars: type(up).unflatten(a, s)
        for kind, bad in damaged.items():
            try:
                algo.validate_upload(state, bad() if callable(bad) else bad, cid)
            except PayloadError as exc:
                assert _named(field).search(str(exc)), (kind, str(exc))
            else:
                pytest.fail(f"{name}: {type(up).__name__}.{field} ({kind}) was accepted")
            checked += 1
    assert checked >= 2 * len(fields)
