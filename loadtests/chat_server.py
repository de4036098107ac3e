"""An OpenAI-compatible chat-completions server over the decoder, for the RAG user of a load test, and a
streaming chat load against any such server (vLLM, or this one). Tokens are UTF-8 bytes in and syllables
out: the weights are random, so the answers are noise, but every token costs a real forward pass."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from fusionrag.retriever.errors import ConfigError
from fusionrag.loadtests.decoder import DecoderConfig, KVCache, generate, make_model


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
