"""Snapshots (one archive of a collection's state, written while writes go on, restored elsewhere) and bulk
import (files into an empty collection, indexed by one build): in the engine, over HTTP and from the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import clustered, exact_knn, recall
from server_util import ServerProcess

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document, importer, quota
from fusionrag.retriever.engine.vectors import write_bin
from fusionrag.retriever.errors import ConflictError, InputError, StorageError

DIM = 16


def docs_of(x, start=0, prefix="d"):
    return [Document(f"{prefix}{start + i}", f"paragraph {start + i} about topic{(start + i) % 7}", v,
                     {"n": start + i, "tags": [f"t{(start + i) % 3}"]}) for i, v in enumerate(x)]


def _cfg():
    return CollectionConfig(min_index_count=200, background_merge=False)


def _answers(col, q, **kw):
    return [[(h.id, round(h.distance, 5)) for h in hits] for hits in col.search(q, k=5, **kw).hits]


# -- snapshots -------------------------------------------------------------------------------------

@pytest.fixture
def source(tmp_path):
    """A collection with every part a snapshot must carry: an index, writes after it, deletes of indexed
    documents (tombstones) and replaced ones."""
    cat = Catalog(tmp_path / "a", collection_config=_cfg())
    col = cat.create("src", DIM, "l2")
    x = clustered(700, DIM, 10, seed=1)
    col.add(docs_of(x[:600]))
    col.merge()
    col.add(docs_of(x[600:], start=600))
    col.delete([f"d{i}" for i in range(0, 60, 3)])
    col.upsert([Document("d5", "replaced", x[650], {"n": -1})])
    yield cat, col, x
    cat.close()


def test_a_restored_snapshot_answers_the_same_searches_on_another_data_directory(source, tmp_path):
    cat, col, x = source
    info = col.snapshot(tmp_path / "s.tar")
    assert info["documents"] == len(col) == 680 and info["generation"] == 1
    q = clustered(20, DIM, 10, seed=9)
    expect = [_answers(col, q), _answers(col, q, filter={"n": {"$lt": 300}}),
              _answers(col, None, texts=["topic3 paragraph"], mode="text")]
    other = Catalog(tmp_path / "b", collection_config=_cfg())
    with open(tmp_path / "s.tar", "rb") as f:
        copy = other.restore("copy", f)
    assert copy.name == "copy" and len(copy) == 680
    assert [_answers(copy, q), _answers(copy, q, filter={"n": {"$lt": 300}}),
            _answers(copy, None, texts=["topic3 paragraph"], mode="text")] == expect
    assert copy.info()["build_state"] == {**col.info()["build_state"], "import": None}
    assert copy.get(["d5"])[0].text == "replaced" and copy.get(["d3"]) == []
    copy.add(docs_of(x[:5], prefix="new"))  # a restored collection takes writes and merges
    copy.merge()
    assert len(copy) == 685
    other.close()


def test_a_snapshot_taken_while_writes_go_on_holds_every_write_acknowledged_before_it(source, tmp_path):
    cat, col, x = source
    acked: list[tuple[float, str]] = []
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            col.upsert([Document(f"w{i}", None, x[i % 700])])
            acked.append((time.monotonic(), f"w{i}"))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.3)
    started = time.monotonic()
    col.snapshot(tmp_path / "s.tar")
    finished = time.monotonic()
    stop.set()
    t.join()
    other = Catalog(tmp_path / "b")
    with open(tmp_path / "s.tar", "rb") as f:
        copy = other.restore("copy", f)
    before = [i for at, i in acked if at < started]
    during = [i for at, i in acked if started <= at <= finished]
    assert before and len(copy.get(before)) == len(before)  # nothing acknowledged before it is missing
    n = len(copy)
    assert 680 + len(before) <= n <= 680 + len(before) + len(during) + 1
    # a consistent point: the writes it holds are a prefix of the writer's
    held = {d.id for d in copy.get([i for _, i in acked])}
    assert held == {f"w{i}" for i in range(len(held))}
    other.close()


def _tar_members(path):
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def _write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for m, data in members:
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))


def _flip(members):
    out = []
    for m, data in members:
        if m.name.endswith("rows.npy"):
            data = data[:-1] + bytes([data[-1] ^ 1])
        out.append((m, data))
    return out


def _evil(members):
    extra = tarfile.TarInfo("gen-000001/index/../../../evil")
    return [(extra, b"x")] + members


def _newer(members):
    out = []
    for m, data in members:
        if m.name == "snapshot.json":
            data = json.dumps({**json.loads(data), "format_version": 99}).encode()
        out.append((m, data))
    return out


@pytest.mark.parametrize("damage, words", [
    (_flip, "altered"), (_evil, "unexpected member"), (_newer, "newer than this fusionrag"),
    (lambda members: members[:-1], "no snapshot.json"), (lambda members: members[:3], "no snapshot.json"),
])
def test_a_damaged_archive_is_refused_and_leaves_nothing(source, tmp_path, damage, words):
    _, col, _ = source
    col.snapshot(tmp_path / "s.tar")
    _write_tar(tmp_path / "bad.tar", damage(_tar_members(tmp_path / "s.tar")))
    other = Catalog(tmp_path / "b")
    with open(tmp_path / "bad.tar", "rb") as f, pytest.raises(InputError, match=words):
        other.restore("copy", f)
    assert other.names() == [] and list((tmp_path / "b" / "collections").iterdir()) == []
    assert not (tmp_path / "evil").exists()
    with open(tmp_path / "s.tar", "rb") as f:
        assert len(other.restore("copy", f)) == 680  # the name was left free
    with open(tmp_path / "s.tar", "rb") as f, pytest.raises(ConflictError):
        other.restore("copy", f)
    other.close()


def _forge(members, changes: dict):
    """The members with `changes` (name -> (TarInfo or None, data)) applied, and snapshot.json rewritten to
    declare them, as someone who knows the format would forge an archive."""
    out, files = [], {}
    for m, data in members:
        if m.name == "snapshot.json":
            manifest = json.loads(data)
            continue
        info, data = changes.get(m.name, (m, data))
        out.append((info or m, data))
        files[m.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["files"] = files
    return out + [(tarfile.TarInfo("snapshot.json"), json.dumps(manifest).encode())]


def _sparse(name: str, claims: int) -> tarfile.TarInfo:
    """A GNU sparse member (PAX 0.1) of 1 stored byte whose data expands to `claims` bytes when read."""
    info = tarfile.TarInfo(name)
    info.pax_headers = {"GNU.sparse.size": str(claims), "GNU.sparse.numblocks": "1",
                        "GNU.sparse.map": f"{claims - 1},1"}
    return info


def _write_pax(path, members):
    """Like _write_tar, but a member's own size is kept where it is sparse (its header's claim)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for m, data in members:
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))


