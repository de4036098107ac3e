"""Micro-batching: concurrent searches gathered into few engine calls, which run off the event loop.

A batch opens with the first waiting request and closes after `max_wait_s` or once `max_queries`
queries wait, whichever comes first; a request that finds no batch running goes at once. A batch takes at most its thread's
share of what waits (ceil(queued / threads)), never less than SHARE_FLOOR queries (nor less than one request): four
clients of 32 queries each kept one thread on three requests while the other ran one and then idled (1.3 of 2 cores
busy); below the floor one call still pays for itself (an engine call's cost a query falls steeply up to ~32
queries and little beyond). Requests are then grouped by what the engine needs to share one
call (collection, k, filter, tuning, whether hits carry vectors); each group is one `Collection.search`, whose rows are handed back to the requests they came from. While
every engine thread is busy, new requests keep queueing and join the next batch, so batches grow with
the load instead of the wait. A collection whose index serves calls from a size on from the GPU
(`Collection.crossover`: filter_tier auto with CUDA, the size from which the GPU is measured cheaper) has its
batch held open up to `gpu_wait_s` longer to reach that size, only while other requests keep arriving fast
enough to fill it in the time left (their rate since the batch's first request): under load the device gets the
batches it needs, and a lone client, whose next query waits for this answer, waits no longer than before.

Texts to embed never reach a search thread: each model has its own queue and thread (`_ModelQueue`), where the
texts of concurrent requests are embedded together, one model call for all that wait, before the requests join
a search batch with their vectors. A slow or hung model (an endpoint) holds only the requests that need it, and
no search of another collection waits behind it.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fusionrag.retriever.collection import DEFAULT_TEXT_WEIGHT, CollectionSearch
from fusionrag.retriever.collection.config import Fusion
from fusionrag.retriever.collection.contract import CollectionContract
from fusionrag.retriever.collection.embedding import get_embedder
from fusionrag.retriever.engine.config import SearchOverrides, SearchParams
from fusionrag.retriever.engine.queries import PreparedQueries
from fusionrag.server.metrics import Metrics

# Queries from which a batch no longer waits for company and is split across the search threads: Collection.search's
# CPU a query on the 38k x 384 Python-docs set (bench/service/chroma_http.py's), calls of 1 query 402 us, 4 266,
# 8 213, 16 180, 32 161, 64 146, 128 148 (2-core VM): little is gained past 32, and a thread that idles loses it all.
SHARE_FLOOR = 32
# How long after two requests last overlapped a lone request may search on the event loop (MicroBatcher._quiet).
QUIET_S = 1.0
# The HTTP server's requests in progress (uvicorn's ServerState.tasks: a task each from its head on, started or not),
# set by the service's protocol (main._HeadDeadline); None where another server runs the app (then the middleware's
# count, which misses requests whose tasks have not started: a burst's, read in one turn of the loop).
_REQUESTS: set | None = None


def count_requests_in(tasks: set) -> None:
    """The set of the HTTP server's request tasks, whose size says how many requests are in progress."""
    global _REQUESTS
    _REQUESTS = tasks


def _joined(parts: list) -> PreparedQueries | np.ndarray:
    """A group's query vectors in one matrix, still prepared when every request's was (the route checked
    them), so the collection takes them as they are; otherwise an array it checks."""
    if all(isinstance(p, PreparedQueries) for p in parts) and len({p.metric for p in parts}) == 1:
        return PreparedQueries(np.concatenate([p.vectors for p in parts]), parts[0].metric)
    return np.concatenate([getattr(p, "vectors", p) for p in parts])


@dataclass(eq=False)
class _Request:
    collection: CollectionContract
    # (q, dim) float32: PreparedQueries as the route checked them, an array once `texts` are embedded;
    # None until then, and in text mode
    vectors: PreparedQueries | np.ndarray | None
    texts: list[str] | None
    k: int
    filter: dict | None
    params: SearchParams | SearchOverrides | None
    mode: str
    text_weight: float
    future: asyncio.Future
    enqueued: float
    with_vectors: bool = False
    fusion: Fusion | None = None
    partial: bool = True  # a sharded collection's: an answer missing a down shard's lists may be given

    @property
    def size(self) -> int:
        return len(self.texts) if self.vectors is None else len(self.vectors)

    def group(self) -> tuple:
        return (id(self.collection), self.k, json.dumps(self.filter, sort_keys=True), self.params, self.mode,
                self.text_weight, self.with_vectors, self.fusion, self.partial)


