"""A build killed with SIGKILL resumes from its last finished step (#51), and a half-built index is never taken for a
whole one.

Each kill is a real SIGKILL of a build in its own process, sent from inside a step (its progress callback, once the
step has done some of its work); the rerun's index is compared file by file (sizes and SHA-256 from the manifests,
the page file through its block CRCs) with an uninterrupted build of the same source and settings, on one thread so
that the graph is the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fusionrag.retriever.engine.build import build_index
from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.engine.index import Index
from fusionrag.retriever.engine.manifest import BUILD_STATE, ResumableWriter, read_manifest
from fusionrag.retriever.errors import ConflictError, IndexFormatError, InputError

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from fusionrag.retriever.engine.build import build_index
    from fusionrag.retriever.engine.config import BuildConfig
    source, out, kill_at, config = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    def on_progress(step, done, total):
        if step == kill_at and done > 0:
            os.kill(os.getpid(), signal.SIGKILL)
    build_index(source, out, BuildConfig(**config), progress=False, on_progress=on_progress)
""")

STEPS = ["clustering", "graph", "pq training", "assigning", "pages"]  # as the build records them


def data(path: Path, n: int = 12000, dim: int = 24, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(40, dim)) * 3
    x = (centres[rng.integers(0, len(centres), n)] + rng.normal(size=(n, dim))).astype(np.float32)
    np.save(path, x)
    return path


def killed_build(source: Path, out: Path, kill_at: str, **config) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(source), str(out), kill_at,
                           json.dumps({"threads": 1, **config})], capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


def partial_of(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def same_index(a: Path, b: Path) -> None:
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma["files"] == mb["files"]  # every file's size and hash (vectors.pages: its size; its CRCs are hashed)
    for key in ("count", "centroids", "postings", "pq", "pages", "storage_dtype", "list_navigation",
                "search_defaults", "search_defaults_ram"):
        assert ma.get(key) == mb.get(key), key


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted builds the resumed ones are compared with, by metric."""
    root = tmp_path_factory.mktemp("whole")
    source = data(root / "x.npy")
    built = {}
    for metric in ("l2", "ip"):
        out = root / f"whole-{metric}"
        build_index(str(source), out, BuildConfig(threads=1, metric=metric), progress=False)
        built[metric] = out
    return source, built


@pytest.mark.parametrize("kill_at, metric", [("graph", "ip"), ("assigning", "l2"), ("ordering pages", "l2"),
                                             ("calibrating", "ip")])
def test_a_build_killed_in_a_step_resumes_after_the_last_one_it_finished(tmp_path, whole, kill_at, metric):
    source, built = whole
    out = tmp_path / "index"
    killed_build(source, out, kill_at, metric=metric)
    # Half built: nothing at the target's name, the partial directory beside it not an index.
    assert not out.exists()
    with pytest.raises(IndexFormatError):
        Index.open(out)
    state = json.loads((partial_of(out) / BUILD_STATE).read_text())
    finished = {"graph": 1, "assigning": 3, "ordering pages": 4, "calibrating": 5}[kill_at]
    assert list(state["steps"]) == STEPS[:finished]

    seen: list[str] = []
    m = build_index(str(source), out, BuildConfig(threads=1, metric=metric, memory_budget_bytes=40 << 20),
                    progress=False, on_progress=lambda step, done, total: seen.append(step))
    assert m["build_resumed"] == STEPS[:finished]
    ran = set(seen)
    assert not ran & set(STEPS[:finished]) - {"pages"}  # the finished steps were read back, not run again
    if finished < 5:
        assert {"ordering pages", "writing pages"} <= ran
    assert "calibrating" in ran
    assert not partial_of(out).exists()
    same_index(out, built[metric])
    index = Index.open(out)
    try:  # and it answers as an index (a row's nearest neighbour by l2 is itself)
        ids = index.search(np.load(source)[:50], 1).ids[:, 0]
        assert (ids >= 0).all() and (metric != "l2" or (ids == np.arange(50)).mean() >= 0.9)
    finally:
        index.close()


def test_another_source_or_other_settings_start_over_and_no_resume_starts_over(tmp_path, whole):
    source, built = whole
    out = tmp_path / "index"
    killed_build(source, out, "assigning")
    # Other settings: the killed build's steps are not used, and what it left is cleared.
    m = build_index(str(source), out, BuildConfig(threads=1, centroid_ratio=0.05), progress=False)
    assert "build_resumed" not in m and m["centroids"] != read_manifest(built["l2"])["centroids"]

    out2 = tmp_path / "index2"
    killed_build(source, out2, "ordering pages")
    copy = tmp_path / "y.npy"
    np.save(copy, np.load(source))
    os.utime(source, ns=(os.stat(copy).st_mtime_ns,) * 2)  # the same file's content, rewritten: another source
    m = build_index(str(source), out2, BuildConfig(threads=1), progress=False)
    assert "build_resumed" not in m
    same_index(out2, built["l2"])

    out3 = tmp_path / "index3"
    killed_build(source, out3, "ordering pages")
    cli = subprocess.run([sys.executable, "-m", "fusionrag", "build", str(source), str(out3), "--quiet",
                          "--no-resume", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout.splitlines()[-1])["resumed_after"] == []
    same_index(out3, built["l2"])


def test_the_cli_resumes_by_default_and_says_after_which_steps(tmp_path, whole):
    source, built = whole
    out = tmp_path / "index"
    killed_build(source, out, "pq training")
    cli = subprocess.run([sys.executable, "-m", "fusionrag", "build", str(source), str(out), "--quiet",
                          "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout.splitlines()[-1])["resumed_after"] == ["clustering", "graph"]
    same_index(out, built["l2"])


def test_a_second_build_of_the_same_target_is_refused_while_one_runs(tmp_path, whole):
    source, _ = whole
    out = tmp_path / "index"
    running = ResumableWriter(out, False, {"a": 1})  # holds the partial directory's lock as a running build does
    try:
        with pytest.raises(ConflictError, match="another process is building"):
            build_index(str(source), out, BuildConfig(threads=1), progress=False)
        assert partial_of(out).is_dir()  # the running build's directory is left alone
    finally:
        running.release()
    m = build_index(str(source), out, BuildConfig(threads=1, calibrate=False), progress=False)
    assert "build_resumed" not in m and not partial_of(out).exists()


def test_a_build_that_fails_on_its_input_leaves_nothing(tmp_path):
    x = np.load(data(tmp_path / "x.npy"))
    x[7000, 3] = np.nan
    np.save(tmp_path / "bad.npy", x)
    out = tmp_path / "index"
    with pytest.raises(InputError):
        build_index(str(tmp_path / "bad.npy"), out, BuildConfig(threads=1), progress=False)
    assert not out.exists() and not partial_of(out).exists()
