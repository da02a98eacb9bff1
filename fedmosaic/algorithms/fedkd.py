"""FedKD (Wu et al., Communication-efficient federated learning via knowledge distillation,
Nature Communications 13, 2032, 2022).

Shared: a small "mentee" (student) model, the same architecture on every client, exchanged with
its weight matrices SVD-truncated in both directions. Each client's "mentor" (teacher: its own
model, any architecture) and a local projection ``W_h`` (mentee features -> mentor features) stay
local. Both models train together by adaptive mutual distillation (per batch; ``w`` detached):
``w = 1 / (CE_t + CE_s)``, mentor loss ``CE_t + w KL(p_s || p_t) + w MSE(h_t, W_h h_s)``, mentee
loss ``CE_s + w KL(p_t || p_s) + w MSE(W_h h_s, h_t)`` (each KL/MSE towards the other's detached
output). Prediction: the mentor (``acc``); ``acc_mentee`` is reported too.

Compression: each float weight with >= 2 dims (conv weights as ``[out, in*kh*kw]``) is sent as
``U_k [m, k]``, ``S_k [k]``, ``V_k [k, n]`` with the smallest ``k`` whose retained energy
``sum_{i<k} s_i^2 / sum_i s_i^2 >= T(t)``; ``T(t) = T_start + (T_end - T_start) (t - 1) / (R - 1)``
rises linearly from ``T_start`` in round 1 to ``T_end`` in the last round ``R``. Wire bytes are
those of the factors.

Choices and differences from the paper and the reference code (the authors' ``run.py``/
``model_bert.py``; PFLlib/HtFLlib ``clientkd``/``serverkd``):

- Upload: the SVD-compressed local *update* (mentee after training minus the mentee received), the
  paper's "dynamic gradient approximation" and the authors' code. ``upload_mode = "state"``
  compresses the mentee's parameters themselves, as PFLlib/HtFLlib do.
- Download: the SVD-compressed global mentee itself (as PFLlib/HtFLlib), not the compressed global
  update of the paper: an update only works for clients holding the previous global mentee exactly,
  which clients skipping rounds (partial participation) do not. The server keeps exactly what the
  clients reconstruct as the base that their updates are added to.
- Round 1's download. Paper: no message for the initial mentee is described (every later
  download is compressed). Reference code (PFLlib): the first broadcast sends the full, dense
  model; only later ones are SVD-compressed. Default: ``first_broadcast = "full"``, the
  reference's (every client starts from the exact same initial mentee); ``"svd"`` compresses it
  at ``T_start`` like every later broadcast.
- Truncation: the smallest ``k >= 1`` reaching the threshold (``>=``). PFLlib and the authors'
  client code use a strict ``>`` and, when no ``k`` below the full rank passes it, keep ``k = 0``
  and so zero that tensor -- a bug not copied. A weight whose factors would not take fewer wire
  bytes than the matrix itself is sent dense (exactly). 1-D tensors (biases, BatchNorm) and integer
  buffers are always sent dense. PFLlib runs batched SVDs over the ``kh x kw`` slices of conv
  kernels; we factor the ``[out, in*kh*kw]`` matrix.
- Schedule: ``T_start`` in round 1 and ``T_end`` in the last round (PFLlib's end points; the
  authors' code starts one step above ``T_start``). ``T_start = 0.95``, ``T_end = 0.98``: the
  PFLlib/HtFLlib defaults.
- Adaptive weight ``1 / (CE_t + CE_s)`` is a detached per-batch weight (as in both references' per-
  batch form; the paper writes the losses for one example). The references differentiate through
  it, which rewards raising the task losses.
- KL with ``reduction="batchmean"`` and detached targets, so each loss trains only its own model;
  the references' ``nn.KLDivLoss()`` (mean over ``B * C``) backpropagates both directions into both
  models. The hidden loss: ``nn.MSELoss`` mean over ``B * d``; the mentor's pulls ``h_t`` towards
  ``W_h h_s`` (detached), the mentee's pulls ``W_h h_s`` (mentee encoder, ``W_h``) towards ``h_t``
  (detached). The references add the same undetached term twice.
- ``W_h = Linear(d_mentee, d_mentor, bias=False)``, local and trained, as in HtFLlib, although here
  both feature sizes are ``model.feature_dim``. The paper's attention-map loss (Transformers) has no
  counterpart in CNN encoders and is left out.
- One optimizer and learning rate for mentor, mentee and ``W_h`` (HtFLlib; PFLlib has a separate
  ``mentee_learning_rate``); no gradient clipping (PFLlib/HtFLlib clip at norm 10).
- Server: sample-weighted average (the references average uniformly).
- Mentee architecture: ``mentee_arch = ""`` picks the family's smallest member by parameter count
  (HtFLlib: the family's first member, or its ``global_model``), built as every client model is,
  with the federation's projection (``model.projection``).

Parity options (HtFLlib ``clientkd.py``, commit 728e52a; defaults keep the form above):

- ``loss_form = "htfllib"``: the reference's per-batch loss. Its two backward passes
  (``loss``, ``loss_g``) accumulate into one gradient, that of ``CE_t + CE_s + (KL(p_s || p_t) +
  KL(p_t || p_s) + 2 MSE(h_t, W_h h_s)) / (CE_t + CE_s)``: nothing detached (the weight, both KL
  targets, both sides of the hidden loss, counted twice), KL the mean over ``B * C``
  (``nn.KLDivLoss()``). Its gradient clipping (norm 10 per model) is not reproduced.
- ``svd_form = "htfllib"``: the reference's ``decomposition`` for uploads and broadcasts. Every
  float tensor with >= 2 dims and ``shape[0] > 1`` is truncated: 2-D as one matrix, conv kernels
  as one SVD per ``kh x kw`` slice with one ``k`` for all slices (energy summed over them); ``k``
  is the smallest ``n < r`` with ``sum_{i<n} s_i^2 > T * sum_i s_i^2`` (strict), else ``0`` (the
  tensor is zeroed). The truncated tensors are sent dense (a diagnostic: wire bytes are not
  those of factors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.algorithms._distill import (
    build_shared_model,
    check_member,
    initial_shared_state,
    kl_rows,
    small_member,
)
from fedmosaic.algorithms._shared import weighted_average
from fedmosaic.core.algorithm import Acceleration, Algorithm, FederationSpec, Weighted
from fedmosaic.core.client import ClientData
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.schema import Update

UploadMode = Literal["update", "state"]
FirstBroadcast = Literal["full", "svd"]
LossForm = Literal["detached", "htfllib"]
SvdForm = Literal["matrix", "htfllib"]
FACTORS = ("U", "S", "V")
HEADER_BYTES = 64  # approximate safetensors header entry of one tensor, besides its name


@dataclass(frozen=True)
class MenteeBroadcast(Payload):
    """The global mentee, SVD-compressed, and the threshold clients compress their uploads with."""

    # "<name>" dense, or "<name>/U" [m, k], "<name>/S" [k], "<name>/V" [k, n]
    tensors: dict[str, Tensor]
    energy: float  # T(t) of this round


@dataclass(frozen=True)
class MenteeUpload(Payload):
    """A client's mentee update (or state), SVD-compressed like the broadcast."""

    # the mentee's entries, each dense or as U/S/V factors (``check_compressed``); to the guard,
    # decoded, an update of ``base`` (the mentee, or nothing where the upload is a delta)
    tensors: Annotated[
        dict[str, Tensor], "like mentee", Update("base", scale="global", decode="dense")
    ]


