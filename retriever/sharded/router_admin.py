"""The administration of the sharded router (ShardedIndex, sharded/router.py): RouterAdmin, the part of ShardedIndex
that merges the shards' fresh tiers into their indexes, measures the default search settings again, finds shards
down and restarts them, and holds the files still for a snapshot (quiesced).

Faults: a shard that does not answer is marked down and its lists go to their other replica; lists no live shard
holds are reported per query (missing_lists), and restart_shard re-creates a shard from its directory, its log
replayed; heal restarts every shard marked down.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from fusionrag.retriever.engine.calibrate import config_of, merge_remeasures, set_defaults, write_calibration
from fusionrag.retriever.engine.config import search_defaults
from fusionrag.retriever.engine.vectors import sample_query_matrix
from fusionrag.retriever.errors import IndexFormatError
from fusionrag.retriever.sharded.actors import is_down
from fusionrag.retriever.sharded.calls import ShardCall
from fusionrag.retriever.sharded.generations import current_part, load_global_ids
from fusionrag.retriever.sharded.parts import part_name, shards_resident

log = logging.getLogger("fusionrag.retriever.sharded.router")  # the router's log, as before its parts were apart


class RouterAdmin:
    """ShardedIndex's merges, calibration and faults (mixed into it: it reads the router's state and calls its
    shards through ShardedIndex's plumbing, sharded/router.py)."""

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
            state = self._write_round([ShardCall(s, "where") for s in live], "asking what to merge", False)
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
                    self.load_write_maps()
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
        the router's manifest (search_defaults, search_defaults_ram, calibration) and search with them from now on
        (those for RAM where every shard holds its raw vectors there). queries, target: calibrate_queries and
        target_recall (the build's, where None). Returns the calibration."""
        config, built = config_of(self.manifest, queries, target)
        log = None if sample_queries is None else sample_query_matrix(sample_queries, self.dim, self.metric)
        from fusionrag.retriever.sharded.calibrate import calibrate_open_sharded

        cal = calibrate_open_sharded(self, config.calibrate_queries, config.target_recall, built.get("seed", 0), log)
        write_calibration(self.path, cal)
        manifest = dict(self.manifest)
        set_defaults(manifest, cal)
        self.manifest = manifest
        self.params = search_defaults(self.manifest, self.path, shards_resident(self.where))
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
                self._get(self._send(ShardCall(s, "where")))
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
            self.load_write_maps()
        return where

    @contextlib.contextmanager
    def quiesced(self):
        """Hold the index's files still: no merge, no write (each waits) until the block ends; searches go on. What
        a snapshot copies the files under."""
        with self._merge_lock, self.write_lock:
            yield
