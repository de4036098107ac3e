"""Where each raw vector lives on the SSD tier.

Every vector is stored once, in the bucket of its nearest centroid, so the vectors of one posting
list share pages and the re-ranker's reads merge. A record (one vector) never straddles a block;
a block is one 4 KiB page, or several pages for a record larger than a page. Each bucket fills
whole blocks of its own, then its remainder (fewer records than a block holds) is packed with
other buckets' remainders by best-fit decreasing, which wastes the least space while keeping
every bucket on at most one shared block.

Within a bucket the vectors are laid out as a nearest-neighbour chain (`chain_order`), so the
records that share a page are near each other: a query that wants one of them likely wants its
page-mates too, and the re-ranker scores the query's other candidates on a page it reads
(EngineConfig.page_mates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

PAGE = 4096


@dataclass(frozen=True)
class PageLayout:
    record_bytes: int
    records_per_block: int
    pages_per_block: int
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.pages_per_block * PAGE

    @property
    def file_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def block_shape(record_bytes: int) -> tuple[int, int]:
    """(records per block, pages per block) for a record size."""
    if record_bytes <= PAGE:
        return PAGE // record_bytes, 1
    return 1, -(-record_bytes // PAGE)


def plan_layout(bucket_of: np.ndarray, num_buckets: int, record_bytes: int,
                order: np.ndarray | None = None) -> tuple[PageLayout, np.ndarray]:
    """Assign every vector a slot; returns the layout and slot (uint32) per vector id.

    A slot s is record s % records_per_block of block s // records_per_block. `order` lists every
    id once, grouped by bucket in bucket order (`chain_order`); a bucket's vectors take its slots
    in that order. Without it, in id order.
    """
    per_block, pages = block_shape(record_bytes)
    counts = np.bincount(bucket_of, minlength=num_buckets)
    full = counts // per_block
    rest = counts % per_block
    # Whole blocks first, bucket after bucket.
    full_start = np.concatenate([[0], np.cumsum(full)[:-1]])
    shared_base = int(full.sum())
    # Remainders, largest first, each into the fullest shared block it still fits (best fit).
    shared_block = np.full(num_buckets, -1, dtype=np.int64)
    shared_offset = np.zeros(num_buckets, dtype=np.int64)
    open_by_room: list[list[int]] = [[] for _ in range(per_block + 1)]
    used: list[int] = []
    for b in np.argsort(-rest, kind="stable"):
        r = int(rest[b])
        if r == 0:
            break
        room = next((room for room in range(r, per_block + 1) if open_by_room[room]), None)
        if room is None:
            blk, room = len(used), per_block
            used.append(0)
        else:
            blk = open_by_room[room].pop()
        shared_block[b] = blk
        shared_offset[b] = used[blk]
        used[blk] += r
        if room - r:
            open_by_room[room - r].append(blk)
    num_blocks = shared_base + len(used)
    if num_blocks * per_block >= 2**32:
        raise ValueError(f"{num_blocks} blocks of {per_block} records exceed the 32-bit slot space")
    # Vectors of a bucket, in `order`, take its full-block slots then its shared-block slots.
    if order is None:
        order = np.argsort(bucket_of, kind="stable")
    elif (len(order) != len(bucket_of) or np.any(np.diff(bucket_of[order]) < 0)
          or np.bincount(order, minlength=len(order)).max(initial=1) != 1):
        raise ValueError("order must list every id once, grouped by bucket in bucket order")
    rank = np.empty(len(bucket_of), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank[order] = np.arange(len(order)) - np.repeat(starts, counts)
    b = bucket_of
    in_full = rank < full[b] * per_block
    slots = np.where(
        in_full,
        full_start[b] * per_block + rank,
        (shared_base + shared_block[b]) * per_block + shared_offset[b] + rank - full[b] * per_block,
    )
    return PageLayout(record_bytes, per_block, pages, num_blocks), slots.astype(np.uint32)


def chain_order(bucket_of: np.ndarray, num_buckets: int, centers: np.ndarray, vectors,
                chunk_floats: int = 1 << 24, progress: Callable[[int], None] = lambda n: None) -> np.ndarray:
    """Every id, grouped by bucket in bucket order, each bucket as a greedy nearest-neighbour chain:
    it starts at the vector nearest the bucket's center and steps to the nearest vector not yet
    placed, so consecutive ids (which `plan_layout` puts on the same page) are near each other.

    vectors(ids) returns float32 rows (the build passes PQ reconstructions: no pass over the
    source). Buckets of one size are chained together, a chunk of at most ~chunk_floats floats at
    a time, so a 10M-vector build neither loops over a million buckets in Python nor holds more
    than one chunk of vectors. A bucket longer than sqrt(chunk_floats) (at least 256) is cut first into
    pieces of at most that many by median splits along its principal direction, each piece chained in turn
    from the vector nearest where the last ended: a chain holds a (size, size) matrix of distances, and one
    bucket of 20k vectors would hold 1.6 GB (three such temporaries at once).

    On the benchmark's Fashion-MNIST index (5 records per page) the true top-10 of a query lie on
    7.5 pages instead of 8.1 in id order, and the pages a re-rank touches at the same recall fall
    by 8-10%, 20% with page-mate scoring (bench/results/peers/page_order.md).

    progress(n) is called as n more ids have their place.
    """
    order = np.argsort(bucket_of, kind="stable")
    counts = np.bincount(bucket_of, minlength=num_buckets)
    starts = np.concatenate([[0], np.cumsum(counts)])
    progress(int(counts[counts <= 2].sum()))  # any order is a chain of one or two
    longest = max(256, math.isqrt(int(chunk_floats)))
    for size in np.unique(counts[counts > 2]):
        buckets = np.flatnonzero(counts == size)
        if size > longest:
            for b in buckets:
                pos = starts[b] + np.arange(size)
                ids = order[pos]
                v = np.asarray(vectors(ids), dtype=np.float32)
                at = np.asarray(centers[b], dtype=np.float32)
                chained = []
                for piece in _pieces(v, longest):
                    link = _chains(v[piece][None], at[None])[0]
                    chained.append(piece[link])
                    at = v[piece[link[-1]]]
                order[pos] = ids[np.concatenate(chained)]
                progress(int(size))
            continue
        per = max(1, chunk_floats // int(size * max(size, centers.shape[1])))
        for lo in range(0, len(buckets), per):
            b = buckets[lo:lo + per]
            pos = starts[b][:, None] + np.arange(size)[None, :]  # (B, size) positions in order
            ids = order[pos]
            v = np.asarray(vectors(ids.ravel()), dtype=np.float32).reshape(len(b), size, -1)
            chain = _chains(v, np.asarray(centers[b], dtype=np.float32))
            order[pos] = ids[np.arange(len(b))[:, None], chain]
            progress(ids.size)
    return order


def _chains(v: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(B, size) positions: each of B groups of vectors v (B, size, d) as a greedy nearest-neighbour chain from
    its vector nearest c (B, d)."""
    size = v.shape[1]
    norms = np.einsum("bsd,bsd->bs", v, v)
    d = norms[:, :, None] + norms[:, None, :] - 2 * np.matmul(v, v.transpose(0, 2, 1))
    cur = (norms - 2 * np.einsum("bsd,bd->bs", v, c)).argmin(axis=1)
    rows = np.arange(len(v))
    placed = np.zeros((len(v), size), dtype=bool)
    chain = np.empty((len(v), size), dtype=np.int64)
    for t in range(size):
        chain[:, t] = cur
        placed[rows, cur] = True
        if t + 1 < size:
            step = np.where(placed, np.inf, d[rows, cur])
            cur = step.argmin(axis=1)
    return chain


