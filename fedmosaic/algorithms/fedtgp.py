"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with adaptive-margin contrastive learning.

Zhang, Liu, Hua, Cao. FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced
Contrastive Learning for Data and Model Heterogeneity in Federated Learning. AAAI 2024.

Shared: per-class prototypes only. Clients upload the exact per-class mean feature of each class
they hold (``protos [k, d]`` + ``classes [k]``, k = |C_i|: the paper's ``K x |C_i|`` floats; never
class counts, the paper's privacy point);
the server trains global prototypes ``P_hat = F(Embedding(c))`` with the ACL loss (Eq. 10) and
broadcasts them. Client models (encoder and head, any architecture) stay local; the client loss is
``CE + lam * phi(f(x), P_hat[y])`` (Eq. 11) and inference is the nearest global prototype.
Once the server has trained, the broadcast holds all C global prototypes, classes no client has
uploaded yet included (the paper's and the reference's; ``unseen="zero"`` sends zero rows for
them instead, never predicted and without an alignment term).

Where we differ from the paper:
- client term: Eq. 11 is one distance per class, ``lam * E_{c in C_i} phi(P_i^c, P_hat^c)``
  between the client's class prototype and the global one; we use ``mean_i ||f(x_i) -
  P_hat[y_i]||`` over the batch, as FedProto's code applies its term per sample.

Where we differ from the reference code (github.com/TsingZ0/FedTGP, HtFLlib ``clienttgp.py`` /
``servertgp.py``), with its behaviour as options:
- uploaded prototypes: the reference's ``collect_protos()`` reloads the model from disk *before*
  ``train()`` saves the updated one, so it uploads the prototypes of the model before this round's
  training; we upload the trained model's prototypes (the paper's Algorithm 1, lines 7-9).
  ``stale_prototypes=True`` reproduces the reference.
- client distance: ours is the paper's Euclidean phi (``lam=0.1``) per sample (above); the
  reference uses ``MSELoss`` over the batch with ``lam=10`` (its run script). ``distance="mse"``
  gives the reference's form; ``lam`` stays a separate field, so reproducing the reference means
  ``distance="mse", lam=10``.
- prototypes: the reference collects them through its training loader (``shuffle=False,
  drop_last=True``), so the last partial batch is left out; ours are means over every training
  row. It also trains in that fixed order; ``train.shuffle = false`` gives it (the
  ``fedtgp_table10`` suite keeps ``shuffle = true``, ``drop_last = true``).
- server distance: the reference computes ``sqrt(|a|^2 - 2ab + |b|^2)``, NaN when rounding makes it
  negative and an infinite gradient at 0; we clamp the squared distance before the square root.
