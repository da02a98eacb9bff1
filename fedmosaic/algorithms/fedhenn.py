"""FedHeNN (Makhija et al., ICML 2022): align client representations through CKA on a shared RAD.

Makhija, Han, Ho, Ghosh. Architecture Agnostic Federated Learning for Neural Networks. ICML 2022.

Heterogeneous FedHeNN (Algorithm 2, Eq. 6). Shared: a server-held, unlabelled representation
alignment dataset (RAD) drawn from the public split, and L x L kernel matrices of representations
on it. Each client's model (any architecture, any representation width) stays local; its loss is
``CE + eta(t) * (1 - CKA(K_i, K_bar(t-1)))`` with ``K_i = kernel(A_i, A_i)`` computed with gradient
on the RAD (``A_i`` = the encoder's features) and ``K_bar = sum_j w_j K_j`` from last round's
clients. Clients upload their kernel ``K_j`` (not their weights, which the paper's server uses to
compute it: the kernel is all the server needs and keeps the models private).

Which RAD: the paper (and the reference code) compute ``K_bar`` and ``K_i`` on the *same* inputs.
Since clients compute ``K_j`` after training, the RAD they compute it on must be known one round
ahead: the broadcast of round t carries ``rad`` + ``kernel`` (the RAD of round t-1 and ``K_bar`` on
it, for the alignment term) and ``next_rad`` (round t's fresh RAD, drawn from the server stream
``(seed, t, SERVER, "fedhenn-rad")``, on which the client computes its upload ``K_j`` in eval mode
after training). This is the reference code's order: after round t it draws a new RAD, computes the
trained clients' kernels on it, and aligns round t+1 on that RAD. Round 1 has no ``K_bar``: CE only;
from round 2 on the downlink carries two RADs.

Which representation: ``Phi_i`` is "all but the last layer" of the client's own network (Sec. 3.3),
of width ``d_i`` ("d_i can vary with i"): models are built with no projection to a common
``model.feature_dim`` (``model_projection = "none"``), so the 5 CNNs of Sec. 4.1 align their own
penultimate layers (1 conv + 1 FC stays 1 conv + 1 FC).

Which mode: ``Phi_i(X; W_i)`` is a function of the weights, the same map the paper's server applies
to every client's weights to build ``K_bar``. Both the client's ``K_i`` (with gradient, every step)
and the uploaded ``K_j`` are computed with the network in eval mode (:func:`rad_kernel`): BatchNorm
normalizes the RAD with its running statistics and leaves them as training on local data alone
leaves them (the RAD is another distribution); dropout is off. The zoo's ``fedhenn5`` CNNs have no
BatchNorm and no dropout, so for them this equals train mode. (The reference's CIFAR-10 CNNs apply
Dropout(0.6) to the logits, and the CIFAR-100 ones before the penultimate output: what it aligns,
the log-softmax after that dropout, is a train-mode quantity there.)

Where we differ from the paper:
- round 1 has no alignment term; Algorithm 2 aligns round 1 to the kernels of the initial models
  ``W_j(0)`` (the reference has none either: its ``eta`` is 0 in its first round).
- ``K_bar`` averages the kernels received in the round; the paper's server recomputes all N
  clients' kernels from their last known weights (w_j = 1/N), which a kernel upload cannot do (a
  non-participant has no kernel on the new RAD).
- the RAD is ``min(rad_size, data.public_size)`` inputs of the public split: when the split is no
  larger than ``rad_size`` (``fedhenn_5cnn``'s quick, full and converged budgets: 200 public
  inputs, ``rad_size`` 5000) every round's RAD is the whole split in a new order, so every round
  aligns on the same inputs, where the paper samples a new RAD each round (Sec. 3.3).
- the heterogeneous families give client i member ``i % len(family)`` (``models/families.py``);
  the paper samples each client's CNN uniformly at random from the five.

Where we differ from the reference code (github.com/dishamakhija/FedHeNN):
- representations: the reference's models return ``(log_softmax, features)`` and its loss applies
  CE to the features and CKA to the log-probabilities; we follow the paper (CE on the head's
  logits, CKA on the encoder's features ``Phi``).
- the RAD comes from the server's public split (``data.public_size``), never from client data
  (the reference samples it from the pooled training set).
- eta schedule: ``eta(t) = eta0 * f(t)`` with the paper's round index t = 1, 2, ...; the
  reference's loop starts at 0, so its ``sqrt`` schedule is ``eta0 * sqrt(t - 1)`` in our indexing.
- ``eta0`` defaults to the paper's CIFAR value 0.001; the reference's heterogeneous script uses
  0.01 (``fedhenn_5cnn`` does). Optimizer: the paper says "SGD with momentum"; the reference uses
  momentum 0.5 and weight decay 1e-4 on weights, not biases (``train.momentum``,
  ``train.weight_decay``, which applies to every parameter).
- ``rad_batch > 0`` (not in the paper) aligns on a random subset of the RAD per step (speed).
- RBF kernel: ``exp(-||a_p - a_q||^2 / (2 sigma^2 m))``, ``m`` the median of the L x L squared
  distances, zero diagonal included (Kornblith et al. 2019's ``gram_rbf``; torch's lower median),
  treated as a constant in the backward pass.
- no extra last round: the reference runs ``epochs + 1`` rounds, the last one with every client
  and 10 local epochs each; here each client keeps the model of its last sampled round (the
  paper describes no such round). ``train.finetune_epochs = 10`` comes closest: every client
  then trains 10 epochs of its own loss against the last global kernel, reported as the
  accuracy after fine-tuning.
- accuracy: the reference's ``test_img_local_all`` weights each client's accuracy by its test
  examples; the suites read the paper's "average test accuracy of all clients", the unweighted
  mean over clients (the weighted one is recorded beside it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.core import seeding
from fedmosaic.core.aggregate import weighted_mean
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Unguarded
from fedmosaic.core.secure import WEIGHT

log = logging.getLogger("fedmosaic")

Kernel = Literal["linear", "rbf"]
Schedule = Literal["sqrt", "constant", "linear"]
Weighting = Literal["uniform", "samples"]
FEATURE_BATCH = 500  # RAD rows per forward pass when computing an upload kernel (eval mode)
EPS = 1e-12  # floor of HSIC(K, K) before the square root


@dataclass(frozen=True)
class HeNNBroadcast(Payload):
    """Alignment target and the round's RAD (see the module docstring for which is which)."""

    rad: Tensor  # [L, C, H, W] inputs K_bar was computed on ([0, C, H, W] in round 1)
    kernel: Tensor  # [L, L] K_bar(t-1) ([0, 0] in round 1)
    next_rad: Tensor  # [L, C, H, W] this round's RAD: the client's upload kernel is computed on it
    eta: float  # eta(t) = eta0 * f(t), the weight of the CKA term this round
    round_num: int


