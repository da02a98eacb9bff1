"""Plain CNN encoders: FedAvg's 4-layer CNN, FedTGP's CNN1..CNN8, FedGH's and FedHeNN's CNNs, the
layer-expansion paper's shallow CNN and FedClassAvg's small-image AlexNet.

Conventions shared by every encoder here (and documented per builder):

- Each conv block is ``Conv2d -> 2x2 max pool -> ReLU`` (see ``_layers`` for why the pool comes
  first; it is the same function as conv -> ReLU -> pool). Blocks are named ``conv1..convK``.
- Each hidden fully-connected block is ``Linear -> ReLU``, named ``fc1..fcM``; ``fc1`` starts with
  the flatten, so every block owns parameters (layer expansion unfreezes blocks one by one).
- The paper's last layer (the classifier, e.g. FedTGP's "10-d fc") is *not* part of the encoder:
  it is the ClientModel's head. The encoder's last fc is the feature layer and, as in
  PFLlib/HtFLlib's ``FedAvgCNN`` and HtFLlib's ``CNN`` (``Linear -> ReLU`` for every hidden fc
  before ``fc``), it ends with a ReLU: features are non-negative.
- Convs are unpadded as in the papers; if an image is too small for the unpadded stack (8x8
  digits) all convs of that encoder use 'same' padding instead (see ``plain_cnn``).
- No dropout anywhere (FedClassAvg's AlexNet has one before its fc): forward passes in train mode
  stay deterministic and ``torch.func`` batching needs no randomness handling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch import nn

from fedmosaic.core.registry import ENCODERS

from ._layers import ToChannelsLast, fc_relu, plain_cnn

Builder = Callable[[int, int], tuple[nn.Module, int]]


def _register_plain(
    name: str, convs: list[tuple[int, int, int]], fcs: list[int], doc: str
) -> Builder:
    def build(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
        return plain_cnn(in_channels, image_size, convs, fcs)

    build.__name__ = name
    build.__qualname__ = name
    build.__doc__ = doc
    ENCODERS.add(name, build)
    return build


def _block_names(num_convs: int, num_fcs: int) -> str:
    return ", ".join(
        [f"conv{i}" for i in range(1, num_convs + 1)] + [f"fc{i}" for i in range(1, num_fcs + 1)]
    )


def _k5(*channels: int) -> list[tuple[int, int, int]]:
    """Unpadded 5x5 convs with the given output channels."""
    return [(c, 5, 0) for c in channels]


_register_plain(
    "fedavgcnn",
    _k5(32, 64),
    [512],
    """FedAvg's 4-layer CNN (McMahan et al. 2017) as in PFLlib/HtFLlib ``FedAvgCNN``.

    conv5x5 32 -> pool -> ReLU, conv5x5 64 -> pool -> ReLU, fc 512 -> ReLU (natural_dim 512);
    the 4th layer (fc -> C) is the head. Flatten dim 1024 at 28x28, 1600 at 32x32, 10816 at 64x64.
    Blocks: conv1, conv2, fc1 (flatten + linear + ReLU). FedTGP's "4-layer CNN" in HtFE2/4/8.
    """,
)

_register_plain(
    "shallowcnn",
    _k5(32, 64),
    [512],
    """The layer-expansion paper's shallow CNN (layer_expansion Table 3): conv1, conv2, fc1 base
    blocks + fc2 head. Same architecture as ``fedavgcnn`` (Table 3's 582,026 parameters are
    fedavgcnn's at 1x28x28 with 10 classes); registered under its own name so configs read like
    the paper. Blocks: conv1, conv2, fc1 = the paper's 3 scheduled base layers.
    """,
)

# FedTGP Table 9 (HtCNN8 for FMNIST): [5x5, 32] max-pool [, [5x5, 64] max-pool], fcs, 10-d fc.
_CNN_TABLE9: dict[str, tuple[list[int], list[int]]] = {
    "cnn1": ([32], [512]),
    "cnn2": ([32, 64], [512]),
    "cnn3": ([32], [512, 512]),
    "cnn4": ([32, 64], [512, 512]),
    "cnn5": ([32], [1024, 512]),
    "cnn6": ([32, 64], [1024, 512]),
    "cnn7": ([32], [1024, 512, 512]),
    "cnn8": ([32, 64], [1024, 512, 512]),
}
for _name, (_convs, _fcs) in _CNN_TABLE9.items():
    _register_plain(
        _name,
        _k5(*_convs),
        _fcs,
        f"""FedTGP Table 9 {_name.upper()}: convs {_convs} (5x5, each + 2x2 max pool), fcs {_fcs}.

        The "10-d fc" is the head; the last fc (512) is the feature layer, with ReLU (HtFLlib
        ``CNN``). Blocks: {_block_names(len(_convs), len(_fcs))}.{" Same as fedavgcnn." if _name == "cnn2" else ""}
        """,
    )

# FedGH Table 2: conv1 5x5 16, conv2 5x5 {32,16,32,32,32}, fc1 {2000,2000,1000,800,500}, fc2 500
# (the 500-d representation layer), fc3 = head. Each conv is followed by a 2x2 max pool: with that,
# the parameter counts reproduce Table 2's model sizes on 3x32x32 (e.g. CNN-1: 2,621,558 params =
# 10.00 MiB, CNN-2: 6.92 MiB, CNN-3: 5.04 MiB, CNN-5: 2.56 vs 2.55). CNN-4's listed 3.81 MB does
# not fit its listed fc1 of 800 (4.04 MiB); we follow the listed widths.
_FEDGH_TABLE2: dict[str, tuple[int, int]] = {
    "fedgh_cnn1": (32, 2000),
    "fedgh_cnn2": (16, 2000),
    "fedgh_cnn3": (32, 1000),
    "fedgh_cnn4": (32, 800),
    "fedgh_cnn5": (32, 500),
}
for _name, (_c2, _f1) in _FEDGH_TABLE2.items():
    _register_plain(
        _name,
        _k5(16, _c2),
        [_f1, 500],
        f"""FedGH Table 2 CNN-{_name[-1]}: conv5x5 16, conv5x5 {_c2} (each + max pool), fc1 {_f1},
        fc2 500 (representation, natural_dim 500; use feature_dim=500 to match the paper, else a
        projection is added). Blocks: conv1, conv2, fc1, fc2.
        """,
    )

# FedHeNN Sec. 4.1: five CNN sizes from (1 conv, 1 fc) to (3 conv, 3 fc), fc counts including the
# output layer; the homogeneous model (2 conv + 3 fc) is LeNet-5-like. The paper gives no widths:
# we use LeNet-5's (convs 6, 16 at 5x5; fcs 120, 84) and a third conv of 32 at 3x3 (padded, so it
# fits 28x28), and step (conv, fc) = (1,1), (1,2), (2,2), (2,3), (3,3).
_FEDHENN: dict[str, tuple[list[tuple[int, int, int]], list[int]]] = {
    "fedhenn_cnn1": (_k5(6), []),
    "fedhenn_cnn2": (_k5(6), [120]),
    "fedhenn_cnn3": (_k5(6, 16), [120]),
    "fedhenn_cnn4": (_k5(6, 16), [120, 84]),
    "fedhenn_cnn5": ([*_k5(6, 16), (32, 3, 1)], [120, 84]),
}
for _name, (_convs3, _fcs) in _FEDHENN.items():
    _register_plain(
        _name,
        _convs3,
        _fcs,
        f"""FedHeNN (Sec. 4.1) CNN size {_name[-1]} of 5: {len(_convs3)} conv + {len(_fcs) + 1} fc
        (the last fc is the head). Convs {[c for c, _, _ in _convs3]}, hidden fcs {_fcs}.
        Blocks: {_block_names(len(_convs3), len(_fcs))}
        (with no hidden fc the flatten ends the last conv block; natural_dim = flattened size).
        """,
    )


@ENCODERS.register("alexnet")
def alexnet(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """FedClassAvg's small-image AlexNet (the paper's custom AlexNet, Sec. 4: torchvision's only
    fits ImageNet): conv3x3 64 -> max pool (2, stride 1, pad 1) -> ReLU, conv3x3 128 -> max pool
    (2, stride 2, pad 1) -> ReLU, conv3x3 256 -> ReLU, adaptive avg pool 3x3, fc 2304 -> 512 -> ReLU
    (natural_dim 512; the paper's feature extractor is "conv layers + one fc"). Its dropout before
    the fc is omitted (see module note). Blocks: conv1, conv2, conv3, fc1 (pool + flatten + fc).
    """
    del image_size  # any size: the adaptive pool fixes the flatten dim
    encoder = nn.Sequential(
        OrderedDict(
            conv1=nn.Sequential(
                nn.Conv2d(in_channels, 64, 3, padding=1),
                ToChannelsLast(),
                nn.MaxPool2d(2, stride=1, padding=1),
                nn.ReLU(),
            ),
            conv2=nn.Sequential(
                nn.Conv2d(64, 128, 3, padding=1),
                ToChannelsLast(),
                nn.MaxPool2d(2, stride=2, padding=1),
                nn.ReLU(),
            ),
            conv3=nn.Sequential(nn.Conv2d(128, 256, 3, padding=1), nn.ReLU()),
            fc1=nn.Sequential(nn.AdaptiveAvgPool2d(3), *fc_relu(256 * 3 * 3, 512, flatten=True)),
        )
    )
    return encoder, 512
