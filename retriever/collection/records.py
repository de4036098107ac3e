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
from fusionrag.retriever.errors import IndexFormatError, InputError
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

# A log record's payload in the one format both a collection and a shard write (v2, #69): this magic, then
# _V2_HEAD, a JSON head (op, names, texts, metadata, filter, guests), the keys (int64), the router's lists (int64)
# and the vectors (float32). No v1 payload starts so: a collection's v1 payload starts with its JSON head's byte
# count, and this one's would be past a record's 1 GiB; a shard's v1 payload starts with its op letter.
V2 = b"\x00FRS\x02"
_V2_HEAD = struct.Struct("<IIIII")  # JSON head bytes, keys, lists, vectors, dimension
_SHARD_V1 = struct.Struct("<cII")  # a shard's v1 record: op letter, count, dimension


@dataclass
class StoreRecord:
    """One write to a local store (store.py), a collection's or a shard's, as it is logged and applied.

    keys: the int64 keys it writes. A collection assigns an upsert's when it logs it (its rows) and names the
    documents a delete or a metadata update touches; a shard's writer (the router) gives every key (its global
    ids), and names only the documents it carries. ids/texts/metas: the documents' names, texts and metadata
    (JSON text), one per key of an upsert that carries documents. lists: a shard's upsert, the router's list of
    each vector (-1: none known). guests: per document, the shard that counts it in BM25 (-1: this one)."""
    op: str  # "upsert" | "delete" | "delete_where" | "clear" | "set_metadata" | "merge_metadata"
    ids: list[str] = field(default_factory=list)
    texts: list = field(default_factory=list)
    metas: list[str] = field(default_factory=list)  # JSON text
    vectors: np.ndarray | None = None  # float32 (n, dim)
    keys: np.ndarray | None = None  # int64 (n,)
    lsn: int = 0
    offset: int = 0
    applied: bool = False
    error: BaseException | None = None
    result: int = 0
    filter: str | None = None  # JSON text, op "delete_where": evaluated when applied, at its place in the log
    lists: np.ndarray | None = None  # int64 (n,)
    guests: list[int] | None = None

    def payload(self) -> bytes:
        head: dict = {"op": self.op}
        for name in ("ids", "texts", "metas"):
            if getattr(self, name):
                head[name] = getattr(self, name)
        if self.filter is not None:
            head["filter"] = self.filter
        if self.guests is not None:
            head["guests"] = self.guests
        h = json.dumps(head, separators=(",", ":")).encode()  # ASCII: a lone surrogate is written escaped
        keys = b"" if self.keys is None else np.ascontiguousarray(self.keys, "<i8").tobytes()
        lists = b"" if self.lists is None else np.ascontiguousarray(self.lists, "<i8").tobytes()
        vecs = np.empty((0, 0), "<f4") if self.vectors is None else np.ascontiguousarray(self.vectors, "<f4")
        return (V2 + _V2_HEAD.pack(len(h), len(keys) // 8, len(lists) // 8, vecs.shape[0],
                                   vecs.shape[1] if vecs.ndim == 2 else 0) + h + keys + lists + vecs.tobytes())

    @classmethod
    def decode(cls, lsn: int, payload: bytes, dim: int, legacy: str) -> "StoreRecord":
        """A logged record: the v2 format, or the v1 format of `legacy` ("collection" or "shard"), the one its
        store wrote before v2 (kept read-only: logs in users' directories hold them). IndexFormatError if garbled."""
        try:
            if payload[:len(V2)] == V2:
                return cls._decode_v2(lsn, payload, dim)
            if legacy == "collection":
                return cls._decode_collection_v1(lsn, payload, dim)
            return cls._decode_shard_v1(lsn, payload)
        except IndexFormatError:
            raise
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise IndexFormatError(f"log record {lsn} is garbled ({e})") from None

    @classmethod
    def _decode_v2(cls, lsn: int, payload: bytes, dim: int) -> "StoreRecord":
        hn, nk, nl, nv, vdim = _V2_HEAD.unpack_from(payload, len(V2))
        pos = len(V2) + _V2_HEAD.size
        end = pos + hn + 8 * (nk + nl) + 4 * nv * vdim
        if end != len(payload) or (nv and vdim != dim):
            raise IndexFormatError(f"log record {lsn} is garbled (its sizes do not add up)")
        head = json.loads(payload[pos:pos + hn])
        pos += hn
        w = cls(head["op"], head.get("ids", []), head.get("texts", []), head.get("metas", []), lsn=lsn,
                filter=head.get("filter"), guests=head.get("guests"))
        if nk:
            w.keys = np.frombuffer(payload, "<i8", nk, pos).astype(np.int64)
        pos += 8 * nk
        if nl:
            w.lists = np.frombuffer(payload, "<i8", nl, pos).astype(np.int64)
        pos += 8 * nl
        if nv:
            w.vectors = np.frombuffer(payload, "<f4", nv * vdim, pos).reshape(nv, vdim).copy()
        return w

    @classmethod
    def _decode_collection_v1(cls, lsn: int, payload: bytes, dim: int) -> "StoreRecord":
        (n,) = struct.unpack_from("<I", payload)
        head = json.loads(payload[4:4 + n])
        w = cls(head["op"], head["ids"], head["texts"], head["metas"], lsn=lsn, filter=head.get("filter"))
        if w.op == "upsert":
            w.keys = np.asarray(head["rows"], dtype=np.int64)
            w.vectors = np.frombuffer(payload[4 + n:], dtype=np.float32).reshape(len(w.ids), dim)
        return w

    @classmethod
    def _decode_shard_v1(cls, lsn: int, payload: bytes) -> "StoreRecord":
        """b"u" an upsert (ids, vectors), b"l" one with the router's lists, b"U" one with lists and documents (as
        JSON: name, text, metadata JSON[, the shard counting it in BM25]), b"d" a delete (ids)."""
        op, n, dim = _SHARD_V1.unpack_from(payload)
        pos = _SHARD_V1.size
        listed = op in (b"l", b"U")
        end = pos + n * 8 + n * dim * 4 + (n * 4 if listed else 0)
        if op not in (b"u", b"l", b"U", b"d") or len(payload) < end or (op != b"U" and len(payload) != end):
            raise IndexFormatError("a shard log record is garbled")
        w = cls("delete" if op == b"d" else "upsert", lsn=lsn)
        w.keys = np.frombuffer(payload, "<i8", n, pos).astype(np.int64)
        if op == b"d":
            return w
        w.vectors = np.frombuffer(payload, "<f4", n * dim, pos + n * 8).reshape(n, dim).copy()
        w.lists = np.frombuffer(payload, "<i4", n, pos + n * 8 + n * dim * 4).astype(np.int64) if listed \
            else np.full(n, -1, np.int64)
        if op == b"U":
            try:
                docs = [tuple(d) for d in json.loads(payload[end:])]
            except ValueError:
                raise IndexFormatError("a shard log record's documents are garbled") from None
            if len(docs) != n or not all(len(d) == 3 or (len(d) == 4 and type(d[3]) is int) for d in docs):
                raise IndexFormatError("a shard log record's documents are garbled")
            w.ids, w.texts, w.metas = (list(c) for c in zip(*(d[:3] for d in docs)))
            w.guests = [d[3] if len(d) == 4 else -1 for d in docs]
        return w


# Collection.search's words for queries it refuses (queries.check_queries does the checking).
QUERY_WORDS = QueryWords(
    numeric="queries: not numeric ({detail})",
    shape="queries: expected dimension {dim}, got shape {shape}",
    dimension="queries: expected dimension {dim}, got shape {shape}",
    empty="queries: no query vectors given",
)


def upsert_record(docs: Sequence[Document], dim: int, metric: str) -> tuple[StoreRecord, list[str]]:
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
    return StoreRecord("upsert", [ids[j] for j in keep], [texts[j] for j in keep], [metas[j] for j in keep],
                  vectors), out


METADATA_OPS = ("set_metadata", "merge_metadata")


def metadata_record(updates: Mapping[str, dict], merge: bool) -> StoreRecord:
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
    return StoreRecord("merge_metadata" if merge else "set_metadata", ids, [], metas)


def engine_form(vecs: np.ndarray, metric: str) -> np.ndarray:
    """Vectors as the engine indexes and searches them: normalised for cosine (the one place this happens)."""
    return normalize(vecs) if metric == "cosine" else vecs
