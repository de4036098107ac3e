"""A real transformer LLM for load tests where vLLM is not at hand: a Llama-style decoder made from a
config (random weights), generating with a preallocated KV cache.

Two uses:
- `decode`: generate continuously at a fixed batch for some seconds, holding a fixed share of GPU
  memory, and record tokens per second over time (the LLM side of the co-location measurement);
- `serve`: an OpenAI-compatible chat-completions server (streaming or not) for the RAG user, one
  request at a time. Tokens are UTF-8 bytes in and syllables out: the weights are random, so the
  answers are noise, but every token costs a real forward pass.

    python -m fusionrag.loadtests.llm serve --port 8100 --preset tiny
    python -m fusionrag.loadtests.llm decode --preset 1b --device cuda --seconds 60 --memory-fraction 0.4 --out llm.json
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.nn.functional as F
from torch import nn

from fusionrag.kernels.pool import process_gpu_bytes
from fusionrag.retriever.errors import ConfigError


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 512
    dim: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 172
    max_seq: int = 512

    def __post_init__(self):
        if self.vocab < 257:
            raise ConfigError(f"vocab must be >= 257 (bytes are tokens), got {self.vocab}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ConfigError(f"dim {self.dim} must split into {self.heads} heads of even size")
        if min(self.layers, self.ffn, self.max_seq) < 1:
            raise ConfigError("layers, ffn and max_seq must be >= 1")

    def parameters(self) -> int:
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.ffn + 2 * self.dim
        return 2 * self.vocab * self.dim + self.layers * per_layer + self.dim


# "1b": about 1.06e9 parameters, the shape of the small Llama models.
PRESETS = {
    "tiny": DecoderConfig(),
    "1b": DecoderConfig(vocab=32000, dim=2048, layers=18, heads=16, ffn=5632, max_seq=2048),
}


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `max_seq` tokens, allocated once."""

    def __init__(self, cfg: DecoderConfig, batch: int, device, dtype):
        hd = cfg.dim // cfg.heads
        self.kv = torch.zeros(cfg.layers, 2, batch, cfg.heads, cfg.max_seq, hd, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.hd = cfg.heads, cfg.dim // cfg.heads
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.up_gate = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x, cos, sin, kv, start: int):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kv[0, :, :, start:start + t] = k
        kv[1, :, :, start:start + t] = v
        keys, values = kv[0, :, :, :start + t], kv[1, :, :, :start + t]
        # New token i may see cached positions up to start + i.
        mask = None if t == 1 else (torch.arange(start + t, device=x.device)[None, :]
                                    <= torch.arange(start, start + t, device=x.device)[:, None])
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, -1))
        up, gate = self.up_gate(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rotate(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        hd = cfg.dim // cfg.heads
        freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits of `tokens` (batch, t) at positions start..start+t-1 (only the last with `last_only`,
        which spares a prefill the full logits), extending the cache."""
        t = tokens.shape[1]
        if start + t > self.cfg.max_seq:
            raise ConfigError(f"sequence of {start + t} tokens exceeds max_seq {self.cfg.max_seq}")
        x = self.embed(tokens)
        cos = self.cos[start:start + t].to(x.dtype)
        sin = self.sin[start:start + t].to(x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache.kv[i], start)
        if last_only:
            x = x[:, -1:]
        return self.head(self.norm(x)).float()


def make_model(cfg: DecoderConfig, device: str = "cpu", dtype=None, seed: int = 0) -> Decoder:
    """Random weights, scaled like a trained model's, created on the device directly."""
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02 if "embed" in name else 1.0 / math.sqrt(p.shape[1]))
    return model.to(dtype).eval()


@torch.inference_mode()
def generate(model: Decoder, cache: KVCache, prompt: torch.Tensor, max_new: int):
    """Greedy decoding: yield the next token of each sequence (a (batch,) tensor) `max_new` times."""
    logits = model(prompt, cache, 0, last_only=True)
    pos = prompt.shape[1]
    for _ in range(max_new):
        nxt = logits[:, -1].argmax(-1)
        yield nxt
        if pos >= model.cfg.max_seq:
            return
        logits = model(nxt[:, None], cache, pos)
        pos += 1


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def hold_memory_share(device: str, fraction: float, headroom: int) -> tuple[int, torch.Tensor | None]:
    """Cap this process at `fraction` of the GPU and claim all of it now, as vLLM does, so that what
    the retriever may use is fixed from the start. The share counts the whole process, as vLLM's
    does: its CUDA context and whatever else the driver counts beside torch's allocator come off the
    allocator's cap. Returns the budget in bytes and the filler block."""
    if not str(device).startswith("cuda"):
        return 0, None
    dev = torch.device(device)
    total = torch.cuda.get_device_properties(dev).total_memory
    budget = int(total * fraction)
    torch.cuda.synchronize(dev)
    held = process_gpu_bytes(dev, nvidia_smi=True)
    beside = 0 if held is None else max(0, held - torch.cuda.memory_reserved(dev))
    torch.cuda.set_per_process_memory_fraction((budget - beside) / total, dev)
    spare = budget - beside - torch.cuda.memory_reserved(dev) - headroom
    filler = torch.empty(max(spare, 0), dtype=torch.uint8, device=dev) if spare > 0 else None
    return budget, filler


def decode_loop(cfg: DecoderConfig, device: str, batch: int, prompt_len: int, seconds: float,
                memory_fraction: float = 0.0, seed: int = 0, on_start=None) -> dict:
    """Generate continuously for `seconds`: prefill a batch of prompts, decode to max_seq, start over.

    Returns tokens per second overall, a timeline of (unix time, tokens so far) every ~0.25 s, and GPU
    memory against the share held. An out-of-memory error is reported, not raised.
    """
    if not 1 <= prompt_len < cfg.max_seq:
        raise ConfigError(f"prompt_len must be in [1, max_seq={cfg.max_seq}), got {prompt_len}")
    out = {"config": asdict(cfg), "parameters": cfg.parameters(), "device": device, "batch": batch,
           "prompt_len": prompt_len, "oom": False}
    try:
        model = make_model(cfg, device, seed=seed)
        cache = KVCache(cfg, batch, device, next(model.parameters()).dtype)
        out["kv_cache_bytes"] = cache.nbytes
        # Activations of a prefill (attention and MLP inputs in 16 bits, twice over) and the logits.
        headroom = 4 * batch * prompt_len * (4 * cfg.dim + 2 * cfg.ffn) + 8 * batch * cfg.vocab + (256 << 20)
        budget, filler = hold_memory_share(device, memory_fraction, headroom) if memory_fraction else (0, None)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        timeline, tokens, last = [], 0, 0.0
        cuda = str(device).startswith("cuda")
        held_max = None  # the driver's count of this process, sampled with the timeline
        if on_start:
            on_start()
        t0 = time.time()
        while time.time() - t0 < seconds:
            prompt = torch.randint(0, cfg.vocab, (batch, prompt_len), generator=gen).to(device)
            for _ in generate(model, cache, prompt, cfg.max_seq - prompt_len):
                tokens += batch
                now = time.time()
                if now - last >= 0.25:
                    _sync(device)
                    timeline.append((time.time(), tokens))
                    last = now
                    held = process_gpu_bytes(torch.device(device)) if cuda else None
                    if held is not None:
                        held_max = max(held_max or 0, held)
                if now - t0 >= seconds:
                    break
        _sync(device)
        end = time.time()
        timeline.append((end, tokens))
        out.update(tokens=tokens, seconds=end - t0, tokens_per_s=tokens / (end - t0), timeline=timeline)
        if cuda:
            dev = torch.device(device)
            out.update(memory_budget_bytes=budget, memory_reserved_max_bytes=torch.cuda.max_memory_reserved(dev),
                       memory_allocated_max_bytes=torch.cuda.max_memory_allocated(dev),
                       memory_process_max_bytes=held_max)
            # Measured by the driver (the allocator's cap makes its own figures hold by construction).
            out["budget_held"] = None if not budget or held_max is None else held_max <= budget
        del filler
    except torch.OutOfMemoryError as e:
        out.update(oom=True, error=str(e)[:500])
    return out


def rate_between(timeline: list, start: float, end: float) -> float:
    """Tokens per second of a (unix time, tokens so far) timeline between two instants."""
    inside = [(t, n) for t, n in timeline if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        raise ConfigError(f"the LLM timeline has {len(inside)} points between {start:.2f} and {end:.2f}; "
                          "it must cover the measured window")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


# -- an OpenAI-compatible server --------------------------------------------------------------------

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def encode(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]  # token 0 stays free; vocab >= 257 holds every byte


def token_text(token: int) -> str:
    return " " + _SYLLABLES[token % len(_SYLLABLES)]


def render_chat(messages: list[dict]) -> str:
    return "".join(f"<{m.get('role', 'user')}>\n{m.get('content', '')}\n" for m in messages) + "<assistant>\n"


class ChatModel:
    """One decoder and one KV cache behind a lock: requests are answered one after another."""

    def __init__(self, cfg: DecoderConfig, device: str = "cpu", name: str = "fusionrag-tiny"):
        self.cfg, self.device, self.name = cfg, device, name
        self.model = make_model(cfg, device)
        self.cache = KVCache(cfg, 1, device, next(self.model.parameters()).dtype)
        self.lock = threading.Lock()

    def prompt(self, messages: list[dict], max_tokens: int) -> torch.Tensor:
        """The chat as tokens; keeps the end of a prompt too long for the cache."""
        room = self.cfg.max_seq - max_tokens
        if room < 1:
            raise ConfigError(f"max_tokens {max_tokens} leaves no room for a prompt (max_seq {self.cfg.max_seq})")
        return torch.tensor([encode(render_chat(messages))[-room:]], device=self.device)

    def stream(self, prompt: torch.Tensor, max_tokens: int):
        """Yield (text piece, finish_reason on the last piece else None)."""
        with self.lock:
            for n, tok in enumerate(generate(self.model, self.cache, prompt, max_tokens), 1):
                yield token_text(int(tok[0])), ("length" if n == max_tokens else None)


def chat_load(url: str, model: str, concurrency: int, seconds: float, max_tokens: int = 64) -> dict:
    """Keep `concurrency` streaming chat requests in flight for `seconds` against an OpenAI-compatible
    server (vLLM, or this module's); count streamed tokens over time, as `decode_loop` does."""
    import urllib.request

    from fusionrag.loadtests.checks import Wrong, read_chat_stream

    lock, stamps, errors = threading.Lock(), [], []
    end = time.time() + seconds
    body = json.dumps({"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell a long story about retrieval."}]}).encode()

    def worker():
        while time.time() < end:
            req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    def lines():
                        for line in r:
                            line = line.strip()
                            if line.startswith(b"data:") and line != b"data: [DONE]" and any(
                                    (c.get("delta") or {}).get("content")
                                    for c in json.loads(line[5:]).get("choices", [])):
                                with lock:
                                    stamps.append(time.time())
                            yield line
                    read_chat_stream(lines(), time.perf_counter(), time.perf_counter)
            except (OSError, ValueError, Wrong) as e:
                with lock:
                    errors.append(str(e)[:200])
                time.sleep(0.1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stamps.sort()
    timeline = [(t0, 0)] + [(t, i + 1) for i, t in enumerate(stamps)]
    span = max(time.time() - t0, 1e-9)
    return {"tokens": len(stamps), "seconds": span, "tokens_per_s": len(stamps) / span, "timeline": timeline,
            "errors": len(errors), "first_errors": errors[:5], "oom": any("out of memory" in e.lower() for e in errors)}


def _chunk(cid: str, model: str, delta: dict, finish: str | None) -> bytes:
    event = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(event)}\n\n".encode()


