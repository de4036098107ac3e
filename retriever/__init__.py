"""The engine: build pipeline, index directory format, the query path over the three tiers."""

from fusionrag.retriever.config import BuildConfig, EngineConfig, SearchParams
from fusionrag.retriever.errors import (ConfigError, ConflictError, FusionRAGError, IndexFormatError, InputError,
                                       NotFoundError, StorageError, VectorFileError)
from fusionrag.retriever.index import Index, SearchResult
from fusionrag.retriever.vectors import open_vectors

__all__ = [
    "BuildConfig", "ConfigError", "ConflictError", "EngineConfig", "FusionRAGError", "Index", "IndexFormatError", "InputError", "NotFoundError",
    "SearchParams", "SearchResult", "StorageError", "VectorFileError", "open_vectors",
]
