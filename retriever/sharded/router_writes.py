"""The writes of the sharded router (ShardedIndex, sharded/router.py): RouterWrites, the part of ShardedIndex that
upserts and deletes by id, and keeps the write maps those go by.

Writes (sharded/writes.py): each shard owns a log and a fresh tier; an upsert goes to the live shards holding the
vector's nearest list, a delete to every shard holding the id; a shard's answers merge its index's top-k with its
fresh tier's exact top-k. The router's write maps (which shards' fresh tiers hold an id, which built ids are gone,
the names of documents, how many upserts each replica of a list took) follow the shards' logs: built from them at
opening (load_write_maps), changed by each write under ShardedIndex.write_lock. A write that a shard down would
miss is refused (UnavailableError), not acknowledged.
"""

from __future__ import annotations

import sys

import numpy as np

from fusionrag.retriever.errors import InputError, UnavailableError
from fusionrag.retriever.sharded.calls import ShardCall
from fusionrag.retriever.sharded.parts import NAMED_IDS, UPSERT_PROBE


class RouterWrites:
    """ShardedIndex's writes and write maps (mixed into it: it reads the router's state and calls its shards
    through ShardedIndex's plumbing, sharded/router.py)."""

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

    def _count_upserts(self, to_list: np.ndarray, targets: list[tuple[int, ...]], acked: set[int]) -> None:
        """Count an upsert round's vectors for the replicas of their lists that took them (replica_writes)."""
        for lst, t in zip(to_list.tolist(), targets):
            if lst < 0:
                continue
            for s in t:
                if s in acked:
                    self.replica_writes[lst, 0 if self.list_shards[lst, 0] == s else 1] += 1
        self._changed()  # after the counts: a view built at the new version holds them

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
                self._write_round([ShardCall(s, "upsert", (ids[r], v[r], None if docs is None else
                                                           [tuple(docs[i]) + ((targets[i][0],) if targets[i][0] != s
                                                                              else ()) for i in r], to_list[r]))
                                   for s, r in ups.items()], "upsert")
            finally:  # the shards that took the write counted it for their lists, failed round or not
                self._count_upserts(to_list, targets, getattr(sys.exc_info()[1], "acked", set(ups)))
            if dels:
                self._write_round([ShardCall(s, "delete", (ids[r],)) for s, r in dels.items()], "upsert")
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
                self._write_round([ShardCall(s, "delete", (ids[r],)) for s, r in dels.items()], "delete")
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

    def load_write_maps(self) -> None:
        """The router's maps (which shards' fresh tiers hold an id, which built ids are gone) from the shards'
        replayed logs."""
        self._base_count = None  # the shards' indexes may have changed (a merge, a restart)
        states = [self._get(self._send(ShardCall(s, "write_state"))) for s in range(self.n_shards)]
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
