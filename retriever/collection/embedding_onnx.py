"""A sentence-transformers model from a directory, run by ONNX Runtime instead of torch: the same vectors (cosine
>= 0.9999 to the torch model's, checked as it is exported), a short query embedded in about a third of the time.

The model's transformer is exported once, from the model itself (sentence-transformers on torch, offline), by
torch's TorchScript ONNX exporter (MiniLM in ~4 s, without onnxscript; torch.export's exporter took ~15 s and
made a graph onnxruntime's optimizer does not fuse, ~20% slower. The TorchScript one is deprecated since torch
2.9: where a later torch drops it, the export fails and the model runs on torch, the log says so); for BERT-like
models onnxruntime's transformer optimizer then fuses its attention, layer norms and GELUs. Tokenizing (the model's own fast tokenizer, saved beside the graph), pooling and
normalising happen here, as sentence-transformers does them for the model's modules (Transformer, Pooling,
Normalize). Any other shape of model (a Dense layer, a prompt, a tokenizer without a fast version, ...) is
Unsupported, and runs on torch as before.

The exported files are cached on disk, in FUSIONRAG_CACHE_DIR/onnx (default ~/.cache/fusionrag/onnx), one folder
per model, named by a hash of the model directory's contents (so a changed model is exported anew) and of this
module's FORMAT: model.onnx, tokenizer.json and meta.json (what to do around the graph, and the files' SHA-256).
A folder is written whole under a temporary name and renamed into place, so a reader sees a complete one or none:
two processes exporting at once both succeed, and one's folder is kept. A cached folder whose files do not match
their hashes, or that ONNX Runtime cannot load, is set aside and exported again. Where the cache cannot be written,
the export goes to a temporary folder this process removes at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# ONNX Runtime's wheels (1.29 and later) send telemetry from Linux too: its uploader looked up
# mobile.events.data.microsoft.com every few seconds from a retrieval service that calls out to nothing else.
# Off unless the operator says otherwise; read once, when onnxruntime first initialises (so set here, before
# any import of it).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

FORMAT = 1  # of a cache folder: a change here exports every model anew
MIN_COSINE = 0.9999  # an export whose vectors are further than this from the torch model's is refused
# Model types onnxruntime's transformer optimizer fuses as BERT (optimum maps them so too); an export of any
# other runs unfused, as ONNX Runtime's own graph optimisations leave it.
FUSED_AS_BERT = {"bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "mpnet"}
POOLING = ("mean", "cls", "max", "mean_sqrt_len_tokens")
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
PROBES = ["", "PQ", "What happens to a deleted document?", "Ünïcödé text, 中文 and emoji 🚀", "  spaced   out  ",
          "Reads go through io_uring, a ring buffer shared with the Linux kernel. " * 3,
          " ".join(f"word{i}" for i in range(600))]  # past any max_seq_length: cut as torch cuts it
STALE_S = 3600.0  # a temporary export folder this old was left by a process that died: removed

_export_lock = threading.Lock()  # torch's ONNX exporter keeps global state: one export at a time in a process


class Unsupported(Exception):
    """The model cannot run on ONNX Runtime here (the reason is the message): it runs on torch."""


class Corrupt(Exception):
    """A cached export that is not what its meta.json says."""


def cache_root() -> Path:
    base = os.environ.get("FUSIONRAG_CACHE_DIR")
    if base:
        return Path(base).expanduser() / "onnx"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusionrag" / "onnx"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def model_hash(path: Path) -> str:
    """A hash of what the model directory holds (each file's name and contents; hidden ones left out) and of
    FORMAT: the name of its cache folder."""
    h = hashlib.sha256(f"fusionrag-onnx-{FORMAT}\n".encode())
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    for f in files:
        h.update(f"{f.relative_to(path).as_posix()}\0{f.stat().st_size}\0{_file_sha256(f)}\n".encode())
    return h.hexdigest()[:40]


def cores() -> int:
    """CPU cores this process may run on (its affinity: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load(path: Path, reference: Callable[[], object], threads: Callable[[bool], int]) -> OnnxModel:
    """The model in directory `path` on ONNX Runtime: from the cache, else exported from reference() (its
    SentenceTransformer, on torch) and cached. threads(bulk) gives the intra-op threads a pass may use.
    Unsupported when it cannot run there (onnxruntime missing, a model of another shape, an export whose vectors
    differ from the torch model's)."""
    try:
        import onnxruntime
    except (ImportError, OSError) as e:  # OSError: its shared library does not load
        raise Unsupported(f"onnxruntime is not installed ({e})") from None
    onnxruntime.disable_telemetry_events()  # (ORT_DISABLE_TELEMETRY, set above, is what stops its uploader)
    root = cache_root()
    key = model_hash(path)
    entry = root / key
    if entry.is_dir():
        try:
            return OnnxModel(entry, threads)
        except Corrupt as e:
            log.warning("cached ONNX export %s of embedding model %s is unusable (%s): exporting it again", entry,
                        path, e)
            _discard(entry)
    with _export_lock:
        if entry.is_dir():  # exported meanwhile, by this process or another
            try:
                return OnnxModel(entry, threads)
            except Corrupt:
                _discard(entry)
        st = reference()  # the torch model: its own errors are the model's, raised as they are
        try:
            entry = export(path, st, root, key)
        except Unsupported:
            raise
        except Exception as e:  # noqa: BLE001 - a full disk, an exporter's bug: the torch model still serves
            raise Unsupported(f"its export failed ({type(e).__name__}: {str(e)[:300]})") from e
    try:
        return OnnxModel(entry, threads)
    except Corrupt as e:  # what was just written and checked does not load: the disk is at fault
        raise Unsupported(f"its export does not load back ({e})") from None


def _discard(folder: Path) -> None:
    """Set a cache folder aside (renamed, so that no reader takes it meanwhile), then remove it."""
    aside = folder.with_name(f".bad-{uuid.uuid4().hex}")
    try:
        folder.rename(aside)
    except OSError:
        return  # another process set it aside first
    shutil.rmtree(aside, ignore_errors=True)


def _recipe(st) -> dict:
    """What runs around the transformer's graph, read off the SentenceTransformer; Unsupported for a model of
    another shape than Transformer, Pooling (a mode POOLING lists), Normalize (optional)."""
    kinds = [type(m).__name__ for m in st]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise Unsupported(f"its modules are {kinds}, not Transformer, Pooling and optionally Normalize")
    transformer, pooling = st[0], st[1]
    if getattr(st, "default_prompt_name", None):
        raise Unsupported(f"it prepends a default prompt ({st.default_prompt_name!r})")
    if getattr(transformer, "modality_config", None) not in (
            None, {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}):
        raise Unsupported(f"its transformer is not a text encoder ({transformer.modality_config})")
    if getattr(transformer, "do_lower_case", False):
        raise Unsupported("its Transformer module lowercases texts itself (do_lower_case)")
    if getattr(transformer, "processing_kwargs", None):
        raise Unsupported(f"its tokenizer is called with extra arguments ({transformer.processing_kwargs})")
    mode = pooling.pooling_mode
    if mode not in POOLING:
        raise Unsupported(f"its pooling is {mode!r}, not one of {', '.join(POOLING)}")
    tokenizer = st.tokenizer
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise Unsupported("its tokenizer has no fast (tokenizers) version")
    if getattr(tokenizer, "padding_side", "right") != "right":
        raise Unsupported("its tokenizer pads on the left")
    names = list(tokenizer.model_input_names)
    if not set(names) <= set(INPUTS) or "input_ids" not in names or "attention_mask" not in names:
        raise Unsupported(f"its model reads {names}, not {' and '.join(INPUTS)}")
    return {"inputs": [n for n in INPUTS if n in names], "max_seq_length": int(st.max_seq_length),
            "pooling": mode, "normalize": kinds[-1] == "Normalize", "dim": int(st.get_embedding_dimension()),
            "pad_id": int(tokenizer.pad_token_id or 0), "truncation_side": tokenizer.truncation_side,
            "model_type": getattr(transformer.auto_model.config, "model_type", None)}


def export(path: Path, st, root: Path, key: str) -> Path:
    """Export the SentenceTransformer `st` (the model in `path`) into the cache folder root/key, written whole
    under a temporary name and renamed into place; returns the folder (another process's, if it got there first;
    a temporary one, removed at exit, if the cache cannot be written)."""
    import torch

    t0 = time.perf_counter()
    recipe = _recipe(st)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        cached = True
    except OSError as e:
        log.warning("the ONNX cache %s cannot be written (%s): embedding model %s is exported for this process only",
                    root, e, path)
        tmp = Path(tempfile.mkdtemp(prefix="fusionrag-onnx-"))
        atexit.register(shutil.rmtree, tmp, True)
        cached = False
    try:
        _remove_stale(root)
        auto_model = st[0].auto_model
        tokenizer = st.tokenizer
        # The graph runs the transformer only; eager attention (the same sums as sdpa) traces into the pattern
        # that onnxruntime's optimizer fuses into one Attention op.
        attn = getattr(auto_model.config, "_attn_implementation", None)
        names = recipe["inputs"]

        class Encoder(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, *inputs):
                return self.model(**dict(zip(names, inputs)), return_dict=True).last_hidden_state

        example = tokenizer(PROBES[2:4], padding=True, truncation=True, max_length=recipe["max_seq_length"],
                            return_tensors="pt")
        axes = {n: {0: "batch", 1: "sequence"} for n in [*names, "token_embeddings"]}
        switch = attn not in (None, "eager") and hasattr(auto_model, "set_attn_implementation")
        try:
            if switch:
                auto_model.set_attn_implementation("eager")
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation, tracer notes
                torch.onnx.export(Encoder(auto_model).eval(), tuple(example[n] for n in names),
                                  str(tmp / "plain.onnx"), input_names=names, output_names=["token_embeddings"],
                                  dynamic_axes=axes, opset_version=17, dynamo=False)
        except Exception as e:
            raise Unsupported(f"torch.onnx.export failed: {type(e).__name__}: {str(e)[:300]}") from None
        finally:
            if switch:
                auto_model.set_attn_implementation(attn)
        (tmp / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str())
        reference = st.encode(PROBES, batch_size=4, normalize_embeddings=True, convert_to_numpy=True,
                              show_progress_bar=False)
        graphs = []
        if recipe["model_type"] in FUSED_AS_BERT:
            try:
                _fuse(tmp / "plain.onnx", tmp / "fused.onnx", auto_model.config)
                graphs.append("fused.onnx")
            except Exception as e:  # noqa: BLE001 - the unfused graph still serves
                log.info("embedding model %s: onnxruntime's optimizer did not fuse it (%s: %s)", path,
                         type(e).__name__, e)
        graphs.append("plain.onnx")
        tried = []
        for graph in graphs:
            recipe["files"] = {"model.onnx": _file_sha256(tmp / graph), "tokenizer.json":
                               _file_sha256(tmp / "tokenizer.json")}
            got = OnnxModel(tmp, lambda bulk: 1, recipe, graph).encode(PROBES, batch_size=4)
            cosine = float((got * reference).sum(1).min())  # both unit-length
            tried.append(f"{graph}: {cosine:.6f}")
            if cosine >= MIN_COSINE:
                break
        else:
            raise Unsupported(f"its ONNX export's vectors differ from torch's (minimum cosine {', '.join(tried)})")
        (tmp / graph).rename(tmp / "model.onnx")
        for other in ("plain.onnx", "fused.onnx"):
            (tmp / other).unlink(missing_ok=True)
        import onnxruntime
        recipe.update(format=FORMAT, source=str(path), graph=graph.removesuffix(".onnx"), probe_min_cosine=cosine,
                      torch=torch.__version__, onnxruntime=onnxruntime.__version__,
                      export_s=round(time.perf_counter() - t0, 1))
        (tmp / "meta.json").write_text(json.dumps(recipe, indent=1))
        for f in tmp.iterdir():
            _fsync(f)
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep other users' processes out of a shared cache
        if not cached:
            return tmp
        entry = root / key
        try:
            tmp.rename(entry)  # atomic: a reader sees the whole folder or none
        except OSError:
            if not entry.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process renamed its own first: that one is kept
            return entry
        _fsync(root)
        log.info("embedding model %s exported to ONNX (%s graph, minimum cosine to torch %.6f, %.1f s): %s", path,
                 recipe["graph"], cosine, recipe["export_s"], entry)
        return entry
    except BaseException:
        if cached:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fuse(src: Path, dst: Path, config) -> None:
    from onnxruntime.transformers import optimizer

    # Its fusions report themselves at INFO, line by line: not this service's news.
    quiet = {name: logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
             if name.startswith(("fusion", "onnx_model", "optimizer", "onnxruntime.transformers"))}
    levels = {name: logger.level for name, logger in quiet.items()}
    for logger in quiet.values():
        logger.setLevel(logging.WARNING)
    try:
        model = optimizer.optimize_model(str(src), model_type="bert", opt_level=0,
                                         num_heads=int(getattr(config, "num_attention_heads", 0) or 0),
                                         hidden_size=int(getattr(config, "hidden_size", 0) or 0))
        fused = model.get_fused_operator_statistics()
        if not fused.get("Attention") and not fused.get("MultiHeadAttention"):
            raise ValueError(f"no attention fused ({fused})")
        model.save_model_to_file(str(dst))
    finally:
        for name, logger in quiet.items():
            logger.setLevel(levels[name])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(root: Path) -> None:
    """Temporary folders of exports whose process died (older than STALE_S)."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > STALE_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


class OnnxModel:
    """An exported model with the parts of a SentenceTransformer an Embedder uses (encode, max_seq_length,
    get_embedding_dimension) and token_spans. Each pass takes a slot of its session (as many passes at once as the
    cores hold the session's threads), so a query's session is not held behind a bulk import's."""

    runtime = "onnx"

    def __init__(self, folder: Path, threads: Callable[[bool], int], recipe: dict | None = None,
                 graph: str = "model.onnx"):
        from tokenizers import Tokenizer

        self.folder, self._threads, self._graph = folder, threads, graph
        if recipe is None:
            try:
                recipe = json.loads((folder / "meta.json").read_text())
            except (OSError, ValueError) as e:
                raise Corrupt(f"meta.json: {e}") from None
            if not isinstance(recipe, dict) or recipe.get("format") != FORMAT:
                raise Corrupt("meta.json is not this version's")
            for name, digest in recipe.get("files", {}).items():
                try:
                    ok = _file_sha256(folder / name) == digest
                except OSError as e:
                    raise Corrupt(f"{name}: {e}") from None
                if not ok:
                    raise Corrupt(f"{name} does not match its SHA-256")
        self.recipe = recipe
        try:
            self.max_seq_length = int(recipe["max_seq_length"])
            self._dim, self._names, self._pad = int(recipe["dim"]), list(recipe["inputs"]), int(recipe["pad_id"])
            self._pooling, self._normalize = recipe["pooling"], bool(recipe["normalize"])
            self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the folder is unusable
            raise Corrupt(f"{type(e).__name__}: {e}") from None
        # Texts cut as transformers cuts them (padding is done here, per batch); spans read the whole text.
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_seq_length, strategy="longest_first",
                                    direction=recipe.get("truncation_side", "right"))
        self._spans = Tokenizer.from_str(self._tok.to_str())
        self._spans.no_truncation()
        self._sessions: dict[int, tuple] = {}  # intra-op threads -> (session, its lock)
        self._sessions_lock = threading.Lock()
        self._session(False)  # a file ONNX Runtime cannot load is found now

    def _session(self, bulk: bool):
        return self._session_of(max(1, int(self._threads(bulk))))

    def _session_of(self, threads: int):
        """The session of `threads` intra-op threads, and the semaphore of its passes at once."""
        with self._sessions_lock:
            if threads not in self._sessions:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
                opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                # Threads that wait sleep instead of spinning: on a busy machine spinning threads take the cores
                # the working ones need (torch's OpenMP pool, spinning, made 2 threads up to 20x slower than 1 there).
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                opts.log_severity_level = 3
                try:
                    session = ort.InferenceSession(str(self.folder / self._graph), opts,
                                                   providers=["CPUExecutionProvider"])
                except Exception as e:  # noqa: BLE001 - ONNX Runtime's own error types
                    raise Corrupt(f"ONNX Runtime cannot load {self._graph}: {str(e)[:300]}") from None
                # Passes at once on a session: as many as its threads leave cores for (ONNX Runtime runs a session
                # from several threads); the query session's single-threaded passes use every core together,
                # the bulk session's own threads do.
                passes = max(1, (os.cpu_count() or 1) // threads)
                self._sessions[threads] = (session, threading.BoundedSemaphore(passes))
            return self._sessions[threads]

    def get_embedding_dimension(self) -> int:
        return self._dim

    def encode_on(self, threads: int, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """encode (normalised) on the session of `threads` intra-op threads, whatever the call would take: a
        measurement's, as embedding_bf16.timing takes it on one thread."""
        texts = list(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        session, lock = self._session_of(threads)
        return self._encode(texts, out, session, lock, batch_size, True, False) if texts else out

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        return [tuple(o) for o in self._spans.encode(text, add_special_tokens=False).offsets]

    def encode(self, texts: Sequence[str], batch_size: int = 64, normalize_embeddings: bool = True,
               show_progress_bar: bool = False, bulk: bool = False, wide: bool = False, **_) -> np.ndarray:
        """float32 (len(texts), dim): batches of texts of like lengths (longest first, as sentence-transformers
        orders them), each padded to its longest. wide: a call alone on the machine (the caller knows): on the bulk
        session's threads (every core by default) where no bulk pass holds it now, else as any call; one query of
        a paragraph took 9.6 ms on one thread and 6.5 on two (2-core VM)."""
        texts = list(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        if not texts:
            return out
        session, lock = self._session(bulk)
        if wide and not bulk:
            wide_session, wide_lock = self._session(True)
            if wide_lock is not lock and wide_lock.acquire(blocking=False):
                try:
                    return self._encode(texts, out, wide_session, contextlib.nullcontext(), batch_size,
                                        normalize_embeddings, show_progress_bar)
                finally:
                    wide_lock.release()
        return self._encode(texts, out, session, lock, batch_size, normalize_embeddings, show_progress_bar)

    def _encode(self, texts, out, session, lock, batch_size, normalize_embeddings, show_progress_bar) -> np.ndarray:
        from tqdm import tqdm

        encodings, lengths, batches = self._plan(texts, batch_size)
        for rows in tqdm(batches, desc="Batches", disable=not show_progress_bar):  # as sentence-transformers'
            feed = self._feed(encodings, lengths, rows)
            with lock:
                tokens = session.run(None, feed)[0]
            out[rows] = self._pool(tokens, feed["attention_mask"])
        if normalize_embeddings or self._normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def _plan(self, texts, batch_size):
        """The texts' encodings, their lengths in tokens, and the batches (length_batches) they run in."""
        encodings, lengths, order = self._tokens(texts)
        return encodings, lengths, length_batches(lengths[order], order, batch_size)

    def _tokens(self, texts):
        """The texts' encodings, their lengths in tokens, and their order longest first (as sentence-transformers
        orders them)."""
        encodings = self._tok.encode_batch(texts)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(texts))
        return encodings, lengths, np.argsort(-lengths, kind="stable")

    def _feed(self, encodings, lengths, rows) -> dict:
        """The model's inputs for one batch (the texts `rows`, longest first), padded to its longest."""
        width = int(lengths[rows[0]])
        feed = {n: np.zeros((len(rows), width), dtype=np.int64) for n in self._names}
        feed["input_ids"].fill(self._pad)
        for r, i in enumerate(rows):
            e, n = encodings[i], int(lengths[i])
            feed["input_ids"][r, :n] = e.ids
            feed["attention_mask"][r, :n] = e.attention_mask
            if "token_type_ids" in feed:
                feed["token_type_ids"][r, :n] = e.type_ids
        return feed

    def _pool(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """sentence-transformers' Pooling, its mode, over the tokens the attention mask keeps."""
        m = mask.astype(tokens.dtype)
        if self._pooling == "cls":
            return tokens[:, 0]
        if self._pooling == "max":
            return np.where(m[..., None] > 0, tokens, -np.inf).max(1)
        summed = np.einsum("bsd,bs->bd", tokens, m)
        counts = np.maximum(m.sum(1, keepdims=True), 1e-9)
        return summed / (counts if self._pooling == "mean" else np.sqrt(counts))


CUT = 0.75  # a batch ends before a text shorter than this share of its longest: the padding it would bring


def length_batches(lengths: np.ndarray, order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Texts (their indices, `order`, longest first, `lengths` theirs) in batches of at most batch_size, each cut
    before a text shorter than CUT of the batch's longest: padding costs as much as tokens do, and a transformer's
    attention more. (A batch used to take texts of any length until it held 1,024 tokens: 16 concurrent paragraph
    queries then cost 20 ms of CPU each, against 11.4 cut so and 14 one at a time; a bulk pass of 256 paragraphs
    costs the same either way, 12-13 ms each: 2-core VM, all-MiniLM-L6-v2.)"""
    out, lo = [], 0
    while lo < len(order):
        width, hi = int(lengths[lo]), lo + 1
        while hi < len(order) and hi - lo < batch_size and lengths[hi] >= CUT * width:
            hi += 1
        out.append(order[lo:hi])
        lo = hi
    return out
