"""No tenant may take the disk or the descriptors from another, or lose an import in silence (#48): the real
service, in its own process, against each finding of the adversarial run, and one tenant doing all of it in a
loop beside another tenant's searches and writes."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from server_util import ServerProcess

from fusionrag.retriever.collection import importer, quota

DIM = 16
KEYS = "key-a-000000 a-*\nkey-b-000000 b-*\n"
A = {"Authorization": "Bearer key-a-000000"}
B = {"Authorization": "Bearer key-b-000000"}


def _docs(n, seed=0, prefix="d", text=True):
    x = np.random.default_rng(seed).standard_normal((n, DIM)).round(4)
    return [{"id": f"{prefix}{i}", "vector": v.tolist(),
             **({"text": f"paragraph {i} on topic {i % 7}"} if text else {})} for i, v in enumerate(x)]


def _keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    return path


def _wait_import(c: httpx.Client, name: str, headers=None, timeout=120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = c.get(f"/v1/collections/{name}", headers=headers).json()["build_state"]["import"]
        if state and state["state"] not in ("uploading", "running"):
            return state
        time.sleep(0.05)
    raise AssertionError(f"import into {name} did not end")


def _sparse_archive() -> bytes:
    """1.5 KB of tar whose one member expands to 2 GiB when read (a GNU sparse file, PAX 0.1)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("docs.sqlite")
        info.size = 1
        info.pax_headers = {"GNU.sparse.size": str(1 << 31), "GNU.sparse.numblocks": "1",
                            "GNU.sparse.map": f"{(1 << 31) - 1},1"}
        tar.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


# -- descriptors ------------------------------------------------------------------------------------

def test_one_tenant_creating_collections_cannot_exhaust_the_descriptors(tmp_path):
    """Under `ulimit -n 1024` (which #48's run exhausted with 166 creates of empty collections), tenant A creates
    300 collections, its per-key limit, while tenant B searches and writes: every create is a 201 until the
    limit's 409, B never sees an error, the server never holds more descriptors than its limit less the reserve
    plus B's connection, and B's snapshot still gets its 201."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo", "--api-keys-file", str(_keys(tmp_path)),
                        "--max-collections-per-key", "300", "--descriptor-reserve", "128", nofile=1024)
    stop = threading.Event()
    b_status: list[int] = []
    most = [0]
    try:
        srv.wait_ready()
        with srv.client(headers=B) as c:
            r = c.post("/v1/collections", json={"name": "b-main", "dimension": DIM, "metric": "l2"})
            assert r.status_code == 201
            assert c.post("/v1/collections/b-main/documents", json={"documents": _docs(50)}).status_code == 200

        def tenant_b():
            rng = np.random.default_rng(1)
            made = []
            with srv.client(headers=B) as c:
                i = 0
                while not stop.is_set():
                    q = rng.standard_normal((1, DIM)).tolist()
                    b_status.append(c.post("/v1/collections/b-main/search", json={"vectors": q, "k": 3}).status_code)
                    b_status.append(c.post("/v1/collections/b-main/documents",
                                           json={"documents": _docs(2, seed=i, prefix=f"w{i}-")}).status_code)
                    most[0] = max(most[0], srv.open_files())
                    i += 1

        t = threading.Thread(target=tenant_b)
        t.start()
        statuses = []
        with srv.client(headers=A) as c:
            for i in range(301):
                r = c.post("/v1/collections", json={"name": f"a-{i}", "dimension": DIM, "metric": "l2"})
                statuses.append(r.status_code)
                if i % 10 == 0:
                    most[0] = max(most[0], srv.open_files())
            assert statuses == [201] * 300 + [409], [(i, s) for i, s in enumerate(statuses) if s != 201][:5]
            assert "max_collections_per_key" in r.text
            assert c.post("/v1/collections/a-0/documents", json={"documents": _docs(3)}).status_code == 200
        stop.set()
        t.join()
        with srv.client(headers=B) as c:
            assert c.post("/v1/collections/b-main/snapshots").status_code == 201
        assert b_status and set(b_status) == {200}, sorted(set(b_status))
        assert most[0] <= 1024 - 128 + 8, most[0]
    finally:
        stop.set()
        srv.stop()


def _holding_files(srv: ServerProcess, root: Path) -> dict[str, int]:
    """Descriptors the server process holds on each collection's files under root (by collection name)."""
    out: dict[str, int] = {}
    fds = Path(f"/proc/{srv.proc.pid}/fd")
    for fd in fds.iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.is_relative_to(root):
            name = target.relative_to(root).parts[0]
            out[name] = out.get(name, 0) + 1
    return out