class _Stream(io.RawIOBase):
    """A file read as a pipe is: no seeking."""

    def __init__(self, f):
        self.f = f

    def readable(self):
        return True

    def readinto(self, b):
        return self.f.readinto(b)


def _bytes_under(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("seekable", [True, False])
@pytest.mark.parametrize("member, words", [
    (lambda: _sparse("docs.sqlite", 1 << 31), "sparse file"),
    (lambda: tarfile.TarInfo("docs.sqlite"), None),  # a plain one: the control
    (lambda: _link("docs.sqlite"), "tar member of type"),
    (lambda: _fifo("docs.sqlite"), "tar member of type"),
])
def test_a_restore_refuses_members_a_snapshot_never_holds_before_writing_them(source, tmp_path, seekable, member,
                                                                              words):
    """A 1 KB member claiming 2 GiB as a GNU sparse file (#48: one 1.5 KB request wrote 2 GiB), a hard link or a
    FIFO in place of docs.sqlite, snapshot.json declaring what it claims: refused, and the data directory holds
    what it held before (for a seekable archive nothing is written at all: the headers are read first)."""
    _, col, _ = source
    col.snapshot(tmp_path / "s.tar")
    members = _tar_members(tmp_path / "s.tar")
    store = next(data for m, data in members if m.name == "docs.sqlite")
    forged = _forge(members, {"docs.sqlite": (member(), store)})
    _write_pax(tmp_path / "bad.tar", forged)
    other = Catalog(tmp_path / "b")
    before = _bytes_under(tmp_path / "b")
    with open(tmp_path / "bad.tar", "rb") as f:
        archive = f if seekable else _Stream(f)
        if words is None:  # the same archive with a plain member restores
            assert len(other.restore("copy", archive)) == 680
            other.close()
            return
        with pytest.raises(InputError, match=words):
            other.restore("copy", archive)
    assert other.names() == [] and list((tmp_path / "b" / "collections").iterdir()) == []
    assert _bytes_under(tmp_path / "b") - before < 1 << 20
    other.close()


def _link(name):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, "collection.json"
    return info


def _fifo(name):
    info = tarfile.TarInfo(name)
    info.type = tarfile.FIFOTYPE
    return info


@pytest.mark.parametrize("seekable", [True, False])
def test_a_restore_writes_at_most_its_limit_and_never_into_the_disk_reserve(source, tmp_path, seekable):
    """max_restore_bytes one byte short of the members' total, then a disk reserve larger than the disk's free
    space: each refused (InputError, StorageError), nothing left behind; a seekable archive writes nothing."""
    _, col, _ = source
    col.snapshot(tmp_path / "s.tar")
    members = _tar_members(tmp_path / "s.tar")
    total = sum(len(data) for m, data in members if m.name != "snapshot.json")
    for limits, error, words in [
            (quota.Limits(max_restore_bytes=total - 1), InputError, "max_restore_bytes"),
            (quota.Limits(disk_reserve_bytes=quota.free_bytes(tmp_path) + (1 << 30)), StorageError, "in reserve")]:
        other = Catalog(tmp_path / "b", limits=limits)
        with open(tmp_path / "s.tar", "rb") as f, pytest.raises(error, match=words):
            other.restore("copy", f if seekable else _Stream(f))
        assert list((tmp_path / "b" / "collections").iterdir()) == []
        other.close()
    other = Catalog(tmp_path / "b", limits=quota.Limits(max_restore_bytes=total))
    with open(tmp_path / "s.tar", "rb") as f:
        assert len(other.restore("copy", f if seekable else _Stream(f))) == 680
    other.close()


def test_sizes_that_disagree_with_the_manifest_are_refused_before_anything_is_written(source, tmp_path):
    _, col, _ = source
    col.snapshot(tmp_path / "s.tar")
    members = _tar_members(tmp_path / "s.tar")
    out = []
    for m, data in members:
        if m.name == "snapshot.json":
            manifest = json.loads(data)
            manifest["files"]["docs.sqlite"]["bytes"] += 1
            data = json.dumps(manifest).encode()
        out.append((m, data))
    _write_tar(tmp_path / "bad.tar", out)
    other = Catalog(tmp_path / "b")
    with open(tmp_path / "bad.tar", "rb") as f, pytest.raises(InputError, match="do not match snapshot.json"):
        other.restore("copy", f)
    assert list((tmp_path / "b" / "collections").iterdir()) == []
    other.close()


@pytest.mark.parametrize("change, words", [
    ({"dim": 32}, "does not open"),  # disagrees with the stored vectors (#48: a 500)
    ({"dim": "16"}, "dim must be an integer"),
    ({"metric": "hamming"}, "metric must be one of"),
    ({"embedding": 7}, "embedding must be a model name"),
])
def test_a_restored_description_is_checked_as_create_checks_it(source, tmp_path, change, words):
    _, col, _ = source
    col.snapshot(tmp_path / "s.tar")
    members = _tar_members(tmp_path / "s.tar")
    desc = json.loads(next(data for m, data in members if m.name == "collection.json"))
    _write_tar(tmp_path / "bad.tar", _forge(members, {"collection.json": (None, json.dumps({**desc, **change}).encode())}))
    other = Catalog(tmp_path / "b")
    with open(tmp_path / "bad.tar", "rb") as f, pytest.raises(InputError, match=words):
        other.restore("copy", f)
    assert other.names() == [] and list((tmp_path / "b" / "collections").iterdir()) == []
    other.close()


def test_snapshot_over_http_restored_by_another_service(source, tmp_path):
    cat, col, _ = source
    q = clustered(5, DIM, 10, seed=3)
    expect = _answers(col, q)
    cat.close()
    keys = tmp_path / "keys"
    keys.write_text("admin-key-0000\nother-key-0000 other-*\n")
    a = ServerProcess(tmp_path / "a", tmp_path / "a.log", "--no-demo", "--api-keys-file", str(keys))
    b = ServerProcess(tmp_path / "b", tmp_path / "b.log", "--no-demo")
    try:
        a.wait_ready()
        b.wait_ready()
        with a.client(headers={"Authorization": "Bearer admin-key-0000"}) as c, b.client() as cb:
            r = c.post("/v1/collections/src/snapshots")
            assert r.status_code == 201 and r.json()["documents"] == 680, r.text
            sid = r.json()["id"]
            assert [s["id"] for s in c.get("/v1/collections/src/snapshots").json()["snapshots"]] == [sid]
            archive = c.get(f"/v1/collections/src/snapshots/{sid}")
            assert archive.status_code == 200 and archive.headers["content-type"] == "application/x-tar"
            other = {"Authorization": "Bearer other-key-0000"}
            assert c.post("/v1/collections/src/snapshots", headers=other).status_code == 403
            assert c.get(f"/v1/collections/src/snapshots/{sid}", headers=other).status_code == 403
            assert c.get("/v1/collections/src/snapshots/../../etc").status_code == 404
            r = cb.post("/v1/collections/copy/restore", content=archive.content,
                        headers={"content-type": "application/x-tar"})
            assert r.status_code == 201 and r.json()["count"] == 680, r.text
            got = cb.post("/v1/collections/copy/search", json={"vectors": q.tolist(), "k": 5}).json()["results"]
            assert [[(h["id"], round(h["distance"], 5)) for h in hits] for hits in got] == expect
            assert cb.post("/v1/collections/copy/restore", content=archive.content).status_code == 409
            r = cb.post("/v1/collections/junk/restore", content=b"not a tar" * 100)
            assert r.status_code == 422 and "not a readable tar archive" in r.text
            assert cb.post("/v1/collections/junk/restore", content=b"").status_code == 422
            assert c.delete(f"/v1/collections/src/snapshots/{sid}").status_code == 200
            assert c.get(f"/v1/collections/src/snapshots/{sid}").status_code == 404
    finally:
        a.stop()
        b.stop()


def test_cli_snapshot_and_restore_and_the_data_directory_lock(source, tmp_path):
    cat, col, x = source
    run = [sys.executable, "-m", "fusionrag"]
    busy = subprocess.run(run + ["snapshot", str(tmp_path / "a"), "src", str(tmp_path / "s.tar")],
                          capture_output=True, text=True)
    assert busy.returncode == 2 and "in use by another catalog" in busy.stderr  # the fixture's catalog holds it
    q = x[:5]
    expect = _answers(col, q)
    cat.close()
    done = subprocess.run(run + ["snapshot", str(tmp_path / "a"), "src", str(tmp_path / "s.tar")],
                          capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout)["documents"] == 680, done.stderr
    done = subprocess.run(run + ["restore", str(tmp_path / "b"), str(tmp_path / "s.tar"), "--collection", "copy"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout)["count"] == 680, done.stderr
    other = Catalog(tmp_path / "b")
    assert _answers(other.get("copy"), q) == expect
    other.close()


# -- bulk import -----------------------------------------------------------------------------------

@pytest.fixture
def files(tmp_path):
    x = clustered(3000, DIM, 20, seed=4)
    write_bin(tmp_path / "v.fbin", x)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"id": f"d{i}", "text": f"paragraph {i} about topic{i % 7}",
                                "metadata": {"n": i, "tags": [f"t{i % 3}"]}}) + "\n")
    return tmp_path, x


