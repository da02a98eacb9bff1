"""FedClassAvg (Jang et al., ICPP 2022): classifier averaging plus local contrastive learning.

Jang, Ha, Jung, Yoon. FedClassAvg: Local Representation Learning for Personalized Federated
Learning on Heterogeneous Neural Networks. ICPP 2022.

Shared: the classifier head ``Linear(feature_dim, C)`` only (sample-weighted average, Eq. 3);
each client's encoder stays local, so encoders may differ. Client loss per batch (Eq. 4):
``SupCon(F(x'), F(x''), y) + CE(C(F(x')), y) + rho * ||w_C - w_C_global||_2`` on two augmented
views x', x'' of the batch, the proximal term being Eq. 5's unsquared L2 distance over the head's
weight and bias (with a zero gradient, not NaN, at distance 0 - the start of every round).
Evaluated (``acc``): each client's model as Algorithm 1 outputs it, ``w_k = w_F_k + w_C_k``: its
encoder with its own classifier as it was after its last local training (the reference code
evaluates the same); ``acc_global``: the encoder with the global head received before evaluation.

Where we differ from the reference code (github.com/hukla/FedClassAvg), with its form as options:
- proximal term: the code uses ``rho/2 * sum_tensors mean((w - w_g)^2)`` (``prox="mse"``) and skips
  it on the first batch (where it is 0 anyway); the paper's Eq. 5 is the default.
- SupCon: the code uses temperature 100 on unnormalized features and Khosla's code's loss scale
  ``temperature / base_temperature`` (base 0.07); reproduce with ``normalize=False,
  temperature=100, base_temperature=0.07``. Default: the SupCon loss the paper cites (Khosla et
  al.), features L2-normalized, scale 1, temperature 0.07 (the paper states none; 0.07 is the
  default of Khosla et al.'s code).
- augmentations are tensor ops (``_augment.py``): resized crop (scale 0.2-1), flip,
  brightness/contrast jitter on every image; the code's torchvision pipeline applies its
  ``ColorJitter(0.4, 0.4, 0.4, 0.1)`` (brightness, contrast, saturation, hue) with p = 0.8 and
  random grayscale with p = 0.2; saturation, hue and grayscale do not apply to normalized
  grayscale tensors.
- the code's classifier is ``ReLU -> Linear`` on the feature extractor's last FC output, so its
  SupCon sees features before the ReLU; ours is the zoo's plain ``Linear`` head on the encoder's
  output, which ends in a ReLU for most zoo encoders (SupCon then sees non-negative features).
- the code trains with Adam (lr 1e-4, betas 0.5/0.999, batch 64): set it in ``[train]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmosaic.algorithms._augment import augment
from fedmosaic.algorithms._shared import SharedState, SharedWeights, StoredState
from fedmosaic.algorithms.lg_fedavg import check_same_heads
from fedmosaic.core.algorithm import Acceleration, FederationSpec
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ALGORITHMS

ProxForm = Literal["l2", "squared", "mse"]


def supcon_loss(
    f1: Tensor,
    f2: Tensor,
    y: Tensor,
    temperature: float = 0.07,
    normalize: bool = True,
    base_temperature: float = 0.0,
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020, L_out) over two views of a batch.

    ``f1, f2 [B, d]`` are the features of the two views, ``y [B]`` the labels. Every one of the
    ``2B`` features is an anchor; its positives are the other features with the same label (at
    least its other view), its contrast set every other feature:
    ``L = scale * mean_i -1/|P(i)| sum_{p in P(i)} log(exp(z_i.z_p/t) / sum_{a != i} exp(z_i.z_a/t))``
    with ``scale = temperature / base_temperature`` (1 when ``base_temperature`` is 0).
    """
    z = torch.cat([f1, f2], 0)  # [2B, d]
    if normalize:
        z = F.normalize(z, dim=1)
    n = z.shape[0]
    labels = torch.cat([y, y], 0)  # [2B]
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)  # [2B, 2B]
    logits = (z @ z.T) / temperature  # [2B, 2B]
    # log p(a | i) over a != i; the diagonal is excluded from the normalizer.
    log_prob = logits - torch.logsumexp(logits.masked_fill(self_mask, float("-inf")), 1, True)
    pos = (labels[:, None] == labels[None, :]) & ~self_mask  # [2B, 2B]
    mean_log_prob_pos = (log_prob * pos).sum(1) / pos.sum(1)  # [2B]; every anchor has >= 1
    scale = 1.0 if base_temperature == 0 else temperature / base_temperature
    return -scale * mean_log_prob_pos.mean()


