"""Calls racing the drop of a sharded collection in the data directory (#66, finding 6a): each answers, or is
refused as a drop refuses (NotFoundError, 404; UnavailableError, 503), never with what the shards' threads say
once they are shut down (RuntimeError: cannot schedule new futures after shutdown, a 500). The drop waits for
the calls in progress (hosted.py counts them), and the router refuses a call that reaches it once it is closed."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.collection import CollectionConfig, Document, quota
from fusionrag.retriever.errors import NotFoundError, UnavailableError

DIM = 8
REFUSED = (NotFoundError, UnavailableError)


def _sharded(cat, name: str, seed: int = 0, n: int = 300):
    x = clustered(n, DIM, 4, seed=seed)
    path = cat.root.parent / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{name}-{i}", "text": f"note {i} on topic {i % 7}",
                                        "metadata": {"i": i}, "vector": v.tolist()}) + "\n" for i, v in enumerate(x)))
    col = cat.create(name, DIM, "l2", shards=2)
    col.import_files(path)
    return col, x


def test_a_closed_sharded_index_refuses_calls_with_unavailable(tmp_path):
    """The router's calls after close() began: UnavailableError, not RuntimeError (its threads shut down) or an
    IndexError (its shards let go of)."""
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False))
    try:
        col, x = _sharded(cat, "c")
        index = col.index
    finally:
        cat.close()  # closes the index under the reference held here
    for call in (lambda: index.search(x[:2], k=5), lambda: index.documents(np.array([1, 2])),
                 lambda: index.text_search(["topic 3"], 5), lambda: index.page(-1, 5)):
        with pytest.raises(UnavailableError, match="closed"):
            call()


def test_a_search_in_progress_on_a_sharded_index_being_closed_answers_or_gets_unavailable(tmp_path):
    """Threads searching the router itself (no collection counting its calls) while it is closed: each search
    answers or gets UnavailableError."""
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False))
    try:
        col, x = _sharded(cat, "c")
        index = col.index
        other: list = []
        ok = [0]
        go = threading.Barrier(5)

        def search():
            go.wait()
            while True:
                try:
                    index.search(x[:4], k=5)
                    ok[0] += 1
                except UnavailableError:
                    return
                except BaseException as e:  # noqa: BLE001
                    other.append(e)
                    return

        threads = [threading.Thread(target=search) for _ in range(4)]
        for t in threads:
            t.start()
        go.wait()
        time.sleep(0.2)
        index.close()
        for t in threads:
            t.join()
        assert not other, other[:3]
        assert ok[0]
    finally:
        cat.close()


def _race(cat, name: str, x: np.ndarray, rounds_before_drop: float = 0.2) -> tuple[dict, list]:
    """Threads calling the collection (searches by vector and text, get, count, scroll, info, upsert, snapshot),
    through the catalog as the service does, while it is dropped. Returns (outcomes, unexpected errors)."""
    seen: dict[str, int] = {}
    bad: list = []
    lock = threading.Lock()
    started = threading.Barrier(8)  # 7 threads and this one
    calls = {
        "search": lambda c, i: c.search(x[:3], k=5),
        "text": lambda c, i: c.search(texts=["topic 3"], k=5, mode="text"),
        "get": lambda c, i: c.get([f"{name}-1", f"{name}-2"]),
        "count": lambda c, i: (c.count(), len(c), c.scroll(5)),
        "info": lambda c, i: c.info(),
        "upsert": lambda c, i: c.upsert([Document(f"w{i}", "written", x[i % len(x)] + 0.01)]),
    }

    def worker(what: str):
        call = calls[what]
        started.wait()
        i = 0
        while True:
            i += 1
            try:
                call(cat.get(name), i)
                out = "ok"
            except REFUSED as e:
                out = type(e).__name__
            except BaseException as e:  # noqa: BLE001
                bad.append((what, repr(e)))
                return
            with lock:
                seen[f"{what} {out}"] = seen.get(f"{what} {out}", 0) + 1
            if out == "NotFoundError":
                return

    def snapshots():
        started.wait()
        i = 0
        while True:
            i += 1
            try:
                cat.get(name).snapshot(cat.root.parent / f"{name}-snap-{i}.tar")
                out = "ok"
            except REFUSED as e:
                out = type(e).__name__
            except BaseException as e:  # noqa: BLE001
                bad.append(("snapshot", repr(e)))
                return
            with lock:
                seen[f"snapshot {out}"] = seen.get(f"snapshot {out}", 0) + 1
            if out == "NotFoundError":
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in calls] + [threading.Thread(target=snapshots)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(rounds_before_drop)
    cat.drop(name)
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    return seen, bad


def test_calls_racing_the_drop_of_a_sharded_collection_answer_or_get_404_or_503(tmp_path):
    """Every kind of call, in threads, while the collection is dropped (several times, the drop at another point
    of the calls each time): each answers, or gets NotFoundError (404) or UnavailableError (503); the drop
    leaves nothing, and every thread ends with NotFoundError."""
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False))
    try:
        for r in range(4):
            _, x = _sharded(cat, "c", seed=r)
            seen, bad = _race(cat, "c", x, 0.05 + 0.1 * r)
            assert not bad, bad[:3]
            assert sum(n for k, n in seen.items() if k.endswith(" ok")), seen
            assert sum(n for k, n in seen.items() if k.endswith("NotFoundError")) == 7, seen
            assert not (tmp_path / "data" / "collections" / "c").exists()
            with pytest.raises(NotFoundError):
                cat.get("c")
    finally:
        cat.close()


def test_calls_racing_the_drop_of_a_sharded_collection_whose_shards_the_pool_closes_and_reopens(tmp_path):
    """As above, with room in the pool of open files for one sharded collection and another one searched
    throughout: the dropped collection's shards are closed and opened again as the calls alternate."""
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False),
                  limits=quota.Limits(max_open_collections=3))
    stop = threading.Event()
    other_bad: list = []
    try:
        keep, y = _sharded(cat, "keep", seed=7)

        def other():
            while not stop.is_set():
                try:
                    keep.search(y[:2], k=5)
                except BaseException as e:  # noqa: BLE001
                    other_bad.append(repr(e))
                    return

        t = threading.Thread(target=other)
        t.start()
        try:
            for r in range(2):
                _, x = _sharded(cat, "c", seed=r)
                seen, bad = _race(cat, "c", x, 0.1 + 0.1 * r)
                assert not bad, bad[:3]
                assert sum(n for k, n in seen.items() if k.endswith("NotFoundError")) == 7, seen
        finally:
            stop.set()
            t.join()
        assert not other_bad, other_bad[:3]
    finally:
        cat.close()
