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

Writes (sharded/writes.py): each shard owns a log and a fresh tier; an upsert goes to the live shards holding
the vector's nearest list, a delete to every shard holding the id; a shard's answers merge its index's top-k
with its fresh tier's exact top-k. Faults: a shard that does not answer is marked down and its lists go to
their other replica; lists no live shard holds are reported per query (missing_lists), and restart_shard
re-creates a shard from its directory, its log replayed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.engine.build import sample_query_matrix
from fusionrag.retriever.engine.calibrate import config_of, merge_remeasures, search_defaults, write_calibration
from fusionrag.retriever.engine.config import EngineConfig, SearchParams, cpu_threads, resolve_params
from fusionrag.retriever.engine.index import prepare_queries
from fusionrag.retriever.engine.learned_probe import load_probe_model
from fusionrag.retriever.engine.manifest import MANIFEST, ManifestShape, load_array, read_manifest
from fusionrag.retriever.engine.tiers import NavigationTier, recorded_navigation
from fusionrag.retriever.errors import ConfigError, IndexFormatError, InputError, UnavailableError
from fusionrag.retriever.sharded.actors import LocalShards, RayShards, is_down
from fusionrag.retriever.sharded.generations import current_part, load_global_ids
from fusionrag.retriever.sharded.parts import NAMED_IDS, ROUTER_FILES, UPSERT_PROBE, is_sharded, merge_topk, part_name
from fusionrag.retriever.sharded.shard import MISSING, ShardReads, best_text_hits, sum_text_stats

log = logging.getLogger(__name__)


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




