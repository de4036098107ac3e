"""The native worker pool (native/threadpool.h) under calls from several threads at once: a call never waits for
another call's job, and concurrent calls answer as calls one at a time do."""

import os
import threading

import numpy as np
import pytest
from conftest import clustered

from fusionrag.native import _native
from fusionrag.retriever import BuildConfig, Index


def _blocked_calls():
    """(syscall number, first argument) of each of this process's threads, from /proc (not from the pool's
    bookkeeping); threads that are running show no number and are left out."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/syscall") as fh:
                fields = fh.read().split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0].isdigit():
            yield int(fields[0]), int(fields[1], 16)


def _threads_reading(fd: int, syscall: int) -> int:
    """How many of this process's threads are blocked in read(fd)."""
    return sum(1 for nr, arg in _blocked_calls() if nr == syscall and arg == fd)


def _read_syscall_number() -> int:
    """The number /proc shows for read() (architectures differ): a thread of ours blocked in one on a pipe."""
    r, w = os.pipe()
    t = threading.Thread(target=os.read, args=(r, 1))
    t.start()
    try:
        for _ in range(2000):
            for nr, arg in _blocked_calls():
                if arg == r:
                    return nr
            threading.Event().wait(0.005)
        pytest.fail("no thread was seen blocked in read() in /proc/self/task/*/syscall")
    finally:
        os.write(w, b"x")
        t.join()
        os.close(r), os.close(w)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = clustered(4000, 32, 40, seed=11)
    queries = clustered(96, 32, 40, seed=12)
    path = tmp_path_factory.mktemp("pool") / "idx"
    Index.build(base, path, BuildConfig(metric="l2", threads=1), progress=False)
    return queries, path


def test_a_call_does_not_wait_for_another_calls_job(small):
    """Every worker of the pool, and the caller, blocked in one job's items: a search with threads=2 from another
    thread still finishes, on its own thread, before that job is let go. With one job at a time it waited."""
    queries, path = small
    index = Index.open(path, threads=2, batch_size=16)
    want = index.search(queries, 10, nprobe=8)
    syscall = _read_syscall_number()
    workers = os.cpu_count()
    r, w = os.pipe()
    holder = threading.Thread(target=_native._pool_read_bytes, args=(r, workers, 0))
    holder.start()
    try:
        for _ in range(4000):
            if _threads_reading(r, syscall) >= workers:
                break
            threading.Event().wait(0.005)
        assert _threads_reading(r, syscall) == workers, "the holding job did not take every worker"
        got = {}
        searcher = threading.Thread(target=lambda: got.update(res=index.search(queries, 10, nprobe=8)))
        searcher.start()
        searcher.join(timeout=60)
        finished = not searcher.is_alive()
        assert _threads_reading(r, syscall) == workers  # the holding job was still holding every worker
    finally:
        os.write(w, b"x" * workers)
        holder.join()
        os.close(r), os.close(w)
    searcher.join()
    index.close()
    assert finished, "the search waited for the other call's job"
    np.testing.assert_array_equal(got["res"].ids, want.ids)


@pytest.mark.parametrize("pipeline", [True, False])
def test_concurrent_searches_answer_as_searches_one_at_a_time(small, pipeline):
    """Four threads searching one index at once, each call's batches overlapped (pipeline) or not, on 2 threads
    each: every answer is the answer of the same call made alone."""
    queries, path = small
    index = Index.open(path, threads=2, batch_size=16, pipeline=pipeline)
    knobs = [dict(nprobe=4, rerank=40), dict(nprobe=8), dict(nprobe=16, beta=1), dict(nprobe=32, rerank=200)]
    alone = [index.search(queries, 10, **kn) for kn in knobs]
    results, errors = [[None] * 6 for _ in knobs], []

    def run(i):
        try:
            for rep in range(6):
                results[i][rep] = index.search(queries, 10, **knobs[i])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(knobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    index.close()
    assert not errors
    for i, a in enumerate(alone):
        for res in results[i]:
            np.testing.assert_array_equal(res.ids, a.ids)
            np.testing.assert_array_equal(res.distances, a.distances)


def test_an_error_in_one_of_two_concurrent_jobs_reaches_its_caller_only(small):
    """A failing item's error is raised by its own call; a call running beside it is unaffected."""
    queries, path = small
    index = Index.open(path, threads=2, batch_size=16)
    want = index.search(queries, 10, nprobe=8)
    r, w = os.pipe()
    os.close(w)  # every read sees end of file: the job's items fail
    errors, got = [], {}

    def failing():
        try:
            _native._pool_read_bytes(r, 64, 2)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=failing)
    t.start()
    got["res"] = index.search(queries, 10, nprobe=8)
    t.join()
    os.close(r)
    index.close()
    assert len(errors) == 1 and "read gave 0" in str(errors[0])
    np.testing.assert_array_equal(got["res"].ids, want.ids)
