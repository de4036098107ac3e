"""The vLLM endpoint plugin: fusionrag's retrieval API and a retrieval-augmented chat route inside
vLLM's own OpenAI-compatible server.

Enable it by name (vLLM loads endpoint plugins only when allow-listed):

    VLLM_PLUGINS=fusionrag FUSIONRAG_DATA_DIR=data vllm serve MODEL

It adds, on vLLM's port:
- the service's `/v1/collections...` routes, the same API as `fusionrag serve` (so the LangChain and
  LlamaIndex stores work against vLLM's URL), configured like the service by FUSIONRAG_* variables
  or the FUSIONRAG_CONFIG file (API keys included);
- `POST /v1/rag/chat/completions`: an OpenAI chat-completions request plus
  `"retrieval": {"collection": NAME, "k": 4, "filter": {...}, "stats": false}`. The last user message
  is searched for in the collection (embedded by the collection's model), the hits are put into the
  prompt (`prompt.py` shows the template), vLLM generates, and the answer comes back as a chat
  completion with `"retrieval": {"collection", "ids", "scores", "citations"}` added (citations: each
  passage's number in the prompt, id and text; with "stats", the engine's statistics of the search).
  With `"stream": true` the answer is vLLM's own server-sent events, after a first chunk that carries
  the retrieval (and no choices) sent as soon as the search is done; usage comes in the last chunk
  unless `stream_options` says otherwise, and a client that disconnects aborts the generation.

The plugin opens its collections when vLLM calls `init_state`, once vLLM's engine is up (weights
loaded, memory profiled, KV cache allocated). On the GPU tier it first checks that its budget fits
beside vLLM (`memory.plan_plugin_split`), takes the largest that does when FUSIONRAG_GPU_BUDGET_MB
is 0, and refuses to start with the reason when none does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from argparse import Namespace
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusionrag.integrations.vllm.memory import plan_plugin_split
from fusionrag.integrations.vllm.prompt import augment, question_of
from fusionrag.retriever.errors import ConfigError, FusionRAGError, InputError, NotFoundError, UnavailableError
from fusionrag.server.auth import Key
from fusionrag.server.config import ServerConfig, load_config
from fusionrag.server.deps import authenticate, reaches
from fusionrag.server.errors import engine_error
from fusionrag.server.life import Service, State
from fusionrag.server.routes import v1

# Under vLLM's logger: its handler prints these lines in vLLM's own log.
log = logging.getLogger("vllm.fusionrag")
MiB = 1 << 20

RAG_PATH = "/v1/rag/chat/completions"


class RetrievalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    collection: str = Field(description="the collection to retrieve from; it must have an embedding model")
    k: int = Field(4, ge=1, description="passages put into the prompt")
    filter: dict[str, Any] | None = Field(None, description="metadata filter, the collection's syntax")
    stats: bool = Field(False, description="add the engine's statistics of the search to the retrieval")


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's error shape, so OpenAI clients report it as they report vLLM's own errors.
    return JSONResponse({"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalError",
                                   "param": None, "code": status}}, status)


def _invalid(prefix: str, e: ValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:10]]
    return _error(422, f"{prefix}: " + "; ".join(parts))


rag = APIRouter()


async def _events(first: dict, chunks: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """The retrieval chunk, then vLLM's events. Closing this (a client that went away) closes vLLM's
    stream, whose engine request is then aborted."""
    try:
        yield f"data: {json.dumps(first)}\n\n"
        async for chunk in chunks:
            yield chunk
    finally:
        await chunks.aclose()


@rag.post(RAG_PATH, summary="Chat completion over the hits of a collection search")
async def rag_chat_completions(raw_request: Request, key: Key | None = Depends(authenticate)):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive

    try:
        body = json.loads(await raw_request.body())
    except ValueError as e:
        return _error(400, f"malformed JSON: {e}")
    if not isinstance(body, dict) or "retrieval" not in body:
        return _error(422, 'the body needs "retrieval": {"collection": NAME, "k": ..., "filter": ...} beside the '
                           "chat-completions fields")
    try:
        opts = RetrievalOptions.model_validate(body.pop("retrieval"))
    except ValidationError as e:
        return _invalid("retrieval", e)
    if body.get("stream") is True and body.get("stream_options") is None:
        body["stream_options"] = {"include_usage": True}
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        return _invalid("chat request", e)

    svc: State = raw_request.app.state.fusionrag
    if not reaches(svc, key, opts.collection):
        return _error(403, f"this API key has no rights to collection {opts.collection!r}")
    if opts.k > svc.config.max_k:
        return _error(422, f"retrieval.k is {opts.k}, at most {svc.config.max_k} allowed (max_k)")
    if not svc.ready.is_set():
        return _error(503, "fusionrag is still loading its collections; retry shortly")
    handler = raw_request.app.state.openai_serving_chat
    if handler is None:
        return _error(404, "this vLLM server does not serve chat completions")
    try:
        coll = svc.catalog.get(opts.collection)
        if not coll.embedding:
            return _error(422, f"collection {opts.collection!r} has no embedding model to embed the question with")
        question = question_of(request.messages)
        found = await svc.batcher.search(coll, opts.k, texts=[question], filter=opts.filter)
    except (NotFoundError, InputError, ConfigError, UnavailableError) as e:
        status = 404 if isinstance(e, NotFoundError) else 503 if isinstance(e, UnavailableError) else 422
        return _error(status, str(e))
    hits = found.hits[0]
    retrieval = {"collection": coll.name, "ids": [h.id for h in hits], "scores": [h.score for h in hits],
                 "citations": [{"n": n, "id": h.id, "text": h.text} for n, h in enumerate(hits, 1)]}
    if opts.stats:
        retrieval["stats"] = found.stats[0]
    request = request.model_copy(update={"messages": augment(request.messages, hits)})

    out = await handler.create_chat_completion(request, raw_request)
    if isinstance(out, ErrorResponse):
        return JSONResponse(out.model_dump(), out.error.code)
    if isinstance(out, ChatCompletionResponse):
        data = out.model_dump()
        data["retrieval"] = retrieval
        return JSONResponse(data)
    # A stream: its first chunk (OpenAI's shape, no choices, like the usage chunk) carries the retrieval.
    first = {"id": raw_request.state.request_metadata.request_id, "object": "chat.completion.chunk",
             "created": int(time.time()), "model": handler.models.model_name(), "choices": [],
             "retrieval": retrieval}
    keep_alive = getattr(getattr(raw_request.app.state, "args", None), "sse_keep_alive_interval", 0) or 0
    return StreamingResponse(with_sse_keep_alive(_events(first, out), float(keep_alive)),
                             media_type="text/event-stream")


def _device_sizes() -> tuple[int, int]:
    """(total, free) bytes of the device the GPU tier takes its budget on: CUDA's, or host RAM where
    Triton's interpreter stands in for a GPU (tests)."""
    import torch

    from fusionrag.retriever.engine.gpu_tier import gpu_device

    device = gpu_device()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    # Host RAM: what the kernel could give now (MemAvailable counts the page cache it would reclaim;
    # MemFree, sysconf's AVPHYS_PAGES, does not, and a busy machine's cache leaves it small).
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return fields["MemTotal"], fields["MemAvailable"]