@dataclass
class FedKDState:
    """Server state (CPU)."""

    mentee: dict[str, Tensor]  # the global mentee exactly as clients reconstruct it
    message: dict[str, Tensor]  # its compressed form, broadcast to every client
    energy: float  # threshold of ``message`` and of the uploads it asks for
    rounds: int  # total rounds R, for the threshold schedule


# ---- SVD compression ----------------------------------------------------------------------
def energy_threshold(round_num: int, rounds: int, T_start: float, T_end: float) -> float:
    """``T(t) = T_start + (T_end - T_start) (t - 1) / (R - 1)``, ``t`` clamped to ``1..R``."""
    if rounds <= 1:
        return T_start
    t = min(max(round_num, 1), rounds)
    return T_start + (T_end - T_start) * (t - 1) / (rounds - 1)


def energy_rank(s: Tensor, energy: float) -> int:
    """Smallest ``k >= 1`` with ``sum_{i<k} s_i^2 >= energy * sum_i s_i^2`` (``s`` descending)."""
    cum = s.detach().double().pow(2).cumsum(0)  # [r]
    target = (energy * cum[-1]).reshape(1)
    k = int(torch.searchsorted(cum, target).item()) + 1  # first index reaching the target, + 1
    return min(k, s.numel())


def factorizable(t: Tensor) -> bool:
    """Float tensors that are matrices of at least 2 x 2 once flattened to ``[shape[0], -1]``."""
    return t.is_floating_point() and t.dim() >= 2 and t.shape[0] > 1 and t[0].numel() > 1


