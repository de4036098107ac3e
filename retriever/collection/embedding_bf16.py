"""An embedding model's transformer run by torch in bfloat16, on CPUs with bf16 matrix instructions (AMX-BF16,
AVX512-BF16): about half the CPU of ONNX Runtime's float32 model for the same vectors (cosine >= 0.9999 to the
float32 model's, checked as it loads), a third for short questions embedded together.

It stands beside the ONNX Runtime model (embedding_onnx.OnnxModel), whose tokenizer, pooling and normalisation it
shares: only the transformer's pass differs. The pass (_Bert) is BERT's encoder written out in a dozen torch calls
a layer, its weights read from the model's own files (no transformers or sentence-transformers in the process):
the Linear layers (nearly all of the arithmetic) hold bfloat16 weights packed once for oneDNN (bf16 products with
float32 sums: its AMX kernels), query, key and value as one product, the GELU fused into the first feed-forward
product; attention in bf16 (torch's scaled_dot_product_attention); embeddings, layer norms and residual sums
float32. A pass packs its texts: every product and norm runs on their tokens alone, end to end, padding only where
attention needs each text's own (a call's texts of any lengths then share a pass at no cost in padding); the token
count is rounded up to one of a few dozen sizes (padded_rows), since oneDNN compiles and keeps a kernel a shape.

choose() decides, per machine, as the model loads: the bf16 model serves only where the CPU has bf16 matrix
instructions, torch imports, the model is a BERT encoder, its vectors on PROBES and SAMPLE are within MIN_COSINE of
the float32 model's, and a short timing (thread CPU, one thread each, min of a few passes) finds it at most FASTER
of the float32 runtime's time for a batch of 16 paragraphs and for one. Otherwise the float32 runtime serves,
unchanged. The log says which and why. FUSIONRAG_EMBED_BF16 (or embedding.set_runtime): 'auto' (the default) as
above, 'off' never, 'on' without the capability check and the timing (the cosine check stays).

Measured in the service (fusionrag serve, text queries from 1 and 16 connections, runs alternated x2 with ONNX
Runtime's float32 model, 2-core AMX VM): Python-docs paragraphs 88-92 and 199 q/s against 90-92 and 155-171;
questions as RAG users ask them 116-117 and 278-297 against 111-112 and 274-276; server CPU a query 8.1-8.2 ms
against 11.0-12.1 at 16 connections; the process ~155 MiB more (RssAnon: torch, the weights, oneDNN's kernels).

Threads: every pass runs on one torch thread (torch's thread count is one setting for the process, and its
OpenMP passes on two threads were far slower on a busy machine: _Passes), at most one pass a core at once across
the process. A call's texts run as many passes at once as its threads allow (pass_batches: a share of its tokens
each): threads(False) for a call, threads(True) for bulk work (an import) and for a wide call (a lone query: one
text is one pass, so a wide call of one text runs on one thread). An import's passes so take free cores pass by
pass, and a query takes the next free one rather than waiting for the import's call. Since a call spreads over
the cores itself, the service runs one call of the model at a time (calls_at_once), gathering the texts that arrive
meanwhile into the next.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fusionrag.retriever.collection import embedding_onnx

log = logging.getLogger(__name__)

ENV = "FUSIONRAG_EMBED_BF16"  # off (default) | auto | on
MODES = ("auto", "on", "off")
MIN_COSINE = 0.9999  # to the float32 model's vectors, on PROBES and SAMPLE
FASTER = 0.9  # the bf16 pass must take at most this share of the float32 runtime's thread CPU (batch and single)
CPU_FLAGS = ("amx_bf16", "avx512_bf16")

# Paragraph-long texts of the kind a collection holds (and a RAG client asks about): what the timing embeds and,
# with embedding_onnx.PROBES, what the vectors are checked on.
_SENTENCES = [
    "The collection keeps its vectors in a graph index on disk and reads the blocks a query needs through io_uring.",
    "A deleted document is marked in a tombstone file first; the next merge drops it from the index for good.",
    "Compaction folds the write-ahead log into the main index once it holds more than a few thousand records.",
    "Each shard answers its own top-k, and the router merges the answers by score before it returns the hits.",
    "If the argument is omitted, the function returns None and the caller is expected to check for that case.",
    "Changed in version 3.11: the exception now carries the offending value in its args attribute as well.",
    "The context manager closes the file when the block ends, even when an exception propagates out of it.",
    "Keyword arguments that are not recognised raise TypeError, naming the first unexpected one in the message.",
    "Product quantisation splits each vector into sub-vectors and stores the index of the nearest centroid of each.",
    "Recall at ten is the share of the true ten nearest neighbours that the approximate search returns.",
    "Environment variables override the values in the configuration file; command-line flags override both.",
    "Ünïcödé names, 中文 paragraphs and emoji 🚀 are tokenised into word pieces the model has seen in training.",
]
SAMPLE = [" ".join(_SENTENCES[(i + j) % len(_SENTENCES)] for j in range(3 + i % 5)) for i in range(16)]


class Unsupported(Exception):
    """The bf16 model is not used here; the message says why."""


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    return value if value in MODES else "auto"


def cpu_bf16() -> str | None:
    """Why this CPU runs bf16 matrix products natively (its flags), or None where it does not."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    found = [flag for flag in CPU_FLAGS if flag in line.split()]
                    return ", ".join(found) if found else None
    except OSError:
        pass
    return None


