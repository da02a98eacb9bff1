"""Client-level differential privacy of an upload, derived from its declarations.

What a field *is* to the server (its guard role, ``core/schema.py``) says how it is released
under ``[privacy]`` (:class:`~fedmosaic.core.checks.PrivacyRule`), so a method is covered by
declaring its upload; nothing here is method code:

- ``Update`` (weight-like state): the *update* ``value - ref`` is private; the client's ``ref``
  is what it received this round (its upload before training), the server's is the state it
  broadcast. Integer entries (BatchNorm's batch counters) are set to the reference's.
- ``Rows``, ``Whole``, ``Unguarded`` floats (prototypes, class-mean logits, soft labels, kernel
  matrices): the value itself is private.
- The class set is data too. The protocol fixes it: per-class rows are released for *every*
  class (a class the client does not hold sends a zero row before the noise), class-id fields
  become ``arange(C)``, presence masks all true and per-class counts all one (the server's
  class means become uniform means over the round's uploads).

The private floats of one upload are clipped to L2 norm ``clip`` *as one vector* and get
Gaussian noise of standard deviation ``sd`` per coordinate, drawn from the run's seeded streams
(``seeding.randn``: the same bits on every runtime and host). The result is then projected back
onto what the field's schema promises (``>= 0``, ``in [0, 1]``, ``rows sum 1``, ``symmetric``,
``diag >= 0``; rows that sum to 1 have no entry below ``PROBABILITY_FLOOR``; a state dict's
``running_var`` non-negative): post-processing, which costs no
privacy, so the server's guard sees a well-formed upload.

Local DP: each client releases with ``sd = noise_multiplier x clip`` before it sends. Central DP
(a trusted server, for methods whose server only averages, ``Algorithm.server_sums``): the
server releases each of the round's ``K`` uploads with ``sd / sqrt(K)``, so their sum carries
exactly the noise ``N(0, sd^2)`` of the clipped sum and the uniform mean its ``1/K``.
Scalars (costs, flags) are released as they are: they are not the data (docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedmosaic.core import schema, seeding
from fedmosaic.core.payload import Payload
from fedmosaic.core.schema import Claims, Counts, Rows, SchemaError, Update

PROBABILITY_FLOOR = 1e-6  # the smallest entry of a row projected to sum to its target, / target


class PrivacyError(ValueError):
    """An upload type the mechanism cannot make private (with the reason)."""


@dataclass(frozen=True)
class ReleasePlan:
    """How one upload type is released (read once per type from its declarations)."""

    updates: tuple[str, ...]  # Update fields: the update from the reference is private
    values: tuple[str, ...]  # float tensor fields whose value is private
    class_ids: tuple[tuple[str, str], ...]  # (rows field, its class-id field): densified
    masks: tuple[tuple[str, str], ...]  # (rows field, its mask/count field): absent rows zeroed
    fixed: tuple[str, ...]  # Claims / Counts fields the protocol fixes


def release_plan(cls: type[Payload]) -> ReleasePlan:
    """The release of ``cls`` from its schema and guard roles (cached per class)."""
    cached = cls.__dict__.get("_release_plan")
    if isinstance(cached, ReleasePlan):
        return cached
    fields, roles = schema.schema_of(cls), schema.roles_of(cls)
    updates, values, ids, masks, fixed = [], [], [], [], []
    for name, fs in fields.items():
        role = roles[name]
        where = f"{cls.__qualname__}.{name}"
        if isinstance(role, Update):
            if role.decode:
                raise PrivacyError(f"{where}: a compressed update ({role.decode}) has no release")
            updates.append(name)
        elif isinstance(role, (Claims, Counts)):
            fixed.append(name)
        elif fs.kind == "tensor" and fs.dtype is not None and fs.dtype.is_floating_point:
            values.append(name)
            if isinstance(role, Rows) and role.classes:
                ids.append((name, role.classes))
            elif isinstance(role, Rows):
                masks.append((name, role.where))
        elif fs.kind == "like":
            raise PrivacyError(f"{where}: a state dict that is not an Update has no release")
        elif fs.kind == "tensor":
            raise PrivacyError(f"{where}: an integer tensor without a Claims or Counts role")
    plan = ReleasePlan(tuple(updates), tuple(values), tuple(ids), tuple(masks), tuple(fixed))
    cls._release_plan = plan  # type: ignore[attr-defined]
    return plan


def check_releasable(cls: type[Payload], refusal: str = "") -> None:
    """Raise :class:`PrivacyError` when uploads of ``cls`` cannot be released (``refusal``: the
    method's own reason, ``Algorithm.privacy_refusal``)."""
    if refusal:
        raise PrivacyError(refusal)
    release_plan(cls)


def needs_reference(cls: type[Payload]) -> bool:
    """Whether a release of ``cls`` needs the reference its updates are taken from."""
    return bool(release_plan(cls).updates)


def server_refs(upload: Payload, names: Mapping[str, Any]) -> dict[str, Any]:
    """Each Update field's reference on the server: the value its role names in ``names`` (the
    method's ``upload_names``: what the server broadcast)."""
    roles = schema.roles_of(type(upload))
    out = {}
    for name in release_plan(type(upload)).updates:
        role = roles[name]
        assert isinstance(role, Update)  # release_plan put it there
        out[name] = names[role.ref]
    return out


def _as_state(x: Any) -> dict[str, Tensor]:
    return {"": x} if isinstance(x, Tensor) else dict(x)


def _back(like: Any, state: dict[str, Tensor]) -> Any:
    return state[""] if isinstance(like, Tensor) else state


def _protocol(upload: Payload, plan: ReleasePlan, num_classes: int) -> dict[str, Any]:
    """The upload's fields with the class set fixed (every class released, counts one)."""
    out = {f.name: getattr(upload, f.name) for f in dataclasses.fields(upload)}
    for rows_name, ids_name in plan.class_ids:  # [k, ...] rows of classes ids[k] -> [C, ...]
        rows, ids = out[rows_name], out[ids_name]
        dense = rows.new_zeros((num_classes, *rows.shape[1:]))
        dense[ids] = rows
        out[rows_name] = dense
        out[ids_name] = torch.arange(num_classes, dtype=ids.dtype)
    for rows_name, mask_name in plan.masks:  # rows of classes the client lacks sent as zeros
        present = out[mask_name] != 0  # [C]
        out[rows_name] = torch.where(
            present.view(-1, *[1] * (out[rows_name].dim() - 1)),
            out[rows_name],
            torch.zeros((), dtype=out[rows_name].dtype),
        )
    id_fields = {ids for _, ids in plan.class_ids}
    for name in plan.fixed:
        if name not in id_fields:  # bool masks all true, counts all one
            out[name] = torch.ones_like(out[name])
    return out


def release(
    upload: Payload,
    refs: Mapping[str, Any],
    clip: float,
    sd: float,
    generator: torch.Generator,
    num_classes: int,
) -> Payload:
    """``upload`` released: the class set fixed, the private floats clipped to ``clip`` as one
    vector, ``N(0, sd^2)`` added per coordinate, projected onto the schema. ``refs``: each
    Update field's reference (a state dict or tensor of the same names and shapes)."""
    plan = release_plan(type(upload))
    out = _protocol(upload, plan, num_classes)
    parts: list[tuple[str, str, Tensor]] = []  # (field, key, private float tensor)
    states: dict[str, dict[str, Tensor]] = {}
    for name in plan.updates:
        if name not in refs:
            raise SchemaError(f"{type(upload).__qualname__}.{name}: no reference for its update")
        value, ref_state = _as_state(out[name]), _as_state(refs[name])
        states[name] = {}
        for key, x in value.items():
            r = ref_state[key]
            if x.is_floating_point():
                parts.append((name, key, (x - r.to(x.device)).float()))
            else:  # a counter of the client's batches: the reference's (no information)
                states[name][key] = r.clone()
    for name in plan.values:
        parts.append((name, "", out[name].float()))
    norm = math.sqrt(sum(float(p.double().pow(2).sum()) for _, _, p in parts))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    for name, key, p in parts:
        noise = seeding.randn(p.numel(), generator=generator).view(p.shape) * sd
        private = p.cpu() * scale + noise
        if name in states:
            base = _as_state(refs[name])[key]
            like = _as_state(out[name])[key]
            states[name][key] = (base.cpu().float() + private).to(like.dtype)
        else:
            out[name] = private.to(out[name].dtype)
    for name, state in states.items():
        ordered = {k: state[k] for k in _as_state(out[name])}
        out[name] = _back(out[name], {k: _clean_state_entry(k, v) for k, v in ordered.items()})
    fields = schema.schema_of(type(upload))
    for name in plan.values:
        out[name] = project(out[name], fields[name])
    return type(upload)(**out)


def _clean_state_entry(key: str, x: Tensor) -> Tensor:
    # BatchNorm's running variance is a variance: negative after the noise, it would NaN the
    # normalization (post-processing: no privacy cost).
    return x.clamp_min(0) if key.endswith("running_var") else x


def project(x: Tensor, fs: schema.FieldSchema) -> Tensor:
    """``x`` moved onto what the numeric constraints of ``fs`` promise (post-processing)."""
    cons = dict(fs.constraints) if fs.constraints else {}
    ops = [op for op, _ in fs.constraints]
    if "symmetric" in ops and x.dim() == 2:
        x = (x + x.T) / 2
    for op, v in fs.constraints:
        if not isinstance(v, (int, float)):
            continue  # a bound name: the caller's, not a property of the value
        if op in (">=", ">", "[", "("):
            x = x.clamp_min(float(v))
        elif op in ("<=", "<", "]", ")"):
            x = x.clamp_max(float(v))
        elif op == "diag>=" and x.dim() == 2:
            d = x.diagonal().clamp_min(float(v))
            x = x.clone()
            x.diagonal().copy_(d)
    if "rows" in cons and isinstance(cons["rows"], (int, float)):
        target = float(cons["rows"])
        # Probabilities: kept off 0, since a server may take their log (KT-pFL's KL terms).
        x = x.clamp_min(PROBABILITY_FLOOR * target)
        sums = x.sum(-1, keepdim=True)
        uniform = torch.full_like(x, target / max(x.shape[-1], 1))
        x = torch.where(sums > 0, x / sums.clamp_min(1e-30) * target, uniform)
    return x


def local_generator(seed: int, round_num: int, client_id: int) -> torch.Generator:
    """The stream of a client's own noise in round ``round_num``."""
    return seeding.torch_generator(seed, round_num, client_id, "dp-local")


def central_generator(seed: int, round_num: int, client_id: int) -> torch.Generator:
    """The stream of the server's noise share on client ``client_id``'s upload."""
    return seeding.torch_generator(seed, round_num, client_id, "dp-central")
