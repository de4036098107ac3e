"""The reads of documents through the sharded router (ShardedIndex, sharded/router.py): RouterReads, the part of
ShardedIndex that sharded/docs.py's ShardedCollection reads by: documents by id, pages of them in id order (a
scroll), the ids a metadata filter passes, the types a metadata key holds, BM25 text search, and the memory the
shards hold. Each is one round of calls to the shards (ShardCall, sharded/calls.py), merged here."""

from __future__ import annotations

import numpy as np

from fusionrag.retriever.errors import UnavailableError
from fusionrag.retriever.sharded.calls import ShardCall
from fusionrag.retriever.sharded.shard import best_text_hits, sum_text_stats


class RouterReads:
    """ShardedIndex's reads of documents (mixed into it: it reads the router's state and calls its shards through
    ShardedIndex's plumbing, sharded/router.py)."""

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
        for got in self._write_round([ShardCall(s, "documents", (np.asarray(a, np.int64), with_vectors))
                                      for s, a in asks.items()], "reading documents", False).values():
            out.update(got)
        return out

    def memory(self) -> dict:
        """Bytes held per tier over the shards that answer now (each shard's Index.memory(), summed; a shard down
        is left out, and `shards_counted` says how many were summed), the router's navigation graph counted in
        host_index_bytes."""
        out, _ = self._round([ShardCall(s, "where") for s in range(self.n_shards) if self.alive[s]])
        tiers: dict[str, int] = {"host_index_bytes": int(self.nav.memory_bytes())}
        for w in out.values():
            for key, value in w.get("memory", {}).items():
                tiers[key] = tiers.get(key, 0) + int(value)
        tiers["shards_counted"] = len(out)
        return tiers

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
                got, failed = self._round([ShardCall(s, "text_stats", (texts, live)) for s in live])
                live = sorted(got)
                if not failed or not live:
                    break
            stats = sum_text_stats(list(got.values()), len(texts))
        got, _ = self._round([ShardCall(s, "text_search", (texts, int(limit), where, stats)) for s in live])
        missing = sorted(set(range(self.n_shards)) - set(got))
        return [best_text_hits([found[i] for found in got.values()], limit) for i in range(len(texts))], missing

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
        got = self._write_round([ShardCall(s, "field_types", (key,)) for s in live], "reading field types", False)
        return set().union(*got.values()) if got else set()

    def field_names(self, limit: int = 10000) -> list[str]:
        """The metadata keys the documents hold, over the live shards, sorted (the nearest to a filter's missing
        field are suggested, as a collection's are: filters.filter_warnings)."""
        live = [s for s in range(self.n_shards) if self.alive[s]]
        got = self._write_round([ShardCall(s, "field_names", (limit,)) for s in live], "reading field names", False)
        return sorted(set().union(*got.values()))[:limit] if got else []
