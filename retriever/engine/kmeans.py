"""k-means for the build: flat (PQ codebooks, tree nodes) and hierarchical balanced (posting lists).

Plain NumPy on BLAS: the build is offline, and the matrix products are where the time goes.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from fusionrag.retriever.engine.manifest import DIRTY_BYTES, written_back

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
    spill: Path | None = None,
    leaf_of: np.ndarray | None = None,
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
    spill: a directory where each streaming pass writes every part's rows (float32, as rows() gives them) to a file
    of the part's own as it reads them, so that a part is later read from its file in order, not gathered row by
    row from the source (scattered 4 KiB page reads where the source is larger than the page cache may hold: a
    build under a memory cap); the files are removed as their parts are done. The centroids are the same.
    leaf_of: an integer array of count (a memory map, say) given each row's leaf, the number of the centroid that is
    its part's mean: where the build starts a row's search for its lists (a search from the graph's entry point can
    end in another cluster of the data; a row's own leaf is in its own).
    """
    leaves = _Leaves(out)
    if count <= max_size:
        leaves.add(rows(np.arange(count)).mean(axis=0, keepdims=True))
        if leaf_of is not None:
            leaf_of[:] = 0
        progress(count)
        return leaves.done()
    cap = max(top_cluster_cap, max_size)
    k_top = max(min(branching, int(np.ceil(count / target))), int(np.ceil(count / cap)))
    id_type = np.uint32 if count < 2**32 else np.int64  # the parts' ids: a 4-byte id a row, as the labels
    # (sorted ids, streaming passes they came through, the file their rows were spilled to or None)
    pending = [(np.arange(count, dtype=id_type), 0, None)]
    try:
        while pending:
            ids, depth, path = pending.pop()
            read = rows if path is None else _PartRows(path, ids)
            if depth and (len(ids) <= cap or depth >= _MAX_PASSES):
                mine: list[np.ndarray] = []
                _split(read(ids.astype(np.int64)), target, max_size, branching, iters, rng, mine, progress,
                       ids, leaf_of, leaves.rows)
                leaves.add(np.concatenate(mine))  # one array a top-level cluster, not one a leaf
            else:
                k = k_top if not depth else max(2, min(branching, 2 * int(np.ceil(len(ids) / cap))))
                parts = _streamed_split(read, ids, k, iters, rng, spill)
                # a pass that cannot part them (identical rows) leaves one part: it is read whole after the next
                pending.extend((part, _MAX_PASSES if len(parts) == 1 and depth else depth + 1, file)
                               for part, file in reversed(parts))
            if path is not None:
                read.close()
    finally:
        for _, _, path in pending:  # an error: the spilled rows go
            if path is not None:
                path.unlink(missing_ok=True)
    return leaves.done()


class _PartRows:
    """rows(ids) of a part whose rows were spilled, in its ids' order, to a file of its own (_Spill)."""

    def __init__(self, path: Path, ids: np.ndarray):
        self.path, self.ids = path, ids
        dim = path.stat().st_size // 4 // max(1, len(ids))
        self.data = np.memmap(path, np.float32, "r", shape=(len(ids), dim)) if len(ids) else None

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.ids, ids)
        if len(pos) and pos[-1] - pos[0] + 1 == len(pos):  # a run of the part (a pass's chunk, the whole part)
            return np.array(self.data[pos[0]:pos[-1] + 1])
        return np.asarray(self.data[pos])

    def close(self) -> None:
        self.data = None
        self.path.unlink(missing_ok=True)


