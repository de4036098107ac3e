"""What the SIGKILL crash tests share (test_collection_crash.py, test_sharded_crash.py): the writer a child runs
(threads streaming writes, printing "B t i" before write i of thread t starts and "A t i" once it is
acknowledged), the parent's run of a child killed after a random number of acknowledgements, and the state a
sequence of writes promises."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def stream_writes(col, ops, seed: int, threads: int) -> None:
    """In a child: `threads` writers, each applying ops(seed, t) to col (a collection: upsert and delete) in turn,
    saying when each write begins and when it is acknowledged."""
    from fusionrag.retriever.collection import Document

    out = threading.Lock()

    def say(line: str) -> None:
        with out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def writer(t: int) -> None:
        for i, op, ids, docs in ops(seed, t):
            say(f"B {t} {i}")
            if op == "delete":
                col.delete(ids)
            else:
                col.upsert([Document(d, text, v, m) for d, text, v, m in docs])
            say(f"A {t} {i}")

    running = [threading.Thread(target=writer, args=(t,), daemon=True) for t in range(threads)]
    for th in running:
        th.start()
    for th in running:
        th.join()


def run_and_kill(child: Path, root: Path, seed: int, rng: np.random.Generator, threads: int,
                 most_acks: int = 120, pause_s: float = 0.02) -> dict:
    """Start the child writer on root, SIGKILL it after a random number of acknowledgements (5 to most_acks) and a
    random pause; returns per thread (last acknowledged write, last begun write)."""
    proc = subprocess.Popen([sys.executable, str(child), str(root), str(seed)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    acked = {t: -1 for t in range(threads)}
    begun = {t: -1 for t in range(threads)}
    target = int(rng.integers(5, most_acks))

    def note(line: str) -> int:
        kind, t, i = line.split()
        (acked if kind == "A" else begun)[int(t)] = int(i)
        return kind == "A"

    n = 0
    try:
        for line in proc.stdout:
            n += note(line)
            if n >= target:
                time.sleep(float(rng.uniform(0, pause_s)))
                break
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for line in proc.stdout:  # what it printed before it died
            note(line)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return {t: (acked[t], begun[t]) for t in range(threads)}


def apply_op(state: dict, op: str, ids, docs) -> None:
    """state (id -> (text, vector, metadata)) after one write."""
    if op == "delete":
        for d in ids:
            state.pop(d, None)
    else:
        for d, text, v, meta in docs:
            state[d] = (text, v, meta)
