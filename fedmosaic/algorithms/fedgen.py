"""FedGen (Zhu, Hong, Zhou, Data-Free Knowledge Distillation for Heterogeneous Federated Learning,
ICML 2021), in HtFLlib's heterogeneous-model form: shared heads, local encoders.

Shared: the classifier head ``Linear(feature_dim, C)`` (sample-weighted average) and a feature
generator ``G(z, y) -> [feature_dim]`` that lives on the server. Clients upload their head and
their training label counts ``[C]``; the server trains ``G`` so that the label-count-weighted
ensemble of the uploaded heads classifies ``G(z, y)`` as ``y`` (plus FedGen's diversity term) and
broadcasts the averaged head, ``G`` and the label distribution. Each client keeps its own encoder
(any architecture), loads the global head and trains on
``CE(h(f(x)), y) + gen_lam * CE(h(G(z, y')), y')`` with ``y'`` drawn from the label distribution
and ``G`` frozen. Prediction: the client's model with the global head.

Choices and differences from the reference code (official FedGen ``serverpFedGen.py`` /
``userpFedGen.py``; HtFLlib ``servergen.py`` / ``clientgen.py``):

- The generator persists and is trained every round, starting from the previous round's weights
  (kept in the server state, a fresh Adam each round as HtFLlib). HtFLlib's ``train_generator``
  loads the saved generator, trains the loaded copy and never saves it, so its clients always
  distill from the untrained initial generator: not copied.
- Teacher (``teacher = "logits"``, default): ``CE(sum_k w_ky head_k(G(z, y)), y)`` with
  ``w_ky = n_ky / sum_k' n_k'y`` from this round's uploaded label counts (the paper's ensemble of
  the clients' predictors, weighted per class as the official code's ``get_label_weights``).
  ``teacher = "losses"`` is what the official code optimizes, ``sum_k mean_b(w_ky * CE(head_k(G),
  y))``. HtFLlib weights whole clients by sample count regardless of the label.
- Diversity regularizer: the official ``DiversityLoss(metric="l1")``,
  ``exp(-mean_ab(mean_i (z_ai - z_bi)^2 * mean_j |G_aj - G_bj|))`` over all pairs of the batch,
  weight ``eta = 1`` (official ``ensemble_eta``); HtFLlib drops it (``eta = 0`` reproduces that).
- Labels for the generator step are drawn in proportion to the participants' uploaded counts, and
  clients draw ``y'`` from the same distribution (broadcast ``label_probs [C]``). HtFLlib computes
  these counts on the server from every client's data at start-up; the official code samples
  uniformly over labels some selected client holds.
- Noise ``z ~ N(0, I)`` as the paper writes (both codes call ``torch.rand``, uniform on [0, 1),
  under a comment "sampling from Gaussian"). All server randomness comes from the seeded server
  stream, so runs are deterministic.
- The client term starts once a generator has been trained (round 2 on), like the official code's
  ``regularization = glob_iter > 0``; HtFLlib applies the untrained generator from round 1. The
  generator is used in eval mode on clients (BatchNorm running statistics; as the official code;
  HtFLlib leaves it in train mode). Generated batch = the real batch's size (HtFLlib); weight
  ``gen_lam = 1`` (HtFLlib). The official code's decaying ``generative_alpha = 10`` and its extra
  latent-matching term ``generative_beta`` are not part of the paper's objective and are omitted.
- Defaults from HtFLlib's run script (``-nd 32 -glr 0.1 -hd 512 -se 100``, ``-lbs 10``). Its
  ``generator_lr = 0.1`` was never exercised there (the generator is never updated, see above);
  with a persistent generator the generated features grow in norm round after round (on FMNIST,
  over 100x the real features' norm after 40 rounds) while the global head classifies them
  perfectly, and accuracy was not hurt in our runs. The official FedGen rate ``3e-4`` (MNIST
  ``ensemble_lr``) grows them more slowly. Weight decay 0 (HtFLlib; official 1e-2), no
  learning-rate decay (official: 0.98 per round).

Heads must be identical across clients (``check_same_heads``); encoders may differ.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedmosaic.algorithms._shared import weighted_average
from fedmosaic.algorithms.lg_fedavg import check_same_heads
from fedmosaic.core import seeding
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Phase, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Counts, Update
from fedmosaic.models.build import build_head, split_member

Teacher = Literal["logits", "losses"]


class FeatureGenerator(nn.Module):
    """``G(z, y)``: ``[z, onehot(y)] -> Linear -> BatchNorm -> ReLU -> Linear -> [feature_dim]``.

    The architecture of both reference codes (official FedGen's ``Generator`` with one hidden
    layer and its ``representation_layer``). Noise is an input, so callers control randomness.
    """

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int):
        super().__init__()
        self.noise_dim = noise_dim
        self.num_classes = num_classes
        self.fc1 = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.bn = nn.BatchNorm1d(hidden_dim)
        self.fc = nn.Linear(hidden_dim, feature_dim)

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        onehot = F.one_hot(y, self.num_classes).to(z.dtype)  # [B, C]
        h = F.relu(self.bn(self.fc1(torch.cat([z, onehot], dim=1))))  # [B, hidden]
        return self.fc(h)  # [B, feature_dim]


class FedGenExtras(nn.Module):
    """Client-side copy of the server's generator: frozen, always in eval mode."""

    def __init__(self, generator: FeatureGenerator) -> None:
        super().__init__()
        self.generator = generator.requires_grad_(False)

    def train(self, mode: bool = True) -> FedGenExtras:
        # The training loop puts extras in train mode; the frozen generator must keep using its
        # BatchNorm running statistics (the official client calls generative_model.eval()).
        super().train(mode)
        self.generator.eval()
        return self