def _safe_sqrt(s: Tensor) -> Tensor:
    """``sqrt(s)`` with gradient 0 (not inf/NaN) at ``s = 0``; exact elsewhere."""
    pos = s > 0
    return torch.where(
        pos, torch.sqrt(torch.where(pos, s, torch.ones_like(s))), torch.zeros_like(s)
    )


def prox_term(head: nn.Module, global_state: dict[str, Tensor], form: str = "l2") -> Tensor:
    """Distance of the head's parameters to the global head (without the ``rho`` factor).

    ``l2``: ``||w - w_g||_2`` over all parameters concatenated (weight and bias; Eq. 5).
    ``squared``: ``1/2 ||w - w_g||_2^2`` (FedProx's form).
    ``mse``: ``1/2 sum_tensors mean((w - w_g)^2)`` (the reference code's ``MSELoss`` sum).
    """
    sq: Tensor | None = None
    for name, p in head.named_parameters():
        diff = (p - global_state[name].to(p.dtype)).pow(2)
        term = diff.mean() if form == "mse" else diff.sum()
        sq = term if sq is None else sq + term
    if sq is None:
        raise ValueError("proximal term over a head without parameters")
    if form == "l2":
        return _safe_sqrt(sq)
    if form in ("squared", "mse"):
        return 0.5 * sq
    raise ValueError(f"prox = {form!r}; choose one of {get_args(ProxForm)}")


@ALGORITHMS.register("fedclassavg")
@dataclass(frozen=True)
class FedClassAvg(SharedWeights):
    """Average the classifier head; train local encoders with SupCon + CE + head proximal term."""

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    rho: float = 0.1  # proximal strength on the head's distance to the global head (paper: 0.1 CIFAR/EMNIST, 0.4662 FMNIST)
    prox: ProxForm = "l2"  # l2 (Eq. 5, unsquared) | squared (rho/2 ||.||^2) | mse (reference code)
    contrastive: bool = True  # add the SupCon loss on two augmented views (Table 4 ablation)
    temperature: float = 0.07  # SupCon temperature (Khosla et al.'s code; reference code: 100)
    base_temperature: float = 0.0  # SupCon scale t/base_t; 0 -> scale 1 (reference code: 0.07)
    normalize: bool = True  # L2-normalize features inside SupCon (reference code: False)
    augment: bool = True  # augment the views; False feeds x itself (then == LG-FedAvg at rho=0)

    shared: ClassVar[str] = "head"
    paper: ClassVar[str] = (
        "Jang et al., FedClassAvg: Local Representation Learning for Personalized Federated "
        "Learning on Heterogeneous Neural Networks, ICPP 2022"
    )

    def __post_init__(self) -> None:
        # ValueError: the config loader reports it as a ConfigError naming [algorithm].
        if self.temperature <= 0 or self.base_temperature < 0 or self.rho < 0:
            raise ValueError("temperature must be > 0, base_temperature >= 0 and rho >= 0")

    def check(self, spec: FederationSpec) -> None:
        check_same_heads(spec, "fedclassavg")

    # ---- client half (server half: SharedWeights' sample-weighted head average) ------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        return StoredState(model.part_state("head"))  # the client's own head

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: SharedState
    ) -> Tensor:
        x1 = augment(x) if self.augment else x  # x' [B, ...]
        if self.contrastive:
            x2 = augment(x) if self.augment else x  # x'' [B, ...]
            # One pass over both views (as SupCon's reference and FedClassAvg's code do).
            f1, f2 = model.features(torch.cat([x1, x2], 0)).split(x.shape[0])  # [B, d] each
            loss = F.cross_entropy(model.head(f1), y) + supcon_loss(
                f1, f2, y, self.temperature, self.normalize, self.base_temperature
            )
        else:
            loss = F.cross_entropy(model.head(model.features(x1)), y)
        if self.rho > 0:
            loss = loss + self.rho * prox_term(model.head, msg.state, self.prox)
        return loss

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: SharedState
    ) -> SharedState:
        head = model.part_state("head")
        if isinstance(extras, StoredState):
            extras.store(head)  # the personalized classifier: the headline ``acc``
        return SharedState(head)

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: SharedState
    ) -> dict[str, Tensor]:
        f = model.features(x)  # [B, d]
        glob = model.head(f)  # the global head, received before evaluation
        if not isinstance(extras, StoredState):
            return {"acc": glob}
        # Algorithm 1's output w_k = w_F_k + w_C_k: the client's classifier after its local update
        return {"acc": functional_call(model.head, extras.state(), (f,)), "acc_global": glob}
