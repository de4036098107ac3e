"""k-means for the build: flat (PQ codebooks, tree nodes) and hierarchical balanced (posting lists).

Plain NumPy on BLAS: the build is offline, and the matrix products are where the time goes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

_CHUNK = 16384


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
        new_labels = _capacitated_assign(sq_dists(x, centers), capacity)
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
    """Per-cluster sums of x in float64 (sort once, then one segmented reduction)."""
    sizes = np.bincount(labels, minlength=k)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    sums = np.zeros((k, x.shape[1]), dtype=np.float64)
    nonempty = sizes > 0
    sums[nonempty] = np.add.reduceat(x[np.argsort(labels, kind="stable")].astype(np.float64), starts[nonempty], axis=0)
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
) -> np.ndarray:
    """Centroids of posting lists of at most max_size vectors and about `target` on average.

    rows(ids) returns float32 vectors for sorted ids. The top level is trained on a sample and
    assigned in a streaming pass, so only one top-level cluster at a time is in memory; below it
    each node of more than max_size vectors is split into min(branching, size / target) balanced
    clusters until every leaf fits. progress(n) is called as n vectors reach their leaf.
    """
    leaves: list[np.ndarray] = []
    k_top = max(min(branching, int(np.ceil(count / target))), int(np.ceil(count / top_cluster_cap)))
    if count <= max_size:
        all_ids = np.arange(count)
        leaves.append(rows(all_ids).mean(axis=0, keepdims=True))
        progress(count)
        return np.concatenate(leaves).astype(np.float32)
    sample_ids = np.sort(rng.choice(count, min(count, 256 * k_top), replace=False))
    top, _ = kmeans(rows(sample_ids), k_top, iters, rng, balance=0.25)
    labels = np.empty(count, dtype=np.int64)
    for s in range(0, count, 65536):
        ids = np.arange(s, min(count, s + 65536))
        labels[ids], _ = assign(rows(ids), top)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(k_top + 1))
    for j in range(k_top):
        ids = order[bounds[j]:bounds[j + 1]]
        if len(ids):
            _split(rows(ids), target, max_size, branching, iters, rng, leaves, progress)
    return np.concatenate(leaves).astype(np.float32)


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
