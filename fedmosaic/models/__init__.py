"""The model zoo: encoders (``ENCODERS``), named heterogeneous families (``FAMILIES``) and
``build_client_model``. Importing this package registers everything.

Encoder contract: ``ENCODERS.get(name)(in_channels, image_size) -> (encoder, natural_dim)`` where
``encoder`` is an ``nn.Sequential`` of named blocks (applied in order; each owns parameters) that
maps ``[B, C, H, W]`` to ``[B, natural_dim]``. Block splits are listed in each builder's docstring.
"""

from . import cnn, mobile, resnet  # noqa: F401  (registration)
from .build import (
    build_client_model,
    build_encoder,
    build_head,
    ends_nonnegative,
    parse_head,
    split_member,
)
from .families import family_members
from .flops import count_params, flops_per_image, trainable_flops

__all__ = [
    "build_client_model",
    "build_encoder",
    "ends_nonnegative",
    "build_head",
    "count_params",
    "family_members",
    "flops_per_image",
    "parse_head",
    "split_member",
    "trainable_flops",
]
