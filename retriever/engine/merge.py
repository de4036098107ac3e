"""Incremental merge: the next index generation from the current one, its tombstones and the
fresh vectors, without re-clustering or re-training (docs/design.md, "Build": a merge).

- Tombstoned vectors leave their posting lists, their PQ codes and their SSD slots; survivors
  are renumbered densely (the collection maps the new numbers to rows).
- New vectors join their nearest posting lists with the build's boundary replication, get a PQ
  code from the existing codebooks, and take free SSD slots (dead vectors' slots first, in
  ascending order so a list's new vectors share pages) before new blocks are appended.
- A posting list that grows past its bound is split SPFresh-style: 2-means over its vectors, the
  centre farther from the old centroid becomes a new centroid in the navigation graph, the list's
  vectors are re-assigned between the two (with replication), and vectors of the neighbouring
  lists that now lie within the replication bound of the new centroid join it.
- The default search settings the build calibrated are measured again on the new generation's rows once it
  holds calibrate.REMEASURE_GROWTH times more (or fewer) rows than were measured (calibrate.merge_remeasures);
  until then each generation keeps its predecessor's.

The old generation is never touched: its page file is copied (copy_file_range: in-kernel, a
reflink where the file system has them) and changed only in the copy, so searches keep running
on it until the new generation is published.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.engine.build import nearest_rows, save_index_files
from fusionrag.retriever.engine.calibrate import calibrate, calibrate_build, merge_remeasures
from fusionrag.retriever.engine.config import BuildConfig, cpu_threads
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.kmeans import kmeans
from fusionrag.retriever.engine.layout import PageLayout
from fusionrag.retriever.engine.learned_probe import MODEL_FILE
from fusionrag.retriever.engine.manifest import ArrayFileWriter, copy_file, load_array, writing_index
from fusionrag.retriever.engine.vectors import STORAGE_DTYPES, internal_metric
from fusionrag.retriever.progress import OnProgress, Progress

log = logging.getLogger(__name__)
_DTYPES = {v: k for k, v in STORAGE_DTYPES.items()}
_NEIGHBOURS = 8  # lists around a split whose vectors may join the new centroid
_CHUNK = 65536  # new vectors assigned at a time: a step of the progress shown
_CHUNK_BYTES = 8 << 20  # rows of vectors a step of the merge holds at once (and a few temporaries of that size)
_MERGE_BEAM = 64  # the graph search beam that assigns new rows to lists (_nearest), from their sampled entries
# A new row's graph search starts at the nearest of this many centroids (at most _ENTRY_SAMPLE_BYTES of them), taken
# evenly over the graph's order and compared exactly: a sample of the data's regions (_entry_sample).
_ENTRY_SAMPLE, _ENTRY_SAMPLE_BYTES = 16384, 16 << 20


def _rows_of(dim: int) -> int:
    """Vectors of this dimension in _CHUNK_BYTES."""
    return max(256, _CHUNK_BYTES // (4 * dim))


@dataclass
class MergeStats:
    removed: int
    added: int
    splits: int
    slots_reused: int
    blocks_appended: int
    splits_deferred: int = 0  # oversized lists left for a later merge: no room for a second copy of the graph
    unsplit_postings: int = 0  # the postings those lists hold (compaction.can_grow rebuilds past a share of all)


def can_store(index: Index, vectors: np.ndarray) -> bool:
    """Whether the index's SSD element type holds these vectors exactly (an index of byte-valued
    floats stores bytes; a float that is not one needs a rebuild)."""
    dtype = _DTYPES[index.manifest["storage_dtype"]]
    if dtype == np.float32 or not len(vectors):
        return True
    info = np.iinfo(dtype)
    return bool(np.array_equal(vectors, np.rint(vectors)) and vectors.min() >= info.min and vectors.max() <= info.max)


class _Records:
    """The page file memory-mapped for writing, addressed by slot. A block's records need not fill
    it (20 records of 200 bytes in 4096), so slots are (block, record) pairs of a 3-D view: a
    flat (slots, record_bytes) reshape of the strided map would be a copy, and writes to it lost."""

    def __init__(self, path: Path, layout: PageLayout, num_blocks: int):
        self.per = layout.records_per_block
        self.blocks = np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_blocks, layout.block_bytes))
        self.view = self.blocks[:, :self.per * layout.record_bytes].reshape(num_blocks, self.per, layout.record_bytes)
        assert np.shares_memory(self.view, self.blocks)

    def __getitem__(self, slots: np.ndarray) -> np.ndarray:
        return self.view[slots // self.per, slots % self.per]

    def __setitem__(self, slots: np.ndarray, data) -> None:
        self.view[slots // self.per, slots % self.per] = data


def _int_for(n: int):
    """The narrowest signed integer type that holds 0..n (a merge's per-posting arrays: 4 bytes, not 8)."""
    return np.int32 if n < 2**31 else np.int64


class _Lists:
    """(list, id) pairs: the new vectors' postings, and those of the vectors a split places again; the other
    postings stay in the old CSR lists until _stream_lists writes the new ones. Held as the narrowest integers that
    hold the lists and the ids."""

    def __init__(self, lists: np.ndarray, ids: np.ndarray, count: int):
        self.list_type, self.id_type = np.int32, _int_for(count)
        self.lists, self.ids = lists.astype(self.list_type, copy=False), ids.astype(self.id_type, copy=False)

    def add(self, lists: np.ndarray, ids: np.ndarray) -> None:
        self.lists = np.concatenate([self.lists, lists.astype(self.list_type)])
        self.ids = np.concatenate([self.ids, ids.astype(self.id_type)])


def merge_index(old: Index, dead: np.ndarray, new_vectors: np.ndarray, out_dir: Path,
                config: BuildConfig, progress: bool | None = None, on_progress: OnProgress | None = None,
                order: np.ndarray | None = None, extra: Callable | None = None,
                assign: np.ndarray | None = None) -> MergeStats:
    """Write the next generation of `old` to out_dir: vectors flagged in dead (bool per old id)
    removed, new_vectors (engine form: unit rows under cosine) appended after the survivors.

    progress, on_progress: as for build_index. order: the vectors' order in the new generation (a
    permutation of survivors-then-new: new id j is that order's j-th; a shard keeps its ids ascending by
    its global ids). extra(w): writes more files into the generation before it is published. assign: the
    list each new vector joins, alone (-1: its nearest lists, with the build's replication, as without)."""
    t0 = time.perf_counter()
    steps = Progress(progress, on_progress)
    m_old = old.manifest
    dim, metric = old.dim, old.metric
    dtype = _DTYPES[m_old["storage_dtype"]]
    layout = PageLayout(**m_old["pages"])
    threads = cpu_threads(config.threads)
    rng = np.random.default_rng(config.seed + int(m_old.get("generation", 0)) + 1)
    alive = ~dead
    n_keep, n_new = int(alive.sum()), len(new_vectors)
    ids_type = _int_for(n_keep + n_new)
    renum = (np.cumsum(alive, dtype=ids_type) - 1)  # a survivor's new id (a dead one's is never read)
    new_ids = np.arange(n_keep, n_keep + n_new)

    # The new vectors are placed by the open index's own graph (read only, maybe SQ8 codes: its candidates are
    # ranked again by exact l2 to the full centroids) and the old centroids memory-mapped from its graph file; a
    # private copy of the graph, which a split adds nodes to, is loaded only where a list splits. A copy of the
    # graph and the centroids as an array were the merge's largest arrays: at lists of ~10 vectors and 128-d, 64
    # and 51 bytes a vector, on top of the index the service holds.
    shared = old.nav.graph
    centroids = _Centroids(old.path / "graph.bin", dim)
    graph = None
    n_lists = shared.size
    f = old.filter
    # The survivors' postings stay in the old index's lists, read a block of lists at a time: (list, id) pairs of
    # every posting (8 bytes each, ~1.2-4 postings a vector) are made only where a list splits.
    kept_per_list = _kept_counts(f.list_offsets, f.list_ids, alive)
    new_pairs = _Lists(np.empty(0, np.int32), np.empty(0, ids_type), n_keep + n_new)

    # New vectors to their nearest lists, with the build's boundary replication.
    x = np.ascontiguousarray(new_vectors, dtype=np.float32)
    entry = None if not n_new or metric == "ip" or old.nav.exhaustive else _entry_sample(centroids)
    primary = np.empty(n_new, np.int64)
    with steps.step("assigning", n_new) as update:
        for s in range(0, n_new, _CHUNK):
            part = slice(s, min(n_new, s + _CHUNK))
            kk = min(config.max_replicas, n_lists)
            near, sqd = _nearest(x[part], centroids, shared, metric, kk, threads, old.nav.exhaustive, entry)
            dist = np.sqrt(np.maximum(sqd, 0))
            take = (dist <= (1 + config.replica_eps) * dist[:, :1]) & (near >= 0)
            take[:, 0] = True
            if assign is not None:
                given = assign[part] >= 0
                near[given, 0] = assign[part][given]
                take[given, 1:] = False
            new_pairs.add(near[take], np.broadcast_to(new_ids[part, None], near.shape)[take])
            primary[part] = near[:, 0]
            update(len(near))

    with writing_index(out_dir) as w:
        # The SSD tier: a copy of the old page file, survivors where they were, new vectors into
        # free slots (dead vectors' first), then new blocks.
        pages = w.path("vectors.pages")
        with steps.step("copying pages", layout.num_blocks, "block") as update:
            copy_file(old.path / "vectors.pages", pages)
            update(layout.num_blocks)
        locations = old.reranker.locations[alive]  # uint32, as locations.npy holds them
        per = layout.records_per_block
        used = np.zeros(layout.num_blocks * per, bool)
        used[locations] = True
        free = np.flatnonzero(~used)
        by_list = np.argsort(primary, kind="stable")
        reuse = min(len(free), n_new)
        extra_blocks = -(-(n_new - reuse) // per)
        new_slots = np.empty(n_new, np.int64)
        new_slots[by_list] = np.concatenate([free[:reuse], layout.num_blocks * per + np.arange(n_new - reuse)])
        num_blocks = layout.num_blocks + extra_blocks
        if extra_blocks:
            with open(pages, "r+b") as fh:
                fh.truncate(num_blocks * layout.block_bytes)
        records = _Records(pages, layout, num_blocks)
        blocks = records.blocks
        dead_slots = old.reranker.locations[dead].astype(np.int64)
        records[dead_slots] = 0  # a reclaimed slot keeps no deleted vector
        if n_new:
            records[new_slots] = x.astype(dtype).view(np.uint8).reshape(n_new, layout.record_bytes)
        blocks.flush()
        block_crc = np.concatenate([load_array(old.path, "block_crc.npy", np.uint32, 1),
                                    np.zeros(extra_blocks, np.uint32)])
        for b in np.unique(np.concatenate([new_slots, dead_slots]) // per).tolist():
            block_crc[b] = native.crc32c(np.ascontiguousarray(blocks[b]))
        locations = np.concatenate([locations, new_slots.astype(np.uint32)])

        # Oversized lists split; their vectors come from the new page file.
        def vectors_of(ids: np.ndarray) -> np.ndarray:
            return records[locations[ids].astype(np.int64)].view(dtype).reshape(len(ids), dim).astype(np.float32)

        vectors_of.order = np.argsort(locations, kind="stable")  # a calibration's pass reads the file in its order

        sizes = kept_per_list + np.bincount(new_pairs.lists, minlength=n_lists)
        bound = max(16, int(2 * config.max_list_factor * len(f.list_ids) / max(1, len(f.list_offsets) - 1)))
        oversized = np.flatnonzero(sizes > bound).tolist()
        deferred = unsplit = 0
        if oversized and not _room_for_graph(old.path / "graph.bin"):
            # A split adds a node to a private copy of the graph, beside the one the open index searches: where
            # the process has no room for it, the lists stay oversized (slower to scan, never wrong) until a merge
            # that has, or a rebuild.
            deferred, unsplit, oversized = len(oversized), int(sizes[oversized].sum()), []
            log.warning("%s: %d oversized posting lists left unsplit: no room for a second copy of the %d MiB "
                        "graph beside the open index", old.path, deferred,
                        (old.path / "graph.bin").stat().st_size >> 20)
        # Each split offers its new list the vectors of the lists around it as they stood before any split
        # (offers seen by later splits would snowball, each offering the last one's offers again): read from the
        # old lists and the new pairs, not from a copy of every pair.
        members = _members(f.list_offsets, f.list_ids, alive, renum, new_pairs)
        if oversized:
            graph = native.Graph.load(str(old.path / "graph.bin"))  # whole, with its links: it is saved
        with steps.step("splitting lists", len(oversized), "list") as update:
            affected, offered_to = [], []
            for lst in oversized:
                new_id, cand = _split(lst, members, centroids, graph, vectors_of, metric, config, rng, threads)
                affected.append(cand.astype(ids_type))
                offered_to.append(np.full(len(cand), new_id, np.int32))
                update(1)
        if graph is not None:
            n_lists = graph.size
        # The vectors splits touched are placed again by the replication rule over every list they are in or were
        # offered; every other posting stays where it was.
        moved = np.zeros(n_keep + n_new, bool)
        placed = _Lists(np.empty(0, np.int32), np.empty(0, ids_type), n_keep + n_new)
        if affected:
            touched = np.unique(np.concatenate(affected))
            moved[touched] = True
            placed = _pairs_of(moved, f.list_offsets, f.list_ids, alive, renum, new_pairs, n_keep + n_new)
            placed.add(np.concatenate(offered_to), np.concatenate(affected))
            del affected, offered_to
            _reassign(placed, touched, centroids, vectors_of, config)
        stay = ~moved[new_pairs.ids]
        placed.add(new_pairs.lists[stay], new_pairs.ids[stay])
        kept_old = alive & ~moved[np.maximum(renum, 0)]  # the old postings that stay as they are
        del moved, members
        splits = len(oversized)

        # From the index's own file, not the filter tier: on the GPU its codes are a device tensor, and
        # when tiered only the hot rows, in slot order.
        old_codes = np.load(old.path / "pq_codes.npy", mmap_mode="r")
        pq = old.pq
        new_codes = np.empty((n_new, pq.code_bytes), np.uint8)
        with steps.step("pq encoding", n_new) as update:
            rows = _rows_of(dim)  # the encoder's tables are several times the rows
            for s in range(0, n_new, rows):
                part = x[s:s + rows]
                new_codes[s:s + len(part)] = pq.encode(part)
                update(len(part))
        new_of = None
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            if len(order) != n_keep + n_new or not np.array_equal(np.sort(order), np.arange(n_keep + n_new)):
                raise ValueError("order must be a permutation of the new generation's vectors")
            new_of = np.empty_like(order)
            new_of[order] = np.arange(len(order))
            locations = locations[order]
        offsets, list_ids = _stream_lists(w, f.list_offsets, f.list_ids, kept_old, renum, placed, n_lists, new_of)
        del renum, new_pairs, placed, kept_old
        codes = _write_codes(w, old_codes, alive, new_codes, order)
        del centroids
        # Unsplit, the graph is the old one's: its file copied (in-kernel), not a copy in memory saved.
        save_index_files(w, block_crc, graph if graph is not None else old.path / "graph.bin", offsets, list_ids,
                         pq.codebooks, codes, locations)
        if old.nav.model is not None:
            # Its features are distances to the nearest centroids, which a split only refines: kept.
            w.save_array(MODEL_FILE, old.nav.model.trees)
        if extra is not None:
            extra(w)
        stats = MergeStats(int(dead.sum()), n_new, splits, reuse, extra_blocks, deferred, unsplit)
        manifest = {k: v for k, v in m_old.items() if k not in ("format", "format_version", "files")}
        manifest.update({
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "count": n_keep + n_new,
            "centroids": n_lists,
            # Kept through splits, and recorded for an index built before the record: queries go as rows went.
            "list_navigation": "exact" if old.nav.exhaustive else "graph",
            "postings": int(len(list_ids)),
            "pages": {**layout.to_dict(), "num_blocks": num_blocks},
            "source": {"path": "<incremental merge>", "dtype": "float32"},
            "generation": int(m_old.get("generation", 0)) + 1,
            "full_build_count": int(m_old.get("full_build_count", m_old["count"])),
            "merge": {**stats.__dict__, "seconds": time.perf_counter() - t0},
        })
        count = n_keep + n_new
        if merge_remeasures(m_old, count, config.calibrate):  # grown (or shrunk) past what was measured
            timings: dict = {}
            calibrate_build(manifest, w, steps, timings, t0, lambda d: calibrate(
                d, vectors_of, count, internal_metric(metric), config.calibrate_queries, config.target_recall,
                config.seed + manifest["generation"], threads))
            manifest["merge"].update(calibrate_s=timings["calibrate_s"], seconds=timings["total_s"])
        w.publish(manifest)
    return stats


def _list_blocks(offsets: np.ndarray, postings: int = 1 << 20):
    """(a, b): consecutive ranges of lists holding about `postings` postings each (at least one list)."""
    n, a = len(offsets) - 1, 0
    while a < n:
        b = int(np.searchsorted(offsets, offsets[a] + postings, side="right")) - 1
        b = min(max(b, a + 1), n)
        yield a, b
        a = b


def _kept_counts(offsets: np.ndarray, list_ids: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """Surviving postings per list, a block of lists at a time."""
    out = np.zeros(len(offsets) - 1, np.int64)
    for a, b in _list_blocks(offsets):
        kept = np.concatenate([[0], np.cumsum(alive[list_ids[offsets[a]:offsets[b]]], dtype=np.int64)])
        out[a:b] = np.diff(kept[offsets[a:b + 1] - offsets[a]])
    return out


def _block_pairs(offsets, list_ids, alive, renum, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(list, new id) of the surviving postings of lists a..b-1."""
    ids = np.asarray(list_ids[offsets[a]:offsets[b]])
    keep = alive[ids]
    lst = np.repeat(np.arange(a, b, dtype=np.int32), np.diff(offsets[a:b + 1]))[keep]
    return lst, renum[ids[keep]]


def _members(offsets, list_ids, alive, renum, new: _Lists) -> Callable[[int], np.ndarray]:
    """list -> its ids as the lists stand before any split: its surviving old postings (renumbered), then the new
    vectors it took; none for a list a split made."""
    o = np.argsort(new.lists, kind="stable")
    nl, ni = new.lists[o], new.ids[o]
    n_old = len(offsets) - 1

    def of(lst: int) -> np.ndarray:
        if lst >= n_old:
            return ni[:0]
        ids = np.asarray(list_ids[offsets[lst]:offsets[lst + 1]])
        s, e = np.searchsorted(nl, [lst, lst + 1])
        return np.concatenate([renum[ids[alive[ids]]], ni[s:e]])
    return of


def _pairs_of(wanted: np.ndarray, offsets, list_ids, alive, renum, new: _Lists, count: int) -> _Lists:
    """The (list, id) pairs of the vectors flagged in wanted (by new id): their surviving old postings, read a
    block of lists at a time, and their new ones."""
    out = _Lists(np.empty(0, np.int32), np.empty(0, renum.dtype), count)
    for a, b in _list_blocks(offsets):
        lst, ids = _block_pairs(offsets, list_ids, alive, renum, a, b)
        sel = wanted[ids]
        out.add(lst[sel], ids[sel])
    sel = wanted[new.ids]
    out.add(new.lists[sel], new.ids[sel])
    return out


def _stream_lists(w, offsets, list_ids, kept: np.ndarray, renum, add: _Lists, n_lists: int,
                  new_of: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The new generation's CSR lists (n_lists of them, the old ones first), written to list_ids.npy a block of
    lists at a time: each list's old postings flagged in kept (by old id; renumbered) and the pairs of add, ids
    ascending within a list (after new_of, where given), as a build orders them; no pair per posting is ever whole
    in memory. Returns (offsets, the ids memory-mapped)."""
    n_old = len(offsets) - 1
    sizes = np.zeros(n_lists, np.int64)
    sizes[:n_old] = _kept_counts(offsets, list_ids, kept)
    sizes += np.bincount(add.lists, minlength=n_lists)
    new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = ArrayFileWriter(w.path("list_ids.npy"), np.uint32, (int(new_offsets[-1]),))
    o = np.lexsort((add.ids, add.lists))
    nl, ni = add.lists[o], add.ids[o]
    blocks = list(_list_blocks(offsets)) + ([(n_old, n_lists)] if n_lists > n_old else [])
    for a, b in blocks:
        lst, ids = _block_pairs(offsets, list_ids, kept, renum, a, b) if a < n_old else (nl[:0], ni[:0])
        s, e = np.searchsorted(nl, [a, b])
        lst, ids = np.concatenate([lst, nl[s:e]]), np.concatenate([ids, ni[s:e]])
        if new_of is not None:
            ids = new_of[ids]
        out.write(ids[np.lexsort((ids, lst))])
    return new_offsets, out.array()


def _write_codes(w, old_codes: np.ndarray, alive: np.ndarray, new_codes: np.ndarray,
                 order: np.ndarray | None) -> np.ndarray:
    """The new generation's pq_codes.npy, written a chunk at a time (the survivors' codes, then the new ones; with
    order, gathered into that order), so the merge holds no copy of them: returns it, memory-mapped."""
    n, m = int(alive.sum()) + len(new_codes), old_codes.shape[1]
    out = ArrayFileWriter(w.path("pq_codes.npy"), np.uint8, (n, m))
    if order is None:
        for s in range(0, len(alive), _CHUNK):
            out.write(np.asarray(old_codes[s:s + _CHUNK])[alive[s:s + _CHUNK]])
        out.write(new_codes)
        return out.array()
    survivors = np.flatnonzero(alive)
    for s in range(0, n, _CHUNK):
        j = order[s:s + _CHUNK]  # new ids: survivors first, then the new vectors
        part = np.empty((len(j), m), np.uint8)
        old_j = j < len(survivors)
        part[old_j] = old_codes[survivors[j[old_j]]]
        part[~old_j] = new_codes[j[~old_j] - len(survivors)]
        out.write(part)
    return out.array()


class _Centroids:
    """The centroids a merge reads (without the ip coordinate): the old ones memory-mapped from the old graph's
    file (native/graph.cpp: a 64-byte header, a level byte per node, then the nodes' vectors), and those splits
    add, appended: not the graph's whole copy in the heap (at lists of ~10 vectors and 128-d, 51 bytes a vector)."""

    def __init__(self, graph_file: Path, dim: int):
        header = np.fromfile(graph_file, np.dtype([("magic", "S8"), ("version", "<u4"), ("metric", "<u4"),
                                                   ("dim", "<u8"), ("M", "<u8"), ("efc", "<u8"), ("seed", "<u8"),
                                                   ("size", "<u8"), ("entry", "<u4"), ("max_level", "<i4")]), 1)[0]
        self.n_old, gdim = int(header["size"]), int(header["dim"])
        self.full = np.memmap(graph_file, np.float32, "r", offset=64 + self.n_old, shape=(self.n_old, gdim))
        self.dim = dim
        self.added: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.n_old + len(self.added)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.dim

    def append(self, centroid: np.ndarray) -> None:
        self.added.append(np.asarray(centroid, np.float32)[:self.dim])

    def __getitem__(self, idx):
        if np.ndim(idx) == 0:
            i = int(idx)
            return np.asarray(self.full[i, :self.dim]) if i < self.n_old else self.added[i - self.n_old]
        idx = np.asarray(idx)
        out = np.empty(idx.shape + (self.dim,), np.float32)
        old = idx < self.n_old
        out[old] = self.full[idx[old], :self.dim]
        if not old.all():
            out[~old] = np.stack(self.added)[idx[~old] - self.n_old]
        return out

    def array(self) -> np.ndarray:
        """All of them, in memory (ip's exact nearest centroids read every one for each vector)."""
        return np.ascontiguousarray(np.concatenate([self.full[:, :self.dim]] + [a[None] for a in self.added]))


SPLIT_ROOM = 4  # splits need this many times the graph's file free: its copy, then the pairs and vectors they move


def _room_for_graph(graph_file: Path) -> bool:
    """Whether splits fit: a copy of this graph (about its file's bytes in the heap) and what the splits move, at
    most 1/SPLIT_ROOM of what the process has left beside its resident anonymous memory (process.memory_limit: its
    cgroup's limit, else the machine's memory). Measured: 300k x 128 in 176 MiB, a 17 MiB graph, 190 splits, the
    merge's peak 31 MiB above one without splits."""
    from fusionrag.retriever.process import anonymous_bytes, memory_limit

    return SPLIT_ROOM * graph_file.stat().st_size <= memory_limit() - anonymous_bytes()


def _entry_sample(centroids: _Centroids) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of _ENTRY_SAMPLE centroids taken evenly over the graph's order (the build's clustering
    writes a region's centroids together), at most _ENTRY_SAMPLE_BYTES of them."""
    n = min(len(centroids), _ENTRY_SAMPLE, max(1, _ENTRY_SAMPLE_BYTES // (4 * centroids.dim)))
    ids = np.unique(np.linspace(0, len(centroids) - 1, n).astype(np.int64))
    return ids, np.ascontiguousarray(centroids[ids], dtype=np.float32)


def _nearest(x: np.ndarray, centroids: _Centroids, graph, metric: str, k: int, threads: int, exact: bool,
             entry: tuple[np.ndarray, np.ndarray] | None = None):
    """The k nearest centroids by exact l2 (what the build's replication uses), ids and squared dists. l2 and
    cosine: the graph's 4k nearest (by its exact search where the index navigates so: queries look where rows
    went), ranked again by their full centroids; ip (whose graph orders by inner product): every centroid, a
    chunk of the memory-mapped ones at a time. A new row has no leaf of the build's clustering to start its graph
    search from (build.assign_rows); from the graph's entry point the search ended in another cluster of the data
    for 5.1% of rows at beam 64 and 1.1% at 256. Started at the nearest centroid of entry (_entry_sample), none at
    beam 64, in less time than 256 from the entry point (bench/results/peers/merge_beam.md, 3M clustered)."""
    if metric != "ip":
        m = min(len(centroids), max(4 * k, 32))
        entries = None
        if entry is not None and not exact:
            ids, vecs = entry
            e, _ = nearest_rows(x, vecs, 1, rows=max(64, (4 << 20) // len(ids)))
            entries = np.ascontiguousarray(ids[e[:, 0]], dtype=np.int32)
        cand, _ = (graph.exact_search(x, m, threads) if exact
                   else graph.search(x, m, max(2 * m, _MERGE_BEAM), threads, entries=entries))
        cand = cand.astype(np.int64)
        near = np.empty((len(x), k), np.int64)
        sqd = np.empty((len(x), k), np.float32)
        rows = max(1, _CHUNK_BYTES // (4 * m * x.shape[1]))
        for s in range(0, len(x), rows):
            c = cand[s:s + rows]
            d = ((x[s:s + rows, None, :] - centroids[np.maximum(c, 0)]) ** 2).sum(-1)
            d[c < 0] = np.inf
            o = np.argsort(d, axis=1, kind="stable")[:, :k]
            near[s:s + rows] = np.where(np.isfinite(np.take_along_axis(d, o, 1)), np.take_along_axis(c, o, 1), -1)
            sqd[s:s + rows] = np.take_along_axis(d, o, 1)
        return near, sqd
    return _nearest_every(x, centroids, k)


def _nearest_every(x: np.ndarray, centroids: _Centroids, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of every old centroid by exact squared l2, ids and squared dists: a chunk of the memory-mapped
    ones at a time."""
    step = max(1024, _CHUNK_BYTES // (4 * centroids.dim))
    best_i, best_d = None, None
    for lo in range(0, len(centroids), step):
        block = np.ascontiguousarray(centroids.full[lo:lo + step, :centroids.dim])
        i, d = nearest_rows(x, block, min(k, len(block)))
        i = i.astype(np.int64) + lo
        if best_i is not None:
            i, d = np.concatenate([best_i, i], 1), np.concatenate([best_d, d], 1)
            o = np.argsort(d, axis=1, kind="stable")[:, :k]
            i, d = np.take_along_axis(i, o, 1), np.take_along_axis(d, o, 1)
        best_i, best_d = i, d
    return best_i, best_d


def _split(lst: int, members: Callable[[int], np.ndarray], centroids: _Centroids, graph, vectors_of, metric: str,
           config: BuildConfig, rng: np.random.Generator, threads: int) -> tuple[int, np.ndarray]:
    """Split list lst (SPFresh): 2-means over its vectors; the centre farther from the old centroid
    becomes a new centroid (graph node). Returns it and its candidates, the list's vectors and those
    of the lists around it; _reassign then keeps what the replication rule allows."""
    ids = members(lst)
    c = centroids[lst]
    centers, _ = kmeans(vectors_of(ids), 2, config.kmeans_iters, rng)
    new_c = centers[int(np.argmax(((centers - c) ** 2).sum(1)))].astype(np.float32)
    node = new_c[None]
    if metric == "ip":  # the augmented coordinate keeps the graph's l2 order = inner-product order
        r_sq = float((np.asarray(centroids.full[0], np.float64) ** 2).sum())  # every node's augmented norm
        node = np.hstack([node, [[np.sqrt(max(r_sq - float(new_c @ new_c), 0.0))]]]).astype(np.float32)
    new_id = graph.size
    graph.add(np.ascontiguousarray(node, dtype=np.float32), threads)
    centroids.append(new_c)
    hood, _ = graph.search(node, min(_NEIGHBOURS + 1, graph.size), max(32, 2 * _NEIGHBOURS), threads)
    cand = np.unique(np.concatenate([ids] + [members(nb) for nb in hood[0].tolist()
                                             if nb >= 0 and nb not in (lst, new_id)]))
    return new_id, cand


def _reassign(lists: _Lists, ids: np.ndarray, centroids: _Centroids, vectors_of, config: BuildConfig) -> None:
    """The build's replication rule again for these vectors over the lists they are in or were
    offered: keep list l if dist(v, c_l) <= (1 + eps) * the nearest such distance, at most
    max_replicas lists, the nearest always."""
    mark = np.zeros(int(max(lists.ids.max(initial=-1), ids.max(initial=-1))) + 1, bool)
    mark[ids] = True
    sel = mark[lists.ids]  # (np.isin sorts a copy of every pair)
    del mark
    n_lists = int(lists.lists.max(initial=-1)) + 1
    key = np.unique(lists.ids[sel].astype(np.int64) * n_lists + lists.lists[sel])  # the pairs, by id then list
    pid, pl = (key // n_lists).astype(lists.id_type), (key % n_lists).astype(lists.list_type)
    del key
    d = np.empty(len(pid), np.float32)
    rows = _rows_of(centroids.shape[1])
    for s in range(0, len(pid), rows):  # (pairs, dim) at once could be gigabytes; the vectors read as needed
        e = s + rows
        d[s:e] = np.sqrt(((vectors_of(pid[s:e]) - centroids[pl[s:e]]) ** 2).sum(1))
    order = np.lexsort((d, pid))
    pid, pl, d = pid[order], pl[order], d[order]
    start = np.flatnonzero(np.concatenate([[True], pid[1:] != pid[:-1]]))
    group = np.repeat(np.arange(len(start)), np.diff(np.concatenate([start, [len(pid)]])))
    rank = np.arange(len(pid)) - start[group]
    keep = (d <= (1 + config.replica_eps) * d[start][group]) & (rank < config.max_replicas)
    lists.lists = np.concatenate([lists.lists[~sel], pl[keep]])
    lists.ids = np.concatenate([lists.ids[~sel], pid[keep]])
