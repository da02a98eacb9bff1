"""Declared payload schemas and the one validator that checks an upload against them.

A payload field says what it holds in its annotation, ``typing.Annotated`` with a short string::

    protos: Annotated[Tensor, "[k, d] float32"]
    classes: Annotated[Tensor, "[k] int64 increasing in [0, C)"]
    counts: Annotated[Tensor, "[C] int64 >= 0 sum <= 1e9"]
    state: Annotated[dict[str, Tensor], "like shared"]
    num_active: Annotated[int, "int in [1, B]"]

Forms:

- ``[DIMS] DTYPE CONSTRAINTS``: a tensor. A dim is an integer or a name; ``DTYPE`` a torch dtype
  name (``float32``, ``int64``, ``bool``, ...). Floating tensors must be finite.
- ``like NAME``: a tensor or a state dict with exactly the names, dtypes and shapes of the
  reference bound to ``NAME`` (floating entries finite); a reference may instead be a function
  ``(value, where) -> None`` that checks a relation no string spells (FedKD's SVD factors).
- ``int|float|bool|str CONSTRAINTS``: a scalar (floats finite).

Constraints, on every element (or the scalar): ``>= X``, ``> X``, ``<= X``, ``< X``,
``in [A, B]`` (either bracket may be open: ``in [0, C)``); on the whole tensor: ``sum <= X``
(in float64: no integer wrap-around), ``rows sum X`` (the last dim sums to X within 1e-3),
``increasing`` (1-D, strictly), ``symmetric`` (a square matrix equal to its transpose within
1e-4 of its largest entry), ``diag >= X``. Operands are numbers or names (``MAX_EXAMPLES`` is built in).

Names are bound by the caller (:func:`check`'s keywords: what the method's server state says the
spec's ``C``, ``d``, ... are, and the references for ``like``); a dim name the caller leaves
unbound is a free dimension, fixed by its first occurrence (``k`` rows of ``protos`` and ``k``
class ids). Scalar fields are checked first, so a reference may depend on them (FedSeq's blocks).
Every failure is a :class:`PayloadError` naming the client, the payload type and the field.

A field may also declare what it *is* to the server's guard, a second annotation beside the
string (:class:`Update`, :class:`Rows`, :class:`Claims`, :class:`Counts`, :class:`Whole`, or
:class:`Unguarded` with the reason)::

    state: Annotated[dict[str, Tensor], "like shared", Update("shared")]
    protos: Annotated[Tensor, "[k, d] float32", Rows(classes="classes", ref="glob", known="known")]

The round loop applies what the roles say to every upload (``core/guard.py``): magnitude sanity
against the server's reference, the claims against the partition and the peer guard. Every
floating field of an upload carries a role (``tests/core/test_guard.py``), so a method cannot
forget its protection; a role's names are bound like the schema's.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedmosaic.core.payload import Payload, PayloadError

Bound = int | float | Tensor | Mapping[str, Tensor] | Callable[[Any, str], None]

MAX_EXAMPLES = 10**9  # more examples than this is not a real client (``rounds`` refuses it too)
# Names every schema may use without the caller binding them.
BUILTINS: dict[str, Any] = {"MAX_EXAMPLES": MAX_EXAMPLES}

_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}
_OPS: dict[str, Callable[[Any, Any], Any]] = {
    ">=": lambda x, v: x >= v,
    ">": lambda x, v: x > v,
    "<=": lambda x, v: x <= v,
    "<": lambda x, v: x < v,
}
_RANGE = {"[": ">=", "(": ">", "]": "<=", ")": "<"}  # an ``in`` range's brackets
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_OPERAND = rf"(?:{_NAME}|[-+]?[0-9.]+(?:e[-+]?[0-9]+)?)"
_CONSTRAINT = re.compile(
    rf"\s*(?:(?P<inc>increasing)|(?P<sym>symmetric)"
    rf"|diag\s*>=\s*(?P<diag>{_OPERAND})"
    rf"|in\s*(?P<lo_br>[\[(])\s*(?P<lo>{_OPERAND})\s*,\s*(?P<hi>{_OPERAND})\s*(?P<hi_br>[\])])"
    rf"|rows\s+sum\s+(?P<rows>{_OPERAND})"
    rf"|sum\s*<=\s*(?P<sum>{_OPERAND})"
    rf"|(?P<op>>=|<=|>|<)\s*(?P<val>{_OPERAND}))"
)


class SchemaError(TypeError):
    """A malformed schema declaration (a programming error, not a hostile upload)."""


# ---- what a field is to the server's guard (core/guard.py applies them) ----------------------
@dataclass(frozen=True)
class Update:
    """Weight-like: a state dict (or tensor) that updates the server's ``ref`` (a bound name).

    Its update norm ``||value - ref||`` is checked against ``server.max_norm_ratio`` x
    ``||scale||`` (``scale`` defaults to ``ref``) and enters the peer guard's norm test. ``decode``
    names a bound function giving the dense state dict of a compressed value (FedKD's SVD
    factors). A ``ref`` entry the value lacks is skipped; one of another shape counts as 0."""

    ref: str
    scale: str = ""
    decode: str = ""


@dataclass(frozen=True)
class Rows:
    """Per-class vectors: row ``i`` belongs to class ``classes[i]`` (an int64 index field), or
    the rows ``where`` a ``[C]`` field (bool, or counts) is nonzero belong to their classes.

    Each row enters the peer guard against the other clients' rows of its class; with ``ref``
    (bound ``[C, d]`` global rows) and ``known`` (bound ``[C]`` bool), a row of a class the server
    has a global row for is also bounded by ``server.max_norm_ratio`` x the largest global norm.
    ``features``: the rows are class means of the client's features, so where every client's
    features are >= 0 (``FederationSpec.nonnegative_features``) a negative entry is refused."""

    classes: str = ""
    where: str = ""
    ref: str = ""
    known: str = ""
    features: bool = False

    def __post_init__(self) -> None:
        if bool(self.classes) == bool(self.where):
            raise SchemaError("Rows: name exactly one of classes= (indices) or where= (a mask)")
        if bool(self.ref) != bool(self.known):
            raise SchemaError("Rows: ref= and known= go together")


@dataclass(frozen=True)
class Claims:
    """The classes a client says it holds (``[k]`` int64 ids, or a ``[C]`` bool mask): each
    must be held by the client's partition, where the server knows it."""


