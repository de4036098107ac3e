"""The LLM side of the co-location measurement: generate continuously at a fixed batch, holding a fixed
share of GPU memory, and record tokens per second over time."""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from fusionrag.kernels.pool import process_gpu_bytes
from fusionrag.retriever.errors import ConfigError
from fusionrag.loadtests.decoder import DecoderConfig, KVCache, generate, make_model


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
    if dev.index is None:  # "cuda": set_per_process_memory_fraction takes only a device with its index
        dev = torch.device("cuda", torch.cuda.current_device())
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
