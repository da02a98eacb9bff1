"""The seed papers' headline claims, judged from finished comparison cells.

Each claim is a list of paired comparisons ``method`` vs ``baseline`` on one suite setting. Both
ran on the same seeds, and a seed fixes the split and the initial models. So the comparison is
made per seed: ``d_s = metric(method, s) - metric(baseline, s)``, in percentage points. It is
reported as the mean of ``d_s`` and its 95% Student-t interval ``[lo, hi]`` over the seeds
(:func:`fedmosaic.report.suite_report.aggregate`). The label follows the interval, never the sign of
the mean alone (issue 22):

- ``above`` (the paper has ``method`` higher):
  - **holds** when ``lo > 0`` and the mean gap is at least half the paper's gap;
  - **holds but smaller** when ``lo > 0`` and the mean gap is under half the paper's;
  - **does not hold** when ``hi < 0`` (the baseline is above, resolved);
  - **inconclusive** when the interval contains 0.
- ``at_or_above`` (non-inferiority: level with or above, within a margin ``m`` stated before the
  runs: 1 point unless the paper states one):
  - **holds** when ``lo > 0``; **holds within the m-point margin** when ``-m < lo <= 0``;
  - **does not hold** when ``hi < -m`` (below by more than the margin, resolved);
  - **inconclusive** otherwise.
- ``lower`` (a cost the paper has lower: bytes, compute): **holds** when ``hi < 0`` and the ratio
  of the means is at most the paper's ratio + 0.1; **holds but smaller** when ``hi < 0`` and the
  ratio is above that; **does not hold** when ``lo > 0`` or the means are not lower;
  **inconclusive** otherwise.
- One seed gives no interval: **inconclusive (1 seed)**, whatever the sign.
- A resolved accuracy verdict from cells that ran less than the paper (a fraction of the data, or
  fewer rounds than the suite's ``paper_rounds`` at the round compared) ends "at this budget": it
  says what these cells show, not that the paper is wrong at its own budget.

A claim's verdict is its weakest comparison's (does not hold < inconclusive < holds but smaller <
holds). Every accuracy comparison carries a power column: the seeds that the observed per-seed
spread of the paired gap would need for 80% power at the 5% level (two-sided t) to resolve the
paper's gap (``above``: the interval above 0 if the true gap is the paper's; ``at_or_above``: the
lower bound above ``-m``), and the test-set resolution of the cells (points per test image, and the
binomial sampling spread of one accuracy on that test set).

Fair pairs: :func:`pair_problems` checks each pair of cells (same seed, same data config, the same
per-client parameter counts, the same round budget). An unfair pair is not judged: its row says
"not comparable" and the reason.

Equal training length: ``final`` reads both runs at the same round: the last round when both ran
the same number, else the last round both evaluated (the first plateau stop), and the row says
so. Beside it (not used for the verdict): the gap on best-on-val (test accuracy at the best
validation round, up to that round) and on best-on-test (optimistic: it selects the round on the
test set, as the papers do).

The metric is the paper's:
- ``final``: test accuracy at the round above, in the suite's paper metric (weighted or unweighted
  over clients);
- ``after_finetune``: the same after local fine-tuning (FedBABU, layer expansion);
- ``common_round``: both runs' test accuracy at the last round both ran, for claims "at the same
  rounds";
- ``mean_over_rounds``: each run's test accuracy averaged over rounds 1..that round (the area
  under the learning curve, divided by the rounds): "at the same rounds" over the whole training;
- ``kb_per_round``: KB up + down per client per round (1 KB = 1000 bytes);
- ``paper_cost_g``: layer expansion's Table 4 cost.

Cells: each comparison is judged from the first cell folder (``--cells``, in order; default the
full-data cells ``<results>/full`` then the reduced-data ``<results>/converged``, where
``<results>`` is ``--results``, by default ``docs/results`` under the current directory) holding
at least 3 paired seeds of it, else from the folder with the most. The package computes no path
of its own: run from the repository root, or say where the results are.

    python -m fedmosaic.report.claims                   # -> stdout
    python -m fedmosaic.report.claims --out docs/results/claims.md
    python -m fedmosaic.report.claims --results /elsewhere/docs/results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedmosaic.algorithms import ALGORITHMS  # importing the package registers every built-in
from fedmosaic.config import ConfigError
from fedmosaic.models import build_client_model, family_members
from fedmosaic.report.suite import load_suite
from fedmosaic.report.suite_report import METRIC_KEYS, aggregate

HOLDS = "holds"
SMALLER = "holds but smaller"
INCONCLUSIVE = "inconclusive"
FAILS = "does not hold"
NOT_COMPARABLE = "not comparable"
RANK = {FAILS: 0, NOT_COMPARABLE: 0, INCONCLUSIVE: 1, SMALLER: 2, HOLDS: 3}
MARGIN = 1.0  # points: the non-inferiority margin, stated before the runs (the papers state none)
MIN_SEEDS = 3  # a cell folder is used for a comparison once it holds this many paired seeds
POWER, ALPHA = 0.8, 0.05  # the power column: 80% power at the 5% level, two-sided t
MAX_SEEDS = 10_000  # "needs more than this many seeds" past it

# Relative on purpose: the repository's results, resolved against the current directory when read
# (the package lives in site-packages once installed, where no docs/ sits beside it).
RESULTS = Path("docs") / "results"


def result_roots(results: Path = RESULTS) -> tuple[Path, Path]:
    """The cell folders under a results folder, in order of preference: full data, then reduced."""
    return (results / "full", results / "converged")


DEFAULT_ROOTS = result_roots()
DEFAULT_CELLS = DEFAULT_ROOTS[-1]


@dataclass(frozen=True)
class Comparison:
    """``method`` against ``baseline`` on ``suite``/``setting``, as the paper has it."""

    suite: str
    setting: str
    method: str
    baseline: str
    relation: str = "above"  # above | at_or_above | lower
    # final | after_finetune | common_round | mean_over_rounds | kb_per_round | paper_cost_g
    metric: str = "final"
    accuracy: str = "weighted"  # the paper's: weighted | unweighted (accuracy metrics only)
    paper: tuple[float, float] | None = None  # the paper's (method, baseline) numbers
    paper_note: str = ""  # where the paper's numbers come from, when not this setting's
    margin: float = MARGIN  # at_or_above: the non-inferiority margin (points)
    # algorithm keys that must be equal in both cells (e.g. one client term for both methods)
    same: tuple[str, ...] = ()


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    comparisons: tuple[Comparison, ...]


_TERM = ("distance", "lam")  # FedTGP vs FedProto: one client term for both (the paper's Eq. 4/11)


def _tgp(
    setting: str, method: str, base: str, paper: tuple[float, float] | None, **kw: Any
) -> Comparison:
    same = _TERM if base.startswith("fedproto") else ()
    return Comparison("fedtgp_table10", setting, method, base, paper=paper, same=same, **kw)


def _gh(baseline: str, paper: tuple[float, float], note: str = "CIFAR-10", **kw: Any) -> Comparison:
    return Comparison(
        "fedgh_table3",
        "pathological",
        "fedgh",
        baseline,
        accuracy="unweighted",
        paper=paper,
        paper_note=note,
        **kw,
    )


def _le(method: str, relation: str, metric: str, paper: tuple[float, float]) -> Comparison:
    note = "MNIST, 100 rounds" if metric == "after_finetune" else "Table 4, G"
    return Comparison(
        "layer_expansion",
        "dir01",
        method,
        "fedbabu",
        relation=relation,
        metric=metric,
        paper=paper,
        paper_note=note,
    )


_TGP_PAPER = {  # Table 10, FMNIST, best-over-rounds test accuracy after 1000 rounds
    "pathological": {
        "fedtgp": 99.56,
        "fedproto": 99.48,
        "lg_fedavg": 99.39,
        "feddistill": 99.47,
        "fml": 99.42,
        "fedkd": 99.37,
        "fedgen": 99.38,
    },
    "practical": {
        "fedtgp": 97.58,
        "fedproto": 97.46,
        "lg_fedavg": 97.23,
        "feddistill": 97.48,
        "fml": 97.36,
        "fedkd": 97.30,
        "fedgen": 97.35,
    },
}
_CA_PAPER = {  # Table 2, FMNIST, average test accuracy over clients (%)
    "dir05": {"fedclassavg": 93.03, "local": 88.40, "fedproto": 60.42, "ktpfl": 90.39},
    "skewed": {"fedclassavg": 98.00, "local": 94.30, "fedproto": 63.64, "ktpfl": 97.37},
}
_TGP_OTHERS = ("lg_fedavg", "feddistill", "fml", "fedkd", "fedgen")


def _tgp_claim(method: str, fedproto: str) -> tuple[Comparison, ...]:
    """FedTGP (``method``) against FedProto with the same client term and the other baselines."""
    return tuple(
        _tgp(
            s,
            method,
            b,
            (_TGP_PAPER[s]["fedtgp"], _TGP_PAPER[s]["fedproto" if b == fedproto else b]),
        )
        for s in ("pathological", "practical")
        for b in (fedproto, *_TGP_OTHERS)
    )


CLAIMS: tuple[Claim, ...] = (
    Claim(
        "fedtgp",
        "FedTGP above FedProto, LG-FedAvg, FD, FML, FedKD and FedGen (Table 10, HtCNN8, 20 "
        "clients), as the paper writes it: the Euclidean client term with lambda = 0.1 for FedTGP "
        "and FedProto alike (fedproto_l2)",
        _tgp_claim("fedtgp", "fedproto_l2"),
    ),
    Claim(
        "fedtgp_code",
        "The same as the authors' code trains it: MSE over the batch with lambda = 10 and the "
        "prototypes of the model before local training (fedtgp_mse), FedProto with the same "
        "term (fedproto_mse)",
        _tgp_claim("fedtgp_mse", "fedproto_mse"),
    ),
    Claim(
        "fedtgp_mechanism",
        "FedTGP's trained, margin-separated prototypes beat FedProto's averaged ones at the same "
        "round (nearest-prototype inference, one client term for both)",
        tuple(
            _tgp(s, "fedtgp", "fedproto_l2", None, metric=m)
            for s in ("pathological", "practical")
            for m in ("mean_over_rounds", "common_round")
        ),
    ),
    Claim(
        "fedclassavg",
        "FedClassAvg above Local, FedProto and KT-pFL (Table 2, FMNIST, 20 clients, Dir(0.5) and "
        "2 classes per client)",
        tuple(
            Comparison(
                "fedclassavg_table2",
                s,
                "fedclassavg",
                b,
                accuracy="unweighted",
                paper=(_CA_PAPER[s]["fedclassavg"], _CA_PAPER[s][b]),
                paper_note="ResNet-18/ShuffleNetV2/GoogLeNet/AlexNet",
            )
            for s in ("dir05", "skewed")
            for b in ("local", "fedproto", "ktpfl")
        ),
    ),
    Claim(
        "fedclassavg_ablation",
        "FedClassAvg's ablation (Table 4): proximal regularization helps with and without the "
        "contrastive loss (CA < CA+PR, CA+CL < CA+PR+CL)",
        (
            Comparison(
                "fedclassavg_ablation",
                "dir05",
                "ca_pr",
                "ca",
                accuracy="unweighted",
                paper=(89.71, 85.78),
            ),
            Comparison(
                "fedclassavg_ablation",
                "dir05",
                "ca_pr_cl",
                "ca_cl",
                accuracy="unweighted",
                paper=(93.03, 92.40),
            ),
        ),
    ),
    Claim(
        "fedgh",
        "FedGH above LG-FedAvg and FedProto (Table 3 setting, 5 CNNs, 10 clients, pathological), "
        "and its communication below LG-FedAvg's",
        (
            _gh("lg_fedavg", (97.60, 96.37)),
            _gh("fedproto", (97.60, 96.47)),
            _gh(
                "lg_fedavg",
                (23.45, 39.14),
                relation="lower",
                metric="kb_per_round",
                note="CIFAR-10, KB/client/round",
            ),
        ),
    ),
    Claim(
        "fedhenn",
        "FedHeNN above Local on the same heterogeneous networks (5 CNNs, 2 or 5 classes per "
        "client), and above its own ablation without the alignment term (eta0 = 0)",
        tuple(
            Comparison("fedhenn_5cnn", s, "fedhenn_linear", b, accuracy="unweighted")
            for s in ("cls2", "cls5")
            for b in ("local_own", "fedhenn_eta0")
        ),
    ),
    Claim(
        "layer_expansion",
        "Vanilla and Anti scheduling at or above FedBABU after fine-tuning (within a 1-point "
        "margin), at lower training compute (Table 2 / Table 4; shallow CNN, 100 clients, 10%, "
        "Dir(0.1))",
        (
            _le("fedseq_vanilla", "at_or_above", "after_finetune", (98.21, 98.19)),
            _le("fedseq_anti", "at_or_above", "after_finetune", (98.34, 98.19)),
            _le("fedseq_vanilla", "lower", "paper_cost_g", (314.912, 865.344)),
            _le("fedseq_anti", "lower", "paper_cost_g", (838.880, 865.344)),
        ),
    ),
)

ACCURACY_METRICS = ("final", "after_finetune", "common_round", "mean_over_rounds")


def load_cells(root: Path, suite: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """``(setting, method, seed) -> results document`` of a suite's finished cells under ``root``
    (``root/<suite>/cells/<setting>/<method>/seed<k>/results.json``)."""
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    base = root / suite / "cells"
    for path in sorted(base.glob("*/*/seed*/results.json")):
        seed_dir = path.parent
        try:
            seed = int(seed_dir.name.removeprefix("seed"))
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: not a cell's results.json ({exc})") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
            raise ValueError(f"{path}: not a cell's results.json (no summary table)")
        out[(seed_dir.parent.parent.name, seed_dir.parent.name, seed)] = doc
    return out


def _at_round(doc: dict[str, Any], round_num: int, key: str) -> float | None:
    for r in doc.get("rounds", []):
        if int(r["round"]) == round_num and r.get(key) is not None:
            return float(r[key])
    return None


def _last_evaluated(doc: dict[str, Any], key: str) -> int:
    rounds = [int(r["round"]) for r in doc.get("rounds", []) if r.get(key) is not None]
    return max(rounds) if rounds else 0


def _rounds_run(doc: dict[str, Any]) -> int | None:
    r = doc.get("summary", {}).get("rounds_run")
    return None if r is None else int(r)


def _val_key(key: str) -> str:
    return "val_" + key  # acc_weighted -> val_acc_weighted, acc_mean -> val_acc_mean


def pair_values(
    c: Comparison, a: dict[str, Any], b: dict[str, Any]
) -> tuple[float | None, float | None, int | None]:
    """The metric of ``method`` (doc ``a``) and ``baseline`` (doc ``b``) on one seed (accuracies in
    %), and the round both were read at where that matters (``final``: the last round when both
    ran the same number of rounds, else the last round both evaluated; ``common_round``)."""
    sa, sb = a.get("summary", {}), b.get("summary", {})
    if c.metric == "final":
        key = METRIC_KEYS[c.accuracy]
        ra, rb = _rounds_run(a), _rounds_run(b)
        if ra == rb:  # the same length (or no record of it): the final rows
            return _pct(sa.get("final", {}).get(key)), _pct(sb.get("final", {}).get(key)), ra
        r = min(_last_evaluated(a, key), _last_evaluated(b, key))
        return _pct(_at_round(a, r, key)), _pct(_at_round(b, r, key)), r
    if c.metric == "after_finetune":
        key = METRIC_KEYS[c.accuracy]
        va, vb = sa.get(c.metric, {}).get(key), sb.get(c.metric, {}).get(key)
        return _pct(va), _pct(vb), _rounds_run(a)
    if c.metric == "common_round":
        key = METRIC_KEYS[c.accuracy]
        r = min(_last_evaluated(a, key), _last_evaluated(b, key))
        return _pct(_at_round(a, r, key)), _pct(_at_round(b, r, key)), r
    if c.metric == "mean_over_rounds":
        key = METRIC_KEYS[c.accuracy]
        r = min(_last_evaluated(a, key), _last_evaluated(b, key))
        both = [
            (x, y)
            for t in range(1, r + 1)
            if (x := _at_round(a, t, key)) is not None and (y := _at_round(b, t, key)) is not None
        ]
        if not both:
            return None, None, r
        return (
            _pct(sum(x for x, _ in both) / len(both)),
            _pct(sum(y for _, y in both) / len(both)),
            r,
        )
    if c.metric == "kb_per_round":

        def kb(s: dict[str, Any]) -> float | None:
            up, down = (
                s.get("bytes_up_per_client_per_round"),
                s.get("bytes_down_per_client_per_round"),
            )
            return None if up is None or down is None else (float(up) + float(down)) / 1000

        return kb(sa), kb(sb), None
    if c.metric == "paper_cost_g":
        ca, cb = sa.get("paper_cost_total"), sb.get("paper_cost_total")
        return (
            None if ca is None else float(ca) / 1e9,
            None if cb is None else float(cb) / 1e9,
            None,
        )
    raise ValueError(f"unknown comparison metric {c.metric!r}")


def best_up_to(doc: dict[str, Any], key: str, r: int) -> tuple[float | None, float | None]:
    """Test accuracy (%) over rounds 1..r: at the best validation round (the first maximum; None
    without validation data) and the best on test (optimistic: selects the round on the test
    set, as the papers report it)."""
    rows = [x for x in doc.get("rounds", []) if int(x["round"]) <= r and x.get(key) is not None]
    if not rows:
        return None, None
    on_test = max(float(x[key]) for x in rows)
    with_val = [x for x in rows if x.get(_val_key(key)) is not None]
    if not with_val:
        return None, _pct(on_test)
    best = max(with_val, key=lambda x: (float(x[_val_key(key)]), -int(x["round"])))
    return _pct(best[key]), _pct(on_test)


def _pct(v: Any) -> float | None:
    return None if v is None else 100.0 * float(v)


# ---- fair pairs ------------------------------------------------------------------------------
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


def pair_problems(c: Comparison, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Why the method's cell ``a`` and the baseline's cell ``b`` are not a fair pair (empty: they
    are): the same seed (split and initial models), data config, per-client parameter counts,
    round budget, rounds compared, and the algorithm keys the comparison names (``same``)."""
    ca, cb = a.get("config", {}), b.get("config", {})
    out = []
    if ca.get("seed") != cb.get("seed"):
        out.append(f"seeds {ca.get('seed')} vs {cb.get('seed')}")
    if ca.get("data") != cb.get("data"):
        keys = sorted(
            k
            for k in set(ca.get("data", {})) | set(cb.get("data", {}))
            if ca.get("data", {}).get(k) != cb.get("data", {}).get(k)
        )
        out.append(f"data config differs ({', '.join(keys)})")
    ta, tb = ca.get("train", {}), cb.get("train", {})
    for k in ("rounds", "plateau_delta", "plateau_window", "plateau_min_rounds"):
        if ta.get(k) != tb.get(k):
            out.append(f"train.{k} {ta.get(k)} vs {tb.get(k)}")
    if c.metric == "after_finetune" and _rounds_run(a) != _rounds_run(b):
        out.append(f"rounds run {_rounds_run(a)} vs {_rounds_run(b)} before fine-tuning")
    if c.metric in ACCURACY_METRICS:
        pa, pb = param_counts(a), param_counts(b)
        if pa is not None and pb is not None and pa != pb:
            diff = next(i for i, (x, y) in enumerate(zip(pa, pb, strict=False)) if x != y)
            out.append(
                f"client models differ (client {diff}: {pa[diff]:,} vs {pb[diff]:,} parameters)"
            )
    for k in c.same:
        va, vb = _algo_value(ca, k), _algo_value(cb, k)
        if va != vb:
            out.append(f"algorithm.{k} {va!r} vs {vb!r}")
    for label, doc in ((c.method, a), (c.baseline, b)):
        out += definition_problems(c.suite, label, doc)
        out += guard_problems(label, doc)
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


