"""The prompt of the RAG user: the retrieved hits as numbered context, then the question."""

from __future__ import annotations

SYSTEM = ("Answer the question from the context alone. Cite the ids of the passages you use in brackets. "
          "If the context does not hold the answer, say so.")
MAX_HIT_CHARS = 1200


def rag_messages(question: str, hits: list[dict]) -> list[dict]:
    """OpenAI chat messages for `question` with `hits` (dicts with "id" and "text") as the context."""
    context = "\n\n".join(f"[{h['id']}] {(h.get('text') or '')[:MAX_HIT_CHARS]}" for h in hits)
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]
