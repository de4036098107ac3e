"""Batch RAG with vLLM's offline engine: one embedding call, one batched search and one batched
`LLM.chat` for a whole list of questions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusionrag.integrations.vllm.prompt import PASSAGE_TEMPLATE, RAG_TEMPLATE, augment
from fusionrag.retriever.collection import Collection, Hit
from fusionrag.retriever.errors import InputError


@dataclass
class RAGAnswer:
    question: str
    text: str          # the model's answer
    hits: list[Hit]    # what was retrieved, best first
    prompt: str        # the prompt the engine ran, after the chat template

    @property
    def ids(self) -> list[str]:
        return [h.id for h in self.hits]


def rag_chat(llm, collection: Collection, questions: Sequence[str], *, k: int = 4, filter: dict | None = None,
             sampling_params=None, embedder=None, template: str = RAG_TEMPLATE,
             passage_template: str = PASSAGE_TEMPLATE, system: str | None = None) -> list[RAGAnswer]:
    """Answer each question from its top-k hits in `collection` (a Collection, or a ShardedCollection:
    retriever/sharded/docs.py) with the `vllm.LLM` engine `llm`.

    Questions are embedded by `embedder` (anything with `.embed(texts)`), by default the
    collection's own embedding model. `system` is an optional system message put before the passages.
    """
    questions = list(questions)
    if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
        raise InputError("questions must be a non-empty list of non-empty strings")
    if embedder is None:
        if not collection.embedding:
            raise InputError(f"collection {collection.name!r} has no embedding model: pass embedder=")
        from fusionrag.retriever.collection.embedding import get_embedder

        embedder = get_embedder(collection.embedding)
    vectors = np.asarray(embedder.embed(questions), dtype=np.float32)
    hits = collection.search(vectors, k=k, filter=filter).hits
    head = [{"role": "system", "content": system}] if system else []
    conversations = [augment(head + [{"role": "user", "content": q}], h, template, passage_template)
                     for q, h in zip(questions, hits)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False)
    return [RAGAnswer(q, o.outputs[0].text, h, o.prompt) for q, h, o in zip(questions, hits, outputs)]
