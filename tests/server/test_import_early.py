"""#67 item 4, imports that failed late: the service answered 202 to a gzipped body, or to JSON lines with an unknown
key, and the import failed only when polled ("not JSON ('utf-8' codec can't decode byte 0x8b ...)"). Now the start of
an upload is checked before the 202, by the importer's own checks of a line (retriever/collection/importer.py), and
refused at once with the line and the problem, nothing written to the collection and the upload removed; a gzip body
(Content-Encoding: gzip) or part (a file name ending in .gz) is decompressed as it arrives, a corrupt one refused
with 400, and its decompressed size bounded (an inflation past 200-fold, max_upload_bytes, the disk reserve). The
real service (`python -m fusionrag serve`) over HTTP."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_util import ServerProcess

from fusionrag.retriever.collection import quota

DIM = 16
MiB = 1 << 20
NDJSON = {"content-type": "application/x-ndjson"}
GZIP = {**NDJSON, "content-encoding": "gzip"}


def _docs(n: int, seed: int = 0, prefix: str = "d") -> list[dict]:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).round(4)
    return [{"id": f"{prefix}{i}", "text": f"paragraph {i} on topic {i % 7}", "metadata": {"n": i, "topic": i % 7},
             "vector": v.tolist()} for i, v in enumerate(x)]


def _jsonl(docs: list[dict]) -> bytes:
    return b"".join(json.dumps(d).encode() + b"\n" for d in docs)


def _deflate(blocks, level: int = 9) -> bytes:
    """The gzip of the blocks' bytes, compressed a block at a time (never all of them in memory)."""
    z = zlib.compressobj(level, zlib.DEFLATED, 31)
    return b"".join([z.compress(b) for b in blocks] + [z.flush()])


