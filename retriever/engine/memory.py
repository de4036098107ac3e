"""What the page buffer holds beside its blocks' bytes, and its budget split so that all of it stays within it (#68).

The page buffer (native/page_buffer.cpp) keeps per entry its block number, use and pin bytes, a slot of its shard's
FrameMap and, under the lfu and auto policies, count-min counters; a compressed buffer per entry its chain head and
coded size and per 256-byte chunk of its memory a link; the auto policy's miniature two metadata-only shadows of up
to 511 entries, and an adaptive layout's miniature a shadow of the blocks and one of the records. `PageBuffer::init`
and its constructor size them; these functions size them the same way (tests/retriever/test_memory_accounting.py
checks the sum against the process's resident memory). A record cache entry's bookkeeping is counted in its
record_cache_overhead (96 bytes, more than it holds), as it always was.
"""

from __future__ import annotations

import math

from fusionrag import native

CHUNK_BYTES = 256  # native kChunkBytes
SHARD_MIN_FRAMES, MAX_SHARDS = 256, 16
MINIATURE_FRAMES = 256  # the miniatures' rate is chosen for shadows of about this many entries


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _shard_bytes(frames: int, sketch: bool, compressed: bool = False) -> int:
    """One shard's (or shadow's) metadata (PageBuffer::init, and init_chunks' per-entry arrays)."""
    n = frames * (4 + 1 + 1) + _pow2_at_least(max(8, 2 * frames)) * 8  # block_of, uses, pinned; FrameMap slots
    if sketch:
        n += _pow2_at_least(max(64, 16 * frames))
    if compressed:
        n += frames * 8  # head, coded
    return n


def entry_factor(compress_gain: float) -> float:
    """Entries a compressed buffer keeps per block of its memory (1.25 x the gain, at most 4); 1 plain."""
    return min(4.0, compress_gain * 1.25) if compress_gain > 1 else 1.0