def compress(state: dict[str, Tensor], energy: float) -> dict[str, Tensor]:
    """Truncated SVD factors of every factorizable tensor; others (and unprofitable ones) dense.

    The result references (does not copy) the dense tensors of ``state``.
    """
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if not factorizable(t):
            out[name] = t
            continue
        mat = t.detach().reshape(t.shape[0], -1).float()  # [m, n]
        m, n = mat.shape
        u, s, vh = torch.linalg.svd(mat, full_matrices=False)  # [m, r], [r], [r, n]
        k = energy_rank(s, energy)
        # Wire bytes: three float32 factors (two more header entries) against one dense matrix.
        factored = 4 * k * (m + n + 1) + 2 * (len(name) + HEADER_BYTES)
        if factored >= 4 * m * n:  # not smaller: send the matrix exactly
            out[name] = t
            continue
        # Copies, so the full SVD outputs are not kept alive by the message.
        out[f"{name}/U"] = u[:, :k].clone()  # [m, k]
        out[f"{name}/S"] = s[:k].clone()  # [k]
        out[f"{name}/V"] = vh[:k].clone()  # [k, n]
    return out


def htfllib_rank(s: Tensor, energy: float) -> int:
    """HtFLlib's ``k`` from singular values ``s [..., r]`` (one row per slice, each descending).

    Energies are summed over the slices; ``k`` is the smallest ``n`` in ``0 .. r - 1`` with
    ``sum_{i<n} s_i^2 > energy * sum_i s_i^2`` (strict), else ``0``: the full rank is never kept.
    """
    e = s.detach().double().pow(2).reshape(-1, s.shape[-1]).sum(0)  # [r], over the slices
    below = torch.cat([e.new_zeros(1), e.cumsum(0)[:-1]])  # [r]: sum_{i<n} for n = 0 .. r - 1
    hits = (below > energy * e.sum()).nonzero()
    return int(hits[0].item()) if hits.numel() else 0


def truncate_htfllib(state: dict[str, Tensor], energy: float) -> dict[str, Tensor]:
    """HtFLlib's ``decomposition`` then ``recover``: dense truncated tensors (``svd_form``).

    Conv kernels ``[out, in, kh, kw]`` get one SVD per ``kh x kw`` slice (numpy's batched SVD in
    the reference) with one shared ``k``; ``k = 0`` zeroes the tensor, as the reference does.
    """
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if not (t.is_floating_point() and t.dim() >= 2 and t.shape[0] > 1):
            out[name] = t
            continue
        u, s, vh = torch.linalg.svd(t.detach().float(), full_matrices=False)  # batched over dims
        if not bool(s.pow(2).sum() > 0):  # an all-zero tensor: the reference keeps it as is
            out[name] = t
            continue
        k = htfllib_rank(s, energy)
        # [..., m, k] * [..., 1, k] @ [..., k, n]
        out[name] = ((u[..., :k] * s[..., None, :k]) @ vh[..., :k, :]).to(t.dtype)
    return out