def budget_beside_vllm(config: ServerConfig, args: Namespace) -> ServerConfig:
    """`config` with the GPU tier's budget checked against what vLLM holds, and when 0 set to the largest
    that fits; ConfigError saying what to set when they cannot fit. Off the GPU tier, `config` as it is."""
    from fusionrag.retriever.engine.tiers import cuda_available

    if config.filter_tier == "cpu" or (config.filter_tier == "auto" and not cuda_available()):
        return config
    import vllm.envs as envs

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise ConfigError("fusionrag's GPU tier needs vLLM's engine in a process of its own "
                          "(VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default): its budget holds all that its process "
                          "has on the GPU, which would include vLLM's model; or set FUSIONRAG_FILTER_TIER=cpu")
    total, free = _device_sizes()
    split = plan_plugin_split(total, free, budget_bytes=int(config.gpu_budget_mb * MiB),
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    if not split.fits:
        raise ConfigError(f"fusionrag cannot open its collections on the GPU beside vLLM: {split.advice} (the "
                          f"retriever's budget is FUSIONRAG_GPU_BUDGET_MB, vLLM's share --gpu-memory-utilization "
                          f"or --kv-cache-memory-bytes)")
    log.info("fusionrag: GPU budget %d MiB beside vLLM: %s", split.retriever_bytes // MiB, split.advice)
    return replace(config, gpu_budget_mb=split.retriever_bytes / MiB)


class FusionRAGEndpointPlugin:
    """The `vllm.endpoint_plugins` entry point: vLLM calls the class and uses the instance
    (see vllm/plugins/endpoint_plugins/interface.py)."""

    name = "fusionrag"
    # Chat needs generation; this also keeps the plugin off vLLM's engine-less render server.
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.service: Service | None = None

    @property
    def state(self) -> State | None:
        return None if self.service is None else self.service.state

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(v1)
        app.include_router(rag)
        app.add_exception_handler(FusionRAGError, engine_error)
        # vLLM's app has a lifespan of its own; ours wraps it to stop the batcher and close the
        # collections when vLLM shuts down.
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a):
            async with inner(a) as value:
                try:
                    yield value
                finally:
                    await self.close()

        app.router.lifespan_context = lifespan

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        # vLLM calls this once its engine is up: weights loaded, memory profiled, KV cache allocated.
        log.info("fusionrag: vLLM's engine is up; opening the collections")
        self.service = Service(budget_beside_vllm(load_config(), args))
        await self.service.start()
        state.fusionrag = self.service.state

    async def close(self) -> None:
        if self.service is not None:
            service, self.service = self.service, None
            await service.stop()