@dataclass(frozen=True)
class FedGenBroadcast(Payload):
    """The averaged head, the generator and the label distribution it was trained on."""

    head: dict[str, Tensor]  # global head state, e.g. weight [C, d], bias [C]
    generator: dict[str, Tensor]  # FeatureGenerator state dict (parameters + BatchNorm buffers)
    label_probs: Tensor  # [C] float32; labels y' are drawn from it (zeros before round 1)
    trained: bool  # False until the generator has been trained once: clients skip the term


@dataclass(frozen=True)
class FedGenUpload(Payload):
    """A client's head after local training and its training label counts."""

    head: Annotated[dict[str, Tensor], "like head", Update("head")]  # updates the global head
    # training label counts
    counts: Annotated[Tensor, "[C] int64 >= 0 sum <= MAX_EXAMPLES", Counts()]


@dataclass
class FedGenState:
    """Server state (CPU), plain data: the global head, the persistent generator's state dict and
    its label distribution; both are evaluated with ``functional_call`` on an architecture-only
    (meta-device) module rebuilt from the shapes and ``head_arch``."""

    head: dict[str, Tensor]
    generator: dict[str, Tensor]  # FeatureGenerator state dict (parameters + BatchNorm buffers)
    label_probs: Tensor  # [C] float32
    trained: bool
    seed: int
    head_arch: str  # the clients' (shared) head spec, e.g. "linear" or "mlp512"


def teacher_weights(counts: Tensor) -> Tensor:
    """``w_ky = n_ky / sum_k' n_k'y`` from label counts ``[K, C]``; columns with no data are 0."""
    counts = counts.to(torch.float32)
    return counts / counts.sum(0, keepdim=True).clamp(min=1.0)  # [K, C]


def ensemble_logits(head_logits: Tensor, weights: Tensor, y: Tensor) -> Tensor:
    """``sum_k w_{k, y_b} * head_logits[k, b]``: the per-class weighted teacher, ``[B, C]``.

    ``head_logits [K, B, C]`` are the uploaded heads' outputs, ``weights [K, C]``, ``y [B]``.
    """
    return (weights[:, y].unsqueeze(-1) * head_logits).sum(0)


def diversity_loss(noise: Tensor, features: Tensor) -> Tensor:
    """FedGen's diversity term: ``exp(-mean_ab(d_z(a, b) * d_G(a, b)))`` over all ``B x B`` pairs.

    ``d_z`` is the mean squared difference of the noise rows, ``d_G`` the mean absolute difference
    of the generated rows (official ``DiversityLoss(metric="l1")``). Small when different noise
    gives different features, so minimizing it discourages mode collapse.
    """
    d_z = (noise.unsqueeze(0) - noise.unsqueeze(1)).pow(2).mean(-1)  # [B, B]
    d_g = (features.unsqueeze(0) - features.unsqueeze(1)).abs().mean(-1)  # [B, B]
    return torch.exp(-(d_z * d_g).mean())


@functools.lru_cache(maxsize=8)
def _generator_skeleton(
    noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int
) -> FeatureGenerator:
    with torch.device("meta"):  # architecture only: no weights drawn, no RNG touched
        return FeatureGenerator(noise_dim, num_classes, hidden_dim, feature_dim)


@functools.lru_cache(maxsize=8)
def _head_skeleton(head_arch: str, feature_dim: int, num_classes: int) -> nn.Module:
    with torch.device("meta"):
        return build_head(head_arch, feature_dim, num_classes).eval()


def generator_module(
    state: dict[str, Tensor], num_classes: int, training: bool = False
) -> FeatureGenerator:
    """The architecture of a generator state dict (``functional_call`` supplies its tensors);
    ``training``: BatchNorm on batch statistics, updating the state's running ones in place."""
    hidden, inputs = state["fc1.weight"].shape
    feature_dim = state["fc.weight"].shape[0]
    skeleton = _generator_skeleton(inputs - num_classes, num_classes, hidden, feature_dim)
    return skeleton.train(training)