def test_import_of_vectors_and_sidecar_builds_the_index_directly(files):
    tmp, x = files
    cat = Catalog(tmp / "data", collection_config=CollectionConfig(min_index_count=200))
    col = cat.create("c", DIM, "l2")
    done = col.import_files(tmp / "docs.jsonl", tmp / "v.fbin", progress=False)
    assert done["documents"] == done["stored"] == 3000 and done["indexed"]
    state = col.info()["build_state"]
    assert state["indexed"] == 3000 and state["fresh"] == 0 and state["generation"] == 1  # not the fresh tier
    assert state["import"]["state"] == "done"
    q = clustered(30, DIM, 20, seed=5)
    res = col.search(q, k=10)
    assert res.stats[0]["lists_probed"] > 0
    assert recall(np.asarray([[int(h.id[1:]) for h in hits] for hits in res.hits]), exact_knn(x, q, 10)) >= 0.95
    d7 = col.get(["d7"], with_vectors=True)[0]
    assert d7.text == "paragraph 7 about topic0" and d7.metadata == {"n": 7, "tags": ["t1"]}
    assert np.array_equal(d7.vector, x[7])
    assert {h.id for h in col.search(q[:1], k=5, filter={"tags": {"$contains": "t2"}}).hits[0]} <= \
        {f"d{i}" for i in range(2, 3000, 3)}
    assert col.search(k=3, texts=["topic4"], mode="text").hits[0][0].metadata["n"] % 7 == 4
    with pytest.raises(ConflictError, match="already holds documents"):
        col.import_files(tmp / "docs.jsonl", tmp / "v.fbin")
    col.upsert([Document("after", None, x[0])])  # writes go on after it
    cat.close()
    cat = Catalog(tmp / "data")  # and all of it is there after a restart
    assert len(cat.get("c")) == 3001 and cat.get("c").info()["build_state"]["indexed"] == 3000
    cat.close()