def _torch_bf16(torch) -> bool:
    """Whether torch's oneDNN runs bf16 here (it checks the CPU itself)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an older or a differently built torch
        return torch.backends.mkldnn.is_available()


class _Passes:
    """Passes of one torch thread each, at most one a core at once. torch's thread count is one setting for the
    process, not a call's, and a pass of its OpenMP threads forks and joins at every op: on the busy 2-core VM a
    lone paragraph on 2 threads cost 286 ms of CPU and 616 ms of wall against 16 ms of CPU on one (its second
    thread, descheduled, held every op's join). So calls that may use more cores run their batches as parallel
    single-threaded passes instead."""

    def __init__(self):
        self._cv = threading.Condition()
        self.busy = 0

    @staticmethod
    def slots() -> int:
        return embedding_onnx.cores()

    @contextlib.contextmanager
    def one(self):
        import torch

        with self._cv:
            self._cv.wait_for(lambda: self.busy < self.slots())
            self.busy += 1
            if torch.get_num_threads() != 1:
                torch.set_num_threads(1)
        try:
            yield
        finally:
            with self._cv:
                self.busy -= 1
                self._cv.notify()


PASS_TOKENS = 4096  # tokens one pass holds at most (its padded attention: texts x heads x longest^2)
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> oneDNN's GELU algorithm


class _Bert:
    """A BERT encoder's weights as the bf16 pass runs them, read from the model's own files (config.json and
    model.safetensors or pytorch_model.bin in its Transformer module's folder): each Linear in bf16, packed once for
    oneDNN (F.linear on a bf16 weight reorders it at every call: 2.4x the time of one text's pass of 4 tokens, 1.4x
    of 128), the query, key and value products as one; embeddings and layer norms float32. Unsupported for a model
    of another architecture than BERT's (post-layer-norm, absolute positions, GELU)."""

    def __init__(self, path: Path):
        import torch

        folder = path
        try:
            modules = json.loads((path / "modules.json").read_text())
            sub = next((m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Transformer")), "")
            folder = path / sub if sub else path
        except (OSError, ValueError):
            pass
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise Unsupported(f"its config.json does not read ({e})") from None
        kind = cfg.get("model_type")
        if kind != "bert" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise Unsupported(f"the bf16 runtime runs BERT encoders with absolute positions, not {kind!r}")
        if cfg.get("hidden_act") not in ACTIVATIONS:
            raise Unsupported(f"its activation is {cfg.get('hidden_act')!r}, not one of {', '.join(ACTIVATIONS)}")
        self.gelu = ACTIVATIONS[cfg["hidden_act"]]
        self.dim, self.heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if self.dim % self.heads:
            raise Unsupported(f"its hidden size {self.dim} is not a multiple of its {self.heads} heads")
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        sd = self._state(folder)
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in sd else ""

        def get(name):
            try:
                return sd[prefix + name].detach().float().contiguous()
            except KeyError:
                raise Unsupported(f"its weights have no {prefix + name}") from None

        e = "embeddings."
        self.words, self.positions = get(e + "word_embeddings.weight"), get(e + "position_embeddings.weight")
        self.types = get(e + "token_type_embeddings.weight")
        self.norm = (get(e + "LayerNorm.weight"), get(e + "LayerNorm.bias"))
        self.layers = []
        for i in range(int(cfg["num_hidden_layers"])):
            at = f"encoder.layer.{i}."
            a = at + "attention."
            qkv = [get(f"{a}self.{n}.weight") for n in ("query", "key", "value")]
            qkv_b = [get(f"{a}self.{n}.bias") for n in ("query", "key", "value")]
            self.layers.append((
                self._linear(torch.cat(qkv), torch.cat(qkv_b)),
                self._linear(get(a + "output.dense.weight"), get(a + "output.dense.bias")),
                (get(a + "output.LayerNorm.weight"), get(a + "output.LayerNorm.bias")),
                self._linear(get(at + "intermediate.dense.weight"), get(at + "intermediate.dense.bias")),
                self._linear(get(at + "output.dense.weight"), get(at + "output.dense.bias")),
                (get(at + "output.LayerNorm.weight"), get(at + "output.LayerNorm.bias"))))

    @staticmethod
    def _state(folder: Path) -> dict:
        import torch

        if (folder / "model.safetensors").is_file():
            try:
                from safetensors.torch import load_file
            except ImportError as e:
                raise Unsupported(f"safetensors does not import ({e})") from None
            return load_file(str(folder / "model.safetensors"))
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        raise Unsupported(f"no model.safetensors or pytorch_model.bin in {folder}")

    @staticmethod
    def _linear(weight, bias):
        """(weight, bf16 bias, packed): the weight packed for oneDNN (packed True) where this torch has it and it
        answers as F.linear does, else the bf16 weight for F.linear (packed False)."""
        import torch

        w, b = weight.to(torch.bfloat16).contiguous(), bias.to(torch.bfloat16)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            probe = torch.linspace(-1, 1, 3 * w.shape[1]).reshape(3, -1).to(torch.bfloat16)
            with torch.inference_mode():
                same = torch.equal(torch.ops.mkldnn._linear_pointwise(probe, packed, b, "none", [], ""),
                                   torch.nn.functional.linear(probe, w, b))
            if same:
                return packed, b, True
        except Exception:  # noqa: BLE001 - a torch without oneDNN's packed linear: F.linear
            pass
        return w, b, False

    def _apply(self, lin, x, gelu: bool = False):
        import torch

        w, b, packed = lin
        if packed:
            # The overload itself: the op's packet resolves it at every call (~9 us of a 30 us product of 18 tokens).
            return torch.ops.mkldnn._linear_pointwise.default(x, w, b, "gelu" if gelu else "none", [],
                                                      self.gelu if gelu else "")
        y = torch.nn.functional.linear(x, w, b)
        return torch.nn.functional.gelu(y, approximate="tanh" if self.gelu == "tanh" else "none") if gelu else y

    def tokens(self, ids: np.ndarray, types: np.ndarray | None, mask: np.ndarray) -> np.ndarray:
        """The last hidden state (B, L, dim) float32 of a padded batch (right-padded: `mask` a prefix of ones a
        row), zero where padded. The texts' tokens run packed, without their padding, through every product and
        norm (their count rounded up to padded_rows, the rest zeros); only attention sees them padded, each text's
        own."""
        import torch
        import torch.nn.functional as F

        bsz, width = mask.shape
        slot = np.flatnonzero(mask.reshape(-1) > 0)
        count, d, h = len(slot), self.dim, self.heads
        rows = padded_rows(count)
        pos = np.zeros(rows, dtype=np.int64)
        pos[:count] = slot % width
        tok = np.zeros(rows, dtype=np.int64)
        tok[:count] = ids.reshape(-1)[slot]
        kind = np.zeros(rows, dtype=np.int64)
        if types is not None:
            kind[:count] = types.reshape(-1)[slot]
        with torch.inference_mode():
            x = (self.words[torch.from_numpy(tok)] + self.positions[torch.from_numpy(pos)]
                 + self.types[torch.from_numpy(kind)])
            x = F.layer_norm(x, (d,), *self.norm, self.eps)
            index = torch.from_numpy(slot)
            attn_mask = None if count == bsz * width else torch.from_numpy(mask > 0)[:, None, None, :]
            for qkv_l, out_l, norm1, up_l, down_l, norm2 in self.layers:
                qkv = self._apply(qkv_l, x.to(torch.bfloat16))
                padded = qkv.new_zeros(bsz * width, 3 * d)
                padded[index] = qkv[:count]
                q, k, v = padded.view(bsz, width, 3, h, d // h).permute(2, 0, 3, 1, 4)
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(-1, d)
                packed = a.new_zeros(rows, d)
                packed[:count] = a[index]
                x = F.layer_norm(x + self._apply(out_l, packed).float(), (d,), *norm1, self.eps)
                up = self._apply(up_l, x.to(torch.bfloat16), gelu=True)
                x = F.layer_norm(x + self._apply(down_l, up).float(), (d,), *norm2, self.eps)
            out = np.zeros((bsz * width, d), dtype=np.float32)
            out[slot] = x[:count].numpy()
        return out.reshape(bsz, width, d)


def padded_rows(count: int) -> int:
    """The rows a pass of `count` tokens runs its products on: rounded up to a multiple of 8, or of an eighth of
    the power of two below it (at most an eighth more rows), so passes repeat a few dozen shapes (56 up to 4,096
    tokens). oneDNN compiles and caches a kernel a shape: with a shape a token count, calls of three paragraphs
    each grew the process by 410 MiB over 400 calls and spent a sixth of their time compiling (2-core AMX VM)."""
    step = max(8, (1 << (max(1, count).bit_length() - 1)) // 8)
    return -(-count // step) * step


class Bf16Model(embedding_onnx.OnnxModel):
    """The model's transformer in bf16 on torch (_Bert, read from the model's own files), around it the tokenizer,
    batches and pooling of the model's OnnxModel (`fp32`, not kept): the same interface (encode, max_seq_length,
    get_embedding_dimension, token_spans)."""

    runtime = "bf16"
    calls_at_once = 1  # a call's passes take the cores themselves (Embedder.calls_at_once)

    def __init__(self, fp32: embedding_onnx.OnnxModel, path: Path, threads: Callable[[bool], int]):
        from tokenizers import Tokenizer

        self.folder, self._threads, self.recipe = fp32.folder, threads, fp32.recipe
        self.max_seq_length, self._dim, self._names, self._pad = (fp32.max_seq_length, fp32._dim, fp32._names,
                                                                   fp32._pad)
        self._pooling, self._normalize = fp32._pooling, fp32._normalize
        self._tok = Tokenizer.from_str(fp32._tok.to_str())
        self._spans = fp32._spans
        self.bert = _Bert(path)
        if self.bert.dim != self._dim:  # the pooled tokens are the embedding
            raise Unsupported(f"its hidden size {self.bert.dim} is not its embedding's {self._dim}")
        self._passes = _Passes()
        self.timing: dict = {}
        self._pool_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.choice = ""  # why it serves (choose() fills it)

    def set_threads(self, threads: Callable[[bool], int]) -> None:
        self._threads = threads

    def run(self, _outputs, feed: dict) -> list[np.ndarray]:
        """One batch's token embeddings, float32 (as an ONNX Runtime session's run answers)."""
        return [self.bert.tokens(feed["input_ids"], feed.get("token_type_ids"), feed["attention_mask"])]

    def encode(self, texts: Sequence[str], batch_size: int = 64, normalize_embeddings: bool = True,
               show_progress_bar: bool = False, bulk: bool = False, wide: bool = False, **_) -> np.ndarray:
        """float32 (len(texts), dim), as OnnxModel.encode. Its batches (pass_batches) run as single-threaded
        passes (_Passes), as many at once as the call's threads: threads(False) for a call, threads(True) for bulk
        work and for a wide call (alone on the machine, the caller knows); one text is one pass."""
        from tqdm import tqdm

        texts = list(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        if not texts:
            return out
        encodings, lengths, order = self._tokens(texts)
        parallel = min(len(texts), self._passes.slots(), max(1, int(self._threads(bulk or wide))))
        batches = pass_batches(lengths, order, batch_size, parallel)

        def one(rows):
            feed = self._feed(encodings, lengths, rows)
            with self._passes.one():
                tokens = self.run(None, feed)[0]
            out[rows] = self._pool(tokens, feed["attention_mask"])

        if parallel > 1 and len(batches) > 1:
            pool = self._pool_of()
            futures = [pool.submit(one, rows) for rows in batches]
            try:
                for f in tqdm(futures, desc="Batches", disable=not show_progress_bar):
                    f.result()
            finally:
                for f in futures:
                    f.cancel()
        else:
            for rows in tqdm(batches, desc="Batches", disable=not show_progress_bar):
                one(rows)
        if normalize_embeddings or self._normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def _pool_of(self) -> ThreadPoolExecutor:
        """Threads that run a call's batches at once (as many as the cores: each pass takes a core's slot)."""
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._passes.slots(), thread_name_prefix="fusionrag-bf16")
            return self._executor


def pass_batches(lengths: np.ndarray, order: np.ndarray, batch_size: int, parallel: int) -> list[np.ndarray]:
    """The passes of a call: runs of its texts longest first (`order`, `lengths` of each text), each at most
    batch_size texts and PASS_TOKENS tokens and at most a `parallel`-th of the call's tokens (so its passes
    share the cores evenly). Padding costs only attention here (the pass packs the texts for every product), so a
    pass takes texts of any length: 16 paragraph queries in one pass cost what 16 passes do, 16 short questions
    a third (2-core AMX VM, all-MiniLM-L6-v2, one thread)."""
    total = int(lengths.sum())
    share = min(PASS_TOKENS, max(1, -(-total // max(1, parallel))))
    out, lo, n = [], 0, len(order)
    while lo < n:
        hi, tokens = lo + 1, int(lengths[order[lo]])
        while hi < n and hi - lo < batch_size and tokens + int(lengths[order[hi]]) <= share:
            tokens += int(lengths[order[hi]])
            hi += 1
        out.append(order[lo:hi])
        lo = hi
    return out


def _thread_cpu(fn, reps: int) -> float:
    """The least thread CPU seconds of `reps` calls of fn (one warm-up first)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def timing(model, texts: Sequence[str], reps: int = 2) -> tuple[float, float]:
    """ms/text of thread CPU on one thread: a batch of `texts`, and one of them alone (the longest); the least of
    `reps` passes each, after one to warm up."""
    one = [max(texts, key=len)]
    batch = _thread_cpu(lambda: model.encode(texts, batch_size=len(texts)), reps) / len(texts)
    single = _thread_cpu(lambda: model.encode(one), reps)
    return batch * 1e3, single * 1e3


def _one_thread(onnx: embedding_onnx.OnnxModel):
    """The float32 model on a session of one thread, as timing() measures it (thread CPU sees one thread)."""
    class One:
        def encode(self, texts, batch_size=64):
            return onnx.encode_on(1, texts, batch_size)

    return One()


def choose(onnx: embedding_onnx.OnnxModel, path: Path, threads: Callable[[bool], int],
           forced: str | None = None) -> Bf16Model:
    """The bf16 model beside `onnx` (the float32 one, of the sentence-transformers model in directory `path`), or
    Unsupported saying why the float32 one serves. Its vectors are checked against the float32 model's (whose
    export was checked against the torch model's)."""
    how = forced or mode()
    said = f"{ENV}={how}" if forced is None else f"the runtime asked for is {'onnx' if how == 'off' else 'bf16'!r}"
    if how == "off":
        raise Unsupported(said)
    flags = cpu_bf16()
    if how == "auto" and not flags:
        raise Unsupported("the CPU has no bf16 matrix instructions (amx_bf16, avx512_bf16)")
    try:
        import torch
    except (ImportError, OSError) as e:
        raise Unsupported(f"torch does not import ({e})") from None
    if how == "auto" and not _torch_bf16(torch):
        raise Unsupported("torch's oneDNN does not run bf16 on this CPU")
    texts = list(embedding_onnx.PROBES) + SAMPLE
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = onnx.encode_on(1, texts, batch_size=16)
        model = Bf16Model(onnx, path, lambda bulk: 1)  # one thread while it is checked and timed
        got = model.encode(texts, batch_size=16)
        cosine = float((got.astype(np.float64) * want).sum(1).min())
        if not cosine >= MIN_COSINE:
            raise Unsupported(f"its vectors differ from the float32 model's (minimum cosine {cosine:.6f} < "
                              f"{MIN_COSINE})")
        if how == "on":
            model.choice = f"{said} (minimum cosine {cosine:.6f})"
            model.set_threads(threads)
            return model
        bf16_batch, bf16_one = timing(model, SAMPLE)
        fp32_batch, fp32_one = timing(_one_thread(onnx), SAMPLE)
    finally:
        torch.set_num_threads(saved)
    figures = (f"ms/text of thread CPU, bf16 / ONNX Runtime float32: batch of {len(SAMPLE)} {bf16_batch:.2f} / "
               f"{fp32_batch:.2f}, one text {bf16_one:.2f} / {fp32_one:.2f}; minimum cosine {cosine:.6f}")
    model.timing = {"bf16_batch_ms": bf16_batch, "bf16_one_ms": bf16_one, "fp32_batch_ms": fp32_batch,
                    "fp32_one_ms": fp32_one, "min_cosine": cosine}
    if bf16_batch > FASTER * fp32_batch or bf16_one > FASTER * fp32_one:
        raise Unsupported(f"not faster here ({figures})")
    model.choice = f"{flags}; {figures}"
    model.set_threads(threads)
    return model
