"""What one tenant may take from the others, in the engine (retriever/collection/quota.py): collections that close their files
while idle, a reserve of descriptors no collection takes, caps on how many collections there are, and a bulk
import that is claimed before its files arrive, so that it is never dropped in silence (#48)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document, quota
from fusionrag.retriever.errors import ConflictError, QuotaError, StorageError, UnavailableError

DIM = 8


def _fds_under(path: Path) -> int:
    """Descriptors this process holds on files under path, counted from /proc."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(path))
        except OSError:
            pass
    return n


def _docs(n, seed=0, prefix="d"):
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return [Document(f"{prefix}{i}", f"text {i}", v, {"n": i}) for i, v in enumerate(x)]


def test_idle_collections_close_their_files_and_reopen_them_on_their_next_call(tmp_path):
    """40 collections, at most 4 with files open: the descriptors on the data directory stay within 4
    collections' worth however many are used, and every collection answers what was written to it, in turn
    and again, its writes after a reopen durable across a restart."""
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False),
                  limits=quota.Limits(max_open_collections=4))
    q = np.ones((1, DIM), np.float32)
    most = 0
    expect = {}
    for j in range(40):
        col = cat.create(f"c{j}", DIM, "l2")
        col.upsert(_docs(5, seed=j, prefix=f"c{j}-"))
        expect[f"c{j}"] = [h.id for h in col.search(q, k=3).hits[0]]
        most = max(most, _fds_under(tmp_path / "collections"))
    for _ in range(2):
        for j in range(40):
            col = cat.get(f"c{j}")
            assert [h.id for h in col.search(q, k=3).hits[0]] == expect[f"c{j}"]
            assert len(col.get([f"c{j}-0"])) == 1
            most = max(most, _fds_under(tmp_path / "collections"))
    assert len(cat.files) <= 4
    # Writer (3) and log (1) per open collection, and a reader (2) each: 6 * 4; without the pool, 40 * 6.
    assert most <= 4 * 6 + 6, most
    dormant = [n for n in cat.names() if cat.get(n).dormant]
    assert len(dormant) >= 36
    col = cat.get(dormant[0])
    col.upsert(_docs(1, seed=99, prefix="late-"))  # a write to a collection that had closed its files
    cat.close()
    cat = Catalog(tmp_path)
    assert len(cat.get(dormant[0]).get(["late-0"])) == 1
    cat.close()


def test_a_collection_in_use_keeps_its_files(tmp_path):
    cat = Catalog(tmp_path, limits=quota.Limits(max_open_collections=1))
    a = cat.create("a", DIM, "l2")
    a.upsert(_docs(3))
    a._enter()  # a call in progress (what every public method does first)
    try:
        assert not a.release_files()
        cat.create("b", DIM, "l2").upsert(_docs(3))  # one too many open, but a is busy: it keeps its files
        assert not a.dormant and a.store.count() == 3
    finally:
        a._leave()
    cat.create("c", DIM, "l2")  # now a is idle and the longest unused
    assert a.dormant and len(a) == 3 and not a.dormant
    cat.close()


def test_no_collection_opens_files_into_the_descriptor_reserve(tmp_path):
    """With the reserve set so that one more collection's files would pass it, and the open collection busy (it
    cannot close its files), a create is refused with UnavailableError and leaves nothing; once the busy
    collection is idle, the create goes through (the idle one closes its files)."""
    limit = quota.descriptor_limit()
    cat = Catalog(tmp_path)
    a = cat.create("a", DIM, "l2")
    a.upsert(_docs(3))
    now = quota.open_descriptors()
    cat.files.reserve = limit - now - quota.DESCRIPTORS_PER_COLLECTION + 1
    a._enter()
    try:
        with pytest.raises(UnavailableError, match="files open and keeps"):
            cat.create("b", DIM, "l2")
        assert cat.names() == ["a"]
    finally:
        a._leave()
    cat.files.reserve = limit - now - quota.DESCRIPTORS_PER_COLLECTION + 4  # room once a's files are closed
    assert len(cat.create("b", DIM, "l2")) == 0 and a.dormant
    cat.close()


def test_the_number_of_collections_is_capped_in_all_and_by_the_callers_check(tmp_path):
    cat = Catalog(tmp_path, limits=quota.Limits(max_collections=3))
    for name in ("a", "b", "c"):
        cat.create(name, DIM, "l2")
    with pytest.raises(QuotaError, match="max_collections"):
        cat.create("d", DIM, "l2")
    with pytest.raises(QuotaError):
        cat.check_free("d")
    cat.drop("a")
    cat.create("d", DIM, "l2")

    def one_of_team(names):
        if sum(n.startswith("team-") for n in names) >= 1:
            raise QuotaError("team has one")
    cat.drop("b")
    cat.drop("c")
    cat.create("team-1", DIM, "l2", allow=one_of_team)
    with pytest.raises(QuotaError, match="team has one"):
        cat.create("team-2", DIM, "l2", allow=one_of_team)
    assert sorted(cat.names()) == ["d", "team-1"]
    cat.close()


