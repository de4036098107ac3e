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
    col._local.wal.close()
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


# -- sharded collections in the pool of open files (#66, finding 2) --------------------------------------

EXHAUSTIVE = {"nprobe": 4096, "rerank": 4096, "beta": 0}


def _sharded(cat, name: str, seed: int, n: int = 300, shards: int = 2):
    """A built sharded collection of n documents (texts, vectors, metadata), and one written after its build."""
    x = clustered(n, DIM, 4, seed=seed)
    path = cat.root.parent / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{name}-{i}", "text": f"note {i} on topic {i % 7}",
                                        "metadata": {"i": i}, "vector": v.tolist()}) + "\n" for i, v in enumerate(x)))
    col = cat.create(name, DIM, "l2", shards=shards)
    col.import_files(path)
    col.upsert([Document(f"{name}-late", "written after the build", x[0] + 0.01, {"late": True})])
    return col


def _answers(col) -> tuple:
    q = clustered(3, DIM, 4, seed=99)
    by_vector = [[h.id for h in hits] for hits in col.search(q, k=5, params=EXHAUSTIVE).hits]
    by_text = [[h.id for h in hits] for hits in col.search(texts=["topic 3", "note 12"], k=5, mode="text").hits]
    return by_vector, by_text, len(col), [d.id for d in col.get([f"{col.name}-late", f"{col.name}-7"])]


def test_idle_sharded_collections_close_their_shards_and_reopen_them_on_their_next_call(tmp_path):
    """#66: a sharded collection's shards never left the pool of open files, so a tenant's built sharded
    collections kept their descriptors for good. Now each counts for its shards' descriptors, and the idle ones
    close their shards whole once the pool needs the room: six 2-shard collections under a pool of 5 collections'
    worth of descriptors (room for two of them) hold at most two collections' files between calls, a released one
    holds none (the process's descriptors drop by what it held), and each answers as it did, its writes kept."""
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False),
                  limits=quota.Limits(max_open_collections=5))
    assert 2 * 2 * quota.DESCRIPTORS_PER_SHARD <= cat.files.budget < 3 * 2 * quota.DESCRIPTORS_PER_SHARD
    root = tmp_path / "data" / "collections"
    expect, held, most = {}, 0, 0
    for j in range(6):
        col = _sharded(cat, f"s{j}", seed=j)
        expect[col.name] = _answers(col)
        held = max(held, _fds_under(root / col.name))
        most = max(most, _fds_under(root))
    assert held >= 2 * 4, held  # each shard's lock, doc store and page file at least
    for _ in range(2):
        for j in reversed(range(6)):
            col = cat.get(f"s{j}")
            assert _answers(col) == expect[col.name]
            most = max(most, _fds_under(root))
            assert cat.files.held <= cat.files.budget
    # Without the pool all six keep their shards open: 6 * held.
    assert most <= 2 * held + 4, (most, held)
    dormant = [n for n in cat.names() if cat.get(n).dormant]
    assert len(dormant) >= 4, dormant
    assert all(_fds_under(root / n) == 0 for n in dormant)

    # Released by hand: the process's descriptors drop by what its shards held; its next call opens them again.
    col = next(cat.get(n) for n in cat.names() if not cat.get(n).dormant)
    had, before = _fds_under(root / col.name), quota.open_descriptors()
    assert had > 0 and col.release_files() and col.dormant
    assert quota.open_descriptors() <= before - had and _fds_under(root / col.name) == 0
    assert _answers(col) == expect[col.name] and not col.dormant

    # A write to a collection that had closed its shards is durable: there after a restart.
    late = cat.get(dormant[0])
    late.upsert([Document("after-release", "kept", np.ones(DIM, np.float32))])
    cat.close()
    assert _fds_under(root) == 0
    cat = catalog(tmp_path / "data")
    assert [d.id for d in cat.get(dormant[0]).get(["after-release"])] == ["after-release"]
    assert _answers(cat.get(dormant[1])) == expect[dormant[1]]
    cat.close()


def test_a_sharded_collection_in_use_keeps_its_shards(tmp_path):
    """A call in progress (or a merge, or an import) holds the shards open: the pool passes over it."""
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False),
                  limits=quota.Limits(max_open_collections=2))
    a = _sharded(cat, "a", seed=1)
    want = _answers(a)
    a._enter()
    try:
        assert not a.release_files()
        b = cat.create("b", DIM, "l2")  # past the pool's budget, but a is busy: it keeps its shards
        b.upsert(_docs(3))
        assert not a.dormant and len(a.index.shards) == 2
    finally:
        a._leave()
    cat.create("c", DIM, "l2")  # now a is idle and the longest unused: it closes its shards
    assert a.dormant and _fds_under(a.path) == 0
    assert _answers(a) == want
    cat.close()


