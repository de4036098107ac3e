"""The records the router (sharded/router.py and its router_*.py parts) keeps of its calls to shards, where it
passed positional tuples: a call to send (ShardCall: which shard, which ShardServer method, its arguments), and a
search's call in flight (Dispatched: the call's handle, the query rows it asked, the work it was counted for and
which of those rows' lists it was sent)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class ShardCall:
    """One call to one shard: ShardServer.<method>(*args) on shard `shard` (the router's number, 0 .. S-1)."""

    shard: int
    method: str
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A search's call to one shard, sent (ShardedIndex._dispatch), its answer not yet read."""

    shard: int
    rows: np.ndarray  # int: the rows of the search's queries it asked (into the whole search, not the batch)
    handle: Any  # what the shards' kind (sharded/actors.py) returned: a Ray ObjectRef or a LocalFuture
    work: int  # list-size units counted as outstanding on the shard until it answers
    lists_sent: np.ndarray  # bool (len(rows), m): which of each row's probed lists went to this shard
