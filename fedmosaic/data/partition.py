"""Partitioners (label skew and quantity skew): pure functions from labels to per-client index arrays.

Every partitioner has the signature ``(labels, num_clients, rng, *, <settings>) ->
list[np.ndarray]``; the label-skew ones take ``num_classes, alpha, classes_per_client, min_size,
max_tries`` and ignore those they do not use, the quantity-skew ones also take ``quantity_alpha``,
``power_law_exponent`` and ``quantity_labels``. :func:`partition` passes each partitioner only
the settings its signature names. Returned arrays are sorted int64 positions into ``labels``; they
are pairwise disjoint. All randomness comes from ``rng``, so the same generator state gives the same split.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from fedmosaic.core.registry import PARTITIONERS


class PartitionError(ValueError):
    """A partition that cannot be made; the message says which setting to change."""


def _prepare(
    labels: np.ndarray, num_clients: int, num_classes: int | None
) -> tuple[np.ndarray, int]:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(
            f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}"
        )
    if num_clients < 1:
        raise PartitionError(f"num_clients = {num_clients} must be >= 1")
    inferred = int(labels.max()) + 1 if labels.size else 0
    c = inferred if num_classes is None else int(num_classes)
    if labels.size and (labels.min() < 0 or inferred > c):
        raise PartitionError(f"labels span [{labels.min()}, {labels.max()}] but num_classes = {c}")
    return labels, c


def _by_class(labels: np.ndarray, num_classes: int) -> list[np.ndarray]:
    return [np.flatnonzero(labels == c) for c in range(num_classes)]


def _finish(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [
        np.sort(np.concatenate(p)).astype(np.int64) if p else np.empty(0, np.int64) for p in parts
    ]


@PARTITIONERS.register("iid")
def iid(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Uniformly random, equal-sized shares (sizes differ by at most one)."""
    labels, _ = _prepare(labels, num_clients, num_classes)
    if labels.size < num_clients:
        raise PartitionError(f"{labels.size} samples cannot give each of {num_clients} clients one")
    perm = rng.permutation(labels.size)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) proportions over clients (MOON / PFLlib convention).

    For each class, shares are drawn from Dir(alpha); a client that already holds at least
    N / num_clients samples gets a zero share of later classes. The whole draw is repeated until
    every client has ``>= min_size`` samples, at most ``max_tries`` times.
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    n = labels.size
    if alpha <= 0:
        raise PartitionError(f"dirichlet: alpha = {alpha} must be > 0")
    if n < num_clients * min_size:
        raise PartitionError(
            f"dirichlet: {n} samples cannot give {num_clients} clients >= min_size = {min_size} "
            "each; use fewer clients or a smaller min_size"
        )
    by_class = _by_class(labels, c)
    cap = n / num_clients  # the "fair share" beyond which a client gets no more classes
    smallest = 0
    for _ in range(max(1, max_tries)):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx_c in by_class:
            if idx_c.size == 0:
                continue
            idx_c = rng.permutation(idx_c)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = np.where(np.isfinite(p), p, 0.0) * (sizes < cap)
            if p.sum() <= 0:
                # Every open client drew ~0 (tiny alpha underflow): share evenly among them.
                p = (sizes < cap).astype(np.float64)
            p = p / p.sum()
            cuts = (np.cumsum(p) * idx_c.size).astype(np.int64)[:-1]
            for j, chunk in enumerate(np.split(idx_c, cuts)):
                parts[j].append(chunk)
                sizes[j] += chunk.size
        smallest = int(sizes.min())
        if smallest >= min_size:
            return _finish(parts)
    raise PartitionError(
        f"dirichlet: no split with every client >= min_size = {min_size} samples after "
        f"{max_tries} tries (last smallest client: {smallest}); use a larger alpha "
        f"(now {alpha}), a smaller min_size, fewer clients (now {num_clients}) or more max_tries"
    )


def _check_k(k: int, c: int, name: str) -> None:
    if k < 1 or k > c:
        raise PartitionError(f"{name}: classes_per_client = {k} must be in [1, num_classes = {c}]")