# ---- verdicts and power ----------------------------------------------------------------------
def verdict(c: Comparison, diff: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> str:
    """The label of one comparison from the aggregated per-seed differences (module docstring);
    ``a``/``b``: the method's and baseline's aggregates."""
    mean, ci, n = diff["mean"], diff["ci95"], diff["n"]
    if n == 0 or mean is None:
        return "not run"
    if n == 1 or ci is None:
        return INCONCLUSIVE + " (1 seed)"
    lo, hi = mean - ci, mean + ci
    if c.relation == "above":
        if lo > 0:
            return SMALLER if _short(c, mean) else HOLDS
        return FAILS if hi < 0 else INCONCLUSIVE
    if c.relation == "at_or_above":
        if lo > 0:
            return HOLDS
        if lo > -c.margin:
            return f"{HOLDS} within the {c.margin:g}-point margin"
        return FAILS if hi < -c.margin else INCONCLUSIVE
    if c.relation == "lower":
        ma, mb = a["mean"], b["mean"]
        if ma is None or mb is None or ma >= mb or lo > 0:
            return FAILS
        if hi >= 0:
            return INCONCLUSIVE
        if c.paper is not None and mb > 0 and ma / mb > c.paper[0] / c.paper[1] + 0.1:
            return SMALLER
        return HOLDS
    raise ValueError(f"unknown relation {c.relation!r}")


def _short(c: Comparison, mean_gap: float) -> bool:
    """Whether the gap is under half the paper's (never, without a paper gap)."""
    if c.paper is None:
        return False
    paper_gap = c.paper[0] - c.paper[1]
    return paper_gap > 0 and mean_gap < 0.5 * paper_gap


def seeds_needed(sd: float | None, delta: float) -> int | None:
    """The smallest n with ``n >= ((t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / delta)^2``: the
    seeds for 80% power at the 5% level (two-sided) to resolve a true gap ``delta`` with a per-seed
    spread ``sd``; None without a spread or a gap, or past ``MAX_SEEDS``."""
    from scipy.stats import t

    if sd is None or delta <= 0:
        return None
    if sd == 0:
        return 2
    lo, hi = 2, MAX_SEEDS + 1

    def enough(n: int) -> bool:
        q = (float(t.ppf(1 - ALPHA / 2, n - 1)) + float(t.ppf(POWER, n - 1))) * sd / delta
        return n >= q * q

    if not enough(MAX_SEEDS):
        return None
    while lo < hi:  # enough() is monotone in n
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid + 1, hi)
    return lo


