"""Sharded mode (docs/sharded.md, docs/design.md): one collection over S shards, on Ray or in one process.

An index directory in sharded mode holds a router part and S shard parts:

- the router (the directory's own files): the navigation graph over every posting-list centroid,
  the shared PQ codebooks, and the list -> shard(s) map (`list_shards.npy`, `list_local.npy`:
  up to two shards per list, and the list's number inside each);
- `shard-000/` ...: each an ordinary fusionrag index directory (`Index.open` opens it) holding its
  lists' IDs, PQ codes and SSD pages, with `global_ids.npy` (a shard vector's row in the source)
  and `lists.npy` (a shard list's number in the router). A vector that boundary replication put in
  lists of two shards is stored by both; its PQ code is the same in both (one codebook).

Build: k-means, the graph and PQ are trained once at the driver (build.train_index, as a single
index is); assigning and encoding (chunks of the source) and writing (one task per shard) run as Ray
tasks in parallel when Ray is initialised, in this process otherwise; both give the same index.

Placement after SmartANNS: a list's expected work is its size x how often sample queries (drawn from
the data at build time, or a query log) probe it; lists go, heaviest first, to the shard with the
least expected work so far (no shard holding more than 1.25x its share of postings), and the hottest
lists get a replica on a second shard, each replica expecting half the work. `round-robin` (list i
on shard i mod S, no replicas) is the baseline it is measured against. `locality` puts regions of centroid
space (recursive bisection, work balanced) on shards, so a query's lists sit on fewer of them.

Query path: the router finds each query's lists (as Index does), sends each shard only the lists
it owns, the queries of a batch grouped per shard (one call per shard per batch); a replicated list
goes to the replica with the least outstanding work. Each shard filters and re-ranks exactly as
Index does (Index.search_lists) and returns its top-k with exact distances; the router merges.

Writes (sharded_writes.py): each shard owns a log and a fresh tier; an upsert goes to the live shards holding
the vector's nearest list, a delete to every shard holding the id; a shard's answers merge its index's top-k
with its fresh tier's exact top-k. Faults: a shard that does not answer is marked down and its lists go to
their other replica; lists no live shard holds are reported per query (missing_lists), and restart_shard
re-creates a shard from its directory, its log replayed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever import dirlock
from fusionrag.retriever.build import (_CHUNK, _IntegralCheck, _Rows, assign_rows, index_manifest, internal_metric,
                                       mips_augment, open_source, postings, sample_query_matrix, save_index_files,
                                       train_index, write_pages)
from fusionrag.retriever.calibrate import (calibrate_build, calibrate_open_sharded, calibrate_sharded, config_of,
                                          merge_remeasures, page_rows, search_defaults, write_calibration)
from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.retriever.config import BuildConfig, EngineConfig, SearchParams, cpu_threads, resolve_params
from fusionrag.retriever.docstore import query_words
from fusionrag.retriever.errors import ConfigError, ConflictError, IndexFormatError, InputError, UnavailableError
from fusionrag.retriever.fresh import FreshView
from fusionrag.retriever.index import prepare_queries
from fusionrag.retriever.kmeans import sq_dists
from fusionrag.retriever.learned_probe import (exact_topk, lists_of_pairs, load_probe_model, save_probe_model,
                                               train_probe_model)
from fusionrag.retriever.manifest import MANIFEST, ManifestShape, load_array, read_manifest, writing_index
from fusionrag.retriever.pq import ProductQuantizer
from fusionrag.retriever.progress import OnProgress, Progress
from fusionrag.retriever.queries import PreparedQueries
from fusionrag.retriever.sharded_merge import (LIST_WRITES, NO_SPLIT_FACTOR, current_part, gen_dir_name,
                                               load_global_ids, manifest_sha, publish)
from fusionrag.retriever.sharded_writes import DELETE, UPSERT, UPSERT_DOCS, ShardWrites
from fusionrag.retriever.tiers import NavigationTier, build_navigation, recorded_navigation
from fusionrag.retriever.vectors import STORAGE_DTYPES, as_source

log = logging.getLogger(__name__)

KIND = "sharded"
PLACEMENTS = ("hotness", "round-robin", "locality")
ROUTER_FILES = {"graph.bin": True, "pq_codebooks.npy": True, "list_shards.npy": True, "list_local.npy": True,
                "list_sizes.npy": True, "list_visits.npy": True}
# Ids from here up are those of documents named by a string that is not an id (sharded_docs.py); below, a name
# that is an id's decimal digits names that id.
NAMED_IDS = 1 << 62
# A shard answers a filter that at most this many of its documents pass exactly, over their vectors (as a
# collection does).
FILTER_EXACT_MAX = CollectionConfig().filter_exact_max
# An upsert goes to the nearest of this many nearest lists that has a live shard.
UPSERT_PROBE = 8
# A shard holds at most this multiple of its share of the postings, however its expected work falls.
STORAGE_SLACK = 1.25
# Locality placement moves boundary lists between regions until no shard expects more than this x the mean.
LOCALITY_TOLERANCE = 1.05
# A shard part's lock file: the one process that has it open (ShardServer) holds it (retriever/dirlock.py). A shard
# restarted as a Ray actor waits this long for the process it replaces, which ray.kill() stops but does not wait for.
SHARD_LOCK = "LOCK"
SHARD_LOCK_WAIT_S = 30.0


def part_name(s: int) -> str:
    return f"shard-{s:03d}"


def is_sharded(path) -> bool:
    """Whether the index directory at path is a sharded one (its manifest says so)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("sharded mode on Ray needs the ray extra (pip install 'fusionrag[ray]')") from e
    return ray


def _ray_active() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


# ---------------------------------------------------------------------------------------------
# Placement


@dataclass
class Placement:
    shards: np.ndarray  # int32 (lists, 2): the list's shards, -1 where it has no second one
    work: np.ndarray  # float64 (lists,): expected work of each list (size x visits)
    kind: str

    def shard_work(self, n_shards: int) -> np.ndarray:
        """Expected work per shard, a replicated list's split evenly between its two shards."""
        out = np.zeros(n_shards)
        two = self.shards[:, 1] >= 0
        np.add.at(out, self.shards[:, 0], np.where(two, self.work / 2, self.work))
        np.add.at(out, self.shards[two, 1], self.work[two] / 2)
        return out

    def imbalance(self, n_shards: int) -> float:
        w = self.shard_work(n_shards)
        return float(w.max() / w.mean()) if w.mean() > 0 else 1.0


def _regions(points: np.ndarray, work: np.ndarray, n_parts: int, seed: int = 0, iters: int = 8) -> np.ndarray:
    """Recursive bisection of `points` (list centroids) into n_parts regions of balanced `work`: each split
    runs a few rounds of weighted 2-means, orders the points by (distance to one centre - distance to the
    other) and cuts where the work reaches the part's share (n_parts // 2 of n_parts), so each region is
    a compact piece of centroid space and its work is its share to within one list's."""
    part = np.zeros(len(points), dtype=np.int32)
    rng = np.random.default_rng(seed)

    def split(idx: np.ndarray, first: int, parts: int) -> None:
        if parts == 1 or len(idx) == 0:
            part[idx] = first
            return
        x, w = points[idx].astype(np.float64), work[idx]
        left = parts // 2
        if len(idx) <= parts:
            for j, i in enumerate(idx):
                part[i] = first + min(j, parts - 1)
            return
        a, b = x[rng.choice(len(idx), 2, replace=False)]
        for _ in range(iters):
            key = ((x - a) ** 2).sum(1) - ((x - b) ** 2).sum(1)
            near_a = key <= np.median(key)
            if near_a.all() or not near_a.any():
                break
            a = np.average(x[near_a], axis=0, weights=w[near_a] + 1e-12)
            b = np.average(x[~near_a], axis=0, weights=w[~near_a] + 1e-12)
        key = ((x - a) ** 2).sum(1) - ((x - b) ** 2).sum(1)
        order = np.argsort(key, kind="stable")
        cum = np.cumsum(w[order])
        cut = int(np.searchsorted(cum, cum[-1] * left / parts))
        cut = min(max(cut, left), len(idx) - (parts - left))  # every region keeps a list
        split(idx[order[:cut]], first, left)
        split(idx[order[cut:]], first + left, parts - left)

    split(np.arange(len(points)), 0, n_parts)
    return part


def _rebalance(plan: Placement, x: np.ndarray, n_shards: int, tolerance: float = LOCALITY_TOLERANCE) -> None:
    """Replicas (and lists heavier than a region's slack) can leave a region over its share: while the
    heaviest shard is over `tolerance` x the mean, move one of its unreplicated lists to a shard under the
    mean, the list nearest that shard's region (its centroid's distance to the region's centre, less its
    distance to its own), so regions give up their boundary lists first. In place."""
    own = plan.shards[:, 0]
    centre = np.stack([x[own == s].mean(axis=0) if (own == s).any() else x.mean(axis=0) for s in range(n_shards)])
    d = sq_dists(x.astype(np.float32), centre.astype(np.float32)).astype(np.float64)
    single = plan.shards[:, 1] < 0
    for _ in range(len(own)):
        load = plan.shard_work(n_shards)
        mean = load.mean()
        s = int(np.argmax(load))
        if mean <= 0 or load[s] <= tolerance * mean:
            return
        mine = np.flatnonzero(single & (own == s))
        under = np.flatnonzero(load < mean)
        if not len(mine) or not len(under):
            return
        # Moving list c from s to t helps while its work is under the gap between them.
        cost = d[mine][:, under] - d[mine, s][:, None]
        cost[plan.work[mine][:, None] >= (load[s] - load[under])[None, :]] = np.inf
        i, j = np.unravel_index(np.argmin(cost), cost.shape)
        if not np.isfinite(cost[i, j]):
            return
        own[mine[i]] = under[j]


def place_lists(sizes: np.ndarray, visits: np.ndarray, n_shards: int, kind: str = "hotness",
                replicate: float = 0.02, centroids: np.ndarray | None = None) -> Placement:
    """Each list's shard(s). hotness: lists by expected work (size x (visits + 1)), heaviest first, each to the
    shard with the least work so far among those under STORAGE_SLACK x their share of postings; the hottest
    `replicate` fraction of lists get a second shard (the next least loaded), each copy expecting half.
    round-robin: list i on shard i mod n_shards, no replicas.
    locality: shard s holds region s of centroid space (`centroids`, one row per list; _regions: recursive
    bisection balancing the expected work), so lists probed together sit together; the hottest `replicate`
    fraction get a second shard, the nearest other region's (by the distance from the list's centroid to the
    work-weighted centre of each region), each copy expecting half. No storage cap: it balances work."""
    sizes = np.asarray(sizes, dtype=np.int64)
    n_lists = len(sizes)
    if kind not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {PLACEMENTS}, got {kind!r}")
    if kind == "locality" and (centroids is None or len(centroids) != n_lists):
        raise ConfigError("placement 'locality' needs the lists' centroids (one row per list)")
    if not 1 <= n_shards <= n_lists:
        raise ConfigError(f"shards must be in [1, {n_lists}] (the posting lists), got {n_shards}")
    if not 0 <= replicate <= 1:
        raise ConfigError(f"replicate must be in [0, 1], got {replicate}")
    work = sizes * (np.asarray(visits, dtype=np.float64) + 1.0)
    shards = np.full((n_lists, 2), -1, dtype=np.int32)
    if kind == "round-robin":
        shards[:, 0] = np.arange(n_lists) % n_shards
        return Placement(shards, work, kind)
    n_rep = int(round(replicate * n_lists)) if n_shards > 1 else 0
    if kind == "locality":
        x = np.asarray(centroids, dtype=np.float64)
        shards[:, 0] = _regions(x, work, n_shards)
        if n_rep:
            centre = np.stack([np.average(x[shards[:, 0] == s], axis=0, weights=work[shards[:, 0] == s] + 1e-12)
                               for s in range(n_shards)])
            hot = np.argsort(-work, kind="stable")[:n_rep]
            d = sq_dists(x[hot].astype(np.float32), centre.astype(np.float32)).astype(np.float64)
            d[np.arange(n_rep), shards[hot, 0]] = np.inf
            shards[hot, 1] = np.argmin(d, axis=1)
        _rebalance(Placement(shards, work, kind), x, n_shards)
        return Placement(shards, work, kind)
    load = np.zeros(n_shards)
    stored = np.zeros(n_shards)
    cap = STORAGE_SLACK * sizes.sum() / n_shards + sizes.max(initial=0)
    # Every shard first gets one list, so none is left empty.
    order = np.argsort(-work, kind="stable")
    for rank, c in enumerate(order):
        c = int(c)
        copies = 2 if rank < n_rep else 1
        if rank < n_shards:
            pick = [rank] if copies == 1 else [rank, (rank + 1) % n_shards]
        else:
            room = stored + sizes[c] <= cap
            key = np.where(room, load, np.inf + load)
            if not room.any():
                key = stored.astype(np.float64)
            pick = list(np.argsort(key, kind="stable")[:copies])
        for j, s in enumerate(pick):
            shards[c, j] = s
            load[s] += work[c] / copies
            stored[s] += sizes[c]
    return Placement(shards, work, kind)


