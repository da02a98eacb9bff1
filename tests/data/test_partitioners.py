"""Partitioner properties: disjoint, covering, class counts, sizes, determinism, failures."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedmosaic.core.registry import PARTITIONERS
from fedmosaic.data import PartitionError, dirichlet, partition, pathological, skewed

# 10 classes, slightly unbalanced (95..104 samples), in a shuffled order.
LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), np.arange(95, 105)))
KW = dict(num_classes=10, alpha=0.5, classes_per_client=2, min_size=10, max_tries=1000)
COVERING = ["iid", "dirichlet", "pathological", "quantity_dirichlet", "quantity_power_law"]


def run(
    name: str, seed: int = 0, labels: np.ndarray = LABELS, n: int = 20, **kw
) -> list[np.ndarray]:
    return partition(name, labels, n, np.random.default_rng(seed), **{**KW, **kw})


def test_registry() -> None:
    assert PARTITIONERS.names() == [
        "dirichlet",
        "iid",
        "pathological",
        "pfedhn",
        "quantity_dirichlet",
        "quantity_power_law",
        "shards",
        "skewed",
    ]


@pytest.mark.parametrize("name", PARTITIONERS.names())
def test_disjoint_sorted_int64(name: str) -> None:
    parts = run(name)
    assert len(parts) == 20
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0) and p.size > 0
    flat = np.concatenate(parts)
    assert np.unique(flat).size == flat.size  # no row in two clients
    assert flat.min() >= 0 and flat.max() < LABELS.size


@pytest.mark.parametrize("name", COVERING)
def test_covering(name: str) -> None:
    flat = np.sort(np.concatenate(run(name)))
    np.testing.assert_array_equal(flat, np.arange(LABELS.size))


@pytest.mark.parametrize("name", PARTITIONERS.names())
def test_same_seed_same_split_other_seed_other_split(name: str) -> None:
    a, b, c = run(name, 0), run(name, 0), run(name, 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_equal_sizes() -> None:
    sizes = [p.size for p in run("iid", n=7)]
    assert max(sizes) - min(sizes) <= 1


def n_classes(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> list[int]:
    return [np.unique(labels[p]).size for p in parts]


@pytest.mark.parametrize("n, k", [(20, 2), (10, 1), (5, 2), (10, 5), (50, 2), (4, 10)])
def test_pathological_exactly_k(n: int, k: int) -> None:
    parts = run("pathological", n=n, classes_per_client=k)
    assert n_classes(parts) == [k] * n


def test_pathological_follows_pflib_blocks() -> None:
    # 20 clients x 2 classes over 10 classes: each class goes to 4 clients; clients 0-3 take
    # classes 0 and 1, clients 4-7 classes 2 and 3, and so on.
    parts = run("pathological", n=20, classes_per_client=2)
    for i, p in enumerate(parts):
        block = i // 4
        assert set(np.unique(LABELS[p]).tolist()) == {2 * block, 2 * block + 1}
    sizes = [p.size for p in parts]
    assert len(set(sizes)) > 1  # unbalanced, as PFLlib


@pytest.mark.parametrize(
    "n, k, match",
    [
        (20, 11, "classes_per_client = 11"),
        (7, 2, "no client left"),  # 7 x 2 slots: classes 8 and 9 would be dropped
        (20, 3, "fewer than classes_per_client"),  # blocks of 6 clients leave 2 clients short
    ],
)
def test_pathological_impossible(n: int, k: int, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        run("pathological", n=n, classes_per_client=k)


@pytest.mark.parametrize("n, k", [(20, 2), (7, 3), (10, 10), (3, 1), (30, 4)])
def test_skewed_exactly_k_equal_sizes(n: int, k: int) -> None:
    parts = run("skewed", n=n, classes_per_client=k, min_size=1)
    assert n_classes(parts) == [k] * n
    assert len({p.size for p in parts}) == 1
    per_class = [np.bincount(LABELS[p], minlength=10) for p in parts]
    assert all(set(c[c > 0].tolist()) == {parts[0].size // k} for c in per_class)


def test_skewed_impossible() -> None:
    with pytest.raises(PartitionError, match="classes_per_client = 0"):
        run("skewed", classes_per_client=0)
    with pytest.raises(PartitionError, match="fewer samples than clients"):
        run(
            "skewed",
            labels=np.arange(10) % 5,
            n=20,
            classes_per_client=1,
            num_classes=5,
            min_size=1,
        )


@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_min_size(alpha: float) -> None:
    parts = run("dirichlet", n=10, alpha=alpha, min_size=25)
    assert min(p.size for p in parts) >= 25


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_balanced() -> None:
    def mean_classes(alpha: float) -> float:
        return float(np.mean(n_classes(run("dirichlet", alpha=alpha, min_size=1))))

    assert mean_classes(0.05) < 4 and mean_classes(100.0) == 10


def test_dirichlet_moon_cap() -> None:
    # Two equal classes, two clients: a client that took all of class 0 (its fair share N/2)
    # gets a zero share of class 1, so no client ever ends up with both classes complete.
    labels = np.repeat([0, 1], 100)
    for seed in range(40):
        parts = dirichlet(labels, 2, np.random.default_rng(seed), alpha=0.01, min_size=0)
        assert max(p.size for p in parts) < 200


def test_dirichlet_impossible_fails_fast() -> None:
    start = time.perf_counter()
    with pytest.raises(PartitionError, match="larger alpha.*smaller min_size.*fewer clients"):
        run("dirichlet", n=10, alpha=0.01, min_size=90, max_tries=200)
    with pytest.raises(PartitionError, match="cannot give 20 clients"):
        run("dirichlet", min_size=51)  # 995 samples < 20 x 51: no redraw can help
    assert time.perf_counter() - start < 5.0


def test_partitioners_take_the_common_keywords() -> None:
    rng = np.random.default_rng(0)
    for name in PARTITIONERS.names():
        parts = PARTITIONERS.get(name)(LABELS, 5, rng, **KW)
        assert len(parts) == 5


def test_bad_labels() -> None:
    with pytest.raises(PartitionError, match="num_classes = 5"):
        pathological(LABELS, 5, np.random.default_rng(0), num_classes=5)
    with pytest.raises(PartitionError, match="unknown"):
        partition("mcmahan", LABELS, 5, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="1-D integer"):
        skewed(LABELS.astype(float), 5, np.random.default_rng(0))