def power(c: Comparison, diff: dict[str, Any]) -> dict[str, Any]:
    """The seeds the observed spread of the paired gap needs (80% power) to resolve the paper's
    gap (``above``; the observed gap without one) or to place the lower bound above ``-margin``
    if the true gap is the paper's (``at_or_above``). Costs: none."""
    if c.relation == "lower" or c.metric not in ACCURACY_METRICS or diff["mean"] is None:
        return {"delta": None, "basis": "", "seeds": None, "observed_seeds": None}
    paper_gap = None if c.paper is None else c.paper[0] - c.paper[1]
    if c.relation == "at_or_above":
        delta, basis = c.margin + max(paper_gap or 0.0, 0.0), "margin + paper gap"
    elif paper_gap is not None and paper_gap > 0:
        delta, basis = paper_gap, "paper gap"
    else:
        delta, basis = abs(diff["mean"]), "observed gap"
    # the same for the gap observed here (at_or_above: its distance above -margin)
    observed = diff["mean"] + c.margin if c.relation == "at_or_above" else abs(diff["mean"])
    return {
        "delta": delta,
        "basis": basis,
        "seeds": seeds_needed(diff["std"], delta),
        "observed_seeds": seeds_needed(diff["std"], observed) if observed > 0 else None,
    }


def needs_text(p: dict[str, Any], n: int) -> str:
    """How many seeds would resolve an inconclusive comparison: the power column's count when it
    is more than the ``n`` seeds run; else (the observed gap is smaller than the target) the
    count for the observed gap."""
    need = p["seeds"] if p["seeds"] is not None and p["seeds"] > n else p["observed_seeds"]
    if p["seeds"] is None and p["delta"] is not None:
        need = None
    return f"more than {MAX_SEEDS:,} seeds" if need is None else f"{need:,} seeds"


