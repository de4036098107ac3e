"""The sharded build (docs/sharded.md, "Build"): train once at the driver, assign and encode in chunks, write one
shard part per task (Ray tasks when Ray is initialised, this process otherwise: executors.py, chosen once)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.engine.build import (CHUNK_ROWS, IntegralCheck, Rows, assign_rows, index_manifest,
                                              internal_metric, mips_augment, open_source, postings, sample_query_matrix,
                                              save_index_files, train_index, write_pages)
from fusionrag.retriever.collection.docstore import DocStore
from fusionrag.retriever.collection.importer import check_sidecar, first_vector_dim, sidecar_documents, stage_vectors
from fusionrag.retriever.engine.calibrate import calibrate_build
from fusionrag.retriever.engine.config import BuildConfig, SearchParams, cpu_threads
from fusionrag.retriever.engine.learned_probe import lists_of_pairs, save_probe_model, train_probe_model
from fusionrag.retriever.engine.manifest import MANIFEST, writing_index
from fusionrag.retriever.engine.pq import ProductQuantizer
from fusionrag.retriever.engine.tiers import NavigationTier, build_navigation
from fusionrag.retriever.engine.vectors import STORAGE_DTYPES, as_source
from fusionrag.retriever.errors import ConfigError, InputError
from fusionrag.retriever.progress import OnProgress, Progress
from fusionrag.retriever.sharded.executors import LocalExecutor, RayExecutor, executor_for
from fusionrag.retriever.sharded.parts import KIND, PLACEMENTS, part_name
from fusionrag.retriever.sharded.placement import place_lists, sample_visits
from fusionrag.retriever.sharded.writes import DOCS

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Build


def _assign_range(source, metric: str, graph_path: str, codebooks: np.ndarray, dim: int, config: BuildConfig,
                  lo: int, hi: int, threads: int, leaves: np.ndarray | None = None):
    """Step 4 of the build for rows lo..hi-1 (a Ray task, or called in this process); leaves: those rows' leaves of
    the clustering, where their graph searches start (build.assign_rows)."""
    rows = Rows(as_source(source), metric)
    graph = native.Graph.load(graph_path)
    # As the router's queries find lists (build.assign_rows); config.navigation is the build's resolved one.
    exact = graph.vectors() if build_navigation(config.navigation, graph.size, graph.dim) == "exact" else None
    pq = ProductQuantizer(codebooks, dim)
    integral = IntegralCheck(rows.src.dtype, metric)
    out = []
    for s in range(lo, hi, CHUNK_ROWS):
        ids = np.arange(s, min(hi, s + CHUNK_ROWS))
        x = rows(ids)
        integral.update(x)
        out.append(assign_rows(graph, pq, ids, x, config, threads, exact,
                               None if leaves is None else leaves[s - lo:s - lo + len(ids)]))
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


def _write_documents(path: Path, plan: _ShardPlan, documents: str, owners: np.ndarray, rows: Rows, dim: int) -> int:
    """The shard's doc store (sharded/writes.py's DOCS, as its writes make it) holding the documents of its built
    vectors, read from the sidecar (line i: row i's id, text, metadata), each under its global id, with its
    vector as the engine holds it; a document another shard counts in BM25's statistics (owners[j]: the first
    shard of its vector's nearest list) marked so. Returns how many."""
    store = DocStore(path, dim, create=True)
    try:
        store.begin()
        gids = plan.global_ids.astype(np.int64)
        row = 0
        for chunk in sidecar_documents(Path(documents)):
            lo, hi = np.searchsorted(gids, [row, row + len(chunk)])
            if hi > lo:
                mine = gids[lo:hi]
                picked = [chunk[i - row] for i in mine.tolist()]
                ids, texts, metas = (list(x) for x in zip(*picked))
                store.insert(mine.tolist(), ids, texts, metas, rows(mine))
                guest = owners[lo:hi] != plan.index
                if guest.any():
                    store.mark_text_guests(mine[guest].tolist(), owners[lo:hi][guest].tolist())
            row += len(chunk)
        store.commit(0, 0)
        store.make_durable()
    except BaseException:
        store.rollback()
        raise
    finally:
        store.close()
    return len(plan.global_ids)


def _write_shard(part_dir: str, plan: _ShardPlan, source, metric: str, store_dtype: str, centroids: np.ndarray,
                 codebooks: np.ndarray, codes: np.ndarray, config: BuildConfig, threads: int, n_shards: int,
                 documents: str | None = None, owners: np.ndarray | None = None) -> dict:
    """One shard part: an ordinary index directory of the shard's lists (a Ray task, or called here); with
    documents (a sidecar's path, every node seeing it), the doc store of its built vectors' documents beside it."""
    t = time.perf_counter()
    src = as_source(source)
    rows = Rows(src, metric)
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
        if documents is not None:
            _write_documents(w.path(DOCS), plan, documents, owners, rows, dim)
        manifest = index_manifest(n, dim, metric, store_dtype, src, len(plan.lists), len(plan.list_ids), pq, config,
                                  {"total_s": time.perf_counter() - t}, navigation=navigation, pages=layout,
                                  shard={"index": plan.index, "of": n_shards})
        w.publish(manifest)
    return manifest


def build_sharded(source, out_dir, shards: int, config: BuildConfig = BuildConfig(), placement: str = "hotness",
                  replicate: float = 0.02, sample_queries=None, num_sample_queries: int = 2000,
                  params: SearchParams = SearchParams(), use_ray: bool | None = None,
                  progress: bool | None = None, overwrite: bool = False,
                  on_progress: OnProgress | None = None, probe_model: bool = True, documents=None,
                  embedding: str | None = None) -> dict:
    """Build a sharded index of `source` (a vector file path or a 2-D array) with `shards` shard parts.

    documents: a JSON-lines file, line i describing vector i ({"id", "text", "metadata"}; the id the row number
    where a line has none), as a collection's import takes beside a vector file: the built vectors are then
    those documents, found, fetched, filtered and replaced by their ids (sharded/docs.py), not the unnamed rows
    "0", "1", ... (checked whole before anything is built). With source None the documents are the source, as a
    collection's import of JSON lines takes them: a line's "vector", else its text embedded by `embedding`.

    embedding: the model (a name get_embedder knows) that made the vectors: recorded in the router's manifest, so
    the sharded collection embeds the texts written or searched without a vector, as a collection with a model
    does; its dimension must be the source's.

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
    executor = executor_for(use_ray, cpu_threads(config.threads))
    embedder = None
    if embedding is not None:
        from fusionrag.retriever.collection.embedding import canonical_name, get_embedder

        embedding = canonical_name(embedding)
        embedder = get_embedder(embedding)
    if source is not None:
        return _build_sharded(source, out_dir, shards, config, placement, replicate, sample_queries,
                              num_sample_queries, params, executor, progress, overwrite, on_progress, probe_model,
                              documents, embedder, t_start)
    if documents is None:
        raise ConfigError("build_sharded: give a vector source, or documents (JSON lines) to take the vectors from")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:  # before the embedding, the build's longest step here
        raise FileExistsError(f"{out_dir} already exists (pass overwrite to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Beside the index (on storage every node sees, as the index is), named as a build's temporary directory, so a
    # killed build's is removed by the next build of the same target.
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        vectors = staging / "vectors.npy"
        dim = embedder.dim if embedder is not None else first_vector_dim(Path(documents))
        stage_vectors(Path(documents), None, vectors, Progress(progress, on_progress), embedder, dim, config.metric,
                      f"the sharded build of {out_dir.name!r}")
        return _build_sharded(str(vectors), out_dir, shards, config, placement, replicate, sample_queries,
                              num_sample_queries, params, executor, progress, overwrite, on_progress, probe_model,
                              documents, embedder, t_start, vectors_in_lines=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build_sharded(source, out_dir, shards, config, placement, replicate, sample_queries, num_sample_queries,
                   params, executor: LocalExecutor | RayExecutor, progress, overwrite, on_progress, probe_model,
                   documents, embedder, t_start, vectors_in_lines: bool = False) -> dict:
    src = open_source(source)
    n, dim = src.count, src.dim
    if embedder is not None and embedder.dim != dim:
        raise InputError(f"embedding model {embedder.name!r} makes {embedder.dim}-dimensional vectors, the source's "
                         f"are {dim}-dimensional")
    if documents is not None:
        documents = str(Path(documents).resolve())
        check_sidecar(Path(documents), n, vectors_in_lines)
    metric = config.metric
    threads = cpu_threads(config.threads)
    rng = np.random.default_rng(config.seed)
    rows = Rows(src, metric)
    timings: dict = {}
    steps = Progress(progress, on_progress)

    centroids, graph, assign_graph, pq, leaf_of = train_index(rows, n, dim, config, rng, threads, steps, timings)
    n_lists = len(centroids)
    navigation = build_navigation(config.navigation, graph.size, graph.dim)
    part_config = config.with_overrides(navigation=navigation)  # what assigning and the parts follow
    if shards > n_lists:
        raise ConfigError(f"shards ({shards}) exceed the {n_lists} posting lists of {n} vectors")

    with writing_index(Path(out_dir), overwrite) as w:
        # 4. Assign and encode, chunks of the source in parallel.
        t = time.perf_counter()
        integral = IntegralCheck(src.dtype, metric)
        graph_path = str(w.path("assign-graph.tmp"))
        assign_graph.save(graph_path)
        del assign_graph
        ranges = executor.ranges(list(range(0, n, CHUNK_ROWS)) + [n])
        results = {}
        with steps.step("assigning", n) as update:
            src_ref, cb_ref = executor.source(source), executor.put(pq.codebooks)
            calls = (((lo, hi), (src_ref, metric, graph_path, cb_ref, dim, part_config, lo, hi, executor.threads,
                                 leaf_of[lo:hi])) for lo, hi in ranges)
            for (lo, hi), result in executor.map(_assign_range, calls):
                results[lo] = result
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
        # Who counts a built document on two shards (its vector in lists of both) in BM25's statistics: the first
        # shard of its nearest list, as an upsert's document is counted by the first shard it goes to.
        owners = plan.shards[primary, 0].astype(np.int64) if documents is not None else None

        # 5-6. The shard parts, in parallel.
        t = time.perf_counter()
        store_dtype = STORAGE_DTYPES[integral.dtype() or rows.dtype]
        shard_manifests = {}
        with steps.step("writing shards", shards, "shard") as update:
            shared = (executor.source(source), executor.put(centroids), executor.put(pq.codebooks))
            calls = ((sp.index, (str(w.dir / part_name(sp.index)), sp, shared[0], metric, store_dtype, shared[1],
                                 shared[2], codes[sp.global_ids], part_config, executor.threads, shards, documents,
                                 None if owners is None else owners[sp.global_ids])) for sp in shard_plans)
            for index, part in executor.map(_write_shard, calls):
                shard_manifests[index] = part
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
            kind=KIND, shards=shards, documents=documents is not None,
            placement={"kind": placement, "replicate": replicate if placement != "round-robin" else 0.0,
                       "replicated_lists": int((plan.shards[:, 1] >= 0).sum()),
                       "sample_queries": int(len(queries)), "probe": params.to_dict(),
                       "expected_work": [float(x) for x in expected],
                       "expected_imbalance": float(expected.max() / expected.mean()),
                       "built_with": executor.kind},
            parts={part_name(s): {"manifest_sha256": hashlib.sha256(
                (w.dir / part_name(s) / MANIFEST).read_bytes()).hexdigest(),
                "count": shard_manifests[s]["count"], "lists": shard_manifests[s]["centroids"]}
                for s in range(shards)})
        if probe_info is not None:
            manifest["probe_model"] = probe_info
        if embedder is not None:
            manifest["embedding"] = embedder.name
        if config.calibrate:  # the router's default search settings, measured on the sharded index as written
            from fusionrag.retriever.sharded.calibrate import calibrate_sharded

            calibrate_build(manifest, w, steps, timings, t_start, lambda d: calibrate_sharded(
                d, rows, n, internal_metric(metric), config.calibrate_queries, config.target_recall, config.seed,
                threads, None if sample_queries is None else queries))
        w.publish(manifest)
    return manifest
