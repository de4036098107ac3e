"""More than one router (retriever/sharded/follow.py): followers search with the leader's shards and write state,
shards in this process (the same over Ray Serve: test_sharded_ray.py). A follower answers as the leader does, sees
each write the leader acknowledged from its next search on, fails over when a shard is down, takes a restarted
shard back, and refuses writes."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import clustered

from fusionrag.retriever.collection import Document
from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.errors import ConfigError, UnavailableError
from fusionrag.retriever.sharded.build import build_sharded
from fusionrag.retriever.sharded.docs import ShardedCollection
from fusionrag.retriever.sharded.follow import FollowerCollection, ShardedFollower
from fusionrag.retriever.sharded.router import ShardedIndex

N, DIM, K = 3000, 16, 10


class CountingLeader:
    """The leader's view(), as a follower in another process calls it (delay_s: the time its answer takes back,
    the state read when the call starts), counting the calls and the views sent."""

    def __init__(self, index: ShardedIndex):
        self.index, self.calls, self.sent, self.delay_s = index, 0, 0, 0.0

    def __call__(self, epoch, version):
        self.calls += 1
        v = self.index.view(epoch, version)
        time.sleep(self.delay_s)
        self.sent += v is not None
        return v


@pytest.fixture
def routers(tmp_path):
    base = clustered(N, DIM, 20, seed=5, spread=0.6)
    # Every list replicated: a dead shard loses no list.
    build_sharded(base, tmp_path / "idx", 3, BuildConfig(threads=1, centroid_ratio=0.05), replicate=1.0,
                  progress=False)
    leader = ShardedIndex.open(tmp_path / "idx")
    view = CountingLeader(leader)
    follower = ShardedFollower.follow(tmp_path / "idx", view)
    yield leader, follower, view, clustered(40, DIM, 20, seed=6, spread=0.6)
    follower.close()
    leader.close()


def test_a_follower_answers_as_the_leader_and_asks_only_for_changes(routers):
    leader, follower, view, q = routers
    a, b = leader.search(q, K), follower.search(q, K)
    assert np.array_equal(a.ids, b.ids) and np.allclose(a.distances, b.distances)
    assert np.array_equal(a.stats["lists_probed"], b.stats["lists_probed"])
    sent = view.sent
    for _ in range(5):
        follower.search(q[:3], K)
    assert view.sent == sent and view.calls >= 6  # asked each time, sent nothing: nothing changed


def test_each_acknowledged_write_is_seen_by_the_followers_next_search(routers):
    leader, follower, view, q = routers
    new = q[:8] + 0.001
    for j in range(8):
        leader.upsert([N + j], new[j:j + 1])
        # No waiting: the very next search on the follower finds the write the leader acknowledged.
        assert follower.search(new[j:j + 1], 1).ids[0, 0] == N + j
    leader.delete([N + 3])
    assert N + 3 not in follower.search(new[3:4], K).ids[0]
    assert np.array_equal(follower.search(new, K).ids, leader.search(new, K).ids)
    # The write state a follower holds is the leader's.
    assert np.array_equal(follower.fresh_count, leader.fresh_count) and follower.fresh_groups == leader.fresh_groups


def test_writes_under_concurrent_follower_searches(routers):
    leader, follower, _, q = routers
    new = q + 0.002

    def write():
        for j in range(len(new)):
            leader.upsert([N + 100 + j], new[j:j + 1])

    def read():
        for _ in range(30):
            follower.search(q[:4], K)

    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(write), pool.submit(read), pool.submit(read)]:
            f.result()
    assert (follower.search(new, 1).ids[:, 0] == N + 100 + np.arange(len(new))).all()


def test_searches_at_once_share_calls_to_the_leader_and_still_see_every_write(routers):
    """Group commit (ShardedFollower.sync): concurrent searches wait for one call to the leader rather than each
    making its own, yet a search that starts after a write was acknowledged never takes a view from a call that
    started before it."""
    leader, follower, view, q = routers
    view.delay_s = 0.04
    new = q[:10] + 0.001
    stop, seen, stale = False, [], []

    def hammer():
        n = 0
        while not stop:
            follower.search(q[n % len(q):n % len(q) + 1], K)
            n += 1
        return n

    def write_then_read():
        for j in range(len(new)):
            leader.upsert([N + 700 + j], new[j:j + 1])
            acked = leader.version
            follower.sync()  # as a search starts: the view it then holds is at least the acknowledged write's
            stale.append(follower.seen[1] < acked)
            seen.append(int(follower.search(new[j:j + 1], 1).ids[0, 0]))

    calls = view.calls
    with ThreadPoolExecutor(7) as pool:
        readers = [pool.submit(hammer) for _ in range(6)]
        pool.submit(write_then_read).result()
        stop = True
        searches = sum(f.result() for f in readers) + len(new)
    assert seen == [N + 700 + j for j in range(len(new))] and not any(stale), (seen, stale)
    assert view.calls - calls < searches / 2, (view.calls - calls, searches)


def test_a_dead_shard_fails_over_and_the_restarted_one_is_taken_back(routers):
    leader, follower, _, q = routers
    expect = leader.search(q, K)
    leader.kill_shard(1)
    res = follower.search(q, K)
    assert not follower.alive[1] and not res.partial  # every list has a replica
    assert np.array_equal(res.ids, expect.ids)
    # The leader restarts it (a new shard object: a new view), with a write it took meanwhile.
    leader.check_shards()
    leader.upsert([N + 500], q[:1] + 0.001)
    leader.heal()
    assert leader.alive.all()
    res = follower.search(q[:1] + 0.001, K)
    assert follower.alive.all() and res.ids[0, 0] == N + 500
    assert res.stats["shards_probed"][0] == 3  # asked shard 1 again


def test_a_follower_writes_nothing(routers):
    _, follower, _, q = routers
    for call in (lambda: follower.upsert([1], q[:1]), lambda: follower.delete([1]), follower.merge_shards,
                 lambda: follower.restart_shard(0)):
        with pytest.raises(ConfigError, match="leader"):
            call()


def test_a_follower_collection_searches_here_and_writes_through_the_leader(routers):
    leader, follower, _, q = routers
    coll = ShardedCollection(leader, "docs")
    calls = []

    def on_leader(method, args, kwargs):
        calls.append(method)
        return getattr(coll, method)(*args, **kwargs)

    fcoll = FollowerCollection(follower, "docs", on_leader)
    v = q[0] + 0.001
    assert fcoll.upsert([Document("note", "a note", v, {"kind": "x"})]) == ["note"]
    hits = fcoll.search(v[None], 1).hits[0]
    assert hits[0].id == "note" and hits[0].text == "a note" and hits[0].metadata == {"kind": "x"}
    assert calls == ["upsert"]  # the vector search ran on the follower
    assert fcoll.search(None, 1, texts=["note"], mode="text").hits[0][0].id == "note"
    assert [d.id for d in fcoll.get(["note"])] == ["note"] and len(fcoll) == N + 1
    assert fcoll.info()["count"] == N + 1
    assert fcoll.delete(["note"]) == 1 and fcoll.search(v[None], 1).hits[0][0].id != "note"
    assert calls == ["upsert", "search", "get", "__len__", "info", "delete"]


def test_a_leader_that_does_not_answer_fails_the_search_clearly_and_its_successor_is_followed(routers, tmp_path):
    """No view (the leader's replica being replaced): the search is refused with UnavailableError (a 503), each
    waiting search trying itself; a new leader on the same index (a new epoch, new shards) is then followed, with
    the writes the old one acknowledged."""
    leader, follower, view, q = routers
    leader.upsert([N + 900], q[:1] + 0.001)
    assert follower.search(q[:1] + 0.001, 1).ids[0, 0] == N + 900
    leader.close()
    gone = follower.leader_view

    def down(epoch, version):
        raise UnavailableError("the leading router is being replaced: try again")

    follower.leader_view = down
    with ThreadPoolExecutor(3) as pool:
        fails = [pool.submit(follower.search, q[:2], K) for _ in range(3)]
        for f in fails:
            with pytest.raises(UnavailableError, match="being replaced"):
                f.result()
    successor = ShardedIndex.open(tmp_path / "idx")
    try:
        epoch = follower.seen[0]
        follower.leader_view = CountingLeader(successor)
        res = follower.search(q[:1] + 0.001, 1)
        assert follower.seen[0] == successor.epoch != epoch and follower.shards == successor.shards
        assert res.ids[0, 0] == N + 900 and not res.partial
    finally:
        follower.leader_view = gone
        successor.close()