def resolution(doc: dict[str, Any], accuracy_pct: float | None) -> dict[str, Any]:
    """A cell's test-set resolution: its test images, points per image, and the binomial
    sampling spread (points) of one accuracy near ``accuracy_pct`` on that many images."""
    n = sum(int(cl.get("num_test", 0)) for cl in doc.get("clients", []))
    if n == 0 or accuracy_pct is None:
        return {"test_images": n, "per_image": None, "sampling_sd": None}
    p = min(max(accuracy_pct / 100.0, 0.0), 1.0)
    return {
        "test_images": n,
        "per_image": 100.0 / n,
        "sampling_sd": 100.0 * math.sqrt(p * (1 - p) / n),
    }


def judge(c: Comparison, cells: dict[tuple[str, str, int], dict[str, Any]]) -> dict[str, Any]:
    """The per-seed values, their aggregates, the verdict, the power and the fair-pair check of
    one comparison."""
    seeds = paired_seeds(c, cells)
    va, vb, vd, rounds, problems = [], [], [], [], []
    val_d, test_d = [], []
    for s in seeds:
        a, b = cells[(c.setting, c.method, s)], cells[(c.setting, c.baseline, s)]
        problems += [f"seed {s}: {p}" for p in pair_problems(c, a, b)]
        x, y, r = pair_values(c, a, b)
        if x is None or y is None:
            continue
        va.append(x)
        vb.append(y)
        vd.append(x - y)
        if r is not None:
            rounds.append(r)
        if c.metric == "final" and r is not None:
            key = METRIC_KEYS[c.accuracy]
            (av, at), (bv, bt) = best_up_to(a, key, r), best_up_to(b, key, r)
            val_d.append(None if av is None or bv is None else av - bv)
            test_d.append(None if at is None or bt is None else at - bt)
    a_, b_, d = aggregate(va), aggregate(vb), aggregate(vd)
    res = {"test_images": 0, "per_image": None, "sampling_sd": None}
    if seeds and c.metric in ACCURACY_METRICS:
        res = resolution(cells[(c.setting, c.baseline, seeds[0])], b_["mean"])
    if problems:
        label = f"{NOT_COMPARABLE}: {problems[0]}" + (
            f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        )
    else:
        label = verdict(c, d, a_, b_)
    pw = power(c, d)
    if label == INCONCLUSIVE and pw["delta"] is not None:
        label += f": needs {needs_text(pw, d['n'])}"
        gap = None if c.paper is None else c.paper[0] - c.paper[1]
        if c.relation == "above" and gap is not None and gap > 0 and d["mean"] + d["ci95"] < gap:
            label += f"; the paper's gap (+{gap:.2f}) is above the interval"
    return {
        "comparison": c,
        "seeds": seeds,
        "method": a_,
        "baseline": b_,
        "diff": d,
        "rounds": rounds,
        "verdict": label,
        "problems": problems,
        "power": pw,
        "resolution": res,
        "best_on_val": aggregate(val_d),
        "best_on_test": aggregate(test_d),
    }


