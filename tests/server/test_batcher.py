"""The micro-batcher lets batches grow to what the GPU needs under load (#47 part 7): a collection whose index
serves calls from a size on cheaper on the GPU (Collection.crossover) has its batch held open, up to
gpu_wait_s, while other requests keep arriving fast enough to fill it; a lone client is never held. Checked by
the engine calls' sizes and the held-batch counter, against a real collection (crossover set: there is no GPU)."""

import asyncio
import os

import numpy as np
import pytest

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.server.batcher import MicroBatcher
from fusionrag.server.metrics import Metrics

DIM = 8


@pytest.fixture
def collection(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False))
    col = cat.create("b", DIM, "l2")
    rng = np.random.default_rng(0)
    col.add([Document(str(i), None, rng.standard_normal(DIM)) for i in range(200)])
    calls = []
    search = col.search

    def counted(vectors=None, *a, **kw):
        calls.append(len(vectors))
        return search(vectors, *a, **kw)

    col.search = counted
    col.quick = lambda queries: False  # on the search threads, as under load (the event loop's own: its own test)
    yield col, calls
    cat.close()


def _run(col, users: int, rounds: int, gpu_wait_s: float, crossover: int | None, think_s: float = 0.005):
    col.crossover = lambda: crossover
    metrics = Metrics(lambda: {})
    rng = np.random.default_rng(1)

    async def main():
        batcher = MicroBatcher(0.0002, 256, 2, metrics, gpu_wait_s)
        await batcher.start()

        async def user():
            for _ in range(rounds):  # a closed loop: the next query once this one is answered, and a pause
                res = await batcher.search(col, 5, vectors=rng.standard_normal((1, DIM)).astype(np.float32))
                assert len(res.hits) == 1 and len(res.hits[0]) == 5
                await asyncio.sleep(float(rng.uniform(0, think_s)))

        await asyncio.gather(*(user() for _ in range(users)))
        await batcher.stop()

    asyncio.run(main())
    return metrics.batches_held._value.get()


def test_under_load_batches_are_held_to_the_gpu_crossover(collection):
    col, calls = collection
    assert _run(col, users=8, rounds=30, gpu_wait_s=0.0, crossover=8) == 0
    alone = sum(n for n in calls if n == 8) / sum(calls)  # the users' pauses scatter them: small calls
    calls.clear()
    held = _run(col, users=8, rounds=30, gpu_wait_s=0.5, crossover=8)
    assert sum(calls) == 8 * 30 and held > 0
    waited = sum(n for n in calls if n == 8) / sum(calls)
    assert waited >= 0.75 and waited > alone + 0.3, (alone, waited, calls)  # most queries went in calls of 8


def test_a_lone_client_and_a_collection_without_a_gpu_are_never_held(collection):
    col, calls = collection
    assert _run(col, users=1, rounds=20, gpu_wait_s=0.5, crossover=8) == 0 and calls == [1] * 20
    calls.clear()
    assert _run(col, users=8, rounds=5, gpu_wait_s=0.5, crossover=None) == 0 and sum(calls) == 40
    calls.clear()
    assert _run(col, users=8, rounds=5, gpu_wait_s=0.0, crossover=8) == 0 and sum(calls) == 40


def test_a_request_to_an_idle_engine_goes_at_once_and_batches_gather_while_one_runs(collection):
    """The window (max_wait_s, here 60 s) is waited only while another batch runs: a lone request is answered long
    before it would end, and requests arriving while the engine is busy go together in the next call."""
    col, calls = collection
    col.crossover = lambda: None
    search = col.search
    gate, started = __import__("threading").Event(), []

    def held(vectors=None, *a, **kw):  # the first call waits for the gate: a batch in flight meanwhile
        started.append(len(vectors))
        if len(started) == 1:
            gate.wait(30)
        return search(vectors, *a, **kw)

    col.search = held
    q = np.random.default_rng(2).standard_normal((1, DIM)).astype(np.float32)

    async def main():
        batcher = MicroBatcher(60.0, 4, 1, Metrics(lambda: {}))
        await batcher.start()
        first = asyncio.create_task(batcher.search(col, 5, vectors=q))
        await asyncio.sleep(0.5)
        assert started == [1]  # dispatched at once, not after the 60 s window
        rest = []
        for _ in range(4):  # one at a time, while the first batch runs: they wait together
            rest.append(asyncio.create_task(batcher.search(col, 5, vectors=q)))
            await asyncio.sleep(0.05)
        assert started == [1]
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), 10)  # max_queries (4) closed their batch
        await batcher.stop()

    asyncio.run(main())
    assert started == [1, 4] and calls == [1, 4]


