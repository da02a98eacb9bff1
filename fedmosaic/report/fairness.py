"""Fair pairs: what makes two cells of a claim comparable (``report/claims.py`` judges them).

Both cells must come from the same suite definition and source code (``provenance``'s hash), the
same numerics, the plan's round budget, and agree on every ``data``, ``model``, ``train``,
``server`` and ``eval`` key and on the method's own hyperparameters, except what the suite
declares the paper prescribes per method; the clients' parameter counts are compared too (a
changed width or projection shows there). Each problem found is a line of text; none means fair.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fedmosaic.algorithms import ALGORITHMS  # importing the package registers every built-in
from fedmosaic.checkpoint import config_fingerprint, config_hash
from fedmosaic.config import ConfigError
from fedmosaic.models import build_client_model, family_members
from fedmosaic.report.plans import Comparison, Plan
from fedmosaic.report.suite import load_suite

# Config sections every pair must share key by key (unless the plan declares a difference);
# ``sim`` only for its numerics (backend, threads and workers give the same numbers).
PAIRED_SECTIONS = ("data", "model", "train", "server", "eval")


def _rounds_run(doc: dict[str, Any]) -> int | None:
    r = doc.get("summary", {}).get("rounds_run")
    return None if r is None else int(r)


_INPUT_SHAPES = {
    "fmnist": (1, 28, 28),
    "mnist": (1, 28, 28),
    "emnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "cifar100": (3, 32, 32),
    "tinyimagenet": (3, 64, 64),
}

_COUNTS: dict[str, tuple[int, ...] | None] = {}


def param_counts(doc: dict[str, Any]) -> tuple[int, ...] | None:
    """Client by client, the parameter count of the model a cell trained and evaluated, rebuilt
    from its stored config (None when the input shape is not known without the data)."""
    cfg = doc.get("config", {})
    data, model = cfg.get("data", {}), cfg.get("model", {})
    dataset = str(data.get("dataset", ""))
    shape = _INPUT_SHAPES.get(dataset.split("-")[0])
    if dataset == "synthetic":
        shape = tuple(data.get("synthetic_shape", (1, 28, 28)))
    clients = doc.get("clients", [])
    if shape is None or not clients:
        return None
    name = cfg.get("algorithm", {}).get("name")
    fixed = ALGORITHMS.get(name).model_projection if name in ALGORITHMS else None
    projection = fixed or model.get("projection", "linear")
    num_classes = len(clients[0]["train_label_counts"])
    key = json.dumps([model, projection, shape, num_classes, len(clients)], sort_keys=True)
    if key not in _COUNTS:
        out = []
        try:
            members = family_members(model["family"])
            with torch.device("meta"):  # shapes only: nothing allocated
                for cid in range(len(clients)):
                    m = build_client_model(
                        members[cid % len(members)],
                        shape,
                        num_classes,
                        int(model["feature_dim"]),
                        projection=projection,
                    )
                    out.append(sum(p.numel() for p in m.parameters()))
        except (KeyError, TypeError, ValueError) as exc:  # a damaged cell: name it, no traceback
            raise ValueError(
                f"a cell's stored model config {model!r} cannot be rebuilt ({exc!r})"
            ) from exc
        _COUNTS[key] = tuple(out)
    return _COUNTS[key]


def _algo_value(cfg: dict[str, Any], key: str) -> Any:
    algo = cfg.get("algorithm", {})
    name = algo.get("name")
    default = getattr(ALGORITHMS.get(name), key, None) if name in ALGORITHMS else None
    return algo.get(key, default)


def _cfg_value(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _code(doc: dict[str, Any]) -> str | None:
    code = doc.get("provenance", {}).get("code", {})
    return code.get("source_hash") if isinstance(code, dict) else None


def _numerics(doc: dict[str, Any]) -> str:
    """The cell's arithmetic: its config's ``sim.numerics`` (cells before the key: native)."""
    return str(doc.get("config", {}).get("sim", {}).get("numerics", "native"))


def _arithmetic(doc: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """What a portable cell's arithmetic still depends on: the CPU's vendor (MKL keeps its AVX2
    branch on Intel processors only), the branch MKL ran, as read back, and the CPU's
    instruction-set level (None: not recorded)."""
    prov = doc.get("provenance", {})
    host = prov.get("host", {}) if isinstance(prov, dict) else {}
    cpu_id = host.get("cpu_id", {}) if isinstance(host, dict) else {}
    num = prov.get("numerics", {}) if isinstance(prov, dict) else {}
    vendor = cpu_id.get("vendor_id") if isinstance(cpu_id, dict) else None
    mkl = num.get("mkl_branch") if isinstance(num, dict) else None
    level = num.get("host_level") if isinstance(num, dict) else None
    return vendor, (mkl.get("branch") if isinstance(mkl, dict) else None), level


def arithmetic_problems(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Two portable cells whose hosts do other arithmetic (``docs/design.md``, "Portable
    numerics"): made on different vendors' processors, or MKL read back on other branches, or,
    off Intel (where MKL reads back ``AUTO`` and runs the processor's own code), on processors of
    two instruction-set levels."""
    (va, ma, la), (vb, mb, lb) = _arithmetic(a), _arithmetic(b)
    if va and vb and va != vb:
        return [f"made on a {va} and a {vb} host (MKL keeps its AVX2 branch on Intel only)"]
    if ma and mb and ma != mb:
        return [f"MKL ran its {ma} branch for one cell and its {mb} branch for the other"]
    if va and va != "GenuineIntel" and la and lb and la != lb:
        return [
            f"made on {va} hosts of two instruction-set levels ({la}, {lb}): off Intel MKL runs "
            "the processor's own branch"
        ]
    return []