def _pieces(v: np.ndarray, most: int) -> list[np.ndarray]:
    """Positions of v's rows in pieces of at most `most`, near rows together: each group longer than that split at
    the median of its projection on its principal direction (a few power iterations), the lower half first, so that
    consecutive pieces lie side by side."""
    out, stack = [], [np.arange(len(v))]
    while stack:
        idx = stack.pop()
        if len(idx) <= most:
            out.append(idx)
            continue
        x = v[idx] - v[idx].mean(axis=0)
        direction = x[np.argmax(np.einsum("sd,sd->s", x, x))].astype(np.float64)
        for _ in range(6):
            direction = x.T @ (x @ direction)
            direction /= np.linalg.norm(direction) or 1.0
        ranked = idx[np.argsort(x @ direction, kind="stable")]
        half = len(idx) // 2
        stack += [ranked[half:], ranked[:half]]
    return out


def raw_reader(pages_path, layout: PageLayout, locations: np.ndarray, dtype: np.dtype, dim: int
               ) -> Callable[[int, int], np.ndarray]:
    """raw(start, stop): the stored vectors of ids start..stop-1 as float32, read from the page file's memory map
    (the page cache, not the process's heap, holds them while a caller copies them: the device tier's upload)."""
    pages = np.memmap(pages_path, dtype=np.uint8, mode="r", shape=(layout.file_bytes,))
    per, width = layout.records_per_block, dim * np.dtype(dtype).itemsize
    records = np.lib.stride_tricks.as_strided(pages, shape=(layout.num_blocks, per, width),
                                              strides=(layout.block_bytes, layout.record_bytes, 1), writeable=False)

    def read(start: int, stop: int) -> np.ndarray:
        slots = locations[start:stop].astype(np.int64)
        rows = records[slots // per, slots % per]
        return np.ascontiguousarray(rows).view(dtype).reshape(len(slots), dim).astype(np.float32)
    return read