class _Model:
    """An embedding model stand-in: a vector per text from its words (the same text, the same vector), each call
    recorded; calls for texts holding "hang" wait for `gate`."""

    def __init__(self, dim: int):
        self.dim, self.calls, self.wide = dim, [], []
        self.gate = __import__("threading").Event()

    def embed(self, texts, wide=False):
        self.calls.append(len(texts))
        self.wide.append(wide)
        if any("hang" in t for t in texts):
            assert self.gate.wait(30)
        out = np.stack([np.random.default_rng(abs(hash(t)) % (1 << 32)).standard_normal(self.dim) for t in texts])
        return out.astype(np.float32)


def _text_collection(tmp_path, name, model, n=300):
    cat = Catalog(tmp_path / name, collection_config=CollectionConfig(background_merge=False, min_index_count=100))
    col = cat.create(name, DIM, "l2", embedding="all-MiniLM-L6-v2")  # the name only: the batcher asks get_embedder
    texts = [f"passage {i} about topic {i % 17}" for i in range(n)]
    col.add([Document(str(i), t, v) for i, (t, v) in enumerate(zip(texts, model.embed(texts)))])
    col.merge()  # an index, not only the exact fresh tier
    model.calls.clear()
    model.wide.clear()
    return cat, col, texts


def test_concurrent_text_queries_share_model_calls_and_answer_as_alone(tmp_path, monkeypatch):
    """Texts are embedded off the search threads, by their model's own queue: 24 concurrent text queries take far
    fewer model calls than queries (those waiting while a call runs go together), and each answers what it answers
    alone, in vector and hybrid mode."""
    model = _Model(DIM)
    monkeypatch.setattr("fusionrag.server.batcher.get_embedder", lambda name: model)
    cat, col, texts = _text_collection(tmp_path, "t", model)
    queries = [texts[i] for i in range(0, 240, 10)]

    async def main():
        batcher = MicroBatcher(0.002, 256, 2, Metrics(lambda: {}))
        await batcher.start()
        alone = []
        for mode in ("vector", "hybrid"):
            for q in queries:
                alone.append(await batcher.search(col, 5, texts=[q], mode=mode))
        calls_alone, wide_alone = list(model.calls), list(model.wide)
        model.calls.clear()
        model.wide.clear()
        together = await asyncio.gather(*(batcher.search(col, 5, texts=[q], mode=mode)
                                          for mode in ("vector", "hybrid") for q in queries))
        await batcher.stop()
        return alone, calls_alone, wide_alone, together

    alone, calls_alone, wide_alone, together = asyncio.run(main())
    assert calls_alone == [1] * 48
    # A call alone (none other of the model running or waiting) may take every core's thread (wide); the first of
    # the concurrent ones started with the rest waiting, and may not.
    assert wide_alone == [True] * 48
    assert model.wide[0] is False and len(model.wide) == len(model.calls), (model.wide, model.calls)
    assert sum(model.calls) == 48 and len(model.calls) < 12, model.calls  # shared calls
    for a, b in zip(alone, together):
        assert [h.id for h in a.hits[0]] == [h.id for h in b.hits[0]]
        np.testing.assert_allclose([h.score for h in a.hits[0]], [h.score for h in b.hits[0]], rtol=1e-5)
    # Each query's own passage comes first (its vector is the stored one).
    assert [r.hits[0][0].id for r in together[:24]] == [str(i) for i in range(0, 240, 10)]
    cat.close()