def make_handler(chat: ChatModel):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # one line per request would drown the load test's own output
            pass

        def _json(self, status: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._json(200, {"status": "ok"})
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [{"id": chat.name, "object": "model"}]})
            self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": {"message": f"no route {self.path}"}})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                messages = req["messages"]
                max_tokens = int(req.get("max_tokens") or 16)
                if not isinstance(messages, list) or not messages or max_tokens < 1:
                    raise ValueError("messages must be a non-empty list and max_tokens >= 1")
            except (ValueError, KeyError, TypeError) as e:
                return self._json(400, {"error": {"message": f"bad request: {e}"}})
            cid = "chatcmpl-" + uuid.uuid4().hex
            try:
                prompt = chat.prompt(messages, max_tokens)
                if not req.get("stream"):
                    pieces = list(chat.stream(prompt, max_tokens))
                    return self._json(200, {
                        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": chat.name,
                        "choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": "".join(p for p, _ in pieces)},
                                     "finish_reason": pieces[-1][1]}],
                        "usage": {"prompt_tokens": prompt.shape[1], "completion_tokens": len(pieces),
                                  "total_tokens": prompt.shape[1] + len(pieces)}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                self.wfile.write(_chunk(cid, chat.name, {"role": "assistant"}, None))
                for piece, finish in chat.stream(prompt, max_tokens):
                    self.wfile.write(_chunk(cid, chat.name, {"content": piece}, finish))
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except ConfigError as e:
                self._json(400, {"error": {"message": str(e)}})
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left; the lock is released by the generator's exit

    return Handler