def hash_problems(label: str, doc: dict[str, Any]) -> list[str]:
    """A cell whose stored config does not give its stored config hash (an edited cell)."""
    stored = doc.get("cell", {}).get("config_hash") if isinstance(doc.get("cell"), dict) else None
    if stored is None:
        return []
    if config_hash(doc.get("config", {})) != stored:
        return [f"{label}'s stored config does not match its config hash (edited after the run)"]
    return []


def pair_problems(c: Comparison, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Why the method's cell ``a`` and the baseline's cell ``b`` are not a fair pair (empty: they
    are): the same seed, every data, model, train, server and eval key (but those the plan
    declares the paper prescribes differently), the same numerics (portable cells: on one
    vendor's processors and MKL branch), the same per-client
    parameter counts, the algorithm keys the comparison names (``same``), both cells by the same
    code (source hash), each cell's config matching its config hash, the suite's current
    definition of both methods, and no honest reply dropped by the peer guard."""
    ca, cb = a.get("config", {}), b.get("config", {})
    out = []
    if ca.get("seed") != cb.get("seed"):
        out.append(f"seeds {ca.get('seed')} vs {cb.get('seed')}")
    fa, fb = config_fingerprint(ca), config_fingerprint(cb)  # a later key at its default = absent
    for section in PAIRED_SECTIONS:
        sa, sb = fa.get(section, {}), fb.get(section, {})
        if section == "server":  # the peer guard: bitwise off where it dropped nothing (below)
            sa, sb = ({k: v for k, v in x.items() if k != "peer_factor"} for x in (sa, sb))
        keys = sorted(
            k
            for k in set(sa) | set(sb)
            if sa.get(k) != sb.get(k) and f"{section}.{k}" not in c.declared
        )
        if section == "model" and "projection" in keys:  # a method may fix its projection
            pa, pb = _projection(ca), _projection(cb)
            if pa == pb:
                keys.remove("projection")
        if section == "data" and keys:
            out.append(f"data config differs ({', '.join(keys)})")
        else:
            out += [f"{section}.{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in keys]
    if _numerics(a) != _numerics(b):
        out.append(f"sim.numerics {_numerics(a)!r} vs {_numerics(b)!r}")
    elif _numerics(a) == "portable":  # the pins hold the arithmetic only on one MKL branch
        out += arithmetic_problems(a, b)
    if c.metric == "after_finetune" and _rounds_run(a) != _rounds_run(b):
        out.append(f"rounds run {_rounds_run(a)} vs {_rounds_run(b)} before fine-tuning")
    pa, pb = param_counts(a), param_counts(b)
    if pa is not None and pb is not None and pa != pb:
        diff = next(i for i, (x, y) in enumerate(zip(pa, pb, strict=False)) if x != y)
        out.append(f"client models differ (client {diff}: {pa[diff]:,} vs {pb[diff]:,} parameters)")
    for k in c.same:
        va, vb = _algo_value(ca, k), _algo_value(cb, k)
        if va != vb:
            out.append(f"algorithm.{k} {va!r} vs {vb!r}")
    code_a, code_b = _code(a), _code(b)
    if code_a != code_b:
        out.append(f"made by different code (source {str(code_a)[:12]} vs {str(code_b)[:12]})")
    for label, doc in ((c.method, a), (c.baseline, b)):
        out += hash_problems(label, doc)
        out += definition_problems(c.suite, label, doc)
        out += guard_problems(label, doc)
    return out


def _projection(cfg: dict[str, Any]) -> Any:
    """The projection a cell's networks were built with: the method's own where it fixes one."""
    name = cfg.get("algorithm", {}).get("name")
    fixed = ALGORITHMS.get(name).model_projection if name in ALGORITHMS else None
    return fixed or cfg.get("model", {}).get("projection", "linear")


def budget_problems(plan: Plan, label: str, doc: dict[str, Any]) -> list[str]:
    """Where a cell is not of the plan's equal budget: another round count, stopped before its
    last round (a plateau stop), or other numerics than the plan's."""
    out = []
    rounds = doc.get("config", {}).get("train", {}).get("rounds")
    if rounds != plan.rounds:
        out.append(f"{label}'s cell has train.rounds = {rounds}, the plan {plan.rounds}")
    ran = _rounds_run(doc)
    if ran is not None and rounds is not None and ran != rounds:
        out.append(f"{label}'s cell stopped at round {ran} of {rounds} (a plateau stop)")
    if _numerics(doc) != plan.numerics:
        out.append(
            f"{label}'s cell has sim.numerics = {_numerics(doc)!r}, the plan {plan.numerics!r}"
        )
    return out


def guard_problems(label: str, doc: dict[str, Any]) -> list[str]:
    """Where the peer guard (``server.peer_factor``) dropped replies in a cell: an honest run
    that lost a client's update is not the paper's method (its numbers are those of the guard
    off only when nothing was dropped). The cure is a re-run with ``server.peer_factor = 0``."""
    server = doc.get("config", {}).get("server", {})
    if not server.get("peer_factor", 10.0):  # the guard was off: rejections were invalid replies
        return []
    rounds = [r.get("round") for r in doc.get("rounds", []) if r.get("rejected")]
    if not rounds:
        return []
    shown = ", ".join(str(t) for t in rounds[:5]) + (", ..." if len(rounds) > 5 else "")
    return [
        f"{label}'s run dropped replies in round(s) {shown} (server.peer_factor): re-run it with "
        "server.peer_factor = 0"
    ]


_SUITES: dict[str, Any] = {}


def _suite(name: str) -> Any:
    """A bundled suite's definition, read once (None: not a bundled suite)."""
    if name not in _SUITES:
        try:
            _SUITES[name] = load_suite(name)
        except (ConfigError, OSError):  # the claims name bundled suites; tests use others
            _SUITES[name] = None
    return _SUITES[name]


def definition_problems(suite: str, label: str, doc: dict[str, Any]) -> list[str]:
    """Where a cell of ``label`` was made by another definition of that method than the suite's
    current one (its algorithm table and its overrides): e.g. a method whose options changed."""
    definition = _suite(suite)
    if definition is None:
        return []
    method = next((m for m in definition.methods if m.label == label), None)
    if method is None:
        return [f"{label} is not a method of suite {suite}"]
    cfg = doc.get("config", {})
    out = []
    for k, want in method.algorithm.items():
        if cfg.get("algorithm", {}).get(k) != want:
            got = cfg.get("algorithm", {}).get(k)
            out.append(f"{label}'s cell has algorithm.{k} = {got!r}, the suite {want!r}")
    for dotted, want in method.overrides.items():
        node: Any = cfg
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != want:
            out.append(f"{label}'s cell has {dotted} = {node!r}, the suite {want!r}")
    return out
