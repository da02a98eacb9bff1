"""Helpers shared by the distillation methods (FedDistill, FML, FedKD).

- ``kl_rows``: per-example KL divergence between softened predictions, the building block of every
  distillation term here (``reduction="batchmean"`` is ``kl_rows(...).mean()``).
- ``small_member`` / ``build_shared_model``: the shared small model of FML (the "meme") and FedKD
  (the "mentee"): one architecture for every client, by default the family's smallest member by
  parameter count, chosen the same way on the server and on every client from the federation spec.
  It is built like every client model, with the federation's projection (``spec.projection``:
  with ``model.projection = "pool"`` the shared model pools to ``feature_dim`` as the personal
  encoders do, it does not end in a learnable Linear).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from fedmosaic.core import seeding
from fedmosaic.core.algorithm import FederationSpec
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.model import ClientModel
from fedmosaic.models import build_client_model, family_members


def kl_rows(student_logits: Tensor, teacher_logits: Tensor, T: float = 1.0) -> Tensor:
    """``KL(softmax(teacher / T) || softmax(student / T))`` per row, ``[B]``.

    Gradients flow into whichever argument is not detached; callers detach the teacher. Computed
    from log-probabilities on both sides (``log_target=True``), so a zero teacher probability is
    exact (no ``0 * log 0`` NaN) and the teacher is never a raw logit used as a probability.
    """
    log_q = F.log_softmax(student_logits / T, dim=1)  # [B, C]
    log_p = F.log_softmax(teacher_logits / T, dim=1)  # [B, C]
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(1)  # [B]


def _zoo_model(
    member: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int,
    projection: str = "linear",
) -> ClientModel:
    return build_client_model(member, input_shape, num_classes, feature_dim, projection)


def _build(member: str, spec: FederationSpec) -> ClientModel:
    """``member`` built as the federation builds its client models (same projection)."""
    return _zoo_model(member, spec.input_shape, spec.num_classes, spec.feature_dim, spec.projection)


@functools.lru_cache(maxsize=32)
def _smallest(
    members: tuple[str, ...],
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int,
    projection: str = "linear",
) -> str:
    """The member with the fewest parameters; ties go to the first in ``members`` order."""
    sizes: dict[str, int] = {}
    # Building the candidates draws random initial weights; keep the caller's RNG stream intact.
    with torch.random.fork_rng(devices=[]):
        for m in dict.fromkeys(members):  # distinct members, first-appearance order
            model = _zoo_model(m, input_shape, num_classes, feature_dim, projection)
            sizes[m] = sum(p.numel() for p in model.parameters())
    return min(sizes, key=lambda m: sizes[m])


def small_member(choice: str, spec: FederationSpec) -> str:
    """``choice`` if given, else the smallest member of the federation's family (deterministic).

    Sizes are counted as built (with ``spec.projection``): a learnable projection counts.
    """
    if choice:
        return choice
    return _smallest(
        spec.members, spec.input_shape, spec.num_classes, spec.feature_dim, spec.projection
    )


def build_shared_model(member: str, spec: FederationSpec) -> ClientModel:
    """A fresh shared model on the client's device; weights come from the caller's RNG state.

    Clients overwrite these weights with the server's on every ``receive``.
    """
    return _build(member, spec).to(spec.device)


def initial_shared_state(member: str, spec: FederationSpec, purpose: str) -> dict[str, Tensor]:
    """The server's initial shared model: same seed, same weights, whatever ran before (CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeding.derive(spec.seed, 0, seeding.SERVER, purpose))
        model = _build(member, spec)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def check_member(member: str, key: str, spec: FederationSpec) -> None:
    """Raise ``ConfigError`` if an explicitly chosen shared architecture is neither one of the
    federation's members nor in the zoo (a plugin's encoder is in the zoo once registered)."""
    if not member or member in spec.members:
        return
    try:
        family_members(member)
    except KeyError as exc:
        raise ConfigError(f"algorithm.{key} = {member!r}: {exc.args[0]}") from None
