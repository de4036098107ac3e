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

ShardedIndex, the router, is this module's class with one part per kind of operation, each a module of its own:
this module opens the index, routes lists to shards, and holds the plumbing every call to a shard goes through
(one call, a round of calls, a shard marked down, the view a following router reads); router_search.py the
vector search (the query path); router_reads.py the reads of documents (by id, pages, filters, text search);
router_writes.py upserts, deletes and the write maps; router_admin.py merges, calibration, faults and quiescing.
A call to a shard is a ShardCall (sharded/calls.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from fusionrag import native
from fusionrag.retriever.engine.config import EngineConfig, SearchParams, calibrated_defaults, cpu_threads
from fusionrag.retriever.engine.index import prepare_queries
from fusionrag.retriever.engine.learned_probe import load_probe_model
from fusionrag.retriever.engine.manifest import MANIFEST, ManifestShape, load_array, read_manifest
from fusionrag.retriever.engine.tiers import NavigationTier, recorded_navigation
from fusionrag.retriever.errors import ConfigError, IndexFormatError, UnavailableError
from fusionrag.retriever.sharded.actors import LocalShards, RayShards, is_down
from fusionrag.retriever.sharded.calls import ShardCall
from fusionrag.retriever.sharded.generations import current_part, load_global_ids
from fusionrag.retriever.sharded.parts import NAMED_IDS, ROUTER_FILES, is_sharded, part_name, shards_resident
from fusionrag.retriever.sharded.router_admin import RouterAdmin
from fusionrag.retriever.sharded.router_reads import RouterReads
from fusionrag.retriever.sharded.router_search import RouterSearch, ShardedResult
from fusionrag.retriever.sharded.router_writes import RouterWrites
from fusionrag.retriever.sharded.shard import MISSING

__all__ = ["ShardedIndex", "ShardedResult"]


class ShardedIndex(RouterSearch, RouterReads, RouterWrites, RouterAdmin, ManifestShape):
    """A sharded index, opened: the router in this process, the shards as Ray actors (ray=True) or as
    objects in this process (ray=False: the same code, threads for the shards). Thread-safe. Its operations are
    in its parts (RouterSearch, RouterReads, RouterWrites, RouterAdmin: the module docstring); its state and its
    calls to shards are here."""

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
        defaults = None if params is not None else calibrated_defaults(m, path)  # what the build's calibration chose
        params = params or defaults[0]
        shard_paths = [str((path / name).resolve()) for name in names]
        kind = RayShards.connected(actor_options) if ray else LocalShards(len(shard_paths))
        shards, where = kind.open_all(path, shard_paths, config, params)
        for s, (name, w) in enumerate(zip(names, where)):
            if w["count"] != expected[name]:
                kind.stop(shards)
                raise IndexFormatError(f"{path}: shard part {name} holds {w['count']} vectors, the router expects "
                                       f"{expected[name]}")
        if defaults is not None and shards_resident(where):
            params = defaults[1]
        nav = NavigationTier(graph, metric == "ip", cpu_threads(config.threads), navigation, None, list_sizes)
        out = cls(path, m, nav,
                  list_shards, list_local, list_sizes, shards, kind, params, batch_size)
        out.where, out.config, out.shard_paths = where, config, shard_paths
        out.call_timeout_s = call_timeout_s
        out.base_ids = [load_global_ids(current_part(p)[0]) for p in shard_paths]
        out.load_write_maps()
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
        return self._send(ShardCall(s, method, args))

    def _send(self, call: ShardCall):
        """Send one call to its shard; the handle its answer comes by (_get)."""
        shards = self.shards
        self._check_open()
        try:
            return self.shard_kind.call(shards[call.shard], call.method, *call.args)
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

    def _round(self, sends: list[ShardCall]) -> tuple[dict, list[int]]:
        """One call per shard, in parallel; ({shard: answer} of those that answered, the shards found down, each
        marked so). Any other error is raised."""
        handles = {call.shard: self._send(call) for call in sends}
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

    def _write_round(self, sends: list[ShardCall], what: str, write: bool = True) -> dict:
        """One call per shard, in parallel; a shard that fails is marked down and the write refused
        (UnavailableError: not acknowledged; retrying it after the shard is back completes it). write=False: a
        read's round, failed the same way."""
        out, failed = self._round(sends)
        if failed:
            err = UnavailableError(f"{self.path}: {what} {'not acknowledged' if write else 'failed'}: shard "
                                   f"{part_name(failed[0])} is down")
            err.acked = set(out)  # the shards that did take it
            raise err
        return out

    def _refuse_if_down(self, shards, what: str) -> None:
        down = sorted(s for s in shards if not self.alive[s])
        if down:
            raise UnavailableError(f"{self.path}: {what} refused: it needs shard(s) "
                                   f"{', '.join(part_name(s) for s in down)}, which are down")

    def every_shard(self, method: str, args: tuple, what: str) -> list:
        """One call to every shard; UnavailableError (503) when one is down (its documents cannot be left out)."""
        self._refuse_if_down(range(self.n_shards), what)
        got = self._write_round([ShardCall(s, method, args) for s in range(self.n_shards)], what, False)
        return [got[s] for s in range(self.n_shards)]

    def close(self) -> None:
        """Refuse the calls that come next (UnavailableError), then stop the shards: their threads end once the
        calls already sent have answered, and the shards close after them."""
        self._closed = True
        self.shard_kind.stop(self.shards)
        self.shards = []