def decompress(tensors: dict[str, Tensor], template: dict[str, Tensor]) -> dict[str, Tensor]:
    """Dense tensors shaped like ``template`` from ``compress``'s output (``U diag(S) V``)."""
    out: dict[str, Tensor] = {}
    for name, ref in template.items():
        if name in tensors:
            out[name] = tensors[name]
            continue
        u, s, v = (tensors[f"{name}/{f}"] for f in FACTORS)
        out[name] = ((u * s) @ v).reshape(ref.shape).to(ref.dtype)  # [m, k] * [k] @ [k, n]
    return out


def check_compressed(tensors: dict[str, Tensor], template: dict[str, Tensor], what: str) -> None:
    """Raise ``PayloadError`` unless ``tensors`` is a valid ``compress`` output for ``template``.

    Factor ranks vary per round, so factors are checked for consistency with the reference shape:
    ``U [m, k]``, ``S [k]``, ``V [k, n]`` with ``1 <= k <= min(m, n)``, in the reference dtype.
    """
    seen: set[str] = set()
    for name, ref in template.items():
        if name in tensors:
            x = tensors[name]
            if x.dtype != ref.dtype or x.shape != ref.shape:
                raise PayloadError(
                    f"{what}: {name} is {x.dtype}{tuple(x.shape)}, "
                    f"expected {ref.dtype}{tuple(ref.shape)}"
                )
            seen.add(name)
            continue
        keys = [f"{name}/{f}" for f in FACTORS]
        if not factorizable(ref) or not all(k in tensors for k in keys):
            raise PayloadError(f"{what}: {name} is missing (dense or as U/S/V factors)")
        u, s, v = (tensors[k] for k in keys)
        m, n = ref.shape[0], ref[0].numel()
        k = s.shape[0] if s.dim() == 1 else -1
        shapes_ok = (
            1 <= k <= min(m, n)
            and tuple(u.shape) == (m, k)
            and tuple(v.shape) == (k, n)
            and all(f.dtype == ref.dtype for f in (u, s, v))
        )
        if not shapes_ok:
            raise PayloadError(
                f"{what}: {name} factors are U{tuple(u.shape)} S{tuple(s.shape)} V{tuple(v.shape)}"
                f" ({u.dtype}), expected U({m}, k) S(k,) V(k, {n}) with 1 <= k <= {min(m, n)}"
                f" ({ref.dtype})"
            )
        seen.update(keys)
    extra = sorted(set(tensors) - seen)
    if extra:
        raise PayloadError(f"{what}: unexpected tensors {extra[:5]}")


