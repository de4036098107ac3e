"""The CLI contract other work relies on: build, search --out, the JSON line, recall, errors."""

import json
import subprocess
import sys

import numpy as np
from conftest import clustered, exact_knn

from fusionrag.retriever.engine.vectors import write_bin, write_vecs


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "fusionrag", *map(str, args)], capture_output=True, text=True)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_build_search_recall(tmp_path):
    base = clustered(4000, 16, 40, seed=11)
    queries = clustered(64, 16, 40, seed=12)
    write_bin(tmp_path / "base.fbin", base)
    write_bin(tmp_path / "q.fbin", queries)
    write_vecs(tmp_path / "gt.ivecs", exact_knn(base, queries, 10).astype(np.int32))
    built = json.loads(run("build", tmp_path / "base.fbin", tmp_path / "idx", "--metric", "l2", "--quiet").stdout)
    assert built["count"] == 4000 and built["dim"] == 16 and built["centroids"] > 100
    out = run("search", tmp_path / "idx", tmp_path / "q.fbin", "--k", "10", "--out", tmp_path / "ids.npy",
              "--groundtruth", tmp_path / "gt.ivecs", "--nprobe", "32", "--rerank", "100").stdout.strip().splitlines()
    assert len(out) == 1
    report = json.loads(out[0])
    ids = np.load(tmp_path / "ids.npy")
    assert ids.dtype == np.int64 and ids.shape == (64, 10)
    assert report["queries"] == 64 and report["qps"] > 0
    assert report["params"]["nprobe"] == 32 and report["params"]["rerank"] == 100
    assert report["recall@10"] >= 0.9
    # 4000 x 16 float32 fit the default budget: re-ranked from RAM (raw_in_ram 'auto'), no page read
    assert report["raw_in_ram"] and report["stats"]["reranked"] >= 64 * 10 and report["stats"]["pages_read"] == 0
    assert report["stats"]["unique_candidates"] <= report["stats"]["candidates"]
    assert report["io_backend"] in ("io_uring", "pread")
    flt = json.loads(run("search", tmp_path / "idx", tmp_path / "q.fbin", "--k", "10", "--out", tmp_path / "ids.npy",
                         "--groundtruth", tmp_path / "gt.ivecs", "--nprobe", "32", "--rerank", "100",
                         "--no-graph-sq8").stdout)
    assert flt["recall@10"] >= 0.9 and flt["memory"]["host_index_bytes"] > report["memory"]["host_index_bytes"]
    info = json.loads(run("info", tmp_path / "idx").stdout)
    assert info["count"] == 4000 and info["memory"]["pq_bytes"] > 0


def test_errors_are_messages_not_tracebacks(tmp_path):
    base = clustered(300, 8, 4)
    write_bin(tmp_path / "base.fbin", base)
    run("build", tmp_path / "base.fbin", tmp_path / "idx", "--quiet")
    write_bin(tmp_path / "q.fbin", clustered(5, 9, 4))
    p = run("search", tmp_path / "idx", tmp_path / "q.fbin", "--k", "10", "--out", tmp_path / "o.npy", check=False)
    assert p.returncode == 2 and "dimension 9, the index has dimension 8" in p.stderr and "Traceback" not in p.stderr
    p = run("search", tmp_path / "idx", tmp_path / "q.fbin", "--out", tmp_path / "o.npy", "--rerank-inflight", "0",
            check=False)
    assert p.returncode == 2 and "rerank_inflight must be in [1, 1024]" in p.stderr
    p = run("search", tmp_path / "nowhere", tmp_path / "q.fbin", "--out", tmp_path / "o.npy", check=False)
    assert p.returncode == 2 and "no such index directory" in p.stderr
    p = run("build", tmp_path / "base.fbin", tmp_path / "idx", "--quiet", check=False)
    assert p.returncode == 2 and "already exists" in p.stderr
    p = run("build", tmp_path / "base.fbin", tmp_path / "idx2", "--centroid-ratio", "7", check=False)
    assert p.returncode == 2 and "centroid_ratio" in p.stderr


def test_serve_refuses_a_bad_setting_from_any_source_before_starting(tmp_path):
    """flags > FUSIONRAG_* > the TOML file: the one that gave the bad value is named, with the setting's range."""
    import os

    (tmp_path / "bad.toml").write_text("max_k = 0\n")
    cases = [(["--max-k", "0"], {}, "--max-k: max_k must be in [1, 100000], got 0"),
             ([], {"FUSIONRAG_MAX_K": "0"}, "FUSIONRAG_MAX_K: max_k must be in [1, 100000], got 0"),
             (["--config", tmp_path / "bad.toml"], {}, f"config file {tmp_path / 'bad.toml'}: max_k must be in"),
             (["--config", tmp_path / "bad.toml", "--max-k", "5"], {"FUSIONRAG_SEARCH_THREADS": "99"},
              "FUSIONRAG_SEARCH_THREADS: search_threads must be in [1, 64], got 99")]
    for argv, env, message in cases:
        p = subprocess.run([sys.executable, "-m", "fusionrag", "serve", "--data-dir", str(tmp_path / "data"),
                            *map(str, argv)], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "data").exists()


def test_serve_ray_gives_the_users_settings_to_the_ray_service(tmp_path, monkeypatch):
    """The limits given to `serve --ray` (flags, environment, file) reach ray_serve.serve, whose every router
    replica builds the service's app from that config; they were dropped here before."""
    import fusionrag.server.ray_serve as ray_serve
    from fusionrag.cli import main

    seen = {}
    monkeypatch.setattr(ray_serve, "serve", lambda *a, **kw: seen.update(args=a, **kw))
    monkeypatch.setenv("FUSIONRAG_MAX_DOCUMENTS", "9")
    assert main(["serve", "--ray", "127.0.0.1:1", "--index", str(tmp_path), "--max-k", "7",
                 "--max-queries", "3"]) == 0
    config = seen["config"]
    assert (config.max_k, config.max_queries, config.max_documents) == (7, 3, 9)


def test_serve_ray_needs_a_sharded_index_and_says_so(tmp_path):
    """`serve --ray` serves a sharded index: without --index, with an index that is not sharded, or with --index
    but no --ray, the command stops with a message, before any Ray connection or service starts."""
    base = clustered(300, 8, 4)
    write_bin(tmp_path / "base.fbin", base)
    run("build", tmp_path / "base.fbin", tmp_path / "idx", "--quiet")
    cases = [(["--ray", "127.0.0.1:1"], "serve --ray needs --index"),
             (["--ray", "127.0.0.1:1", "--index", tmp_path / "idx"], "not a sharded index (build it with --shards)"),
             (["--ray", "127.0.0.1:1", "--index", tmp_path / "idx", "--routers", "0"],
              "routers must be a positive integer, got 0"),
             (["--index", tmp_path / "idx"], "--index, --name, --routers and --proxy-location go with --ray")]
    for argv, message in cases:
        p = run("serve", "--data-dir", tmp_path / "data", *argv, check=False)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "data").exists()