class ShardedIndex(ManifestShape):
    """A sharded index, opened: the router in this process, the shards as Ray actors (ray=True) or as
    objects in this process (ray=False: the same code, threads for the shards). Thread-safe."""

    def __init__(self, path: Path, manifest: dict, nav: NavigationTier, list_shards: np.ndarray,
                 list_local: np.ndarray, list_sizes: np.ndarray, shards: list, kind: LocalShards | RayShards,
                 params: SearchParams, batch_size: int):
        self.path, self.manifest, self.nav = path, manifest, nav
        self.list_shards, self.list_local, self.list_sizes = list_shards, list_local, list_sizes
        # How the shards are reached (sharded/actors.py): Ray actors, or objects in this process.
        self.shards, self.shard_kind, self.params, self.batch_size = shards, kind, params, batch_size
        self.n_shards = len(shards)
        self._lock = threading.Lock()
        self.outstanding = np.zeros(self.n_shards, dtype=np.int64)  # list-size units sent, not yet answered
        self.alive = np.ones(self.n_shards, dtype=bool)
        # Writes one at a time: the router's maps follow the shards' logs. Public: a caller that reads the name map
        # (named, next_named) and then writes by it (ShardedCollection) holds it across both.
        self.write_lock = threading.RLock()
        self._merge_lock = threading.Lock()  # merges one at a time, none while quiesced() holds the files still
        self.fresh_owner: dict[int, tuple[int, ...]] = {}  # id -> the shards whose fresh tier holds it
        # How many fresh ids each set of owners holds (under _lock): what a search asks when a shard is down, read
        # without the write lock and without a pass over every fresh id.
        self.fresh_groups: dict[tuple[int, ...], int] = {}
        self.base_gone: set[int] = set()  # built ids deleted or replaced (tombstoned on their shards)
        # A document's name -> its id (sharded/docs.py): every name a shard's doc store holds. built_named: the build
        # named its vectors (a documents sidecar), so a name of digits names a document, not the id it spells.
        self.named: dict[str, int] = {}
        self.built_named = bool(manifest.get("documents", False))
        # Upserts each replica of each list logged (column j: list_shards[:, j]): the one with fewer missed some.
        self.replica_writes = np.zeros((len(list_shards), 2), dtype=np.int64)
        self.next_named = NAMED_IDS  # the id the next new such name gets
        self._base_count: int | None = None  # distinct ids in the shards' indexes (live_count)
        self.fresh_count = np.zeros(self.n_shards, dtype=np.int64)
        self.call_timeout_s: float | None = None
        # What a following router's searches read of the state above (view(), sharded/follow.py) changed since
        # (epoch, version): epoch is this process's, version counts the changes (under _lock).
        self.epoch, self.version = os.urandom(8).hex(), 0
        self._views: tuple[int, dict] | None = None  # the last view built, by version
        self._closed = False  # close() began: a call to a shard is refused (UnavailableError), not sent

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
        kind = RayShards.connected(actor_options) if ray else LocalShards(len(shard_paths))
        shards, where = kind.open_all(path, shard_paths, config, params)
        for s, (name, w) in enumerate(zip(names, where)):
            if w["count"] != expected[name]:
                kind.stop(shards)
                raise IndexFormatError(f"{path}: shard part {name} holds {w['count']} vectors, the router expects "
                                       f"{expected[name]}")
        nav = NavigationTier(graph, metric == "ip", cpu_threads(config.threads), navigation, None, list_sizes)
        out = cls(path, m, nav,
                  list_shards, list_local, list_sizes, shards, kind, params, batch_size)
        out.where, out.config, out.shard_paths = where, config, shard_paths
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
        shards = self.shards
        self._check_open()
        try:
            return self.shard_kind.call(shards[s], method, *args)
        except (RuntimeError, IndexError) as e:  # the threads shut down ("cannot schedule new futures after shutdown")
            self._check_open(e)
            raise

    def _check_open(self, cause: BaseException | None = None) -> None:
        """UnavailableError (503) once close() has begun: a call that would reach a shard then is refused, rather
        than failing on the shards' threads shut down under it. (A collection that holds the index, hosted.py,
        waits for its calls in progress before it closes the index, and refuses later ones itself.)"""
        if self._closed:
            raise UnavailableError(f"{self.path}: the sharded index is closed") from cause

    def _get(self, handle):
        return self.shard_kind.get(handle, self.call_timeout_s)

    def _mark_down(self, s: int) -> None:
        with self._lock:
            self.alive[s] = False
            self.version += 1

    def _changed(self) -> None:
        with self._lock:
            self.version += 1

    def view(self, epoch: str | None = None, version: int = -1) -> dict | None:
        """What a router following this one needs for its searches (ShardedFollower, sharded/follow.py): None
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
               _again: bool = True, **overrides) -> ShardedResult:
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
                        if not is_down(e):
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
                ids[sl], dists[sl] = merge_topk(parts, k)
        if errors:
            s, e = errors[0]
            raise UnavailableError(f"{self.path}: shard {part_name(s)} did not answer: {e}") from e
        short = np.flatnonzero((ids >= 0).sum(1) < k) if _again and reads is not None and reads.where is not None \
            else np.empty(0, np.int64)
        if len(short):
            # Vectors a filter excludes can empty the lists probed: queries left short probe every list, as a
            # collection's do (Collection._search_main), the ratio rule off (it would still cut the far ones).
            again = self.search(q[short], k, p.with_overrides(nprobe=len(self.list_shards), probe="ratio",
                                                             probe_ratio=0.0), partial=True, reads=reads, _again=False)
            ids[short], dists[short] = again.ids, again.distances
            docs.update(again.docs or {})
            for key in ("candidates", "reranked", "lists_probed"):
                stats[key][short] += again.stats[key]
            for i, m in zip(short.tolist(), again.missing_lists):
                missing[i] = set(m.tolist())
            missing_shards.update(again.missing_shards)
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
        """named: ids from NAMED_IDS up (those of documents named by a string, sharded/docs.py) allowed."""
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
        with self.write_lock:
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
        with self.write_lock:
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
        with self.write_lock:
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
            self.named.update(zip(names, named_ids.tolist()))
        self.next_named = max((i for i in self.named.values() if i >= NAMED_IDS), default=NAMED_IDS - 1) + 1
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

    # -- documents (sharded/docs.py) ---------------------------------------------------------------

    def documents(self, ids, with_vectors: bool = False) -> dict[int, tuple]:
        """id -> (name, text, metadata, vector or None) of those of these ids that are live, each asked of one live
        shard holding it. UnavailableError (503) when every shard holding one of them is down."""
        ids = np.asarray(ids, dtype=np.int64)
        with self.write_lock:
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

    def memory(self) -> dict:
        """Bytes held per tier over the shards that answer now (each shard's Index.memory(), summed; a shard down
        is left out, and `shards_counted` says how many were summed), the router's navigation graph counted in
        host_index_bytes."""
        out, _ = self._round({s: ("where", ()) for s in range(self.n_shards) if self.alive[s]})
        tiers: dict[str, int] = {"host_index_bytes": int(self.nav.memory_bytes())}
        for w in out.values():
            for key, value in w.get("memory", {}).items():
                tiers[key] = tiers.get(key, 0) + int(value)
        tiers["shards_counted"] = len(out)
        return tiers

    def every_shard(self, method: str, args: tuple, what: str) -> list:
        """One call to every shard; UnavailableError (503) when one is down (its documents cannot be left out)."""
        self._refuse_if_down(range(self.n_shards), what)
        got = self._write_round({s: (method, args) for s in range(self.n_shards)}, what, False)
        return [got[s] for s in range(self.n_shards)]

    def matching(self, where: tuple[str, list]) -> np.ndarray:
        """Sorted ids of the documents a compiled metadata filter passes."""
        found = self.every_shard("matching", (where,), "a metadata filter")
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
                if not is_down(e):
                    raise
                self._mark_down(s)
                failed.append(s)
        return out, failed

    def page(self, after: int, limit: int, where: tuple[str, list] | None = None,
             with_vectors: bool = False) -> tuple[list[tuple], int | None]:
        """(id, name, text, metadata, vector or None) of the first `limit` documents with id > after (those a
        compiled filter passes), in id order, and the id to continue after (None at the end)."""
        merged: dict[int, tuple] = {}
        for found in self.every_shard("page", (int(after), int(limit) + 1, where, with_vectors), "listing documents"):
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
        tombstones (or of each of `shards`) into a new generation of its index (ShardServer.merge, sharded/generations.py), in parallel;
        searches and writes go on meanwhile. The router's maps then follow (what was fresh is in the shards'
        indexes now), and its default search settings are measured again where the index has grown past its
        calibration (calibrate()). Returns each shard's report; one that goes down meanwhile is marked down and
        left out."""
        with self._merge_lock:
            return self._merge_shards(min_fresh, shards)

    def _merge_shards(self, min_fresh: int, shards) -> dict[int, dict]:
        if shards is None:
            live = [s for s in range(self.n_shards) if self.alive[s]]
            state = self._write_round({s: ("where", ()) for s in live}, "asking what to merge", False)
            todo = [s for s, w in state.items() if w["fresh"] + w["tombstones"] >= min_fresh]
        else:
            todo = [s for s in shards if self.alive[s]]
        self._check_open()
        handles = {s: self.shard_kind.call_apart(self.shards[s], "merge") for s in todo}
        out = {}
        for s, h in handles.items():
            try:  # no call timeout: a merge takes as long as its shard's fresh tier asks
                out[s] = self.shard_kind.get(h)
            except Exception as e:  # noqa: BLE001
                if not is_down(e):
                    raise
                self._mark_down(s)
        merged = [s for s, r in out.items() if r.get("merged")]
        if merged:
            with self.write_lock:
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
        from fusionrag.retriever.sharded.calibrate import calibrate_open_sharded

        cal = calibrate_open_sharded(self, config.calibrate_queries, config.target_recall, built.get("seed", 0), log)
        self.manifest = {**self.manifest, **write_calibration(self.path, cal)}
        self.params = SearchParams(**cal["params"])
        self._changed()
        return cal

    # -- faults ------------------------------------------------------------------------------------

    def kill_shard(self, s: int) -> None:
        """Stop shard s as a crash would (tests, drills): its actor killed, or its object closed. Its directory,
        log included, stays; restart_shard brings it back."""
        self.shard_kind.kill(self.shards[s])

    def check_shards(self) -> np.ndarray:
        """Ask every shard whether it runs; marks those that do not down. Returns the alive mask."""
        for s in range(self.n_shards):
            try:
                self._get(self._call(s, "where"))
            except Exception as e:  # noqa: BLE001
                if not is_down(e):
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
        one it ran on where there is one (that node may be dying: start_actor), and route to it again. Returns
        where it runs."""
        path = self.shard_paths[s]
        shard, where = self.shard_kind.restart(self.shards[s], path, self.config, self.params, s,
                                         avoid=self.where[s].get("node_id"))
        gen_dir, rec = current_part(path)
        want = rec["count"] if rec else self.manifest["parts"][part_name(s)]["count"]
        if where["count"] != want:
            raise IndexFormatError(f"{path}: the restarted shard holds {where['count']} vectors, the router expects "
                                   f"{want}")
        with self.write_lock:
            self.shards[s] = shard
            self.where[s] = where
            self.base_ids[s] = load_global_ids(gen_dir)
            with self._lock:
                self.outstanding[s] = 0
                self.alive[s] = True
                self.version += 1
            self._load_write_maps()
        return where

    @contextlib.contextmanager
    def quiesced(self):
        """Hold the index's files still: no merge, no write (each waits) until the block ends; searches go on. What
        a snapshot copies the files under."""
        with self._merge_lock, self.write_lock:
            yield

    def close(self) -> None:
        """Refuse the calls that come next (UnavailableError), then stop the shards: their threads end once the
        calls already sent have answered, and the shards close after them."""
        self._closed = True
        self.shard_kind.stop(self.shards)
        self.shards = []
