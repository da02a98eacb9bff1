"""Batch image augmentations written with tensor ops (no torchvision), for contrastive methods.

Everything acts on a normalized float batch ``[B, C, H, W]`` on any device and draws from torch's
global RNG (the runtime seeds it per (seed, round, client), so runs are reproducible). Each image
gets its own random parameters; the whole batch is transformed with one ``grid_sample``.

- random resized crop: area fraction ~ U(scale), aspect ratio ~ logU(ratio), resized back to
  ``H x W`` with bilinear interpolation (torchvision's RandomResizedCrop retries ten draws and falls
  back to a centre crop when the box does not fit; we clamp the box to the image instead);
- horizontal flip with probability ``flip_p`` (folded into the same affine map);
- brightness / contrast jitter. The inputs are already normalized (the dataset's mean/std are not
  known here), so brightness is an additive offset ``x + b`` with ``b ~ U(-brightness, brightness)``
  and contrast scales around each image's mean: ``(x - m) * c + m`` with
  ``c ~ U(1 - contrast, 1 + contrast)``. Contrast around the mean commutes with any per-channel
  affine normalization, so it equals torchvision's on raw pixels (without its clamp to [0, 1]).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _uniform(n: int, low: float, high: float, device: torch.device) -> Tensor:
    return torch.rand(n, device=device) * (high - low) + low  # [n]


def random_resized_crop_flip(
    x: Tensor,
    scale: tuple[float, float] = (0.2, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    flip_p: float = 0.5,
) -> Tensor:
    """Per-image random resized crop and horizontal flip, output the same size as ``x``."""
    b = x.shape[0]
    dev = x.device
    area = _uniform(b, scale[0], scale[1], dev)  # [B] fraction of the image area
    log_r = _uniform(b, math.log(ratio[0]), math.log(ratio[1]), dev)
    r = torch.exp(log_r)  # [B] width / height of the box
    # Box size as a fraction of the image side; clamped so the box stays inside the image.
    w = torch.sqrt(area * r).clamp(max=1.0)  # [B]
    h = torch.sqrt(area / r).clamp(max=1.0)  # [B]
    # Box centre in normalized coordinates [-1, 1]: anywhere the whole box fits.
    cx = (torch.rand(b, device=dev) * 2 - 1) * (1 - w)  # [B]
    cy = (torch.rand(b, device=dev) * 2 - 1) * (1 - h)  # [B]
    flip = torch.rand(b, device=dev) < flip_p  # [B]
    sx = torch.where(flip, -w, w)  # a negative x-scale mirrors the box
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.stack([sx, zero, cx], 1), torch.stack([zero, h, cy], 1)], 1).to(
        x.dtype
    )  # [B, 2, 3] output coords -> input coords
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # [B, H, W, 2]
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def color_jitter(x: Tensor, brightness: float = 0.4, contrast: float = 0.4) -> Tensor:
    """Per-image brightness offset and contrast scaling on a normalized batch."""
    b = x.shape[0]
    dev = x.device
    shape = (b,) + (1,) * (x.dim() - 1)
    if brightness > 0:
        x = x + _uniform(b, -brightness, brightness, dev).view(shape).to(x.dtype)
    if contrast > 0:
        c = _uniform(b, 1 - contrast, 1 + contrast, dev).view(shape).to(x.dtype)
        m = x.mean(dim=tuple(range(1, x.dim())), keepdim=True)  # [B, 1, 1, 1] per-image mean
        x = (x - m) * c + m
    return x


def augment(
    x: Tensor,
    scale: tuple[float, float] = (0.2, 1.0),
    flip_p: float = 0.5,
    brightness: float = 0.4,
    contrast: float = 0.4,
) -> Tensor:
    """One random view of each image: resized crop + flip, then brightness/contrast jitter."""
    return color_jitter(random_resized_crop_flip(x, scale, flip_p=flip_p), brightness, contrast)
