"""Query vectors checked once, at the edge where they come in (the service, a collection, an index), and
handed inward in the engine's form, which the inner layers take as it is.

`check_queries` is the one check (shape, numbers, dimension, finite rows of a usable norm, no zero
vector under cosine); `prepare_queries` adds the engine's form (unit rows under cosine) and wraps the
result as PreparedQueries. Each public edge keeps its own words for what is wrong (QueryWords).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusionrag.retriever.engine.vectors import MAX_SQ_NORM, problem
from fusionrag.retriever.errors import InputError


@dataclass(frozen=True)
class QueryWords:
    """An edge's messages. Fields are format strings over: numeric {detail} (the dtype, or why the
    input is no array); shape {dim} {shape}; dimension {got} {dim} {shape}; empty {dim} {shape};
    row {row} {why}. shape: input of other than one or two axes; dimension: rows of another length."""
    numeric: str
    shape: str
    dimension: str
    empty: str
    row: str = "queries: row {row} {why}"


# Index.search's and the sharded router's words.
INDEX_WORDS = QueryWords(
    numeric="queries must be numeric, got {detail}",
    shape="queries must be a non-empty (count, {dim}) array, got shape {shape}",
    dimension="queries have dimension {got}, the index has dimension {dim}",
    empty="queries must be a non-empty (count, {dim}) array, got shape {shape}",
)


@dataclass(frozen=True, eq=False)
class PreparedQueries:
    """Queries that passed check_queries, in the engine's form: a non-empty C-contiguous float32 (count, dim)
    matrix, unit rows under cosine. An index (or router) of the same dimension and metric searches
    `vectors` as they are: neither checked nor normalised again."""
    vectors: np.ndarray
    metric: str

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def __len__(self) -> int:
        return len(self.vectors)

    def fits(self, dim: int, metric: str) -> bool:
        return self.dim == dim and self.metric == metric

    def rows(self, which) -> "PreparedQueries":
        """Some of the queries (an index array or slice), still prepared."""
        return PreparedQueries(np.ascontiguousarray(self.vectors[which]), self.metric)


def _shaped(queries, dim: int, words: QueryWords) -> np.ndarray:
    """`queries` as a C-contiguous float32 (count, dim) matrix, its rows not yet checked."""
    if isinstance(queries, PreparedQueries):
        queries = queries.vectors
    try:
        q = np.asarray(queries)
    except (TypeError, ValueError) as e:  # ragged rows
        raise InputError(words.numeric.format(detail=e)) from e
    shape = q.shape
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2:
        raise InputError(words.shape.format(dim=dim, shape=shape))
    if q.dtype.kind not in "fiu":
        raise InputError(words.numeric.format(detail=q.dtype))
    if q.shape[1] != dim:
        raise InputError(words.dimension.format(got=q.shape[1], dim=dim, shape=shape))
    if q.shape[0] == 0:
        raise InputError(words.empty.format(dim=dim, shape=shape))
    return np.ascontiguousarray(q, dtype=np.float32)


_check_rows = None  # native.check_rows, once loaded


def _native_check_rows():
    """The native check, imported on first use: the client imports these words and checks, and loads no engine
    (and a `from ... import` each call cost ~1 us through importlib's fromlist handling)."""
    global _check_rows
    from fusionrag import native

    _check_rows = native.check_rows
    return _check_rows


def _rows(q: np.ndarray, metric: str, words: QueryWords, unit: bool) -> np.ndarray | None:
    """The rows' check (vector_problems' rules and words) in one native pass, and with `unit` their unit-length
    copy (normalize's, bit for bit): numpy's ten calls cost ~16 us on one query, this ~1.3."""
    out, bad, why, sq = (_check_rows or _native_check_rows())(q, metric == "cosine", unit, MAX_SQ_NORM)
    if bad >= 0:
        raise InputError(words.row.format(row=bad, why=problem(why, sq)))
    return out


def check_queries(queries, dim: int, metric: str, words: QueryWords = INDEX_WORDS) -> np.ndarray:
    """`queries` (one vector, or rows of them) as a C-contiguous float32 (count, dim) matrix of vectors the
    engine can search under `metric`, not normalised; InputError in `words` saying what is wrong."""
    q = _shaped(queries, dim, words)
    _rows(q, metric, words, unit=False)
    return q


def prepare_queries(queries, dim: int, metric: str, words: QueryWords = INDEX_WORDS) -> PreparedQueries:
    """check_queries, then the engine's form (cosine: unit rows). Queries already prepared for this
    dimension and metric come back as they are."""
    if isinstance(queries, PreparedQueries) and queries.fits(dim, metric):
        return queries
    q = _shaped(queries, dim, words)
    unit = _rows(q, metric, words, unit=metric == "cosine")
    return PreparedQueries(q if unit is None else unit, metric)


def checked_for_search(queries, dim: int, metric: str, words: QueryWords = INDEX_WORDS) -> tuple[np.ndarray, bool]:
    """What a search call takes in: (check_queries' matrix, or prepared queries' own, and whether its rows are
    still to be made unit length). A search normalises each internal batch when it comes to it (pipeline.cut,
    QueryBatch.ready), so a call holds one batch's normalised copy, not a copy of all its queries (384 B a
    query at 96-d, 3 KiB at 768-d: 1.5 MB for 1000 MiniLM queries, more than the transient rest of a call)."""
    if isinstance(queries, PreparedQueries) and queries.fits(dim, metric):
        return queries.vectors, False
    return check_queries(queries, dim, metric, words), metric == "cosine"
