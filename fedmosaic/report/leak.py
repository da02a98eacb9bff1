"""Membership inference: how much a party holding a model learns about whether given examples
were in a client's training data.

Each attack gives every candidate example a membership score (higher means "more likely a
member") and is judged on known members and known nonmembers by two numbers:

- :func:`roc_auc`: the area under the ROC curve, ``P(score_member > score_nonmember)`` with ties
  counted half; 0.5 is chance, 1.0 perfect separation.
- :func:`tpr_at_fpr`: the true-positive rate at a low false-positive rate (default 1%), the number
  Carlini et al. (2022) argue for: an attack that confidently identifies a few members is a real
  leak even when its AUC is modest, and a high AUC can hide a useless low-FPR regime.

The attacks:

- :func:`loss_threshold_attack` (Yeom et al. 2018): score = minus the per-example loss; a model
  fits its training examples better than unseen ones.
- :func:`calibrated_loss_attack` (Watson et al. 2022): the same loss, minus what reference models
  trained without the examples give them, so that examples that are simply easy (or hard) stop
  looking like members (or nonmembers). This is the offline form of LiRA (Carlini et al. 2022)
  reduced to a mean difference; see the function for why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from fedmosaic.core import membership

DEFAULT_FPR = membership.FPR


@dataclass(frozen=True)
class AttackResult:
    """An attack's success on known members and nonmembers."""

    auc: float  # area under the ROC curve of the membership score (0.5 = chance)
    tpr_at_fpr: float  # true-positive rate at false-positive rate ``fpr``
    fpr: float  # the false-positive rate asked for
    members: int
    nonmembers: int

    def to_dict(self) -> dict[str, float | int]:
        """The fields as a plain dict (for JSON reports)."""
        return asdict(self)


def roc_auc(scores_in: Tensor, scores_out: Tensor) -> float:
    """AUC = P(score_member > score_nonmember) + 0.5 P(equal), exactly: the integer pair counts
    of ``core/membership.py`` (what a client reports under ``eval.membership``), then one
    division.

    ``scores_in`` are the members' scores, ``scores_out`` the nonmembers'; any shape (flattened).
    """
    won2, pairs2 = membership.pair_counts(scores_in, scores_out)
    return won2 / pairs2


def tpr_at_fpr(scores_in: Tensor, scores_out: Tensor, fpr: float = DEFAULT_FPR) -> float:
    """The largest TPR over thresholds whose FPR <= fpr (a threshold strictly above the chosen
    nonmember score quantile; no interpolation).

    An example is called a member when its score is strictly above the threshold ``t``. With
    ``m`` nonmembers at most ``k`` of them may be called members (``membership.allowed_false``);
    the lowest threshold that allows it is the ``(k + 1)``-th largest nonmember score, so the
    answer is the share of members strictly above that score. When ``fpr * m < 1`` no false
    positive is allowed and the threshold is the largest nonmember score.
    """
    members = membership.flat("scores_in", scores_in)
    return membership.true_positives(members, scores_out, fpr) / members.size


def per_example_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1000) -> Tensor:
    """Cross-entropy per example, float64 [N], model in eval mode under torch.no_grad (restores
    the model's train/eval mode).

    The logits are cast to float64 before the loss: a memorizing model's losses are often below
    float32's resolution near zero, and rounding them all to 0 would turn real differences into
    ties that the attacks cannot rank.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} examples but y has {len(y)}")
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else x.device
    # Each submodule's own flag, not just the top one: model.train(mode) would overwrite a
    # submodule deliberately left in eval mode (a frozen BatchNorm).
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        out = []
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                xb = x[start : start + batch_size].to(device)
                yb = y[start : start + batch_size].to(device)
                out.append(-membership.scores(model(xb), yb).cpu())  # the run's own score
    finally:
        for module, mode in modes:
            module.training = mode
    if not out:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(out)


def _result(scores_in: Tensor, scores_out: Tensor, fpr: float) -> AttackResult:
    return AttackResult(
        auc=roc_auc(scores_in, scores_out),
        tpr_at_fpr=tpr_at_fpr(scores_in, scores_out, fpr),
        fpr=fpr,
        members=int(scores_in.numel()),
        nonmembers=int(scores_out.numel()),
    )


def _check_sets(members: tuple[Tensor, Tensor], nonmembers: tuple[Tensor, Tensor]) -> None:
    # Before any forward pass: an empty set is a caller's mistake, not a reason to run the model.
    for name, (x, y) in (("members", members), ("nonmembers", nonmembers)):
        if len(x) == 0:
            raise ValueError(f"{name} is empty")
        if len(x) != len(y):
            raise ValueError(f"{name}: x has {len(x)} examples but y has {len(y)}")


def loss_threshold_attack(
    model: nn.Module,
    members: tuple[Tensor, Tensor],
    nonmembers: tuple[Tensor, Tensor],
    fpr: float = DEFAULT_FPR,
) -> AttackResult:
    """Yeom et al. 2018: score = -loss (members have lower loss).

    ``members`` and ``nonmembers`` are ``(x, y)`` pairs with class-index labels.
    """
    fpr = membership.check_fpr(fpr)
    _check_sets(members, nonmembers)
    scores_in = -per_example_loss(model, *members)
    scores_out = -per_example_loss(model, *nonmembers)
    return _result(scores_in, scores_out, fpr)


def calibrated_loss_attack(
    model: nn.Module,
    reference_models: Sequence[nn.Module],
    members: tuple[Tensor, Tensor],
    nonmembers: tuple[Tensor, Tensor],
    fpr: float = DEFAULT_FPR,
) -> AttackResult:
    """Difficulty-calibrated loss attack (Watson et al. 2022; the offline simplification of
    LiRA, Carlini et al. 2022): score = mean over reference models (trained without the target
    examples) of loss_ref(x) minus loss_target(x).

    The choice: the reference losses are averaged and subtracted, rather than fitted per example
    with a Gaussian as LiRA does. With the handful of reference models a federation can afford
    (often 1 to 4), a per-example variance is too noisy to divide by, and offline LiRA with one
    global variance ranks examples by the same kind of difference (on the logit-scaled confidence
    rather than the loss). The reference models must not have seen the target examples, members
    or nonmembers: a reference that trained on a member would make it look easy and hide the leak.

    The score's noise is the references' spread on unseen examples plus the target's: with very
    overconfident models (unbounded losses on what they did not see) and few references it can be
    weaker than the plain loss attack, which needs no calibration when all examples are equally
    hard (random labels). Calibration pays where difficulty varies between examples.
    """
    fpr = membership.check_fpr(fpr)
    if len(reference_models) == 0:
        raise ValueError("reference_models is empty")
    _check_sets(members, nonmembers)

    def score(x: Tensor, y: Tensor) -> Tensor:
        reference = torch.stack([per_example_loss(r, x, y) for r in reference_models]).mean(0)
        return reference - per_example_loss(model, x, y)

    return _result(score(*members), score(*nonmembers), fpr)
