"""Typed configuration, validated at the edge (CLI, HTTP, Python callers) so the engine can trust it.

Every knob is declared once, as a field of a frozen dataclass: its type (a `Literal` for a choice), its
default, and in `knob(...)` its help and its bounds. Everything else comes from that declaration:
validation (pydantic) with a `ConfigError` naming the knob and what it allows, the CLI flags
(`add_flags`, `flags_of`), and for the service the environment variables and the TOML file
(server/config.py). The configs stay dataclasses: `dataclasses.fields`, `asdict` and `replace` work.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass

from fusionrag.retriever.errors import ConfigError, IndexFormatError, InputError

Metric = Literal["l2", "ip", "cosine"]
IoBackend = Literal["auto", "io_uring", "pread"]
DirectIO = Literal["auto", "on", "off"]
FilterTier = Literal["auto", "cpu", "gpu"]
GpuSearch = Literal["auto", "device", "lists"]
BufferPolicy = Literal["auto", "clock", "lfu"]
RecordCache = Literal["auto", "on", "off"]
BufferCompression = Literal["auto", "on", "off"]
MapArrays = Literal["auto", "on", "off"]
RawInRam = Literal["auto", "on", "off"]
Probe = Literal["ratio", "learned"]
Navigation = Literal["auto", "exact", "graph"]
METRICS = get_args(Metric)
IO_BACKENDS = get_args(IoBackend)
DIRECT_IO = get_args(DirectIO)
FILTER_TIERS = get_args(FilterTier)
BUFFER_POLICIES = get_args(BufferPolicy)
PROBES = get_args(Probe)
# Automatic EngineConfig.batch_size per filter tier.
CPU_BATCH, GPU_BATCH = 64, 1024


# --- the declarations' machinery -------------------------------------------------------------------------

def knob(help: str, *, ge=None, gt=None, le=None, lt=None, min_length=None, note: str | None = None,
         flag: bool = True):
    """A knob's declaration, for `Annotated[type, knob(...)] = default`: its help (the CLI's and the
    docs'), its bounds, a note on special values that error messages carry ("0 = automatic"), and
    whether it has a flag (secrets do not: every user of the machine can read a command line)."""
    extra = {"note": note, "flag": flag}
    return Field(ge=ge, gt=gt, le=le, lt=lt, min_length=min_length, description=help, json_schema_extra=extra)


@dataclass(frozen=True)
class Knob:
    """What one declaration says, in the form the flags, the sources and the messages use."""

    name: str
    type: type  # int, float, bool or str (a choice's values are str)
    default: Any
    help: str
    choices: tuple | None
    bounds: str  # "in [1, 1024]", ">= 0", "" (none); a choice: "one of ('a', 'b')"
    note: str | None
    flag: bool

    @property
    def allowed(self) -> str:
        return self.bounds + (f" ({self.note})" if self.note else "")


def _bounds(metadata) -> str:
    lo = hi = None
    for m in metadata:
        if getattr(m, "min_length", None):
            return "non-empty" if m.min_length == 1 else f"at least {m.min_length} long"
        for attr, bracket in (("ge", "["), ("gt", "(")):
            if getattr(m, attr, None) is not None:
                lo = (getattr(m, attr), bracket)
        for attr, bracket in (("le", "]"), ("lt", ")")):
            if getattr(m, attr, None) is not None:
                hi = (getattr(m, attr), bracket)
    if lo and hi:
        return f"in {lo[1]}{lo[0]}, {hi[0]}{hi[1]}"
    if lo:
        return f"{'>=' if lo[1] == '[' else '>'} {lo[0]}"
    if hi:
        return f"{'<=' if hi[1] == ']' else '<'} {hi[0]}"
    return ""


def _knob_of(name: str, info) -> Knob:
    kind, choices = info.annotation, None
    if get_origin(kind) is Literal:
        choices = get_args(kind)
        kind = type(choices[0])
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    bounds = f"one of {choices}" if choices else _bounds(info.metadata)
    return Knob(name, kind, info.default, info.description or "", choices, bounds, extra.get("note"),
                extra.get("flag", True))


def knobs(cls) -> dict[str, Knob]:
    """The knobs a config class declares, by name, in declaration order."""
    return cls.__knobs__


_TYPE_ERRORS = ("_type", "_parsing", "int_from_float", "finite_number")


def _problem(cls, err: dict) -> tuple[str | None, str]:
    """(the knob, what is wrong with it) of one of pydantic's errors."""
    ctx = err.get("ctx") or {}
    if isinstance(ctx.get("error"), ConfigError):  # one of our own checks, run by pydantic
        return (err["loc"][-1] if err["loc"] else None), str(ctx["error"])
    loc, value = err["loc"], err.get("input")
    owner = cls
    for part in loc[:-1]:  # a nested config (CollectionConfig.build)
        nested = getattr(owner, "__knobs__", {}).get(part)
        owner = nested.type if nested is not None and hasattr(nested.type, "__knobs__") else owner
    k = getattr(owner, "__knobs__", {}).get(loc[-1]) if loc else None
    name = ".".join(map(str, loc)) or cls.__name__
    if k is None:
        return None, f"{name}: {err['msg']}"
    if k.choices is None and err["type"].endswith(_TYPE_ERRORS):
        return k.name, f"{name} must be a {k.type.__name__}, got {value!r}"
    if k.allowed:
        if isinstance(value, str) and k.type in (int, float):  # from text (the environment): the number it read
            try:
                value = k.type(value)
            except ValueError:
                pass
        return k.name, f"{name} must be {k.allowed}, got {value!r}"
    return k.name, f"{name}: {err['msg']}, got {value!r}"


