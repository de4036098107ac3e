"""The fresh tier: vectors written since the last merge, in RAM, searched exactly.

Append-only buffers that grow by a quarter at a time: a search takes views of the first n slots, and
later appends write past n (or into a new buffer), so a view never changes under a search.
Removals clear a slot's live flag; searches copy the flags when they take their snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def distances(q: np.ndarray, x: np.ndarray, x_sq: np.ndarray, metric: str) -> np.ndarray:
    """Engine distances (q, n) between queries and vectors, both in the engine's form (unit
    length under cosine): squared L2, 1 - cos, or -inner product."""
    dots = q @ x.T
    if metric == "ip":
        return -dots
    if metric == "cosine":
        return 1.0 - dots
    return np.maximum((q * q).sum(1, keepdims=True) - 2 * dots + x_sq[None, :], 0)


@dataclass
class FreshView:
    vectors: np.ndarray  # float32 (n, dim)
    sq: np.ndarray  # float32 (n,)
    rows: np.ndarray  # int64 (n,)
    live: np.ndarray  # bool (n,), a copy

    def search(self, q: np.ndarray, k: int, metric: str, allowed: np.ndarray | None = None):
        """Exact top-k over the live (and allowed) slots: (rows int64 (q, k'), dists (q, k')),
        k' = min(k, candidates)."""
        mask = self.live if allowed is None else self.live & allowed
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            return np.empty((len(q), 0), np.int64), np.empty((len(q), 0), np.float32)
        if 2 * idx.size >= len(mask):
            # Most slots searched: over all of them, the others put out of reach, rather than a copy of the ones
            # searched a call (1.5 MB a query at 1,000 fresh 384-d vectors).
            d = distances(q, self.vectors, self.sq, metric).astype(np.float32, copy=False)
            if idx.size < len(mask):
                d[:, ~mask] = np.inf
            slots = None  # d's columns are the slots
        else:
            d = distances(q, self.vectors[idx], self.sq[idx], metric).astype(np.float32)
            slots = idx  # d's columns are these slots
        kk = min(k, idx.size)  # at most the searched ones: those out of reach are never among the kk nearest
        part = np.argpartition(d, kk - 1, axis=1)[:, :kk] if kk < d.shape[1] else np.broadcast_to(
            np.arange(d.shape[1]), (len(q), d.shape[1]))
        pd = np.take_along_axis(d, part, axis=1)
        order = np.argsort(pd, axis=1, kind="stable")
        best = np.take_along_axis(part, order, axis=1)
        return self.rows[best if slots is None else slots[best]], np.take_along_axis(pd, order, axis=1)

class FreshTier:
    def __init__(self, dim: int, capacity: int = 1024):
        self.dim = dim
        self._vecs = np.empty((capacity, dim), np.float32)
        self._sq = np.empty(capacity, np.float32)
        self._rows = np.empty(capacity, np.int64)
        self._live = np.zeros(capacity, bool)
        self._slot: dict[int, int] = {}
        self.n = 0
        self.live_count = 0
        self._empty: FreshView | None = None

    def _grow(self, need: int) -> None:
        cap = len(self._rows)
        if need <= cap:
            return
        cap = max(need, cap + cap // 4)  # by a quarter, not doubling: the old and new buffers are held at once
        for name in ("_vecs", "_sq", "_rows", "_live"):
            old = getattr(self, name)
            new = np.zeros((cap,) + old.shape[1:], old.dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)

    def add(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """vectors in the engine's form (unit length under cosine)."""
        m = len(rows)
        self._grow(self.n + m)
        s = slice(self.n, self.n + m)
        self._vecs[s] = vectors
        self._sq[s] = (vectors * vectors).sum(1)
        self._rows[s] = rows
        self._live[s] = True
        self._slot.update(zip(rows.tolist(), range(self.n, self.n + m)))
        self.n += m
        self.live_count += m

    def remove(self, rows) -> int:
        """Clear the live flag of these rows (those not here are ignored); returns how many."""
        hit = 0
        for r in rows:
            s = self._slot.pop(int(r), None)
            if s is not None:
                self._live[s] = False
                hit += 1
        self.live_count -= hit
        return hit

    def view(self) -> FreshView:
        n = self.n
        if not n:  # nothing written since the merge (most searches): one view of nothing, shared
            if self._empty is None or self._empty.vectors.base is not self._vecs:
                self._empty = FreshView(self._vecs[:0], self._sq[:0], self._rows[:0], self._live[:0].copy())
            return self._empty
        return FreshView(self._vecs[:n], self._sq[:n], self._rows[:n], self._live[:n].copy())

    def contains(self, rows) -> np.ndarray:
        """bool: which of these rows are live here."""
        return np.array([int(r) in self._slot for r in np.asarray(rows).tolist()], dtype=bool)

    def vectors_of(self, rows) -> dict[int, np.ndarray]:
        """row -> vector (a copy) of those of these rows that are live."""
        slots = [(int(r), self._slot.get(int(r))) for r in rows]
        return {r: self._vecs[s].copy() for r, s in slots if s is not None}

    def live_items(self) -> tuple[np.ndarray, np.ndarray]:
        idx = np.flatnonzero(self._live[:self.n])
        return self._rows[idx].copy(), self._vecs[idx].copy()

    @property
    def bytes(self) -> int:
        return int(self.n * (self.dim * 4 + 4 + 8 + 1))
