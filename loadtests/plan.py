"""What a load test does, as typed configs validated at the edge: the load shape, the users, the checks.

The runner writes one `Plan` as JSON; the Locust process reads it back (FUSIONRAG_LOADTEST_PLAN), so
both sides agree on every figure without Locust-specific flags.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

from fusionrag.retriever.errors import ConfigError

PLAN_ENV = "FUSIONRAG_LOADTEST_PLAN"
SHAPES = ("steady", "step", "burst")
# How a rag user reaches the LLM: "separate": a search of the service, then a chat completion with the hits
# in the prompt; "plugin": one streamed request to the plugin's /v1/rag/chat/completions on vLLM.
RAG_ROUTES = ("separate", "plugin")
# Locust user class of each kind the runner offers.
USER_CLASSES = {"vector": "VectorSearchUser", "text": "TextSearchUser", "mixed": "MixedUser", "rag": "RagUser"}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ShapeConfig:
    """Users over time. steady: `users` throughout; step: `start_users`, plus `step_users` every
    `step_seconds`, up to `users`; burst: `start_users`, jumping to `users` for `burst_seconds`
    every `burst_every_s`."""

    kind: str = "steady"
    users: int = 4
    seconds: float = 30.0
    spawn_rate: float = 0.0  # users started per second; 0: all at once
    start_users: int = 1
    step_users: int = 1
    step_seconds: float = 10.0
    burst_every_s: float = 10.0
    burst_seconds: float = 3.0

    def __post_init__(self):
        _check(self.kind in SHAPES, f"shape must be one of {SHAPES}, got {self.kind!r}")
        _check(self.users >= 1, f"users must be >= 1, got {self.users}")
        _check(0 < self.seconds <= 7 * 86400, f"seconds must be in (0, 604800], got {self.seconds}")
        _check(self.spawn_rate >= 0, f"spawn_rate must be >= 0, got {self.spawn_rate}")
        _check(1 <= self.start_users <= self.users, f"start_users must be in [1, users={self.users}], "
                                                    f"got {self.start_users}")
        _check(self.step_users >= 1, f"step_users must be >= 1, got {self.step_users}")
        _check(self.step_seconds > 0, f"step_seconds must be > 0, got {self.step_seconds}")
        _check(self.burst_every_s > 0, f"burst_every_s must be > 0, got {self.burst_every_s}")
        _check(0 < self.burst_seconds <= self.burst_every_s,
               f"burst_seconds must be in (0, burst_every_s={self.burst_every_s}], got {self.burst_seconds}")

    def users_at(self, t: float) -> int | None:
        """Target user count `t` seconds into the run; None once the run is over."""
        if t >= self.seconds:
            return None
        if self.kind == "steady":
            return self.users
        if self.kind == "step":
            return min(self.users, self.start_users + self.step_users * math.floor(t / self.step_seconds))
        in_burst = (t % self.burst_every_s) >= self.burst_every_s - self.burst_seconds
        return self.users if in_burst else self.start_users

    def peak_users(self) -> int:
        """The most users the shape reaches within the run: a step ramp too slow for its length stops short."""
        if self.kind != "step":
            return self.users
        steps = math.ceil(self.seconds / self.step_seconds) - 1  # the last step that starts before the end
        return min(self.users, self.start_users + self.step_users * steps)

    def short_of_peak(self) -> str | None:
        """A sentence when the run ends before the shape reaches its users, else None."""
        peak = self.peak_users()
        if peak >= self.users:
            return None
        need = self.step_seconds * math.ceil((self.users - self.start_users) / self.step_users)
        return (f"the step ramp reaches {peak} of {self.users} users in {self.seconds:g} s (one step of "
                f"{self.step_users} every {self.step_seconds:g} s): --seconds {need + self.step_seconds:g} reaches "
                f"all of them")

    def rate(self) -> float:
        # Bursts must arrive at once to be bursts; otherwise ramp as asked.
        return float(self.spawn_rate or self.users)


@dataclass(frozen=True)
class QuerySet:
    """Known queries of one collection and their exact top-k (ids and distances, best first)."""

    collection: str
    kind: str  # "vectors" or "texts"
    metric: str
    queries: list  # vectors (lists of floats) or texts
    truth: list[list[str]]
    truth_dist: list[list[float]]
    dist_tol: float  # how far a reported distance may undercut the exact one (float error, embedding noise)

    def __post_init__(self):
        _check(self.kind in ("vectors", "texts"), f"query set kind must be vectors or texts, got {self.kind!r}")
        _check(len(self.queries) > 0, "query set has no queries")
        _check(len(self.truth) == len(self.queries) == len(self.truth_dist),
               f"query set: {len(self.queries)} queries but {len(self.truth)} ground-truth rows")
        _check(self.dist_tol >= 0, f"dist_tol must be >= 0, got {self.dist_tol}")

    @property
    def k(self) -> int:
        return len(self.truth[0])


@dataclass(frozen=True)
class LLMTarget:
    """An OpenAI-compatible chat-completions server that the RAG user streams answers from."""

    url: str
    model: str = "fusionrag-tiny"
    max_tokens: int = 16

    def __post_init__(self):
        _check(self.url.startswith(("http://", "https://")), f"LLM url must start with http(s)://, got {self.url!r}")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Plan:
    shape: ShapeConfig
    request_log: str
    weights: dict[str, int] = field(default_factory=lambda: {"vector": 1})
    k: int = 10
    user_rate: float = 0.0  # requests per second per user; 0: back to back
    min_recall: float = 0.5  # a checked answer below this recall@k counts as a failure
    vector: QuerySet | None = None
    text: QuerySet | None = None
    # Written vectors sit at `write_offset` in every coordinate, spread by `write_spread`: far from the
    # data, so they never enter a known query's top-k and its ground truth holds while users write.
    write_offset: float = 1000.0
    write_spread: float = 1.0
    rag_k: int = 4
    llm: LLMTarget | None = None
    rag_route: str = "separate"

    def __post_init__(self):
        unknown = sorted(set(self.weights) - set(USER_CLASSES))
        _check(not unknown, f"unknown user kind(s) {unknown}; known: {sorted(USER_CLASSES)}")
        _check(any(w > 0 for w in self.weights.values()), "no user kind has a weight > 0")
        _check(all(w >= 0 for w in self.weights.values()), f"user weights must be >= 0, got {self.weights}")
        _check(1 <= self.k <= 1000, f"k must be in [1, 1000], got {self.k}")
        _check(self.user_rate >= 0, f"user_rate must be >= 0, got {self.user_rate}")
        _check(0 <= self.min_recall <= 1, f"min_recall must be in [0, 1], got {self.min_recall}")
        _check(self.rag_k >= 1, f"rag_k must be >= 1, got {self.rag_k}")
        _check(self.rag_route in RAG_ROUTES, f"rag_route must be one of {RAG_ROUTES}, got {self.rag_route!r}")
        for qs in (self.vector, self.text):
            if qs is not None:
                _check(qs.k >= self.k, f"query set of {qs.collection!r} has ground truth for k={qs.k}, "
                                       f"the plan asks k={self.k}")
        kinds = {name for name, w in self.weights.items() if w > 0}
        if kinds & {"vector", "mixed"}:
            _check(self.vector is not None, "vector and mixed users need a vector query set")
        if "mixed" in kinds:
            _check(self.vector.metric == "l2", "mixed users write vectors far from the data, which only keeps "
                                               f"ground truth under the l2 metric, not {self.vector.metric}")
        if "text" in kinds:
            _check(self.text is not None, "text users need a text query set (a collection with an embedding)")
        if "rag" in kinds:
            _check(self.llm is not None, "rag users need an LLM server")
            _check(self.text is not None or self.vector is not None, "rag users need a query set")
            _check(self.rag_route != "plugin" or self.text is not None,
                   "rag users on the plugin's route need a text query set: the plugin embeds the question")

    def user_classes(self) -> list[str]:
        return [USER_CLASSES[name] for name, w in self.weights.items() if w > 0]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        _check(not unknown, f"unknown plan field(s): {unknown}")
        d["shape"] = ShapeConfig(**d["shape"])
        for key in ("vector", "text"):
            if d.get(key) is not None:
                d[key] = QuerySet(**d[key])
        if d.get("llm") is not None:
            d["llm"] = LLMTarget(**d["llm"])
        return cls(**d)

    @classmethod
    def from_env(cls) -> "Plan":
        path = os.environ.get(PLAN_ENV)
        _check(bool(path), f"{PLAN_ENV} is not set: run load tests through `fusionrag loadtest`")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def parse_weights(spec: str) -> dict[str, int]:
    """'vector=3,mixed=1' -> {'vector': 3, 'mixed': 1}; a bare name has weight 1."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition("=")
        _check(name in USER_CLASSES, f"unknown user kind {name!r} in {spec!r}; known: {', '.join(USER_CLASSES)}")
        try:
            out[name] = int(w) if w else 1
        except ValueError:
            raise ConfigError(f"weight of {name!r} must be an integer, got {w!r}") from None
    _check(bool(out), f"no users in {spec!r}")
    return out
