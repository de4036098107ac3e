"""k-means for the build: flat (PQ codebooks, tree nodes) and hierarchical balanced (posting lists).

Plain NumPy on BLAS: the build is offline, and the matrix products are where the time goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

_CHUNK = 16384
_MAX_PASSES = 4  # streaming passes over a top-level cluster before it is read whole


def sq_dists(x: np.ndarray, c: np.ndarray, c_sq: np.ndarray | None = None) -> np.ndarray:
    """Squared L2 distances (len(x), len(c)), clipped at 0 against rounding."""
    if c_sq is None:
        c_sq = np.einsum("ij,ij->i", c, c)
    d = x @ c.T
    d *= -2
    d += np.einsum("ij,ij->i", x, x)[:, None]
    d += c_sq[None, :]
    return np.maximum(d, 0, out=d)


def assign(x: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid of each row and its squared distance, in chunks to bound memory."""
    c_sq = np.einsum("ij,ij->i", c, c)
    labels = np.empty(len(x), dtype=np.int64)
    dists = np.empty(len(x), dtype=np.float32)
    for s in range(0, len(x), _CHUNK):
        d = sq_dists(x[s:s + _CHUNK], c, c_sq)
        labels[s:s + _CHUNK] = lab = d.argmin(axis=1)
        dists[s:s + _CHUNK] = d[np.arange(len(lab)), lab]
    return labels, dists


def _plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding on at most 64k rows."""
    if len(x) > 65536:
        x = x[rng.choice(len(x), 65536, replace=False)]
    centers = np.empty((k, x.shape[1]), dtype=np.float32)
    centers[0] = x[rng.integers(len(x))]
    closest = sq_dists(x, centers[:1])[:, 0]
    for i in range(1, k):
        weights = closest.astype(np.float64)  # a float32 sum over 64k squared distances can overflow
        total = weights.sum()
        j = rng.choice(len(x), p=weights / total) if total > 0 else rng.integers(len(x))
        centers[i] = x[j]
        np.minimum(closest, sq_dists(x, centers[i:i + 1])[:, 0], out=closest)
    return centers


def kmeans(x: np.ndarray, k: int, iters: int, rng: np.random.Generator, balance: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding; returns (centroids (k, d), labels).

    balance > 0 makes it balanced k-means: no cluster takes more than (1 + balance) times the
    mean size, the closest points winning a full cluster and the rest going to their next choice.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = len(x)
    if n <= k:
        # Too few points to cluster: each point its own centroid, the rest repeat the first.
        centers = np.concatenate([x, np.repeat(x[:1], k - n, axis=0)])
        return centers, np.arange(n)
    centers = _plus_plus(x, k, rng)
    capacity = int(np.ceil(n / k * (1 + balance))) if balance > 0 else n
    labels = np.full(n, -1, dtype=np.int64)
    for it in range(iters):
        # Unbalanced (PQ codebooks): the nearest centre, in chunks, never the whole (n, k) distance matrix.
        new_labels = assign(x, centers)[0] if capacity >= n else _capacitated_assign(sq_dists(x, centers), capacity)
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
        sizes = np.bincount(labels, minlength=k)
        sums = _segment_sums(x, labels, k)
        nonempty = sizes > 0
        centers[nonempty] = (sums[nonempty] / sizes[nonempty, None]).astype(np.float32)
        for j in np.flatnonzero(~nonempty):
            # Re-seed an empty cluster from a random member of the largest one.
            big = int(sizes.argmax())
            members = np.flatnonzero(labels == big)
            pick = members[rng.integers(len(members))]
            centers[j] = x[pick]
            labels[pick] = j
            sizes[big] -= 1
            sizes[j] = 1
    return centers, labels


def _capacitated_assign(d: np.ndarray, capacity: int) -> np.ndarray:
    """Each row to its nearest column with room; rows beyond a full column try their next choice."""
    n, k = d.shape
    labels = d.argmin(axis=1)
    if capacity >= n:
        return labels
    labels[:] = -1
    room = np.full(k, capacity)
    prefs = np.argsort(d, axis=1)
    for r in range(k):
        rows = np.flatnonzero(labels < 0)
        if not rows.size:
            break
        want = prefs[rows, r]
        order = np.lexsort((d[rows, want], want))  # by column, closest first
        rows, want = rows[order], want[order]
        first = np.searchsorted(want, want)  # index of each column's first row in this round
        accept = np.arange(len(rows)) - first < room[want]
        labels[rows[accept]] = want[accept]
        room -= np.bincount(want[accept], minlength=k)
    return labels


def _segment_sums(x: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Per-cluster sums of x in float64: rows sorted by cluster, then reduced a chunk at a time, so no float64
    copy of all of x is made (a top-level cluster of a budgeted build is most of its working memory)."""
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    sums = np.zeros((k, x.shape[1]), dtype=np.float64)
    for s in range(0, len(order), _CHUNK):
        lab = sorted_labels[s:s + _CHUNK]
        starts = np.flatnonzero(np.concatenate([[True], lab[1:] != lab[:-1]]))
        sums[lab[starts]] += np.add.reduceat(x[order[s:s + _CHUNK]].astype(np.float64), starts, axis=0)
    return sums


