"""The offline build: vectors in, an index directory out (see docs/design.md, "Build").

1. hierarchical balanced k-means into posting-list centroids (about count * centroid_ratio);
2. the navigation graph over the centroids (native HNSW);
3. PQ training on a sample;
4. one streaming pass: each vector's nearest centroids (boundary replication), its PQ code;
5. the SSD layout: each vector once in its nearest centroid's bucket, a bucket as a nearest-neighbour
   chain (page-mates are near), buckets packed on blocks;
6. the page file and the arrays, published atomically with a manifest.
"""

from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np

from fusionrag import __version__
from fusionrag.native import Graph, PageWriter
from fusionrag.retriever.engine import pq_choice
from fusionrag.retriever.engine.calibrate import MIN_ROWS, calibrate, calibrate_build
from fusionrag.retriever.engine.config import BuildConfig, cpu_threads
from fusionrag.retriever.engine.kmeans import cluster_cap, hierarchical_balanced_kmeans
from fusionrag.retriever.engine.layout import PageLayout, chain_order, plan_layout
from fusionrag.retriever.engine.learned_probe import csr_lists_of, save_probe_model, train_probe_model
from fusionrag.retriever.engine.manifest import copy_file, resumable_index, writing_index
from fusionrag.retriever.engine.pq import ProductQuantizer
from fusionrag.retriever.engine.tiers import build_navigation, nearest_exhaustive
from fusionrag.retriever.engine.vectors import (STORAGE_DTYPES, VectorFile, as_source, check_vectors,
                                                internal_metric, normalize, sample_query_matrix, storage_dtype)
from fusionrag.retriever.errors import ConfigError, InputError
from fusionrag.retriever.progress import OnProgress, Progress

CHUNK_ROWS = 65536


