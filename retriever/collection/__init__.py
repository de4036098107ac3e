"""Mutable collections: documents added, replaced and deleted without a rebuild, durable when a write returns.

The package, a module for each thing a collection is made of:
- config.py: names, formats, CollectionConfig (merging, filtering, hybrid search);
- records.py: Document, Hit, the write-ahead log's records, the checks a document or a query passes;
- wal.py: the write-ahead log; docstore.py: the documents in SQLite (texts, metadata, BM25); filters.py: metadata
  filters compiled to SQL over it; fresh.py: the fresh tier (vectors since the last merge, searched exactly);
- generations.py: the published generations on disk (CURRENT, gen-NNNNNN/) and the read view of one;
- compaction.py: the merge's disk work, the next generation written beside the current one;
- api.py: Collection, writes, searches (main index, fresh tier, filters, text and hybrid), merge scheduling;
- importer.py: bulk import into an empty collection; snapshot.py: snapshots and restores;
- embedding.py: the text embedding models; quota.py: what one tenant may take from the others;
- catalog.py: Catalog, every collection of one data directory.

The names below are imported on first use (fusionrag.lazy), but for Document, Hit and DEFAULT_TEXT_WEIGHT: the
types the client shares, from fusionrag.types, which loads no engine.
"""

from fusionrag.lazy import face
from fusionrag.types import DEFAULT_TEXT_WEIGHT, Document, Hit

__all__ = ["Catalog", "Collection", "CollectionConfig", "CollectionSearch", "DEFAULT_TEXT_WEIGHT", "Document",
           "HYBRID_DEPTH", "Hit", "MAX_ID_CHARS", "NAME_RE", "RRF_K", "SEARCH_MODES"]
__getattr__, __dir__ = face(__name__, {
    "Collection": "api", "Catalog": "catalog",
    **dict.fromkeys(["HYBRID_DEPTH", "MAX_ID_CHARS", "NAME_RE", "RRF_K", "SEARCH_MODES", "CollectionConfig"],
                    "config"),
    "CollectionSearch": "records",
})
