"""Quantity-skew partitioners: hand-computed sizes, the skew present, min_size, label modes,
bad settings (PartitionError from the functions, ConfigError from the config, naming the key)."""

from __future__ import annotations

import numpy as np
import pytest

from fedmosaic import config
from fedmosaic.config import ConfigError
from fedmosaic.data import PartitionError, partition
from fedmosaic.data.partition import _largest_remainder, quantity_power_law

# 10 classes, slightly unbalanced (95..104 samples, 995 in all), in a shuffled order.
LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), np.arange(95, 105)))
QUANTITY = ["quantity_dirichlet", "quantity_power_law"]


def run(name: str, n: int = 10, seed: int = 0, **kw) -> list[np.ndarray]:
    kw = {"num_classes": 10, "min_size": 10, **kw}
    return partition(name, LABELS, n, np.random.default_rng(seed), **kw)


def sizes(parts: list[np.ndarray]) -> np.ndarray:
    return np.array([p.size for p in parts])


def n_classes(parts: list[np.ndarray]) -> list[int]:
    return [np.unique(LABELS[p]).size for p in parts]


def test_largest_remainder_by_hand() -> None:
    # 945 over weights 1, 1/2, .., 1/5 (sum 137/60): shares 413.87 206.93 137.96 103.47 82.77;
    # floors sum to 941, the 4 left go to remainders .96, .93, .87, .77.
    w = 1.0 / np.arange(1, 6)
    np.testing.assert_array_equal(_largest_remainder(945, w), [414, 207, 138, 103, 83])
    np.testing.assert_array_equal(_largest_remainder(7, np.ones(3)), [3, 2, 2])


def test_power_law_sizes_by_hand() -> None:
    # 995 rows, 5 clients, min_size 10: 945 shared as above, plus 10 each.
    parts = quantity_power_law(LABELS, 5, np.random.default_rng(3), num_classes=10, min_size=10)
    got = sizes(parts)
    assert sorted(got.tolist(), reverse=True) == [424, 217, 148, 113, 93]
    ranks = np.random.default_rng(3).permutation(5) + 1  # the partitioner's first draw
    np.testing.assert_array_equal(got, np.array([424, 217, 148, 113, 93])[ranks - 1])
    # exponent 0: equal sizes
    flat = sizes(run("quantity_power_law", n=5, power_law_exponent=0.0))
    assert flat.tolist() == [199] * 5


@pytest.mark.parametrize("name", QUANTITY)
@pytest.mark.parametrize("labels", ["iid", "dirichlet"])
def test_cover_every_row_once_and_deterministic(name: str, labels: str) -> None:
    a = run(name, quantity_labels=labels, alpha=0.3)
    b = run(name, quantity_labels=labels, alpha=0.3)
    c = run(name, seed=1, quantity_labels=labels, alpha=0.3)
    np.testing.assert_array_equal(np.sort(np.concatenate(a)), np.arange(LABELS.size))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_sizes_skew_follows_quantity_alpha() -> None:
    def spread(qa: float) -> float:  # mean over seeds of largest / smallest client
        return float(
            np.mean(
                [
                    (
                        s := sizes(run("quantity_dirichlet", seed=k, quantity_alpha=qa, min_size=1))
                    ).max()
                    / s.min()
                    for k in range(5)
                ]
            )
        )

    assert spread(1000.0) < 1.3  # near-equal sizes
    assert spread(0.5) > 8.0  # strongly unequal


@pytest.mark.parametrize("name", QUANTITY)
def test_labels_iid_or_dirichlet_within_the_sizes(name: str) -> None:
    iid = run(name, n=5, quantity_labels="iid", quantity_alpha=50.0)
    skew = run(name, n=5, quantity_labels="dirichlet", alpha=0.05, quantity_alpha=50.0)
    np.testing.assert_array_equal(sizes(iid), sizes(skew))  # same sizes draw, labels differ
    assert n_classes(iid) == [10] * 5  # every client sees every class
    # IID: each client's class shares stay near the pool's (about 0.1 each)
    for p in iid:
        share = np.bincount(LABELS[p], minlength=10) / p.size
        assert np.abs(share - 0.1).max() < 0.06
    assert np.mean(n_classes(skew)) < 7  # Dir(0.05) concentrates each client on a few classes


def test_min_size_respected() -> None:
    # Dir(3) sizes over 10 clients (mean 99.5): some draws have a client below 40, redrawn.
    assert sizes(run("quantity_dirichlet", quantity_alpha=3.0, min_size=40)).min() >= 40
    # k^-3 leaves the tail clients with the floor exactly
    assert sizes(run("quantity_power_law", n=20, min_size=30, power_law_exponent=3.0)).min() == 30


@pytest.mark.parametrize(
    "name, kw, match",
    [
        ("quantity_dirichlet", {"quantity_alpha": 0.0}, "data.quantity_alpha = 0.0"),
        ("quantity_dirichlet", {"quantity_alpha": -1.0}, "data.quantity_alpha = -1.0"),
        ("quantity_power_law", {"power_law_exponent": -0.5}, "data.power_law_exponent = -0.5"),
        ("quantity_power_law", {"quantity_labels": "shards"}, "data.quantity_labels = 'shards'"),
        ("quantity_dirichlet", {"quantity_labels": "dirichlet", "alpha": 0.0}, "data.alpha"),
        ("quantity_power_law", {"min_size": 200}, "min_size = 200"),
        (
            "quantity_dirichlet",
            {"min_size": 90, "quantity_alpha": 0.05, "max_tries": 50},
            "larger quantity_alpha",
        ),
    ],
)
def test_bad_settings_name_the_key(name: str, kw: dict, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        run(name, **kw)


@pytest.mark.parametrize(
    "override, key",
    [
        ("data.quantity_alpha=nan", "data.quantity_alpha"),
        ("data.quantity_alpha=-1.0", "data.quantity_alpha"),
        ('data.quantity_alpha="big"', "data.quantity_alpha"),
        ("data.power_law_exponent=-2", "data.power_law_exponent"),
        ("data.power_law_exponent=inf", "data.power_law_exponent"),
        ('data.quantity_labels="shards"', "data.quantity_labels"),
        ("data.shift_rotation=-5", "data.shift_rotation"),
        ("data.shift_rotation=nan", "data.shift_rotation"),
        ("data.shift_contrast=0.5", "data.shift_contrast"),
        ("data.shift_brightness=2.0", "data.shift_brightness"),
        ("data.shift_domains=-1", "data.shift_domains"),
        ("data.shift_domains=1.5", "data.shift_domains"),
        ("data.hf_image_column=3", "data.hf_image_column"),
    ],
)
def test_config_rejects_bad_values_in_one_line(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config.load(None, ['data.partition="quantity_dirichlet"', override])
    msg = str(exc.value)
    assert key in msg and "\n" not in msg


def test_config_runs_the_new_partitions() -> None:
    cfg = config.load(None, ['data.partition="quantity_power_law"', "data.power_law_exponent=0"])
    assert cfg.data.partition == "quantity_power_law" and cfg.data.power_law_exponent == 0.0