def sample_visits(nav: NavigationTier, queries: np.ndarray, n_lists: int, params: SearchParams) -> np.ndarray:
    """How many of the queries probe each list (the router's own probing)."""
    visits = np.zeros(n_lists, dtype=np.int64)
    for s in range(0, len(queries), 1024):
        lists, _, _ = nav.probe(queries[s:s + 1024], params)
        lists = lists[lists >= 0]
        visits += np.bincount(lists, minlength=n_lists)
    return visits


# ---------------------------------------------------------------------------------------------
# Build


def _assign_range(source, metric: str, graph_path: str, codebooks: np.ndarray, dim: int, config: BuildConfig,
                  lo: int, hi: int, threads: int):
    """Step 4 of the build for rows lo..hi-1 (a Ray task, or called in this process)."""
    rows = _Rows(as_source(source), metric)
    graph = native.Graph.load(graph_path)
    # As the router's queries find lists (build.assign_rows); config.navigation is the build's resolved one.
    exact = graph.vectors() if build_navigation(config.navigation, graph.size, graph.dim) == "exact" else None
    pq = ProductQuantizer(codebooks, dim)
    integral = _IntegralCheck(rows.src.dtype, metric)
    out = []
    for s in range(lo, hi, _CHUNK):
        ids = np.arange(s, min(hi, s + _CHUNK))
        x = rows(ids)
        integral.update(x)
        out.append(assign_rows(graph, pq, ids, x, config, threads, exact))
    primary, lists, members, codes = (np.concatenate(parts) for parts in zip(*out))
    return primary, lists, members, codes, (integral.possible, integral.lo, integral.hi)


@dataclass
class _ShardPlan:
    """What one shard part holds, in its own numbering."""
    index: int
    lists: np.ndarray  # int32: the router's number of each of the shard's lists
    global_ids: np.ndarray  # uint32, ascending: the source row of each of the shard's vectors
    bucket: np.ndarray  # int64: the shard list each vector is stored with (its nearest the shard owns)
    list_offsets: np.ndarray
    list_ids: np.ndarray  # uint32: shard vector numbers


def _plan_shard(s: int, owner: np.ndarray, pair_lists: np.ndarray, pair_ids: np.ndarray,
                n_lists: int) -> _ShardPlan:
    """pair_lists/pair_ids: every (list, vector) posting, vector after vector, each vector's lists
    nearest first (as assign_rows gives them); owner: bool (lists,), the lists shard s holds."""
    lists = np.flatnonzero(owner).astype(np.int32)
    local_of = np.full(n_lists, -1, dtype=np.int64)
    local_of[lists] = np.arange(len(lists))
    mine = owner[pair_lists]
    pl, pi = pair_lists[mine], pair_ids[mine]
    global_ids, first = np.unique(pi, return_index=True)  # the first posting of a vector is its nearest list
    local_vec = np.searchsorted(global_ids, pi).astype(np.uint32)
    offsets, members = postings(local_of[pl], local_vec, len(lists))
    return _ShardPlan(s, lists, global_ids.astype(np.uint32), local_of[pl[first]], offsets, members)


def _write_shard(part_dir: str, plan: _ShardPlan, source, metric: str, store_dtype: str, centroids: np.ndarray,
                 codebooks: np.ndarray, codes: np.ndarray, config: BuildConfig, threads: int, n_shards: int,
                 ) -> dict:
    """One shard part: an ordinary index directory of the shard's lists (a Ray task, or called here)."""
    t = time.perf_counter()
    src = as_source(source)
    rows = _Rows(src, metric)
    rows.dtype = dtype = np.dtype({v: k for k, v in STORAGE_DTYPES.items()}[store_dtype])
    dim = src.dim
    pq = ProductQuantizer(codebooks, dim)
    mine = centroids[plan.lists]
    graph = native.Graph(dim + (metric == "ip"), "l2", config.graph_m, config.graph_ef_construction, config.seed)
    graph.add(mips_augment(mine) if metric == "ip" else np.ascontiguousarray(mine, dtype=np.float32), threads)
    n = len(plan.global_ids)
    with writing_index(Path(part_dir)) as w:
        layout, slots, block_crc = write_pages(w, lambda ids: rows.stored(plan.global_ids[ids].astype(np.int64)), n,
                                               dim, dtype, plan.bucket, mine, pq, codes, Progress(False))
        save_index_files(w, block_crc, graph, plan.list_offsets, plan.list_ids, codebooks, codes, slots)
        w.save_array("global_ids.npy", plan.global_ids)
        w.save_array("lists.npy", plan.lists)
        # As the router's rows went (config.navigation is the build's resolved one), if it is opened alone.
        navigation = build_navigation(config.navigation, graph.size, graph.dim)
        manifest = index_manifest(n, dim, metric, store_dtype, src, len(plan.lists), len(plan.list_ids), pq, config,
                                  {"total_s": time.perf_counter() - t}, navigation=navigation, pages=layout,
                                  shard={"index": plan.index, "of": n_shards})
        w.publish(manifest)
    return manifest


def _ray_source(source):
    """What Ray tasks read the vectors from: a file's path (every node reads it), else the array."""
    src = as_source(source)
    return src.path if isinstance(source, (str, Path)) else src.data


