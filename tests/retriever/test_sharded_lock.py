"""One process at a time writes a shard part (retriever/dirlock.py, ShardServer): a second router, or a shard
restarted while the process it replaces still runs, is turned away (or waits for it to go) instead of writing the
same log and generations, which would lose acknowledged writes."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.errors import ConflictError
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.parts import part_name
from fusionrag.retriever.sharded.router import ShardedIndex
from fusionrag.retriever.sharded.shard import ShardServer

DIM = 16


@pytest.fixture
def sharded(tmp_path):
    path = tmp_path / "idx"
    build_sharded(clustered(1500, DIM, 10, seed=5, spread=0.6), path, 2, BuildConfig(threads=1, centroid_ratio=0.05),
                  progress=False)
    return path


def _holder(shard_dir, hold_s: float) -> subprocess.Popen:
    """A process of its own that opens the shard at shard_dir, writes one vector, says so, and keeps it open."""
    code = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from fusionrag.retriever.sharded.shard import ShardServer
        shard = ShardServer({str(shard_dir)!r})
        shard.upsert(np.array([777_001]), np.ones((1, {DIM}), np.float32))
        print("open", flush=True)
        time.sleep({hold_s})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "open", p.stderr.read()
    return p


def test_a_second_router_is_turned_away_and_a_failed_open_lets_go_of_every_shard(sharded):
    first = ShardedIndex.open(sharded)
    try:
        first.upsert(np.array([5_000_000]), np.ones((1, DIM), np.float32))
        with pytest.raises(ConflictError, match=f"already open \\(process {os.getpid()} on "):
            ShardedIndex.open(sharded)
        # Another process is turned away too, naming this one.
        p = subprocess.run([sys.executable, "-c", f"from fusionrag.retriever.sharded.shard import ShardServer; "
                            f"ShardServer({str(sharded / part_name(1))!r})"], capture_output=True, text=True)
        assert p.returncode != 0 and f"process {os.getpid()} on" in p.stderr, p.stderr[-2000:]
    finally:
        first.close()
    # Shard 1 open in another process: refused, naming it, and shard 0, opened first, is let go again.
    other = _holder(sharded / part_name(1), hold_s=60)
    try:
        with pytest.raises(ConflictError, match=f"process {other.pid} on "):
            ShardedIndex.open(sharded)
    finally:
        other.kill()
        other.wait()
    # Every shard opens again, with the writes acknowledged: the first router's, and the other process's.
    again = ShardedIndex.open(sharded)
    try:
        assert {5_000_000, 777_001} <= set(again.fresh_owner)
        assert again.live_count() == 1500 + 2
    finally:
        again.close()


def test_a_restarted_shard_waits_for_the_process_it_replaces(sharded):
    shard_dir = sharded / part_name(0)
    old = _holder(shard_dir, hold_s=60)
    try:
        with pytest.raises(ConflictError, match=f"process {old.pid} on "):
            ShardServer(str(shard_dir))  # no wait: refused at once while the old process runs
        killer_at = time.monotonic() + 1.0

        def kill_old():
            time.sleep(max(0.0, killer_at - time.monotonic()))
            os.kill(old.pid, signal.SIGKILL)

        t = threading.Thread(target=kill_old)
        t.start()
        shard = ShardServer(str(shard_dir), lock_wait_s=30)  # as a restarted Ray actor opens it
        opened_at = time.monotonic()
        t.join()
    finally:
        old.kill()
        old.wait()
    try:
        assert old.returncode == -signal.SIGKILL
        assert opened_at >= killer_at  # not before the old process was gone
        # What the old process acknowledged before it died is there, replayed from the log it wrote alone.
        assert 777_001 in set(shard.writes.fresh_ids().tolist())
    finally:
        shard.close()
