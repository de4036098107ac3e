"""The vLLM endpoint plugin: fusionrag's retrieval API and a retrieval-augmented chat route inside
vLLM's own OpenAI-compatible server.

Enable it by name (vLLM loads endpoint plugins only when allow-listed):

    VLLM_PLUGINS=fusionrag FUSIONRAG_DATA_DIR=data vllm serve MODEL

It adds, on vLLM's port:
- the service's `/v1/collections...` routes, the same API as `fusionrag serve` (so the LangChain and
  LlamaIndex stores work against vLLM's URL), configured like the service by FUSIONRAG_* variables
  or the FUSIONRAG_CONFIG file (API keys included);
- `POST /v1/rag/chat/completions`: an OpenAI chat-completions request plus
  `"retrieval": {"collection": NAME, "k": 4, "filter": {...}}`. The last user message is searched
  for in the collection (embedded by the collection's model), the hits are put into the prompt
  (`prompt.py` shows the template), vLLM generates, and the answer comes back as a chat completion
  with `"retrieval": {"collection", "ids", "scores"}` added. Streaming is not offered on this route.
"""

from __future__ import annotations

import contextlib
import json
import threading
from argparse import Namespace
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusionrag.integrations.vllm.prompt import augment, question_of
from fusionrag.retriever.errors import ConfigError, FusionRAGError, InputError, NotFoundError, UnavailableError
from fusionrag.server.app import State, authenticate, engine_error, v1
from fusionrag.server.auth import Key
from fusionrag.server.config import load_config

RAG_PATH = "/v1/rag/chat/completions"


class RetrievalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    collection: str = Field(description="the collection to retrieve from; it must have an embedding model")
    k: int = Field(4, ge=1, description="passages put into the prompt")
    filter: dict[str, Any] | None = Field(None, description="metadata filter, the collection's syntax")


def _error(status: int, message: str) -> JSONResponse:
    # vLLM's error shape, so OpenAI clients report it as they report vLLM's own errors.
    return JSONResponse({"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalError",
                                   "param": None, "code": status}}, status)


def _invalid(prefix: str, e: ValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:10]]
    return _error(422, f"{prefix}: " + "; ".join(parts))


rag = APIRouter()


@rag.post(RAG_PATH, summary="Chat completion over the hits of a collection search")
async def rag_chat_completions(raw_request: Request, key: Key | None = Depends(authenticate)):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

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
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        return _invalid("chat request", e)
    if request.stream:
        return _error(422, f"stream=true is not supported on {RAG_PATH}; use the non-streaming form")

    svc: State = raw_request.app.state.fusionrag
    if key is not None and not key.allows(opts.collection):
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
        hits = (await svc.batcher.search(coll, opts.k, texts=[question], filter=opts.filter)).hits[0]
    except (NotFoundError, InputError, ConfigError, UnavailableError) as e:
        status = 404 if isinstance(e, NotFoundError) else 503 if isinstance(e, UnavailableError) else 422
        return _error(status, str(e))
    request = request.model_copy(update={"messages": augment(request.messages, hits)})

    out = await handler.create_chat_completion(request, raw_request)
    if isinstance(out, ErrorResponse):
        return JSONResponse(out.model_dump(), out.error.code)
    if not isinstance(out, ChatCompletionResponse):
        raise FusionRAGError(f"vLLM answered a non-streaming request with {type(out).__name__}")
    data = out.model_dump()
    data["retrieval"] = {"collection": coll.name, "ids": [h.id for h in hits], "scores": [h.score for h in hits]}
    return JSONResponse(data)


class FusionRAGEndpointPlugin:
    """The `vllm.endpoint_plugins` entry point: vLLM calls the class and uses the instance
    (see vllm/plugins/endpoint_plugins/interface.py)."""

    name = "fusionrag"
    # Chat needs generation; this also keeps the plugin off vLLM's engine-less render server.
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.state: State | None = None
        self._loader: threading.Thread | None = None

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
        self.state = State(load_config())
        await self.state.batcher.start()
        self._loader = threading.Thread(target=self.state.load, name="fusionrag-load", daemon=True)
        self._loader.start()
        state.fusionrag = self.state

    async def close(self) -> None:
        if self.state is None:
            return
        await self.state.batcher.stop()
        if self._loader is not None:
            self._loader.join()
        self.state.catalog.close()
        self.state = None
