"""Helpers of the navigation-graph studies (bench/peers/graph_sq8.py, exact_navigation.py): this process's
memory counters, and queries as the navigation tier sees them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def engine_queries(index: Path, queries: np.ndarray) -> np.ndarray:
    """Queries as the navigation tier sees them (tiers.NavigationTier.probe)."""
    metric = json.loads((index / "manifest.json").read_text())["metric"]
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    if metric == "ip":
        q = np.hstack([q, np.zeros((len(q), 1), np.float32)])
    return q