@dataclass(frozen=True)
class HeNNUpload(Payload):
    # K_j = kernel(A_j, A_j) on next_rad (L = the RAD's size), after training, eval mode
    # A kernel matrix (linear or RBF): symmetric with a non-negative diagonal, so a flipped or
    # unrelated one is refused. Representations of different widths give kernels whose scale
    # differs by two orders of magnitude between honest clients: no peer scale applies.
    kernel: Annotated[
        Tensor,
        "[L, L] float32 symmetric diag >= 0",
        Unguarded("honest kernels differ in scale by 100 x across widths; the schema bounds them"),
    ]


@dataclass
class HeNNState:
    """Server state: the public inputs, and K_bar with the round whose RAD it lives on."""

    public: Tensor  # [P, C, H, W] normalized float, server-held
    seed: int
    rad_size: int  # L (capped to P)
    kernel: Tensor  # [L, L] K_bar; [0, 0] before any upload
    kernel_round: int = 0  # K_bar lives on the RAD of this round (0: none yet)


# ---- math ------------------------------------------------------------------------------------
def center(k: Tensor) -> Tensor:
    """``H K H`` with ``H = I - 11^T / n``, without forming H."""
    return k - k.mean(0, keepdim=True) - k.mean(1, keepdim=True) + k.mean()


