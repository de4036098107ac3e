"""Request bodies and error answers of the HTTP API. Limits that come from the configuration are checked in the
routes (and written into the OpenAPI document by the app). The search and documents routes read their vectors
themselves (server/bodies.py) and validate the rest of their body with these models; the constraints that span
fields (exactly one of vectors and texts; a text or a vector) are checked in the routes and declared here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, NAME_RE, RRF_K
from fusionrag.retriever.collection.config import QUESTION_SHARE
from fusionrag.retriever.collection.embedding import model_names

NAME_PATTERN = f"^{NAME_RE.pattern}$"

# JSON has no NaN, but Python's parser accepts the literal; a non-finite number is refused here.
Finite = Annotated[float, Field(allow_inf_nan=False)]
# JSON Schema's integer: 3.0 is one (strict mode alone refuses it), true and "3" are not.
Integer = Annotated[int, BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)]


class _Body(BaseModel):
    # Strict: JSON's types as the document declares them, not Python's coercions of "3" or true to numbers.
    model_config = ConfigDict(extra="forbid", strict=True)


def _given(name: str, kind: str) -> dict:
    return {"required": [name], "properties": {name: {"type": kind}}}


class TextAnalyzer(_Body):
    stemming: Literal["porter", "none"] = Field("porter", description="porter: English stemming (\"running\" "
                                                "matches \"runs\"); none: words as written (other languages)")
    stop_words: Literal["english", "none"] = Field("english", description="english: Lucene's English stop words "
                                                   "are left out of text queries; none: every word counts")


class CreateCollection(_Body):
    model_config = ConfigDict(json_schema_extra={"anyOf": [_given("dimension", "integer"),
                                                           _given("embedding", "string")]})
    name: str = Field(description="1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
                      json_schema_extra={"pattern": NAME_PATTERN})
    dimension: Integer | None = Field(None, ge=1, le=65536,
                                      description="vector dimension; may be left out when `embedding` is given")
    metric: Literal["l2", "ip", "cosine"] = "cosine"
    embedding: str | None = Field(None, description="model that embeds texts (or an alias, such as "
                                                  "sentence-transformers/all-MiniLM-L6-v2)",
                                  json_schema_extra=lambda s: s["anyOf"][0].update(enum=model_names()))
    text_analyzer: TextAnalyzer | None = Field(None, description="how the documents' texts are indexed and text "
                                               "queries read (English by default); fixed at create")
    shards: Integer | None = Field(None, ge=1, le=16, description="a sharded collection of this many shards, in the "
                                   "service's process (docs/sharded.md): empty until its first import builds it; "
                                   "left out: a collection")

    @model_validator(mode="after")
    def _dimension_or_embedding(self):
        if self.dimension is None and self.embedding is None:
            raise ValueError("give a dimension, an embedding model, or both")
        return self


def _search_kinds() -> list[dict]:
    """Vectors alone (mode vector), texts alone (any mode), or both, one text per vector (mode hybrid)."""
    vectors, texts = _given("vectors", "array"), _given("texts", "array")
    return [{**vectors, "not": {"required": ["texts"]}, "properties": {**vectors["properties"],
                                                                       "mode": {"enum": ["vector"]}}},
            {**texts, "not": {"required": ["vectors"]}},
            {"required": ["vectors", "texts", "mode"], "properties": {"vectors": {"type": "array"},
                                                                      "texts": {"type": "array"},
                                                                      "mode": {"const": "hybrid"}}}]


class FusionSpec(_Body):
    method: Literal["rrf", "weighted"] = Field("rrf", description="rrf: reciprocal rank fusion, (1 - w)/(k + vector "
                                               "rank) + w/(k + text rank); weighted: each ranking's scores min-max "
                                               "normalised to [0, 1], then (1 - w) x vector + w x text")
    k: Integer = Field(RRF_K, ge=1, le=10_000, description="rrf: the rank constant")
    question_share: Finite = Field(QUESTION_SHARE, ge=0, le=1,
                                   description="a query phrased as a question (\"How do I ...?\") is fused with "
                                               "this share of text_weight, its text ranking made without the words of "
                                               "questions; 1: as any other query")


class SearchRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": _search_kinds()})
    vectors: list[list[Finite]] | None = Field(None, description="query vectors", json_schema_extra={"minItems": 1})
    texts: list[str] | None = Field(None, description="query texts: embedded by the collection's model (unless "
                                    "`vectors` are given too, in hybrid mode), and matched by their words in the "
                                    "text and hybrid modes", json_schema_extra={"minItems": 1})
    mode: Literal["vector", "text", "hybrid"] = Field(
        "vector", description="vector: nearest by vector; text: BM25 over the documents' texts; hybrid: both "
                              "rankings fused by reciprocal rank")
    text_weight: Finite = Field(DEFAULT_TEXT_WEIGHT, ge=0, le=1,
                                description="hybrid mode: the text ranking's weight in the fusion (the vector "
                                            "ranking's is 1 - text_weight; a query phrased as a question gets "
                                            "fusion.question_share of it)")
    fusion: FusionSpec | None = Field(None, description="hybrid mode: how the two rankings are fused (reciprocal "
                                                        "rank, k 60, by default)")
    k: Integer = Field(10, ge=1, description="hits per query")
    offset: Integer = Field(0, ge=0, description="hits to skip first: each query's k hits after its best `offset` "
                                                 "(pages of a ranking; k + offset at most max_k)")
    score_threshold: Finite | None = Field(None, description="only hits whose score is at least this (vector "
                                                             "mode: 1 - distance under cosine, -distance under l2 "
                                                             "and ip; text: -bm25; hybrid: the fused score)")
    filter: dict[str, Any] | None = Field(None, description="metadata filter, e.g. {\"source\": \"design.md\"}")
    params: dict[str, Any] | None = Field(None, description="tuning: nprobe, probe_ratio, rerank, ...")
    stats: bool = Field(False, description="return the engine's statistics of each query")
    with_vectors: bool = Field(False, description="return each hit's stored vector (`vector`)")
    partial: bool = Field(True, description="a sharded collection: false answers 503 rather than an answer that "
                                            "misses the lists of a shard that is down (a collection's answers are "
                                            "never partial)")


class GroupSearchRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": _search_kinds()})
    vectors: list[list[Finite]] | None = Field(None, description="query vectors", json_schema_extra={"minItems": 1})
    texts: list[str] | None = Field(None, description="query texts, as a search takes them",
                                    json_schema_extra={"minItems": 1})
    mode: Literal["vector", "text", "hybrid"] = Field("vector", description="as a search's")
    text_weight: Finite = Field(DEFAULT_TEXT_WEIGHT, ge=0, le=1, description="hybrid mode: as a search's")
    fusion: FusionSpec | None = Field(None, description="hybrid mode: as a search's")
    group_by: str = Field(min_length=1, max_length=512, description="the metadata field whose value groups the hits "
                          "(a dotted path reaches into objects); a hit with a list value is in each of its values' "
                          "groups, one without a string or integer value under the field in none")
    group_size: Integer = Field(3, ge=1, description="hits per group at most, best first")
    limit: Integer = Field(10, ge=1, description="groups per query at most, ordered by their best hit "
                                                 "(limit x group_size at most max_k)")
    filter: dict[str, Any] | None = Field(None, description="metadata filter, as a search's")
    params: dict[str, Any] | None = Field(None, description="tuning: nprobe, probe_ratio, rerank, ...")
    with_vectors: bool = Field(False, description="return each hit's stored vector (`vector`)")
    partial: bool = Field(True, description="a sharded collection: as a search's")


class RecommendRequest(_Body):
    positive: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        min_length=1, description="ids of stored documents like those wanted")
    negative: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        default_factory=list, description="ids of stored documents unlike those wanted")
    k: Integer = Field(10, ge=1, description="hits (the examples themselves left out)")
    filter: dict[str, Any] | None = Field(None, description="metadata filter")
    params: dict[str, Any] | None = Field(None, description="tuning: nprobe, probe_ratio, rerank, ...")
    with_vectors: bool = Field(False, description="return each hit's stored vector (`vector`)")


class DocumentIn(_Body):
    model_config = ConfigDict(json_schema_extra={"anyOf": [_given("text", "string"), _given("vector", "array")]})
    id: str | None = Field(None, min_length=1, max_length=512, description="left out: a new id is assigned")
    text: str | None = None
    vector: list[Finite] | None = Field(None, description="left out: the text is embedded")
    metadata: dict[str, Any] = Field(default_factory=dict)


class UpsertRequest(_Body):
    documents: list[DocumentIn] = Field(min_length=1)


DocId = Annotated[str, Field(min_length=1, max_length=512)]


def _alone(name: str, other: str, kind: str) -> dict:
    return {**_given(name, kind), "not": {"required": [other]}}


class DeleteRequest(_Body):
    # Typed without None (so null is refused, as the schema says), and left out by default.
    model_config = ConfigDict(json_schema_extra={"oneOf": [_alone("ids", "filter", "array"),
                                                           _alone("filter", "ids", "object")]})
    ids: list[DocId] = Field(None, min_length=1, description="delete these ids (unknown ones are ignored)")
    filter: dict[str, Any] = Field(None, description="delete every document this metadata filter passes, in one "
                                                     "write")


class GetRequest(_Body):
    ids: list[DocId] = Field(min_length=1, description="documents are returned in this order; ids not found are "
                                                       "left out")
    with_vectors: bool = Field(False, description="return each document's vector")


class DocumentOut(BaseModel):
    id: str
    text: str | None
    metadata: dict[str, Any]
    vector: list[float] = Field(None, description="given with_vectors only")


class Documents(BaseModel):
    documents: list[DocumentOut]


class DocumentsPage(Documents):
    next_cursor: str | None = Field(description="the `cursor` of the next page; null on the last page")
    warnings: list[str] = Field(None, description="why the filter can match nothing, as search says it")


class MetadataIn(_Body):
    id: DocId
    metadata: dict[str, Any] = Field(description="merge: an RFC 7386 merge patch (a key given null is removed, "
                                                 "objects merge key by key); else the whole new metadata")


class MetadataRequest(_Body):
    documents: list[MetadataIn] = Field(min_length=1, description="unknown ids are skipped")
    merge: bool = Field(True, description="merge into the stored metadata (false: replace it)")


class Updated(BaseModel):
    updated: int = Field(description="documents whose metadata changed")


class CountRequest(_Body):
    filter: dict[str, Any] = Field(None, description="count the documents this metadata filter passes (all of them "
                                                     "without one)")


class Counted(BaseModel):
    count: int = Field(description="documents the filter passes (all of them without one)")
    warnings: list[str] = Field(None, description="why the filter can match nothing, as search says it")


class Deleted(BaseModel):
    deleted: int = Field(description="documents deleted")


class ErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class Error(BaseModel):
    """Every 4xx and 5xx answer: what was wrong; for a body the models refused, their findings too."""
    detail: str
    errors: list[ErrorItem] | None = None


class Readiness(BaseModel):
    """The names in it are those the caller's key may see; with API keys, none without a key."""
    status: str = Field(description="ready (200), loading (503); a sharded collection: degraded (200, a shard is "
                                    "down) or 503 (every shard is down)")
    collections: list[str] | None = None
    failed: dict[str, str] | None = Field(None, description="collections that failed to open, and why")
    building: list[str] | None = None
    shards_alive: list[bool] | None = Field(None, description="a sharded collection: whether each shard answers")


_NAME = Field(description="1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
              json_schema_extra={"pattern": NAME_PATTERN})


class CreateAlias(_Body):
    collection_name: str = _NAME
    alias_name: str = _NAME


class DeleteAlias(_Body):
    alias_name: str = _NAME


class RenameAlias(_Body):
    old_alias_name: str = _NAME
    new_alias_name: str = _NAME


class AliasAction(_Body):
    """One of create_alias (also points an existing alias elsewhere), delete_alias, rename_alias."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["create_alias"]}, {"required": ["delete_alias"]},
                                                           {"required": ["rename_alias"]}]})
    create_alias: CreateAlias | None = None
    delete_alias: DeleteAlias | None = None
    rename_alias: RenameAlias | None = None

    @model_validator(mode="after")
    def _one(self):
        if sum(a is not None for a in (self.create_alias, self.delete_alias, self.rename_alias)) != 1:
            raise ValueError("an action is exactly one of create_alias, delete_alias and rename_alias")
        return self


class AliasActions(_Body):
    actions: list[AliasAction] = Field(min_length=1, max_length=1000, description="applied together, in order, or "
                                       "none of them (Qdrant's POST /collections/aliases)")
