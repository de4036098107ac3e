"""Documents in sharded mode (docs/sharded.md, "Documents"): string ids, texts, metadata and metadata filters over a
sharded index, with the interface of a Collection (retriever/collection) that the sharded service's routes, and
through them the LangChain and LlamaIndex stores and the vLLM plugin, use.

Names and ids. The index addresses vectors by int64 id; a document has a name (the string id users give), kept by
the router (ShardedIndex.named) and rebuilt from the shards' doc stores whenever it loads its write maps. A build
given a documents sidecar (build_sharded's documents) names its vectors: each shard's doc store holds its built
vectors' documents (ids, texts, metadata) under their ids, their source rows, so a document written later with the
same name replaces the built one. Without one, a name that is an id's decimal digits ("17", below 2**62) names that
id, so the built vectors are the documents "0", "1", ... (no text, no metadata). Any other new name gets the next
free id from 2**62 up.
Each shard keeps the name, text and metadata of the documents it holds in a doc store of its own
(sharded/writes.py), written from the same log record as the vector: a shard restarted from its directory has
them all back.

Filters are a collection's (retriever/collection/filters.py), evaluated by each shard over its own doc store: a search under a
filter is answered, on every shard, from the vectors whose documents pass it. Text search asks every live shard for
its best BM25 matches (each shard's full-text index, with its own term statistics, as a search engine's shards rank
unless asked for global ones) and keeps the best; hybrid search fuses that ranking with the vector one by reciprocal
rank, as a collection does, and needs the query vectors beside the texts. Documents without a vector are refused
(a sharded index has no embedding model).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np

from fusionrag.retriever.collection import CollectionSearch, Document, Hit
from fusionrag.retriever.collection.config import (DEFAULT_TEXT_WEIGHT, HYBRID_DEPTH, CollectionConfig, Fusion,
                                                   check_search)
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.collection.filters import compile_filter, filter_warnings
from fusionrag.retriever.collection.fusion import fuse, fused_hits
from fusionrag.retriever.collection.docstore import merge_patch
from fusionrag.retriever.collection.records import metadata_record, upsert_record
from fusionrag.retriever.collection.values import check_ids
from fusionrag.retriever.engine.config import SearchParams
from fusionrag.retriever.errors import InputError, UnavailableError, UnsupportedError
from fusionrag.retriever.sharded.parts import NAMED_IDS, part_name
from fusionrag.retriever.sharded.router import ShardedIndex
from fusionrag.retriever.sharded.shard import ShardReads


def numeric_id(name: str) -> int | None:
    """The id a name written as an id's decimal digits names (no sign, no leading zero, below 2**62), else None."""
    if name.isascii() and name.isdigit() and (name == "0" or name[0] != "0") and len(name) <= 19:
        n = int(name)
        return n if n < NAMED_IDS else None
    return None