@dataclass(frozen=True)
class Counts:
    """Per-class example counts (``[C]`` int64): none above the client's partition (per class
    where the server knows it, else in total)."""


@dataclass(frozen=True)
class Whole:
    """One vector compared as a whole with the other clients' values of this field (a kernel
    matrix, soft labels on public data): the peer guard's row test with the round's uploads as
    one class. Only for values whose honest scale is the same for every client (probabilities):
    FedHeNN's kernel matrices, whose scale follows each model's width, are bounded by their
    schema."""


@dataclass(frozen=True)
class Unguarded:
    """No guard applies; ``reason`` says why (e.g. an integer cost the server only reports)."""

    reason: str


Role = Update | Rows | Claims | Counts | Whole | Unguarded
ROLES = (Update, Rows, Claims, Counts, Whole, Unguarded)


@dataclass(frozen=True)
class FieldSchema:
    """One field's parsed declaration."""

    text: str
    kind: str  # tensor | like | scalar
    dims: tuple[int | str, ...] = ()
    dtype: torch.dtype | None = None
    scalar: type | None = None
    ref: str = ""
    # (op, operand), op: one of _OPS, a range bracket (_RANGE), "sum<=", "rows" or "increasing"
    constraints: tuple[tuple[str, int | float | str], ...] = ()

    def names(self) -> set[str]:
        """Every name the declaration uses (dims, operands, the reference)."""
        out = {d for d in self.dims if isinstance(d, str)}
        out |= {v for _, v in self.constraints if isinstance(v, str)}
        return out | ({self.ref} if self.ref else set())


