"""The demo collection: the project's own documentation (server/corpus/*.md), chunked and embedded.

Built on the first start of a service whose data directory has no collection, loaded on later starts.
"""

from __future__ import annotations

import logging
import re
from importlib import resources

from fusionrag.retriever.collection import Catalog, Collection, Document
from fusionrag.retriever.collection.embedding import get_embedder

DEMO = "demo"
MAX_CHUNK_CHARS = 900
log = logging.getLogger("fusionrag.server")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


def _blocks(markdown: str):
    """(heading, block) pairs: blocks are paragraphs, lists, tables or code, split on blank lines."""
    heading, lines, fenced = "", [], False
    for line in markdown.splitlines() + [""]:
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,4} ", line):
            if lines:
                yield heading, "\n".join(lines)
            heading, lines = line.lstrip("#").strip(), []
        elif not fenced and not line.strip():
            if lines:
                yield heading, "\n".join(lines)
            lines = []
        else:
            lines.append(line.rstrip())


def _unwrap(block: str) -> str:
    """Prose and list items on one line each, as the text was meant; tables and code stay as they are."""
    if block.startswith(("|", "```")):
        return block
    items: list[str] = []
    for line in block.split("\n"):
        if not items or re.match(r"\s*([-*]|\d+\.) ", line) and not line.startswith("   "):
            items.append(line.strip())
        else:
            items[-1] += " " + line.strip()
    return "\n".join(items)


def _split_long(block: str) -> list[str]:
    """A block longer than a chunk is cut between lines (list items, table rows), never inside one."""
    if len(block) <= MAX_CHUNK_CHARS:
        return [block]
    out, cur = [], ""
    for line in block.split("\n"):
        if cur and len(cur) + 1 + len(line) > MAX_CHUNK_CHARS:
            out.append(cur)
            cur = line
        else:
            cur = f"{cur}\n{line}" if cur else line
    return out + [cur]


def chunk_markdown(markdown: str, source: str) -> list[Document]:
    """One document per section, or several when a section is longer than a chunk. Ids: `stem/section[-n]`."""
    stem = source.rsplit(".", 1)[0]
    sections: dict[str, list[str]] = {}
    for heading, block in _blocks(markdown):
        if heading:  # text before the first section heading is only the title
            sections.setdefault(heading, []).extend(_split_long(_unwrap(block)))
    docs = []
    for heading, blocks in sections.items():
        chunks, cur = [], ""
        for block in blocks:
            if cur and len(cur) + 2 + len(block) > MAX_CHUNK_CHARS:
                chunks.append(cur)
                cur = block
            else:
                cur = f"{cur}\n\n{block}" if cur else block
        chunks.append(cur)
        for n, text in enumerate(chunks):
            doc_id = f"{stem}/{_slug(heading)}" + (f"-{n + 1}" if len(chunks) > 1 else "")
            docs.append(Document(id=doc_id, text=text,
                                 metadata={"source": source, "section": heading, "part": n + 1}))
    return docs


def corpus() -> list[Document]:
    folder = resources.files("fusionrag.server") / "corpus"
    docs = []
    for name in sorted(p.name for p in folder.iterdir() if p.name.endswith(".md")):
        docs += chunk_markdown((folder / name).read_text(encoding="utf-8"), name)
    return docs


def embedded_text(doc: Document) -> str:
    # The section title says what a chunk is about, so it goes into the vector.
    return f"{doc.metadata['section']}: {doc.text}"


def ensure_demo(catalog: Catalog, embedding: str) -> Collection | None:
    """Build the demo collection when the data directory has none, or finish one a crash interrupted."""
    names = catalog.names()
    embedder = get_embedder(embedding)
    if DEMO in names:
        coll = catalog.get(DEMO)
        unfinished = coll.info()["build_state"]["generation"] == 0  # never merged: a crash cut the build short
        if not (unfinished and coll.embedding == embedder.name and coll.dim == embedder.dim):
            return None
    elif names:
        return None
    else:
        coll = catalog.create(DEMO, embedder.dim, "cosine", embedder.name)
    docs = corpus()
    log.info("building the demo collection", extra={"documents": len(docs), "embedding": embedder.name})
    vectors = embedder.embed([embedded_text(d) for d in docs])
    for doc, vec in zip(docs, vectors):
        doc.vector = vec
    coll.upsert(docs)  # ids are fixed, so a rerun after a crash replaces rather than duplicates
    coll.merge(progress=False)  # the service's stderr is its log: no bars in it
    log.info("demo collection ready", extra={"documents": len(coll)})
    return coll
