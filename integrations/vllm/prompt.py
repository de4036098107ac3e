"""The retrieval-augmented prompt: the hits go into a system message, numbered, best first.

With the default template, a question whose search found two passages reaches the model as

    system:  Answer the user's question using the numbered passages below. Cite the passages you
             use by their number. If they do not contain the answer, say that you do not know.

             Passages:
             [1] <text of the best hit>

             [2] <text of the second hit>
    user:    <the question>

A conversation that already starts with a system message keeps it; the passages block follows it
in the same message. The user's messages are never changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionrag.retriever.collection import Hit
from fusionrag.retriever.errors import InputError

RAG_TEMPLATE = (
    "Answer the user's question using the numbered passages below. Cite the passages you use by their "
    "number. If they do not contain the answer, say that you do not know.\n\n"
    "Passages:\n{passages}"
)
PASSAGE_TEMPLATE = "[{n}] {text}"


def passages(hits: Sequence[Hit], passage_template: str = PASSAGE_TEMPLATE) -> str:
    """The hits as numbered passages; `passage_template` may use {n}, {id}, {text} and {score}."""
    return "\n\n".join(passage_template.format(n=i, id=h.id, text=h.text or "", score=h.score)
                       for i, h in enumerate(hits, 1))


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def question_of(messages: Sequence[dict]) -> str:
    """The text of the last user message: what retrieval searches for."""
    for m in reversed(messages):
        if m.get("role") == "user":
            text = _text_of(m.get("content")).strip()
            if text:
                return text
            break
    raise InputError("the conversation needs a last user message with text to retrieve for")


def augment(messages: Sequence[dict], hits: Sequence[Hit], template: str = RAG_TEMPLATE,
            passage_template: str = PASSAGE_TEMPLATE) -> list[dict]:
    """The conversation with the hits put into its system message (see the module docstring)."""
    block = template.format(passages=passages(hits, passage_template))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