class ServiceClosing(RuntimeError):
    """A search arrived after shutdown began."""


class _ModelQueue:
    """The texts waiting for one embedding model, embedded a batch a model call in the model's own threads (never a
    search thread): a call takes every text waiting when it starts (at most max_texts), and texts that arrive
    while the calls run wait for the next, so a lone query waits for nothing and concurrent ones share calls. Up to
    `calls` calls run at once (the model's single-threaded passes then use as many cores: one call at a time held
    text queries to one core, 0.92x Chroma's clients embedding on theirs at 16 connections), or as few as the
    loaded model says (Embedder.calls_at_once: one where a call's passes take every core themselves). A slow or
    hung model (an endpoint) holds only the requests that need it; the endpoint's own total deadline
    (embedding._Endpoint.DEADLINE_S) bounds each call."""

    def __init__(self, embedder, max_texts: int, metrics: Metrics, calls: int = 1):
        self.embedder, self.max_texts, self.metrics, self.calls = embedder, max_texts, metrics, max(1, calls)
        self._waiting: deque[tuple[list[str], asyncio.Future]] = deque()
        self._running = 0
        self._frozen = False  # whether the objects its model's load made are out of the collector's passes
        self._executor = ThreadPoolExecutor(self.calls, thread_name_prefix="fusionrag-embed")

    async def embed(self, texts: list[str]) -> np.ndarray:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((texts, future))
        if self._running < self._limit():
            self._next()
        return await future

    def _limit(self) -> int:
        return min(self.calls, getattr(self.embedder, "calls_at_once", None) or self.calls)

    def _next(self) -> None:
        while self._running < self._limit() and self._waiting:
            batch, n = [], 0
            while self._waiting and (not batch or n + len(self._waiting[0][0]) <= self.max_texts):
                texts, future = self._waiting.popleft()
                if future.done():  # its client went away
                    continue
                batch.append((texts, future))
                n += len(texts)
            if not batch:
                return
            self._running += 1
            task = asyncio.ensure_future(self._call(batch))
            task.add_done_callback(self._done)

    def _done(self, _task) -> None:
        self._running -= 1
        self._next()

    async def _call(self, batch: list[tuple[list[str], asyncio.Future]]) -> None:
        texts = [t for part, _ in batch for t in part]
        # A call alone (no other of this model running, none waiting) may take every core's thread: a lone text
        # query's embedding is a third quicker on two threads than on one (embedding_onnx.OnnxModel.encode).
        wide = self._running == 1 and not self._waiting
        t = time.perf_counter()
        try:
            vectors = await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(self.embedder.embed, texts, wide=wide))
        except Exception as e:  # noqa: BLE001 - handed to every request of the call
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        self.metrics.stage["embed"].observe(time.perf_counter() - t)
        if not self._frozen:  # a model loaded after the start (its first call loads it): as life.load's gc.freeze
            self._frozen = True
            gc.freeze()
        at = 0
        for part, future in batch:
            if not future.done():
                future.set_result(vectors[at:at + len(part)])
            at += len(part)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class MicroBatcher:
    def __init__(self, max_wait_s: float, max_queries: int, threads: int, metrics: Metrics, gpu_wait_s: float = 0.0):
        self.max_wait_s, self.max_queries, self.threads = max_wait_s, max_queries, threads
        self.metrics, self.gpu_wait_s = metrics, gpu_wait_s
        self._pending: deque[_Request] = deque()
        self._queued = 0  # queries in _pending
        self._closing = False
        self._models: dict[int, _ModelQueue] = {}  # by id of the embedder: texts waiting for each model

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.threads)
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="fusionrag-search")
        self._inflight: set[asyncio.Task] = set()
        self._loop_task = asyncio.create_task(self._gather_loop())

    async def stop(self) -> None:
        """Run what is queued, wait for every batch in flight, then release the threads."""
        self._closing = True
        self._wake.set()
        await self._loop_task
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        self._executor.shutdown(wait=True)
        for queue in self._models.values():
            queue.close()

    async def search(self, collection: CollectionContract, k: int, *, vectors: np.ndarray | None = None,
                     texts: list[str] | None = None, filter: dict | None = None,
                     params: SearchParams | SearchOverrides | None = None, mode: str = "vector",
                     text_weight: float = DEFAULT_TEXT_WEIGHT, with_vectors: bool = False,
                     fusion: Fusion | None = None, partial: bool = True) -> CollectionSearch:
        """`vectors` ((q, dim) float32, already validated) or `texts` (embedded here unless in text mode),
        or both in hybrid mode; see Collection.search for the modes (and `partial`, a sharded collection's)."""
        if self._closing:
            raise ServiceClosing("the service is shutting down")
        if vectors is None and mode != "text":  # the texts embedded first, by their model's own queue and thread
            vectors = await self.embed(get_embedder(collection.embedding), texts)
        future = asyncio.get_running_loop().create_future()
        req = _Request(collection, vectors, texts, k, filter, params, mode, text_weight, future, time.perf_counter(),
                       with_vectors, fusion, partial)
        if not self._pending and not self._inflight:
            if self._quiet() and mode == "vector" and filter is None and collection.quick(req.size):
                # The one request in progress, none overlapping for QUIET_S, and a quick search (Collection.quick):
                # run here, on the event loop, which has nothing else to do meanwhile; the hand-off to a search
                # thread and back cost more than a tenth of a one-query request (two thread wake-ups). A request that
                # arrives meanwhile waits at most this search's millisecond, and its overlap with the next ends this
                # for QUIET_S: under concurrent load the loop must parse requests while the threads search (the
                # count alone let a burst's requests, whose tasks had not started yet, each run here in turn: one
                # core for 16 connections).
                self._execute_here(req)
                return await future
        if not self._pending and not self._inflight and self.gpu_wait_s <= 0:
            # An idle engine: this request goes at once from its own task, as the gathering loop would send it
            # (alone, without waiting), without the loop's two hand-offs; requests arriving meanwhile gather. (With
            # the default gpu_batch_wait_ms every request goes through the gathering loop, which takes all that
            # arrived in the same turn together: at 16 connections, this path taken whenever the engine fell idle
            # answered 1,510-1,630 req/s against 1,660-1,850 through the loop, alternated x2.)
            task = asyncio.current_task()
            await self._slots.acquire()  # free: nothing is in flight
            self._inflight.add(task)
            try:
                await self._execute([req])
            finally:
                self._inflight.discard(task)
                self._slots.release()
                if self._pending:
                    self._wake.set()
            return await future
        self._pending.append(req)
        self._queued += req.size
        self._wake.set()
        return await future

    async def embed(self, embedder, texts: list[str]) -> np.ndarray:
        """Texts embedded by their model's own queue (and threads): those of concurrent requests share calls."""
        if self._closing:
            raise ServiceClosing("the service is shutting down")
        queue = self._models.get(id(embedder))
        if queue is None:
            queue = self._models[id(embedder)] = _ModelQueue(embedder, self.max_queries, self.metrics,
                                                             os.cpu_count() or 1)
        vectors = await queue.embed(texts)
        if self._closing:
            raise ServiceClosing("the service is shutting down")
        return vectors

    async def _gather_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            opened = loop.time()
            # A batch gathers for max_wait_s only while another runs: a request to an idle engine goes at once,
            # where waiting for company only added the window to a lone client's every query (2 ms, more on a
            # loaded event loop). Under load the engine is busy, so batches still gather (and grow while every
            # thread is taken).
            deadline = opened + (self.max_wait_s if self._inflight else 0.0)
            while self._queued < min(self.max_queries, SHARE_FLOOR) and not self._closing:
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            want = await self._wait_for_the_device(loop, opened)
            # Requests arriving while we wait for a free thread join this batch.
            await self._slots.acquire()
            task = asyncio.create_task(self._execute(self._take(want)))
            self._inflight.add(task)
            task.add_done_callback(self._finished)

    def _rate(self) -> float:
        """Queries a second that joined the waiting batch after its first request (0 with that one alone)."""
        if len(self._pending) < 2:
            return 0.0
        later = self._queued - self._pending[0].size
        return later / max(1e-6, time.perf_counter() - self._pending[0].enqueued)

    async def _wait_for_the_device(self, loop, opened: float) -> int:
        """Hold the batch open (until gpu_wait_s after it opened) while it is below the size from which its
        collection's GPU serves a call cheaper, and queries arrive fast enough to reach that size in time; that
        size (0 for none), which the batch may then take whole."""
        if not self._pending or self._closing:
            return 0
        want = self._pending[0].collection.crossover()
        if not want:
            return 0
        want = min(want, self.max_queries)
        if self.gpu_wait_s <= 0:
            return want
        end = opened + self.gpu_wait_s
        held = False
        while self._queued < want and not self._closing:
            left = end - loop.time()
            if left <= 0 or self._rate() * left < want - self._queued:
                return want
            if not held:
                held = True
                self.metrics.batches_held.inc()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return want
        return want

    def _finished(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        self._slots.release()

    def _take(self, want: int = 0) -> list[_Request]:
        """The next batch: the oldest requests, up to this thread's share of the queries waiting (SHARE_FLOOR at
        least, `want` at least: the size the device needs) and max_queries at most, one request at least."""
        share = max(SHARE_FLOOR, want, -(-self._queued // self.threads))
        limit = min(self.max_queries, share)
        batch, n = [], 0
        while self._pending and (not batch or n + self._pending[0].size <= limit):
            req = self._pending.popleft()
            batch.append(req)
            n += req.size
        self._queued -= n
        return batch

    async def _execute(self, batch: list[_Request]) -> None:
        now = time.perf_counter()
        for req in batch:
            self.metrics.stage["queue"].observe(now - req.enqueued)
        self.metrics.batch_requests.observe(len(batch))
        try:
            answers = await asyncio.get_running_loop().run_in_executor(self._executor, self._run_batch, batch)
        except Exception as e:  # noqa: BLE001 - handed to every request of the batch
            answers = {req: e for req in batch}
        for req in batch:
            if not req.future.done():  # the client may have gone away
                answer = answers[req]
                if isinstance(answer, Exception):
                    req.future.set_exception(answer)
                else:
                    req.future.set_result(answer)

    def _quiet(self) -> bool:
        """This request alone in the server, and none overlapping another for QUIET_S."""
        m = self.metrics
        if (len(_REQUESTS) if _REQUESTS is not None else m.active) > 1:
            m.overlapped_at = time.monotonic()
            return False
        return time.monotonic() - m.overlapped_at > QUIET_S

    def _execute_here(self, req: _Request) -> None:
        """_execute of one request, in this thread (the event loop's)."""
        self.metrics.loop_searches.inc()
        self.metrics.stage["queue"].observe(time.perf_counter() - req.enqueued)
        self.metrics.batch_requests.observe(1)
        try:
            answer = self._search_group([req])[req]
        except Exception as e:  # noqa: BLE001 - the request's own answer
            req.future.set_exception(e)
        else:
            req.future.set_result(answer)

    def _run_batch(self, batch: list[_Request]) -> dict:
        answers: dict[_Request, CollectionSearch | Exception] = {}
        groups = defaultdict(list)
        for req in batch:
            groups[req.group()].append(req)
        for reqs in groups.values():
            try:
                answers.update(self._search_group(reqs))
            except Exception as e:  # noqa: BLE001
                answers.update((req, e) for req in reqs)
        return answers

    def _search_group(self, reqs: list[_Request]) -> dict:
        first = reqs[0]
        vectors = None if first.mode == "text" else _joined([req.vectors for req in reqs])
        texts = None if first.mode == "vector" else [t for req in reqs for t in req.texts]
        t = time.perf_counter()
        res = first.collection.search(vectors, first.k, first.filter, first.params, texts=texts, mode=first.mode,
                                      text_weight=first.text_weight, with_vectors=first.with_vectors,
                                      fusion=first.fusion, partial=first.partial)
        self.metrics.stage["engine"].observe(time.perf_counter() - t)
        self.metrics.batch_queries.observe(len(res.hits))
        self.metrics.observe_search(first.collection.name, res.stats)
        out, at = {}, 0
        for req in reqs:
            end = at + req.size
            out[req] = res.part(at, end)
            at = end
        return out