def test_other_tenants_keep_their_descriptors_beside_built_sharded_collections(tmp_path):
    """Under a reserve set so that the process has no room for one more collection's files: with a tenant's
    collection busy (it cannot close its files), the idle sharded collections close their shards so that the other
    tenant's create, write and search go through; a sharded collection that finds no room to open its shards again
    gets UnavailableError (503) and opens nothing, and answers as before once there is room."""
    from fusionrag.retriever.directory import catalog

    limit = quota.descriptor_limit()
    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False))
    shards = [_sharded(cat, f"s{j}", seed=j) for j in range(3)]
    expect = {s.name: _answers(s) for s in shards}
    b = cat.create("b", DIM, "l2")
    b.upsert(_docs(20))
    q = np.ones((1, DIM), np.float32)
    b_hits = [h.id for h in b.search(q, k=3).hits[0]]
    now = quota.open_descriptors()
    cat.files.reserve = limit - now - quota.DESCRIPTORS_PER_COLLECTION + 1  # no room for one more collection
    b._enter()  # the other tenant's collection is busy: only the sharded ones can make room
    try:
        c = cat.create("b2", DIM, "l2")
        c.upsert(_docs(5, prefix="c"))
        assert len(c) == 5
        assert [h.id for h in b.search(q, k=3).hits[0]] == b_hits
        b.upsert(_docs(2, seed=5, prefix="w"))
        assert any(s.dormant for s in shards)
        assert quota.open_descriptors() <= limit - cat.files.reserve
        # No room left at all: a dormant sharded collection's call is refused, and opens nothing.
        c._enter()
        try:
            cat.files.reserve = limit - quota.open_descriptors() + 1
            sleeping = next(s for s in shards if s.dormant)
            before = quota.open_descriptors()
            with pytest.raises(UnavailableError, match="files open and keeps"):
                sleeping.search(q, k=3)
            assert sleeping.dormant and quota.open_descriptors() <= before
        finally:
            c._leave()
    finally:
        b._leave()
    cat.files.reserve = quota.Limits().descriptor_reserve
    for s in shards:
        assert _answers(s) == expect[s.name]
    cat.close()


def test_a_sharded_collection_that_could_never_open_its_shards_is_refused_at_create(tmp_path):
    from fusionrag.retriever.directory import catalog

    cat = catalog(tmp_path / "data")
    cat.files.reserve = quota.descriptor_limit() - 3 * quota.DESCRIPTORS_PER_SHARD
    with pytest.raises(QuotaError, match="at most 3 shards"):
        cat.create("big", DIM, "l2", shards=4)
    assert cat.names() == []
    cat.create("small", DIM, "l2", shards=3)
    cat.close()


def test_concurrent_calls_on_sharded_collections_that_close_each_other_all_answer(tmp_path, monkeypatch):
    """Room in the pool for one 2-shard collection: threads searching and writing three of them at once make each
    close and reopen the others' shards over and over. No call is closed under (every answer is right, no
    error), and the writes are all there."""
    from fusionrag.retriever.directory import catalog
    from fusionrag.retriever.sharded.hosted import HostedSharded

    released = []
    release = HostedSharded.release_files

    def counted(self):
        done = release(self)
        released.append(done)
        return done
    monkeypatch.setattr(HostedSharded, "release_files", counted)
    cat = catalog(tmp_path / "data", collection_config=CollectionConfig(background_merge=False),
                  limits=quota.Limits(max_open_collections=3))
    cols = [_sharded(cat, f"s{j}", seed=j, n=200) for j in range(3)]
    expect = {c.name: _answers(c)[0] for c in cols}
    q = clustered(3, DIM, 4, seed=99)
    errors: list = []

    def work(t: int):
        try:
            for i in range(25):
                col = cols[(t + i) % 3]
                got = [[h.id for h in hits] for hits in col.search(q, k=5, params=EXHAUSTIVE).hits]
                assert got == expect[col.name], (col.name, got)
                col.upsert([Document(f"t{t}-{i}", "w", np.full(DIM, 50.0 + t, np.float32))])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert sum(released) >= 3, sum(released)  # closed while idle, and opened again by the next call, many times
    for t in range(4):
        for i in range(25):
            assert len(cols[(t + i) % 3].get([f"t{t}-{i}"])) == 1
    cat.close()