def _bomb(size: int = 200 * MiB) -> bytes:
    """200 MB of zeros, gzipped: about 200 KB."""
    zeros = bytes(MiB)
    return _deflate(zeros for _ in range(size // MiB))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("import-early")
    s = ServerProcess(tmp / "data", tmp / "log", "--no-demo")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture
def c(srv):
    with srv.client() as client:
        yield client


_names = iter(range(10 ** 6))


def _create(c: httpx.Client, dim: int = DIM) -> str:
    name = f"c{next(_names)}"
    r = c.post("/v1/collections", json={"name": name, "dimension": dim, "metric": "l2"})
    assert r.status_code == 201, r.text
    return name


def _wait_import(c: httpx.Client, name: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = c.get(f"/v1/collections/{name}").json()["build_state"]["import"]
        if state and state["state"] not in ("uploading", "running"):
            return state
        time.sleep(0.05)
    raise AssertionError(f"the import into {name} did not end")


def _imported_exactly(c: httpx.Client, name: str, docs: list[dict]) -> None:
    """Every document is in, and a few hold exactly what was sent: text, metadata, vector."""
    state = _wait_import(c, name)
    assert state["state"] == "done" and state["documents"] == len(docs), state
    assert c.get(f"/v1/collections/{name}").json()["count"] == len(docs)
    some = [docs[0], docs[len(docs) // 2], docs[-1]]
    r = c.post(f"/v1/collections/{name}/documents/get", json={"ids": [d["id"] for d in some], "with_vectors": True})
    assert r.status_code == 200, r.text
    got = r.json()["documents"]
    assert [d["id"] for d in got] == [d["id"] for d in some]
    for g, want in zip(got, some):
        assert g["text"] == want["text"] and g["metadata"] == want["metadata"]
        assert np.array_equal(np.float32(g["vector"]), np.float32(want["vector"]))
    q = docs[123]
    r = c.post(f"/v1/collections/{name}/search", json={"vectors": [q["vector"]], "k": 1})
    assert r.status_code == 200 and r.json()["results"][0][0]["id"] == q["id"], r.text


def _refused(srv: ServerProcess, c: httpx.Client, name: str, r: httpx.Response, status: int | tuple,
             *words: str) -> None:
    """r is a refusal (never a 202) whose message names the problem; the collection is as it was (empty, no
    import recorded) and the upload's files are gone; and it takes an import still."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text)
    detail = r.json()["detail"]
    for w in words:
        assert w in detail, (w, detail)
    assert str(srv.data_dir) not in detail
    info = c.get(f"/v1/collections/{name}").json()
    assert info["count"] == 0 and info["build_state"]["import"] is None, info
    uploads = srv.data_dir / "uploads"
    assert not (uploads.exists() and list(uploads.iterdir())), list(uploads.iterdir())
    assert not [p for p in (srv.data_dir / "collections" / name).iterdir() if p.name.startswith(".import")]
    docs = _docs(3, prefix="after")
    r = c.post(f"/v1/collections/{name}/import", content=_jsonl(docs), headers=NDJSON)
    assert r.status_code == 202, r.text
    assert _wait_import(c, name)["state"] == "done" and c.get(f"/v1/collections/{name}").json()["count"] == 3


# -- gzip accepted --------------------------------------------------------------------------------------------

def test_a_gzip_body_is_imported_whole(srv, c):
    """Content-Encoding: gzip on a JSON-lines body: decompressed as it arrives, every document imported as sent."""
    docs = _docs(1000, seed=1)
    body = gzip.compress(_jsonl(docs))
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=body, headers=GZIP)
    assert r.status_code == 202, r.text
    assert r.json()["files"] == {"documents": len(_jsonl(docs))}  # what it took, decompressed
    _imported_exactly(c, name, docs)


def test_gz_parts_are_imported_whole(srv, c):
    """Multipart parts whose file names end in .gz: JSON lines, and a vector file with its JSON-lines sidecar (as
    several gzip members, as pigz or `cat a.gz b.gz` write them)."""
    docs = _docs(1000, seed=2)
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"documents": ("docs.jsonl.gz", gzip.compress(_jsonl(docs)))})
    assert r.status_code == 202, r.text
    _imported_exactly(c, name, docs)

    buf = io.BytesIO()
    np.save(buf, np.float32([d["vector"] for d in docs]))
    side = _jsonl([{k: v for k, v in d.items() if k != "vector"} for d in docs])
    two_members = gzip.compress(side[:5000]) + gzip.compress(side[5000:])
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"vectors": ("base.npy.gz", gzip.compress(buf.getvalue())),
                                                        "documents": ("meta.jsonl.gz", two_members)})
    assert r.status_code == 202, r.text
    assert r.json()["files"] == {"vectors": len(buf.getvalue()), "documents": len(side)}
    _imported_exactly(c, name, docs)


def test_the_client_sends_a_gz_file_gzipped_and_raises_a_refusal(srv, tmp_path):
    """Client.import_documents of docs.jsonl.gz sends it with Content-Encoding: gzip; a refused one raises
    InputError naming the line, at once."""
    from fusionrag.client import Client
    from fusionrag.retriever.errors import InputError

    docs = _docs(300, seed=7)
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(gzip.compress(_jsonl(docs)))
    with Client(srv.url) as client, srv.client() as c:
        name = _create(c)
        assert client.import_documents(name, path)["files"] == {"documents": len(_jsonl(docs))}
        _imported_exactly(c, name, docs)
        docs[9]["colour"] = "red"
        path.write_bytes(gzip.compress(_jsonl(docs)))
        name = _create(c)
        with pytest.raises(InputError, match="documents line 10: unknown key 'colour'"):
            client.import_documents(name, path)
        assert c.get(f"/v1/collections/{name}").json()["build_state"]["import"] is None


# -- refused before the 202, naming the problem ---------------------------------------------------------------

def test_an_unknown_key_is_refused_at_once(srv, c):
    docs = _docs(50, seed=3)
    docs[2]["colour"] = "red"
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=_jsonl(docs), headers=NDJSON)
    _refused(srv, c, name, r, 422, "documents line 3", "unknown key 'colour'")
    docs[2].pop("colour")  # gzipped, and in a .gz part: the same check, on the decompressed lines
    docs[4]["colour"] = "red"
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=gzip.compress(_jsonl(docs)), headers=GZIP)
    _refused(srv, c, name, r, 422, "documents line 5", "unknown key 'colour'")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"documents": ("d.jsonl.gz", gzip.compress(_jsonl(docs)))})
    _refused(srv, c, name, r, 422, "documents line 5", "unknown key 'colour'")
    docs[4].pop("colour")  # a first line longer than the 64 KiB checked: read whole
    docs[0].update(text="long " * 40_000, colour="red")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=_jsonl(docs), headers=NDJSON)
    _refused(srv, c, name, r, 422, "documents line 1", "unknown key 'colour'")


def test_a_body_not_utf8_is_refused_at_once(srv, c):
    """Latin-1 in a text, and the issue's own case: a gzipped file sent as JSON lines without its encoding."""
    lines = _jsonl(_docs(5, seed=4)).splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"paragraph 1', b'"caf\xe9 1')
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=b"".join(lines), headers=NDJSON)
    _refused(srv, c, name, r, 422, "documents line 2", "not UTF-8", "0xe9")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=gzip.compress(_jsonl(_docs(50))), headers=NDJSON)
    _refused(srv, c, name, r, 422, "documents line 1", "not UTF-8", "gzip")


def test_lines_the_importer_would_refuse_are_refused_at_once(srv, c):
    """Not JSON, not an object, a vector of the wrong dimension, neither text nor vector, no model to embed a text,
    a vector not finite; a vector file of the wrong dimension, or a sidecar line with its own vector."""
    good = _docs(10, seed=5)
    for number, line, words in (
            (4, b"{not json", ("documents line 4", "not JSON")),
            (2, b'["a", "list"]', ("documents line 2", "object")),
            (3, json.dumps({"id": "x", "vector": [1.0, 2.0]}).encode(), ("documents line 3", f"{DIM} numbers")),
            (5, b'{"id": "x"}', ("documents line 5", "a text, a vector, or both")),
            (6, b'{"id": "x", "text": "no vector"}', ("no embedding model", "line 6")),
            (7, json.dumps({"id": "x", "vector": [1e30] * DIM}).encode(), ("documents line 7", "squared norm")),
            (2, b'{"id": "", "vector": ' + json.dumps([0.0] * DIM).encode() + b"}", ("documents line 2", "id"))):
        lines = _jsonl(good).splitlines(keepends=True)
        lines[number - 1] = line + b"\n"
        name = _create(c)
        r = c.post(f"/v1/collections/{name}/import", content=b"".join(lines), headers=NDJSON)
        _refused(srv, c, name, r, 422, *words)
    buf = io.BytesIO()
    np.save(buf, np.zeros((10, 8), np.float32))
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"vectors": ("v.npy", buf.getvalue())})
    _refused(srv, c, name, r, 422, "vectors: dimension 8", f"dimension {DIM}")
    buf = io.BytesIO()
    np.save(buf, np.float32([d["vector"] for d in good]))
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"vectors": ("v.npy", buf.getvalue()),
                                                        "documents": ("d.jsonl", _jsonl(good))})
    _refused(srv, c, name, r, 422, "documents line 1", "vectors come from it")
    name = _create(c)  # a truncated vector file: its header says more than it holds
    r = c.post(f"/v1/collections/{name}/import", files={"vectors": ("v.fvecs", b"\x10\0\0\0" + b"\0" * 30)})
    _refused(srv, c, name, r, 422, "v")