AT_THIS_BUDGET = " at this budget"


def reduced_budget(c: Comparison, j: dict[str, Any]) -> bool:
    """Whether a comparison's cells ran less than the paper: a fraction of the data, or fewer
    rounds than the suite's ``paper_rounds`` at the round compared. Its verdict then says "at
    this budget": a resolved gap here is not a verdict on the paper's own budget."""
    if c.metric not in ACCURACY_METRICS:
        return False  # costs (bytes, Table 4 compute) do not depend on the budget's length
    if any(f < 1.0 for f in j.get("fraction", [])):
        return True
    definition = _suite(c.suite)
    paper_rounds = None if definition is None else definition.paper_rounds
    return bool(paper_rounds and j["rounds"] and min(j["rounds"]) < paper_rounds)


def paired_seeds(c: Comparison, cells: dict[tuple[str, str, int], dict[str, Any]]) -> list[int]:
    return sorted(
        s
        for (st, m, s) in cells
        if st == c.setting and m == c.method and (c.setting, c.baseline, s) in cells
    )


def claim_verdict(verdicts: Sequence[str]) -> str:
    """The weakest of a claim's comparison verdicts. A claim is a conjunction: one comparison
    that does not hold settles it even with others not run yet; otherwise a missing one leaves
    the claim "not run"."""
    ran = [v for v in verdicts if v != "not run"]
    failed = [v for v in ran if v.startswith(FAILS)]
    if failed:
        return failed[0] if all(v == failed[0] for v in failed) else FAILS
    if not verdicts or len(ran) < len(verdicts):
        return "not run (cells missing)"
    worst = min(verdicts, key=lambda v: RANK[next(k for k in RANK if v.startswith(k))])
    if worst.startswith((NOT_COMPARABLE, INCONCLUSIVE + ":")):  # the rows give the details
        return worst.split(":")[0]
    return worst


