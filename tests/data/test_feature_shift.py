"""Feature shift: hand-checked transforms, seeded per-domain draws, and build_federated_data
applying each client's transform to its rows only (labels and the partition unchanged)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmosaic.config import DataConfig
from fedmosaic.data import build_federated_data
from fedmosaic.data.shift import draw_domains, transform


def cfg(**kw) -> DataConfig:
    base = dict(
        dataset="synthetic",
        synthetic_size=600,
        synthetic_classes=6,
        synthetic_shape=[1, 8, 8],
        num_clients=6,
        partition="iid",
        public_size=60,
    )
    return DataConfig(**{**base, **kw})


def test_rotation_matches_rot90_and_keeps_square_images_exact() -> None:
    x = torch.randint(0, 256, (3, 1, 6, 6), dtype=torch.uint8)
    for k, angle in [(1, 90.0), (2, 180.0), (3, 270.0), (3, -90.0)]:
        assert torch.equal(transform(x, rotation=angle), torch.rot90(x, k, dims=(2, 3)))
    assert torch.equal(transform(x), x)  # no-op transform


def test_contrast_and_brightness_by_hand() -> None:
    # pixels 50 and 150 (mean 100): contrast 2 -> 0 and 200; brightness 0.2 adds 51.
    x = torch.tensor([50, 150], dtype=torch.uint8).view(1, 1, 1, 2)
    assert transform(x, contrast=2.0).flatten().tolist() == [0, 200]
    assert transform(x, contrast=2.0, brightness=0.2).flatten().tolist() == [51, 251]
    assert transform(x, contrast=0.5).flatten().tolist() == [75, 125]
    # clipped to [0, 255]
    y = torch.tensor([0, 250], dtype=torch.uint8).view(1, 1, 1, 2)
    assert transform(y, brightness=0.1).flatten().tolist() == [26, 255]  # 25.5 and 275.5
    assert transform(y, contrast=3.0).flatten().tolist() == [0, 255]  # -250 and 500


def test_domains_are_seeded_and_within_range() -> None:
    c = cfg(shift_rotation=30.0, shift_contrast=2.0, shift_brightness=0.1, shift_domains=3)
    a, b, other = draw_domains(c, 5, 7), draw_domains(c, 5, 7), draw_domains(c, 6, 7)
    assert a == b and a != other
    assert [s["domain"] for s in a] == [0, 1, 2, 0, 1, 2, 0]
    assert a[0] == {**a[3], "domain": 0} == {**a[6], "domain": 0}
    for s in a:
        assert abs(s["rotation"]) <= 30 and 0.5 <= s["contrast"] <= 2.0
        assert abs(s["brightness"]) <= 0.1
    # turning one range off keeps the other draws (always three draws per domain)
    rot_only = draw_domains(cfg(shift_rotation=30.0, shift_domains=3), 5, 7)
    assert [s["rotation"] for s in rot_only] == [s["rotation"] for s in a]
    assert all(s["contrast"] == 1.0 and s["brightness"] == 0.0 for s in rot_only)
    # shift_domains = 0: every client its own domain
    assert [s["domain"] for s in draw_domains(cfg(shift_rotation=10.0), 0, 4)] == [0, 1, 2, 3]


def test_build_applies_each_clients_transform_to_its_rows_only() -> None:
    plain = build_federated_data(cfg(), 0)
    c = cfg(shift_rotation=90.0, shift_contrast=1.5, shift_domains=2)
    fd = build_federated_data(c, 0)
    again = build_federated_data(c, 0)
    assert torch.equal(fd.dataset.images, again.dataset.images)  # deterministic in cfg + seed
    assert fd.shifts == draw_domains(c, 0, 6) and plain.shifts == []
    assert torch.equal(fd.dataset.labels, plain.dataset.labels)
    assert torch.equal(fd.public, plain.public)
    for a, b in zip(fd.clients, plain.clients):  # same partition and splits
        assert all(torch.equal(a.get(s), b.get(s)) for s in ("train", "val", "test"))
    np.testing.assert_array_equal(fd.label_histograms("all"), plain.label_histograms("all"))
    orig = plain.dataset.images
    for cs, s in zip(fd.clients, fd.shifts):
        rows = cs.get("all")
        want = transform(orig[rows], s["rotation"], s["contrast"], s["brightness"])
        assert torch.equal(fd.dataset.images[rows], want)
    assert torch.equal(fd.dataset.images[fd.public], orig[fd.public])  # server data untouched
    # the cached source tensor was not modified in place
    assert torch.equal(build_federated_data(cfg(), 0).dataset.images, orig)


@pytest.mark.slow
def test_real_fashion_mnist_rotated_domains() -> None:
    root = Path("/usr/share/datasets/fashion-mnist")
    if not root.is_dir():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    base = dict(dataset="fmnist", root=str(root), subsample=0.02, num_clients=4, partition="iid")
    plain = build_federated_data(DataConfig(**base), 0)
    c = DataConfig(**base, shift_rotation=180.0, shift_contrast=2.0, shift_domains=4)
    fd = build_federated_data(c, 0)
    np.testing.assert_array_equal(fd.label_histograms("all"), plain.label_histograms("all"))
    angles = [s["rotation"] for s in fd.shifts]
    assert len(set(angles)) == 4
    for cs, s in zip(fd.clients, fd.shifts):
        rows = cs.get("all")
        got = fd.dataset.images[rows].float()
        want = transform(plain.dataset.images[rows], s["rotation"], s["contrast"], 0.0)
        assert torch.equal(fd.dataset.images[rows], want)
        # contrast acts: the per-image pixel std scales by about the factor (clipping aside)
        ratio = (
            got.std(dim=(1, 2, 3)).mean()
            / transform(plain.dataset.images[rows], s["rotation"]).float().std(dim=(1, 2, 3)).mean()
        )
        assert math.isclose(float(ratio), s["contrast"], rel_tol=0.25)
