"""Member strings -> ClientModel: encoder (+ projection to feature_dim) and head.

Member-string format: ``"<arch>[/<head>]"``

- ``<arch>``: a registered encoder name (``fedmosaic list`` / ``ENCODERS.names()``).
- ``<head>`` (optional, default ``linear``):
  - ``linear``: ``Linear(feature_dim, C)`` (every paper's default classifier);
  - ``mlp<h1>[-<h2>...]``: hidden fcs with ReLU between and no ReLU on the logits, e.g.
    ``mlp512`` = ``Linear(d, 512) -> ReLU -> Linear(512, C)`` (FedTGP's HtC4 classifiers).

Projection: when the encoder's natural dimension differs from ``feature_dim`` a last encoder block
named ``proj`` maps it there:

- ``"linear"`` (default): a learnable ``Linear(natural_dim, feature_dim)``, no activation.
- ``"pool"``: HtFLlib's parameter-free ``AdaptiveAvgPool1d(feature_dim)``.
- ``"none"``: no projection: the model keeps its encoder's own width (``ClientModel.feature_dim`` =
  the natural dimension, so it differs across a family's members). Only for methods that never
  compare features across clients coordinate by coordinate (FedHeNN's L x L kernel matrices): an
  algorithm picks it through ``Algorithm.model_projection``; ``model.projection = "none"`` is
  accepted for ``local`` only (Local on FedHeNN's own networks, the fair control of its claim).

Why linear by default: the pool is a fixed, arbitrary channel map. It averages adjacent channels
(ResNet50's 2048 -> 512 in fixed groups of 4, MobileNetV2's 1280 -> 512 in overlapping windows of
3) and, when natural_dim < feature_dim, copies them (each of ResNet4's 64 channels appears 8 times
in its "512-d" feature). A learnable linear map lets every architecture learn its own compression
or embedding into the shared space, as FedClassAvg (backbone + one fc to 512) and FedGH (a
representation fc) do; it costs natural_dim x feature_dim parameters, and its output has no ReLU
(features can be negative). Either way the features span at most min(natural_dim, feature_dim)
dimensions. Use ``"pool"`` to reproduce HtFLlib.
"""

from __future__ import annotations

import re

from torch import nn

from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ENCODERS

PROJECTIONS = ("linear", "pool", "none")
_MLP = re.compile(r"mlp(\d+(?:-\d+)*)")


def split_member(member: str) -> tuple[str, str]:
    """``"arch/head"`` -> ``("arch", "head")``; the head defaults to ``"linear"``."""
    arch, sep, head = member.partition("/")
    if sep and not head:
        raise ValueError(f"member {member!r}: empty head after '/'")
    head = head or "linear"
    parse_head(head)  # validate
    return arch, head


def parse_head(spec: str) -> list[int]:
    """Hidden widths of a head spec: ``"linear"`` -> ``[]``, ``"mlp512-256"`` -> ``[512, 256]``."""
    if spec == "linear":
        return []
    m = _MLP.fullmatch(spec)
    if m is None:
        raise ValueError(
            f"unknown head {spec!r}; expected 'linear' or 'mlp<h1>[-<h2>...]' (e.g. 'mlp512')"
        )
    widths = [int(w) for w in m.group(1).split("-")]
    if any(w < 1 for w in widths):
        raise ValueError(f"head {spec!r}: widths must be positive")
    return widths


def build_head(spec: str, feature_dim: int, num_classes: int) -> nn.Module:
    """The classifier for a head spec (no activation on the logits)."""
    hidden = parse_head(spec)
    if not hidden:
        return nn.Linear(feature_dim, num_classes)
    layers: list[nn.Module] = []
    dim = feature_dim
    for width in hidden:
        layers += [nn.Linear(dim, width), nn.ReLU()]
        dim = width
    layers.append(nn.Linear(dim, num_classes))
    return nn.Sequential(*layers)


def build_encoder(
    arch: str,
    input_shape: tuple[int, int, int],
    feature_dim: int,
    projection: str = "linear",
) -> nn.Module:
    """The registered encoder for ``input_shape = (C, H, W)``, projected to ``feature_dim``."""
    return _encoder(arch, input_shape, feature_dim, projection)[0]


def _encoder(
    arch: str, input_shape: tuple[int, int, int], feature_dim: int, projection: str
) -> tuple[nn.Module, int]:
    """``(encoder, output width)``: ``feature_dim``, or the natural width for ``"none"``."""
    if projection not in PROJECTIONS:
        raise ValueError(f"unknown projection {projection!r}; known: {', '.join(PROJECTIONS)}")
    channels, height, width = input_shape
    if height != width:
        raise ValueError(f"square images only, got input_shape {tuple(input_shape)}")
    encoder, natural_dim = ENCODERS.get(arch)(channels, height)
    if not isinstance(encoder, nn.Sequential):  # its forward must run the blocks, proj included
        raise TypeError(f"encoder {arch!r} must be an nn.Sequential of blocks")
    if projection == "none":
        return encoder, natural_dim
    if natural_dim != feature_dim:
        proj = (
            nn.Linear(natural_dim, feature_dim)
            if projection == "linear"
            else nn.AdaptiveAvgPool1d(feature_dim)
        )
        encoder.add_module("proj", proj)
    return encoder, feature_dim


# Modules whose every output is >= 0, and modules that keep the sign of each input entry in each
# output entry (a max or mean over entries of one sign keeps it; a reshape moves entries).
_NONNEGATIVE = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Softmax, nn.Softplus)
_SIGN_KEEPING = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.Flatten,
    nn.Identity,
    nn.Dropout,
)


def ends_nonnegative(module: nn.Module) -> bool:
    """Whether every output of ``module`` is >= 0 by its structure: a ReLU-like activation, or an
    ``nn.Sequential`` whose last such activation is followed only by sign-keeping modules
    (pooling, flatten, dropout; HtFLlib's pool projection). A module of any other kind (a custom
    block whose ``forward`` the structure does not show, a Linear, a BatchNorm) is not: the
    answer errs towards "may be negative", never the other way."""
    if isinstance(module, _NONNEGATIVE):
        return True
    if isinstance(module, nn.Sequential):
        for child in reversed(list(module.children())):
            if isinstance(child, _SIGN_KEEPING):
                continue
            return ends_nonnegative(child)
    return False


def build_client_model(
    member: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int,
    projection: str = "linear",
) -> ClientModel:
    """Build the ClientModel for a family member string (see module doc for the format).

    Parameters are drawn from torch's global RNG: seed it first for reproducible models.
    With ``projection = "none"`` the model's ``feature_dim`` is its encoder's natural width.
    """
    arch, head = split_member(member)
    encoder, dim = _encoder(arch, input_shape, feature_dim, projection)
    return ClientModel(encoder, build_head(head, dim, num_classes), dim, num_classes, arch=member)
