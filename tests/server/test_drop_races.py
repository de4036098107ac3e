"""Searches and snapshots racing the drop of a collection (#66, finding 6a and 6c): a search answers 200, 404 or
503, a snapshot 201, 404 or 409, never a 500 (the shards' threads shut down under a search) nor a 507 (a
snapshot's files gone with the dropped collection: "No such file or directory"). The service's snapshot shelf
in-process over both kinds of collection, then the real service (`python -m fusionrag serve`) over HTTP."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered
from server_util import ServerProcess

from fusionrag.retriever.collection import CollectionConfig, Document
from fusionrag.retriever.errors import ConflictError, NotFoundError, StorageError, UnavailableError

DIM = 8


def _fill(cat, name: str, sharded: bool, seed: int) -> np.ndarray:
    x = clustered(300, DIM, 4, seed=seed)
    if sharded:
        path = cat.root.parent / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{name}-{i}", "vector": v.tolist()}) + "\n"
                                for i, v in enumerate(x)))
        cat.create(name, DIM, "l2", shards=2).import_files(path)
    else:
        cat.create(name, DIM, "l2").upsert([Document(f"{name}-{i}", None, v) for i, v in enumerate(x)])
    return x


@pytest.mark.parametrize("sharded", [False, True], ids=["collection", "sharded"])
def test_snapshots_racing_a_drop_are_written_or_refused_with_404(tmp_path, sharded):
    """Threads taking snapshots through the service's shelf (as POST .../snapshots does) while the collection is
    dropped, three times: each snapshot is written whole (its archive and description there) or refused with
    NotFoundError (404) or ConflictError (409); none is a StorageError (507), and none leaves a part behind."""
    from fusionrag.retriever.directory import catalog
    from fusionrag.server.snapshots import SnapshotShelf

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False))
    shelf = SnapshotShelf(tmp_path / "snapshots", 10_000, 1 << 40, 0)
    try:
        for r in range(3):
            _fill(cat, "c", sharded, seed=r)
            seen: dict[str, int] = {}
            bad: list = []
            lock = threading.Lock()
            go = threading.Barrier(4)

            def take():
                go.wait()
                while True:
                    try:
                        shelf.take(cat.get("c"))
                        out = "201"
                    except NotFoundError:
                        out = "404"
                    except (ConflictError, UnavailableError) as e:  # 409, 503
                        out = type(e).__name__
                    except BaseException as e:  # noqa: BLE001 - a StorageError (507) among them
                        bad.append(repr(e))
                        return
                    with lock:
                        seen[out] = seen.get(out, 0) + 1
                    if out == "404":
                        return

            threads = [threading.Thread(target=take) for _ in range(3)]
            for t in threads:
                t.start()
            go.wait()
            time.sleep(0.05 + 0.1 * r)
            cat.drop("c")
            for t in threads:
                t.join(120)
            assert not bad, bad[:3]
            assert seen.get("404") == 3, seen
        folder = tmp_path / "snapshots" / "c"
        tars, descs = sorted(folder.glob("*.tar")), sorted(folder.glob("*.json"))
        assert tars and [p.stem for p in tars] == [p.stem for p in descs]
        assert not list(folder.glob(".*"))  # no archive cut short, no doc-store copy left
    finally:
        cat.close()


def test_a_snapshot_that_fails_on_the_disk_is_still_507(tmp_path, monkeypatch):
    """A real disk error while the collection is there: StorageError (507), as before."""
    from fusionrag.retriever.collection.api import Collection
    from fusionrag.retriever.directory import catalog
    from fusionrag.server.snapshots import SnapshotShelf

    cat = catalog(tmp_path / "data")
    shelf = SnapshotShelf(tmp_path / "snapshots", 10, 1 << 40, 0)
    try:
        _fill(cat, "c", False, seed=0)

        def full(self, dest):
            raise StorageError(f"collection {self.name!r}: cannot write its snapshot: [Errno 28] No space left")
        monkeypatch.setattr(Collection, "snapshot", full)
        with pytest.raises(StorageError, match="No space"):
            shelf.take(cat.get("c"))
    finally:
        cat.close()


def test_searches_and_snapshots_racing_the_drop_of_a_sharded_collection_over_http(tmp_path):
    """The real service: threads searching a sharded collection (by vector and text) and snapshotting it while it
    is dropped, twice: every search 200, 404 or 503, every snapshot 201, 404 or 409."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo", "--max-snapshots", "10000",
                        "--max-snapshot-bytes", str(1 << 40))
    x = clustered(400, DIM, 4, seed=5).round(4)
    lines = "".join(json.dumps({"id": f"r{i}", "text": f"note {i} on topic {i % 7}", "vector": v.tolist()}) + "\n"
                    for i, v in enumerate(x)).encode()
    allowed = {"search": {200, 404, 503}, "text": {200, 404, 503}, "snapshot": {201, 404, 409}}
    try:
        srv.wait_ready()
        with srv.client() as c:
            for r in range(2):
                r0 = c.post("/v1/collections", json={"name": "s", "dimension": DIM, "metric": "l2", "shards": 2})
                assert r0.status_code == 201, r0.text
                r0 = c.post("/v1/collections/s/import", content=lines,
                            headers={"content-type": "application/x-ndjson"})
                assert r0.status_code == 202, r0.text
                deadline = time.monotonic() + 120
                while c.get("/v1/collections/s").json()["build_state"]["import"]["state"] != "done":
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                seen: dict[tuple, int] = {}
                bad: list = []
                lock = threading.Lock()
                go = threading.Barrier(6)

                def worker(what: str):
                    body = {"search": {"vectors": x[:3].tolist(), "k": 5},
                            "text": {"texts": ["topic 3"], "mode": "text", "k": 5}}.get(what)
                    with srv.client() as wc:
                        go.wait()
                        while True:
                            if what == "snapshot":
                                resp = wc.post("/v1/collections/s/snapshots")
                            else:
                                resp = wc.post("/v1/collections/s/search", json=body)
                            with lock:
                                seen[(what, resp.status_code)] = seen.get((what, resp.status_code), 0) + 1
                            if resp.status_code not in allowed[what]:
                                bad.append((what, resp.status_code, resp.text[:300]))
                                return
                            if resp.status_code == 404:
                                return

                threads = [threading.Thread(target=worker, args=(w,))
                           for w in ("search", "search", "text", "snapshot", "snapshot")]
                for t in threads:
                    t.start()
                go.wait()
                time.sleep(0.2 + 0.2 * r)
                assert c.delete("/v1/collections/s").status_code == 200
                for t in threads:
                    t.join(120)
                assert not bad, (bad[:3], seen)
                assert seen.get(("search", 200)) and seen.get(("snapshot", 201)), seen
                assert c.get("/v1/collections/s").status_code == 404
    finally:
        srv.stop()
    errors = [line for line in Path(tmp_path / "log").read_text().splitlines() if '"level": "error"' in line]
    assert not errors, errors[:2]