def problems(cls, e: ValidationError) -> list[tuple[str | None, str]]:
    """(knob, message) per problem of a ValidationError from config class `cls`."""
    unknown = sorted(str(err["loc"][-1]) for err in e.errors() if err["type"] == "unexpected_keyword_argument")
    out = [(None, f"unknown {cls.__name__} option(s): {', '.join(unknown)}")] if unknown else []
    return out + [_problem(cls, err) for err in e.errors() if err["type"] != "unexpected_keyword_argument"]


def config_error(cls, e: ValidationError) -> ConfigError:
    return ConfigError("; ".join(msg for _, msg in problems(cls, e)))


def config_class(cls):
    """Make `cls` a frozen, validated config dataclass whose errors are ConfigErrors."""
    cls = _pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kw):
        try:
            init(self, *args, **kw)
        except ValidationError as e:
            raise config_error(type(self), e) from None

    cls.__init__ = __init__
    cls.__knobs__ = {name: _knob_of(name, info) for name, info in cls.__pydantic_fields__.items()}
    cls.__field_validators__ = {}
    return cls


def _field_validator(cls, name: str) -> TypeAdapter:
    adapter = cls.__field_validators__.get(name)
    if adapter is None:
        info = cls.__pydantic_fields__[name]
        adapter = TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)
        cls.__field_validators__[name] = adapter
    return adapter