def generator_loss(
    generator: Callable[[Tensor, Tensor], Tensor],
    head_module: nn.Module,
    heads: Sequence[dict[str, Tensor]],
    weights: Tensor,
    z: Tensor,
    y: Tensor,
    eta: float,
    teacher: str = "logits",
) -> Tensor:
    """The server's objective for one batch: teacher CE on ``G(z, y)`` + ``eta`` * diversity."""
    feats = generator(z, y)  # [B, d]
    logits = torch.stack([functional_call(head_module, h, (feats,)) for h in heads])  # [K, B, C]
    if teacher == "logits":
        loss = F.cross_entropy(ensemble_logits(logits, weights, y), y)
    else:  # "losses": the official code's weighted sum of per-head cross-entropies
        per_head = torch.stack([F.cross_entropy(lg, y, reduction="none") for lg in logits])
        loss = (weights[:, y] * per_head).sum(0).mean()  # per_head [K, B]
    if eta > 0:
        loss = loss + eta * diversity_loss(z, feats)
    return loss


def generated_features(
    generator: nn.Module, label_probs: Tensor, n: int, noise_dim: int
) -> tuple[Tensor, Tensor]:
    """``(G(z, y'), y')`` for ``n`` fresh samples, no gradient (the generator is frozen here).

    Draws ``y'`` and ``z`` from torch's global RNG (seeded per round and client by the runtime).
    """
    y = torch.multinomial(label_probs, n, replacement=True)  # [n]
    z = seeding.randn(n, noise_dim).to(label_probs.device)  # [n, noise_dim]
    with torch.no_grad():
        feats = generator(z, y)  # [n, d]
    return feats, y


def generated_ce(
    head: nn.Module, generator: nn.Module, label_probs: Tensor, n: int, noise_dim: int
) -> Tensor:
    """``CE(head(G(z, y')), y')`` on ``n`` fresh samples; gradients reach the head only."""
    feats, y = generated_features(generator, label_probs, n, noise_dim)
    return F.cross_entropy(head(feats), y)