def test_a_tenants_built_sharded_collections_take_no_descriptors_from_another(tmp_path):
    """#66: a sharded collection's shards never left the pool of open files, so under a 1,024 limit one key's seven
    16-shard collections held the descriptors for good and another key's searches, writes, creates and snapshots got
    503. Under `ulimit -n 384`: tenant A builds ten 4-shard collections (room in the pool for two at a time) while
    tenant B searches, writes and creates. Every call of both goes through, B never sees an error, the server never
    holds more descriptors than its limit less the reserve, and each of A's collections, its shards closed while
    idle, answers afterwards as it did when built."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo", "--api-keys-file", str(_keys(tmp_path)),
                        "--descriptor-reserve", "64", nofile=384)
    stop = threading.Event()
    b_status: list[tuple[str, int]] = []
    most = [0]
    q = np.random.default_rng(7).standard_normal((2, DIM)).round(4).tolist()
    exhaustive = {"nprobe": 4096, "rerank": 4096, "beta": 0}

    def answers(c: httpx.Client, name: str) -> list:
        out = []
        for body in ({"vectors": q, "k": 5, "params": exhaustive}, {"texts": ["topic 3"], "mode": "text", "k": 5}):
            r = c.post(f"/v1/collections/{name}/search", json=body)
            assert r.status_code == 200, (name, r.status_code, r.text)
            out.append([[h["id"] for h in hits] for hits in r.json()["results"]])
        return out

    try:
        srv.wait_ready()
        with srv.client(headers=B) as c:
            r = c.post("/v1/collections", json={"name": "b-main", "dimension": DIM, "metric": "l2"})
            assert r.status_code == 201
            assert c.post("/v1/collections/b-main/documents", json={"documents": _docs(50)}).status_code == 200

        def tenant_b():
            rng = np.random.default_rng(1)
            made = []
            with srv.client(headers=B) as c:
                i = 0
                while not stop.is_set():
                    v = rng.standard_normal((1, DIM)).tolist()
                    r = c.post("/v1/collections/b-main/search", json={"vectors": v, "k": 3})
                    b_status.append(("search", r.status_code))
                    r = c.post("/v1/collections/b-main/documents",
                               json={"documents": _docs(2, seed=i, prefix=f"w{i}-")})
                    b_status.append(("write", r.status_code))
                    if i % 10 == 0:
                        r = c.post("/v1/collections", json={"name": f"b-{i}", "dimension": DIM, "metric": "l2"})
                        b_status.append(("create", r.status_code))
                        made.append(f"b-{i}")
                        if len(made) > 3:  # a few at a time: B's own per-key limit (100) is not what is tested
                            r = c.delete(f"/v1/collections/{made.pop(0)}")
                            b_status.append(("drop", 200 if r.status_code == 204 else r.status_code))
                    most[0] = max(most[0], srv.open_files())
                    i += 1

        t = threading.Thread(target=tenant_b)
        t.start()
        built = {}
        with srv.client(headers=A) as c:
            for j in range(10):
                name = f"a-s{j}"
                r = c.post("/v1/collections", json={"name": name, "dimension": DIM, "metric": "l2", "shards": 4})
                assert r.status_code == 201, (name, r.status_code, r.text)
                body = "".join(json.dumps(d) + "\n" for d in _docs(200, seed=100 + j, prefix=f"{name}-"))
                r = c.post(f"/v1/collections/{name}/import", content=body,
                           headers={"content-type": "application/x-ndjson"})
                assert r.status_code == 202, (name, r.status_code, r.text)
                state = _wait_import(c, name, timeout=300)
                assert state["state"] == "done", (name, state)
                built[name] = answers(c, name)
                most[0] = max(most[0], srv.open_files())
        stop.set()
        t.join()
        with srv.client(headers=B) as c:
            assert c.post("/v1/collections/b-main/snapshots").status_code == 201
            r = c.post("/v1/collections", json={"name": "b-last", "dimension": DIM, "metric": "l2"})
            assert r.status_code == 201, r.text
        bad = [(what, s) for what, s in b_status if s not in (200, 201)]
        assert b_status and not bad, bad[:5]
        assert {what for what, _ in b_status} >= {"search", "write", "create"}
        assert most[0] <= 384 - 64 + 8, most[0]
        holding = _holding_files(srv, tmp_path / "data" / "collections")
        assert len({n for n in holding if n.startswith("a-s")}) <= 2, holding  # the others closed their shards
        with srv.client(headers=A) as c:
            for name, want in built.items():  # each one's shards were closed while idle, and opened again now
                assert answers(c, name) == want, name
                most[0] = max(most[0], srv.open_files())
        assert most[0] <= 384 - 64 + 8, most[0]
    finally:
        stop.set()
        srv.stop()


# -- imports: decided before the 202, never dropped in silence ---------------------------------------

def test_a_second_import_or_a_write_during_an_upload_is_refused_and_the_first_import_lands(tmp_path):
    """#48: two imports into one empty collection, or writes landing during a long upload, made the later import
    fail in its thread after its 202. Now the collection is claimed before the upload: both get 409 while it
    arrives, and the first import is done with its own documents."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo")
    try:
        srv.wait_ready()
        lines = [json.dumps(d) + "\n" for d in _docs(400, seed=2)]
        proceed = threading.Event()

        def body():
            yield "".join(lines[:200]).encode()
            proceed.wait(60)
            yield "".join(lines[200:]).encode()

        out = {}
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "c", "dimension": DIM, "metric": "l2"}).status_code == 201
            t = threading.Thread(target=lambda: out.update(r=c.post(
                "/v1/collections/c/import", content=body(), headers={"content-type": "application/x-ndjson"})))
            t.start()
            with srv.client() as other:
                deadline = time.monotonic() + 30
                while (other.get("/v1/collections/c").json()["build_state"]["import"] or {}).get(
                        "state") != "uploading":
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                second = other.post("/v1/collections/c/import", content="".join(lines[:5]),
                                    headers={"content-type": "application/x-ndjson"})
                write = other.post("/v1/collections/c/documents", json={"documents": _docs(1, prefix="w")})
            proceed.set()
            t.join()
            assert second.status_code == 409 and "already importing" in second.text
            assert write.status_code == 409 and "importing" in write.text
            assert out["r"].status_code == 202, out["r"].text
            state = _wait_import(c, "c")
            assert state["state"] == "done" and state["documents"] == 400
            assert c.get("/v1/collections/c").json()["count"] == 400
            assert c.post("/v1/collections/c/documents", json={"documents": _docs(1, prefix="w")}).status_code == 200
    finally:
        srv.stop()


