"""The server's guard over one upload, applied by the round loop from the upload's declarations.

An upload type declares each field's schema and what the field *is* to the server
(``core/schema.py``: :class:`~fedmosaic.core.schema.Update`, ``Rows``, ``Claims``, ``Counts``,
``Whole``, ``Unguarded``); a method binds the names those declarations use from its server state
(``Algorithm.upload_names``). :func:`check_upload` is then the one check every upload of every
method goes through, on every runtime (the round loop calls it for the simulator, the process
backend and Flower alike):

1. the schema (shapes, dtypes, finiteness, ranges; ``schema.check``);
2. claims against the partition where the server knows it (``Claims``, ``Counts``);
3. magnitude sanity against what the server holds (``Update``: the update norm within
   ``server.max_norm_ratio`` x the reference's norm; ``Rows`` with a reference: each row within
   that ratio x the largest global row norm);
4. what the round's peer guard needs (``Update``: the update norm; ``Rows``/``Whole``: the rows),
   kept on the round's view; the round loop screens the round's uploads together afterwards
   (``robust.peer_screen``).

A method therefore never calls the guard: it declares. Outside the round loop (a unit test calling
``Algorithm.validate_upload``) steps 1-3 apply under the default rule and nothing is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from fedmosaic.core import robust, schema
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.schema import Claims, Counts, Rows, Unguarded, Update, Whole


def check_upload(upload: Payload, client_id: int, names: Mapping[str, Any]) -> None:
    """Raise ``PayloadError`` for an upload its declarations refuse (see the module docstring);
    otherwise record what the round's peer guard needs. ``names``: the method's bindings.
    Under the local privacy mechanism (the server view's ``private_noise``) the protocol fixed
    the class set (every class claimed, counts one: ``core/privacy.py``), so the claims say
    nothing to check against the partition."""
    schema.check(upload, client_id, **names)
    env = {**schema.BUILTINS, **names}
    roles = list(schema.roles_of(type(upload)).items())
    if robust.current().private_noise is not None:
        roles = [(f, r) for f, r in roles if not isinstance(r, (Claims, Counts))]
    # The claims first (cheap, and a refused upload keeps nothing for the peer guard).
    ordered = sorted(roles, key=lambda fr: not isinstance(fr[1], (Claims, Counts)))
    try:
        for field, role in ordered:
            _apply(upload, field, role, env, client_id)
    except PayloadError:
        robust.forget(client_id)
        raise


def _apply(upload: Payload, field: str, role: Any, env: Mapping[str, Any], cid: int) -> None:
    if role is None or isinstance(role, Unguarded):
        return
    value = getattr(upload, field)
    where = f"{type(upload).__qualname__}.{field}"
    if isinstance(role, Update):
        _update(value, role, env, cid, where)
    elif isinstance(role, Rows):
        _rows(upload, value, role, env, cid, where, field)
    elif isinstance(role, Claims):
        _claims(value, cid, where)
    elif isinstance(role, Counts):
        robust.check_class_counts(value, cid, where)
    elif isinstance(role, Whole):
        robust.note_rows(value.detach().reshape(1, -1), None, cid, field)
    else:  # pragma: no cover - ROLES and this dispatch are edited together
        raise schema.SchemaError(f"{where}: unknown guard role {role!r}")


def _bound(env: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in env:
        raise schema.SchemaError(f"{where}: the guard role names {name!r}, which was not bound")
    return env[name]


def _as_state(x: Any) -> dict[str, Tensor]:
    return {"": x} if isinstance(x, Tensor) else dict(x)


def _update(value: Any, role: Update, env: Mapping[str, Any], cid: int, where: str) -> None:
    if role.decode:
        decode: Callable[[Any], Any] = _bound(env, role.decode, where)
        value = decode(value)
    state = _as_state(value)
    ref = _as_state(_bound(env, role.ref, where))
    scale = _as_state(_bound(env, role.scale, where)) if role.scale else ref
    robust.check_update(state, ref, cid, where, scale)


def _rows(
    upload: Payload,
    value: Tensor,
    role: Rows,
    env: Mapping[str, Any],
    cid: int,
    where: str,
    field: str,
) -> None:
    if role.classes:
        classes = getattr(upload, role.classes)  # [k] int64, the schema checked its range
        rows = value
    else:
        mask = getattr(upload, role.where) != 0  # [C]: bool, or counts
        classes = mask.nonzero().flatten()
        rows = value[mask]
    if role.features:
        _nonnegative(rows, classes, cid, where)
    if role.ref:
        ref, known = _bound(env, role.ref, where), _bound(env, role.known, where)
        robust.check_rows(rows, classes, ref, known, cid, where, field)
    else:
        robust.note_rows(rows, classes, cid, field)


def _nonnegative(rows: Tensor, classes: Tensor, cid: int, where: str) -> None:
    """Class means of features that are >= 0 by construction (every client's encoder ends in a
    ReLU) are >= 0: a negative entry is no client's honest upload (a sign-flipped or negated
    row). Not under the local privacy mechanism (its noise is signed) nor for a secure round's
    rebuilt sum (``cid < 0``: no one client's upload)."""
    view = robust.current()
    if not view.nonnegative_features or view.private_noise is not None or cid < 0:
        return
    if rows.numel() == 0:
        return
    low = rows.detach().amin(dim=1)  # [k]
    bad = (low < 0).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise PayloadError(
            f"client {cid} {where}: its class {int(classes[i])} row has a negative entry "
            f"({float(low[i]):.3g}), but every client's features are >= 0 here (each encoder "
            "ends in a ReLU), so no class mean of them is"
        )


def _claims(value: Tensor, cid: int, where: str) -> None:
    if value.dtype == torch.bool:
        present = value
    else:  # class ids: as a mask over the classes the server knows of
        held = robust.current().held(cid)
        if held is None:
            return
        present = torch.zeros(held.numel(), dtype=torch.bool)
        ids = value[(value >= 0) & (value < held.numel())]
        present[ids] = True
        if ids.numel() < value.numel():
            raise PayloadError(f"client {cid} {where}: claims classes outside [0, {held.numel()})")
    robust.check_claimed_classes(present, cid, where)