def test_concurrent_creates_never_pass_the_cap(tmp_path):
    cat = Catalog(tmp_path, limits=quota.Limits(max_collections=5))
    results = []

    def make(i):
        try:
            cat.create(f"c{i}", DIM, "l2")
            results.append("ok")
        except QuotaError:
            results.append("quota")

    threads = [threading.Thread(target=make, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 5 and len(cat.names()) == 5
    cat.close()


# -- bulk import: claimed before its files arrive, its outcome always recorded ----------------------------

def _jsonl(path: Path, n: int, bad_line: int | None = None) -> Path:
    x = clustered(n, DIM, 4, seed=3)
    with open(path, "w") as f:
        for i, v in enumerate(x):
            vec = v.tolist() if i != bad_line else [1.0]
            f.write(json.dumps({"id": f"i{i}", "text": f"t{i}", "vector": vec}) + "\n")
    return path


def test_a_claimed_import_refuses_a_second_import_and_writes_until_it_ends(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(min_index_count=50))
    col = cat.create("c", DIM, "l2")
    col.claim_import()
    assert col.info()["build_state"]["import"]["state"] == "uploading"
    with pytest.raises(ConflictError, match="already importing"):
        col.claim_import()
    with pytest.raises(ConflictError, match="importing"):
        col.import_files(_jsonl(tmp_path / "other.jsonl", 10))
    with pytest.raises(ConflictError, match="importing documents"):
        col.upsert(_docs(1))
    done = col.import_files(_jsonl(tmp_path / "mine.jsonl", 200), claimed=True)
    state = col.info()["build_state"]["import"]
    assert state["state"] == "done" and state["documents"] == done["documents"] == 200 and len(col) == 200
    col.upsert(_docs(1, prefix="after-"))  # writes go on once it is done
    assert len(col) == 201
    cat.close()


def test_a_released_claim_leaves_the_state_as_before(tmp_path):
    cat = Catalog(tmp_path)
    col = cat.create("c", DIM, "l2")
    col.claim_import()
    col.release_import()
    assert col.info()["build_state"]["import"] is None
    col.upsert(_docs(2))
    assert len(col) == 2
    cat.close()


def test_an_import_that_fails_says_why_and_never_done(tmp_path):
    cat = Catalog(tmp_path)
    col = cat.create("c", DIM, "l2")
    col.claim_import()
    with pytest.raises(Exception):
        col.import_files(_jsonl(tmp_path / "bad.jsonl", 30, bad_line=7), claimed=True)
    state = col.info()["build_state"]["import"]
    assert state["state"] == "failed" and "line 8" in state["reason"] and str(tmp_path) not in state["reason"]
    # An import refused because another holds the collection leaves that one's state alone.
    col.claim_import()
    with pytest.raises(ConflictError):
        col.import_files(_jsonl(tmp_path / "x.jsonl", 5))
    assert col.info()["build_state"]["import"]["state"] == "uploading"
    cat.close()


def test_an_import_past_the_disk_reserve_is_refused_before_it_stages(tmp_path):
    cat = Catalog(tmp_path, limits=quota.Limits(disk_reserve_bytes=quota.free_bytes(tmp_path) + (1 << 30)))
    col = cat.create("c", DIM, "l2")
    with pytest.raises(StorageError, match="in reserve"):
        col.import_files(_jsonl(tmp_path / "d.jsonl", 100))
    assert col.info()["build_state"]["import"]["state"] == "failed"
    assert not list((tmp_path / "collections" / "c").glob(".import-*"))
    col.upsert(_docs(3))  # ordinary writes still go into the reserve
    assert len(col) == 3
    cat.close()


def test_an_import_interrupted_by_the_process_end_is_reported_and_its_staging_removed(tmp_path):
    """What a SIGKILL during an import leaves (import.json saying it runs, a staging folder with its vectors):
    the next open removes the staging and reports the import as interrupted, and writes are taken again."""
    cat = Catalog(tmp_path)
    col = cat.create("c", DIM, "l2")
    col.claim_import()
    path = col.path
    staging = path / ".import-0123456789abcdef"
    staging.mkdir()
    (staging / "vectors.npy").write_bytes(b"\0" * (1 << 20))
    cat.files.forget(col)
    cat._open.clear()  # the process ends here: nothing closes the collection
    col._wal.close()
    col.store.close()
    cat._release()
    cat = Catalog(tmp_path)
    col = cat.get("c")
    state = col.info()["build_state"]["import"]
    assert state["state"] == "interrupted" and "nothing of it was stored" in state["reason"]
    assert not staging.exists()
    col.upsert(_docs(2))
    assert len(col) == 2
    cat.close()