def hsic(k: Tensor, l: Tensor) -> Tensor:  # noqa: E741 - the paper's symbol
    """``HSIC(K, L) = tr(K H L H) / (n - 1)^2`` (the paper's estimator)."""
    n = k.shape[0]
    # tr(KHLH) = tr((HKH)(HLH)) as H is idempotent; tr(AB) = sum(A * B^T).
    return (center(k) * center(l).T).sum() / (n - 1) ** 2


def cka(k: Tensor, l: Tensor) -> Tensor:  # noqa: E741
    """``HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))`` for kernels ``[n, n]``: 1 for identical ones."""
    kc, lc = center(k), center(l)
    num = (kc * lc.T).sum()
    den = (kc * kc.T).sum().clamp_min(EPS).sqrt() * (lc * lc.T).sum().clamp_min(EPS).sqrt()
    return num / den  # the (n-1)^2 factors cancel


def linear_kernel(a: Tensor) -> Tensor:
    return a @ a.T  # [n, n]


def rbf_kernel(a: Tensor, sigma: float = 1.0) -> Tensor:
    """``exp(-||a_p - a_q||^2 / (2 sigma^2 m))``, ``m`` the median squared pairwise distance.

    The bandwidth scales with the data (Kornblith et al. 2019), so CKA stays invariant to
    isotropic scaling; ``m`` is detached (a per-step constant, as in their numpy code).
    """
    # |a_p|^2 + |a_q|^2 - 2 a_p.a_q: O(n^2) memory, where differences would take [n, n, d]
    # (500 MB for a 500-row RAD at d = 512). Clamped at 0 against rounding; the diagonal is
    # zeroed exactly.
    sqn = a.pow(2).sum(1)  # [n]
    sq = (sqn.unsqueeze(1) + sqn.unsqueeze(0) - 2.0 * (a @ a.T)).clamp_min(0.0)  # [n, n]
    sq = sq * (1.0 - torch.eye(a.shape[0], dtype=sq.dtype, device=sq.device))
    m = sq.detach().median().clamp_min(EPS)
    return torch.exp(-sq / (2 * sigma**2 * m))


def kernel_matrix(a: Tensor, kind: str = "linear", sigma: float = 1.0) -> Tensor:
    """``K(p, q) = kernel(a_p, a_q)`` for representations ``a [n, d]`` (any d) -> ``[n, n]``."""
    a = a.flatten(1).float()
    return linear_kernel(a) if kind == "linear" else rbf_kernel(a, sigma)


def eta_at(eta0: float, schedule: str, t: int) -> float:
    """``eta(t) = eta0 * f(t)``: f = sqrt(t) | 1 | t, with t the round number (1, 2, ...)."""
    if schedule == "sqrt":
        return eta0 * math.sqrt(t)
    if schedule == "linear":
        return eta0 * float(t)
    return eta0


def sample_rad(num_public: int, rad_size: int, seed: int, round_num: int) -> Tensor:
    """Indices ``[L]`` into the public split: round ``round_num``'s RAD (server stream)."""
    gen = seeding.torch_generator(seed, round_num, seeding.SERVER, "fedhenn-rad")
    return torch.randperm(num_public, generator=gen)[: min(rad_size, num_public)]


# A memo of the last few rounds' RADs, outside the (plain-data) state: every broadcast of a
# round would otherwise gather and hold its own [L, C, H, W] copy (20 clients x L = 5000 CIFAR
# inputs: GBs). The entry holds ``public`` itself, so its id cannot be reused by another tensor.
_RADS: dict[tuple[int, int, int, int], tuple[Tensor, Tensor]] = {}


