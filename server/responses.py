"""Answers: hits and documents as JSON, vectors written by orjson."""

from __future__ import annotations

import json

import numpy as np
import orjson
from fastapi.responses import JSONResponse

from fusionrag.retriever.collection import Document


def hit_json(h, with_vector: bool = False) -> dict:
    out = {"id": h.id, "score": float(h.score), "distance": float(h.distance), "text": h.text, "metadata": h.metadata}
    if with_vector:
        out["vector"] = np.asarray(h.vector, dtype=np.float32)
    return out


class VectorJSON(JSONResponse):
    """JSON by orjson, vectors given as float32 arrays: the floats' text is most of what an answer with vectors
    costs, and orjson writes them far faster than json.dumps (bench/cache/remote_reads.py measures the answer's
    cost), in float32's shortest digits: half the bytes, read back to the same float32."""

    def render(self, content) -> bytes:
        try:
            return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError:  # what orjson does not write, such as an integer past 64 bits in metadata
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                              default=np.ndarray.tolist).encode()


def document_json(d: Document, with_vector: bool = False) -> dict:
    out = {"id": d.id, "text": d.text, "metadata": d.metadata}
    if with_vector:
        out["vector"] = np.asarray(d.vector, dtype=np.float32)
    return out


def plain(stats: dict) -> dict:
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in stats.items()}