def rows_per_chunk(budget: int | None, dim: int) -> int:
    """Rows a build's pass takes at a time within budget bytes: CHUNK_ROWS, or fewer where a chunk's rows (float32),
    their PQ encoding's distances (256 floats a row) and their graph search would take more than a sixteenth of
    the budget; at least 1024."""
    if budget is None:
        return CHUNK_ROWS
    return int(min(CHUNK_ROWS, max(1024, budget // 16 // (4 * dim * 3 + 256 * 4 + 256))))


def mips_augment(centroids: np.ndarray) -> np.ndarray:
    """Append sqrt(R^2 - |c|^2) (R the largest norm): then |q' - c'|^2 = |q|^2 + R^2 - 2 q.c for
    q' = (q, 0), so the l2 order of the augmented centroids is their inner-product order."""
    sq = np.einsum("ij,ij->i", centroids, centroids)
    extra = np.sqrt(np.maximum(sq.max() - sq, 0))[:, None]
    return np.ascontiguousarray(np.hstack([centroids, extra]), dtype=np.float32)


def save_index_files(w, block_crc, graph, list_offsets, list_ids, codebooks, codes, locations) -> None:
    """Every file of an index directory but the manifest, into the index being written (w), once
    the page file is complete: one place for the format a build and a merge both write. graph: a native Graph,
    or the path of a graph file to copy."""
    w.add_file("vectors.pages", hashed=False)
    w.save_array("block_crc.npy", block_crc)
    if isinstance(graph, Path):  # an unchanged graph's file (a merge without splits)
        copy_file(graph, w.path("graph.bin"))
    else:
        graph.save(str(w.path("graph.bin")))
    w.add_file("graph.bin")
    w.save_array("list_offsets.npy", list_offsets)
    w.save_array("list_ids.npy", list_ids)
    w.save_array("pq_codebooks.npy", codebooks)
    w.save_array("pq_codes.npy", codes)
    w.save_array("locations.npy", np.asarray(locations, dtype=np.uint32))


class IntegralCheck:
    """Float data whose every value is an integer in a byte's range (SIFT, say) is stored as
    bytes: exactly the same distances, a quarter of the SSD reads."""

    def __init__(self, dtype: np.dtype, metric: str):
        self.possible = np.dtype(dtype).kind == "f" and metric != "cosine"
        self.lo, self.hi = np.inf, -np.inf

    def update(self, x: np.ndarray) -> None:
        if self.possible:
            self.possible = bool(np.array_equal(x, np.rint(x)))
            self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def dtype(self) -> np.dtype | None:
        if self.possible and 0 <= self.lo and self.hi <= 255:
            return np.dtype(np.uint8)
        if self.possible and -128 <= self.lo and self.hi <= 127:
            return np.dtype(np.int8)
        return None


class Rows:
    """Vectors of the source as the engine sees them: float32, unit length under cosine."""

    def __init__(self, src: VectorFile, metric: str):
        self.src, self.metric = src, metric
        self.dtype = np.dtype(np.float32) if metric == "cosine" else storage_dtype(src.dtype)

    def stored(self, ids: np.ndarray) -> np.ndarray:
        """Rows as written to the SSD tier, in self.dtype."""
        raw = self.src[ids]
        check_vectors(raw, self.metric, self.src.path, ids)
        if self.metric == "cosine":
            return normalize(raw)
        return raw.astype(self.dtype, copy=False)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return self.stored(ids).astype(np.float32, copy=False)


def train_index(rows, n: int, dim: int, config: BuildConfig, rng: np.random.Generator, threads: int,
                steps: Progress, timings: dict, budget: int | None = None, scratch: Path | None = None, w=None):
    """Steps 1-3: (centroids, navigation graph, l2 graph of the plain centroids for assigning, PQ, each row's leaf:
    the centroid of the clustering's part it fell in, int32, or None where a resumed build's clustering did not
    record it). budget: the
    clustering's top-level clusters sized to it (kmeans.cluster_cap); scratch: a directory the centroids go to
    (a read-only memory map of them is returned), so the graph is built beside one copy of them, its own.
    w: the index being written, where it records steps (manifest.ResumableWriter, with scratch): each of the three
    is recorded as it finishes, with its results in scratch, and one it recorded before is read back, not run."""
    metric = config.metric
    done = {} if w is None or scratch is None else w.steps
    # 1. Posting-list centroids.
    if "clustering" in done:
        centroids = np.memmap(scratch / "centroids.f32", np.float32, "r", shape=(done["clustering"]["centroids"], dim))
        leaf_of = (np.load(scratch / "leaf_of.npy", mmap_mode="r", allow_pickle=False)
                   if (scratch / "leaf_of.npy").exists() else None)
    else:
        t = time.perf_counter()
        target = 1.0 / config.centroid_ratio
        cap = (1 << 18) if budget is None else cluster_cap(budget, dim, config.kmeans_branching)
        # Rows more than the budget are not in the page cache when a cluster is read whole: the streaming pass
        # spills each part's rows to a file of its own, read back in order (kmeans._Spill), not gathered from
        # the source 4 KiB page by page.
        spill = None
        if scratch is not None and budget is not None and n * dim * 4 > budget:
            spill = scratch / "kmeans-spill"
            shutil.rmtree(spill, ignore_errors=True)  # what a killed clustering left
        # Each row's leaf (4 bytes a row: a file beside the centroids where there is scratch).
        leaf_of = (np.empty(n, np.int32) if scratch is None
                   else np.lib.format.open_memmap(scratch / "leaf_of.npy", "w+", np.int32, (n,)))
        with steps.step("clustering", n) as update:
            centroids = hierarchical_balanced_kmeans(
                rows, n, target, max(1, int(target * config.max_list_factor)), config.kmeans_branching,
                config.kmeans_iters, rng, progress=update, top_cluster_cap=cap,
                out=None if scratch is None else scratch / "centroids.f32", spill=spill, leaf_of=leaf_of)
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
        timings["cluster_s"] = time.perf_counter() - t
        if isinstance(leaf_of, np.memmap):
            leaf_of.flush()
        if w is not None and scratch is not None:
            w.step_done("clustering", {"centroids": len(centroids)},
                        [scratch / "centroids.f32", scratch / "leaf_of.npy"], rng, timings)

    # 2. Navigation graph. It is always an l2 graph: cosine is l2 over unit vectors, and for ip
    # the centroids gain one coordinate that turns inner-product order into l2 order (HNSW
    # graphs built on inner products leave nodes unreachable). Replicas are chosen by l2.
    if "graph" in done:
        assign_graph = Graph.load(str(scratch / "assign_graph.bin"))
        graph = Graph.load(str(scratch / "graph.bin")) if metric == "ip" else assign_graph
    else:
        t = time.perf_counter()
        with steps.step("graph", len(centroids) * (2 if metric == "ip" else 1), "centroid") as update:
            assign_graph = Graph(dim, "l2", config.graph_m, config.graph_ef_construction, config.seed)
            assign_graph.add(centroids, threads)
            update(len(centroids))
            graph = assign_graph
            if metric == "ip":
                graph = Graph(dim + 1, "l2", config.graph_m, config.graph_ef_construction, config.seed)
                graph.add(mips_augment(centroids), threads)
                update(len(centroids))
        timings["graph_s"] = time.perf_counter() - t
        if w is not None and scratch is not None:
            saved = [scratch / "assign_graph.bin"] + ([scratch / "graph.bin"] if metric == "ip" else [])
            assign_graph.save(str(saved[0]))
            if metric == "ip":
                graph.save(str(saved[1]))
            w.step_done("graph", {}, saved, rng, timings)

    # 3. PQ codebooks from a sample.
    if "pq training" in done:
        pq = ProductQuantizer(np.load(scratch / "pq_codebooks.npy", allow_pickle=False), dim)
    else:
        t = time.perf_counter()
        sample = np.sort(rng.choice(n, min(n, config.pq_train_size), replace=False))
        pq_m = config.pq_subspaces(dim)
        with steps.step("pq training", pq_m, "sub-space") as update:
            pq = ProductQuantizer.train(rows(sample), pq_m, config.kmeans_iters, rng, progress=update,
                                        ksub=1 << (config.pq_bits or 8))
        timings["pq_train_s"] = time.perf_counter() - t
        if w is not None and scratch is not None:
            np.save(scratch / "pq_codebooks.npy", pq.codebooks, allow_pickle=False)
            w.step_done("pq training", {}, [scratch / "pq_codebooks.npy"], rng, timings)
    return centroids, graph, assign_graph, pq, leaf_of


def assign_rows(assign_graph, pq: ProductQuantizer, ids: np.ndarray, x: np.ndarray, config: BuildConfig,
                threads: int, centroids: np.ndarray | None = None, leaves: np.ndarray | None = None):
    """Step 4 for rows x (ids): (nearest list, the (list, id) pairs of boundary replication, PQ codes).
    centroids: given where queries find their lists by exact distances (tiers.build_navigation), rows
    find theirs so too; otherwise by the graph, as queries will. (Before the graph linked the nodes its heuristic
    left out of reach, 2-8% of Fashion-MNIST's 5,954 centroids, built on two threads, were reached by no search,
    and rows put there by exact distance would have been lost to queries.)
    leaves: each row's leaf of the clustering (train_index), where the row's graph search starts: from the graph's
    entry point, a search at the build's beam (32) ended in another cluster of the data for 9-11% of the rows of
    bench/peers/scale_lists's clustered sets (1M-20M), which then joined the same few far lists: lists of up to
    111k postings that queries, searching at their calibrated beam, did not probe (a ceiling of recall@10 near
    0.93 at 20M). From its own leaf a row's search stays in its cluster and finds the lists around it."""
    reps = min(config.max_replicas, assign_graph.size)
    if centroids is not None:
        near, sqd = nearest_rows(x, centroids, reps)
    else:
        entries = None if leaves is None else np.ascontiguousarray(leaves, np.int32)
        near, sqd = assign_graph.search(x, reps, max(32, 2 * reps), threads, entries=entries)
    dist = np.sqrt(np.maximum(sqd, 0))
    keep = (dist <= (1 + config.replica_eps) * dist[:, :1]) & (near >= 0)
    keep[:, 0] = True
    return (near[:, 0].astype(np.int64), near[keep].astype(np.int64),
            np.broadcast_to(ids[:, None], near.shape)[keep].astype(np.uint32), pq.encode(x))


def nearest_rows(x: np.ndarray, centroids: np.ndarray, k: int, rows: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest centroids of each row of x by exact squared l2, nearest first, rows at a time (a block
    of rows x centroids distances, 128 MiB at 32k centroids)."""
    c_sq = np.einsum("ij,ij->i", centroids, centroids)
    near = np.empty((len(x), k), np.int32)
    sqd = np.empty((len(x), k), np.float32)
    for s in range(0, len(x), rows):
        near[s:s + rows], sqd[s:s + rows] = nearest_exhaustive(x[s:s + rows], centroids, k, c_sq)
    return near, sqd


def postings(lists: np.ndarray, ids: np.ndarray, n_lists: int) -> tuple[np.ndarray, np.ndarray]:
    """(list_offsets, list_ids) in CSR form from (list, id) pairs; ids stay in their order within a list."""
    order = np.argsort(lists, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(lists, minlength=n_lists))]).astype(np.int64)
    return offsets, ids[order]


class PairSpill:
    """Step 4's (list, id) pairs of boundary replication, appended a chunk at a time to two files beside the index
    being written (list numbers int32, ids uint32) and counted per list; grouped() then writes the CSR list ids
    (postings()'s, the same order: a list's ids in the order they came) a chunk at a time, so neither the pairs nor
    a sort of them is ever whole in memory."""

    def __init__(self, where: Path, n_lists: int):
        self.lists_path, self.ids_path = where / "pair_lists.bin", where / "pair_ids.bin"
        self.lists_file, self.ids_file = open(self.lists_path, "wb"), open(self.ids_path, "wb")
        self.counts = np.zeros(n_lists, np.int64)
        self.total = 0

    def add(self, lists: np.ndarray, ids: np.ndarray) -> None:
        np.ascontiguousarray(lists, np.int32).tofile(self.lists_file)
        np.ascontiguousarray(ids, np.uint32).tofile(self.ids_file)
        self.counts += np.bincount(lists, minlength=len(self.counts))
        self.total += len(lists)

    def grouped(self, out: Path, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(list_offsets, list_ids): list_ids a memory map of the .npy file out, written chunk pairs at a time."""
        self.lists_file.close()
        self.ids_file.close()
        offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        list_ids = np.lib.format.open_memmap(out, "w+", np.uint32, (self.total,))
        cursor = offsets[:-1].copy()
        if self.total:
            lists = np.memmap(self.lists_path, np.int32, "r")
            ids = np.memmap(self.ids_path, np.uint32, "r")
            for s in range(0, self.total, chunk):
                lab = np.asarray(lists[s:s + chunk])
                order = np.argsort(lab, kind="stable")
                lab = lab[order]
                rank = np.arange(len(lab)) - np.searchsorted(lab, lab)  # each pair's place among its list's here
                list_ids[cursor[lab] + rank] = ids[s:s + chunk][order]
                cursor += np.bincount(lab, minlength=len(cursor))
            del lists, ids
        self.lists_path.unlink()
        self.ids_path.unlink()
        list_ids.flush()
        return offsets, list_ids


def write_pages(w, stored, n: int, dim: int, store_dtype: np.dtype, primary: np.ndarray, centroids: np.ndarray,
                pq: ProductQuantizer, codes: np.ndarray, steps: Progress, budget: int | None = None,
                scratch: Path | None = None):
    """Steps 5-6's page file, into the index being written (w): rows 0..n-1 (stored(ids), in store_dtype,
    asked for in ascending order), each in the bucket of its list `primary`. Returns (layout, slots, block CRCs).
    Where the rows are more than budget bytes and scratch is given, they are read once in file order and spilled
    to scratch in ranges of slots (_spilled_pages), not read in slot order: a source larger than the memory a
    process has is then read sequentially, once, instead of a page of it for every few rows."""
    record_bytes = dim * store_dtype.itemsize
    # Within a bucket, near vectors share pages; PQ reconstructions are near enough to order them.
    chunk_floats = 1 << 24 if budget is None else int(min(1 << 24, max(1 << 18, budget // 16)))
    with steps.step("ordering pages", n) as update:
        order = chain_order(primary, len(centroids), centroids, lambda ids: pq.decode(codes[ids]),
                            chunk_floats=chunk_floats, progress=update)
    layout, slots = plan_layout(primary, len(centroids), record_bytes, order)
    del order
    writer = PageWriter(str(w.path("vectors.pages")), record_bytes, layout.records_per_block,
                        layout.pages_per_block)
    if budget is not None and scratch is not None and n * record_bytes > budget:
        _spilled_pages(writer, stored, n, dim, store_dtype, slots, budget, scratch, steps)
        return layout, slots, writer.close()
    by_slot = np.argsort(slots, kind="stable")
    with steps.step("writing pages", n) as update:
        for s in range(0, n, CHUNK_ROWS):
            ids = by_slot[s:s + CHUNK_ROWS]
            read_order = np.argsort(ids)  # read the source in file order, write in slot order
            recs = np.empty((len(ids), dim), dtype=store_dtype)
            recs[read_order] = stored(ids[read_order])
            writer.write(slots[ids], recs.view(np.uint8).reshape(len(ids), record_bytes))
            update(len(ids))
    return layout, slots, writer.close()


def _spilled_pages(writer, stored, n: int, dim: int, store_dtype: np.dtype, slots: np.ndarray, budget: int,
                   scratch: Path, steps: Progress) -> None:
    """The page file written through scratch: the rows read in file order, a chunk at a time, each appended
    (with its slot) to the file of its range of slots, ranges of at most half the budget; then each range read
    back, sorted by slot and written. The source is read once, in order; memory holds one range."""
    record_bytes = dim * store_dtype.itemsize
    per_range = max(1, (budget // 2) // (record_bytes + 4))
    n_ranges = int(slots.max()) // per_range + 1 if n else 0
    paths = [(scratch / f"pages-{r}.rec", scratch / f"pages-{r}.slot") for r in range(n_ranges)]
    files = [(open(a, "wb"), open(b, "wb")) for a, b in paths]
    chunk = rows_per_chunk(budget, dim)
    try:
        with steps.step("spilling pages", n) as update:
            for s in range(0, n, chunk):
                ids = np.arange(s, min(n, s + chunk))
                recs = np.ascontiguousarray(stored(ids), dtype=store_dtype)
                sl = slots[ids]
                r = sl // per_range
                order = np.argsort(r, kind="stable")
                r_sorted = r[order]
                bounds = np.searchsorted(r_sorted, np.arange(n_ranges + 1))
                for j in np.flatnonzero(np.diff(bounds)):
                    part = order[bounds[j]:bounds[j + 1]]
                    recs[part].tofile(files[j][0])
                    np.ascontiguousarray(sl[part], np.uint32).tofile(files[j][1])
                update(len(ids))
    finally:
        for a, b in files:
            a.close()
            b.close()
    with steps.step("writing pages", n) as update:
        for rec_path, slot_path in paths:
            sl = np.fromfile(slot_path, np.uint32)
            recs = np.fromfile(rec_path, np.uint8).reshape(len(sl), record_bytes)
            order = np.argsort(sl, kind="stable")
            writer.write(sl[order], recs[order])
            rec_path.unlink()
            slot_path.unlink()
            update(len(sl))


def index_manifest(count: int, dim: int, metric: str, storage_dtype: str, src, centroids: int, postings: int,
                   pq: ProductQuantizer, config: BuildConfig, timings: dict, *, navigation: str, pages=None,
                   **extra) -> dict:
    """The manifest fields every index directory holds (a single index, a shard part, a sharded router);
    navigation: how its rows found their lists, and so how queries must ('exact' or 'graph',
    tiers.build_navigation); pages: the SSD layout where the directory has one; extra: fields of its own
    kind, added at the end."""
    manifest = {
        "fusionrag_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "count": int(count),
        "dim": int(dim),
        "metric": metric,
        "internal_metric": internal_metric(metric),
        "navigation": "mips-augmented" if metric == "ip" else "l2",
        "list_navigation": navigation,
        "storage_dtype": storage_dtype,
        "source": {"path": str(src.path), "dtype": str(src.dtype)},
        "centroids": int(centroids),
        "postings": int(postings),
        "pq": {"m": pq.m, "dsub": pq.dsub, "bits": 4 if pq.ksub == 16 else 8},
    }
    if pages is not None:
        manifest["pages"] = pages.to_dict()
    manifest.update(extra)
    manifest["build_config"] = config.to_dict()
    manifest["build_timings"] = timings
    return manifest


def train_single_probe(graph, rows, n: int, list_offsets: np.ndarray, list_ids: np.ndarray, config: BuildConfig,
                       threads: int, navigation: str, sample_queries: np.ndarray | None = None):
    """(model, manifest entry) of learned pruning for a single index: up to config.probe_queries of the sample
    queries (a query log, in the engine's form), else of the data's rows, probed as SearchParams() probes."""
    from fusionrag.retriever.engine.config import SearchParams
    from fusionrag.retriever.engine.tiers import NavigationTier

    nav = NavigationTier(graph, config.metric == "ip", threads, navigation)
    rng = np.random.default_rng(config.seed + 2)
    if sample_queries is None:
        picked = np.sort(rng.choice(n, min(n, config.probe_queries), replace=False))
        queries = rows(picked)
    else:
        picked, queries = None, sample_queries[rng.permutation(len(sample_queries))[:config.probe_queries]]
    return train_probe_model(nav, rows, n, queries, picked, partial(csr_lists_of, list_offsets, list_ids),
                             internal_metric(config.metric), SearchParams(), config.probe_quantile, seed=config.seed)


def open_source(source):
    """The vectors a build reads (a file path or a 2-D array, vectors.as_source), refused when there are more
    than the 2^32 vector ids an index holds. Shared by build_index and sharded.build_sharded."""
    src = as_source(source)
    if src.count >= 2**32:
        raise InputError(f"{src.path}: {src.count} vectors exceed the 2^32 vector ids an index holds")
    return src


def build_key(src: VectorFile, config: BuildConfig, sample_queries: np.ndarray | None) -> dict:
    """What a killed build must match for a rerun to resume it (manifest.ResumableWriter): fusionrag's version, the
    source (a file by its resolved path, size, modification time and shape; an array by a hash of its contents),
    the sample queries' hash, and every setting but the memory budget and the threads, which change how a step
    runs, not its result (a build killed for memory may be resumed with a smaller budget)."""
    import hashlib

    def digest(arr) -> str:
        h = hashlib.sha256(str((arr.shape, str(arr.dtype))).encode())
        for s in range(0, len(arr), 1 << 16):
            h.update(np.ascontiguousarray(arr[s:s + (1 << 16)]).tobytes())
        return h.hexdigest()

    if src.path == "<array>":
        source = {"array_sha256": digest(src.data)}
    else:
        st = Path(src.path).stat()
        source = {"path": str(Path(src.path).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                  "count": src.count, "dim": src.dim, "dtype": str(src.dtype)}
    settings = {k: v for k, v in config.to_dict().items() if k not in ("memory_budget_bytes", "threads")}
    return {"fusionrag_version": __version__, "source": source, "config": settings,
            "sample_queries": None if sample_queries is None else digest(sample_queries)}


def build_index(source, out_dir, config: BuildConfig = BuildConfig(), progress: bool | None = None,
                overwrite: bool = False, on_progress: OnProgress | None = None, sample_queries=None,
                resume: bool = True) -> dict:
    """Build an index of `source` (a vector file path or a 2-D array) into the directory out_dir.

    progress: a bar per step on stderr (None: when stderr is a terminal); on_progress(step, done, total)
    is told the same as the steps advance. sample_queries: queries like those the index will serve (a query
    log) that config.probe_model's model is trained on and calibration measures, instead of rows of the data.
    resume: a build of out_dir killed before it finished (its `.NAME.partial` directory beside out_dir) with the
    same source and settings goes on from its last finished step, and its steps are the manifest's
    build_resumed; False: start over (what such a build left is removed). A build that fails on its input or
    settings leaves nothing; one interrupted otherwise (a full disk, Ctrl-C) leaves what it finished to resume."""
    t_start = time.perf_counter()
    src = open_source(source)
    n, dim = src.count, src.dim
    metric = config.metric
    if sample_queries is not None:
        if not config.probe_model and not config.calibrate:
            raise ConfigError("sample_queries train the probe model and are what calibration measures: build with "
                              "probe_model (--probe-model) or calibrate")
        sample_queries = sample_query_matrix(sample_queries, dim, metric)
    threads = cpu_threads(config.threads)
    rng = np.random.default_rng(config.seed)
    rows = Rows(src, metric)
    integral = IntegralCheck(src.dtype, metric)
    steps = Progress(progress, on_progress)
    budget = config.memory_budget()

    # Written from the start into the index's partial directory (manifest.ResumableWriter; a temporary one,
    # manifest.writing_index, where it is not to resume): what grows with the count (the codes, each row's list,
    # the postings) goes to files there as it is made, and the build's scratch (the centroids, the pairs, the
    # spilled pages, each finished step's results) to scratch/, which is gone before it is published. Each step
    # is recorded as it finishes; a resumed build reads back what its recorded steps left instead of running them.
    if resume:
        writer = resumable_index(Path(out_dir), overwrite, build_key(src, config, sample_queries), True,
                                 discard=(InputError, ConfigError))
    else:
        writer = writing_index(Path(out_dir), overwrite)
    with writer as w:
        done = dict(w.steps)  # the steps a killed build of the same key finished (none where it starts afresh)
        timings = w.timings
        t_start -= w.elapsed_before
        w.restore_rng(rng)
        scratch = w.path("scratch")
        scratch.mkdir(exist_ok=True)
        if "pages" not in done:
            # 1-3. Centroids, navigation graph, PQ codebooks.
            centroids, graph, assign_graph, pq, leaf_of = train_index(rows, n, dim, config, rng, threads, steps,
                                                                      timings, budget, scratch, w)
        n_centroids = done["clustering"]["centroids"] if "pages" in done else len(centroids)
        navigation = build_navigation(config.navigation, n_centroids, dim + (metric == "ip"))

        # 4. One pass over all vectors: nearest centroids, replicas, PQ codes (and NaN checks).
        if "assigning" in done:
            codes = np.load(w.path("pq_codes.npy"), mmap_mode="r", allow_pickle=False)
            if "pages" not in done:
                primary = np.load(scratch / "primary.npy", mmap_mode="r", allow_pickle=False)
            list_offsets = np.load((w.path("list_offsets.npy") if "pages" in done else scratch / "list_offsets.npy"),
                                   allow_pickle=False)
            list_ids = np.load(w.path("list_ids.npy"), mmap_mode="r", allow_pickle=False)
            store_dtype = np.dtype(done["assigning"]["store_dtype"])
        else:
            t = time.perf_counter()
            exact = centroids if navigation == "exact" else None  # and queries will go as rows went (NavigationTier)
            codes = np.lib.format.open_memmap(w.path("pq_codes.npy"), "w+", np.uint8, (n, pq.code_bytes))
            primary = np.lib.format.open_memmap(scratch / "primary.npy", "w+", np.int32, (n,))
            pairs = PairSpill(scratch, len(centroids))
            chunk = rows_per_chunk(budget, dim)
            with steps.step("assigning", n) as update:
                for s in range(0, n, chunk):
                    ids = np.arange(s, min(n, s + chunk))
                    x = rows(ids)
                    integral.update(x)
                    primary[ids], lists, members, codes[ids] = assign_rows(
                        assign_graph, pq, ids, x, config, threads, exact, None if leaf_of is None else leaf_of[ids])
                    pairs.add(lists, members)
                    update(len(ids))
            del exact, leaf_of
            list_offsets, list_ids = pairs.grouped(w.path("list_ids.npy"), max(CHUNK_ROWS, budget // 32))
            store_dtype = integral.dtype() or rows.dtype
            timings["assign_s"] = time.perf_counter() - t
            codes.flush()
            primary.flush()
            np.save(scratch / "list_offsets.npy", list_offsets, allow_pickle=False)
            w.step_done("assigning", {"store_dtype": store_dtype.name},
                        [w.path("pq_codes.npy"), scratch / "primary.npy", scratch / "list_offsets.npy",
                         w.path("list_ids.npy")], rng, timings)
        if "pages" not in done:
            del assign_graph
        rows.dtype = store_dtype

        # Learned pruning's model, on rows of the data as queries (each not its own neighbour).
        probe_entry = (done.get("probe model") or {}).get("entry")
        if config.probe_model and "probe model" not in done:
            t = time.perf_counter()
            with steps.step("probe model", 1, "model") as update:
                probe_model = train_single_probe(graph, rows, n, list_offsets, list_ids, config, threads,
                                                 navigation, sample_queries)
                update(1)
            timings["probe_model_s"] = time.perf_counter() - t
            probe_entry = None if probe_model is None else save_probe_model(w, *probe_model)
            w.step_done("probe model", {"entry": probe_entry}, (), rng, timings)

        # 5-6. SSD layout and page file, then everything else.
        if "pages" in done:
            layout = PageLayout(**done["pages"]["layout"])
        else:
            # The navigation graph (about 15% of the raw vectors at 128-d with lists of ~10) is in its file since
            # the graph step: the pages are written without it in memory, and the index's graph.bin is that file.
            graph_file = scratch / ("graph.bin" if metric == "ip" else "assign_graph.bin")
            del graph
            t = time.perf_counter()
            layout, slots, block_crc = write_pages(w, rows.stored, n, dim, store_dtype, primary, centroids, pq,
                                                   codes, steps, budget, scratch)
            del primary, centroids
            save_index_files(w, block_crc, graph_file, list_offsets, list_ids, pq.codebooks, codes, slots)
            del slots  # what calibration opens is the index as written, not these
            timings["write_s"] = time.perf_counter() - t
            w.step_done("pages", {"layout": layout.to_dict()}, (), rng, timings)
        del codes, list_ids
        shutil.rmtree(scratch)
        extra = {"build_memory_budget_bytes": int(budget)}
        if done:
            extra["build_resumed"] = list(done)
        if probe_entry is not None:
            extra["probe_model"] = probe_entry
        timings["total_s"] = time.perf_counter() - t_start
        pq_shape = ProductQuantizer(np.load(w.path("pq_codebooks.npy"), allow_pickle=False), dim)
        manifest = index_manifest(n, dim, metric, STORAGE_DTYPES[store_dtype], src, n_centroids,
                                  int(list_offsets[-1]), pq_shape, config, timings, navigation=navigation,
                                  pages=layout, **extra)
        # pq_bits 0: 4-bit codes of the same rows, measured against the 8-bit ones by calibration (pq_choice).
        trial = None
        if not config.pq_bits:
            why = pq_choice.why_eight(config, n, pq_shape.m, sample_queries, MIN_ROWS)
            manifest["pq_choice"] = {"bits": 8, "why": why}
            if why is None:
                t = time.perf_counter()
                with steps.step("4-bit codes", 1, "trial") as update:
                    trial = pq_choice.train_trial(w.dir, rows, n, pq_shape.m, config, rows_per_chunk(budget, dim))
                    update(1)
                timings["pq4_trial_s"] = time.perf_counter() - t
        if config.calibrate:  # the default search settings, measured on the index as written
            calibrate_build(manifest, w, steps, timings, t_start, lambda d: calibrate(
                d, rows, n, internal_metric(metric), config.calibrate_queries, config.target_recall, config.seed,
                threads, sample_queries, trial=trial))
        if trial is not None:
            manifest["pq_choice"] = manifest["calibration"].pop("pq_bits")
            pq_choice.adopt(w, manifest)
        w.publish(manifest)
    return manifest
