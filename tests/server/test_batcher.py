"""The micro-batcher lets batches grow to what the GPU needs under load (#47 part 7): a collection whose index
serves calls from a size on cheaper on the GPU (Collection.crossover) has its batch held open, up to
gpu_wait_s, while other requests keep arriving fast enough to fill it; a lone client is never held. Checked by
the engine calls' sizes and the held-batch counter, against a real collection (crossover set: there is no GPU)."""

import asyncio

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
