"""Run inside a network and PID namespace of its own (tests/retriever/test_sharded_ray.py starts it under
`unshare --net --pid`, loopback up): a three-node Ray cluster on 127.0.0.1, a sharded index whose shards are Ray
actors, searches and writes under load while one shard's actor process (or a whole worker node) is killed (SIGKILL) and
its shard restarted from its directory. Prints one JSON line of what it saw; stops every Ray process it started.

usage: sharded_ray_faults_child.py WORKDIR [actor|node|node-crash|node-term]   (WORKDIR holds base.npy, queries.npy and
idx/, a 3-shard index; node: a whole worker node is killed instead of one actor, its raylet SIGKILLed; node-crash: the
raylet and every process under it SIGKILLed at once; node-term: removed, its raylet sent SIGTERM)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from ray_namespace import listening, ray_cluster  # noqa: E402

NODES = 3
KILLED = 1  # the shard whose actor is killed


def load(index, base, queries, stop, report, lock, written):
    """Two searchers and a writer until stop is set; what they saw goes into report."""
    from fusionrag.retriever.engine.config import SearchParams
    from fusionrag.retriever.errors import UnavailableError

    n = len(base)
    exhaustive = SearchParams(rerank=n, beta=0)

    def searcher(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            q = queries[rng.choice(len(queries), 8)]
            try:
                res = index.search(q, 10, exhaustive)
            except Exception as e:  # noqa: BLE001 - a failed search is what the test counts
                with lock:
                    report["search_errors"].append(repr(e))
                continue
            with lock:
                report["searches"] += 1
                report["partial"] += int(res.partial)
                report["missing"].update(int(x) for m in res.missing_lists for x in m)

    def writer():
        rng = np.random.default_rng(9)
        next_id = n
        while not stop.is_set():
            ids = np.arange(next_id, next_id + 5)
            next_id += 5
            vecs = (base[rng.choice(n, 5)] + 0.02 * rng.standard_normal((5, base.shape[1]))).astype(np.float32)
            try:
                index.upsert(ids, vecs)
            except UnavailableError:
                with lock:
                    report["writes_refused"] += 1
                continue
            except Exception as e:  # noqa: BLE001
                with lock:
                    report["write_errors"].append(repr(e))
                continue
            with lock:
                written.append((ids, vecs))
            time.sleep(0.02)

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(2)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    return threads


def raylet_pid(node_id: str) -> int:
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"raylet") and f"--node_id={node_id}".encode() in cmd:
            return int(proc.name)
    raise RuntimeError(f"no raylet of node {node_id}")


def process_tree(root: int) -> list[int]:
    """root and every process descended from it (the raylet's workers and agents), root first."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def kill_a_node(index, base, queries, written, all_found, sig: int = signal.SIGKILL, crash: bool = False) -> dict:
    """A whole worker node killed under load (its raylet, SIGKILL; its workers follow), crashed (crash: the raylet
    and every process under it SIGKILLed at once, as a machine's sudden death takes them), or removed (SIGTERM: the
    raylet leaves the cluster as `ray stop` makes it): the shard on it is restarted from its directory on a live
    node."""
    import ray

    # Neither the head node (the GCS) nor the node whose raylet this driver is connected to.
    keep = {ray.get_runtime_context().get_node_id()} | {
        n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n.get("Resources", {})}
    victim = next(s for s in range(index.n_shards) if index.where[s]["node_id"] not in keep)
    node = index.where[victim]["node_id"]
    report: dict = {"searches": 0, "partial": 0, "missing": set(), "search_errors": [], "write_errors": [],
                    "writes_refused": 0, "shard": victim, "kept_nodes": len(keep)}
    stop, lock = threading.Event(), threading.Lock()
    threads = load(index, base, queries, stop, report, lock, written)
    time.sleep(2)
    pids = process_tree(raylet_pid(node)) if crash else [raylet_pid(node)]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    report["processes_killed"] = len(pids)
    t = time.perf_counter()
    while index.alive[victim] and time.perf_counter() - t < 60:
        time.sleep(0.2)
    report["noticed_s"] = round(time.perf_counter() - t, 2)
    time.sleep(2)
    t = time.perf_counter()
    where = index.restart_shard(victim)
    report["restart_s"] = round(time.perf_counter() - t, 2)
    report["moved_to_another_node"] = where["node_id"] != node
    time.sleep(2)
    stop.set()
    for th in threads:
        th.join()
    report["nodes_alive"] = sum(1 for n in ray.nodes() if n["Alive"])
    report["missing"] = len(report["missing"])
    report["acknowledged_found"] = all_found(index)
    report["full_after_restart"] = not index.search(queries, 10, partial=False).partial
    return report


def kill_an_actor(index, base, queries, written, all_found, report) -> None:
    """Shard KILLED's actor process killed (SIGKILL) under load, restarted from its directory 4 s later."""
    from fusionrag.retriever.engine.config import SearchParams

    sole = np.flatnonzero((index.list_shards[:, 0] == KILLED) & (index.list_shards[:, 1] < 0))
    stop, lock = threading.Event(), threading.Lock()
    threads = load(index, base, queries, stop, report, lock, written)
    time.sleep(3)
    os.kill(index.where[KILLED]["pid"], signal.SIGKILL)
    report["killed_at_searches"] = report["searches"]
    time.sleep(4)
    report["alive_after_kill"] = index.alive.tolist()
    t = time.perf_counter()
    index.restart_shard(KILLED)
    report["restart_s"] = time.perf_counter() - t
    with lock:
        report["partial_before_restart"] = report["partial"]
        report["searches_before_restart"] = report["searches"]
    time.sleep(3)
    stop.set()
    for th in threads:
        th.join()
    with lock:
        report["partial_after_restart"] = report["partial"] - report["partial_before_restart"]
        report["searches_after_restart"] = report["searches"] - report["searches_before_restart"]
    report["missing_outside_sole_lists"] = sorted(report["missing"] - set(sole.tolist()))
    report["missing"] = len(report["missing"])
    report["acknowledged_writes"] = sum(len(i) for i, _ in written)
    report["acknowledged_found"] = all_found(index)
    full = index.search(queries, 10, SearchParams(rerank=len(base), beta=0), partial=False)
    report["full_after_restart"] = not full.partial


def main() -> None:
    work = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "actor"  # actor: an actor process killed; node: a whole node
    report: dict = {"searches": 0, "partial": 0, "missing": set(), "search_errors": [], "write_errors": [],
                    "writes_refused": 0}
    t0 = time.perf_counter()
    with ray_cluster(NODES, logs_to=work / "ray-logs"):  # the cluster's logs beside the stderr, should it fail
        import ray

        from fusionrag.retriever.engine.config import SearchParams
        from fusionrag.retriever.sharded.router import ShardedIndex

        report["nodes"] = sum(1 for n in ray.nodes() if n["Alive"])
        report["cluster_start_s"] = time.perf_counter() - t0
        base, queries = np.load(work / "base.npy"), np.load(work / "queries.npy")
        exhaustive = SearchParams(rerank=len(base), beta=0)
        index = ShardedIndex.open(work / "idx", ray=True)
        report["actor_nodes"] = len({w["node_id"] for w in index.where})
        report["healthy_partial"] = index.search(queries, 10, exhaustive).partial
        report["mode"] = mode

        written: list = []

        def all_found(ix) -> bool:
            ids = np.concatenate([i for i, _ in written])
            vecs = np.concatenate([v for _, v in written])
            res = ix.search(vecs, 1, exhaustive, partial=False)
            return bool(np.array_equal(res.ids[:, 0], ids))

        if mode == "actor":
            kill_an_actor(index, base, queries, written, all_found, report)
        else:
            report["node_kill"] = kill_a_node(index, base, queries, written, all_found,
                                              signal.SIGTERM if mode == "node-term" else signal.SIGKILL,
                                              crash=mode == "node-crash")
        report["listening"] = listening()
        index.close()
        # Every shard again from its directory: its log replayed, the router's maps rebuilt.
        index = ShardedIndex.open(work / "idx", ray=True)
        report["acknowledged_found_after_reopen"] = all_found(index)
        index.close()
    report["total_s"] = time.perf_counter() - t0
    if isinstance(report["missing"], set):
        report["missing"] = len(report["missing"])
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