def shards_bytes(capacity: int, block_bytes: int, policy: str, compress_gain: float = 0.0) -> int:
    """Bytes an active PageBuffer of `capacity` blocks (or records) of block_bytes keeps per entry beside their
    bytes: its shards' metadata (PageBuffer's constructor and init; a compressed buffer's chunk links too)."""
    if capacity <= 0:
        return 0
    compressed = compress_gain > 1
    n = 0
    shards = min(max(capacity // SHARD_MIN_FRAMES, 1), MAX_SHARDS)
    for i in range(shards):
        nominal = capacity * (i + 1) // shards - capacity * i // shards
        entries = math.ceil(nominal * entry_factor(compress_gain)) if compressed else nominal
        n += _shard_bytes(entries, policy != "clock", compressed)
        if compressed:
            n += nominal * block_bytes // CHUNK_BYTES * 4
    return n


def miniature_bytes(capacity: int, policy: str, compress_gain: float = 0.0) -> int:
    """The auto policy's miniature of a PageBuffer of `capacity` blocks (or records): two metadata-only shadows,
    made with the buffer whether it is on or not; none under lfu or clock."""
    if capacity <= 0 or policy != "auto":
        return 0
    effective = int(capacity * compress_gain) if compress_gain > 1 else capacity
    frames = max(1, effective // max(1, effective // MINIATURE_FRAMES))
    return _shard_bytes(frames, False) + _shard_bytes(frames, True)


def layout_miniature_bytes(blocks: int, records: int) -> int:
    """An adaptive layout's miniature: lfu shadows of blocks / rate and records / rate entries (PageStore)."""
    rate = max(1, blocks // MINIATURE_FRAMES)
    return shards_bytes(max(1, blocks // rate), 0, "lfu") + shards_bytes(max(1, records // rate), 0, "lfu")


def held_bytes(blocks: int, records: int, adaptive: bool, layout, policy: str, compress_gain: float = 0.0,
               records_on: bool | None = None) -> int:
    """What the page buffer of `blocks` blocks and `records` records holds full, its bookkeeping included: under
    an adaptive layout the layout on (records_on; None: the larger of the two, either may come), else both. A
    record costs record_cache_overhead beside its bytes, which covers its entry's metadata."""
    per_record = layout.record_bytes + native.PageStore.record_cache_overhead
    as_blocks = blocks * layout.block_bytes + shards_bytes(blocks, layout.block_bytes, policy, compress_gain)
    as_records = records * per_record
    minis = miniature_bytes(blocks, policy, compress_gain) + miniature_bytes(records, policy)
    if adaptive:
        held = {None: max(as_blocks, as_records), True: as_records, False: as_blocks}[records_on]
        return held + minis + layout_miniature_bytes(blocks, records)
    return as_blocks + as_records + minis


def records_cache_denser(layout) -> bool:
    """Whether a record cached alone (its bytes and metadata) costs less than its share of a block: records
    that leave part of their pages empty (1536-byte records two to a 4 KiB page). The store's own rule, which
    an adaptive layout starts by."""
    return native.PageStore.records_denser(layout.record_bytes, layout.records_per_block, layout.pages_per_block)


def split_buffer(buffer_bytes: int, config, layout, compressed: bool = False,
                 compress_gain: float = 0.0) -> tuple[int, int, bool]:
    """(page buffer blocks, record cache records, adaptive) of buffer_bytes, so that what the buffer holds full, its
    bookkeeping included (held_bytes), is within buffer_bytes. record_cache 'auto': all of it as blocks or as
    records, one at a time (adaptive: the store switches between the two by a miniature of both), where it holds at
    least one of each, and blocks alone where the buffer is compressed; 'on': record_cache_share of it goes to
    records, each costing its bytes and its metadata (native.PageStore.record_cache_overhead), the rest to blocks;
    'off': blocks."""
    per_record = layout.record_bytes + native.PageStore.record_cache_overhead
    compressed = compressed or compress_gain > 1

    def split(budget: int) -> tuple[int, int, bool]:
        blocks, records = budget // layout.block_bytes, budget // per_record
        if config.record_cache == "auto" and compressed:
            return blocks, 0, False
        if config.record_cache == "auto" and blocks and records:
            return blocks, records, True
        on = config.record_cache == "on" or (config.record_cache == "auto" and records_cache_denser(layout))
        record_bytes = int(budget * config.record_cache_share) if on else 0
        return (budget - record_bytes) // layout.block_bytes, record_bytes // per_record, False

    budget = buffer_bytes
    while True:
        got = split(budget)
        over = held_bytes(*got, layout, config.buffer_policy, compress_gain) - buffer_bytes
        if over <= 0 or budget <= 0:
            return got
        budget = max(0, budget - max(over, layout.record_bytes))


# Per query of a batch in its graph stage: the nearest lists' ids and distances (4 + 4 bytes a list) and the ratio
# rule's temporaries over them (distance roots 4, the keep mask 1, list sizes and their running sums 8 + 8 + 8).
GRAPH_STAGE_BYTES = 37
IN_FLIGHT = 3  # batches past their first stage and before their last at once (overlap.overlapped: depth + 1)


def search_call_bytes(queries: int, k: int, nprobe: int, rerank: int, dim: int, batch: int, lists: int,
                      pipelined: bool, stat_keys: int = 14) -> int:
    """What one search call holds at most beside the index (pipeline.cut, overlap.overlapped, Index's stages): its
    result arrays (ids 8 + distances 4 bytes a hit, a float per stat), and per batch in flight (IN_FLIGHT where
    the call's batches overlap) its lists (4 bytes each), its candidates (id 8 + PQ distance 4 bytes each, n =
    max(rerank, k) a query) and its normalised rows; one graph stage's temporaries at a time. A bound: the ratio
    rule and the re-rank's early stop use less."""
    if queries <= 0:
        return 0
    b = min(batch, queries)
    batches = -(-queries // batch)
    inflight = min(batches, IN_FLIGHT if pipelined else 1)
    m = min(nprobe, lists)
    n = max(rerank, k)
    per_batch = b * (m * 4 + n * 12 + dim * 4)
    return int(queries * (k * 12 + stat_keys * 8) + inflight * per_batch + b * m * GRAPH_STAGE_BYTES)