def _operand(tok: str) -> int | float | str:
    if re.fullmatch(_NAME, tok):
        return tok
    num = float(tok)
    return int(num) if num.is_integer() and "e" not in tok and "." not in tok else num


def _constraints(text: str, rest: str) -> tuple[tuple[str, int | float | str], ...]:
    out: list[tuple[str, int | float | str]] = []
    pos = 0
    while rest[pos:].strip():
        m = _CONSTRAINT.match(rest, pos)
        if m is None:
            raise SchemaError(f"schema {text!r}: cannot parse {rest[pos:].strip()!r}")
        pos = m.end()
        if m["inc"]:
            out.append(("increasing", 0))
        elif m["sym"]:
            out.append(("symmetric", 0))
        elif m["diag"]:
            out.append(("diag>=", _operand(m["diag"])))
        elif m["lo"]:
            out.append((m["lo_br"], _operand(m["lo"])))  # "[" or "(": the range's lower end
            out.append((m["hi_br"], _operand(m["hi"])))  # "]" or ")": its upper end
        elif m["rows"]:
            out.append(("rows", _operand(m["rows"])))
        elif m["sum"]:
            out.append(("sum<=", _operand(m["sum"])))
        else:
            out.append((m["op"], _operand(m["val"])))
    return tuple(out)


def parse(text: str) -> FieldSchema:
    """Parse one field's declaration; a malformed one raises :class:`SchemaError`."""
    s = text.strip()
    if m := re.fullmatch(rf"like\s+({_NAME})", s):
        return FieldSchema(text, "like", ref=m[1])
    if m := re.fullmatch(r"\[([^\]]*)\]\s*(\w+)(.*)", s, re.DOTALL):
        dims: list[int | str] = []
        for tok in (t.strip() for t in m[1].split(",")) if m[1].strip() else ():
            if re.fullmatch(r"[0-9]+", tok):
                dims.append(int(tok))
            elif re.fullmatch(_NAME, tok):
                dims.append(tok)
            else:
                raise SchemaError(f"schema {text!r}: bad dimension {tok!r}")
        dtype = getattr(torch, m[2], None)
        if not isinstance(dtype, torch.dtype):
            raise SchemaError(f"schema {text!r}: {m[2]!r} is not a torch dtype")
        return FieldSchema(text, "tensor", tuple(dims), dtype, constraints=_constraints(text, m[3]))
    if m := re.fullmatch(r"(int|float|bool|str)\b(.*)", s, re.DOTALL):
        return FieldSchema(
            text, "scalar", scalar=_SCALARS[m[1]], constraints=_constraints(text, m[2])
        )
    raise SchemaError(f"schema {text!r}: expected '[dims] dtype ...', 'like NAME' or a scalar type")