# ---- losses -------------------------------------------------------------------------------
def adaptive_mutual_losses(
    mentor_logits: Tensor,
    mentee_logits: Tensor,
    mentor_features: Tensor,
    projected_mentee_features: Tensor,
    y: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(L_mentor, L_mentee)`` of one batch; ``projected_mentee_features = W_h(h_s)``.

    ``w = 1 / (CE_t + CE_s)`` (detached); ``L_mentor = CE_t + w KL(p_s || p_t) + w MSE(h_t, W_h
    h_s)``, ``L_mentee = CE_s + w KL(p_t || p_s) + w MSE(W_h h_s, h_t)``; the second argument of
    each KL/MSE is the detached target, KL is ``batchmean``, MSE the mean over ``B * d``.
    """
    ce_t = F.cross_entropy(mentor_logits, y)
    ce_s = F.cross_entropy(mentee_logits, y)
    w = 1.0 / (ce_t + ce_s).detach()  # adaptive: weak distillation while both predict badly
    kl_t = kl_rows(mentor_logits, mentee_logits.detach()).mean()
    kl_s = kl_rows(mentee_logits, mentor_logits.detach()).mean()
    hid_t = F.mse_loss(mentor_features, projected_mentee_features.detach())
    hid_s = F.mse_loss(projected_mentee_features, mentor_features.detach())
    return ce_t + w * (kl_t + hid_t), ce_s + w * (kl_s + hid_s)


def htfllib_loss(
    mentor_logits: Tensor,
    mentee_logits: Tensor,
    mentor_features: Tensor,
    projected_mentee_features: Tensor,
    y: Tensor,
) -> Tensor:
    """HtFLlib's ``loss + loss_g`` (``loss_form = "htfllib"``); its two backward passes sum.

    ``CE_t + CE_s + (KL(p_s || p_t) + KL(p_t || p_s) + 2 MSE(h_t, W_h h_s)) / (CE_t + CE_s)``
    with nothing detached.
    """
    ce_t = F.cross_entropy(mentor_logits, y)
    ce_s = F.cross_entropy(mentee_logits, y)
    s = ce_t + ce_s  # not detached: its gradient rewards larger task losses, as in the reference
    # nn.KLDivLoss()'s mean over B * C elements, both arguments undetached: L_d + L_d_g
    c = mentor_logits.shape[1]
    kl = kl_rows(mentor_logits, mentee_logits).mean() / c
    kl = kl + kl_rows(mentee_logits, mentor_logits).mean() / c
    hid = F.mse_loss(mentor_features, projected_mentee_features)  # L_h and L_h_g: the same term
    return s + (kl + 2 * hid) / s


class MenteeExtras(nn.Module):
    """Client extras: the local copy of the shared mentee and the local projection ``W_h``."""

    def __init__(self, mentee: ClientModel, W_h: nn.Linear) -> None:
        super().__init__()
        self.mentee = mentee
        self.W_h = W_h


@ALGORITHMS.register("fedkd")
@dataclass(frozen=True)
class FedKD(Algorithm[FedKDState, MenteeBroadcast, MenteeUpload]):
    """Mentor/mentee mutual distillation; only the SVD-compressed mentee is communicated."""

    secure_refusal: ClassVar[str] = (
        "its uploads are SVD factors of each client's update: the sum of factors is not the factors of the sum"
    )

    # The rank of each SVD factor follows the energy threshold on the client's own update, so
    # the upload's shape is data: no fixed-shape release exists for it.
    privacy_refusal: ClassVar[str] = (
        "fedkd's uploads are truncated SVD factors whose ranks depend on the client's data; "
        "differential privacy needs a fixed shape (use fedavg or lg_fedavg with [privacy])"
    )

    acceleration: ClassVar[Acceleration] = Acceleration(fused_sgd=True)

    T_start: float = 0.95  # SVD energy threshold in round 1 (PFLlib/HtFLlib default)
    T_end: float = 0.98  # SVD energy threshold in the last round (PFLlib/HtFLlib default)
    # what clients compress: update (paper) | state (PFLlib/HtFLlib)
    upload_mode: UploadMode = "update"
    mentee_arch: str = ""  # zoo architecture of the mentee; "" = the family's smallest member
    # round 1's mentee: full (PFLlib) | svd (compressed like later)
    first_broadcast: FirstBroadcast = "full"
    # client loss: detached (ours) | htfllib (its clientkd.py loss, nothing detached)
    loss_form: LossForm = "detached"
    # compression: matrix (ours) | htfllib (its decomposition: per-slice conv SVD, strict >, k = 0)
    svd_form: SvdForm = "matrix"

    supports_heterogeneous: ClassVar[bool] = True
    paper: ClassVar[str] = (
        "Wu et al., Communication-efficient federated learning via knowledge distillation, "
        "Nature Communications 2022"
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.T_start <= self.T_end <= 1.0:
            raise ValueError(
                f"T_start = {self.T_start}, T_end = {self.T_end}: need 0 < T_start <= T_end <= 1"
            )

    def check(self, spec: FederationSpec) -> None:
        check_member(self.mentee_arch, "mentee_arch", spec)

    def threshold(self, round_num: int, rounds: int) -> float:
        return energy_threshold(round_num, rounds, self.T_start, self.T_end)

    # ---- server half ---------------------------------------------------------------------
    def init_server(self, spec: FederationSpec) -> FedKDState:
        initial = initial_shared_state(small_member(self.mentee_arch, spec), spec, "fedkd-mentee")
        energy = self.threshold(1, spec.rounds)  # clients compress round 1's uploads with it
        if self.first_broadcast == "full":
            return FedKDState(initial, dict(initial), energy, spec.rounds)  # dense, exact
        return self._publish(initial, energy, spec.rounds)

    def _compress(self, state: dict[str, Tensor], energy: float) -> dict[str, Tensor]:
        if self.svd_form == "htfllib":
            return truncate_htfllib(state, energy)
        return compress(state, energy)

    def _publish(self, mentee: dict[str, Tensor], energy: float, rounds: int) -> FedKDState:
        message = self._compress(mentee, energy)
        return FedKDState(decompress(message, mentee), message, energy, rounds)

    def broadcast(self, state: FedKDState, client_id: int, round_num: int) -> MenteeBroadcast:
        return MenteeBroadcast(state.message, state.energy)

    def aggregate(
        self, state: FedKDState, uploads: Sequence[Weighted[MenteeUpload]], round_num: int
    ) -> FedKDState:
        dense = [decompress(u.payload.tensors, state.mentee) for u in uploads]
        # "update" uploads are already deltas; "weights" ones are aggregated against the mentee.
        reference = None if self.upload_mode == "update" else state.mentee
        avg = weighted_average(dense, [u.weight for u in uploads], reference=reference)
        if self.upload_mode == "update":
            # Float entries are updates relative to the mentee every client received.
            avg = {k: state.mentee[k] + v if v.is_floating_point() else v for k, v in avg.items()}
        return self._publish(avg, self.threshold(round_num + 1, state.rounds), state.rounds)

    def upload_names(self, state: FedKDState, upload: MenteeUpload) -> dict[str, Any]:
        return {
            "mentee": lambda x, w: check_compressed(x, state.mentee, w),
            "dense": lambda x: decompress(x, state.mentee),
            # "update" uploads are deltas already: each entry is its own update
            "base": {} if self.upload_mode == "update" else state.mentee,
            "global": state.mentee,
        }

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        mentee = build_shared_model(small_member(self.mentee_arch, spec), spec)
        W_h = nn.Linear(mentee.feature_dim, model.feature_dim, bias=False)
        return MenteeExtras(mentee, W_h.to(spec.device))

    def receive(self, model: ClientModel, extras: nn.Module, msg: MenteeBroadcast) -> None:
        mentee = cast(MenteeExtras, extras).mentee  # init_client's extras
        mentee.load_part_state("all", decompress(msg.tensors, mentee.state_dict()))

    def loss(
        self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: MenteeBroadcast
    ) -> Tensor:
        ex = cast(MenteeExtras, extras)  # init_client's extras
        h_t = model.features(x)  # [B, d_mentor]
        h_s = ex.mentee.features(x)  # [B, d_mentee]
        if self.loss_form == "htfllib":
            return htfllib_loss(model.head(h_t), ex.mentee.head(h_s), h_t, ex.W_h(h_s), y)
        l_mentor, l_mentee = adaptive_mutual_losses(
            model.head(h_t), ex.mentee.head(h_s), h_t, ex.W_h(h_s), y
        )
        # Detached targets: the sum trains each model (and W_h) on its own loss only.
        return l_mentor + l_mentee

    def upload(
        self, model: ClientModel, extras: nn.Module, data: ClientData, msg: MenteeBroadcast
    ) -> MenteeUpload:
        state = cast(MenteeExtras, extras).mentee.part_state("all")  # init_client's extras
        if self.upload_mode == "update":
            received = decompress(msg.tensors, state)
            state = {k: v - received[k] if v.is_floating_point() else v for k, v in state.items()}
        return MenteeUpload(self._compress(state, msg.energy))

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: MenteeBroadcast
    ) -> dict[str, Tensor]:
        return {"acc": model(x), "acc_mentee": cast(MenteeExtras, extras).mentee(x)}
