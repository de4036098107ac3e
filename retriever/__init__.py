"""The retriever, in three layers (docs/design.md, "Code map"), each importing only those below it:

- engine/: one index: the build, the index directory, the three tiers, the query pipeline, merge, calibration;
- collection/: mutable collections over an index: documents, the log, the fresh tier, filters, import, snapshots;
- sharded/: one collection over S shards, on Ray or in one process.

Beside them, what all three use: errors, progress, process, dirlock; and directory, which tells a single index
directory from a sharded one (above both). The names below are imported on first use (fusionrag.lazy), so
importing this package, or fusionrag.client, loads no engine.
"""

from fusionrag.lazy import face

__all__ = [
    "BuildConfig", "ConfigError", "ConflictError", "EngineConfig", "FusionRAGError", "Index", "IndexFormatError",
    "InputError", "NotFoundError", "SearchParams", "SearchResult", "StorageError", "VectorFileError", "open_vectors",
]
__getattr__, __dir__ = face(__name__, {
    **dict.fromkeys(["BuildConfig", "EngineConfig", "SearchParams"], "engine.config"),
    **dict.fromkeys(["ConfigError", "ConflictError", "FusionRAGError", "IndexFormatError", "InputError",
                     "NotFoundError", "StorageError", "VectorFileError"], "errors"),
    **dict.fromkeys(["Index", "SearchResult"], "engine.index"),
    "open_vectors": "engine.vectors",
})
