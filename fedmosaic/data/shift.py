"""Feature shift: fixed per-client (or per-domain) image transforms, labels left as partitioned.

Each domain gets one rotation, contrast factor and brightness offset drawn from
``default_rng([seed, 4])`` (domain by domain, always all three draws, so changing one range does
not change the others' draws):

- angle ~ U[-shift_rotation, shift_rotation] degrees (counter-clockwise, bilinear, zero fill;
  the background of MNIST-like images is 0, so the corners stay background);
- contrast factor f = exp(U[-ln c, ln c]) with c = shift_contrast, applied around each image's
  own mean as torchvision's ``adjust_contrast``: ``x' = m + f (x - m)``;
- brightness offset b ~ U[-shift_brightness, shift_brightness] in [0, 1] pixel units;

then clipped to [0, 1] and rounded back to uint8, so the transformed pool is an ordinary
:class:`ImageDataset` (normalization, the GPU copy and the process workers see it unchanged: the
workers rebuild it from the config and the seed, bit for bit). With ``shift_domains = 0`` every
client is its own domain; with ``k > 0`` client ``i`` belongs to domain ``i % k`` (clusters as in
rotated-MNIST benchmarks). All of a client's rows (train, val, test) share its domain; the
server's public split stays untransformed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from fedmosaic.config import DataConfig


def shift_enabled(cfg: DataConfig) -> bool:
    return cfg.shift_rotation > 0 or cfg.shift_contrast > 1 or cfg.shift_brightness > 0


def draw_domains(cfg: DataConfig, seed: int, num_clients: int) -> list[dict[str, float]]:
    """Each client's transform ``{"domain", "rotation", "contrast", "brightness"}``."""
    k = cfg.shift_domains if cfg.shift_domains > 0 else num_clients
    rng = np.random.default_rng([seed % 2**64, 4])
    log_c = math.log(cfg.shift_contrast)
    domains = []
    for _ in range(k):
        angle = rng.uniform(-cfg.shift_rotation, cfg.shift_rotation)
        contrast = math.exp(rng.uniform(-log_c, log_c))
        brightness = rng.uniform(-cfg.shift_brightness, cfg.shift_brightness)
        domains.append((float(angle), float(contrast), float(brightness)))
    out = []
    for i in range(num_clients):
        d = i % k
        angle, contrast, brightness = domains[d]
        out.append({"domain": d, "rotation": angle, "contrast": contrast, "brightness": brightness})
    return out


def transform(
    images: torch.Tensor, rotation: float = 0.0, contrast: float = 1.0, brightness: float = 0.0
) -> torch.Tensor:
    """uint8 ``[N, C, H, W]`` -> uint8 ``[N, C, H, W]``: rotate, then contrast, then brightness."""
    x = images.to(torch.float32).div(255.0)
    if rotation != 0.0:
        t = math.radians(rotation)
        cos, sin = math.cos(t), math.sin(t)
        # affine_grid maps output coordinates (x right, y down, in [-1, 1]) to input ones;
        # with y pointing down this matrix shows the image turned counter-clockwise by t
        # (90 degrees equals torch.rot90(k=1)); h/w rescale for non-square images.
        h, w = x.shape[-2:]
        theta = torch.tensor([[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]])
        grid = F.affine_grid(theta.expand(x.shape[0], 2, 3), list(x.shape), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if contrast != 1.0:
        m = x.mean(dim=(1, 2, 3), keepdim=True)  # [N, 1, 1, 1]: each image's own mean
        x = m + contrast * (x - m)
    if brightness != 0.0:
        x = x + brightness
    return x.clamp_(0.0, 1.0).mul_(255.0).round_().to(torch.uint8)


def apply_shift(
    images: torch.Tensor, client_rows: list[torch.Tensor], shifts: list[dict[str, float]]
) -> torch.Tensor:
    """A copy of ``images`` where each client's rows carry its transform (others untouched)."""
    out = images.clone()  # the loaders' tensors are shared with their decode cache
    by_domain: dict[int, list[torch.Tensor]] = {}
    for rows, s in zip(client_rows, shifts):
        by_domain.setdefault(int(s["domain"]), []).append(rows)
    for d, parts in by_domain.items():
        s = next(s for s in shifts if s["domain"] == d)
        rows = torch.cat(parts)
        if rows.numel():
            out[rows] = transform(images[rows], s["rotation"], s["contrast"], s["brightness"])
    return out
