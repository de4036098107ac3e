"""A real transformer LLM for load tests where vLLM is not at hand: a Llama-style decoder made from a
config (random weights), generating with a preallocated KV cache.

Two uses:
- `decode`: generate continuously at a fixed batch for some seconds, holding a fixed share of GPU
  memory, and record tokens per second over time (the LLM side of the co-location measurement);
- `serve`: an OpenAI-compatible chat-completions server (streaming or not) for the RAG user, one
  request at a time. Tokens are UTF-8 bytes in and syllables out: the weights are random, so the
  answers are noise, but every token costs a real forward pass.

This module is their command line; the model is in decoder.py, the decode loop in decode_loop.py, the
server (and a chat load against any OpenAI-compatible server) in chat_server.py.

    python -m fusionrag.loadtests.llm serve --port 8100 --preset tiny
    python -m fusionrag.loadtests.llm decode --preset 1b --device cuda --seconds 60 --memory-fraction 0.4 --out llm.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from fusionrag.loadtests.chat_server import serve
from fusionrag.loadtests.decode_loop import decode_loop
from fusionrag.loadtests.decoder import PRESETS, DecoderConfig
from fusionrag.retriever.errors import ConfigError


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