def evaluate(roots: Path | Sequence[Path] = DEFAULT_ROOTS) -> list[dict[str, Any]]:
    """Every claim's comparisons judged, each from the first of ``roots`` holding ``MIN_SEEDS``
    paired seeds of it (else the one with the most)."""
    roots = [roots] if isinstance(roots, Path) else list(roots)
    cache: dict[tuple[Path, str], dict[tuple[str, str, int], dict[str, Any]]] = {}

    def cells_of(root: Path, suite: str) -> dict[tuple[str, str, int], dict[str, Any]]:
        if (root, suite) not in cache:
            cache[(root, suite)] = load_cells(root, suite)
        return cache[(root, suite)]

    out = []
    for claim in CLAIMS:
        judged = []
        for c in claim.comparisons:
            counts = [len(paired_seeds(c, cells_of(r, c.suite))) for r in roots]
            pick = next(
                (i for i, n in enumerate(counts) if n >= MIN_SEEDS),
                max(range(len(roots)), key=lambda i: (counts[i], -i)),
            )
            j = judge(c, cells_of(roots[pick], c.suite))
            j["source"] = roots[pick].name if j["seeds"] else "-"
            j["fraction"] = sorted(
                {
                    cells_of(roots[pick], c.suite)[(c.setting, m, s)]
                    .get("config", {})
                    .get("data", {})
                    .get("subsample", 1.0)
                    for s in j["seeds"]
                    for m in (c.method, c.baseline)
                }
            )
            if j["verdict"].startswith((HOLDS, FAILS)) and reduced_budget(c, j):
                j["verdict"] += AT_THIS_BUDGET
            judged.append(j)
        out.append(
            {
                "claim": claim,
                "comparisons": judged,
                "verdict": claim_verdict([j["verdict"] for j in judged]),
            }
        )
    return out