@PARTITIONERS.register("pathological")
def pathological(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """k classes per client with unbalanced sizes, following PFLlib's ``separate_data('pat')``.

    Each client has k class slots. Classes are visited in order; class c goes to the first
    ``ceil(num_clients * k / num_classes)`` clients that still have a free slot (so consecutive
    clients share the same classes, as in PFLlib). The class's samples (shuffled) are split among
    its m holders: m-1 sizes uniform in ``[max(per/10, min_size/num_classes), per)`` with
    ``per = n_c / m`` (PFLlib's ``least_samples`` is our ``min_size``) and the rest to the last;
    every holder gets at least one sample. Raises :class:`PartitionError` when some client would
    not get exactly k classes or some class would have no holder (PFLlib fails or silently drops
    there): choose ``num_clients * k`` a multiple of ``num_classes``, and ``k`` dividing it.
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    k = classes_per_client
    _check_k(k, c, "pathological")
    per_class = math.ceil(num_clients * k / c)  # how many clients hold each class
    slots = np.full(num_clients, k)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls, idx_c in enumerate(_by_class(labels, c)):
        holders = np.flatnonzero(slots > 0)[:per_class]
        if holders.size == 0:
            raise PartitionError(
                f"pathological: class {cls} has no client left to hold it ({num_clients} clients "
                f"x {k} classes with {per_class} clients per class); choose num_clients * "
                f"classes_per_client as a multiple of num_classes = {c}"
            )
        m = holders.size
        if idx_c.size < m:
            raise PartitionError(
                f"pathological: class {cls} has {idx_c.size} samples for {m} clients; use fewer "
                "clients or a larger classes_per_client"
            )
        idx_c = rng.permutation(idx_c)
        per = idx_c.size / m
        low = max(1, int(max(per / 10, min_size / c)))
        high = int(per)
        if m > 1:
            if low < high:
                sizes = rng.integers(low, high, size=m - 1)
            else:  # too few samples for a random range: split evenly
                sizes = np.full(m - 1, max(1, high))
        else:
            sizes = np.empty(0, dtype=np.int64)
        cuts = np.cumsum(sizes)
        for holder, chunk in zip(holders, np.split(idx_c, cuts)):
            parts[holder].append(chunk)
        slots[holders] -= 1
    short = np.flatnonzero(slots > 0)
    if short.size:
        raise PartitionError(
            f"pathological: clients {short.tolist()} get fewer than classes_per_client = {k} "
            f"classes with {num_clients} clients and {c} classes (each class goes to "
            f"{per_class} clients); choose num_clients and classes_per_client so that "
            f"num_clients * k / num_classes is a whole number of clients per class and those "
            "blocks fill every client"
        )
    return _finish(parts)


@PARTITIONERS.register("skewed")
def skewed(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Exactly k classes per client and equal client sizes (FedClassAvg's skewed split).

    Classes are shuffled, then client i takes classes ``perm[(i*k + j) % C]`` for j < k, so each
    class is held by as many clients as possible evenly. Every client takes the same number s of
    samples of each of its classes, s = min over held classes of floor(n_c / holders_c); samples
    beyond that are left out, so this partition does not cover the whole pool.
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    k = classes_per_client
    _check_k(k, c, "skewed")
    perm = rng.permutation(c)
    held = [perm[(i * k + np.arange(k)) % c] for i in range(num_clients)]  # [num_clients][k]
    holders = np.bincount(np.concatenate(held), minlength=c)
    by_class = _by_class(labels, c)
    s = min(by_class[cls].size // holders[cls] for cls in range(c) if holders[cls] > 0)
    if s < 1 or k * s < min_size:
        raise PartitionError(
            f"skewed: some class has fewer samples than clients holding it (or clients would get "
            f"fewer than min_size = {min_size}); use fewer clients or a larger classes_per_client"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    taken = np.zeros(c, dtype=np.int64)  # how many holders of each class were served so far
    shuffled = [rng.permutation(idx) for idx in by_class]
    for i, classes in enumerate(held):
        for cls in classes:
            start = taken[cls] * s
            parts[i].append(shuffled[cls][start : start + s])
            taken[cls] += 1
    return _finish(parts)


# ------------------------------------------------------------ label skew as the papers split


def _at_least(parts: list[np.ndarray], min_size: int, name: str) -> list[np.ndarray]:
    """``parts``, or a :class:`PartitionError` naming the smallest client below ``min_size``."""
    smallest = min(p.size for p in parts)
    if smallest < min_size:
        raise PartitionError(
            f"{name}: a client gets {smallest} samples, fewer than min_size = {min_size}; use "
            "fewer clients, a larger classes_per_client or a smaller min_size"
        )
    return parts


@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """k single-class shards per client, dealt at random: FedHeNN's split (Makhija et al. 2022).

    Follows ``noniid`` in the FedHeNN authors' ``scripts/heterogeneous_clients.py``
    (github.com/dishamakhija/FedHeNN), the per-class form of McMahan et al.'s (2017) shards.
    There are ``num_clients * k`` shards, ``s = num_clients * k / num_classes`` of each class:
    class c's rows, in pool order, are cut into s consecutive runs of ``n_c // s`` rows, and its
    last ``n_c % s`` rows go one each to its first shards. Client i's shard labels are row i of
    the multiset ``[0..C-1] * s`` shuffled and read as a ``num_clients x k`` table; for each of
    its labels it takes one of that class's remaining shards at random. So clients hold random,
    overlapping class sets, and sizes are equal up to one row per shard when the classes are
    equally large (McMahan's sort-and-cut shards may straddle two classes; these never do).
    A client may draw a label twice: then, as in the reference, it takes two shards of that
    class and holds fewer than k classes. Every row goes to exactly one client.

    Raises :class:`PartitionError` unless ``num_clients * k`` is a multiple of ``num_classes``
    (the reference's table needs it) and every class has at least s rows, or when a client
    would get fewer than ``min_size`` rows.
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    k = classes_per_client
    _check_k(k, c, "shards")
    total = num_clients * k
    if total % c:
        raise PartitionError(
            f"shards: num_clients x classes_per_client = {num_clients} x {k} = {total} shards "
            f"cannot be shared equally among num_classes = {c} classes; choose num_clients and "
            f"classes_per_client with a product that is a multiple of {c}"
        )
    per_class = total // c  # shards of each class
    by_class = _by_class(labels, c)
    for cls, idx_c in enumerate(by_class):
        if idx_c.size < per_class:
            raise PartitionError(
                f"shards: class {cls} has {idx_c.size} samples for {per_class} shards "
                f"({num_clients} clients x classes_per_client = {k} / {c} classes); use fewer "
                "clients or a smaller classes_per_client"
            )
    pools: list[list[np.ndarray]] = []
    for idx_c in by_class:
        size, extra = divmod(idx_c.size, per_class)
        cut = [idx_c[j * size : (j + 1) * size] for j in range(per_class)]
        tail = idx_c[per_class * size :]  # extra rows, one each to the first shards
        pools.append([np.append(run, tail[j]) if j < extra else run for j, run in enumerate(cut)])
    deal = rng.permutation(np.tile(np.arange(c), per_class)).reshape(num_clients, k)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for i, row in enumerate(deal):
        for cls in row:
            parts[i].append(pools[cls].pop(int(rng.integers(len(pools[cls])))))
    return _at_least(_finish(parts), min_size, "shards")


# pFedHN's range for the unnormalized share of each class slot (``low_prob``, ``high_prob``).
PFEDHN_SHARE_RANGE = (0.4, 0.6)


@PARTITIONERS.register("pfedhn")
def pfedhn(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """k random classes per client, balanced over classes: pFedHN's split (Shamsian et al. 2021).

    Follows ``gen_classes_per_node`` and ``gen_data_split`` in ``experiments/dataset.py`` of
    github.com/AvivSham/pFedHN; FedGH (Yi et al.) cites this split. Each class has
    ``m = num_clients * k // num_classes + 1`` slots with shares ``u / sum(u)``,
    ``u ~ U(0.4, 0.6)`` drawn for all m slots. Clients, in order, each pick k classes one at a
    time, uniformly among the classes with the most slots left, taking one slot; so every class
    ends up with ``floor`` or ``ceil(num_clients * k / num_classes)`` holders. The j-th holder of
    class c takes the share of slot ``m - 1 - j`` (the reference pops from the end). Each class's
    rows are shuffled, and clients in order take ``int(n_c * share)`` of them.

    As in the reference, the shares are normalized over all m slots while only about ``m - 1``
    are taken, so roughly one slot's share of each class (plus the rounding down) is left out:
    this partition does not cover the whole pool. One difference: the reference can give a client
    a class it already holds (the class it just took can still be among those with the most
    slots left, e.g. with 10 clients x 3 of 10 classes); here such a draw is repeated, so every
    client holds exactly k distinct classes. Otherwise the draws are the reference's, in its
    order (shares, then classes, then the shuffles). The reference applies one draw of classes
    and shares to its train, validation and test sets separately; here it splits the pool, which
    the per-client splits then divide.

    Raises :class:`PartitionError` when a class is too small for a holder to get one row of it, or
    a client would get fewer than ``min_size`` rows.
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    k = classes_per_client
    _check_k(k, c, "pfedhn")
    slots = num_clients * k // c + 1
    low, high = PFEDHN_SHARE_RANGE
    shares: list[list[float]] = []
    for _ in range(c):
        u = rng.uniform(low, high, size=slots)
        shares.append((u / u.sum()).tolist())
    left = np.full(c, slots)  # slots not yet taken, per class
    held: list[list[int]] = []
    for _ in range(num_clients):
        mine: list[int] = []
        for _ in range(k):
            top = np.flatnonzero(left == left.max())
            if np.isin(top, mine).all():  # not reached while holder counts differ by <= 1
                open_ = np.where(np.isin(np.arange(c), mine), -1, left)
                top = np.flatnonzero(open_ == open_.max())
            cls = int(top[rng.integers(top.size)])
            while cls in mine:  # a client does not take a class twice: draw again
                cls = int(top[rng.integers(top.size)])
            mine.append(cls)
            left[cls] -= 1
        held.append(mine)
    by_class = _by_class(labels, c)
    pools = [rng.permutation(idx) for idx in by_class]
    taken = np.zeros(c, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for i, mine in enumerate(held):
        for cls in mine:
            count = int(by_class[cls].size * shares[cls].pop())
            if count < 1:
                raise PartitionError(
                    f"pfedhn: class {cls} has {by_class[cls].size} samples, too few to give each "
                    f"of its holders one ({num_clients} clients x classes_per_client = {k} over "
                    f"{c} classes); use fewer clients or a smaller classes_per_client"
                )
            parts[i].append(pools[cls][taken[cls] : taken[cls] + count])
            taken[cls] += count
    return _at_least(_finish(parts), min_size, "pfedhn")


# ----------------------------------------------------------------------------- quantity skew


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split into integers proportional to ``weights`` (Hamilton's method: floors,
    then one more to the largest remainders; ties go to the lower index). Sums to ``total``."""
    share = weights / weights.sum() * total
    sizes = np.floor(share).astype(np.int64)
    short = total - int(sizes.sum())
    if short > 0:
        sizes[np.argsort(-(share - sizes), kind="stable")[:short]] += 1
    return sizes


def _fill_labels(
    labels: np.ndarray,
    sizes: np.ndarray,
    c: int,
    rng: np.random.Generator,
    how: str,
    alpha: float,
) -> list[np.ndarray]:
    """Rows for clients of the given ``sizes`` (summing to ``labels.size``).

    ``how = "iid"``: a random permutation cut at the sizes. ``how = "dirichlet"``: each client
    (in a random order) draws class proportions from Dir(alpha) and takes that many rows of each
    class, redrawing its shortfall over the classes that still have rows (so sizes are exact and
    clients served last get what is left, as flwr-datasets' InnerDirichletPartitioner).
    """
    n = labels.size
    if how == "iid":
        perm = rng.permutation(n)
        return [np.sort(p).astype(np.int64) for p in np.split(perm, np.cumsum(sizes)[:-1])]
    if how != "dirichlet":
        raise PartitionError(f"data.quantity_labels = {how!r}; choose iid or dirichlet")
    if alpha <= 0:
        raise PartitionError(f"data.alpha = {alpha} must be > 0 (quantity_labels = dirichlet)")
    pools = [rng.permutation(idx) for idx in _by_class(labels, c)]
    left = np.array([p.size for p in pools], dtype=np.int64)  # rows not yet given, per class
    taken = np.zeros(c, dtype=np.int64)  # how far each class's pool has been handed out
    parts: list[list[np.ndarray]] = [[] for _ in sizes]
    for i in rng.permutation(sizes.size):
        want = rng.dirichlet(np.full(c, alpha))
        want = np.where(np.isfinite(want), want, 0.0)
        counts = np.zeros(c, dtype=np.int64)
        need = int(sizes[i])
        while need > 0:  # each pass takes >= 1 row: p is positive only where rows remain
            avail = left - counts
            p = want * (avail > 0)
            if p.sum() <= 0:
                p = (avail > 0).astype(np.float64)
            draw = np.minimum(rng.multinomial(need, p / p.sum()), avail)
            counts += draw
            need -= int(draw.sum())
        for cls in np.flatnonzero(counts):
            parts[i].append(pools[cls][taken[cls] : taken[cls] + counts[cls]])
        taken += counts
        left -= counts
    return _finish(parts)


@PARTITIONERS.register("quantity_dirichlet")
def quantity_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 10,
    max_tries: int = 1000,
    quantity_alpha: float = 1.0,
    quantity_labels: str = "iid",
) -> list[np.ndarray]:
    """Quantity skew: client sizes ``q * N`` with ``q ~ Dir(quantity_alpha)`` (NIID-Bench's
    "iid-diff-quantity", Li et al. 2022), redrawn until every client has ``>= min_size`` rows,
    at most ``max_tries`` times. Sizes are rounded by largest remainder and cover every row.
    Labels: IID within each client (``quantity_labels = "iid"``, the paper's setting) or
    Dirichlet(``alpha``) label skew on top of these sizes (``"dirichlet"``).
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    n = labels.size
    if quantity_alpha <= 0:
        raise PartitionError(f"data.quantity_alpha = {quantity_alpha} must be > 0")
    if n < num_clients * max(min_size, 1):
        raise PartitionError(
            f"quantity_dirichlet: {n} samples cannot give {num_clients} clients >= "
            f"min_size = {max(min_size, 1)} each; use fewer clients or a smaller min_size"
        )
    smallest = 0
    for _ in range(max(1, max_tries)):
        q = rng.dirichlet(np.full(num_clients, quantity_alpha))
        q = np.where(np.isfinite(q), q, 0.0)
        if q.sum() <= 0:
            continue
        sizes = _largest_remainder(n, q)
        smallest = int(sizes.min())
        if smallest >= max(min_size, 1):
            return _fill_labels(labels, sizes, c, rng, quantity_labels, alpha)
    raise PartitionError(
        f"quantity_dirichlet: no sizes with every client >= min_size = {min_size} after "
        f"{max_tries} tries (last smallest client: {smallest}); use a larger quantity_alpha "
        f"(now {quantity_alpha}), a smaller min_size, fewer clients (now {num_clients}) or "
        "more max_tries"
    )


@PARTITIONERS.register("quantity_power_law")
def quantity_power_law(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    num_classes: int | None = None,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    min_size: int = 10,
    max_tries: int = 1000,
    power_law_exponent: float = 1.0,
    quantity_labels: str = "iid",
) -> list[np.ndarray]:
    """Quantity skew with power-law (Zipf) sizes: the client of rank k (a seeded random
    permutation of 1..N) gets ``min_size`` rows plus a share ``k^-power_law_exponent / sum_j
    j^-power_law_exponent`` of the rest (largest remainder rounding; every row is used). So the
    largest client holds about ``N^exponent`` times the smallest one's share; exponent 0 gives
    equal sizes. Labels as in :func:`quantity_dirichlet` (``quantity_labels``).
    """
    labels, c = _prepare(labels, num_clients, num_classes)
    n = labels.size
    if power_law_exponent < 0:
        raise PartitionError(f"data.power_law_exponent = {power_law_exponent} must be >= 0")
    floor = max(min_size, 1)
    if n < num_clients * floor:
        raise PartitionError(
            f"quantity_power_law: {n} samples cannot give {num_clients} clients >= "
            f"min_size = {floor} each; use fewer clients or a smaller min_size"
        )
    ranks = rng.permutation(num_clients) + 1  # client i has rank ranks[i]
    weights = ranks.astype(np.float64) ** -float(power_law_exponent)
    sizes = floor + _largest_remainder(n - num_clients * floor, weights)
    return _fill_labels(labels, sizes, c, rng, quantity_labels, alpha)


def partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    **kwargs: object,
) -> list[np.ndarray]:
    """Run the registered partitioner ``name``."""
    if name not in PARTITIONERS:
        raise PartitionError(
            f"data.partition = {name!r} is unknown; known: {', '.join(PARTITIONERS.names())}"
        )
    fn = PARTITIONERS.get(name)
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        # Each partitioner names the settings it uses; the others are not its business.
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(labels, num_clients, rng, **kwargs)
