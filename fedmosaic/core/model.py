"""ClientModel: encoder -> [B, feature_dim] -> head, with named parts."""

from __future__ import annotations

import torch
from torch import Tensor, nn

PARTS = ("all", "encoder", "head")


class ClientModel(nn.Module):
    """encoder(x) -> [B, feature_dim] -> head -> [B, num_classes].

    ``feature_dim`` is this model's own width: the common ``model.feature_dim``, or, for a method
    that keeps each encoder's natural width (``Algorithm.model_projection`` -> ``"none"``, e.g.
    FedHeNN), a per-client value. Code that needs a common width must not assume it then.

    Parts are addressed by name: ``all``, ``encoder``, ``head``. The encoder's top-level children
    (``encoder.named_children()``) are its blocks in forward order (used by layer expansion).
    """

    def __init__(
        self,
        encoder: nn.Module,
        head: nn.Module,
        feature_dim: int,
        num_classes: int,
        arch: str = "",
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.arch = arch

    def features(self, x: Tensor) -> Tensor:
        return self.encoder(x)  # [B, feature_dim]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))  # [B, C]

    def part(self, part: str) -> nn.Module:
        if part == "all":
            return self
        if part == "encoder":
            return self.encoder
        if part == "head":
            return self.head
        raise KeyError(f"unknown model part {part!r}; known: {', '.join(PARTS)}")

    def part_state(self, part: str) -> dict[str, Tensor]:
        """Detached copies of the part's parameters and buffers (names relative to the part)."""
        return {k: v.detach().clone() for k, v in self.part(part).state_dict().items()}

    def load_part_state(self, part: str, state: dict[str, Tensor]) -> None:
        module = self.part(part)
        own = module.state_dict()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(
                f"state for part {part!r}: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        with torch.no_grad():
            for k, v in own.items():
                src = state[k]
                if src.shape != v.shape:
                    raise ValueError(
                        f"state for part {part!r}: {k} has shape {tuple(src.shape)}, "
                        f"expected {tuple(v.shape)}"
                    )
                v.copy_(src)

    def named_part_parameters(self, part: str) -> dict[str, nn.Parameter]:
        prefix = "" if part == "all" else f"{part}."
        return {prefix + k: p for k, p in self.part(part).named_parameters()}

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The encoder's blocks in forward order, as (qualified name prefix, module)."""
        return [(f"encoder.{n}", m) for n, m in self.encoder.named_children()]
