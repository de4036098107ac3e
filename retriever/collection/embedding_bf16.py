"""An embedding model's transformer run by torch in bfloat16, on CPUs with bf16 matrix instructions (AMX-BF16,
AVX512-BF16): about half the CPU of ONNX Runtime's float32 model for the same vectors (cosine >= 0.9999 to the
float32 model's, checked as it loads).

It stands beside the ONNX Runtime model (embedding_onnx.OnnxModel), whose tokenizer, batches, pooling and
normalisation it shares: only the transformer's pass differs. Its Linear layers (nearly all of the model's
arithmetic) hold bfloat16 weights, packed once for oneDNN, and take bf16 inputs: bf16 products with float32 sums
(its AMX kernels); attention runs under torch's CPU autocast, in bf16; embeddings, layer norms and residual sums
stay float32. (Measured on a 2-core AMX Xeon VM, 1 thread, Python-docs paragraphs: autocast over float32 weights,
which casts every weight at every pass, cost 10-15% more; the whole model cast to bf16, layer norms included, 2%
less but its vectors were further, minimum cosine 0.99993 against 0.99997.)

choose() decides, per machine, as the model loads: the bf16 model serves only where the CPU has bf16 matrix
instructions, torch imports, its vectors on PROBES and SAMPLE are within MIN_COSINE of the float32 model's, and a
short timing (thread CPU, one thread each, min of a few passes) finds it at most FASTER of the float32 runtime's
time for a batch of 16 paragraphs and for one. Otherwise the float32 runtime serves, unchanged. The log says which
and why. FUSIONRAG_EMBED_BF16 (or embedding.set_runtime): 'off' (the default) never, 'on' without the capability
check and the timing (the cosine check stays), 'auto' as above. Off by default: in the service (text queries of
Python-docs paragraphs from 1 and 16 connections, alternated x2 on the 2-core AMX VM) it answered 64.6 and 113 q/s
against ONNX Runtime's 81.9 and 129, at the same server CPU a query (14.4-15.1 ms against 14.4-16.9), and holds
~650 MB more: the one-thread thread-CPU timing here does not see what the service pays.

Threads: every pass runs on one torch thread (torch's thread count is one setting for the process, and its
OpenMP passes on two threads were far slower on a busy machine: _Passes), at most one pass a core at once across
the process. A call's batches run as many passes at once as its threads allow: threads(False) for a call,
threads(True) for bulk work (an import) and for a wide call (a lone query: one text is one pass, so a wide call
of one text runs on one thread). An import's batches so take free cores pass by pass, and a query takes the next
free one rather than waiting for the import's call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

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
    value = os.environ.get(ENV, "off").strip().lower() or "off"
    return value if value in MODES else "off"


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


_LINEAR = None  # the module class below, made on first use (torch imported only then)


def _bf16_linear(linear):
    """A Linear layer's stand-in: its product in bf16 with float32 sums, its weight packed once for oneDNN (F.linear
    on a bf16 weight reorders it at every call: 2.4x the time of one text's pass of 4 tokens, 1.4x of 128; the
    same results to the bit). Where this torch has no packed linear, or it answers otherwise, F.linear."""
    global _LINEAR
    import torch

    if _LINEAR is None:
        class Linear(torch.nn.Module):
            def __init__(self, linear):
                super().__init__()
                self.in_features, self.out_features = linear.in_features, linear.out_features
                weight = linear.weight.detach().to(torch.bfloat16)
                self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
                self.weight, self.packed = weight, None
                try:
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                    probe = torch.linspace(-1, 1, 3 * self.in_features).reshape(3, -1).to(torch.bfloat16)
                    with torch.inference_mode():
                        same = torch.equal(self.forward(probe), torch.nn.functional.linear(probe, weight, self.bias))
                    if same:
                        self.weight = None  # the packed copy serves
                    else:
                        self.packed = None
                except Exception:  # noqa: BLE001 - a torch without oneDNN's packed linear: F.linear
                    self.packed = None

            def forward(self, x):
                x = x.to(torch.bfloat16)
                if self.packed is not None:
                    return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
                return torch.nn.functional.linear(x, self.weight, self.bias)

        _LINEAR = Linear
    return _LINEAR(linear)


class Bf16Model(embedding_onnx.OnnxModel):
    """The transformer of a SentenceTransformer in bf16, around it the tokenizer, batches and pooling of the model's
    OnnxModel (`fp32`, not kept): the same interface (encode, max_seq_length, get_embedding_dimension, token_spans)."""

    runtime = "bf16"

    def __init__(self, fp32: embedding_onnx.OnnxModel, auto_model, threads: Callable[[bool], int]):
        import torch
        from tokenizers import Tokenizer

        self.folder, self._threads, self.recipe = fp32.folder, threads, fp32.recipe
        self.max_seq_length, self._dim, self._names, self._pad = (fp32.max_seq_length, fp32._dim, fp32._names,
                                                                   fp32._pad)
        self._pooling, self._normalize = fp32._pooling, fp32._normalize
        self._tok = Tokenizer.from_str(fp32._tok.to_str())
        self._spans = fp32._spans
        model = auto_model.eval()
        if getattr(model, "pooler", None) is not None:  # BERT's pooled output: not what a sentence embedding reads
            model.pooler = None
        for p in model.parameters():
            p.requires_grad_(False)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, _bf16_linear(child))
        self.model = model
        self._passes = _Passes()
        self.timing: dict = {}
        self._pool_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.choice = ""  # why it serves (choose() fills it)

    def set_threads(self, threads: Callable[[bool], int]) -> None:
        self._threads = threads

    def run(self, _outputs, feed: dict) -> list[np.ndarray]:
        """One batch's token embeddings, float32 (as an ONNX Runtime session's run answers)."""
        import torch

        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model(**{n: torch.from_numpy(feed[n]) for n in self._names}, return_dict=True)
            return [out.last_hidden_state.float().numpy()]

    def encode(self, texts: Sequence[str], batch_size: int = 64, normalize_embeddings: bool = True,
               show_progress_bar: bool = False, bulk: bool = False, wide: bool = False, **_) -> np.ndarray:
        """float32 (len(texts), dim), as OnnxModel.encode. Its batches run as single-threaded passes (_Passes), as
        many at once as the call's threads: threads(False) for a call, threads(True) for bulk work and for a wide
        call (alone on the machine, the caller knows); one text is one pass."""
        from tqdm import tqdm

        texts = list(texts)
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        if not texts:
            return out
        encodings, lengths, batches = self._plan(texts, batch_size)

        def one(rows):
            feed = self._feed(encodings, lengths, rows)
            with self._passes.one():
                tokens = self.run(None, feed)[0]
            out[rows] = self._pool(tokens, feed["attention_mask"])

        parallel = min(len(batches), self._passes.slots(), max(1, int(self._threads(bulk or wide))))
        if parallel > 1:
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


def choose(onnx: embedding_onnx.OnnxModel, reference: Callable[[], object], threads: Callable[[bool], int],
           forced: str | None = None) -> Bf16Model:
    """The bf16 model beside `onnx` (the float32 one), or Unsupported saying why the float32 one serves.
    reference(): the model's SentenceTransformer on torch, float32 (its transformer becomes the bf16 one's)."""
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
    st = reference()
    texts = list(embedding_onnx.PROBES) + SAMPLE
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = st.encode(texts, batch_size=16, normalize_embeddings=True, convert_to_numpy=True,
                         show_progress_bar=False)
        model = Bf16Model(onnx, st[0].auto_model, lambda bulk: 1)  # one thread while it is checked and timed
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