def rad_inputs(public: Tensor, rad_size: int, seed: int, round_num: int) -> Tensor:
    """The RAD of ``round_num`` as inputs ``[L, C, H, W]``, derived from the seed (the same
    tensor for every broadcast of that round)."""
    key = (id(public), rad_size, seed, round_num)
    hit = _RADS.get(key)
    if hit is None or hit[0] is not public:
        while len(_RADS) > 2:
            _RADS.pop(next(iter(_RADS)))
        rad = public[sample_rad(public.shape[0], rad_size, seed, round_num)].contiguous()
        hit = _RADS[key] = (public, rad)
    return hit[1]


@contextmanager
def inference_mode(model: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode, each one's own flag restored after.

    The RAD representation ``Phi(X; W)`` is the network's inference map: BatchNorm normalizes with
    (and leaves untouched) its running statistics, dropout is off. Autograd is unaffected.
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in flags:
            m.training = was  # not m.train(was): that would recurse over children


def rad_kernel(model: ClientModel, inputs: Tensor, kind: str, sigma: float) -> Tensor:
    """``K = kernel(Phi(X; W), Phi(X; W))`` on ``inputs [L, C, H, W]`` in eval mode -> ``[L, L]``.

    With gradient (the client's ``K_i``); the same map as the uploaded kernel, and the RAD pass
    leaves BatchNorm's running statistics as training on local data alone leaves them.
    """
    with inference_mode(model):
        return kernel_matrix(model.features(inputs), kind, sigma)


@torch.no_grad()
def representation_kernel(
    model: ClientModel, inputs: Tensor, kind: str, sigma: float, batch: int = FEATURE_BATCH
) -> Tensor:
    """:func:`rad_kernel` without gradient, forwarded ``batch`` rows at a time -> ``[L, L]``."""
    with inference_mode(model):
        feats = [model.features(inputs[i : i + batch]) for i in range(0, len(inputs), batch)]
    return kernel_matrix(torch.cat(feats), kind, sigma).float()


def need_public(spec: FederationSpec, name: str) -> Tensor:
    if spec.public is None or spec.public.shape[0] < 2:
        raise ConfigError(
            f"algorithm.name = {name!r} aligns representations on a server-held public set of "
            "at least 2 inputs: set data.public_size > 1 (e.g. 1000)"
        )
    return spec.public.detach().cpu().float()


# ---- the algorithm -----------------------------------------------------------------------------
@ALGORITHMS.register("fedhenn")
@dataclass(frozen=True)
class FedHeNN(Algorithm[HeNNState, HeNNBroadcast, HeNNUpload]):
    """Heterogeneous FedHeNN: CKA alignment of each client's RAD kernel to the clients' mean."""

    server_sums: ClassVar[bool] = True  # its server only averages the uploads (privacy)

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    eta0: float = 0.001  # eta_0: base weight of the CKA term (paper: 0.001 on CIFAR)
    # f(t) in eta(t) = eta0 * f(t): sqrt (reference) | constant | linear
    schedule: Schedule = "sqrt"
    kernel: Kernel = "linear"  # kernel on representations: linear | rbf
    sigma: float = 1.0  # rbf: exp(-d^2 / (2 sigma^2 m)), m the median squared distance
    rad_size: int = 1000  # L: RAD inputs per round (paper 5000), capped to data.public_size
    rad_batch: int = 0  # >0: align on this many random RAD rows per step (0: whole RAD, paper)
    weighting: Weighting = "uniform"  # w_j in K_bar: uniform 1/N (paper) | samples (n_j / sum n)

    supports_heterogeneous: ClassVar[bool] = True
    model_projection: ClassVar[str | None] = "none"  # each client aligns its own Phi (width d_i)
    paper: ClassVar[str] = (
        "Makhija et al., Architecture Agnostic Federated Learning for Neural Networks, ICML 2022"
    )

    def __post_init__(self) -> None:
        check_hyperparameters(self.sigma, self.eta0, self.rad_size)
        if self.rad_batch < 0 or self.rad_batch == 1:
            raise ValueError(f"rad_batch = {self.rad_batch} must be 0 (whole RAD) or >= 2")

    def check(self, spec: FederationSpec) -> None:
        need_public(spec, "fedhenn")

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> HeNNState:
        public = need_public(spec, "fedhenn")
        if self.rad_size > public.shape[0]:
            # Said, not silent: suites' quick budgets shrink the public split under the paper's L.
            log.warning(
                "fedhenn: rad_size = %d is above the public split (data.public_size = %d): "
                "each round's RAD holds all %d public inputs",
                self.rad_size,
                public.shape[0],
                public.shape[0],
            )
        return HeNNState(public, spec.seed, min(self.rad_size, public.shape[0]), torch.zeros(0, 0))

    def broadcast(self, state: HeNNState, client_id: int, round_num: int) -> HeNNBroadcast:
        next_rad = rad_inputs(state.public, state.rad_size, state.seed, round_num)
        if state.kernel_round > 0:
            rad = rad_inputs(state.public, state.rad_size, state.seed, state.kernel_round)
        else:
            rad = next_rad[:0]  # [0, C, H, W]: no K_bar yet
        return HeNNBroadcast(
            rad,
            state.kernel,
            next_rad,
            eta_at(self.eta0, self.schedule, round_num),
            round_num,
        )

    def upload_names(self, state: HeNNState, upload: HeNNUpload) -> dict[str, Any]:
        return {"L": state.rad_size}

    def aggregate(
        self, state: HeNNState, uploads: Sequence[Weighted[HeNNUpload]], round_num: int
    ) -> HeNNState:
        w = [u.weight if self.weighting == "samples" else 1.0 for u in uploads]
        kbar = weighted_mean([u.payload.kernel for u in uploads], w)  # [L, L]
        # The uploads were computed on this round's RAD (the broadcast's next_rad).
        return HeNNState(state.public, state.seed, state.rad_size, kbar, round_num)

    def summands(self, upload: HeNNUpload, weight: float) -> dict[str, Tensor]:
        w = weight if self.weighting == "samples" else 1.0
        return {
            WEIGHT: torch.tensor([w], dtype=torch.float64),
            "kernel": w * upload.kernel.double(),
        }

    def from_sums(
        self, state: HeNNState, sums: Mapping[str, Tensor], round_num: int
    ) -> Weighted[HeNNUpload]:
        total = float(sums[WEIGHT][0])
        return Weighted(-1, total, HeNNUpload((sums["kernel"] / total).float()))

    # ---- client half ---------------------------------------------------------------------
    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: HeNNBroadcast
    ) -> Tensor:
        ce = F.cross_entropy(model(x), y)
        if msg.eta == 0 or msg.kernel.numel() == 0:
            return ce
        return ce + msg.eta * cka_distance(
            model, msg.rad, msg.kernel, self.kernel, self.sigma, self.rad_batch
        )

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: HeNNBroadcast
    ) -> HeNNUpload:
        return HeNNUpload(representation_kernel(model, msg.next_rad, self.kernel, self.sigma).cpu())


def cka_distance(
    model: ClientModel, rad: Tensor, target: Tensor, kind: str, sigma: float, rad_batch: int = 0
) -> Tensor:
    """``1 - CKA(K_i, target)`` with ``K_i`` the model's feature kernel on ``rad`` (with gradient).

    ``rad_batch > 0`` uses a random subset of the RAD rows (and the matching block of ``target``).
    """
    if 0 < rad_batch < rad.shape[0]:
        idx = torch.randperm(rad.shape[0])[:rad_batch].to(rad.device)
        rad, target = rad[idx], target[idx][:, idx]
    return 1.0 - cka(rad_kernel(model, rad, kind, sigma), target)


def check_hyperparameters(sigma: float, eta0: float, rad: int) -> None:
    if sigma <= 0 or eta0 < 0:
        raise ValueError(f"sigma = {sigma} must be > 0 and eta0 = {eta0} >= 0")
    if rad < 2:
        raise ValueError(f"rad_size = {rad} must be >= 2 (CKA needs at least two inputs)")
