"""Request bodies of the HTTP API. Limits that come from the configuration are checked in the routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# JSON has no NaN, but Python's parser accepts the literal; a non-finite number is refused here.
Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateCollection(_Body):
    name: str = Field(description="^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    dimension: int | None = Field(None, ge=1, le=65536,
                                  description="vector dimension; may be left out when `embedding` is given")
    metric: Literal["l2", "ip", "cosine"] = "cosine"
    embedding: str | None = Field(None, description="model that embeds texts, e.g. all-MiniLM-L6-v2")

    @model_validator(mode="after")
    def _dimension_or_embedding(self):
        if self.dimension is None and self.embedding is None:
            raise ValueError("give a dimension, an embedding model, or both")
        return self


class SearchRequest(_Body):
    vectors: list[list[Finite]] | None = Field(None, description="query vectors")
    texts: list[str] | None = Field(None, description="query texts, embedded by the collection's model")
    k: int = Field(10, ge=1, description="hits per query")
    filter: dict[str, Any] | None = Field(None, description="metadata filter, e.g. {\"source\": \"design.md\"}")
    params: dict[str, Any] | None = Field(None, description="tuning: nprobe, probe_ratio, rerank, ...")
    stats: bool = Field(False, description="return the engine's statistics of each query")

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.vectors is None) == (self.texts is None):
            raise ValueError("give exactly one of 'vectors' and 'texts'")
        if not (self.vectors or self.texts):
            raise ValueError("no queries: 'vectors' or 'texts' is empty")
        return self


class DocumentIn(_Body):
    id: str | None = Field(None, min_length=1, max_length=512, description="left out: a new id is assigned")
    text: str | None = None
    vector: list[Finite] | None = Field(None, description="left out: the text is embedded")
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _text_or_vector(self):
        if self.text is None and self.vector is None:
            raise ValueError("a document needs a text, a vector, or both")
        return self


class UpsertRequest(_Body):
    documents: list[DocumentIn] = Field(min_length=1)


class DeleteRequest(_Body):
    ids: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(min_length=1)