class ConfigBase:
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        unknown = set(d) - set(cls.__knobs__)
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} option(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def with_overrides(self, **kw):
        """A copy with the non-None keyword arguments applied (and validated).

        On the query path (Index.search), so only the overridden fields are validated: the others were
        when `self` was made."""
        kw = {k: v for k, v in kw.items() if v is not None}
        if not kw:
            return self  # frozen: as good as a copy
        cls = type(self)
        new = object.__new__(cls)
        state = new.__dict__
        state.update(self.__dict__)
        errors = []
        for name, value in kw.items():
            if name not in cls.__knobs__:
                raise ConfigError(f"unknown {cls.__name__} option(s): "
                                  f"{', '.join(sorted(set(kw) - set(cls.__knobs__)))}")
            try:
                state[name] = _field_validator(cls, name).validate_python(value)
            except ValidationError as e:
                errors += [_problem(cls, {**err, "loc": (name, *err["loc"])})[1] for err in e.errors()]
        if errors:
            raise ConfigError("; ".join(errors))
        post = getattr(new, "__post_init__", None)
        if post is not None:
            post()
        return new


def add_flags(parser: argparse.ArgumentParser, cls, skip=(), env_prefix: str | None = None) -> None:
    """One --flag per knob of `cls` (help, type and choices from its declaration), defaulting to None so
    that a flag not given leaves the knob to lower sources (`flags_of`). Values are checked by the
    config class, not argparse, so a bad one gets the same ConfigError from every source."""
    for k in knobs(cls).values():
        if not k.flag or k.name in skip:
            continue
        opt = "--" + k.name.replace("_", "-")
        env = f"env {env_prefix}{k.name.upper()}; " if env_prefix else ""
        helptext = k.help.replace("%", "%%")
        if k.type is bool:
            parser.add_argument(opt, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{helptext} ({env}default {'on' if k.default else 'off'})")
        else:
            bounds = "" if k.choices or not k.bounds else f"{k.bounds}; "
            metavar = "{" + ",".join(k.choices) + "}" if k.choices else k.name.upper()
            default = f"{k.default!r}".replace("%", "%%")
            parser.add_argument(opt, type=k.type, default=None, metavar=metavar,
                                help=f"{helptext} ({bounds.replace('%', '%%')}{env}default {default})")


def flags_of(args: argparse.Namespace, cls, skip=()) -> dict:
    """The knobs of `cls` given as flags (those added by add_flags), by name."""
    return {name: getattr(args, name) for name, k in knobs(cls).items()
            if k.flag and name not in skip and getattr(args, name, None) is not None}


# --- the engine's configs --------------------------------------------------------------------------------

MIN_BUILD_BUDGET = 32 << 20


@config_class
class BuildConfig(ConfigBase):
    """How an index is built. Defaults are meant to be good on real data without tuning."""

    metric: Annotated[Metric, knob("distance: l2, ip (inner product) or cosine")] = "l2"
    centroid_ratio: Annotated[float, knob("posting-list centroids per vector (lists of about 1/ratio vectors)",
                                          gt=0, le=0.5)] = 0.1
    max_list_factor: Annotated[float, knob("a list is split again while larger than this multiple of its "
                                           "target size", ge=1)] = 2.0
    kmeans_branching: Annotated[int, knob("hierarchical k-means: clusters per split", ge=2, le=256)] = 16
    kmeans_iters: Annotated[int, knob("k-means iterations per split", ge=1, le=100)] = 12
    replica_eps: Annotated[float, knob("boundary replication: join list i if dist <= (1+eps) * nearest dist",
                                       ge=0)] = 0.1
    max_replicas: Annotated[int, knob("posting lists a vector joins at most", ge=1, le=8)] = 8
    pq_m: Annotated[int, knob("PQ bytes per vector (0: dim/2, at most 64)", ge=0, le=256,
                              note="0 = automatic")] = 0
    # 4: 16 centroids a sub-space and twice the sub-spaces in the same bytes, scanned 32 codes at a time with the
    # table in registers: the same recall after re-rank as 8-bit on MiniLM and GloVe, at 1.3-3x the scan's speed;
    # not on Fashion-MNIST's pixels (bench/results/peers/fastscan.md). Scanned by the CPU and device tiers, not the
    # lists tier. 0 ('auto'):
    # calibration measures both on the index and keeps 4-bit codes where they hold recall and scan faster
    # (retriever/engine/pq_choice.py; 8-bit where a GPU tier could serve the index).
    pq_bits: Annotated[int, knob("bits a PQ sub-code: 8 (256 centroids a sub-space), 4 (16, two sub-spaces a "
                                 "byte: twice the sub-spaces in pq_m bytes; not the GPU lists tier), or 0: measured at "
                                 "calibration", ge=0, le=8, note="0 = automatic")] = 0
    pq_train_size: Annotated[int, knob("vectors PQ is trained on", ge=256)] = 32768
    graph_m: Annotated[int, knob("navigation graph: links per centroid", ge=4, le=64)] = 16
    graph_ef_construction: Annotated[int, knob("navigation graph: build beam (at least graph_m)")] = 200
    # How queries, and the build's rows, find their nearest posting lists; recorded in the manifest
    # ("list_navigation"), so that later queries, merges and splits go the way the rows went. 'auto': exactly
    # where that costs no more than the graph (tiers.exhaustive_is_cheap). Measured: docs/tuning.md.
    navigation: Annotated[Navigation, knob("how queries and rows find their nearest posting lists: exact (distances "
                                           "to every centroid), graph, or auto (exact where it is as cheap)")] = "auto"
    threads: Annotated[int, knob("build threads (0: all cores)", ge=0)] = 0
    seed: Annotated[int, knob("random seed of the build (k-means, the graph, samples)")] = 0
    # The build's working memory (#51): k-means' top-level clusters, the page file's write, brute force for
    # calibration, in pieces of at most this; what is proportional to the count (codes, assignments, postings) on
    # disk beside the index being written. The index's own in-RAM tiers (the navigation graph) come on top.
    memory_budget_bytes: Annotated[int, knob("build working memory, bytes (0: a quarter of what the process may use: "
                                             "its cgroup's memory limit, else the machine's memory)", ge=0,
                                             note="0 = automatic")] = 0
    # Learned pruning (retriever/engine/learned_probe.py): a quantile regression of how many lists, in probe order, hold
    # a query's true top-10, fitted on rows of the data as queries (search with probe='learned'). Needs
    # scikit-learn at build time only. Measured against the ratio rule: docs/tuning.md.
    probe_model: Annotated[bool, knob("train learned pruning's model (search --probe learned; needs scikit-learn "
                                      "to build, sharded builds train it unless --no-probe-model)")] = False
    probe_queries: Annotated[int, knob("rows of the data the probe model is trained on", ge=10, le=100_000)] = 1000
    probe_quantile: Annotated[float, knob("the probe model predicts the lists enough for this share of queries",
                                          gt=0, lt=1)] = 0.9
    # Build-time calibration (retriever/engine/calibrate.py): recall@10 of sample queries at the default search settings,
    # and, where it falls short of target_recall (flat data), the re-rank raised until it does; the index keeps
    # the result as its default SearchParams. Measured: docs/tuning.md#calibration, bench/results/calibration_*.md.
    calibrate: Annotated[bool, knob("measure recall@10 at the default search settings on sample queries and raise "
                                    "the index's default re-rank until it reaches target_recall")] = True
    calibrate_queries: Annotated[int, knob("sample queries (rows of the data, or the build's sample queries) "
                                           "calibration measures", ge=10, le=100_000)] = 500
    target_recall: Annotated[float, knob("recall@10 calibration raises the default re-rank to reach", gt=0,
                                         le=1)] = 0.95

    def __post_init__(self):
        if self.graph_ef_construction < self.graph_m:
            raise ConfigError("graph_ef_construction must be >= graph_m")
        if self.pq_bits not in (0, 4, 8):
            raise ConfigError(f"pq_bits must be 8, 4 or 0 (measured at calibration), not {self.pq_bits}")
        if self.pq_bits == 4 and self.pq_m > 128:
            raise ConfigError(f"pq_m must be at most 128 with pq_bits 4 (256 sub-spaces of 4 bits), not {self.pq_m}")

    def pq_subspaces(self, dim: int) -> int:
        """Sub-spaces of a build of dim dimensions: pq_m bytes (auto_m where 0), twice as many with 4-bit codes
        (at most 256). pq_bits 0 trains 8-bit codes first (pq_choice measures 4-bit ones after)."""
        from fusionrag.retriever.engine.pq import auto_m

        m = self.pq_m or auto_m(dim)
        return min(2 * m, 256) if self.pq_bits == 4 else m

    def memory_budget(self) -> int:
        """memory_budget_bytes, or where 0 a quarter of what this process may use (process.memory_limit); at
        least 32 MiB."""
        if self.memory_budget_bytes:
            return max(self.memory_budget_bytes, MIN_BUILD_BUDGET)
        from fusionrag.retriever.process import memory_limit

        return max(memory_limit() // 4, MIN_BUILD_BUDGET)

    def beside_resident(self) -> BuildConfig:
        """This config for a build or merge in a process that already holds memory (a service, its open indexes):
        where memory_budget_bytes is 0, the budget is a quarter of what the process may use or half of what it has
        left beside its resident anonymous memory now, whichever is less (at least 32 MiB)."""
        if self.memory_budget_bytes:
            return self
        from fusionrag.retriever.process import anonymous_bytes, memory_limit

        limit = memory_limit()
        left = max(0, limit - anonymous_bytes())
        return dataclasses.replace(self, memory_budget_bytes=max(min(limit // 4, left // 2), MIN_BUILD_BUDGET))


@config_class
class SearchParams(ConfigBase):
    """Per-request knobs of the query path (steps 3-6 of the design)."""

    # m: the distance-ratio rule may probe fewer per query. How the default was chosen: docs/tuning.md.
    nprobe: Annotated[int, knob("posting lists probed at most (m)", ge=1, le=1 << 20)] = 256
    probe_ratio: Annotated[float, knob("probe list i only if dist(q, c_i) <= (1+ratio) * dist(q, c_1); "
                                       "0 disables", ge=0)] = 1.0
    graph_ef: Annotated[int, knob("navigation graph beam (at least nprobe)", ge=0)] = 0
    rerank: Annotated[int, knob("PQ candidates re-ranked exactly (n)", ge=1, le=1_000_000)] = 200
    # 'learned': the nprobe nearest lists cut to the count the index's probe model predicts for each query
    # (BuildConfig.probe_model), times probe_scale, instead of the ratio rule. Measured: docs/tuning.md.
    probe: Annotated[Probe, knob("which lists of the nprobe nearest are probed: ratio (probe_ratio) or learned "
                                 "(the index's probe model)")] = "ratio"
    probe_scale: Annotated[float, knob("with probe learned: probe this multiple of the predicted lists", gt=0,
                                       le=1024)] = 1.0
    # Algorithm 1 of FusionANNS: mini-batch size, and stop after beta batches with delta <= eps.
    minibatch: Annotated[int, knob("re-rank mini-batch size", ge=1)] = 8
    eps: Annotated[float, knob("early stop: top-k change ratio counted as stable", ge=0, le=1)] = 0.0
    beta: Annotated[int, knob("early stop after this many stable mini-batches (0 disables)", ge=0,
                              note="0 disables early stop")] = 2
    # A query's first mini-batch also scores its later candidates whose blocks are in the DRAM page buffer
    # then: no read, and the top-k starts nearer its end, so it holds still after fewer SSD pages. Measured:
    # bench/results/cache/resident_first.md.
    resident_first: Annotated[bool, knob("re-rank: score first the candidates whose pages are in the page buffer "
                                         "now (no read)")] = False


def probe_widening(p: SearchParams, passing: float) -> tuple[int, int]:
    """(lists to find, postings the ratio rule keeps at least) for a search that may return only `passing` (a share
    in (0, 1]) of the index's vectors: p.nprobe and p.rerank divided by it. The scan skips the vectors excluded
    before scoring them, so the lists widened by 1 / passing cost about the vectors an unfiltered search scores,
    plus a bit test a posting. Measured (bench/peers/filtered.py, GloVe 390k, docs/tuning.md "Filtered search"):
    recall@10 at the defaults 0.867 / 0.754 under random filters passing 10% / 3%, 0.997 / 0.997 widened; 0.662 /
    0.484 under filters of a half-space (passing vectors together, away from most queries), 0.937 / 0.957."""
    if not 0 < passing <= 1:
        raise InputError(f"passing must be a share in (0, 1], got {passing!r}")
    if passing == 1:
        return p.nprobe, p.rerank
    return min(math.ceil(p.nprobe / passing), 2**31 - 1), min(math.ceil(p.rerank / passing), 2**62)


@dataclass(frozen=True)
class SearchOverrides:
    """The search knobs a request names, to apply over the defaults of the index that serves it (Index.params:
    the class defaults, or those its build's calibration chose), where a SearchParams would replace them all.
    Checked when made (ConfigError); hashable, so that requests asking the same can share a batch."""

    items: tuple

    @classmethod
    def of(cls, given: dict) -> "SearchOverrides":
        items = tuple(sorted(given.items()))
        try:
            return _overrides(cls, items)  # requests mostly ask the same few: each set checked once
        except TypeError:  # a value that cannot be a cache key (a list): checked, and refused, on its own
            SearchParams.from_dict(dict(given))  # names and ranges
            return cls(items)

    def over(self, base: SearchParams) -> SearchParams:
        try:
            return _over(self, base)
        except TypeError:  # unhashable values
            return base.with_overrides(**dict(self.items))

    def to_dict(self) -> dict:
        return dict(self.items)


@functools.lru_cache(maxsize=256)
def _overrides(cls, items: tuple) -> "SearchOverrides":
    """SearchOverrides.of's check (a whole SearchParams made: ~20 us) once a set of knobs; ConfigErrors aren't kept."""
    SearchParams.from_dict(dict(items))
    return cls(items)


@functools.lru_cache(maxsize=256)
def _over(overrides: "SearchOverrides", base: SearchParams) -> SearchParams:
    """The knobs over an index's defaults, once a pair (both frozen; each search resolved them anew before)."""
    return base.with_overrides(**dict(overrides.items))


def resolve_params(params: "SearchParams | SearchOverrides | dict | None", base: SearchParams) -> SearchParams:
    """The SearchParams a search runs with: params in full, or its knobs (SearchOverrides, a dict) over base,
    or base."""
    if params is None:
        return base
    if isinstance(params, SearchOverrides):
        return params.over(base)
    if isinstance(params, dict):
        return base.with_overrides(**params)
    return params


def search_defaults(manifest: dict, path, resident: bool = False) -> SearchParams:
    """An index's (or a sharded router's) default SearchParams: its manifest's search_defaults, what its build's
    calibration chose (the class defaults where it has none); resident (the raw vectors in RAM,
    EngineConfig.raw_in_ram): its search_defaults_ram where it has them, what calibration chose for RAM."""
    key = "search_defaults_ram" if resident and manifest.get("search_defaults_ram") is not None else "search_defaults"
    try:
        return SearchParams.from_dict(manifest.get(key) or {})
    except (ConfigError, TypeError) as e:
        raise IndexFormatError(f"{path}: the manifest's {key} are not search settings ({e})") from e


def calibrated_defaults(manifest: dict, path) -> tuple[SearchParams, SearchParams]:
    """(for the SSD path, for the raw vectors in RAM): search_defaults both ways, read at once so that an open
    refuses a bad entry before it opens the page file or a shard, and takes the one that fits once it knows where
    the raw vectors are (Index.open, ShardedIndex.open)."""
    return search_defaults(manifest, path), search_defaults(manifest, path, True)


@config_class
class EngineConfig(ConfigBase):
    """How an opened index uses the machine. What each knob was measured to do: docs/tuning.md,
    docs/engine.md and bench/results/."""

    buffer_bytes: Annotated[int, knob("DRAM page buffer shared by all queries, bytes", ge=0)] = 64 << 20
    io_backend: Annotated[IoBackend, knob("SSD reads: auto, io_uring or pread (a pool of threads)")] = "auto"
    direct_io: Annotated[DirectIO, knob("O_DIRECT reads: auto, on or off")] = "auto"
    io_threads: Annotated[int, knob("threads of the pread pool", ge=1, le=256)] = 8
    threads: Annotated[int, knob("worker threads (0: all cores)", ge=0)] = 0
    # Queries each re-rank thread keeps in flight: their mini-batches' SSD reads go out together, so I/O
    # latency overlaps instead of being waited out one mini-batch at a time. Results do not depend on it.
    # Memory: rerank_inflight x minibatch blocks per thread (bench/results/cache/rerank_inflight.md).
    rerank_inflight: Annotated[int, knob("queries each re-rank thread keeps in flight, their SSD reads overlapped "
                                         "(1: one at a time)", ge=1, le=1024,
                                         note="1: one query at a time")] = 16
    # 0 picks by filter tier (batch_for): small on the CPU, where a batch's PQ tables are most of a search's
    # working memory and small batches cost no speed (bench/results/pipeline/lut_scan.md); the GPU wants big ones.
    batch_size: Annotated[int, knob("queries per internal batch (0: 64 on the CPU filter tier, 1024 on the GPU)",
                                    ge=0, le=65536, note="0 = automatic")] = 0
    verify: Annotated[bool, knob("check every file against the manifest's checksums when opening")] = True
    # The centroids are most of the graph, the largest part of the host-RAM tier, and it only has to pick the
    # top-m lists; coded while read, in chunks, so opening never holds the float matrix.
    graph_sq8: Annotated[bool, knob("hold the navigation graph's centroids as 8-bit codes (a quarter of their "
                                    "memory)")] = True
    # No read and no memory: the build puts near vectors on the same page (layout.chain_order), so the top-k
    # settles after fewer pages.
    page_mates: Annotated[bool, knob("a block read for a mini-batch also scores the query's later candidates "
                                     "stored in it")] = True
    # While a round's blocks are scored, the next mini-batch's are already being read (io_uring, or the pread
    # fallback's helper threads); a query one stable mini-batch from stopping is not read ahead, so at beta >= 2
    # nothing is read that the search would not read. On by default since the read-ahead went two rounds deep
    # (stop 44): +10-21% q/s for single-query calls on GloVe, Fashion-MNIST and MiniLM (tuning halves, a cold 1/64
    # buffer, bench/results/cache/rerank_prefetch.md), -3% to +4% for calls of 16 (report halves). It holds up to 2 x 128 KiB
    # of blocks in flight per search thread (measured: -0.2 to +0.6 MiB peak RSS on GloVe and MiniLM with 2 threads
    # since the re-rank keeps its scratch between calls, +1-3 MiB before); off where every MiB counts.
    rerank_prefetch: Annotated[bool, knob("read each query's next mini-batch of pages while the current one is "
                                          "scored")] = True
    # 'clock' (CLOCK), or 'lfu', cache by use: requests counted per block (weighted by how many queries asked,
    # halved every 20 requests a frame), a missed block admitted only if asked for more often than the block it
    # would evict (TinyLFU); or 'auto', either, whichever a miniature simulation of both on a sample of the
    # blocks finds serving more now. Measured: bench/results/cache/cache_policy_auto.md.
    buffer_policy: Annotated[BufferPolicy, knob("page buffer replacement: auto (lfu or clock, whichever serves more "
                                                "now), lfu (counts use, weighted by the queries asking, aged) or "
                                                "clock")] = "auto"
    # Single records rather than whole blocks, kept by buffer_policy: a re-rank round skips a block whose candidates
    # of the round are all cached (so answers never depend on it). Each record is counted with its metadata
    # (native.PageStore.record_cache_overhead). 'auto': the whole buffer as blocks or as records, one at a time,
    # whichever a miniature of both (on a sample of the blocks) serves more now: it starts with records where a
    # record costs fewer bytes cached alone than its share of a block (384- and 768-d float32 embeddings), with
    # blocks elsewhere, and switches when the other layout's shadow serves 10% more (a switch to records takes the
    # most used blocks' records along). 'on': record_cache_share of the buffer always holds records, the rest
    # blocks; 'off': blocks only. Measured: bench/results/cache/ (cache_policy_records*.md).
    record_cache: Annotated[RecordCache, knob("the buffer's bytes as single records or whole blocks: auto (whichever "
                                              "serves more now, one at a time), on (record_cache_share of it as "
                                              "records) or off (blocks)")] = "auto"
    record_cache_share: Annotated[float, knob("share of buffer_bytes the record cache takes when on",
                                              gt=0, le=1)] = 1.0
    # Blocks held zero-run coded in 256-byte chunks of the same buffer bytes (native PageBuffer), so that records
    # with many zero bytes (8-bit images, ReLU outputs) fit more blocks in the buffer. 'auto': where a
    # sample of 64 blocks read at open codes to at most 0.8 of its bytes, chunks counted whole (the threshold was
    # set before any measurement: below a 1.25x gain the coding's CPU is not worth it); float embeddings have
    # almost no zero bytes and stay plain. A compressed buffer holds whole blocks: with record_cache 'auto' there
    # is no record layout. Answers never depend on it. Measured: bench/results/cache/buffer_compression_fashion.md.
    buffer_compression: Annotated[BufferCompression, knob("hold the page buffer's blocks zero-run coded: auto (where "
                                                          "a sample of blocks codes to 0.8 of its bytes or less), "
                                                          "on or off")] = "auto"
    # The index's largest arrays, the PQ codes and the posting lists' IDs (and the vectors' slots), through read-only
    # memory maps of their files rather than copies in the heap (#51): resident as they are read, but page cache the
    # kernel may reclaim under pressure (and read again from the file), not anonymous memory a process under a
    # cgroup's limit is killed for. 'auto': mapped where the index's in-RAM files (codes, IDs, slots, graph) would
    # take more than an eighth of what the process may use (its cgroup's limit, else the machine's memory); the
    # GPU tiers always map the codes (they copy them to the device).
    map_arrays: Annotated[MapArrays, knob("read the PQ codes, list IDs and slots through memory maps of their files "
                                          "(page cache the kernel may reclaim) rather than heap copies: auto (where "
                                          "the index's in-RAM files exceed an eighth of what the process may use), "
                                          "on or off")] = "auto"
    # The raw vectors held in RAM as one array (row = vector id), read once from the page file at open (each block's
    # CRC checked): the re-rank scores every candidate straight from it in native code (native.rerank_resident: no
    # page buffer lookup, no copy, no SSD read, no early stop), answering what the SSD path answers at beta 0, and
    # the page buffer is not opened (its budget is the array's). 'auto': where buffer_bytes (as fitted to the
    # process's memory) holds the array, count x record bytes; below that the SSD path with the page buffer, as
    # before. 'on': always (the array's bytes beyond buffer_bytes); 'off': never (the tests of the SSD path set
    # it). 'auto' by default: most RAG collections fit the budget, and then no query waits on the SSD. docs/tuning.md.
    raw_in_ram: Annotated[RawInRam, knob("hold the raw vectors in RAM and re-rank from them, reading nothing from "
                                         "the SSD: auto (where buffer_bytes holds them), on or off")] = "auto"
    # Re-chosen by the index manager thread every manager_interval_s seconds, never on the request path;
    # results never depend on it. Off by default: bench/results/cache/cache_policy.md.
    pin_fraction: Annotated[float, knob("share of the page buffer pinned to the pages of the most visited "
                                        "posting lists (0: none)", ge=0, le=0.75)] = 0.0
    # The manager re-pins hot pages and, on a GPU tier that holds only its hottest lists' codes, calls
    # GpuFilterTier.rebalance(). 0: no thread (call Index.refresh_hotness() yourself).
    manager_interval_s: Annotated[float, knob("how often the index manager thread re-chooses pinned pages and "
                                              "GPU-resident codes, seconds (0: no thread)", ge=0)] = 1.0
    # On the CPU filter tier, batch b+1's graph search, batch b's PQ scan and batch b-1's re-rank at once, as the
    # GPU tier always does. Results do not depend on it; measured: bench/results/pipeline/cpu_pipeline.md.
    pipeline: Annotated[bool, knob("overlap a call's batches: the graph search of batch b+1 runs while batch b "
                                   "is filtered")] = True
    # On the CPU filter tier, a batch's queries that probe the same posting lists are scanned together (Aether's
    # batch plan): each list read once per group of queries, each code scored against every asking query's table.
    # Results do not depend on it; measured: bench/results/pipeline/batch_plan.md.
    batch_plan: Annotated[bool, knob("CPU filter tier: scan posting lists shared by a batch's queries once per "
                                     "group of queries, not once per query")] = False
    # auto with CUDA: both tiers open (the CPU one over the same host parts) and each call goes to the one whose
    # measured cost for its size is lower (tier_choice.py); gpu: every call on the GPU tier; cpu: on the CPU.
    filter_tier: Annotated[FilterTier, knob("PQ filter tier: auto (with CUDA, the GPU and the CPU tier both, each "
                                            "call to the cheaper by measured cost), cpu or gpu")] = "auto"
    # Codes, codebooks and working blocks; 0: what an LLM server on the same GPU leaves,
    # (1 - gpu_memory_utilization) of the device, at most what is free.
    gpu_budget_bytes: Annotated[int, knob("GPU memory the filter tiers of the process share (0: what the LLM "
                                          "server leaves)", ge=0, note="0 = automatic")] = 0
    gpu_memory_utilization: Annotated[float, knob("the LLM server's share of GPU memory (vLLM's "
                                                  "--gpu-memory-utilization), for the default budget",
                                                  ge=0, lt=1)] = 0.9
    # Every index of a process shares one GPU budget: one whose codes do not all fit keeps its hottest lists'
    # codes in at most this fraction of what is left, so later indexes still start (1: all).
    gpu_tiered_share: Annotated[float, knob("an index whose PQ codes do not all fit takes at most this share of "
                                            "the budget left", gt=0, le=1)] = 0.5
    # The GPU tier's two forms (docs/gpu.md): the whole batch on the device (device_tier.py: navigation, lists,
    # scan, top-n, and the re-rank where the raw vectors fit), or the host navigating and gathering each
    # query's candidate IDs for the device's scan (gpu_tier.py, which keeps only the hottest codes resident
    # when they do not all fit).
    gpu_search: Annotated[GpuSearch, knob("on the GPU tier: auto (the whole batch on the device where its parts fit "
                                          "the budget, else lists), device or lists")] = "auto"

    def batch_for(self, filter_tier: str) -> int:
        """Queries per internal batch with this filter tier ('cpu' or 'gpu')."""
        return self.batch_size or (CPU_BATCH if filter_tier == "cpu" else GPU_BATCH)


def cpu_threads(requested: int = 0) -> int:
    """Threads to use: the request, or every core this process may run on."""
    return requested or len(os.sched_getaffinity(0))