def _annotations(cls: type[Payload]) -> dict[str, tuple[Any, ...]]:
    """Each field's ``Annotated`` metadata, in field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: getattr(hints[f.name], "__metadata__", ()) for f in dataclasses.fields(cls)}


def schema_of(cls: type[Payload]) -> dict[str, FieldSchema]:
    """Every field's declaration, in field order (cached per class); a field without one, or a
    declaration that does not parse, raises :class:`SchemaError`."""
    cache = cls.__dict__.get("_schema_cache")
    if cache is None:
        cache = {}
        for name, meta in _annotations(cls).items():
            texts = [a for a in meta if isinstance(a, str)]
            if len(texts) != 1:
                raise SchemaError(
                    f"{cls.__qualname__}.{name}: declare its schema as Annotated[type, '...']"
                )
            cache[name] = parse(texts[0])
        cls._schema_cache = cache  # type: ignore[attr-defined]
    return cache


def roles_of(cls: type[Payload]) -> dict[str, Role | None]:
    """Each field's guard role (None: not declared), in field order (cached per class); more
    than one role on a field raises :class:`SchemaError`."""
    cache = cls.__dict__.get("_roles_cache")
    if cache is None:
        cache = {}
        fields = _annotations(cls)
        for name, meta in fields.items():
            roles = [a for a in meta if isinstance(a, ROLES)]
            if len(roles) > 1:
                raise SchemaError(f"{cls.__qualname__}.{name}: more than one guard role")
            role = roles[0] if roles else None
            # a Rows role's classes come from another field of the same upload
            other = role.classes or role.where if isinstance(role, Rows) else ""
            if other and other not in fields:
                raise SchemaError(f"{cls.__qualname__}.{name}: Rows names no field {other!r}")
            cache[name] = role
        cls._roles_cache = cache  # type: ignore[attr-defined]
    return cache


def _value(v: int | float | str, env: Mapping[str, Any], where: str) -> int | float:
    if isinstance(v, str):
        if v not in env:
            raise SchemaError(f"{where}: the schema names {v!r}, which the caller did not bind")
        return env[v]
    return v


def _dims_text(dims: tuple[int | str, ...], env: Mapping[str, Any]) -> str:
    parts = [f"{d}={env[d]}" if isinstance(d, str) and d in env else str(d) for d in dims]
    return "[" + ", ".join(parts) + "]"


def _describe(x: Tensor) -> str:
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"


def _check_tensor(fs: FieldSchema, x: Any, env: dict[str, Any], where: str) -> None:
    if not isinstance(x, Tensor):
        raise PayloadError(f"{where} is {type(x).__name__}, expected a tensor")

    def wrong() -> PayloadError:
        expected = f"{str(fs.dtype).removeprefix('torch.')}{_dims_text(fs.dims, env)}"
        return PayloadError(f"{where} is {_describe(x)}, expected {expected}")

    if x.dtype != fs.dtype or x.dim() != len(fs.dims):
        raise wrong()
    for i, d in enumerate(fs.dims):
        want = env.get(d) if isinstance(d, str) else d
        if want is None and isinstance(d, str):
            env[d] = int(x.shape[i])  # a free dimension: fixed by its first occurrence
        elif int(x.shape[i]) != want:
            raise wrong()
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise PayloadError(f"{where} has NaN or Inf values")
    _check_constraints(fs, x, env, where)


def _check_scalar(fs: FieldSchema, x: Any, env: dict[str, Any], where: str) -> None:
    tp = fs.scalar
    assert tp is not None  # a scalar declaration names its type (parse)
    ok = isinstance(x, tp) and not (tp in (int, float) and isinstance(x, bool))
    if tp is float and isinstance(x, int) and not isinstance(x, bool):
        ok = True
    if not ok:
        raise PayloadError(f"{where} = {x!r} is not {tp.__name__}")
    if isinstance(x, float) and not math.isfinite(x):
        raise PayloadError(f"{where} = {x!r} is not finite")
    _check_constraints(fs, x, env, where)


def _check_constraints(fs: FieldSchema, x: Any, env: dict[str, Any], where: str) -> None:
    cons = fs.constraints
    for i, (op, raw) in enumerate(cons):
        v = _value(raw, env, where)
        if op in _OPS:
            if not bool(torch.as_tensor(_OPS[op](x, v)).all()):
                raise PayloadError(f"{where} has values not {op} {v}")
        elif op in _RANGE:
            if op in "[(":
                continue  # checked with its upper end, the next constraint
            lo_br, lo = cons[i - 1][0], _value(cons[i - 1][1], env, where)
            inside = _OPS[_RANGE[lo_br]](x, lo) & _OPS[_RANGE[op]](x, v)
            if not bool(torch.as_tensor(inside).all()):
                raise PayloadError(f"{where} has values outside {lo_br}{lo}, {v}{op}")
        elif op == "sum<=":
            total = float(x.double().sum()) if isinstance(x, Tensor) else float(x)
            if not total <= v:
                raise PayloadError(f"{where} sums to {total:.6g}, more than {v}")
        elif op == "rows":
            sums = x.double().sum(-1)
            if not bool(((sums - v).abs() <= 1e-3 + 1e-5 * abs(v)).all()):  # as allclose
                raise PayloadError(f"{where} rows do not sum to {v}")
        elif op == "increasing":
            if x.dim() != 1 or not bool((x.diff() > 0).all()):
                raise PayloadError(f"{where} is not strictly increasing")
        elif op == "symmetric":  # within float32 rounding of the larger entries
            tol = 1e-4 * float(x.abs().max()) if x.numel() else 0.0
            if x.dim() != 2 or x.shape[0] != x.shape[1] or not bool(((x - x.T).abs() <= tol).all()):
                raise PayloadError(f"{where} is not a symmetric matrix")
        elif op == "diag>=":
            if x.dim() != 2 or not bool((x.diagonal() >= v).all()):
                raise PayloadError(f"{where} has diagonal values not >= {v}")


def _check_finite(value: Any, where: str) -> None:
    items = value.items() if isinstance(value, Mapping) else [("", value)]
    for k, x in items:
        if isinstance(x, Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise PayloadError(f"{where} {k}".rstrip() + " has NaN or Inf values")


def check_like(value: Any, ref: Any, where: str) -> None:
    """``value`` has exactly the names, dtypes and shapes of ``ref`` (a tensor or a state dict),
    and its floating entries are finite."""
    if isinstance(ref, Tensor):
        if not isinstance(value, Tensor):
            raise PayloadError(f"{where} is {type(value).__name__}, expected a tensor")
        value, ref, prefix = {"": value}, {"": ref}, ""
    else:
        if not isinstance(value, Mapping):
            raise PayloadError(f"{where} is {type(value).__name__}, expected a state dict")
        prefix = " "
    if value.keys() != ref.keys():
        extra = sorted(set(value) - set(ref))[:5]
        missing = sorted(set(ref) - set(value))[:5]
        raise PayloadError(f"{where}: unexpected tensors {extra}, missing {missing}")
    for k, t in ref.items():
        x = value[k]
        name = f"{where}{prefix}{k}".rstrip()
        if not isinstance(x, Tensor):
            raise PayloadError(f"{name} is {type(x).__name__}, expected a tensor")
        if x.dtype != t.dtype or x.shape != t.shape:
            raise PayloadError(f"{name} is {_describe(x)}, expected {_describe(t)}")
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise PayloadError(f"{name} has NaN or Inf values")


def check(payload: Payload, client_id: int, **bound: Bound) -> None:
    """Check ``payload`` against its type's declared schema; raise :class:`PayloadError` naming
    the client, the type and the field. ``bound``: the values of the schema's names (dims,
    bounds, ``like`` references); unbound dim names are free."""
    cls = type(payload)
    fields = schema_of(cls)
    env: dict[str, Any] = {**BUILTINS, **bound}
    label = f"client {client_id} {cls.__qualname__}"
    # Scalars first: cheap, and a reference may depend on them (``bound`` callables read them).
    for name in sorted(fields, key=lambda n: fields[n].kind != "scalar"):
        fs = fields[name]
        where = f"{label}.{name}"
        value = getattr(payload, name)
        if fs.kind == "scalar":
            _check_scalar(fs, value, env, where)
        elif fs.kind == "tensor":
            _check_tensor(fs, value, env, where)
        else:
            if fs.ref not in env:
                raise SchemaError(f"{where}: the schema names {fs.ref!r}, which was not bound")
            ref = env[fs.ref]
            if callable(ref):
                ref(value, where)
                _check_finite(value, where)
            else:
                check_like(value, ref, where)