- adaptive margin (Eq. 9): ``delta(t) = min(max_c min_{c' != c} ||Q_c - Q_c'||, tau)``, the
  "maximum prototype margin" of the text and of the reference code (Eq. 9 as typeset reads as the
  maximum over all pairs). With fewer than two classes uploaded in a round the margin is undefined:
  we use 0 where the reference ends up at ``tau``.
- server batch size: the reference uses the clients' batch size (10 in its script): our default.
- server step speed: each server step is plain autograd + ``torch.optim.SGD``; with
  ``server_fused_sgd`` (default) and ``fedmosaic.accel`` installed it runs written out by hand
  (``accel/prototypes.py``: the ACL gradient, then the MLP's backward with its SGD update in the
  same pass over each weight), the same step to float rounding.
- inference before any global prototype exists: the reference reports accuracy 0; we fall back to
  the client's head (``acc`` = ``acc_head`` until the first aggregation).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmosaic.algorithms._shared import Distance, alignment_loss, class_means
from fedmosaic.core import seeding, training
from fedmosaic.core.aggregate import robust_rule_in_force, server_points
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, FitContext, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Claims, Rows

Margin = Literal["adaptive", "fixed", "none"]
Unseen = Literal["generator", "zero"]
EPS = 1e-12  # floor of squared distances before sqrt: finite gradients at distance 0


@dataclass(frozen=True)
class Prototypes(Payload):
    """Dense per-class prototypes; rows where ``known`` is False carry no information (zeros)."""

    protos: Tensor  # [C, d] float32
    known: Tensor  # [C] bool


@dataclass(frozen=True)
class ClientPrototypes(Payload):
    """A client's prototypes of the classes it holds only: ``k = |C_i|`` rows, sorted classes."""

    # row i: the prototype of class classes[i]; to the guard, bounded by the global prototypes
    protos: Annotated[
        Tensor, "[k, d] float32", Rows(classes="classes", ref="glob", known="known", features=True)
    ]
    classes: Annotated[Tensor, "[k] int64 increasing in [0, C)", Claims()]


class TrainablePrototypes(nn.Module):
    """``P_hat_c = F(P'_c)``: a trainable vector per class, then the shared MLP ``F`` (Fig. 3).

    ``F`` is ``Linear(d, d) -> ReLU -> Linear(d, d)``; ``mlp=False`` drops it (Table 6 ablation).
    """

    def __init__(self, num_classes: int, feature_dim: int, mlp: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, feature_dim)
        self.mlp: nn.Module = (
            nn.Sequential(
                nn.Linear(feature_dim, feature_dim),
                nn.ReLU(),
                nn.Linear(feature_dim, feature_dim),
            )
            if mlp
            else nn.Identity()
        )

    def forward(self) -> Tensor:
        return self.mlp(self.embedding.weight)  # [C, d]


@functools.lru_cache(maxsize=8)
def _skeleton(num_classes: int, feature_dim: int, mlp: bool) -> TrainablePrototypes:
    with torch.device("meta"):  # architecture only: no weights drawn, no RNG touched
        return TrainablePrototypes(num_classes, feature_dim, mlp)


def global_prototypes(params: dict[str, Tensor]) -> Tensor:
    """``P_hat [C, d]`` from the trainable prototypes' parameters (``embedding.weight [C, d]``
    and, with the MLP, ``mlp.0.*`` / ``mlp.2.*``), through :class:`TrainablePrototypes`."""
    c, d = params["embedding.weight"].shape
    return functional_call(_skeleton(c, d, "mlp.0.weight" in params), params, ())


@dataclass
class TGPState:
    """Server state: the trainable prototypes' parameters (persistent across rounds) and
    bookkeeping; plain tensors, so the state is a checkpoint as it is."""

    params: dict[str, Tensor]  # TrainablePrototypes' parameters by name
    known: Tensor  # [C] bool: classes some client has uploaded so far
    seed: int
    margin: float = 0.0  # delta(t) of the last aggregation
    loss: float = math.nan  # ACL loss of the last server minibatch
    num_points: int = 0  # (prototype, class) pairs in the last aggregation


# ---- math ------------------------------------------------------------------------------------
def euclidean_distances(points: Tensor, protos: Tensor) -> Tensor:
    """``||x_i - p_c||_2`` for ``points [N, d]``, ``protos [C, d]`` -> ``[N, C]``.

    Differences, not the ``|a|^2 - 2ab + |b|^2`` expansion, so the squared distance is never
    negative; it is clamped at ``EPS`` before the square root, so a prototype sitting exactly on a
    point has a finite (zero) gradient instead of NaN.
    """
    sq = (points.unsqueeze(1) - protos.unsqueeze(0)).pow(2).sum(-1)  # [N, C]
    return sq.clamp_min(EPS).sqrt()


def class_centers(points: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``Q_c``: unweighted mean of the uploaded prototypes of class c; ``present [C]`` bool."""
    sums = torch.zeros(num_classes, points.shape[1], dtype=points.dtype)
    sums.index_add_(0, labels, points)
    n = torch.bincount(labels, minlength=num_classes)  # [C]
    return sums / n.clamp_min(1).unsqueeze(1).to(points.dtype), n > 0


def adaptive_margin(points: Tensor, labels: Tensor, num_classes: int, tau: float) -> float:
    """Eq. 9: ``min(max_c min_{c' != c} ||Q_c - Q_c'||, tau)`` over the classes present.

    ``points [N, d]`` are the uploaded client prototypes, ``labels [N]`` their classes. With fewer
    than two classes present there is no margin to measure: 0.
    """
    q, present = class_centers(points, labels, num_classes)
    q = q[present]  # [K, d]
    if q.shape[0] < 2:
        return 0.0
    dist = torch.cdist(q.double(), q.double())  # [K, K]
    dist.fill_diagonal_(math.inf)
    return float(min(float(dist.min(1).values.max()), tau))


def acl_loss(points: Tensor, labels: Tensor, protos: Tensor, delta: float) -> Tensor:
    """Eq. 10 averaged over a minibatch: CE over logits ``-(dist + delta * onehot(y))``."""
    dist = euclidean_distances(points, protos)  # [N, C]
    onehot = F.one_hot(labels, protos.shape[0]).to(dist.dtype)
    return F.cross_entropy(-(dist + delta * onehot), labels)


def train_prototypes(
    params: dict[str, Tensor],
    points: Tensor,
    labels: Tensor,
    delta: float,
    epochs: int,
    batch_size: int,
    lr: float,
    gen: torch.Generator,
    fused: bool = True,
) -> float:
    """``epochs`` passes of SGD over shuffled minibatches of (prototype, class) pairs, on ``params``
    in place (leaf tensors; the caller passes copies).

    Every step recomputes all ``C`` global prototypes (all of them enter the denominator of Eq. 10,
    as in the paper). Returns the loss of the last step (NaN when there was nothing to train).

    Each step is ordinary torch: the global prototypes forward, the ACL loss, its backward and
    the SGD update. With ``fused`` (the default) and an accelerator installed
    (``fedmosaic.accel``, wired in by the assembly layer), the same step runs as its hand-written
    form instead (``training.FEDTGP_SERVER_STEP``: no autograd graph, each MLP weight's update inside its
    backward), equal to this one to float rounding.
    """
    acc = training.accelerator()
    fast = acc.step(training.FEDTGP_SERVER_STEP) if fused and acc is not None else None
    if any(p.dtype != torch.float32 for p in params.values()):
        fast = None  # the hand-written step is float32 only
    leaves = [] if fast is not None else [p.requires_grad_(True) for p in params.values()]
    opt = torch.optim.SGD(leaves, lr=lr) if fast is None else None
    last = math.nan
    n = points.shape[0]
    with torch.set_grad_enabled(fast is None):
        for _ in range(epochs):
            for pos in torch.randperm(n, generator=gen).split(batch_size):
                if fast is not None:
                    last = fast(params, points[pos], labels[pos], delta, lr, EPS)
                    continue
                assert opt is not None
                loss = acl_loss(points[pos], labels[pos], global_prototypes(params), delta)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                last = float(loss.detach())
    for p in leaves:
        p.requires_grad_(False)
        p.grad = None
    return last


def stale_buffers(extras: nn.Module) -> tuple[Tensor, Tensor]:
    """The client's ``stale_protos [C, d]`` and ``stale_known [C]`` buffers (``init_client``
    registers them with ``stale_prototypes``)."""
    return cast(Tensor, extras.stale_protos), cast(Tensor, extras.stale_known)


def nearest_prototype_scores(features: Tensor, protos: Tensor, known: Tensor) -> Tensor:
    """Scores ``-||f - P_c||`` (``[B, C]``); classes without a global prototype get ``-inf``."""
    dist = euclidean_distances(features, protos)
    return (-dist).masked_fill(~known.unsqueeze(0), -math.inf)


# ---- the algorithm -----------------------------------------------------------------------------
@ALGORITHMS.register("fedtgp")
@dataclass(frozen=True)
class FedTGP(Algorithm[TGPState, Prototypes, ClientPrototypes]):
    """Trainable global prototypes learned on the server with adaptive-margin contrastive loss."""

    secure_refusal: ClassVar[str] = (
        "its server trains the global prototypes on each client's prototypes (the margin loss)"
    )

    per_example_loss: ClassVar[bool] = True  # cross-entropy + the prototype term per row

    lam: float = 0.1  # weight of the prototype-alignment term (paper 0.1; reference mse form: 10)
    distance: Distance = "euclidean"  # client phi: euclidean (paper) | mse (reference code)
    tau: float = 100.0  # threshold capping the adaptive margin delta(t)
    margin: Margin = "adaptive"  # adaptive (Eq. 9) | fixed (fixed_margin) | none (Eq. 6, delta 0)
    fixed_margin: float = 1.0  # delta when margin = "fixed" (ours: the paper gives none for FM)
    mlp: bool = True  # further-processing MLP F after the embedding (False: Table 6 ablation)
    server_epochs: int = 100  # S: server epochs over the uploaded prototypes per round
    server_batch_size: int = 10  # server minibatch (the reference uses the client batch size, 10)
    server_lr: float = 0.01  # server SGD learning rate
    server_fused_sgd: bool = True  # server step by hand, SGD fused (False: autograd + SGD)
    stale_prototypes: bool = False  # True: upload pre-training prototypes (reference code)
    # classes no client has uploaded yet, once the server has trained: generator (paper, reference
    # code: every class's F(Embedding(c)) is broadcast and may be predicted) | zero (zero rows,
    # never predicted, no alignment term for them)
    unseen: Unseen = "generator"

    supports_heterogeneous: ClassVar[bool] = True
    acceleration: ClassVar[Acceleration] = Acceleration(batched=True, fused_sgd=True)
    paper: ClassVar[str] = (
        "Zhang et al., FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced "
        "Contrastive Learning for Data and Model Heterogeneity in Federated Learning, AAAI 2024"
    )

    def __post_init__(self) -> None:
        if self.server_epochs < 0 or self.server_batch_size < 1:
            raise ValueError("server_epochs must be >= 0 and server_batch_size >= 1")
        if self.server_lr <= 0 or self.lam < 0 or self.tau < 0 or self.fixed_margin < 0:
            raise ValueError("server_lr must be > 0; lam, tau and fixed_margin must be >= 0")

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> TGPState:
        # Seeded from the server's own stream: the same prototypes in every runtime.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeding.derive(spec.seed, 0, seeding.SERVER, "fedtgp-init"))
            module = TrainablePrototypes(spec.num_classes, spec.feature_dim, self.mlp)
        params = {k: v.detach() for k, v in module.named_parameters()}
        return TGPState(params, torch.zeros(spec.num_classes, dtype=torch.bool), spec.seed)

    def broadcast(self, state: TGPState, client_id: int, round_num: int) -> Prototypes:
        with torch.no_grad():
            protos = global_prototypes(state.params).float()  # [C, d]
        known = state.known.clone()  # [C] bool
        if self.unseen == "generator" and bool(known.any()):
            # After the first aggregation the generator gives a prototype for every class (the
            # paper's C global prototypes); before it there is none (nothing trained yet).
            known.fill_(True)
        protos = protos.masked_fill(~known.unsqueeze(1), 0.0)
        return Prototypes(protos.contiguous(), known)

    def upload_names(self, state: TGPState, upload: ClientPrototypes) -> dict[str, Any]:
        c, d = state.params["embedding.weight"].shape
        with torch.no_grad():
            glob = global_prototypes(state.params).float()  # [C, d]
        return {"C": c, "d": d, "glob": glob, "known": state.known}

    def margin_for(self, points: Tensor, labels: Tensor, num_classes: int) -> float:
        """delta(t) for this round's uploads, per the ``margin`` setting."""
        if self.margin == "adaptive":
            return adaptive_margin(points, labels, num_classes, self.tau)
        return self.fixed_margin if self.margin == "fixed" else 0.0

    def aggregate(
        self, state: TGPState, uploads: Sequence[Weighted[ClientPrototypes]], round_num: int
    ) -> TGPState:
        # The uploaded (prototype, class) pairs; weights (example counts) are not used: FedTGP
        # treats every client prototype alike (no class counts exist on the server).
        points = torch.cat([u.payload.protos for u in uploads]).float()  # [N, d]
        labels = torch.cat([u.payload.classes for u in uploads])  # [N]
        if points.shape[0] == 0:
            return state
        if robust_rule_in_force():  # clipped deviations from the global prototypes, per class
            with torch.no_grad():
                glob = global_prototypes(state.params).float()  # [C, d]
            points = server_points(points, labels, glob, state.known)
        num_classes = state.known.numel()
        delta = self.margin_for(points, labels, num_classes)
        params = {k: v.clone() for k, v in state.params.items()}  # the previous state stays as is
        gen = seeding.torch_generator(state.seed, round_num, seeding.SERVER, "fedtgp-server")
        loss = train_prototypes(
            params,
            points,
            labels,
            delta,
            self.server_epochs,
            self.server_batch_size,
            self.server_lr,
            gen,
            self.server_fused_sgd,
        )
        known = state.known.clone()
        known[labels] = True
        return TGPState(params, known, state.seed, delta, loss, int(points.shape[0]))

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        extras = nn.Module()
        if self.stale_prototypes:
            # The prototypes of the model as received, uploaded after training (reference code).
            extras.register_buffer("stale_protos", torch.zeros(spec.num_classes, spec.feature_dim))
            extras.register_buffer("stale_known", torch.zeros(spec.num_classes, dtype=torch.bool))
        return extras

    def before_fit(self, ctx: FitContext[Prototypes]) -> None:
        if self.stale_prototypes:
            data, extras = ctx.data, ctx.extras
            protos, counts = class_means(
                ctx.model, data, data.num_classes, ctx.settings.eval_batch_size
            )
            stale_protos, stale_known = stale_buffers(extras)
            stale_protos.copy_(protos)
            stale_known.copy_(counts > 0)

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: Prototypes
    ) -> Tensor:
        features = model.features(x)  # [B, d]
        ce = F.cross_entropy(model.head(features), y)
        if self.lam == 0:
            return ce
        # no branch on ``known`` (a host sync a CUDA graph cannot capture): with no global
        # prototype yet the alignment term is exactly 0, and so is its gradient
        return ce + self.lam * alignment_loss(features, y, msg.protos, msg.known, self.distance)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: Prototypes
    ) -> ClientPrototypes:
        if self.stale_prototypes:
            protos, has = stale_buffers(extras)
        else:
            protos, counts = class_means(model, data, data.num_classes)
            has = counts > 0
        # Exact per-class means of the classes held; the counts stay on the client.
        classes = has.nonzero().flatten().cpu()  # [k] int64, increasing
        return ClientPrototypes(protos[has].detach().float().cpu().contiguous(), classes)

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: Prototypes
    ) -> dict[str, Tensor]:
        features = model.features(x)  # [B, d]
        logits = model.head(features)  # [B, C]
        if not bool(msg.known.any()):
            # No global prototype yet (before the first aggregation): the head decides.
            return {"acc": logits, "acc_head": logits}
        return {
            "acc": nearest_prototype_scores(features, msg.protos, msg.known),
            "acc_head": logits,
        }
