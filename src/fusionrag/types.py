"""The types both sides of the service share: what a collection holds and answers (`Document`, `Hit`) and hybrid
search's default text weight. The engine (retriever/collection) and the client (fusionrag.client) both take them
from here, so `import fusionrag.client` loads no engine: this module needs numpy and the error classes
(retriever/errors.py, which import nothing).

Search parameters (`SearchParams`, `SearchOverrides`) stay with the configuration they are declared in
(retriever/engine/config.py, validated by pydantic): a request carries them as their knobs (`to_dict()`), which
the client writes into the body as it finds them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusionrag.retriever.errors import InputError

# Hybrid search: the text ranking's weight by default (retriever/collection/config.py has the other knobs of
# fusion). Chosen on half of a labelled question set of the Python docs' headings (bench/service/hybrid.py).
DEFAULT_TEXT_WEIGHT = 0.5


@dataclass
class Document:
    id: str | None = None
    text: str | None = None
    vector: np.ndarray | list[float] | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.vector, dict):  # Document(id, text, {...}): the third field is the vector
            raise InputError(f"document {self.id!r}: its third field is the vector, and a dict was given there; "
                             "pass metadata by name: Document(id, text, metadata={...}) or "
                             "Document(id, text, vector, {...})")


@dataclass
class Hit:
    id: str
    distance: float
    score: float
    text: str | None
    metadata: dict
    vector: np.ndarray | None = None


__all__ = ["DEFAULT_TEXT_WEIGHT", "Document", "Hit"]