def build_sharded(source, out_dir, shards: int, config: BuildConfig = BuildConfig(), placement: str = "hotness",
                  replicate: float = 0.02, sample_queries=None, num_sample_queries: int = 2000,
                  params: SearchParams = SearchParams(), use_ray: bool | None = None,
                  progress: bool | None = None, overwrite: bool = False,
                  on_progress: OnProgress | None = None, probe_model: bool = True) -> dict:
    """Build a sharded index of `source` (a vector file path or a 2-D array) with `shards` shard parts.

    placement: 'hotness' (SmartANNS), 'locality' (regions of centroid space, work balanced) or 'round-robin';
    replicate: the fraction of lists, hottest first, that get a replica on a second shard (not round-robin).
    sample_queries: queries (a query log) whose probing
    measures how hot each list is; None draws num_sample_queries rows of the source. params: the search
    settings the sample queries are probed with. probe_model: train learned pruning's model (learned_probe.py)
    on up to config.probe_queries of the sample queries, fitted to config.probe_quantile (a router has one
    unless told not to; config.probe_model is a single index's). use_ray: run the assign and write steps as Ray tasks
    (None: when Ray is initialised in this process); the index directory must then be on storage every
    node sees. Returns the router's manifest."""
    t_start = time.perf_counter()
    if not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ConfigError(f"shards must be a positive integer, got {shards!r}")
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not 0 <= replicate <= 1:
        raise ConfigError(f"replicate must be in [0, 1], got {replicate}")
    if num_sample_queries < 1:
        raise ConfigError(f"num_sample_queries must be >= 1, got {num_sample_queries}")
    use_ray = _ray_active() if use_ray is None else use_ray
    ray = _ray() if use_ray else None
    if use_ray and not ray.is_initialized():
        raise ConfigError("use_ray: connect to a Ray cluster first (ray.init(address=...))")
    src = open_source(source)
    n, dim = src.count, src.dim
    metric = config.metric
    threads = cpu_threads(config.threads)
    rng = np.random.default_rng(config.seed)
    rows = _Rows(src, metric)
    timings: dict = {}
    steps = Progress(progress, on_progress)

    centroids, graph, assign_graph, pq = train_index(rows, n, dim, config, rng, threads, steps, timings)
    n_lists = len(centroids)
    navigation = build_navigation(config.navigation, graph.size, graph.dim)
    part_config = config.with_overrides(navigation=navigation)  # what assigning and the parts follow
    if shards > n_lists:
        raise ConfigError(f"shards ({shards}) exceed the {n_lists} posting lists of {n} vectors")

    with writing_index(Path(out_dir), overwrite) as w:
        # 4. Assign and encode, chunks of the source in parallel.
        t = time.perf_counter()
        integral = _IntegralCheck(src.dtype, metric)
        graph_path = str(w.path("assign-graph.tmp"))
        assign_graph.save(graph_path)
        del assign_graph
        bounds = list(range(0, n, _CHUNK)) + [n]
        if use_ray:
            per = max(1, -(-(len(bounds) - 1) // max(1, int(ray.cluster_resources().get("CPU", 1)))))
            ranges = [(bounds[i], bounds[min(i + per, len(bounds) - 1)]) for i in range(0, len(bounds) - 1, per)]
        else:
            ranges = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        results = {}
        with steps.step("assigning", n) as update:
            if use_ray:
                task = ray.remote(_assign_range).options(num_cpus=1)
                src_ref = ray.put(_ray_source(source))
                cb_ref = ray.put(pq.codebooks)
                pending = {task.remote(src_ref, metric, graph_path, cb_ref, dim, part_config, lo, hi, 1): (lo, hi)
                           for lo, hi in ranges}
                while pending:
                    done, _ = ray.wait(list(pending), num_returns=1)
                    lo, hi = pending.pop(done[0])
                    results[lo] = ray.get(done[0])
                    update(hi - lo)
            else:
                for lo, hi in ranges:
                    results[lo] = _assign_range(source, metric, graph_path, pq.codebooks, dim, part_config, lo, hi,
                                                threads)
                    update(hi - lo)
        Path(graph_path).unlink()
        primary, pair_lists, pair_ids, codes = (np.concatenate(parts) for parts in
                                                zip(*(results[lo][:4] for lo, _ in ranges)))
        for possible, lo, hi in (results[lo][4] for lo, _ in ranges):
            integral.possible &= possible
            integral.lo, integral.hi = min(integral.lo, lo), max(integral.hi, hi)
        del results
        list_offsets, _ = postings(pair_lists, pair_ids, n_lists)
        sizes = np.diff(list_offsets)
        timings["assign_s"] = time.perf_counter() - t

        # Placement from the expected work of each list.
        t = time.perf_counter()
        nav = NavigationTier(graph, metric == "ip", threads, navigation, None, sizes)
        sample = None
        if sample_queries is None:
            sample = np.sort(np.random.default_rng(config.seed + 1).choice(n, min(n, num_sample_queries),
                                                                           replace=False))
            queries = rows(sample)
        else:
            queries = sample_query_matrix(sample_queries, dim, metric)
        visits = sample_visits(nav, queries, n_lists, params)
        plan = place_lists(sizes, visits, shards, placement, replicate, centroids=centroids)
        local = np.full((n_lists, 2), -1, dtype=np.int32)
        shard_plans = []
        for s in range(shards):
            owner = (plan.shards == s).any(axis=1)
            sp = _plan_shard(s, owner, pair_lists, pair_ids, n_lists)
            if not len(sp.global_ids):
                raise InputError(f"shard {s} would hold no vectors: fewer shards, please")
            for j in (0, 1):
                on = plan.shards[:, j] == s
                local[on, j] = np.searchsorted(sp.lists, np.flatnonzero(on))
            shard_plans.append(sp)
        timings["placement_s"] = time.perf_counter() - t
        probe_info = None
        if probe_model:
            t = time.perf_counter()
            pick = np.random.default_rng(config.seed + 2).permutation(len(queries))[:config.probe_queries]
            model, probe_info = train_probe_model(
                nav, rows, n, queries[pick], None if sample is None else sample[pick],
                lists_of_pairs(pair_lists, pair_ids),
                internal_metric(metric), params, config.probe_quantile, seed=config.seed)
            save_probe_model(w, model, probe_info)
            timings["probe_model_s"] = time.perf_counter() - t
        del pair_lists, pair_ids

        # 5-6. The shard parts, in parallel.
        t = time.perf_counter()
        store_dtype = STORAGE_DTYPES[integral.dtype() or rows.dtype]
        shard_manifests = {}
        with steps.step("writing shards", shards, "shard") as update:
            args = (metric, store_dtype, centroids, pq.codebooks)
            if use_ray:
                task = ray.remote(_write_shard).options(num_cpus=1)
                shared = [ray.put(a) for a in (_ray_source(source), centroids, pq.codebooks)]
                pending = {task.remote(str(w.dir / part_name(sp.index)), sp, shared[0], metric, store_dtype,
                                       shared[1], shared[2], codes[sp.global_ids], part_config, 1, shards): sp.index
                           for sp in shard_plans}
                while pending:
                    done, _ = ray.wait(list(pending), num_returns=1)
                    shard_manifests[pending.pop(done[0])] = ray.get(done[0])
                    update(1)
            else:
                for sp in shard_plans:
                    shard_manifests[sp.index] = _write_shard(str(w.dir / part_name(sp.index)), sp, source, *args,
                                                             codes[sp.global_ids], part_config, threads, shards)
                    update(1)
        timings["write_s"] = time.perf_counter() - t

        graph.save(str(w.path("graph.bin")))
        w.add_file("graph.bin")
        w.save_array("pq_codebooks.npy", pq.codebooks)
        w.save_array("list_shards.npy", plan.shards)
        w.save_array("list_local.npy", local)
        w.save_array("list_sizes.npy", sizes)
        w.save_array("list_visits.npy", visits)
        timings["total_s"] = time.perf_counter() - t_start
        expected = plan.shard_work(shards)
        manifest = index_manifest(
            n, dim, metric, store_dtype, src, n_lists, list_offsets[-1], pq, config, timings, navigation=navigation,
            kind=KIND, shards=shards,
            placement={"kind": placement, "replicate": replicate if placement != "round-robin" else 0.0,
                       "replicated_lists": int((plan.shards[:, 1] >= 0).sum()),
                       "sample_queries": int(len(queries)), "probe": params.to_dict(),
                       "expected_work": [float(x) for x in expected],
                       "expected_imbalance": float(expected.max() / expected.mean()),
                       "built_with": "ray" if use_ray else "local"},
            parts={part_name(s): {"manifest_sha256": hashlib.sha256(
                (w.dir / part_name(s) / MANIFEST).read_bytes()).hexdigest(),
                "count": shard_manifests[s]["count"], "lists": shard_manifests[s]["centroids"]}
                for s in range(shards)})
        if probe_info is not None:
            manifest["probe_model"] = probe_info
        if config.calibrate:  # the router's default search settings, measured on the sharded index as written
            calibrate_build(manifest, w, steps, timings, t_start, lambda d: calibrate_sharded(
                d, rows, n, internal_metric(metric), config.calibrate_queries, config.target_recall, config.seed,
                threads, None if sample_queries is None else queries))
        w.publish(manifest)
    return manifest


# ---------------------------------------------------------------------------------------------
# Query path

MISSING = -2  # route(): no live shard holds the list


@dataclass(frozen=True)
class ShardReads:
    """What a shard's search is asked besides the top-k: a compiled metadata filter (filters.compile_filter) the
    answers must pass, and whether to return the answers' documents (with their vectors)."""
    where: tuple[str, list] | None = None
    with_docs: bool = False
    with_vectors: bool = False


class ShardDown(UnavailableError):
    """A shard that is not running (its actor died, or it was closed): the router fails over."""


class _Generation:
    """One index generation of a shard, opened, and the searches reading it."""

    def __init__(self, number: int, path: Path, index, global_ids: np.ndarray):
        self.number, self.path, self.index, self.global_ids = number, path, index, global_ids
        self.readers = 0
        self.retired = False
        self.list_writes: dict[int, int] = {}  # upserts per router list that a merged generation holds


def sum_text_stats(counts: list[tuple[int, int, list[list[int]]]], n_texts: int) -> tuple[int, int, list[list[int]]]:
    """Stores' DocStore.text_stats summed: the collection's BM25 statistics (documents, tokens, per text the
    documents each query word matches)."""
    return (sum(c[0] for c in counts), sum(c[1] for c in counts),
            [[sum(words) for words in zip(*(c[2][i] for c in counts))] for i in range(n_texts)])


def best_text_hits(found: list[tuple[np.ndarray, np.ndarray]], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Stores' (ids, bm25 scores) for one text merged: the `limit` best (lowest score, then id), a document
    that several stores hold once, with its best score."""
    best: dict[int, float] = {}
    for ids, scores in found:
        for d, sc in zip(ids.tolist(), scores.tolist()):
            if d not in best or sc < best[d]:
                best[d] = sc
    order = sorted(best.items(), key=lambda item: (item[1], item[0]))[:limit]
    return np.asarray([d for d, _ in order], np.int64), np.asarray([sc for _, sc in order], np.float64)


class ShardServer:
    """One shard part, opened: the lists it is sent, filtered and re-ranked by Index.search_lists, its
    top-k as source rows with exact distances, merged with its fresh tier's exact top-k; its writes logged
    (sharded_writes.ShardWrites); its fresh tier folded into a new generation of its index by merge()
    (sharded_merge.py). A Ray actor in Ray mode (calls in threads of its own), an object in this process else.
    Thread-safe: searches run at once, writes and merges one at a time."""

    def __init__(self, path: str, config: EngineConfig | None = None, params: SearchParams | None = None,
                 lock_wait_s: float = 0.0):
        """lock_wait_s: how long to wait for another process that has this shard open to let go of it (one being
        killed, when a shard is restarted) before refusing with ConflictError: two processes writing one shard's
        log and generations would lose acknowledged writes."""
        self.path, self.config, self.params = str(path), config, params
        self.closed = False
        self._lock = threading.Lock()  # the current generation, its writes, the readers of each
        self._write_lock = threading.RLock()  # writes, and a merge's switch to its generation
        self._merge_lock = threading.Lock()
        held = dirlock.hold(Path(path) / SHARD_LOCK, lambda holder: (
            f"{path}: this shard is already open ({holder}), and whoever opened it writes its log and generations; "
            "close or stop that one first (another router serving this index?)"), lock_wait_s)
        # Let go by close(), or when this object is collected unclosed.
        self._let_go = weakref.finalize(self, os.close, held)
        try:
            gen, rec = self._open_generation()
            try:
                self.writes = ShardWrites(path, gen.global_ids, gen.index.dim, gen.index.metric,
                                          merged_lsn=int(rec["merged_lsn"]) if rec else 0,
                                          list_writes=gen.list_writes)
            except BaseException:
                gen.index.close()
                raise
        except BaseException:
            self._let_go()
            raise
        self._gen = gen

    def _open_generation(self, path: Path | None = None) -> tuple[_Generation, dict | None]:
        from fusionrag.retriever.index import Index

        gen_dir, rec = current_part(self.path) if path is None else (path, None)
        index = Index.open(gen_dir, self.config, self.params)
        try:
            ids = load_global_ids(gen_dir)
            if len(ids) != index.count:
                raise IndexFormatError(f"{gen_dir}: global_ids.npy does not hold one row per vector")
        except BaseException:
            index.close()
            raise
        gen = _Generation(int(rec["generation"]) if rec else 0, gen_dir, index, ids)
        if (gen_dir / LIST_WRITES).exists():
            gen.list_writes = {int(a): int(b) for a, b in np.load(gen_dir / LIST_WRITES).tolist()}
        return gen, rec

    @property
    def index(self):
        return self._gen.index

    @property
    def global_ids(self) -> np.ndarray:
        return self._gen.global_ids

    @contextlib.contextmanager
    def _reading(self):
        """(generation, its writes) for one call: the generation stays open until the call is done."""
        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        with self._lock:
            g, w = self._gen, self.writes
            g.readers += 1
        try:
            yield g, w
        finally:
            with self._lock:
                g.readers -= 1
                done = g.retired and not g.readers
            if done:
                self._drop(g)

    @staticmethod
    def _drop(g: _Generation) -> None:
        """Close a generation no longer current and no longer read; a merged one's directory goes too."""
        g.index.close()
        if g.number > 0:
            shutil.rmtree(g.path, ignore_errors=True)

    def search(self, queries: np.ndarray, lists: np.ndarray, k: int, params: SearchParams,
               reads: ShardReads | None = None):
        """(ids, distances, stats, seconds, documents): ids are global ids, -1 where fewer than k. A query whose
        lists are all -1 is answered from the fresh tier alone. queries: as the router prepared them
        (ShardedIndex.prepare_queries, which checked and normalised them), searched as they are. reads: a
        compiled metadata filter only the documents it passes may answer, and whether to return the found
        ids' documents (id -> (name, text, metadata, vector or None); None when not asked)."""
        t = time.perf_counter()
        reads = reads or ShardReads()
        with self._reading() as (g, w):
            index, gids = g.index, g.global_ids
            queries = PreparedQueries(np.ascontiguousarray(getattr(queries, "vectors", queries), dtype=np.float32),
                                      index.metric)
            exclude, fresh = w.snapshot()
            nq = len(queries)
            ids = np.full((nq, k), -1, dtype=np.int64)
            dists = np.full((nq, k), np.inf, dtype=np.float32)
            stats = {"candidates": np.zeros(nq, np.int64), "reranked": np.zeros(nq, np.int64)}
            rows = np.flatnonzero((np.asarray(lists) >= 0).any(axis=1))
            fresh_ok = None
            if reads.where is not None:
                allowed = w.store.rows_where(*reads.where) if w.store is not None else np.empty(0, np.int64)
                if len(allowed) <= FILTER_EXACT_MAX:  # few pass: exact, over their vectors in the doc store
                    if len(allowed):
                        rows_, vecs = w.store.vectors_where(*reads.where)
                        view = FreshView(vecs, (vecs * vecs).sum(1), rows_, np.ones(len(rows_), bool))
                        ids, dists = _merge([view.search(queries.vectors, k, index.metric)], k)
                    docs = self._documents(g, w, np.unique(ids[ids >= 0]), reads.with_vectors) \
                        if reads.with_docs else None
                    return ids, dists, stats, time.perf_counter() - t, docs
                ok = np.zeros(index.count, bool)
                pos = np.searchsorted(gids, allowed)
                inside = pos < len(gids)
                ok[pos[inside][gids[pos[inside]] == allowed[inside]]] = True
                if exclude is not None:
                    ok &= ~np.unpackbits(exclude, count=index.count, bitorder="little").astype(bool)
                exclude = np.packbits(~ok, bitorder="little")
                if not ok.any():
                    rows = rows[:0]  # no vector of the index passes: its lists hold nothing to find
                fresh_ok = None if fresh is None else np.isin(fresh.rows, allowed)
            if len(rows):
                res = index.search_lists(queries.rows(rows), lists[rows], k, params, exclude)
                ids[rows] = np.where(res.ids >= 0, gids[np.maximum(res.ids, 0)], -1)
                dists[rows] = np.where(res.ids >= 0, res.distances, np.inf)
                for key in stats:
                    stats[key][rows] = res.stats[key]
            if fresh is not None:
                fi, fd = fresh.search(queries.vectors, k, index.metric, fresh_ok)
                ids, dists = _merge([(ids, dists), (fi, fd)], k)
            docs = self._documents(g, w, np.unique(ids[ids >= 0]), reads.with_vectors) if reads.with_docs else None
        return ids, dists, stats, time.perf_counter() - t, docs

    # -- writes --------------------------------------------------------------------------------------

    def upsert(self, ids, vectors, docs: list | None = None, lists=None) -> int:
        """Log and apply: these ids now hold these vectors (in the engine's form) in this shard's fresh tier,
        any older version here tombstoned; docs: their (name, text, metadata JSON), kept in the shard's doc store;
        lists: the router's list each was sent for (where a merge puts it). Durable when it returns; how many ids
        had a version here."""
        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        with self._write_lock:
            return self.writes.write(UPSERT if docs is None else UPSERT_DOCS, ids, vectors, docs, lists)

    def delete(self, ids) -> int:
        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        with self._write_lock:
            return self.writes.write(DELETE, ids)

    def merge(self, threads: int | None = None) -> dict:
        """Fold the fresh tier and the tombstones into a new generation of this shard's index (sharded_merge.py)
        and go on from it. Searches and writes go on meanwhile, on the generation before; writes logged during the
        merge are replayed onto the new one when it takes over. Returns what was merged."""
        from fusionrag.retriever.merge import merge_index

        if self.closed:
            raise ShardDown(f"{self.path}: shard closed")
        t0 = time.perf_counter()
        with self._merge_lock:
            with self._reading() as (g, w):
                lsn, tomb, fresh_ids, fresh_vectors, fresh_lists, list_writes = w.state()
                dead = np.unpackbits(tomb, count=g.index.count, bitorder="little").astype(bool)
                if not len(fresh_ids) and not dead.any():
                    return {"merged": False, "generation": g.number}
                number = g.number + 1
                out = Path(self.path) / gen_dir_name(number)
                shutil.rmtree(out, ignore_errors=True)  # what a merge cut short left
                ids = np.concatenate([g.global_ids[~dead], fresh_ids])
                order = np.argsort(ids, kind="stable")
                lists = np.load(g.path / "lists.npy") if (g.path / "lists.npy").exists() else None
                # Each vector into the list the router sent it for, and only that one: every replica of a list
                # then holds the same vectors. One sent for no list (none of its lists' shards was up) goes to
                # its nearest list here.
                local = {int(r): i for i, r in enumerate(lists)} if lists is not None else {}
                assign = np.array([local.get(r, -1) for r in fresh_lists.tolist()], dtype=np.int64)
                config = BuildConfig.from_dict(g.index.manifest.get("build_config", {})).with_overrides(
                    max_list_factor=NO_SPLIT_FACTOR, threads=threads or 0)

                def extra(wr):
                    wr.save_array("global_ids.npy", ids[order])
                    if lists is not None:
                        wr.save_array("lists.npy", lists)
                    wr.save_array(LIST_WRITES, np.array(sorted(list_writes.items()), dtype=np.int64).reshape(-1, 2))

                stats = merge_index(g.index, dead, fresh_vectors, out, config, progress=False, order=order,
                                    extra=extra, assign=assign)
            rec = {"generation": number, "dir": out.name, "manifest_sha256": manifest_sha(out),
                   "count": len(ids), "merged_lsn": lsn}
            new, _ = self._open_generation(out)
            new.number = number
            with self._write_lock:  # no write until the new generation's writes have replayed those since lsn
                try:
                    publish(Path(self.path), rec)
                    old_w = self.writes
                    old_w.close(keep_store=True)
                    w = ShardWrites(self.path, new.global_ids, new.index.dim, new.index.metric, merged_lsn=lsn,
                                    store=old_w.store, list_writes=new.list_writes)
                except BaseException:
                    new.index.close()
                    raise
                with self._lock:
                    old, self._gen, self.writes = self._gen, new, w
                    old.retired = True
                    done = not old.readers
            if done:
                self._drop(old)
            dropped = w.compact()  # the log's records the generation holds go (writes wait meanwhile)
        return {"merged": True, "log_bytes_dropped": dropped, "generation": number, "count": len(ids), "merged_lsn": lsn,
                "fresh_merged": len(fresh_ids), "removed": int(dead.sum()), "seconds": time.perf_counter() - t0,
                "merge": stats.__dict__}

    # -- documents (sharded_docs.py) ----------------------------------------------------------------

    def documents(self, ids, with_vectors: bool = False) -> dict[int, tuple]:
        """id -> (name, text, metadata, vector or None) of those of these ids live here. A vector written without
        a document (built, or upserted by id alone) is named by its id, with no text and no metadata."""
        with self._reading() as (g, w):
            return self._documents(g, w, np.asarray(ids, dtype=np.int64), with_vectors)

    @staticmethod
    def _documents(g: _Generation, w: ShardWrites, ids: np.ndarray, with_vectors: bool) -> dict[int, tuple]:
        live = ids[w.live(ids)] if len(ids) else ids
        out = w.store.by_rows(live.tolist(), with_vectors) if w.store is not None and len(live) else {}
        rest = [i for i in live.tolist() if i not in out]
        vectors = {}
        if with_vectors and rest:
            vectors = w.fresh_vectors(rest)
            built = [i for i in rest if i not in vectors]
            if built:
                vectors.update(zip(built, g.index.read_vectors(np.searchsorted(g.global_ids, built))))
        for i in rest:
            out[i] = (str(i), None, {}, vectors.get(i))
        return out

    def matching(self, where: tuple[str, list]) -> np.ndarray:
        """Sorted ids of the documents here that pass a compiled filter (only documents written with their
        metadata can)."""
        with self._reading() as (_, w):
            return w.store.rows_where(*where) if w.store is not None else np.empty(0, np.int64)

    def text_stats(self, texts: list[str], counted_by=()) -> tuple[int, int, list[list[int]]]:
        """BM25's counts over this shard's documents (DocStore.text_stats), for the router to sum with those of the
        shards `counted_by`: the documents here one of them owns (a replicated list's) are left out."""
        with self._reading() as (_, w):
            return w.store.text_stats(texts, counted_by) if w.store is not None else \
                (0, 0, [[0] * len(query_words(t)) for t in texts])

    def text_search(self, texts: list[str], limit: int, where: tuple[str, list] | None,
                    stats: tuple[int, int, list[list[int]]] | None = None) -> list[tuple]:
        """Per text, (ids, bm25 scores) of the `limit` live documents here whose texts match it best, best first
        (lower is better): scored with `stats` (every shard's text_stats summed: the scores of one collection
        holding every shard's documents) or, with none, with this shard's own."""
        with self._reading() as (_, w):
            if w.store is None:
                return [(np.empty(0, np.int64), np.empty(0, np.float64)) for _ in texts]
            out = []
            for i, t in enumerate(texts):
                ids, scores = (w.store.text_search(t, limit, where) if stats is None else
                               w.store.global_bm25(t, limit, where, stats[0], stats[1], stats[2][i]))
                live = w.live(ids) if len(ids) else np.zeros(0, bool)
                out.append((ids[live], scores[live]))
            return out

    def page(self, after: int, limit: int, where: tuple[str, list] | None, with_vectors: bool) -> list[tuple]:
        """(id, name, text, metadata, vector or None) of the first `limit` documents here with id > after (those
        a compiled filter passes), in id order."""
        with self._reading() as (g, w):
            if where is not None:
                return w.store.page(after, limit, where, with_vectors) if w.store is not None else []
            ids = w.live_ids(after)[:limit]
            docs = self._documents(g, w, ids, with_vectors)
            return [(i, *docs[i]) for i in ids.tolist() if i in docs]

    def live_ids(self) -> np.ndarray:
        """Sorted ids live here: built and not deleted or replaced since, and written."""
        with self._reading() as (_, w):
            return w.live_ids()

    def exact(self, queries: np.ndarray, k: int, exclude: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global ids, distances) of each query's exact k nearest vectors live here, built (read back from the
        page file) and written (the fresh tier), -1 / inf where fewer; exclude[i]: an id query i may not return
        (-1: none). Calibration's truth, merged at the router, so that no process holds every vector."""
        with self._reading() as (g, w):
            built = np.flatnonzero(~np.isin(g.global_ids, w.tombstoned_ids()))
            fresh = w.fresh_ids().astype(np.int64)
            held = w.fresh_vectors(fresh)
            written = np.array([held[int(i)] for i in fresh], np.float32).reshape(len(fresh), g.index.dim)
            stored = page_rows(g.index)
            ids = np.concatenate([g.global_ids[built].astype(np.int64), fresh])

            def rows(pos: np.ndarray) -> np.ndarray:
                pos = np.asarray(pos, dtype=np.int64)
                out = np.empty((len(pos), g.index.dim), np.float32)
                b = pos < len(built)
                if b.any():
                    out[b] = stored(built[pos[b]])
                if not b.all():
                    out[~b] = written[pos[~b] - len(built)]
                return out

            order = np.argsort(ids, kind="stable")
            exclude = np.asarray(exclude, dtype=np.int64)
            at = np.minimum(np.searchsorted(ids[order], exclude), max(len(ids) - 1, 0))
            mine = (exclude >= 0) & (ids[order][at] == exclude) if len(ids) else np.zeros(len(exclude), bool)
            skip = np.where(mine, order[at], -1)
            found, dist = exact_topk(rows, len(ids), np.asarray(queries, np.float32), k,
                                     g.index.manifest["internal_metric"], exclude=skip, distances=True)
            return np.where(found >= 0, ids[np.maximum(found, 0)], -1), dist

    def field_types(self, key: str) -> set[str]:
        with self._reading() as (_, w):
            return w.store.field_types(key) if w.store is not None else set()

    def write_state(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, list[str]], dict[int, int]]:
        """(ids live in the fresh tier, base ids tombstoned, (ids, names) of the documents here, upserts logged per
        router list): what the router's write maps are built from."""
        with self._reading() as (_, w):
            return w.fresh_ids(), w.tombstoned_ids(), w.named(), dict(w.list_writes)

    def where(self) -> dict:
        import os

        node = None
        if _ray_active():
            import ray

            node = ray.get_runtime_context().get_node_id()
        with self._reading() as (g, w):
            mem = g.index.memory()
            # The filter tier this shard's process runs: the GPU's where CUDA shows it one (Ray leaves
            # CUDA_VISIBLE_DEVICES as the node has it for an actor that reserves no GPU), under this process's
            # gpu_budget_bytes.
            return {"pid": os.getpid(), "node_id": node, "count": g.index.count, "path": self.path,
                    "generation": g.number, "pq_tier": mem["pq_tier"], "pq_bytes": mem["pq_bytes"],
                    "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), **w.info()}

    def close(self) -> None:
        self.closed = True
        with self._write_lock, self._merge_lock:
            self.writes.close()
            with self._lock:
                g = self._gen
                g.retired = True
                done = not g.readers
            self._let_go()  # nothing of this process writes the shard any more
        if done:
            g.index.close()


def _is_down(e: BaseException) -> bool:
    """Whether a shard call failed because the shard is not running (not because of what it was asked)."""
    if isinstance(e, (ShardDown, FutureTimeout)):
        return True
    try:
        from ray import exceptions as rx
    except ImportError:
        return False
    return isinstance(e, (rx.RayActorError, rx.ActorUnavailableError, rx.GetTimeoutError))


def _reachable_nodes(ray) -> list[str]:
    """The ids of the nodes Ray counts alive whose raylet also takes a connection now, sorted (all that Ray counts
    alive, if none does). Ray counts a node alive until its health checks fail, 12-15 s after it died; an actor
    placed there meanwhile waits on it, and on Ray 2.60 the GCS itself was seen to exit when the node was then
    declared dead with that actor's lease pending (tests/retriever/sharded_ray_faults_child.py node-crash)."""
    import socket

    alive = sorted((n["NodeID"], n.get("NodeManagerAddress"), n.get("NodeManagerPort")) for n in ray.nodes()
                   if n.get("Alive"))
    reachable = []
    for node, host, port in alive:
        try:
            socket.create_connection((host, int(port)), timeout=NODE_PROBE_S).close()
        except (OSError, TypeError, ValueError):
            continue
        reachable.append(node)
    return reachable or [node for node, _, _ in alive]


NODE_PROBE_S = 0.5  # a raylet that takes no connection in this long is taken for dead


def _start_actor(path: str, config: EngineConfig, params: SearchParams, options: dict, s: int,
                 avoid: str | None = None, reachable: list[str] | None = None):
    """Shard s as a Ray actor: by default on the s-th alive node (mod their count), and only there (a hard
    affinity: a soft one lets the chosen raylet spill the lease to a node Ray still counts alive, a dead one), of
    the nodes whose raylet answers (_reachable_nodes, or reachable where the caller probed them once for several
    shards). avoid: a node left out while another answers, the node a dead shard ran on."""
    ray = _ray()
    options = dict(options)
    if "scheduling_strategy" not in options:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        reachable = reachable or _reachable_nodes(ray)
        nodes = [n for n in reachable if n != avoid] or reachable
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[s % len(nodes)], soft=False)
    return ray.remote(ShardServer).options(**options).remote(path, config, params, SHARD_LOCK_WAIT_S)


class _Future:
    """A result computed in this process, with the interface the router needs of a Ray ObjectRef."""

    def __init__(self, fut):
        self.fut = fut

    def get(self, timeout: float | None = None):
        return self.fut.result(timeout)


@dataclass
class ShardedResult:
    ids: np.ndarray  # int64 (q, k), source rows, -1 where fewer than k
    distances: np.ndarray  # float32 (q, k), ascending, in the metric Index.search reports
    stats: dict[str, np.ndarray] = field(default_factory=dict)  # per query
    per_shard: dict[str, np.ndarray] = field(default_factory=dict)  # per shard, summed over the queries
    # Per query: the router's numbers of the probed lists no live shard could search (empty: a full answer).
    missing_lists: list[np.ndarray] = field(default_factory=list)
    missing_shards: list[int] = field(default_factory=list)  # down shards whose fresh tier went unsearched
    docs: dict[int, tuple] = field(default_factory=dict)  # id -> (name, text, metadata, vector), when asked

    @property
    def partial(self) -> bool:
        return bool(self.missing_shards) or any(len(m) for m in self.missing_lists)


def _merge(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of each row over the parts' (ids, distances), a vector found by two shards once."""
    ids = np.concatenate([p[0] for p in parts], axis=1)
    d = np.concatenate([p[1] for p in parts], axis=1).astype(np.float32)
    d = np.where(ids < 0, np.inf, d)
    order = np.lexsort((d, ids), axis=-1)
    sid = np.take_along_axis(ids, order, axis=1)
    sd = np.take_along_axis(d, order, axis=1)
    dup = np.zeros_like(sid, dtype=bool)
    dup[:, 1:] = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)
    sd[dup] = np.inf
    best = np.argsort(sd, axis=1, kind="stable")[:, :k]
    out_ids = np.take_along_axis(sid, best, axis=1)
    out_d = np.take_along_axis(sd, best, axis=1)
    out_ids[~np.isfinite(out_d)] = -1
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = np.pad(out_ids, ((0, 0), (0, pad)), constant_values=-1)
        out_d = np.pad(out_d, ((0, 0), (0, pad)), constant_values=np.inf)
    return out_ids, out_d


class ShardedIndex(ManifestShape):
    """A sharded index, opened: the router in this process, the shards as Ray actors (ray=True) or as
    objects in this process (ray=False: the same code, threads for the shards). Thread-safe."""

    def __init__(self, path: Path, manifest: dict, nav: NavigationTier, list_shards: np.ndarray,
                 list_local: np.ndarray, list_sizes: np.ndarray, shards: list, use_ray: bool,
                 params: SearchParams, batch_size: int):
        self.path, self.manifest, self.nav = path, manifest, nav
        self.list_shards, self.list_local, self.list_sizes = list_shards, list_local, list_sizes
        self.shards, self.use_ray, self.params, self.batch_size = shards, use_ray, params, batch_size
        self.n_shards = len(shards)
        self._lock = threading.Lock()
        self.outstanding = np.zeros(self.n_shards, dtype=np.int64)  # list-size units sent, not yet answered
        self._pool = None if use_ray else ThreadPoolExecutor(max_workers=self.n_shards,
                                                             thread_name_prefix="fusionrag-shard")
        self.alive = np.ones(self.n_shards, dtype=bool)
        self._write_lock = threading.RLock()  # writes one at a time: the router's maps follow the shards' logs
        self.fresh_owner: dict[int, tuple[int, ...]] = {}  # id -> the shards whose fresh tier holds it
        # How many fresh ids each set of owners holds (under _lock): what a search asks when a shard is down, read
        # without the write lock and without a pass over every fresh id.
        self.fresh_groups: dict[tuple[int, ...], int] = {}
        self.base_gone: set[int] = set()  # built ids deleted or replaced (tombstoned on their shards)
        self.named: dict[str, int] = {}  # a document's name -> its id, for names that are not an id (sharded_docs)
        # Upserts each replica of each list logged (column j: list_shards[:, j]): the one with fewer missed some.
        self.replica_writes = np.zeros((len(list_shards), 2), dtype=np.int64)
        self.next_named = NAMED_IDS  # the id the next new such name gets
        self._base_count: int | None = None  # distinct ids in the shards' indexes (live_count)
        self.fresh_count = np.zeros(self.n_shards, dtype=np.int64)
        self.call_timeout_s: float | None = None
        # What a following router's searches read of the state above (view(), sharded_follow.py) changed since
        # (epoch, version): epoch is this process's, version counts the changes (under _lock).
        self.epoch, self.version = os.urandom(8).hex(), 0
        self._views: tuple[int, dict] | None = None  # the last view built, by version

    @classmethod
    def open(cls, path, config: EngineConfig | None = None, params: SearchParams | None = None,
             ray: bool = False, actor_options: dict | None = None, batch_size: int = 1024,
             verify: bool = True, call_timeout_s: float | None = None) -> "ShardedIndex":
        """ray: the shards as Ray actors (Ray must be initialised: ray.init(address=...)); actor_options:
        passed to the actors' .options() (default: no CPU reserved, shard s on the s-th node). batch_size:
        queries per batch, each batch one call per shard it needs. call_timeout_s: a shard that has not answered a
        call by then is taken for down (its lists go to their replicas; heal() restarts it); None: wait as long as
        Ray takes to report a dead actor or node."""
        cls._check_options(call_timeout_s, batch_size)
        path = Path(path)
        config = config or EngineConfig()
        m, names = cls._read_router(path, config, verify)
        try:
            parts = m["parts"]
            hashes = [parts[name]["manifest_sha256"] for name in names]
        except (KeyError, TypeError, ValueError) as e:
            raise IndexFormatError(f"{path}: manifest lacks or garbles a field ({e!r})") from e
        expected = {}  # part -> the vectors its current generation holds
        for name, want in zip(names, hashes):
            mp = path / name / MANIFEST
            if not (path / name).is_dir():
                raise IndexFormatError(f"{path}: shard part {name} is missing")
            _, rec = current_part(path / name)  # a merged generation: checked against the part's own CURRENT.json
            expected[name] = rec["count"] if rec else parts[name].get("count")
            if rec:
                continue
            if not mp.exists():
                raise IndexFormatError(f"{path}: shard part {name} has no manifest (incomplete or damaged)")
            if hashlib.sha256(mp.read_bytes()).hexdigest() != want:
                raise IndexFormatError(f"{path}: shard part {name} was replaced or is corrupt (its manifest does "
                                       "not match the router's)")
        graph, list_shards, list_local, list_sizes, navigation = cls._router_tier(path, m, config)
        metric = m["metric"]
        params = params or search_defaults(m, path)  # what the build's calibration chose
        shard_paths = [str((path / name).resolve()) for name in names]
        options = None
        if ray:
            rray = _ray()
            if not rray.is_initialized():
                raise ConfigError("ray=True: connect to a Ray cluster first (ray.init(address=...))")
            # Threads of its own for a shard's calls: searches go on while it merges (ShardServer is thread-safe).
            options = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 8, **(actor_options or {})}
            reachable = None if "scheduling_strategy" in options else _reachable_nodes(rray)  # probed once
            shards = [_start_actor(p, config, params, options, s, reachable=reachable)
                      for s, p in enumerate(shard_paths)]
            try:
                where = rray.get([s.where.remote() for s in shards])
            except rray.exceptions.RayActorError as e:
                for s in shards:
                    rray.kill(s)
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, ConflictError):  # open in another process: the index is fine
                    raise ConflictError(f"{path}: a shard failed to open: {cause}") from e
                raise IndexFormatError(f"{path}: a shard failed to open: {cause}") from e
        else:
            shards = []
            try:
                for p in shard_paths:
                    shards.append(ShardServer(p, config, params))
            except BaseException:
                for opened in shards:  # and so lets go of its directory
                    opened.close()
                raise
            where = [s.where() for s in shards]
        for s, (name, w) in enumerate(zip(names, where)):
            if w["count"] != expected[name]:
                raise IndexFormatError(f"{path}: shard part {name} holds {w['count']} vectors, the router expects "
                                       f"{expected[name]}")
        nav = NavigationTier(graph, metric == "ip", cpu_threads(config.threads), navigation, None, list_sizes)
        out = cls(path, m, nav,
                  list_shards, list_local, list_sizes, shards, bool(ray), params, batch_size)
        out.where, out.config, out.actor_options, out.shard_paths = where, config, options, shard_paths
        out.call_timeout_s = call_timeout_s
        out.base_ids = [load_global_ids(current_part(p)[0]) for p in shard_paths]
        out._load_write_maps()
        out.nav.model = load_probe_model(path, m)
        return out

    @staticmethod
    def _check_options(call_timeout_s: float | None, batch_size: int) -> None:
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ConfigError(f"call_timeout_s must be positive, got {call_timeout_s}")
        if not 1 <= batch_size <= 65536:
            raise ConfigError(f"batch_size must be in [1, 65536], got {batch_size}")

    @staticmethod
    def _read_router(path: Path, config: EngineConfig, verify: bool) -> tuple[dict, list[str]]:
        """The router's manifest (checked) and its shard parts' names."""
        if (path / MANIFEST).exists() and not is_sharded(path):
            raise IndexFormatError(f"{path}: not a sharded index (open it with Index.open)")
        m = read_manifest(path, verify and config.verify, ROUTER_FILES)
        try:
            n_shards = int(m["shards"])
            int(m["centroids"]), int(m["dim"]), str(m["metric"])
        except (KeyError, TypeError, ValueError) as e:
            raise IndexFormatError(f"{path}: manifest lacks or garbles a field ({e!r})") from e
        return m, [part_name(s) for s in range(n_shards)]

    @staticmethod
    def _router_tier(path: Path, m: dict, config: EngineConfig) -> tuple:
        """The router's navigation graph and list maps, checked against each other and the manifest: (graph,
        list_shards, list_local, list_sizes, navigation)."""
        n_shards, n_lists, dim, metric = int(m["shards"]), int(m["centroids"]), int(m["dim"]), m["metric"]
        navigation = recorded_navigation(m, n_lists, dim + (metric == "ip"), path)
        try:  # a router that navigates exactly never follows the graph's links: they stay on disk
            graph = native.Graph.load(str(path / "graph.bin"), quantize=config.graph_sq8,
                                      links=navigation != "exact")
        except ValueError as e:
            raise IndexFormatError(f"{path}: {e}") from e
        list_shards = load_array(path, "list_shards.npy", np.int32, 2)
        list_local = load_array(path, "list_local.npy", np.int32, 2)
        list_sizes = load_array(path, "list_sizes.npy", np.int64, 1)
        problems = [
            graph.size != n_lists and f"graph has {graph.size} nodes, manifest says {n_lists}",
            graph.dim != dim + (metric == "ip") and f"graph dimension {graph.dim} does not fit dimension {dim}",
            list_shards.shape != (n_lists, 2) and "list_shards.npy does not hold a row per list",
            list_local.shape != (n_lists, 2) and "list_local.npy does not hold a row per list",
            len(list_sizes) != n_lists and "list_sizes.npy does not hold a size per list",
            (list_shards.shape == (n_lists, 2) and (list_shards.min(initial=0) < -1 or list_shards.max(initial=0)
                                                     >= n_shards or (list_shards[:, 0] < 0).any()))
            and "list_shards.npy names shards that do not exist",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise IndexFormatError(f"{path}: inconsistent sharded index: " + "; ".join(problems))
        return graph, list_shards, list_local, list_sizes, navigation

    def prepare_queries(self, queries) -> np.ndarray:
        return prepare_queries(queries, self.dim, self.metric)

    def route(self, lists: np.ndarray, outstanding: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Which shard serves each probed list of each query: (shard int32 (q, m), -1 where no list, MISSING
        where no shard holding the list is alive; the work planned per shard). A list with two live replicas
        goes to the one with the least outstanding work, counting what this batch already sent each shard."""
        lists = np.asarray(lists)
        planned = np.zeros(self.n_shards, dtype=np.int64)
        base = self.outstanding.copy() if outstanding is None else np.asarray(outstanding, dtype=np.int64).copy()
        valid = lists >= 0
        safe = np.where(valid, lists, 0)
        first, second = self.list_shards[safe, 0], self.list_shards[safe, 1]
        a_ok = self.alive[first]
        b_ok = (second >= 0) & self.alive[np.maximum(second, 0)]
        # A replica that missed upserts to its list (it was down) is read only when its twin is down.
        w = self.replica_writes[safe]
        a_good, b_good = a_ok & (w[..., 0] >= w[..., 1]), b_ok & (w[..., 1] >= w[..., 0])
        a_ok, b_ok = a_good | (a_ok & ~b_good), b_good | (b_ok & ~a_good)
        shard = np.where(valid, np.where(a_ok, first, np.where(b_ok, second, MISSING)), -1).astype(np.int32)
        sizes = self.list_sizes[safe]
        single = valid & (a_ok ^ b_ok)
        np.add.at(planned, shard[single], sizes[single])
        # Lists with two live replicas one by one, least loaded first at each step.
        rq, rj = np.nonzero(valid & a_ok & b_ok)
        for i, j in zip(rq, rj):
            a, b = first[i, j], second[i, j]
            pick = a if base[a] + planned[a] <= base[b] + planned[b] else b
            shard[i, j] = pick
            planned[pick] += sizes[i, j]
        return shard, planned

    def _call(self, s: int, method: str, *args):
        if self.use_ray:
            return getattr(self.shards[s], method).remote(*args)
        return _Future(self._pool.submit(getattr(self.shards[s], method), *args))

    def _get(self, handle):
        if self.use_ray:
            import ray

            return ray.get(handle, timeout=self.call_timeout_s)
        return handle.get(self.call_timeout_s)

    def _mark_down(self, s: int) -> None:
        with self._lock:
            self.alive[s] = False
            self.version += 1

    def _changed(self) -> None:
        with self._lock:
            self.version += 1

    def view(self, epoch: str | None = None, version: int = -1) -> dict | None:
        """What a router following this one needs for its searches (ShardedFollower, sharded_follow.py): None
        when nothing changed since (epoch, version), else the shards (their actors), which are alive, how many
        fresh rows each holds and which sets of shards hold some (fresh_groups), the lists whose replica missed
        writes (behind: list, then which replica, as replica_writes' columns), the default search settings, and
        the (epoch, version) it is."""
        with self._lock:
            if epoch == self.epoch and version == self.version:
                return None
            v = self.version
            if self._views is not None and self._views[0] == v:
                return self._views[1]
            out = {"epoch": self.epoch, "version": v, "alive": self.alive.copy(),
                   "fresh_count": self.fresh_count.copy(), "fresh_groups": dict(self.fresh_groups),
                   "shards": list(self.shards), "params": self.params.to_dict()}
        w = self.replica_writes.copy()  # written under the write lock: a newer count is sent again at its version
        lag = np.flatnonzero(w[:, 0] != w[:, 1])
        out["behind"] = (lag.astype(np.int64), (w[lag, 1] > w[lag, 0]).astype(np.int8))
        with self._lock:
            self._views = (v, out)
        return out

    def probe(self, q: np.ndarray, p: SearchParams):
        """(lists int32 (q, m), -1 where cut; their count per query): as Index probes (p.probe 'ratio', the
        distance-ratio rule, or 'learned', the router's probe model)."""
        lists, probed, _ = self.nav.probe(q, p)
        return lists, probed

    def _dispatch(self, q: np.ndarray, lo: int, lists: np.ndarray, k: int, p: SearchParams, fresh: bool,
                  stats: dict, per_shard: dict, missing: list[set], reads: ShardReads | None = None) -> list:
        """Send one batch's lists (the router's numbers, (b, m), -1 where none) to the live shards holding them,
        one call per shard; with fresh, every query also to each live shard with a fresh tier. Returns the
        calls: (shard, query rows, handle, work, which of the rows' lists it was sent)."""
        with self._lock:
            shard, planned = self.route(lists)
            self.outstanding += planned
        miss = shard == MISSING
        for r in np.flatnonzero(miss.any(axis=1)):
            missing[lo + r].update(lists[r][miss[r]].tolist())
        calls = []
        for s in range(self.n_shards):
            on = shard == s
            # A filter's documents may be on any shard: it asks every one.
            with_fresh = fresh and self.alive[s] and (self.fresh_count[s] > 0 or
                                                      (reads is not None and reads.where is not None))
            rows = np.arange(len(lists)) if with_fresh else np.flatnonzero(on.any(axis=1))
            if not len(rows):
                continue
            width = max(1, int(on[rows].sum(axis=1).max()))
            local = np.full((len(rows), width), -1, dtype=np.int32)
            sub, sub_on = lists[rows], on[rows]
            col = np.cumsum(sub_on, axis=1) - 1
            r, c = np.nonzero(sub_on)
            replica = (self.list_shards[sub[r, c], 1] == s).astype(np.int64)
            local[r, col[r, c]] = self.list_local[sub[r, c], replica]
            stats["shards_probed"][lo + rows] += 1
            per_shard["queries"][s] += len(rows)
            per_shard["lists"][s] += int(sub_on.sum())
            per_shard["work"][s] += int(planned[s])
            extra = () if reads is None else (reads,)
            calls.append((s, lo + rows, self._call(s, "search", q[lo + rows], local, k, p, *extra), int(planned[s]),
                          sub_on))
        return calls

    def _fresh_unreachable(self) -> list[int]:
        """Down shards holding fresh rows no live shard also holds. Searches call it while writes change the
        fresh rows' owners: it reads the groups of owners under _lock, which writes take to change them."""
        if self.alive.all():
            return []
        with self._lock:
            groups, alive = list(self.fresh_groups), self.alive.copy()
        return sorted({o for owners in groups if not alive[list(owners)].any() for o in owners})

    def search(self, queries, k: int = 10, params: SearchParams | None = None, probe: str | None = None,
               probe_scale: float | None = None, partial: bool = True, reads: ShardReads | None = None,
               **overrides) -> ShardedResult:
        """Top-k of each query over every shard's index and fresh tier, with exact distances (as Index.search
        reports them). probe, probe_scale: SearchParams' (as overrides): 'ratio' (the distance-ratio rule, as
        Index) or 'learned' (learned pruning; probe_scale x the predicted lists).
        A shard that does not answer (its actor died) is marked down and its lists are sent to their other
        replica; lists no live shard holds are reported per query (missing_lists) and, partial=False, raise
        UnavailableError instead.
        stats per query: lists_probed, shards_probed, candidates (PQ-scanned postings), reranked, missing_lists;
        per_shard: queries, lists, work (postings of the lists sent), candidates, seconds. reads: a metadata filter
        the answers must pass, and whether the shards return the answers' documents (ShardedResult.docs)."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        p = resolve_params(params, self.params).with_overrides(probe=probe, probe_scale=probe_scale, **overrides)
        q = self.prepare_queries(queries)
        nq, S = len(q), self.n_shards
        stats = {key: np.zeros(nq, dtype=np.int64) for key in ("lists_probed", "shards_probed", "candidates",
                                                                "reranked", "missing_lists")}
        per_shard = {key: np.zeros(S, dtype=np.float64 if key == "seconds" else np.int64)
                     for key in ("queries", "lists", "work", "candidates", "seconds")}
        missing: list[set] = [set() for _ in range(nq)]
        missing_shards = set(self._fresh_unreachable())
        jobs = []  # (batch slice, its lists, its calls)
        for lo in range(0, nq, self.batch_size):
            sl = slice(lo, min(nq, lo + self.batch_size))
            lists, probed = self.probe(q[sl], p)
            stats["lists_probed"][sl] = probed
            jobs.append((sl, lists, self._dispatch(q, lo, lists, k, p, True, stats, per_shard, missing, reads)))
        ids = np.full((nq, k), -1, dtype=np.int64)
        dists = np.full((nq, k), np.inf, dtype=np.float32)
        errors = []
        docs: dict[int, tuple] = {}
        for sl, lists, calls in jobs:
            parts = []
            n_b = sl.stop - sl.start
            while calls:
                retry = np.full_like(lists, -1)
                for s, rows, handle, work, sent in calls:
                    try:
                        sid, sd, sst, secs, sdocs = self._get(handle)
                    except Exception as e:  # noqa: BLE001 - a down shard fails over; others reported below
                        if not _is_down(e):
                            errors.append((s, e))
                            continue
                        self._mark_down(s)
                        retry[rows - sl.start] = np.where(sent, lists[rows - sl.start], retry[rows - sl.start])
                        missing_shards.update(self._fresh_unreachable())
                        continue
                    finally:
                        with self._lock:
                            self.outstanding[s] -= work
                    full_ids = np.full((n_b, k), -1, dtype=np.int64)
                    full_d = np.full((n_b, k), np.inf, dtype=np.float32)
                    full_ids[rows - sl.start], full_d[rows - sl.start] = sid, sd
                    parts.append((full_ids, full_d))
                    docs.update(sdocs or {})
                    stats["candidates"][rows] += sst["candidates"]
                    stats["reranked"][rows] += sst["reranked"]
                    per_shard["candidates"][s] += int(sst["candidates"].sum())
                    per_shard["seconds"][s] += secs
                # The lists of shards that went down, to their live replicas (fresh tiers were all asked once).
                calls = (self._dispatch(q, sl.start, retry, k, p, False, stats, per_shard, missing, reads)
                         if (retry >= 0).any() else [])
            if parts:
                ids[sl], dists[sl] = _merge(parts, k)
        if errors:
            s, e = errors[0]
            raise UnavailableError(f"{self.path}: shard {part_name(s)} did not answer: {e}") from e
        missing_lists = [np.array(sorted(m), dtype=np.int32) for m in missing]
        stats["missing_lists"][:] = [len(m) for m in missing_lists]
        res = ShardedResult(ids, dists, stats, per_shard, missing_lists, sorted(missing_shards), docs)
        if res.partial and not partial:
            down = [part_name(s) for s in np.flatnonzero(~self.alive)]
            why = [f"{int((stats['missing_lists'] > 0).sum())} queries need posting lists no live shard holds "
                   f"({sum(map(len, missing_lists))} lists)"] if stats["missing_lists"].any() else []
            why += [f"fresh rows only {', '.join(part_name(s) for s in sorted(missing_shards))} held"] \
                if missing_shards else []
            raise UnavailableError(f"{self.path}: {'; '.join(why)}; down: {', '.join(down) or 'none'}")
        return res

    # -- writes ------------------------------------------------------------------------------------

    def _base_holders(self, ids: np.ndarray) -> list[list[int]]:
        """For each id, the shards whose built index holds it (none once it was deleted or replaced)."""
        out = [[] for _ in ids]
        for s, base in enumerate(self.base_ids):
            pos = np.minimum(np.searchsorted(base, ids), max(len(base) - 1, 0))
            for i in np.flatnonzero(base[pos] == ids) if len(base) else []:
                if int(ids[i]) not in self.base_gone:
                    out[i].append(s)
        return out

    def _check_ids(self, ids, named: bool = True) -> np.ndarray:
        """named: ids from NAMED_IDS up (those of documents named by a string, sharded_docs.py) allowed."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
            raise InputError("ids must be a 1-D sequence of integers")
        if len(ids) and ids.dtype.kind == "u" and int(ids.max()) > np.iinfo(np.int64).max:
            raise InputError("ids must fit in 63 bits")
        ids = ids.astype(np.int64)
        if (ids < 0).any() or len(np.unique(ids)) != len(ids):
            raise InputError("ids must be distinct non-negative integers")
        if not named and (ids >= NAMED_IDS).any():
            raise InputError(f"ids from {NAMED_IDS} (2**62) up are those of documents named by a string: "
                             "write those through ShardedCollection")
        return ids

    def _write_round(self, sends: dict[int, tuple], what: str, write: bool = True) -> dict:
        """One call per shard, in parallel: {shard: (method, args)}; a shard that fails is marked down and the
        write refused (UnavailableError: not acknowledged; retrying it after the shard is back completes it).
        write=False: a read's round, failed the same way."""
        out, failed = self._round(sends)
        if failed:
            err = UnavailableError(f"{self.path}: {what} {'not acknowledged' if write else 'failed'}: shard "
                                   f"{part_name(failed[0])} is down")
            err.acked = set(out)  # the shards that did take it
            raise err
        return out

    def _count_upserts(self, to_list: np.ndarray, targets: list[tuple[int, ...]], acked: set[int]) -> None:
        """Count an upsert round's vectors for the replicas of their lists that took them (replica_writes)."""
        for lst, t in zip(to_list.tolist(), targets):
            if lst < 0:
                continue
            for s in t:
                if s in acked:
                    self.replica_writes[lst, 0 if self.list_shards[lst, 0] == s else 1] += 1
        self._changed()  # after the counts: a view built at the new version holds them

    def _refuse_if_down(self, shards, what: str) -> None:
        down = sorted(s for s in shards if not self.alive[s])
        if down:
            raise UnavailableError(f"{self.path}: {what} refused: it needs shard(s) "
                                   f"{', '.join(part_name(s) for s in down)}, which are down")

    def _set_fresh(self, i: int, owners: tuple[int, ...]) -> None:
        """Id i's fresh owners are now these shards (none: it is in no fresh tier); under the write lock."""
        with self._lock:
            old = self.fresh_owner.pop(i, ())
            if old:
                for o in old:
                    self.fresh_count[o] -= 1
                left = self.fresh_groups[old] - 1
                if left:
                    self.fresh_groups[old] = left
                else:
                    del self.fresh_groups[old]
            if owners:
                owners = tuple(owners)
                self.fresh_owner[i] = owners
                for o in owners:
                    self.fresh_count[o] += 1
                self.fresh_groups[owners] = self.fresh_groups.get(owners, 0) + 1
            self.version += 1

    def upsert(self, ids, vectors, docs: list | None = None) -> int:
        """Insert or replace vectors by id (non-negative integers below 2**62; the built vectors' ids are their
        source rows). docs (ShardedCollection's): one (name, text, metadata JSON) per id, kept with the vector.
        Each goes to the fresh tier of every live shard holding its nearest list (to the live shard with the
        fewest fresh rows when none does), its older version deleted wherever it was. Durable on every shard
        it went to when this returns; returns how many ids replaced a live version. UnavailableError (503)
        when an older version sits on a down shard, or no shard is alive."""
        ids = self._check_ids(ids, named=docs is not None)
        v = self.prepare_queries(vectors)
        if len(v) != len(ids):
            raise InputError(f"{len(ids)} ids for {len(v)} vectors")
        if docs is not None and len(docs) != len(ids):
            raise InputError(f"{len(ids)} ids for {len(docs)} documents")
        if not len(ids):
            return 0
        near = self.nav.nearest(v, self.params.with_overrides(nprobe=min(UPSERT_PROBE, len(self.list_shards))))[0]
        with self._write_lock:
            if not self.alive.any():
                raise UnavailableError(f"{self.path}: upsert refused: every shard is down")
            base = self._base_holders(ids)
            holders = [set(b) | set(self.fresh_owner.get(int(i), ())) for i, b in zip(ids.tolist(), base)]
            # Each vector to every live shard holding its nearest list with a live shard (its list: where a merge
            # puts it); none among the UPSERT_PROBE nearest: the live shard with the fewest fresh rows, no list.
            targets, to_list = [], np.full(len(ids), -1, np.int64)
            for i, row in enumerate(near.tolist()):
                t = ()
                for lst in row:
                    t = tuple(int(s) for s in self.list_shards[lst] if s >= 0 and self.alive[s]) if lst >= 0 else ()
                    if t:
                        to_list[i] = lst
                        break
                targets.append(t or (int(np.flatnonzero(self.alive)[np.argmin(self.fresh_count[self.alive])]),))
            old = [h - set(t) for h, t in zip(holders, targets)]
            self._refuse_if_down(set().union(*old), "upsert")
            ups: dict[int, list[int]] = {}
            for i, t in enumerate(targets):
                for s in t:
                    ups.setdefault(s, []).append(i)
            dels: dict[int, list[int]] = {}
            for i, o in enumerate(old):
                for s in o:
                    dels.setdefault(s, []).append(i)
            # New versions first: a write cut short leaves an id twice (the merge keeps its nearer version) rather
            # than not at all, and its retry completes it.
            try:
                # A document on two shards (its list replicated) is counted in BM25's statistics by the first,
                # the second told so (DocStore.mark_text_guests).
                self._write_round({s: ("upsert", (ids[r], v[r], None if docs is None else
                                                  [tuple(docs[i]) + ((targets[i][0],) if targets[i][0] != s else ())
                                                   for i in r], to_list[r])) for s, r in ups.items()}, "upsert")
            finally:  # the shards that took the write counted it for their lists, failed round or not
                self._count_upserts(to_list, targets, getattr(sys.exc_info()[1], "acked", set(ups)))
            if dels:
                self._write_round({s: ("delete", (ids[r],)) for s, r in dels.items()}, "upsert")
            for i, (b, t) in enumerate(zip(base, targets)):
                if b:
                    self.base_gone.add(int(ids[i]))
                self._set_fresh(int(ids[i]), t)
            return sum(1 for h in holders if h)

    def delete(self, ids) -> int:
        """Delete by id from every shard holding a version (unknown ids are ignored); durable when it returns;
        how many ids were live. UnavailableError (503) when a shard holding one of them is down."""
        ids = self._check_ids(ids)
        with self._write_lock:
            base = self._base_holders(ids)
            holders = [set(b) | set(self.fresh_owner.get(int(i), ())) for i, b in zip(ids.tolist(), base)]
            self._refuse_if_down(set().union(*holders) if holders else set(), "delete")
            dels: dict[int, list[int]] = {}
            for i, h in enumerate(holders):
                for s in h:
                    dels.setdefault(s, []).append(i)
            if dels:
                self._write_round({s: ("delete", (ids[r],)) for s, r in dels.items()}, "delete")
            for i, b in enumerate(base):
                if b:
                    self.base_gone.add(int(ids[i]))
                self._set_fresh(int(ids[i]), ())
            return sum(1 for h in holders if h)

    def live_count(self) -> int:
        """Live vectors, each counted once however many shards hold it: those in the shards' indexes not deleted
        or replaced since, and those in their fresh tiers."""
        with self._write_lock:
            if self._base_count is None:
                self._base_count = len(np.unique(np.concatenate(self.base_ids))) if self.base_ids else 0
            return self._base_count - len(self.base_gone) + len(self.fresh_owner)

    def _load_write_maps(self) -> None:
        """The router's maps (which shards' fresh tiers hold an id, which built ids are gone) from the shards'
        replayed logs."""
        self._base_count = None  # the shards' indexes may have changed (a merge, a restart)
        states = [self._get(self._call(s, "write_state")) for s in range(self.n_shards)]
        owners: dict[int, list[int]] = {}
        self.named = {}
        self.replica_writes[:] = 0
        for s, (fresh, _, (named_ids, names), list_writes) in enumerate(states):
            for i in fresh.tolist():
                owners.setdefault(i, []).append(s)
            for lst, n in list_writes.items():
                if 0 <= lst < len(self.list_shards) and s in self.list_shards[lst]:
                    self.replica_writes[lst, 0 if self.list_shards[lst, 0] == s else 1] = n
            self.named.update((n, i) for i, n in zip(named_ids.tolist(), names) if i >= NAMED_IDS)
        self.next_named = max(self.named.values(), default=NAMED_IDS - 1) + 1
        with self._lock:
            self.fresh_owner, self.fresh_groups, self.fresh_count[:] = {}, {}, 0
        for i, o in owners.items():
            self._set_fresh(i, tuple(o))
        tomb = np.concatenate([t for _, t, _, _ in states]) if states else np.empty(0, np.int64)
        self.base_gone = set()
        if len(tomb):
            uniq, times = np.unique(tomb, return_counts=True)
            held = np.array([len(h) for h in self._base_holders(uniq)])
            self.base_gone = set(uniq[times >= held].tolist())
        self._changed()

    # -- documents (sharded_docs.py) ---------------------------------------------------------------

    def documents(self, ids, with_vectors: bool = False) -> dict[int, tuple]:
        """id -> (name, text, metadata, vector or None) of those of these ids that are live, each asked of one live
        shard holding it. UnavailableError (503) when every shard holding one of them is down."""
        ids = np.asarray(ids, dtype=np.int64)
        with self._write_lock:
            holders = [set(b) | set(self.fresh_owner.get(i, ())) for i, b in zip(ids.tolist(), self._base_holders(ids))]
        asks: dict[int, list[int]] = {}
        down: set[int] = set()
        for i, h in zip(ids.tolist(), holders):
            live = sorted(s for s in h if self.alive[s])
            if live:
                asks.setdefault(min(live, key=lambda s: self.outstanding[s]), []).append(i)
            else:
                down |= h
        self._refuse_if_down(down, "reading documents")
        out: dict[int, tuple] = {}
        for got in self._write_round({s: ("documents", (np.asarray(a, np.int64), with_vectors))
                                      for s, a in asks.items()}, "reading documents", False).values():
            out.update(got)
        return out

    def _every_shard(self, method: str, args: tuple, what: str) -> list:
        """One call to every shard; UnavailableError (503) when one is down (its documents cannot be left out)."""
        self._refuse_if_down(range(self.n_shards), what)
        got = self._write_round({s: (method, args) for s in range(self.n_shards)}, what, False)
        return [got[s] for s in range(self.n_shards)]

    def matching(self, where: tuple[str, list]) -> np.ndarray:
        """Sorted ids of the documents a compiled metadata filter passes."""
        found = self._every_shard("matching", (where,), "a metadata filter")
        return np.unique(np.concatenate(found)).astype(np.int64) if found else np.empty(0, np.int64)

    def text_search(self, texts: list[str], limit: int, where: tuple[str, list] | None = None,
                    global_stats: bool = True) -> tuple[list, list[int]]:
        """Per text, the ids of the `limit` documents whose texts match it best by BM25, best first, with their
        scores (lower is better), and the shards that could not be asked (down: their documents are missing
        from the answers). global_stats (the default): two rounds, as a search engine's distributed term
        statistics: every live shard's counts (documents, tokens, documents matching each word) summed, then
        each shard's documents scored with the sums, so a document scores what it would in one collection
        holding them all (a document on two shards, its list replicated, counted once: by the shard that took its
        write first, or, that one down, by the other; a shard found down in the round, the round is asked again of
        the others). False: each shard
        scores with its own counts (one round; scores of shards of different topics do not compare well).
        A document two shards hold keeps its better score."""
        live = [s for s in range(self.n_shards) if self.alive[s]]
        if not live:
            raise UnavailableError(f"{self.path}: text search refused: every shard is down")
        texts = list(texts)
        stats = None
        if global_stats:
            while True:  # each shard leaves out the documents another one asked counts: asked again if one fails
                got, failed = self._round({s: ("text_stats", (texts, live)) for s in live})
                live = sorted(got)
                if not failed or not live:
                    break
            stats = sum_text_stats(list(got.values()), len(texts))
        got, _ = self._round({s: ("text_search", (texts, int(limit), where, stats)) for s in live})
        missing = sorted(set(range(self.n_shards)) - set(got))
        return [best_text_hits([found[i] for found in got.values()], limit) for i in range(len(texts))], missing

    def _round(self, sends: dict[int, tuple]) -> tuple[dict, list[int]]:
        """One call per shard, in parallel: {shard: (method, args)}; ({shard: answer} of those that answered, the
        shards found down, each marked so). Any other error is raised."""
        handles = {s: self._call(s, method, *args) for s, (method, args) in sends.items()}
        out, failed = {}, []
        for s, h in handles.items():
            try:
                out[s] = self._get(h)
            except Exception as e:  # noqa: BLE001
                if not _is_down(e):
                    raise
                self._mark_down(s)
                failed.append(s)
        return out, failed

    def page(self, after: int, limit: int, where: tuple[str, list] | None = None,
             with_vectors: bool = False) -> tuple[list[tuple], int | None]:
        """(id, name, text, metadata, vector or None) of the first `limit` documents with id > after (those a
        compiled filter passes), in id order, and the id to continue after (None at the end)."""
        merged: dict[int, tuple] = {}
        for found in self._every_shard("page", (int(after), int(limit) + 1, where, with_vectors), "listing documents"):
            for d in found:
                merged.setdefault(int(d[0]), d)
        order = sorted(merged)
        page = [merged[i] for i in order[:limit]]
        return page, (order[limit - 1] if len(order) > limit else None)

    def field_types(self, key: str) -> set[str]:
        """The types under which documents hold a metadata key, over the live shards."""
        live = [s for s in range(self.n_shards) if self.alive[s]]
        got = self._write_round({s: ("field_types", (key,)) for s in live}, "reading field types", False)
        return set().union(*got.values()) if got else set()

    # -- merges ------------------------------------------------------------------------------------

    def merge_shards(self, min_fresh: int = 1, shards=None) -> dict[int, dict]:
        """Fold the fresh tier and tombstones of each live shard holding at least min_fresh fresh rows and
        tombstones (or of each of `shards`) into a new generation of its index (ShardServer.merge, sharded_merge.py), in parallel;
        searches and writes go on meanwhile. The router's maps then follow (what was fresh is in the shards'
        indexes now), and its default search settings are measured again where the index has grown past its
        calibration (calibrate()). Returns each shard's report; one that goes down meanwhile is marked down and
        left out."""
        if shards is None:
            live = [s for s in range(self.n_shards) if self.alive[s]]
            state = self._write_round({s: ("where", ()) for s in live}, "asking what to merge", False)
            todo = [s for s, w in state.items() if w["fresh"] + w["tombstones"] >= min_fresh]
        else:
            todo = [s for s in shards if self.alive[s]]
        # In this process merges get threads of their own: the pool's stay free for searches and writes.
        pool = None if self.use_ray else ThreadPoolExecutor(max_workers=max(1, len(todo)),
                                                             thread_name_prefix="fusionrag-merge")
        handles = {s: self._call(s, "merge") if pool is None else _Future(pool.submit(self.shards[s].merge))
                   for s in todo}
        if pool is not None:
            pool.shutdown(wait=False)
        out = {}
        for s, h in handles.items():
            try:  # no call timeout: a merge takes as long as its shard's fresh tier asks
                if self.use_ray:
                    import ray

                    out[s] = ray.get(h)
                else:
                    out[s] = h.get()
            except Exception as e:  # noqa: BLE001
                if not _is_down(e):
                    raise
                self._mark_down(s)
        merged = [s for s, r in out.items() if r.get("merged")]
        if merged:
            with self._write_lock:
                for s in merged:
                    self.base_ids[s] = load_global_ids(current_part(self.shard_paths[s])[0])
                if self.alive.all():
                    self._load_write_maps()
                else:  # the maps are rebuilt when the down shard is back; the merged ones hold no fresh rows now
                    self.fresh_count[merged] = 0
                    self._base_count = None
                    self._changed()
        # Grown (or shrunk) past what the router's calibration measured: measured again, as a single index's merge
        # does (calibrate.merge_remeasures); with every shard up, since the truth needs all of them. Checked at
        # every call, not only after a merge, so a calibration cut short (a shard down) is tried again.
        built = self.manifest.get("build_config") or {}
        if self.alive.all() and merge_remeasures(self.manifest, self.live_count(), built.get("calibrate", False)):
            self.calibrate()
        return out

    def calibrate(self, sample_queries: np.ndarray | None = None, queries: int | None = None,
                  target: float | None = None) -> dict:
        """Measure this index's default search settings again through its shards (calibrate.calibrate_open_sharded:
        on a query log where given, else on rows of its live vectors, written ones included), write them into
        the router's manifest (search_defaults, calibration) and search with them from now on. queries, target:
        calibrate_queries and target_recall (the build's, where None). Returns the calibration."""
        config, built = config_of(self.manifest, queries, target)
        log = None if sample_queries is None else sample_query_matrix(sample_queries, self.dim, self.metric)
        cal = calibrate_open_sharded(self, config.calibrate_queries, config.target_recall, built.get("seed", 0), log)
        self.manifest = {**self.manifest, **write_calibration(self.path, cal)}
        self.params = SearchParams(**cal["params"])
        self._changed()
        return cal

    # -- faults ------------------------------------------------------------------------------------

    def kill_shard(self, s: int) -> None:
        """Stop shard s as a crash would (tests, drills): its actor killed, or its object closed. Its directory,
        log included, stays; restart_shard brings it back."""
        if self.use_ray:
            import ray

            ray.kill(self.shards[s], no_restart=True)
        else:
            self.shards[s].close()

    def check_shards(self) -> np.ndarray:
        """Ask every shard whether it runs; marks those that do not down. Returns the alive mask."""
        for s in range(self.n_shards):
            try:
                self._get(self._call(s, "where"))
            except Exception as e:  # noqa: BLE001
                if not _is_down(e):
                    raise
                self._mark_down(s)
        return self.alive.copy()

    def heal(self) -> list[int]:
        """Restart every shard marked down (restart_shard); returns those that came back. One that cannot be
        restarted now stays down, and is tried again at the next call."""
        back = []
        for s in np.flatnonzero(~self.alive).tolist():
            try:
                self.restart_shard(s)
            except Exception:  # noqa: BLE001 - its node may be gone for now; logged, retried at the next heal
                log.warning("sharded index %s: cannot restart %s yet", self.path, part_name(s), exc_info=True)
                continue
            back.append(s)
        return back

    def restart_shard(self, s: int) -> dict:
        """Re-create shard s from its directory (its index, and its log replayed), on another alive node than the
        one it ran on where there is one (that node may be dying: _start_actor), and route to it again. Returns
        where it runs."""
        path = self.shard_paths[s]
        if self.use_ray:
            import ray

            try:
                ray.kill(self.shards[s], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            # Hard affinity (_start_actor): with a soft one, the node-crash test saw the head's raylet hand the lease
            # on to the killed node, and the GCS exit when that node was declared dead.
            shard = _start_actor(path, self.config, self.params, self.actor_options, s,
                                 avoid=self.where[s].get("node_id"))
            where = ray.get(shard.where.remote())
        else:
            try:
                self.shards[s].close()
            except Exception:  # noqa: BLE001
                pass
            shard = ShardServer(path, self.config, self.params)
            where = shard.where()
        gen_dir, rec = current_part(path)
        want = rec["count"] if rec else self.manifest["parts"][part_name(s)]["count"]
        if where["count"] != want:
            raise IndexFormatError(f"{path}: the restarted shard holds {where['count']} vectors, the router expects "
                                   f"{want}")
        with self._write_lock:
            self.shards[s] = shard
            self.where[s] = where
            self.base_ids[s] = load_global_ids(gen_dir)
            with self._lock:
                self.outstanding[s] = 0
                self.alive[s] = True
                self.version += 1
            self._load_write_maps()
        return where

    def close(self) -> None:
        if self.use_ray:
            import ray

            for s in self.shards:
                ray.kill(s)
        else:
            self._pool.shutdown()
            for s in self.shards:
                if not s.closed:
                    s.close()
        self.shards = []