def test_imports_that_fail_at_once_are_answered_and_recorded(tmp_path):
    """#48: a quick failure removed the upload's files before the 202 was built (500 for 20 of 81). 30 imports of
    a bad line (past the start that the service checks before its 202, #67): each answered 202 with its files'
    sizes, each recorded as failed with its reason, no server path in it; and a multipart body without its closing
    boundary is refused with 400."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo")
    try:
        srv.wait_ready()
        good = b"".join(json.dumps(d).encode() + b"\n" for d in _docs(400))
        assert len(good) > importer.CHECKED_BYTES
        bad = good + b'{"id": "x", "vector": [1, 2]}\n'
        with srv.client() as c:
            for i in range(30):
                assert c.post("/v1/collections", json={"name": f"c{i}", "dimension": DIM}).status_code == 201
                r = c.post(f"/v1/collections/c{i}/import", content=bad,
                           headers={"content-type": "application/x-ndjson"})
                assert r.status_code == 202 and r.json()["files"] == {"documents": len(bad)}, r.text
            for i in range(30):
                state = _wait_import(c, f"c{i}")
                assert state["state"] == "failed" and "line 401" in state["reason"], state
                assert str(srv.data_dir) not in json.dumps(state) and "/uploads/" not in state["reason"]
            # a truncated vector file, refused before the 202 (#67): named as the file, not where the server put it
            assert c.post("/v1/collections", json={"name": "v", "dimension": DIM}).status_code == 201
            r = c.post("/v1/collections/v/import", files={"vectors": ("v.fvecs", b"\x10\0\0\0" + b"\0" * 30)})
            assert r.status_code == 422 and "vectors.fvecs" in r.text and str(srv.data_dir) not in r.text, r.text
            assert c.get("/v1/collections/v").json()["build_state"]["import"] is None
            assert c.post("/v1/collections", json={"name": "m", "dimension": DIM}).status_code == 201
            cut = (b"--XyZ\r\nContent-Disposition: form-data; name=\"documents\"; filename=\"d.jsonl\"\r\n\r\n"
                   + json.dumps(_docs(1)[0]).encode() + b"\n")
            r = c.post("/v1/collections/m/import", content=cut,
                       headers={"content-type": "multipart/form-data; boundary=XyZ"})
            assert r.status_code == 400 and "closing boundary" in r.text, r.text
            assert c.get("/v1/collections/m").json()["build_state"]["import"] is None
    finally:
        srv.stop()


def test_a_sigkill_during_an_import_is_reported_and_its_staging_removed(tmp_path):
    """#48: a SIGKILL during an import left the staged vectors inside the collection for good and the info said
    nothing. Killed while the import builds: the next start removes the staging and the upload, reports the
    import as interrupted, and takes writes."""
    x = np.random.default_rng(3).standard_normal((60_000, 32)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    data = tmp_path / "data"
    srv = ServerProcess(data, tmp_path / "log", "--no-demo")
    try:
        srv.wait_ready()
        with srv.client() as c:
            assert c.post("/v1/collections", json={"name": "c", "dimension": 32, "metric": "l2"}).status_code == 201
            r = c.post("/v1/collections/c/import", files={"vectors": ("v.npy", buf.getvalue())})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 120
            while True:
                info = c.get("/v1/collections/c").json()["build_state"]
                state = (info["import"] or {}).get("state")
                if state == "running" and list((data / "collections" / "c").glob(".import-*")):
                    break
                assert state in ("uploading", "running") and time.monotonic() < deadline, info
                time.sleep(0.01)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
    finally:
        srv.stop()
    assert list((data / "collections" / "c").glob(".import-*"))  # what the kill left
    srv = ServerProcess(data, tmp_path / "log2", "--no-demo")
    try:
        srv.wait_ready()
        with srv.client() as c:
            state = c.get("/v1/collections/c").json()["build_state"]["import"]
            assert state["state"] == "interrupted" and "stopped during the import" in state["reason"], state
            assert not list((data / "collections" / "c").glob(".import-*"))
            assert not (data / "uploads").exists() or not list((data / "uploads").iterdir())
            assert c.post("/v1/collections/c/documents", json={"documents": [
                {"id": "after", "vector": [0.5] * 32}]}).status_code == 200
    finally:
        srv.stop()


# -- restore, snapshots and the disk -------------------------------------------------------------------

def test_restore_snapshots_and_imports_are_bounded_and_refused_before_writes_are(tmp_path):
    """A sparse 1.5 KB restore (#48: it wrote 2 GiB) gets 422 and writes nothing; a restored collection.json
    naming a local directory as its embedding gets 422 (as create does); snapshots stop at max_snapshots and at
    max_snapshot_bytes (409);
    listing during deletes never fails; and with the disk reserve above the free space, snapshots, imports and
    restores get 507 while upserts and searches go on."""
    data = tmp_path / "data"
    srv = ServerProcess(data, tmp_path / "log", "--no-demo", "--max-snapshots", "3", "--max-snapshot-bytes",
                        str(1 << 20))
    try:
        srv.wait_ready()
        with srv.client() as c:
            r = c.post("/v1/collections/x/restore", content=_sparse_archive())
            assert r.status_code == 422 and "sparse" in r.text, r.text
            assert quota.tree_bytes(data) < 4 << 20 and "x" not in [d["name"] for d in c.get("/v1/collections").json()[
                "collections"]]
            assert c.post("/v1/collections", json={"name": "c", "dimension": DIM, "metric": "l2"}).status_code == 201
            assert c.post("/v1/collections/c/documents", json={"documents": _docs(30)}).status_code == 200
            ids = [c.post("/v1/collections/c/snapshots").json()["id"] for _ in range(3)]
            r = c.post("/v1/collections/c/snapshots")
            assert r.status_code == 409 and "max_snapshots" in r.text
            archive = c.get(f"/v1/collections/c/snapshots/{ids[0]}").content
            assert c.post("/v1/collections", json={"name": "big", "dimension": DIM, "metric": "l2"}).status_code == 201
            for i in range(5):
                assert c.post("/v1/collections/big/documents", json={"documents": _docs(1000, seed=i, prefix=f"{i}-")}
                              ).status_code == 200
            r = c.post("/v1/collections/big/snapshots")
            assert r.status_code == 409 and "max_snapshot_bytes" in r.text, r.text
            model = tmp_path / "model"
            model.mkdir()
            (model / "modules.json").write_text("[]")
            assert c.post("/v1/collections/r/restore", content=_with_description(archive, embedding=str(model))
                          ).status_code == 422
            assert c.post("/v1/collections/r/restore", content=archive).status_code == 201
            # listing while snapshots are taken and deleted: never an error
            stop = threading.Event()
            listed = []

            def lister():
                with srv.client() as lc:
                    while not stop.is_set():
                        listed.append(lc.get("/v1/collections/c/snapshots").status_code)

            t = threading.Thread(target=lister)
            t.start()
            for _ in range(15):
                assert c.delete(f"/v1/collections/c/snapshots/{ids.pop(0)}").status_code == 200
                r = c.post("/v1/collections/c/snapshots")
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            stop.set()
            t.join()
            assert listed and set(listed) == {200}
    finally:
        srv.stop()
    reserve_mb = (quota.free_bytes(data) >> 20) + 1024
    srv = ServerProcess(data, tmp_path / "log2", "--no-demo", "--disk-reserve-mb", str(reserve_mb))
    try:
        srv.wait_ready()
        with srv.client() as c:
            r = c.post("/v1/collections/c/snapshots")
            assert r.status_code == 507 and "reserve" in r.text, r.text
            r = c.post("/v1/collections/r2/restore", content=archive)
            assert r.status_code == 507 and "reserve" in r.text, r.text
            assert c.post("/v1/collections", json={"name": "i", "dimension": DIM}).status_code == 201
            r = c.post("/v1/collections/i/import", content=b"".join(json.dumps(d).encode() + b"\n" for d in _docs(10)),
                       headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 507 and "reserve" in r.text, r.text
            assert c.get("/v1/collections/i").json()["build_state"]["import"] is None
            assert c.post("/v1/collections/c/documents", json={"documents": _docs(5, prefix="late")}).status_code == 200
            assert c.post("/v1/collections/c/search", json={"vectors": [[0.1] * DIM], "k": 3}).status_code == 200
            assert str(data) not in r.text
    finally:
        srv.stop()


def _with_description(archive: bytes, **change) -> bytes:
    """The archive with collection.json changed and snapshot.json declaring it (as a forger would)."""
    import hashlib

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    out, files = io.BytesIO(), {}
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m, data in members:
            if m.name == "snapshot.json":
                manifest = json.loads(data)
                continue
            if m.name == "collection.json":
                data = json.dumps({**json.loads(data), **change}).encode()
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
            files[m.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        data = json.dumps({**manifest, "files": files}).encode()
        info = tarfile.TarInfo("snapshot.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_what_a_crash_leaves_of_a_snapshot_is_removed_at_start(tmp_path):
    folder = tmp_path / "data" / "snapshots" / "c"
    folder.mkdir(parents=True)
    (folder / ".20261201T000000Z-0000abcd.tar.tmp").write_bytes(b"x" * 1000)
    (folder / ".20261201T000000Z-0000abcd.tar.docs.sqlite").write_bytes(b"x" * 1000)
    (folder / "20261201T000000Z-0000abcd.json").write_text("{}")
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo")
    try:
        srv.wait_ready()
        assert list(folder.iterdir()) == []
    finally:
        srv.stop()


# -- requests that take their time --------------------------------------------------------------------

def test_unfinished_heads_are_closed_and_stalled_bodies_refused(tmp_path):
    """No deadline let a client hold a connection with half a request head, or a body that stops, for ever."""
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo", "--header-timeout-s", "1",
                        "--body-timeout-s", "1")
    try:
        srv.wait_ready()
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            t0 = time.monotonic()
            assert s.recv(100) == b""  # closed by the server
            assert time.monotonic() - t0 < 8
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/collections HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"name\": ")  # the body stops
            answer = b""
            while chunk := s.recv(1000):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in answer, answer
        with srv.client() as c:  # a patient client that sends its request in time is unaffected
            assert c.get("/readyz").status_code == 200
    finally:
        srv.stop()


# -- one tenant doing all of it beside another -------------------------------------------------------------

def _small_disk(path: Path, size_mb: int):
    """A tmpfs of size_mb where mounting is allowed (root, as CI runs), else None."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True)
    return path if r.returncode == 0 else None


def test_a_tenant_that_creates_restores_imports_and_snapshots_in_a_loop_takes_nothing_from_another(tmp_path):
    """Tenant A, for 25 s: creates collections past its key's limit (dropping its oldest when refused), fills
    them, snapshots them past max_snapshots (deleting the oldest), restores them, imports a 6 MiB file into
    new ones, and sends a sparse archive; tenant B searches and writes throughout. On a 96 MiB disk (a tmpfs;
    a 96 MiB budget of the real disk where mounting is not allowed) with a 24 MiB reserve, 8 MiB of
    snapshots per collection and 256 descriptors: B gets no error at all, A hits every bound with a clear 4xx/507 and never a
    500, the server's descriptors stay under its limit, the snapshots within their bytes, the disk's free space
    never below what B's writes need."""
    disk = _small_disk(tmp_path / "disk", 96)
    root = disk or tmp_path / "disk"
    reserve_mb = 24 if disk else max(24, (quota.free_bytes(root) >> 20) - 72)
    srv = ServerProcess(root / "data", tmp_path / "log", "--no-demo", "--api-keys-file", str(_keys(tmp_path)),
                        "--max-collections-per-key", "8", "--max-snapshots", "2",
                        "--max-snapshot-bytes", str(8 << 20), "--disk-reserve-mb", str(reserve_mb),
                        "--descriptor-reserve", "64", "--buffer-mb", "4", nofile=256)
    stop = threading.Event()
    b_bad: list = []
    a_seen: dict[int, int] = {}
    lowest_free = [quota.free_bytes(root)]
    most_fds = [0]
    try:
        srv.wait_ready()
        with srv.client(headers=B) as c:
            r = c.post("/v1/collections", json={"name": "b-main", "dimension": DIM, "metric": "l2"})
            assert r.status_code == 201
            assert c.post("/v1/collections/b-main/documents", json={"documents": _docs(200)}).status_code == 200

        def tenant_b(seed):
            rng = np.random.default_rng(seed)
            with srv.client(headers=B) as c:
                i = 0
                while not stop.is_set():
                    try:
                        calls = [("search", lambda: c.post("/v1/collections/b-main/search", json={
                                     "vectors": rng.standard_normal((2, DIM)).tolist(), "k": 5})),
                                 ("text", lambda: c.post("/v1/collections/b-main/search", json={
                                     "texts": ["topic 3"], "mode": "text", "k": 5})),
                                 ("write", lambda: c.post("/v1/collections/b-main/documents", json={
                                     "documents": _docs(5, seed=i, prefix=f"s{seed}-{i}-")}))]
                        for what, call in calls:
                            r = call()
                            if r.status_code != 200:
                                b_bad.append((what, r.status_code, r.text[:200]))
                    except httpx.HTTPError as e:
                        b_bad.append(("connection", repr(e)))
                    i += 1

        def watch():
            while not stop.is_set():
                lowest_free[0] = min(lowest_free[0], quota.free_bytes(root))
                most_fds[0] = max(most_fds[0], srv.open_files())
                time.sleep(0.05)

        threads = [threading.Thread(target=tenant_b, args=(s,)) for s in (1, 2)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        lines = b"".join(json.dumps(d).encode() + b"\n" for d in _docs(5000, seed=9))  # ~1.5 MiB
        huge = bytes(80 << 20)
        sparse = _sparse_archive()
        mine: list[str] = []
        taken: list[tuple[str, str]] = []
        deadline = time.monotonic() + 25
        with srv.client(headers=A) as c:

            def note(r):
                a_seen[r.status_code] = a_seen.get(r.status_code, 0) + 1
                assert r.status_code < 500 or r.status_code == 507, (r.status_code, r.text)
                return r

            i = 0
            while time.monotonic() < deadline:
                name = f"a-{i}"
                r = note(c.post(f"/v1/collections/{name}-s/restore", content=sparse))
                assert r.status_code in (409, 422), r.text  # 409: no room for one more of A's collections
                r = note(c.post("/v1/collections", json={"name": name, "dimension": DIM, "metric": "l2"}))
                if r.status_code == 409:
                    note(c.delete(f"/v1/collections/{mine.pop(0)}"))
                    i += 1
                    continue
                mine.append(name)
                note(c.post(f"/v1/collections/{name}/documents", json={"documents": _docs(300, seed=i)}))
                for _ in range(3):
                    r = note(c.post(f"/v1/collections/{name}/snapshots"))
                    if r.status_code == 201:
                        taken.append((name, r.json()["id"]))
                    elif r.status_code == 409 and taken:  # its count, or the bytes of all: the oldest goes
                        note(c.delete("/v1/collections/{}/snapshots/{}".format(*taken.pop(0))))
                if taken:
                    archive = c.get("/v1/collections/{}/snapshots/{}".format(*taken[-1])).content
                    r = note(c.post(f"/v1/collections/{name}-r/restore", content=archive))
                    if r.status_code == 201:
                        mine.append(f"{name}-r")
                r = note(c.post("/v1/collections", json={"name": f"{name}-i", "dimension": DIM}))
                if r.status_code == 201:
                    mine.append(f"{name}-i")
                    if i % 2:  # an upload larger than the disk's room above the reserve
                        r = note(c.post(f"/v1/collections/{name}-i/import", files={"vectors": ("v.npy", huge)}))
                        assert r.status_code == 507, r.text
                    else:
                        note(c.post(f"/v1/collections/{name}-i/import", content=lines,
                                    headers={"content-type": "application/x-ndjson"}))
                i += 1
        stop.set()
        for t in threads:
            t.join()
        print("A saw", a_seen, "lowest free", lowest_free[0] >> 20, "MiB, fds", most_fds[0])
        assert not b_bad, b_bad[:5]
        assert a_seen.get(409) and a_seen.get(422) and a_seen.get(507) and a_seen.get(202), a_seen
        assert most_fds[0] < 256, most_fds[0]
        for folder in (root / "data" / "snapshots").iterdir():
            assert quota.tree_bytes(folder) <= 8 << 20, folder.name
        assert lowest_free[0] >= (reserve_mb - 1) << 20  # what B wrote into the reserve: far less than 1 MiB
        with srv.client(headers=B) as c:
            r = c.post("/v1/collections/b-main/snapshots")  # A's snapshots took nothing of B's allowance
            assert r.status_code == 201, r.text
    finally:
        stop.set()
        srv.stop()
        if disk:
            subprocess.run(["umount", "-l", str(disk)], check=False)


# -- the noisy neighbour of #66: sharded builds, large files and a hung embedding model -----------------------

class _HungEndpoint:
    """An OpenAI-compatible /v1/embeddings on 127.0.0.1 that answers the service's question of its dimension and
    never answers anything else (until stopped)."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        gone = self.gone = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if body["input"] != ["dimension"]:
                    gone.wait(120)
                    return
                raw = json.dumps({"data": [{"index": 0, "embedding": [0.1] * 384}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.gone.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _p99(seconds: list[float]) -> float:
    return float(np.percentile(np.asarray(seconds), 99))


def test_a_noisy_neighbour_with_sharded_builds_large_files_and_a_hung_model_leaves_another_tenant_served(tmp_path):
    """#66: tenant A builds 4-shard collections, adds a large file to its vector store (embedded by the service's
    model, a batch of chunks at a time) and searches a collection whose embedding endpoint never answers, while
    tenant B searches and writes its own collection. B, measured alone (8 s before A starts and 8 s after it ends,
    pooled) and beside A: no error at all, and its p99 beside A at most 2x its p99 alone (both measured here and
    printed); A never gets a 500, its
    hung model's searches get 503 at --embedding-timeout-s, and its file and builds complete. What kept B's tail
    past 2x on 2 cores (2.1-2.5x) was A's Python holding the service's GIL: the builds' (22% of the GIL's held
    time, py-spy --gil), now in a child process of their own (HostedSharded._build_in_child), and the file's
    tokenizer calls, each holding it throughout (18-35 ms a 50,000-character piece, now 4,000: file_chunks.PIECE).
    The ratio is of B beside A against B alone on the same machine: other work on the machine in one phase and
    not the other moves it (run it on a quiet one). A's first sharded build runs before B's measurements: a
    one-time cost (the service's first sharded index opened, the child's first imports)."""
    hung = _HungEndpoint()
    srv = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo", "--api-keys-file", str(_keys(tmp_path)),
                        "--embedding-models", f"hung={hung.url}#m", "--embedding-timeout-s", "3",
                        "--descriptor-reserve", "64", nofile=512)
    lat: dict[str, list[float]] = {"alone": [], "beside": []}
    b_bad: list = []
    a_status: dict[str, list[int]] = {}
    phase = ["alone"]
    stop = threading.Event()
    try:
        srv.wait_ready()
        with srv.client(headers=B) as c:
            assert c.post("/v1/collections", json={"name": "b-main", "dimension": DIM, "metric": "l2"}).status_code == 201
            assert c.post("/v1/collections/b-main/documents", json={"documents": _docs(400)}).status_code == 200

        def tenant_b(seed):
            rng = np.random.default_rng(seed)
            with srv.client(headers=B) as c:
                i = 0
                while not stop.is_set():
                    for what, call in (
                            ("search", lambda: c.post("/v1/collections/b-main/search", json={
                                "vectors": rng.standard_normal((1, DIM)).round(4).tolist(), "k": 5})),
                            ("write", lambda: c.post("/v1/collections/b-main/documents", json={
                                "documents": _docs(2, seed=1000 * seed + i, prefix=f"s{seed}-{i}-")}))):
                        t0 = time.perf_counter()
                        try:
                            r = call()
                        except httpx.HTTPError as e:
                            b_bad.append((what, repr(e)))
                            continue
                        if what == "search":
                            lat[phase[0]].append(time.perf_counter() - t0)
                        if r.status_code != 200:
                            b_bad.append((what, r.status_code, r.text[:200]))
                    i += 1

        b = [threading.Thread(target=tenant_b, args=(s,)) for s in (1, 2)]

        def note(kind: str, r: httpx.Response) -> httpx.Response:
            a_status.setdefault(kind, []).append(r.status_code)
            return r

        a_stop = threading.Event()

        def a_hung():  # text searches of a collection whose model never answers
            with srv.client(headers=A) as c:
                while not stop.is_set() and not a_stop.is_set():
                    note("hung", c.post("/v1/collections/a-hung/search", json={"texts": ["anything"], "k": 3}))

        def a_sharded(first=0, count=3):
            with srv.client(headers=A) as c:
                for j in range(first, first + count):
                    name = f"a-s{j}"
                    note("create", c.post("/v1/collections", json={"name": name, "dimension": DIM, "metric": "l2",
                                                                    "shards": 4}))
                    body = "".join(json.dumps(d) + "\n" for d in _docs(2000, seed=100 + j, prefix=f"{name}-"))
                    note("import", c.post(f"/v1/collections/{name}/import", content=body,
                                          headers={"content-type": "application/x-ndjson"}))
                    a_status.setdefault("built", []).append(_wait_import(c, name, timeout=300)["state"] == "done")

        a_sharded(first=10, count=1)  # the process's first build: see above
        for t in b:
            t.start()
        time.sleep(8)  # B alone
        with srv.client(headers=A) as c:
            assert c.post("/v1/collections", json={"name": "a-hung", "dimension": 384, "metric": "cosine",
                                                   "embedding": "hung"}).status_code == 201
            text = " ".join(f"Paragraph {i} of a long manual on topic {i % 13}, with words enough to chunk."
                            for i in range(6000)).encode()  # ~0.5 MB: hundreds of chunks to embed
            fid = note("upload", c.post("/v1/files", files={"file": ("manual.txt", text)},
                                        data={"purpose": "assistants"})).json()["id"]
            vs = note("store", c.post("/v1/vector_stores", json={"name": "a-store"})).json()["id"]
            phase[0] = "beside"
            a = [threading.Thread(target=a_hung), threading.Thread(target=a_sharded)]
            for t in a:
                t.start()
            note("add", c.post(f"/v1/vector_stores/{vs}/files", json={"file_id": fid}))
            deadline = time.monotonic() + 240
            status = "in_progress"
            while status == "in_progress" and time.monotonic() < deadline:
                time.sleep(0.5)
                status = c.get(f"/v1/vector_stores/{vs}/files/{fid}").json()["status"]
            a[1].join(300)
            a_stop.set()
            a[0].join(120)
            phase[0] = "alone"  # B alone again: its p99 alone from both sides of A's work, so that drift of the
            time.sleep(8)  # machine over the run falls on both phases alike
            stop.set()
            for t in b:
                t.join(120)
        alone, beside = _p99(lat["alone"]), _p99(lat["beside"])
        print(f"tenant B: {len(lat['alone'])} searches alone, p99 {alone * 1e3:.1f} ms; {len(lat['beside'])} "
              f"beside A, p99 {beside * 1e3:.1f} ms ({beside / alone:.2f}x); A: "
              f"{ {k: sorted(set(v)) for k, v in a_status.items()} }")
        assert not b_bad, b_bad[:5]
        assert status == "completed" and all(a_status["built"]) and len(a_status["built"]) == 4, (status, a_status)
        assert set(a_status["hung"]) == {503}, a_status["hung"]
        assert all(s < 500 for k, v in a_status.items() if k not in ("hung", "built") for s in v), a_status
        assert len(lat["alone"]) > 50 and len(lat["beside"]) > 50
        assert beside <= 2 * alone, (alone, beside)  # a hung model in B's way would be 3 s, not 2x
    finally:
        stop.set()
        srv.stop()
        hung.stop()
