"""Progress of long steps: bars on a terminal (a real pseudo-terminal) and nowhere else unless asked for, and a
running merge's step in the collection's info."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import clustered
from terminal import run_on_terminal

from fusionrag.retriever.collection import Catalog, CollectionConfig, Document
from fusionrag.retriever.engine.pq import auto_m

BUILD_STEPS = ["clustering", "graph", "pq training", "assigning", "ordering pages", "writing pages", "calibrating"]
MERGE_STEPS = ["assigning", "copying pages", "splitting lists", "pq encoding", "calibrating"]
DIM = 32


def _build(tmp_path, *flags: str, terminal: bool) -> str:
    """`fusionrag build` with stderr on a terminal (a pty of 120 columns) or a pipe; what it wrote there."""
    src = tmp_path / "base.npy"
    if not src.exists():
        np.save(src, clustered(6000, DIM, 30))
    argv = [sys.executable, "-m", "fusionrag", "build", str(src), str(tmp_path / "idx"), "--overwrite", *flags]
    if not terminal:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        return run.stderr
    status, shown = run_on_terminal(argv)
    assert status == 0, shown[-2000:]
    return shown


def test_build_draws_a_bar_per_step_on_a_terminal_only(tmp_path):
    shown = _build(tmp_path, terminal=True)
    for step in BUILD_STEPS:
        assert f"{step}:" in shown, (step, shown[-2000:])
    assert "100%|" in shown  # tqdm's bar, finished
    assert _build(tmp_path, terminal=False) == ""  # a log, a pipe: no bars
    quiet = _build(tmp_path, "--quiet", terminal=True)
    assert not any(f"{step}:" in quiet for step in BUILD_STEPS)


def _watch_merge(col) -> list[dict]:
    """Run a merge in a thread and read the collection's info meanwhile: each new progress seen, in order."""
    merging = threading.Thread(target=col.merge)
    seen: list[dict] = []
    merging.start()
    while merging.is_alive():
        p = col.info()["build_state"]["progress"]
        if p is not None and (not seen or p != seen[-1]):
            seen.append(p)
    merging.join()
    assert col.info()["build_state"]["progress"] is None  # none once the merge is done
    return seen


def _check_steps(seen: list[dict], expected_order: list[str]) -> list[str]:
    steps = list(dict.fromkeys(p["step"] for p in seen))
    assert steps == [s for s in expected_order if s in steps], steps  # in the order they run
    for step in steps:
        ps = [p for p in seen if p["step"] == step]
        assert all(0 <= p["done"] <= p["total"] and p["total"] == ps[0]["total"] for p in ps), ps
        assert [p["done"] for p in ps] == sorted(p["done"] for p in ps), ps  # it only advances
    return steps


def test_a_merge_shows_its_step_in_the_collection_info(tmp_path):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False, min_index_count=100))
    try:
        col = cat.create("c", DIM, "l2")
        x = clustered(12000, DIM, 40, seed=3)
        col.upsert([Document(str(i), None, v) for i, v in enumerate(x[:9000])])
        seen = _watch_merge(col)  # the first merge builds the index
        steps = _check_steps(seen, BUILD_STEPS)
        assert "pq training" in steps
        assert {p["total"] for p in seen if p["step"] == "pq training"} == {auto_m(DIM)}
        col.upsert([Document(str(i), None, v) for i, v in enumerate(x[9000:], 9000)])
        seen = _watch_merge(col)  # the next one folds the new vectors in, and calibrates (1.33x the rows)
        steps = _check_steps(seen, MERGE_STEPS)
        assert "calibrating" in steps
        assert steps and {p["total"] for p in seen if p["step"] in ("assigning", "pq encoding")} <= {3000}
    finally:
        cat.close()


@pytest.mark.parametrize("progress", [True, False])
def test_merge_bars_when_asked(tmp_path, capfd, progress):
    cat = Catalog(tmp_path, collection_config=CollectionConfig(background_merge=False, min_index_count=100))
    try:
        col = cat.create("c", DIM, "l2")
        x = clustered(3000, DIM, 20, seed=4)
        col.upsert([Document(str(i), None, v) for i, v in enumerate(x[:2000])])
        col.merge(progress=progress)
        col.upsert([Document(str(i), None, v) for i, v in enumerate(x[2000:], 2000)])
        col.merge(progress=progress)
        err = capfd.readouterr().err
        for step in ["pq training", "writing pages", "copying pages", "pq encoding"]:
            assert (f"{step}:" in err) == progress, (step, err[-2000:])
    finally:
        cat.close()