def serve(cfg: DecoderConfig, host: str, port: int, device: str = "cpu", name: str = "fusionrag-tiny") -> None:
    server = ThreadingHTTPServer((host, port), make_handler(ChatModel(cfg, device, name)))
    server.daemon_threads = True
    try:
        server.serve_forever()
    finally:
        server.server_close()


def _config(args) -> DecoderConfig:
    if args.preset not in PRESETS:
        raise ConfigError(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    cfg = PRESETS[args.preset]
    if args.max_seq:
        cfg = DecoderConfig(**{**asdict(cfg), "max_seq": args.max_seq})
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusionrag.loadtests.llm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible chat completions")
    d = sub.add_parser("decode", help="generate continuously; write tokens/s as JSON")
    for p in (s, d):
        p.add_argument("--preset", default="tiny", help=f"model shape: {', '.join(PRESETS)}")
        p.add_argument("--max-seq", type=int, default=0, help="override the preset's context length")
        p.add_argument("--device", default="cpu")
        # On a few shared cores, more than one intra-op thread makes every step wait on the others.
        p.add_argument("--threads", type=int, default=1, help="CPU threads of PyTorch")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--model-name", default="fusionrag-tiny")
    d.add_argument("--seconds", type=float, default=30.0)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--prompt-len", type=int, default=128)
    d.add_argument("--memory-fraction", type=float, default=0.0,
                   help="GPU share to cap this process at and hold from the start (0: no cap)")
    d.add_argument("--out", required=True, help="JSON report")
    d.add_argument("--ready-file", help="created once the model is built and generation starts")
    args = parser.parse_args(argv)
    cfg = _config(args)
    torch.set_num_threads(args.threads)
    if args.command == "serve":
        serve(cfg, args.host, args.port, args.device, args.model_name)
        return 0
    ready = (lambda: open(args.ready_file, "w").close()) if args.ready_file else None
    result = decode_loop(cfg, args.device, args.batch, args.prompt_len, args.seconds, args.memory_fraction,
                         on_start=ready)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "config")}))
    return 3 if result["oom"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
