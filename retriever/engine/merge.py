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

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.engine.build import internal_metric, nearest_rows, save_index_files
from fusionrag.retriever.engine.calibrate import calibrate, calibrate_build, merge_remeasures
from fusionrag.retriever.engine.config import BuildConfig, cpu_threads
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.kmeans import kmeans
from fusionrag.retriever.engine.layout import PageLayout
from fusionrag.retriever.engine.learned_probe import MODEL_FILE
from fusionrag.retriever.engine.manifest import load_array, writing_index
from fusionrag.retriever.engine.vectors import STORAGE_DTYPES
from fusionrag.retriever.progress import OnProgress, Progress

_DTYPES = {v: k for k, v in STORAGE_DTYPES.items()}
_NEIGHBOURS = 8  # lists around a split whose vectors may join the new centroid
_CHUNK = 65536  # new vectors assigned and encoded at a time: a step of the progress shown


@dataclass
class MergeStats:
    removed: int
    added: int
    splits: int
    slots_reused: int
    blocks_appended: int


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


class _Lists:
    """Posting lists as (list, id) pairs while they change; CSR at the end."""

    def __init__(self, lists: np.ndarray, ids: np.ndarray):
        self.lists, self.ids = lists, ids

    def add(self, lists: np.ndarray, ids: np.ndarray) -> None:
        self.lists = np.concatenate([self.lists, lists.astype(np.int64)])
        self.ids = np.concatenate([self.ids, ids.astype(np.int64)])

    def members(self) -> Callable[[int], np.ndarray]:
        """list -> its ids, as the lists stand now (later changes are not seen)."""
        order = np.argsort(self.lists, kind="stable")
        ids, offsets = self.ids[order], np.searchsorted(self.lists[order], np.arange(int(self.lists.max(initial=-1)) + 2))
        return lambda lst: ids[offsets[lst]:offsets[lst + 1]] if lst + 1 < len(offsets) else ids[:0]

    def csr(self, num_lists: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.lexsort((self.ids, self.lists))  # ids ascending within a list, as the build has them
        offsets = np.concatenate([[0], np.cumsum(np.bincount(self.lists, minlength=num_lists))]).astype(np.int64)
        return offsets, self.ids[order].astype(np.uint32)


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
    renum = np.full(len(alive), -1, np.int64)
    renum[alive] = np.arange(n_keep)
    new_ids = np.arange(n_keep, n_keep + n_new)

    graph = native.Graph.load(str(old.path / "graph.bin"))  # a private copy: the old one is in use
    centroids = graph.vectors()[:, :dim].copy()
    f = old.filter
    old_lists = np.repeat(np.arange(len(f.list_offsets) - 1), np.diff(f.list_offsets))
    keep = alive[f.list_ids]
    lists = _Lists(old_lists[keep], renum[f.list_ids[keep]])

    # New vectors to their nearest lists, with the build's boundary replication.
    x = np.ascontiguousarray(new_vectors, dtype=np.float32)
    primary = np.empty(n_new, np.int64)
    with steps.step("assigning", n_new) as update:
        for s in range(0, n_new, _CHUNK):
            part = slice(s, min(n_new, s + _CHUNK))
            near, sqd = _nearest(x[part], centroids, graph, metric, min(config.max_replicas, len(centroids)), threads,
                                 old.nav.exhaustive)
            dist = np.sqrt(np.maximum(sqd, 0))
            take = (dist <= (1 + config.replica_eps) * dist[:, :1]) & (near >= 0)
            take[:, 0] = True
            if assign is not None:
                given = assign[part] >= 0
                near[given, 0] = assign[part][given]
                take[given, 1:] = False
            lists.add(near[take], np.broadcast_to(new_ids[part, None], near.shape)[take])
            primary[part] = near[:, 0]
            update(len(near))

    with writing_index(out_dir) as w:
        # The SSD tier: a copy of the old page file, survivors where they were, new vectors into
        # free slots (dead vectors' first), then new blocks.
        pages = w.path("vectors.pages")
        with steps.step("copying pages", layout.num_blocks, "block") as update:
            shutil.copyfile(old.path / "vectors.pages", pages)
            update(layout.num_blocks)
        locations = old.reranker.locations[alive].astype(np.int64)
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
        locations = np.concatenate([locations, new_slots])

        # Oversized lists split; their vectors come from the new page file.
        def vectors_of(ids: np.ndarray) -> np.ndarray:
            return records[locations[ids]].view(dtype).reshape(len(ids), dim).astype(np.float32)

        sizes = np.bincount(lists.lists, minlength=len(centroids))
        bound = max(16, int(2 * config.max_list_factor * len(f.list_ids) / max(1, len(f.list_offsets) - 1)))
        oversized = np.flatnonzero(sizes > bound).tolist()
        # Each split offers its new list the vectors of the lists around it as they stood before any
        # split: offers seen by later splits would snowball (each offering the last one's offers again).
        members = lists.members()
        with steps.step("splitting lists", len(oversized), "list") as update:
            affected, offered_to = [], []
            for lst in oversized:
                new_id, cand = _split(lst, members, centroids, graph, vectors_of, metric, config, rng, threads)
                affected.append(cand)
                offered_to.append(np.full(len(cand), new_id))
                update(1)
        centroids = graph.vectors()[:, :dim]
        if affected:
            lists.add(np.concatenate(offered_to), np.concatenate(affected))
            _reassign(lists, np.unique(np.concatenate(affected)), centroids, vectors_of, config)
        splits = len(oversized)

        # From the index's own file, not the filter tier: on the GPU its codes are a device tensor, and
        # when tiered only the hot rows, in slot order.
        old_codes = np.load(old.path / "pq_codes.npy", mmap_mode="r")
        pq = old.pq
        new_codes = np.empty((n_new, pq.m), np.uint8)
        with steps.step("pq encoding", n_new) as update:
            for s in range(0, n_new, _CHUNK):
                part = x[s:s + _CHUNK]
                new_codes[s:s + len(part)] = pq.encode(part)
                update(len(part))
        codes = np.concatenate([old_codes[alive], new_codes])
        offsets, list_ids = lists.csr(len(centroids))
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            if sorted(order.tolist()) != list(range(n_keep + n_new)):
                raise ValueError("order must be a permutation of the new generation's vectors")
            new_of = np.empty_like(order)
            new_of[order] = np.arange(len(order))
            of_list = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
            moved = new_of[list_ids]
            list_ids = moved[np.lexsort((moved, of_list))].astype(list_ids.dtype)  # ascending within a list again
            codes, locations = codes[order], locations[order]
        save_index_files(w, block_crc, graph, offsets, list_ids, pq.codebooks, codes, locations)
        if old.nav.model is not None:
            # Its features are distances to the nearest centroids, which a split only refines: kept.
            w.save_array(MODEL_FILE, old.nav.model.trees)
        if extra is not None:
            extra(w)
        stats = MergeStats(int(dead.sum()), n_new, splits, reuse, extra_blocks)
        manifest = {k: v for k, v in m_old.items() if k not in ("format", "format_version", "files")}
        manifest.update({
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "count": n_keep + n_new,
            "centroids": len(centroids),
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


def _nearest(x, centroids, graph, metric: str, k: int, threads: int, exact: bool):
    """The k nearest centroids by l2 (what the build's replication uses), ids and squared dists: by the
    graph, or exactly where the index navigates so (its list_navigation: queries look where rows went)."""
    if metric != "ip" and not exact:
        near, sqd = graph.search(x, k, max(32, 2 * k), threads)
        return near.astype(np.int64), sqd
    # The ip graph orders by inner product; l2 neighbours come from the centroids directly.
    near, sqd = nearest_rows(x, centroids, k)
    return near.astype(np.int64), sqd


def _split(lst: int, members: Callable[[int], np.ndarray], centroids: np.ndarray, graph, vectors_of, metric: str,
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
        r_sq = float((graph.vectors()[0] ** 2).sum())
        node = np.hstack([node, [[np.sqrt(max(r_sq - float(new_c @ new_c), 0.0))]]]).astype(np.float32)
    new_id = graph.size
    graph.add(np.ascontiguousarray(node, dtype=np.float32), threads)
    hood, _ = graph.search(node, min(_NEIGHBOURS + 1, graph.size), max(32, 2 * _NEIGHBOURS), threads)
    cand = np.unique(np.concatenate([ids] + [members(nb) for nb in hood[0].tolist()
                                             if nb >= 0 and nb not in (lst, new_id)]))
    return new_id, cand


def _reassign(lists: _Lists, ids: np.ndarray, centroids: np.ndarray, vectors_of, config: BuildConfig) -> None:
    """The build's replication rule again for these vectors over the lists they are in or were
    offered: keep list l if dist(v, c_l) <= (1 + eps) * the nearest such distance, at most
    max_replicas lists, the nearest always."""
    sel = np.isin(lists.ids, ids)
    pairs = np.unique(np.stack([lists.ids[sel], lists.lists[sel]], axis=1), axis=0)  # sorted by id
    pid, pl = pairs[:, 0], pairs[:, 1]
    x = vectors_of(ids)
    at = np.searchsorted(ids, pid)
    d = np.empty(len(pid), np.float32)
    for s in range(0, len(pid), _CHUNK):  # (pairs, dim) at once could be gigabytes
        e = s + _CHUNK
        d[s:e] = np.sqrt(((x[at[s:e]] - centroids[pl[s:e]]) ** 2).sum(1))
    order = np.lexsort((d, pid))
    pid, pl, d = pid[order], pl[order], d[order]
    start = np.flatnonzero(np.concatenate([[True], pid[1:] != pid[:-1]]))
    group = np.repeat(np.arange(len(start)), np.diff(np.concatenate([start, [len(pid)]])))
    rank = np.arange(len(pid)) - start[group]
    keep = (d <= (1 + config.replica_eps) * d[start][group]) & (rank < config.max_replicas)
    lists.lists = np.concatenate([lists.lists[~sel], pl[keep]])
    lists.ids = np.concatenate([lists.ids[~sel], pid[keep]])
