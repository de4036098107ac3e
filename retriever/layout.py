"""Where each raw vector lives on the SSD tier.

Every vector is stored once, in the bucket of its nearest centroid, so the vectors of one posting
list share pages and the re-ranker's reads merge. A record (one vector) never straddles a block;
a block is one 4 KiB page, or several pages for a record larger than a page. Each bucket fills
whole blocks of its own, then its remainder (fewer records than a block holds) is packed with
other buckets' remainders by best-fit decreasing, which wastes the least space while keeping
every bucket on at most one shared block.
"""

from __future__ import annotations

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


def plan_layout(bucket_of: np.ndarray, num_buckets: int, record_bytes: int) -> tuple[PageLayout, np.ndarray]:
    """Assign every vector a slot; returns the layout and slot (uint32) per vector id.

    A slot s is record s % records_per_block of block s // records_per_block.
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
    # Vectors of a bucket, in id order, take its full-block slots then its shared-block slots.
    order = np.argsort(bucket_of, kind="stable")
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