def test_a_model_that_takes_every_core_runs_one_call_at_a_time(tmp_path, monkeypatch):
    """A model whose calls spread their passes over the cores themselves (Embedder.calls_at_once 1: bf16) runs one
    call at a time, the texts that arrive meanwhile gathered for the next; one without it runs a call a core."""
    import threading
    import time as _time

    for limit, most_allowed in ((1, 1), (None, os.cpu_count() or 1)):
        model = _Model(DIM)
        if limit is not None:
            model.calls_at_once = limit
        active, most = [0], [0]
        lock = threading.Lock()
        embed = model.embed

        def slow(texts, wide=False, _embed=embed):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            _time.sleep(0.02)
            try:
                return _embed(texts, wide=wide)
            finally:
                with lock:
                    active[0] -= 1

        model.embed = slow
        monkeypatch.setattr("fusionrag.server.batcher.get_embedder", lambda name, _m=model: _m)
        cat, col, texts = _text_collection(tmp_path, f"t{limit}", model)

        async def main():
            batcher = MicroBatcher(0.002, 256, 2, Metrics(lambda: {}))
            await batcher.start()
            out = []
            for _ in range(3):
                out += await asyncio.gather(*(batcher.search(col, 5, texts=[texts[i]]) for i in range(0, 160, 10)))
            await batcher.stop()
            return out

        answers = asyncio.run(main())
        assert [r.hits[0][0].id for r in answers] == [str(i) for i in range(0, 160, 10)] * 3
        assert sum(model.calls) == 48 and len(model.calls) < 24, model.calls
        if limit == 1:
            assert most[0] == 1, most[0]
        else:
            assert 1 <= most[0] <= most_allowed
            if most_allowed > 1:
                assert most[0] > 1, model.calls  # 16 texts at once: a second call beside the first
        cat.close()


def test_a_hung_model_holds_only_the_requests_that_need_it(tmp_path, monkeypatch):
    """A model that hangs (an endpoint that stopped answering) holds its own requests, not the search threads: another
    collection's vector searches, sent while it hangs, are all answered; the held ones are answered once it does."""
    model = _Model(DIM)
    monkeypatch.setattr("fusionrag.server.batcher.get_embedder", lambda name: model)
    cat, col, texts = _text_collection(tmp_path, "t", model)
    other = Catalog(tmp_path / "o", collection_config=CollectionConfig(background_merge=False))
    vec = other.create("o", DIM, "l2")
    rng = np.random.default_rng(3)
    vec.add([Document(str(i), None, rng.standard_normal(DIM)) for i in range(200)])

    async def main():
        batcher = MicroBatcher(0.002, 256, 1, Metrics(lambda: {}))  # one search thread: nothing may hold it
        await batcher.start()
        searches = lambda n: [batcher.search(vec, 5, vectors=rng.standard_normal((1, DIM)).astype(np.float32))  # noqa
                              for _ in range(n)]
        first = [asyncio.ensure_future(s) for s in searches(5)]  # sent with the held ones: one batch before
        held = [asyncio.create_task(batcher.search(col, 5, texts=[f"hang {i}"])) for i in range(3)]
        await asyncio.sleep(0.2)
        answered = await asyncio.wait_for(asyncio.gather(*first, *searches(35)), 20)
        still = [t.done() for t in held]
        model.gate.set()
        done = await asyncio.wait_for(asyncio.gather(*held), 20)
        await batcher.stop()
        return answered, still, done

    answered, still, done = asyncio.run(main())
    assert len(answered) == 40 and all(len(r.hits[0]) == 5 for r in answered)
    assert still == [False] * 3  # held the while, by their model alone
    assert all(len(r.hits[0]) == 5 for r in done)
    cat.close()
    other.close()


