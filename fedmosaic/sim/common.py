"""Helpers shared by the simulator backends: deduplicated wire messages and the evaluation cache."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from fedmosaic.core.payload import Payload, encode


# ---- messages ------------------------------------------------------------------------------------
class MessageTable:
    """The round's messages, each distinct one encoded once: ``key[cid]`` -> ``blobs[key]``.

    Two messages are the same when they hold the same tensor objects (the server broadcasting one
    state to everyone) or encode to the same bytes.
    """

    def __init__(self, messages: dict[int, Payload]) -> None:
        self.key: dict[int, int] = {}
        self.blobs: dict[int, bytes] = {}
        self.digests: dict[int, bytes] = {}
        self.sizes: dict[int, int] = {}
        by_object: dict[tuple[Any, ...], int] = {}
        by_digest: dict[bytes, int] = {}
        alive = []  # keep flattened tensors referenced: their ids stay unique while we look
        for cid, msg in messages.items():
            arrays, scalars = msg.flatten()
            alive.append(arrays)
            ident = (
                type(msg),
                tuple((k, id(v)) for k, v in arrays.items()),
                tuple(sorted(scalars.items())),
            )
            k = by_object.get(ident)
            if k is None:
                blob = encode(msg)
                digest = hashlib.blake2b(blob, digest_size=16).digest()
                k = by_digest.get(digest)
                if k is None:
                    k = len(self.blobs)
                    self.blobs[k] = blob
                    self.digests[k] = digest
                    by_digest[digest] = k
                by_object[ident] = k
            self.key[cid] = k
            self.sizes[cid] = len(self.blobs[k])

    def digest(self, cid: int) -> bytes:
        return self.digests[self.key[cid]]

    def part(self, cids: Sequence[int]) -> tuple[dict[int, bytes], list[tuple[int, int]]]:
        """The blobs a worker needs for ``cids`` and the (client, blob key) list."""
        keys = {self.key[c] for c in cids}
        return {k: self.blobs[k] for k in keys}, [(c, self.key[c]) for c in cids]


class EvalCache:
    """Counts of each client's last evaluation, keyed by (state version, message digest, receive).

    A client not trained since (same version) and sent byte-identical message is evaluated on
    exactly the same model: its counts are reused.
    """

    def __init__(self) -> None:
        self.entries: dict[int, tuple[tuple[Any, ...], dict[str, dict[str, int]]]] = {}
        self.hits = 0

    def get(self, cid: int, key: tuple[Any, ...]) -> dict[str, dict[str, int]] | None:
        entry = self.entries.get(cid)
        if entry is not None and entry[0] == key:
            self.hits += 1
            return {split: dict(counts) for split, counts in entry[1].items()}
        return None

    def put(self, cid: int, key: tuple[Any, ...], counts: dict[str, dict[str, int]]) -> None:
        self.entries[cid] = (key, counts)

    def clear(self) -> None:
        self.entries.clear()
