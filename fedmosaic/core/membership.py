"""The loss-threshold membership attack (Yeom et al. 2018) as integer counts, so that a client can
report it with its evaluation and any runtime can carry it.

A party holding a client's model scores every candidate example by minus its loss on the
example's true label; members (the client's training split) tend to have lower losses than
nonmembers (its test split). The attack is judged by two numbers, both exact ratios of integers:

- AUC: ``P(score_member > score_nonmember) + P(equal) / 2`` over all (member, nonmember) pairs,
  reported as ``won2 / pairs2`` with ``won2 = 2 #(>) + #(=)`` and ``pairs2 = 2 n_in n_out``;
- TPR at a false-positive rate ``fpr``: the share of members strictly above the lowest threshold
  that calls at most ``floor(fpr n_out)`` nonmembers members, reported as ``tp / n_in``.

``evaluate`` (``core/client.py``) adds them to the client's counts as two extra "splits",
:data:`PAIRS` (``{"n": pairs2, "auc": won2}``) and :data:`MEMBERS` (``{"n": n_in, "tpr": tp}``);
:func:`summarize` turns a round's reports into the mean over clients (each client's attack is
one experiment: its own model against its own data).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

PAIRS = "mia_pairs"  # {"n": 2 n_in n_out, "auc": 2 #(member > nonmember) + #(equal)}
MEMBERS = "mia_members"  # {"n": n_in, "tpr": members above the threshold at FPR}
SPLITS = (PAIRS, MEMBERS)
FPR = 0.01  # the false-positive rate of the TPR (Carlini et al. 2022 argue for a low one)


def scores(logits: Tensor, y: Tensor) -> Tensor:
    """Minus the cross-entropy of ``logits`` ``[B, C]`` at labels ``y`` ``[B]``, float64 ``[B]``
    (float64: a memorizing model's losses sit below float32's resolution near 0, and rounding
    them to ties would hide the differences the attack ranks)."""
    return -F.cross_entropy(logits.to(torch.float64), y, reduction="none")


def flat(name: str, values: Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    if isinstance(values, Tensor):
        values = values.detach().cpu()
    a = np.asarray(values, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    if np.isnan(a).any():
        raise ValueError(f"{name} has {int(np.isnan(a).sum())} NaN value(s) of {a.size}")
    return a


def pair_counts(scores_in: Tensor | np.ndarray, scores_out: Tensor | np.ndarray) -> tuple[int, int]:
    """``(won2, pairs2)``: twice the (member, nonmember) pairs the member wins, ties counting
    one, and twice the number of pairs; the AUC is their ratio."""
    a = flat("scores_in", scores_in)
    b = np.sort(flat("scores_out", scores_out))
    below = np.searchsorted(b, a, side="left")  # nonmembers strictly below each member
    at_or_below = np.searchsorted(b, a, side="right")
    return int(below.sum() + at_or_below.sum()), 2 * a.size * b.size


def check_fpr(fpr: float) -> float:
    """``fpr`` as a float in (0, 1); ValueError otherwise (NaN included)."""
    fpr = float(fpr)
    if not 0.0 < fpr < 1.0:  # also false for NaN
        raise ValueError(f"fpr must lie in (0, 1), got {fpr}")
    return fpr


def allowed_false(m: int, fpr: float) -> int:
    """The most nonmembers of ``m`` that may be called members at rate ``fpr``: the largest
    ``k`` with ``k / m <= fpr`` as computed (``floor(fpr * m)`` can land one off:
    ``0.29 * 100 == 28.999999999999996``)."""
    fpr = check_fpr(fpr)
    k = int(math.floor(fpr * m))
    while (k + 1) / m <= fpr:
        k += 1
    while k > 0 and k / m > fpr:
        k -= 1
    return k


def true_positives(
    scores_in: Tensor | np.ndarray, scores_out: Tensor | np.ndarray, fpr: float = FPR
) -> int:
    """Members strictly above the ``(k + 1)``-th largest nonmember score, ``k`` =
    :func:`allowed_false`: the largest TPR whose FPR is at most ``fpr`` (no interpolation; with
    ``fpr * n_out < 1`` no false positive is allowed and the threshold is the top nonmember)."""
    a = flat("scores_in", scores_in)
    b = flat("scores_out", scores_out)
    k = allowed_false(b.size, fpr)
    threshold = np.sort(b)[::-1][k]  # k < m because fpr < 1
    return int((a > threshold).sum())


def counts(scores_in: Tensor, scores_out: Tensor, fpr: float = FPR) -> dict[str, dict[str, int]]:
    """The two count groups a client reports (see the module docstring)."""
    won2, pairs2 = pair_counts(scores_in, scores_out)
    tp = true_positives(scores_in, scores_out, fpr)
    return {PAIRS: {"n": pairs2, "auc": won2}, MEMBERS: {"n": int(scores_in.numel()), "tpr": tp}}


def client_scores(c: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """One client's ``mia_auc`` and ``mia_tpr`` from its counts (empty without an attack)."""
    pairs, members = c.get(PAIRS, {}), c.get(MEMBERS, {})
    if not pairs.get("n") or not members.get("n"):
        return {}
    return {"mia_auc": pairs["auc"] / pairs["n"], "mia_tpr": members["tpr"] / members["n"]}


def summarize(
    per_client: Sequence[Mapping[str, Mapping[str, int]]], prefix: str = "mia"
) -> dict[str, float]:
    """A round's attack over the clients that reported one: ``<prefix>_auc`` and
    ``<prefix>_tpr`` (means over clients), ``<prefix>_auc_max`` (the most exposed client) and
    ``<prefix>_clients``. ``mia``: the evaluated models; ``mia_upload``: the models the server
    rebuilds from the round's uploads."""
    got = [s for c in per_client if (s := client_scores(c))]
    if not got:
        return {}
    aucs = [s["mia_auc"] for s in got]
    return {
        f"{prefix}_auc": sum(aucs) / len(aucs),
        f"{prefix}_auc_max": max(aucs),
        f"{prefix}_tpr": sum(s["mia_tpr"] for s in got) / len(got),
        f"{prefix}_clients": len(got),
    }


def sizes(n_train: int, n_test: int) -> dict[str, int]:
    """The ``n`` of each count group of a client with these split sizes (what a server that
    knows them checks a report against)."""
    return {PAIRS: 2 * n_train * n_test, MEMBERS: n_train}


def check(c: Mapping[str, Mapping[str, int]], max_examples: int) -> str:
    """Why a reported attack cannot be a real client's ("" when it can): counts beyond what
    ``max_examples`` members and nonmembers allow, an odd pair count, or more wins than pairs."""
    pairs, members = c.get(PAIRS), c.get(MEMBERS)
    if pairs is None and members is None:
        return ""
    if pairs is None or members is None:
        return f"only one of {PAIRS!r} and {MEMBERS!r}"
    if set(pairs) != {"n", "auc"} or set(members) != {"n", "tpr"}:
        return f"{PAIRS!r} needs n and auc, {MEMBERS!r} n and tpr"
    n_in, pairs2 = members["n"], pairs["n"]
    if not 0 < n_in <= max_examples or pairs2 <= 0 or pairs2 % (2 * n_in):
        return f"{pairs2} pair counts do not fit {n_in} members"
    if pairs2 // (2 * n_in) > max_examples:
        return "more nonmembers than examples"
    if pairs["auc"] > pairs2 or members["tpr"] > n_in:
        return "more wins than pairs or more true positives than members"
    return ""