class _Spill:
    """The rows of a streaming pass's k parts, appended to a file each as the pass reads them (rows in the order
    of their ids), at most DIRTY_BYTES of them not yet written back and dropped from the page cache: a memory
    cgroup counts dirty pages, and v1 cannot throttle a writer by them."""

    def __init__(self, folder: Path, k: int):
        folder.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:12]
        self.paths = [folder / f"part-{tag}-{j}.f32" for j in range(k)]
        self.files = [open(p, "wb") for p in self.paths]
        self.dirty = 0

    def add(self, x: np.ndarray, labels: np.ndarray) -> None:
        order = np.argsort(labels, kind="stable")
        bounds = np.searchsorted(labels[order], np.arange(len(self.files) + 1))
        for j, f in enumerate(self.files):
            if bounds[j + 1] > bounds[j]:
                f.write(np.ascontiguousarray(x[order[bounds[j]:bounds[j + 1]]], dtype=np.float32).data)
        self.dirty += x.nbytes
        if self.dirty >= DIRTY_BYTES:
            self._written_back()

    def _written_back(self) -> None:
        for f in self.files:
            f.flush()
            written_back(f.fileno(), f.tell())
        self.dirty = 0

    def close(self) -> list[Path]:
        self._written_back()
        for f in self.files:
            f.close()
        return self.paths

    def discard(self) -> None:
        for f, p in zip(self.files, self.paths):
            f.close()
            p.unlink(missing_ok=True)


def _streamed_split(rows, ids: np.ndarray, k: int, iters: int, rng: np.random.Generator,
                    spill: Path | None = None) -> list[tuple[np.ndarray, Path | None]]:
    """ids (sorted) parted among k centres trained on a sample of their rows, each row to its nearest centre,
    read 65,536 rows at a time; the non-empty parts, each sorted, with the file of its rows where spill is a
    directory (_Spill; else None)."""
    sample = np.sort(rng.choice(ids, min(len(ids), 256 * k), replace=False))
    top, _ = kmeans(rows(sample.astype(np.int64)), k, iters, rng, balance=0.25)
    labels = np.empty(len(ids), dtype=np.int32)
    files = _Spill(spill, k) if spill is not None else None
    try:
        for s in range(0, len(ids), 65536):
            x = rows(ids[s:s + 65536].astype(np.int64))
            labels[s:s + 65536], _ = assign(x, top)
            if files is not None:
                files.add(x, labels[s:s + 65536])
            del x
    except BaseException:
        if files is not None:
            files.discard()
        raise
    paths = files.close() if files is not None else [None] * k
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(k + 1))
    del labels
    out = []
    for j in range(k):
        if bounds[j + 1] > bounds[j]:
            out.append((ids[order[bounds[j]:bounds[j + 1]]], paths[j]))
        elif paths[j] is not None:
            paths[j].unlink(missing_ok=True)
    return out


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
           rng: np.random.Generator, leaves: list, progress, ids: np.ndarray, leaf_of: np.ndarray | None,
           first: int) -> None:
    """x (rows ids) split until every part has at most max_size rows; each part's mean appended to leaves, and
    where leaf_of is given, leaf_of[its ids] = first + its place in leaves."""
    def leaf(part: np.ndarray, part_ids: np.ndarray) -> None:
        if leaf_of is not None:
            leaf_of[part_ids] = first + len(leaves)
        leaves.append(part.mean(axis=0, keepdims=True))
        progress(len(part))

    stack = [(x, ids)]
    while stack:
        x, ids = stack.pop()
        if len(x) <= max_size:
            leaf(x, ids)
            continue
        k = int(min(branching, np.ceil(len(x) / target)))
        _, labels = kmeans(x, k, iters, rng, balance=0.25)
        sizes = np.bincount(labels, minlength=k)
        if sizes.max() == len(x):
            # k-means cannot separate identical points: cut them into equal parts instead.
            parts = int(np.ceil(len(x) / max_size))
            for part, part_ids in zip(np.array_split(x, parts), np.array_split(ids, parts)):
                leaf(part, part_ids)
            continue
        order = np.argsort(labels, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        for j in range(k):
            if sizes[j]:
                stack.append((x[order[bounds[j]:bounds[j + 1]]], ids[order[bounds[j]:bounds[j + 1]]]))