@ALGORITHMS.register("fedgen")
@dataclass(frozen=True)
class FedGen(Algorithm[FedGenState, FedGenBroadcast, FedGenUpload]):
    """Shared heads plus a server-trained feature generator that regularizes the heads."""

    secure_refusal: ClassVar[str] = "its server trains the generator against each client's head"

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    gen_lam: float = 1.0  # weight of CE(head(G(z, y')), y') in the client loss (HtFLlib: 1)
    noise_dim: int = 32  # generator noise size (HtFLlib run script -nd 32; official MNIST 32)
    hidden_dim: int = 512  # generator hidden width (HtFLlib run script -hd 512)
    generator_lr: float = 0.1  # Adam learning rate of the generator (HtFLlib run script -glr)
    generator_steps: int = 100  # generator updates per round, one batch each (HtFLlib -se 100)
    generator_batch_size: int = 10  # labels per generator step (HtFLlib: client batch size 10)
    eta: float = 1.0  # weight of the diversity regularizer (official ensemble_eta; HtFLlib 0)
    teacher: Teacher = "logits"  # logits: CE of the weighted logit ensemble | losses: official code

    supports_heterogeneous: ClassVar[bool] = True
    paper: ClassVar[str] = (
        "Zhu, Hong, Zhou, Data-Free Knowledge Distillation for Heterogeneous Federated Learning, "
        "ICML 2021"
    )

    def __post_init__(self) -> None:
        if self.noise_dim < 1 or self.hidden_dim < 1:
            raise ValueError("noise_dim and hidden_dim must be >= 1")
        if self.generator_steps < 0:
            raise ValueError(f"generator_steps = {self.generator_steps} must be >= 0")
        if self.generator_batch_size < 2:
            raise ValueError(  # BatchNorm and the pairwise diversity term need two samples
                f"generator_batch_size = {self.generator_batch_size} must be >= 2"
            )
        if self.generator_lr <= 0:
            raise ValueError(f"generator_lr = {self.generator_lr} must be > 0")
        if self.gen_lam < 0 or self.eta < 0:
            raise ValueError("gen_lam and eta must be >= 0")

    def check(self, spec: FederationSpec) -> None:
        check_same_heads(spec, "fedgen")

    def _generator(self, spec: FederationSpec) -> FeatureGenerator:
        return FeatureGenerator(self.noise_dim, spec.num_classes, self.hidden_dim, spec.feature_dim)

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> FedGenState:
        head = {
            k: v.detach().cpu().clone() for k, v in spec.build_model(0).head.state_dict().items()
        }
        # The generator's initial weights come from their own server stream; the caller's global
        # RNG state is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeding.derive(spec.seed, 0, seeding.SERVER, "fedgen-init"))
            generator = self._generator(spec).state_dict()
        return FedGenState(
            head=head,
            generator={k: v.detach().clone() for k, v in generator.items()},
            label_probs=torch.zeros(spec.num_classes),
            trained=False,
            seed=spec.seed,
            head_arch=split_member(spec.members[0])[1],  # one head for all (check_same_heads)
        )

    def broadcast(self, state: FedGenState, client_id: int, round_num: int) -> FedGenBroadcast:
        gen_state = {k: v.clone() for k, v in state.generator.items()}
        return FedGenBroadcast(state.head, gen_state, state.label_probs, state.trained)

    def upload_names(self, state: FedGenState, upload: FedGenUpload) -> dict[str, Any]:
        return {"C": state.label_probs.shape[0], "head": state.head}

    def aggregate(
        self, state: FedGenState, uploads: Sequence[Weighted[FedGenUpload]], round_num: int
    ) -> FedGenState:
        heads = [u.payload.head for u in uploads]
        head = weighted_average(heads, [u.weight for u in uploads], reference=state.head)
        counts = torch.stack([u.payload.counts for u in uploads])  # [K, C]
        total = counts.sum(0).to(torch.float32)  # [C]
        if float(total.sum()) <= 0:  # no labels to train on: keep the previous generator
            return dataclasses.replace(state, head=head)
        label_probs = total / total.sum()  # [C]
        # Continue from last round's generator (copies: the previous state stays as it was).
        generator = {k: v.clone() for k, v in state.generator.items()}
        trained = state.trained
        if self.generator_steps > 0:
            gen = seeding.torch_generator(state.seed, round_num, seeding.SERVER, "fedgen")
            self.train_generator(generator, state.head_arch, heads, counts, label_probs, gen)
            trained = True
        return dataclasses.replace(
            state, head=head, generator=generator, label_probs=label_probs, trained=trained
        )

    def train_generator(
        self,
        generator: dict[str, Tensor],
        head_arch: str,
        heads: Sequence[dict[str, Tensor]],
        counts: Tensor,
        label_probs: Tensor,
        gen: torch.Generator,
    ) -> None:
        """``generator_steps`` Adam steps on the teacher + diversity objective, on the generator's
        state dict in place (BatchNorm running statistics included); a fresh Adam each round."""
        weights = teacher_weights(counts)  # [K, C]
        heads = [{k: v.detach() for k, v in h.items()} for h in heads]
        c = label_probs.shape[0]
        module = generator_module(generator, c, training=True)
        params = [generator[k].requires_grad_(True) for k, _ in module.named_parameters()]
        head = _head_skeleton(head_arch, generator["fc.weight"].shape[0], c)

        def forward(z: Tensor, y: Tensor) -> Tensor:
            return functional_call(module, generator, (z, y))

        opt = torch.optim.Adam(params, lr=self.generator_lr)
        b = self.generator_batch_size
        with torch.enable_grad():
            for _ in range(self.generator_steps):
                y = torch.multinomial(label_probs, b, replacement=True, generator=gen)  # [b]
                z = seeding.randn(b, self.noise_dim, generator=gen)  # [b, noise_dim]
                loss = generator_loss(forward, head, heads, weights, z, y, self.eta, self.teacher)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        module.eval()
        for p in params:
            p.requires_grad_(False)
            p.grad = None

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        # Placeholder weights: every receive overwrites them with the server's generator.
        return FedGenExtras(self._generator(spec))

    def receive(self, model: ClientModel, extras: nn.Module, msg: FedGenBroadcast) -> None:
        model.load_part_state("head", msg.head)
        cast(FedGenExtras, extras).generator.load_state_dict(msg.generator)  # init_client's

    def phases(self, round_num: int, epochs: int) -> Sequence[Phase]:
        # The generator is frozen on clients: never hand it to the optimizer.
        return (Phase(("all",), epochs, train_extras=False),)

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: FedGenBroadcast
    ) -> Tensor:
        features = model.features(x)  # [B, d]
        if self.gen_lam == 0 or not msg.trained:
            return F.cross_entropy(model.head(features), y)
        b = x.shape[0]
        gen_feats, gen_y = generated_features(
            cast(FedGenExtras, extras).generator, msg.label_probs, b, self.noise_dim
        )  # [B, d], [B]
        # One head call on real and generated rows (heads act row-wise): the same values as two
        # calls, and the head's layers stay eligible for the fused SGD update.
        logits = model.head(torch.cat([features, gen_feats.to(features.dtype)]))  # [2B, C]
        ce = F.cross_entropy(logits[:b], y)
        return ce + self.gen_lam * F.cross_entropy(logits[b:], gen_y)

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: FedGenBroadcast
    ) -> FedGenUpload:
        return FedGenUpload(model.part_state("head"), data.class_counts("train"))