def hierarchical_balanced_kmeans(
    rows: Callable[[np.ndarray], np.ndarray],
    count: int,
    target: float,
    max_size: int,
    branching: int,
    iters: int,
    rng: np.random.Generator,
    progress: Callable[[int], None] = lambda n: None,
    top_cluster_cap: int = 1 << 18,
    out: Path | None = None,
) -> np.ndarray:
    """Centroids of posting lists of at most max_size vectors and about `target` on average.

    rows(ids) returns float32 vectors for sorted ids. The top level is trained on a sample and
    assigned in a streaming pass, so only one top-level cluster at a time is in memory; below it
    each node of more than max_size vectors is split into min(branching, size / target) balanced
    clusters until every leaf fits. progress(n) is called as n vectors reach their leaf. top_cluster_cap: the
    most rows a top-level cluster holds (more top-level clusters where the count needs it): a budgeted build
    sets it from its memory budget (cluster_cap), as a cluster and its split are the clustering's working memory.
    A top-level cluster the streaming assignment left larger than that (the sample's clusters are balanced, the
    nearest-centre pass is not) is split by another streaming pass over its rows before it is read whole.
    out: a file the centroids are appended to as each top-level cluster is done (a read-only memory map of them
    is returned), so that the centroids, a tenth of the vectors' count, are not in memory beside the clustering.
    """
    leaves = _Leaves(out)
    if count <= max_size:
        leaves.add(rows(np.arange(count)).mean(axis=0, keepdims=True))
        progress(count)
        return leaves.done()
    cap = max(top_cluster_cap, max_size)
    k_top = max(min(branching, int(np.ceil(count / target))), int(np.ceil(count / cap)))
    id_type = np.uint32 if count < 2**32 else np.int64  # the parts' ids: a 4-byte id a row, as the labels
    pending = [(np.arange(count, dtype=id_type), 0)]  # (sorted ids, streaming passes they came through)
    while pending:
        ids, depth = pending.pop()
        if depth and (len(ids) <= cap or depth >= _MAX_PASSES):
            mine: list[np.ndarray] = []
            _split(rows(ids.astype(np.int64)), target, max_size, branching, iters, rng, mine, progress)
            leaves.add(np.concatenate(mine))  # one array a top-level cluster, not one a leaf
            continue
        k = k_top if not depth else max(2, min(branching, 2 * int(np.ceil(len(ids) / cap))))
        parts = _streamed_split(rows, ids, k, iters, rng)
        # a pass that cannot part them (identical rows) leaves one part: it is read whole after the next
        pending.extend((part, _MAX_PASSES if len(parts) == 1 and depth else depth + 1) for part in reversed(parts))
    return leaves.done()


def _streamed_split(rows, ids: np.ndarray, k: int, iters: int, rng: np.random.Generator) -> list[np.ndarray]:
    """ids (sorted) parted among k centres trained on a sample of their rows, each row to its nearest centre,
    read 65,536 rows at a time; the non-empty parts, each sorted."""
    sample = np.sort(rng.choice(ids, min(len(ids), 256 * k), replace=False))
    top, _ = kmeans(rows(sample.astype(np.int64)), k, iters, rng, balance=0.25)
    labels = np.empty(len(ids), dtype=np.int32)
    for s in range(0, len(ids), 65536):
        labels[s:s + 65536], _ = assign(rows(ids[s:s + 65536].astype(np.int64)), top)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(k + 1))
    del labels
    return [ids[order[bounds[j]:bounds[j + 1]]] for j in range(k) if bounds[j + 1] > bounds[j]]


class _Leaves:
    """The centroids as they are made: in memory, or appended to a file (out) and mapped back when done."""

    def __init__(self, out: Path | None):
        self.out, self.parts, self.rows, self.dim = out, [], 0, None
        self.f = open(out, "wb") if out is not None else None

    def add(self, c: np.ndarray) -> None:
        c = np.ascontiguousarray(c, dtype=np.float32)
        self.rows, self.dim = self.rows + len(c), c.shape[1]
        if self.f is None:
            self.parts.append(c)
        else:
            c.tofile(self.f)

    def done(self) -> np.ndarray:
        if self.f is None:
            return np.concatenate(self.parts)
        self.f.close()
        return np.memmap(self.out, np.float32, "r", shape=(self.rows, self.dim))


def cluster_cap(budget: int, dim: int, branching: int) -> int:
    """The most rows of dim float32 dimensions whose split by hierarchical_balanced_kmeans fits in budget bytes:
    the cluster (read once), its children (copies), k-means' distances, preferences and sorts (per row, branching
    floats and int64s and a few int64s), with a third to spare; at least 4096 rows, at most 2^18."""
    per_row = 3 * 4 * dim + branching * (4 + 8) + 64
    return int(min(1 << 18, max(4096, budget * 2 // 3 // per_row)))


def _split(x: np.ndarray, target: float, max_size: int, branching: int, iters: int,
           rng: np.random.Generator, leaves: list, progress) -> None:
    stack = [x]
    while stack:
        x = stack.pop()
        if len(x) <= max_size:
            leaves.append(x.mean(axis=0, keepdims=True))
            progress(len(x))
            continue
        k = int(min(branching, np.ceil(len(x) / target)))
        _, labels = kmeans(x, k, iters, rng, balance=0.25)
        sizes = np.bincount(labels, minlength=k)
        if sizes.max() == len(x):
            # k-means cannot separate identical points: cut them into equal parts instead.
            parts = int(np.ceil(len(x) / max_size))
            for part in np.array_split(x, parts):
                leaves.append(part.mean(axis=0, keepdims=True))
                progress(len(part))
            continue
        order = np.argsort(labels, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        for j in range(k):
            if sizes[j]:
                stack.append(x[order[bounds[j]:bounds[j + 1]]])