def budget_rows(root: Path = DEFAULT_CELLS) -> list[dict[str, Any]]:
    """Per suite folder under ``root``: its cells, seeds, data fractions, rounds run, the wall
    hours they took on this machine and the code versions (source hashes) that produced them."""
    rows = []
    if not root.is_dir():
        return rows
    for suite_dir in sorted(p for p in root.iterdir() if (p / "cells").is_dir()):
        docs = load_cells(root, suite_dir.name)
        if not docs:
            continue
        rounds = [int(d.get("summary", {}).get("rounds_run") or 0) for d in docs.values()]
        fractions = {
            d.get("config", {}).get("data", {}).get("subsample", 1.0) for d in docs.values()
        }
        codes = {
            (d.get("provenance", {}).get("code", {}).get("source_hash") or "?")[:12]
            for d in docs.values()
        }
        rows.append(
            {
                "folder": root.name,
                "suite": suite_dir.name,
                "cells": len(docs),
                "seeds": sorted({s for _, _, s in docs}),
                "fractions": sorted(fractions),
                "rounds": (min(rounds), max(rounds)),
                "hours": sum(float(d.get("wall_seconds") or 0.0) for d in docs.values()) / 3600,
                "codes": sorted(codes),
            }
        )
    return rows


def budget_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| cells folder | suite | cells | seeds | FMNIST fraction | rounds run | "
        "wall hours (2 cores) | code |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('folder', '')} | {r['suite']} | {r['cells']} | "
            f"{', '.join(map(str, r['seeds']))} | "
            f"{', '.join(f'{f:g}' for f in r['fractions'])} | {r['rounds'][0]}-{r['rounds'][1]} | "
            f"{r['hours']:.2f} | {', '.join(r['codes'])} |"
        )
    total = sum(r["hours"] for r in rows)
    lines.append(f"| all | | {sum(r['cells'] for r in rows)} | | | | {total:.2f} | |")
    return "\n".join(lines) + "\n"


def _num(agg: dict[str, Any], digits: int = 2) -> str:
    if agg["mean"] is None:
        return "-"
    if agg["ci95"] is None:
        return f"{agg['mean']:.{digits}f}"
    return f"{agg['mean']:.{digits}f} ± {agg['ci95']:.{digits}f}"


def _metric_label(c: Comparison) -> str:
    if c.metric == "kb_per_round":
        return "KB/client/round (up + down)"
    if c.metric == "paper_cost_g":
        return "Table 4 cost (G)"
    acc = "weighted" if c.accuracy == "weighted" else "unweighted"
    where = {
        "final": "final",
        "after_finetune": "after fine-tune",
        "common_round": "same round",
        "mean_over_rounds": "mean over rounds 1..r",
    }
    return f"{where[c.metric]} acc, {acc} (%)"


def _seeds_text(p: dict[str, Any]) -> str:
    if p["delta"] is None:
        return "-"
    n = "> " + f"{MAX_SEEDS:,}" if p["seeds"] is None else f"{p['seeds']:,}"
    return f"{n} ({p['basis']} {p['delta']:.2f})"


def _resolution_text(r: dict[str, Any]) -> str:
    if r["per_image"] is None:
        return "-"
    return f"{r['test_images']:,} img: {r['per_image']:.3f} pt each, sd {r['sampling_sd']:.2f}"