def test_a_corrupt_or_cut_gzip_is_refused_at_once(srv, c):
    body = gzip.compress(_jsonl(_docs(2000, seed=6)))
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=body[:len(body) // 2], headers=GZIP)
    _refused(srv, c, name, r, 400, "gzip", "cut short")
    bad = bytearray(body)
    bad[len(bad) // 3: len(bad) // 3 + 64] = bytes(64)  # zeros in the middle of the deflate stream
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=bytes(bad), headers=GZIP)
    _refused(srv, c, name, r, 400, "gzip", "not a valid")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=b"this is not gzip\n", headers=GZIP)
    _refused(srv, c, name, r, 400, "gzip", "not a valid")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"documents": ("d.jsonl.gz", body[:len(body) // 2])})
    _refused(srv, c, name, r, 400, "'documents'", "d.jsonl.gz", "cut short")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=body, headers={**NDJSON, "content-encoding": "br"})
    _refused(srv, c, name, r, 415, "br", "gzip")


def test_a_gzip_bomb_is_refused_at_once(srv, c):
    """200 MB of zeros in 200 KB of gzip: refused with 413 as soon as it inflates past 200-fold (after its first
    16 MiB), as a body and as a part; nothing of it is left on the disk."""
    bomb = _bomb()
    assert len(bomb) < 400_000
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", content=bomb, headers=GZIP)
    _refused(srv, c, name, r, 413, "inflates", "200-fold")
    name = _create(c)
    r = c.post(f"/v1/collections/{name}/import", files={"documents": ("docs.jsonl.gz", bomb)})
    _refused(srv, c, name, r, 413, "inflates", "200-fold", "'documents'")


def test_a_gzip_body_is_bounded_by_max_upload_bytes_decompressed(tmp_path):
    """max_upload_bytes bounds the bytes on the wire and, for gzip, the bytes they decompress to: 3 MiB of JSON
    lines in about 0.4 MiB of gzip, under a limit of 1 MiB, are refused with 413 naming the limit."""
    docs = [{"id": f"d{i}", "text": f"paragraph {i} on topic {i % 7}"} for i in range(60_000)]
    body = gzip.compress(_jsonl(docs))
    assert len(_jsonl(docs)) > 3 * MiB and len(body) < MiB // 2
    s = ServerProcess(tmp_path / "data", tmp_path / "log", "--no-demo", "--max-upload-bytes", str(MiB))
    try:
        s.wait_ready()
        with s.client() as c:
            name = _create(c)
            r = c.post(f"/v1/collections/{name}/import", content=body, headers=GZIP)
            _refused(s, c, name, r, 413, "decompressed", "max_upload_bytes")
    finally:
        s.stop()


def _small_disk(path: Path, size_mb: int):
    """A tmpfs of size_mb where mounting is allowed (root, as CI runs), else None."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True)
    return path if r.returncode == 0 else None


def test_a_gzip_body_claims_its_decompressed_bytes_from_the_disk(tmp_path):
    """32 MiB free above the disk reserve, and a gzip body of 3.3 MiB that decompresses to 128 MiB (about 40-fold,
    under the bomb bound): refused with 507 naming the reserve once its decompressed bytes reach it (before: the
    3.3 MiB were all it claimed)."""
    disk = _small_disk(tmp_path / "disk", 256)
    root = disk or tmp_path / "disk"
    try:
        srv = ServerProcess(root / "data", tmp_path / "log0", "--no-demo")
        srv.wait_ready()
        srv.stop()
        reserve = quota.free_bytes(root) - 32 * MiB
        srv = ServerProcess(root / "data", tmp_path / "log", "--no-demo", "--disk-reserve-mb", f"{reserve / MiB:.6f}")
        try:
            srv.wait_ready()
            body = _deflate((os.urandom(1024) + bytes(49 * 1024) for _ in range(128 * MiB // (50 * 1024))), 1)
            assert len(body) < 4 * MiB
            with srv.client() as c:
                name = _create(c)
                r = c.post(f"/v1/collections/{name}/import", content=body, headers=GZIP)
                _refused(srv, c, name, r, 507, "reserve")
        finally:
            srv.stop()
    finally:
        if disk:
            subprocess.run(["umount", "-l", str(disk)], check=False)