class ShardedCollection(CollectionContract):
    """A sharded index (opened: ShardedIndex.open) as a collection named `name`. Thread-safe as the index is;
    writes are one at a time (the index's write lock, which also guards the name map)."""

    sharded = True

    def __init__(self, index: ShardedIndex, name: str, config: CollectionConfig | None = None):
        """config: the collection settings that apply to a sharded one (filter_exact_max: a filter at most that
        many of a shard's documents pass is answered exactly there)."""
        self.index, self.name = index, name
        self.config = config or CollectionConfig()

    @property
    def dim(self) -> int:
        return self.index.dim

    @property
    def embedding(self) -> str | None:
        """The model that made the built vectors (build_sharded(embedding=...)), which the service embeds texts
        written or searched without a vector with; None: every document and query comes with its vector."""
        return self.index.manifest.get("embedding")

    @property
    def metric(self) -> str:
        return self.index.metric

    # -- names ---------------------------------------------------------------------------------------

    def _ids(self, names: Sequence[str], create: bool) -> np.ndarray:
        """The ids these names name (-1 for an unknown name, unless create: then the next free id from 2**62 up).
        Caller holds the index's write lock when create."""
        out = np.empty(len(names), dtype=np.int64)
        ix = self.index
        for j, name in enumerate(names):
            i = ix.named.get(name)
            if i is None and not ix.built_named:  # the unnamed built vectors are "0", "1", ...
                i = numeric_id(name)
            if i is None and create:
                i = ix.named[name] = ix.next_named
                ix.next_named += 1
            out[j] = -1 if i is None else i
        return out

    @staticmethod
    def _check_names(ids, what: str) -> list[str]:
        return check_ids(ids, what)

    # -- writes --------------------------------------------------------------------------------------

    def upsert(self, docs: Sequence[Document]) -> list[str]:
        """Insert or replace documents by id; durable on every shard they went to when it returns. Ids in input
        order (made up where a document has none)."""
        w, ids = upsert_record(docs, self.dim, self.metric)
        if not w.ids:
            return ids
        with self.index.write_lock:
            nums = self._ids(w.ids, create=True)
            self.index.upsert(nums, w.vectors, list(zip(w.ids, w.texts, w.metas)))
        return ids

    add = upsert

    def delete(self, ids: Sequence[str]) -> int:
        """Delete by id (unknown ids are ignored); how many were live."""
        names = self._check_names(ids, "delete")
        with self.index.write_lock:
            nums = self._ids(names, create=False)
            return self.index.delete(nums[nums >= 0]) if (nums >= 0).any() else 0

    def delete_where(self, filter: dict) -> int:
        """Delete every document the filter passes, as of now (writes wait meanwhile); how many."""
        where = compile_filter(filter)
        with self.index.write_lock:
            nums = self.index.matching(where)
            return self.index.delete(nums) if len(nums) else 0

    def clear(self) -> None:
        raise InputError("a sharded collection is not cleared: delete its documents (by id or filter), or rebuild "
                         "the index")

    def set_metadata(self, updates: Mapping[str, dict], merge: bool = True) -> int:
        """Change documents' metadata (as Collection.set_metadata: with merge an RFC 7386 merge patch over the
        stored metadata, else the whole new one; unknown ids skipped): each document written again with its text
        and vector, as a shard's log has no metadata-only record. Returns how many were updated."""
        w = metadata_record(updates, merge)
        if not w.ids:
            return 0
        with self.index.write_lock:  # no write between reading the documents and writing them again
            found = self.get(w.ids, with_vectors=True)
            new = dict(zip(w.ids, w.metas))
            docs = [Document(d.id, d.text, d.vector,
                             merge_patch(d.metadata, json.loads(new[d.id])) if merge else json.loads(new[d.id]))
                    for d in found]
            if docs:
                self.upsert(docs)
        return len(docs)

    # What a sharded collection does not do through the service: refused with 405 (UnsupportedError).
    def snapshot(self, *_, **__):
        raise UnsupportedError("a sharded collection is not snapshotted through the service: snapshot each shard "
                               "part's directory (docs/sharded.md)")

    def claim_import(self, *_, **__):
        raise UnsupportedError("a sharded collection does not take imports: build it with its documents "
                               "(fusionrag build VECTORS INDEX --shards N --documents DOCS.jsonl)")

    import_files = release_import = claim_import

    @property
    def path(self):
        return self.index.path

    # -- reads ---------------------------------------------------------------------------------------

    def count(self, filter: dict | None = None) -> int:
        """How many documents the filter passes (all of them without one)."""
        if filter is None:
            return self.index.live_count()
        return len(self.index.matching(compile_filter(filter)))

    def __len__(self) -> int:
        """Live documents: the built and merged vectors not deleted or replaced since, and those written since the
        last merge (each once, however many shards hold it)."""
        return self.index.live_count()

    def get(self, ids: Sequence[str], with_vectors: bool = False) -> list[Document]:
        """The documents with these ids, in that order; ids not found are left out."""
        names = self._check_names(ids, "get")
        nums = self._ids(names, create=False)
        found = self.index.documents(nums[nums >= 0], with_vectors)
        by_name = {}
        for name, i in zip(names, nums.tolist()):
            d = found.get(i)
            if d is not None and d[0] == name:
                by_name[name] = Document(name, d[1], d[3], d[2])
        return [by_name[i] for i in ids if i in by_name]

    def scroll(self, limit: int, after: int = -1, filter: dict | None = None,
               with_vectors: bool = False) -> tuple[list[Document], int | None]:
        """Up to `limit` documents (those the filter passes) in id order past id `after`, and the id to continue
        after (None at the end). A document live throughout a scroll is seen once."""
        for what, v, low in (("limit", limit, 1), ("after", after, -1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise InputError(f"{what} must be an integer >= {low}, got {v!r}")
        where = compile_filter(filter) if filter is not None else None
        found, nxt = self.index.page(int(after), int(limit), where, with_vectors)
        return [Document(name, text, vec, meta) for _, name, text, meta, vec in found], nxt

    def filter_warnings(self, filter: dict) -> list[str]:
        return filter_warnings(filter, self.index.field_types, self.index.field_names)

    def search(self, vectors=None, k: int = 10, filter: dict | None = None, params: SearchParams | None = None,
               with_vectors: bool = False, *, texts: Sequence[str] | None = None, mode: str = "vector",
               text_weight: float = DEFAULT_TEXT_WEIGHT, partial: bool = True, fusion: Fusion | dict | None = None,
               **_) -> CollectionSearch:
        """Top-k documents of each query (those a filter passes), as Collection.search answers them: mode "vector"
        by the query vectors, with exact distances; "text" by BM25 over the documents' texts (distance: the bm25
        score, lower is better); "hybrid" both rankings, each HYBRID_DEPTH deep (or k), fused by reciprocal rank
        (the vectors must be given: nothing is embedded). partial=False: UnavailableError rather than an answer
        missing lists or documents of a down shard."""
        k = check_search(k, mode, texts, vectors, text_weight)
        fusion = Fusion.of(fusion)
        if mode == "vector" and texts is not None:
            raise InputError("mode 'vector' searches by vectors: texts are searched with mode 'text' or 'hybrid'")
        if mode == "hybrid" and vectors is None:
            raise InputError("mode 'hybrid' over a sharded collection needs the query vectors beside the texts "
                             "(it embeds nothing)")
        where = compile_filter(filter) if filter is not None else None
        if mode == "text":
            return self._text_hits(list(texts), k, where, with_vectors, partial)
        q = self.index.prepare_queries(vectors)
        if mode == "hybrid" and len(texts) != len(q):
            raise InputError(f"mode 'hybrid' needs one text per query vector, got {len(texts)} for {len(q)}")
        depth = k if mode == "vector" else max(k, HYBRID_DEPTH)
        res = self.index.search(q, depth, params, partial=partial,
                                reads=ShardReads(where, with_docs=True, with_vectors=with_vectors,
                                                 exact_max=self.config.filter_exact_max))
        stats = [{key: int(v[j]) for key, v in res.stats.items()} for j in range(len(q))]
        missing_lists, missing_shards = [m.tolist() for m in res.missing_lists], list(res.missing_shards)
        if mode == "vector":
            hits = []
            for ids, ds in zip(res.ids, res.distances):
                row = []
                for i, d in zip(ids.tolist(), ds.tolist()):
                    doc = res.docs.get(i)
                    if i < 0 or doc is None:  # padding, or gone since the shard answered
                        continue
                    row.append(Hit(doc[0], d, self._score(d), doc[1], doc[2], doc[3] if with_vectors else None))
                hits.append(row)
            return CollectionSearch(hits, stats, missing_lists, missing_shards)
        queries = [fusion.query(t, float(text_weight)) for t in texts]  # a question's text ranking and weight
        found, down = self._text_ranking([t for t, _ in queries], depth, where, partial)
        hits = []
        for i in range(len(q)):
            order = np.argsort(res.distances[i], kind="stable")
            ids_i, d_i = res.ids[i][order], res.distances[i][order]
            ranked = [d for d in ids_i.tolist() if d >= 0]
            fused = fuse(ranked, d_i[ids_i >= 0], found[i][0].tolist(), found[i][1], queries[i][1], fusion)
            stats[i]["text_candidates"] = len(found[i][0])
            hits.append(fused_hits(q[i], fused, k, self._with_vectors(res.docs), self.metric, with_vectors))
        return CollectionSearch(hits, stats, missing_lists, sorted(set(missing_shards) | set(down)))

    def _with_vectors(self, have: dict):
        """fetch(ids) for fused_hits: the documents the shards returned with their vectors, the others asked of
        the shards that hold them."""
        def fetch(ids: list) -> dict:
            out = {d: have[d] for d in ids if d in have and have[d][3] is not None}
            rest = [d for d in ids if d not in out]
            if rest:
                out.update(self.index.documents(rest, True))
            return out
        return fetch

    def _text_ranking(self, texts: list[str], limit: int, where, partial: bool) -> tuple[list, list[int]]:
        found, down = self.index.text_search(texts, limit, where)
        if down and not partial:
            raise UnavailableError(f"{self.index.path}: a text search needs every shard's documents; shard(s) "
                                   f"{', '.join(part_name(s) for s in down)} are down")
        return found, down

    def _text_hits(self, texts: list[str], k: int, where, with_vectors: bool, partial: bool) -> CollectionSearch:
        found, down = self._text_ranking(texts, k, where, partial)
        wanted = sorted({d for ids, _ in found for d in ids.tolist()})
        docs = self.index.documents(wanted, with_vectors) if wanted else {}
        hits = [[Hit(docs[d][0], sc, -sc, docs[d][1], docs[d][2], docs[d][3] if with_vectors else None)
                 for d, sc in zip(ids.tolist(), scores.tolist()) if d in docs] for ids, scores in found]
        stats = [{"text_candidates": len(ids)} for ids, _ in found]
        return CollectionSearch(hits, stats, [[] for _ in texts], down)

    def _score(self, d: float) -> float:
        return 1.0 - d if self.metric == "cosine" else -d

    def info(self) -> dict:
        ix = self.index
        with ix.write_lock:
            count, fresh = ix.live_count(), len(ix.fresh_owner)
        return {"name": self.name, "dimension": self.dim, "metric": self.metric, "embedding": self.embedding,
                "state": "ready",
                "count": count, "sharded": True, "shards": ix.n_shards, "shards_alive": ix.alive.tolist(),
                # Each shard's filter tier as it opened ("gpu" where its node's GPU was visible to it).
                "shards_tiers": [{key: w.get(key) for key in ("pq_tier", "pq_bytes", "visible_gpus")}
                                 for w in ix.where],
                # Bytes per tier, summed over the shards (ShardedIndex.memory): what /metrics exports per tier.
                "tiers": ix.memory(),
                "search_defaults": ix.params.to_dict(), "calibration": ix.manifest.get("calibration"),
                "build_state": {"indexed": count - fresh, "fresh": fresh}}

    def close(self) -> None:
        self.index.close()