def summary_markdown(results: Sequence[dict[str, Any]]) -> str:
    """One row per claim: its verdict, the seeds behind it and its comparisons' verdicts."""
    lines = [
        "| claim | verdict | seeds | evidence (cells, data fraction, round compared) | "
        "comparisons |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        ns = sorted({j["diff"]["n"] for j in res["comparisons"]})
        evidence = sorted(
            {
                f"{j['source']} {', '.join(f'{100 * f:g}%' for f in j['fraction'])}"
                for j in res["comparisons"]
                if j.get("fraction")
            }
        )
        rounds = [r for j in res["comparisons"] for r in j["rounds"]]
        if rounds:
            lo, hi = min(rounds), max(rounds)
            evidence.append(f"round {lo}" if lo == hi else f"rounds {lo}-{hi}")
        counts: dict[str, int] = {}
        for j in res["comparisons"]:
            v = j["verdict"].split(":")[0]
            counts[v] = counts.get(v, 0) + 1
        parts = ", ".join(f"{k} {v}" for v, k in sorted(counts.items(), key=lambda kv: kv[0]))
        seeds = "-".join(str(n) for n in (ns[0], ns[-1])) if ns[0] != ns[-1] else str(ns[0])
        lines.append(
            f"| {res['claim'].title} | **{res['verdict']}** | {seeds} | "
            f"{'; '.join(evidence) or '-'} | {parts} |"
        )
    return "\n".join(lines) + "\n"


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """One table per claim: per comparison the cells it reads, the two methods, the paired gap
    with its interval, the paper's, the verdict, the power and the side metrics."""
    lines = [summary_markdown(results)]
    for res in results:
        claim = res["claim"]
        lines += [f"#### {claim.title}", "", f"**Verdict: {res['verdict']}.**", ""]
        lines.append(
            "| setting | method vs baseline | metric | cells | seeds | method | baseline | "
            "gap (paired) | paper | verdict | seeds for 80% power | test-set resolution | "
            "gap best-on-val | gap best-on-test (optimistic) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for j in res["comparisons"]:
            c: Comparison = j["comparison"]
            paper = "-"
            if c.paper is not None:
                paper = f"{c.paper[0]:g} vs {c.paper[1]:g}"
                if c.relation != "lower":
                    paper += f" ({c.paper[0] - c.paper[1]:+.2f})"
                if c.paper_note:
                    paper += f" ({c.paper_note})"
            metric = _metric_label(c)
            if j["rounds"]:
                lo, hi = min(j["rounds"]), max(j["rounds"])
                metric += f" (round {lo})" if lo == hi else f" (rounds {lo}-{hi})"
            fraction = ", ".join(f"{f:g}" for f in j.get("fraction", [])) or "-"
            lines.append(
                f"| {c.setting} | {c.method} vs {c.baseline} | {metric} | "
                f"{j.get('source', '-')} ({fraction}) | {j['diff']['n']} | "
                f"{_num(j['method'])} | {_num(j['baseline'])} | {_interval(j['diff'])} | {paper} | "
                f"{j['verdict']} | {_seeds_text(j['power'])} | {_resolution_text(j['resolution'])} | "
                f"{_interval(j['best_on_val'])} | {_interval(j['best_on_test'])} |"
            )
        lines.append("")
    lines.append(
        "Values: mean ± half-width of the 95% t-interval over seeds; the gap is the mean of the "
        "per-seed differences (same seed = same split and initial models) with its interval "
        "[lo, hi]. Seeds for 80% power: from the observed per-seed spread of the paired gap, the "
        "seeds a two-sided t-test at 5% needs to resolve the stated gap (`at_or_above`: the "
        f"margin, {MARGIN:g} point, plus the paper's gap). Test-set resolution: all clients' test "
        "images in one cell, the points one image is worth, and the binomial sampling spread of "
        "one accuracy on them. Best-on-val and best-on-test gaps use rounds up to the compared "
        "round; best-on-test selects the round on the test set (optimistic) and never decides a "
        "verdict."
    )
    return "\n".join(lines) + "\n"


def _interval(agg: dict[str, Any]) -> str:
    if agg["mean"] is None:
        return "-"
    s = f"{agg['mean']:+.2f}"
    if agg["ci95"] is None:
        return s
    return f"{s} [{agg['mean'] - agg['ci95']:+.2f}, {agg['mean'] + agg['ci95']:+.2f}]"


def page(roots: Sequence[Path] = DEFAULT_ROOTS) -> str:
    """The whole claims page: the verdicts, the tables and the cells behind them."""
    text = markdown(evaluate(roots))
    text += "\n#### The cells behind these verdicts\n\n"
    return text + budget_markdown([r for root in roots for r in budget_rows(root)])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedmosaic.report.claims", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--cells",
        type=Path,
        action="append",
        help="a folder of <suite>/cells/...; repeat, in order of preference "
        "(default: RESULTS/full, then RESULTS/converged)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        metavar="RESULTS",
        help="the results folder whose full/ and converged/ cells are read when no --cells is "
        f"given (default: {RESULTS}, relative to the current directory: run from the repository "
        "root)",
    )
    p.add_argument("--out", type=Path, help="write the Markdown here (default: stdout)")
    args = p.parse_args(argv)
    roots = args.cells or list(result_roots(args.results))
    if not any(r.is_dir() for r in roots):
        if args.cells:
            print(f"error: --cells {roots[0]} is not a folder", file=sys.stderr)
        else:
            print(
                f"error: --results {args.results} holds no full/ or converged/ folder (run from "
                "the repository root, or pass --results DIR)",
                file=sys.stderr,
            )
        return 2
    try:
        text = page([r for r in roots if r.is_dir()])
        if args.out is None:
            sys.stdout.write(text)
        else:  # written whole or not at all
            tmp = args.out.with_suffix(args.out.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(args.out)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "CLAIMS",
    "Claim",
    "Comparison",
    "evaluate",
    "judge",
    "markdown",
    "pair_problems",
    "seeds_needed",
    "verdict",
]
