"""The papers' label-skew splits (``shards``: FedHeNN; ``pfedhn``: pFedHN / FedGH), and a pin on
PFLlib's ``pathological`` split, which the committed suite cells use."""

from __future__ import annotations

import numpy as np
import pytest

from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.registry import PARTITIONERS
from fedmosaic.data import PartitionError, partition

pytestmark = pytest.mark.unit

# 4 classes x 5 rows, in label order: class c is rows 5c .. 5c+4.
SMALL = np.repeat(np.arange(4), 5)
# 10 classes, slightly unbalanced (95..104 rows), in a shuffled order.
LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), np.arange(95, 105)))


def run(
    name: str,
    labels: np.ndarray = LABELS,
    n: int = 10,
    k: int = 2,
    seed: int = 0,
    num_classes: int = 10,
    min_size: int = 1,
) -> list[np.ndarray]:
    return partition(
        name,
        labels,
        n,
        np.random.default_rng(seed),
        num_classes=num_classes,
        alpha=0.5,
        classes_per_client=k,
        min_size=min_size,
        max_tries=1000,
    )


def classes(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> list[list[int]]:
    return [np.unique(labels[p]).tolist() for p in parts]


def as_lists(parts: list[np.ndarray]) -> list[list[int]]:
    return [p.tolist() for p in parts]


def test_registered() -> None:
    assert "shards" in PARTITIONERS and "pfedhn" in PARTITIONERS
    for name in ("shards", "pfedhn"):
        assert from_dict({"data": {"partition": name}}).data.partition == name


# --------------------------------------------------------------------------- pathological pin


def test_pathological_unchanged() -> None:
    # PFLlib's block split as committed: clients (0, 1) hold {0, 1}, (2, 3) hold {2, 3}.
    parts = run("pathological", SMALL, n=4, k=2, num_classes=4)
    assert as_lists(parts) == [
        [2, 9],
        [0, 1, 3, 4, 5, 6, 7, 8],
        [10, 18],
        [11, 12, 13, 14, 15, 16, 17, 19],
    ]
    parts = run("pathological", n=10, k=2, min_size=10)
    assert [p.size for p in parts] == [64, 127, 82, 113, 58, 141, 56, 147, 76, 131]
    assert classes(parts) == [[2 * (i // 2), 2 * (i // 2) + 1] for i in range(10)]


# --------------------------------------------------------------------------------- shards

# 4 clients x 2 shards over 4 classes: 2 shards a class; class c's rows 5c..5c+4 are cut into
# runs of 5 // 2 = 2 rows, and its last row joins its first shard.
SMALL_SHARDS = sorted(
    [[5 * c, 5 * c + 1, 5 * c + 4] for c in range(4)] + [[5 * c + 2, 5 * c + 3] for c in range(4)]
)


@pytest.mark.parametrize("seed", range(6))
def test_shards_small_case_is_whole_shards(seed: int) -> None:
    parts = run("shards", SMALL, n=4, k=2, seed=seed, num_classes=4)
    dealt = []
    for p in parts:  # each client's rows are exactly two of the hand-listed shards
        mine = [s for s in SMALL_SHARDS if set(s) <= set(p.tolist())]
        assert len(mine) == 2 and sorted(sum(mine, [])) == p.tolist()
        dealt += mine
    assert sorted(dealt) == SMALL_SHARDS  # every shard dealt once: the pool is covered


def test_shards_pinned() -> None:
    # seed 1 deals both shards of class 2 to client 2 (the reference keeps such a deal).
    assert as_lists(run("shards", SMALL, n=4, k=2, seed=0, num_classes=4)) == [
        [2, 3, 10, 11, 14],
        [12, 13, 17, 18],
        [0, 1, 4, 7, 8],
        [5, 6, 9, 15, 16, 19],
    ]
    assert as_lists(run("shards", SMALL, n=4, k=2, seed=1, num_classes=4)) == [
        [0, 1, 4, 7, 8],
        [2, 3, 5, 6, 9],
        [10, 11, 12, 13, 14],
        [15, 16, 17, 18, 19],
    ]


@pytest.mark.parametrize("n, k", [(10, 2), (10, 5), (20, 2), (5, 4), (4, 5)])
def test_shards_k_equal_shards_of_one_class(n: int, k: int) -> None:
    labels = np.random.default_rng(1).permutation(np.repeat(np.arange(10), 120))
    parts = run("shards", labels, n=n, k=k)
    per_class = n * k // 10
    shard = 120 // per_class
    assert 120 % per_class == 0 and [p.size for p in parts] == [k * shard] * n
    for p in parts:  # k shards: each class held in a whole number of shards
        counts = np.bincount(labels[p], minlength=10)
        assert set((counts[counts > 0] % shard).tolist()) == {0}
        assert counts.sum() // shard == k
    # every class is dealt n * k / C shards in all
    held = np.bincount(np.concatenate([labels[p] for p in parts]), minlength=10)
    np.testing.assert_array_equal(held, np.full(10, 120))


def test_shards_random_overlapping_class_sets() -> None:
    # Unlike pathological's blocks, class sets overlap without being equal (FedHeNN's example:
    # {2, 3, 4, 5, 8} and {1, 4, 5, 6, 7}).
    sets = classes(run("shards", n=10, k=5))
    assert len({tuple(s) for s in sets}) == 10
    assert classes(run("shards", n=10, k=5, seed=1)) != sets


def test_shards_covers_unbalanced_classes() -> None:
    parts = run("shards", n=20, k=2)  # 95..104 rows per class, 4 shards a class
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(LABELS.size))
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)
    # a shard of class c has n_c // 4 or n_c // 4 + 1 rows
    for p in parts:
        for cls, count in enumerate(np.bincount(LABELS[p], minlength=10)):
            n_c = 95 + cls
            assert count in (
                0,
                n_c // 4,
                n_c // 4 + 1,
                2 * (n_c // 4),
                2 * (n_c // 4) + 1,
                2 * (n_c // 4) + 2,
            )


def test_shards_duplicates_as_reference() -> None:
    # The deal is a shuffled multiset: over seeds, some client draws one class twice.
    seen = [min(len(c) for c in classes(run("shards", n=10, k=2, seed=s))) for s in range(20)]
    assert min(seen) == 1 and max(seen) == 2


@pytest.mark.parametrize(
    "n, k, labels, match",
    [
        (7, 2, LABELS, r"7 x 2 = 14 shards .* num_classes = 10"),
        (10, 11, LABELS, r"shards: classes_per_client = 11 must be in \[1, num_classes = 10\]"),
        (10, 0, LABELS, r"classes_per_client = 0"),
        (20, 5, np.repeat(np.arange(10), 5), r"class 0 has 5 samples for 10 shards"),
    ],
)
def test_shards_refusals(n: int, k: int, labels: np.ndarray, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        run("shards", labels, n=n, k=k)


def test_shards_min_size() -> None:
    with pytest.raises(
        PartitionError, match="shards: a client gets 4 samples, fewer than min_size = 5"
    ):
        run("shards", np.repeat(np.arange(2), 10), n=5, k=2, num_classes=2, min_size=5)


# --------------------------------------------------------------------------------- pfedhn


def test_pfedhn_small_case() -> None:
    # 4 clients x 2 of 4 classes: m = 8 // 4 + 1 = 3 slots a class, 2 taken, so each class has
    # exactly 2 holders; a share is u / (u + v + w), u, v, w in [0.4, 0.6], so in [0.25, 3/7]
    # and a holder takes int(5 * share) in {1, 2} rows.
    for seed in range(10):
        parts = run("pfedhn", SMALL, n=4, k=2, seed=seed, num_classes=4)
        sets = classes(parts, SMALL)
        assert [len(s) for s in sets] == [2, 2, 2, 2]
        assert np.bincount(sum(sets, []), minlength=4).tolist() == [2, 2, 2, 2]
        for p in parts:
            assert set(np.bincount(SMALL[p], minlength=4).tolist()) <= {0, 1, 2}
        # at most 2 x int(5 x 3/7) = 4 of a class's 5 rows are dealt: never the whole pool
        assert sum(p.size for p in parts) <= 16


def test_pfedhn_pinned() -> None:
    assert as_lists(run("pfedhn", SMALL, n=4, k=2, seed=0, num_classes=4)) == [
        [7, 19],
        [4, 13],
        [0, 18],
        [9, 12],
    ]
    parts = run("pfedhn", n=10, k=2, seed=0)
    # balanced: clients 0-4 take each class once, clients 5-9 each class once more
    assert classes(parts) == [
        [6, 8],
        [2, 5],
        [0, 9],
        [4, 7],
        [1, 3],
        [3, 5],
        [2, 4],
        [6, 8],
        [0, 9],
        [1, 7],
    ]
    assert [p.size for p in parts] == [68, 64, 60, 71, 61, 72, 59, 66, 64, 70]


@pytest.mark.parametrize("n, k", [(10, 2), (10, 3), (7, 3), (50, 2), (13, 10), (3, 9), (25, 4)])
def test_pfedhn_exactly_k_balanced_holders(n: int, k: int) -> None:
    for seed in range(3):
        parts = run("pfedhn", n=n, k=k, seed=seed)
        sets = classes(parts)
        assert [len(s) for s in sets] == [k] * n
        holders = np.bincount(sum(sets, []), minlength=10)
        assert holders.sum() == n * k and holders.max() - holders.min() <= 1
        flat = np.concatenate(parts)
        assert np.unique(flat).size == flat.size  # disjoint


@pytest.mark.parametrize("n, k", [(10, 2), (10, 3), (50, 2)])
def test_pfedhn_shares_within_bounds(n: int, k: int) -> None:
    # Every holder's share of a class is u / (sum of m draws), u in [0.4, 0.6], m = n*k//C + 1;
    # it takes int(n_c * share) rows: so n_c * lo - 1 < rows <= n_c * hi.
    m = n * k // 10 + 1
    lo, hi = 0.4 / (0.4 + 0.6 * (m - 1)), 0.6 / (0.6 + 0.4 * (m - 1))
    n_c = np.bincount(LABELS, minlength=10)
    for seed in range(3):
        parts = run("pfedhn", n=n, k=k, seed=seed)
        dealt = np.zeros(10)
        for p in parts:
            counts = np.bincount(LABELS[p], minlength=10)
            held = counts > 0
            assert np.all(counts[held] > n_c[held] * lo - 1)
            assert np.all(counts[held] <= n_c[held] * hi)
            dealt += counts
        holders = np.bincount(sum(classes(parts), []), minlength=10)
        # m draws normalized to 1, only `holders` of them taken: a share of at least one slot
        # (>= lo) of each class is left out, as in the reference
        assert np.all(dealt <= n_c * (1 - lo * (m - holders)))


def test_pfedhn_differs_from_pathological_blocks() -> None:
    sets = classes(run("pfedhn", n=10, k=2))
    blocks = classes(run("pathological", n=10, k=2, min_size=10))
    assert blocks == [[2 * (i // 2), 2 * (i // 2) + 1] for i in range(10)]
    assert sets != blocks and len({tuple(s) for s in sets}) > 5


@pytest.mark.parametrize(
    "n, k, labels, match",
    [
        (10, 11, LABELS, r"pfedhn: classes_per_client = 11 must be in \[1, num_classes = 10\]"),
        (10, 0, LABELS, r"classes_per_client = 0"),
        (20, 2, np.repeat(np.arange(10), 2), r"class \d has 2 samples, too few"),
    ],
)
def test_pfedhn_refusals(n: int, k: int, labels: np.ndarray, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        run("pfedhn", labels, n=n, k=k)


def test_pfedhn_min_size() -> None:
    with pytest.raises(PartitionError, match="pfedhn: a client gets .* fewer than min_size = 500"):
        run("pfedhn", n=10, k=2, min_size=500)


# ----------------------------------------------------------------------------------- both


@pytest.mark.parametrize("name", ["shards", "pfedhn"])
def test_same_seed_same_split(name: str) -> None:
    a, b, c = run(name, seed=3), run(name, seed=3), run(name, seed=4)
    assert as_lists(a) == as_lists(b)
    assert as_lists(a) != as_lists(c)


@pytest.mark.parametrize("name", ["shards", "pfedhn"])
def test_bad_labels_refused(name: str) -> None:
    with pytest.raises(PartitionError, match="num_classes = 5"):
        run(name, num_classes=5)
    with pytest.raises(PartitionError, match="1-D integer"):
        run(name, LABELS.astype(float))


def test_config_refuses_unknown_partition() -> None:
    with pytest.raises(ConfigError, match="shards, pfedhn"):
        from_dict({"data": {"partition": "mcmahan"}})
