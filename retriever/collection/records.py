"""Documents and the records of writes: what a collection holds and answers, the write-ahead log's records,
and the checks a document passes before it is logged (cosine normalisation of stored vectors happens once, here,
in `engine_form`; of queries in queries.prepare_queries, in the words QUERY_WORDS)."""

from __future__ import annotations

import json
import struct
import uuid
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from fusionrag.retriever.collection.config import MAX_ID_CHARS
from fusionrag.retriever.collection.values import check_id, check_text, metadata_json
from fusionrag.retriever.engine.queries import QueryWords
from fusionrag.retriever.engine.vectors import normalize, vector_problems
from fusionrag.retriever.errors import InputError
# Document and Hit are the types the client shares (fusionrag.types); named here as ever.
from fusionrag.types import Document, Hit


@dataclass
class CollectionSearch:
    """A search's answer, whatever the collection (the one answer type of the collection contract, contract.py):
    per query its hits and statistics. A sharded collection's also says, per query, the lists (the router's
    numbers) no live shard could search, and which down shards' fresh documents went unsearched; missing_lists
    is None for a collection that cannot miss any (one local store)."""
    hits: list[list[Hit]]
    stats: list[dict]
    missing_lists: list[list[int]] | None = None
    missing_shards: list[int] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        """Whether a shard down left some of it unsearched."""
        return bool(self.missing_shards) or any(self.missing_lists or ())

    def part(self, start: int, end: int) -> "CollectionSearch":
        """The answer of queries start..end-1 alone (the batcher's split of a batched call)."""
        return CollectionSearch(self.hits[start:end], self.stats[start:end],
                                None if self.missing_lists is None else self.missing_lists[start:end],
                                self.missing_shards)


# -- writes as log records ---------------------------------------------------------------------

@dataclass
class Write:
    op: str  # "upsert" | "delete" | "delete_where" | "clear" | "set_metadata" | "merge_metadata"
    ids: list[str] = field(default_factory=list)
    texts: list = field(default_factory=list)
    metas: list[str] = field(default_factory=list)  # JSON text
    vectors: np.ndarray | None = None  # float32 (n, dim), as given
    rows: np.ndarray | None = None  # int64 (n,), assigned when logged
    lsn: int = 0
    offset: int = 0
    applied: bool = False
    error: BaseException | None = None
    result: int = 0
    filter: str | None = None  # JSON text, op "delete_where": evaluated when applied, at its place in the log

    def payload(self) -> bytes:
        head = {"op": self.op, "ids": self.ids, "texts": self.texts, "metas": self.metas,
                "rows": [] if self.rows is None else self.rows.tolist()}
        if self.filter is not None:
            head["filter"] = self.filter
        h = json.dumps(head, separators=(",", ":")).encode()
        vec = b"" if self.vectors is None else np.ascontiguousarray(self.vectors, np.float32).tobytes()
        return struct.pack("<I", len(h)) + h + vec

    @classmethod
    def decode(cls, lsn: int, payload: bytes, dim: int) -> "Write":
        (n,) = struct.unpack_from("<I", payload)
        head = json.loads(payload[4:4 + n])
        w = cls(head["op"], head["ids"], head["texts"], head["metas"], lsn=lsn, filter=head.get("filter"))
        w.rows = np.asarray(head["rows"], dtype=np.int64)
        if w.op == "upsert":
            w.vectors = np.frombuffer(payload[4 + n:], dtype=np.float32).reshape(len(w.ids), dim)
        return w


# Collection.search's words for queries it refuses (queries.check_queries does the checking).
QUERY_WORDS = QueryWords(
    numeric="queries: not numeric ({detail})",
    shape="queries: expected dimension {dim}, got shape {shape}",
    dimension="queries: expected dimension {dim}, got shape {shape}",
    empty="queries: no query vectors given",
)


def upsert_record(docs: Sequence[Document], dim: int, metric: str) -> tuple[Write, list[str]]:
    """The log record of an upsert, every document checked (an id given twice: the last one wins), and the ids
    in input order (made up where a document has none)."""
    if isinstance(docs, (Document, str, bytes)) or not isinstance(docs, Sequence):
        raise InputError("upsert takes a sequence of Document")
    ids, texts, metas, vecs = [], [], [], []
    for i, d in enumerate(docs):
        if not isinstance(d, Document):
            raise InputError(f"document {i}: expected a Document, got {type(d).__name__}")
        doc_id = uuid.uuid4().hex if d.id is None else d.id
        if not isinstance(doc_id, str) or not doc_id or len(doc_id) > MAX_ID_CHARS:
            raise InputError(f"document {i}: id must be a non-empty string of at most {MAX_ID_CHARS} "
                             f"characters, got {d.id!r:.80}")
        check_id(doc_id, f"document {i}: id")
        if d.text is not None:
            if not isinstance(d.text, str):
                raise InputError(f"document {doc_id!r}: text must be a string or None")
            check_text(d.text, f"document {doc_id!r}: text")
        if d.vector is None:
            raise InputError(f"document {doc_id!r}: a vector is required")
        meta = metadata_json(doc_id, d.metadata)
        try:
            with np.errstate(over="ignore"):
                v = None if isinstance(d.vector, (str, bytes)) else np.asarray(d.vector, dtype=np.float32)
        except OverflowError:  # an integer past float64's range: refused as past float32's below
            v = np.full(dim, np.inf, np.float32) if len(d.vector) == dim else None
        except (TypeError, ValueError):
            v = None
        if v is None or v.shape != (dim,):
            raise InputError(f"document {doc_id!r}: vector must be {dim} numbers, "
                             f"got {getattr(v, 'shape', type(d.vector).__name__)}")
        _, why = vector_problems(v[None, :], metric)
        if why:
            raise InputError(f"document {doc_id!r}: vector {why[0]}")
        ids.append(doc_id)
        texts.append(d.text)
        metas.append(meta)
        vecs.append(v)
    out = list(ids)
    # An id given twice in one call: the last one wins, as if written one after the other.
    last = {doc_id: j for j, doc_id in enumerate(ids)}
    keep = sorted(last.values())
    vectors = np.stack([vecs[j] for j in keep]) if keep else np.empty((0, dim), np.float32)
    return Write("upsert", [ids[j] for j in keep], [texts[j] for j in keep], [metas[j] for j in keep],
                  vectors), out


METADATA_OPS = ("set_metadata", "merge_metadata")


def metadata_record(updates: Mapping[str, dict], merge: bool) -> Write:
    """The log record of a metadata-only update: ids and their new metadata (merged into the stored one as an RFC
    7386 merge patch, or replacing it), each checked as upsert checks a document's."""
    if not isinstance(updates, Mapping):
        raise InputError("set_metadata takes a mapping of ids to metadata dicts")
    ids, metas = [], []
    for doc_id, meta in updates.items():
        if not isinstance(doc_id, str) or not doc_id or len(doc_id) > MAX_ID_CHARS:
            raise InputError(f"id must be a non-empty string of at most {MAX_ID_CHARS} characters, got {doc_id!r:.80}")
        check_id(doc_id)
        metas.append(metadata_json(doc_id, meta))
        ids.append(doc_id)
    return Write("merge_metadata" if merge else "set_metadata", ids, [], metas)


def engine_form(vecs: np.ndarray, metric: str) -> np.ndarray:
    """Vectors as the engine indexes and searches them: normalised for cosine (the one place this happens)."""
    return normalize(vecs) if metric == "cosine" else vecs