def test_large_requests_are_shared_across_the_search_threads(collection):
    """Four clients of 32 queries each and two search threads: each batch takes its thread's share of what waits,
    so a call takes half of what waits at most and both threads run (before, one thread took three requests in one
    call while the other ran one and then idled). Requests of one query still gather into one call while the threads are
    busy."""
    import threading
    import time

    col, calls = collection
    col.crossover = lambda: None
    search = col.search
    running, most = [0], [0]
    lock = threading.Lock()

    def slow(vectors=None, *a, **kw):  # an engine call long enough for the others to queue behind it
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.02)
            return search(vectors, *a, **kw)
        finally:
            with lock:
                running[0] -= 1

    col.search = slow
    rng = np.random.default_rng(3)

    async def main(users: int, rows: int, rounds: int):
        batcher = MicroBatcher(0.002, 256, 2, Metrics(lambda: {}))
        await batcher.start()

        async def user():
            for _ in range(rounds):
                q = rng.standard_normal((rows, DIM)).astype(np.float32)
                res = await batcher.search(col, 5, vectors=q)
                assert len(res.hits) == rows and all(len(h) == 5 for h in res.hits)

        await asyncio.gather(*(user() for _ in range(users)))
        await batcher.stop()

    asyncio.run(main(4, 32, 10))
    # A call takes at most half of what waits (four requests waiting: two each), never three of four.
    assert sum(calls) == 4 * 10 * 32 and max(calls) <= 64, calls
    assert most[0] == 2, most
    calls.clear()
    asyncio.run(main(16, 1, 10))  # small requests: the busy threads' queue still goes in few calls
    assert sum(calls) == 16 * 10 and max(calls) > 4, calls


def test_a_quick_search_alone_runs_on_the_event_loop_and_any_other_on_a_search_thread(tmp_path):
    """The one request in progress (the service's count of requests, Metrics.active) with a quick search
    (Collection.quick: a few queries, CPU only, no filter) is searched on the event loop, with no hand-off; beside
    another request in progress, within QUIET_S of two requests overlapping, with a filter, with more queries than
    quick allows, or on a collection that is not quick, on a search thread. Each answer equals the collection's own
    search."""
    import threading
    import time

    from fusionrag.server.batcher import QUIET_S

    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False, min_index_count=100))
    col = cat.create("q", DIM, "l2")
    rng = np.random.default_rng(4)
    col.add([Document(str(i), None, rng.standard_normal(DIM), {"even": i % 2 == 0}) for i in range(300)])
    col.merge()  # an index: quick asks that its searches stay on the CPU
    where, search = [], col.search

    def recorded(*a, **kw):
        where.append(threading.current_thread().name)
        return search(*a, **kw)

    col.search = recorded
    metrics = Metrics(lambda: {})
    q1 = rng.standard_normal((1, DIM)).astype(np.float32)
    q8 = rng.standard_normal((8, DIM)).astype(np.float32)

    async def main():
        # The service's defaults (server/config.py): gpu_batch_wait_ms 5 holds batches only for a collection a GPU
        # serves from a size on (crossover), none here.
        batcher = MicroBatcher(0.002, 256, 2, metrics, 0.005)
        await batcher.start()
        loop_thread = threading.current_thread().name
        cases = []
        for active, q, flt, quick, overlap in ((1, q1, None, None, False), (2, q1, None, None, False),
                                               (1, q1, {"even": True}, None, False), (1, q8, None, None, False),
                                               (1, q1, None, False, False), (1, q1, None, None, True),
                                               (1, q1, None, None, False)):
            await asyncio.sleep(0.01)  # the batch before this one done and out of the batcher's books
            metrics.active = active
            # Two requests overlapped just now (ObserveMiddleware's mark), or over QUIET_S ago.
            metrics.overlapped_at = time.monotonic() - (0.0 if overlap else QUIET_S + 0.1)
            if quick is not None:
                col.quick = lambda queries: quick
            res = await batcher.search(col, 5, vectors=q, filter=flt)
            if quick is not None:
                del col.quick
            want = search(q, 5, flt)
            assert [[h.id for h in hits] for hits in res.hits] == [[h.id for h in hits] for hits in want.hits]
            cases.append(where[-1] == loop_thread)
        await batcher.stop()
        return cases

    assert asyncio.run(main()) == [True, False, False, False, False, False, True], where
    assert col.quick(1) and col.quick(4) and not col.quick(5)
    cat.close()
