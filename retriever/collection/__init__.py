"""Mutable collections: documents added, replaced and deleted without a rebuild, durable when a write returns.

The package, a module for each thing a collection is made of:
- config.py: names, formats, CollectionConfig (merging, filtering, hybrid search);
- records.py: Document, Hit, the write-ahead log's records, the checks a document or a query passes;
- generations.py: the published generations on disk (CURRENT, gen-NNNNNN/) and the read view of one;
- compaction.py: the merge's disk work, the next generation written beside the current one;
- api.py: Collection, writes, searches (main index, fresh tier, filters, text and hybrid), merge scheduling;
- catalog.py: Catalog, every collection of one data directory.
"""

from fusionrag.retriever.collection.api import Collection
from fusionrag.retriever.collection.catalog import Catalog
from fusionrag.retriever.collection.config import (DEFAULT_TEXT_WEIGHT, HYBRID_DEPTH, MAX_ID_CHARS, NAME_RE, RRF_K,
                                                   SEARCH_MODES, CollectionConfig)
from fusionrag.retriever.collection.records import CollectionSearch, Document, Hit

__all__ = ["Catalog", "Collection", "CollectionConfig", "CollectionSearch", "DEFAULT_TEXT_WEIGHT", "Document",
           "HYBRID_DEPTH", "Hit", "MAX_ID_CHARS", "NAME_RE", "RRF_K", "SEARCH_MODES"]
