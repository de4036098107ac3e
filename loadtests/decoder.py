"""A Llama-style decoder made from a config (random weights), generating with a preallocated KV cache:
the model behind the load tests' LLM (`fusionrag.loadtests.llm`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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
