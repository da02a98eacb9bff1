"""Named heterogeneous model families: name -> member strings; client i gets member i % len.

Member strings are ``"<arch>[/<head>]"`` (see ``build``). Sources:

- FedTGP (fedtgp.txt) Sec. "Model heterogeneity", Tab. 2, Appendix Tab. 9 and the HtC4 list:
  ``htfe2``, ``htfe3``, ``htfe4``, ``htfe8``, ``htfe9``, ``htfe8-gray`` (HtCNN8, FMNIST),
  ``htc4`` (Res34-HtC4) and ``htfe8-htc4``. ResNet101/152 are implemented (small-image stem),
  so the groups are complete; they are by far the costliest members on CPU.
- FedClassAvg Sec. 4: ``fedclassavg4``. FedGH Tab. 2: ``fedgh5``. FedHeNN Sec. 4.1: ``fedhenn5``.
"""

from __future__ import annotations

from fedmosaic.core.registry import ENCODERS, FAMILIES

from .build import split_member

_HTC4_HEADS = ["linear", "mlp512", "mlp256", "mlp128"]  # 100-d fc | 512,100 | 256,100 | 128,100
_HTFE8 = [
    "fedavgcnn",
    "googlenet",
    "mobilenetv2",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
]

_FAMILIES: dict[str, list[str]] = {
    "htfe8-gray": [f"cnn{i}" for i in range(1, 9)],
    "htfe2": ["fedavgcnn", "resnet18"],
    "htfe3": ["resnet10", "resnet18", "resnet34"],
    "htfe4": ["fedavgcnn", "googlenet", "mobilenetv2", "resnet18"],
    "htfe8": _HTFE8,
    "htfe9": [
        "resnet4",
        "resnet6",
        "resnet8",
        "resnet10",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
    ],
    # Same encoder, heterogeneous classifiers (FedTGP "Res34-HtC4").
    "htc4": [f"resnet34/{h}" if h != "linear" else "resnet34" for h in _HTC4_HEADS],
    # HtFE8 encoders with HtC4 heads: client i gets encoder i % 8 and head i % 4 (8 = lcm).
    "htfe8-htc4": [
        f"{arch}/{head}" if head != "linear" else arch
        for arch, head in zip(_HTFE8, _HTC4_HEADS * 2)
    ],
    "fedclassavg4": ["resnet18", "shufflenetv2", "googlenet", "alexnet"],
    "fedgh5": [f"fedgh_cnn{i}" for i in range(1, 6)],
    "fedhenn5": [f"fedhenn_cnn{i}" for i in range(1, 6)],
}

for _name, _members in _FAMILIES.items():
    FAMILIES.add(_name, _members)


def family_members(name: str) -> list[str]:
    """Members of a family, or ``[name]`` for a single architecture (``"arch[/head]"``).

    Raises KeyError naming the known families and architectures for anything else.
    """
    if name in FAMILIES:
        return list(FAMILIES.get(name))
    try:
        arch, _ = split_member(name)
    except ValueError as err:
        raise KeyError(f"{name!r}: {err}") from None
    if arch in ENCODERS:
        return [name]
    raise KeyError(
        f"unknown model family or architecture {name!r}; "
        f"families: {', '.join(FAMILIES.names())}; architectures: {', '.join(ENCODERS.names())}"
    )