def test_import_of_json_lines_later_lines_win_and_a_model_embeds_texts(tmp_path):
    from fusionrag.retriever.collection.embedding import get_embedder

    lines = [{"id": "a", "text": "the first version"}, {"id": "b", "text": "asyncio runs event loops"},
             {"id": "a", "text": "tombstones keep deleted documents out of results"}, {"text": "no id given"}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    cat = Catalog(tmp_path / "data", collection_config=CollectionConfig(min_index_count=2))
    col = cat.create("c", 384, "cosine", "all-MiniLM-L6-v2")
    done = col.import_files(tmp_path / "docs.jsonl", progress=False)
    assert done["documents"] == 4 and done["stored"] == 3  # "a" twice: the later line won
    assert col.get(["a"])[0].text.startswith("tombstones")
    q = get_embedder("all-MiniLM-L6-v2").embed(["how are deleted documents kept out?"])
    hits = col.search(q, k=3).hits[0]
    assert hits[0].id == "a" and [h.id for h in hits].count("a") == 1  # the superseded row is a tombstone
    cat.close()


def test_import_progress_moves_as_texts_are_embedded(tmp_path, monkeypatch):
    """#49: progress sat at "staging vectors 0/5000" for minutes while a chunk of 4,096 texts was embedded; it now
    moves by each batch of EMBED_BATCH texts embedded (the steps seen by the collection's progress, as its info
    reports them)."""
    from fusionrag.retriever.collection import api, importer

    rng = np.random.default_rng(2)
    n = 700
    lines = [{"id": f"d{i}", "text": f"text {i}"} if i % 7 else {"id": f"d{i}", "vector": rng.standard_normal(16)
                                                                  .tolist()} for i in range(n)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    class Embedder:  # the model's shape, without the model: each call's size recorded
        dim, calls = 16, []

        def embed(self, texts, bulk=False):
            assert bulk  # an import embeds on the bulk threads
            self.calls.append(len(texts))
            return rng.standard_normal((len(texts), 16)).astype(np.float32)

    monkeypatch.setattr(importer, "EMBED_BATCH", 64)
    cat = Catalog(tmp_path / "data", collection_config=CollectionConfig(min_index_count=2))
    col = cat.create("c", 16, "l2")
    monkeypatch.setattr("fusionrag.retriever.collection.embedding.get_embedder", lambda name: Embedder())
    col.embedding = "fake"
    seen = []
    step = api.Collection._merge_step
    monkeypatch.setattr(api.Collection, "_merge_step", lambda self, *a: (seen.append(a), step(self, *a)))
    done = col.import_files(tmp_path / "docs.jsonl", progress=False)
    assert done["stored"] == n and max(Embedder.calls) == 64 and sum(Embedder.calls) == n - len(range(0, n, 7))
    staged = [d for name, d, total in seen if name == "staging vectors (embedding texts)"]
    assert staged[0] == 0 and staged[-1] == n and len(staged) >= n // 64
    assert max(b - a for a, b in zip(staged, staged[1:])) <= n // 7 + 64  # never more than a batch (+ the vectors)
    cat.close()


@pytest.mark.parametrize("lines, vectors, words", [
    (['{"id": "x", "vector": [1, 2]}'], False, "line 1: vector must be 16 numbers"),
    (['{"vector": ' + json.dumps([0.0] * 15 + [1e20]) + '}'], False, "line 1: vector has squared norm"),
    (['{"id": "x", "text": "no model"}'], False, "has no embedding model"),
    (['not json'], False, "line 1: not JSON"),
    (['{"id": "x", "colour": "red"}'], False, "keys among"),
    (['{"id": "x"}'] * 5, True, "5 lines, the vector file 3000 vectors"),
])
def test_a_bad_import_is_refused_naming_the_line_and_changes_nothing(files, lines, vectors, words):
    tmp, _ = files
    (tmp / "bad.jsonl").write_text("\n".join(lines) + "\n")
    cat = Catalog(tmp / "data")
    col = cat.create("c", DIM, "l2")
    with pytest.raises(InputError, match=words):
        col.import_files(tmp / "bad.jsonl", tmp / "v.fbin" if vectors else None)
    state = col.info()["build_state"]
    assert len(col) == 0 and state["generation"] == 0 and state["import"]["state"] == "failed"
    assert not [p for p in (tmp / "data" / "collections" / "c").iterdir() if p.name.startswith(".import")]
    assert col.import_files(None, tmp / "v.fbin", progress=False)["stored"] == 3000  # and can be done again
    assert col.get(["2999"])  # ids by row number without a sidecar
    cat.close()


def test_writes_wait_for_an_import(files, monkeypatch):
    tmp, x = files
    cat = Catalog(tmp / "data", collection_config=CollectionConfig(min_index_count=200))
    col = cat.create("c", DIM, "l2")
    building, release = threading.Event(), threading.Event()
    real = importer.build_index

    def slow_build(*args, **kwargs):
        building.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(importer, "build_index", slow_build)
    t = threading.Thread(target=col.import_files, args=(tmp / "docs.jsonl", tmp / "v.fbin", False))
    t.start()
    assert building.wait(30)
    assert col.info()["build_state"]["import"]["state"] == "running"
    with pytest.raises(ConflictError, match="importing"):
        col.upsert([Document("x", None, x[0])])
    release.set()
    t.join(60)
    col.upsert([Document("x", None, x[0])])
    assert len(col) == 3001
    cat.close()


def test_import_over_http_multipart_and_json_lines(files):
    tmp, x = files
    srv = ServerProcess(tmp / "srv", tmp / "srv.log", "--no-demo", "--min-index-count", "200")
    try:
        srv.wait_ready()
        with srv.client() as c:
            for name in ("a", "b"):
                assert c.post("/v1/collections", json={"name": name, "dimension": DIM, "metric": "l2"}).status_code == 201
            with open(tmp / "v.fbin", "rb") as fv, open(tmp / "docs.jsonl", "rb") as fd:
                r = c.post("/v1/collections/a/import", files={"vectors": ("base.fbin", fv), "documents": ("d.jsonl", fd)})
            assert r.status_code == 202, r.text
            lines = "".join(json.dumps({"id": f"e{i}", "vector": x[i].tolist()}) + "\n" for i in range(500))
            r = c.post("/v1/collections/b/import", content=lines, headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 202, r.text
            for name, n in (("a", 3000), ("b", 500)):
                deadline = time.monotonic() + 120
                while (state := c.get(f"/v1/collections/{name}").json()["build_state"])["import"]["state"] == "running":
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                assert state["import"]["state"] == "done" and state["indexed"] == n, state
            r = c.post("/v1/collections/a/search", json={"vectors": x[:1].tolist(), "k": 1, "stats": True}).json()
            assert r["results"][0][0]["id"] == "d0" and r["stats"][0]["lists_probed"] > 0
            assert c.post("/v1/collections/a/import", content=lines,
                          headers={"content-type": "application/x-ndjson"}).status_code == 409
            assert c.post("/v1/collections", json={"name": "e", "dimension": DIM}).status_code == 201
            assert c.post("/v1/collections/e/import", content=lines, headers={"content-type": "text/csv"}).status_code == 415
            r = c.post("/v1/collections/e/import", files={"vectors": ("base.txt", b"123")})
            assert r.status_code == 422 and "must end in one of" in r.text
            assert c.post("/v1/collections/e/import", content=b"",
                          headers={"content-type": "application/x-ndjson"}).status_code == 422
    finally:
        srv.stop()


def test_cli_import_makes_the_collection(files):
    tmp, x = files
    done = subprocess.run([sys.executable, "-m", "fusionrag", "import", str(tmp / "data"), "--collection", "c",
                           "--vectors", str(tmp / "v.fbin"), "--documents", str(tmp / "docs.jsonl"), "--metric", "l2"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout)["stored"] == 3000, done.stderr
    cat = Catalog(tmp / "data")
    col = cat.get("c")
    assert col.dim == DIM and col.metric == "l2" and col.search(x[:1], k=1).hits[0][0].id == "d0"
    cat.close()
