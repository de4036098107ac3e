"""Tombstones over an index's vectors, as a collection and a shard of a sharded index keep them: a bitmap (uint8,
bit i little-endian: vector i deleted or replaced since the index was built) that the filter tier skips; and the
exclusion bitmap of a filtered search, the vectors a filter passes less the dead ones. One implementation for both
(they had a bit loop each)."""

from __future__ import annotations

import numpy as np


def empty(count: int) -> np.ndarray:
    """No vector of count dead."""
    return np.zeros((count + 7) // 8, dtype=np.uint8)


def positions(sorted_ids: np.ndarray, ids) -> np.ndarray:
    """Where the given ids sit in sorted_ids (ascending), for those that are there."""
    ids = np.asarray(ids, dtype=np.int64)
    pos = np.searchsorted(sorted_ids, ids)
    inside = pos < len(sorted_ids)
    hit = np.zeros(len(ids), bool)
    hit[inside] = sorted_ids[pos[inside]] == ids[inside]
    return pos[hit]


def mark(tomb: np.ndarray, pos) -> int:
    """Set the bits of the vectors at pos; how many were not set before."""
    p = np.unique(np.asarray(pos, dtype=np.int64))
    if not len(p):
        return 0
    byte, bit = p >> 3, np.left_shift(1, p & 7).astype(np.uint8)
    new = (tomb[byte] & bit) == 0
    np.bitwise_or.at(tomb, byte[new], bit[new])
    return int(new.sum())


def dead(tomb: np.ndarray, count: int) -> np.ndarray:
    """bool (count,): each vector's bit."""
    return np.unpackbits(tomb, count=count, bitorder="little").astype(bool)


def dead_at(tomb: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """bool: the bits of the vectors at pos."""
    pos = np.asarray(pos, dtype=np.int64)
    return ((tomb[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1).astype(bool)


def passing(sorted_ids: np.ndarray, allowed, tomb: np.ndarray | None) -> np.ndarray:
    """bool (len(sorted_ids),): the vectors whose ids a filter passed (allowed) and that are not dead."""
    ok = np.zeros(len(sorted_ids), bool)
    ok[positions(sorted_ids, allowed)] = True
    if tomb is not None:
        ok &= ~dead(tomb, len(sorted_ids))
    return ok


def exclusion(ok: np.ndarray) -> np.ndarray:
    """The bitmap a search excludes: every vector not ok."""
    return np.packbits(~ok, bitorder="little")
