"""FML (Shen et al., Federated Mutual Learning, arXiv:2006.16765, 2020).

Shared: a small "meme" model, the same architecture on every client, sample-weighted averaged by
the server (all parameters and buffers). Each client's personal model (any architecture) stays
local. Both are trained together by deep mutual learning on every local batch:
``L_personal = alpha * CE(z_p, y) + (1 - alpha) * KL(p_meme || p_personal)`` and
``L_meme = beta * CE(z_m, y) + (1 - beta) * KL(p_personal || p_meme)``, each KL towards the other
model's detached prediction. Prediction: the personal model (``acc``); ``acc_meme`` is reported too.

Choices and differences from the reference code (PFLlib/HtFLlib ``clientfml``/``serverfml``):

- Meme architecture: ``meme_arch = ""`` picks the family's smallest member by parameter count
  (deterministically, on the server and on every client); HtFLlib uses the family's first member.
  Any zoo architecture string may be given instead. The meme is built as every client model is,
  with the federation's projection (``model.projection``; "pool" as HtFLlib's models).
- KL uses ``reduction="batchmean"`` (the true KL per example). The reference's ``nn.KLDivLoss()``
  default ``"mean"`` divides by ``B * C`` as well, shrinking the distillation term by ``C``.
- Targets are detached, so each loss trains only its own model. The reference backpropagates
  ``L_personal`` into the meme too (and vice versa) because its targets are not detached.
- Both losses are summed and minimized by the one local optimizer; with plain SGD this is the
  reference's two optimizers at the same learning rate. The reference's gradient-norm clipping at
  10 ("prevent divergency on specific tasks") is not applied.
- Server: sample-weighted average of the uploaded memes, buffers included (BatchNorm statistics;
  integer counters keep the maximum); HtFLlib averages parameters uniformly and never updates the
  meme's buffers.
- ``alpha = beta = 0.5``: an even split of each model's loss between its labels and its peer. The
  argparse defaults of the references switch mutual learning (partly) off: PFLlib ``alpha=1.0,
  beta=0.0`` (the personal model ignores the meme), HtFLlib ``alpha=beta=1.0`` (no KL at all).

Parity options (HtFLlib ``clientfml.py``/``serverfml.py``, commit 728e52a; defaults keep the form
above):

- ``loss_form = "htfllib"``: the reference's per-batch loss. Its two backward passes (``loss``
  with ``retain_graph``, then ``loss_g``) accumulate into one gradient, that of ``L_personal +
  L_meme`` with neither KL target detached and each KL the mean over ``B * C``
  (``nn.KLDivLoss()``). Its gradient clipping (norm 10 per model) is not reproduced.
- ``server_average = "uniform"``: the reference's ``1 / len(uploaded_ids)`` mean of the memes'
  parameters instead of the sample-weighted one (buffers are averaged alike).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._distill import (
    build_shared_model,
    check_member,
    initial_shared_state,
    kl_rows,
    small_member,
)
from fedmosaic.algorithms._shared import SharedState, weighted_average
from fedmosaic.core import secure
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ALGORITHMS

LossForm = Literal["detached", "htfllib"]
ServerAverage = Literal["samples", "uniform"]


class MemeExtras(nn.Module):
    """Client extras: the local copy of the shared meme model."""

    def __init__(self, meme: ClientModel) -> None:
        super().__init__()
        self.meme = meme


def mutual_losses(
    personal_logits: Tensor, meme_logits: Tensor, y: Tensor, alpha: float, beta: float
) -> tuple[Tensor, Tensor]:
    """Deep mutual learning losses ``(L_personal, L_meme)`` for one batch.

    ``L_personal = alpha CE(z_p, y) + (1 - alpha) KL(softmax(z_m) || softmax(z_p))`` and
    ``L_meme = beta CE(z_m, y) + (1 - beta) KL(softmax(z_p) || softmax(z_m))``, KL averaged over
    the batch (``batchmean``) and each KL target detached.
    """
    ce_p = F.cross_entropy(personal_logits, y)
    ce_m = F.cross_entropy(meme_logits, y)
    kl_p = kl_rows(personal_logits, meme_logits.detach()).mean()
    kl_m = kl_rows(meme_logits, personal_logits.detach()).mean()
    return alpha * ce_p + (1 - alpha) * kl_p, beta * ce_m + (1 - beta) * kl_m


def htfllib_mutual_loss(
    personal_logits: Tensor, meme_logits: Tensor, y: Tensor, alpha: float, beta: float
) -> Tensor:
    """HtFLlib's ``loss + loss_g`` (``loss_form = "htfllib"``); its two backward passes sum.

    ``alpha CE(z_p, y) + (1 - alpha) KL(p_m || p_p) / C + beta CE(z_m, y) + (1 - beta) KL(p_p ||
    p_m) / C`` with KL averaged over the batch and nothing detached: each KL also pulls its target
    towards the other model.
    """
    c = personal_logits.shape[1]
    kl_p = kl_rows(personal_logits, meme_logits).mean() / c  # nn.KLDivLoss(): mean over B * C
    kl_m = kl_rows(meme_logits, personal_logits).mean() / c
    ce_p = F.cross_entropy(personal_logits, y)
    ce_m = F.cross_entropy(meme_logits, y)
    return alpha * ce_p + (1 - alpha) * kl_p + beta * ce_m + (1 - beta) * kl_m


@ALGORITHMS.register("fml")
@dataclass(frozen=True)
class FML(Algorithm[dict[str, Tensor], SharedState, SharedState]):
    """Federated mutual learning: a shared meme model distils to and from each personal model."""

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    alpha: float = 0.5  # personal model: weight of CE vs (1 - alpha) of KL to the meme
    beta: float = 0.5  # meme model: weight of CE vs (1 - beta) of KL to the personal model
    meme_arch: str = ""  # zoo architecture of the meme; "" = the family's smallest member
    loss_form: LossForm = "detached"  # "htfllib": the reference's undetached, 1/C-scaled KL terms
    server_average: ServerAverage = "samples"  # "uniform": the reference's plain mean of memes

    supports_heterogeneous: ClassVar[bool] = True
    paper: ClassVar[str] = "Shen et al., Federated Mutual Learning, arXiv:2006.16765, 2020"

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} = {v} must be in [0, 1]")

    def check(self, spec: FederationSpec) -> None:
        check_member(self.meme_arch, "meme_arch", spec)

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> dict[str, Tensor]:
        return initial_shared_state(small_member(self.meme_arch, spec), spec, "fml-meme")

    def broadcast(self, state: dict[str, Tensor], client_id: int, round_num: int) -> SharedState:
        return SharedState(state)

    def aggregate(
        self, state: dict[str, Tensor], uploads: Sequence[Weighted[SharedState]], round_num: int
    ) -> dict[str, Tensor]:
        states = [u.payload.state for u in uploads]
        return weighted_average(states, [self._weight(u.weight) for u in uploads], reference=state)

    def _weight(self, samples: float) -> float:
        return 1.0 if self.server_average == "uniform" else samples

    def summands(self, upload: SharedState, weight: float) -> dict[str, Tensor]:
        return secure.state_terms(upload.state, self._weight(weight))

    def from_sums(
        self, state: dict[str, Tensor], sums: Mapping[str, Tensor], round_num: int
    ) -> Weighted[SharedState]:
        mean, total = secure.state_from_terms(sums, state)
        return Weighted(-1, total, SharedState(mean))

    def upload_names(self, state: dict[str, Tensor], upload: SharedState) -> dict[str, Any]:
        return {"shared": state}

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        return MemeExtras(build_shared_model(small_member(self.meme_arch, spec), spec))

    def receive(self, model: ClientModel, extras: nn.Module, msg: SharedState) -> None:
        cast(MemeExtras, extras).meme.load_part_state("all", msg.state)  # init_client's extras

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: SharedState
    ) -> Tensor:
        meme = cast(MemeExtras, extras).meme  # init_client's extras
        if self.loss_form == "htfllib":
            return htfllib_mutual_loss(model(x), meme(x), y, self.alpha, self.beta)
        l_personal, l_meme = mutual_losses(model(x), meme(x), y, self.alpha, self.beta)
        # Detached targets: the sum trains each model on its own loss only.
        return l_personal + l_meme

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: SharedState
    ) -> SharedState:
        return SharedState(cast(MemeExtras, extras).meme.part_state("all"))  # init_client's

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: SharedState
    ) -> dict[str, Tensor]:
        return {"acc": model(x), "acc_meme": cast(MemeExtras, extras).meme(x)}
